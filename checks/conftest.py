"""pytest glue for the exercise checks: installs the `impl` selection, bounds each check in time and
streams one result per check to the grader.

The grader (course/grader/grade.py) runs a check file in a subprocess with COURSE_EVENTS pointing at a file;
one JSON line is appended per event, as it happens, so the grader can show progress:
  {"event": "plan", "checks": [{"nodeid", "point"}, ...], "limit": 30}     after collection
  {"event": "start", "nodeid", "point", "limit"}                              a check begins
  {"event": "result", "nodeid", "name", "point", "status", "message", "where"}
Statuses, the way the learner reads them: passed / todo (未实现: the stub raised NotImplementedError) /
failed / error / timeout / skipped / notrun (未运行: the time left after a timeout ran out).
COURSE_CHECK_TIMEOUT and COURSE_DEADLINE set the limits (checks/timeouts.py).
COURSE_CHECK_FIRST (a check's name) moves that check to the front of the run, the order otherwise kept
(the selftest runs first the check that caught a planted mistake last time: checks/plants/catchers.json).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from checks.kit import crash_text  # noqa: E402
from checks.timeouts import CheckTimeout, HungEarlier, Watchdog  # noqa: E402
from course.grader import select  # noqa: E402
from course.grader.grade import CHECK_TIMEOUT_S  # noqa: E402

select.install()


def _triton_interpreter_without_cuda() -> None:
    """Track K: without CUDA the Triton kernels run in the interpreter (read when triton is imported)."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_triton_interpreter_without_cuda()


def _ast_parse_one_thread_at_a_time() -> None:
    """CPython 3.11 keeps the AST constructor's recursion depth in state shared by all threads: two threads parsing
    at once can raise SystemError "AST constructor recursion depth mismatch" (python/cpython#106905). A check's live
    server logs a traceback on its own thread (3.11's traceback module parses each source line for its ^^^ carets)
    while pytest formats the check's failure (it parses the check file): CI saw the grading die with an INTERNALERROR
    in place of the check's message. One lock around ast.parse for every thread of the check process."""
    import ast
    import threading
    lock, parse = threading.RLock(), ast.parse

    def parse_locked(*args, **kwargs):
        with lock:
            return parse(*args, **kwargs)

    ast.parse = parse_locked


_ast_parse_one_thread_at_a_time()


NOT_RUN = "未运行：前面的检查超时，这次运行的时间已经用完；先修好超时的函数再运行"
_watchdog: Watchdog | None = None


def _emit(event: str, **data) -> None:
    path = os.environ.get("COURSE_EVENTS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": event, **data}, ensure_ascii=False) + "\n")


def _title(item) -> str:
    marker = item.get_closest_marker("point")
    return marker.args[0] if marker else (item.function.__doc__ or item.name).strip().splitlines()[0]


def pytest_configure(config):
    global _watchdog
    config.addinivalue_line("markers", "point(title): the 验收要点 this check grades")
    selection = select.current()
    graded = {f"{select.PACKAGE}.{m}" for m, choice in selection.items() if m != "default" and choice != "solutions"}
    deadline = os.environ.get("COURSE_DEADLINE")
    _watchdog = Watchdog(float(os.environ.get("COURSE_CHECK_TIMEOUT", CHECK_TIMEOUT_S)),
                         float(deadline) if deadline else None, graded)


def pytest_collection_modifyitems(session, config, items):
    first = os.environ.get("COURSE_CHECK_FIRST")
    if first:
        items.sort(key=lambda item: item.name != first)    # stable: the others keep the file's order


def pytest_collection_finish(session):
    _emit("plan", checks=[dict(nodeid=i.nodeid, point=_title(i)) for i in session.items], limit=_watchdog.limit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = _watchdog.arm(_title(item))
    _emit("start", nodeid=item.nodeid, point=_title(item), limit=limit)
    try:
        yield
    finally:
        _watchdog.disarm()


def _phase():
    """The timer interrupts only inside a phase (setup / call / teardown), never pytest's own bookkeeping."""
    _watchdog.running(True)
    try:
        yield
    finally:
        _watchdog.running(False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    if _watchdog.out_of_time():
        item.course_notrun = True
        pytest.skip(NOT_RUN)
    yield from _phase()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _phase()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield from _phase()


def _learner_location(excinfo) -> str:
    """file:line of the deepest frame inside an exercise file (mine/, solutions/ or a planted copy), taken from the
    innermost exception of the chain that has one. The Triton interpreter (TRITON_INTERPRET=1) raises an
    InterpreterError at the kernel launch whose __cause__ holds the failing line inside the @triton.jit function;
    a check's explain_crash re-raises `from` the learner's exception the same way."""
    exc = excinfo.value
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{_short(exc.filename)}:{exc.lineno}"
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for i, exc in enumerate(reversed(chain)):                  # the original exception first
        tb = excinfo.tb if i == len(chain) - 1 else exc.__traceback__
        where = ""
        for frame, lineno in traceback.walk_tb(tb):
            if frame.f_globals.get("__name__", "").startswith(select.PACKAGE + "."):
                where = f"{_short(frame.f_code.co_filename)}:{lineno}"
        if where:
            return where
    return ""


def _short(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def _classify(call) -> tuple[str, str]:
    excinfo = call.excinfo
    exc = excinfo.value
    if isinstance(exc, (CheckTimeout, HungEarlier)):
        return "timeout", exc.message
    if isinstance(exc, NotImplementedError):
        return "todo", str(exc)
    text = str(exc)
    if "Timeout" in text and type(exc).__name__ == "Failed":            # pytest-timeout, when run by hand
        return "timeout", "超时：这个检查运行超过时限（死循环？或逐 token 的 Python 循环太慢）"
    if isinstance(exc, AssertionError):
        return "failed", text.split("\nassert ")[0].strip()
    return "error", crash_text(exc).strip()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.passed:
            status, message, where = "passed", "", ""
        elif report.skipped:
            notrun = getattr(item, "course_notrun", False)
            status = "notrun" if notrun else "skipped"
            message = NOT_RUN if notrun else (str(report.longrepr[-1]) if report.longrepr else "")
            where = ""
        else:
            status, message = _classify(call)
            exc = call.excinfo.value
            timed_out = isinstance(exc, (CheckTimeout, HungEarlier)) and exc.where
            where = exc.where if timed_out else _learner_location(call.excinfo)
        result = dict(nodeid=item.nodeid, name=item.name, point=_title(item), status=status,
                      message=message, where=where)
        _emit("result", **result)
