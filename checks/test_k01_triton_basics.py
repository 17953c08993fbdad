"""Checks for K01 · Triton basics (lessons/k01_triton_basics.md).

Oracles: e04's torch `store_kvcache` (index assignment into the flat cache view) and m01's `rms_norm` /
`gemma_rms_norm` with the residual protocol. Every check runs the kernels at small fp32 / fp16 shapes on
checks.kit.DEVICE: natively with CUDA, otherwise in the Triton interpreter (checks/conftest.py sets
TRITON_INTERPRET=1); the torch oracles run on the CPU. With CUDA the last check also runs them natively at 8k
tokens in bf16 (skipped, never passed, without a GPU).
"""

from __future__ import annotations

import contextlib

import torch

from checks.kit import (DEVICE, GuardedAlloc, Rand, assert_close, assert_equal, impl, needs_cuda, point, record_case,
                        to_cpu, to_dev)

MODULE = "k01_triton_basics"
torch.set_num_threads(1)

M_SLOT_NEG = "slot = −1 的填充行也写了（应整行跳过：if slot < 0: return）"
M_SLOT_ZERO = "把 slot 0 当成了填充行跳过（判断应为 slot < 0，不是 slot ≤ 0：slot 0 是块 0 的第 0 行，一个合法的槽位）"
M_STRIDE = "把 k/v 当成连续张量（token 步长写成 nKV·D）：从 qkv 切出的 k/v 是非连续 view，应传 k.stride(0)"
M_D_STRIDE = ("D 维不连续的 k/v 没有先 .contiguous()：kernel 按 d 连续取址（+ dims），"
              "k.stride(-1) != 1 时 launcher 要先复制一份")
M_STATS_DTYPE = "平方和在 x.dtype（fp16/bf16）里算：统计量必须先 .to(tl.float32)"
M_BLOCK_MEAN = "均值除以了 BLOCK_H（补齐到 2 的幂的块宽）而不是真实的 H"
M_CAST_ORDER = "cast 顺序写反：Qwen3 是先 n.to(x.dtype) 再乘 w，(1+w) norm 是在 fp32 里乘完再 cast"
M_GEMMA_W = "(1+w) norm 乘了 w 而不是 1 + w"
M_GEMMA_DTYPE = ("(1+w) 在权重的 dtype 里算：w load 出来没有 .to(tl.float32)，1 + w 在 fp16 / bf16 里相加就舍入了"
                 "（m01 / HF 是 1.0 + w.float()，在 fp32 里加）")
M_SUM_UNROUNDED = "对未舍入的 fp32 和 x + residual 求统计量：应先把和舍入到 x.dtype（与 HF / m01 一致），再求 norm"
M_RES_OUT = "返回的 residual 不是 x + residual"
M_EPS_OUT = "eps 放在了根号外（h / (sqrt(mean) + eps)）：应为 h · rsqrt(mean(h²) + eps)，范数很小的行差别很大"
M_ROWS_ZERO = ("H > 2048 时每个 program 的行数算成了 0：2048 // BLOCK_H = 0，"
               "grid = cdiv(R, 0) 除以零；ROWS 至少为 1（max(1, ...)）")
M_OUT_DTYPE = ("输出 dtype 照 m01：Qwen3 norm 是 w * n.to(x.dtype)，dtype 是 w 与 x 的提升（fp32 权重 → fp32）；"
               "(1+w) norm 在 fp32 里乘完 cast 回 x.dtype")
M_X_STRIDE = "把 x 的行步长当成了 H：x 可以是更宽张量的列切片（x.stride(0) > H），应把 x2.stride(0) 传进 kernel"
M_GRID_DOWN = "最后几行没有被归一化：grid 向下取整了，应为 cdiv(R, ROWS)（R 不是 ROWS 的整数倍）"
M_ROW_MASK = "最后一个 program 多出来的行没有 mask（行 mask rows < R）：写到了输出张量之外"
M_EMPTY = "N = 0（没有新 token）时 store_kvcache 应什么都不做：launcher 里对空的 slot_mapping / k 求 max、取 k[0] 之类会出错"
M_SHAPE = "输出要与 x 同形状 [..., H]（kernel 按 [R, H] 写，返回前 view 回 x.shape）"


