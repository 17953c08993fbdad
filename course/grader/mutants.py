"""`./check.sh mutants e07`: mutation testing of an exercise's checks (for course developers).

The mutants are cosmic-ray's (the `dev` extra, locked in requirements/dev.txt): its `init` enumerates every mutation
of the reference `solutions/<module>.py` and `cosmic_ray.mutating.mutate_code` writes one. Only the code a
learner writes is a target: the functions and methods whose body in `mine/<module>.py` raises
NotImplementedError (given code is not). Each mutant is graded exactly as a learner's file would be
(`grade.run_checks` with that file selected for the exercise, references for the rest), stopping at the first
failing check, so a killed mutant costs little.

A survivor is either a hole in the checks (fix the checks, add a plant) or equivalent: no input can tell it
apart from the reference. Equivalent survivors are triaged in `checks/mutants/<id>.toml`, each with a reason:

    [[equivalent]]
    function = "HybridSnapshotStore.capture"      # qualified name of the task in mine/
    operator = "core/ReplaceComparisonOperator_Lt_LtE"
    line = "if len(self._free) < 1:"              # the mutated line of solutions/, stripped
    nth = 0                                       # which mutant of this operator on this line (default 0)
    reason = "the store never holds fewer than 0 free rows, so < 1 and <= 1 agree on every reachable state"
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import registry
from .forkserver import ForkServer
from .grade import run_checks
from .select import ROOT

TRIAGE_DIR = ROOT / "checks" / "mutants"
TIMEOUT_RETRY = 4

# cosmic-ray's operators, one or two plausible replacements per site (its full set swaps every binary
# operator for every other one: ~12 mutants per `+`, most of them a TypeError in tensor code). These are the
# slips a learner makes: an off-by-one bound, a flipped comparison or condition, + for -, * for /, // for /,
# a constant off by one, and/or swapped, a loop that never runs, a break for a continue, a lost `not`.
OPERATORS = frozenset({
    "core/ReplaceBinaryOperator_Add_Sub", "core/ReplaceBinaryOperator_Sub_Add",
    "core/ReplaceBinaryOperator_Mul_Div", "core/ReplaceBinaryOperator_Div_Mul",
    "core/ReplaceBinaryOperator_Div_FloorDiv", "core/ReplaceBinaryOperator_FloorDiv_Div",
    "core/ReplaceBinaryOperator_Mod_FloorDiv", "core/ReplaceBinaryOperator_Pow_Mul",
    "core/ReplaceBinaryOperator_LShift_RShift", "core/ReplaceBinaryOperator_RShift_LShift",
    "core/ReplaceBinaryOperator_BitAnd_BitOr", "core/ReplaceBinaryOperator_BitOr_BitAnd",
    "core/ReplaceBinaryOperator_BitXor_BitOr",
    "core/ReplaceComparisonOperator_Lt_LtE", "core/ReplaceComparisonOperator_LtE_Lt",
    "core/ReplaceComparisonOperator_Gt_GtE", "core/ReplaceComparisonOperator_GtE_Gt",
    "core/ReplaceComparisonOperator_Eq_NotEq", "core/ReplaceComparisonOperator_NotEq_Eq",
    "core/ReplaceComparisonOperator_Is_IsNot", "core/ReplaceComparisonOperator_IsNot_Is",
    "core/ReplaceComparisonOperator_In_NotIn", "core/ReplaceComparisonOperator_NotIn_In",
    "core/ReplaceUnaryOperator_Delete_Not",
    "core/ReplaceUnaryOperator_Delete_USub", "core/ReplaceUnaryOperator_Invert_USub",
    "core/AddNot", "core/ReplaceTrueWithFalse", "core/ReplaceFalseWithTrue",
    "core/ReplaceAndWithOr", "core/ReplaceOrWithAnd",
    "core/ReplaceBreakWithContinue", "core/ReplaceContinueWithBreak",
    "core/ZeroIterationForLoop", "core/NumberReplacer", "core/ExceptionReplacer",
})


@dataclass
class Mutant:
    function: str           # qualified name of the learner's task it sits in
    operator: str
    line: str               # the mutated line of the reference, stripped
    nth: int                # index among this operator's mutants of this line in this function
    lineno: int
    diff: str
    code: str = field(repr=False)
    outcome: str = ""       # killed / survived / equivalent
    by: str = ""            # the check that killed it (its 验收要点) and status
    reason: str = ""        # for equivalent: the triage file's reason

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.function, self.operator, self.line, self.nth)


class _closing:
    def __init__(self, server):
        self.server = server

    def __enter__(self):
        return self.server

    def __exit__(self, *exc):
        if self.server is not None:
            self.server.close()


def tasks(stub: Path) -> list[str]:
    """Qualified names of the functions and methods whose body in the stub raises NotImplementedError."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(isinstance(s, ast.Raise) and "NotImplementedError" in ast.unparse(s.exc or s)
                       for s in child.body):
                    found.append(prefix + child.name)
    visit(ast.parse(stub.read_text(encoding="utf-8")), "")
    return found


