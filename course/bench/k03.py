"""`./check.sh bench k03`: the fused MoE kernels beside two torch alternatives, on the GPU.

For Qwen3-30B-A3B's MoE layer (E=128, k=8, H=2048, I=768) and Qwen3.5-35B-A3B's (E=256, k=8, H=2048,
I=512, plus a 512-wide shared expert), bf16, decode batches 1..256 and an 8k-token prefill:
  fused    k03's fused_moe_forward (the selected implementation: yours once k03 passes, else the reference)
  loop     m03's moe_forward: one SwiGLU per expert launched from Python
  grouped  sort + torch grouped GEMM (torch.nn.functional.grouped_mm / torch._grouped_mm) when torch has it
Each line: ms as median [min–max] and spread over the replays (common.time_cycled: a CUDA graph of back-to-back calls
cycling through buffer sets, each with its own weights and x, that together touch >= 2x the L2; the loop syncs with the
host, so it runs eagerly between CUDA events, marked *), TFLOP/s, and at batch >= 64 the fraction of HBM bandwidth:
bytes of the expert weights read (every expert some token was routed to, plus the shared expert) / time, over a
device-to-device copy measured in the same run. Goal: >= 70 % at decode batch 256, and fused fastest everywhere:
decided on the medians, and only where fused's min–max range does not overlap the other's (else: cannot decide).
"""

from __future__ import annotations

import torch

from .common import (VERDICTS, Report, Span, at_least, buffer_sets, copy_anchor, l2_bytes, say_out, time_cycled,
                     timing_legend, versus)

SHAPES = [dict(name="Qwen3-30B-A3B", experts=128, top_k=8, hidden=2048, inter=768, shared=0),
          dict(name="Qwen3.5-35B-A3B", experts=256, top_k=8, hidden=2048, inter=512, shared=512)]
DECODE = (1, 8, 32, 64, 128, 256)
PREFILL = 8192
HBM_BATCH = 256                    # the goal ">= 70 % of the copy bandwidth" is at decode batch 256


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


def bench_k03(opts, say=None) -> int:
    """`./check.sh bench k03 [--shapes 0,1] [--no-loop] [--solutions] [--replays N] [--json FILE]` (opts parsed by
    cli.py); the exit status. Prints plain lines (say, the CLI's rich printer, would read "[...]" as markup)."""
    if not torch.cuda.is_available():
        say_out("./check.sh bench k03 需要 GPU（CUDA）：这台机器没有，benchmark 没有运行。")
        return 1
    import triton

    from course.grader import select
    from course.runtime.run import kernel_source
    select.use({"default": "solutions", "k03_fused_moe": kernel_source("k03", opts.solutions)})
    k03, m03 = select.load("k03_fused_moe"), select.load("m03_sparse_moe")
    source = select.resolve("k03_fused_moe")
    rep = Report("k03", opts)
    grouped_mm = _grouped_mm()
    say_out(f"device: {torch.cuda.get_device_name()}   torch {torch.__version__}   triton {triton.__version__}")
    say_out(f"k03 from: {source}")
    say_out(timing_legend(rep.replays))
    copy_bw, t_copy = copy_anchor(rep.replays)                   # GB/s
    say_out(f"device-to-device copy: {copy_bw.mid / 1e3:.2f} TB/s [{copy_bw.lo / 1e3:.2f}–{copy_bw.hi / 1e3:.2f}], "
            f"波动 {t_copy.spread:.1%} (the HBM reference below)")
    rep.add("anchor: device-to-device copy", t_copy, rate=copy_bw.mid, rate_min=copy_bw.lo,
            rate_max=copy_bw.hi, unit="GB/s")
    if grouped_mm is None:
        say_out("grouped: this torch has neither torch.nn.functional.grouped_mm nor torch._grouped_mm; column skipped")
    say_out("loop（标 *）：m03 的 moe_forward 用 .tolist() 把每个 expert 的 token 数拿回 host，不能进 CUDA graph，"
            f"改为 eager：{LOOP_NOTE}；别的列若也标 *，行尾写明原因")
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = float("inf")
    try:
        for idx in (int(i) for i in opts.shapes.split(",")):
            _shape(SHAPES[idx], k03, m03, grouped_mm, gen, copy_bw, opts, rep)
            for row in rep.rows:
                if row.get("shape") == SHAPES[idx]["name"] and row.get("ratio") is not None:
                    worst = min(worst, row["ratio"])
        _closing(rep, worst)
    finally:
        rep.save()
    return 0


LOOP_NOTE = "背靠背的 eager 调用夹在 CUDA event 之间计时，含 host 同步"
CELL = 26


def _cell(t) -> str:
    if t is None:
        return f"{'—':>{CELL}}"
    text = f"{t.median:.3f} [{t.lo:.3f}–{t.hi:.3f}] {t.spread:4.0%}"
    return f"{text:>{CELL}}" + ("*" if t.method != "graph" else " ")


