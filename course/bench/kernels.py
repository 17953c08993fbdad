"""`./check.sh bench k01|k02 [--solutions]`: speed of the Track K kernels beside anchors measured in the same run.

Every time is triton.testing.do_bench's median. Anchors:
  HBM peak      a device-to-device copy of 2 GiB (bytes read + written per second)
  k01           store_kvcache and add_rms_norm at 8k tokens: bytes moved / time vs the HBM peak (target >= 80 %)
  k02 decode    bf16, batch 256, contexts U(512, 4096), D 128, nKV 8, nH 16 / 32: K/V bytes read / time vs the
                HBM peak (target >= 80 %); beside torch SDPA on the keys already gathered and padded
  k02 prefill   bf16, 8k tokens in 8 / 16 / 64 sequences, D 128, nH 32, nKV 8, causal: TFLOP/s vs torch SDPA's
                flash backend on the same unpaged problem (target >= 0.9x); paged vs unpaged (within 15 %)
"""

from __future__ import annotations

import os
import random

from ..grader import select


def _say(text: str) -> None:
    print(text, flush=True)


def _bench(fn) -> float:
    """Median milliseconds of fn()."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _hbm_peak() -> float:
    """GB/s of a 2 GiB device-to-device copy (read + write)."""
    import torch
    src = torch.empty(2 ** 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6


def _row(name: str, ms: float, amount: float, unit: str, anchor: float | None = None, target: str = "") -> None:
    rate = amount / ms / 1e6 if unit == "GB/s" else amount / ms / 1e9
    ratio = f"  {rate / anchor:6.1%} of anchor" if anchor else ""
    _say(f"  {name:<58} {ms * 1e3:9.1f} us  {rate:8.1f} {unit}{ratio}  {target}")


def bench_k01(m, peak: float) -> None:
    import torch
    bf16 = torch.bfloat16
    n, nkv, d, page = 8192, 8, 128, 16
    qkv = torch.randn(n, (32 + 2 * nkv) * d, dtype=bf16, device="cuda")
    _, k, v = qkv.split([32 * d, nkv * d, nkv * d], dim=-1)
    k, v = k.view(n, nkv, d), v.view(n, nkv, d)
    kc = torch.zeros(n // page + 16, page, nkv, d, dtype=bf16, device="cuda")
    vc = torch.zeros_like(kc)
    slots = torch.randperm(kc.shape[0] * page, device="cuda")[:n]
    moved = 2 * 2 * n * nkv * d * 2                                  # k and v, read and written
    _row("store_kvcache 8k tokens, nKV 8, D 128 (strided k/v)", _bench(lambda: m.store_kvcache(k, v, kc, vc, slots)),
         moved, "GB/s", peak, "target >= 80 %")
    # the anchor at this size: one 67 MB problem pays a launch and a ramp that a 2 GiB copy spreads thin
    src = torch.empty(moved // 4, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    _row("  torch D2D copy of the same bytes (one launch, contiguous)", _bench(lambda: dst.copy_(src)), moved, "GB/s", peak)
    del src, dst
    for hidden in (1024, 4096):
        x = torch.randn(n, hidden, dtype=bf16, device="cuda")
        res = torch.randn_like(x)
        w = torch.randn(hidden, dtype=bf16, device="cuda")
        moved = 4 * n * hidden * 2                                    # x, residual in; normed, residual out
        _row(f"add_rms_norm 8k x {hidden} with residual", _bench(lambda: m.add_rms_norm(x, res, w, 1e-6)),
             moved, "GB/s", peak, "target >= 80 %")

        def eager():
            s = x + res
            h = s.float()
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(s.dtype), s
        _row("  torch eager add + RMSNorm (same bytes)", _bench(eager), moved, "GB/s", peak)
    q = torch.randn(n, 32, 128, dtype=bf16, device="cuda")
    wq = torch.randn(128, dtype=bf16, device="cuda")
    _row("add_rms_norm per-head q norm [8k, 32, 128]", _bench(lambda: m.add_rms_norm(q, None, wq, 1e-6)),
         2 * q.numel() * 2, "GB/s", peak, "target >= 80 %")


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


def bench_k02(m, peak: float) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    bf16, d, nkv, page = torch.bfloat16, 128, 8, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = random.Random(0)

    _say("decode (one query per sequence; bytes = K and V read)")
    lens = [rnd.randint(512, 4096) for _ in range(256)]
    kc, vc, tables = _paged(lens, nkv, d, page, bf16, gen)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * sum(lens) * nkv * d * 2
    for nh in (16, 32):
        q = torch.randn(256, nh, d, dtype=bf16, device="cuda", generator=gen)
        for splits in (1, 2, 4, 8):
            _row(f"decode_attention B 256, nH {nh}, nKV 8, D 128, splits {splits}",
                 _bench(lambda: m.decode_attention(q, kc, vc, tables, ctx, d ** -0.5, splits)),
                 kv_bytes, "GB/s", peak, "target >= 80 %")
        # torch SDPA on the same keys, already gathered and padded to the longest context (not timed: the gather)
        longest = max(lens)
        keys = torch.zeros(256, nkv, longest, d, dtype=bf16, device="cuda")
        values = torch.zeros_like(keys)
        flat_k, flat_v = _gather(kc, tables, lens, page), _gather(vc, tables, lens, page)
        start = 0
        for b, n in enumerate(lens):
            keys[b, :, :n] = flat_k[start:start + n].transpose(0, 1)
            values[b, :, :n] = flat_v[start:start + n].transpose(0, 1)
            start += n
        mask = (torch.arange(longest, device="cuda")[None, :] < ctx[:, None])[:, None, None, :]
        qs = q[:, :, None, :]
        _row(f"  torch SDPA on gathered, padded K/V (nH {nh}; counts only real K/V bytes)",
             _bench(lambda: F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)),
             kv_bytes, "GB/s", peak)
        del keys, values

    _say("prefill (8k tokens, causal, no prefix; FLOPs = 4 * D * nH * sum L(L+1)/2)")
    nh = 32
    for num_seqs in (8, 16, 64):
        length = 8192 // num_seqs
        lens = [length] * num_seqs
        flops = 4 * d * nh * sum(n * (n + 1) / 2 for n in lens)
        q = torch.randn(8192, nh, d, dtype=bf16, device="cuda", generator=gen)
        kc, vc, tables = _paged(lens, nkv, d, page, bf16, gen)
        k, v = _gather(kc, tables, lens, page), _gather(vc, tables, lens, page)
        cu = torch.arange(0, 8193, length, dtype=torch.int32, device="cuda")
        qb = q.view(num_seqs, length, nh, d).transpose(1, 2)
        kb = k.view(num_seqs, length, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        vb = v.view(num_seqs, length, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_ms = _bench(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True))
        sdpa_rate = flops / sdpa_ms / 1e9
        _row(f"torch SDPA flash, {num_seqs} x {length} (unpaged, K/V repeated)", sdpa_ms, flops, "TFLOP/s")
        unpaged_ms = _bench(lambda: m.flash_attention_varlen(q, k, v, cu, cu, length, d ** -0.5))
        _row(f"flash_attention_varlen, {num_seqs} x {length} (unpaged)", unpaged_ms, flops, "TFLOP/s", sdpa_rate,
             "target >= 90 % of SDPA flash")
        paged_ms = _bench(lambda: m.prefill_attention(q, kc, vc, cu, cu, tables, length, d ** -0.5))
        _row(f"prefill_attention, {num_seqs} x {length} (paged, P {page})", paged_ms, flops, "TFLOP/s", sdpa_rate,
             f"paged / unpaged time = {paged_ms / unpaged_ms:.2f} (target <= 1.15)")


def bench_kernel(exercise_id: str, args: list[str]) -> int:
    """Entry point for `./check.sh bench k01|k02 [--solutions]`; returns the exit status."""
    import torch
    if not torch.cuda.is_available():
        _say(f"./check.sh bench {exercise_id}：需要 GPU（CUDA），这台机器上没有。正确性检查请运行 ./check.sh {exercise_id}。")
        return 1
    module = {"k01": "k01_triton_basics", "k02": "k02_paged_attention"}[exercise_id]
    from ..runtime.run import kernel_source
    source = kernel_source(exercise_id, "--solutions" in args)
    os.environ[select.ENV] = select.encode({"default": "solutions", module: source})
    m = select.load(module)
    _say(f"{exercise_id} benchmark ({source}/{module}.py) on {torch.cuda.get_device_name()}, "
         f"torch {torch.__version__}")
    peak = _hbm_peak()
    _say(f"  anchor: device-to-device copy of 2 GiB = {peak:.0f} GB/s (the HBM peak used below)")
    with torch.inference_mode():
        (bench_k01 if exercise_id == "k01" else bench_k02)(m, peak)
    return 0
