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
    b = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    taps = tl.arange(0, BK)
    slot = tl.load(slots_ptr + b)
    live = slot >= 0                                                    # slot -1: a padded row
    base = pool_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_ps + cols[:, None] * stride_pc
    cmask = cols < C
    pmask = (cols < tl.where(live, C, 0))[:, None]                     # the pool rows of a live slot
    past = tl.load(base + taps[None, :] * stride_pk, mask=pmask & (taps[None, :] < K - 1), other=0.0)
    new = tl.load(x_ptr + b * stride_x + cols, mask=cmask, other=0.0)
    window = tl.where(taps[None, :] == K - 1, new[:, None], past)      # [BC, BK]: the K inputs, oldest first
    weight = tl.load(w_ptr + cols[:, None] * stride_w + taps[None, :], mask=cmask[:, None] & (taps[None, :] < K),
                     other=0.0)
    y = tl.sum(window.to(tl.float32) * weight.to(tl.float32), 1)
    y = tl.where(live, y / (1.0 + tl.exp(-y)), 0.0)                     # silu
    tl.store(out_ptr + b * C + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)
    tl.debug_barrier()                                                  # every thread has read the old state
    shifted = pmask & (taps[None, :] >= 1) & (taps[None, :] < K)
    tl.store(base + (taps[None, :] - 1) * stride_pk, window, mask=shifted)   # drop the oldest input


@triton.jit
def _decode_rule_kernel(x_ptr, a_ptr, stride_a, b_ptr, stride_b, A_log_ptr, dt_bias_ptr,
                        ssm_ptr, stride_ss, stride_sh, stride_sk, slots_ptr, o_ptr, C, scale,
                        HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr):
    b, hv, vt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = hv // GROUP                                                    # value head hv reads key head hv // (nv/nk)
    slot = tl.load(slots_ptr + b)
    live = slot >= 0
    dks = tl.arange(0, BK)
    dvs = vt * BV + tl.arange(0, BV)
    kmask, vmask = dks < DK, dvs < DV
    row = x_ptr + b * C                                                 # conv output [q_all | k_all | v_all]
    q = tl.load(row + hk * DK + dks, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(row + (HV // GROUP + hk) * DK + dks, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * (HV // GROUP) * DK + hv * DV + dvs, mask=vmask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    a = tl.load(a_ptr + b * stride_a + hv).to(tl.float32)
    g = -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32)) * _softplus(a + tl.load(dt_bias_ptr + hv).to(tl.float32))
    b_raw = tl.load(b_ptr + b * stride_b + hv)
    beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)

    ptrs = (ssm_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_ss + hv * stride_sh
            + dks[:, None] * stride_sk + dvs[None, :])
    smask = (dks < tl.where(live, DK, 0))[:, None] & vmask[None, :]
    S = tl.load(ptrs, mask=smask, other=0.0) * tl.exp(g)               # 1. decay         [dk, BV] fp32
    u = beta * (v - tl.sum(k[:, None] * S, 0))                          # 2. beta (v - k^T S)
    S = S + k[:, None] * u[None, :]                                     # 3. S += k u^T
    o = tl.sum(q[:, None] * S, 0)                                       # 4. o = S^T q
    tl.store(ptrs, S, mask=smask)
    tl.store(o_ptr + (b * HV + hv) * DV + dvs, tl.where(live, o, 0.0).to(o_ptr.dtype.element_ty), mask=vmask)


# ---------------------------------------------------------------------------------------------- prefill conv

