"""Every written exercise: the reference passes, the untouched stub is 未实现 everywhere, every plant is caught."""

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from selftest_cache import REFERENCE, fork_spawn

from checks.plants import catchers, plants_for, record_catchers
from course.grader import registry
from course.grader.grade import run_checks

import torch

# g01 is graded on the CPU too: its card example, decode contract (a fake CUDA graph) and sampler (the Triton
# interpreter) run there, its GPU checks report skipped; a plant only a GPU check can catch is skipped without
# CUDA. `./check.sh selftest -k g01` on a GPU machine grades all of it.
WRITTEN = registry.written()
CUDA = torch.cuda.is_available()
_GRADES: dict = {}
_TMP = tempfile.TemporaryDirectory(prefix="course-plants-")


def _graded(ex):
    """Grade the reference, the stub and every plant of `ex`, as many at once as there are cores (two for a GPU
    exercise on a GPU)."""
    if ex.id not in _GRADES:
        jobs = {"reference": {"default": "solutions"}, "stub": {"default": "solutions", ex.module: "mine"}}
        broken, done = {}, {}
        if ex.id in REFERENCE:        # tests/test_contracts.py graded it already in this run (seed 1 of 1-4)
            del jobs["reference"]
            done["reference"] = REFERENCE[ex.id]
        for plant in plants_for(ex.module):
            if plant.gpu_only and not CUDA:
                continue
            planted = Path(_TMP.name) / plant.id / f"{ex.module}.py"
            planted.parent.mkdir(parents=True, exist_ok=True)
            try:
                planted.write_text(plant.apply(ex.reference.read_text(encoding="utf-8")), encoding="utf-8")
            except ValueError as exc:          # the plant no longer fits the reference: fails that plant only
                broken[plant.id] = exc
                continue
            jobs[plant.id] = {"default": "solutions", ex.module: str(planted)}
        # a plant's grading stops at the first failure that proves it caught (named, when the plant says how):
        # the checks after it would not change the verdict
        stops = {p.id: _caught(p) for p in plants_for(ex.module)}
        # ... and runs first the check that caught it last time (checks/plants/catchers.json): the order only
        first = catchers().get(ex.module, {})
        envs = {key: dict(os.environ, COURSE_CHECK_FIRST=first[key]) for key in jobs if key in first}
        # on a GPU every g01 grading builds models of real width on the one device (~17-21 GiB each): as many at
        # once as there are cores ran the H200 out of memory (2026-12-01, 16 cores); two fit
        workers = 2 if CUDA and ex.needs_gpu else max(1, os.cpu_count() or 1)
        # every grading forks from the run's one fork server (tests/selftest_cache.py), which imported torch,
        # transformers and what the checks take from them once: a fresh `python -m pytest` spends ~5 s of a
        # 2-core machine on those imports alone; COURSE_SELFTEST_FORK=0 starts each grading as a fresh process
        spawn = fork_spawn()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {key: pool.submit(run_checks, ex, sel, env=envs.get(key), stop_when=stops.get(key),
                                        spawn=spawn) for key, sel in jobs.items()}
            _GRADES[ex.id] = {key: f.result() for key, f in futures.items()} | broken | done
        if os.environ.get("COURSE_PLANT_CATCHERS_UPDATE") == "1":
            found = {key: _catcher(grade, stops[key]) for key, grade in _GRADES[ex.id].items() if key in stops}
            record_catchers(ex.module, {key: name for key, name in found.items() if name})
    return _GRADES[ex.id]


def _catcher(grade, settles) -> str | None:
    """The check that settled a planted mistake's grading: the last result that `settles` it (a failure, naming the
    mistake where the plant says how), None when none did (a plant not caught keeps its old entry)."""
    if isinstance(grade, Exception):
        return None
    ran = [r for r in grade.results if settles(r)]
    return ran[-1]["name"] if ran else None


def _caught(plant):
    """The failure that settles a plant: any failing check, or one whose message names the mistake."""
    return lambda r: r["status"] in ("failed", "error", "timeout") and (not plant.expect or plant.expect in r["message"])


def _summary(grade) -> str:
    rows = [f"{r['status']:8} {r['point']}: {r['message'][:300]} {r.get('where', '')}" for r in grade.results]
    return (grade.crash + "\n" if grade.crash else "") + "\n".join(rows)


def _skip_without_packages(ex):
    if ex.missing_packages:
        pytest.skip(f"{ex.id} needs {', '.join(ex.missing_packages)} (pyproject.toml); not installed here")


@pytest.mark.parametrize("ex", WRITTEN, ids=[e.id for e in WRITTEN])
def test_reference_passes(ex):
    _skip_without_packages(ex)
    grade = _graded(ex)["reference"]
    assert grade.passed, _summary(grade)
    assert len(grade.results) >= 3, f"{ex.id}: too few checks"


@pytest.mark.parametrize("ex", WRITTEN, ids=[e.id for e in WRITTEN])
def test_untouched_stub_is_not_implemented_everywhere(ex):
    _skip_without_packages(ex)
    grade = _graded(ex)["stub"]
    assert not grade.crash, grade.crash
    assert grade.all_todo, _summary(grade)


PLANTED = [(ex, p) for ex in WRITTEN for p in plants_for(ex.module)]


@pytest.mark.parametrize("ex,plant", PLANTED, ids=[f"{ex.id}-{p.id}" for ex, p in PLANTED])
def test_planted_mistake_is_caught(ex, plant):
    _skip_without_packages(ex)
    if plant.gpu_only and not CUDA:
        pytest.skip(f"{plant.id}: only a check that needs CUDA catches it")
    grade = _graded(ex)[plant.id]
    if isinstance(grade, Exception):
        raise grade
    assert not grade.crash, grade.crash
    bad = [r for r in grade.results if r["status"] in ("failed", "error", "timeout")]
    assert bad, f"planted mistake {plant.id!r} ({plant.mistake}) was not caught:\n{_summary(grade)}"
    assert not any(r["status"] == "todo" for r in grade.results)
    if plant.expect:
        assert any(plant.expect in r["message"] for r in bad), \
            f"planted mistake {plant.id!r}: no failure message names it ({plant.expect!r}):\n{_summary(grade)}"
