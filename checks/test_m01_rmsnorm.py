"""Checks for m01_rmsnorm: the RMSNorm family against HF transformers 5.17 (fp32 and bit-level bf16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from checks.kit import Rand, assert_close, assert_dtype, assert_equal, impl, point, record_case

MOD = "m01_rmsnorm"
BF16 = torch.bfloat16

# the card's 逐步图 (lessons/m01_rmsnorm.md): H = 4, eps = 1e-6
EX_X = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1e-3, -1e-3, 1e-3, -1e-3]])
EX_W = torch.tensor([1.0, 0.5, -1.0, 2.0])
EX_Z = torch.tensor([[0.0, 1.0, -1.0, 2.0], [2.0, -2.0, 0.5, 1.0]])
EX_QWEN3 = torch.tensor([[0.3651, 0.3651, -1.0954, 2.9212], [0.7071, -0.3536, -0.7071, -1.4142]])
EX_GEMMA = torch.tensor([[0.7303, 1.0954, 0.0000, 4.3818], [1.4142, -1.0607, 0.0000, -2.1213]])
EX_GATED = torch.tensor([[0.0000, 0.2669, 0.2946, 5.1459], [1.2456, 0.0843, -0.2201, -1.0339]])
EX_SUB = torch.tensor([[0.5, -0.5, 0.5, -0.5]])                 # a sublayer output added to row 0
EX_FUSED = torch.tensor([[0.5571, 0.2785, -1.2999, 2.5997]])
# bf16 step of the 逐步图: the same effective scale, the two cast orders, one ulp apart in the last element
EX_BF16_X = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=BF16)
EX_BF16_W = torch.tensor([1.2, 1.1, 0.9, 1.3]).to(BF16)           # [1.203125, 1.1015625, 0.8984375, 1.296875]
EX_BF16_QWEN3 = torch.tensor([0.43945312, 0.8046875, 0.984375, 1.8984375], dtype=BF16)
EX_BF16_GEMMA = torch.tensor([0.43945312, 0.8046875, 0.984375, 1.890625], dtype=BF16)
EX_ATOL = 1e-4                                                   # the card prints 4 decimals

# mistake names (the card's 易错点 wording, shortened)
M_EPS = "eps 放在了 sqrt 外面（x / (sqrt(mean) + eps)），应是 rsqrt(mean(x²) + eps)"
M_SUM = "用了 sum(x²) 而不是 mean(x²)（结果小了 sqrt(H) 倍）"
M_LN = "减了均值（那是 LayerNorm；RMSNorm 不减均值）"
M_Q3_FP32 = "Qwen3 norm 先在 fp32 里乘 w 再 cast（那是 Gemma/Qwen3.5 的顺序；Qwen3RMSNorm 是先 cast 回 x.dtype 再乘 w）"
M_GEMMA_CAST = "Gemma norm 先 cast 再乘 (1+w)（那是 Qwen3 的顺序；Qwen3_5RMSNorm 是在 fp32 里乘完再 cast）"
M_GEMMA_W = "Gemma norm 乘的是 w 而不是 (1+w)（权重从 0 开始，真实权重在 0 附近）"
M_GATED_1PW = "RMSNormGated 用了 (1+w)：它的权重从 1 开始，乘的就是 w"
M_GATED_NOSILU = "RMSNormGated 忘了对 z 做 silu（直接乘了 z）"
M_GATED_SILU_X = "RMSNormGated 把 silu 用在了 x（norm 的结果）上，而不是 z 上"
M_GATED_BEFORE = "RMSNormGated 先门控再 norm（norm(x·silu(z))，Mamba2 的 norm_before_gate=False）"
M_GATED_SIGMOID = "RMSNormGated 用了 sigmoid(z) 而不是 silu(z) = z·sigmoid(z)"
M_PRE_RES = "fused 形式返回了相加前的 residual（应返回 x + residual）"
M_PRE_X = "fused 形式返回了相加前的 x（应返回 x + residual）"
M_NORM_X = "fused 形式对相加前的 x 做了 norm（应 norm(x + residual)）"
M_RES_FP32 = "residual 在 fp32 里相加并以 fp32 返回：HF 与 vLLM 都在 x.dtype 里做 x + residual，返回的 residual 也是 x.dtype"
M_FP32_SUM = "在 fp32 里相加后对未舍入的和做 norm（nano-vllm 的写法）；HF 先在 x.dtype 里相加，再对舍入后的和做 norm"
M_SELF_EPS = "模块没有用构造时传入的 eps（self.eps），用了默认的 1e-6"


def _eps(r: Rand) -> float:
    """Never the default 1e-6, and large enough that the tiny rows of _rows change with it."""
    return r.choice([1e-4, 3e-4, 1e-3])


# ----------------------------------------------------------------------------- helpers

def _hf(cls, size: int, eps: float, r: Rand, mean: float, dtype=torch.float32):
    """An HF norm with every weight randomised (HF starts them at 1 or 0, which hides w vs 1+w)."""
    return r.init_(cls(size, eps=eps), std=0.5, mean=mean).to(dtype).eval()


def _copy(mine: torch.nn.Module, hf: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        mine.weight.copy_(hf.weight)
    return mine


def _rows(r: Rand, lead: tuple[int, ...], h: int, dtype=torch.float32) -> torch.Tensor:
    """Random [*lead, h] whose rows span 1e-3.5 .. 10 in scale (tiny rows make eps matter), row 0 all zero; the
    tiniest row is never row 0, so even two rows (a tiny one and the zero one) tell eps 1e-6 from the one asked for."""
    x = r.randn(*lead, h)
    scale = torch.logspace(-3.5, 1.0, x[..., 0].numel())
    scale = scale[torch.randperm(scale.numel(), generator=r.gen)]
    if scale.numel() > 1 and scale[0] == scale.min():     # row 0 is zeroed below: keep the tiny row, where eps shows
        scale[[0, 1]] = scale[[1, 0]]
    x = x * scale.reshape(x.shape[:-1])[..., None]
    x.reshape(-1, h)[0] = 0.0
    return x.to(dtype)


def _lead(r: Rand) -> tuple[int, ...]:
    """[N], [B, T] or [N, heads] (q/k norm per head): any leading shape must work."""
    return r.choice([(r.int(3, 9),), (r.int(1, 3), r.int(2, 6)), (r.int(2, 7), r.int(1, 4))])


def _all_leads(r: Rand) -> list[tuple[tuple[int, ...], str]]:
    """Each leading shape the card names, every run: [N, H], [B, T, H] and [N, nH, D] (q/k norm per head)."""
    return [((r.int(3, 9),), "[N,H]"), ((r.int(1, 3), r.int(2, 6)), "[B,T,H]"), ((r.int(2, 7), r.int(1, 4)), "[N,nH,D]")]


def _record_rows(label: str) -> None:
    """_rows always holds an all-zero row and a tiny row (|x| ~ 1e-3.5, mean square near eps)."""
    record_case(f"{label}:zero-row")
    record_case(f"{label}:tiny-row")


def _core(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _wrong_cores(x: torch.Tensor, eps: float) -> list[tuple[torch.Tensor, str]]:
    h = x.float()
    return [(h / (h.pow(2).mean(-1, keepdim=True).sqrt() + eps), M_EPS),
            (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps), M_SUM),
            ((h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, unbiased=False, keepdim=True) + eps), M_LN)]


def _assert_bf16(actual, expected: torch.Tensor, *, what: str, r: Rand, looks_like=(), dtype_mistake: str = "") -> None:
    """Bit-level bf16 comparison.

    Equal bits are required, except that at most 1 % of the elements may sit one bf16 ulp away: that is what
    an x / sqrt(...) instead of x * rsqrt(...) produces (a 1-ulp fp32 difference that flips a rounding now
    and then). A wrong cast order changes about a quarter of the elements, so it never hides in that slack.
    """
    if isinstance(actual, torch.Tensor):
        assert_dtype(actual, expected.dtype, what=what, mistake=dtype_mistake)
    if isinstance(actual, torch.Tensor) and actual.shape == expected.shape:
        a, e = actual.view(torch.int16).int(), expected.view(torch.int16).int()
        differ = a != e
        if not differ.any():
            return
        if (a - e).abs().max() <= 1 and differ.float().mean() <= 0.01:
            return
    assert_equal(actual, expected, what=what + "（bf16 逐位比较）", rand=r, looks_like=looks_like)


# ----------------------------------------------------------------------------- checks

@point("Qwen3 RMSNorm 与 HF 一致（任意前导维度）")
def test_qwen3_rmsnorm_matches_hf():
    m = impl(MOD)
    r = Rand()
    out = m.rms_norm(EX_X, EX_W, 1e-6)
    assert_close(out, EX_QWEN3, what="逐步图 rms_norm(x, w, 1e-6)", atol=EX_ATOL, rtol=0,
                 looks_like=[(EX_W * w, msg) for w, msg in _wrong_cores(EX_X, 1e-6)])
    record_case("card:rms_norm")

    h, eps = r.int(8, 96), _eps(r)
    hf = _hf(Qwen3RMSNorm, h, eps, r, mean=1.0)
    for lead, lead_label in _all_leads(r):
        x = _rows(r, lead, h)
        with torch.no_grad():
            ref = hf(x)
            wrong = [(hf.weight * c, msg) for c, msg in _wrong_cores(x, eps)]
            assert_close(m.rms_norm(x, hf.weight, eps), ref, what=f"rms_norm，x {list(x.shape)}，eps={eps:g}", rand=r,
                         looks_like=wrong)
            out = _copy(m.RMSNorm(h, eps=eps), hf)(x)
            if isinstance(out, tuple):
                raise AssertionError("RMSNorm(x)：residual=None（第一层）时应只返回 normed 张量，不是 tuple")
            if isinstance(out, torch.Tensor) and out.shape == x.shape and not torch.isfinite(out.reshape(-1, h)[0]).all():
                raise AssertionError(f"RMSNorm(x)：全零行的输出应为 0，得到 NaN/inf（eps 要加在 sqrt 里面防止除以 0）；{r}")
            assert_close(out, ref, what=f"RMSNorm(x)，x {list(x.shape)}（要用 self.eps={eps:g}）", rand=r,
                         looks_like=wrong + [(hf.weight * _core(x, 1e-6), M_SELF_EPS)])
        record_case(f"qwen3:lead-{lead_label}")
    _record_rows("qwen3")
    record_case("qwen3:module-eps-non-default")


@point("fused residual：链式调用与 HF 残差模式一致")
def test_fused_residual_chain_matches_hf():
    m = impl(MOD)
    r = Rand()
    mine = m.RMSNorm(4, eps=1e-6)
    with torch.no_grad():
        mine.weight.copy_(EX_W)
        normed, res = mine(EX_SUB, EX_X[:1])
    assert_close(res, EX_SUB + EX_X[:1], what="逐步图 fused：返回的 residual",
                 looks_like=[(EX_X[:1], M_PRE_RES), (EX_SUB, M_PRE_X)])
    assert_close(normed, EX_FUSED, what="逐步图 fused：返回的 normed", atol=EX_ATOL, rtol=0,
                 looks_like=[(EX_W * _core(EX_SUB, 1e-6), M_NORM_X)])
    record_case("card:fused")

    h, num_layers, eps = r.int(8, 64), r.int(2, 3), _eps(r)
    for cls_name, hf_cls, mean in (("RMSNorm", Qwen3RMSNorm, 1.0), ("GemmaRMSNorm", Qwen3_5RMSNorm, 0.0)):
        for dtype in (torch.float32, BF16):
            lead = _lead(r)
            hf_norms = [_hf(hf_cls, h, eps, r, mean, dtype) for _ in range(2 * num_layers + 1)]
            mine = [_copy(getattr(m, cls_name)(h, eps=eps).to(dtype), n) for n in hf_norms]
            subs = [(r.randn(h, h, scale=h ** -0.5)).to(dtype) for _ in range(2 * num_layers)]
            x = r.randn(*lead, h, dtype=dtype)
            what = f"{cls_name} 链式 fused（{num_layers} 层，{dtype}，x {list(x.shape)}）"

            def sub(i, t):                                  # stands in for attention / MLP
                return torch.tanh(t @ subs[i].T)

            def same(actual, expected, what_step, looks_like=(), dtype_mistake=""):
                if dtype == torch.float32:
                    assert_close(actual, expected, what=f"{what}：{what_step}", rand=r, looks_like=looks_like)
                else:                                       # bit-level, step by step (1-ulp flips would compound)
                    _assert_bf16(actual, expected, what=f"{what}：{what_step}", r=r, looks_like=looks_like,
                                 dtype_mistake=dtype_mistake)

            def fp32_sum_normed(norm, t):                   # nano-vllm: add in fp32, normalise the unrounded sum
                c = _core(t.float(), eps)
                w = norm.weight
                if cls_name == "RMSNorm":              # either cast order on the unrounded sum
                    return [(w * c.to(dtype), M_FP32_SUM), ((w.float() * c).to(dtype), M_FP32_SUM)]
                return [((c * (1 + w.float())).to(dtype), M_FP32_SUM)]

            def swapped_cast(norm, t):                      # the other norm's cast order
                c, w = _core(t, eps), norm.weight
                if cls_name == "RMSNorm":
                    return [((w.float() * c).to(dtype), M_Q3_FP32)]
                return [((1 + w) * c.to(dtype), M_GEMMA_CAST), ((c.to(dtype) * (1 + w.float())).to(dtype), M_GEMMA_CAST)]

            with torch.no_grad():
                # HF's decoder: residual = h; h = norm(h); h = f(h); h = residual + h
                hs = x
                for i in range(2 * num_layers):
                    residual = hs
                    hs = residual + sub(i, hf_norms[i](hs))
                ref_stream, ref_out = hs, hf_norms[-1](hs)

                # the fused protocol: the first norm has no residual, every later one gets (x, residual)
                out, residual = mine[0](x), x
                if isinstance(out, tuple):
                    raise AssertionError(f"{what}：第一层 residual=None 时应只返回 normed 张量，不是 tuple")
                same(out, hf_norms[0](x), "第一层 norm(x)", looks_like=swapped_cast(hf_norms[0], x))
                for i in range(2 * num_layers):
                    delta = sub(i, out)
                    step = mine[i + 1](delta, residual)
                    if not (isinstance(step, tuple) and len(step) == 2):
                        raise AssertionError(f"{what}：带 residual 调用时应返回 (normed, x + residual) 两个张量")
                    expected = residual + delta             # HF's order, in x.dtype
                    same(step[1], expected, f"第 {i + 1} 次 fused 返回的 residual",
                         looks_like=[(residual, M_PRE_RES), (delta, M_PRE_X)],
                         dtype_mistake=M_RES_FP32 if isinstance(step[1], torch.Tensor)
                         and step[1].dtype == torch.float32 else "")
                    same(step[0], hf_norms[i + 1](expected), f"第 {i + 1} 次 fused 返回的 normed",
                         looks_like=[(hf_norms[i + 1](delta), M_NORM_X)]
                         + fp32_sum_normed(hf_norms[i + 1], delta.float() + residual.float())
                         + swapped_cast(hf_norms[i + 1], expected))
                    out, residual = step
            if dtype == torch.float32:                      # end to end: the same stream as HF's decoder
                assert_close(residual, ref_stream, what=f"{what}：最终 residual 流", rand=r)
                assert_close(out, ref_out, what=f"{what}：最终 normed", rand=r)
            record_case(f"fused:{cls_name}:{'fp32' if dtype == torch.float32 else 'bf16'}")
    record_case("fused:first-layer-no-residual")


@point("Gemma 风格 (1+w) norm 与 Qwen3_5RMSNorm 一致")
def test_gemma_rmsnorm_matches_hf():
    m = impl(MOD)
    r = Rand()
    out = m.gemma_rms_norm(EX_X, EX_W, 1e-6)
    assert_close(out, EX_GEMMA, what="逐步图 gemma_rms_norm(x, w, 1e-6)", atol=EX_ATOL, rtol=0,
                 looks_like=[(EX_QWEN3, M_GEMMA_W)] + [((1 + EX_W) * c, msg) for c, msg in _wrong_cores(EX_X, 1e-6)])
    record_case("card:gemma_rms_norm")

    h, eps = r.int(8, 96), _eps(r)
    hf = _hf(Qwen3_5RMSNorm, h, eps, r, mean=0.0)
    for lead, lead_label in _all_leads(r):
        x = _rows(r, lead, h)
        with torch.no_grad():
            ref = hf(x)
            wrong = [(hf.weight * _core(x, eps), M_GEMMA_W)] + [((1 + hf.weight) * c, msg)
                                                                for c, msg in _wrong_cores(x, eps)]
            assert_close(m.gemma_rms_norm(x, hf.weight, eps), ref,
                         what=f"gemma_rms_norm，x {list(x.shape)}，eps={eps:g}", rand=r, looks_like=wrong)
            fresh = m.GemmaRMSNorm(h, eps=eps)
            assert_close(fresh(x), _core(x, eps), what="刚构造的 GemmaRMSNorm（权重为 0）应是纯 norm(x)", rand=r,
                         looks_like=[(torch.zeros_like(x), M_GEMMA_W)])
            out = _copy(fresh, hf)(x)
            if isinstance(out, tuple):
                raise AssertionError("GemmaRMSNorm(x)：residual=None 时应只返回 normed 张量，不是 tuple")
            assert_close(out, ref, what=f"GemmaRMSNorm(x)，x {list(x.shape)}", rand=r,
                         looks_like=wrong + [((1 + hf.weight) * _core(x, 1e-6), M_SELF_EPS)])
        record_case(f"gemma:lead-{lead_label}")
    _record_rows("gemma")
    record_case("gemma:fresh-zero-weight")
    record_case("gemma:module-eps-non-default")


@point("RMSNormGated 与 Qwen3_5RMSNormGated 一致")
def test_rmsnorm_gated_matches_hf():
    m = impl(MOD)
    r = Rand()
    out = m.rms_norm_gated(EX_X, EX_Z, EX_W, 1e-6)
    n = _core(EX_X, 1e-6)
    assert_close(out, EX_GATED, what="逐步图 rms_norm_gated(x, z, w, 1e-6)", atol=EX_ATOL, rtol=0,
                 looks_like=[((1 + EX_W) * n * F.silu(EX_Z), M_GATED_1PW), (EX_W * n * EX_Z, M_GATED_NOSILU),
                             (F.silu(EX_W * n) * EX_Z, M_GATED_SILU_X),
                             (EX_W * _core(EX_X * F.silu(EX_Z), 1e-6), M_GATED_BEFORE),
                             (EX_W * n * torch.sigmoid(EX_Z), M_GATED_SIGMOID)])
    record_case("card:rms_norm_gated")

    # Gated DeltaNet applies it per value head: x, z [T, num_v_heads, head_v_dim], weight [head_v_dim]
    d, eps = r.int(8, 64), _eps(r)
    lead = (r.int(2, 9), r.int(1, 4))
    for dtype in (torch.float32, BF16):
        hf = _hf(Qwen3_5RMSNormGated, d, eps, r, mean=1.0, dtype=dtype)
        x = _rows(r, lead, d, dtype)
        z = r.randn(*lead, d, scale=2.0, dtype=dtype)
        what = f"RMSNormGated，x/z {list(x.shape)}，{dtype}"
        with torch.no_grad():
            ref = hf(x, z)
            w, n, zf = hf.weight.float(), _core(x, eps), z.float()
            wrong = [((1 + w) * n * F.silu(zf), M_GATED_1PW), (w * n * zf, M_GATED_NOSILU),
                     (F.silu(w * n) * zf, M_GATED_SILU_X), (w * _core(x.float() * F.silu(zf), eps), M_GATED_BEFORE),
                     (w * n * torch.sigmoid(zf), M_GATED_SIGMOID), (w * _core(x, 1e-6) * F.silu(zf), M_SELF_EPS)]
            fn_out = m.rms_norm_gated(x, z, hf.weight, eps)
            mod_out = _copy(m.RMSNormGated(d, eps=eps).to(dtype), hf)(x, z)
            if dtype == torch.float32:
                assert_close(fn_out, ref, what=f"rms_norm_gated，{what}", rand=r, looks_like=wrong)
                assert_close(mod_out, ref, what=f"RMSNormGated(x, z)，{what}", rand=r, looks_like=wrong)
            else:
                all_fp32 = (w * n * F.silu(zf)).to(dtype)
                bf16_wrong = [(all_fp32, "全程 fp32 再一次 cast：HF 是先把 w·norm(x) cast 回 x.dtype，再乘 silu(z)"),
                              (((w * n).to(dtype) * F.silu(zf)).to(dtype), M_Q3_FP32)]
                _assert_bf16(fn_out, ref, what=f"rms_norm_gated，{what}", r=r, looks_like=bf16_wrong)
                _assert_bf16(mod_out, ref, what=f"RMSNormGated(x, z)，{what}", r=r, looks_like=bf16_wrong)
        record_case(f"gated:{'fp32' if dtype == torch.float32 else 'bf16'}")
    _record_rows("gated")
    record_case("gated:lead-[N,nv,dv]")


@point("bf16 下两种 cast 顺序与 HF 逐位一致")
def test_bf16_cast_orders_bit_exact():
    m = impl(MOD)
    r = Rand()
    _assert_bf16(m.rms_norm(EX_BF16_X, EX_BF16_W, 1e-6), EX_BF16_QWEN3, what="逐步图 bf16 rms_norm", r=r,
                 looks_like=[(EX_BF16_GEMMA, M_Q3_FP32)])
    _assert_bf16(m.gemma_rms_norm(EX_BF16_X, (EX_BF16_W.float() - 1).to(BF16), 1e-6), EX_BF16_GEMMA,
                 what="逐步图 bf16 gemma_rms_norm", r=r, looks_like=[(EX_BF16_QWEN3, M_GEMMA_CAST)])
    record_case("card:bf16-cast-orders")

    h, eps = r.int(64, 160), 1e-6
    lead = (r.int(8, 16),)
    x = _rows(r, lead, h, BF16)
    with torch.no_grad():
        hf = _hf(Qwen3RMSNorm, h, eps, r, mean=1.0, dtype=BF16)
        n = _core(x, eps)
        _assert_bf16(_copy(m.RMSNorm(h, eps=eps).to(BF16), hf)(x), hf(x), what=f"RMSNorm，bf16 x {list(x.shape)}",
                     r=r, looks_like=[((hf.weight.float() * n).to(BF16), M_Q3_FP32)])

        hg = _hf(Qwen3_5RMSNorm, h, eps, r, mean=0.0, dtype=BF16)
        g_wrong = [((1 + hg.weight) * n.to(BF16), M_GEMMA_CAST),
                   ((n.to(BF16) * (1 + hg.weight.float())).to(BF16), M_GEMMA_CAST)]
        _assert_bf16(_copy(m.GemmaRMSNorm(h, eps=eps).to(BF16), hg)(x), hg(x),
                     what=f"GemmaRMSNorm，bf16 x {list(x.shape)}", r=r, looks_like=g_wrong)
    record_case("bf16:RMSNorm")
    record_case("bf16:GemmaRMSNorm")
