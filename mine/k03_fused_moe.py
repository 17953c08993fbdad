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
    raise NotImplementedError("k03: 请实现 _count_kernel（见 lessons/k03_fused_moe.md）")


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(topk_ids_ptr, counts_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                  num_pairs, num_experts, num_blocks,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program e: write expert e's pairs (in pair order) into its padded segment, and its block ids."""
    raise NotImplementedError("k03: 请实现 _align_kernel（见 lessons/k03_fused_moe.md）")


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [N, k] -> (sorted_ids [P] int32, expert_ids [P // block_m] int32, num_tokens_post_padded [1] int32).

    P = M + min(E, M) * (block_m - 1), M = N*k, fixed by the shapes. sorted_ids holds the flat pair ids
    p (token p // k, slot p % k) grouped by expert in pair order, each expert's run padded with the id M
    up to a multiple of block_m; entries past num_tokens_post_padded are M too and their blocks have
    expert id -1. Computed on the device without a host sync.
    """
    raise NotImplementedError("k03: 请实现 moe_align_block_size（见 lessons/k03_fused_moe.md）")


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(x_ptr, wg_ptr, wu_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                    num_pairs, top_k, inter, hidden,
                    stride_xn, stride_xh, stride_ge, stride_gi, stride_gh, stride_ue, stride_ui, stride_uh,
                    stride_hm, stride_hi,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """h[p, n] = silu(x[p // k] . Wg[e, n]) * (x[p // k] . Wu[e, n]) for the pairs p of block pid_m."""
    raise NotImplementedError("k03: 请实现 _gate_up_kernel（见 lessons/k03_fused_moe.md）")


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(h_ptr, wd_ptr, y_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                 num_pairs, hidden, inter,
                 stride_hm, stride_hi, stride_de, stride_dh, stride_di, stride_ym, stride_yh,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """y[p, n] = w[p] * (h[p] . Wd[e, n]) for the pairs p of block pid_m (w: the pair's routing weight)."""
    raise NotImplementedError("k03: 请实现 _down_kernel（见 lessons/k03_fused_moe.md）")


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
    raise NotImplementedError("k03: 请实现 gate_up_silu（见 lessons/k03_fused_moe.md）")


def down_weighted(h: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor,
                  expert_ids: torch.Tensor, num_post: torch.Tensor, block_m: int,
                  out: torch.Tensor) -> torch.Tensor:
    """Launch _down_kernel: out [M, H] (row p = pair p) = w[p] * (h[p] Wd^T); pad rows untouched."""
    raise NotImplementedError("k03: 请实现 down_weighted（见 lessons/k03_fused_moe.md）")


def fused_experts(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [N, H], w_gate/w_up [E, I, H] (may be strided views), w_down [E, H, I], topk_* [N, k] -> [N, H] in x.dtype.

    align -> gate+up with SiLU(gate)*up -> down times the routing weight -> sum over the k slots.
    """
    raise NotImplementedError("k03: 请实现 fused_experts（见 lessons/k03_fused_moe.md）")


def fused_moe_forward(x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """Drop-in for m03's moe_forward: m03's route (HF-exact), fused_experts, the sigmoid-gated shared expert."""
    raise NotImplementedError("k03: 请实现 fused_moe_forward（见 lessons/k03_fused_moe.md）")
