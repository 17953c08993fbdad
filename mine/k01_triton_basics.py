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
    raise NotImplementedError("k01: 请实现 _store_kvcache_kernel（见 lessons/k01_triton_basics.md）")


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k, v [N, nKV, D] (any strides: a view whose D is not contiguous is copied first) -> caches [num_blocks, P, nKV, D] at
    flat slots slot_mapping [N] (int32/int64, slot = block * P + offset); a slot of -1 writes nothing."""
    raise NotImplementedError("k01: 请实现 store_kvcache（见 lessons/k01_triton_basics.md）")


@triton.jit(do_not_specialize=["num_rows"])   # N changes every prefill step: no recompile per N % 16
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                         num_rows, hidden, stride_x, stride_r, stride_o, stride_ro, eps,
                         HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program i normalises rows i*ROWS .. i*ROWS + ROWS - 1 of the [R, H] input (a [ROWS, BLOCK_H] tile)."""
    raise NotImplementedError("k01: 请实现 _add_rms_norm_kernel（见 lessons/k01_triton_basics.md）")


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """[..., H] -> a [R, H] view with a contiguous last dim (a copy only when no such view exists)."""
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 gemma: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (any leading dims), residual [..., H] or None, weight [H] ->
    normed(x) if residual is None, else (normed(x + residual), x + residual). Same dtypes as m01."""
    raise NotImplementedError("k01: 请实现 add_rms_norm（见 lessons/k01_triton_basics.md）")
