"""`./check.sh bench k05`: the FP8 kernels beside bf16 and torch's FP8 GEMM, on the GPU.

Linear layers of Qwen3-30B-A3B (qkv 5120x2048, o 2048x4096) and Qwen3-8B's MLP (gate_up 24576x4096, down 4096x12288),
bf16 activations, decode T = 1..256 and a 4096-token prefill:
  bf16        F.linear on the bf16 weights (cuBLAS)
  fp8         k05's fp8_linear: FP8 weights with 128x128 block scales, weight-only (the selected implementation)
  w8a8        k05's w8a8_linear: the activation quantization kernel plus the FP8 x FP8 GEMM
  scaled_mm   torch._scaled_mm on the same FP8 weights and 128x128 block scales, x quantized by k05's
              quantize_act_fp8 (1x128 groups) outside the timed call: cuBLAS's block-scaled FP8 GEMM, the same sums as
              w8a8 (g01's FP8Linear uses it from 128 tokens). Where torch refuses the shape or the scales (cuBLAS
              takes token counts in multiples of 4), '—' and why.
The FP8 MoE layer (Qwen3-30B-A3B: E=128, k=8, H=2048, I=768) at decode batch 256: k05's fused_experts_fp8
(weight-only and act_fp8) against k03's bf16 fused_experts, with the fraction of copy bandwidth: bytes of the expert
weights read (FP8 plus scales for k05, bf16 for k03) / time, over a device-to-device copy measured in the same run.
Each line: ms as median [min–max] and spread over the replays (common.time_cycled: a CUDA graph of back-to-back calls
cycling through buffer sets that together touch >= 2x the L2). Verdicts: fp8 faster than bf16 at decode (weight-only
reads half the bytes) and the FP8 MoE at batch 256 faster than k03's bf16 one, decided on the medians, and only where
the min–max ranges do not overlap.
"""

from __future__ import annotations

import torch

from .common import (VERDICTS, Report, Span, buffer_sets, copy_anchor, l2_bytes, say_out, time_cycled,
                     timing_legend, versus)
from .k03 import CELL, _cell

LINEARS = [("Qwen3-30B-A3B qkv", 5120, 2048), ("Qwen3-30B-A3B o_proj", 2048, 4096),
           ("Qwen3-8B gate_up", 24576, 4096), ("Qwen3-8B down", 4096, 12288)]
TOKENS = (1, 16, 64, 256, 4096)
DECODE_MAX = 256                   # rows with T <= this get the "fp8 faster than bf16" verdict
MOE = dict(name="Qwen3-30B-A3B", experts=128, top_k=8, hidden=2048, inter=768)
MOE_BATCH = 256


