"""The per-check time limit of a grading run, and what one hang costs the checks after it.

- Every check (setup, call and teardown together) gets `limit` seconds of wall time; the grader prints
  the limit. The check is interrupted with `CheckTimeout` (SIGALRM; a BaseException, so a learner's
  `except Exception:` inside the loop cannot swallow it).
- A few seconds before the limit the stack is sampled, and again at the limit. The innermost call in the
  graded file that is in both samples (the same activation, not just the same function) has not
  returned for those seconds: that function is the hang. Its code is replaced by one that raises
  `HungEarlier` at once, so every later check that calls it is reported as 超时 immediately instead of
  waiting out the limit again. Checks that never call it run normally.
- Once a check has timed out, the run ends at the grader's deadline: a check still running then is
  interrupted, a check not started yet is not run (未运行). Without a timeout there is no deadline.
"""

from __future__ import annotations

import gc
import signal
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW = "\n  只是慢、不是死循环？用 COURSE_CHECK_TIMEOUT=60 ./check.sh {id} 放宽每个检查的时限"
PROBE_S = 3.0          # the first stack sample is taken this long before the limit (at most 20 % of it)


class CheckTimeout(BaseException):
    """The check ran past its limit."""

    def __init__(self, message: str, where: str = ""):
        super().__init__(message)
        self.message, self.where = message, where


class HungEarlier(BaseException):
    """The check called a function that already hung in an earlier check."""

    def __init__(self, message: str, where: str = ""):
        super().__init__(message)
        self.message, self.where = message, where


def _short(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def _describe(frame: types.FrameType) -> tuple[str, str]:
    """('route()', 'mine/m03_sparse_moe.py:57') for a frame; a module's top level has no function name."""
    code = frame.f_code
    name = "模块顶层代码" if code.co_name == "<module>" else f"{getattr(code, 'co_qualname', code.co_name)}()"
    return name, f"{_short(code.co_filename)}:{frame.f_lineno}"


class Watchdog:
    """One per grading process: arms the timer around each check and disables the functions that hung."""

    def __init__(self, limit: float, deadline: float | None, graded_modules: set[str]):
        self.limit = limit
        self.deadline = deadline               # time.time() after which nothing runs, once a check timed out
        self.graded = graded_modules           # "impl.m03_sparse_moe", ...: the learner's files
        ids = sorted(m.split(".", 1)[1].split("_", 1)[0] for m in graded_modules)
        self.slow = SLOW.format(id=ids[0] if ids else "<练习编号>")
        self.timed_out = False
        self._point = ""
        self._running = False                  # inside a check's setup / call / teardown
        self._check_limit = limit
        self._started = 0.0
        self._sample: list[types.FrameType] = []
        self._probing = False

    # ------------------------------------------------------------------ around each check
    def out_of_time(self) -> bool:
        return self.timed_out and self.deadline is not None and time.time() >= self.deadline - 1.0

    def check_limit(self) -> float:
        """This check's limit: the full limit, or what is left until the deadline after a timeout."""
        if self.timed_out and self.deadline is not None:
            return max(1.0, min(self.limit, self.deadline - time.time()))
        return self.limit

    def arm(self, point: str) -> float:
        self._point, self._check_limit, self._started = point, self.check_limit(), time.monotonic()
        self._sample = []
        probe = min(PROBE_S, 0.2 * self._check_limit)
        self._probing = True
        signal.signal(signal.SIGALRM, self._on_alarm)
        signal.setitimer(signal.ITIMER_REAL, self._check_limit - probe)
        return self._check_limit

    def disarm(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self._sample = []

    def running(self, flag: bool) -> None:
        self._running = flag

    # ------------------------------------------------------------------ the alarm
    def _learner_frames(self, frame: types.FrameType | None) -> list[types.FrameType]:
        """Frames of the graded files, innermost first."""
        out = []
        while frame is not None:
            if frame.f_globals.get("__name__", "") in self.graded:
                out.append(frame)
            frame = frame.f_back
        return out

    def _on_alarm(self, signum, frame) -> None:
        if self._probing:
            self._probing = False
            self._sample = self._learner_frames(frame)
            remaining = self._check_limit - (time.monotonic() - self._started)
            signal.setitimer(signal.ITIMER_REAL, max(0.05, remaining))
            return
        if not self._running:                  # between pytest's phases: interrupt inside the check instead
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            return
        self.timed_out = True
        now = self._learner_frames(frame)
        earlier = {id(f) for f in self._sample}
        stuck = next((f for f in now if id(f) in earlier), None)     # innermost call that never returned
        self._sample = []
        seconds = f"{self._check_limit:.0f}"
        if stuck is not None:
            name, where = _describe(stuck)
            self._disable(stuck.f_code, name, where)
            raise CheckTimeout(f"超时：这个检查超过 {seconds} 秒没有结束，{name} 一直没有返回（死循环？"
                               f"或逐 token 的 Python 循环太慢）{self.slow}", where)
        inner = now[0] if now else None
        where = _describe(inner)[1] if inner is not None else ""
        raise CheckTimeout(f"超时：这个检查超过 {seconds} 秒没有结束（死循环？或逐 token 的 Python 循环太慢）{self.slow}",
                           where)

    def _disable(self, code: types.CodeType, name: str, where: str) -> None:
        """Make every later call of the hung function raise HungEarlier at once."""
        message = (f"超时：这个检查调用了 {name}（{where}），它在前面的检查「{self._point}」里超过 "
                   f"{self._check_limit:.0f} 秒没有返回；这里不再等它。先修好那个死循环")
        replacement = _raiser(code.co_freevars, message, where)
        for obj in gc.get_referrers(code):
            if isinstance(obj, types.FunctionType) and obj.__code__ is code:
                try:
                    obj.__code__ = replacement
                except ValueError:             # unexpected closure layout: the deadline still bounds the run
                    continue


def _raiser(freevars: tuple[str, ...], message: str, where: str) -> types.CodeType:
    """Code that raises HungEarlier(message), with as many free variables as the code it replaces."""
    lines = ["def _outer():"]
    lines += [f"    {v} = None" for v in freevars]
    lines += ["    def _hung(*args, **kwargs):",
              f"        raise __import__('checks.timeouts', fromlist=['_']).HungEarlier({message!r}, {where!r})"]
    if freevars:
        lines.append("        " + ", ".join(freevars) + ",")      # referenced, so they stay free variables
    lines.append("    return _hung")
    namespace: dict = {}
    exec("\n".join(lines), namespace)  # noqa: S102 - generated from names of the learner's code object
    return namespace["_outer"]().__code__
