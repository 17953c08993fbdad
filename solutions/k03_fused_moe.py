"""K03 · Fused MoE in Triton: align (token, slot) pairs to expert blocks, then grouped GEMMs.

    out[n] = sum_j w[n, j] * Expert_{ids[n, j]}(x[n]),   Expert(h) = (silu(h Wg^T) * (h Wu^T)) Wd^T

m03 ran one SwiGLU per expert from Python (E launches, a host sync for the counts). Here the whole
MoE is five launches whose grids depend only on the shapes, so they fit in a CUDA graph:

1. moe_align_block_size: the M = N*k pairs sorted by expert (stable), each expert's segment padded
   to a multiple of BLOCK_M with the pad id M; expert_ids[b] is the expert of block b. The padded
   size is bounded in advance: M + min(E, M) * (BLOCK_M - 1).
2. _gate_up_kernel: one program per (block of BLOCK_M pairs, BLOCK_N columns of I). Every row of a
   block belongs to the same expert, so the block is a small GEMM against that expert's Wg and Wu;
   h = silu(gate) * up in the epilogue, stored per pair: h [M, I].
3. _down_kernel: h @ Wd^T for the block's expert, times the pair's routing weight: y [M, H].
4. the sum over the k slots of every token: out = y.view(N, k, H).sum(1).
Pad rows (pair id M) are masked in every load and store; blocks past the padded count return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .m03_sparse_moe import MoEWeights, route, swiglu


@triton.jit(do_not_specialize=["num_pairs"])   # N * top_k changes every prefill step: no recompile
def _count_kernel(topk_ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
    """Program e: counts[e] = how many of the num_pairs flat expert ids equal e."""
    e = tl.program_id(0)
    hits = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        hits += (ids == e).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(hits, axis=0))


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(topk_ids_ptr, counts_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                  num_pairs, num_experts, num_blocks,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program e: write expert e's pairs (in pair order) into its padded segment, and its block ids."""
    e = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M                  # [E] segment lengths
    start = tl.sum(tl.where(offs_e < e, padded, 0), axis=0)               # exclusive prefix sum at e
    end = start + tl.sum(tl.where(offs_e == e, padded, 0), axis=0)
    if e == 0:
        tl.store(num_post_ptr, tl.sum(padded, axis=0))
    for b0 in range(0, num_blocks, BLOCK):                                # blocks start//BM .. end//BM
        blocks = b0 + tl.arange(0, BLOCK)
        mine = (blocks * BLOCK_M >= start) & (blocks * BLOCK_M < end) & (blocks < num_blocks)
        tl.store(expert_ids_ptr + blocks, tl.zeros([BLOCK], dtype=tl.int32) + e, mask=mine)
    written = start
    for p0 in range(0, num_pairs, BLOCK):
        pairs = p0 + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = (ids == e).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - 1                                   # position among the hits
        tl.store(sorted_ids_ptr + written + rank, pairs, mask=hit == 1)
        written += tl.sum(hit, axis=0)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [N, k] -> (sorted_ids [P] int32, expert_ids [P // block_m] int32, num_tokens_post_padded [1] int32).

    P = M + min(E, M) * (block_m - 1), M = N*k, fixed by the shapes. sorted_ids holds the flat pair ids
    p (token p // k, slot p % k) grouped by expert in pair order, each expert's run padded with the id M
    up to a multiple of block_m; entries past num_tokens_post_padded are M too and their blocks have
    expert id -1. Computed on the device without a host sync.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    size = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = triton.cdiv(size, block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    expert_ids = torch.full((num_blocks,), -1, dtype=torch.int32, device=flat.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    num_post = torch.empty(1, dtype=torch.int32, device=flat.device)
    block = min(1024, triton.next_power_of_2(max(num_pairs, 16)))
    _count_kernel[(num_experts,)](flat, counts, num_pairs, BLOCK=block)
    _align_kernel[(num_experts,)](flat, counts, sorted_ids, expert_ids, num_post, num_pairs, num_experts,
                                  num_blocks, BLOCK_M=block_m, BLOCK=block,
                                  BLOCK_E=triton.next_power_of_2(num_experts))
    return sorted_ids, expert_ids, num_post


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(x_ptr, wg_ptr, wu_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                    num_pairs, top_k, inter, hidden,
                    stride_xn, stride_xh, stride_ge, stride_gi, stride_gh, stride_ue, stride_ui, stride_uh,
                    stride_hm, stride_hi,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """h[p, n] = silu(x[p // k] . Wg[e, n]) * (x[p // k] . Wu[e, n]) for the pairs p of block pid_m."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return                                                            # past the last padded block
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)                      # one expert per block
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs                                             # pad entries hold num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < inter
    a_ptrs = x_ptr + tokens[:, None] * stride_xn + offs_k[None, :] * stride_xh                # [BM, BK]
    g_ptrs = wg_ptr + e * stride_ge + offs_n[None, :] * stride_gi + offs_k[:, None] * stride_gh  # [BK, BN] = Wg^T
    u_ptrs = wu_ptr + e * stride_ue + offs_n[None, :] * stride_ui + offs_k[:, None] * stride_uh
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < hidden - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g.to(a.dtype), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u.to(a.dtype), acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_gh
        u_ptrs += BLOCK_K * stride_uh
    h = acc_g * tl.sigmoid(acc_g) * acc_u                                 # SwiGLU epilogue, fp32
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * stride_hm + offs_n[None, :] * stride_hi
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(h_ptr, wd_ptr, y_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                 num_pairs, hidden, inter,
                 stride_hm, stride_hi, stride_de, stride_dh, stride_di, stride_ym, stride_yh,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """y[p, n] = w[p] * (h[p] . Wd[e, n]) for the pairs p of block pid_m (w: the pair's routing weight)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < hidden
    a_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :] * stride_hi
    d_ptrs = wd_ptr + e * stride_de + offs_n[None, :] * stride_dh + offs_k[:, None] * stride_di   # [BK, BN] = Wd^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            d = tl.load(d_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            d = tl.load(d_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, d.to(a.dtype), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_hi
        d_ptrs += BLOCK_K * stride_di
    weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]                                           # the routing weight, once
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yh
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M from the average pairs per expert: small for decode (few rows per expert), large for prefill."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 12 else 32 if per_expert <= 24 else 64 if per_expert <= 96 else 128


def _tiles(block_m: int, dtype: torch.dtype) -> dict:
    """BLOCK_N, BLOCK_K, launch options (H200 target) and the dot precision: fp32 inputs stay IEEE, not TF32."""
    precision = "ieee" if dtype == torch.float32 else "tf32"      # tf32 is the default; ignored for bf16/fp16
    stages = 2 if dtype == torch.float32 else 4                # fp32 tiles are twice as big in shared memory
    if block_m == 16:   # small decode batches: few blocks, so narrow tiles to keep every SM streaming weights
        return dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=stages, PRECISION=precision)
    if block_m == 32:   # decode around batch 256: about one block per expert, each expert's weights read once
        return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=stages, PRECISION=precision)
    if block_m == 64:
        return dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=stages, PRECISION=precision)
    return dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=min(stages, 3), PRECISION=precision)


def gate_up_silu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, sorted_ids: torch.Tensor,
                 expert_ids: torch.Tensor, num_post: torch.Tensor, top_k: int, block_m: int,
                 out: torch.Tensor) -> torch.Tensor:
    """Launch _gate_up_kernel: out [M, I] (row p = pair p) = silu(x Wg^T) * (x Wu^T) per pair; pad rows untouched."""
    tiles = _tiles(block_m, x.dtype)
    inter, hidden = w_gate.shape[1], w_gate.shape[2]
    grid = (expert_ids.numel(), triton.cdiv(inter, tiles["BLOCK_N"]))
    _gate_up_kernel[grid](x, w_gate, w_up, out, sorted_ids, expert_ids, num_post,
                          out.shape[0], top_k, inter, hidden,
                          x.stride(0), x.stride(1), *w_gate.stride(), *w_up.stride(), out.stride(0), out.stride(1),
                          BLOCK_M=block_m, EVEN_K=hidden % tiles["BLOCK_K"] == 0, **tiles)
    return out


