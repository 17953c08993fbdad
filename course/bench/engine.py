"""`./check.sh bench`: the engine on the nano-vllm bench workload, beside HF transformers in the same run.

Workload (nano-vllm's bench.py, common.workload): random.seed(0); num_seqs prompts of randint(0, 10000) token ids
with lengths randint(100, max_input_len), then output lengths randint(100, max_output_len); temperature 0.6,
ignore_eos; throughput = output tokens / wall time of one generate() call (after a warm-up request).
Beside the measured decode time: the decode phase's roofline (roofline.py: the bytes it must move over the copy
bandwidth measured in the same run).
Models: the real architectures with dummy bf16 weights built on the GPU (no download; common.MODELS).
With --peer hf every engine runs in a process of its own (the whole GPU each: a second engine in the same
process would find the first one's memory still held); the ratio is printed only from runs that started
with the same free GPU memory on the same prompts. --tp N: the engine at TP=N and at TP=1 on the same prompts
(bench_tp). The command line is parsed, and every other workload dispatched, by cli.py.
--repeats N: one engine runs the timed workload N times (run 1 on nano-vllm's prompts, run r on the same lengths with
other token ids, common.fresh_tokens, so that no run hits what an earlier one cached); the table shows the median run,
and every run's output tok/s, the median and the min–max spread are printed. --json FILE: the runs, their step
timelines, the plotted series, the command line, the machine (GPU, driver, CPUs), the versions and the date.
--plot PNG: output tok/s over wall time, each point the mean over a window of wall time (smoothed: not per step, see
smoothed()), the decode roofline of the same steps as a line, and the decode batch beneath.
--device cpu: the same loop on e05's engine with a tiny dummy Qwen3 (a smoke run of the bench, not a measurement).
"""

from __future__ import annotations

import json
import time

from .common import (build_engine, command_line, cpu_copy_gbps, event_ms, fresh_tokens, hbm_peak, hf_config,
                     machine_info, replay_ms, time_calls, watch_compiles, workload)


