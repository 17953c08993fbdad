"""pytest glue for the exercise checks: installs the `impl` selection and records one result per check.

The grader (course/grade.py) runs a check file in a subprocess with COURSE_REPORT pointing at a JSON
file; every check's outcome is written there, classified the way the learner reads it:
passed / todo (未实现: the stub raised NotImplementedError) / failed / error / timeout / skipped.
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

from course import select  # noqa: E402

select.install()


def _triton_interpreter_without_cuda() -> None:
    """Track K: without CUDA the Triton kernels run in the interpreter (read when triton is imported)."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_triton_interpreter_without_cuda()

_results: list[dict] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "point(title): the 验收要点 this check grades")


def _learner_location(excinfo) -> str:
    """file:line of the deepest frame inside an exercise file (mine/, solutions/ or a planted copy)."""
    exc = excinfo.value
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{_short(exc.filename)}:{exc.lineno}"
    where = ""
    for frame, lineno in traceback.walk_tb(excinfo.tb):
        name = frame.f_code.co_filename
        if frame.f_globals.get("__name__", "").startswith(select.PACKAGE + "."):
            where = f"{_short(name)}:{lineno}"
    return where


def _short(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def _classify(call) -> tuple[str, str]:
    excinfo = call.excinfo
    exc = excinfo.value
    if isinstance(exc, NotImplementedError):
        return "todo", str(exc)
    text = str(exc)
    if "Timeout" in text and type(exc).__name__ == "Failed":
        return "timeout", "超时：这个检查运行超过时限（死循环？或逐 token 的 Python 循环太慢）"
    if isinstance(exc, AssertionError):
        return "failed", text.split("\nassert ")[0].strip()
    return "error", f"{type(exc).__name__}: {text}".strip()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and not report.passed):
        marker = item.get_closest_marker("point")
        title = marker.args[0] if marker else (item.function.__doc__ or item.name).strip().splitlines()[0]
        if report.passed:
            status, message, where = "passed", "", ""
        elif report.skipped:
            status, message, where = "skipped", str(report.longrepr[-1]) if report.longrepr else "", ""
        else:
            status, message = _classify(call)
            where = _learner_location(call.excinfo)
        _results.append(dict(nodeid=item.nodeid, name=item.name, point=title, status=status,
                             message=message, where=where))


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("COURSE_REPORT")
    if path:
        Path(path).write_text(json.dumps(_results, ensure_ascii=False, indent=1), encoding="utf-8")
