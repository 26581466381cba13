#!/usr/bin/env python3
"""Checks that the top-level modules of each crate form layers, with no new import cycles.

The `mod` items in a crate's root file should stack: `engine` may use `kv` and `model`, but then
`kv` and `model` must not reach back into `engine`. A cycle between top-level modules means none
of them can be read, tested or moved on its own. Some cycles exist today; the baseline
(scripts/module-cycles.allowed) records them so that no new one lands while they are cut.

What counts:
- Each workspace member (root Cargo.toml, `[workspace] members`) is scanned per root: its library
  (`src/lib.rs`) and each binary (`src/main.rs`, `src/bin/*`, `[[bin]]`) on its own, named
  `<package>` and `<package>/bin/<name>`. A root's top-level modules are its `mod x;` items;
  inline `mod x { ... }` in the root belong to the root and are ignored.
- A module's code is every file reached through its `mod` items (following `#[path]`), plus any
  other `.rs` file under `src/<name>/`.
- Module A depends on module B (A != B) when A's code names `crate::B`, in paths or in `use`
  trees (`use crate::{B::x, C}`, nested braces too), or `super::B` (also `super::super::B`, ...)
  where that `super` is the crate root. `crate::X` where the root re-exports X with a `use`
  (`pub use finish::FinishReason;`) counts as a use of the module X comes from. `pub(in crate::B)`
  is not a use.
- Comments (`//`, `///`, `//!`, nested `/* */`) and string and char literals are skipped.
- Code under `#[cfg(test)]` counts: a cycle through tests is still a cycle. Such references are
  marked `(test)` in the output, so it is clear when moving a test would cut one.

A cycle is a strongly connected component of two or more modules. The check fails (exit 1) when a
crate has a cycle whose modules are not all on one allowed line of the same crate: a new cycle,
or an allowed one that took in another module. It then prints one path of references that closes
the cycle, file:line per edge, to show where to cut it. It passes (exit 0) otherwise, with a note
when an allowed line is no longer needed or could shrink. Exit 2: bad usage or baseline.

Baseline lines: `<crate>: <module> <module> ...` (sorted); `#` starts a comment.

    python3 scripts/check-module-cycles.py              # the check
    python3 scripts/check-module-cycles.py --verbose    # every edge in each cycle, cheapest cut
    python3 scripts/check-module-cycles.py --print-baseline
    python3 scripts/check-module-cycles.py --self-test
"""

import argparse
import glob
import itertools
import os
import re
import sys
import tempfile
import tomllib
from collections import defaultdict, deque
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Tokens: just enough of Rust's lexer to drop comments and literals and keep paths.

RAW_STR = re.compile(r'(?:br|cr|r)(#*)"')
STR = re.compile(r'[bc]?"')
RAW_IDENT = re.compile(r"r#([^\W\d]\w*)")
IDENT = re.compile(r"[^\W\d]\w*")
NUMBER = re.compile(r"\d\w*")


class Tok:
    __slots__ = ("text", "line", "ident")

    def __init__(self, text, line, ident=False):
        self.text, self.line, self.ident = text, line, ident

    def __repr__(self):
        return f"{self.text}@{self.line}"


def tokenize(src):
    """Identifiers and punctuation with their line numbers; comments dropped, and each literal
    one opaque token (a string's is its quoted text, never an identifier)."""
    toks, i, n, line = [], 0, len(src), 1
    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
            continue
        if c.isspace():
            i += 1
            continue
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
            continue
        if src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    line += src[j] == "\n"
                    j += 1
            i = j
            continue
        m = RAW_STR.match(src, i)
        if m:
            end = src.find('"' + m.group(1), m.end())
            end = n if end < 0 else end + 1 + len(m.group(1))
            toks.append(Tok('"lit"', line))
            line += src.count("\n", i, end)
            i = end
            continue
        m = STR.match(src, i)
        if m:
            j = m.end()
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            toks.append(Tok(src[m.end() - 1 : j + 1], line))  # keeps `#[path = "..."]`
            line += src.count("\n", i, j)
            i = j + 1
            continue
        if c == "'" or (c == "b" and src.startswith("b'", i)):
            q = i if c == "'" else i + 1
            if src.startswith("\\", q + 1):  # '\n', '\'', '\u{..}'
                end = src.find("'", q + 3)
                i = n if end < 0 else end + 1
                toks.append(Tok('"lit"', line))
            elif q + 2 < n and src[q + 2] == "'":  # 'x'
                i = q + 3
                toks.append(Tok('"lit"', line))
            else:  # a lifetime or a label: 'a
                m = IDENT.match(src, q + 1)
                i = m.end() if m else q + 1
                toks.append(Tok("'lifetime", line))
            continue
        m = RAW_IDENT.match(src, i)
        if m:
            toks.append(Tok(m.group(1), line, True))
            i = m.end()
            continue
        m = IDENT.match(src, i)
        if m:
            toks.append(Tok(m.group(0), line, True))
            i = m.end()
            continue
        m = NUMBER.match(src, i)
        if m:
            toks.append(Tok("0", line))
            i = m.end()
            continue
        if src.startswith("::", i):
            toks.append(Tok("::", line))
            i += 2
            continue
        toks.append(Tok(c, line))
        i += 1
    return toks