def task_spans(reference: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    """Line span (first body line, last line) of each named task in the reference (after its docstring)."""
    spans: dict[str, tuple[int, int]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and prefix + child.name in names:
                body = child.body
                if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str) and len(body) > 1):
                    body = body[1:]
                spans[prefix + child.name] = (body[0].lineno, child.end_lineno)
    visit(ast.parse(reference.read_text(encoding="utf-8")), "")
    missing = set(names) - set(spans)
    if missing:
        raise SystemExit(f"{reference}: no definition of {', '.join(sorted(missing))} (mine/ and solutions/ differ)")
    return spans


def generate(ex: registry.Exercise, workdir: Path) -> list[Mutant]:
    """Every cosmic-ray mutant (of OPERATORS) that falls inside a task of `ex`, in source order."""
    import cosmic_ray.commands
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.work_db import WorkDB, use_db

    code = ex.reference.read_text(encoding="utf-8")
    lines = code.splitlines()
    spans = task_spans(ex.reference, tasks(ex.stub))
    target = workdir / ex.reference.name
    target.write_text(code, encoding="utf-8")
    with use_db(str(workdir / "session.sqlite"), WorkDB.Mode.create) as db:
        cosmic_ray.commands.init([target], db, {})
        items = [m for item in db.work_items for m in item.mutations]
    mutants: list[Mutant] = []
    seen: dict[tuple[str, str, str], int] = {}
    for spec in sorted(items, key=lambda s: (s.start_pos, s.operator_name, s.occurrence)):
        if spec.operator_name not in OPERATORS:
            continue
        lineno = spec.start_pos[0]
        function = next((name for name, (lo, hi) in spans.items() if lo <= lineno <= hi), None)
        if function is None:
            continue
        operator = cosmic_ray.plugins.get_operator(spec.operator_name)()
        mutated = mutate_code(code, operator, spec.occurrence)
        if mutated is None or mutated == code:
            continue
        line = lines[lineno - 1].strip()
        nth = seen.get((function, spec.operator_name, line), 0)
        seen[(function, spec.operator_name, line)] = nth + 1
        diff = "".join(l for l in difflib.unified_diff(code.splitlines(True), mutated.splitlines(True), n=0)
                       if l[:1] in "+-" and not l.startswith(("+++", "---")))
        mutants.append(Mutant(function, spec.operator_name, line, nth, lineno, diff.rstrip("\n"), mutated))
    return mutants


def load_triage(ex: registry.Exercise) -> dict[tuple[str, str, str, int], str]:
    """(function, operator, line, nth) -> reason, from checks/mutants/<id>.toml."""
    path = TRIAGE_DIR / f"{ex.id}.toml"
    if not path.exists():
        return {}
    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10: pytest's own dependency
        import tomli as tomllib
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    triage = {}
    for entry in data.get("equivalent", []):
        if not str(entry.get("reason", "")).strip():
            raise SystemExit(f"{path}: an equivalent mutant without a reason: {entry}")
        triage[(entry["function"], entry["operator"], entry["line"], int(entry.get("nth", 0)))] = entry["reason"]
    return triage


def grade_mutant(ex: registry.Exercise, mutant: Mutant, workdir: Path, index: int, spawn=None) -> None:
    path = workdir / f"m{index:04d}" / ex.reference.name
    path.parent.mkdir()
    path.write_text(mutant.code, encoding="utf-8")

    def failed(r: dict) -> bool:
        return r["status"] in ("failed", "error", "timeout", "todo")
    selection = {"default": "solutions", ex.module: str(path)}
    grade = run_checks(ex, selection, stop_when=failed, spawn=spawn)
    bad = [r for r in grade.results if failed(r)]
    if bad and all(r["status"] == "timeout" for r in bad):
        # a loaded machine can push a slow check past its limit: a timeout kills a mutant only when it also
        # happens with TIMEOUT_RETRY times the limit (a mutant that loops forever costs that long once)
        grade = run_checks(ex, selection, stop_when=failed, spawn=spawn, timeout_s=grade.limit * TIMEOUT_RETRY,
                           wall_s=grade.limit * TIMEOUT_RETRY + 30)
        bad = [r for r in grade.results if failed(r)]
    if grade.crash or bad:
        mutant.outcome = "killed"
        mutant.by = f"{bad[0]['status']}: {bad[0]['point']}" if bad else "crash: " + grade.crash.splitlines()[0][:80]
    else:
        mutant.outcome = "survived"


