"""lm-evaluation-harness against `./check.sh serve --model DIR` (issue 46), compared with transformers.

course/bench/lmeval.py builds a tiny random fp32 Qwen3 folder with a tokenizer trained on the spot, serves it on
127.0.0.1 and runs lm-eval's local-completions (batch sizes 1 and 80: loglikelihood through a multiple-choice task,
generate_until with five `until` strings) and local-chat-completions on the tasks committed in
course/bench/lmeval_tasks/; every sample is recomputed with transformers on the same folder.

lm-eval is a test-only dependency (pyproject.toml's `test` dependency group, requirements/group-test.txt):
`./check.sh selftest` installs it into .venv on first use. Without it the test skips, except under CI=true.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from course.grader import registry, select

MISSING = registry.get("e06").missing_packages
HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
CI = os.environ.get("CI") == "true"

pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"e06 needs {', '.join(MISSING)}"),
    pytest.mark.skipif(not HAVE_LM_EVAL and not CI,
                       reason="lm-eval is not installed: ./check.sh selftest installs requirements/group-test.txt "
                              "into .venv (or: pip install -r requirements/group-test.txt)"),
]


@pytest.mark.timeout(600)
def test_lm_eval_matches_transformers(tmp_path):
    assert HAVE_LM_EVAL, "CI=true: lm-eval must be installed (requirements/group-test.txt, ./check.sh selftest)"
    out = tmp_path / "lm-eval.json"
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "course.bench.lmeval", "--json", str(out), "--keep",
                           str(tmp_path / "work")], cwd=select.ROOT, env=env, capture_output=True, text=True,
                          timeout=580)
    report = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert out.exists(), report
    doc = json.loads(out.read_text(encoding="utf-8"))
    rows = {(r["model"], r["batch_size"]): r for r in doc["rows"]}
    assert set(rows) == {("local-completions", 1), ("local-completions", 80), ("local-chat-completions", 1)}
    # lm-eval found the server's tokenizer routes (/tokenizer_info, /tokenize) on its own
    assert doc["tokenizer_backend"].startswith("remote"), doc["tokenizer_backend"]
    assert len(doc["until"]) == 5, doc["until"]
    for key, row in rows.items():
        ll, gen = row["loglikelihood"], row["generate_until"]
        if key[0] == "local-completions":
            assert ll["pairs"] == 288 and ll["max_abs_diff"] <= 1e-4, (key, ll["max_abs_diff"], ll["mismatches"][:3])
            assert ll["greedy_agree"] == ll["pairs"], (key, ll["mismatches"][:3])
            assert 0 < ll["greedy_true"] < ll["pairs"], (key, ll["greedy_true"])   # both outcomes are exercised
            assert gen["texts"] == 96, (key, gen["texts"])
        assert gen["equal"] == gen["texts"], (key, gen["mismatches"][:3])
        assert gen["stop"] > 0, (key, "no greedy text ended at a stop string")
    assert proc.returncode == 0, report
