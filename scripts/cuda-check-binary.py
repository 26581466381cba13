#!/usr/bin/env python3
"""Checks the device code a `--features cuda` hearth-worker carries against the GPU hosts it is
built for, before it is copied there:

- every PTX module (candle ships most kernels, and Hearth its own, as PTX text that the driver
  compiles at first use) must be of a PTX ISA version the driver accepts: a CUDA 13.0 driver
  refuses PTX 9.1 and newer, and the worker would load its model and then fail at its first
  kernel;
- every PTX module must target the chosen compute capability or an older one (the driver cannot
  compile `.target sm_100` for an sm_90 GPU);
- every fatbin (the kernels candle compiles to machine code, in `.nv_fatbin` or embedded as
  bytes) must hold SASS the GPU runs (same major version, minor not above the GPU's), or PTX it
  can compile.

It reads the bytes of the binary: PTX headers (`.version X.Y` then `.target sm_NN`) and fatbin
headers (magic 0xBA55ED50; each entry names its kind, PTX or ELF, its version and its sm_NN).
Exit status 0 when the binary fits, 1 with one line per problem otherwise.

    scripts/cuda-check-binary.py target/cuda/hearth-worker --cuda 13.0 --arch 90
    scripts/cuda-check-binary.py --self-test
"""

import argparse
import re
import struct
import sys

# The newest PTX ISA each driver's CUDA version accepts (the PTX ISA document's release table).
PTX_ISA = {
    (12, 0): (8, 0), (12, 1): (8, 1), (12, 2): (8, 2), (12, 3): (8, 3), (12, 4): (8, 4),
    (12, 5): (8, 5), (12, 6): (8, 5), (12, 8): (8, 7), (12, 9): (8, 8),
    (13, 0): (9, 0), (13, 1): (9, 1), (13, 2): (9, 2),
}

PTX_HEADER = re.compile(rb"\n\.version (\d+)\.(\d+)[ \t]*\r?\n\.target (sm_\d+[a-z]?)")
FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
KINDS = {1: "PTX", 2: "ELF"}


def sm(name):
    """`sm_90a` -> (90, 'a')."""
    m = re.fullmatch(r"sm_(\d+)([a-z]?)", name)
    return int(m.group(1)), m.group(2)


def ptx_modules(data):
    """(version, target) of every PTX text in `data`."""
    return [((int(a), int(b)), t.decode()) for a, b, t in PTX_HEADER.findall(data)]


def fatbins(data):
    """Every fatbin in `data`: a list of (kind, (major, minor), sm) per fatbin."""
    found, at = [], data.find(FATBIN_MAGIC)
    while at >= 0:
        entries = []
        if at + 16 <= len(data):
            _, version, header, size = struct.unpack_from("<IHHQ", data, at)
            off, end = at + header, at + header + size
            while version == 1 and header == 16 and off + 32 <= min(end, len(data)):
                kind, _, ehead, payload = struct.unpack_from("<HHIQ", data, off)
                minor, major, arch = struct.unpack_from("<HHI", data, off + 24)
                if kind not in KINDS or ehead < 32:
                    break
                entries.append((KINDS[kind], (major, minor), arch))
                off += ehead + payload
        if entries:
            found.append(entries)
        at = data.find(FATBIN_MAGIC, at + 4)
    return found


