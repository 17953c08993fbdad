"""`./check.sh bench --workload multiturn` (e07) on the CPU: the tiny hybrid, prefix caching off and on."""

import json
import os
import subprocess
import sys

from course.grader import select


def test_multiturn_bench_smoke(tmp_path):
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "course", "bench", "--workload", "multiturn", "--device", "cpu",
                          "--conversations", "3", "--turns", "2", "--system-len", "40", "--message-len", "8",
                          "--answer-len", "4"], cwd=select.ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("BENCH_JSON "))
    result = json.loads(line.split(" ", 1)[1])
    off, on = result["off"], result["on"]
    assert off["prompt_tokens"] == on["prompt_tokens"] and off["output_tokens"] == on["output_tokens"] == 6 * 4
    assert off["prefill_computed"] == off["prompt_tokens"] and off["snapshot_hits"] == 0
    assert on["snapshot_hits"] >= 3 and on["prefill_computed"] < off["prefill_computed"], result
    assert "prefill tokens computed" in out.stdout and "mean TTFT" in out.stdout
