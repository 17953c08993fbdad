"""`./check.sh bench k01|k02 [--solutions] [--replays N] [--json FILE]`: speed of the Track K kernels beside anchors
measured in the same run.

Every row is timed by common.time_cycled: a CUDA graph of back-to-back calls cycling through buffer sets that together
touch at least 2x the L2 (read off the device), replayed N times; a row prints the median per call, the min–max over
the replays and the spread (max - min) / median, and a row whose spread exceeds common.SPREAD_LIMIT gets no verdict.
A verdict against a target is given only when the whole min–max range is on one side of it. Anchors:
  copy          a device-to-device copy of 2 GiB (bytes read + written per second), timed the same way
  k01           store_kvcache and add_rms_norm at 8k tokens: bytes moved / time vs the copy (target >= 80 %); beside the
                torch copy of the same bytes and torch's eager add + RMSNorm
  k02 decode    bf16, batch 256, contexts U(512, 4096), D 128, nKV 8, nH 16 / 32: K/V bytes read / time vs the copy
                (target >= 80 %); beside torch SDPA on the keys already gathered and padded
  k02 prefill   bf16, 8k tokens in 8 / 16 / 64 sequences, D 128, nH 32, nKV 8, causal: TFLOP/s vs torch SDPA's
                flash backend on the same unpaged problem (target >= 0.9x); paged vs unpaged time (target <= 1.15)
"""

from __future__ import annotations

import os
import random

from ..grader import select
from .common import (VERDICTS, Report, Span, Timing, at_least, at_most, copy_anchor, say_out, time_cycled,
                     timing_legend)

NAME_WIDTH = 74
# the problem sizes (module constants: a CPU dry run of the bench's plumbing shrinks them)
K01 = dict(tokens=8192, hidden=(1024, 4096), heads=32)
K02 = dict(batch=256, context=(512, 4096), prefill_tokens=8192, prefill_seqs=(8, 16, 64))


def _pad(text: str, width: int, right: bool = False) -> str:
    """text in `width` terminal cells (a CJK character takes two)."""
    from rich.cells import cell_len
    fill = " " * max(0, width - cell_len(text))
    return fill + text if right else text + fill


def _row(rep: Report, name: str, t: Timing, amount: float, unit: str, anchor: Span | None = None,
         target: tuple[str, float, str] | None = None, extra: tuple[str, Span] | None = None) -> dict:
    """Print and record one row: time (median [min–max] spread), rate, share of the anchor, and the verdict.
    target = (label, value, what): `what` is "anchor" (rate / anchor >= value) or "extra" (extra's Span <= value)."""
    scale = 1e6 if unit == "GB/s" else 1e9                # amount per ms -> GB/s or TFLOP/s
    rate = Span.rate(amount / scale, t)
    share = rate.over(anchor) if anchor else None
    text = f"  {name:<{NAME_WIDTH}} {t.cell():>30}  {rate.mid:8.1f} {unit:<7}"
    text += f" {share.mid:6.1%} of anchor" if share else " " * 17
    verdicts = {}
    if target:
        label, value, what = target
        if what == "anchor":
            key = at_least(share, value, t)
        else:
            key = at_most(extra[1], value, t)
            text += f"  {extra[0]} = {extra[1].mid:.2f} [{extra[1].lo:.2f}–{extra[1].hi:.2f}]"
        verdicts[label] = key
        text += f"  {label}：{VERDICTS[key]}"
    if t.method != "graph":
        text += f"  （eager：{t.note}）"
    if not t.cold:
        text += "  （缓冲区合计没超过 L2）"
    say_out(text)
    return rep.add(name, t, verdicts, rate=rate.mid, rate_min=rate.lo, rate_max=rate.hi, unit=unit,
                   of_anchor=share.mid if share else None)


def _memo(build):
    """build(i) once per i: several rows share one set of buffers."""
    made = {}

    def get(i):
        if i not in made:
            made[i] = build(i)
        return made[i]
    return get