def _scaled_mm_call(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, k05):
    """The timed block-scaled torch._scaled_mm call on x quantized beforehand, or None with the reason when torch
    refuses it. cuBLAS reads the activation scales column-major ([T, K/128] with stride (1, T)) and the weight's
    [N/128, K/128] grid transposed."""
    scaled_mm = getattr(torch, "_scaled_mm", None)
    if scaled_mm is None:
        return None, "this torch has no torch._scaled_mm"
    xq, s_x = k05.quantize_act_fp8(x)
    s_x = s_x.t().contiguous().t()
    call = lambda: scaled_mm(xq, q.T, scale_a=s_x, scale_b=s.T, out_dtype=torch.bfloat16)  # noqa: E731
    try:
        y = call()
        ref = k05.w8a8_linear(x, q, s).float()
        err = (y.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    except (RuntimeError, TypeError, ValueError) as exc:
        return None, f"torch._scaled_mm refused: {str(exc).splitlines()[0][:100]}"
    if err > 1e-2:
        return None, f"torch._scaled_mm differs from w8a8 by {err:.2g} (relative): not the same sums"
    return call, ""


def bench_k05(opts, say=None) -> int:
    """`./check.sh bench k05 [--solutions] [--replays N] [--json FILE]`; the exit status."""
    if not torch.cuda.is_available():
        say_out("./check.sh bench k05 需要 GPU（CUDA）：这台机器没有，benchmark 没有运行。")
        return 1
    import triton

    from course.grader import select
    from course.runtime.run import kernel_source
    select.use({"default": "solutions", "k05_fp8": kernel_source("k05", opts.solutions)})
    k05, k03 = select.load("k05_fp8"), select.load("k03_fused_moe")
    rep = Report("k05", opts)
    say_out(f"device: {torch.cuda.get_device_name()}   torch {torch.__version__}   triton {triton.__version__}")
    say_out(f"k05 from: {select.resolve('k05_fp8')}")
    say_out(timing_legend(rep.replays))
    copy_bw, t_copy = copy_anchor(rep.replays)
    say_out(f"device-to-device copy: {copy_bw.mid / 1e3:.2f} TB/s [{copy_bw.lo / 1e3:.2f}–{copy_bw.hi / 1e3:.2f}], "
            f"波动 {t_copy.spread:.1%} (the HBM reference below)")
    rep.add("anchor: device-to-device copy", t_copy, rate=copy_bw.mid, rate_min=copy_bw.lo, rate_max=copy_bw.hi,
            unit="GB/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    try:
        for name, n, k in LINEARS:
            _linear(name, n, k, k05, gen, copy_bw, rep)
        _moe(k05, k03, gen, copy_bw, rep)
    finally:
        rep.save()
    return 0


def _linear(name, n, k, k05, gen, copy_bw, rep) -> None:
    w_bytes = n * k * 2
    sets = buffer_sets(w_bytes // 2, l2_bytes())                       # the FP8 weights alone touch 2x the L2
    weights = []
    for _ in range(sets):
        w = torch.randn(n, k, device="cuda", generator=gen).bfloat16() * 0.02
        q, s = k05.quantize_block_fp8(w)
        weights.append((w, q, s))
    say_out(f"\n{name}: N={n} K={k}; {sets} weight set(s); bf16 {w_bytes / 2**20:.0f} MiB, FP8 {n * k / 2**20:.0f} MiB")
    say_out(f"{'T':>6} | {'bf16 ms [min–max] spread':>{CELL}}  | {'fp8 ms [min–max] spread':>{CELL}}  {'HBM':>5} | "
            f"{'w8a8 ms [min–max] spread':>{CELL}}  | {'scaled_mm ms [min–max] spread':>{CELL}}  | bf16/fp8  fp8 更快？")
    for t_len in TOKENS:
        xs = [torch.randn(t_len, k, device="cuda", generator=gen).bfloat16() for _ in range(sets)]
        w, q, s = weights[0]
        exact = xs[0].float() @ (q.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).T
        for label, fn in (("fp8", k05.fp8_linear), ("w8a8", k05.w8a8_linear)):
            err = (fn(xs[0], q, s).float() - exact).abs().max().item() / max(exact.abs().max().item(), 1e-6)
            if err > (5e-2 if label == "w8a8" else 1e-2):
                say_out(f"  {label} at T={t_len}: relative error {err:.3g} against x @ dequantize(w)^T (check it!)")
        touched16 = w_bytes + 2 * t_len * (k + n)
        touched8 = n * k + 2 * t_len * (k + n)
        times = {
            "bf16": time_cycled(lambda j: (lambda x=xs[j], w=weights[j][0]: torch.nn.functional.linear(x, w)),
                                touched16, replays=rep.replays, max_sets=sets),
            "fp8": time_cycled(lambda j: (lambda x=xs[j], p=weights[j]: k05.fp8_linear(x, p[1], p[2])),
                               touched8, replays=rep.replays, max_sets=sets),
            "w8a8": time_cycled(lambda j: (lambda x=xs[j], p=weights[j]: k05.w8a8_linear(x, p[1], p[2])),
                                touched8, replays=rep.replays, max_sets=sets),
        }
        calls = [_scaled_mm_call(xs[j], weights[j][1], weights[j][2], k05) for j in range(sets)]
        note = next((why for call, why in calls if call is None), "")
        if not note:
            times["scaled_mm"] = time_cycled(lambda j: calls[j][0], touched8, replays=rep.replays, max_sets=sets)
        fp8 = times["fp8"]
        hbm = Span.rate((n * k + n * k // 16384 * 4) / 1e6, fp8).over(copy_bw)
        ratio = times["bf16"].median / fp8.median
        verdicts, text = {}, "—"
        if t_len <= DECODE_MAX:
            key, _ = versus(fp8, {"bf16": times["bf16"]})
            verdicts["fp8 比 bf16 快"] = key
            text = VERDICTS[key]
        if note:
            text += f"  （scaled_mm：{note}）"
        say_out(f"{t_len:>6} | {_cell(times['bf16'])} | {_cell(fp8)} {hbm.mid:5.0%} | {_cell(times['w8a8'])} | "
                f"{_cell(times.get('scaled_mm'))} | {ratio:7.2f}x  {text}")
        rep.add(f"{name} T={t_len}", fp8, verdicts, shape=name, tokens=t_len, hbm=hbm.mid, ratio=ratio,
                others={key: tm.as_dict() for key, tm in times.items() if key != "fp8"})
    del weights
    torch.cuda.empty_cache()


def _moe(k05, k03, gen, copy_bw, rep) -> None:
    e, k, h, i = MOE["experts"], MOE["top_k"], MOE["hidden"], MOE["inter"]
    n = MOE_BATCH
    bf16_bytes = 2 * e * 3 * h * i
    sets = buffer_sets(bf16_bytes // 2, l2_bytes())
    sets_w = []
    for _ in range(sets):
        gate_up = torch.randn(e, 2 * i, h, device="cuda", generator=gen).bfloat16() * 0.02
        down = torch.randn(e, h, i, device="cuda", generator=gen).bfloat16() * 0.02
        q_gu, s_gu = k05.quantize_block_fp8(gate_up)
        q_d, s_d = k05.quantize_block_fp8(down)
        sets_w.append((gate_up, down, q_gu, s_gu, q_d, s_d))
    say_out(f"\n{MOE['name']} MoE layer: E={e} k={k} H={h} I={i}, N={n}; {sets} weight set(s)")
    xs = [torch.randn(n, h, device="cuda", generator=gen).bfloat16() for _ in range(sets)]
    logits = torch.randn(n, e, device="cuda", generator=gen)
    topw, ids = torch.softmax(logits, -1).topk(k, -1)
    topw = (topw / topw.sum(-1, keepdim=True)).bfloat16()
    hit = int(torch.unique(ids).numel())
    ni = i // 128

    def fp8_call(j, act):
        gu, dn, q_gu, s_gu, q_d, s_d = sets_w[j]
        return lambda: k05.fused_experts_fp8(xs[j], q_gu[:, :i], q_gu[:, i:], q_d, s_gu[:, :ni], s_gu[:, ni:], s_d,
                                             topw, ids, act_fp8=act)

    def bf16_call(j):
        gu, dn = sets_w[j][:2]
        return lambda: k03.fused_experts(xs[j], gu[:, :i], gu[:, i:], dn, topw, ids)

    touched16 = 2 * hit * 3 * h * i + 2 * n * h * 2
    touched8 = hit * 3 * h * i + 2 * n * h * 2
    times = {"k03 bf16": time_cycled(bf16_call, touched16, replays=rep.replays, max_sets=sets),
             "fp8": time_cycled(lambda j: fp8_call(j, False), touched8, replays=rep.replays, max_sets=sets),
             "fp8 act_fp8": time_cycled(lambda j: fp8_call(j, True), touched8, replays=rep.replays, max_sets=sets)}
    say_out(f"{'':>12} | {'ms [min–max] spread':>{CELL}}  {'HBM':>5}   ({hit} experts hit)")
    for name, t in times.items():
        nbytes = hit * 3 * h * i * (2 if name == "k03 bf16" else 1)
        hbm = Span.rate(nbytes / 1e6, t).over(copy_bw)
        say_out(f"{name:>12} | {_cell(t)} {hbm.mid:5.0%}")
    key, _ = versus(times["fp8"], {"k03 bf16": times["k03 bf16"]})
    say_out(f"FP8 MoE（weight-only）比 k03 的 bf16 快？{VERDICTS[key]}")
    rep.add(f"{MOE['name']} MoE N={n}", times["fp8"], {"fp8 MoE 比 bf16 快": key}, n=n, experts_hit=hit,
            others={name: t.as_dict() for name, t in times.items() if name != "fp8"})
    del sets_w
    torch.cuda.empty_cache()
