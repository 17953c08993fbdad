"""`./check.sh serve` and `./check.sh bench --serve` (e06) on the CPU with the offline dummy model."""

import os
import subprocess
import sys

import pytest

from course.grader import registry, select

MISSING = registry.get("e06").missing_packages
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"e06 needs {', '.join(MISSING)}")


def test_bench_serve_smoke(tmp_path):
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "course", "bench", "--serve", "--requests", "8", "--clients", "4",
                          "--min-out", "4", "--max-out", "8", "--max-pending", "2"],
                         cwd=select.ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for fragment in ("离线 LLM.generate", "HTTP（4 个流式客户端）", "TTFT p50", "错误 0 个"):
        assert fragment in out.stdout, (fragment, out.stdout)
