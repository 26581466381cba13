#!/usr/bin/env python3
"""Runs every whole-stack test binary many times and reports each test that failed at least once.

A flaky test lets a broken change land by luck and holds a good one back, so `make flake-hunt`
looks for them on purpose: it builds the test binaries once (`cargo test --no-run`), then runs
each of them `--runs` times, each run with its own seed (`HEARTH_TEST_SEED`, which every seeded
test reads), and prints one line per test that failed, with how often and the seeds to replay it
with. A binary that exits without naming a failed test (a crash) or runs past `--timeout` counts
as a failure of the binary itself. The log of every failed run is kept under `--logs`.

Run it with the machine busy too (a second `make flake-hunt` beside it, or any other load): CI
machines are shared, and a test that passes only on an idle machine is a flake.

    python3 scripts/flake-hunt.py --runs 20                 # every hearth-e2e test binary
    python3 scripts/flake-hunt.py --runs 50 --only models   # one binary

Exit status: 0 when nothing failed, 1 when something did, 2 when the build failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAILED = re.compile(r"^test (\S+) \.\.\. FAILED$")
SEED_VAR = "HEARTH_TEST_SEED"


def build(packages: list[str]) -> list[tuple[str, Path]]:
    """Builds the binaries the stacks run and the packages' test binaries; returns the latter,
    each with its short name (the test target's)."""
    bins = ["cargo", "build", "-p", "hearth-orchestrator", "-p", "hearth-worker", "-p", "hearth-e2e", "--bins"]
    if subprocess.run(bins, cwd=ROOT).returncode != 0:
        sys.exit(2)
    cmd = ["cargo", "test", "--no-run", "--message-format=json-render-diagnostics"]
    for p in packages:
        cmd += ["-p", p]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        sys.exit(2)
    found = []
    for line in out.stdout.splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        target = msg.get("target", {})
        # Test harnesses only (a binary target is also built as itself, which is no test).
        if (msg.get("reason") == "compiler-artifact" and msg.get("executable")
                and msg.get("profile", {}).get("test")):
            found.append((target["name"], Path(msg["executable"])))
    return sorted(set(found))


def run_once(name: str, exe: Path, seed: int, timeout: float, logs: Path, run: int) -> list[str]:
    """Runs one test binary with `seed`; returns the names of the tests that failed (the
    binary's own name in angle brackets for a crash or a timeout)."""
    env = dict(os.environ, **{SEED_VAR: str(seed)})
    # `cargo test` runs a test binary in its package's directory; so does this.
    cwd = ROOT / "tests"
    started = time.monotonic()
    # A session of its own, so that a timeout kills the stacks the tests started too.
    p = subprocess.Popen([str(exe)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, errors="replace",
                         start_new_session=True)
    try:
        output, _ = p.communicate(timeout=timeout)
        code = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        output, _ = p.communicate()
        output, code = output + f"\n<timed out after {timeout:.0f} s>\n", None
    failed = [m.group(1) for m in map(FAILED.match, output.splitlines()) if m]
    if code is None:
        failed.append("<timeout>")
    elif code != 0 and not failed:
        failed.append(f"<exit {code}>")
    if failed:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{name}-run{run}-seed{seed}.log").write_text(output)
    took = time.monotonic() - started
    status = "ok" if not failed else "FAILED " + " ".join(failed)
    print(f"flake-hunt: run {run} {name}: {status} ({took:.0f} s)", flush=True)
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=int(os.environ.get("RUNS", "20")))
    ap.add_argument("--package", action="append", default=None,
                    help="a package whose test binaries to run (default: hearth-e2e)")
    ap.add_argument("--only", action="append", default=[], help="only the test binaries named so")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one binary may run")
    ap.add_argument("--seed", type=lambda s: int(s, 0), default=None,
                    help="the first run's seed (default: random); run i uses seed + i")
    ap.add_argument("--logs", type=Path, default=ROOT / "target" / "flake-hunt")
    args = ap.parse_args()

    binaries = build(args.package or ["hearth-e2e"])
    if args.only:
        binaries = [b for b in binaries if b[0] in args.only]
    if not binaries:
        print("flake-hunt: no test binary to run", file=sys.stderr)
        return 2
    base = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    print(f"flake-hunt: {len(binaries)} test binaries x {args.runs} runs, seeds {base:#x} + run; "
          f"failed runs' logs in {args.logs}", flush=True)

    failures: dict[str, list[int]] = defaultdict(list)
    started = time.monotonic()
    for run in range(1, args.runs + 1):
        seed = base + run
        for name, exe in binaries:
            for test in run_once(name, exe, seed, args.timeout, args.logs, run):
                failures[f"{name}::{test}"].append(seed)

    minutes = (time.monotonic() - started) / 60
    print(f"\nflake-hunt: {args.runs} runs of {len(binaries)} test binaries in {minutes:.0f} min")
    if not failures:
        print("flake-hunt: no test failed")
        return 0
    print(f"{'test':<80} {'failed':>8}  seeds ({SEED_VAR})")
    for test, seeds in sorted(failures.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = " ".join(f"{s:#x}" for s in seeds[:5]) + (" ..." if len(seeds) > 5 else "")
        print(f"{test:<80} {len(seeds):>3}/{args.runs:<4}  {shown}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