def _guarded_caches(num_blocks: int, page: int, nkv: int, d: int, dtype=torch.float32, device=DEVICE):
    """k/v caches that are views into buffers with one guard block before and after (NaN-free sentinels)."""
    bufs = [torch.full((num_blocks + 2, page, nkv, d), -100.0, dtype=dtype, device=device) for _ in range(2)]
    return bufs, [b[1:-1] for b in bufs]


def _store_case(r: Rand, dtype=torch.float32, device=DEVICE, n=None, pad=True, nkv=None):
    nkv, d, page = nkv or r.choice([1, 3]), r.choice([24, 48]), r.choice([16, 32])   # D never a power of 2
    n = n or r.int(3, 24)
    num_blocks = (n + page - 1) // page + r.int(1, 3)
    nh = nkv * r.int(1, 3)
    qkv = r.randn(n, (nh + 2 * nkv) * d, dtype=dtype).to(device)                 # the fused projection
    q_, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
    k, v = k.view(n, nkv, d), v.view(n, nkv, d)                                    # strided views
    slots = torch.randperm(num_blocks * page, generator=r.gen)[:n]
    at = r.int(0, n - 1)                              # slot 0 (block 0, row 0) is a real slot: always written
    slots[slots == 0] = slots[at]
    slots[at] = 0
    if pad:
        slots[(at + r.int(1, n - 1)) % n] = -1
    return k, v, slots.to(device), num_blocks, page


def _expected_caches(bufs, k, v, slots, skip_zero=False):
    """e04's torch store (index assignment, exact on any device) into copies of the guarded buffers."""
    exp = [b.clone() for b in bufs]
    keep = slots > 0 if skip_zero else slots >= 0
    for e, src in zip(exp, (k, v)):
        e[1:-1].reshape(-1, *e.shape[2:])[slots[keep].long()] = src[keep]
    return exp


@point("store_kvcache 写入正确的槽位")
def test_store_kvcache_slots():
    m = impl(MODULE)
    # int64 with nKV = 3 (BLOCK = 4: the head mask matters), int32 with a random nKV; D is 24 or 48 on both
    for slot_dtype, nkv in ((torch.int64, 3), (torch.int32, None)):
        r = Rand()
        k, v, slots, nb, page = _store_case(r, pad=False, nkv=nkv)
        bufs, (kc, vc) = _guarded_caches(nb, page, k.shape[1], k.shape[2])
        exp = _expected_caches(bufs, k, v, slots)
        m.store_kvcache(k.contiguous(), v.contiguous(), kc, vc, slots.to(slot_dtype))
        no_zero = _expected_caches(bufs, k, v, slots, skip_zero=True)
        what = f"slot_mapping {slot_dtype}，nKV = {k.shape[1]}，D = {k.shape[2]}"
        assert_equal(bufs[0], exp[0], what=f"k_cache（{what}）", rand=r, looks_like=[(no_zero[0], M_SLOT_ZERO)])
        assert_equal(bufs[1], exp[1], what=f"v_cache（{what}）", rand=r, looks_like=[(no_zero[1], M_SLOT_ZERO)])
        record_case("store:slots-" + str(slot_dtype).removeprefix("torch."))
        record_case("store:slot-zero")
        record_case("store:D-not-pow2")
        if k.shape[1] == 3:
            record_case("store:nKV-not-pow2")
    # N = 0 (no new token): nothing is written, nothing fails
    r = Rand()
    k, v, slots, nb, page = _store_case(r, pad=False)
    bufs, (kc, vc) = _guarded_caches(nb, page, k.shape[1], k.shape[2])
    before = [b.clone() for b in bufs]
    try:
        m.store_kvcache(k[:0].contiguous(), v[:0].contiguous(), kc, vc, slots[:0])
    except Exception as exc:
        raise AssertionError(f"store_kvcache 在 N = 0（k [0, {k.shape[1]}, {k.shape[2]}]、slot_mapping 为空）时出错："
                             f"{type(exc).__name__}: {exc}；{r}\n  {M_EMPTY}") from exc
    for got, want, name in zip(to_cpu(*bufs), to_cpu(*before), ("k_cache", "v_cache")):
        assert torch.equal(got, want), f"{name}：N = 0 时 cache 被改写了；{r}\n  {M_EMPTY}"
    record_case("store:N=0")


