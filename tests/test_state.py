"""Progress state: record, status, a changed file, a corrupt state file."""

import pytest

from course.grader import state


@pytest.fixture(autouse=True)
def _tmp_state(tmp_path, monkeypatch):
    monkeypatch.setenv(state.STATE_DIR_ENV, str(tmp_path / "st"))


def test_unknown_exercise_is_todo(tmp_path):
    assert state.status_of("m03", tmp_path / "nothing.py") == "todo"


def test_passed_then_file_changed(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("a = 1\n")
    state.record("m03", "passed", f, 10, 10)
    assert state.status_of("m03", f) == "passed"
    f.write_text("a = 2\n")
    assert state.status_of("m03", f) == "changed"


def test_failed_is_failed(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("")
    state.record("m03", "failed", f, 3, 10)
    assert state.status_of("m03", f) == "failed"
    assert state.load()["m03"]["passed"] == 3


def test_corrupt_state_is_no_progress(tmp_path):
    state.state_file().parent.mkdir(parents=True)
    state.state_file().write_text("{not json")
    assert state.load() == {}
