"""./check.sh mutants: the learner's tasks are found in every exercise, the triage files fit the reference,
the fork server grades as a fresh process does, and the command runs end to end (installing cosmic-ray)."""

import os
import subprocess
import sys

import pytest

from course.grader import mutants, registry
from course.grader.forkserver import ForkServer
from course.grader.grade import run_checks
from course.grader.select import ROOT

WRITTEN = registry.written()


@pytest.mark.parametrize("ex", WRITTEN, ids=[e.id for e in WRITTEN])
def test_every_task_of_the_stub_is_located_in_the_reference(ex):
    names = mutants.tasks(ex.stub)
    assert names, f"{ex.stub}: no function raises NotImplementedError"
    spans = mutants.task_spans(ex.reference, names)
    assert all(lo <= hi for lo, hi in spans.values())


def test_triage_files_name_mutable_lines_of_the_learners_tasks():
    for path in sorted(mutants.TRIAGE_DIR.glob("*.toml")):
        ex = registry.get(path.stem)
        triage = mutants.load_triage(ex)
        assert triage, f"{path}: empty (delete it)"
        spans = mutants.task_spans(ex.reference, mutants.tasks(ex.stub))
        lines = ex.reference.read_text(encoding="utf-8").splitlines()
        for (function, operator, line, nth), reason in triage.items():
            assert function in spans, f"{path}: {function} is not a task of {ex.stub.name}"
            assert operator in mutants.OPERATORS, f"{path}: {operator} is not one of the operators run"
            lo, hi = spans[function]
            assert any(lines[i - 1].strip() == line for i in range(lo, hi + 1)), \
                f"{path}: {line!r} is not a line of {function} in {ex.reference.name}"
            assert len(reason.strip()) > 20, f"{path}: say why no input tells {line!r} apart"


def test_the_fork_server_grades_like_a_fresh_process():
    ex = registry.get("m01")
    server = ForkServer(ex.checks)
    try:
        for selection, status in (({"default": "solutions"}, ("passed", "passed_cpu")),
                                  ({"default": "solutions", ex.module: "mine"}, ("todo",))):
            forked = run_checks(ex, selection, spawn=server.spawn)
            fresh = run_checks(ex, selection)
            assert forked.status in status and fresh.status in status, (forked.results, fresh.results)
            assert [r["status"] for r in forked.results] == [r["status"] for r in fresh.results]
    finally:
        server.close()


def test_the_command_kills_mutants_and_prints_its_table(tmp_path):
    """End to end, the way a developer runs it: installs the dev extra into .venv when missing."""
    out = tmp_path / "m01.json"
    proc = subprocess.run([sys.executable, "-m", "course", "mutants", "m01", "--limit", "4", "-j", "2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exercise mutants  killed" in proc.stdout
    import json
    (row,) = json.loads(out.read_text(encoding="utf-8"))
    assert row["mutants"] == 4 and row["killed"] == 4 and row["survived"] == 0, row
