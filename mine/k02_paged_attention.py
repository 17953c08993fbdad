"""K02 · Paged attention in Triton: varlen flash-attention prefill and split-K (flash-decoding) decode.

Both kernels compute m04's varlen attention (bottom-right causal, GQA, fp32 softmax) over keys that live
in e04's paged cache [num_blocks, P, nKV, D]: key j of sequence b sits at block block_tables[b, j // P],
row j % P. Neither kernel materialises the gathered keys, the repeated GQA heads or the score matrix.

Online softmax (one query row, keys visited a tile at a time, s = q.k * scale in fp32):

    m_new = max(m, max_j s_j)                 running max
    alpha = exp(m - m_new)                    rescale what was accumulated under the old max
    p_j   = exp(s_j - m_new)
    l     = l * alpha + sum_j p_j             running denominator
    acc   = acc * alpha + sum_j p_j v_j       running numerator;   o = acc / l at the end

exp(x) is computed as exp2(x * log2 e) with log2 e folded into the scale.

Prefill: program (tile of BLOCK_M queries, sequence b, head h). Query i of a sequence with Lq queries and
Lk keys sees keys j <= (Lk - Lq) + i. Key tiles entirely left of the tile's diagonal need no mask; only
the last few tiles are masked, and tiles right of the diagonal are never loaded.

Decode (flash-decoding): one query per sequence, Lk = context_lens[b] keys split into num_splits
partitions of part = ceil(Lk / num_splits) keys (rounded up to BLOCK_N). Program (b, kv head g, split s)
runs the online softmax over its partition for all G = nH / nKV query heads of kv head g together (one
load of K/V serves G heads) and stores o_s = acc / l and lse_s = m + log(l). The reduce kernel then, per
(b, h):   w_s = exp(lse_s - max lse);   o = sum_s w_s o_s / sum_s w_s.
The grid depends only on (B, nKV, num_splits): a CUDA graph can capture it; splits past Lk return early.

Lesson: lessons/k02_paged_attention.md (#15 · 书 §K.2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from .k01_triton_basics import store_kvcache
from .m04_attention import AttentionContext

LOG2E = 1.4426950408889634


@triton.jit
def _key_rows(bt_ptr, j, Lk, PAGE: tl.constexpr, PAGED: tl.constexpr):
    """Row index (into the [num_slots, nKV, D] view of the cache, or of unpaged k/v) of keys j [BLOCK_N]."""
    raise NotImplementedError("k02: 请实现 _key_rows（见 lessons/k02_paged_attention.md）")


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, n0, Lk, diag, offs_m, offs_d,
                 stride_kt, stride_vt, qk_scale, D,
                 MASKED: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) of the online softmax for the query rows offs_m (diag = Lk - Lq)."""
    raise NotImplementedError("k02: 请实现 _attend_tile（见 lessons/k02_paged_attention.md）")


@triton.jit(do_not_specialize=["stride_bt"])   # the batch's widest block table: no recompile per width
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bt_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    stride_bt, qk_scale, D, GROUP: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Program (tile, b, h): query rows tile*BLOCK_M .. of sequence b, head h, against its causal keys."""
    raise NotImplementedError("k02: 请实现 _prefill_kernel（见 lessons/k02_paged_attention.md）")


def _prefill_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for an H200; fp32 tiles are twice the bytes."""
    if head_dim <= 64:
        m, n, warps = 128, 64, 4
    elif head_dim <= 128:                # 64 x 64 in 4 warps: 1.14-1.21x SDPA flash on 8k tokens in 8..64 sequences,
        m, n, warps = 64, 64, 4          # 128 x 64 in 8 warps 0.87-1.01x (H200, 2026-12-01, bench k02)
    else:
        m, n, warps = 64, 32, 8
    if dtype == torch.float32:
        m = max(16, m // 2)
    return m, n, warps, 2


def _launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, block_tables, max_seqlen_q, scale, page):
    raise NotImplementedError("k02: 请实现 _launch_prefill（见 lessons/k02_paged_attention.md）")


def _precision(q: torch.Tensor) -> str:
    """fp32 inputs: exact fp32 products (tf32 would lose 13 mantissa bits); bf16/fp16: tensor cores."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _d_contiguous(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, block_tables: torch.Tensor, max_seqlen_q: int,
                      scale: float) -> torch.Tensor:
    """q [Nq, nH, D]; every sequence's keys/values read from the caches [num_blocks, P, nKV, D] through
    block_tables [B, M] (int32, -1 padded); bottom-right causal, GQA -> o [Nq, nH, D] in q.dtype."""
    raise NotImplementedError("k02: 请实现 prefill_attention（见 lessons/k02_paged_attention.md）")


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, scale: float) -> torch.Tensor:
    """The same kernel on unpaged packed k/v [Nk, nKV, D] (m04's varlen_attention, tiled)."""
    raise NotImplementedError("k02: 请实现 flash_attention_varlen（见 lessons/k02_paged_attention.md）")


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_part_ptr, lse_part_ptr,
                         stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                         qk_scale, D, GROUP, NUM_SPLITS: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Program (b, g, s): the G query heads of kv head g over partition s of sequence b's keys."""
    raise NotImplementedError("k02: 请实现 _decode_split_kernel（见 lessons/k02_paged_attention.md）")


@triton.jit
def _decode_reduce_kernel(o_part_ptr, lse_part_ptr, lens_ptr, o_ptr, stride_ob, stride_oh, D,
                          NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Program (b, h): combine the partial (o_s, lse_s) of the splits that ran into o[b, h]."""
    raise NotImplementedError("k02: 请实现 _decode_reduce_kernel（见 lessons/k02_paged_attention.md）")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, num_splits: int) -> torch.Tensor:
    """q [B, nH, D] (one new token per sequence) attends to all context_lens[b] keys of its sequence in the
    paged caches -> o [B, nH, D]. Split-K over num_splits partitions (a static int) plus a reduce kernel;
    no host sync, grid fixed by (B, nKV, num_splits)."""
    raise NotImplementedError("k02: 请实现 decode_attention（见 lessons/k02_paged_attention.md）")


def default_num_splits(k_cache: torch.Tensor) -> int:
    """Splits for decode when the engine gives none: about one per 2048 cached keys, 1 .. 16."""
    keys = k_cache.shape[0] * k_cache.shape[1]
    return max(1, min(16, triton.cdiv(keys, 2048)))


class TritonPagedAttention(nn.Module):
    """Drop-in for e04's PagedAttention on CUDA: store_kvcache, then decode or prefill from the caches."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, num_splits: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.k_cache, self.v_cache = k_cache, v_cache           # [num_blocks, P, nKV, D] each
        self.num_splits = num_splits or default_num_splits(k_cache)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q [N, nH, D], k/v [N, nKV, D] (the new tokens) -> [N, nH, D]."""
        raise NotImplementedError("k02: 请实现 TritonPagedAttention.forward（见 lessons/k02_paged_attention.md）")