def text(toks, i):
    return toks[i].text if 0 <= i < len(toks) else ""


def close_of(toks, i):
    """Index of the bracket closing the one at `i`."""
    pairs = {"{": "}", "(": ")", "[": "]"}
    stack = []
    for j in range(i, len(toks)):
        t = toks[j].text
        if t in pairs:
            stack.append(pairs[t])
        elif stack and t == stack[-1]:
            stack.pop()
            if not stack:
                return j
    return len(toks) - 1


def item_end(toks, i):
    """Index of the last token of the item starting at `i`: its `;` or its body's `}`."""
    depth = 0
    for j in range(i, len(toks)):
        t = toks[j].text
        if t in "([{":
            if t == "{" and depth == 0:
                return close_of(toks, j)
            depth += 1
        elif t in ")]}":
            depth -= 1
            if depth < 0:
                return j - 1
        elif t == ";" and depth == 0:
            return j
    return len(toks) - 1


def is_cfg_test(attr):
    """`#[cfg(test)]`, `#[cfg(all(test, ...))]`; not `cfg(not(test))`."""
    words = [t.text for t in attr]
    return bool(words) and words[0] == "cfg" and "test" in words and "not" not in words


def path_attr(attr):
    words = [t.text for t in attr]
    return len(words) >= 2 and words[0] == "path" and words[1] == "="


# ---------------------------------------------------------------------------------------------
# One file: its `mod` items, its `crate::`/`super::` references, the root's re-exports.


def parse_use_tree(toks, i, prefix):
    """The (path, bound name) pairs of the use tree starting at `i`, and the index after it."""
    out, segs = [], list(prefix)
    while i < len(toks):
        t = toks[i].text
        if t == "::":
            i += 1
        elif t == "{":
            i += 1
            while i < len(toks) and toks[i].text != "}":
                sub, j = parse_use_tree(toks, i, segs)
                out += sub
                i = j + 1 if text(toks, j) == "," else max(j, i + 1)
            return out, i + 1
        elif t == "*":
            return out + [(segs + ["*"], None)], i + 1
        elif toks[i].ident:
            segs.append(t)
            i += 1
            if text(toks, i) == "::":
                continue
            if segs[-1] == "self" and len(segs) > 1:
                segs.pop()
            name = segs[-1]
            if text(toks, i) == "as":
                name, i = text(toks, i + 1), i + 2
            return out + [(segs, name)], i
        else:
            return out, i
    return out, i


def first_segments(toks, i):
    """The first segment names of the path (or use group) starting at `i`, with their lines."""
    if text(toks, i) != "{":
        return [(toks[i].text, toks[i].line)] if i < len(toks) and toks[i].ident else []
    names, end, j = [], close_of(toks, i), i + 1
    while j < end:
        if toks[j].text == "{":
            names += first_segments(toks, j)
        elif toks[j].ident and toks[j].text != "self":
            names.append((toks[j].text, toks[j].line))
        # skip to this element's end: the next `,` at this group's level
        depth = 0
        while j < end:
            t = toks[j].text
            if t in "{([":
                depth += 1
            elif t in "})]":
                depth -= 1
            elif t == "," and depth == 0:
                break
            j += 1
        j += 1
    return names


