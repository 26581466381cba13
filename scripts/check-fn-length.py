#!/usr/bin/env python3
"""Checks that no Rust function in the given directories is longer than a limit (default 80
lines), counted from its `fn` line to its closing brace, doc comments and attributes not
included. A long function is a unit that does several things; it is easier to read, test and
change as named steps.

Comments, string literals (raw ones too) and char literals are skipped when matching braces, so
`"{"` or `'}'` do not count. Functions without a body (trait items, `extern` declarations) do not
count. Nested functions and closures count as part of the function around them, and a nested
`fn` is also checked on its own.

With `--allowed FILE`, the functions over the limit today are listed there (`path name lines`,
one per line, `#` for a comment), each with the most lines it may have: a listed function may
shrink, and should, but may not grow, and no other function may pass the limit. `make test`
runs it so, at 60 lines, with `scripts/fn-length.allowed`.

    python3 scripts/check-fn-length.py orchestrator/src gpu-worker/src/engine
    python3 scripts/check-fn-length.py --max 60 --allowed scripts/fn-length.allowed orchestrator/src
    python3 scripts/check-fn-length.py --max 60 --list orchestrator/src   # every fn over 60
    python3 scripts/check-fn-length.py --self-test

Exit 0: none too long; 1: the ones too long are printed (file:line, name, length); 2: bad usage.
"""

import argparse
import os
import re
import sys

FN = re.compile(
    r"\b(?:pub(?:\s*\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
    r"(?:extern\s+\"[^\"]*\"\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)"
)


def blank_out(src):
    """The source with comments and string and char literals replaced by spaces (newlines kept),
    so that only code braces remain and line numbers stay the same."""
    out = []
    i, n = 0, len(src)
    keep = lambda s: "".join(c if c == "\n" else " " for c in s)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(keep(src[i:j]))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(keep(src[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', src[i:]) and not (i and (src[i - 1].isalnum() or src[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", src[i:]).group(1)
            end = src.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(keep(src[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append(keep(src[i : j + 1]))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])'", src[i:])
            if m:
                out.append(keep(m.group(0)))
                i += len(m.group(0))
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(src):
    """(name, first line, length in lines) of every function with a body."""
    code = blank_out(src)
    found = []
    for m in FN.finditer(code):
        # The body's opening brace: the first `{` at depth 0 of (), [] and <> after the
        # signature; a `;` first means no body.
        i, depth = m.end(), 0
        while i < len(code):
            ch = code[i]
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif ch == ";" and depth == 0:
                i = -1
                break
            elif ch == "{" and depth == 0:
                break
            i += 1
        if i < 0 or i >= len(code):
            continue
        braces, j = 0, i
        while j < len(code):
            if code[j] == "{":
                braces += 1
            elif code[j] == "}":
                braces -= 1
                if braces == 0:
                    break
            j += 1
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, j) + 1
        found.append((m.group(1), first, last - first + 1))
    return found


def scan(paths):
    for root in paths:
        if os.path.isfile(root):
            files = [root]
        else:
            files = sorted(
                os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".rs")
            )
        for path in files:
            with open(path, encoding="utf-8") as f:
                for name, line, length in functions(f.read()):
                    yield path, line, name, length


def read_allowed(text):
    """`path name lines` per line; `#` starts a comment."""
    allowed = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            path, name, lines = line.split()
            allowed[(path, name)] = int(lines)
    return allowed


def too_long(found, limit, allowed):
    """The functions of `found` ((path, line, name, length) each) over their limit: `limit`, or
    the allowance of a listed one; each with the limit it passed. Longest first."""
    over = []
    for path, line, name, length in found:
        cap = allowed.get((path, name), limit)
        if length > cap:
            over.append((path, line, name, length, cap))
    return sorted(over, key=lambda x: -x[3])


def self_test():
    allowed = read_allowed("# why\na.rs big 90  # to split\n")
    assert allowed == {("a.rs", "big"): 90}
    found = [("a.rs", 1, "big", 90), ("a.rs", 9, "small", 61), ("b.rs", 1, "big", 60)]
    assert too_long(found, 60, allowed) == [("a.rs", 9, "small", 61, 60)]
    assert too_long([("a.rs", 1, "big", 91)], 60, allowed) == [("a.rs", 1, "big", 91, 90)]
    cases = [
        ("fn a() {\n    x();\n}\n", [("a", 1, 3)]),
        ("pub(crate) async fn b(x: u32) -> u32 {\n    x\n}\n", [("b", 1, 3)]),
        ('fn c() {\n    let s = "}}}";\n    let t = r#"{"#;\n}\n', [("c", 1, 4)]),
        ("fn d() {\n    let c = '}';\n    let l: &'static str = \"\";\n}\n", [("d", 1, 4)]),
        ("trait T {\n    fn e(&self);\n    fn f(&self) {}\n}\n", [("f", 3, 1)]),
        ("fn g() {\n    // }\n    /* { /* } */ */\n    fn h() {\n    }\n}\n", [("g", 1, 6), ("h", 4, 2)]),
        ("fn w<T>(t: T) -> Vec<[u8; 4]>\nwhere\n    T: Copy,\n{\n    vec![]\n}\n", [("w", 1, 6)]),
        ("let f = |x| { x };\nfn k() { if a { b } }\n", [("k", 2, 1)]),
    ]
    failed = 0
    for src, want in cases:
        got = functions(src)
        if got != want:
            failed += 1
            print(f"self-test failed for {src!r}: got {got}, want {want}")
    print(f"check-fn-length self-test: {len(cases) - failed}/{len(cases)} passed")
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--max", type=int, default=80)
    ap.add_argument("--list", action="store_true", help="print every function over --max and exit 0")
    ap.add_argument("--allowed", help="the functions allowed over --max, each with its most lines")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.paths:
        ap.print_usage()
        return 2
    allowed = {}
    if a.allowed and not a.list:
        with open(a.allowed, encoding="utf-8") as f:
            allowed = read_allowed(f.read())
    long = too_long(scan(a.paths), a.max, allowed)
    for path, line, name, length, cap in long:
        print(f"{path}:{line}: fn {name} is {length} lines (at most {cap})")
    if a.list or not long:
        if not long:
            print(f"check-fn-length: no function over {a.max} lines in {', '.join(a.paths)}")
        return 0
    print(f"check-fn-length: {len(long)} function(s) too long; split them into named steps")
    return 1


if __name__ == "__main__":
    sys.exit(main())
