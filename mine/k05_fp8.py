"""K05 · FP8 weights: block-scaled e4m3 GEMMs in Triton (weight-only and w8a8), and the FP8 fused MoE.

A Qwen3 FP8 checkpoint stores every linear weight w [N, K] as w_fp8 [N, K] float8_e4m3fn plus one fp32
multiplier per 128x128 block, `weight_scale_inv` [ceil(N/128), ceil(K/128)]:

    w[n, k] ~= w_fp8[n, k] * scale_inv[n // 128, k // 128]

1. fp8_linear (weight-only): y = x @ w^T. The kernel loads FP8 weight tiles (half the bytes of bf16),
   converts them in registers to x's dtype, and for every K-tile (BLOCK_K divides 128, so one scale column
   per tile) multiplies the tile's partial dot by the scale vector over N before adding it to the fp32
   accumulator: BLOCK_N multiplies per tile row, not one per weight element.
2. quantize_act_fp8: dynamic per-token-group quantization of x, one scale per (token, 128 columns):
   s = amax / 448, x_fp8 = round_e4m3(x / s).
3. w8a8_linear: quantize_act_fp8, then an FP8 x FP8 tl.dot per K-tile scaled by x_scale[t] * w_scale[n].
4. fused_experts_fp8: k03's structure (moe_align_block_size, gate+up with SiLU, down times the routing
   weight, sum over the k slots) with FP8 expert weights scaled per block inside both grouped GEMMs;
   act_fp8=True quantizes x before gate/up and h before down, per token group, as w8a8 does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .k03_fused_moe import moe_align_block_size, pick_block_m
from .m03_sparse_moe import SharedExpert, route, swiglu

FP8_MAX = 448.0                     # the largest finite float8_e4m3fn
BLOCK = 128                         # the checkpoint's weight_block_size, and the activation group
FP8 = torch.float8_e4m3fn


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (w_fp8 [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N/bn), ceil(K/bk)] fp32).

    scale = amax(|block|) / 448 so the block's largest element maps to +-448; an all-zero block gets scale 1
    (its FP8 values are 0 whatever the scale). Works on [N, K] and stacked experts [E, N, K].
    """
    raise NotImplementedError("k05: 请实现 quantize_block_fp8（见 lessons/k05_fp8.md）")


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still fp32 (so exact).

    Given code: the Triton interpreter's own fp32 -> fp8 cast does not round to nearest even (a mantissa carry
    is lost: 7.96 becomes 4.0), so the kernels round first and the cast that follows is exact on any backend.
    The e4m3 spacing at v is 2^(e-3) for 2^e <= |v| (e >= -6) and 2^-9 below 2^-6 (subnormals); adding and
    subtracting 1.5 * 2^23 * spacing rounds v to a multiple of the spacing in fp32's round-to-nearest-even.
    """
    exp = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF                    # biased fp32 exponent of v
    exp = tl.maximum(exp, 127 - 6)
    spacing = ((exp - 3) << 23).to(tl.float32, bitcast=True)
    magic = spacing * 12582912.0                                           # 1.5 * 2^23 * spacing
    return (v + magic) - magic


@triton.jit(do_not_specialize=["T", "stride_sg"])   # stride_sg = T (column-major scales)
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_xt, stride_xk, stride_qt, stride_st, stride_sg,
                      GROUP: tl.constexpr, ROWS: tl.constexpr):
    """Program (i, g): rows t = i*ROWS .. i*ROWS+ROWS-1, s[t, g] = amax(x[t, g*GROUP : (g+1)*GROUP]) / 448,
    q = round_e4m3(x / s). ROWS rows per program: one row of 128 would leave each program a few hundred bytes."""
    raise NotImplementedError("k05: 请实现 _quant_act_kernel（见 lessons/k05_fp8.md）")


def quantize_act_fp8(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_fp8 [T, K] float8_e4m3fn, x_scale [T, ceil(K/group)] fp32): one scale per token and group.
    x_scale is column-major (stride (1, T)), the layout cuBLAS's block-scaled FP8 GEMM reads (g01's FP8Linear)."""
    raise NotImplementedError("k05: 请实现 quantize_act_fp8（见 lessons/k05_fp8.md）")