class FileScan:
    def __init__(self):
        self.mods = []  # (name, inline prefix, #[path] or None, test, inline?, line)
        self.refs = []  # (first segment at the crate root, line, test)
        self.root_uses = []  # (path, bound name) of `use` items at the top of the file


def scan_file(src, modpath, file_test=False):
    """Scans one file whose module path is `modpath` ([] for the crate root)."""
    toks = tokenize(src)
    scan = FileScan()
    test = [file_test] * len(toks)
    scope = []  # open braces: (inline mod name or None, index of the closing brace)
    pending = []  # attributes since the last item boundary
    i = 0
    while i < len(toks):
        t = toks[i].text
        while scope and i > scope[-1][1]:
            scope.pop()
        if t == "#" and text(toks, i + 1) in ("[", "!"):
            inner = text(toks, i + 1) == "!"
            open_ = i + 2 if inner else i + 1
            if text(toks, open_) == "[":
                close = close_of(toks, open_)
                attr = toks[open_ + 1 : close]
                if is_cfg_test(attr):
                    if inner:  # the rest of the enclosing block, or file
                        end = scope[-1][1] if scope else len(toks) - 1
                        start = close
                    else:
                        start = close + 1
                        while text(toks, start) == "#":
                            start = close_of(toks, start + 1) + 1
                        end = item_end(toks, start)
                    for k in range(start, end + 1):
                        test[k] = True
                pending.append(attr)
                i = close + 1
                continue
        if t == "mod" and toks[i + 1 : i + 2] and toks[i + 1].ident and text(toks, i + 2) in (";", "{"):
            name, inline = toks[i + 1].text, text(toks, i + 2) == "{"
            path = next((a[2].text for a in pending if path_attr(a) and len(a) > 2), None)
            prefix = [s[0] for s in scope if s[0]]
            scan.mods.append((name, prefix, path, test[i], inline, toks[i].line))
            pending = []
            if inline:
                scope.append((name, close_of(toks, i + 2)))
                i += 3
                continue
            i += 3
            continue
        if t == "{":
            scope.append((None, close_of(toks, i)))
            pending = []
        elif t in (";", "}"):
            pending = []
        here = modpath + [s[0] for s in scope if s[0]]
        if t == "use" and not here and not scope:
            scan.root_uses += parse_use_tree(toks, i + 1, [])[0]
        prev = text(toks, i - 1)
        if t == "crate" and text(toks, i + 1) == "::" and prev != "::":
            if not (prev == "in" and text(toks, i - 2) == "("):  # pub(in crate::x)
                for name, line in first_segments(toks, i + 2):
                    scan.refs.append((name, line, test[i]))
        elif t in ("super", "self") and text(toks, i + 1) == "::" and prev != "::":
            ups, j = 0, i
            while text(toks, j) in ("super", "self") and text(toks, j + 1) == "::":
                ups += text(toks, j) == "super"
                j += 2
            if ups and len(here) == ups:  # `super` is the crate root
                for name, line in first_segments(toks, j):
                    scan.refs.append((name, line, test[i]))
            i = j
            continue
        i += 1
    return scan


# ---------------------------------------------------------------------------------------------
# Crates and their module graphs.


def crate_roots(ws):
    """(crate name, root file) for every library and binary of every workspace member."""
    manifest = tomllib.loads((ws / "Cargo.toml").read_text())
    members = []
    for pattern in manifest.get("workspace", {}).get("members", []):
        members += sorted(glob.glob(str(ws / pattern)))
    excluded = {os.path.normpath(ws / e) for e in manifest.get("workspace", {}).get("exclude", [])}
    if "package" in manifest:
        members.insert(0, str(ws))
    roots = []
    for member in members:
        member = Path(member)
        if os.path.normpath(member) in excluded or not (member / "Cargo.toml").is_file():
            continue
        pkg = tomllib.loads((member / "Cargo.toml").read_text())
        name = pkg.get("package", {}).get("name", member.name)
        lib = member / pkg.get("lib", {}).get("path", "src/lib.rs")
        if lib.is_file():
            roots.append((name, lib))
        bins = {}
        for b in pkg.get("bin", []):
            default = "src/main.rs" if b["name"] == name else f"src/bin/{b['name']}.rs"
            bins[b["name"]] = member / b.get("path", default)
        if pkg.get("package", {}).get("autobins", True):
            found = [(name, member / "src/main.rs")]
            found += [(Path(p).stem, Path(p)) for p in sorted(glob.glob(str(member / "src/bin/*.rs")))]
            found += [(Path(p).parent.name, Path(p))
                      for p in sorted(glob.glob(str(member / "src/bin/*/main.rs")))]
            taken = {os.path.normpath(p) for p in bins.values()}
            for bname, path in found:
                if path.is_file() and bname not in bins and os.path.normpath(path) not in taken:
                    bins[bname] = path
        for bname, path in sorted(bins.items()):
            if path.is_file():
                roots.append((f"{name}/bin/{bname}", path))
    return roots


