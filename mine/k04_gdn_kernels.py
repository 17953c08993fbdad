"""K04 · Gated DeltaNet kernels in Triton: fused decode on the state pool, chunked (WY) varlen prefill.

The math is m05's (lessons/m05_gated_deltanet.md); here it runs as a few kernels per layer that read and
write e04's state pool in place through each sequence's slot:

    decode   _conv_update_kernel   grid (B, C/BC)       conv window [conv_state, x] -> silu, slide the state
             _decode_rule_kernel   grid (B, nv, dv/BV)  l2norm, gates, one delta-rule step on the fp32 state tile
    prefill  _conv_prefill_kernel  grid (chunks, C/BC)  causal conv over packed tokens (past inputs from the pool)
             _conv_state_kernel    grid (B, C/BC)       each sequence's last K-1 inputs -> the pool
             _chunk_prep_kernel    grid (chunks, nv)    per chunk of 64: gamma = cumsum(g), L, (I+L)^-1, w, u, Aqk
             _chunk_state_kernel   grid (B, nv, dv/BV)  walks a sequence's chunks carrying S [dk, BV] in registers

Per chunk (gamma_i = g_1 + ... + g_i from the chunk start, S0 the state at the chunk start):
    L    = strict_lower(beta_i e^{gamma_i - gamma_j} k_i.k_j)      (I + L)^-1 by 16x16 blocks
    w    = (I + L)^-1 (beta e^gamma k)       u = (I + L)^-1 (beta v)     Aqk = lower(q_i.k_j e^{gamma_i - gamma_j})
    v'   = u - w S0      o = (q e^gamma) S0 + Aqk v'      S = e^{gamma_last} S0 + (k e^{gamma_last - gamma})^T v'

Everything the rule accumulates is fp32; matmul operands are in the input dtype (bf16 on the GPU), as in
flash-linear-attention. Slot -1 marks a padded decode row: its pool rows are neither read nor written.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

CHUNK = 64  # tokens per chunk in the WY form (the solve below is written for 4 blocks of 16)
_DOT_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))   # F.softplus, threshold 20


@triton.jit
def _l2norm_rows(x):
    """x [R, D] fp32 -> x * rsqrt(sum(x^2) + 1e-6) per row (eps inside the root, on the sum)."""
    return x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]


# ---------------------------------------------------------------------------------------------- decode

@triton.jit
def _conv_update_kernel(x_ptr, stride_x, w_ptr, stride_w, pool_ptr, stride_ps, stride_pc, stride_pk,
                        slots_ptr, out_ptr, C, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    raise NotImplementedError("k04: 请实现 _conv_update_kernel（见 lessons/k04_gdn_kernels.md）")


@triton.jit
def _decode_rule_kernel(x_ptr, a_ptr, stride_a, b_ptr, stride_b, A_log_ptr, dt_bias_ptr,
                        ssm_ptr, stride_ss, stride_sh, stride_sk, slots_ptr, o_ptr, C, scale,
                        HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr):
    raise NotImplementedError("k04: 请实现 _decode_rule_kernel（见 lessons/k04_gdn_kernels.md）")


# ---------------------------------------------------------------------------------------------- prefill conv

@triton.jit
def _conv_prefill_kernel(x_ptr, stride_x, w_ptr, stride_w, pool_ptr, stride_ps, stride_pc, stride_pk, slots_ptr,
                         cu_ptr, chunk_seq_ptr, chunk_start_ptr, out_ptr, C,
                         K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    raise NotImplementedError("k04: 请实现 _conv_prefill_kernel（见 lessons/k04_gdn_kernels.md）")


@triton.jit
def _conv_state_kernel(x_ptr, stride_x, pool_ptr, stride_ps, stride_pc, stride_pk, slots_ptr, cu_ptr, C,
                       K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    raise NotImplementedError("k04: 请实现 _conv_state_kernel（见 lessons/k04_gdn_kernels.md）")


# ---------------------------------------------------------------------------------------------- prefill rule

@triton.jit
def _invert_diag_blocks(L):
    """L [64, 64] fp32, strictly lower -> the block-diagonal [64, 64] of (I + L_bb)^-1 for its four 16x16 diagonal
    blocks L_bb: forward substitution X_i = e_i - sum_{j<i} L_ij X_j, row i of all four blocks at once."""
    raise NotImplementedError("k04: 请实现 _invert_diag_blocks（见 lessons/k04_gdn_kernels.md）")


@triton.jit
def _solve_unit_lower(L, PREC: tl.constexpr):
    """(I + L)^-1 for a strictly lower L [64, 64] fp32, all in registers. With D = (I + L_diag)^-1 (block diagonal)
    and M = D L_off (strictly block-lower, so M^4 = 0): I + L = D^-1 (I + M), (I + L)^-1 = (I - M + M^2 - M^3) D."""
    raise NotImplementedError("k04: 请实现 _solve_unit_lower（见 lessons/k04_gdn_kernels.md）")


@triton.jit
def _chunk_prep_kernel(q_ptr, k_ptr, v_ptr, stride_q, stride_k, stride_v, stride_qh, stride_kh, stride_vh,
                       g_ptr, stride_g, beta_ptr, stride_beta, A_log_ptr, dt_bias_ptr,
                       cu_ptr, chunk_seq_ptr, chunk_start_ptr, w_ptr, u_ptr, gc_ptr, aqk_ptr, scale,
                       HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, RAW_GATES: tl.constexpr, NORM_QK: tl.constexpr,
                       DOT: tl.constexpr, PREC: tl.constexpr):
    raise NotImplementedError("k04: 请实现 _chunk_prep_kernel（见 lessons/k04_gdn_kernels.md）")


@triton.jit
def _chunk_state_kernel(q_ptr, k_ptr, stride_q, stride_k, stride_qh, stride_kh, w_ptr, u_ptr, gc_ptr, aqk_ptr,
                        o_ptr, h0_ptr, ht_ptr, idx_ptr, stride_hs, stride_hh, stride_hk, cu_ptr, scale,
                        HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, NORM_QK: tl.constexpr, HAS_INITIAL: tl.constexpr,
                        DOT: tl.constexpr, PREC: tl.constexpr):
    raise NotImplementedError("k04: 请实现 _chunk_state_kernel（见 lessons/k04_gdn_kernels.md）")


# ---------------------------------------------------------------------------------------------- launchers

def _chunk_table(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, first token) of every chunk of CHUNK tokens, each sequence chunked from its own start."""
    raise NotImplementedError("k04: 请实现 _chunk_table（见 lessons/k04_gdn_kernels.md）")


