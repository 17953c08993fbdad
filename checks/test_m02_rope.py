"""Checks for m02 · RoPE family (lessons/m02_rope.md).

Oracles (transformers 5.17.0, fp32): Qwen3RotaryEmbedding / Qwen3MoeRotaryEmbedding + qwen3
apply_rotary_pos_emb (plain RoPE), Qwen3_5TextRotaryEmbedding / Qwen3_5MoeTextRotaryEmbedding + qwen3_5
apply_rotary_pos_emb (partial rotary, interleaved MRoPE), Qwen3OmniMoeThinkerTextRotaryEmbedding + qwen3_omni_moe
apply_rotary_pos_emb (full-dim interleaved MRoPE). RoPE has no weights; q, k and positions are random per run.
"""

from __future__ import annotations

import copy
import math

import torch
import transformers
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as hf_apply
from transformers.models.qwen3.modeling_qwen3 import rotate_half as hf_rotate_half
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb as hf_apply_partial
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRotaryEmbedding
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb as hf_apply_omni

from checks.kit import (Rand, assert_close, assert_dtype, assert_equal, crash_text, explain_crash, impl, point,
                        record_case)

transformers.utils.logging.set_verbosity_error()

MOD = "m02_rope"
P = 32768   # max_position_embeddings of every config below (HF default); 30000 is a real decode position

# the 易错点 of the card, as the messages name them
GPTJ = "相邻配对 (2i, 2i+1)（GPT-J 风格），而不是 rotate-half 的 (i, i+R/2)"
SIGN = "rotate_half 的负号放反（写成 cat(x2, -x1)），等于反向旋转"
ARANGE = "按 cache[:N] 取行（默认位置是 0..N-1），而不是按每个 token 的 positions 取"
ALLDIMS = "partial rotary 时旋转了全部 head_dim 维（忘了 partial_rotary_factor，或没把 q[..., R:] 原样拼回）"
DENOM = "partial rotary 的 inv_freq 分母用了 head_dim 而不是 rotary_dim"
BF16 = "cos/sin 在 bf16 中计算或存储（cache 必须是 fp32；arange 要写 dtype=torch.float32，默认 dtype 可能是 bf16）"
CHUNKED = "MRoPE 按段连续切分（Qwen2-VL 的 TTT…HHH…WWW），而不是交错 THWTHW…"
ONLY_T = "MRoPE 只用了 t 行位置，忽略了 h/w"
BOUND = "交错规则的上界写成 i < sec[k]，应为 i < 3·sec[k]"
UNCHECKED = "没有检查 rotary_dim（奇数、0 或大于 head_dim 时应抛 ValueError）"
PERSISTENT = "register_buffer 没写 persistent=False（默认是 True），cos/sin 表或 MRoPE 的轴 buffer 进了 state_dict"
TRUEDIV = "没有 head_dim 字段时用 / 算 head_dim（hidden_size / num_attention_heads 得到 float）"
BF16_AT_USE = ("cos/sin 以 bf16 参与了旋转（存成了 bf16，或在旋转前转成了 q.dtype）：cos/sin 要保持 fp32，"
               "在 fp32 里旋转后再转回 q.dtype")
ATTR_FACTOR = ("config 的 rope_parameters 里没有 partial_rotary_factor 时，没有读同名属性 config.partial_rotary_factor"
               "（转了全部 head_dim 维）")
ATTR_THETA = "config 的 rope_parameters 里没有 rope_theta 时，没有读同名属性 config.rope_theta（用了默认的 10000）"
OMNI_DEFAULT = ("Omni thinker 的 config 没写 mrope_section 时用了 Qwen3.5 的 [11, 11, 10]；"
                "默认值按 model_type 取 HF 该模型的值（qwen3_omni_moe_text 是 [24, 20, 20]）")
FORMULA = ("只有大位置处与 HF 不一致：inv_freq 或角度的 fp32 算法与 HF/vLLM 不同（例如 base**(-x) 或先用 fp64）。"
           "p≈30000 时 inv_freq 差 1 ulp，角度就差约 1e-3；请照抄 1.0 / base ** (arange(0, R, 2, dtype=float32) / R) "
           "与 outer(arange(P, dtype=float32), inv_freq)")


# ----------------------------------------------------------------------------------- independent references

