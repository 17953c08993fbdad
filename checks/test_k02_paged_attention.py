"""Checks for K02 · Paged attention in Triton (lessons/k02_paged_attention.md).

Oracle: m04's `varlen_attention` (fp32 softmax, bottom-right causal, GQA by repeat_interleave) over the keys
gathered from the paged cache in torch; e04's `PagedAttention` for the drop-in module. Every check runs the
kernels at small fp32 / fp16 shapes on checks.kit.DEVICE: natively with CUDA, otherwise in the Triton
interpreter (checks/conftest.py); problems are built and the oracles run on the CPU. With CUDA the last two
checks also run them natively in bf16 at serving shapes (skipped, never passed, without a GPU).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from checks.kit import GuardedAlloc, Rand, assert_close, impl, needs_cuda, point, record_case, to_cpu, to_dev

MODULE = "k02_paged_attention"
torch.set_num_threads(1)

M_TOP_LEFT = "有缓存前缀时 causal mask 左上对齐（j ≤ i）：应右下对齐，query i 看得到 key j ≤ (Lk − Lq) + i"
M_GQA = "GQA 头映射写成 h % nKV（平铺）：query head h 应读 kv head h // (nH / nKV)"
M_NO_RESCALE = "running max 变大后没有用 alpha = exp(m_old − m_new) 重新缩放 acc 和 l"
M_REDUCE_WEIGHT = "reduce 时没有按 2^(lse_s − max lse) 给各 split 加权（直接平均了各 split 的输出）"
M_MIXED_LSE = ("lse 混用了对数的底：m 是 log₂ 单位（分数乘过 log₂e），lse 应为 m + log₂(l)，权重 2^(lse − max lse)；"
               "写成 m + ln(l)（或权重用 exp）时各 split 的权重不对")
M_TAIL_MASK = "最后一个不满的 key tile 没有 mask：越过长度的 key（k = 0，分数 0）也进了 softmax"
M_LAST_KEY = "漏掉了最后一个 key（长度差一：context_lens 已包含当前 token）"
M_DEFAULT_SPLITS = ("TritonPagedAttention 没给 num_splits（None）时应取 default_num_splits(k_cache)，"
                    "不能把 None 直接交给 decode_attention")
M_FP16 = "分数在 fp16 里累加（tl.dot 的 out_dtype / 结果转成了 q.dtype）：|q·k| > 65504 时溢出成 inf"


# ------------------------------------------------------------------------------------------------ problems

def paged_problem(r: Rand, lens_q, lens_k, nh, nkv, d, page, dtype=torch.float32, device="cpu", scale_qk=1.0):
    """Random q and a shuffled paged cache holding every sequence's keys; also the gathered keys (torch)."""
    nblocks = [-(-lk // page) for lk in lens_k]
    total = sum(nblocks) + 2
    perm = torch.randperm(total, generator=r.gen)
    width = max(nblocks) + 1
    tables = torch.full((len(lens_k), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblocks):
        tables[b, :n] = perm[used:used + n].int()
        used += n
    k_cache = r.randn(total, page, nkv, d, scale=scale_qk, dtype=dtype)
    v_cache = r.randn(total, page, nkv, d, dtype=dtype)
    slots = []
    for b, lk in enumerate(lens_k):
        j = torch.arange(lk)
        slots.append(tables[b, j // page].long() * page + j % page)
    slots = torch.cat(slots)
    keys = k_cache.view(-1, nkv, d)[slots]
    values = v_cache.view(-1, nkv, d)[slots]
    q = r.randn(sum(lens_q), nh, d, scale=scale_qk, dtype=dtype)
    cu_q = torch.tensor([0] + list(lens_q)).cumsum(0).int()
    cu_k = torch.tensor([0] + list(lens_k)).cumsum(0).int()
    move = lambda t: t.to(device)  # noqa: E731
    return [move(t) for t in (q, k_cache, v_cache, tables, cu_q, cu_k, keys, values)]


def reference(q, keys, values, cu_q, cu_k, scale, *, gqa_tiled=False, top_left=False):
    """m04's varlen attention; optionally one of the classic wrong variants."""
    m04 = impl("m04_attention")
    if gqa_tiled:
        g = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat(1, g, 1), values.repeat(1, g, 1)      # head h reads kv head h % nKV
    if not top_left:
        return m04.varlen_attention(q, keys, values, cu_q, cu_k, scale)
    out = torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        cut = k0 + (q1 - q0)                          # top-left: query i sees j <= i of the first Lq keys
        out[q0:q1] = m04.varlen_attention(q[q0:q1], keys[k0:cut], values[k0:cut],
                                          torch.tensor([0, q1 - q0]), torch.tensor([0, q1 - q0]), scale)
    return out


def _decode_lens(r: Rand, b: int, lo: int = 1, hi: int = 150):
    return [r.int(lo, hi) for _ in range(b)]


# ------------------------------------------------------------------------------------------------ prefill

@point("prefill：packed 变长序列（无前缀）与 m04 一致")
def test_prefill_no_prefix():
    m = impl(MODULE)
    r = Rand()
    nkv = r.choice([1, 2])
    nh, d, page = nkv * r.choice([1, 2, 3]), r.choice([16, 32]), 32          # P = 16: the cached-prefix check
    # one odd length (no tile / page multiple: the masked tail) and one of 64 (whole BLOCK_M / BLOCK_N tiles, pages)
    lens = [r.int(0, 44) * 2 + 1, 64] + [r.int(1, 90) for _ in range(r.int(0, 1))]
    q, kc, vc, bt, cu_q, cu_k, keys, values = paged_problem(r, lens, lens, nh, nkv, d, page)
    scale = d ** -0.5
    out = m.prefill_attention(*to_dev(q, kc, vc, cu_q, cu_k, bt), max(lens), scale)
    assert_close(out, reference(q, keys, values, cu_q, cu_k, scale),
                 what=f"prefill_attention（P={page}, D={d}，长度 {lens}）",
                 rand=r, atol=1e-5, rtol=1e-4,
                 looks_like=[(reference(q, keys, values, cu_q, cu_k, scale, gqa_tiled=True) if nh > nkv else None,
                              M_GQA)])
    for label in ("prefill:P=32", "prefill:D-pow2", "prefill:len-not-tile-multiple", "prefill:len-tile-multiple"):
        record_case(label)


@point("prefill：带缓存前缀（右下对齐的因果 mask）与 GQA")
def test_prefill_cached_prefix_gqa():
    m = impl(MODULE)
    r = Rand()
    nkv = 2
    nh, d, page = nkv * r.choice([2, 3]), r.choice([24, 40]), 16       # D not a power of 2; P = 32: the check above
    lens_k = [r.int(20, 100) for _ in range(2)]
    lens_q = [r.int(2, lk - 5) for lk in lens_k]
    q, kc, vc, bt, cu_q, cu_k, keys, values = paged_problem(r, lens_q, lens_k, nh, nkv, d, page)
    scale = d ** -0.5
    out = _guarded(lambda: m.prefill_attention(*to_dev(q, kc, vc, cu_q, cu_k, bt), max(lens_q), scale), d, r)
    assert_close(out, reference(q, keys, values, cu_q, cu_k, scale), what=f"带前缀的 prefill_attention（D={d}）",
                 rand=r, atol=1e-5, rtol=1e-4,
                 looks_like=[(reference(q, keys, values, cu_q, cu_k, scale, top_left=True), M_TOP_LEFT),
                             (reference(q, keys, values, cu_q, cu_k, scale, gqa_tiled=True), M_GQA)])
    for label in ("prefill:cached-prefix", "prefill:gqa", "prefill:D-not-pow2", "prefill:P=16"):
        record_case(label)


@point("flash_attention_varlen（不分页）与 m04 一致")
def test_flash_attention_varlen_unpaged():
    m = impl(MODULE)
    r = Rand()
    nh, nkv, d = 4, 2, 32
    lens_k = [r.int(1, 70) for _ in range(2)]
    lens_q = [r.int(1, lk) for lk in lens_k]
    q, kc, vc, bt, cu_q, cu_k, keys, values = paged_problem(r, lens_q, lens_k, nh, nkv, d, 16)
    scale = d ** -0.5
    out = m.flash_attention_varlen(*to_dev(q, keys, values, cu_q, cu_k), max(lens_q), scale)
    assert_close(out, reference(q, keys, values, cu_q, cu_k, scale), what="flash_attention_varlen", rand=r,
                 atol=1e-5, rtol=1e-4,
                 looks_like=[(reference(q, keys, values, cu_q, cu_k, scale, top_left=True), M_TOP_LEFT)])
    record_case("varlen:unpaged")


def _guarded(call, d: int, r: Rand):
    """Run call() with every output it allocates followed by NaN; a store past the end of one fails here
    (instead of corrupting memory and killing the check process)."""
    with GuardedAlloc() as alloc:
        out = call()
    if alloc.overran():
        raise AssertionError(f"kernel 写到了它分配的输出的末尾之外（D = {d} 不是 2 的幂）：store 的 mask 要同时限制行"
                             f"（i < Lq）和列（d < D：BLOCK_D 补齐出来的列不属于这个头）；{r}")
    return out


def _ramp_problem(r: Rand, rising: bool):
    """One sequence of 150 keys whose scores rise (max in the last tile) or fall (max in the first) along j."""
    d, lk = 16, 150
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    keys = torch.zeros(lk, 1, d)
    ramp = torch.linspace(0.0, 12.0, lk)
    keys[:, 0, 0] = ramp if rising else ramp.flip(0)
    keys[:, 0, 1:] = r.randn(lk, d - 1, scale=0.1)
    values = r.randn(lk, 1, d)
    page = 16
    kc = torch.zeros(-(-lk // page), page, 1, d)
    vc = torch.zeros_like(kc)
    kc.view(-1, 1, d)[:lk], vc.view(-1, 1, d)[:lk] = keys, values
    bt = torch.arange(kc.shape[0], dtype=torch.int32)[None]
    return q, kc, vc, bt, keys, values, lk


@point("online softmax：分数最大值出现在后面的 key tile（prefill 与 decode）")
def test_online_softmax_rescale():
    m = impl(MODULE)
    r = Rand()
    for rising in (False, True):
        q, kc, vc, bt, keys, values, lk = _ramp_problem(r, rising)
        cu_q, cu_k = torch.tensor([0, 1]).int(), torch.tensor([0, lk]).int()
        ref = reference(q, keys, values, cu_q, cu_k, 1.0)
        ctx = torch.tensor([lk]).int()
        for name, out in (("prefill_attention", m.prefill_attention(*to_dev(q, kc, vc, cu_q, cu_k, bt), 1, 1.0)),
                          ("decode_attention", m.decode_attention(*to_dev(q, kc, vc, bt, ctx), 1.0, 1))):
            if not torch.allclose(to_cpu(out), ref, atol=1e-5, rtol=1e-4):
                where = "分数沿 key 递增（最大值在最后一个 tile）" if rising else "分数沿 key 递减"
                msg = f"{name}：{where}时与参考不一致；{r}"
                short = reference(q, keys[:-1], values[:-1], cu_q, cu_k - torch.tensor([0, 1]).int(), 1.0)
                if torch.allclose(to_cpu(out), short, atol=1e-5, rtol=1e-4):
                    msg += f"\n  看起来像易错点：{M_LAST_KEY}（输出等于去掉最后一个 key 的结果）"
                elif rising:                                  # the falling case (checked first) passed
                    msg += f"\n  看起来像易错点：{M_NO_RESCALE}（递减时正确、递增时出错）"
                raise AssertionError(msg)
            record_case(f"online:{name}:" + ("max-in-last-tile" if rising else "max-in-first-tile"))


@point("fp16：|q·k| 超过 65504 时分数在 fp32 里累加")
def test_fp16_score_accumulator():
    m = impl(MODULE)
    r = Rand()
    nh = nkv = 1
    d, page = 32, 16
    lens = [r.int(10, 40)]
    q, kc, vc, bt, cu_q, cu_k, keys, values = paged_problem(r, lens, lens, nh, nkv, d, page,
                                                            dtype=torch.float16, scale_qk=100.0)
    scale = d ** -0.5
    ref = reference(q, keys, values, cu_q, cu_k, scale)
    for name, out in (("prefill_attention", m.prefill_attention(*to_dev(q, kc, vc, cu_q, cu_k, bt), lens[0], scale)),
                      ("decode_attention", m.decode_attention(*to_dev(q[-1:], kc, vc, bt, cu_k[1:].int()), scale, 2))):
        out, want = to_cpu(out), (ref if name == "prefill_attention" else ref[-1:])
        if not torch.isfinite(out).all():
            raise AssertionError(f"{name}：fp16 输入、|q·k| 可达 1e5 时输出含 inf / NaN；{r}\n  看起来像易错点：{M_FP16}")
        assert_close(out, want, what=f"fp16 {name}", rand=r, atol=2e-3, rtol=2e-3)
        record_case(f"fp16:{name}")


# ------------------------------------------------------------------------------------------------ decode

def _split_variants(q, keys, values, cu_k, scale, splits: int, block_n: int = 64) -> dict:
    """Split-K decode in torch with the card's partition (part = ceil(ceil(Lk / S) / BLOCK_N) * BLOCK_N), combined in
    the classic wrong ways: {"average", "mixed_lse", "exp_weights"} -> o [B, nH, D]."""
    nh, nkv = q.shape[1], keys.shape[1]
    log2e = 1.4426950408889634
    out = {name: torch.zeros_like(q) for name in ("average", "mixed_lse", "exp_weights")}
    for b in range(q.shape[0]):
        k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
        lk = k1 - k0
        kb = keys[k0:k1].repeat_interleave(nh // nkv, 1)                       # [Lk, nH, D]
        vb = values[k0:k1].repeat_interleave(nh // nkv, 1)
        s2 = torch.einsum("hd,jhd->hj", q[b].double(), kb.double()) * scale * log2e   # scores in log2 units
        part = -(-(-(-lk // splits)) // block_n) * block_n
        o_s, lse2, lse_mixed = [], [], []
        for start in range(0, lk, part):
            seg = slice(start, min(start + part, lk))
            m2 = s2[:, seg].max(-1).values                                      # [nH]
            p = torch.exp2(s2[:, seg] - m2[:, None])
            l = p.sum(-1)
            o_s.append(torch.einsum("hj,jhd->hd", p, vb[seg].double()) / l[:, None])
            lse2.append(m2 + torch.log2(l))
            lse_mixed.append(m2 + torch.log(l))                                # m in log2 units, log of l natural
        o_s, lse2, lse_mixed = torch.stack(o_s), torch.stack(lse2), torch.stack(lse_mixed)    # [S_live, nH, ...]

        def combine(lse, base):
            w = base ** (lse - lse.max(0).values)
            return ((w[..., None] * o_s).sum(0) / w.sum(0)[:, None]).to(q.dtype)
        out["average"][b] = o_s.mean(0).to(q.dtype)
        out["mixed_lse"][b] = combine(lse_mixed, 2.0)
        out["exp_weights"][b] = combine(lse2, math.e)
    return out


def _decode_case(r: Rand, lens, nh, nkv, d, page, **kw):
    q, kc, vc, bt, cu_q, cu_k, keys, values = paged_problem(r, [1] * len(lens), lens, nh, nkv, d, page, **kw)
    return q, kc, vc, bt, torch.tensor(lens).int(), cu_q, cu_k, keys, values


@point("decode：split-K 任意 num_splits 与 m04 一致（reduce 按 lse 加权）")
def test_decode_splits():
    m = impl(MODULE)
    r = Rand()
    nkv = r.choice([1, 2])
    nh, d, page = nkv * r.choice([1, 2, 4]), r.choice([16, 32]), 32          # P = 16: the padded-row check
    # one sequence always spans >= 2 splits; one is 128 keys (whole BLOCK_N tiles and pages)
    lens = _decode_lens(r, r.int(0, 2), 40, 300) + [128, r.int(200, 300)]
    q, kc, vc, bt, ctx, cu_q, cu_k, keys, values = _decode_case(r, lens, nh, nkv, d, page)
    scale = d ** -0.5
    ref = reference(q, keys, values, cu_q, cu_k, scale)
    one = m.decode_attention(*to_dev(q, kc, vc, bt, ctx), scale, 1)
    assert_close(one, ref, what=f"decode_attention（num_splits=1，P={page}，长度 {lens}）", rand=r, atol=1e-5, rtol=1e-4,
                 looks_like=[(_unmasked_tail(q, keys, values, cu_q, cu_k, scale, 1), M_TAIL_MASK)])
    for label in ("decode:splits=1", "decode:P=32", "decode:D-pow2", "decode:len-tile-multiple"):
        record_case(label)
    for splits in (2, 5, 16):
        out = to_cpu(m.decode_attention(*to_dev(q, kc, vc, bt, ctx), scale, splits))
        if not torch.allclose(out, ref, atol=1e-5, rtol=1e-4):
            wrong = _split_variants(q, keys, values, cu_k, scale, splits)
            assert_close(out, ref, what=f"decode_attention（num_splits={splits}，长度 {lens}；num_splits=1 正确）",
                         rand=r, atol=1e-5, rtol=1e-4,
                         looks_like=[(wrong["average"], M_REDUCE_WEIGHT), (wrong["mixed_lse"], M_MIXED_LSE),
                                     (wrong["exp_weights"], M_MIXED_LSE)])
        record_case(f"decode:splits={splits}")
    record_case("decode:idle-splits")                # 16 splits of >= 64 keys: those past Lk <= 300 return


@point("decode：任意长度（不是 tile / 块的整数倍）与 GQA 成组")
def test_decode_tail_and_gqa():
    m = impl(MODULE)
    r = Rand()
    nkv, d, page = 2, r.choice([24, 40]), r.choice([16, 32])                      # D not a power of 2
    nh = nkv * r.choice([2, 4])
    scale = d ** -0.5
    lens = [r.int(2, 15), r.int(17, 127), r.int(129, 200)]        # >= 2 keys: dropping the last leaves one
    q, kc, vc, bt, ctx, cu_q, cu_k, keys, values = _decode_case(r, lens, nh, nkv, d, page)
    out = to_cpu(_guarded(lambda: m.decode_attention(*to_dev(q, kc, vc, bt, ctx), scale, 3), d, r))
    ref = reference(q, keys, values, cu_q, cu_k, scale)
    short = reference(q, torch.cat([keys[int(cu_k[b]):int(cu_k[b + 1]) - 1] for b in range(3)]),
                      torch.cat([values[int(cu_k[b]):int(cu_k[b + 1]) - 1] for b in range(3)]),
                      cu_q, cu_k - torch.arange(4).int(), scale)
    hints = [(reference(q, keys, values, cu_q, cu_k, scale, gqa_tiled=True), M_GQA), (short, M_LAST_KEY),
             (_unmasked_tail(q, keys, values, cu_q, cu_k, scale, 3), M_TAIL_MASK)]
    assert_close(out, ref, what=f"decode_attention（长度 {lens}，P={page}，D={d}）", rand=r, atol=1e-5, rtol=1e-4,
                 looks_like=hints)
    for label in ("decode:len-not-tile-multiple", "decode:gqa", "decode:D-not-pow2"):
        record_case(label)


def _unmasked_tail(q, keys, values, cu_q, cu_k, scale, splits: int, block_n: int = 64):
    """m04 with the keys the last tile of each sequence reads past its length (k = v = 0, score 0) kept in."""
    ks, vs, lens = [], [], []
    for b in range(len(cu_k) - 1):
        k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
        lk = k1 - k0
        part = -(-(-(-lk // splits)) // block_n) * block_n
        last = (lk - 1) // part * part                                          # first key of the last live split
        extra = -(lk - last) % block_n
        ks += [keys[k0:k1], keys.new_zeros(extra, *keys.shape[1:])]
        vs += [values[k0:k1], values.new_zeros(extra, *values.shape[1:])]
        lens.append(lk + extra)
    cu = torch.tensor([0] + lens).cumsum(0).int()
    return reference(q, torch.cat(ks), torch.cat(vs), cu_q, cu, scale)


@point("decode：context_lens = 0 的填充行不出错，其余行不受影响")
def test_decode_padded_row():
    m = impl(MODULE)
    r = Rand()
    nh, nkv, d, page = 4, 2, 16, 16
    lens = [1] + _decode_lens(r, 2, 2, 60)                         # a one-key row too (the first decode step)
    q, kc, vc, bt, ctx, cu_q, cu_k, keys, values = _decode_case(r, lens, nh, nkv, d, page)
    ref = reference(q, keys, values, cu_q, cu_k, d ** -0.5)
    ctx_pad = torch.cat([ctx, torch.zeros(1, dtype=torch.int32)])
    bt_pad = torch.cat([bt, torch.full((1, bt.shape[1]), -1, dtype=torch.int32)])
    q_pad = torch.cat([q, r.randn(1, nh, d)])
    out = to_cpu(m.decode_attention(*to_dev(q_pad, kc, vc, bt_pad, ctx_pad), d ** -0.5, 4))
    assert out.shape == q_pad.shape, f"输出形状应为 {list(q_pad.shape)}，得到 {list(out.shape)}"
    assert_close(out[:3], ref, what="有填充行时其余行的 decode 输出", rand=r, atol=1e-5, rtol=1e-4)
    for label in ("decode:context-len-0", "decode:one-key,more-splits-than-keys", "decode:P=16"):
        record_case(label)


@point("卡片例子：前缀 Lq = 2、Lk = 5 得 [1.5, 2.0]；两个 split 合并得 2.0（平均会得 2.25）")
def test_card_example():
    m = impl(MODULE)
    d = 16
    # prefill: q = 0 makes every visible key equally likely; v_j = j in dim 0
    kc = torch.zeros(1, 16, 1, d)
    vc = torch.zeros(1, 16, 1, d)
    vc[0, :5, 0, 0] = torch.arange(5.0)
    bt = torch.tensor([[0]], dtype=torch.int32)
    out = to_cpu(m.prefill_attention(*to_dev(torch.zeros(2, 1, d), kc, vc, torch.tensor([0, 2]).int(),
                                             torch.tensor([0, 5]).int(), bt), 2, 1.0))
    got = out[:, 0, 0].tolist()
    if not torch.allclose(out[:, 0, 0], torch.tensor([1.5, 2.0])):
        hint = f"\n  看起来像易错点：{M_TOP_LEFT}" if torch.allclose(out[:, 0, 0], torch.tensor([0.0, 0.5])) else ""
        raise AssertionError(f"Lq = 2、Lk = 5：两个 query 应得 [1.5, 2.0]（平均 key 0..3 与 0..4），得到 {got}{hint}")
    record_case("card:prefix")
    # decode: 128 keys, two splits of 64 (BLOCK_N = 64): scores 0 | ln 2, values 6, 0, 6, 0, ... | 3, 0, 3, 0, ...
    kc = torch.zeros(8, 16, 1, d)
    vc = torch.zeros(8, 16, 1, d)
    kc.view(128, d)[64:, 0] = math.log(2.0)
    vc.view(128, d)[:64:2, 0] = 6.0
    vc.view(128, d)[64::2, 0] = 3.0
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    bt = torch.arange(8, dtype=torch.int32)[None]
    for splits in (1, 2):
        o = float(to_cpu(m.decode_attention(*to_dev(q, kc, vc, bt, torch.tensor([128]).int()), 1.0, splits))[0, 0, 0])
        if abs(o - 2.0) >= 1e-5:
            hint = f"\n  看起来像易错点：{M_REDUCE_WEIGHT}" if splits == 2 and abs(o - 2.25) < 1e-5 else ""
            why = ("（两个 split 各 64 个 key：o₀ = 3、lse₀ = 6，o₁ = 1.5、lse₁ = 7，权重 [0.5, 1]）" if splits == 2
                   else "（e^s 是 64 个 1 和 64 个 2：o = 384 / 192）")
            raise AssertionError(f"128 个 key、num_splits={splits}：o 应为 2.0{why}，得到 {o:.6g}{hint}")
    record_case("card:two-splits")


def _ctx_to_dev(ctx):
    """The same AttentionContext with its tensors on DEVICE."""
    return dataclasses.replace(ctx, **{f.name: to_dev(getattr(ctx, f.name)) for f in dataclasses.fields(ctx)})


@point("TritonPagedAttention 可替换 e04 的 PagedAttention（prefill、分块前缀、decode 步）")
def test_drop_in_module():
    m = impl(MODULE)
    e04, e02 = impl("e04_model_runner"), impl("e02_block_manager")
    r = Rand()
    nh, nkv, d, page = 4, 2, 16, 16
    shape = (12, page, nkv, d)
    ours = m.TritonPagedAttention(nh, d, d ** -0.5, nkv, *to_dev(torch.zeros(shape), torch.zeros(shape)),
                                  num_splits=2)
    default = m.TritonPagedAttention(nh, d, d ** -0.5, nkv, ours.k_cache, ours.v_cache)      # num_splits=None
    theirs = e04.PagedAttention(nh, d, d ** -0.5, nkv, torch.zeros(shape), torch.zeros(shape))
    prompts = [r.int(3, 40), r.int(20, 50)]
    seqs = [e02.Sequence(list(range(n))) for n in prompts]
    free = list(torch.randperm(12, generator=r.gen).tolist())
    for s in seqs:
        s.block_table = [free.pop() for _ in range(-(-(s.num_tokens + 3) // page))]
        s.num_cached_tokens = 0
    steps = [[n - 2 for n in prompts], [2, 2], [1, 1], [1, 1]]          # chunked prefill, its tail, two decodes
    for step, news in enumerate(steps):
        for s, n in zip(seqs, news):
            s.num_scheduled_tokens = n
            while s.num_cached_tokens + n > s.num_tokens:
                s.append_token(7)
        _, _, ctx = e04.prepare_batch(seqs, page)
        n = int(ctx.cu_seqlens_q[-1])
        q, k, v = r.randn(n, nh, d), r.randn(n, nkv, d), r.randn(n, nkv, d)
        want = theirs(q, k, v, ctx)
        got = ours(*to_dev(q, k, v), _ctx_to_dev(ctx))
        assert_close(got, want, what=f"第 {step + 1} 步（{'decode' if not ctx.is_prefill else 'prefill'}）",
                     rand=r, atol=1e-5, rtol=1e-4)
        record_case("module:" + ("decode" if not ctx.is_prefill else "chunked-prefix" if step else "prefill"))
        if not ctx.is_prefill:
            try:
                got = default(*to_dev(q, k, v), _ctx_to_dev(ctx))
            except Exception as exc:
                raise AssertionError(f"第 {step + 1} 步（decode，num_splits 缺省）出错：{type(exc).__name__}: {exc}；{r}\n"
                                     f"  看起来像易错点：{M_DEFAULT_SPLITS}") from exc
            assert_close(got, want, what=f"第 {step + 1} 步（decode，TritonPagedAttention 没给 num_splits）",
                         rand=r, atol=1e-5, rtol=1e-4)
            record_case("module:decode,default-num-splits")
        for s, n in zip(seqs, news):
            s.num_cached_tokens += n


# ------------------------------------------------------------------------------------------------ native CUDA

@needs_cuda
@point("原生 CUDA：bf16 prefill（64 条序列、head_dim 128/256、带前缀）")
def test_native_cuda_prefill():
    m = impl(MODULE)
    r = Rand()
    for nh, nkv, d, page in ((16, 8, 128, 16), (16, 2, 256, 32)):
        lens_k = [r.int(16, 400) for _ in range(64)]
        lens_q = [lk if b % 2 else r.int(1, lk) for b, lk in enumerate(lens_k)]
        q, kc, vc, bt, cu_q, cu_k, keys, values = paged_problem(r, lens_q, lens_k, nh, nkv, d, page,
                                                                dtype=torch.bfloat16, device="cuda")
        scale = d ** -0.5
        out = m.prefill_attention(q, kc, vc, cu_q, cu_k, bt, max(lens_q), scale)
        ref = reference(q.float(), keys.float(), values.float(), cu_q, cu_k, scale)
        assert out.dtype == torch.bfloat16
        assert_close(out.float(), ref, what=f"CUDA bf16 prefill（D={d}, P={page}）", rand=r, atol=2e-2, rtol=2e-2)
        unpaged = m.flash_attention_varlen(q, keys, values, cu_q, cu_k, max(lens_q), scale)
        assert_close(unpaged.float(), ref, what=f"CUDA bf16 flash_attention_varlen（D={d}）", rand=r,
                     atol=2e-2, rtol=2e-2)


@needs_cuda
@point("原生 CUDA：bf16 decode（batch 256、context 到 32k、head_dim 256）")
def test_native_cuda_decode():
    m = impl(MODULE)
    r = Rand()
    for batch, nh, nkv, d, page, hi, splits in ((256, 32, 8, 128, 16, 4096, 4), (64, 16, 2, 256, 32, 32768, 16)):
        lens = [r.int(1, hi) for _ in range(batch)]
        lens[0] = hi
        q, kc, vc, bt, ctx, cu_q, cu_k, keys, values = _decode_case(r, lens, nh, nkv, d, page,
                                                                    dtype=torch.bfloat16, device="cuda")
        ctx = ctx.cuda()
        scale = d ** -0.5
        out = m.decode_attention(q, kc, vc, bt, ctx, scale, splits)
        ref = reference(q.float(), keys.float(), values.float(), cu_q, cu_k, scale)
        assert_close(out.float(), ref, what=f"CUDA bf16 decode（B={batch}, D={d}, 最长 {hi}）", rand=r,
                     atol=2e-2, rtol=2e-2)
