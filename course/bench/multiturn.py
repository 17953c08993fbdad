"""`./check.sh bench --workload multiturn`: multi-turn chats on a hybrid model, prefix caching off and on (e07).

    ./check.sh bench --workload multiturn --model qwen3.5-35b-a3b     the H200 measurement (dummy bf16 weights)
    ./check.sh bench --workload multiturn --device cpu                a tiny hybrid on the CPU (a smoke test)

Workload (random.Random(0)): `conversations` chats share one system prompt of `system_len` random token ids;
turn 1 of chat c is the system prompt + a message of `message_len` tokens; each answer has
randint(answer_len // 2, answer_len + answer_len // 2) tokens, drawn per chat and turn (greedy, ignore_eos;
--fixed-answers: exactly answer_len, and then the chats run in lockstep: every chat ends each turn in the same
step, and all next turns arrive at once); turn t+1 = turn t's prompt + its answer + a new message. Closed
loop: every chat sends turn 1 at once, and each next turn as soon as the previous answer is complete. The
same engine settings run the whole workload twice in one process, caching off then on; before the clock
starts each engine runs the same workload with other tokens, so that no Triton kernel compiles inside the
timed run (the count of compiles seen there is reported, and must be 0). Reported per run: prompt tokens,
prefill tokens computed (prompt tokens the model actually ran), snapshot hits, mean / p50 / p90 / per-turn
time to first token (from submitting a turn to its first token), output tokens per second, wall time.
--repeats N: each engine runs the timed workload N times (after its one warm-up), each time with other tokens
(seeds 0, 2, 3, ...: nothing one run cached is hit by the next); the ratios are printed per run, and the median
of the per-run ratios is the result line.
"""

from __future__ import annotations

import json
import random
import statistics
import time

from ..runtime.run import tiny_hybrid_config
from .common import command_line, hf_config, machine_info, watch_compiles

CPU_DEFAULTS = dict(conversations=4, turns=3, system_len=96, message_len=16, answer_len=24, block_size=16,
                    max_num_batched_tokens=256, snapshots=16)
GPU_DEFAULTS = dict(conversations=64, turns=4, system_len=1000, message_len=100, answer_len=64, block_size=16,
                    max_num_batched_tokens=8192, snapshots=256)


