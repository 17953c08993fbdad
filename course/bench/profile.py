"""`./check.sh bench --profile`: where one prefill step and one decode step spend their time (torch.profiler).

On the bench workload (same prompts, same engine, warmed up as `./check.sh bench` does):
  prefill   the workload's prefill steps (16k prompt tokens each, the last ones mixed with decodes): step 2 under
            the profiler, every other one timed plainly; split into GPU kernel time by kernel class, GPU busy time (the union of kernel intervals)
            and the step's wall time; the rest of the wall time is the host (Python, launches, waiting)
  decode    the first decode step with the batch full, likewise (the steps before it unprofiled), then one
            CUDA-graph replay at batch 1 under the profiler: the GPU floor of a small-batch step
  mixed     a step where one new 110-token request (a chat turn whose prefix is cached) joins the running
            decodes: any prefill sends the whole batch down the eager path
  host      the CPU operators with the most self time in the profiled prefill step, and how many times the
            host waited for the device (cudaStreamSynchronize / cudaDeviceSynchronize / blocking memcpy)
The profiler adds a few microseconds of host time per operator: the plain wall times beside it are the
numbers to quote; the profiled step gives the split.
"""

from __future__ import annotations

import json
import random
import re
import time

from .common import build_engine, command_line, hbm_peak, machine_info, replay_ms, time_calls, watch_compiles, workload