@point("slot = −1 的填充行不写")
def test_store_kvcache_skips_padding():
    m = impl(MODULE)
    r = Rand()
    k, v, slots, nb, page = _store_case(r)
    bufs, (kc, vc) = _guarded_caches(nb, page, k.shape[1], k.shape[2])
    exp = _expected_caches(bufs, k, v, slots)
    m.store_kvcache(k.contiguous(), v.contiguous(), kc, vc, slots)
    no_zero = _expected_caches(bufs, k, v, slots, skip_zero=True)
    for got, want, skipped, name in zip(to_cpu(*bufs), to_cpu(*exp), to_cpu(*no_zero), ("k_cache", "v_cache")):
        if not torch.equal(got, want):
            outside = not torch.equal(got[0], want[0]) or not torch.equal(got[-1], want[-1])
            if outside:                               # slot -1 taken literally lands in the block before the cache
                raise AssertionError(f"{name}：slot_mapping 含 −1 时 cache 之外（前后的保护块）被改写了；{r}\n"
                                     f"  看起来像易错点：{M_SLOT_NEG}")
            hint = f"\n  看起来像易错点：{M_SLOT_ZERO}" if torch.equal(got, skipped) else ""
            raise AssertionError(f"{name}：slot_mapping 含 −1 时 cache 内有槽位与参考不同"
                                 f"（slots = {slots.tolist()}）；{r}{hint}")
    record_case("store:pad-minus-one")


@point("store_kvcache 处理非连续的 k/v（qkv 切出的 view、D 维不连续的 view）")
def test_store_kvcache_strided_views():
    m = impl(MODULE)
    r = Rand()
    k, v, slots, nb, page = _store_case(r)
    assert not k.is_contiguous()
    _store_strided(m, r, k, v, slots, nb, page)
    record_case("store:qkv-view")
    # The same k/v with a D that is not contiguous: a kernel that assumes d is contiguous (+ dims) reads other
    # elements. Four layouts, each given to k once and to v once, so every launcher guard meets each of them.
    layouts = {"D-major（stride(1) = 1）": lambda t: t.permute(2, 0, 1).contiguous().permute(1, 2, 0),
               "全转置（stride(0) = 1）": lambda t: t.permute(2, 1, 0).contiguous().permute(2, 1, 0),
               "隔列切出（stride(-1) = 2）": _every_other_column,
               "D 维广播（stride(-1) = 0）": None}
    names = list(layouts)
    n, nkv, d = k.shape
    for i in range(len(names)):
        kname, vname = names[i], names[(i + 1) % len(names)]
        kk, vv = (_d_strided(layouts[name], t) for name, t in ((kname, k), (vname, v)))
        assert kk.stride(-1) != 1 and vv.stride(-1) != 1
        bufs, (kc, vc) = _guarded_caches(nb, page, nkv, d)
        exp = _expected_caches(bufs, kk, vv, slots)
        m.store_kvcache(kk, vv, kc, vc, slots)
        for got, want, name in zip(to_cpu(*bufs), to_cpu(*exp), ("k_cache", "v_cache")):
            if not torch.equal(got, want):
                raise AssertionError(f"{name}：k/v 的 D 维不连续时写入的内容不对（k：{kname}，stride {tuple(kk.stride())}；"
                                     f"v：{vname}，stride {tuple(vv.stride())}），qkv 切出的 view 是对的；{r}\n"
                                     f"  看起来像易错点：{M_D_STRIDE}")
    record_case("store:D-strided")


def _every_other_column(t):
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def _d_strided(layout, t):
    """t [N, nKV, D] in a layout whose D is not contiguous; None: t's D broadcast (every element of a row = its
    first), which the caches must then hold too."""
    if layout is None:
        return t[..., :1].expand(t.shape)
    out = layout(t)
    assert torch.equal(out, t)
    return out


def _store_strided(m, r, k, v, slots, nb, page):
    bufs, (kc, vc) = _guarded_caches(nb, page, k.shape[1], k.shape[2])
    exp = _expected_caches(bufs, k, v, slots)
    m.store_kvcache(k, v, kc, vc, slots)
    for got, want, name in zip(to_cpu(*bufs), to_cpu(*exp), ("k_cache", "v_cache")):
        if not torch.equal(got, want):
            copies, (kc2, vc2) = _guarded_caches(nb, page, k.shape[1], k.shape[2])
            m.store_kvcache(k.contiguous(), v.contiguous(), kc2, vc2, slots)
            hint = (f"\n  看起来像易错点：{M_STRIDE}" if all(torch.equal(a, b) for a, b in zip(to_cpu(*copies), to_cpu(*exp)))
                    else "（连续的 k/v 也写错了：先看另外两项 store_kvcache 检查）")
            raise AssertionError(f"{name}：k/v 是 qkv 的非连续 view 时写入的内容不对；{r}{hint}")


