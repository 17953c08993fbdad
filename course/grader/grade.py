"""Run one exercise's checks in a subprocess and collect one result per 验收要点, as they finish.

A subprocess keeps the CLI alive whatever the learner's file does (syntax error, exception, infinite
loop, segfault); transformers is imported once per run. Time limits (checks/timeouts.py does the
interrupting inside the run):
- every check gets CHECK_TIMEOUT_S seconds (the slowest reference check takes ~6 s on one core); a
  function that hung is not waited for again by later checks;
- once a check has timed out, the run stops WALL_AFTER_TIMEOUT_S after it started (a hanging file is
  reported in under a minute); checks not started by then are 未运行;
- a check that ignores its interrupt (stuck inside one long C call) is killed GRACE_S after its limit,
  with the whole process group (worker processes included); so is the run on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import select
from .registry import Exercise

CHECK_TIMEOUT_S = int(os.environ.get("COURSE_CHECK_TIMEOUT", "20"))   # per check; a slow machine may raise it
GPU_CHECK_TIMEOUT_S = 600   # native GPU checks (g01, Track K on a CUDA machine): first Triton compiles, real shapes
WALL_AFTER_TIMEOUT_S = 50 # once a check timed out, nothing runs past this (or the limit + 25 s) from the start
GRACE_S = 10              # a check still running this long after its limit is killed from outside
EXIT_GRACE_S = 5          # every result is in: the process gets this long to exit
RUN_TIMEOUT_S = 900       # whole file, a hard stop
POLL_S = 0.1

Listener = Callable[[str, dict], None]    # ("plan", {"checks", "limit"}) / ("result", {...})


@dataclass
class Grade:
    exercise: Exercise
    results: list[dict] = field(default_factory=list)
    crash: str = ""          # set when pytest itself died or produced no report
    seconds: float = 0.0
    limit: float = 0.0       # seconds per check

    @property
    def passed(self) -> bool:
        # a check skipped for want of a GPU neither fails nor counts as passed
        return (not self.crash and self.count("passed") > 0
                and all(r["status"] in ("passed", "skipped") for r in self.results))

    @property
    def gpu_skipped(self) -> int:
        """Checks skipped for want of a GPU (checks/kit.py needs_cuda / needs_cuda_devices: "需要 … GPU")."""
        return sum(r["status"] == "skipped" and "GPU" in r.get("message", "") for r in self.results)

    @property
    def multi_gpu_skipped(self) -> int:
        """Checks skipped on a machine that has a GPU, for want of more of them (tensor parallel: "需要 2 块 GPU
        （这台机器有 1 块）"). A course cannot require two GPUs: these do not hold acceptance back."""
        return sum(r["status"] == "skipped" and re.search(r"这台机器有 [1-9]", r.get("message", "")) is not None
                   for r in self.results)

    @property
    def status(self) -> str:
        """What the learner's progress records: passed, passed_cpu (everything that ran here passed, but checks
        that need a GPU did not run: not yet accepted), todo or failed. On a GPU machine, checks that need more
        GPUs than it has are reported but do not keep an exercise at passed_cpu."""
        if self.passed:
            return "passed_cpu" if self.gpu_skipped > self.multi_gpu_skipped else "passed"
        return "todo" if self.all_todo else "failed"

    @property
    def failing(self) -> list[dict]:
        """Every check that failed, errored or timed out, in the order they ran."""
        return [r for r in self.results if r["status"] in ("failed", "error", "timeout")]

    @property
    def all_todo(self) -> bool:
        return self.count("todo") > 0 and all(r["status"] in ("todo", "skipped") for r in self.results)

    @property
    def all_skipped(self) -> bool:
        """Nothing could run here (e.g. a package the exercise needs is missing): neither passed nor failed."""
        return bool(self.results) and all(r["status"] == "skipped" for r in self.results)

    def count(self, status: str) -> int:
        return sum(r["status"] == status for r in self.results)


class _Events:
    """Reads the JSON lines the check process appends (checks/conftest.py), as they arrive."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def new(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as f:       # bytes: a read can end inside a multi-byte character
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()              # an incomplete last line waits for the rest
        return [json.loads(line.decode("utf-8")) for line in lines if line.strip()]


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the check process and everything it started (its own session), then reap it."""
    with _no_interrupts():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


class _no_interrupts:
    """Hold Ctrl-C off while the child is being killed (a second Ctrl-C must not leave it running)."""

    def __enter__(self):
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)