@triton.jit(do_not_specialize=["T", "stride_xsk"])   # T and the scales' column stride (= T) change every step
def _fp8_linear_kernel(x_ptr, w_ptr, ws_ptr, xs_ptr, y_ptr, T, N, K,
                       stride_xt, stride_xk, stride_wn, stride_wk, stride_wsn, stride_wsk, stride_xst, stride_xsk,
                       stride_yt, stride_yn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SCALE_BLOCK: tl.constexpr, ACT_FP8: tl.constexpr, EVEN_K: tl.constexpr,
                       PRECISION: tl.constexpr):
    """y[t, n] = sum over K-tiles of (x_tile . w_tile^T) * w_scale[n // 128, k0 // 128] (* x_scale[t, k0 // 128])."""
    raise NotImplementedError("k05: 请实现 _fp8_linear_kernel（见 lessons/k05_fp8.md）")


def _linear_tiles(num_tokens: int, dtype: torch.dtype, act_fp8: bool) -> dict:
    """Tiles for one linear (H200 target). BLOCK_N and BLOCK_K divide 128: a K-tile never straddles two scale
    columns and an N-tile never straddles two scale rows. Decode: narrow N-tiles so every SM streams weights."""
    precision = "ieee" if dtype == torch.float32 else "tf32"               # fp32 stays IEEE, not TF32
    if num_tokens <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, PRECISION=precision)
    if not act_fp8:
        if num_tokens <= 64:
            return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, PRECISION=precision)
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=2 if dtype == torch.float32 else 3,
                    PRECISION=precision)
    if num_tokens <= 256:   # w8a8 tiles from an H200 sweep (2026-12-03): 2048 x 4096 at 256 tokens, 5120 x 2048 at 8k
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, PRECISION=precision)
    return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, PRECISION=precision)


