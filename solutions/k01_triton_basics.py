"""K01 · Triton basics: store_kvcache and the fused residual-add + RMSNorm kernel.

A Triton kernel is a function run by a grid of programs; each program owns one tile of the problem,
computes its pointers from tl.program_id and the tensors' strides, loads with a mask, computes in
registers, stores with a mask. Both kernels here are memory-bound: one pass over the bytes, nothing else.

store_kvcache (e04's torch version: k_cache.view(-1, nKV, D)[slot_mapping] = k):

    program t (one per new token):   slot = slot_mapping[t]        (-1 = a padded row: write nothing)
        block, offset = slot // P, slot % P
        k_cache[block, offset, :, :] = k[t, :, :]      v_cache likewise        all nKV heads at once

add_rms_norm (m01's fused residual protocol and cast order, exactly):

    s = x + residual                                   rounded to x.dtype (HF: residual + hidden_states)
    n = s_f32 * rsqrt(mean(s_f32^2) + eps)             fp32 statistics
    Qwen3 (gemma=False):       out = w * n.to(x.dtype)             cast first, then scale
    Qwen3.5 (gemma=True):      out = (n * (1 + w_f32)).to(x.dtype)   scale in fp32, then cast
    residual None -> out;   else -> (out, s)

One program normalises ROWS rows of H: a [ROWS, BLOCK_H] tile (BLOCK_H = next power of two >= H, masked),
so a per-head q/k norm (H = D = 128) still gives each program enough bytes to move.

Lesson: lessons/k01_triton_basics.md (#14 · 书 §K.1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cb, stride_cp, stride_ch, page_size, num_kv_heads, head_dim,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program t copies token t's [nKV, D] K and V rows to cache slot slot_mapping[t] (nothing if it is -1)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:                                         # padded row of a CUDA-graph batch
        return
    block, offset = slot // page_size, slot % page_size
    heads = tl.arange(0, BLOCK_H)[:, None]               # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_D)[None, :]                # [1, BLOCK_D]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = block * stride_cb + offset * stride_cp + heads * stride_ch + dims      # same layout for both caches
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k, v [N, nKV, D] (any strides: a view whose D is not contiguous is copied first) -> caches [num_blocks, P, nKV, D] at
    flat slots slot_mapping [N] (int32/int64, slot = block * P + offset); a slot of -1 writes nothing."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "caches: same layout, D contiguous"
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4)


@triton.jit(do_not_specialize=["num_rows"])   # N changes every prefill step: no recompile per N % 16
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                         num_rows, hidden, stride_x, stride_r, stride_o, stride_ro, eps,
                         HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program i normalises rows i*ROWS .. i*ROWS + ROWS - 1 of the [R, H] input (a [ROWS, BLOCK_H] tile)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]        # [ROWS, 1]
    cols = tl.arange(0, BLOCK_H)[None, :]                                # [1, BLOCK_H]
    mask = (rows < num_rows) & (cols < hidden)
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)           # the sum, rounded to x.dtype
        tl.store(res_out_ptr + rows * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    mean_sq = tl.sum(h * h, axis=1) / hidden                             # [ROWS] fp32; padding adds 0
    n = h * tl.math.rsqrt(mean_sq + eps)[:, None]                        # eps inside the sqrt
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    if GEMMA:
        out = n * (1.0 + w)                                              # scale in fp32, then cast
    else:
        out = w * n.to(x.dtype).to(tl.float32)                           # cast first, then scale
    tl.store(out_ptr + rows * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """[..., H] -> a [R, H] view with a contiguous last dim (a copy only when no such view exists)."""
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 gemma: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (any leading dims), residual [..., H] or None, weight [H] ->
    normed(x) if residual is None, else (normed(x + residual), x + residual). Same dtypes as m01."""
    hidden = x.shape[-1]
    x2 = _rows(x, hidden)
    out_dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)     # m01: w * n.to(x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    r2 = _rows(residual, hidden) if residual is not None else x2
    num_rows = x2.shape[0]
    block_h = triton.next_power_of_2(hidden)
    rows = max(1, min(16, 2048 // block_h))                             # >= 2048 elements per program
    grid = (triton.cdiv(num_rows, rows),)
    ro2 = res_out.view(-1, hidden) if res_out is not None else x2
    _add_rms_norm_kernel[grid](
        x2, r2, weight, out, ro2, num_rows, hidden,
        x2.stride(0), r2.stride(0), hidden, ro2.stride(0), eps,
        HAS_RESIDUAL=residual is not None, GEMMA=gemma, ROWS=rows, BLOCK_H=block_h,
        num_warps=4 if block_h <= 2048 else 8)
    return out if residual is None else (out, res_out)