def problems(data, cuda, arch):
    """What keeps the binary from running on a `cuda` driver with an sm_`arch` GPU, and a summary."""
    out = []
    limit = PTX_ISA.get(cuda)
    if limit is None:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(PTX_ISA))
        return [f"unknown CUDA version {cuda[0]}.{cuda[1]} (known: {known})"], ""
    mods = ptx_modules(data)
    for i, (version, target) in enumerate(mods):
        if version > limit:
            out.append(
                f"PTX module {i} is PTX ISA {version[0]}.{version[1]}: a CUDA {cuda[0]}.{cuda[1]} "
                f"driver accepts up to {limit[0]}.{limit[1]} (build with the matching toolkit)"
            )
        number, suffix = sm(target)
        if number > arch:
            out.append(f"PTX module {i} targets {target}, newer than the GPU's sm_{arch}")
        elif suffix and number != arch:
            out.append(f"PTX module {i} targets {target}, which only an sm_{number} GPU runs")
    bins = fatbins(data)
    for i, entries in enumerate(bins):
        runs = any(
            (kind == "ELF" and a // 10 == arch // 10 and a <= arch)
            or (kind == "PTX" and a <= arch and version <= limit)
            for kind, version, a in entries
        )
        if not runs:
            have = ", ".join(f"{k} sm_{a}" for k, _, a in entries)
            out.append(f"fatbin {i} has no code an sm_{arch} GPU runs ({have})")
        for kind, version, a in entries:
            if kind == "PTX" and version > limit:
                out.append(
                    f"fatbin {i} carries PTX ISA {version[0]}.{version[1]} (sm_{a}), newer than "
                    f"a CUDA {cuda[0]}.{cuda[1]} driver accepts"
                )
    if not mods and not bins:
        out.append("no device code found: is this a `--features cuda` build?")
    versions = sorted({f"{v[0]}.{v[1]}" for v, _ in mods})
    targets = sorted({t for _, t in mods})
    sass = sorted({f"sm_{a}" for e in bins for k, _, a in e if k == "ELF"})
    summary = (
        f"{len(mods)} PTX modules (ISA {', '.join(versions) or '-'}; {', '.join(targets) or '-'}), "
        f"{len(bins)} fatbins (SASS {', '.join(sass) or '-'})"
    )
    return out, summary


def self_test():
    """The verdicts on small made-up binaries shaped like nvcc's output."""
    def ptx(version, target):
        return f"//\n// Generated by NVIDIA NVVM Compiler\n\n.version {version}\n.target {target}\n.address_size 64\n".encode()

    def fatbin(*entries):
        body = b""
        for kind, (major, minor), arch in entries:
            head = struct.pack("<HHIQ", kind, 0x101, 64, 8) + struct.pack("<IIHHI", 0, 0, minor, major, arch)
            body += head.ljust(64, b"\0") + b"\0" * 8
        return FATBIN_MAGIC + struct.pack("<HHQ", 1, 16, len(body)) + body

    elf90, ptx90 = (2, (1, 8), 90), (1, (9, 0), 90)
    cases = [
        (b"junk" + ptx("9.0", "sm_90") + b"more" + fatbin(elf90, ptx90), (13, 0), 90, []),
        (ptx("9.5", "sm_90"), (13, 0), 90, ["PTX ISA 9.5"]),
        (ptx("9.0", "sm_100"), (13, 0), 90, ["targets sm_100"]),
        (ptx("9.0", "sm_90a"), (13, 0), 90, []),
        (ptx("8.7", "sm_90a"), (13, 0), 100, ["only an sm_90"]),
        (ptx("8.4", "sm_80") + fatbin((2, (1, 8), 80)), (13, 0), 90, ["no code an sm_90"]),
        (fatbin((2, (1, 8), 86), (1, (8, 7), 86)), (12, 4), 89, ["PTX ISA 8.7"]),
        (fatbin((2, (1, 8), 86)), (12, 4), 89, []),
        (b"no device code here", (13, 0), 90, ["no device code"]),
        (ptx("9.0", "sm_90"), (11, 8), 90, ["unknown CUDA version"]),
    ]
    for data, cuda, arch, want in cases:
        got, _ = problems(data, cuda, arch)
        assert len(got) == len(want) and all(w in g for w, g in zip(want, got)), (cuda, arch, want, got)
    print(f"cuda-check-binary: self-test passed ({len(cases)} cases)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("binary", nargs="?")
    p.add_argument("--cuda", default="13.0", help="the GPU hosts' driver CUDA version (default 13.0)")
    p.add_argument("--arch", type=int, default=90, help="the GPU's compute capability, as 90 (default)")
    p.add_argument("--self-test", action="store_true")
    a = p.parse_args()
    if a.self_test:
        return self_test()
    if not a.binary:
        p.error("a binary to check is required")
    cuda = tuple(int(x) for x in a.cuda.split("."))
    with open(a.binary, "rb") as f:
        found, summary = problems(f.read(), cuda, a.arch)
    for line in found:
        print(f"cuda-check-binary: {a.binary}: {line}", file=sys.stderr)
    if found:
        sys.exit(1)
    print(f"cuda-check-binary: {a.binary} runs on CUDA {a.cuda} drivers, sm_{a.arch}: {summary}")


if __name__ == "__main__":
    main()