def run_engine(args, prompts, out_lens, tp: int = 1) -> dict:
    """Build and warm up the engine once, then run the timed workload args.repeats times (run r > 0 on fresh_tokens:
    the same lengths, other token ids). The result holds the median run's figures (the lower middle one when the
    number of runs is even) and timeline, every run's figures in "runs", and the min / max of output tok/s."""
    import torch
    cuda = getattr(args, "device", "cuda") != "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    llm, SamplingParams, startup = build_engine(args, prompts, tp)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    steps: list[tuple[float, int, bool, float]] = []   # (seconds, tokens sampled, decode step?, seconds since start)
    inner = llm.step
    own = getattr(llm.runner, "inner", llm.runner)      # under TP, rank 0's runner inside the step-sending wrapper
    timers = {"schedule": (llm.scheduler, "schedule"), "postprocess": (llm.scheduler, "postprocess"),
              "run": (llm.runner, "run"), "decode inputs + replay launch": (own, "_run_decode"),
              "prefill forward (launch)": (own, "_run_prefill")}
    if hasattr(llm, "_resolve"):          # g01's async step: an overlapped step waits for the previous one in here
        timers["resolve"] = (llm, "_resolve")
    host, restore_calls = time_calls({k: v for k, v in timers.items() if hasattr(*v)})
    was_decode = _decode_flag(llm)
    clock = [0.0]

    def step():
        t = time.perf_counter()
        events = inner()
        now = time.perf_counter()
        steps.append((now - t, len(events), was_decode(), now - clock[0]))
        return events
    llm.step = step
    prompt_tokens = sum(len(p) for p in prompts)
    runs = []
    for r in range(args.repeats):
        run_prompts = prompts if r == 0 else fresh_tokens(prompts, seed=r)
        steps.clear()
        for k in host:
            host[k] = 0.0
        sync()
        with watch_compiles() as compiled:
            clock[0] = t = time.perf_counter()
            outs = llm.generate(run_prompts, params)
            sync()
            wall = time.perf_counter() - t
        tokens = sum(len(o.token_ids) for o in outs)
        assert tokens == sum(out_lens), f"engine produced {tokens} tokens, expected {sum(out_lens)}"
        timeline = list(steps)
        decode_steps = [s for s in timeline if s[2]]
        prefill_time = sum(s[0] for s in timeline if not s[2])
        decode_time = sum(s[0] for s in decode_steps)
        run = dict(run=r + 1, token_seed="nano-vllm (random.seed(0))" if r == 0 else r, seconds=wall,
                   tok_per_s=tokens / wall, prefill_tok_per_s=prompt_tokens / max(prefill_time, 1e-9),
                   decode_tok_per_s=sum(s[1] for s in decode_steps) / max(decode_time, 1e-9), steps=len(timeline),
                   mean_step_ms=1e3 * wall / max(len(timeline), 1),
                   mean_decode_step_ms=1e3 * decode_time / max(len(decode_steps), 1),
                   triton_compiles_in_timed_run=list(compiled),
                   host_ms_per_step={k: 1e3 * v / max(len(timeline), 1) for k, v in host.items()})
        print("RESULT", json.dumps(run), flush=True)
        run["timeline"] = timeline
        runs.append(run)
    restore_calls()
    rates = [r["tok_per_s"] for r in runs]
    mid = sorted(runs, key=lambda r: r["tok_per_s"])[(len(runs) - 1) // 2]
    result = dict(engine="course", model=args.model if cuda else "tiny dummy Qwen3 (CPU smoke run)",
                  device="cuda" if cuda else "cpu", num_seqs=len(prompts), output_tokens=sum(out_lens),
                  prompt_tokens=prompt_tokens, **{k: v for k, v in mid.items() if k not in ("run", "token_seed")},
                  median_run=mid["run"], repeats=len(runs), tok_per_s_min=min(rates), tok_per_s_max=max(rates),
                  tok_per_s_spread=(max(rates) - min(rates)) / mid["tok_per_s"],
                  runs=[{k: v for k, v in r.items() if k != "timeline"} for r in runs],
                  run_timelines=[r["timeline"] for r in runs],
                  kv_blocks=getattr(llm.runner, "num_blocks", None) or llm.config.num_kvcache_blocks,
                  block_size=args.block_size, cuda_graph_buckets=sorted(getattr(llm.runner, "graphs", None) or []),
                  startup_s=startup, free_gib_at_start=args._free_at_start)
    plan = getattr(llm, "memory_plan", None)
    if plan is not None and cuda:            # the plan and what the allocator really holds after the timed runs
        from ..runtime import memory
        plan.measured["free_after_timed_runs"] = memory.free_within(plan.budget, torch.device("cuda"))
        plan.measured["max_allocated"] = torch.cuda.max_memory_allocated()
        result["memory_plan"] = plan.as_dict()
    if getattr(llm.runner, "graphs", None):
        try:
            with torch.inference_mode():
                # the full-batch decode steps run right after the prefills: context ~ prompt + a few tokens
                full = min(len(prompts), args.max_num_seqs)
                result["gpu_decode_step_ms"] = graph_step_ms(llm, full, sum(map(len, prompts)) // len(prompts) + 32)
                walls = [s[0] for s in mid["timeline"] if s[2] and s[1] == full]
                result["full_batch_decode_step_ms"] = 1e3 * sum(walls) / max(len(walls), 1)
        except Exception as exc:          # a diagnostic only: never lose the measured throughput over it
            print(f"graph_step_ms failed: {exc!r}")
    try:                                  # what the decode roofline counts (course/bench/roofline.py)
        from .roofline import engine_bytes
        result["engine_bytes"] = engine_bytes(llm.model, own)
    except Exception as exc:              # a diagnostic only, like graph_step_ms
        print(f"engine_bytes failed: {exc!r}")
    if tp > 1:                            # what one decode step communicates, timed on its own
        text = getattr(llm.model.config, "text_config", llm.model.config)
        result.update(tp=tp, batch=min(len(prompts), args.max_num_seqs), hidden=text.hidden_size,
                      allreduce_count=2 * text.num_hidden_layers + 1)
        result["allreduce_ms"] = llm.tp.call(_allreduce_ms, result["allreduce_count"], result["batch"], text.hidden_size)
    llm.step = inner
    if hasattr(llm, "close"):
        llm.close()
    del llm, inner, step
    import gc
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _decode_flag(llm):
    """A function saying whether the step just run (under async scheduling: just launched) was a pure decode step:
    g01's runner says so itself; on e05's (the CPU smoke run) a wrapper around runner.run looks at the batch."""
    if hasattr(llm.runner, "last_was_decode"):
        return lambda: llm.runner.last_was_decode
    flag = [False]
    run = llm.runner.run

    def wrapped(seqs):
        flag[0] = bool(seqs) and all(s.num_scheduled_tokens == 1 for s in seqs)
        return run(seqs)
    llm.runner.run = wrapped            # an instance attribute: restore_calls' delattr removes it with the timer
    return lambda: flag[0]


def time_breakdown(result: dict) -> list[str]:
    """Where the wall time went: prefill vs decode steps, decode steps by batch size, host time per step."""
    tl = result["timeline"]
    pre = [s for s in tl if not s[2]]
    dec = [s for s in tl if s[2]]
    lines = [f"prefill/mixed steps: {len(pre)}, {sum(s[0] for s in pre):.2f} s; "
             f"decode steps: {len(dec)}, {sum(s[0] for s in dec):.2f} s"]
    for lo, hi in ((193, 10**9), (129, 192), (65, 128), (17, 64), (1, 16)):
        part = [s for s in dec if lo <= s[1] <= hi]
        if part:
            sec = sum(s[0] for s in part)
            lines.append(f"  decode batch {lo}-{hi if hi < 10**9 else '':<3}: {len(part):5d} steps, {sec:6.2f} s, "
                         f"{1e3 * sec / len(part):6.2f} ms/step, {sum(s[1] for s in part) / sec:8.0f} tok/s")
    host = result.get("host_ms_per_step", {})
    if host:
        lines.append("host ms per step (mean over all steps; 'run' is a synchronous step's forward + its wait for the "
                     "GPU; an overlapped decode step does not call it and waits for the previous step in 'resolve'): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))
    return lines


def roofline_line(eng: dict, prompts, out_lens, gb_per_s: float | None = None) -> str:
    """The decode phase's bytes / the copy bandwidth measured now (gb_per_s; None: hbm_peak()), beside the measured
    decode time (roofline.py). Leaves the bound in eng["decode_bound"] (with the whole workload's, prefill at its
    measured time, as "workload_tok_per_s")."""
    from .roofline import decode_bound
    n = eng["num_seqs"]
    bound = eng["decode_bound"] = decode_bound(eng["engine_bytes"], [len(p) for p in prompts[:n]], out_lens[:n],
                                               hbm_peak() if gb_per_s is None else gb_per_s)
    tb = {k: v / 1e12 for k, v in bound["bytes"].items()}
    decode = sum(s[0] for s in eng["timeline"] if s[2])
    prefill = sum(s[0] for s in eng["timeline"] if not s[2])
    bound["workload_tok_per_s"] = eng["output_tokens"] / (bound["seconds"] + prefill)
    bound["share_of_decode_bound"] = bound["seconds"] / max(decode, 1e-9)
    moe = " (experts: the expected distinct ones under uniform routing)" if eng["engine_bytes"]["num_experts"] else ""
    return (f"decode roofline at the copy bandwidth measured now ({bound['gb_per_s']:.0f} GB/s): K/V {tb['kv']:.2f} TB + "
            f"weights {tb['weights']:.2f} TB{moe} + GDN states {tb['gdn']:.2f} TB + logits {tb['logits']:.2f} TB over "
            f"{bound['steps']} steps = {bound['seconds']:.2f} s; measured decode {decode:.2f} s "
            f"({bound['seconds'] / max(decode, 1e-9):.0%} of the bound's speed); with the measured prefill time "
            f"({prefill:.2f} s) this workload is bounded at {bound['workload_tok_per_s']:.0f} output tok/s")


def step_floors(timeline, sizes: dict, prompt_lens: list[int], out_lens: list[int], gb_per_s: float) -> list[float]:
    """The least time the roofline allows each step of a timeline: a decode step of batch b moves at least the bytes of
    the bench schedule's cheapest step of that batch (roofline.decode_steps; a batch the schedule never runs: b
    sequences at the shortest prompt + 1); a prefill or mixed step keeps its measured time (the roofline leaves
    prefill out, as roofline_line does)."""
    from .roofline import decode_steps, step_bytes
    fewest: dict[int, float] = {}
    for batch, nbytes in decode_steps(sizes, prompt_lens, out_lens):
        fewest[batch] = min(fewest.get(batch, float("inf")), sum(nbytes.values()))
    shortest = min(prompt_lens) + 1
    floors = []
    for seconds, tokens, decode, *_ in timeline:
        if not decode:
            floors.append(seconds)
        elif tokens == 0:
            floors.append(0.0)
        else:
            nbytes = fewest.get(tokens) or sum(step_bytes(sizes, tokens, tokens * shortest).values())
            floors.append(nbytes / (gb_per_s * 1e9))
    return floors


def smoothed(timeline, floors: list[float] | None, window: float, points: int = 400) -> dict:
    """Output tok/s over wall time, smoothed over `window` seconds (not per step: under async scheduling a step's call
    returns the previous step's tokens, and an overlapped call that finds them ready takes microseconds, so per-step
    rates spike far above anything the GPU did), and the roofline over the same windows.

    Each step's tokens (and its floor, step_floors) are spread evenly over the step's own interval of the timeline;
    the point at time T counts the tokens in [T - window/2, T + window/2] (clipped to the run) over the window's length,
    and the bound there is the same tokens over the floors of the same (fractions of) steps. The steps follow one
    another, so the measured point lies under the bound wherever the steps took at least their floors."""
    import numpy as np
    dur = np.array([s[0] for s in timeline], dtype=float)
    tokens = np.array([s[1] for s in timeline], dtype=float)
    end = np.array([s[3] for s in timeline], dtype=float)
    start = end - dur
    wall = float(end.max()) if len(end) else 0.0
    t = np.linspace(0.0, wall, points)
    lo, hi = np.clip(t - window / 2, 0, wall), np.clip(t + window / 2, 0, wall)
    overlap = np.clip(np.minimum(hi[:, None], end[None, :]) - np.maximum(lo[:, None], start[None, :]), 0, None)
    frac = np.clip(overlap / np.maximum(dur, 1e-12)[None, :], 0, 1)
    in_window = frac @ tokens
    length = np.maximum(hi - lo, 1e-12)
    series = dict(window_s=window, t=t.tolist(), measured=(in_window / length).tolist(), bound=None)
    if floors is not None:
        need = frac @ np.asarray(floors, dtype=float)
        series["bound"] = [float(n / f) if f > 0 else None for n, f in zip(in_window, need)]
    decode = [(s[3], s[1]) for s in timeline if s[2]]
    series["batch_t"] = [e for e, _ in decode]
    series["batch"] = [b for _, b in decode]
    series["prefill_spans"] = _spans([(s[3] - s[0], s[3]) for s in timeline if not s[2]])
    return series


def _spans(intervals: list[tuple[float, float]], gap: float = 1e-3) -> list[tuple[float, float]]:
    """Intervals merged where they (nearly) touch: the prefill / mixed stretches of a run."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def plot_window(timeline) -> float:
    """Seconds of wall time a plotted point averages over: 20 median steps, and at least 1 % of the run."""
    import statistics
    if not timeline:
        return 1.0
    return max(20 * statistics.median(s[0] for s in timeline), timeline[-1][3] / 100)


def plot_title(eng: dict, where: str, date: str) -> str:
    head = f"{eng['tok_per_s']:,.0f} output tok/s"
    if eng.get("repeats", 1) > 1:
        head += (f" (median of {eng['repeats']} runs, {eng['tok_per_s_min']:,.0f}–{eng['tok_per_s_max']:,.0f}, "
                 f"spread {eng['tok_per_s_spread']:.1%})")
    bound = eng.get("decode_bound")
    if bound:
        head += f"; decode at {bound['share_of_decode_bound']:.0%} of its roofline"
    return f"./check.sh bench: {eng['model']} on {where}, {date}\n{eng['num_seqs']} requests, {head}"


def render_plot(path: str, series: dict, title: str) -> None:
    """The PNG of --plot: smoothed throughput and the roofline above, the decode batch size beneath (English labels:
    the machine that draws it may have no CJK font)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw=dict(height_ratios=[3, 1.4]))
    for ax in (top, bottom):
        for a, b in series["prefill_spans"]:
            ax.axvspan(a, b, color="0.9", lw=0)
    top.plot(series["t"], series["measured"], lw=1.4, color="C0",
             label=f"measured output tok/s (mean over {series['window_s']:.2f} s windows of wall time)")
    if series.get("bound"):
        bound = [float("nan") if b is None else b for b in series["bound"]]
        top.plot(series["t"], bound, lw=1.2, ls="--", color="C3",
                 label="decode roofline: the same steps at bytes / copy bandwidth (prefill at its measured time)")
    top.set_ylabel("output tokens / s")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    top.legend(loc="upper right", fontsize=8)
    bottom.step(series["batch_t"], series["batch"], where="pre", lw=1, color="C2")
    bottom.set_ylabel("decode batch\n(sequences / step)")
    bottom.set_xlabel("wall time (s); grey: prefill and mixed steps")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def graph_step_ms(llm, batch: int, context: int) -> float:
    """GPU time of one decode step (graph replay) at `batch` sequences of `context` tokens: the step's floor.
    Under tensor parallel every rank replays at once (the graph holds NCCL all-reduces)."""
    if getattr(llm, "tp", None) is not None:
        return llm.tp.call(replay_ms, batch, context, llm.runner.num_blocks)
    return replay_ms(llm.runner, batch, context, llm.runner.num_blocks)


def run_hf_peer(args, prompts, out_lens) -> dict:
    """HF transformers 5.17 on the same prompts: continuous batching (paged|sdpa) where HF supports the model,
    else (hybrid Qwen3.5: HF CB refuses linear-attention layers) generate() on static left-padded batches."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    cfg = hf_config(args.model)
    hybrid = "linear_attention" in (getattr(cfg, "layer_types", None) or [])
    attn = "sdpa" if hybrid else "paged|sdpa"
    free_at_start = torch.cuda.mem_get_info()[0] / 2**30          # before the model, as run_engine measures it
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn).eval()
    gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, eos_token_id=None,
                           pad_token_id=0, max_new_tokens=max(out_lens))
    manager = None
    if not hybrid:                               # started and warmed up (one short request) before the clock
        manager = model.init_continuous_batching(generation_config=gen)
        manager.start()
        manager.add_request(prompts[0][:16], max_new_tokens=2)
        while not ((r := manager.get_result(timeout=600)) is not None and r.is_finished()):
            pass
    torch.cuda.synchronize()
    t = time.perf_counter()
    tokens = 0
    if not hybrid:
        try:
            ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, out_lens)]
            done = 0
            while done < len(ids):
                r = manager.get_result(timeout=600)
                if r is not None and r.is_finished():
                    done += 1
                    tokens += len(r.generated_tokens)
        finally:
            manager.stop(block=True)
        peer = "HF continuous batching (paged|sdpa)"
    else:
        batch = 16
        for i in range(0, len(prompts), batch):
            chunk, lens = prompts[i:i + batch], out_lens[i:i + batch]
            width = max(len(p) for p in chunk)
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen,
                                 max_new_tokens=max(lens))
            tokens += sum(min(n, out.shape[1] - width) for n in lens)   # count only what each request asked for
        peer = "HF generate, static batches of 16 (sdpa; HF CB refuses linear attention)"
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return dict(engine=peer, model=args.model, num_seqs=len(prompts), output_tokens=tokens, seconds=wall,
                tok_per_s=tokens / wall, free_gib_at_start=free_at_start)


def bench(args, argv: list[str], say) -> int:
    """`./check.sh bench [options]` on a GPU, or the smoke run with --device cpu (cli.py parsed argv into args; the child
    processes get argv again)."""
    import torch
    if args.tp > 1 or args.tp_run:
        return bench_tp(args, argv, say)
    prompts, out_lens = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    if args.engine_run:                         # a child: one engine, one JSON line for the parent
        n = args.subset or len(prompts)
        run = run_engine if args.engine_run == "course" else run_hf_peer
        result = run(args, prompts[:n], out_lens[:n])
        print("ENGINE_JSON " + json.dumps(result), flush=True)
        return 0
    from rich.table import Table
    cpu = args.device == "cpu"
    if args.peer == "hf":                       # every engine in its own process: the whole GPU each
        n = min(args.peer_num_seqs or args.num_seqs, args.num_seqs)
        runs = [("course", args.num_seqs)] + ([("course", n)] if n != args.num_seqs else []) + [("hf", n)]
        results = []
        for engine, count in runs:
            r = _child(argv, engine, count, say)
            if r is None:
                return 1
            if engine == "course" and count != args.num_seqs:
                r["engine"] = f"course ({count} prompts)"
            results.append(r)
    else:
        from ..runtime.memory import MemoryPlanError
        try:
            results = [run_engine(args, prompts, out_lens)]
        except MemoryPlanError as exc:            # refused at start, with the numbers: no traceback
            from rich.markup import escape
            say(f"[red]{escape(str(exc))}[/]")
            print("BENCH_REFUSED " + json.dumps({"model": args.model, "dtype": getattr(args, "dtype", "bf16"),
                                                 "message": str(exc)}, ensure_ascii=False), flush=True)
            return 3
    where = "CPU" if cpu else torch.cuda.get_device_name()
    weights = "" if getattr(args, "dtype", "bf16") == "bf16" else f" --dtype {args.dtype}"
    table = Table(title=f"./check.sh bench --model {args.model}{weights}  ({where})" if not cpu else
                  "./check.sh bench --device cpu  (tiny dummy Qwen3 on the CPU: a smoke run, not a measurement)")
    for col in ("engine", "prompts", "output tok", "seconds", "output tok/s", "prefill tok/s", "decode tok/s",
                "mean step ms", "decode step ms", "free GiB at start"):
        table.add_column(col)
    for r in results:
        table.add_row(r["engine"], str(r["num_seqs"]), str(r["output_tokens"]), f"{r['seconds']:.2f}",
                      f"{r['tok_per_s']:.0f}", f"{r.get('prefill_tok_per_s', 0):.0f}",
                      f"{r.get('decode_tok_per_s', 0):.0f}", f"{r.get('mean_step_ms', 0):.2f}",
                      f"{r.get('mean_decode_step_ms', 0):.2f}", f"{r.get('free_gib_at_start', 0):.1f}")
    say(table)
    eng = results[0]
    say(runs_line(eng))
    say(f"KV blocks {eng['kv_blocks']} × {eng['block_size']} tokens; CUDA-graph buckets {eng['cuda_graph_buckets']}; "
        f"start-up {eng['startup_s']:.1f} s")
    compiled = [name for run in eng.get("runs", [eng]) for name in run.get("triton_compiles_in_timed_run", [])]
    say(f"Triton compiles during the timed runs: {len(compiled)}"
        + (f" ({', '.join(sorted(set(compiled)))}: their compile time is in the wall time above)" if compiled else ""))
    if "gpu_decode_step_ms" in eng:
        wall = eng.get("full_batch_decode_step_ms", eng["mean_decode_step_ms"])
        say(f"decode step at the full batch {min(eng['num_seqs'], args.max_num_seqs)}: {wall:.2f} ms wall (mean of those "
            f"steps) vs {eng['gpu_decode_step_ms']:.2f} ms GPU (one graph replay, every sequence at the mean prompt length "
            f"+ 32) -> host share {max(0.0, 1 - eng['gpu_decode_step_ms'] / max(wall, 1e-9)):.0%}"
            + (" (MoE: the replay's synthetic inputs route to other experts than a real step's, so this share is not "
               "the host's; --profile measures a real step's GPU time)" if "a3b" in args.model else ""))
    for line in time_breakdown(eng):
        say(line)
    if "engine_bytes" in eng and eng["num_seqs"] <= args.max_num_seqs:     # all running at once: the bound's schedule
        try:
            say(roofline_line(eng, prompts, out_lens, cpu_copy_gbps() if cpu else None))
        except Exception as exc:          # a diagnostic only: never lose the measured throughput over it
            say(f"roofline failed: {exc!r}")
    if args.peer == "hf":
        ours, hf = results[-2], results[-1]
        free = (ours["free_gib_at_start"], hf["free_gib_at_start"])
        if abs(free[0] - free[1]) > 0.05 * max(free):
            say(f"[red]不比较：两次运行开始时空闲显存不同（本课 {free[0]:.1f} GiB，HF {free[1]:.1f} GiB），条件不对等。[/]")
        else:
            say(f"[bold]ratio course / HF on the same {ours['num_seqs']} prompts, each in its own process "
                f"({free[0]:.1f} / {free[1]:.1f} GiB free at start): {ours['tok_per_s'] / hf['tok_per_s']:.1f}×[/]"
                + (f" (course: the median of {ours['repeats']} runs; HF: one run)" if ours.get("repeats", 1) > 1 else ""))
    machine = machine_info()
    series = None
    if args.plot or args.json:
        n = eng["num_seqs"]
        bound = eng.get("decode_bound")
        floors = step_floors(eng["timeline"], eng["engine_bytes"], [len(p) for p in prompts[:n]], out_lens[:n],
                             bound["gb_per_s"]) if bound else None
        series = smoothed(eng["timeline"], floors, plot_window(eng["timeline"]))
    if args.plot:
        try:
            render_plot(args.plot, series, plot_title(eng, "CPU" if cpu else machine.get("gpu", where),
                                                      machine["date"][:10]))
            say(f"plot: {args.plot}（吞吐按 {series['window_s']:.2f} s 的墙钟时间窗口平滑；虚线是同样这些步按 roofline 的上限）")
        except ImportError:
            say("matplotlib 不可用，跳过 --plot")
    line = json.dumps([{k: v for k, v in r.items() if k not in ("timeline", "run_timelines")} for r in results])
    print("BENCH_JSON " + line)
    if args.json:
        doc = dict(command=command_line(argv), argv=argv, machine=machine,
                   workload=dict(model=eng["model"], device=args.device, num_seqs=args.num_seqs,
                                 max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                 block_size=args.block_size, repeats=args.repeats,
                                 dtype=getattr(args, "dtype", "bf16")),
                   results=[{k: v for k, v in r.items() if k not in ("timeline", "run_timelines")} for r in results],
                   timelines=[[[round(x, 6) if isinstance(x, float) else x for x in step] for step in tl]
                              for tl in eng.get("run_timelines", [])],
                   plot=series)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)
    return 0


def runs_line(eng: dict) -> str:
    """Every timed run's output tok/s, the median and the min–max spread (the table shows the median run)."""
    runs = eng.get("runs", [])
    if len(runs) <= 1:
        return "1 timed run (--repeats N: N runs on one engine, the median and the min–max spread)"
    each = ", ".join(f"{r['tok_per_s']:.0f}" for r in runs)
    return (f"{len(runs)} timed runs, output tok/s: {each}; median {eng['tok_per_s']:.0f} (run {eng['median_run']}, "
            f"shown above), min–max {eng['tok_per_s_min']:.0f}–{eng['tok_per_s_max']:.0f}, spread "
            f"{eng['tok_per_s_spread']:.1%}")


def _child(argv: list[str], engine: str, count: int, say) -> dict | None:
    """One engine on the first `count` prompts in a fresh process (`--engine-run`); its result dict, None if it failed."""
    import subprocess
    import sys
    parent_only = {"--plot", "--json", "--peer", "--peer-num-seqs"}
    child_argv, skip = [], False
    for a in argv:                               # the workload flags travel; what only the parent does stays here
        if skip:
            skip = False
            continue
        if a.split("=")[0] in parent_only:
            skip = "=" not in a
            continue
        child_argv.append(a)
    cmd = [sys.executable, "-m", "course", "bench", *child_argv, "--engine-run", engine, "--subset", str(count)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ENGINE_JSON ")]
    print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("ENGINE_JSON ")), flush=True)
    if proc.returncode or not lines:
        say(f"[red]{engine}（{count} 条）的运行失败（exit {proc.returncode}）[/]")
        return None
    return json.loads(lines[-1][len("ENGINE_JSON "):])


def bench_tp(args, argv: list[str], say) -> int:
    """`--tp N`: the engine at TP=N, then at TP=1, each in its own process (GPU memory starts clean), on the same
    prompts; prints both, the speed-up, and where a decode step's time goes.

    decode step (GPU): one CUDA-graph replay on every rank at once, batch min(num_seqs, max_num_seqs), every
    sequence at the workload's mean context, timed with CUDA events on rank 0. all-reduce: the same number
    (2 per layer + 1 for the embedding) of NCCL all-reduces of the same size ([batch, H] in bf16), timed the
    same way on their own; their share of the decode step is an estimate (inside the graph they overlap
    nothing, so it is close).
    """
    import subprocess
    import sys
    import torch
    if args.tp_run:                                     # the child: one engine, one JSON line
        result = run_engine(args, *workload(args.num_seqs, args.max_input_len, args.max_output_len), tp=args.tp_run)
        result.pop("timeline")
        result.pop("run_timelines")
        print("TP_JSON " + json.dumps({"tp": args.tp_run, "allreduce_ms": 0.0, **result}), flush=True)
        return 0
    if torch.cuda.device_count() < args.tp:
        say(f"[yellow]--tp {args.tp} 需要 {args.tp} 块 GPU，这台机器有 {torch.cuda.device_count()} 块；未运行。[/]")
        return 2
    results = []
    for tp in (args.tp, 1):
        cmd = [sys.executable, "-m", "course", "bench", *argv, "--tp-run", str(tp)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("TP_JSON ")]
        print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("TP_JSON ")), flush=True)
        if proc.returncode or not lines:
            say(f"[red]TP={tp} 的运行失败（exit {proc.returncode}）[/]")
            return 1
        results.append(json.loads(lines[-1][len("TP_JSON "):]))
    from rich.table import Table
    table = Table(title=f"./check.sh bench --tp {args.tp} --model {args.model}  ({torch.cuda.get_device_name()})")
    for col in ("TP", "output tok/s", "decode tok/s", "decode step ms (wall)", "decode step ms (GPU)",
                "all-reduce ms / step", "all-reduce share", "start-up s"):
        table.add_column(col)
    for r in results:
        share = r["allreduce_ms"] / r["gpu_decode_step_ms"] if r.get("gpu_decode_step_ms") else 0.0
        table.add_row(str(r["tp"]), f"{r['tok_per_s']:.0f}", f"{r['decode_tok_per_s']:.0f}",
                      f"{r['mean_decode_step_ms']:.2f}", f"{r.get('gpu_decode_step_ms', 0):.2f}",
                      f"{r['allreduce_ms']:.3f}", f"{share:.0%}", f"{r['startup_s']:.1f}")
    say(table)
    tp_n, tp_1 = results
    say(f"[bold]speed-up TP={args.tp} / TP=1: {tp_n['tok_per_s'] / tp_1['tok_per_s']:.2f}× output tok/s, "
        f"{tp_n['decode_tok_per_s'] / tp_1['decode_tok_per_s']:.2f}× decode tok/s[/]  "
        f"(all-reduce: {tp_n['allreduce_count']} × [{tp_n['batch']}, {tp_n['hidden']}] bf16 per decode step)")
    line = json.dumps(results)
    print("BENCH_JSON " + line)
    if args.json:
        open(args.json, "w").write(line)
    return 0


def _allreduce_ms(runner, count: int, rows: int, hidden: int) -> float:
    """`count` NCCL all-reduces of [rows, hidden] bf16, back to back: what one decode step communicates."""
    import torch
    import torch.distributed as dist
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=runner.device)   # sums stay finite
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()

    def one_step():
        for _ in range(count):
            dist.all_reduce(x)
    return event_ms(one_step, 5)
