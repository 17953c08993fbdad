"""Checks for K05 · FP8 weights (lessons/k05_fp8.md).

Oracles: torch in fp32/fp64 on the dequantized weights (m06's dequantize_block_fp8: w_fp8 * scale_inv per
128x128 block), torch's own float8_e4m3fn cast (round to nearest even) for the quantizers, and HF transformers
5.17.0's Qwen3-MoE / Omni talker sparse MoE blocks run on the dequantized expert weights.
Weight-only results must equal x @ dequantize(w)^T up to fp32 accumulation error; w8a8 results the same computation
on the quantize-dequantized activations. Every check runs the kernels on checks.kit.DEVICE: without CUDA in
Triton's interpreter (fp32 x: the interpreter's bf16 tl.dot is unreliable), with CUDA natively; with CUDA the
real-shape bf16 checks run too (without CUDA they are reported as skipped).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from checks import oracles
from checks.kit import (DEVICE, GuardedAlloc, Rand, assert_close, assert_dtype, assert_equal, explain_crash, impl, point,
                        record_case)

MODULE = "k05_fp8"
# FP8 x FP8 dots: exact products, fp32 accumulation in the interpreter (1e-5 of |a|.|b|); on Hopper the FP8 tensor
# cores accumulate inside one wgmma in a narrower register (about 14 mantissa bits: DeepSeek-V3 technical report,
# section 3.3.2), and the kernels promote to fp32 once per 128-column K-tile. Measured on an H200 (2026-12-03):
# 0.013 at 25.1 in a 280-wide w8a8 dot. 2e-3 of |a|.|b| covers that and still fails a wrong scale by orders.
FP8_DOT_REL = 1e-5 if DEVICE.type == "cpu" else 2e-3
FP8 = torch.float8_e4m3fn
CRASHES = {
    "'NoneType' object has no attribute": "忘了 w.shared is None（Qwen3-MoE 没有 shared expert）时跳过",
    "NaN": "全零 block / group 的 scale 为 0：x / 0 得到 NaN（scale 要取正数，卡片约定为 1）",
}
M_SCALE_INDEX = ("block scale 用错了：每个 K-tile（BLOCK_K 整除 128）的部分和乘这个 tile 的 scale，行号 n // 128、"
                 "列号 k0 // 128，stride 从 scale_inv.stride() 取；所有 scale 换成 1 时结果是对的")
M_STORE_MASK = "store 的 mask 没有把 T、N 的尾部挡住（offs_m < T、offs_n < N）：越界写会破坏别的张量"
M_K_TAIL = ("K 维的尾部没有 mask 对：K 大于 BLOCK_K 且不是它的整数倍时，最后一次循环只剩 K − k0 列"
            "（mask 是 offs_k < K − k0），多读的列属于下一行")


def _dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """w = w_fp8 * scale_inv[n // 128, k // 128] in fp32 (m06's dequantize_block_fp8)."""
    return impl("m06_models").dequantize_block_fp8(q.cpu(), s.cpu())


def _act_quant(x: torch.Tensor, scale: torch.Tensor | None = None, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """torch oracle of quantize_act_fp8: per (row, `group` columns) scale = amax / 448 in fp32 (1 for an all-zero
    group) and the round-to-nearest-even cast of x / scale, from x alone (any float dtype: read as fp32); with
    `scale` given, only the cast."""
    rows, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float().cpu(), (0, groups * group - k)).view(rows, groups, group)
    if scale is None:
        amax = padded.abs().amax(-1)
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (padded / scale.cpu()[..., None]).clamp(-448.0, 448.0).to(FP8)
    return q.view(rows, groups * group)[:, :k].contiguous(), scale.cpu()


def _act_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.cpu().float() * s.cpu().repeat_interleave(128, -1)[:, :q.shape[1]]


def _spread(r: Rand, *shape, low: float = -4.0, decades: float = 6.0) -> torch.Tensor:
    """Block scales spanning `decades` orders of magnitude from 10^low: reading a neighbour's scale is far off."""
    return 10.0 ** (torch.rand(*shape, generator=r.gen) * decades + low)


def _fp8_weight(r: Rand, *shape, zero_block: bool = True, low: float = -4.0,
                decades: float = 6.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 weights [..., N, K] with spread scales; the last block of the first matrix all zero."""
    q = (r.randn(*shape) * 100).clamp(-448, 448).to(FP8)
    s = _spread(r, *shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128), low=low, decades=decades)
    if zero_block:
        first = q.view(-1, *shape[-2:])[0]
        first[(s.shape[-2] - 1) * 128:, (s.shape[-1] - 1) * 128:] = 0
        s.view(-1, *s.shape[-2:])[0, -1, -1] = 1e6            # a zero block: any scale gives zeros
    return q, s


def _assert_fp32(out, ref: torch.Tensor, bound: torch.Tensor, *, what: str, r: Rand, rel: float = 1e-5,
                 looks_like=()) -> None:
    """|out - ref| <= rel * bound elementwise, bound = |a| @ |b|^T: fp32 accumulation error of a dot of that size."""
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise AssertionError(f"{what}：形状应为 {list(ref.shape)}，得到 {got}；{r}")
    out = out.detach().cpu().double()
    tol = rel * bound.double() + 1e-30
    err = (out - ref.double()).abs()
    bad = ~(err <= tol)
    if not bool(bad.any()):
        return
    ratio = torch.nan_to_num(err / tol, nan=float("inf"))
    idx = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
    msg = (f"{what}：{int(bad.sum())} 个元素超出 fp32 累加误差（容差 {rel:g}·(|a|·|b|ᵀ)），最差的在 {list(idx)}："
           f"得到 {float(out[idx]):.6g}，期望 {float(ref[idx]):.6g}；{r}")
    for wrong, mistake in looks_like:
        wrong = None if wrong is None else wrong.double()
        if wrong is not None and bool(((out - wrong).abs() <= tol + 1e-4 * wrong.abs() + 1e-5 * wrong.abs().max()).all()):
            msg += f"\n  看起来像易错点：{mistake}"
            break
    raise AssertionError(msg)


@contextlib.contextmanager
def _hint_if(evidence, mistake: str):
    """A failure inside names `mistake` when `evidence()` (run only on a failure) singles it out."""
    try:
        yield
    except AssertionError as exc:
        if "易错点" not in str(exc) and evidence():
            raise AssertionError(f"{exc}\n  看起来像易错点：{mistake}") from None
        raise


def _ones_like(s: torch.Tensor) -> torch.Tensor:
    """Unit scales, contiguous like s is, inside a buffer of ones: a scale read at a wrong index or stride still reads 1."""
    return torch.ones(s.numel() * 8 + 64)[:s.numel()].view(s.shape)


def _passes(fn) -> bool:
    try:
        fn()
    except (AssertionError, RuntimeError, ValueError, IndexError):
        return False
    return True


M_ROUNDING = ("舍入不对：x / scale 要按最近偶数（round-to-nearest-even）舍入到 e4m3。不要截断；直接 .to(tl.float8e4nv) "
              "在 Triton 解释器里也不是最近偶数（进位会丢：7.936 → 4.0），先用给出的 _round_e4m3 再转 FP8")


def _rounding_hint(got: torch.Tensor, v: torch.Tensor) -> list:
    """Evidence for M_ROUNDING: every wrong element sits where round-to-nearest-even rounds away from zero or on a
    tie: exactly where truncation, round-half-up or a lost carry differ from it."""
    near8 = v.clamp(-448, 448).to(FP8)
    near, bits = near8.float(), near8.view(torch.uint8)
    nxt = torch.where((bits & 0x7F) < 0x7E, bits + 1, bits).view(FP8).float().abs()
    tie = (v.abs() - near.abs()) == (nxt - v.abs())
    wrong = got.float() != near
    up = (near.abs() > v.abs()) | tie
    return [(got.float(), M_ROUNDING)] if bool(wrong.any()) and bool(up[wrong].all()) else []


def _truncated(v: torch.Tensor) -> torch.Tensor:
    """v cast toward zero onto the e4m3 grid (a wrong rounding), as floats."""
    near = v.clamp(-448, 448).to(FP8)
    bits = near.view(torch.uint8)
    step_down = (near.float().abs() > v.abs()) & ((bits & 0x7F) > 0)
    return torch.where(step_down, bits - 1, bits).view(FP8).float()


@point("卡片例子：一个 group 的量化（amax 7 → scale 2⁻⁶，最近偶数舍入、平局取偶、次正规数、进位）")
def test_card_example():
    m = impl(MODULE)
    row = [7.0, -0.3, 0.15, 1.0, 0.65625, 0.0001, 0.0, 3.3, -0.124]
    x = torch.tensor([row + [0.0] * (128 - len(row)) + [0.0] * 5], device=DEVICE)   # K = 133: a second, all-zero group
    with explain_crash(CRASHES):
        q, s = m.quantize_act_fp8(x)
    assert_equal(s.cpu(), torch.tensor([[2.0 ** -6, 1.0]]), what="卡片例子的 x_scale（第一组 amax 7 / 448 = 2⁻⁶，第二组全零 → 1）",
                 looks_like=[(torch.tensor([[7.0, 1.0]]), "scale 取了 amax，少了除以 448"),
                             (torch.tensor([[2.0 ** -6, 0.0]]), "全零 block / group 的 scale 为 0（卡片约定为 1）")])
    want = torch.tensor([448.0, -20.0, 10.0, 64.0, 40.0, 0.005859375, 0.0, 208.0, -8.0] + [0.0] * 124)
    got = q.cpu().float()[0]
    assert_equal(got, want, what="卡片例子的 x_fp8（x / scale 按最近偶数舍入到 e4m3）",
                 looks_like=_rounding_hint(got, x.cpu()[0] * 64))
    record_case("card:group")


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
M_SCALE_DTYPE = ("scale 跟着输入的 dtype（bf16 / fp16）算了：引擎喂给量化函数的是 bf16，卡片约定 scale 一律是 fp32——"
                 "先把输入转成 fp32（.float()）再求 amax、除以 448、做除法")
M_BLOCK_ARG = "block 参数没有用上（写死了 128×128）：块大小是 block=(bn, bk)，bn 管行（N）、bk 管列（K）"
M_BLOCK_SWAPPED = "block 的两个数用反了：block=(bn, bk) 里 bn 是行（N）方向的块大小、bk 是列（K）方向的"
# quantize_block_fp8's contract cases, each drawn on every run on its own: (label, input dtype, stacked experts, block)
BLOCK_CASES = (("fp32", torch.float32, False, None), ("bf16-stacked", torch.bfloat16, True, None),
               ("fp16", torch.float16, False, None), ("nondefault-block", torch.float32, False, "draw"))


@point("quantize_block_fp8：每个 128×128 block 一个 scale = amax / 448，N、K 不是 128 的倍数，全零 block，堆叠的 expert，"
       "bf16 / fp16 输入（scale 仍是 fp32），非默认的 block 参数")
def test_quantize_block():
    m = impl(MODULE)
    r = Rand()
    for label, dtype, stacked, block in BLOCK_CASES:
        bn, bk = (128, 128) if block is None else r.choice([(64, 32), (32, 64), (16, 128), (128, 64)])
        shape = (bn + r.int(1, bn // 2), 2 * bk + r.int(1, bk - 1))                # partial last block row and column
        if stacked:
            shape = (r.int(2, 3), r.int(20, 140), r.int(130, 200))
        w = r.randn(*shape) * _spread(r, *shape[:-2], 1, shape[-1])          # columns of very different sizes
        first = w.view(-1, *shape[-2:])[0]
        first[:bn, :bk] = 0                                                  # an all-zero block
        first[:bn, bk:2 * bk] *= 1e-4 / first[:bn, bk:2 * bk].abs().max()
        w = w.to(dtype)                                                      # what the engine feeds: bf16 weights
        wf = w.float()                                                       # the same numbers, exactly
        args = () if block is None else ((bn, bk),)
        with explain_crash(CRASHES):
            q, s = m.quantize_block_fp8(w.to(DEVICE), *args)
        where = f"（w 的形状 {list(shape)}，{DTYPE_NAMES[dtype]}，block ({bn}, {bk})）"
        nb, kb = -(-shape[-2] // bn), -(-shape[-1] // bk)
        if q.dtype != FP8 or tuple(q.shape) != shape:
            raise AssertionError(f"w_fp8 应为 float8_e4m3fn {list(shape)}，得到 {q.dtype} {list(q.shape)}{where}；{r}")
        if tuple(s.shape) != (*shape[:-2], nb, kb):
            looks = "scale 不是按 block 取的（按整个张量或按行）"
            if tuple(s.shape) == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128)):
                looks = M_BLOCK_ARG
            elif tuple(s.shape) == (*shape[:-2], -(-shape[-2] // bk), -(-shape[-1] // bn)):
                looks = M_BLOCK_SWAPPED
            raise AssertionError(f"scale_inv 的形状应为 {[*shape[:-2], nb, kb]}（每个 {bn}×{bk} block 一个，"
                                 f"N、K 向上取整），得到 {list(s.shape)}{where}；{r}\n  看起来像易错点：{looks}")
        if s.dtype != torch.float32:
            hint = f"\n  看起来像易错点：{M_SCALE_DTYPE}" if s.dtype == dtype else ""
            raise AssertionError(f"scale_inv 应为 float32（卡片约定 scale 是 fp32），输入是 {DTYPE_NAMES[dtype]} 时得到 "
                                 f"{s.dtype}{where}；{r}{hint}")
        s = s.cpu()
        pad = F.pad(wf.abs(), (0, kb * bk - shape[-1], 0, nb * bn - shape[-2]))
        amax = pad.reshape(*shape[:-2], nb, bn, kb, bk).amax(dim=(-3, -1))
        zero = amax == 0
        if not bool((s[zero] > 0).all() and torch.isfinite(s).all()):
            raise AssertionError(f"全零 block 的 scale 应为正数（卡片约定为 1），得到 {s[zero].tolist()}{where}；{r}\n"
                                 "  看起来像易错点：全零 block 的 scale 为 0：x / 0 得到 NaN")
        want = amax / 448.0
        if not torch.allclose(s[~zero], want[~zero], rtol=1e-6, atol=0):
            looks = "  看起来像易错点：scale 取了 amax，少了除以 448" if torch.allclose(s[~zero], amax[~zero]) else ""
            if dtype != torch.float32 and torch.equal(s[~zero], (amax.to(dtype) / 448.0).float()[~zero]):
                looks = f"  看起来像易错点：{M_SCALE_DTYPE}"
            raise AssertionError(f"非零 block 的 scale 应为 amax / 448（block 的最大值映射到 ±448）{where}；{r}\n{looks}")
        ref_s = torch.where(zero, torch.ones_like(want), want)               # the oracle's scales, from w alone
        per_elem = ref_s.repeat_interleave(bn, -2)[..., :shape[-2], :].repeat_interleave(bk, -1)[..., :shape[-1]]
        err = (q.cpu().float() * per_elem - wf).abs()
        half_ulp = wf.abs() / 16 + per_elem * 2.0 ** -10                    # e4m3: half a spacing, subnormals 2^-10
        if not bool((err <= half_ulp * (1 + 1e-6)).all()):
            hint = f"\n  看起来像易错点：{M_SCALE_DTYPE}" if dtype != torch.float32 else ""
            raise AssertionError(f"w_fp8 · scale（scale = amax / 448）与 w 相差超过 e4m3 的半个间距{where}；{r}{hint}")
        record_case(f"block:{label}")
    record_case("block:partial-zero-block")


M_ACT_GROUP_ARG = "group 参数没有用上（写死了 128）：每个 token 每 group 列一个 scale，x_scale 是 [T, ⌈K/group⌉]"
# quantize_act_fp8's contract cases, each drawn on every run on its own: (label, x dtype, group)
ACT_CASES = (("fp32", torch.float32, 128), ("bf16", torch.bfloat16, 128), ("fp16", torch.float16, 128),
             ("nondefault-group", torch.float32, "draw"))


@point("quantize_act_fp8：每个 token、每 128 列一个 scale，按最近偶数舍入；K 不是 128 的倍数、全零 group、strided x，"
       "bf16 / fp16 输入（scale 仍是 fp32），非默认的 group 参数")
def test_quantize_act():
    m = impl(MODULE)
    r = Rand()
    for label, dtype, group in ACT_CASES:
        group = group if group != "draw" else r.choice([32, 64])
        rows, k = r.int(3, 9), 128 * r.int(1, 2) + r.choice([5, 37, 90])
        base = r.randn(rows + 1, k + 16) * _spread(r, rows + 1, 1)          # rows of very different sizes
        base[1, 128:256] = 0                                                # an all-zero group
        base[:, k:] = 3e4                                                   # past the row's end: a read shows in amax
        base = base.to(dtype)                                               # what the engine feeds: bf16 activations
        x = base[:rows, :k]                                                 # a strided view: stride(0) = k + 16
        args = () if group == 128 else (group,)
        with explain_crash(CRASHES):
            q, s = m.quantize_act_fp8(x.to(DEVICE), *args)
        ref_q, ref_s = _act_quant(x, group=group)                           # from x alone
        where = f"（x 形状 [{rows}, {k}]，{DTYPE_NAMES[dtype]}，stride {list(x.stride())}，group {group}）"
        if q.dtype != FP8 or s.dtype != torch.float32:
            hint = f"\n  看起来像易错点：{M_SCALE_DTYPE}" if s.dtype == dtype != torch.float32 else ""
            raise AssertionError(f"x_fp8 应为 float8_e4m3fn、x_scale 应为 float32（卡片约定 scale 是 fp32），得到 {q.dtype}、"
                                 f"{s.dtype}{where}；{r}{hint}")
        if tuple(s.shape) != tuple(ref_s.shape) or tuple(q.shape) != (rows, k):
            hint = (f"\n  看起来像易错点：{M_ACT_GROUP_ARG}" if group != 128 and tuple(s.shape) == (rows, -(-k // 128))
                    else "")
            raise AssertionError(f"x_fp8 / x_scale 的形状应为 {[rows, k]} / {list(ref_s.shape)}（[T, ⌈K/group⌉]），"
                                 f"得到 {list(q.shape)} / {list(s.shape)}{where}；{r}{hint}")
        s = s.cpu()
        zero = ref_s == 1.0
        if not bool((s[zero] > 0).all()):
            raise AssertionError(f"全零 group 的 scale 应为正数（卡片约定为 1），得到 {s[zero].tolist()}{where}；{r}\n"
                                 "  看起来像易错点：全零 block / group 的 scale 为 0：x / 0 得到 NaN")
        flat = base.float().flatten()
        unmasked = torch.stack([torch.stack([flat[t * (k + 16) + g * group:][:group].abs().max()
                                             for g in range(s.shape[1])]) for t in range(rows)])   # read past K
        unmasked = torch.where(unmasked > 0, unmasked / 448.0, torch.ones_like(unmasked))
        by_shape = _act_quant(flat[:rows * k].view(rows, k), group=group)[1]   # rows read at stride K
        looks = [(torch.where(zero, ref_s, ref_s * 448.0), "scale 取了 amax，少了除以 448"),
                 (unmasked, "最后一个 group 的 load 没有 mask（offs < K）：读进了这一行之后的数"),
                 (by_shape, "x 的行 stride 按形状推了（x 可能是 strided view，stride 从 x.stride() 取）")]
        if not torch.allclose(s, ref_s, rtol=1e-6, atol=0):
            msg = f"x_scale 应为每组 amax / 448{where}；{r}"
            for wrong, mistake in looks:
                if torch.allclose(s, wrong, rtol=1e-6, atol=0):
                    msg += f"\n  看起来像易错点：{mistake}"
                    break
            raise AssertionError(msg)
        got = q.cpu().float()
        v = x.float() / ref_s.repeat_interleave(group, -1)[:, :k]
        assert_equal(got, ref_q.float(), what=f"x_fp8 = round_e4m3(x / scale)（最近偶数）{where}", rand=r,
                     looks_like=_rounding_hint(got, v))
        record_case(f"act:{label}")
    record_case("act:strided-partial-zero-group")


def _linear_case(r: Rand, num_tokens: int, k_whole: bool = False, k_small: bool = False, k_one: bool = False):
    n, k = 128 + r.choice([8, 40, 72]), 256 + r.choice([24, 56, 100])      # neither a multiple of 128, 3 K blocks
    if k_whole:
        k = 256                                                             # whole K-tiles: the unmasked-K path
    if k_small:
        k = r.choice([40, 72, 100])                                         # K < BLOCK_K: one partial K-tile
    if k_one:
        k = 257                                                             # the last K-tile holds one column
    q, s = _fp8_weight(r, n, k)
    wide = torch.full((n, k + 16), float("nan")).to(FP8)                  # NaN past K: an unmasked K-tail read of x
    wide[:, :k] = q                                                         # turns outputs to NaN (of w: on a GPU)
    base = r.randn(num_tokens, k + 8)
    base[:, k:] = float("nan")
    return base[:, :k], wide[:, :k], s                                      # x and w_fp8 are strided views


def _check_linear(m, r: Rand, x, q, s, w8a8: bool) -> None:
    fn, name = (m.w8a8_linear, "w8a8_linear") if w8a8 else (m.fp8_linear, "fp8_linear")
    w = _dequant(q, s).double()
    if w8a8:
        xq, xs = _act_quant(x)
        a = _act_dequant(xq, xs).double()
    else:
        a = x.double()
    ref, bound = a @ w.T, a.abs() @ w.abs().T
    where = f"{name}（T={x.shape[0]}，N={q.shape[0]}，K={q.shape[1]}）"

    def run(x_, q_, s_):
        with explain_crash(CRASHES):
            return fn(x_.to(DEVICE), q_.to(DEVICE), s_.to(DEVICE))

    alloc = GuardedAlloc()
    with alloc:
        out = run(x, q, s)
    if alloc.overran():
        raise AssertionError(f"{where} 写到了输出张量的末尾之外（输出后面的哨兵 NaN 被改写）；{r}\n"
                             f"  看起来像易错点：{M_STORE_MASK}")
    rel = FP8_DOT_REL if w8a8 else 1e-5
    looks = [(a @ q.double().T, "没有乘 block scale（FP8 的值直接当权重用）")]
    if w8a8:
        looks.append((xq.double() @ w.T, "w8a8 没有乘 x_scale（只乘了权重的 scale）"))
        looks.append((x.double() @ w.T, "w8a8 没有量化激活（和 fp8_linear 一样用了原始的 x）"))

    def unit_scales_right() -> bool:
        ones = _ones_like(s)
        w1 = _dequant(q, ones).double()
        return _passes(lambda: _assert_fp32(run(x, q, ones), a @ w1.T, a.abs() @ w1.abs().T, what=where, r=r))

    def padded_right() -> bool:
        kp = -(-q.shape[1] // 128) * 128
        xp, qp = F.pad(x, (0, kp - x.shape[1])), F.pad(q.float(), (0, kp - q.shape[1])).to(FP8)
        return _passes(lambda: _assert_fp32(run(xp, qp, s), ref, bound, what=where, r=r, rel=rel))

    with _hint_if(unit_scales_right, M_SCALE_INDEX), _hint_if(padded_right, M_K_TAIL):
        _assert_fp32(out, ref, bound, what=where, r=r, rel=rel, looks_like=looks)
    assert_dtype(out, x.dtype, what=f"{name} 的输出")


@point("fp8_linear（weight-only）= x @ dequantize(w)ᵀ（fp32 累加误差）：T=1 与更大的 T，K 小于、等于、不是 128 的倍数，scale 跨 6 个数量级，全零 block")
def test_fp8_linear():
    m = impl(MODULE)
    r = Rand()
    for label, num_tokens, k_whole, k_small, k_one in (("T=1", 1, False, False, False),
                                                       ("K-whole", r.int(2, 15), True, False, False),
                                                       ("K-small", r.int(2, 15), False, True, False),
                                                       ("K-tail-one", r.int(130, 140), False, False, True)):
        _check_linear(m, r, *_linear_case(r, num_tokens, k_whole, k_small, k_one), w8a8=False)
        record_case(f"linear:{label}")


@point("w8a8_linear = 量化-反量化后的 x @ dequantize(w)ᵀ（CPU 上 fp32 累加误差；Hopper 上 K-tile 内低精度累加，容差放宽）")
def test_w8a8_linear():
    m = impl(MODULE)
    r = Rand()
    for label, num_tokens, k_whole in (("T=1", 1, True), ("two-row-blocks", r.int(65, 80), False)):   # T > BLOCK_M
        x, q, s = _linear_case(r, num_tokens, k_whole)
        x = x * _spread(r, num_tokens, 1)                                   # tokens of very different sizes
        _check_linear(m, r, x, q, s, w8a8=True)
        record_case(f"w8a8:{label}")


# ----------------------------------------------------------------------------------------------------- MoE

M_K_TAIL_DIM = ("只在 H、I 中恰好一个是 BLOCK_K（128）的整数倍时出错（两个都是、两个都不是的情形都对了）：K 维尾部的处理"
                "（EVEN_K 与 mask）按错了维度——gate_up 的 K 是 H，down 的 K 是 I，两个 launcher 各按自己的 K 判断")


def _nan_tail(t: torch.Tensor) -> torch.Tensor:
    """t as a view of a wider tensor whose 16 columns past the last are NaN: an unmasked K-tail read shows."""
    wide = torch.full((*t.shape[:-1], t.shape[-1] + 16), float("nan")).to(t.dtype)
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


def _moe_case(r: Rand, hidden: int, inter: int, experts: int, n_tok: int, k: int = 2):
    """FP8 experts: gate/up (and their scales) as strided halves of stacked [E, 2I, H] tensors. Their scales span
    three orders of magnitude around 1e-3, so x Wg^T is of order 0.1..10, where SiLU is not linear (a gate/up swap
    shows); down's span six."""
    gate_up, _ = _fp8_weight(r, experts, 2 * inter, hidden, zero_block=False)
    ni, nh = -(-inter // 128), -(-hidden // 128)
    gu_s = torch.cat([_spread(r, experts, ni, nh, low=-4.5, decades=3), _spread(r, experts, ni, nh, low=-4.5, decades=3)], 1)
    w_down, s_down = _fp8_weight(r, experts, hidden, inter)
    gate_up, w_down = _nan_tail(gate_up), _nan_tail(w_down)
    ids = torch.stack([torch.randperm(experts, generator=r.gen)[:k] for _ in range(n_tok)])
    weights = torch.softmax(r.randn(n_tok, k), -1)
    return dict(x=_nan_tail(r.randn(n_tok, hidden)), w_gate=gate_up[:, :inter], w_up=gate_up[:, inter:], w_down=w_down,
                s_gate=gu_s[:, :ni], s_up=gu_s[:, ni:], s_down=s_down, weights=weights, ids=ids)


def _moe_oracle(c: dict, act_fp8: bool = False, swap: bool = False, no_h_quant: bool = False):
    """fp32 oracle: (out [N, H], h [N, k, I] before the down projection, per-pair dot bound for the tolerance)."""
    wg, wu = _dequant(c["w_gate"], c["s_gate"]), _dequant(c["w_up"], c["s_up"])
    if swap:
        wg, wu = _dequant(c["w_gate"], c["s_up"]), _dequant(c["w_up"], c["s_gate"])
    wd, ids, wt = _dequant(c["w_down"], c["s_down"]), c["ids"], c["weights"][..., None]
    x = _act_dequant(*_act_quant(c["x"])) if act_fp8 else c["x"]
    g = torch.einsum("nh,nkih->nki", x.double(), wg.double()[ids])
    u = torch.einsum("nh,nkih->nki", x.double(), wu.double()[ids])
    h = F.silu(g) * u
    if act_fp8 and not no_h_quant:
        n, k, i = h.shape
        h = _act_dequant(*_act_quant(h.float().reshape(n * k, i))).double().view(n, k, i)
    out = (torch.einsum("nki,nkhi->nkh", h, wd.double()[ids]) * wt.double()).sum(1)
    gb = torch.einsum("nh,nkih->nki", x.double().abs(), wg.double().abs()[ids])
    ub = torch.einsum("nh,nkih->nki", x.double().abs(), wu.double().abs()[ids])
    # h = silu(g) u with g, u off by up to rel * gb, rel * ub: |dh| <= rel (max|silu'| gb |u| + |silu(g)| ub), and
    # max|silu'| < 1.1, |silu(g)| <= |g|; the first-order bound, so that a wrong h cannot hide in the tolerance
    hb = 1.1 * gb * u.abs() + g.abs() * ub
    bound = (torch.einsum("nki,nkhi->nkh", hb + h.abs(), wd.double().abs()[ids]) * wt.double()).sum(1)
    return out, h, bound


def _run_moe(m, c: dict, act_fp8: bool, **over):
    args = {**c, **over}
    with explain_crash(CRASHES):
        return m.fused_experts_fp8(*(args[n].to(DEVICE) for n in ("x", "w_gate", "w_up", "w_down", "s_gate", "s_up",
                                                                  "s_down", "weights", "ids")), act_fp8=act_fp8)


@point("fused_experts_fp8（weight-only）= 反量化权重上的 MoE：N·k = 1、decode 与 prefill 大小，H、I 是与不是 128 的倍数，gate/up 与 scale 是 strided view")
def test_fused_experts_fp8():
    m = impl(MODULE)
    r = Rand()
    odd_h, odd_i = (lambda: 128 + r.choice([8, 24, 40])), (lambda: 128 + r.choice([16, 56]))
    # each shape case on its own, every run (the K-tile is 128 at decode sizes, 64 in prefill: _moe_tiles, given):
    # N = 1 with whole K-tiles in both GEMMs (the unmasked-K path); K tails in both; H whole and I with a tail, and
    # the reverse (each GEMM decides its own K-tail: gate_up's K is H, down's is I); a prefill: over 96 pairs per
    # expert, so k03's pick_block_m says 128 and fused_experts_fp8 runs 64-row blocks
    cases = (("N*k=1,H-whole,I-whole", 1, 256, 128), ("decode,H-tail,I-tail", r.int(5, 12), odd_h(), odd_i()),
             ("decode,H-whole,I-tail", r.int(2, 4), 128, odd_i()),
             ("decode,H-tail,I-whole", r.int(2, 4), odd_h(), 128),
             ("prefill,H-tail,I-tail", r.int(200, 240), odd_h(), odd_i()))
    for label, n_tok, hidden, inter in cases:
        experts = 4 if n_tok > 100 else r.int(4, 6)
        c = _moe_case(r, hidden, inter, experts, n_tok, k=1 if n_tok == 1 else 2)   # N·k = 1: a single pair
        alloc = GuardedAlloc()
        with alloc:
            out = _run_moe(m, c, False)
        if alloc.overran():
            raise AssertionError(f"fused_experts_fp8（N={n_tok}）写到了某个中间张量的末尾之外（哨兵 NaN 被改写）；{r}\n"
                                 "  看起来像易错点：pad 条目或 N 的尾部没有 mask（store 要用 pairs < N·k 与 offs_n < N）")
        ref, _, bound = _moe_oracle(c)
        looks = [(_moe_oracle(c, swap=True)[0], "s_gate 和 s_up 用反了")]

        def unit_right(c=c) -> bool:
            ones = {n: torch.ones(c[n].untyped_storage().nbytes() // 4 * 8 + 64)[:c[n].numel()].view(c[n].shape)
                    for n in ("s_down",)}
            buf = torch.ones(c["s_gate"].numel() * 16 + 64)
            both = buf[:2 * c["s_gate"].numel()].view(c["s_gate"].shape[0], 2 * c["s_gate"].shape[1], -1)
            ones.update(s_gate=both[:, :c["s_gate"].shape[1]], s_up=both[:, c["s_gate"].shape[1]:])
            c1 = {**c, **ones}
            ref1, _, b1 = _moe_oracle(c1)
            return _passes(lambda: _assert_fp32(_run_moe(m, c1, False), ref1, b1, what="", r=r))

        def copies_right(c=c) -> bool:
            cc = {**c, **{n: c[n].contiguous() for n in ("w_gate", "w_up", "s_gate", "s_up")}}
            return _passes(lambda: _assert_fp32(_run_moe(m, cc, False), ref, bound, what="", r=r))

        mixed = "whole" in label and "tail" in label and not label.startswith("N*k")   # the earlier cases passed
        with _hint_if(lambda: mixed, M_K_TAIL_DIM), _hint_if(unit_right, M_SCALE_INDEX), \
                _hint_if(copies_right, "把 gate/up（或它们的 scale）当成了连续张量、按形状推 stride：它们是 [E, 2I, H] "
                                       "两半的 strided view，stride 一律从 .stride() 取"):
            _assert_fp32(out, ref, bound, what=f"fused_experts_fp8（{label}：N={n_tok}，H={c['x'].shape[1]}，"
                         f"I={c['w_gate'].shape[1]}，E={c['w_gate'].shape[0]}）", r=r, looks_like=looks)
        record_case(f"moe:{label}")


@point("gate_up_fp8 / down_fp8 的 FP8×FP8 路径：x_scale 按 token（pair // k）取，h_scale 按 pair 取")
def test_moe_act_fp8_launchers():
    m = impl(MODULE)
    m03 = impl("k03_fused_moe")
    r = Rand()
    experts, k, n_tok = r.int(4, 6), 2, r.int(4, 9)
    c = _moe_case(r, 129, 129, experts, n_tok, k)                            # one column in the last K-tile
    num_pairs, inter, hidden = n_tok * k, c["w_gate"].shape[1], c["x"].shape[1]
    block_m = 16
    sorted_ids, expert_ids, num_post = m03.moe_align_block_size(c["ids"].to(DEVICE), experts, block_m)
    x = c["x"] * _spread(r, n_tok, 1)
    xq, xs = _act_quant(x)
    h = torch.zeros(num_pairs, inter, device=DEVICE)
    with explain_crash(CRASHES):
        m.gate_up_fp8(xq.to(DEVICE), xs.to(DEVICE), c["w_gate"].to(DEVICE), c["w_up"].to(DEVICE),
                      c["s_gate"].to(DEVICE), c["s_up"].to(DEVICE), sorted_ids, expert_ids, num_post, k, block_m, h)
    xd = _act_dequant(xq, xs).double()
    tokens = torch.arange(num_pairs) // k
    ids = c["ids"].reshape(-1)
    wg, wu = _dequant(c["w_gate"], c["s_gate"]).double()[ids], _dequant(c["w_up"], c["s_up"]).double()[ids]
    g, u = torch.einsum("ph,pih->pi", xd[tokens], wg), torch.einsum("ph,pih->pi", xd[tokens], wu)
    sw_g = _dequant(c["w_gate"], c["s_up"]).double()[ids]
    sw_u = _dequant(c["w_up"], c["s_gate"]).double()[ids]
    gb = torch.einsum("ph,pih->pi", xd[tokens].abs(), wg.abs())
    ub = torch.einsum("ph,pih->pi", xd[tokens].abs(), wu.abs())
    _assert_fp32(h, F.silu(g) * u, gb * (1 + gb.abs()) * ub, what="gate_up_fp8（x 是 FP8，x_scale [N, ⌈H/128⌉]）", r=r,
                 rel=FP8_DOT_REL, looks_like=[(F.silu(torch.einsum("ph,pih->pi", xq.double()[tokens], wg))
                              * torch.einsum("ph,pih->pi", xq.double()[tokens], wu),
                              "FP8×FP8 的 dot 之后没有乘 x_scale"),
                             (F.silu(torch.einsum("ph,pih->pi", xd[tokens], sw_g)) * torch.einsum("ph,pih->pi", xd[tokens], sw_u),
                              "s_gate 和 s_up 用反了")])
    record_case("launch:gate-up-x-scale-by-token")
    hq, hs = _act_quant((F.silu(g) * u).float())                  # down's input from the oracle's h, not the kernel's
    y = torch.zeros(num_pairs, hidden, device=DEVICE)
    wts = c["weights"].reshape(-1)
    with explain_crash(CRASHES):
        m.down_fp8(hq.to(DEVICE), hs.to(DEVICE), c["w_down"].to(DEVICE), c["s_down"].to(DEVICE), wts.to(DEVICE),
                   sorted_ids, expert_ids, num_post, block_m, y)
    hd = _act_dequant(hq, hs).double()
    wd = _dequant(c["w_down"], c["s_down"]).double()[ids]
    ref = torch.einsum("pi,phi->ph", hd, wd) * wts.double()[:, None]
    bound = torch.einsum("pi,phi->ph", hd.abs(), wd.abs()) * wts.double()[:, None]
    _assert_fp32(y, ref, bound, what="down_fp8（h 是 FP8，h_scale [M, ⌈I/128⌉]）", r=r, rel=FP8_DOT_REL,
                 looks_like=[(torch.einsum("pi,phi->ph", hq.double(), wd) * wts.double()[:, None],
                              "FP8×FP8 的 dot 之后没有乘 h_scale")])
    record_case("launch:down-h-scale-by-pair")


@point("num_tokens_post_padded 之后的 block 直接返回（那里的 sorted_ids / expert_ids 是任意值时结果不变）")
def test_blocks_past_num_post():
    m = impl(MODULE)
    m03 = impl("k03_fused_moe")
    r = Rand()
    experts, k, n_tok, block_m = r.int(4, 6), 2, r.int(3, 8), 16
    c = _moe_case(r, 136, 144, experts, n_tok, k)
    num_pairs, inter, hidden = n_tok * k, 144, 136
    sorted_ids, expert_ids, num_post = (t.cpu() for t in m03.moe_align_block_size(c["ids"].to(DEVICE), experts, block_m))
    used = int(num_post.item())
    sorted_ids[used:] = torch.randint(0, num_pairs, (sorted_ids.numel() - used,), generator=r.gen).int()
    expert_ids[used // block_m:] = torch.randint(0, experts, (expert_ids.numel() - used // block_m,), generator=r.gen).int()
    h = torch.zeros(num_pairs, inter, device=DEVICE)
    y = torch.zeros(num_pairs, hidden, device=DEVICE)
    dev = {n: c[n].to(DEVICE) for n in ("x", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")}
    with explain_crash(CRASHES):
        m.gate_up_fp8(dev["x"], None, dev["w_gate"], dev["w_up"], dev["s_gate"], dev["s_up"], sorted_ids.to(DEVICE),
                      expert_ids.to(DEVICE), num_post.to(DEVICE), k, block_m, h)
        m.down_fp8(h, None, dev["w_down"], dev["s_down"], c["weights"].reshape(-1).to(DEVICE), sorted_ids.to(DEVICE),
                   expert_ids.to(DEVICE), num_post.to(DEVICE), block_m, y)
    _, hh, _ = _moe_oracle(c)
    ids = c["ids"].reshape(-1)
    wd = _dequant(c["w_down"], c["s_down"]).double()[ids]
    hp = hh.reshape(num_pairs, inter)
    ref = torch.einsum("pi,phi->ph", hp, wd) * c["weights"].reshape(-1).double()[:, None]
    xd = c["x"].double()[torch.arange(num_pairs) // k]
    gb = torch.einsum("ph,pih->pi", xd.abs(), _dequant(c["w_gate"], c["s_gate"]).double().abs()[ids])
    ub = torch.einsum("ph,pih->pi", xd.abs(), _dequant(c["w_up"], c["s_up"]).double().abs()[ids])
    hb = gb * (1 + gb) * ub + hp.abs()                                      # |silu(g) u| and its error scale
    bound = torch.einsum("pi,phi->ph", hb, wd.abs()) * c["weights"].reshape(-1).double()[:, None]
    try:
        _assert_fp32(y, ref, bound, what=f"gate_up_fp8 + down_fp8（num_post = {used}，之后是任意的 pair id 与 expert id）", r=r)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n  看起来像易错点：pid_m·BLOCK_M ≥ num_tokens_post_padded 的 block 没有直接 return："
                             "那之后的 sorted_ids / expert_ids 不保证是 pad，读了就会按错的 expert 重算、覆盖真实 pair 的行") from None
    record_case("moe:past-num-post")


def _act_fp8_tolerance(c: dict, h: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The tolerance of an act_fp8 MoE output against _moe_oracle(c, act_fp8=True) (h, bound: its h and bound).

    The kernel's h and the oracle's differ by fp32 rounding, so an element of h within a hair of an e4m3 rounding
    midpoint may round the other way: each such element may move the output by one e4m3 spacing times |Wd| (only
    those elements; in most draws there is none and the tolerance is fp32 accumulation error alone)."""
    n, k, i = h.shape
    hq, hs = _act_quant(h.float().reshape(n * k, i))
    v = h.reshape(n * k, i) / hs.double().repeat_interleave(128, -1)[:, :i]
    q = hq.double()
    exp = torch.floor(torch.log2(q.abs().clamp_min(2.0 ** -6)))
    spacing = 2.0 ** (exp - 3)                                              # e4m3 spacing at q (2^-9 below 2^-6)
    window = 1e-4 if DEVICE.type == "cpu" else 2e-2        # h's error on a GPU: FP8_DOT_REL, ~1e-2 of a spacing
    near_mid = ((v - q).abs() - spacing / 2).abs() <= window * spacing
    flip = (spacing * hs.double().repeat_interleave(128, -1)[:, :i] * near_mid).view(n, k, i)
    wd = _dequant(c["w_down"], c["s_down"]).double()[c["ids"]]
    return (torch.einsum("nki,nkhi->nkh", flip, wd.abs()) * c["weights"].double()[..., None]).sum(1) + FP8_DOT_REL * bound


@point("fused_experts_fp8（act_fp8=True）：x 与 h 都按 token group 动态量化，误差在一次 e4m3 舍入翻转之内")
def test_fused_experts_act_fp8():
    m = impl(MODULE)
    r = Rand()
    c = _moe_case(r, 128 + r.choice([8, 40]), 128 + r.choice([16, 56]), r.int(4, 6), r.int(5, 10))
    out = _run_moe(m, c, True)
    ref, h, bound = _moe_oracle(c, act_fp8=True)
    tol = _act_fp8_tolerance(c, h, bound)
    weight_only = _moe_oracle(c, act_fp8=True, no_h_quant=True)[0]
    no_quant = _moe_oracle(c)[0]
    _assert_fp32(out, ref, tol, what="fused_experts_fp8（act_fp8=True）", r=r, rel=1.0,
                 looks_like=[(no_quant, "act_fp8=True 时没有量化激活（x 和 h 都按原值算了）"),
                             (weight_only, "act_fp8=True 时 h 没有再量化（down 之前也要按 token group 量化 h）")])
    record_case("moe:act-fp8")


def _fp8_weights_from_hf(block, m, m03, act_fp8: bool = False):
    """FP8MoEWeights from an HF block: gate, up and down quantized by the torch oracle (gate and up on their own
    block grids), and the block's experts replaced by the dequantized values, so HF's forward is the oracle."""
    w = oracles.moe_weights_from_hf(block, m03)
    inter = w.w_down.shape[-1]
    (qg, sg), (qu, su), (qd, sd) = (_quant_block(t) for t in (w.w_gate, w.w_up, w.w_down))
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(torch.cat([_dequant(qg, sg), _dequant(qu, su)], 1))
        block.experts.down_proj.copy_(_dequant(qd, sd))
    assert block.experts.gate_up_proj.shape[1] == 2 * inter
    shared = w.shared
    if shared is not None:
        shared = m03.SharedExpert(*(t.to(DEVICE) for t in (shared.gate_proj, shared.up_proj, shared.down_proj,
                                                            shared.gate)))
    return m.FP8MoEWeights(router=w.router.to(DEVICE), w_gate=qg.to(DEVICE), w_up=qu.to(DEVICE), w_down=qd.to(DEVICE),
                           s_gate=sg.to(DEVICE), s_up=su.to(DEVICE), s_down=sd.to(DEVICE), top_k=w.top_k,
                           norm_topk_prob=w.norm_topk_prob, shared=shared, act_fp8=act_fp8)


def _quant_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch oracle of quantize_block_fp8 (amax / 448 per 128x128 block, 1 for an all-zero block)."""
    *lead, n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    blocks = F.pad(w.float(), (0, kb * 128 - k, 0, nb * 128 - n)).reshape(*lead, nb, 128, kb, 128)
    amax = blocks.abs().amax(dim=(-3, -1))
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / s[..., :, None, :, None]).clamp(-448, 448).to(FP8).reshape(*lead, nb * 128, kb * 128)
    return q[..., :n, :k].contiguous(), s


@point("fp8_moe_forward 与 HF 一致（Qwen3-MoE 与带 shared expert 的 talker，专家权重换成反量化后的 FP8）")
def test_fp8_moe_forward_hf():
    m = impl(MODULE)
    m03 = impl("m03_sparse_moe")
    r = Rand()
    hidden = r.choice([16, 24])
    shape = dict(hidden=hidden, experts=r.int(4, 8), top_k=2, inter=hidden * 2 + r.choice([-4, 4]))
    for block, what in ((oracles.qwen3_moe_block(r, norm_topk_prob=r.choice([True, False]), **shape), "Qwen3MoeSparseMoeBlock"),
                        (oracles.talker_moe_block(r, shared_inter=shape["inter"] + 8, **shape),
                         "Qwen3OmniMoeTalkerTextSparseMoeBlock")):
        w = _fp8_weights_from_hf(block, m, m03)
        x = r.randn(r.int(3, 12), hidden)
        ref = oracles.hf_moe(block, x)
        with explain_crash(CRASHES):
            out = m.fp8_moe_forward(x.to(DEVICE), w)
        assert_close(out, ref, what=f"fp8_moe_forward（{what}）", rand=r, atol=1e-5, rtol=1e-4)
        record_case("forward:talker-shared" if w.shared is not None else "forward:qwen3-moe")
        # the act_fp8 flag through this layer: HF's output with the routed experts' part replaced by the oracle of
        # the same experts with x and h quantized per token group (routing: m03's HF-exact route, the reference)
        w_act = dataclasses.replace(w, act_fp8=True)
        weights, ids = m03.route(x, w.router.cpu(), w.top_k, w.norm_topk_prob)
        c = dict(x=x, w_gate=w.w_gate.cpu(), w_up=w.w_up.cpu(), w_down=w.w_down.cpu(), s_gate=w.s_gate.cpu(),
                 s_up=w.s_up.cpu(), s_down=w.s_down.cpu(), weights=weights, ids=ids)
        routed_q, h, bound = _moe_oracle(c, act_fp8=True)
        want = ref.double() - _moe_oracle(c)[0] + routed_q
        with explain_crash(CRASHES):
            out = m.fp8_moe_forward(x.to(DEVICE), w_act)
        _assert_fp32(out, want, _act_fp8_tolerance(c, h, bound) + 1e-4 * ref.abs().double() + 1e-5, r=r, rel=1.0,
                     what=f"fp8_moe_forward（{what}，act_fp8=True）",
                     looks_like=[(ref, "fp8_moe_forward 没有把 w.act_fp8 传给 fused_experts_fp8：act_fp8=True 时结果和"
                                       "不量化激活时一样（每一层都要把这个开关传下去）")])
        record_case("forward:act-fp8-" + ("talker" if w.shared is not None else "qwen3-moe"))


# ----------------------------------------------------------------------------------------------------- GPU

@point("CUDA：真实形状 bf16（Qwen3-30B-A3B-FP8 的线性层与 MoE：H=2048，E=128，k=8，I=768）")
def test_real_shapes_cuda():
    m = impl(MODULE)
    with explain_crash(CRASHES):                                            # an untouched stub is 未实现 here too
        m.quantize_act_fp8(torch.ones(1, 8, device=DEVICE))
    if DEVICE.type != "cuda":
        pytest.skip("需要 GPU：没有 CUDA，真实形状的 bf16 检查没有运行")
    r = Rand()
    gen = torch.Generator(device="cuda").manual_seed(r.seed)
    dequant = impl("m06_models").dequantize_block_fp8
    for n, k in ((4096, 2048), (2048, 4096), (151936 // 32, 2048)):
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        q, s = _quant_block(w)                                              # the torch oracle, not the learner's
        wd = dequant(q, s)
        for num_tokens in (1, 7, 64, 256, 1000):
            x = torch.randn(num_tokens, k, device="cuda", generator=gen).bfloat16()
            for name, fn, a in (("fp8_linear", m.fp8_linear, x.float()),
                                ("w8a8_linear", m.w8a8_linear, None)):
                out = fn(x, q, s)
                assert_dtype(out, torch.bfloat16, what=f"bf16 输入时 {name} 的输出")
                if a is None:                                               # from x alone (torch oracle)
                    a = _act_dequant(*_act_quant(x)).cuda()
                exact = a @ wd.T
                err = (out.float() - exact).abs()
                tol = exact.abs() * 2.0 ** -8 + 1e-4 * exact.abs().max()  # one bf16 rounding of the output
                if name == "w8a8_linear":                                  # + the FP8 tensor cores' accumulation
                    tol = tol + FP8_DOT_REL * (a.abs() @ wd.abs().T)
                if not bool((err <= tol).all()):
                    raise AssertionError(f"{name}（T={num_tokens}，N={n}，K={k}）：最大误差 {err.max().item():.3g}，"
                                         f"超过输出的 bf16 舍入；{r}")
    experts, hidden, inter, topk = 128, 2048, 768, 8
    gu = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02
    q_gu, s_gu = _quant_block(gu)                                           # the torch oracle, not the learner's
    q_d, s_d = _quant_block(torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02)
    ni = inter // 128
    wg, wu, wdn = dequant(q_gu[:, :inter], s_gu[:, :ni]), dequant(q_gu[:, inter:], s_gu[:, ni:]), dequant(q_d, s_d)
    for n_tok in (1, 64, 256, 1000):
        x = torch.randn(n_tok, hidden, device="cuda", generator=gen).bfloat16()
        logits = torch.randn(n_tok, experts, device="cuda", generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(topk, -1)
        weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
        for act in (False, True):
            out = m.fused_experts_fp8(x, q_gu[:, :inter], q_gu[:, inter:], q_d, s_gu[:, :ni], s_gu[:, ni:], s_d,
                                      weights, ids, act_fp8=act)
            assert_dtype(out, torch.bfloat16, what="bf16 输入时 fused_experts_fp8 的输出")
            xf, exact = x.float(), torch.zeros(n_tok, hidden, device="cuda")
            for e in ids.unique().tolist():                                 # per expert: no [N, k, I, H] gather
                tok, slot = (ids == e).nonzero(as_tuple=True)
                h = F.silu(xf[tok] @ wg[e].T) * (xf[tok] @ wu[e].T)
                exact.index_add_(0, tok, (h @ wdn[e].T) * weights.float()[tok, slot, None])
            err = (out.float() - exact).abs().max().item()
            scale = exact.abs().max().item()
            limit = 0.08 * scale if act else 0.01 * scale   # act_fp8: e4m3 activations (~2-4 %), else bf16 roundings
            if not err <= limit:
                raise AssertionError(f"fused_experts_fp8（act_fp8={act}，N={n_tok}）：最大误差 {err:.3g}，输出量级 "
                                     f"{scale:.3g}；{r}")
