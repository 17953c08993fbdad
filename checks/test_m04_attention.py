"""Checks for M04 · Attention (lessons/m04_attention.md).

Oracles: HF transformers 5.17.0 `Qwen3Attention` and `Qwen3_5Attention` (fp32, eager, every parameter
randomised, an explicit causal mask, one sequence at a time), and a naive per-sequence, per-head softmax
for `varlen_attention` (fp64, masks built from explicit index comparisons).
"""

from __future__ import annotations

import copy

import torch
import transformers  # noqa: F401  (imported once per grading process)
from transformers import Qwen3Config, Qwen3_5TextConfig
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from checks.kit import TOL, OpCount, Rand, assert_close, assert_dtype, explain_crash, impl, point, record_case

MODULE = "m04_attention"
BF16 = torch.bfloat16

transformers.utils.logging.set_verbosity_error()
# tiny tensors: one intra-op thread is ~20x faster than oversubscribing a busy 2-core grader
torch.set_num_threads(1)

# the card's 易错点, as the failure messages name them
M_PACK = "把整个 pack 当成一条序列做 causal：attention 跨序列了（应按 cu_seqlens 逐序列，序列之间互不可见）"
M_TOP_LEFT = "cached prefix 时 causal mask 左上对齐（j ≤ i）：应右下对齐，query i 看得到 key j ≤ (Lk − Lq) + i"
M_OFFSET_TOTAL = ("causal 对角线的偏移用了整个 pack 的 Nk − Nq：偏移要逐序列算，"
                  "序列 b 是 Lk_b − Lq_b（没有 cached prefix 的序列偏移是 0）")
M_OFFSET_MAX = ("causal 对角线的偏移用了 max_seqlen_k − max_seqlen_q：偏移要逐序列算，"
                "序列 b 是 Lk_b − Lq_b（没有 cached prefix 的序列偏移是 0）")
M_KEYS_AT_Q = "k / v 用 cu_seqlens_q 切了：key 的行要用 cu_seqlens_k 切（有 cached prefix 时 Lk > Lq，前缀的 key 在前）"
M_REPEAT = "GQA 用了 repeat（平铺：head h 读 kv head h % nKV），应为 repeat_interleave（head h 读 kv head h // g）"
M_NO_NORM = "漏了 q_norm / k_norm（每个 head 在 D 上做 RMSNorm）"
M_NORM_AFTER = "q_norm / k_norm 放在了 RoPE 之后（应先 norm 再 RoPE）"
M_SCALE_D = "scale 用了 1/D（应为 D^-0.5）"
M_SCALE_ROT = "scale 用了 rotary_dim^-0.5（partial rotary 时 scale 仍是 head_dim^-0.5）"
M_BF16 = "scores / softmax 在 bf16 里算：应先 q.float()、k.float() 再做 QK^T 和 softmax，最后转回 q.dtype"
M_DTYPE = "返回了 fp32：输出应转回 q.dtype"
M_TOKEN_LOOP = "逐 token 的 Python 循环（应逐序列或整个 pack 一次算完）"
M_FLAT_GATE = "q_proj 输出按 [全部 query | 全部 gate] 切开了：应按 head 交错，view(N, nH, 2D) 后每个 head 前 D 是 query、后 D 是 gate"
M_GATE_AFTER = "gate 乘在了 o_proj 之后：应先 o * sigmoid(gate)（[N, nH·D]）再 o_proj"
M_GATE_RAW = "gate 没过 sigmoid：应为 o * sigmoid(gate)"
M_PLAIN_NORM = "gated attention 的 q/k norm 用了普通 RMSNorm（乘 w）：Qwen3.5 的 q_norm / k_norm 是 (1+w) 的 GemmaRMSNorm"
M_NORM_EPS = "q_norm / k_norm 没有用传入的 rms_norm_eps（用了默认的 1e-6）"
M_GEMMA_IN_QWEN3 = "Qwen3 的 q/k norm 用了 (1+w) 的 GemmaRMSNorm：Qwen3 是普通 RMSNorm（乘 w）"
BF16_CRASHES = {"same dtype": "bf16 的模块里出现了 fp32 张量：某一步把结果提升成了 fp32（例如在 fp32 里算了 gate 的 sigmoid，"
                              "或 attention 输出没转回 q.dtype），进 o_proj 时与 bf16 的权重 dtype 不一致"}

CRASHES = {
    "must match the size of tensor": "形状对不上。常见原因：" + M_GATE_AFTER + "；或忘了 GQA（k/v 只有 nKV 个 head）",
    "do not broadcast": "k/v 只有 nKV 个 head：GQA 要先把 k/v 扩成 nH 个 head（repeat_interleave）",
    "shape '[": "view / reshape 的形状不对：q 是 [N, nH, D]，k/v 是 [N, nKV, D]（gated 的 q_proj 输出是 [N, nH, 2D]）",
}