def module_files(root):
    """Every file of the crate at `root`: {path: (module path, test-only)}, following `mod`
    items from the root, then any other .rs file under a top-level module's directory."""
    files = {}

    def visit(path, modpath, mod_rs, test):
        path = Path(os.path.normpath(path))
        if path in files or not path.is_file():
            return
        scan = scan_file(path.read_text(errors="replace"), modpath, test)
        files[path] = (modpath, test, scan)
        base = path.parent if mod_rs else path.parent / path.stem
        for name, prefix, attr, mtest, inline, _ in scan.mods:
            if inline:
                continue
            if attr is not None:
                p = (path.parent if not prefix else base.joinpath(*prefix)) / attr.strip('"')
                visit(p, modpath + prefix + [name], True, test or mtest)
                continue
            d = base.joinpath(*prefix)
            for cand, is_mod_rs in ((d / f"{name}.rs", False), (d / name / "mod.rs", True)):
                if cand.is_file():
                    visit(cand, modpath + prefix + [name], is_mod_rs, test or mtest)
                    break

    visit(root, [], True, False)
    top = {name for name, prefix, _, _, inline, _ in files[Path(os.path.normpath(root))][2].mods
           if not inline and not prefix}
    for name in sorted(top):
        for p in sorted(glob.glob(str(root.parent / name / "**" / "*.rs"), recursive=True)):
            p = Path(os.path.normpath(p))
            if p not in files:
                rel = p.relative_to(root.parent).with_suffix("").parts
                modpath = list(rel[:-1] if rel[-1] == "mod" else rel)
                scan = scan_file(p.read_text(errors="replace"), modpath)
                files[p] = (modpath, False, scan)
    return top, files