# kernel name -> class (first match wins); everything else is "torch elementwise / other"
KERNEL_CLASSES = [
    ("GEMM (cuBLAS)", r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitKreduce|sm90_"),
    ("attention prefill (k02)", r"_prefill_kernel"),
    ("attention decode (k02)", r"_decode_split_kernel|_decode_reduce_kernel"),
    ("store_kvcache (k01)", r"_store_kvcache"),
    ("add_rms_norm (k01)", r"_add_rms_norm"),
    ("qk-norm + RoPE (g01)", r"_qk_norm_rope"),
    ("SiLU·up (g01)", r"_silu_mul"),
    ("fused MoE (k03)", r"_gate_up_kernel|_down_kernel|_count_kernel|_align_kernel"),
    ("FP8 MoE (k05)", r"_gate_up_fp8_kernel|_down_fp8_kernel"),
    ("FP8 linear (k05)", r"_fp8_linear_kernel"),
    ("activation quantization (k05)", r"_quant_act_kernel"),
    ("Gated DeltaNet (k04)", r"_conv_update|_conv_prefill|_conv_state|_chunk_prep|_chunk_state|_decode_rule"),
    ("gated RMSNorm (g01)", r"_norm_gated"),
    ("sampling (g01)", r"_sample_kernel"),
    ("memcpy / memset", r"[Mm]emcpy|[Mm]emset"),
]
# a decode step's byte floors (roofline.step_bytes_by_reader) and the kernel classes that must read those bytes;
# the logits are written by the LM head (a GEMM) and read by the sampler: half of their bytes each. The classes not
# named here (norms, RoPE, SiLU, activation quantization, elementwise) move activation-sized bytes: no floor of theirs
FLOORS = [
    ("K/V cache", "kv", ["attention decode (k02)"]),
    ("dense weights + logits write", "dense", ["GEMM (cuBLAS)", "FP8 linear (k05)"]),
    ("routed experts (expected distinct)", "experts", ["fused MoE (k03)", "FP8 MoE (k05)"]),
    ("GDN states (read + write)", "gdn", ["Gated DeltaNet (k04)"]),
    ("logits read", "sampling", ["sampling (g01)"]),
]
SYNC_CALLS = re.compile(r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy(?!Async)")


def _classify(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if re.search(pattern, name):
            return label
    return "torch elementwise / other"


def _split(prof, wall_ms: float) -> dict:
    """Kernel time by class, GPU busy time (union of the kernel intervals), span, host sync count, top CPU ops."""
    from torch.autograd import DeviceType
    kernels, syncs = [], 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels.append((e.time_range.start, e.time_range.end, e.name))
        elif SYNC_CALLS.search(e.name):
            syncs += 1
    by_class: dict[str, list[float]] = {}
    other: dict[str, list[float]] = {}              # the unclassified kernels by name: what fusing would remove
    def add(table: dict, key: str, ms: float) -> None:
        entry = table.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += ms

    for start, end, name in kernels:
        label = _classify(name)
        add(by_class, label, (end - start) / 1e3)
        if label == "torch elementwise / other":
            add(other, name[:90], (end - start) / 1e3)
    busy, last_end = 0.0, None
    for start, end, _ in sorted(kernels):
        if last_end is None or start >= last_end:
            busy += end - start
            last_end = end
        elif end > last_end:
            busy += end - last_end
            last_end = end
    span = (max(k[1] for k in kernels) - min(k[0] for k in kernels)) / 1e3 if kernels else 0.0
    cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                 key=lambda e: -e.self_cpu_time_total)[:10]
    return dict(wall_ms=wall_ms, kernels=len(kernels), gpu_busy_ms=busy / 1e3, gpu_span_ms=span,
                host_syncs=syncs, by_class={k: dict(count=v[0], ms=v[1]) for k, v in by_class.items()},
                top_cpu_ops=[(e.key, e.count, e.self_cpu_time_total / 1e3) for e in cpu],
                top_other_kernels=sorted(((k, v[0], v[1]) for k, v in other.items()), key=lambda kv: -kv[2])[:12])


def decode_floors(split: dict, sizes: dict, batch: int, context_tokens: int, gb_per_s: float) -> dict:
    """Each floor of a decode step of `batch` sequences (contexts adding up to `context_tokens`) beside the GPU time
    of the kernel classes that read those bytes: floor ms = bytes / the copy bandwidth measured in the same run, and
    the share floor / measured (1.0: those kernels run at copy speed). "rest" is the GPU time of every other class,
    "host" the wall time the GPU was idle (wall - GPU busy)."""
    from .roofline import step_bytes_by_reader
    b = step_bytes_by_reader(sizes, batch, context_tokens)
    b["dense"] += b["logits"] / 2
    b["sampling"] = b.pop("logits") / 2
    rows, named = {}, set()
    for label, key, classes in FLOORS:
        ms = sum(split["by_class"].get(c, {}).get("ms", 0.0) for c in classes)
        named.update(classes)
        if b[key] == 0 and ms == 0:
            continue                                    # e.g. no GDN in a Qwen3, no experts in a dense model
        floor = b[key] / (gb_per_s * 1e9) * 1e3
        rows[label] = dict(bytes=b[key], floor_ms=floor, ms=ms, share=floor / ms if ms else None, classes=classes)
    rest = sum(v["ms"] for c, v in split["by_class"].items() if c not in named)
    host = max(split["wall_ms"] - split["gpu_busy_ms"], 0.0)
    floor = sum(b.values()) / (gb_per_s * 1e9) * 1e3
    # the same rows as a list, then the time no byte floor accounts for (what the book's table renders)
    table = [dict(label=label, **r) for label, r in rows.items()]
    table += [dict(label="every other kernel (no byte floor)", bytes=0, floor_ms=0.0, ms=rest, share=None, classes=[]),
              dict(label="host (wall - GPU busy)", bytes=0, floor_ms=0.0, ms=host, share=None, classes=[])]
    return dict(gb_per_s=gb_per_s, batch=batch, context_tokens=context_tokens, rows=rows, table=table, rest_ms=rest,
                host_ms=host, step_floor_ms=floor,
                share_of_busy=floor / max(split["gpu_busy_ms"], 1e-9), share_of_wall=floor / max(split["wall_ms"], 1e-9))


def _say_floors(f: dict, say) -> None:
    from rich.table import Table
    table = Table(title=f"decode step at batch {f['batch']}, {f['context_tokens']} context tokens: each byte floor "
                        f"at the copy bandwidth measured now ({f['gb_per_s']:.0f} GB/s) beside the kernels that read it")
    for col in ("bytes", "GB", "floor ms", "kernels ms", "floor / kernels", "kernel classes"):
        table.add_column(col)
    for label, r in f["rows"].items():
        share = "—" if r["share"] is None else f"{r['share']:.0%}"
        table.add_row(label, f"{r['bytes'] / 1e9:.3f}", f"{r['floor_ms']:.3f}", f"{r['ms']:.3f}", share,
                      ", ".join(r["classes"]))
    table.add_row("every other kernel (no byte floor)", "", "", f"{f['rest_ms']:.3f}", "", "")
    table.add_row("host (wall - GPU busy)", "", "", f"{f['host_ms']:.3f}", "", "")
    say(table)
    say(f"the step's byte floor {f['step_floor_ms']:.3f} ms = {f['share_of_busy']:.0%} of its GPU busy time, "
        f"{f['share_of_wall']:.0%} of its wall time (profiled step)")


def _timed_step(llm) -> tuple[float, bool]:
    import torch
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.step()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t), llm.runner.last_was_decode


def _profiled(fn) -> tuple[object, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t)
    return prof, wall


def _say_split(title: str, split: dict, plain_ms: list[float], say) -> None:
    from rich.table import Table
    table = Table(title=title)
    for col in ("kernel class", "kernels", "GPU ms", "share of GPU busy"):
        table.add_column(col)
    for label, v in sorted(split["by_class"].items(), key=lambda kv: -kv[1]["ms"]):
        table.add_row(label, str(v["count"]), f"{v['ms']:.3f}", f"{v['ms'] / max(split['gpu_busy_ms'], 1e-9):.0%}")
    say(table)
    plain = ", ".join(f"{ms:.2f}" for ms in plain_ms)
    say(f"wall: {plain} ms (plain steps), {split['wall_ms']:.2f} ms (profiled step); GPU busy {split['gpu_busy_ms']:.2f} ms "
        f"({split['kernels']} kernels, first-to-last span {split['gpu_span_ms']:.2f} ms); "
        f"wall / GPU busy = {split['wall_ms'] / max(split['gpu_busy_ms'], 1e-9):.2f}; "
        f"host waits for the device: {split['host_syncs']}")
    if split.get("top_other_kernels"):
        say("torch elementwise / other, by kernel: " + "; ".join(
            f"{name} ×{n} {ms:.2f} ms" for name, n, ms in split["top_other_kernels"][:8]))


def profile_steps(args, say) -> int:
    """`./check.sh bench --profile [options]` (args parsed by cli.py, the same options as the throughput run)."""
    prompts, out_lens = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    gb_per_s = hbm_peak()                        # before the engine takes the card: the floors' bandwidth
    say(f"copy bandwidth (2 GiB device-to-device, median): {gb_per_s:.0f} GB/s")
    llm, SamplingParams, _ = build_engine(args, prompts)
    from .roofline import engine_bytes
    runner = getattr(llm.runner, "inner", llm.runner)
    sizes = engine_bytes(llm.model, runner)
    for p, n in zip(prompts, out_lens):
        llm.add_request(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
    report = {}
    with watch_compiles() as compiled:
        plain = [_timed_step(llm)[0]]
        prof, wall = _profiled(llm.step)
        if llm.runner.last_was_decode:
            say("[yellow]the second step was already a decode step: the workload has under two prefill steps[/]")
        report["prefill"] = _split(prof, wall)
        decode_plain = []
        host, restore = time_calls({"schedule": (llm.scheduler, "schedule"), "run": (llm.runner, "run"),
                                     "prefill forward launch": (runner, "_run_prefill"),
                                     "postprocess": (llm.scheduler, "postprocess")})
        while llm.has_unfinished():                 # the remaining prefill / mixed steps, plainly timed
            ms, was_decode = _timed_step(llm)
            (decode_plain if was_decode else plain).append(ms)
            if was_decode:
                break
        restore()
        report["prefill"]["plain_step_ms"] = plain
        report["prefill"]["host_ms_per_step"] = {k: v * 1e3 / max(len(plain) - 1, 1) for k, v in host.items()}
        _say_split(f"prefill step ({args.model}, {sum(map(len, prompts))} prompt tokens in all, "
                   f"max_num_batched_tokens 16384)", report["prefill"], plain, say)
        say("host ms per plain prefill step after the profiled one ('run' includes waiting for the GPU): "
            + ", ".join(f"{k} {v:.1f}" for k, v in report["prefill"]["host_ms_per_step"].items()))
        say("CPU operators by self time (profiled prefill step): "
            + "; ".join(f"{k} ×{n} {ms:.1f} ms" for k, n, ms in report["prefill"]["top_cpu_ops"][:8]))
        while llm.has_unfinished() and len(decode_plain) < 3:
            ms, was_decode = _timed_step(llm)
            if was_decode:
                decode_plain.append(ms)
                if len(decode_plain) >= 3:
                    break
        batch = len(llm.scheduler.running)
        context_tokens = sum(seq.num_tokens for seq in llm.scheduler.running)     # each one's whole context is read
        prof, wall = _profiled(llm.step)
        report["decode"] = _split(prof, wall)
        report["decode"]["batch"] = batch
        _say_split(f"decode step, batch {batch} (CUDA graph)", report["decode"], decode_plain, say)
        report["decode"]["floors"] = decode_floors(report["decode"], sizes, batch, context_tokens, gb_per_s)
        _say_floors(report["decode"]["floors"], say)
        if runner.graphs:
            one = min(runner.graphs)
            context = sum(map(len, prompts)) // len(prompts)
            replay_ms(runner, one, context, runner.num_blocks)          # stage a batch-1 replay, then profile one
            prof, wall = _profiled(runner.graphs[one].replay)
            report["decode_graph_b1"] = _split(prof, wall)
            _say_split(f"one CUDA-graph replay at batch {one}, context {context} (the GPU floor of a small-batch step)",
                       report["decode_graph_b1"], [], say)
            report["decode_graph_b1"]["floors"] = decode_floors(report["decode_graph_b1"], sizes, one, one * context,
                                                                gb_per_s)
            _say_floors(report["decode_graph_b1"]["floors"], say)
        # a mixed step: a new 110-token request joins the running decodes (a chat's next turn with its prefix
        # cached). Any prefill sends the whole batch down the eager path: this is what such a step costs
        while llm.has_unfinished() and len(llm.scheduler.running) >= args.max_num_seqs:
            llm.step()                                   # until a sequence has finished and left a free seat
        rng = random.Random(2)

        def join():                                      # one new 110-token request, answered in one step
            llm.add_request([rng.randrange(1, 10000) for _ in range(110)],
                            SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1))
        join()
        llm.step()                                       # the first one unprofiled: Triton compiles outside
        mixed_plain = []
        for _ in range(2):                               # two more timed plainly (the numbers to quote)
            join()
            mixed_plain.append(_timed_step(llm)[0])
        join()
        decodes = sum(s.num_tokens - s.num_cached_tokens == 1 for s in llm.scheduler.running)
        prof, wall = _profiled(llm.step)
        report["mixed"] = _split(prof, wall)
        report["mixed"]["decodes"], report["mixed"]["plain_ms"] = decodes, mixed_plain
        _say_split(f"mixed step: {decodes} decodes + one 110-token prefill (eager, no CUDA graph)", report["mixed"],
                   mixed_plain, say)
    say(f"Triton compiles during the profiled steps: {len(compiled)}"
        + (f" ({', '.join(sorted(set(compiled)))})" if compiled else ""))
    report["triton_compiles"] = compiled
    for part in ("prefill", "decode", "decode_graph_b1", "mixed"):
        if part in report:
            report[part]["top_cpu_ops"] = report[part]["top_cpu_ops"][:10]
    print("PROFILE_JSON " + json.dumps(report), flush=True)
    if args.json:                        # the same, with the command line, the machine and the versions
        doc = dict(report, model=args.model, dtype=getattr(args, "dtype", None),
                   command=command_line(getattr(args, "argv", [])), machine=machine_info())
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)
    llm.close()
    return 0
