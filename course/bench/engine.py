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
"""

from __future__ import annotations

import json
import time

from .common import (build_engine, event_ms, hbm_peak, hf_config, replay_ms, time_calls, watch_compiles,
                     workload)


def run_engine(args, prompts, out_lens, tp: int = 1) -> dict:
    import torch
    llm, SamplingParams, startup = build_engine(args, prompts, tp)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    steps: list[tuple[float, int, bool]] = []       # (seconds, tokens sampled, decode step?)
    inner = llm.step
    own = getattr(llm.runner, "inner", llm.runner)      # under TP, rank 0's runner inside the step-sending wrapper
    timers = {"schedule": (llm.scheduler, "schedule"), "postprocess": (llm.scheduler, "postprocess"),
              "run": (llm.runner, "run"), "decode inputs + replay launch": (own, "_run_decode"),
              "prefill forward (launch)": (own, "_run_prefill")}
    if hasattr(llm, "_resolve"):          # g01's async step: an overlapped step waits for the previous one in here
        timers["resolve"] = (llm, "_resolve")
    host, restore_calls = time_calls(timers)

    def step():
        t = time.perf_counter()
        events = inner()
        steps.append((time.perf_counter() - t, len(events), llm.runner.last_was_decode))
        return events
    llm.step = step
    torch.cuda.synchronize()
    with watch_compiles() as compiled:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(out_lens), f"engine produced {tokens} tokens, expected {sum(out_lens)}"
    prompt_tokens = sum(len(p) for p in prompts)
    decode_steps = [s for s in steps if s[2]]
    prefill_time = sum(s[0] for s in steps if not s[2])
    decode_time = sum(s[0] for s in decode_steps)
    decode_tokens = sum(s[1] for s in decode_steps)
    result = dict(engine="course", model=args.model, num_seqs=len(prompts), output_tokens=tokens,
                  prompt_tokens=prompt_tokens, seconds=wall, tok_per_s=tokens / wall,
                  prefill_tok_per_s=prompt_tokens / max(prefill_time, 1e-9),
                  decode_tok_per_s=decode_tokens / max(decode_time, 1e-9), steps=len(steps),
                  mean_step_ms=1e3 * wall / max(len(steps), 1),
                  mean_decode_step_ms=1e3 * decode_time / max(len(decode_steps), 1),
                  kv_blocks=llm.runner.num_blocks, block_size=args.block_size,
                  cuda_graph_buckets=sorted(llm.runner.graphs), startup_s=startup,
                  triton_compiles_in_timed_run=compiled, free_gib_at_start=args._free_at_start)
    result["timeline"] = steps
    restore_calls()
    result["host_ms_per_step"] = {k: 1e3 * v / max(len(steps), 1) for k, v in host.items()}
    print("RESULT", {k: v for k, v in result.items() if k != "timeline"}, flush=True)
    if llm.runner.graphs:
        try:
            with torch.inference_mode():
                # the full-batch decode steps run right after the prefills: context ~ prompt + a few tokens
                full = min(len(prompts), args.max_num_seqs)
                result["gpu_decode_step_ms"] = graph_step_ms(llm, full, sum(map(len, prompts)) // len(prompts) + 32)
                walls = [s[0] for s in steps if s[2] and s[1] == full]
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
    llm.close()
    del llm, inner, step
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    return result


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


def roofline_line(eng: dict, prompts, out_lens) -> str:
    """The decode phase's bytes / the copy bandwidth measured now, beside the measured decode time (roofline.py)."""
    from .roofline import decode_bound
    n = eng["num_seqs"]
    bound = eng["decode_bound"] = decode_bound(eng["engine_bytes"], [len(p) for p in prompts[:n]], out_lens[:n],
                                               hbm_peak())
    tb = {k: v / 1e12 for k, v in bound["bytes"].items()}
    decode = sum(s[0] for s in eng["timeline"] if s[2])
    prefill = sum(s[0] for s in eng["timeline"] if not s[2])
    moe = " (experts: the expected distinct ones under uniform routing)" if eng["engine_bytes"]["num_experts"] else ""
    return (f"decode roofline at the copy bandwidth measured now ({bound['gb_per_s']:.0f} GB/s): K/V {tb['kv']:.2f} TB + "
            f"weights {tb['weights']:.2f} TB{moe} + GDN states {tb['gdn']:.2f} TB + logits {tb['logits']:.2f} TB over "
            f"{bound['steps']} steps = {bound['seconds']:.2f} s; measured decode {decode:.2f} s "
            f"({bound['seconds'] / max(decode, 1e-9):.0%} of the bound's speed); with the measured prefill time "
            f"({prefill:.2f} s) this workload is bounded at {eng['output_tokens'] / (bound['seconds'] + prefill):.0f} "
            f"output tok/s")


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
    """`./check.sh bench [options]` on a GPU (cli.py parsed argv into args; the child processes get argv again)."""
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
        results = [run_engine(args, prompts, out_lens)]
    table = Table(title=f"./check.sh bench --model {args.model}  ({torch.cuda.get_device_name()})")
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
    say(f"KV blocks {eng['kv_blocks']} × {eng['block_size']} tokens; CUDA-graph buckets {eng['cuda_graph_buckets']}; "
        f"start-up {eng['startup_s']:.1f} s")
    compiled = eng.get("triton_compiles_in_timed_run", [])
    say(f"Triton compiles during the timed run: {len(compiled)}"
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
            say(roofline_line(eng, prompts, out_lens))
        except Exception as exc:          # a diagnostic only: never lose the measured throughput over it
            say(f"roofline failed: {exc!r}")
    if args.peer == "hf":
        ours, hf = results[-2], results[-1]
        free = (ours["free_gib_at_start"], hf["free_gib_at_start"])
        if abs(free[0] - free[1]) > 0.05 * max(free):
            say(f"[red]不比较：两次运行开始时空闲显存不同（本课 {free[0]:.1f} GiB，HF {free[1]:.1f} GiB），条件不对等。[/]")
        else:
            say(f"[bold]ratio course / HF on the same {ours['num_seqs']} prompts, each in its own process "
                f"({free[0]:.1f} / {free[1]:.1f} GiB free at start): {ours['tok_per_s'] / hf['tok_per_s']:.1f}×[/]")
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            tl = eng["timeline"]
            t = [sum(s[0] for s in tl[:i + 1]) for i in range(len(tl))]
            fig, ax = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
            ax[0].plot(t, [s[1] / s[0] for s in tl], lw=0.6)
            ax[0].set_ylabel("tokens/s per step")
            ax[1].plot(t, [s[1] for s in tl], lw=0.6)
            ax[1].set_ylabel("tokens sampled")
            ax[1].set_xlabel("seconds")
            fig.savefig(args.plot, dpi=120)
        except ImportError:
            say("matplotlib 不可用，跳过 --plot")
    line = json.dumps([{k: v for k, v in r.items() if k != "timeline"} for r in results])
    print("BENCH_JSON " + line)
    if args.json:
        open(args.json, "w").write(line)
    return 0


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
