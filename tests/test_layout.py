"""course/ is four rooms and an entry point; each room imports only what its package docstring allows.

Every import in course/ (top level or inside a function, absolute or relative) is resolved to a module of
course/ and checked against ALLOWED. The exercise files may reach into course/ only for the runtime.
"""

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