def _rule_varlen(q, k, v, g, beta, cu_seqlens, state_in, state_out, state_idx, raw_gates=None, scale=None,
                 chunks=None):
    """The gated delta rule over packed sequences. q, k [N, HK, dk], v [N, HV, dv] (strided views allowed, last dim
    contiguous); g, beta [N, HV] (or the raw a, b with raw_gates = (A_log, dt_bias)); states [S, HV, dk, dv] fp32 at
    rows state_idx [B]. scale None: q, k are used as given; else they are l2-normalised and q scaled by it.
    chunks: _chunk_table(cu_seqlens) when the caller has it already (its host sync is then not paid twice)."""
    raise NotImplementedError("k04: 请实现 _rule_varlen（见 lessons/k04_gdn_kernels.md）")


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, cu_seqlens=None):
    """fla-shaped chunked rule: q, k [B, T, H, dk] (l2-normalised, q already scaled by dk^-0.5 as in m05),
    v [B, T, H, dv], g (log decay, fp32), beta [B, T, H]; with cu_seqlens [S+1], B = 1 and the S sequences are
    packed along T. initial_state [S or B, H, dk, dv] or None. Returns (o [B, T, H, dv] in v.dtype, final fp32)."""
    raise NotImplementedError("k04: 请实现 chunk_gated_delta_rule（见 lessons/k04_gdn_kernels.md）")


def gdn_prefill(mixed_qkv, a, b, conv_weight, A_log, dt_bias, cu_seqlens, conv_pool, ssm_pool, slots,
                num_k_heads, head_k_dim, head_v_dim, chunks=None):
    """Packed varlen prefill of one GDN layer from the pools' states at slots [B]; final states written back.
    mixed_qkv [N, C] -> o [N, nv, dv] (m05's rule output, before the gated norm).
    chunks: the (seq, start) int32 table _chunk_table(cu_seqlens) would return, when the caller has it already (the
    engine builds it once per step on the host: no host sync in any layer); None: built here."""
    raise NotImplementedError("k04: 请实现 gdn_prefill（见 lessons/k04_gdn_kernels.md）")


def gdn_decode(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_pool, ssm_pool, slots,
               num_k_heads, head_k_dim, head_v_dim):
    """One token per sequence: mixed_qkv [B, C] -> o [B, nv, dv]; conv and recurrent states updated in place in
    the pools at slots [B] (-1: a padded row, nothing read or written). No host sync: CUDA-graph safe."""
    raise NotImplementedError("k04: 请实现 gdn_decode（见 lessons/k04_gdn_kernels.md）")