@triton.jit
def _conv_prefill_kernel(x_ptr, stride_x, w_ptr, stride_w, pool_ptr, stride_ps, stride_pc, stride_pk, slots_ptr,
                         cu_ptr, chunk_seq_ptr, chunk_start_ptr, out_ptr, C,
                         K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    n = tl.load(chunk_seq_ptr + tl.program_id(0))
    bos, eos = tl.load(cu_ptr + n), tl.load(cu_ptr + n + 1)
    rows = tl.load(chunk_start_ptr + tl.program_id(0)) + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    slot = tl.load(slots_ptr + n)
    base = pool_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_ps + cols[None, :] * stride_pc
    mask = (rows < eos)[:, None] & (cols < C)[None, :]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):                                        # tap j reads input t - (K-1) + j
        src = rows - (K - 1) + j
        mine = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :],
                       mask=mask & (src >= bos)[:, None], other=0.0)
        past = tl.load(base + (src - bos + K - 1)[:, None] * stride_pk,  # before bos: the pool's conv state
                       mask=mask & (src < bos)[:, None] & (cols < tl.where(slot >= 0, C, 0))[None, :], other=0.0)
        weight = tl.load(w_ptr + cols * stride_w + j, mask=cols < C, other=0.0)
        acc += (mine.to(tl.float32) + past.to(tl.float32)) * weight.to(tl.float32)[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_state_kernel(x_ptr, stride_x, pool_ptr, stride_ps, stride_pc, stride_pk, slots_ptr, cu_ptr, C,
                       K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    n = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    bos, eos = tl.load(cu_ptr + n), tl.load(cu_ptr + n + 1)
    slot = tl.load(slots_ptr + n)
    j = tl.arange(0, BK)                                                # new state column j = input eos - (K-1) + j
    src = eos - (K - 1) + j
    mask = (cols < tl.where(slot >= 0, C, 0))[:, None] & (j < K - 1)[None, :]
    base = pool_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_ps + cols[:, None] * stride_pc
    mine = tl.load(x_ptr + src.to(tl.int64)[None, :] * stride_x + cols[:, None], mask=mask & (src >= bos)[None, :],
                   other=0.0)
    past = tl.load(base + (j + eos - bos)[None, :] * stride_pk, mask=mask & (src < bos)[None, :], other=0.0)
    new = tl.where((src >= bos)[None, :], mine, past)                   # a short sequence keeps the old tail
    tl.debug_barrier()                                                  # old state read before it is overwritten
    tl.store(base + j[None, :] * stride_pk, new, mask=mask)


# ---------------------------------------------------------------------------------------------- prefill rule

@triton.jit
def _invert_diag_blocks(L):
    """L [64, 64] fp32, strictly lower -> the block-diagonal [64, 64] of (I + L_bb)^-1 for its four 16x16 diagonal
    blocks L_bb: forward substitution X_i = e_i - sum_{j<i} L_ij X_j, row i of all four blocks at once."""
    blk, r = tl.arange(0, 4), tl.arange(0, 16)
    same = blk[:, None, None, None] == blk[None, None, :, None]                 # [4, 1, 4, 1]: block row == block col
    A = tl.sum(tl.where(same, tl.reshape(L, [4, 16, 4, 16]), 0.0), 2)           # [4, 16, 16]: the diagonal blocks
    X = (r[:, None] == r[None, :]).to(tl.float32)[None, :, :] + tl.zeros([4, 16, 16], dtype=tl.float32)
    for i in range(1, 16):
        a = tl.sum(tl.where((r == i)[None, :, None], A, 0.0), 1)                # [4, 16]: row i of each block, 0 for j >= i
        x = (r == i).to(tl.float32)[None, :] - tl.sum(a[:, :, None] * X, 1)
        X = tl.where((r == i)[None, :, None], x[:, None, :], X)
    return tl.reshape(tl.where(same, X[:, :, None, :], 0.0), [64, 64])


@triton.jit
def _solve_unit_lower(L, PREC: tl.constexpr):
    """(I + L)^-1 for a strictly lower L [64, 64] fp32, all in registers. With D = (I + L_diag)^-1 (block diagonal)
    and M = D L_off (strictly block-lower, so M^4 = 0): I + L = D^-1 (I + M), (I + L)^-1 = (I - M + M^2 - M^3) D."""
    i, j = tl.arange(0, 64)[:, None], tl.arange(0, 64)[None, :]
    D = _invert_diag_blocks(L)
    M = tl.dot(D, tl.where(i // 16 > j // 16, L, 0.0), input_precision=PREC)
    X = D - tl.dot(M, D, input_precision=PREC)                                  # Horner: D - M (D - M (D - M D))
    X = D - tl.dot(M, X, input_precision=PREC)
    return D - tl.dot(M, X, input_precision=PREC)


@triton.jit
def _chunk_prep_kernel(q_ptr, k_ptr, v_ptr, stride_q, stride_k, stride_v, stride_qh, stride_kh, stride_vh,
                       g_ptr, stride_g, beta_ptr, stride_beta, A_log_ptr, dt_bias_ptr,
                       cu_ptr, chunk_seq_ptr, chunk_start_ptr, w_ptr, u_ptr, gc_ptr, aqk_ptr, scale,
                       HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, RAW_GATES: tl.constexpr, NORM_QK: tl.constexpr,
                       DOT: tl.constexpr, PREC: tl.constexpr):
    c, hv = tl.program_id(0), tl.program_id(1)
    hk = hv // GROUP
    n = tl.load(chunk_seq_ptr + c)
    eos = tl.load(cu_ptr + n + 1)
    r = tl.arange(0, 64)
    rows = tl.load(chunk_start_ptr + c) + r
    rmask = rows < eos
    rows = rows.to(tl.int64)
    if RAW_GATES:                                                       # g, beta from the projections a, b
        a = tl.load(g_ptr + rows * stride_g + hv, mask=rmask, other=0.0).to(tl.float32)
        g = -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32)) * _softplus(a + tl.load(dt_bias_ptr + hv).to(tl.float32))
        b_raw = tl.load(beta_ptr + rows * stride_beta + hv, mask=rmask, other=0.0)
        beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
    else:
        g = tl.load(g_ptr + rows * stride_g + hv, mask=rmask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * stride_beta + hv, mask=rmask, other=0.0).to(tl.float32)
    g, beta = tl.where(rmask, g, 0.0), tl.where(rmask, beta, 0.0)      # padded rows change nothing
    gamma = tl.cumsum(g, 0)                                             # log decay from the chunk start
    tl.store(gc_ptr + rows * HV + hv, gamma, mask=rmask)

    dt = DOT                                                            # matmul operand dtype
    dks, dvs = tl.arange(0, BK), tl.arange(0, BV)
    kmask = rmask[:, None] & (dks < DK)[None, :]
    k = tl.load(k_ptr + rows[:, None] * stride_k + hk * stride_kh + dks[None, :], mask=kmask, other=0.0).to(tl.float32)
    if NORM_QK:
        k = _l2norm_rows(k)
    i, j = r[:, None], r[None, :]
    below = i > j
    L = tl.dot(k.to(dt), tl.trans(k.to(dt)), input_precision=PREC)
    L = tl.where(below, L * beta[:, None] * tl.exp(tl.where(below, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    T_inv = _solve_unit_lower(L, PREC).to(dt)                           # (I + L)^-1 [64, 64]

    w = tl.dot(T_inv, (k * (beta * tl.exp(gamma))[:, None]).to(dt), input_precision=PREC)
    tl.store(w_ptr + (rows * HV + hv)[:, None] * DK + dks[None, :], w.to(w_ptr.dtype.element_ty), mask=kmask)
    vmask = rmask[:, None] & (dvs < DV)[None, :]
    v = tl.load(v_ptr + rows[:, None] * stride_v + hv * stride_vh + dvs[None, :], mask=vmask, other=0.0)
    u = tl.dot(T_inv, (v.to(tl.float32) * beta[:, None]).to(dt), input_precision=PREC)
    tl.store(u_ptr + (rows * HV + hv)[:, None] * DV + dvs[None, :], u.to(u_ptr.dtype.element_ty), mask=vmask)

    q = tl.load(q_ptr + rows[:, None] * stride_q + hk * stride_qh + dks[None, :], mask=kmask, other=0.0).to(tl.float32)
    if NORM_QK:
        q = _l2norm_rows(q) * scale
    causal = i >= j
    qk = tl.dot(q.to(dt), tl.trans(k.to(dt)), input_precision=PREC)
    aqk = tl.where(causal, qk * tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    tl.store(aqk_ptr + (rows * HV + hv)[:, None] * 64 + j, aqk.to(aqk_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _chunk_state_kernel(q_ptr, k_ptr, stride_q, stride_k, stride_qh, stride_kh, w_ptr, u_ptr, gc_ptr, aqk_ptr,
                        o_ptr, h0_ptr, ht_ptr, idx_ptr, stride_hs, stride_hh, stride_hk, cu_ptr, scale,
                        HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, NORM_QK: tl.constexpr, HAS_INITIAL: tl.constexpr,
                        DOT: tl.constexpr, PREC: tl.constexpr):
    n, hv, vt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = hv // GROUP
    bos, eos = tl.load(cu_ptr + n), tl.load(cu_ptr + n + 1)
    idx = tl.load(idx_ptr + n)                                          # the sequence's state slot
    dks, dvs = tl.arange(0, BK), vt * BV + tl.arange(0, BV)
    hmask = (dks < tl.where(idx >= 0, DK, 0))[:, None] & (dvs < DV)[None, :]     # slot -1: no state
    h_off = tl.maximum(idx, 0).to(tl.int64) * stride_hs + hv * stride_hh + dks[:, None] * stride_hk + dvs[None, :]
    if HAS_INITIAL:
        h = tl.load(h0_ptr + h_off, mask=hmask, other=0.0).to(tl.float32)   # S [dk, BV], fp32 in registers
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    dt = DOT
    r = tl.arange(0, 64)
    for start in range(bos, eos, 64):
        rows = start + r
        rmask = rows < eos
        rows = rows.to(tl.int64)
        kmask = rmask[:, None] & (dks < DK)[None, :]
        vmask = rmask[:, None] & (dvs < DV)[None, :]
        gamma = tl.load(gc_ptr + rows * HV + hv, mask=rmask, other=0.0)
        g_last = tl.load(gc_ptr + (tl.minimum(start + 63, eos - 1).to(tl.int64) * HV + hv))
        w = tl.load(w_ptr + (rows * HV + hv)[:, None] * DK + dks[None, :], mask=kmask, other=0.0).to(dt)
        u = tl.load(u_ptr + (rows * HV + hv)[:, None] * DV + dvs[None, :], mask=vmask, other=0.0)
        aqk = tl.load(aqk_ptr + (rows * HV + hv)[:, None] * 64 + r[None, :], mask=rmask[:, None], other=0.0).to(dt)
        q = tl.load(q_ptr + rows[:, None] * stride_q + hk * stride_qh + dks[None, :], mask=kmask, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * stride_k + hk * stride_kh + dks[None, :], mask=kmask, other=0.0)
        q, k = q.to(tl.float32), k.to(tl.float32)
        if NORM_QK:
            q, k = _l2norm_rows(q) * scale, _l2norm_rows(k)
        h_in = h.to(dt)
        v_new = u.to(tl.float32) - tl.dot(w, h_in, input_precision=PREC)           # corrections  [64, BV]
        o = tl.dot((q * tl.exp(gamma)[:, None]).to(dt), h_in, input_precision=PREC)  # read S0 decayed to i
        o += tl.dot(aqk, v_new.to(dt), input_precision=PREC)                        # intra-chunk part
        tl.store(o_ptr + (rows * HV + hv)[:, None] * DV + dvs[None, :], o.to(o_ptr.dtype.element_ty), mask=vmask)
        k_write = (k * tl.exp(g_last - gamma)[:, None]).to(dt)                      # k_j decayed to chunk end
        h = h * tl.exp(g_last) + tl.dot(tl.trans(k_write), v_new.to(dt), input_precision=PREC)
    tl.debug_barrier()
    tl.store(ht_ptr + h_off, h, mask=hmask)


# ---------------------------------------------------------------------------------------------- launchers

def _chunk_table(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, first token) of every chunk of CHUNK tokens, each sequence chunked from its own start."""
    cu = cu_seqlens.long()
    counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK                                # [B] chunks per sequence
    total = int(counts.sum())                                                       # one host sync (prefill only)
    seq = torch.repeat_interleave(torch.arange(len(counts), device=cu.device), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts
    start = cu[:-1][seq] + (torch.arange(total, device=cu.device) - first[seq]) * CHUNK
    return seq.int(), start.int()


def _rule_varlen(q, k, v, g, beta, cu_seqlens, state_in, state_out, state_idx, raw_gates=None, scale=None,
                 chunks=None):
    """The gated delta rule over packed sequences. q, k [N, HK, dk], v [N, HV, dv] (strided views allowed, last dim
    contiguous); g, beta [N, HV] (or the raw a, b with raw_gates = (A_log, dt_bias)); states [S, HV, dk, dv] fp32 at
    rows state_idx [B]. scale None: q, k are used as given; else they are l2-normalised and q scaled by it.
    chunks: _chunk_table(cu_seqlens) when the caller has it already (its host sync is then not paid twice)."""
    N, HK, DK = k.shape
    HV, DV = v.shape[1], v.shape[2]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and state_out.stride(-1) == 1
    g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, beta))
    dt, dev = v.dtype, v.device
    prec = "ieee" if dt == torch.float32 else "tf32"          # fp32 dots (the solve; every dot for fp32 inputs)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"                        # the CPU grading path
    dot = tl.float32 if interpreted else _DOT_DTYPE[dt]                            # numpy's matmul has no bf16
    seq, start = chunks if chunks is not None else _chunk_table(cu_seqlens)
    w = torch.empty(N, HV, DK, dtype=dt, device=dev)
    u = torch.empty(N, HV, DV, dtype=dt, device=dev)
    gc = torch.empty(N, HV, dtype=torch.float32, device=dev)
    aqk = torch.empty(N, HV, CHUNK, dtype=dt, device=dev)
    o = torch.empty(N, HV, DV, dtype=dt, device=dev)
    A_log, dt_bias = raw_gates if raw_gates is not None else (g, g)               # unused without raw gates
    BK, BV = max(16, triton.next_power_of_2(DK)), max(16, triton.next_power_of_2(DV))   # tl.dot needs >= 16
    if len(seq):
        _chunk_prep_kernel[(len(seq), HV)](
            q, k, v, q.stride(0), k.stride(0), v.stride(0), q.stride(1), k.stride(1), v.stride(1),
            g, g.stride(0), beta, beta.stride(0), A_log, dt_bias, cu_seqlens, seq, start, w, u, gc, aqk,
            1.0 if scale is None else scale, HV=HV, GROUP=HV // HK, DK=DK, DV=DV, BK=BK, BV=BV,
            RAW_GATES=raw_gates is not None, NORM_QK=scale is not None, DOT=dot, PREC=prec,
            num_warps=4)                            # H200, bf16 [1, 8192, 32, 128]: 0.30 ms
    num_seqs = cu_seqlens.numel() - 1
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    bv = 64 if num_seqs * HV * triton.cdiv(DV, 64) >= 2 * sms else 32             # more programs when few sequences
    bv = min(bv, BV)
    # H200, bf16 [1, 8192, 32, 128], BV 32: 0.22 ms with 3 stages, 0.34 with 2; fp32 tiles at 3 stages need more
    # shared memory than the H200 has (287 KB of 227 KB at dk = 128)
    stages = 3 if bv <= 32 and v.element_size() == 2 else 2
    h0 = state_in if state_in is not None else state_out
    _chunk_state_kernel[(num_seqs, HV, triton.cdiv(DV, bv))](
        q, k, q.stride(0), k.stride(0), q.stride(1), k.stride(1), w, u, gc, aqk, o, h0, state_out, state_idx,
        state_out.stride(0), state_out.stride(1), state_out.stride(2), cu_seqlens, 1.0 if scale is None else scale,
        HV=HV, GROUP=HV // HK, DK=DK, DV=DV, BK=BK, BV=bv, NORM_QK=scale is not None,
        HAS_INITIAL=state_in is not None, DOT=dot, PREC=prec, num_warps=4, num_stages=stages)
    return o


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, cu_seqlens=None):
    """fla-shaped chunked rule: q, k [B, T, H, dk] (l2-normalised, q already scaled by dk^-0.5 as in m05),
    v [B, T, H, dv], g (log decay, fp32), beta [B, T, H]; with cu_seqlens [S+1], B = 1 and the S sequences are
    packed along T. initial_state [S or B, H, dk, dv] or None. Returns (o [B, T, H, dv] in v.dtype, final fp32)."""
    B, T, H, DK = k.shape
    DV = v.shape[-1]
    chunks = None
    if cu_seqlens is None:                          # B sequences of T: the chunk table without _chunk_table's host sync
        cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
        per_seq = triton.cdiv(T, CHUNK)
        c = torch.arange(B * per_seq, dtype=torch.int32, device=q.device)
        chunks = (c // per_seq, (c // per_seq) * T + (c % per_seq) * CHUNK)
    num_seqs = cu_seqlens.numel() - 1
    final = torch.empty(num_seqs, H, DK, DV, dtype=torch.float32, device=q.device)
    initial = None if initial_state is None else initial_state.float().contiguous()
    idx = torch.arange(num_seqs, dtype=torch.int32, device=q.device)
    o = _rule_varlen(q.reshape(B * T, H, DK), k.reshape(B * T, H, DK), v.reshape(B * T, H, DV),
                     g.reshape(B * T, H), beta.reshape(B * T, H), cu_seqlens, initial, final, idx, chunks=chunks)
    return o.view(B, T, H, DV), final


def gdn_prefill(mixed_qkv, a, b, conv_weight, A_log, dt_bias, cu_seqlens, conv_pool, ssm_pool, slots,
                num_k_heads, head_k_dim, head_v_dim, chunks=None):
    """Packed varlen prefill of one GDN layer from the pools' states at slots [B]; final states written back.
    mixed_qkv [N, C] -> o [N, nv, dv] (m05's rule output, before the gated norm).
    chunks: the (seq, start) int32 table _chunk_table(cu_seqlens) would return, when the caller has it already (the
    engine builds it once per step on the host: no host sync in any layer); None: built here."""
    N, C = mixed_qkv.shape
    K = conv_weight.shape[-1]
    nk, dk, dv, nv = num_k_heads, head_k_dim, head_v_dim, a.shape[-1]
    if mixed_qkv.stride(-1) != 1:
        mixed_qkv = mixed_qkv.contiguous()
    seq, start = chunks if chunks is not None else _chunk_table(cu_seqlens)
    x = torch.empty_like(mixed_qkv)                                                 # silu(conv) [N, C]
    BC = 64
    if len(seq):
        _conv_prefill_kernel[(len(seq), triton.cdiv(C, BC))](
            mixed_qkv, mixed_qkv.stride(0), conv_weight, conv_weight.stride(0), conv_pool, *conv_pool.stride(),
            slots, cu_seqlens, seq, start, x, C, K=K, BT=CHUNK, BC=BC)
    _conv_state_kernel[(cu_seqlens.numel() - 1, triton.cdiv(C, BC))](
        mixed_qkv, mixed_qkv.stride(0), conv_pool, *conv_pool.stride(), slots, cu_seqlens, C,
        K=K, BK=triton.next_power_of_2(K), BC=BC)
    q = x[:, :nk * dk].view(N, nk, dk)
    k = x[:, nk * dk:2 * nk * dk].view(N, nk, dk)
    v = x[:, 2 * nk * dk:].view(N, nv, dv)
    return _rule_varlen(q, k, v, a, b, cu_seqlens, ssm_pool, ssm_pool, slots, raw_gates=(A_log, dt_bias),
                        scale=dk ** -0.5, chunks=(seq, start))


def gdn_decode(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_pool, ssm_pool, slots,
               num_k_heads, head_k_dim, head_v_dim):
    """One token per sequence: mixed_qkv [B, C] -> o [B, nv, dv]; conv and recurrent states updated in place in
    the pools at slots [B] (-1: a padded row, nothing read or written). No host sync: CUDA-graph safe."""
    B, C = mixed_qkv.shape
    K = conv_weight.shape[-1]
    nk, dk, dv, nv = num_k_heads, head_k_dim, head_v_dim, a.shape[-1]
    assert ssm_pool.stride(-1) == 1 and mixed_qkv.stride(-1) == 1
    x = torch.empty(B, C, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    BC = 128
    _conv_update_kernel[(B, triton.cdiv(C, BC))](
        mixed_qkv, mixed_qkv.stride(0), conv_weight, conv_weight.stride(0), conv_pool, *conv_pool.stride(),
        slots, x, C, K=K, BK=triton.next_power_of_2(K), BC=BC)
    o = torch.empty(B, nv, dv, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    BK = triton.next_power_of_2(dk)
    BV = 64 if B * nv >= 512 else (32 if B * nv >= 128 else 16)                    # enough programs to fill the GPU
    BV = min(BV, triton.next_power_of_2(dv))
    _decode_rule_kernel[(B, nv, triton.cdiv(dv, BV))](
        x, a, a.stride(0), b, b.stride(0), A_log, dt_bias, ssm_pool, ssm_pool.stride(0), ssm_pool.stride(1),
        ssm_pool.stride(2), slots, o, C, dk ** -0.5, HV=nv, GROUP=nv // nk, DK=dk, DV=dv, BK=BK, BV=BV,
        num_warps=4)
    return o
