"""Run one exercise's checks in a subprocess and collect one result per 验收要点.

A subprocess keeps the CLI alive whatever the learner's file does (syntax error, exception, infinite
loop, segfault); pytest-timeout bounds each check, and transformers is imported once per run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import select
from .registry import Exercise

CHECK_TIMEOUT_S = int(os.environ.get("COURSE_CHECK_TIMEOUT", "30"))   # per check
RUN_TIMEOUT_S = 900                                                    # whole file, a hard stop


@dataclass
class Grade:
    exercise: Exercise
    results: list[dict] = field(default_factory=list)
    crash: str = ""          # set when pytest itself died or produced no report
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        # a GPU-only check skipped on a machine without CUDA does not fail the grade (at least one check must pass)
        return (not self.crash and any(r["status"] == "passed" for r in self.results)
                and all(r["status"] in ("passed", "skipped") for r in self.results))

    @property
    def all_todo(self) -> bool:
        return bool(self.results) and all(r["status"] == "todo" for r in self.results)

    def count(self, status: str) -> int:
        return sum(r["status"] == status for r in self.results)


def run_checks(exercise: Exercise, selection: dict[str, str], extra_args: tuple[str, ...] = (),
               env: dict[str, str] | None = None, timeout_s: int | None = None) -> Grade:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
        report = Path(tmp) / "report.json"
        child_env = dict(os.environ if env is None else env)
        child_env.update({
            select.ENV: select.encode(selection),
            "COURSE_REPORT": str(report),
            "PYTHONDONTWRITEBYTECODE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": child_env.get("OMP_NUM_THREADS", "1"),   # tiny tensors: threads only contend
        })
        # hypothesis and anyio register pytest plugins that cost ~1.8 s of start-up; the checks need neither
        cmd = [sys.executable, "-m", "pytest", str(exercise.checks), "-q", "-p", "no:cacheprovider",
               "-p", "no:hypothesispytest", "-p", "no:anyio",
               "--rootdir", str(select.ROOT), "-c", os.devnull, f"--timeout={timeout_s or CHECK_TIMEOUT_S}",
               "--no-header", "-rN", *extra_args]
        try:
            proc = subprocess.run(cmd, cwd=select.ROOT, env=child_env, capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Grade(exercise, crash=f"整个检查超过 {RUN_TIMEOUT_S} s 被终止", seconds=time.perf_counter() - start)
        grade = Grade(exercise, seconds=time.perf_counter() - start)
        if report.is_file():
            grade.results = json.loads(report.read_text(encoding="utf-8"))
        if not grade.results:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            grade.crash = f"检查进程没有产生结果（退出码 {proc.returncode}）：\n{tail}"
        return grade
