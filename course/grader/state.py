"""The learner's progress: `.course/state.json` (git-ignored), one record per graded exercise."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from .select import ROOT

STATE_DIR_ENV = "COURSE_STATE_DIR"   # tests point this at a temporary folder


def state_file() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV, ROOT / ".course")) / "state.json"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else ""


def load() -> dict[str, dict]:
    path = state_file()
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, OSError):
        return {}   # a corrupt state file is treated as no progress, never as a crash


def save(state: dict[str, dict]) -> None:
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, ensure_ascii=False, indent=2, sort_keys=True), encoding="utf-8")
    tmp.replace(path)


def record(exercise_id: str, status: str, mine_file: Path, passed: int, total: int) -> None:
    state = load()
    state[exercise_id] = {
        "status": status,
        "digest": file_digest(mine_file),
        "passed": passed,
        "total": total,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    save(state)


PASSED = ("passed", "passed_cpu")


def status_of(exercise_id: str, mine_file: Path) -> str:
    """passed / passed_cpu (passed where it ran, but the checks that need a GPU did not run) / changed (passed,
    but the file changed since) / failed / todo."""
    entry = load().get(exercise_id)
    if not entry:
        return "todo"
    if entry["status"] in PASSED:
        return entry["status"] if entry.get("digest") == file_digest(mine_file) else "changed"
    return entry["status"]


def passed_ids(catalogue) -> set[str]:
    """Exercises whose file passed every check that could run (on the CPU: passed_cpu too). The engine is
    assembled from them and the next exercise follows them; the overview says which are passed_cpu."""
    return {e.id for e in catalogue if status_of(e.id, e.stub) in PASSED}
