"""What several benchmarks share: the bench models, nano-vllm's workload, the warmed-up engine, GPU timing helpers.

Every workload module (engine, profile, multiturn, serve, kernels, k03, k04) imports from here, never from another
workload; `./check.sh bench` reaches them all from one place (cli.py), so the package has no import cycle.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass

MODELS = {
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=False),
    # Qwen3_5MoeTextConfig's defaults are the 35B-A3B text model (40 layers, 3 GDN : 1 full attention)
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", max_position_embeddings=32768),
}


def hf_config(name: str):
    from transformers import AutoConfig
    spec = dict(MODELS[name])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def workload(num_seqs: int, max_input_len: int, max_output_len: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py, draw for draw: all prompts first, then all output lengths."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    out_lens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, out_lens


# the workload's token ids are randint(0, 10000): the warm-up's are shifted past them, so that no timed prompt finds a
# warm-up prompt's blocks in the prefix cache; a repeat's prompts (fresh_tokens) are redrawn for the same reason
WARM_UP_OFFSET = 10001
CPU_VOCAB = 2 * WARM_UP_OFFSET + 64               # the tiny model of the CPU smoke run holds both


def fresh_tokens(prompts: list[list[int]], seed: int) -> list[list[int]]:
    """The same prompt lengths with other token ids (randint(0, 10000) from random.Random(seed)): a repeat of the
    workload that runs the same schedule but hits nothing an earlier run left in the prefix cache."""
    rng = random.Random(seed)
    return [[rng.randint(0, 10000) for _ in p] for p in prompts]


def build_engine(args, prompts, tp: int = 1):
    """The engine (the learner's files where they pass, else the references) on the bench model, warmed up.
    Returns (llm, SamplingParams, start-up seconds); records the free GPU memory before it in args._free_at_start.
    With args.device == "cpu": e05's engine on a tiny dummy Qwen3 (the smoke run of the throughput bench)."""
    from ..grader import select
    from ..runtime import run
    cpu = getattr(args, "device", "cuda") == "cpu"
    selection, report = run.auto_selection(gpu=not cpu)
    select.use(selection)
    if not getattr(args, "_reported", False):
        print("engine files: " + ", ".join(path for _, path in report))
        args._reported = True
    SamplingParams = select.load("e01_sampling").SamplingParams
    t0 = time.perf_counter()
    if cpu:
        llm = _cpu_engine(args, prompts, select.load("e05_engine"))
        args._free_at_start = 0.0
    else:
        import torch
        g01 = select.load("g01_gpu_engine")
        args._free_at_start = torch.cuda.mem_get_info()[0] / 2**30
        t0 = time.perf_counter()
        llm = g01.LLM(hf_config(args.model), max_num_seqs=args.max_num_seqs, max_num_batched_tokens=16384,
                      max_model_len=args.max_model_len, block_size=args.block_size, enforce_eager=args.enforce_eager,
                      gpu_memory_utilization=0.9, tensor_parallel_size=tp,
                      async_scheduling=False if getattr(args, "no_async_scheduling", False) else None,
                      **({} if getattr(args, "dtype", "bf16") == "bf16" else {"quantization": args.dtype}))
    startup = time.perf_counter() - t0
    # warm-up: Triton compiles a kernel per specialisation on first use (~0.1-0.6 s each); give every path
    # one: short and long prompts, then more prompt tokens than one step takes so that a chunk continues
    # from a cached prefix and prefill chunks share steps with decodes - all before the clock starts
    # (token ids shifted past the workload's: the timed prompts find none of these in the prefix cache)
    warm = [p[:n] for p, n in zip(prompts[:8], (1, 17, 100, 255, 512, 1000, 64, 33))]
    warm += [(p * 4)[:min(args.max_model_len - 8, 1500)] for p in prompts[8:8 + 12]]
    warm = [[t + WARM_UP_OFFSET for t in p] for p in warm]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
    plan = getattr(llm, "memory_plan", None)
    if plan is not None and not cpu:           # course/runtime/memory.py: where the card's bytes went
        from ..runtime import memory
        torch.cuda.synchronize()
        plan.measured["free_after_bench_warmup"] = memory.free_within(plan.budget, torch.device("cuda"))
        print(plan.table(), flush=True)
    return llm, SamplingParams, startup


def _cpu_engine(args, prompts, e05):
    """e05's engine on the CPU with a tiny dummy Qwen3 and a KV pool that holds every sequence at once."""
    from ..runtime.run import tiny_dummy_config
    longest = max(len(p) for p in prompts) + args.max_output_len + 8
    blocks = sum(-(-(len(p) + args.max_output_len + 8) // args.block_size) for p in prompts) + 64
    return e05.LLM(tiny_dummy_config(CPU_VOCAB), max_num_seqs=args.max_num_seqs, max_num_batched_tokens=1024,
                   max_model_len=min(args.max_model_len, max(longest, 1024)), block_size=args.block_size,
                   num_kvcache_blocks=blocks)


class watch_compiles:
    """`with watch_compiles() as names:` - the Triton kernels compiled (or loaded from the disk cache) inside the block,
    by name: a timed run must show none (each compile costs 0.1-1 s of wall time that is not the engine's work).
    Uses triton.knobs.runtime.jit_cache_hook (Triton >= 3.4); on older Triton the list stays empty."""

    def __enter__(self) -> list[str]:
        self.names: list[str] = []
        try:
            from triton import knobs
            self.runtime = knobs.runtime if hasattr(knobs.runtime, "jit_cache_hook") else None
        except (ImportError, AttributeError):
            self.runtime = None
        if self.runtime is None:
            return self.names
        self.before = self.runtime.jit_cache_hook

        def hook(*, fn, **kw):
            self.names.append(getattr(fn, "name", str(fn)))
            return False                           # False: compile as usual
        self.runtime.jit_cache_hook = hook
        return self.names

    def __exit__(self, *exc) -> None:
        if self.runtime is not None:
            self.runtime.jit_cache_hook = self.before


def time_calls(targets: dict):
    """Wrap obj.name for each (obj, name) to sum its wall time (a diagnostic: where a step's host time goes).
    Returns (seconds per label, restore): restore() removes the wrappers again."""
    acc = {}
    for label, (obj, name) in targets.items():
        fn = getattr(obj, name)
        acc[label] = 0.0

        def timed(*a, _fn=fn, _label=label, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                acc[_label] += time.perf_counter() - t
        setattr(obj, name, timed)

    def restore():
        for obj, name in targets.values():
            delattr(obj, name)                   # the instance attribute shadowed the class method
    return acc, restore


def replay_ms(runner, batch: int, context: int, num_blocks: int) -> float:
    """GPU time of one decode-graph replay at `batch` sequences of `context` tokens (every rank calls it)."""
    import torch
    bs = next(b for b in sorted(runner.graphs) if b >= min(batch, max(runner.graphs)))
    context = max(1, min(context, runner.max_blocks_per_seq * runner.block_size))
    per_seq = -(-context // runner.block_size)
    s = runner.static
    gen = torch.Generator(device=s["tables"].device).manual_seed(0)
    # random blocks (with replacement when the pool holds fewer than bs * per_seq): the reads stay scattered
    blocks = torch.randint(0, num_blocks, (bs, per_seq), device=s["tables"].device, generator=gen)
    with torch.inference_mode():
        s["tables"][:bs, :per_seq] = blocks.int()
        s["lens"][:bs] = context
        s["pos"][:bs] = context - 1
        s["slots"][:bs] = blocks[:, -1] * runner.block_size
        runner.graphs[bs].replay()
        return event_ms(runner.graphs[bs].replay, 20)


def event_ms(fn, reps: int) -> float:
    """Mean GPU milliseconds of fn() over `reps` back-to-back calls, timed with CUDA events."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


# ------------------------------------------------------------------------------------------------------------------
# Kernel timing: the one helper every kernel bench (k01-k04) times its rows with.
#
# A row is one callable on buffer sets built by the bench. The sets are cycled inside a CUDA graph of back-to-back
# calls: no host launch between calls, no L2 flush (do_bench's flush left ~50 MB of dirty lines that the timed kernel
# had to write back, and one call's time swung 21-58 us on the H200), and every set's buffers are cold when its turn
# comes because the sets together touch at least COLD_FACTOR x the L2 (read off the device). The graph is replayed
# `replays` times, each replay timed with CUDA events; a row reports the median per call and the min-max over the
# replays. A row whose spread (max - min) / median exceeds SPREAD_LIMIT gets no verdict.

SPREAD_LIMIT = 0.10      # (max - min) / median of a row's replays above which the row gets no verdict
REPLAYS = 30             # timed replays per row (the kernel benches' --replays)
COLD_FACTOR = 2          # a row's buffer sets touch at least this many times the L2 per cycle
MAX_SETS = 64            # buffer sets per row at most (a row whose sets stay in L2 says so: Timing.cold)
REPLAY_MS = 2.0          # back-to-back calls per replay: enough to fill about this much GPU time ...
MAX_CALLS = 128          # ... but no more calls than this in one graph
WARM_MS = 50.0           # untimed replays before the timed ones: at least this much time, and at least 3
ANCHOR_BYTES = 2 * 2**30  # the device-to-device copy every kernel bench and the decode roofline take as the HBM peak


@dataclass
class Timing:
    """One row's timing: milliseconds per call of every timed replay, and how they were taken."""
    ms: list[float]                 # per call, one value per timed replay
    sets: int                       # buffer sets cycled through
    calls: int                      # back-to-back calls per replay
    touched: float                  # bytes one call reads + writes (the bench's count)
    l2: int                         # the device's L2 in bytes
    method: str                     # "graph": CUDA-graph replay; "events": eager calls between CUDA events
    note: str = ""                  # why "events"

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    @property
    def lo(self) -> float:
        return min(self.ms)

    @property
    def hi(self) -> float:
        return max(self.ms)

    @property
    def spread(self) -> float:
        return (self.hi - self.lo) / self.median

    @property
    def noisy(self) -> bool:
        return self.spread > SPREAD_LIMIT

    @property
    def cold(self) -> bool:
        """The sets together touch more than the L2: no call finds its inputs left in L2 by its previous turn."""
        return self.sets * self.touched > self.l2

    def span(self) -> "Span":
        return Span(self.median, self.lo, self.hi)

    def cell(self) -> str:
        """'18.2 µs [18.0–18.5]  2.7 %': median, min–max over the replays, spread."""
        scale, unit, digits = (1e3, "µs", 1) if self.median < 1 else (1, "ms", 3)
        return (f"{self.median * scale:.{digits}f} {unit} [{self.lo * scale:.{digits}f}–{self.hi * scale:.{digits}f}]"
                f" {self.spread:5.1%}")

    def as_dict(self) -> dict:
        return dict(median_ms=self.median, min_ms=self.lo, max_ms=self.hi, spread=self.spread, noisy=self.noisy,
                    replays=len(self.ms), sets=self.sets, calls=self.calls, touched_bytes=self.touched,
                    cold=self.cold, method=self.method, note=self.note)


@dataclass
class Span:
    """A figure with its range over the replays: mid from the medians, lo and hi from the extremes."""
    mid: float
    lo: float
    hi: float

    @staticmethod
    def rate(amount: float, t: Timing) -> "Span":
        """amount per millisecond: the fastest replay gives the high end."""
        return Span(amount / t.median, amount / t.hi, amount / t.lo)

    def over(self, other: "Span") -> "Span":
        """self / other, with the widest range the two ranges allow."""
        return Span(self.mid / other.mid, self.lo / other.hi, self.hi / other.lo)

    def scaled(self, k: float) -> "Span":
        return Span(self.mid * k, self.lo * k, self.hi * k)


# verdict keys (what --json and repeat_check compare) and the text a row prints for each
VERDICTS = {
    "pass": "✓ 达标",
    "fail": "✗ 未达标",
    "undecided": "? 目标落在最小–最大区间内，不下结论",
    "fastest": "✓ 最快",
    "faster": "✓ 更快",
    "slower": "✗ 更慢",
    "overlap": "? 区间重叠，不下结论",
    "noisy": f"⚠ 波动过大（(最大−最小)/中位数 > {SPREAD_LIMIT:.0%}），不下结论",
}


def at_least(value: Span, target: float, t: Timing) -> str:
    """The verdict on `value >= target` for a row timed as t: decided only when the whole range is on one side."""
    if t.noisy:
        return "noisy"
    return "pass" if value.lo >= target else "fail" if value.hi < target else "undecided"


def at_most(value: Span, target: float, t: Timing) -> str:
    if t.noisy:
        return "noisy"
    return "pass" if value.hi <= target else "fail" if value.lo > target else "undecided"


def versus(t: Timing, others: dict[str, Timing]) -> tuple[str, str]:
    """Is the row timed as t faster than each of others? On medians, decided only where the min–max ranges do not
    overlap. Returns (key, the other that decided it or the ones it could not be told from)."""
    if t.noisy:
        return "noisy", ""
    beaten = [name for name, o in others.items() if o.hi < t.lo]
    if beaten:
        return "slower", min(beaten, key=lambda n: others[n].median)
    close = [name for name, o in others.items() if not t.hi < o.lo]
    if close:
        return "overlap", ", ".join(close)
    return ("fastest" if len(others) > 1 else "faster"), ""


def l2_bytes() -> int:
    import torch
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def buffer_sets(touched: float, l2: int, max_sets: int = MAX_SETS) -> int:
    """How many buffer sets a row cycles through: together they touch at least COLD_FACTOR x the L2."""
    return max(1, min(max_sets, math.ceil(COLD_FACTOR * l2 / max(touched, 1.0))))


def capture_cycled(fns, calls: int):
    """A CUDA graph of `calls` back-to-back calls cycling through fns (the same kernel on different buffers, so each
    call's inputs are cold when its turn comes). The fns run first on the current stream (Triton compiles) and on a
    side stream (the warm-up a capture wants), outside the capture."""
    import torch
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    return graph


def time_cycled(make, touched: float, *, graph: bool | str = True, replays: int | None = None,
                max_sets: int = MAX_SETS) -> Timing:
    """Time one row: make(i) returns the call on buffer set i (a zero-argument callable; i < the number of sets);
    `touched` is the bytes one call reads and writes, from which the number of sets follows (buffer_sets).

    graph=True: a CUDA graph of back-to-back calls cycling through the sets, replayed `replays` times after a warm-up,
    each replay timed with CUDA events. When the capture fails (a call that syncs with the host, or any other error),
    and when graph is a string (the reason a call cannot be captured), the same calls run eagerly between the same
    events, with the same warm-up and repeats: Timing.method says which, Timing.note why."""
    import torch
    replays = replays or REPLAYS
    l2 = l2_bytes()
    sets = buffer_sets(touched, l2, max_sets)
    fns = [make(i) for i in range(sets)]
    for fn in fns:                                   # Triton compiles, autotuning, first touch: before any clock
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in fns:
        fn()
    end.record()
    end.synchronize()
    per_call = max(start.elapsed_time(end) / sets, 1e-4)
    rounds = max(1, min(MAX_CALLS // sets, math.ceil(REPLAY_MS / per_call / sets)))
    calls = sets * rounds
    method, note, cuda_graph, run = "events", "", None, None
    if graph is True:
        stream = torch.cuda.current_stream()
        try:
            cuda_graph = capture_cycled(fns, calls)
            run, method = cuda_graph.replay, "graph"
        except Exception as exc:                     # noqa: BLE001 - any capture failure: time it eagerly instead
            cuda_graph = None
            torch.cuda.set_stream(stream)            # a failed capture_end leaves the capture stream current
            torch.cuda.synchronize()
            first = (str(exc).strip().splitlines() or [""])[0][:120]
            note = f"CUDA graph 捕获失败（{type(exc).__name__}: {first}），改为 eager"
    else:
        note = str(graph)
    if run is None:
        def run():
            for i in range(calls):
                fns[i % sets]()
    warm = max(3, min(50, math.ceil(WARM_MS / (per_call * calls))))
    for _ in range(warm):
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(starts, ends):                   # queued back to back: the GPU never idles between replays
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) / calls for s, e in zip(starts, ends)]
    del cuda_graph, run, fns
    return Timing(ms, sets, calls, touched, l2, method, note)


def copy_anchor(replays: int | None = None, nbytes: int | None = None) -> tuple[Span, Timing]:
    """GB/s (a Span) of a device-to-device copy of nbytes (default ANCHOR_BYTES; read + write), timed with
    time_cycled: the bandwidth anchor of every kernel bench."""
    import torch
    nbytes = nbytes or ANCHOR_BYTES

    def make(i):
        src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda")
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    # eager, between events: captured in a CUDA graph, a device-to-device copy_ becomes a memcpy node that the copy
    # engines run (2.72 TB/s on the H200, 2026-12-03) instead of the SM copy kernel eager copy_ launches (~4.1 TB/s);
    # 2 GiB per call keeps launch gaps and the L2 out of the number
    t = time_cycled(make, 2 * nbytes, replays=replays,
                    graph="a copy_ captured in a CUDA graph is a memcpy node run by the copy engines, not the SM kernel")
    torch.cuda.empty_cache()
    return Span.rate(2 * nbytes / 1e6, t), t


def hbm_peak() -> float:
    """GB/s of a 2 GiB device-to-device copy (read + write), median over the replays: the decode roofline's bandwidth."""
    return copy_anchor()[0].mid


def cpu_copy_gbps(nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """GB/s of a host memory copy (read + write), median of reps: the bandwidth of the CPU smoke run's roofline."""
    import torch
    src = torch.ones(nbytes // 2, dtype=torch.int16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times[1:]) / 1e9


def machine_info() -> dict:
    """What a result file needs to say where it was measured: GPU, driver, CPUs, versions, date."""
    import os
    import platform
    from datetime import datetime, timezone
    from importlib import metadata
    info = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), python=platform.python_version(),
                platform=platform.platform(), cpu_count=os.cpu_count())
    for dist in ("torch", "triton", "transformers", "numpy", "fla-core", "flash-linear-attention"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        import torch
        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            info.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                        l2_bytes=int(getattr(props, "L2_cache_size", 0)), driver=_driver_version())
    except Exception as exc:                         # noqa: BLE001 - a description only: never fail a bench over it
        info["error"] = repr(exc)
    return info


def _driver_version() -> str | None:
    import re
    import subprocess
    try:
        text = open("/proc/driver/nvidia/version", encoding="utf-8").read()
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text) or re.search(r"\s([0-9]{3,}\.[0-9.]+)\s", text)
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def command_line(argv: list[str]) -> str:
    import shlex
    return "./check.sh bench " + shlex.join(argv)


class Report:
    """The rows of one kernel bench run: each printed as it is measured (by the bench), collected here, and saved with
    --json FILE for repeat_check (which compares the verdicts of several runs) and the book's result files."""

    def __init__(self, bench: str, opts):
        self.bench, self.argv = bench, list(getattr(opts, "argv", []) or [])
        self.replays = getattr(opts, "replays", None) or REPLAYS
        self.json = getattr(opts, "json", None)
        self.rows: list[dict] = []
        self.notes: list[str] = []

    def add(self, name: str, t: Timing | None, verdicts: dict[str, str] | None = None, **figures) -> dict:
        """One row; its name is its key across runs (repeat_check), so a repeated name gets a number."""
        taken = {r["name"] for r in self.rows}
        base, k = name, 2
        while name in taken:
            name, k = f"{base} ({k})", k + 1
        row = dict(name=name, **(t.as_dict() if t is not None else {}), verdicts=dict(verdicts or {}), **figures)
        self.rows.append(row)
        return row

    def note(self, text: str) -> None:
        self.notes.append(text)

    def save(self) -> None:
        if not self.json:
            return
        import json
        data = dict(bench=self.bench, command=command_line(self.argv), argv=self.argv, machine=machine_info(),
                    spread_limit=SPREAD_LIMIT, cold_factor=COLD_FACTOR, replays=self.replays, rows=self.rows,
                    notes=self.notes)
        with open(self.json, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=1)
            f.write("\n")


def timing_legend(replays: int) -> str:
    """The line every kernel bench prints above its rows: how a row was timed and when it gets no verdict."""
    return (f"（每行：CUDA graph 里背靠背调用，轮流用几组缓冲区（合计 ≥ {COLD_FACTOR}× L2，每次调用的输入都是冷的），"
            f"重放 {replays} 次；打印每次调用的中位数 [最小–最大] 与波动 (最大−最小)/中位数；"
            f"波动 > {SPREAD_LIMIT:.0%} 的行不下结论；不能进 CUDA graph 的调用标明“eager”，用 CUDA event 同样计时）")


def say_out(text: str = "") -> None:
    print(text, flush=True)
