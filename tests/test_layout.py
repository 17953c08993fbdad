"""course/ is four rooms and an entry point; each room imports only what its package docstring allows.

Every import in course/ (top level or inside a function, absolute or relative) is resolved to a module of
course/ and checked against ALLOWED. The exercise files may reach into course/ only for the runtime. The same
imports make a graph in which no modules import each other (no cycle).
"""

import argparse
import ast
from pathlib import Path

from course.grader.select import ROOT

COURSE = ROOT / "course"
ROOMS = ("grader", "runtime", "bench", "book")
ENTRY = {"__init__.py", "__main__.py", "cli.py"}          # may reach into every room
SELECTION = ("course.grader.select", "course.grader.registry", "course.grader.state")
ALLOWED = {                                              # room -> module prefixes it may import from course/
    "grader": ("course.grader",),
    "runtime": ("course.runtime",) + SELECTION,
    "bench": ("course.bench", "course.runtime") + SELECTION,
    "book": ("course.book", "course.grader.registry", "course.grader.select", "course.grader.cards"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    return _course_imports(path.read_text(encoding="utf-8"), package)


def _course_imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) for every import of a course module in `source` (a module of `package`), relative ones
    resolved; `from X import name` counts as importing X.name when that is a module of the repo."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:                          # `from . import select` names a module
                sub = f"{mod}.{a.name}"
                is_module = (ROOT / Path(*sub.split("."))).is_dir() or (ROOT / (sub.replace(".", "/") + ".py")).is_file()
                found.append((node.lineno, sub if is_module else mod))
    return [(line, m) for line, m in found if m == "course" or m.startswith("course.")]


def test_course_is_rooms_and_an_entry_point():
    top = {p.name for p in COURSE.iterdir() if not p.name.startswith(("__pycache__", "."))}
    assert top == ENTRY | set(ROOMS), f"course/ should hold only {sorted(ENTRY | set(ROOMS))}, found {sorted(top)}"
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((COURSE / room / "__init__.py").read_text(encoding="utf-8")))
        assert doc and "Imports:" in doc, f"course/{room}/__init__.py must say what the room is and what it may import"


def test_every_import_follows_the_rooms_direction():
    bad = []
    for room in ROOMS:
        for path in sorted((COURSE / room).rglob("*.py")):
            for line, mod in _imports(path):
                if not mod.startswith(ALLOWED[room]):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod} (course/{room} may import {ALLOWED[room]})")
    assert not bad, "\n".join(bad)


def test_exercise_files_reach_only_the_runtime():
    bad = []
    for folder in ("solutions", "mine"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for line, mod in _imports(path):
                if not mod.startswith("course.runtime"):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_checker_finds_an_import_against_the_direction():
    """The resolver itself: imports inside a function, relative and absolute, out of the grader are seen."""
    source = "import os\ndef f():\n    from ..book import build\n    from . import select\n    import course.bench\n"
    found = sorted(_course_imports(source, "course.grader"))
    assert found == [(3, "course.book.build"), (4, "course.grader.select"), (5, "course.bench")]
    assert not all(m.startswith(ALLOWED["grader"]) for _, m in found)


def _import_graph() -> dict[str, set[str]]:
    """module of course/ -> the modules of course/ it imports (anywhere in the file: a function's import counts)."""
    paths = sorted(COURSE.rglob("*.py"))
    names = {_module_name(p) for p in paths}
    return {_module_name(p): {m for _, m in _imports(p) if m in names and m != _module_name(p)} for p in paths}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted: every import cycle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_package_in_course_has_an_import_cycle():
    """Modules that import each other (even inside functions) make the order of their initialisation matter: a
    package dispatches from one module and keeps its shared helpers in a module the others import."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles in course/:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_checker_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _course_imports("def f():\n    from .engine import x\n", "course.bench") == [(2, "course.bench.engine")]


def test_bench_help_mentions_every_option_the_bench_parsers_accept():
    import subprocess
    import sys
    from rich.cells import cell_len
    from course.bench import cli
    out = subprocess.run([sys.executable, "-m", "course", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    lines = text.splitlines()
    internal = next(l for l in lines if l.lstrip().startswith("内部用"))
    sections = {}                                       # heading -> its lines, up to the next blank line
    for i, line in enumerate(lines):
        if line.endswith("的选项："):
            sections[line[:-1]] = lines[i + 1:lines.index("", i)] if "" in lines[i:] else lines[i + 1:]
    missing = []
    for keys, heading in cli.SECTIONS:
        assert heading in sections, f"no section {heading!r} in bench --help"
        for key in keys:
            for action in cli.parsers()[key]._actions:
                assert action.help, f"bench {key}: {action.option_strings} has no help text"
                for option in action.option_strings:     # one line each, in its command's section
                    if action.help == argparse.SUPPRESS:
                        ok = option + " " in internal + " "
                    else:
                        ok = any(l.split()[0] == option for l in sections[heading])
                    if not ok:
                        missing.append(f"{key}: {option}")
    assert not missing, "bench --help does not mention: " + ", ".join(missing)
    for kernel in cli.KERNELS:
        assert any(l.lstrip().startswith(kernel + " ") for l in lines), kernel
    for workload in ("--workload multiturn", "--serve", "--profile", "--tp N"):
        assert any(l.lstrip().startswith(workload) for l in lines), workload
    assert "-h, --help" in text
    too_wide = [l for l in lines if cell_len(l) > 80]
    assert not too_wide, "wider than 80 columns:\n" + "\n".join(too_wide)
