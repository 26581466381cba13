#!/usr/bin/env python3
"""Checks that no Rust file under the given directories is longer than a limit (default 700
lines). A long file is several units in one; split it by what each part is for.

The files over the limit today are listed, each with the most lines it may have, in
`scripts/file-length.allowed`: a listed file may shrink, and should, but may not grow, and no
other file may pass the limit. When a listed file shrinks, the check says so, so the allowance
can be tightened (or the line removed once the file is within the limit).

    python3 scripts/check-file-length.py orchestrator/src gpu-worker/src
    python3 scripts/check-file-length.py --self-test

Exit 0: every file within its limit; 1: the ones over it are printed.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = os.path.join(ROOT, "scripts", "file-length.allowed")


def read_allowed(text):
    """`path lines` per line; `#` starts a comment."""
    allowed = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        path, lines = line.split()
        allowed[path] = int(lines)
    return allowed


def problems(sizes, allowed, limit):
    """What is wrong, and what may be tightened, for files with these line counts."""
    over, tighten = [], []
    for path, n in sorted(sizes.items()):
        cap = allowed.get(path)
        if cap is None and n > limit:
            over.append(f"{path}: {n} lines, more than {limit}")
        elif cap is not None and n > cap:
            over.append(f"{path}: {n} lines, more than its allowance of {cap}")
        elif cap is not None and n < cap:
            tighten.append(f"{path}: {n} lines, allowed {cap}: tighten scripts/file-length.allowed")
    return over, tighten


def sizes_under(dirs):
    sizes = {}
    for d in dirs:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                if f.endswith(".rs"):
                    path = os.path.join(base, f)
                    with open(path, encoding="utf-8") as fh:
                        sizes[os.path.relpath(path, ROOT)] = sum(1 for _ in fh)
    return sizes


def self_test():
    allowed = read_allowed("# comment\na.rs 900  # why\n")
    assert allowed == {"a.rs": 900}
    over, tighten = problems({"a.rs": 901, "b.rs": 701, "c.rs": 700}, allowed, 700)
    assert over == ["a.rs: 901 lines, more than its allowance of 900", "b.rs: 701 lines, more than 700"]
    assert tighten == []
    over, tighten = problems({"a.rs": 850}, allowed, 700)
    assert over == [] and len(tighten) == 1
    print("check-file-length: self-test passed")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="*")
    ap.add_argument("--max", type=int, default=700)
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        self_test()
        return
    with open(ALLOWED, encoding="utf-8") as fh:
        allowed = read_allowed(fh.read())
    over, tighten = problems(sizes_under(a.dirs), allowed, a.max)
    for t in tighten:
        print(f"check-file-length: {t}")
    for o in over:
        print(f"check-file-length: {o}")
    if over:
        sys.exit(1)
    print(f"check-file-length: no file over {a.max} lines but the {len(allowed)} allowed ones")


if __name__ == "__main__":
    main()