def run_exercise(ex: registry.Exercise, jobs: int, limit: int | None, verbose: bool, fork: bool = True) -> dict:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"course-mutants-{ex.id}-") as tmp:
        mutants = generate(ex, Path(tmp))
        if limit is not None:
            mutants = mutants[:limit]
        triage = load_triage(ex)
        todo = []
        for m in mutants:
            if m.key in triage:
                m.outcome, m.reason = "equivalent", triage[m.key]
            else:
                todo.append(m)
        print(f"{ex.id}: {len(mutants)} mutants in {len(tasks(ex.stub))} tasks "
              f"({len(mutants) - len(todo)} triaged equivalent), grading {len(todo)} with {jobs} workers",
              flush=True)
        done = 0
        server = ForkServer(ex.checks) if fork and todo else None

        def one(item: tuple[int, Mutant]) -> Mutant:
            grade_mutant(ex, item[1], Path(tmp), item[0], server.spawn if server else None)
            return item[1]
        with ThreadPoolExecutor(max_workers=jobs) as pool, _closing(server):
            for m in pool.map(one, enumerate(todo)):
                done += 1
                if verbose or m.outcome == "survived":
                    print(f"  [{done}/{len(todo)}] {m.outcome:8} {m.function}:{m.lineno} {m.operator}  {m.by}",
                          flush=True)
    survivors = [m for m in mutants if m.outcome == "survived"]
    stale = sorted(set(triage) - {m.key for m in mutants}) if limit is None else []
    row = {
        "exercise": ex.id, "mutants": len(mutants),
        "killed": sum(m.outcome == "killed" for m in mutants),
        "equivalent": sum(m.outcome == "equivalent" for m in mutants),
        "survived": len(survivors), "seconds": round(time.monotonic() - start, 1),
        "survivors": [{k: v for k, v in asdict(m).items() if k != "code"} for m in survivors],
        "equivalents": [{k: v for k, v in asdict(m).items() if k in ("function", "operator", "line", "nth", "reason")}
                        for m in mutants if m.outcome == "equivalent"],
        "stale_triage": [list(k) for k in stale],
    }
    for m in survivors:
        print(f"\nSURVIVED {ex.id} {m.function} (line {m.lineno}) {m.operator} nth={m.nth}\n{m.diff}")
    for k in stale:
        print(f"\nSTALE triage entry in checks/mutants/{ex.id}.toml (no such mutant now): {k}")
    return row


def ensure_tool() -> bool:
    """cosmic-ray importable: the dev extra's lock, requirements/dev.txt, installed into the course's .venv on
    first use (course/grader/lock.py)."""
    try:
        import cosmic_ray  # noqa: F401
        return True
    except ModuleNotFoundError:
        pass
    from . import lock
    return lock.ensure("dev")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="./check.sh mutants",
                                     description="Mutation testing of the exercises' checks (cosmic-ray).")
    parser.add_argument("exercises", nargs="*", help="exercise ids (e.g. e07 m03), or all (default)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                        help="mutants graded at once (default: the number of cores)")
    parser.add_argument("--limit", type=int, help="grade only the first N mutants of each exercise (a smoke run)")
    parser.add_argument("--json", type=Path, help="write the table and every survivor to this file")
    parser.add_argument("--no-fork", action="store_true",
                        help="start every grading as a fresh process (as ./check.sh does) instead of forking it "
                             "from a server that has imported torch and transformers once")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every mutant's outcome")
    args = parser.parse_args(argv)
    if not ensure_tool():
        return 2
    written = registry.written()
    ids = [e.id for e in written] if args.exercises in ([], ["all"]) else args.exercises
    unknown = [i for i in ids if i not in {e.id for e in written}]
    if unknown:
        parser.error(f"unknown exercise(s): {', '.join(unknown)}")
    rows = []
    for ex_id in ids:
        ex = registry.get(ex_id)
        if ex.missing_packages:
            print(f"{ex.id}: skipped, needs {', '.join(ex.missing_packages)}")
            continue
        rows.append(run_exercise(ex, max(1, args.jobs), args.limit, args.verbose, fork=not args.no_fork))
    print(f"\n{'exercise':8} {'mutants':>7} {'killed':>7} {'equiv':>6} {'survived':>8} {'time':>8}")
    for r in rows:
        print(f"{r['exercise']:8} {r['mutants']:7} {r['killed']:7} {r['equivalent']:6} {r['survived']:8} "
              f"{r['seconds']:7.0f}s")
    if args.json:
        args.json.write_text(json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-8")
    return 1 if any(r["survived"] or r["stale_triage"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