# ----------------------------------------------------------------------------------------------- naive oracle

def naive_varlen(q, k, v, lens_q, lens_k, scale, *, kv_head=lambda h, g, n_kv: h // g, bottom_right=True,
                 offset=None, keys_at_q=False):
    """Per sequence, per head: softmax(q k^T * scale + causal mask) v in fp64. Returns [Nq, nH, D] fp32.

    Classic mistakes: bottom_right=False (top-left mask), offset=<int> (one diagonal offset for every
    sequence), keys_at_q (keys and values sliced with cu_seqlens_q: Lk = Lq, the prefix never read).
    """
    n_heads, n_kv = q.shape[1], k.shape[1]
    g = n_heads // n_kv
    out = torch.zeros(q.shape, dtype=torch.float64)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        if keys_at_q:
            k0, lk = q0, lq
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        shift = offset if offset is not None else (lk - lq if bottom_right else 0)
        visible = j <= i + shift
        for h in range(n_heads):
            kh = k[k0:k0 + lk, kv_head(h, g, n_kv)].double()
            vh = v[k0:k0 + lk, kv_head(h, g, n_kv)].double()
            s = (q[q0:q0 + lq, h].double() @ kh.T) * scale
            s = s.masked_fill(~visible, float("-inf"))
            out[q0:q0 + lq, h] = torch.softmax(s, dim=-1).nan_to_num(0.0) @ vh
        q0, k0 = q0 + lq, k0 + lk
    return out.float()


def _cu(lens: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------- HF oracles

def _eps(r: Rand) -> float:
    """q/k-norm eps: never the default 1e-6, large enough to change the result (a norm that ignores it fails)."""
    return r.choice([0.05, 0.1])


def _qwen3(r: Rand, hidden: int, heads: int, kv_heads: int, head_dim: int):
    cfg = Qwen3Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, num_hidden_layers=1, max_position_embeddings=64,
                      rope_theta=r.choice([1e4, 1e6]), rms_norm_eps=_eps(r), attn_implementation="eager")
    hf = r.init_(hf_qwen3.Qwen3Attention(cfg, layer_idx=0).eval())
    with torch.no_grad():                                  # RMSNorm weights around 1 (HF starts them at 1)
        hf.q_norm.weight.copy_(1.0 + r.randn(head_dim, scale=0.3))
        hf.k_norm.weight.copy_(1.0 + r.randn(head_dim, scale=0.3))
    return cfg, hf


def _qwen3_5(r: Rand, hidden: int, heads: int, kv_heads: int, head_dim: int):
    # partial_rotary_factor defaults to 0.25 (G-4); mrope_section defaults to [11, 11, 10]
    cfg = Qwen3_5TextConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=head_dim, num_hidden_layers=1, layer_types=["full_attention"],
                            max_position_embeddings=64, rms_norm_eps=_eps(r), attn_implementation="eager")
    hf = r.init_(hf_qwen3_5.Qwen3_5Attention(cfg, layer_idx=0).eval())
    with torch.no_grad():                                  # (1+w) norms: w around 0 (HF starts them at 0)
        hf.q_norm.weight.copy_(r.randn(head_dim, scale=0.3))
        hf.k_norm.weight.copy_(r.randn(head_dim, scale=0.3))
    return cfg, hf


def _hf_cos_sin(cfg, x_b: torch.Tensor, pos: torch.Tensor, gated: bool):
    """cos/sin for one batch row of positions pos [T] (Qwen3.5 takes text positions [3, B, T])."""
    if gated:
        return hf_qwen3_5.Qwen3_5TextRotaryEmbedding(cfg)(x_b, pos[None, None].expand(3, 1, -1))
    return hf_qwen3.Qwen3RotaryEmbedding(cfg)(x_b, pos[None])


def _causal(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]          # eager ignores is_causal (G-5)


def hf_packed(cfg, hf, x: torch.Tensor, lens: list[int], gated: bool) -> torch.Tensor:
    """HF's own forward, one sequence at a time, concatenated back into the pack: [N, H]."""
    outs = []
    with torch.no_grad():
        for x_s in x.split(lens):
            x_b = x_s[None]
            cos_sin = _hf_cos_sin(cfg, x_b, torch.arange(x_s.shape[0]), gated)
            outs.append(hf(x_b, position_embeddings=cos_sin, attention_mask=_causal(x_s.shape[0]))[0][0])
    return torch.cat(outs)


