"""The kernel benches (k01-k05) end to end on the CPU: a dry run of their plumbing, not a measurement.

Each bench runs in a subprocess of this file (`python tests/test_bench_kernels_cpu.py k01 ...`) with tiny shapes,
every tensor the bench puts on "cuda" put on the CPU, a stand-in for the CUDA timing calls (events read the host
clock; a "graph" replays its calls eagerly, and a call that reads a value back to the host while it is captured fails,
as it does on a GPU) and cheap stand-ins for the exercise's kernels (Triton's interpreter would take minutes a row)
that check every call against the real function's signature. What is checked: every row prints its median,
min–max and spread, the verdicts and the no-verdict marker follow the rule, --json saves what repeat_check compares,
and repeat_check agrees with itself.
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE_L2 = 256 * 1024


def _fake_cuda(torch) -> None:
    """torch.cuda's timing, stream and graph calls on the host; "cuda" tensors on the CPU."""
    from torch.overrides import TorchFunctionMode

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    class Stream:
        def wait_stream(self, other):
            pass

    class Props:
        name, L2_cache_size, total_memory, major = "CPU stand-in", FAKE_L2, 24 * 2**30, 9

    class ToCPU(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    class Generator(torch.Generator):
        def __new__(cls, device=None):
            return super().__new__(cls)

        def __init__(self, device=None):
            super().__init__()

    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.get_device_name = lambda *a: "CPU stand-in"
    cuda.get_device_properties = lambda *a: Props()
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.synchronize = lambda *a: None
    cuda.empty_cache = lambda: None
    cuda.Event, cuda.Stream = Event, Stream
    cuda.current_stream = lambda *a: Stream()
    cuda.set_stream = lambda s: None
    cuda.stream = lambda s: contextlib.nullcontext()
    torch.Generator = Generator
    ToCPU().__enter__()


def _fake_capture(torch):
    """common.capture_cycled's stand-in: the calls run once "under capture" (a host sync there raises, as on a GPU),
    and replay() runs them again eagerly."""
    capturing = [False]
    for name in ("item", "tolist"):
        real = getattr(torch.Tensor, name)

        def guarded(self, *a, _real=real, **kw):
            if capturing[0]:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            return _real(self, *a, **kw)
        setattr(torch.Tensor, name, guarded)

    def capture_cycled(fns, calls):
        for fn in fns:
            fn()
        capturing[0] = True
        try:
            for i in range(calls):
                fns[i % len(fns)]()
        finally:
            capturing[0] = False

        class Graph:
            def replay(self):
                for i in range(calls):
                    fns[i % len(fns)]()
        return Graph()
    return capture_cycled


def _shrink() -> None:
    from course.bench import common, k03, k04, k05, kernels
    common.ANCHOR_BYTES = 2**20
    kernels.K01 = dict(tokens=16, hidden=(32, 64), heads=2)
    kernels.K02 = dict(batch=2, context=(5, 40), prefill_tokens=32, prefill_seqs=(2, 4))
    k03.SHAPES = [dict(name="Qwen3-30B-A3B", experts=4, top_k=2, hidden=16, inter=24, shared=0),
                  dict(name="Qwen3.5-35B-A3B", experts=4, top_k=2, hidden=16, inter=24, shared=16)]
    k03.DECODE, k03.PREFILL, k03.HBM_BATCH = (1, 4), 8, 4
    k04.PREFILL_SHAPES = [(1, 32, 1, 16), (2, 16, 1, 16)]
    k04.DECODE_BATCHES, k04.VERDICT_BATCH = [1, 3], 3
    k04.DECODE_LAYER = dict(nk=2, nv=4, dk=16, dv=16, K=4)
    k05.LINEARS = [("tiny qkv", 160, 256), ("tiny o_proj", 64, 200)]
    k05.TOKENS, k05.DECODE_MAX = (1, 4, 40), 4
    k05.MOE, k05.MOE_BATCH = dict(name="Qwen3-30B-A3B", experts=4, top_k=2, hidden=64, inter=128), 8


def _stand_ins(torch) -> None:
    """select.load of k01-k05 returns the real module with its kernels replaced by cheap functions that first bind
    their arguments to the real kernel's signature (a call the real kernel would refuse fails here too)."""
    import inspect
    import types
    from course.bench import k03 as bench_k03
    from course.grader import select
    real_load = select.load

    def stub(fn, cheap):
        sig = inspect.signature(fn)

        def call(*args, **kwargs):
            sig.bind(*args, **kwargs)
            return cheap(*args, **kwargs)
        return call

    def chunk(q, k, v, g, beta, *a, **kw):
        B, T, H, D = v.shape
        return torch.empty_like(v), torch.zeros(B, H, q.shape[-1], D)

    def fp8_linear(x, w_fp8, scale_inv):
        n, k = w_fp8.shape
        scale = scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return (x.float() @ (w_fp8.float() * scale).T).to(x.dtype)

    def quantize_act_fp8(x, group=128):        # k05's own torch quantizer: a 1 x group block is a token's group
        q, s = real_load("k05_fp8").quantize_block_fp8(x, (1, group))
        return q, s.t().contiguous().t()         # column-major scales, as the kernel writes them

    def load(module):
        mod = real_load(module)
        cheap = {
            "k01_triton_basics": dict(store_kvcache=lambda *a, **kw: None, add_rms_norm=lambda x, *a, **kw: x + 0),
            "k02_paged_attention": {name: (lambda q, *a, **kw: torch.empty_like(q)) for name in
                                    ("decode_attention", "flash_attention_varlen", "prefill_attention")},
            "k03_fused_moe": dict(fused_moe_forward=lambda x, w: bench_k03.grouped_torch_forward(
                x, w, real_load("m03_sparse_moe"), bench_k03._grouped_mm()),
                                  fused_experts=lambda x, *a, **kw: torch.zeros_like(x)),
            "k05_fp8": dict(fp8_linear=fp8_linear, w8a8_linear=fp8_linear, quantize_act_fp8=quantize_act_fp8,
                            fused_experts_fp8=lambda x, *a, **kw: torch.zeros_like(x)),
            "k04_gdn_kernels": dict(chunk_gated_delta_rule=chunk, gdn_decode=lambda *a, **kw: None),
        }.get(module)
        if not cheap:
            return mod
        return types.SimpleNamespace(**{**vars(mod), **{n: stub(getattr(mod, n), f) for n, f in cheap.items()}})
    select.load = load


def _dry_run(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    import torch
    _fake_cuda(torch)
    from course.bench import cli, common
    common.capture_cycled = _fake_capture(torch)
    _shrink()
    _stand_ins(torch)
    return cli.main(argv, lambda *a, **kw: print(*a, flush=True))


def _run(tmp_path, *argv) -> subprocess.CompletedProcess:
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, __file__, *argv], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Each bench once, three replays a row."""
    tmp = tmp_path_factory.mktemp("kernels")
    found = {}
    for bench, runs in (("k01", 1), ("k02", 1), ("k03", 1), ("k04", 1), ("k05", 1)):
        for i in range(runs):
            path = tmp / f"{bench}-{i + 1}.json"
            out = _run(tmp, bench, "--solutions", "--replays", "3", "--json", str(path))
            found.setdefault(bench, []).append((out, path))
    return found


@pytest.mark.parametrize("bench", ["k01", "k02", "k03", "k04", "k05"])
def test_every_row_has_its_median_and_spread(dry_runs, bench):
    from course.bench.common import VERDICTS
    for out, path in dry_runs[bench]:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        assert "Traceback" not in out.stdout + out.stderr, out.stdout[-3000:] + out.stderr[-5000:]
        data = json.loads(path.read_text(encoding="utf-8"))
        assert data["bench"] == bench and data["command"].startswith(f"./check.sh bench {bench} --solutions")
        assert data["replays"] == 3 and data["spread_limit"] == 0.10 and data["machine"]["cpu_count"]
        timed = [r for r in data["rows"] if "median_ms" in r]
        assert len(timed) >= 4, data["rows"]
        # a row's name is its key across runs: no two rows of a bench share one (Report would number the second)
        assert not [r["name"] for r in data["rows"] if re.search(r" \(\d+\)$", r["name"])], data["rows"]
        for row in timed:
            assert row["min_ms"] <= row["median_ms"] <= row["max_ms"] and row["replays"] == 3, row
            assert row["spread"] == pytest.approx((row["max_ms"] - row["min_ms"]) / row["median_ms"])
            for key in row["verdicts"].values():
                assert key in VERDICTS, row
                if row["noisy"]:
                    assert key == "noisy", row         # a row over the spread bound never gets a verdict
            if row["method"] == "graph":
                assert row["sets"] * row["touched_bytes"] > FAKE_L2 or row["sets"] == 64, row   # cold: > L2
        assert "不下结论" in out.stdout and "中位数" in out.stdout, out.stdout[-3000:]
        assert any(r["verdicts"] for r in timed), "no row of the bench has a verdict"


def test_k03_decides_fused_fastest_everywhere_in_one_closing_line(dry_runs):
    for out, path in dry_runs["k03"]:
        data = json.loads(path.read_text(encoding="utf-8"))
        closing = [r for r in data["rows"] if r["name"] == "fused fastest everywhere"]
        assert len(closing) == 1 and closing[0]["verdicts"]["fused 处处最快"] in ("fastest", "slower", "undecided")
        assert "fused 处处最快？" in out.stdout
        rows = [r for r in data["rows"] if r.get("n") is not None]
        assert {r["n"] for r in rows} == {1, 4, 8}
        loop = [r["others"]["loop"] for r in rows if "loop" in r.get("others", {})]
        assert loop and all(o["method"] == "events" for o in loop)      # .tolist(): timed eagerly, said so
        assert all(r["method"] == "graph" for r in rows)
        assert any("HBM ≥ 70 %" in r["verdicts"] for r in rows)


def test_k04_skips_a_missing_fla_peer_cleanly(dry_runs):
    out, path = dry_runs["k04"][0]
    data = json.loads(path.read_text(encoding="utf-8"))
    try:
        import fla  # noqa: F401
        pytest.skip("fla is installed here")
    except ImportError:
        pass
    assert "fla 不可用，跳过 FLA 对照" in out.stdout
    assert "fla: absent (peer skipped)" in data["notes"]
    decode = [r for r in data["rows"] if r["name"].startswith("gdn_decode")]
    assert [bool(r["verdicts"]) for r in decode] == [False, True]       # the target is at the verdict batch only
    assert all(r["eager"]["method"] == "events" for r in decode)


def test_repeat_check_compares_the_runs_side_by_side(dry_runs, tmp_path):
    from course.bench import repeat_check
    paths = [str(p) for _, p in dry_runs["k03"]]
    same = subprocess.run([sys.executable, "-m", "course.bench.repeat_check", paths[0], paths[0], paths[0]], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert same.returncode == 0 and "✓ 每个结论都一致" in same.stdout and "全部一致" in same.stdout, same.stdout
    assert same.stdout.count("./check.sh bench k03 --solutions") >= 3
    # a verdict flipped in one run is a disagreement, and so is a missing run with --expect
    data = json.loads(Path(paths[0]).read_text(encoding="utf-8"))
    row = next(r for r in data["rows"] if r["verdicts"])
    name, (verdict, key) = row["name"], next(iter(row["verdicts"].items()))
    row["verdicts"][verdict] = "fail" if key != "fail" else "pass"
    flipped = tmp_path / "flipped.json"
    flipped.write_text(json.dumps(data), encoding="utf-8")
    lines, disagree = repeat_check.compare([json.loads(Path(paths[0]).read_text(encoding="utf-8")), data])
    assert any(d.startswith(f"{name} [{verdict}]") for d in disagree), disagree
    assert repeat_check.main([paths[0], str(flipped)]) == 1
    assert repeat_check.main([paths[0], paths[0], "--expect", "3"]) == 1


def test_a_capture_that_syncs_with_the_host_falls_back_to_events(tmp_path):
    """time_cycled on a call that reads a value back while captured: the same calls timed between events, said so;
    the number of buffer sets follows from the L2 the device reports."""
    script = (
        "import sys, torch\n"
        f"sys.argv = [{str(__file__)!r}]\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('harness', {str(__file__)!r})\n"
        "h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h)\n"
        "h._fake_cuda(torch)\n"
        "from course.bench import common\n"
        "common.capture_cycled = h._fake_capture(torch)\n"
        "x = torch.ones(10000)\n"
        "t = common.time_cycled(lambda i: (lambda: x.sum().item()), 40000, replays=4)\n"
        "print(t.method, t.sets, t.calls, len(t.ms), t.note)\n"
        "g = common.time_cycled(lambda i: (lambda: x.sum()), 40000, replays=4)\n"
        "print(g.method, g.sets, g.calls, len(g.ms))\n"
        "r = common.time_cycled(lambda i: (lambda: x.sum()), 40000, graph='why not', replays=5)\n"
        "print(r.method, r.note, len(r.ms))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    first, second, third = out.stdout.splitlines()[-3:]
    sets = -(-2 * FAKE_L2 // 40000)                         # 14 sets of 40 kB: together 2x the (fake) L2
    assert first.startswith(f"events {sets} ") and "CUDA graph 捕获失败（RuntimeError" in first and " 4 " in first, first
    assert second.startswith(f"graph {sets} ") and second.endswith(" 4"), second
    assert third == "events why not 5", third


if __name__ == "__main__":
    sys.exit(_dry_run(sys.argv[1:]))


def test_k05_prints_every_linear_and_the_moe_row(dry_runs):
    out, path = dry_runs["k05"][0]
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = [r for r in data["rows"] if r.get("tokens") is not None]
    assert {(r["shape"], r["tokens"]) for r in rows} == {(s, t) for s in ("tiny qkv", "tiny o_proj") for t in (1, 4, 40)}
    assert all(("fp8 比 bf16 快" in r["verdicts"]) == (r["tokens"] <= 4) for r in rows), rows
    assert all({"bf16", "w8a8"} <= set(r["others"]) for r in rows), rows
    moe = [r for r in data["rows"] if r.get("experts_hit") is not None]
    assert len(moe) == 1 and set(moe[0]["others"]) == {"k03 bf16", "fp8 act_fp8"}, moe
    assert "FP8 MoE（weight-only）比 k03 的 bf16 快？" in out.stdout