def run_checks(exercise: Exercise, selection: dict[str, str], extra_args: tuple[str, ...] = (),
               env: dict[str, str] | None = None, timeout_s: float | None = None,
               on_event: Listener | None = None, wall_s: float | None = None,
               stop_when: Callable[[dict], bool] | None = None, spawn: Callable | None = None) -> Grade:
    """Grade `exercise` under `selection`; `on_event` hears the plan and each result as it arrives.

    stop_when: once a result satisfies it, the check process is ended and the checks not yet run are 未运行
    (the selftest stops a planted mistake's grading at the failure that names it).

    timeout_s: per check (CHECK_TIMEOUT_S); wall_s: once a check timed out, nothing runs past this many
    seconds from the start (WALL_AFTER_TIMEOUT_S, or the limit + 25 s when that is longer).

    spawn(cmd, cwd, env, stdout): starts the check process in place of subprocess.Popen (the mutation run forks it
    from a server that has torch and transformers imported already: course/grader/forkserver.py)."""
    start, started_wall = time.monotonic(), time.time()
    on_gpu = exercise.needs_gpu or (exercise.track == "K" and shutil.which("nvidia-smi") is not None)
    limit = timeout_s or (max(GPU_CHECK_TIMEOUT_S, CHECK_TIMEOUT_S) if on_gpu else CHECK_TIMEOUT_S)
    wall = wall_s if wall_s is not None else max(WALL_AFTER_TIMEOUT_S, limit + 25)
    grade = Grade(exercise, limit=limit)
    notify = on_event or (lambda kind, data: None)
    with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
        events, log = _Events(Path(tmp) / "events.jsonl"), Path(tmp) / "pytest.log"
        child_env = dict(os.environ if env is None else env)
        child_env.update({
            select.ENV: select.encode(selection),
            "COURSE_EVENTS": str(events.path),
            "COURSE_CHECK_TIMEOUT": str(limit),
            "COURSE_DEADLINE": str(started_wall + wall),
            "PYTHONDONTWRITEBYTECODE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": child_env.get("OMP_NUM_THREADS", "1"),   # tiny tensors: threads only contend
        })
        # hypothesis and anyio register pytest plugins that cost ~1.8 s of start-up; the checks need neither;
        # the time limits are checks/timeouts.py's, so pytest-timeout stays out of the way
        cmd = [sys.executable, "-m", "pytest", str(exercise.checks), "-q", "-p", "no:cacheprovider",
               "-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:timeout",
               "--rootdir", str(select.ROOT), "-c", os.devnull, "--no-header", "-rN", *extra_args]
        planned: list[dict] = []
        running: dict | None = None          # the check in progress: its start event and when it began
        stopped = False                      # stop_when was met: the rest is deliberately not run
        with open(log, "wb") as out:
            if spawn is not None:
                proc = spawn(cmd, select.ROOT, child_env, out)
            else:
                proc = subprocess.Popen(cmd, cwd=select.ROOT, env=child_env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        try:
            exit_by = None                       # every result is in: when the process must have exited
            while True:
                exited = proc.poll() is not None
                for ev in events.new():
                    kind = ev.pop("event")
                    if kind == "plan":
                        planned = ev["checks"]
                        notify("plan", ev)
                    elif kind == "start":
                        running = dict(ev, since=time.monotonic())
                    elif kind == "result":
                        running = None
                        grade.results.append(ev)
                        notify("result", ev)
                        if stop_when is not None and stop_when(ev):
                            stopped = True
                            break
                if exited or stopped:
                    break
                now = time.monotonic()
                if running and now - running["since"] > running["limit"] + GRACE_S:
                    _give_up(grade, planned, running, notify)
                    break
                if planned and len(grade.results) >= len(planned):
                    exit_by = exit_by or now + EXIT_GRACE_S
                    if now > exit_by:
                        break
                if now - start > RUN_TIMEOUT_S:
                    grade.crash = f"整个检查超过 {RUN_TIMEOUT_S} s 被终止"
                    break
                time.sleep(POLL_S)
        finally:
            _kill_group(proc)
        grade.seconds = time.monotonic() - start
        if stopped:
            _not_run(grade, planned, "未运行：要找的失败已经出现，提前结束", notify)
        elif grade.results and not grade.crash and proc.returncode is not None:
            _died_midway(grade, planned, running, proc.returncode, log, notify)
        if not grade.results and not grade.crash:
            text = log.read_text(encoding="utf-8", errors="replace")
            tail = "\n".join(text.strip().splitlines()[-15:])
            grade.crash = f"检查进程没有产生结果（退出码 {proc.returncode}）：\n{tail}"
        return grade


def _died_midway(grade: Grade, planned: list[dict], running: dict | None, code: int, log: Path,
                 notify: Listener) -> None:
    """The check process exited with planned checks unreported (a segfault, a kernel writing past a buffer, an
    os._exit): the check it was running is an error, the ones after it did not run. Never a pass by omission."""
    seen = {r["nodeid"] for r in grade.results}
    missing = [c for c in planned if c["nodeid"] not in seen]
    if not missing:
        return
    text = log.read_text(encoding="utf-8", errors="replace")
    tail = "\n".join(text.strip().splitlines()[-8:])
    culprit = next((c for c in missing if running and c["nodeid"] == running["nodeid"]), missing[0])
    _report(grade, culprit, "error", f"检查进程在运行这个检查时退出了（退出码 {code}），没有给出结果：常见原因是段错误或 "
                                     f"kernel 写出了缓冲区的边界。进程最后的输出：\n{tail}", notify)
    _not_run(grade, planned, "未运行：检查进程在前面的检查里退出了", notify)


def _give_up(grade: Grade, planned: list[dict], running: dict, notify: Listener) -> None:
    """The running check ignored its interrupt: it is a timeout, the checks after it are not run."""
    _report(grade, running, "timeout", f"超时：这个检查超过 {running['limit']:.0f} 秒没有结束，也没有响应中断（卡在一个"
                                       f"很长的 torch 运算或在等子进程？），检查进程已被强制结束", notify)
    _not_run(grade, planned, "未运行：前面的检查超时，检查进程已被强制结束", notify)


def _not_run(grade: Grade, planned: list[dict], message: str, notify: Listener) -> None:
    """Every planned check without a result is reported as not run, with `message`."""
    seen = {r["nodeid"] for r in grade.results}
    for check in planned:
        if check["nodeid"] not in seen:
            _report(grade, check, "notrun", message, notify)


def _report(grade: Grade, check: dict, status: str, message: str, notify: Listener) -> None:
    """A result the grader writes itself for a planned (or started) check that the check process never reported."""
    r = dict(nodeid=check["nodeid"], name=check["nodeid"].split("::")[-1], point=check["point"], status=status,
             where="", message=message)
    grade.results.append(r)
    notify("result", r)
