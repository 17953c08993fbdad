"""Contract tables (checks/contracts/<id>.toml): every clause of a card's contract is exercised by a drawn case.

A table is a list of clauses, each naming the check (the test function in checks/test_<id>_*.py) and the case label
that check records with checks.kit.record_case when it draws that case:

    [[clause]]
    id = "quant-act-bf16"                         # unique in the file
    text = "quantize_act_fp8 accepts bf16 x"      # the clause, as the card states it
    check = "test_quantize_act"                   # pytest node name
    case = "act:bf16"                             # the label the check records

The test grades the reference with COURSE_SEED=1..4 and COURSE_CASES pointing at a file, collects the (check, label)
pairs the checks recorded and fails for a clause that no seed drew. With `every_seed = true` at the top of the table,
every seed must draw every clause (the check draws each case on every run, not by chance).
"""

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from selftest_cache import REFERENCE, fork_spawn

from checks.kit import CASES_ENV
from course.grader import registry
from course.grader.grade import run_checks
from course.grader.select import ROOT

try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10: pytest's own dependency
    import tomli as tomllib

CONTRACTS = ROOT / "checks" / "contracts"
SEEDS = (1, 2, 3, 4)
TABLES = sorted(CONTRACTS.glob("*.toml"))


def _table(path: Path) -> dict:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    clauses = data.get("clause", [])
    assert clauses, f"{path}: no [[clause]]"
    ids = [c.get("id") for c in clauses]
    assert len(set(ids)) == len(ids), f"{path}: clause ids repeat"
    for c in clauses:
        missing = [k for k in ("id", "text", "check", "case") if not str(c.get(k, "")).strip()]
        assert not missing, f"{path}: clause {c.get('id')!r} lacks {missing}"
    return data


def test_every_table_names_an_exercise_and_its_checks():
    assert TABLES, "no contract tables in checks/contracts"
    for path in TABLES:
        ex = registry.get(path.stem)
        source = ex.checks.read_text(encoding="utf-8")
        for c in _table(path)["clause"]:
            assert f"def {c['check']}(" in source, f"{path}: clause {c['id']!r}: no check {c['check']} in {ex.checks.name}"


@pytest.mark.parametrize("path", TABLES, ids=[p.stem for p in TABLES])
def test_draws_cover_every_clause(path):
    ex = registry.get(path.stem)
    if ex.missing_packages:
        pytest.skip(f"{ex.id} needs {', '.join(ex.missing_packages)}")
    data = _table(path)
    drawn: dict[int, set[tuple[str, str]]] = {}
    # the seeds graded side by side, each forked from the run's one fork server (tests/selftest_cache.py), which
    # imported torch and transformers once: a fresh process per seed costs ~5 s of imports on CI's two cores
    spawn = fork_spawn()
    with tempfile.TemporaryDirectory(prefix="course-cases-") as tmp:
        def grade_seed(seed: int):
            cases = Path(tmp) / f"{seed}.tsv"
            cases.touch()
            return cases, run_checks(ex, {"default": "solutions"}, spawn=spawn,
                                     env={**os.environ, "COURSE_SEED": str(seed), CASES_ENV: str(cases)})
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            graded = dict(zip(SEEDS, pool.map(grade_seed, SEEDS)))
        for seed, (cases, grade) in graded.items():
            assert grade.passed or all(r["status"] in ("passed", "skipped") for r in grade.results), \
                f"{ex.id}: the reference fails on seed {seed}: {grade.crash or [r for r in grade.results if r['status'] != 'passed']}"
        REFERENCE[ex.id] = graded[SEEDS[0]][1]          # tests/test_exercises.py's reference grading (selftest_cache)
        for seed, (cases, grade) in graded.items():
            drawn[seed] = {tuple(line.split("\t", 1)) for line in cases.read_text(encoding="utf-8").splitlines()}
    every = bool(data.get("every_seed", False))
    gaps = []
    for c in data["clause"]:
        pair = (c["check"], c["case"])
        seeds = [s for s in SEEDS if pair in drawn[s]]
        if not seeds or (every and len(seeds) < len(SEEDS)):
            gaps.append(f"{c['id']} ({c['check']} / {c['case']}): drawn on seeds {seeds} of {list(SEEDS)}")
    assert not gaps, f"{path.name}: clauses without a drawn case:\n  " + "\n  ".join(gaps)
