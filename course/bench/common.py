"""What several benchmarks share: the bench models, nano-vllm's workload, the warmed-up engine, GPU timing helpers.

Every workload module (engine, profile, multiturn, serve, kernels, k03, k04) imports from here, never from another
workload; `./check.sh bench` reaches them all from one place (cli.py), so the package has no import cycle.
"""

from __future__ import annotations

import random
import time

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


def build_engine(args, prompts, tp: int = 1):
    """The engine (the learner's files where they pass, else the references) on the bench model, warmed up.
    Returns (llm, SamplingParams, start-up seconds); records the free GPU memory before it in args._free_at_start."""
    import torch
    from ..grader import select
    from ..runtime import run
    selection, report = run.auto_selection(gpu=True)
    select.use(selection)
    if not getattr(args, "_reported", False):
        print("engine files: " + ", ".join(path for _, path in report))
        args._reported = True
    SamplingParams = select.load("e01_sampling").SamplingParams
    g01 = select.load("g01_gpu_engine")
    args._free_at_start = torch.cuda.mem_get_info()[0] / 2**30
    t0 = time.perf_counter()
    llm = g01.LLM(hf_config(args.model), max_num_seqs=args.max_num_seqs, max_num_batched_tokens=16384,
                  max_model_len=args.max_model_len, block_size=args.block_size, enforce_eager=args.enforce_eager,
                  gpu_memory_utilization=0.9, tensor_parallel_size=tp,
                  async_scheduling=False if getattr(args, "no_async_scheduling", False) else None)
    startup = time.perf_counter() - t0
    # warm-up: Triton compiles a kernel per specialisation on first use (~0.1-0.6 s each); give every path
    # one: short and long prompts, then more prompt tokens than one step takes so that a chunk continues
    # from a cached prefix and prefill chunks share steps with decodes - all before the clock starts
    warm = [p[:n] for p, n in zip(prompts[:8], (1, 17, 100, 255, 512, 1000, 64, 33))]
    warm += [(p * 4)[:min(args.max_model_len - 8, 1500)] for p in prompts[8:8 + 12]]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
    return llm, SamplingParams, startup


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


def do_bench_ms(fn) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def hbm_peak() -> float:
    """GB/s of a 2 GiB device-to-device copy (read + write): the bandwidth anchor of k01, k02 and the decode roofline."""
    import torch
    src = torch.empty(2 ** 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6


def capture_cycled(fns, calls: int):
    """A CUDA graph of `calls` back-to-back calls cycling through fns (the same kernel on different buffers, so each
    call's inputs are cold when its turn comes). The fns run first on the current stream (Triton compiles) and on a
    side stream (the warm-up a capture wants), outside the capture. Shared by bench k01 and bench k04's decode."""
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