def down_weighted(h: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor,
                  expert_ids: torch.Tensor, num_post: torch.Tensor, block_m: int,
                  out: torch.Tensor) -> torch.Tensor:
    """Launch _down_kernel: out [M, H] (row p = pair p) = w[p] * (h[p] Wd^T); pad rows untouched."""
    tiles = _tiles(block_m, h.dtype)
    hidden, inter = w_down.shape[1], w_down.shape[2]
    grid = (expert_ids.numel(), triton.cdiv(hidden, tiles["BLOCK_N"]))
    _down_kernel[grid](h, w_down, out, topk_weights, sorted_ids, expert_ids, num_post,
                       out.shape[0], hidden, inter,
                       h.stride(0), h.stride(1), *w_down.stride(), out.stride(0), out.stride(1),
                       BLOCK_M=block_m, EVEN_K=inter % tiles["BLOCK_K"] == 0, **tiles)
    return out


def fused_experts(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [N, H], w_gate/w_up [E, I, H] (may be strided views), w_down [E, H, I], topk_* [N, k] -> [N, H] in x.dtype.

    align -> gate+up with SiLU(gate)*up -> down times the routing weight -> sum over the k slots.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, inter, hidden = w_gate.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = pick_block_m(num_pairs, num_experts)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts, block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    gate_up_silu(x, w_gate, w_up, sorted_ids, expert_ids, num_post, top_k, block_m, h)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    down_weighted(h, w_down, topk_weights.reshape(-1), sorted_ids, expert_ids, num_post, block_m, y)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)                   # row p = token p // k, slot p % k


def fused_moe_forward(x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """Drop-in for m03's moe_forward: m03's route (HF-exact), fused_experts, the sigmoid-gated shared expert."""
    weights, ids = route(x, w.router, w.top_k, w.norm_topk_prob)
    out = fused_experts(x, w.w_gate, w.w_up, w.w_down, weights, ids)
    if w.shared is not None:
        s = w.shared
        out = out + torch.sigmoid(x @ s.gate.T) * swiglu(x, s.gate_proj, s.up_proj, s.down_proj)
    return out
