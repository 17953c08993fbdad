"""`./check.sh bench` (the engine's throughput) on the CPU: --device cpu runs the tiny dummy Qwen3 through the same
timed loop, --repeats, --json and --plot as the GPU run; and the plot's smoothing and roofline on made-up timelines."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from course.grader import select

ARGS = ["--device", "cpu", "--num-seqs", "2", "--max-input-len", "100", "--max-output-len", "100", "--repeats", "2"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    png, path = tmp / "plot.png", tmp / "result.json"
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp / "state"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "course", "bench", *ARGS, "--plot", str(png), "--json", str(path)],
                         cwd=select.ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out, json.loads(path.read_text(encoding="utf-8")), png


def test_repeats_give_every_run_the_median_and_the_spread(smoke):
    out, data, _ = smoke
    assert data["command"] == "./check.sh bench " + " ".join(ARGS) + f" --plot {smoke[2]} --json {smoke[2].parent / 'result.json'}"
    machine = data["machine"]
    for key in ("date", "python", "torch", "transformers", "cpu_count", "platform"):
        assert machine.get(key), (key, machine)
    eng = data["results"][0]
    runs = eng["runs"]
    assert [r["run"] for r in runs] == [1, 2] and eng["repeats"] == 2
    rates = sorted(r["tok_per_s"] for r in runs)
    assert eng["tok_per_s"] == rates[0] and (eng["tok_per_s_min"], eng["tok_per_s_max"]) == (rates[0], rates[1])
    assert eng["tok_per_s_spread"] == pytest.approx((rates[1] - rates[0]) / rates[0])
    assert all(r["triton_compiles_in_timed_run"] == [] for r in runs)
    assert len(data["timelines"]) == 2 and all(len(tl) == r["steps"] for tl, r in zip(data["timelines"], runs))
    assert "2 timed runs, output tok/s:" in out.stdout and "spread" in out.stdout
    assert data["workload"]["repeats"] == 2 and data["workload"]["device"] == "cpu"
    bench_json = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("BENCH_JSON ")).split(" ", 1)[1])
    assert bench_json[0]["runs"] == runs and "timeline" not in bench_json[0]


def test_no_plotted_point_exceeds_the_roofline(smoke):
    _, data, _ = smoke
    plot, eng = data["plot"], data["results"][0]
    assert eng["decode_bound"]["gb_per_s"] > 0 and plot["bound"], "the CPU run draws the roofline too"
    measured, bound = np.array(plot["measured"]), np.array([np.nan if b is None else b for b in plot["bound"]])
    assert len(measured) == len(plot["t"]) == 400 and plot["window_s"] > 0
    assert np.isfinite(bound).sum() > 300
    assert np.all(measured[np.isfinite(bound)] <= bound[np.isfinite(bound)] * (1 + 1e-9))
    # smoothed, not lost: the curve's area is the run's output tokens (the edges' shorter windows aside)
    area = float(np.sum((measured[1:] + measured[:-1]) / 2 * np.diff(plot["t"])))
    assert area == pytest.approx(eng["output_tokens"], rel=0.15)
    assert max(plot["batch"]) == 2 and plot["prefill_spans"]


def test_the_plot_is_rendered(smoke):
    pytest.importorskip("matplotlib")
    _, _, png = smoke
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_smoothing_over_wall_time_absorbs_overlapped_steps():
    """Under async scheduling every other call returns the previous step's tokens after microseconds: per step that
    reads as millions of tok/s. Over a window of wall time the rate is what the GPU did."""
    from course.bench import engine
    tl, t = [(0.05, 8, False, 0.05)], 0.05                  # a prefill step, then pairs of overlapped decode calls
    for _ in range(200):
        for seconds in (1e-5, 0.01):
            t += seconds
            tl.append((seconds, 64, True, t))
    per_step = max(n / s for s, n, _, _ in tl)
    assert per_step > 5e6
    floors = [s if not d else 0.004 for s, _, d, _ in tl]    # the roofline: 4 ms per decode step
    series = engine.smoothed(tl, floors, engine.plot_window(tl))
    steady = [m for x, m in zip(series["t"], series["measured"]) if 0.3 < x < t - 0.3]
    true_rate = 2 * 64 / 0.01001
    assert max(series["measured"]) < 1.1 * true_rate and min(steady) > 0.9 * true_rate
    assert all(m <= b * (1 + 1e-9) for m, b in zip(series["measured"], series["bound"]) if b is not None)
    assert max(b for b in series["bound"] if b is not None) == pytest.approx(2 * 64 / 0.008)
    assert series["prefill_spans"] == [(0.0, 0.05)] and len(series["batch"]) == 400


def test_step_floors_take_the_cheapest_schedule_step_of_each_batch():
    from course.bench import engine
    sizes = dict(kv_per_token=10, gdn_per_seq=0, dense_weights=1000, expert_weights=0, num_experts=0, top_k=0,
                 logits_per_seq=7)
    # schedule (prompts 2 and 3, outputs 2 and 4): t = 1 batch 2 (contexts 3 + 4), t = 2, 3 batch 1 (5, then 6)
    tl = [(9.0, 2, False, 9.0), (8.0, 2, True, 17.0), (7.0, 1, True, 24.0), (6.0, 1, True, 30.0), (5.0, 3, True, 35.0),
          (0.5, 0, True, 35.5)]
    floors = engine.step_floors(tl, sizes, [2, 3], [2, 4], gb_per_s=1e-9)       # 1 byte a second
    assert floors == [9.0, 1000 + 70 + 14, 1000 + 50 + 7, 1000 + 50 + 7, 1000 + 3 * 3 * 10 + 21, 0.0]


def test_device_cpu_is_the_throughput_smoke_run_only(tmp_path):
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp_path / "state"))
    out = subprocess.run([sys.executable, "-m", "course", "bench", "--device", "cpu", "--peer", "hf"], cwd=select.ROOT,
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "--device cpu 只跑引擎吞吐的冒烟测试" in out.stderr, out.stdout + out.stderr
