"""`from course import use`: the checker's selection in a notebook or a script of your own.

`./check.sh m05` grades mine/m05_gated_deltanet.py with every other exercise taken from solutions/, so an
earlier exercise you have not finished (m05 imports m01) never gets in the way. `use` does the same in
your own Python (started in the repository's root):

    from course import use
    impl = use("m05")                    # mine/m05_gated_deltanet.py; every other exercise from solutions/
    m01, m05 = use("m01", "m05")         # both from mine/, the rest from solutions/
    m06 = use("m06", mine=["m01"])       # m06 and m01 from mine/; returns m06
    m01, m05 = use(mine=["m01", "m05"])  # the same as use("m01", "m05")

Each call starts over: files loaded before are dropped, so running the line again picks up your edits.
Without CUDA, Track K's Triton kernels run in Triton's interpreter, as in the checks (checks/conftest.py).
"""

from __future__ import annotations

import os
import types

from . import registry, select


def _exercise(name: str) -> registry.Exercise:
    try:
        return registry.by_module(name) or registry.get(name.split("_", 1)[0])
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def use(*exercises: str, mine: str | list[str] | tuple[str, ...] = ()) -> types.ModuleType | tuple[types.ModuleType, ...]:
    """Load `exercises` (ids like "m05" or module names) from mine/, those in `mine` too, the rest from solutions/.

    Returns the module of each exercise named positionally (of those in `mine` when none is), one module
    for one name. Other exercises' modules are imported on demand, as `impl.<module>`.
    """
    extra = [mine] if isinstance(mine, str) else list(mine)
    wanted = [_exercise(e) for e in exercises]
    also = [_exercise(e) for e in extra]
    if not wanted and not also:
        raise TypeError('use() 需要至少一个练习编号，例如 use("m05") 或 use(mine=["m01", "m05"])')
    if any(ex.track == "K" for ex in wanted + also):
        import torch
        if not torch.cuda.is_available():                  # read when a kernel is defined: before the load below
            os.environ.setdefault("TRITON_INTERPRET", "1")
    selection = {"default": "solutions"}
    selection.update({ex.module: "mine" for ex in wanted + also})
    select.use(selection)
    modules = tuple(select.load(ex.module) for ex in (wanted or also))
    return modules[0] if len(modules) == 1 else modules