def chats(args, seed: int = 0) -> tuple[list[int], list[list[list[int]]], list[list[int]]]:
    """The shared system prompt and, per chat, the new message and the answer length of every turn."""
    rng = random.Random(seed)
    vocab = args.vocab
    system = [rng.randrange(1, vocab) for _ in range(args.system_len)]
    messages = [[[rng.randrange(1, vocab) for _ in range(args.message_len)] for _ in range(args.turns)]
                for _ in range(args.conversations)]
    a = args.answer_len
    lengths = [[a if args.fixed_answers else rng.randint(max(1, a // 2), a + a // 2) for _ in range(args.turns)]
               for _ in range(args.conversations)]
    return system, messages, lengths


def run_chats(llm, SamplingParams, args, caching: bool, seed: int = 0) -> dict:
    """Drive the closed-loop chats through llm.step(); count what the model computed and when first tokens came.
    Engine counters (steps, hits, ...) are reported as the difference over this call."""
    system, messages, lengths = chats(args, seed)
    before = dict(llm.stats)
    computed = [0]
    inner_run = llm.runner.run

    def run(seqs):                   # prompt tokens this step computes (a recomputed answer after preemption: no)
        computed[0] += sum(min(s.num_scheduled_tokens, max(0, s.num_prompt_tokens - s.num_cached_tokens))
                           for s in seqs)
        return inner_run(seqs)
    llm.runner.run = run
    history = [system + messages[c][0] for c in range(args.conversations)]
    turn = [0] * args.conversations
    owner, submitted, ttft, answers, turn_of = {}, {}, [], {}, {}
    by_turn = [[] for _ in range(args.turns)]
    prompt_tokens = 0

    def submit(c):
        nonlocal prompt_tokens
        params = SamplingParams(temperature=0.0, max_tokens=lengths[c][turn[c]], ignore_eos=True)
        rid = llm.add_request(history[c], params)
        owner[rid], submitted[rid], answers[rid] = c, time.perf_counter(), []
        turn_of[rid] = turn[c]
        prompt_tokens += len(history[c])

    sync = _sync(llm)
    sync()
    t0 = time.perf_counter()
    for c in range(args.conversations):
        submit(c)
    output_tokens = 0
    while llm.has_unfinished():
        for rid, token, finished in llm.step():
            now = time.perf_counter()
            if not answers[rid]:
                ttft.append(now - submitted[rid])
                by_turn[turn_of[rid]].append(now - submitted[rid])
            answers[rid].append(token)
            output_tokens += 1
            if finished:
                c = owner[rid]
                llm.requests.pop(rid, None)
                turn[c] += 1
                if turn[c] < args.turns:
                    history[c] = history[c] + answers[rid] + messages[c][turn[c]]
                    submit(c)
    sync()
    wall = time.perf_counter() - t0
    llm.runner.run = inner_run
    stats = {k: v - before.get(k, 0) for k, v in llm.stats.items()}
    ttft_ms = sorted(1e3 * t for t in ttft)
    return dict(caching=caching, requests=len(ttft), prompt_tokens=prompt_tokens, prefill_computed=computed[0],
                snapshot_hits=stats.get("snapshot_hits", 0), snapshots_evicted=stats.get("snapshots_evicted", 0),
                preemptions=stats["preemptions"], steps=stats["steps"], output_tokens=output_tokens,
                mean_ttft_ms=statistics.fmean(ttft_ms), p50_ttft_ms=ttft_ms[len(ttft_ms) // 2],
                p90_ttft_ms=ttft_ms[min(len(ttft_ms) - 1, int(0.9 * len(ttft_ms)))],
                max_ttft_ms=ttft_ms[-1], mean_ttft_ms_by_turn=[round(1e3 * statistics.fmean(t), 1) for t in by_turn],
                tok_per_s=output_tokens / wall, seconds=wall)


def _sync(llm):
    import torch
    device = next(llm.model.parameters()).device
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def build(args, caching: bool):
    """One engine: g01's on CUDA, e05's on the CPU; the engine files the learner has passed, else the references."""
    from ..grader import select
    from ..runtime import run
    selection, report = run.auto_selection(gpu=args.device == "cuda")
    select.use(selection)
    kw = dict(max_num_seqs=max(args.conversations, 1), max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, block_size=args.block_size, enable_prefix_caching=caching,
              num_state_snapshots=args.snapshots)
    if args.device == "cuda":
        g01 = select.load("g01_gpu_engine")
        llm = g01.LLM(hf_config(args.model), gpu_memory_utilization=0.9, enforce_eager=args.enforce_eager, **kw)
    else:
        e05 = select.load("e05_engine")
        llm = e05.LLM(tiny_hybrid_config(), num_kvcache_blocks=args.num_kvcache_blocks, **kw)
    return llm, select.load("e01_sampling").SamplingParams, report


def repeat_seeds(repeats: int) -> list[int]:
    """The token seeds of the timed runs: 0, then 2, 3, ... (1 is the warm-up's). Each run has its own tokens, so a
    later run never hits what an earlier one cached; run i has the same tokens and answer lengths with caching off
    and on."""
    return [0] + list(range(2, repeats + 1))


def measure(args, caching: bool) -> list[dict]:
    import gc
    llm, SamplingParams, report = build(args, caching)
    # Triton compiles a kernel per specialisation on first use (0.1-1 s each, inside some request's TTFT): the
    # same workload with other tokens walks every path and shape first - prefill from zero and from a
    # snapshot, chunks of every size class, decode graphs
    run_chats(llm, SamplingParams, args, caching, seed=1)
    results = []
    for seed in repeat_seeds(args.repeats):
        with watch_compiles() as compiled:
            result = run_chats(llm, SamplingParams, args, caching, seed=seed)
        result["seed"] = seed
        result["triton_compiles_in_timed_run"] = len(compiled)
        result["compiled"] = sorted(set(compiled))
        result["engine files"] = ", ".join(path for _, path in report)
        print("RESULT", json.dumps(result), flush=True)
        results.append(result)
    if hasattr(llm, "close"):
        llm.close()
    del llm
    gc.collect()
    if args.device == "cuda":
        import torch
        torch.cuda.empty_cache()
    return results


def results_table(results: list[dict]):
    """Caching off and on, one row each: two-line headings and right-aligned numbers keep it within 80 columns, and a
    narrower terminal folds a cell onto more lines instead of cutting it (as ./check.sh show does)."""
    from rich import box
    from rich.table import Table
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    table.add_column("prefix\ncaching", overflow="fold")
    for heading in ("prompt\ntokens", "prefill\ncomputed", "snapshot\nhits", "TTFT ms\nmean", "TTFT ms\np50",
                    "TTFT ms\np90", "output\ntok/s", "wall\ns"):
        table.add_column(heading, justify="right", overflow="fold")
    for r in results:
        table.add_row("on" if r["caching"] else "off", str(r["prompt_tokens"]), str(r["prefill_computed"]),
                      str(r["snapshot_hits"]), f"{r['mean_ttft_ms']:.1f}", f"{r['p50_ttft_ms']:.1f}",
                      f"{r['p90_ttft_ms']:.1f}", f"{r['tok_per_s']:.0f}", f"{r['seconds']:.2f}")
    return table


def run(args, say) -> int:
    """`./check.sh bench --workload multiturn [options]` (args parsed by cli.py; None: the device's default)."""
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        say("[yellow]--device cuda 需要 NVIDIA GPU；这台机器没有。CPU 上的冒烟测试：--device cpu[/]")
        return 2
    for name, value in (GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    longest = args.system_len + args.turns * (args.message_len + args.answer_len + args.answer_len // 2)
    args.max_model_len = args.max_model_len or longest + 64
    args.vocab = 151936 if args.device == "cuda" else 512
    runs = list(zip(measure(args, caching=False), measure(args, caching=True)))
    results = list(runs[0])
    where = (f"{args.model}, {torch.cuda.get_device_name()}" if args.device == "cuda"
             else "CPU, tiny dummy Qwen3.5-MoE")
    say(f"multiturn: {args.conversations} chats × {args.turns} turns, system prompt {args.system_len}, "
        f"message {args.message_len}, answer {'' if args.fixed_answers else '≈'}{args.answer_len}  ({where})")
    say(results_table(results))
    per_run = [dict(seed=off["seed"], prefill_ratio=off["prefill_computed"] / max(on["prefill_computed"], 1),
                    ttft_ratio=off["mean_ttft_ms"] / max(on["mean_ttft_ms"], 1e-9),
                    tok_s_ratio=on["tok_per_s"] / max(off["tok_per_s"], 1e-9)) for off, on in runs]
    for (off, on), ratios in zip(runs, per_run):
        if len(runs) > 1:
            say(f"run with seed {ratios['seed']}: mean TTFT off {off['mean_ttft_ms']:.1f} ms, on {on['mean_ttft_ms']:.1f} ms "
                f"({ratios['ttft_ratio']:.2f}×); prefill {ratios['prefill_ratio']:.2f}× fewer")
        say(f"mean TTFT by turn (ms): off {off['mean_ttft_ms_by_turn']}, on {on['mean_ttft_ms_by_turn']}")
    fewer, faster, tok_s = (statistics.median(r[k] for r in per_run) for k in ("prefill_ratio", "ttft_ratio", "tok_s_ratio"))
    median = f"median of {len(runs)} runs: " if len(runs) > 1 else ""
    say(f"{median}prefill tokens computed: {fewer:.2f}× fewer with hybrid prefix caching (target ≥ 3×); "
        f"mean TTFT {faster:.2f}× lower (target ≥ 2×); output tok/s {tok_s:.2f}×")
    off, on = results
    compiles = sum(r["triton_compiles_in_timed_run"] for run in runs for r in run)
    if compiles:
        say(f"[yellow]计时期间 Triton 编译了 {compiles} 次（每次 0.1–1 s，不是引擎的工作）：这次的 TTFT 不可信[/]")
    say(f"engine files: {on['engine files']}")
    line = json.dumps(dict(off=off, on=on, prefill_ratio=fewer, ttft_ratio=faster, runs=per_run))
    print("BENCH_JSON " + line)
    if args.json:                    # the same, with every run, the command line, the machine and the versions
        doc = dict(json.loads(line), all_runs=[list(run) for run in runs],
                   command=command_line(getattr(args, "argv", [])), machine=machine_info())
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)
    return 0