class Graph:
    """The top-level modules of one crate root and the references between them."""

    def __init__(self, crate, root, ws):
        self.crate = crate
        self.top, files = module_files(root)
        root_scan = files[Path(os.path.normpath(root))][2]
        # crate::X where the root has `use m::...::X;` (or `use m as X;`) is a use of m
        alias = {}
        for path, name in root_scan.root_uses:
            segs = path[1:] if path and path[0] in ("crate", "self") else path
            if name and segs and segs[0] in self.top:
                alias.setdefault(name, segs[0])
        self.edges = defaultdict(list)  # (a, b) -> [(file, line, test)]
        for path, (modpath, _, scan) in files.items():
            if not modpath or modpath[0] not in self.top:
                continue
            a = modpath[0]
            for name, line, test in scan.refs:
                b = name if name in self.top else alias.get(name)
                if b and b != a:
                    self.edges[(a, b)].append((rel(path, ws), line, test))
        for sites in self.edges.values():
            sites.sort(key=lambda s: (s[2], s[0], s[1]))  # code before tests, then by place
        self.succ = defaultdict(set)
        for a, b in self.edges:
            self.succ[a].add(b)

    def sccs(self):
        """Tarjan: the strongly connected components of two or more modules, sorted."""
        index, low, stack, on, out = {}, {}, [], set(), []

        def strong(v):
            index[v] = low[v] = len(index)
            stack.append(v)
            on.add(v)
            for w in sorted(self.succ[v]):
                if w not in index:
                    strong(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))

        for v in sorted(self.top):
            if v not in index:
                strong(v)
        return sorted(out, key=sorted)

    def shortest_cycle(self, comp, through=None):
        """A shortest cycle inside `comp` through one of `through` (default: any module)."""
        best = None
        for start in sorted(through or comp):
            prev, queue = {start: None}, deque([start])
            while queue:
                v = queue.popleft()
                if start in self.succ[v] and (v != start):
                    path = [start]
                    while v is not None:
                        path.append(v)
                        v = prev[v]
                    path = path[::-1]  # start ... v start
                    if best is None or len(path) < len(best):
                        best = path
                    break
                for w in sorted(self.succ[v] & comp):
                    if w not in prev:
                        prev[w] = v
                        queue.append(w)
        return best

    def paths_from(self, start, comp):
        """Shortest paths inside `comp` from `start`: {module: [start, ..., module]}."""
        paths, queue = {start: [start]}, deque([start])
        while queue:
            v = queue.popleft()
            for w in sorted(self.succ[v] & comp):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
        return paths

    def shortest_cycle_across(self, comp, old, new):
        """A shortest closed walk inside `comp` through a module of `old` and one of `new`: it
        shows how the new modules joined the allowed cycle."""
        best = None
        for o in sorted(old):
            there = self.paths_from(o, comp)
            for n in sorted(new):
                back = self.paths_from(n, comp).get(o)
                if n in there and back:
                    walk = there[n] + back[1:]
                    if best is None or len(walk) < len(best):
                        best = walk
        return best

    def describe(self, a, b):
        sites = self.edges[(a, b)]
        file, line, test = sites[0]
        more = f" (+{len(sites) - 1} more)" if len(sites) > 1 else ""
        only = " (test)" if test else ""
        return f"{a} -> {b}  {file}:{line}{only}{more}"

    def cheapest_cut(self, comp):
        """Fewest reference sites whose removal leaves `comp` without cycles (up to 3 edges)."""
        inner = sorted(e for e in self.edges if e[0] in comp and e[1] in comp)
        best = None
        for k in range(1, 4):
            for cut in itertools.combinations(inner, k):
                left = [e for e in inner if e not in cut]
                if acyclic(comp, left):
                    cost = sum(len(self.edges[e]) for e in cut)
                    if best is None or cost < best[0]:
                        best = (cost, cut)
            if best:
                return best[1]
        return None


def acyclic(nodes, edges):
    indeg = {v: 0 for v in nodes}
    succ = defaultdict(list)
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    queue = [v for v in nodes if indeg[v] == 0]
    seen = 0
    while queue:
        v = queue.pop()
        seen += 1
        for w in succ[v]:
            indeg[w] -= 1
            if indeg[w] == 0:
                queue.append(w)
    return seen == len(nodes)


def rel(path, ws):
    try:
        return str(Path(path).relative_to(ws))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# The baseline and the check.