def _launch_linear(x, x_scale, w_fp8, scale_inv, out_dtype: torch.dtype) -> torch.Tensor:
    """y [T, N] in out_dtype from x [T, K] (x_scale None: weight-only) or x_fp8 with x_scale [T, ceil(K/128)]."""
    raise NotImplementedError("k05: 请实现 _launch_linear（见 lessons/k05_fp8.md）")


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Weight-only FP8: x [T, K] (fp32/bf16/fp16), w_fp8 [N, K], scale_inv [ceil(N/128), ceil(K/128)] -> y [T, N]
    in x.dtype; equal to x @ dequantize(w).T up to fp32 accumulation error."""
    raise NotImplementedError("k05: 请实现 fp8_linear（见 lessons/k05_fp8.md）")


def w8a8_linear(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """W8A8: x quantized per (token, 128 columns), FP8 x FP8 dots, both scales per K-tile -> y [T, N] in x.dtype."""
    raise NotImplementedError("k05: 请实现 w8a8_linear（见 lessons/k05_fp8.md）")


@triton.jit(do_not_specialize=["num_pairs", "stride_xsh"])   # stride_xsh: N for column-major x_scale
def _gate_up_fp8_kernel(x_ptr, xs_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr,
                        sorted_ids_ptr, expert_ids_ptr, num_post_ptr, num_pairs, top_k, inter, hidden,
                        stride_xn, stride_xh, stride_xsn, stride_xsh,
                        stride_ge, stride_gi, stride_gh, stride_ue, stride_ui, stride_uh,
                        stride_sge, stride_sgi, stride_sgh, stride_sue, stride_sui, stride_suh,
                        stride_hm, stride_hi,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SCALE_BLOCK: tl.constexpr, ACT_FP8: tl.constexpr, EVEN_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    """h[p, n] = silu(x[p // k] . Wg[e, n]) * (x[p // k] . Wu[e, n]), FP8 weights scaled per block per K-tile."""
    raise NotImplementedError("k05: 请实现 _gate_up_fp8_kernel（见 lessons/k05_fp8.md）")


@triton.jit(do_not_specialize=["num_pairs", "stride_hsi"])   # stride_hsi: N·k for column-major h_scale
def _down_fp8_kernel(h_ptr, hs_ptr, wd_ptr, sd_ptr, y_ptr, topk_weights_ptr,
                     sorted_ids_ptr, expert_ids_ptr, num_post_ptr, num_pairs, hidden, inter,
                     stride_hm, stride_hi, stride_hsm, stride_hsi, stride_de, stride_dh, stride_di,
                     stride_sde, stride_sdh, stride_sdi, stride_ym, stride_yh,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SCALE_BLOCK: tl.constexpr, ACT_FP8: tl.constexpr, EVEN_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    """y[p, n] = w[p] * (h[p] . Wd[e, n]), FP8 Wd scaled per block per K-tile (and h per token group if ACT_FP8)."""
    raise NotImplementedError("k05: 请实现 _down_fp8_kernel（见 lessons/k05_fp8.md）")


def _moe_tiles(block_m: int, dtype: torch.dtype) -> dict:
    """BLOCK_N, BLOCK_K (both divide 128), launch options and the dot precision (fp32: IEEE). dtype is the
    activations' dtype: float8_e4m3fn on the w8a8 path. Picked by a sweep on an H200 (Qwen3-30B-A3B's MoE, batch 256
    and 8,192 tokens, 2026-12-03): decode is best with 64-wide N-tiles and the whole 128-column scale block per
    K-step; prefill (BLOCK_M 64, see fused_experts_fp8) with 64-wide N-tiles on the w8a8 path."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    fp32 = dtype == torch.float32
    if block_m <= 32:   # decode: about one block per expert, narrow N-tiles keep every SM streaming FP8 weights
        return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3 if fp32 else 4, PRECISION=precision)
    if dtype == FP8:    # w8a8 prefill
        return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4 if block_m == 64 else 8, num_stages=3 if block_m == 64 else 4,
                    PRECISION=precision)
    return dict(BLOCK_N=128, BLOCK_K=64, num_warps=4 if block_m == 64 else 8, num_stages=3, PRECISION=precision)


def gate_up_fp8(x: torch.Tensor, x_scale: torch.Tensor | None, w_gate: torch.Tensor, w_up: torch.Tensor,
                s_gate: torch.Tensor, s_up: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                num_post: torch.Tensor, top_k: int, block_m: int, out: torch.Tensor) -> torch.Tensor:
    """Launch _gate_up_fp8_kernel: out [M, I] (row p = pair p) = silu(x Wg^T) * (x Wu^T) with Wg, Wu dequantized per
    block inside the kernel. x [N, H] in a float dtype (x_scale None) or FP8 with x_scale [N, ceil(H/128)]."""
    raise NotImplementedError("k05: 请实现 gate_up_fp8（见 lessons/k05_fp8.md）")


def down_fp8(h: torch.Tensor, h_scale: torch.Tensor | None, w_down: torch.Tensor, s_down: torch.Tensor,
             topk_weights: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post: torch.Tensor,
             block_m: int, out: torch.Tensor) -> torch.Tensor:
    """Launch _down_fp8_kernel: out [M, H] (row p = pair p) = w[p] * (h[p] Wd^T), Wd dequantized per block in the
    kernel. h [M, I] in a float dtype (h_scale None) or FP8 with h_scale [M, ceil(I/128)]."""
    raise NotImplementedError("k05: 请实现 down_fp8（见 lessons/k05_fp8.md）")


def fused_experts_fp8(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      s_gate: torch.Tensor, s_up: torch.Tensor, s_down: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, act_fp8: bool = False) -> torch.Tensor:
    """k03's fused_experts with FP8 experts: w_gate/w_up [E, I, H], w_down [E, H, I] float8_e4m3fn (may be strided
    views), s_gate/s_up [E, ceil(I/128), ceil(H/128)], s_down [E, ceil(H/128), ceil(I/128)] -> [N, H] in x.dtype.
    act_fp8: x and h are quantized per (row, 128 columns) and both GEMMs are FP8 x FP8."""
    raise NotImplementedError("k05: 请实现 fused_experts_fp8（见 lessons/k05_fp8.md）")


@dataclass
class FP8MoEWeights:
    """m03's MoEWeights with the three expert tensors in FP8 and their block scales; router and shared expert
    stay in the model dtype (as Qwen's FP8 checkpoints keep the router gate unquantized)."""
    router: torch.Tensor      # [E, H]
    w_gate: torch.Tensor      # [E, I, H] float8_e4m3fn
    w_up: torch.Tensor        # [E, I, H] float8_e4m3fn
    w_down: torch.Tensor      # [E, H, I] float8_e4m3fn
    s_gate: torch.Tensor      # [E, ceil(I/128), ceil(H/128)] fp32
    s_up: torch.Tensor        # [E, ceil(I/128), ceil(H/128)] fp32
    s_down: torch.Tensor      # [E, ceil(H/128), ceil(I/128)] fp32
    top_k: int
    norm_topk_prob: bool
    shared: SharedExpert | None = None
    act_fp8: bool = False     # True: dynamic per-token-group activation quantization (w8a8)


def fp8_moe_forward(x: torch.Tensor, w: FP8MoEWeights) -> torch.Tensor:
    """m03's route (HF-exact), fused_experts_fp8, the sigmoid-gated shared expert (unquantized)."""
    raise NotImplementedError("k05: 请实现 fp8_moe_forward（见 lessons/k05_fp8.md）")