def hf_variant(cfg, hf, x: torch.Tensor, lens: list[int], gated: bool, *, norm: str = "before",
               scale: float | None = None, gate: str = "sigmoid", split: str = "per_head",
               whole_pack: bool = False) -> torch.Tensor | None:
    """A classic wrong answer, built from HF's own pieces (projections, norms, apply_rotary_pos_emb, eager)."""
    mod = hf_qwen3_5 if gated else hf_qwen3
    d = hf.head_dim
    seqs = [x] if whole_pack else list(x.split(lens))
    pos_all = torch.cat([torch.arange(n) for n in lens])
    outs = []
    with torch.no_grad():
        for s_i, x_s in enumerate(seqs):
            t = x_s.shape[0]
            pos = pos_all if whole_pack else torch.arange(t)
            x_b = x_s[None]
            cos, sin = _hf_cos_sin(cfg, x_b, pos, gated)
            if gated:
                qg = hf.q_proj(x_b)                                             # [1, T, nH*2D]
                if split == "per_head":
                    q, g = qg.view(1, t, -1, 2 * d).chunk(2, dim=-1)
                else:                                                           # [all queries | all gates]
                    q, g = (c.reshape(1, t, -1, d) for c in qg.chunk(2, dim=-1))
                g = g.reshape(1, t, -1)
            else:
                q = hf.q_proj(x_b).view(1, t, -1, d)
            k = hf.k_proj(x_b).view(1, t, -1, d)
            v = hf.v_proj(x_b).view(1, t, -1, d).transpose(1, 2)
            if norm == "before":
                q, k = hf.q_norm(q), hf.k_norm(k)
            q, k = mod.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            if norm == "after":
                q, k = hf.q_norm(q), hf.k_norm(k)
            o, _ = mod.eager_attention_forward(hf, q, k, v, _causal(t), scaling=scale or hf.scaling)
            o = o.reshape(1, t, -1)
            if gated and gate == "sigmoid":
                o = o * torch.sigmoid(g)
            elif gated and gate == "raw":
                o = o * g
            elif gated and gate == "after_o_proj":
                if hf.o_proj.out_features != o.shape[-1]:
                    return None                                                  # that mistake crashes instead
                outs.append((hf.o_proj(o) * torch.sigmoid(g))[0])
                continue
            outs.append(hf.o_proj(o)[0])
    return torch.cat(outs)


def _shifted_norms(hf, delta: float):
    """A copy of hf whose q/k norm weights are moved by delta (w vs 1+w is exactly a shift by 1)."""
    other = copy.deepcopy(hf)
    with torch.no_grad():
        other.q_norm.weight.add_(delta)
        other.k_norm.weight.add_(delta)
    return other


def _default_eps_norms(hf):
    """A copy of hf whose q/k norms use eps 1e-6 (the mistake of not passing rms_norm_eps on)."""
    other = copy.deepcopy(hf)
    for norm in (other.q_norm, other.k_norm):
        setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", 1e-6)
    return other


def load_from_hf(mine: torch.nn.Module, hf, hidden: int, q_rows: int, kv_rows: int) -> None:
    """Copy HF's separate projections into the packed qkv_proj (rows = cat[q_proj, k_proj, v_proj])."""
    for name in ("qkv_proj", "o_proj", "q_norm", "k_norm", "rotary", "attn"):
        if not hasattr(mine, name):
            raise AssertionError(f"{type(mine).__name__} 缺少属性 {name}（见卡片“接口”一节：qkv_proj、o_proj、"
                                 "q_norm、k_norm、rotary、attn）")
    expected = {"qkv_proj": [q_rows + 2 * kv_rows, hidden], "o_proj": [hidden, hf.o_proj.in_features]}
    for name, shape in expected.items():
        layer = getattr(mine, name)
        if list(layer.weight.shape) != shape:
            raise AssertionError(f"{name}.weight 的形状应为 {shape}，得到 {list(layer.weight.shape)}")
        if getattr(layer, "bias", None) is not None:
            raise AssertionError(f"{name} 不应有 bias（Qwen3 / Qwen3.5 的 attention_bias=False）：nn.Linear(..., bias=False)")
    with torch.no_grad():
        mine.qkv_proj.weight.copy_(torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight]))
        mine.o_proj.weight.copy_(hf.o_proj.weight)
        mine.q_norm.weight.copy_(hf.q_norm.weight)
        mine.k_norm.weight.copy_(hf.k_norm.weight)


def assert_attention_attrs(attn, *, what: str, heads: int, head_dim: int, scale: float, kv_heads: int) -> None:
    """Attention keeps its four arguments (the engine reads them to size the KV cache) and starts without a cache."""
    want = dict(num_heads=heads, head_dim=head_dim, scale=scale, num_kv_heads=kv_heads, k_cache=None, v_cache=None)
    for name, expected in want.items():
        if not hasattr(attn, name):
            raise AssertionError(f"{what}：应有属性 {name}（= {expected!r}；后面的 engine 读它分配和绑定 KV cache）")
        got = getattr(attn, name)
        ok = got is None if expected is None else (isinstance(got, (int, float)) and abs(got - expected) <= 1e-12)
        if not ok:
            raise AssertionError(f"{what}：{name} 应为 {expected!r}，得到 {got!r}")


