"""Every written exercise: the reference passes, the untouched stub is 未实现 everywhere, every plant is caught."""

import pytest

from checks.plants import plants_for
from course import registry
from course.grade import run_checks

WRITTEN = [e for e in registry.written() if not e.needs_gpu]


def _summary(grade) -> str:
    rows = [f"{r['status']:8} {r['point']}: {r['message'][:300]} {r.get('where', '')}" for r in grade.results]
    return (grade.crash + "\n" if grade.crash else "") + "\n".join(rows)


@pytest.mark.parametrize("ex", WRITTEN, ids=[e.id for e in WRITTEN])
def test_reference_passes(ex):
    grade = run_checks(ex, {"default": "solutions"})
    assert grade.passed, _summary(grade)
    assert len(grade.results) >= 3, f"{ex.id}: too few checks"


@pytest.mark.parametrize("ex", WRITTEN, ids=[e.id for e in WRITTEN])
def test_untouched_stub_is_not_implemented_everywhere(ex):
    grade = run_checks(ex, {"default": "solutions", ex.module: "mine"})
    assert not grade.crash, grade.crash
    assert grade.all_todo, _summary(grade)


PLANTED = [(ex, p) for ex in WRITTEN for p in plants_for(ex.module)]


@pytest.mark.parametrize("ex,plant", PLANTED, ids=[f"{ex.id}-{p.id}" for ex, p in PLANTED])
def test_planted_mistake_is_caught(ex, plant, tmp_path):
    planted = tmp_path / f"{ex.module}.py"
    planted.write_text(plant.apply(ex.reference.read_text(encoding="utf-8")), encoding="utf-8")
    grade = run_checks(ex, {"default": "solutions", ex.module: str(planted)})
    assert not grade.crash, grade.crash
    bad = [r for r in grade.results if r["status"] in ("failed", "error", "timeout")]
    assert bad, f"planted mistake {plant.id!r} ({plant.mistake}) was not caught:\n{_summary(grade)}"
    assert not any(r["status"] == "todo" for r in grade.results)
    if plant.expect:
        assert any(plant.expect in r["message"] for r in bad), \
            f"planted mistake {plant.id!r}: no failure message names it ({plant.expect!r}):\n{_summary(grade)}"