def bench_k01(m, rep: Report, peak: Span) -> None:
    import torch
    bf16 = torch.bfloat16
    n, nkv, d, page, nh = K01["tokens"], 8, 128, 16, K01["heads"]
    target = ("目标 ≥ 80 %", 0.80, "anchor")

    def store_set(i):
        qkv = torch.randn(n, (nh + 2 * nkv) * d, dtype=bf16, device="cuda")
        _, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        kc = torch.zeros(n // page + 16, page, nkv, d, dtype=bf16, device="cuda")
        slots = torch.randperm(kc.shape[0] * page, device="cuda")[:n]
        return k.view(n, nkv, d), v.view(n, nkv, d), kc, torch.zeros_like(kc), slots
    moved = 2 * 2 * n * nkv * d * 2                                  # k and v, read and written
    stores = _memo(store_set)
    _row(rep, "store_kvcache 8k tokens, nKV 8, D 128 (strided k/v)",
         time_cycled(lambda i: (lambda a=stores(i): m.store_kvcache(*a)), moved, replays=rep.replays),
         moved, "GB/s", peak, target)
    del stores

    def copy_set(i):                                 # the anchor at this size: the same bytes in one contiguous copy
        a = torch.empty(moved // 4, dtype=torch.int16, device="cuda")
        b = torch.empty_like(a)
        return lambda: b.copy_(a)
    _row(rep, "  torch D2D copy of the same bytes (one launch, contiguous)",
         time_cycled(copy_set, moved, replays=rep.replays), moved, "GB/s", peak)
    for hidden in K01["hidden"]:
        w = torch.randn(hidden, dtype=bf16, device="cuda")
        data = _memo(lambda i: (torch.randn(n, hidden, dtype=bf16, device="cuda"),
                                torch.randn(n, hidden, dtype=bf16, device="cuda")))
        moved = 4 * n * hidden * 2                                    # x, residual in; normed, residual out
        _row(rep, f"add_rms_norm 8k x {hidden} with residual",
             time_cycled(lambda i: (lambda a=data(i): m.add_rms_norm(a[0], a[1], w, 1e-6)), moved, replays=rep.replays),
             moved, "GB/s", peak, target)

        def eager(x, res):
            s = x + res
            h = s.float()
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(s.dtype), s
        _row(rep, f"  torch eager add + RMSNorm 8k x {hidden} (same bytes)",
             time_cycled(lambda i: (lambda a=data(i): eager(*a)), moved, replays=rep.replays), moved, "GB/s", peak)
        del data
    wq = torch.randn(128, dtype=bf16, device="cuda")
    qs = _memo(lambda i: torch.randn(n, nh, d, dtype=bf16, device="cuda"))
    moved = 2 * n * nh * d * 2
    _row(rep, "add_rms_norm per-head q norm [8k, 32, 128]",
         time_cycled(lambda i: (lambda q=qs(i): m.add_rms_norm(q, None, wq, 1e-6)), moved, replays=rep.replays),
         moved, "GB/s", peak, target)


def _paged(lens, nkv, d, page, dtype, gen):
    """A shuffled paged cache holding len(lens) sequences; block tables [B, M] (-1 padded)."""
    import torch
    nblocks = [-(-n // page) for n in lens]
    total = sum(nblocks)
    perm = torch.randperm(total, device="cuda", generator=gen).int()
    tables = torch.full((len(lens), max(nblocks)), -1, dtype=torch.int32, device="cuda")
    start = 0
    for b, nb in enumerate(nblocks):
        tables[b, :nb] = perm[start:start + nb]
        start += nb
    kc = torch.randn(total, page, nkv, d, dtype=dtype, device="cuda", generator=gen)
    vc = torch.randn_like(kc)
    return kc, vc, tables


def _gather(cache, tables, lens, page):
    import torch
    rows = []
    for b, n in enumerate(lens):
        j = torch.arange(n, device="cuda")
        rows.append(tables[b, j // page].long() * page + j % page)
    return cache.view(-1, *cache.shape[2:])[torch.cat(rows)]


def _padded(kc, vc, tables, lens, page):
    """The keys and values of a paged cache gathered into [B, nKV, longest, D] (zero padded) for torch SDPA."""
    import torch
    longest, nkv, d = max(lens), kc.shape[2], kc.shape[3]
    keys = torch.zeros(len(lens), nkv, longest, d, dtype=kc.dtype, device="cuda")
    values = torch.zeros_like(keys)
    flat_k, flat_v = _gather(kc, tables, lens, page), _gather(vc, tables, lens, page)
    start = 0
    for b, n in enumerate(lens):
        keys[b, :, :n] = flat_k[start:start + n].transpose(0, 1)
        values[b, :, :n] = flat_v[start:start + n].transpose(0, 1)
        start += n
    return keys, values


def bench_k02(m, rep: Report, peak: Span) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    bf16, d, nkv, page = torch.bfloat16, 128, 8, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = random.Random(0)

    say_out("decode (one query per sequence; bytes = K and V read)")
    batch = K02["batch"]
    lens = [rnd.randint(*K02["context"]) for _ in range(batch)]
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * sum(lens) * nkv * d * 2
    caches = _memo(lambda i: _paged(lens, nkv, d, page, bf16, gen))          # the same contexts, other blocks
    longest = max(lens)
    mask = (torch.arange(longest, device="cuda")[None, :] < ctx[:, None])[:, None, None, :]
    padded = _memo(lambda i: _padded(*caches(i), lens, page))
    for nh in (16, 32):
        queries = _memo(lambda i: torch.randn(batch, nh, d, dtype=bf16, device="cuda", generator=gen))
        for splits in (1, 2, 4, 8):
            def make(i, splits=splits):
                kc, vc, tables = caches(i)
                q = queries(i)
                return lambda: m.decode_attention(q, kc, vc, tables, ctx, d ** -0.5, splits)
            _row(rep, f"decode_attention B 256, nH {nh}, nKV 8, D 128, splits {splits}",
                 time_cycled(make, kv_bytes, replays=rep.replays), kv_bytes, "GB/s", peak,
                 ("目标 ≥ 80 %", 0.80, "anchor"))

        def sdpa(i):              # torch SDPA on the same keys, gathered and padded to the longest context (not timed)
            keys, values = padded(i)
            qs = queries(i)[:, :, None, :]
            return lambda: F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)
        _row(rep, f"  torch SDPA on gathered, padded K/V (nH {nh}; counts only real K/V bytes)",
             time_cycled(sdpa, 2 * batch * nkv * longest * d * 2, replays=rep.replays), kv_bytes, "GB/s", peak)
        del queries
    del caches, padded

    say_out("prefill (8k tokens, causal, no prefix; FLOPs = 4 * D * nH * sum L(L+1)/2)")
    nh, total = 32, K02["prefill_tokens"]
    for num_seqs in K02["prefill_seqs"]:
        length = total // num_seqs
        lens = [length] * num_seqs
        flops = 4 * d * nh * sum(n * (n + 1) / 2 for n in lens)
        cu = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")

        def build(i):
            q = torch.randn(total, nh, d, dtype=bf16, device="cuda", generator=gen)
            kc, vc, tables = _paged(lens, nkv, d, page, bf16, gen)
            k, v = _gather(kc, tables, lens, page), _gather(vc, tables, lens, page)
            qb = q.view(num_seqs, length, nh, d).transpose(1, 2)
            kb = k.view(num_seqs, length, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
            vb = v.view(num_seqs, length, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
            return dict(q=q, kc=kc, vc=vc, tables=tables, k=k, v=v, qb=qb, kb=kb, vb=vb)
        sets = _memo(build)
        touched = 2 * total * nh * d * 2 + 2 * total * nkv * d * 2             # q in, o out; K and V

        def flash(i):
            s = sets(i)

            def call():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(s["qb"], s["kb"], s["vb"], is_causal=True)
            return call
        t_sdpa = time_cycled(flash, touched + 2 * total * (nh - nkv) * d * 2, replays=rep.replays)
        sdpa_rate = Span.rate(flops / 1e9, t_sdpa)
        _row(rep, f"torch SDPA flash, {num_seqs} x {length} (unpaged, K/V repeated)", t_sdpa, flops, "TFLOP/s")
        t_unpaged = time_cycled(lambda i: (lambda s=sets(i): m.flash_attention_varlen(
            s["q"], s["k"], s["v"], cu, cu, length, d ** -0.5)), touched, replays=rep.replays)
        _row(rep, f"flash_attention_varlen, {num_seqs} x {length} (unpaged)", t_unpaged, flops, "TFLOP/s", sdpa_rate,
             ("目标 ≥ 90 % of SDPA flash", 0.90, "anchor"))
        t_paged = time_cycled(lambda i: (lambda s=sets(i): m.prefill_attention(
            s["q"], s["kc"], s["vc"], cu, cu, s["tables"], length, d ** -0.5)), touched, replays=rep.replays)
        _row(rep, f"prefill_attention, {num_seqs} x {length} (paged, P {page})", t_paged, flops, "TFLOP/s", sdpa_rate,
             ("目标 paged/unpaged ≤ 1.15", 1.15, "extra"), ("paged/unpaged 时间", t_paged.span().over(t_unpaged.span())))
        del sets


def bench_kernel(exercise_id: str, opts) -> int:
    """`./check.sh bench k01|k02 [--solutions] [--replays N] [--json FILE]` (parsed by cli.py); the exit status."""
    import torch
    if not torch.cuda.is_available():
        say_out(f"./check.sh bench {exercise_id}：需要 GPU（CUDA），这台机器上没有。正确性检查请运行 ./check.sh {exercise_id}。")
        return 1
    module = {"k01": "k01_triton_basics", "k02": "k02_paged_attention"}[exercise_id]
    from ..runtime.run import kernel_source
    source = kernel_source(exercise_id, opts.solutions)
    os.environ[select.ENV] = select.encode({"default": "solutions", module: source})
    m = select.load(module)
    rep = Report(exercise_id, opts)
    say_out(f"{exercise_id} benchmark ({source}/{module}.py) on {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}")
    say_out(timing_legend(rep.replays))
    peak, t_peak = copy_anchor(rep.replays)
    nbytes = t_peak.touched / 2
    say_out(f"  anchor: device-to-device copy of {nbytes / 2**30:g} GiB = {peak.mid:.0f} GB/s "
            f"[{peak.lo:.0f}–{peak.hi:.0f}], 波动 {t_peak.spread:.1%} (the HBM peak used below)")
    rep.add("anchor: device-to-device copy", t_peak, rate=peak.mid, rate_min=peak.lo, rate_max=peak.hi, unit="GB/s",
            nbytes=nbytes)
    say_out(f"  {'':<{NAME_WIDTH}} {_pad('每次调用：中位数 [最小–最大] 波动', 30, right=True)}  "
            f"{_pad('速率（中位数）', 16)} {_pad('占锚点', 16, right=True)}  结论")
    try:
        with torch.inference_mode():
            (bench_k01 if exercise_id == "k01" else bench_k02)(m, rep, peak)
    finally:
        rep.save()
    return 0