def ref_inv_freq(rotary_dim: int, base: float, denom: int | None = None, dtype=torch.float32) -> torch.Tensor:
    """HF's inv_freq; `denom` / `dtype` reproduce the classic mistakes."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.float32).to(dtype) / (denom or rotary_dim)
    return (1.0 / (base ** exps)).float()


def ref_cache(rotary_dim: int, base: float, num_pos: int = P, **kw) -> torch.Tensor:
    freqs = torch.outer(torch.arange(num_pos, dtype=torch.float32), ref_inv_freq(rotary_dim, base, **kw))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)                      # [P, R]


def ref_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox") -> torch.Tensor:
    """x [N, h, R], cos/sin [N, R/2]: neox (i, i+R/2), gptj (2i, 2i+1) or neox turned the other way."""
    cos, sin = cos[:, None], sin[:, None]
    if style == "gptj":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if style == "reverse":
        sin = -sin
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def ref_rope(cache: torch.Tensor, positions: torch.Tensor, x: torch.Tensor, rotary_dim: int,
             axes: torch.Tensor | None = None, style: str = "neox") -> torch.Tensor:
    """Full reference on [N, h, D]: positions [N], or [3, N] with `axes` [R/2] naming T/H/W per frequency."""
    cs = cache[positions]
    if positions.dim() == 2:
        cs = torch.take_along_dim(cs, torch.cat((axes, axes)).view(1, 1, -1), dim=0)[0]
    cos, sin = cs.chunk(2, dim=-1)
    return torch.cat((ref_rotate(x[..., :rotary_dim], cos, sin, style), x[..., rotary_dim:]), dim=-1)


def ref_axes(num_freqs: int, sec: list[int], kind: str = "interleaved") -> torch.Tensor:
    i = torch.arange(num_freqs)
    if kind == "chunked":
        return torch.repeat_interleave(torch.arange(3), torch.tensor(sec))[:num_freqs]
    scale = 1 if kind == "bound" else 3
    axes = torch.zeros(num_freqs, dtype=torch.long)
    axes[(i % 3 == 1) & (i < scale * sec[1])] = 1
    axes[(i % 3 == 2) & (i < scale * sec[2])] = 2
    return axes


def hf_rope(rotary, apply_fn, position_ids, q, k):
    """Run an HF rotary + apply pair on packed q [N, nH, D], k [N, nKV, D] (HF wants [B, heads, T, D])."""
    with torch.no_grad():
        cos, sin = rotary(q, position_ids)
        q_hf, k_hf = apply_fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


def qwen35_config(cls, head_dim: int, factor: float, theta: float, section=None):
    params = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
    if section is not None:
        params["mrope_section"] = list(section)
    return cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
               num_hidden_layers=1, max_position_embeddings=P, rope_parameters=params)


def omni_config(head_dim: int, theta: float, section):
    return Qwen3OmniMoeTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                  max_position_embeddings=P,
                                  rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                   "mrope_section": list(section)})


def packed_positions(r: Rand) -> torch.Tensor:
    """Several sequences in one batch: a fresh prefill, a later prefill chunk, decode tokens (30000 among them)."""
    fresh = torch.arange(r.int(2, 6))
    chunk_start = r.int(100, 5000)
    chunk = torch.arange(chunk_start, chunk_start + r.int(2, 5))
    # decode tokens out of order, the last position P - 1, and a token of another sequence at the chunk's position
    decode = torch.tensor([30000, r.int(1, P - 1), P - 1, r.int(20000, P - 1), chunk_start])
    segments = [fresh, chunk, decode]
    r.py.shuffle(segments)
    return torch.cat(segments)


def mrope_positions(r: Rand) -> torch.Tensor:
    """[3, N] t/h/w: text, an image grid (t fixed, h = row, w = col), text again, then independent large ones."""
    a, gh, gw = r.int(2, 4), r.int(2, 3), r.int(2, 4)
    text1 = torch.arange(a).expand(3, a)
    rows, cols = torch.arange(gh).repeat_interleave(gw), torch.arange(gw).repeat(gh)
    image = torch.stack((torch.full((gh * gw,), a), a + rows, a + cols))
    b = a + max(gh, gw)
    text2 = torch.arange(b, b + r.int(1, 3)).expand(3, -1)
    free = r.randint(0, P, (3, r.int(2, 4)))
    return torch.cat((text1, image, text2, free), dim=1)


def random_section(r: Rand, half: int) -> list[int]:
    h = max(1, half // 3)
    w = max(1, h - r.int(0, 1))
    return [half - h - w, h, w]


def assert_rope(actual, expected, positions, *, what, rand, looks_like=()):
    """assert_close, plus the hint when only tokens at large positions are off (the inv_freq formula)."""
    try:
        assert_close(actual, expected, what=what, rand=rand, looks_like=looks_like)
    except AssertionError as exc:
        pos = positions if positions.dim() == 1 else positions.max(dim=0).values
        small = pos < 2048
        if (isinstance(actual, torch.Tensor) and actual.shape == expected.shape and bool(small.any())
                and torch.allclose(actual[small].double(), expected[small].double(), atol=1e-5, rtol=1e-5)
                and "看起来像易错点" not in str(exc)):
            raise AssertionError(f"{exc}\n  看起来像易错点：{FORMULA}") from None
        raise


def assert_bf16_rope(actual, expected, *, what, rand, looks_like=()):
    """bf16 q/k through forward: bf16 out, equal bits to the fp32 rotation cast once (at most 1 % of the elements
    one bf16 ulp away: an equivalent fp32 formula, e.g. x*cos + rotate_half(x)*sin, may flip a rounding)."""
    assert_dtype(actual, torch.bfloat16, what=what, mistake="结果没有转回输入 dtype")
    if actual.shape == expected.shape:
        a, e = actual.view(torch.int16).int(), expected.view(torch.int16).int()
        if (a - e).abs().max() <= 1 and (a != e).float().mean() <= 0.01:
            return
    assert_equal(actual, expected, what=what + "（bf16 逐位比较）", rand=rand, looks_like=looks_like)


def assert_no_state(rope, *, what):
    """RoPE has no weights: nothing of it may go into (or be expected from) a checkpoint."""
    keys = list(rope.state_dict())
    if keys:
        buffers = dict(rope.named_buffers())
        hint = f"\n  看起来像易错点：{PERSISTENT}" if all(k in buffers for k in keys) else ""
        raise AssertionError(f"{what}：state_dict() 应为空（RoPE 没有权重，checkpoint 里没有这些键，"
                             f"按 state_dict 严格加载会报 Missing key），得到 {keys}{hint}")


def assert_attributes(rope, name: str, **want) -> None:
    """The attributes the card names (later exercises read rope.rotary_dim); head_dim / rotary_dim are ints."""
    for attr, expected in want.items():
        if not hasattr(rope, attr):
            raise AssertionError(f"{name}：RotaryEmbedding 应有属性 {attr}（= {expected!r}）")
        got = getattr(rope, attr)
        if attr == "mrope_section" and got is not None:
            got = list(got)
        if attr in ("head_dim", "rotary_dim") and not (isinstance(got, int) and not isinstance(got, bool)):
            hint = (f"\n  看起来像易错点：{TRUEDIV}"
                    if attr == "head_dim" and isinstance(got, float) and got == expected else "")
            raise AssertionError(f"{name}：rope.{attr} 应为 int {expected}，得到 {got!r}（{type(got).__name__}）；"
                                 f"拿它当形状用（view、empty）会报 TypeError{hint}")
        if got != expected:
            raise AssertionError(f"{name}：rope.{attr} 应为 {expected!r}，得到 {got!r}")


def build_under_bf16_default(m, *args):
    """Construct while torch's default dtype is bf16, as an engine loading a bf16 model does."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return m.RotaryEmbedding(*args)
    finally:
        torch.set_default_dtype(old)


