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
    if PAGED:
        block = tl.load(bt_ptr + j // PAGE, mask=j < Lk, other=0).to(tl.int64)   # bt_ptr: this sequence's row
        return block * PAGE + j % PAGE
    else:
        return bt_ptr + j                                                     # bt_ptr: first key of the sequence


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, n0, Lk, diag, offs_m, offs_d,
                 stride_kt, stride_vt, qk_scale, D,
                 MASKED: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) of the online softmax for the query rows offs_m (diag = Lk - Lq)."""
    j = n0 + tl.arange(0, BLOCK_N)
    rows = _key_rows(bt_ptr, j, Lk, PAGE, PAGED)
    kv_mask = (j < Lk)[:, None] & (offs_d < D)[None, :]
    k = tl.load(k_ptr + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)   # [N, D]
    v = tl.load(v_ptr + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32) * qk_scale   # [M, N] fp32
    if MASKED:
        visible = (j[None, :] <= diag + offs_m[:, None]) & (j[None, :] < Lk)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt"])   # the batch's widest block table: no recompile per width
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bt_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    stride_bt, qk_scale, D, GROUP: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Program (tile, b, h): query rows tile*BLOCK_M .. of sequence b, head h, against its causal keys."""
    tile, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    Lq = tl.load(cu_q_ptr + b + 1) - q_start
    k_start = tl.load(cu_k_ptr + b)
    Lk = tl.load(cu_k_ptr + b + 1) - k_start
    m0 = tile * BLOCK_M
    if m0 >= Lq:
        return
    diag = Lk - Lq                                    # bottom-right causal: row i sees j <= diag + i
    kvh = h // GROUP                                  # GQA: query head h reads kv head h // (nH / nKV)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = (q_start + offs_m).to(tl.int64)
    q_mask = (offs_m < Lq)[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    k_ptr += kvh * stride_kh
    v_ptr += kvh * stride_vh
    if PAGED:
        seq_keys = bt_ptr + b.to(tl.int64) * stride_bt      # this sequence's block-table row
    else:
        seq_keys = k_start.to(tl.int64)                     # first row of this sequence in k/v

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)     # finite: a fully masked row never makes inf - inf
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end = tl.maximum(diag + m0 + 1, 0) // BLOCK_N * BLOCK_N      # every key < full_end is seen by all rows
    causal_end = tl.minimum(Lk, diag + m0 + BLOCK_M)                  # the tile's last row sees keys < this
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, seq_keys, n0, Lk, diag, offs_m, offs_d,
                                     stride_kt, stride_vt, qk_scale, D, False, PAGE, PAGED, BLOCK_N, PRECISION)
    for n0 in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, seq_keys, n0, Lk, diag, offs_m, offs_d,
                                     stride_kt, stride_vt, qk_scale, D, True, PAGE, PAGED, BLOCK_N, PRECISION)
    o = acc / l_i[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=q_mask)


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
    num_tokens, num_heads, head_dim = q.shape
    o = torch.empty_like(q)
    if num_tokens == 0:
        return o
    num_seqs = cu_seqlens_q.shape[0] - 1
    block_m, block_n, warps, stages = _prefill_blocks(head_dim, q.dtype)
    paged = block_tables is not None
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k, v, o, cu_seqlens_q, cu_seqlens_k, block_tables if paged else cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        block_tables.stride(0) if paged else 0, scale * LOG2E, head_dim,
        GROUP=num_heads // k.shape[1], PAGE=page, PAGED=paged,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim), PRECISION=_precision(q),
        num_warps=warps, num_stages=stages)
    return o


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
    (q,) = _d_contiguous(q)
    page, num_kv_heads, head_dim = k_cache.shape[1:]
    k = k_cache.view(-1, num_kv_heads, head_dim)              # [num_slots, nKV, D]: row = block * P + offset
    v = v_cache.view(-1, num_kv_heads, head_dim)
    return _launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, block_tables, max_seqlen_q, scale, page)


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, scale: float) -> torch.Tensor:
    """The same kernel on unpaged packed k/v [Nk, nKV, D] (m04's varlen_attention, tiled)."""
    q, k, v = _d_contiguous(q, k, v)
    return _launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, scale, 1)


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_part_ptr, lse_part_ptr,
                         stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                         qk_scale, D, GROUP, NUM_SPLITS: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Program (b, g, s): the G query heads of kv head g over partition s of sequence b's keys."""
    b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    Lk = tl.load(lens_ptr + b)
    part = tl.cdiv(tl.cdiv(Lk, NUM_SPLITS), BLOCK_N) * BLOCK_N      # keys per split, a whole number of tiles
    start = s * part
    if start >= Lk:                                                 # past this sequence's keys (or Lk == 0)
        return
    end = tl.minimum(start + part, Lk)
    heads = g * GROUP + tl.arange(0, BLOCK_G)                       # the G query heads of kv head g
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = (tl.arange(0, BLOCK_G) < GROUP)[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_mask, other=0.0)                          # [G, D]
    k_ptr += g * stride_kh
    v_ptr += g * stride_vh
    seq_blocks = bt_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        block = tl.load(seq_blocks + j // PAGE, mask=j < end, other=0).to(tl.int64)
        rows = block * PAGE + j % PAGE
        kv_mask = (j < end)[:, None] & (offs_d < D)[None, :]
        k = tl.load(k_ptr + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)   # [N, D]
        v = tl.load(v_ptr + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32) * qk_scale     # [G, N]
        sc = tl.where((j < end)[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)
        m_i = m_new

    # partial results of this split: normalised output and log2-sum-exp2 (in the scaled log2 units)
    part_rows = (b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + s    # [G] of [B, nH, S]
    tl.store(o_part_ptr + part_rows[:, None] * BLOCK_D + offs_d[None, :], acc / l_i[:, None], mask=head_mask)
    tl.store(lse_part_ptr + part_rows, m_i + tl.log2(l_i), mask=tl.arange(0, BLOCK_G) < GROUP)


@triton.jit
def _decode_reduce_kernel(o_part_ptr, lse_part_ptr, lens_ptr, o_ptr, stride_ob, stride_oh, D,
                          NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Program (b, h): combine the partial (o_s, lse_s) of the splits that ran into o[b, h]."""
    b, h = tl.program_id(0), tl.program_id(1)
    Lk = tl.load(lens_ptr + b)
    part = tl.cdiv(tl.cdiv(Lk, NUM_SPLITS), BLOCK_N) * BLOCK_N
    num_live = tl.cdiv(Lk, tl.maximum(part, 1))                     # splits that wrote a result (0 if Lk == 0)
    splits = tl.arange(0, BLOCK_S)
    live = splits < num_live
    offs_d = tl.arange(0, BLOCK_D)
    row = (b.to(tl.int64) * tl.num_programs(1) + h) * NUM_SPLITS
    lse = tl.load(lse_part_ptr + row + splits, mask=live, other=-1.0e30)                             # [S]
    o_s = tl.load(o_part_ptr + (row + splits)[:, None] * BLOCK_D + offs_d[None, :],
                  mask=live[:, None], other=0.0)                                                   # [S, D]
    w = tl.where(live, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)    # each split's share of the softmax mass
    o = tl.sum(w[:, None] * o_s, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o.to(o_ptr.dtype.element_ty),
             mask=offs_d < D)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, num_splits: int) -> torch.Tensor:
    """q [B, nH, D] (one new token per sequence) attends to all context_lens[b] keys of its sequence in the
    paged caches -> o [B, nH, D]. Split-K over num_splits partitions (a static int) plus a reduce kernel;
    no host sync, grid fixed by (B, nKV, num_splits)."""
    (q,) = _d_contiguous(q)
    num_seqs, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    o = torch.empty_like(q)
    if num_seqs == 0:
        return o
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    block_n = 64 if block_d <= 128 else 32
    o_part = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    k = k_cache.view(-1, num_kv_heads, head_dim)
    v = v_cache.view(-1, num_kv_heads, head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k, v, block_tables, context_lens, o_part, lse_part,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_tables.stride(0),
        scale * LOG2E, head_dim, group, NUM_SPLITS=num_splits, PAGE=page,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=_precision(q), num_warps=4, num_stages=2)
    _decode_reduce_kernel[(num_seqs, num_heads)](
        o_part, lse_part, context_lens, o, o.stride(0), o.stride(1), head_dim,
        NUM_SPLITS=num_splits, BLOCK_N=block_n, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
        num_warps=4)
    return o


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
        store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if not ctx.is_prefill:                                  # one new token per sequence
            return decode_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens,
                                    self.scale, self.num_splits)
        return prefill_attention(q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                 ctx.block_tables, ctx.max_seqlen_q, self.scale)
