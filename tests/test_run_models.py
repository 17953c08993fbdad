"""`./check.sh run` on both offline dummy models: it says which exercises the model ran, and the truth of it."""

import os
import re
import subprocess
import sys

import pytest

from course.grader import select
from course.runtime import run

ROOT = select.ROOT


def _run(tmp_path, *args):
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "course", "run", "--max-tokens", "20", *args], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _used(stdout: str) -> list[str]:
    line = next(l for l in stdout.splitlines() if l.startswith("这个模型用到了引擎"))
    return line.split("：", 1)[1].split()


def test_the_dense_default_says_what_it_does_not_exercise(tmp_path):
    out = _run(tmp_path)
    assert "迷你 Qwen3（稠密" in out, out
    assert _used(out) == ["m01", "m02", "m04", "m06", "e01", "e02", "e03", "e04", "e05"], out
    assert "这个模型用到了引擎 12 个练习中的 9 个" in out, out
    unused = re.findall(r"^  (m03|m05|e07)  solutions/\S+\.py +(\S.*)$", out, re.M)
    assert [ex for ex, _ in unused] == ["m03", "m05", "e07"], out
    assert "MoE" in unused[0][1] and "Gated DeltaNet" in unused[1][1] and "Gated DeltaNet" in unused[2][1]
    assert "运行它们：./check.sh run --model tiny-hybrid" in out, out
    assert "第二轮" not in out                                    # no snapshot cache: one turn only
    assert "e06 → ./check.sh serve" in out and "k01–k05、g01 → ./check.sh gpu" in out


def test_tiny_hybrid_runs_every_engine_exercise_and_resumes_from_a_snapshot(tmp_path):
    out = _run(tmp_path, "--model", "tiny-hybrid")
    assert "迷你 Qwen3.5-MoE（混合" in out, out
    assert _used(out) == run.ENGINE_MODULES, out                 # the command the dense run suggests runs them all
    assert f"引擎的全部 {len(run.ENGINE_MODULES)} 个练习" in out and "没有用到" not in out, out
    # the second turn starts with the first one's prompt and answer: 61 + 20 tokens, of which the first 80 (the last
    # block boundary the first turn computed) come back from the KV blocks and the GDN state snapshot
    m = re.search(r"第二轮（.*，(\d+) tokens）：前 (\d+) 个 token 从 prefix cache 接着算.*只算了 (\d+) 个", out)
    assert m, out
    total, saved, computed = map(int, m.groups())
    assert saved == 80 and computed == total - saved, out
    stats = re.search(r"统计：(\{.*\})", out).group(1)
    assert "'snapshot_hits': 1" in stats and "'prefill_tokens_saved': 80" in stats, stats


def test_an_unknown_model_is_neither_a_dummy_nor_a_folder(tmp_path):
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp_path / "state"))
    out = subprocess.run([sys.executable, "-m", "course", "run", "--model", str(tmp_path / "nope")], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "没有这个模型目录" in out.stdout and "tiny-hybrid" in out.stdout, out.stdout


@pytest.mark.parametrize("names, expected", [
    (set(), []),
    ({"m01", "m03"}, ["m01", "m03"]),
])
def test_exercise_trace_sees_only_functions_called_inside(tmp_path, names, expected):
    """A file counts once one of its functions is called inside the block; importing it or calling it after does not."""
    files = {}
    for ex_id in ("m01", "m03"):
        path = tmp_path / f"{ex_id}.py"
        path.write_text("def f():\n    return 1\n")
        files[ex_id] = path
    ns = {ex_id: {} for ex_id in files}
    for ex_id, path in files.items():
        exec(compile(path.read_text(), str(path), "exec"), ns[ex_id])
    before = sys.gettrace()
    with run.ExerciseTrace(files) as ran:
        for ex_id in sorted(names):
            ns[ex_id]["f"]()
    assert sys.gettrace() is before
    ns["m01"]["f"]()
    assert sorted(ran) == expected


def test_the_report_names_what_each_unused_exercise_needs():
    report = [(ex_id, f"solutions/{ex_id}.py") for ex_id in run.ENGINE_MODULES]
    lines = run.usage_report(report, set(run.ENGINE_MODULES) - {"m03", "m05", "e07"}, "tiny")
    text = "\n".join(lines)
    assert all(f"  {ex_id}  solutions/{ex_id}.py" in text for ex_id in ("m03", "m05", "e07"))
    assert "--model tiny-hybrid" in text
    lines = run.usage_report(report, set(run.ENGINE_MODULES), "tiny-hybrid")
    assert "全部 12 个" in lines[0] and not any("没有用到" in line for line in lines)