def check_bf16_module(mine, cfg, hf, x, positions, lens, gated: bool, r: Rand, what: str) -> None:
    """The engine runs the model in bf16: the module in bf16 gives bf16, close to HF in fp32 on the same rounded
    weights and inputs (the loose tolerance covers the bf16 rounding of every intermediate)."""
    m = impl(MODULE)
    hf_r = copy.deepcopy(hf).to(BF16).float()
    x16 = x.to(BF16)
    ref = hf_packed(cfg, hf_r, x16.float(), lens, gated=gated)
    mine16 = copy.deepcopy(mine).to(BF16)
    mine16.rotary = mine.rotary                            # .to() would cast the fp32 cos/sin table too
    with explain_crash({**CRASHES, **BF16_CRASHES}), torch.no_grad():
        out = mine16(positions, x16, m.AttentionContext.from_seqlens(lens))
    assert_dtype(out, BF16, what=f"bf16 的 {what} 输出", mistake=M_DTYPE)
    assert_close(out.float(), ref, what=f"bf16 的 {what}（与 HF 在 fp32 里、同样舍入过的权重和输入上对比）", rand=r,
                 atol=8e-2, rtol=8e-2)


def _sizes(r: Rand, head_dims) -> dict:
    """Tiny random sizes with real GQA (nKV >= 2, g >= 2) and hidden != nH * D (so o_proj is not square)."""
    kv_heads, group = r.int(2, 3), r.int(2, 3)
    return dict(hidden=r.choice([24, 40, 56]), heads=kv_heads * group, kv_heads=kv_heads,
                head_dim=r.choice(head_dims))


def _packed_inputs(r: Rand, hidden: int, lo: int = 1, hi: int = 8):
    lens = [r.int(lo, hi) for _ in range(r.int(2, 4))]
    lens[r.int(0, len(lens) - 1)] = r.int(4, hi)          # one-token sequences alone would not test q and k
    x = r.randn(sum(lens), hidden)
    positions = torch.cat([torch.arange(n) for n in lens])
    return lens, x, positions


# ----------------------------------------------------------------------------------------------- checks

@point("varlen_attention 与逐序列 naive softmax 一致（含 cached prefix）")
def test_varlen_matches_naive_with_prefix():
    m = impl(MODULE)
    r = Rand()
    kv_heads, group, d = r.int(1, 3), r.int(1, 3), r.choice([4, 8, 16])
    heads = kv_heads * group
    # a layout where the offset mistakes all disagree: one sequence without a prefix, two with different
    # prefixes, so Nk - Nq, max_seqlen_k - max_seqlen_q and each sequence's Lk - Lq are different numbers
    a = r.int(2, 3)
    b_q, c_q = r.int(1, 3), r.int(2, 4)
    # plus, every run, a decode step (Lq = 1 after a cached prefix) and a one-token sequence (its output is its v)
    layout = [(a, a), (b_q, b_q + r.int(4, 6)), (c_q, c_q + r.int(1, 2)), (1, 1 + r.int(1, 5)), (1, 1)]
    r.py.shuffle(layout)
    lens_q, lens_k = [lq for lq, _ in layout], [lk for _, lk in layout]
    q = r.randn(sum(lens_q), heads, d)
    k = r.randn(sum(lens_k), kv_heads, d)
    v = r.randn(sum(lens_k), kv_heads, d)
    scale = d ** -0.5
    ref = naive_varlen(q, k, v, lens_q, lens_k, scale)
    looks_like = [
        (naive_varlen(q, k, v, [sum(lens_q)], [sum(lens_k)], scale), M_PACK),
        (naive_varlen(q, k, v, lens_q, lens_k, scale, bottom_right=False), M_TOP_LEFT),
        (naive_varlen(q, k, v, lens_q, lens_k, scale, offset=sum(lens_k) - sum(lens_q)), M_OFFSET_TOTAL),
        (naive_varlen(q, k, v, lens_q, lens_k, scale, offset=max(lens_k) - max(lens_q)), M_OFFSET_MAX),
        (naive_varlen(q, k, v, lens_q, lens_k, scale, keys_at_q=True), M_KEYS_AT_Q),
        (naive_varlen(q, k, v, lens_q, lens_k, scale, kv_head=lambda h, g, n: h % n) if group > 1 else None, M_REPEAT),
    ]
    with explain_crash(CRASHES):
        out = m.varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), scale)
    what = f"varlen_attention（lens_q={lens_q}, lens_k={lens_k}, nH={heads}, nKV={kv_heads}）"
    assert_close(out, ref, what=what, rand=r, looks_like=looks_like)
    for case in ("varlen:no-prefix", "varlen:cached-prefix", "varlen:prefixes-differ", "varlen:decode-Lq=1",
                 "varlen:one-token-sequence"):
        record_case(case)

    ctx = m.AttentionContext(cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k),
                             max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    with explain_crash(CRASHES):
        attn = m.Attention(heads, d, scale, kv_heads)
    assert_attention_attrs(attn, what=f"Attention({heads}, {d}, {scale:.4g}, {kv_heads})", heads=heads, head_dim=d,
                           scale=scale, kv_heads=kv_heads)
    record_case("attention:attributes-no-cache")
    with explain_crash(CRASHES):
        out = attn(q, k, v, ctx)
    assert_close(out, ref, what="Attention.forward(q, k, v, ctx)（应按 ctx 的 cu_seqlens 调 varlen_attention）",
                 rand=r, looks_like=looks_like)
    record_case("attention:forward-ctx")


