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
    bn, bk = block
    *lead, n, k = w.shape
    nb, kb = triton.cdiv(n, bn), triton.cdiv(k, bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))            # zero padding never raises an amax
    blocks = padded.reshape(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))                                  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), scale


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
    pid, g = tl.program_id(0), tl.program_id(1)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = g * GROUP + tl.arange(0, GROUP)
    ok = (rows < T)[:, None] & (offs < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_xt + offs[None, :] * stride_xk, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)                                        # [ROWS]
    scale = tl.where(amax > 0, amax / 448.0, 1.0)                           # an all-zero group: scale 1
    q = _round_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0))
    tl.store(q_ptr + r64 * stride_qt + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + rows.to(tl.int64) * stride_st + g * stride_sg, scale, mask=rows < T)


def quantize_act_fp8(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_fp8 [T, K] float8_e4m3fn, x_scale [T, ceil(K/group)] fp32): one scale per token and group.
    x_scale is column-major (stride (1, T)), the layout cuBLAS's block-scaled FP8 GEMM reads (g01's FP8Linear)."""
    num_tokens, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(num_tokens, k, dtype=FP8, device=x.device)
    s = torch.empty(groups, num_tokens, dtype=torch.float32, device=x.device).t()
    if num_tokens:
        rows = 16 if num_tokens >= 16 else triton.next_power_of_2(num_tokens)
        _quant_act_kernel[(triton.cdiv(num_tokens, rows), groups)](
            x, q, s, num_tokens, k, x.stride(0), x.stride(1), q.stride(0), s.stride(0), s.stride(1),
            GROUP=group, ROWS=rows)
    return q, s


@triton.jit(do_not_specialize=["T", "stride_xsk"])   # T and the scales' column stride (= T) change every step
def _fp8_linear_kernel(x_ptr, w_ptr, ws_ptr, xs_ptr, y_ptr, T, N, K,
                       stride_xt, stride_xk, stride_wn, stride_wk, stride_wsn, stride_wsk, stride_xst, stride_xsk,
                       stride_yt, stride_yn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SCALE_BLOCK: tl.constexpr, ACT_FP8: tl.constexpr, EVEN_K: tl.constexpr,
                       PRECISION: tl.constexpr):
    """y[t, n] = sum over K-tiles of (x_tile . w_tile^T) * w_scale[n // 128, k0 // 128] (* x_scale[t, k0 // 128])."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < T, offs_n < N
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :] * stride_xk         # [BM, BK]
    b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk         # [BK, BN] = w^T
    ws_ptrs = ws_ptr + (offs_n // SCALE_BLOCK) * stride_wsn                                         # [BN]
    xs_ptrs = xs_ptr + offs_m.to(tl.int64) * stride_xst                                             # [BM]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        ks = k0 // SCALE_BLOCK                                              # the tile's one scale column
        w_s = tl.load(ws_ptrs + ks * stride_wsk, mask=n_ok, other=0.0)
        if ACT_FP8:
            x_s = tl.load(xs_ptrs + ks * stride_xsk, mask=m_ok, other=0.0)
            acc += tl.dot(a, b) * (x_s[:, None] * w_s[None, :])            # FP8 x FP8, exact products
        else:
            acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION) * w_s[None, :]
        a_ptrs += BLOCK_K * stride_xk
        b_ptrs += BLOCK_K * stride_wk
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_yt + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


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
    act_fp8 = x_scale is not None
    num_tokens, k = x.shape
    n = w_fp8.shape[0]
    y = torch.empty(num_tokens, n, dtype=out_dtype, device=x.device)
    if num_tokens == 0:
        return y
    tiles = _linear_tiles(num_tokens, x.dtype, act_fp8)
    grid = (triton.cdiv(num_tokens, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]))
    xs = x_scale if x_scale is not None else scale_inv                      # unused when not act_fp8
    _fp8_linear_kernel[grid](x, w_fp8, scale_inv, xs, y, num_tokens, n, k,
                             x.stride(0), x.stride(1), w_fp8.stride(0), w_fp8.stride(1),
                             scale_inv.stride(0), scale_inv.stride(1), xs.stride(0), xs.stride(1), y.stride(0), y.stride(1),
                             SCALE_BLOCK=BLOCK, ACT_FP8=act_fp8, EVEN_K=k % tiles["BLOCK_K"] == 0, **tiles)
    return y


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Weight-only FP8: x [T, K] (fp32/bf16/fp16), w_fp8 [N, K], scale_inv [ceil(N/128), ceil(K/128)] -> y [T, N]
    in x.dtype; equal to x @ dequantize(w).T up to fp32 accumulation error."""
    return _launch_linear(x, None, w_fp8, scale_inv, x.dtype)


def w8a8_linear(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """W8A8: x quantized per (token, 128 columns), FP8 x FP8 dots, both scales per K-tile -> y [T, N] in x.dtype."""
    x_fp8, x_scale = quantize_act_fp8(x)
    return _launch_linear(x_fp8, x_scale, w_fp8, scale_inv, x.dtype)


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
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < inter
    a_ptrs = x_ptr + tokens[:, None] * stride_xn + offs_k[None, :] * stride_xh
    g_ptrs = wg_ptr + e * stride_ge + offs_n[None, :] * stride_gi + offs_k[:, None] * stride_gh
    u_ptrs = wu_ptr + e * stride_ue + offs_n[None, :] * stride_ui + offs_k[:, None] * stride_uh
    sg_ptrs = sg_ptr + e * stride_sge + (offs_n // SCALE_BLOCK) * stride_sgi
    su_ptrs = su_ptr + e * stride_sue + (offs_n // SCALE_BLOCK) * stride_sui
    xs_ptrs = xs_ptr + tokens * stride_xsn
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
        ks = k0 // SCALE_BLOCK
        s_g = tl.load(sg_ptrs + ks * stride_sgh, mask=n_ok, other=0.0)
        s_u = tl.load(su_ptrs + ks * stride_suh, mask=n_ok, other=0.0)
        if ACT_FP8:
            x_s = tl.load(xs_ptrs + ks * stride_xsh, mask=valid, other=0.0)
            acc_g += tl.dot(a, g) * (x_s[:, None] * s_g[None, :])
            acc_u += tl.dot(a, u) * (x_s[:, None] * s_u[None, :])
        else:
            acc_g += tl.dot(a, g.to(a.dtype), input_precision=PRECISION) * s_g[None, :]
            acc_u += tl.dot(a, u.to(a.dtype), input_precision=PRECISION) * s_u[None, :]
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_gh
        u_ptrs += BLOCK_K * stride_uh
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * stride_hm + offs_n[None, :] * stride_hi
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "stride_hsi"])   # stride_hsi: N·k for column-major h_scale
def _down_fp8_kernel(h_ptr, hs_ptr, wd_ptr, sd_ptr, y_ptr, topk_weights_ptr,
                     sorted_ids_ptr, expert_ids_ptr, num_post_ptr, num_pairs, hidden, inter,
                     stride_hm, stride_hi, stride_hsm, stride_hsi, stride_de, stride_dh, stride_di,
                     stride_sde, stride_sdh, stride_sdi, stride_ym, stride_yh,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SCALE_BLOCK: tl.constexpr, ACT_FP8: tl.constexpr, EVEN_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    """y[p, n] = w[p] * (h[p] . Wd[e, n]), FP8 Wd scaled per block per K-tile (and h per token group if ACT_FP8)."""
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
    d_ptrs = wd_ptr + e * stride_de + offs_n[None, :] * stride_dh + offs_k[:, None] * stride_di
    sd_ptrs = sd_ptr + e * stride_sde + (offs_n // SCALE_BLOCK) * stride_sdh
    hs_ptrs = hs_ptr + rows * stride_hsm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            d = tl.load(d_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            d = tl.load(d_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        ks = k0 // SCALE_BLOCK
        s_d = tl.load(sd_ptrs + ks * stride_sdi, mask=n_ok, other=0.0)
        if ACT_FP8:
            h_s = tl.load(hs_ptrs + ks * stride_hsi, mask=valid, other=0.0)
            acc += tl.dot(a, d) * (h_s[:, None] * s_d[None, :])
        else:
            acc += tl.dot(a, d.to(a.dtype), input_precision=PRECISION) * s_d[None, :]
        a_ptrs += BLOCK_K * stride_hi
        d_ptrs += BLOCK_K * stride_di
    weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yh
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


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
    act_fp8 = x_scale is not None
    tiles = _moe_tiles(block_m, x.dtype)
    inter, hidden = w_gate.shape[1], w_gate.shape[2]
    xs = x_scale if act_fp8 else s_gate[0]                                 # unused when not act_fp8
    grid = (expert_ids.numel(), triton.cdiv(inter, tiles["BLOCK_N"]))
    _gate_up_fp8_kernel[grid](x, xs, w_gate, w_up, s_gate, s_up, out, sorted_ids, expert_ids, num_post,
                              out.shape[0], top_k, inter, hidden, x.stride(0), x.stride(1), xs.stride(0), xs.stride(1),
                              *w_gate.stride(), *w_up.stride(), *s_gate.stride(), *s_up.stride(),
                              out.stride(0), out.stride(1), BLOCK_M=block_m, SCALE_BLOCK=BLOCK, ACT_FP8=act_fp8,
                              EVEN_K=hidden % tiles["BLOCK_K"] == 0, **tiles)
    return out


def down_fp8(h: torch.Tensor, h_scale: torch.Tensor | None, w_down: torch.Tensor, s_down: torch.Tensor,
             topk_weights: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post: torch.Tensor,
             block_m: int, out: torch.Tensor) -> torch.Tensor:
    """Launch _down_fp8_kernel: out [M, H] (row p = pair p) = w[p] * (h[p] Wd^T), Wd dequantized per block in the
    kernel. h [M, I] in a float dtype (h_scale None) or FP8 with h_scale [M, ceil(I/128)]."""
    act_fp8 = h_scale is not None
    tiles = _moe_tiles(block_m, h.dtype)
    hidden, inter = w_down.shape[1], w_down.shape[2]
    hs = h_scale if act_fp8 else s_down[0]
    grid = (expert_ids.numel(), triton.cdiv(hidden, tiles["BLOCK_N"]))
    _down_fp8_kernel[grid](h, hs, w_down, s_down, out, topk_weights, sorted_ids, expert_ids, num_post,
                           out.shape[0], hidden, inter, h.stride(0), h.stride(1), hs.stride(0), hs.stride(1),
                           *w_down.stride(), *s_down.stride(), out.stride(0), out.stride(1),
                           BLOCK_M=block_m, SCALE_BLOCK=BLOCK, ACT_FP8=act_fp8,
                           EVEN_K=inter % tiles["BLOCK_K"] == 0, **tiles)
    return out


def fused_experts_fp8(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      s_gate: torch.Tensor, s_up: torch.Tensor, s_down: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, act_fp8: bool = False) -> torch.Tensor:
    """k03's fused_experts with FP8 experts: w_gate/w_up [E, I, H], w_down [E, H, I] float8_e4m3fn (may be strided
    views), s_gate/s_up [E, ceil(I/128), ceil(H/128)], s_down [E, ceil(H/128), ceil(I/128)] -> [N, H] in x.dtype.
    act_fp8: x and h are quantized per (row, 128 columns) and both GEMMs are FP8 x FP8."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter, hidden = w_gate.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = min(pick_block_m(num_pairs, num_experts), 64)   # 128-row blocks were slower in every FP8 tiling
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts, block_m)
    a, a_scale = quantize_act_fp8(x) if act_fp8 else (x, None)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    gate_up_fp8(a, a_scale, w_gate, w_up, s_gate, s_up, sorted_ids, expert_ids, num_post, top_k, block_m, h)
    b, b_scale = quantize_act_fp8(h) if act_fp8 else (h, None)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    down_fp8(b, b_scale, w_down, s_down, topk_weights.reshape(-1), sorted_ids, expert_ids, num_post, block_m, y)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


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
    weights, ids = route(x, w.router, w.top_k, w.norm_topk_prob)
    out = fused_experts_fp8(x, w.w_gate, w.w_up, w.w_down, w.s_gate, w.s_up, w.s_down, weights, ids,
                            act_fp8=w.act_fp8)
    if w.shared is not None:
        s = w.shared
        out = out + torch.sigmoid(x @ s.gate.T) * swiglu(x, s.gate_proj, s.up_proj, s.down_proj)
    return out
