"""The lock (requirements/, course/grader/lock.py): complete, hash-pinned, rendered into the README, installed."""

import os
import re
import sys
from pathlib import Path

import pytest

from course.grader import lock

ROOT = Path(__file__).resolve().parent.parent
GENERATED = sorted(p for p in lock.REQ.glob("*.txt") if not p.name.startswith("torch-"))


def _names(requirements: list[str]) -> set[str]:
    return {lock._name(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in requirements}


def test_every_generated_set_is_pinned_with_hashes():
    assert {p.name for p in GENERATED} >= {"cpu.txt", "uv.txt", "dev.txt"}
    for path in GENERATED:
        entries = lock.blocks(path)
        assert entries, f"{path.name} locks nothing"
        for name, version, entry in entries:
            assert "--hash=sha256:" in entry, f"{path.name}: {name}=={version} has no hash"
            assert name != "torch", f"{path.name} holds torch (it belongs in torch-cpu.txt / torch-cuda.txt)"
    for variant in ("cpu", "cuda"):
        pins = [(n, v) for n, v, _ in lock.blocks(lock.REQ / f"torch-{variant}.txt")]
        assert len(pins) == 1 and pins[0][0] == "torch", pins


def test_the_lock_holds_everything_pyproject_asks_for():
    """A dependency added to pyproject.toml without `./check.sh lock` fails here, not on a learner's machine."""
    project = lock._pyproject()
    base = {n for n, _, _ in lock.blocks(lock.REQ / "cpu.txt")}
    assert _names(project["project"]["dependencies"]) - {"torch"} <= base, "run ./check.sh lock"
    sets = {**project["project"].get("optional-dependencies", {}),
            **{f"group-{g}": reqs for g, reqs in project.get("dependency-groups", {}).items()}}
    for name, reqs in sets.items():
        path = lock.REQ / f"{name}.txt"
        assert path.exists(), f"pyproject.toml's {name} has no requirements/{name}.txt: run ./check.sh lock"
        held = base | {n for n, _, _ in lock.blocks(path)}
        assert _names(r for r in reqs if isinstance(r, str)) <= held, f"{name}: run ./check.sh lock"


def test_readme_states_the_locked_versions():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert lock.readme_table() in readme, "README.md's version table is not the lock's: run ./check.sh lock"


def test_the_course_venv_holds_exactly_the_lock():
    """The .venv that check.sh set up has every locked package at its locked version (torch with its build tag).
    Another interpreter (COURSE_PYTHON, a GPU box's python3) is not the lock's to judge; CI always is."""
    ci = os.environ.get("CI") == "true" and os.environ.get("COURSE_USE_VENV") == "1"
    if not lock.in_course_venv() or (os.environ.get("COURSE_PYTHON") and not ci):
        assert not ci, f"CI runs the selftest in .venv, but this is {sys.executable}"
        pytest.skip(f"{sys.executable} is not check.sh's own .venv (COURSE_PYTHON or another interpreter)")
    installed = lock.installed_versions()
    wrong = {n: (installed.get(n), v) for n, v in lock.pins(lock.variant()).items() if installed.get(n) != v}
    assert not wrong, f"installed vs locked: {wrong}"


def test_drift_ignores_build_tags_but_not_releases():
    locked = {"torch": "2.11.0", "numpy": "2.2.6", "rich": "15.0.0", "jieba": "0.42.1"}
    installed = {"torch": "2.11.0+cu130", "numpy": "2.5.2", "rich": "15.0.0"}       # the GPU box; jieba missing
    assert lock.drift(installed, locked) == [("numpy", "2.5.2", "2.2.6")]
    line = lock.drift_line(lock.drift(installed, locked))
    assert "\n" not in line and "numpy 2.5.2（锁定 2.2.6）" in line and "torch" not in line


def test_drift_warning_is_one_line_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("COURSE_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(lock, "installed_versions", lambda: {"triton": "3.9.0", "numpy": "2.2.6"})
    monkeypatch.setattr(lock, "pins", lambda *a, **k: {"triton": "3.6.0", "numpy": "2.2.6"})
    for _ in range(2):
        monkeypatch.delenv("COURSE_VERSIONS_CHECKED", raising=False)
        lock.warn_if_drifted()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "triton 3.9.0（锁定 3.6.0）" in err, err
    monkeypatch.setattr(lock, "installed_versions", lambda: {"triton": "3.6.0", "numpy": "2.2.6"})
    monkeypatch.delenv("COURSE_VERSIONS_CHECKED", raising=False)
    lock.warn_if_drifted()
    assert capsys.readouterr().err == ""