@point("GQA 分组：query head h 读 kv head h // g")
def test_gqa_grouping():
    m = impl(MODULE)
    r = Rand()
    kv_heads, group, d = r.int(2, 4), r.int(2, 3), r.choice([4, 8])
    heads = kv_heads * group
    lens = [r.int(1, 6) for _ in range(r.int(1, 3))]
    n = sum(lens)
    q = r.randn(n, heads, d)
    k = r.randn(n, kv_heads, d)
    # every kv head carries its own tag in v, so the output of a query head names the kv head it read
    tags = torch.arange(1, kv_heads + 1, dtype=torch.float32)
    v = tags[None, :, None].expand(n, kv_heads, d).contiguous()
    with explain_crash(CRASHES):
        out = m.varlen_attention(q, k, v, _cu(lens), _cu(lens), d ** -0.5)
    h = torch.arange(heads)
    expected = tags[h // group][None, :, None].expand(n, heads, d)
    tiled = tags[h % kv_heads][None, :, None].expand(n, heads, d)
    assert_close(out, expected, what=f"每个 query head 读到的 kv head 标签（nH={heads}, nKV={kv_heads}, g={group}）",
                 rand=r, looks_like=[(tiled, M_REPEAT)])
    record_case("gqa:nKV>=2,g>=2")


@point("按序列计算，不逐 token 循环")
def test_no_loop_over_tokens():
    m = impl(MODULE)
    r = Rand()
    heads, kv_heads, d = 4, 2, 8
    counts = []
    for length in (4, 40):                        # same number of sequences, 10x the tokens
        lens = [length, length]
        q, k, v = r.randn(2 * length, heads, d), r.randn(2 * length, kv_heads, d), r.randn(2 * length, kv_heads, d)
        log = OpCount()
        with explain_crash(CRASHES), torch.no_grad(), log:
            out = m.varlen_attention(q, k, v, _cu(lens), _cu(lens), d ** -0.5)
        assert_close(out, naive_varlen(q, k, v, lens, lens, d ** -0.5), what=f"varlen_attention（lens={lens}）", rand=r)
        counts.append(log.count)
    if counts[1] > counts[0] + 16:
        raise AssertionError(f"同样 2 条序列，每条 4 个 token 时执行了 {counts[0]} 个 torch 算子，每条 40 个 token 时 "
                             f"{counts[1]} 个：算子数随 token 数增长\n  看起来像易错点：{M_TOKEN_LOOP}；{r}")
    record_case("loop:ops-independent-of-tokens")


@point("Qwen3Attention 与 HF 逐序列一致（packed 多序列）")
def test_qwen3_attention_matches_hf():
    m = impl(MODULE)
    rope = impl("m02_rope")
    r = Rand()
    s = _sizes(r, head_dims=[8, 16])
    cfg, hf = _qwen3(r, **s)
    lens, x, positions = _packed_inputs(r, s["hidden"])
    ref = hf_packed(cfg, hf, x, lens, gated=False)
    looks_like = [
        (hf_variant(cfg, hf, x, lens, False, whole_pack=True), M_PACK),
        (hf_variant(cfg, hf, x, lens, False, norm="none"), M_NO_NORM),
        (hf_variant(cfg, hf, x, lens, False, norm="after"), M_NORM_AFTER),
        (hf_variant(cfg, hf, x, lens, False, scale=1.0 / s["head_dim"]), M_SCALE_D),
        (hf_packed(cfg, _shifted_norms(hf, 1.0), x, lens, gated=False), M_GEMMA_IN_QWEN3),
        (hf_packed(cfg, _default_eps_norms(hf), x, lens, gated=False), M_NORM_EPS),
    ]
    with explain_crash(CRASHES):
        mine = m.Qwen3Attention(s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], cfg.rms_norm_eps,
                                rope.rope_from_config(cfg))
    load_from_hf(mine, hf, s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"])
    with explain_crash(CRASHES), torch.no_grad():
        out = mine(positions, x, m.AttentionContext.from_seqlens(lens))
    assert_close(out, ref, what=f"Qwen3Attention 输出（lens={lens}, nH={s['heads']}, nKV={s['kv_heads']}, "
                 f"D={s['head_dim']}）", rand=r, looks_like=looks_like)
    assert_attention_attrs(mine.attn, what="Qwen3Attention.attn", heads=s["heads"], head_dim=s["head_dim"],
                           scale=s["head_dim"] ** -0.5, kv_heads=s["kv_heads"])
    record_case("qwen3:packed-fp32")
    record_case("qwen3:qk-norm-eps-non-default")
    check_bf16_module(mine, cfg, hf, x, positions, lens, False, r, "Qwen3Attention")
    record_case("qwen3:bf16-module")


@point("不跨序列泄漏")
def test_no_cross_sequence_leakage():
    m = impl(MODULE)
    rope = impl("m02_rope")
    r = Rand()
    s = _sizes(r, head_dims=[8, 16])
    cfg, hf = _qwen3(r, **s)
    lens = [r.int(2, 6), r.int(2, 6), r.int(2, 6)]
    x = r.randn(sum(lens), s["hidden"])
    positions = torch.cat([torch.arange(n) for n in lens])
    with explain_crash(CRASHES):
        mine = m.Qwen3Attention(s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], cfg.rms_norm_eps,
                                rope.rope_from_config(cfg))
    load_from_hf(mine, hf, s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"])
    ctx = m.AttentionContext.from_seqlens(lens)
    a, b = lens[0], lens[0] + lens[1]
    x2 = x.clone()
    x2[a:b] = r.randn(lens[1], s["hidden"])                                 # change only sequence 2
    # every output against HF run one sequence at a time (never one of the learner's outputs against another)
    ref, ref2 = hf_packed(cfg, hf, x, lens, gated=False), hf_packed(cfg, hf, x2, lens, gated=False)
    with explain_crash(CRASHES), torch.no_grad():
        out, out2 = mine(positions, x, ctx), mine(positions, x2, ctx)
        alone = mine(positions[:a], x[:a], m.AttentionContext.from_seqlens(lens[:1]))
    assert_close(out, ref, what=f"Qwen3Attention 输出（lens={lens}）", rand=r,
                 looks_like=[(hf_variant(cfg, hf, x, lens, False, whole_pack=True), M_PACK)])
    # out matches HF: a mismatch below is the output of one sequence moving with another sequence's tokens
    checks = ((out2[:a], ref2[:a], "改了第 2 条序列之后，第 1 条序列的输出（与 HF 对比）",
               "第 1 条序列看到了它后面的 token：mask 不是 causal，或者跨序列了"),
              (out2[b:], ref2[b:], "改了第 2 条序列之后，第 3 条序列的输出（与 HF 对比）", M_PACK),
              (alone, ref[:a], "第 1 条序列单独算（一条序列的 ctx）的输出（与 HF 对比）", M_PACK))
    for got, want, what, mistake in checks:
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
            err = (got - want).abs().max().item()
            raise AssertionError(f"{what}不一致（最大差 {err:.3g}，lens={lens}）\n  看起来像易错点：{mistake}；{r}")
    record_case("leak:change-one-sequence")
    record_case("leak:sequence-alone")


@point("bf16：scores 与 softmax 在 fp32，输出保持 q.dtype")
def test_bf16_scores_in_fp32():
    m = impl(MODULE)
    r = Rand()
    heads, kv_heads, d = 2, 1, 16
    # sequence A: random; sequence B: two keys whose scores are 200 and 200.4375 (q, k exact in bf16).
    # In fp32 the second key wins with sigmoid(0.4375) = 0.6077; rounded to bf16 both scores are 200 -> 0.5.
    len_a = r.int(2, 5)
    qa, ka, va = r.randn(len_a, heads, d), r.randn(len_a, kv_heads, d), r.randn(len_a, kv_heads, d)
    qb, kb, vb = torch.zeros(2, heads, d), torch.zeros(2, kv_heads, d), torch.zeros(2, kv_heads, d)
    qb[1, :, 0], qb[1, :, 1] = 32.0, 1.0
    kb[0, 0, 0] = 25.0
    kb[1, 0, 0], kb[1, 0, 1] = 25.0, 1.75
    vb[1] = 1.0
    order = r.choice([0, 1])
    q = torch.cat([qa, qb] if order == 0 else [qb, qa]).to(BF16)
    k = torch.cat([ka, kb] if order == 0 else [kb, ka]).to(BF16)
    v = torch.cat([va, vb] if order == 0 else [vb, va]).to(BF16)
    lens = [len_a, 2] if order == 0 else [2, len_a]
    scale = d ** -0.5
    with explain_crash(CRASHES):
        out = m.varlen_attention(q, k, v, _cu(lens), _cu(lens), scale)
    assert_dtype(out, BF16, what="bf16 输入时 varlen_attention 的输出", mistake=M_DTYPE)
    ref = naive_varlen(q.float(), k.float(), v.float(), lens, lens, scale).to(BF16)
    # the same attention with the scores rounded to bf16 before the softmax
    with torch.no_grad():
        q32, k32, v32 = q.float(), k.float(), v.float()
        wrong = torch.zeros(q.shape)
        start = 0
        for n in lens:
            sl = slice(start, start + n)
            s_bf16 = (torch.einsum("qhd,khd->hqk", q32[sl], k32[sl].expand(-1, heads, -1)) * scale).to(BF16).float()
            s_bf16 = s_bf16.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            wrong[sl] = torch.einsum("hqk,khd->qhd", torch.softmax(s_bf16, -1), v32[sl].expand(-1, heads, -1))
            start += n
    assert_close(out, ref, what="bf16 的 varlen_attention（与 fp32 scores/softmax 的结果对比）", rand=r,
                 looks_like=[(wrong.to(BF16), M_BF16)], **TOL[BF16])
    record_case("bf16:varlen-scores-fp32")
    record_case("bf16:varlen-output-dtype")


@point("GatedAttention 与 HF Qwen3_5Attention 一致")
def test_gated_attention_matches_hf():
    m = impl(MODULE)
    rope = impl("m02_rope")
    r = Rand()
    s = _sizes(r, head_dims=[8, 16, 32])                      # rotary_dim = D/4 must be even
    cfg, hf = _qwen3_5(r, **s)
    lens, x, positions = _packed_inputs(r, s["hidden"])
    rotary_dim = int(s["head_dim"] * cfg.rope_parameters["partial_rotary_factor"])
    ref = hf_packed(cfg, hf, x, lens, gated=True)
    looks_like = [
        (hf_variant(cfg, hf, x, lens, True, split="flat"), M_FLAT_GATE),
        (hf_variant(cfg, hf, x, lens, True, gate="raw"), M_GATE_RAW),
        (hf_variant(cfg, hf, x, lens, True, gate="after_o_proj"), M_GATE_AFTER),
        (hf_packed(cfg, _shifted_norms(hf, -1.0), x, lens, gated=True), M_PLAIN_NORM),
        (hf_variant(cfg, hf, x, lens, True, scale=rotary_dim ** -0.5), M_SCALE_ROT),
        (hf_variant(cfg, hf, x, lens, True, scale=1.0 / s["head_dim"]), M_SCALE_D),
        (hf_variant(cfg, hf, x, lens, True, norm="none"), M_NO_NORM),
        (hf_variant(cfg, hf, x, lens, True, norm="after"), M_NORM_AFTER),
        (hf_variant(cfg, hf, x, lens, True, whole_pack=True), M_PACK),
        (hf_packed(cfg, _default_eps_norms(hf), x, lens, gated=True), M_NORM_EPS),
    ]
    with explain_crash(CRASHES):
        mine = m.GatedAttention(s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], cfg.rms_norm_eps,
                                rope.rope_from_config(cfg))
    load_from_hf(mine, hf, s["hidden"], 2 * s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"])
    with explain_crash(CRASHES), torch.no_grad():
        out = mine(positions[None].expand(3, -1), x, m.AttentionContext.from_seqlens(lens))   # text positions [3, N]
    assert_close(out, ref, what=f"GatedAttention 输出（lens={lens}, nH={s['heads']}, nKV={s['kv_heads']}, "
                 f"D={s['head_dim']}, rotary_dim={rotary_dim}）", rand=r, looks_like=looks_like)
    assert_attention_attrs(mine.attn, what="GatedAttention.attn", heads=s["heads"], head_dim=s["head_dim"],
                           scale=s["head_dim"] ** -0.5, kv_heads=s["kv_heads"])
    record_case("gated:packed-fp32-text-positions-[3,N]")
    record_case("gated:partial-rotary-scale-D")
    check_bf16_module(mine, cfg, hf, x, positions[None].expand(3, -1), lens, True, r, "GatedAttention")
    record_case("gated:bf16-module")


# ----------------------------------------------------------------------------------------------- the card's numbers

# 逐步图 1: nH = 2, nKV = 1, D = 2, scale = 1/sqrt(2); sequence A: 2 tokens; sequence B: 1 cached + 2 new tokens
EX_Q = torch.tensor([[[1., 0.], [0., 1.]], [[1., 1.], [1., -1.]], [[0., 1.], [1., 0.]], [[1., 0.], [-1., 1.]]])
EX_K = torch.tensor([[[1., 0.]], [[0., 1.]], [[1., 1.]], [[0., -1.]], [[2., 0.]]])
EX_V = torch.tensor([[[1., 0.]], [[0., 1.]], [[2., 0.]], [[0., 2.]], [[1., 1.]]])
EX_CU_Q, EX_CU_K = [0, 2, 4], [0, 2, 5]
EX_OUT = torch.tensor([[[1.0000, 0.0000], [1.0000, 0.0000]],
                       [[0.5000, 0.5000], [0.8044, 0.1956]],
                       [[1.6089, 0.3911], [1.3395, 0.6605]],
                       [[1.1440, 0.8560], [1.2920, 0.7080]]])
EX_OUT_PACK = torch.tensor([[[0.6698, 0.3302], [0.3302, 0.6698]],
                            [[1.2552, 0.2483], [1.1440, 0.1400]],
                            [[0.9111, 0.5432], [1.0046, 0.4954]],
                            [[1.0028, 0.6995], [0.6427, 0.7651]]])
EX_OUT_TOP_LEFT = torch.tensor([[[1.0000, 0.0000], [1.0000, 0.0000]],
                                [[0.5000, 0.5000], [0.8044, 0.1956]],
                                [[2.0000, 0.0000], [2.0000, 0.0000]],
                                [[1.3395, 0.6605], [1.3395, 0.6605]]])
# 逐步图 2: one token, H = nH·D = 4, nH = 2, nKV = 1, D = 2; x = e_0, so qkv_proj(x) is the first column
EX_QKV = [0.3, -0.2, 0.5, -1.0, 0.7, 0.1, 2.0, 0.0, 0.4, 0.9, 3.0, -2.0]   # [q0 | g0 | q1 | g1 | k | v]
EX_O = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.float32)  # swap heads
EX_GATED = torch.tensor([[2.6424, -1.0000, 1.8674, -0.5379]])
EX_GATED_FLAT = torch.tensor([[2.6424, -1.0000, 2.0046, -1.0500]])
EX_GATED_RAW = torch.tensor([[6.0000, 0.0000, 1.5000, 2.0000]])
EX_GATED_AFTER = torch.tensor([[1.8674, -0.5379, 2.6424, -1.0000]])
EX_ATOL = 1e-4                                                     # the card prints 4 decimals


