"""State shared by the selftest's modules within one pytest run (not a test module).

REFERENCE: tests/test_contracts.py grades each exercise's reference on COURSE_SEED 1-4 and keeps seed 1's grading
here; tests/test_exercises.py then takes it as its reference grading instead of grading the reference once more
(one grading of 10-60 s per exercise on CI's two cores). Run on its own, tests/test_exercises.py grades the
reference itself, on a random seed.

fork_spawn(): one fork server (course/grader/forkserver.py) for every grading of the run, whatever the exercise:
its start imports what all the check files and reference solutions import (~10 s on CI's two cores), paid once
instead of once per exercise and per contract table. COURSE_SELFTEST_FORK=0 starts each grading as a fresh process.
"""

import atexit
import os
import threading

from course.grader.forkserver import ForkServer
from course.grader.select import ROOT

REFERENCE: dict = {}      # exercise id -> the reference's Grade on seed 1
_SERVER: list = []
_LOCK = threading.Lock()


def fork_spawn():
    """The shared server's spawn for run_checks, or None under COURSE_SELFTEST_FORK=0."""
    if os.environ.get("COURSE_SELFTEST_FORK", "1") == "0":
        return None
    with _LOCK:
        if not _SERVER:
            _SERVER.append(ForkServer(*sorted((ROOT / "checks").glob("test_*.py"))))
            atexit.register(_SERVER[0].close)
    return _SERVER[0].spawn