def read_allowed(text_):
    """[(line number, crate, frozenset of modules)]; raises ValueError on a malformed line."""
    out = []
    for n, line in enumerate(text_.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        crate, sep, mods = line.rpartition(":")
        mods = mods.split()
        if not sep or not crate.strip() or len(mods) < 2:
            raise ValueError(f"line {n}: expected `<crate>: <module> <module> ...`, got {line!r}")
        out.append((n, crate.strip(), frozenset(mods)))
    return out


def fmt(mods):
    return "{" + ", ".join(sorted(mods)) + "}"


def check(ws, allowed_text, allowed_name="the baseline", verbose=False):
    """Returns (exit status, output lines)."""
    ws = Path(ws).resolve()
    try:
        allowed = read_allowed(allowed_text)
    except ValueError as e:
        return 2, [f"module-cycles: {allowed_name}: {e}"]
    graphs = [Graph(crate, root, ws) for crate, root in crate_roots(ws)]
    out, bad, total, used, touched = [], 0, 0, defaultdict(list), set()
    for g in graphs:
        for comp in g.sccs():
            total += 1
            home = [(n, mods) for n, c, mods in allowed if c == g.crate and comp <= mods]
            if home:
                for n, _ in home:
                    used[n].append(comp)
                out.append(f"{g.crate}: {fmt(comp)}  allowed")
                if verbose:
                    out += explain(g, comp)
                continue
            bad += 1
            near = max(((len(comp & mods), n, mods) for n, c, mods in allowed if c == g.crate),
                       key=lambda x: (x[0], -x[1]), default=(0, 0, frozenset()))
            touched.update(n for n, c, mods in allowed if c == g.crate and comp & mods)
            if near[0]:
                grown = comp - near[2]
                out.append(f"{g.crate}: {fmt(comp)}  GROWN: allowed line {near[1]} is "
                           f"{fmt(near[2])}, now also {fmt(grown)}")
                path = g.shortest_cycle_across(comp, near[2] & comp, grown)
            else:
                out.append(f"{g.crate}: {fmt(comp)}  NEW cycle")
                path = g.shortest_cycle(comp)
            out.append("  closed by:")
            out += ["    " + g.describe(a, b) for a, b in zip(path, path[1:])]
            if verbose:
                out += explain(g, comp)
    crates = {g.crate for g in graphs}
    for n, crate, mods in allowed:
        if n in touched:  # a cycle grew out of it: the failure above says what to do
            continue
        if crate not in crates:
            out.append(f"note: allowed line {n} ({crate}: {' '.join(sorted(mods))}): "
                       f"no such crate; remove it")
        elif not used[n]:
            out.append(f"note: allowed line {n} ({crate}: {' '.join(sorted(mods))}): "
                       f"no cycle left; remove it")
        else:
            now = [" ".join(sorted(c)) for c in used[n]]
            if len(now) > 1 or frozenset().union(*used[n]) != mods:
                out.append(f"note: allowed line {n} ({crate}: {' '.join(sorted(mods))}) "
                           f"can shrink to: " + "; ".join(f"{crate}: {m}" for m in now))
    if bad:
        out.append(f"FAIL: {bad} new or grown cycle(s) between top-level modules. Cut an edge "
                   f"above (move the item it names to a lower module), or, if it must stay for "
                   f"now, add the cycle to {allowed_name}.")
        return 1, out
    out.append(f"OK: {total} cycle(s), each within {allowed_name}" if total
               else "OK: no cycles between top-level modules")
    return 0, out


def explain(g, comp):
    lines = []
    inner = sorted((e for e in g.edges if e[0] in comp and e[1] in comp),
                   key=lambda e: (len(g.edges[e]), e))
    lines.append(f"  edges in it, fewest references first ({len(inner)}):")
    for a, b in inner:
        sites = g.edges[(a, b)]
        tests = sum(s[2] for s in sites)
        tag = f", {tests} in tests" if tests else ""
        lines.append(f"    {a} -> {b}: {len(sites)} ref(s){tag}; first {sites[0][0]}:{sites[0][1]}")
    cut = g.cheapest_cut(comp)
    if cut:
        lines.append("  cheapest cut: " + ", ".join(f"{a} -> {b}" for a, b in cut)
                     + f" ({sum(len(g.edges[e]) for e in cut)} ref(s))")
    return lines


def baseline(ws):
    ws = Path(ws).resolve()
    lines = []
    for crate, root in crate_roots(ws):
        for comp in Graph(crate, root, ws).sccs():
            lines.append(f"{crate}: {' '.join(sorted(comp))}")
    return lines


# ---------------------------------------------------------------------------------------------
# Self-test: small made-up crates in a temporary directory.


def self_test():
    def workspace(tmp, files, bins=""):
        ws = Path(tmp)
        (ws / "Cargo.toml").write_text('[workspace]\nmembers = ["alpha"]\n')
        files = {"alpha/Cargo.toml": f'[package]\nname = "alpha"\nversion = "0.1.0"\n{bins}', **files}
        for name, body in files.items():
            p = ws / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(body)
        return ws

    def edges(ws, crate="alpha"):
        root = dict(crate_roots(ws))[crate]
        return Graph(crate, root, ws)

    failures, cases = [], 0

    def expect(name, got, want):
        nonlocal cases
        cases += 1
        if got != want:
            failures.append(f"{name}: got {got!r}, want {want!r}")

    lib = ("pub mod a;\npub mod b;\nmod c;\nmod d;\npub mod e;\n"
           "mod inline { pub fn x() {} }\npub use d::Thing;\n")
    with tempfile.TemporaryDirectory() as tmp:
        ws = workspace(tmp, {
            "alpha/src/lib.rs": lib,
            "alpha/src/a.rs": "pub fn f() { crate::b::g(); }\n",
            "alpha/src/b.rs": "use crate::a::f;\npub fn g() {}\n",
            "alpha/src/c.rs": "use crate::a;\n",
            "alpha/src/d.rs": "pub struct Thing;\n",
            "alpha/src/e/mod.rs": "mod inner;\n",
            "alpha/src/e/inner.rs": "",
        })
        g = edges(ws)
        expect("cycle found", [sorted(c) for c in g.sccs()], [["a", "b"]])
        expect("top-level modules", sorted(g.top), ["a", "b", "c", "d", "e"])

    with tempfile.TemporaryDirectory() as tmp:
        ws = workspace(tmp, {
            "alpha/src/lib.rs": lib,
            "alpha/src/a.rs": "use crate::{\n    b::{x, y::{self, z}},\n    c as cc,\n    inline::x,\n};\n"
                              "use super::d::Thing as T;\npub(in crate::e) fn f() {}\n",
            "alpha/src/b.rs": "pub fn f() -> crate::Thing { todo!() }\n",
            "alpha/src/c.rs": "",
            "alpha/src/d.rs": "pub struct Thing;\n",
            "alpha/src/e/mod.rs": "mod inner;\nuse self::inner::x;\nfn f() { super::a::f() }\n",
            "alpha/src/e/inner.rs": "use super::super::b;\nuse super::c;\n"
                                    "mod deeper { use super::super::super::c; }\n",
        })
        g = edges(ws)
        expect("grouped use parsed", sorted(g.edges), [("a", "b"), ("a", "c"), ("a", "d"), ("b", "d"),
                                                       ("e", "a"), ("e", "b"), ("e", "c")])
        expect("edge line", g.edges[("a", "c")][0][1], 3)

    with tempfile.TemporaryDirectory() as tmp:
        tricky = (
            "//! crate::c in an inner doc comment\n"
            "/// crate::c in a doc comment\n"
            "// crate::c in a comment\n"
            "/* crate::c /* nested crate::c */ still crate::c */\n"
            "fn f<'a>(s: &'a str) -> &'a str {\n"
            "    let _ = \"crate::c \\\" crate::c\";\n"
            "    let _ = r#\"crate::c \" crate::c\"#;\n"
            "    let _ = b\"crate::c\";\n"
            "    let _ = ('\"', '\\'', b'\"', '\\u{1F600}');\n"
            "    'outer: loop { break 'outer; }\n"
            "    crate::b::g();\n"
            "    s\n"
            "}\n"
        )
        ws = workspace(tmp, {
            "alpha/src/lib.rs": lib,
            "alpha/src/a.rs": tricky,
            "alpha/src/b.rs": "",
            "alpha/src/c.rs": "",
            "alpha/src/d.rs": "",
            "alpha/src/e/mod.rs": "#[cfg(test)]\nmod tests {\n    use crate::c;\n}\n"
                                  "fn f() { crate::d::x() }\n",
        })
        g = edges(ws)
        expect("comments and strings ignored", sorted(g.edges), [("a", "b"), ("e", "c"), ("e", "d")])
        expect("code line after literals", g.edges[("a", "b")][0][1], 11)
        expect("test edge marked", [s[2] for s in g.edges[("e", "c")]], [True])
        expect("code edge not marked", [s[2] for s in g.edges[("e", "d")]], [False])

    with tempfile.TemporaryDirectory() as tmp:
        ws = workspace(tmp, {
            "alpha/src/lib.rs": "mod a;\nmod b;\nmod c;\nmod k;\n",
            "alpha/src/a.rs": "", "alpha/src/b.rs": "", "alpha/src/c.rs": "",
            "alpha/src/k.rs": '#[path = "k_impl.rs"]\nmod imp;\n'
                              '#[cfg(test)]\n#[path = "k_tests.rs"]\nmod tests;\n',
            "alpha/src/k_impl.rs": "use crate::a;\n",
            "alpha/src/k_tests.rs": "use crate::b;\n",
            "alpha/src/k/orphan.rs": "use crate::c;\n",
        })
        g = edges(ws)
        expect("#[path] and stray files", sorted((e, [s[2] for s in v]) for e, v in g.edges.items()),
               [(("k", "a"), [False]), (("k", "b"), [True]), (("k", "c"), [False])])

    def run(files, allowed, bins=""):
        with tempfile.TemporaryDirectory() as tmp:
            return check(workspace(tmp, files, bins), allowed)

    two = {
        "alpha/src/lib.rs": "mod a;\nmod b;\nmod c;\n",
        "alpha/src/a.rs": "use crate::b;\n",
        "alpha/src/b.rs": "use crate::a;\n",
        "alpha/src/c.rs": "",
    }
    code, out = run(two, "# today's cycle\nalpha: a b  # a and b\n")
    expect("allowed cycle passes", code, 0)
    code, out = run(two, "alpha: a b c\n")
    expect("wider allowed line passes", code, 0)
    expect("wider allowed line noted", any("can shrink to: alpha: a b" in s for s in out), True)
    code, out = run({**two, "alpha/src/a.rs": ""}, "alpha: a b\n")
    expect("cut cycle passes", code, 0)
    expect("cut cycle noted", any("no cycle left" in s for s in out), True)
    code, out = run(two, "")
    expect("new cycle fails", code, 1)
    expect("new cycle path", [s for s in out if s.startswith("    ")],
           ["    a -> b  alpha/src/a.rs:1", "    b -> a  alpha/src/b.rs:1"])
    grown = {**two, "alpha/src/b.rs": "use crate::a;\nuse crate::c::x;\n",
             "alpha/src/c.rs": "\nuse crate::a;\n"}
    code, out = run(grown, "alpha: a b\n")
    expect("grown cycle fails", code, 1)
    expect("grown cycle named", any("GROWN" in s and "{c}" in s for s in out), True)
    expect("grown line not noted", [s for s in out if s.startswith("note")], [])
    expect("grown cycle path", [s for s in out if s.startswith("    ")],
           ["    a -> b  alpha/src/a.rs:1", "    b -> c  alpha/src/b.rs:2", "    c -> a  alpha/src/c.rs:2"])
    # two allowed cycles joined by one test-only reference: the path shows the join
    joined = {
        "alpha/src/lib.rs": "mod a;\nmod b;\nmod c;\nmod d;\n",
        "alpha/src/a.rs": "use crate::b;\nuse crate::c;\n",
        "alpha/src/b.rs": "use crate::a;\n",
        "alpha/src/c.rs": "use crate::d;\n#[cfg(test)]\nmod tests {\n    use crate::a;\n}\n",
        "alpha/src/d.rs": "use crate::c;\n",
    }
    code, out = run(joined, "alpha: a b\nalpha: c d\n")
    expect("joined cycles fail", code, 1)
    expect("joined cycles path", [s for s in out if s.startswith("    ")],
           ["    a -> c  alpha/src/a.rs:2", "    c -> a  alpha/src/c.rs:4 (test)"])
    expect("joined lines not noted", [s for s in out if s.startswith("note")], [])
    code, out = run(two, "beta: a b\nalpha: a\n")
    expect("malformed baseline", code, 2)

    # a binary's modules are a crate of their own
    code, out = run({
        "alpha/src/lib.rs": "pub mod a;\n",
        "alpha/src/a.rs": "",
        "alpha/src/main.rs": "mod x;\nmod y;\nfn main() {}\n",
        "alpha/src/x.rs": "use crate::y;\n",
        "alpha/src/y.rs": "use crate::x;\nuse alpha::a;\n",
    }, "")
    expect("binary root scanned", [s for s in out if "NEW" in s], ["alpha/bin/alpha: {x, y}  NEW cycle"])

    for f in failures:
        print(f"FAIL {f}")
    print(f"check-module-cycles: self-test {'failed' if failures else 'passed'} ({cases} cases)")
    return 1 if failures else 0


def main():
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workspace", type=Path, default=here.parent, help="workspace root")
    p.add_argument("--allowed", type=Path, default=here / "module-cycles.allowed")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="list every edge inside each cycle and a cheapest cut")
    p.add_argument("--print-baseline", action="store_true", help="print today's cycles as baseline lines")
    p.add_argument("--self-test", action="store_true")
    a = p.parse_args()
    if a.self_test:
        return self_test()
    if a.print_baseline:
        print("\n".join(baseline(a.workspace)))
        return 0
    try:
        allowed = a.allowed.read_text()
    except FileNotFoundError:
        print(f"module-cycles: {a.allowed} is missing (an empty file allows no cycle)")
        return 2
    code, out = check(a.workspace, allowed, rel(a.allowed.resolve(), a.workspace.resolve()), a.verbose)
    print("\n".join(out))
    return code


if __name__ == "__main__":
    sys.exit(main())