# ----------------------------------------------------------------------------------------------- checks

@point("rotate-half 配对 (i, i+R/2) 与 HF 一致")
def test_rotate_half_pairing():
    m = impl(MOD)
    r = Rand()

    # card 逐步图 ①: x = [1, 2, 3, 4], R = 4, base 1e4, position 2 -> angles [2, 0.02]
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    ang = torch.tensor([[2.0, 0.02]])
    cos, sin = ang.cos(), ang.sin()
    assert_close(m.rotate_half(x), torch.tensor([[[-3.0, -4.0, 1.0, 2.0]]]), what="rotate_half([1, 2, 3, 4])",
                 looks_like=[(torch.tensor([[[3.0, 4.0, -1.0, -2.0]]]), SIGN)])
    assert_close(m.apply_rotary(x, cos, sin), torch.tensor([[[-3.1440, 1.9196, -0.3391, 4.0392]]]),
                 what="逐步图 ① apply_rotary([1, 2, 3, 4], 位置 2)", atol=1e-4,
                 looks_like=[(torch.tensor([[[-2.2347, 0.0770, 2.9194, 4.0592]]]), GPTJ),
                             (torch.tensor([[[2.3117, 2.0796, -2.1577, 3.9592]]]), SIGN)])

    # random shapes and angles vs HF's rotate_half and its q*cos + rotate_half(q)*sin
    n, heads, rd = r.int(3, 9), r.int(1, 4), 2 * r.int(2, 16)
    x = r.randn(n, heads, rd)
    ang = r.randn(n, rd // 2, scale=3.0)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.chunk(2, dim=-1)
    assert_close(m.rotate_half(x), hf_rotate_half(x), what="rotate_half", rand=r,
                 looks_like=[(torch.cat((x2, -x1), dim=-1), SIGN)])
    expected = x * torch.cat((cos, cos), -1)[:, None] + hf_rotate_half(x) * torch.cat((sin, sin), -1)[:, None]
    assert_close(m.apply_rotary(x, cos, sin), expected, what="apply_rotary", rand=r,
                 looks_like=[(ref_rotate(x, cos, sin, "gptj"), GPTJ), (ref_rotate(x, cos, sin, "reverse"), SIGN)])

    # bf16 in -> bf16 out (cos/sin stay fp32)
    out = m.apply_rotary(x.bfloat16(), cos, sin)
    assert_dtype(out, torch.bfloat16, what="apply_rotary(bf16 x) 的输出", mistake="结果没有转回输入 dtype")
    assert_close(out.float(), ref_rotate(x.bfloat16().float(), cos, sin), what="apply_rotary(bf16 x)", rand=r,
                 atol=2e-2, rtol=2e-2)
    record_case("card:rotate-half")
    record_case("rotate_half:random")
    record_case("apply_rotary:fp32")
    record_case("apply_rotary:bf16")


@point("cos/sin cache 是 fp32，大位置也精确")
def test_cache_fp32_precise():
    m = impl(MOD)
    r = Rand()

    # card 逐步图 ①: R = 4, base 1e4, row 2 = [cos 2, cos 0.02 | sin 2, sin 0.02]
    small = build_under_bf16_default(m, 4, 4, 16, 10000.0)
    assert_dtype(small.cos_sin_cache, torch.float32, what="cos_sin_cache", mistake=BF16)
    assert_close(small.cos_sin_cache[2], torch.tensor([-0.4161, 0.9998, 0.9093, 0.0200]),
                 what="逐步图 ① cos_sin_cache[2]（布局应为 [cos | sin]）", atol=1e-4)

    rd, base = 2 * r.int(2, 32), r.choice([1e4, 1e6, 1e7])
    head_dim = rd + 2 * r.int(0, 4)
    rope = build_under_bf16_default(m, head_dim, rd, P, base)      # an engine builds it under a bf16 default
    cache = rope.cos_sin_cache
    assert isinstance(cache, torch.Tensor), "cos_sin_cache 应是注册的 buffer（torch.Tensor）"
    assert_dtype(cache, torch.float32, what="cos_sin_cache", mistake=BF16)
    assert list(cache.shape) == [P, rd], (
        f"cos_sin_cache 形状应为 [max_position, rotary_dim] = {[P, rd]}，得到 {list(cache.shape)}"
        + (f"\n  看起来像易错点：{ALLDIMS}" if cache.shape[-1] == head_dim != rd else ""))
    assert_no_state(rope, what=f"RotaryEmbedding({head_dim}, {rd}, {P}, {base:g})")

    # first 64 positions against the fp64 closed form: fp32 is good to ~1e-6 here, bf16 only to ~2e-3
    p64 = torch.arange(64, dtype=torch.float64)
    inv64 = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    truth = torch.outer(p64, inv64)
    truth = torch.cat((truth.cos(), truth.sin()), dim=-1).float()
    exact = ref_cache(rd, base)
    assert_close(cache[:64], truth, what="cos_sin_cache[:64] 与 fp64 闭式解", rand=r,
                 looks_like=[(exact[:64].bfloat16().float(), BF16),
                             (ref_cache(rd, base, 64, dtype=torch.bfloat16), BF16),
                             (torch.cat((truth[:, rd // 2:], truth[:, :rd // 2]), -1), "cache 布局写成了 [sin | cos]")])
    # every position against HF's fp32 formula (tokens at p ~ 30000 are where precision shows)
    assert_rope(cache, exact, torch.arange(P), what="cos_sin_cache（全部位置，对照 HF 的 fp32 公式）", rand=r,
                looks_like=[(exact.bfloat16().float(), BF16)])
    record_case("card:cache-row-2")
    record_case("cache:fp32-under-bf16-default")
    record_case("cache:shape-[P,R]")
    record_case("cache:not-persistent")


@point("packed 多序列、任意位置（含 decode 位置 30000）与 HF Qwen3 一致")
def test_packed_positions_vs_qwen3():
    m = impl(MOD)
    r = Rand()
    head_dim, theta = r.choice([16, 32, 64]), r.choice([5e4, 2e6])      # neither 1e4 nor 1e6: a hard-coded base fails
    nh, nkv = r.choice([(4, 2), (4, 1), (6, 3), (2, 2)])
    if r.int(0, 1):
        cfg = Qwen3Config(hidden_size=64, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=head_dim,
                          max_position_embeddings=P, rope_theta=theta)
        hf_rotary = Qwen3RotaryEmbedding(cfg)
    else:
        # Qwen3MoeConfig has no head_dim field: hidden_size // num_attention_heads
        cfg = Qwen3MoeConfig(hidden_size=head_dim * nh, num_attention_heads=nh, num_key_value_heads=nkv,
                             max_position_embeddings=P, rope_theta=theta)
        hf_rotary = Qwen3MoeRotaryEmbedding(cfg)
    rope = m.rope_from_config(cfg)

    positions = packed_positions(r)
    n = positions.numel()
    q, k = r.randn(n, nh, head_dim), r.randn(n, nkv, head_dim)
    q_ref, k_ref = hf_rope(hf_rotary, hf_apply, positions[None], q, k)
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = rope(positions, q, k)

    cache = ref_cache(head_dim, theta)
    wrong = [(ref_rope(cache, torch.arange(n), q_in, head_dim), ARANGE),
             (ref_rope(cache, positions, q_in, head_dim, style="gptj"), GPTJ),
             (ref_rope(cache, positions, q_in, head_dim, style="reverse"), SIGN),
             (ref_rope(cache.bfloat16().float(), positions, q_in, head_dim), BF16)]
    assert_rope(q_out, q_ref, positions, what=f"q 旋转结果（positions={positions.tolist()}）", rand=r, looks_like=wrong)
    assert_rope(k_out, k_ref, positions, what="k 旋转结果（nKV 个头，同样的位置）", rand=r,
                looks_like=[(ref_rope(cache, torch.arange(n), k_in, head_dim), ARANGE)])

    for case in ("pos:packed-sequences", "pos:decode-30000", "pos:max-position-1", "pos:unsorted",
                 "pos:repeated", "pos:chunk-starts-mid-sequence"):
        record_case(case)

    # bf16 q/k (what the engine feeds) come back as bf16, rotated in fp32 with the fp32 table and cast once
    q16, k16 = q_in.bfloat16(), k_in.bfloat16()
    q16_out, k16_out = rope(positions, q16.clone(), k16.clone())
    assert_bf16_rope(q16_out, ref_rope(cache, positions, q16.float(), head_dim).bfloat16(),
                     what="bf16 q 的输出", rand=r,
                     looks_like=[(ref_rope(cache.bfloat16().float(), positions, q16.float(), head_dim).bfloat16(),
                                  BF16_AT_USE)])
    assert_bf16_rope(k16_out, ref_rope(cache, positions, k16.float(), head_dim).bfloat16(),
                     what="bf16 k 的输出", rand=r,
                     looks_like=[(ref_rope(cache.bfloat16().float(), positions, k16.float(), head_dim).bfloat16(),
                                  BF16_AT_USE)])
    record_case("dtype:bf16-qk")


@point("partial rotary 与 HF Qwen3.5 一致（只转前 rotary_dim 维）")
def test_partial_rotary_vs_qwen35():
    m = impl(MOD)
    r = Rand()
    # factor never the default 0.25 (nor 1.0), theta never 1e6 / 1e7: a value not read from the config fails
    head_dim, factor, theta = r.choice([32, 64, 128]), r.choice([0.5, 0.75]), r.choice([3e5, 2e7])
    cls, hf_cls = r.choice([(Qwen3_5TextConfig, Qwen3_5TextRotaryEmbedding),
                            (Qwen3_5MoeTextConfig, Qwen3_5MoeTextRotaryEmbedding)])
    cfg = qwen35_config(cls, head_dim, factor, theta)
    rd = int(head_dim * factor)
    rope = m.rope_from_config(cfg)
    shape = list(rope.cos_sin_cache.shape)
    assert shape == [P, rd], (
        f"{cls.__name__}(head_dim={head_dim}, partial_rotary_factor={factor})：cos_sin_cache 形状应为 {[P, rd]}，"
        f"得到 {shape}" + (f"\n  看起来像易错点：{ALLDIMS}" if shape[-1] == head_dim else ""))

    positions = packed_positions(r)
    n = positions.numel()
    q, k = r.randn(n, 4, head_dim), r.randn(n, 2, head_dim)
    q_ref, k_ref = hf_rope(hf_cls(cfg), hf_apply_partial, positions[None, None].expand(3, 1, n), q, k)
    q_in, k_in = q.clone(), k.clone()
    with explain_crash({"must match the size of tensor": f"cos/sin 只有 rotary_dim/2 列：{ALLDIMS}"}):
        q_out, k_out = rope(positions, q, k)

    cache = ref_cache(rd, theta)
    wrong = [(ref_rope(ref_cache(head_dim, theta), positions, q_in, head_dim), ALLDIMS),
             (ref_rope(ref_cache(rd, theta, denom=head_dim), positions, q_in, rd), DENOM),
             (ref_rope(cache, positions, q_in, rd, style="gptj"), GPTJ),
             (ref_rope(cache, torch.arange(n), q_in, rd), ARANGE)]
    assert_rope(q_out, q_ref, positions, what=f"q（head_dim={head_dim}，rotary_dim={rd}）", rand=r, looks_like=wrong)
    assert_rope(k_out, k_ref, positions, what="k", rand=r)
    assert_equal(q_out[..., rd:], q_in[..., rd:], what=f"q[..., {rd}:]（不旋转的维度应原样通过）", rand=r)
    record_case("partial:rotary_dim<head_dim")
    record_case("heads:nKV<nH")

    # rotary_dim must be even and in (0, head_dim]: every run tries an odd one, 0 and one past head_dim
    bad = [(2 * r.int(0, head_dim // 2 - 1) + 1,
            "奇数的 rotary_dim 没法按 (i, i+R/2) 两两配对，到 forward 才以形状错误崩溃"),
           (0, "rotary_dim = 0 时什么都不转，位置信息悄悄丢光"),
           (head_dim + 2 * r.int(1, 4),
            "rotary_dim 大于 head_dim 时 q[..., :R] 只有 head_dim 维，到 forward 才以形状错误崩溃")]
    for rd_bad, why in bad:
        call = f"RotaryEmbedding(head_dim={head_dim}, rotary_dim={rd_bad}, max_position=64, base={theta:g})"
        try:
            m.RotaryEmbedding(head_dim, rd_bad, 64, theta)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as exc:
            raise AssertionError(f"{call} 应抛 ValueError（{why}），得到 {crash_text(exc)}；{r}") from exc
        raise AssertionError(f"{call} 应抛 ValueError（{why}），却构造成功了；{r}\n  看起来像易错点：{UNCHECKED}")
    record_case("reject:rotary_dim-odd")
    record_case("reject:rotary_dim-0")
    record_case("reject:rotary_dim>head_dim")


@point("交错 MRoPE（不同 t/h/w 位置）与 HF Qwen3.5、Omni thinker 一致")
def test_interleaved_mrope_vs_hf():
    m = impl(MOD)
    r = Rand()

    # the rule itself (card 逐步图 ③)
    assert_equal(m.mrope_axes(4, [2, 1, 1]), torch.tensor([0, 1, 2, 0]), what="mrope_axes(4, [2, 1, 1])",
                 looks_like=[(ref_axes(4, [2, 1, 1], "chunked"), CHUNKED), (ref_axes(4, [2, 1, 1], "bound"), BOUND)])
    # [3, 2, 1]: H and W have different bounds (3·2 = 6, 3·1 = 3), and i = 5 (5 % 3 == 2, 5 ≥ 3) is past W's one
    for half, sec in ((32, [11, 11, 10]), (64, [24, 20, 20]), (6, [3, 2, 1])):
        rule = f"（H 若 i % 3 == 1 且 i < {3 * sec[1]}，W 若 i % 3 == 2 且 i < {3 * sec[2]}，其余 T）"
        assert_equal(m.mrope_axes(half, sec), ref_axes(half, sec), what=f"mrope_axes({half}, {sec}){rule}",
                     looks_like=[(ref_axes(half, sec, "chunked"), CHUNKED), (ref_axes(half, sec, "bound"), BOUND)])

    # card 逐步图 ③: R = 8, [2, 1, 1], token 0 at (t, h, w) = (5, 2, 7), token 1 text at 4
    x = torch.arange(1.0, 9.0).expand(2, 1, 8)
    pos = torch.tensor([[5, 4], [2, 4], [7, 4]])
    rope = m.RotaryEmbedding(8, 8, 64, 10000.0, [2, 1, 1])
    out, _ = rope(pos, x.clone(), x.clone())
    worked = torch.tensor([[[5.0783, 0.7681, 2.5031, 3.9600, 0.4594, 6.2777, 7.1927, 8.0199]],
                           [[3.1304, -0.4944, 2.7177, 3.9680, -4.0250, 6.3052, 7.1144, 8.0159]]])
    cache, axes = ref_cache(8, 10000.0, 64), ref_axes(4, [2, 1, 1])
    assert_close(out, worked, what="逐步图 ③ 的 MRoPE 输出", atol=1e-4,
                 looks_like=[(ref_rope(cache, pos, x, 8, ref_axes(4, [2, 1, 1], "chunked")), CHUNKED),
                             (ref_rope(cache, pos[0], x, 8), ONLY_T),
                             (ref_rope(cache, pos, x, 8, axes, style="gptj"), GPTJ),
                             (ref_rope(cache, pos, x, 8, axes, style="reverse"), SIGN),
                             (ref_rope(cache.bfloat16().float(), pos, x, 8, axes), BF16)])
    assert_no_state(rope, what="RotaryEmbedding(8, 8, 64, 10000.0, mrope_section=[2, 1, 1])")
    record_case("mrope_axes:sections")
    record_case("card:mrope")
    record_case("mrope:axis-not-persistent")

    # random sizes (or the real ones) against both HF families, distinct t/h/w positions
    real = r.int(0, 1)
    cases = []
    head_dim, factor = (256, 0.25) if real else (r.choice([32, 64]), r.choice([0.25, 0.5]))
    rd = int(head_dim * factor)
    sec = [11, 11, 10] if real else random_section(r, rd // 2)
    theta = r.choice([1e6, 1e7])
    cfg = qwen35_config(Qwen3_5TextConfig, head_dim, factor, theta, sec)
    cases.append(("Qwen3_5TextRotaryEmbedding", Qwen3_5TextRotaryEmbedding(cfg), hf_apply_partial,
                  head_dim, rd, theta, sec))
    head_dim = 128 if real else r.choice([16, 32])
    sec = [24, 20, 20] if real else random_section(r, head_dim // 2)
    theta = r.choice([1e6, 5e6])
    cfg = omni_config(head_dim, theta, sec)
    cases.append(("Qwen3OmniMoeThinkerTextRotaryEmbedding", Qwen3OmniMoeThinkerTextRotaryEmbedding(cfg),
                  hf_apply_omni, head_dim, head_dim, theta, sec))

    for name, hf_rotary, apply_fn, head_dim, rd, theta, sec in cases:
        positions = mrope_positions(r)
        n = positions.shape[1]
        q, k = r.randn(n, 4, head_dim), r.randn(n, 2, head_dim)
        q_ref, k_ref = hf_rope(hf_rotary, apply_fn, positions[:, None], q, k)
        q_in = q.clone()
        rope = m.RotaryEmbedding(head_dim, rd, P, theta, sec)
        with explain_crash({"must match the size of tensor":
                            "positions 为 [3, N] 时，要先按交错规则把 3 行 cos/sin 合成 [N, R]，再旋转"}):
            q_out, k_out = rope(positions, q, k)
        cache = ref_cache(rd, theta)
        wrong = [(ref_rope(cache, positions, q_in, rd, ref_axes(rd // 2, sec, "chunked")), CHUNKED),
                 (ref_rope(cache, positions[0], q_in, rd), ONLY_T),
                 (ref_rope(cache, positions, q_in, rd, ref_axes(rd // 2, sec, "bound")), BOUND),
                 (ref_rope(cache, positions, q_in, rd, ref_axes(rd // 2, sec), style="gptj"), GPTJ)]
        what = f"{name} 对照（head_dim={head_dim}, rotary_dim={rd}, mrope_section={sec}）"
        assert_rope(q_out, q_ref, positions, what=f"q，{what}", rand=r, looks_like=wrong)
        assert_rope(k_out, k_ref, positions, what=f"k，{what}", rand=r)
        record_case(f"mrope:{name}")


@point("纯文本位置（t=h=w）退化为 1-D RoPE")
def test_text_positions_reduce_to_1d():
    m = impl(MOD)
    r = Rand()
    head_dim, factor, theta = r.choice([32, 64]), r.choice([0.25, 0.5, 1.0]), r.choice([1e6, 1e7])
    rd = int(head_dim * factor)
    sec = random_section(r, rd // 2)
    positions = packed_positions(r)
    n = positions.numel()
    q, k = r.randn(n, 4, head_dim), r.randn(n, 2, head_dim)

    mrope = m.RotaryEmbedding(head_dim, rd, P, theta, sec)
    plain = m.RotaryEmbedding(head_dim, rd, P, theta)
    q3, k3 = mrope(positions.expand(3, n), q.clone(), k.clone())       # t = h = w
    q1, k1 = plain(positions, q.clone(), k.clone())                    # 1-D RoPE, no sections
    what = f"t=h=w 的 MRoPE vs 1-D RoPE（rotary_dim={rd}, mrope_section={sec}）"
    assert_rope(q3, q1, positions, what=f"q，{what}", rand=r)
    assert_rope(k3, k1, positions, what=f"k，{what}", rand=r)
    q1m, _ = mrope(positions, q.clone(), k.clone())                    # [N] positions into an MRoPE module
    assert_rope(q1m, q1, positions, what="MRoPE 模块收到 1-D positions [N]（纯文本请求）", rand=r)
    record_case("text:t=h=w")
    record_case("text:1d-positions-into-mrope")

    # and the 1-D result is what HF's Qwen3.5 rotary gives for text (it always runs the 3-axis code)
    cfg = qwen35_config(Qwen3_5TextConfig, head_dim, factor, theta, sec)
    q_ref, _ = hf_rope(Qwen3_5TextRotaryEmbedding(cfg), hf_apply_partial, positions[None, None].expand(3, 1, n), q, k)
    assert_rope(q1, q_ref, positions, what="1-D RoPE vs HF Qwen3_5TextRotaryEmbedding（文本位置）", rand=r)


@point("rope_from_config 读对五种 config（head_dim、partial、theta、mrope_section）")
def test_rope_from_config():
    m = impl(MOD)
    r = Rand()
    head_dim = r.choice([16, 32])
    theta = r.choice([1e4, 1e6, 5e6])
    half = head_dim // 2
    configs = [
        ("Qwen3Config", Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=head_dim, rope_theta=theta), Qwen3RotaryEmbedding, hf_apply, 1),
        ("Qwen3MoeConfig（无 head_dim 字段）", Qwen3MoeConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                                                        num_key_value_heads=2, rope_theta=theta),
         Qwen3MoeRotaryEmbedding, hf_apply, 1),
        # no explicit factor: Qwen3.5 defaults to 0.25; no mrope_section: HF's default [11, 11, 10]
        ("Qwen3_5TextConfig（默认 partial_rotary_factor）",
         Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=4 * head_dim,
                           num_hidden_layers=1, rope_theta=theta), Qwen3_5TextRotaryEmbedding, hf_apply_partial, 3),
        ("Qwen3_5MoeTextConfig", qwen35_config(Qwen3_5MoeTextConfig, 2 * head_dim, 0.5, theta,
                                               random_section(r, head_dim // 2)),
         Qwen3_5MoeTextRotaryEmbedding, hf_apply_partial, 3),
        # the Omni thinker's theta default is 1e6; sections from rope_parameters
        ("Qwen3OmniMoeTextConfig（Omni thinker）",
         Qwen3OmniMoeTextConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                 "mrope_section": random_section(r, half)}),
         Qwen3OmniMoeThinkerTextRotaryEmbedding, hf_apply_omni, 3),
    ]
    for name, cfg, hf_cls, apply_fn, axes in configs:
        rope = m.rope_from_config(cfg)
        hf_rotary = hf_cls(cfg)
        rd = 2 * hf_rotary.inv_freq.numel()
        full = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = list(rope.cos_sin_cache.shape)
        assert shape == [cfg.max_position_embeddings, rd], (
            f"{name}：cos_sin_cache 形状应为 [max_position_embeddings, rotary_dim] = "
            f"{[cfg.max_position_embeddings, rd]}，得到 {shape}"
            + (f"\n  看起来像易错点：{ALLDIMS}" if shape[-1] == full != rd else ""))
        positions = mrope_positions(r) if axes == 3 else packed_positions(r)
        n = positions.shape[-1]
        q, k = r.randn(n, 4, full), r.randn(n, 2, full)
        hf_pos = positions[:, None] if axes == 3 else positions[None]
        q_ref, k_ref = hf_rope(hf_rotary, apply_fn, hf_pos, q, k)
        q_out, k_out = rope(positions, q, k)
        theta_used = cfg.rope_parameters["rope_theta"]
        assert_rope(q_out, q_ref, positions, what=f"{name} 的 q（rotary_dim={rd}, theta={theta_used:g}）", rand=r)
        assert_rope(k_out, k_ref, positions, what=f"{name} 的 k", rand=r)
        assert_attributes(rope, name, head_dim=full, rotary_dim=rd, max_position=cfg.max_position_embeddings,
                          base=theta_used, mrope_section=list(hf_rotary.mrope_section) if axes == 3 else None)  # HF's own
        record_case(f"config:{name.split('（')[0]}")

    # rope_parameters without rope_theta (and no rope_theta attribute): the default base 10000.0, which is also
    # what HF's config fills in for Qwen3-MoE when a config.json leaves it out
    cfg = Qwen3MoeConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=P)
    hf_rotary = Qwen3MoeRotaryEmbedding(cfg)
    bare = copy.deepcopy(cfg)
    bare.rope_parameters = {"rope_type": "default"}
    name = "rope_parameters = {'rope_type': 'default'}（没有 rope_theta）的 Qwen3MoeConfig"
    try:
        rope = m.rope_from_config(bare)
    except KeyError as exc:
        raise AssertionError(f"{name}：运行出错 KeyError: {exc}；rope_parameters 和属性里都没有 rope_theta 时，"
                             f"base 应取默认的 10000.0") from exc
    positions = packed_positions(r)
    n = positions.numel()
    q, k = r.randn(n, 4, head_dim), r.randn(n, 2, head_dim)
    q_ref, _ = hf_rope(hf_rotary, hf_apply, positions[None], q, k)
    q_out, _ = rope(positions, q, k)
    assert_rope(q_out, q_ref, positions, what=f"{name} 的 q（base 应为默认的 10000.0）", rand=r)
    assert_attributes(rope, name, head_dim=head_dim, rotary_dim=head_dim, max_position=P, base=10000.0,
                      mrope_section=None)
    record_case("config:no-rope-theta-default-10000")

    # the attribute form: rope_parameters empty, rope_theta and partial_rotary_factor as the config's own attributes
    rd_full, theta_attr = 2 * head_dim, r.choice([3e5, 2e7])
    legacy = copy.deepcopy(Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=rd_full, max_position_embeddings=P))
    legacy.rope_parameters = None
    legacy.rope_theta, legacy.partial_rotary_factor = theta_attr, 0.5
    name = (f"rope_parameters = None、属性 rope_theta={theta_attr:g}、partial_rotary_factor=0.5 的 Qwen3Config"
            f"（head_dim={rd_full}）")
    rope = m.rope_from_config(legacy)
    positions = packed_positions(r)
    n = positions.numel()
    q, k = r.randn(n, 4, rd_full), r.randn(n, 2, rd_full)
    q_out, k_out = rope(positions, q.clone(), k.clone())
    cache = ref_cache(head_dim, theta_attr)
    assert_rope(q_out, ref_rope(cache, positions, q, head_dim), positions, what=f"{name} 的 q", rand=r,
                looks_like=[(ref_rope(ref_cache(rd_full, theta_attr), positions, q, rd_full), ATTR_FACTOR),
                            (ref_rope(ref_cache(head_dim, 10000.0), positions, q, head_dim), ATTR_THETA)])
    assert_rope(k_out, ref_rope(cache, positions, k, head_dim), positions, what=f"{name} 的 k", rand=r)
    assert_attributes(rope, name, head_dim=rd_full, rotary_dim=head_dim, max_position=P, base=theta_attr,
                      mrope_section=None)
    record_case("config:attribute-form")

    # an Omni thinker config without mrope_section: HF's default for the model type, [24, 20, 20] (R/2 = 64)
    theta_omni = r.choice([2e6, 5e6])
    cfg = Qwen3OmniMoeTextConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=P,
                                 rope_parameters={"rope_type": "default", "rope_theta": theta_omni})
    name = "没写 mrope_section 的 Qwen3OmniMoeTextConfig（head_dim=128）"
    rope = m.rope_from_config(cfg)
    positions = mrope_positions(r)
    n = positions.shape[1]
    q, k = r.randn(n, 4, 128), r.randn(n, 2, 128)
    q_ref, _ = hf_rope(Qwen3OmniMoeThinkerTextRotaryEmbedding(cfg), hf_apply_omni, positions[:, None], q, k)
    q_out, _ = rope(positions, q.clone(), k.clone())
    cache = ref_cache(128, theta_omni)
    assert_rope(q_out, q_ref, positions, what=f"{name} 的 q", rand=r,
                looks_like=[(ref_rope(cache, positions, q, 128, ref_axes(64, [11, 11, 10])), OMNI_DEFAULT)])
    assert_attributes(rope, name, mrope_section=[24, 20, 20])
    record_case("config:omni-default-mrope-section")
