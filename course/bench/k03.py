"""`./check.sh bench k03`: the fused MoE kernels beside two torch alternatives, on the GPU.

For Qwen3-30B-A3B's MoE layer (E=128, k=8, H=2048, I=768) and Qwen3.5-35B-A3B's (E=256, k=8, H=2048,
I=512, plus a 512-wide shared expert), bf16, decode batches 1..256 and an 8k-token prefill:
  fused    k03's fused_moe_forward (the selected implementation: yours once k03 passes, else the reference)
  loop     m03's moe_forward: one SwiGLU per expert launched from Python
  grouped  sort + torch grouped GEMM (torch.nn.functional.grouped_mm / torch._grouped_mm) when torch has it
Each line: ms, TFLOP/s, and at batch >= 64 the fraction of HBM bandwidth: bytes of the expert weights read
(every expert some token was routed to, plus the shared expert) / time, over a device-to-device copy
measured in the same run. Goal: >= 70 % at decode batch 256, and fused fastest everywhere.
"""

from __future__ import annotations

import torch

SHAPES = [dict(name="Qwen3-30B-A3B", experts=128, top_k=8, hidden=2048, inter=768, shared=0),
          dict(name="Qwen3.5-35B-A3B", experts=256, top_k=8, hidden=2048, inter=512, shared=512)]
DECODE = (1, 8, 32, 64, 128, 256)
PREFILL = 8192


def _grouped_mm():
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_torch_forward(x, w, m03, grouped_mm):
    """Route, sort the pairs by expert, two grouped GEMMs over all experts (offsets = cumulative counts)."""
    weights, ids = m03.route(x, w.router, w.top_k, w.norm_topk_prob)
    num_experts, inter = w.w_gate.shape[0], w.w_gate.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.int() if x.is_cuda else flat.float(), bins=num_experts, min=0, max=num_experts - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // w.top_k]
    gate_up = w.gate_up                                                        # [E, 2I, H]
    gu = grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)                    # [M, 2I]
    h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    y = grouped_mm(h, w.w_down.transpose(1, 2), offs=offs)                     # [M, H]
    y = y * weights.reshape(-1)[order, None]
    out = torch.zeros_like(y).index_copy_(0, order, y).view(x.shape[0], w.top_k, -1).sum(1)
    if w.shared is not None:
        s = w.shared
        out = out + torch.sigmoid(x @ s.gate.T) * m03.swiglu(x, s.gate_proj, s.up_proj, s.down_proj)
    return out


def _weights(shape, m03, gen):
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    rnd = lambda *s: (torch.randn(*s, device="cuda", generator=gen) * 0.02).bfloat16()  # noqa: E731
    gate_up = rnd(e, 2 * i, h)
    shared = None
    if shape["shared"]:
        si = shape["shared"]
        shared = m03.SharedExpert(rnd(si, h), rnd(si, h), rnd(h, si), rnd(1, h))
    w = m03.MoEWeights(router=rnd(e, h), w_gate=gate_up[:, :i], w_up=gate_up[:, i:], w_down=rnd(e, h, i),
                       top_k=shape["top_k"], norm_topk_prob=True, shared=shared)
    w.gate_up = gate_up                                                        # for the grouped baseline
    return w


def _copy_bandwidth(do_bench) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write), the practical HBM ceiling."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * (2 << 30) / (ms * 1e-3)


def bench_k03(opts, say=print) -> int:
    """`./check.sh bench k03 [--shapes 0,1] [--no-loop] [--solutions]` (opts parsed by cli.py); the exit status."""
    if not torch.cuda.is_available():
        say("./check.sh bench k03 需要 GPU（CUDA）：这台机器没有，benchmark 没有运行。")
        return 1
    import triton.testing

    from course.grader import select
    from course.runtime.run import kernel_source
    select.use({"default": "solutions", "k03_fused_moe": kernel_source("k03", opts.solutions)})
    k03, m03 = select.load("k03_fused_moe"), select.load("m03_sparse_moe")
    source = select.resolve("k03_fused_moe")
    do_bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    grouped_mm = _grouped_mm()
    copy_bw = _copy_bandwidth(do_bench)
    say(f"device: {torch.cuda.get_device_name()}   torch {torch.__version__}   triton {triton.__version__}")
    say(f"k03 from: {source}")
    say(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s (the HBM reference below)")
    if grouped_mm is None:
        say("grouped: this torch has neither torch.nn.functional.grouped_mm nor torch._grouped_mm; column skipped")
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = 1.0
    for idx in (int(i) for i in opts.shapes.split(",")):
        shape = SHAPES[idx]
        w = _weights(shape, m03, gen)
        e, k, h, i, si = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"], shape["shared"]
        say(f"\n{shape['name']}: E={e} k={k} H={h} I={i}" + (f" shared I_s={si}" if si else "") + " bf16")
        say(f"{'N':>6} {'experts hit':>11} | {'fused ms':>9} {'TFLOP/s':>7} {'HBM':>5} | {'loop ms':>9} | "
            f"{'grouped ms':>10} | {'fused/best other':>16}")
        for n in (*DECODE, PREFILL):
            x = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
            _, ids = m03.route(x, w.router, k, True)
            hit = int(torch.unique(ids).numel())
            flops = 2 * n * k * 3 * h * i + 2 * n * 3 * h * si + 2 * n * h * e
            weight_bytes = 2 * (hit * 3 * h * i + 3 * h * si + e * h)
            runs = {"fused": lambda: k03.fused_moe_forward(x, w)}
            if not (opts.no_loop and n == PREFILL):
                runs["loop"] = lambda: m03.moe_forward(x, w)
            if grouped_mm is not None:
                runs["grouped"] = lambda: grouped_torch_forward(x, w, m03, grouped_mm)
            ref = m03.moe_forward(x, w).float()
            times = {}
            for name, fn in runs.items():
                err = (fn().float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                if err > 5e-2:
                    say(f"  {name} at N={n}: relative error {err:.3g} against m03 (check it!)")
                times[name] = do_bench(fn)
            fused = times["fused"]
            others = [t for key, t in times.items() if key != "fused"]
            ratio = min(others) / fused if others else float("nan")
            worst = min(worst, ratio) if others else worst
            hbm = f"{weight_bytes / (fused * 1e-3) / copy_bw:5.0%}" if n >= 64 else f"{'':>5}"
            say(f"{n:>6} {hit:>11} | {fused:9.3f} {flops / (fused * 1e-3) / 1e12:7.1f} {hbm} | "
                f"{times.get('loop', float('nan')):9.3f} | {times.get('grouped', float('nan')):10.3f} | "
                f"{ratio:15.2f}x")
        del w
        torch.cuda.empty_cache()
    say(f"\nslowest ratio (best other / fused): {worst:.2f}x — fused is the fastest everywhere when this is >= 1")
    return 0