def _m01_fused(x, residual, w, eps, gemma):
    m01 = impl("m01_rmsnorm")
    norm = m01.gemma_rms_norm if gemma else m01.rms_norm
    if residual is None:
        return norm(x, w, eps), None
    s = x + residual
    return norm(s, w, eps), s


def _call(m, x, residual, w, eps, gemma, guard=False):
    """add_rms_norm on DEVICE; the outputs back on the CPU. guard: its outputs get NaN tails (a store past the
    end of an output fails with M_ROW_MASK)."""
    alloc = GuardedAlloc() if guard else contextlib.nullcontext()
    with alloc:
        out = m.add_rms_norm(*to_dev(x, residual, w), eps, gemma=gemma)
    if guard and alloc.overran():
        raise AssertionError(f"add_rms_norm（x {list(x.shape)}）写到了输出张量的末尾之外（输出后面的哨兵 NaN 被改写）\n"
                             f"  看起来像易错点：{M_ROW_MASK}")
    if residual is None:
        assert isinstance(out, torch.Tensor), f"residual=None 时应返回一个张量，得到 {type(out).__name__}"
        return to_cpu(out), None
    assert isinstance(out, tuple) and len(out) == 2, "有 residual 时应返回 (normed, x + residual) 两个张量"
    return to_cpu(*out)


def _norm_variant(s, w, eps, gemma, *, eps_outside=False, denom=None):
    """m01's norm of the sum s with one mistake: eps added to the root (h / (sqrt(mean) + eps)), or the sum of
    squares divided by `denom` (BLOCK_H) instead of H."""
    h = s.float()
    mean = h.pow(2).sum(-1, keepdim=True) / (denom or h.shape[-1])
    n = h / (mean.sqrt() + eps) if eps_outside else h * torch.rsqrt(mean + eps)
    return (n * (1 + w.float())).to(s.dtype) if gemma else w * n.to(s.dtype)