@point("卡片例子：两条序列（含 cached prefix）的 varlen_attention")
def test_card_varlen_example():
    m = impl(MODULE)
    with explain_crash(CRASHES):
        out = m.varlen_attention(EX_Q, EX_K, EX_V, torch.tensor(EX_CU_Q, dtype=torch.int32),
                                 torch.tensor(EX_CU_K, dtype=torch.int32), 2 ** -0.5)
    assert_close(out, EX_OUT, what="卡片逐步图 1 的输出", atol=EX_ATOL, rtol=0,
                 looks_like=[(EX_OUT_PACK, M_PACK),
                             (EX_OUT_TOP_LEFT, "cached prefix 时 causal mask 左上对齐（j ≤ i），或 k / v 用 cu_seqlens_q 切了"
                              "（在这个例子里两者结果相同）：k / v 用 cu_seqlens_k 切，序列 b 的 query i 看得到 key j ≤ (Lk_b − Lq_b) + i")])
    record_case("card:varlen")


@point("卡片例子：单 token 的 GatedAttention（per-head gate）")
def test_card_gated_example():
    m = impl(MODULE)
    rope = impl("m02_rope")
    with explain_crash(CRASHES):
        mine = m.GatedAttention(4, 2, 1, 2, 1e-6, rope.RotaryEmbedding(2, 2, 16, 10000.0))
    with torch.no_grad():
        mine.qkv_proj.weight.zero_()
        mine.qkv_proj.weight[:, 0] = torch.tensor(EX_QKV)
        mine.o_proj.weight.copy_(EX_O)
    with explain_crash(CRASHES), torch.no_grad():
        out = mine(torch.tensor([0]), torch.tensor([[1.0, 0.0, 0.0, 0.0]]), m.AttentionContext.from_seqlens([1]))
    assert_close(out, EX_GATED, what="卡片逐步图 2 的 GatedAttention 输出", atol=EX_ATOL, rtol=0,
                 looks_like=[(EX_GATED_FLAT, M_FLAT_GATE), (EX_GATED_RAW, M_GATE_RAW), (EX_GATED_AFTER, M_GATE_AFTER)])
    record_case("card:gated")