def _shape(shape, k03, m03, grouped_mm, gen, copy_bw, opts, rep) -> None:
    e, k, h, i, si = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"], shape["shared"]
    # the buffer sets: each its own weights (in the engine every layer's experts are other weights) and its own x;
    # as many weight sets as the smallest row (N = 1: k experts hit) needs to touch 2x the L2 per cycle
    smallest = 2 * (k * 3 * h * i + 3 * h * si + e * h)
    weight_sets = buffer_sets(smallest, l2_bytes())
    weights = [_weights(shape, m03, gen) for _ in range(weight_sets)]
    say_out(f"\n{shape['name']}: E={e} k={k} H={h} I={i}" + (f" shared I_s={si}" if si else "") +
            f" bf16; {weight_sets} weight set(s) of {sum(p.nbytes for p in _tensors(weights[0])) / 2**30:.2f} GiB")
    say_out(f"{'N':>6} {'experts hit':>11} | {'fused ms [min–max] spread':>{CELL}}  {'TFLOP/s':>7} {'HBM':>5} | "
            f"{'loop ms [min–max] spread':>{CELL}}  | {'grouped ms [min–max] spread':>{CELL}}  | "
            f"{'best other/fused':>16}  fused 最快？")
    for n in (*DECODE, PREFILL):
        xs = {}

        def x_of(j):
            if j not in xs:
                xs[j] = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
            return xs[j]
        x0, w0 = x_of(0), weights[0]
        _, ids = m03.route(x0, w0.router, k, True)
        hit = int(torch.unique(ids).numel())
        flops = 2 * n * k * 3 * h * i + 2 * n * 3 * h * si + 2 * n * h * e
        weight_bytes = 2 * (hit * 3 * h * i + 3 * h * si + e * h)
        touched = weight_bytes + 2 * n * h * 2 + 2 * n * k * (2 * i + h) * 2     # x, out; h and y per pair
        runs = {"fused": (lambda x, w: k03.fused_moe_forward(x, w), True)}
        if not (opts.no_loop and n == PREFILL):
            runs["loop"] = (lambda x, w: m03.moe_forward(x, w), LOOP_NOTE)
        if grouped_mm is not None:
            runs["grouped"] = (lambda x, w: grouped_torch_forward(x, w, m03, grouped_mm), True)
        ref = m03.moe_forward(x0, w0).float()
        times = {}
        for name, (fn, graph) in runs.items():
            err = (fn(x0, w0).float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            if err > 5e-2:
                say_out(f"  {name} at N={n}: relative error {err:.3g} against m03 (check it!)")
            times[name] = time_cycled(lambda j, fn=fn: (lambda x=x_of(j), w=weights[j % weight_sets]: fn(x, w)),
                                      touched, graph=graph, replays=rep.replays, max_sets=weight_sets)
        fused = times["fused"]
        others = {key: t for key, t in times.items() if key != "fused"}
        ratio = min(t.median for t in others.values()) / fused.median if others else None
        hbm = Span.rate(weight_bytes / 1e6, fused).over(copy_bw)
        verdicts = {}
        if others:
            key, who = versus(fused, others)
            verdicts["fused 最快"] = key
            text = {"slower": f"✗ {who} 更快", "overlap": f"? 与 {who} 区间重叠，不下结论"}.get(key, VERDICTS[key])
        else:
            text = "—"
        if n == HBM_BATCH:
            verdicts["HBM ≥ 70 %"] = at_least(hbm, 0.70, fused)
            text += f"；HBM ≥ 70 %：{VERDICTS[verdicts['HBM ≥ 70 %']]}"
        for t in times.values():
            if t.method != "graph" and t.note != LOOP_NOTE:
                text += f"  （{t.note}）"
        hbm_cell = f"{hbm.mid:5.0%}" if n >= 64 else f"{'':>5}"
        say_out(f"{n:>6} {hit:>11} | {_cell(fused)} {flops / (fused.median * 1e-3) / 1e12:7.1f} {hbm_cell} | "
                f"{_cell(times.get('loop'))} | {_cell(times.get('grouped'))} | "
                f"{(f'{ratio:.2f}x' if ratio else '—'):>16}  {text}")
        rep.add(f"{shape['name']} N={n}", fused, verdicts, shape=shape["name"], n=n, experts_hit=hit,
                tflops=flops / (fused.median * 1e-3) / 1e12, hbm=hbm.mid, hbm_min=hbm.lo, hbm_max=hbm.hi, ratio=ratio,
                others={key: t.as_dict() for key, t in others.items()})
        del xs
    del weights
    torch.cuda.empty_cache()


def _tensors(w):
    found = [w.router, w.gate_up, w.w_down]
    if w.shared is not None:
        s = w.shared
        found += [s.gate_proj, s.up_proj, s.down_proj, s.gate]
    return found


def _closing(rep, worst: float) -> None:
    """fused fastest everywhere? Decided on the medians where the min–max ranges do not overlap; else undecided."""
    rows = [r for r in rep.rows if "fused 最快" in r["verdicts"]]
    if not rows:
        say_out("\nno other implementation was timed: no verdict on fused fastest everywhere")
        return
    keys = {r["name"]: r["verdicts"]["fused 最快"] for r in rows}
    slower = [name for name, key in keys.items() if key == "slower"]
    unsure = [name for name, key in keys.items() if key in ("overlap", "noisy")]
    say_out(f"\nslowest ratio of medians (best other / fused): {worst:.2f}x")
    if slower:
        verdict = "slower"
        say_out(f"fused 处处最快？否：{'、'.join(slower)} 处别的写法更快（区间不重叠）")
    elif unsure:
        verdict = "undecided"
        fastest = len(rows) - len(unsure)
        say_out(f"fused 处处最快？无法判定：{'、'.join(unsure)} 处区间重叠或波动过大"
                + (f"；其余 {fastest} 处 fused 最快（区间不重叠）" if fastest else ""))
    else:
        verdict = "fastest"
        say_out(f"fused 处处最快？是：{len(rows)} 行都比其余写法快，且最小–最大区间都不重叠")
    rep.add("fused fastest everywhere", None, {"fused 处处最快": verdict})