def _rms_inputs(r: Rand, shape, hidden: int, sliced: bool):
    """x, residual, w, and the row whose x and residual have a tiny norm (|x| ~ 1e-4: eps decides its scale).
    sliced: x is a column slice of a wider tensor (x.stride(-2) > H)."""
    x, res, w = r.randn(*shape), r.randn(*shape), r.randn(hidden, scale=0.5)
    tiny = r.int(0, x.numel() // hidden - 1)
    x.view(-1, hidden)[tiny] *= 1e-4
    res.view(-1, hidden)[tiny] *= 1e-4
    if sliced:
        off = r.int(1, 8)
        wide = r.randn(*shape[:-1], hidden + off + r.int(1, 8))
        wide[..., off:off + hidden] = x
        x = wide[..., off:off + hidden]
    return x, res, w, tiny


@point("add_rms_norm 的残差协议与 m01 一致（任意前导维度、奇数行数、列切片输入、范数很小的行、H > 2048）")
def test_add_rms_norm_protocol_fp32():
    m = impl(MODULE)
    r = Rand()
    for gemma in (False, True):
        hidden = r.choice([48, 96, 100, 128] if gemma else [48, 96, 100])      # at least one H not a power of 2
        # odd row counts (never a multiple of a power-of-2 ROWS), one above 64; the 2-D x is a column slice
        wide_h = r.int(2049, 2300)                # BLOCK_H 4096: fewer than one row's 2048 elements per row slot
        for shape, sliced in (((2 * r.int(33, 48) + 1, hidden), True), ((3, 2 * r.int(2, 6) + 1, hidden), False),
                              ((r.int(2, 4), wide_h), False)):
            hidden = shape[-1]
            x, res, w, tiny = _rms_inputs(r, shape, hidden, sliced)
            for residual in (None, res):
                try:
                    out, s = _call(m, x, residual, w, 1e-6, gemma, guard=True)
                except ZeroDivisionError as exc:
                    raise AssertionError(f"add_rms_norm（x {list(shape)}，BLOCK_H = {triton_block(hidden)}）除以零：{exc}；{r}"
                                         + (f"\n  看起来像易错点：{M_ROWS_ZERO}" if hidden > 2048 else "")) from exc
                ref, ref_s = _m01_fused(x, residual, w, 1e-6, gemma)
                name = (f"add_rms_norm（gemma={gemma}，x {list(shape)}"
                        f"{'，x 是宽张量的列切片，行步长 ' + str(x.stride(0)) if sliced else ''}，"
                        f"{'residual=None' if residual is None else '有 residual'}）")
                if isinstance(out, torch.Tensor) and out.shape != ref.shape and out.numel() == ref.numel():
                    raise AssertionError(f"{name}：形状应为 {list(ref.shape)}，得到 {list(out.shape)}；{r}\n"
                                         f"  看起来像易错点：{M_SHAPE}")
                _explain_unwritten(out, ref, name, r)
                summed = x + residual if residual is not None else x
                looks = [(_norm_variant(summed, w, 1e-6, gemma, denom=triton_block(hidden)), M_BLOCK_MEAN),
                         (_m01_fused(x, residual, w, 1e-6, False)[0] if gemma else None, M_GEMMA_W),
                         (_norm_variant(summed, w, 1e-6, gemma, eps_outside=True),
                          M_EPS_OUT + f"（第 {tiny} 行的范数约 1e-4）")]
                if sliced:                                # read with row stride H: rows of the wide tensor, shifted
                    packed = x.as_strided(x.shape, (hidden, 1))
                    looks.append((_m01_fused(packed, residual, w, 1e-6, gemma)[0], M_X_STRIDE))
                assert_close(out, ref, what=name, rand=r, looks_like=looks)
                if s is not None:
                    assert_close(s, ref_s, what=f"{name} 返回的 residual", rand=r, looks_like=[(res, M_RES_OUT)])
                record_case(f"norm:gemma={gemma},residual={'none' if residual is None else 'given'}")
                record_case("norm:tiny-norm-row")
                if len(shape) > 2:
                    record_case("norm:3d-leading")
                if sliced:
                    record_case("norm:x-column-slice")
                if hidden & (hidden - 1):
                    record_case("norm:H-not-pow2")
                if hidden > 2048:
                    record_case("norm:H>2048")
                rows_per = max(1, min(16, 2048 // triton_block(hidden)))
                if rows_per > 1 and x.numel() // hidden % 2:
                    record_case("norm:rows-not-multiple")


def _explain_unwritten(out, ref, what: str, r: Rand) -> None:
    """Rows the kernel never stored hold what the allocation held (NaN under GuardedAlloc): name the grid."""
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return
    rows = torch.isnan(out.reshape(-1, out.shape[-1])).all(-1)
    if bool(rows.any()) and not bool(torch.isnan(ref).any()):
        first = int(rows.nonzero()[0])
        hint = f"\n  看起来像易错点：{M_GRID_DOWN}" if bool(rows[first:].all()) else ""
        raise AssertionError(f"{what}：输出的第 {first} 行起有 {int(rows.sum())} 行（共 {rows.numel()} 行）从未被写入；{r}{hint}")


def triton_block(hidden: int) -> int:
    return 1 << (hidden - 1).bit_length()


def _ulp_match(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of elements bit-equal to the reference (fp16: cast-order mistakes move ~1/4 of them)."""
    return float((out == ref).float().mean())


@point("fp16 下 cast 顺序与 m01 逐位一致（≥ 98% 元素），fp32 权重时输出 dtype 与 m01 相同")
def test_cast_order_fp16():
    m = impl(MODULE)
    r = Rand()
    h = 128
    x, res = r.randn(64, h, dtype=torch.float16), r.randn(64, h, dtype=torch.float16)
    # Qwen3's weights sit near 1, (1+w) weights near 0. The (1+w) ones are drawn at full fp16 precision around 0
    # (not as w - 1 of a weight near 1, which makes 1 + w exact in fp16): 1 + w rounded in fp16 then loses their low
    # bits in ~70 % of the columns and moves ~1/4 of the outputs by an ulp
    weights = {False: r.randn(h, scale=0.3, dtype=torch.float16) + 1, True: r.randn(h, scale=0.3, dtype=torch.float16)}
    for gemma in (False, True):
        ww = weights[gemma]
        out, s = _call(m, x, res, ww, 1e-6, gemma)
        ref, ref_s = _m01_fused(x, res, ww, 1e-6, gemma)
        assert out.dtype == torch.float16, f"fp16 输入应返回 fp16，得到 {out.dtype}"
        assert_equal(s, ref_s, what="fp16 的 residual 和", rand=r)
        hit = _ulp_match(out, ref)
        if hit < 0.98:
            ulps = int((out.view(torch.int16).int() - ref.view(torch.int16).int()).abs().max())
            msg = (f"add_rms_norm fp16（gemma={gemma}）只有 {hit:.1%} 的元素与 m01 逐位相同（应 ≥ 98%），"
                   f"最多相差 {ulps} 个 fp16 ulp；{r}")
            for wrong, mistake in _fp16_variants(x, res, ww, gemma):
                if _ulp_match(out, wrong) >= 0.98:
                    msg += f"\n  看起来像易错点：{mistake}"
                    break
            else:                                         # none of the known orders: say what was compared
                msg += ("\n  与两种 cast 顺序、未舍入的和" + ("、fp16 里相加的 (1+w)" if gemma else "")
                        + "都对不上；cast 顺序的差别最多 1 个 ulp，差得更多时先看统计量是否在 fp32 里算（下一项检查）")
            raise AssertionError(msg)
        assert_close(out, ref, what=f"add_rms_norm fp16（gemma={gemma}）", rand=r, atol=1e-2, rtol=1e-2)
        record_case(f"fp16:gemma={gemma}")
    w32 = r.randn(h, scale=0.3) + 1                                   # fp32 norm weights on fp16 activations
    for gemma in (False, True):
        out, _ = _call(m, x, res, w32, 1e-6, gemma)
        ref, _ = _m01_fused(x, res, w32, 1e-6, gemma)
        if out.dtype != ref.dtype:
            raise AssertionError(f"add_rms_norm（x fp16、w fp32，gemma={gemma}）的输出 dtype 应与 m01 相同，为 {ref.dtype}，"
                                 f"得到 {out.dtype}；{r}\n  {M_OUT_DTYPE}")
        assert_close(out, ref, what=f"add_rms_norm（x fp16、w fp32，gemma={gemma}）", rand=r, atol=1e-2, rtol=1e-2)
        record_case(f"fp16:w-fp32,gemma={gemma}")


def _fp16_variants(x, res, w, gemma):
    """The classic wrong answers of the fp16 norm of x + res: the other cast order, the sum never rounded, and for
    the (1+w) norm 1 + w added in w's dtype."""
    def normed(h):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    n, n_unrounded = normed((x + res).float()), normed(x.float() + res.float())
    if gemma:
        return [(((1 + w.float()) * n.half().float()).half(), M_CAST_ORDER),
                ((n_unrounded * (1 + w.float())).half(), M_SUM_UNROUNDED),
                ((n * (1 + w).float()).half(), M_GEMMA_DTYPE)]
    return [((n * w.float()).half(), M_CAST_ORDER), (w * n_unrounded.half(), M_SUM_UNROUNDED)]


@point("统计量在 fp32 里算（fp16 大数值不溢出）")
def test_fp32_statistics():
    m = impl(MODULE)
    r = Rand()
    x = r.randn(8, 256, scale=400.0, dtype=torch.float16)                        # x² > 65504
    w = r.randn(256, scale=0.5, dtype=torch.float16)
    out = to_cpu(m.add_rms_norm(*to_dev(x, None, w), 1e-6))
    ref = impl("m01_rmsnorm").rms_norm(x, w, 1e-6)
    if not torch.isfinite(out).all() or float(out.float().abs().max()) == 0.0:
        raise AssertionError(f"fp16、|x| ≈ 400 时输出是 0 / inf / NaN；{r}\n  看起来像易错点：{M_STATS_DTYPE}")
    assert_close(out, ref, what="fp16 大数值的 add_rms_norm", rand=r, atol=1e-2, rtol=1e-2)
    record_case("fp16:large-values")


@point("卡片例子：slot 37、P = 16 落在块 2 行 5；[1, 3, −1, 1] + [1, −1, 3, −3] 归一化为 [1, 1, 1, −1]")
def test_card_example():
    m = impl(MODULE)
    k = torch.arange(8, dtype=torch.float32).view(1, 2, 4)
    bufs, (kc, vc) = _guarded_caches(4, 16, 2, 4)
    m.store_kvcache(*to_dev(k, -k), kc, vc, to_dev(torch.tensor([37])))
    kc, vc = to_cpu(kc, vc)
    assert torch.equal(kc[2, 5], k[0]) and torch.equal(vc[2, 5], -k[0]), "slot 37 应写到 k_cache[2, 5]（37 = 2·16 + 5）"
    assert int((kc != -100.0).sum()) == 8, "除了 k_cache[2, 5] 之外不应有别的位置被改写"
    x, res = torch.tensor([[1.0, 3.0, -1.0, 1.0]]), torch.tensor([[1.0, -1.0, 3.0, -3.0]])
    out, s = _call(m, x, res, torch.tensor([0.5, 1.0, 2.0, 1.0]), 0.0, False)
    assert torch.equal(s, torch.tensor([[2.0, 2.0, 2.0, -2.0]])), f"x + residual 应为 [2, 2, 2, −2]，得到 {s.tolist()}"
    assert torch.allclose(out, torch.tensor([[0.5, 1.0, 2.0, -1.0]])), f"w · n 应为 [0.5, 1, 2, −1]，得到 {out.tolist()}"
    g, _ = _call(m, x, res, torch.tensor([0.5, 1.0, 2.0, 1.0]), 0.0, True)
    assert torch.allclose(g, torch.tensor([[1.5, 2.0, 3.0, -2.0]])), f"(1+w) · n 应为 [1.5, 2, 3, −2]，得到 {g.tolist()}"
    record_case("card:example")


@needs_cuda
@point("原生 CUDA：8k token 的 bf16 store_kvcache 与 add_rms_norm")
def test_native_cuda_bf16():
    m = impl(MODULE)
    r = Rand()
    dev, bf16 = "cuda", torch.bfloat16
    n, nkv, d, page = 8192, 8, 128, r.choice([16, 32])
    qkv = r.randn(n, (16 + 2 * nkv) * d, dtype=bf16).to(dev)
    _, k, v = qkv.split([16 * d, nkv * d, nkv * d], dim=-1)
    k, v = k.view(n, nkv, d), v.view(n, nkv, d)
    nb = n // page + 8
    slots = torch.randperm(nb * page, generator=r.gen)[:n].to(dev)
    slots[::97] = -1
    bufs, (kc, vc) = _guarded_caches(nb, page, nkv, d, bf16, dev)
    exp = _expected_caches(bufs, k, v, slots)
    m.store_kvcache(k, v, kc, vc, slots.int())
    torch.cuda.synchronize()
    assert torch.equal(bufs[0], exp[0]) and torch.equal(bufs[1], exp[1]), f"CUDA store_kvcache 与参考不一致；{r}"
    for hidden, gemma in ((4096, False), (5120, True), (128, False)):
        x, res = r.randn(n, hidden, dtype=bf16).to(dev), r.randn(n, hidden, dtype=bf16).to(dev)
        w = (r.randn(hidden, scale=0.2) + (0 if gemma else 1)).to(bf16).to(dev)
        out, s = _call(m, x, res, w, 1e-6, gemma)
        ref, ref_s = to_cpu(*_m01_fused(x, res, w, 1e-6, gemma))                  # torch on the GPU
        assert torch.equal(s, ref_s), "CUDA bf16 的 residual 和应与 torch 逐位相同"
        # fp32 statistics summed in another order: the normalised value n = x * rstd may round to the other
        # neighbour (1 bf16 ulp) on rare elements; m01 then rounds w * n once more in bf16, so |w| up to ~2
        # turns that into at most 2 ulps of the output. More than that is a different computation.
        hit = _ulp_match(out, ref)
        assert hit >= 0.99, f"CUDA bf16 add_rms_norm（H={hidden}, gemma={gemma}）只有 {hit:.2%} 元素逐位一致；{r}"
        ulps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()      # same sign: ulp distance
        far = (ulps > 2) & ((out.float() - ref.float()).abs() > 1e-6)
        assert not far.any(), (f"CUDA bf16 add_rms_norm（H={hidden}）：{int(far.sum())} 个元素与参考相差超过 2 个 bf16 ulp"
                               f"（归一化值舍入差 1 ulp、再乘 w 舍入一次，最多 2 ulp），例如位置 "
                               f"{tuple(far.nonzero()[0].tolist())}；{r}")
