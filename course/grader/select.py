"""Implementation selection: which folder backs each exercise module.

`mine/` and `solutions/` hold modules with identical names. Both are loaded under one package name,
`impl`, so exercise files import each other with plain relative imports
(`from .m01_rmsnorm import RMSNorm`) and never know which folder they came from.

The choice travels in one environment variable so that pytest subprocesses see it too:

    COURSE_SELECTION='{"default": "solutions", "m03_sparse_moe": "mine"}'

A value is "mine", "solutions" or a path to a .py file (used by the planted-mistake selftest).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "impl"
ENV = "COURSE_SELECTION"
FOLDERS = ("mine", "solutions")


def encode(selection: dict[str, str]) -> str:
    return json.dumps(selection, sort_keys=True)


def current() -> dict[str, str]:
    raw = os.environ.get(ENV)
    selection = json.loads(raw) if raw else {}
    selection.setdefault("default", "solutions")
    return selection


def resolve(module: str, selection: dict[str, str] | None = None) -> Path:
    """The file that backs `impl.<module>` under `selection`."""
    selection = current() if selection is None else selection
    choice = selection.get(module, selection.get("default", "solutions"))
    if choice in FOLDERS:
        path = ROOT / choice / f"{module}.py"
    else:
        path = Path(choice)
    if not path.is_file():
        raise ModuleNotFoundError(f"{PACKAGE}.{module}: {path} does not exist", name=f"{PACKAGE}.{module}")
    return path


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == PACKAGE:
            spec = importlib.util.spec_from_loader(fullname, loader=None, is_package=True)
            spec.submodule_search_locations = []
            return spec
        if fullname.startswith(PACKAGE + ".") and fullname.count(".") == 1:
            module = fullname.split(".", 1)[1]
            return importlib.util.spec_from_file_location(fullname, resolve(module))
        return None


_FINDER = _Finder()


def install() -> None:
    """Make `import impl.<module>` resolve through the selection (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def load(module: str) -> types.ModuleType:
    """Import `impl.<module>` fresh: a file that failed to import is retried on every call."""
    install()
    name = f"{PACKAGE}.{module}"
    if name in sys.modules:
        return sys.modules[name]
    return importlib.import_module(name)


def forget() -> None:
    """Drop every loaded `impl.*` module (after the selection changed in this process)."""
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def use(selection: dict[str, str]) -> None:
    """Set the selection for this process and its children."""
    os.environ[ENV] = encode(selection)
    forget()
    install()
