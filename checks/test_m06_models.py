"""Checks for M06 · models and loading (lessons/m06_models.md).

Oracle: HF transformers 5.17.0 *ForCausalLM (fp32, eager, every parameter randomised) written with
save_pretrained (sharded), loaded by our loader; logits compared on several packed sequences.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5MoeConfig

from checks import hf_models
from checks.kit import Rand, assert_close, explain_crash, impl, point, record_case

MODULE = "m06_models"
M_FP8_SCALE_KEY = ("FP8 checkpoint 的 `X.weight_scale_inv` 要和 `X.weight` 一起读、一起消费（它不是一个独立参数）；"
                   "它的形状是 [ceil(N/bn), ceil(K/bk)]，(bn, bk) 从 config.quantization_config 的 weight_block_size 读"
                   "（不能写死 128）")
LOAD_MISTAKES = {
    "_scale_inv'": M_FP8_SCALE_KEY,      # first: an FP8 scale key also contains ".mlp.gate_proj" and the like
    "missing key for 'lm_head.weight'": "tie_word_embeddings=True 时 lm_head 与 embed_tokens 共享同一个权重，checkpoint 里没有 lm_head",
    "unexpected key 'model.language_model.": "没有把 Qwen3.5 的 model.language_model. 前缀换成 model.",
    "unexpected key 'mtp.": "没有跳过 mtp.* / model.visual.* 这些文本模型用不到的 key",
    "unexpected key 'model.visual.": "没有跳过 mtp.* / model.visual.* 这些文本模型用不到的 key",
    "unexpected key 'thinker.": "没有去掉 Omni checkpoint 的 thinker. 前缀",
    "unexpected key 'talker.": "没有跳过 Omni 的 talker / audio_tower key",
    ".mlp.gate_proj": "MoE 层与 dense 层的判断错了（decoder_sparse_step / mlp_only_layers）",
    ".mlp.up_proj": "MoE 层与 dense 层的判断错了（decoder_sparse_step / mlp_only_layers）",
    ".mlp.down_proj": "MoE 层与 dense 层的判断错了（decoder_sparse_step / mlp_only_layers）",
    ".mlp.experts": "MoE 层与 dense 层的判断错了（decoder_sparse_step / mlp_only_layers）",
}


def _ctx(lengths: list[int]):
    return impl("m04_attention").AttentionContext.from_seqlens(lengths)


def _packed(r: Rand, vocab: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[int]]:
    lengths = [r.int(1, 12) for _ in range(r.int(2, 4))]
    seqs = [r.randint(1, vocab, (n,)) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])
    return seqs, torch.cat(seqs), positions, lengths


def _our_logits(m, model, r: Rand, seqs, ids, positions, lengths) -> torch.Tensor:
    with torch.no_grad(), explain_crash(LOAD_MISTAKES):
        return model.compute_logits(model(ids, positions, _ctx(lengths)))


def _load(m, folder: Path):
    with explain_crash(LOAD_MISTAKES):
        try:
            return m.from_pretrained(folder)
        except m.CheckpointError as exc:
            for fragment, mistake in LOAD_MISTAKES.items():
                if fragment in str(exc):
                    raise AssertionError(f"加载失败：{exc}\n  看起来像易错点：{mistake}") from exc
            raise AssertionError(f"加载失败：{exc}") from exc


def _family_matches_hf(family: str, tie: bool = False) -> None:
    m = impl(MODULE)
    r = Rand()
    config = hf_models.tiny_config(family, r, tie=tie, hard=True)
    hf = hf_models.hf_model(family, config, r)
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        if family == "qwen3_omni_moe_text":
            hf_models.omni_checkpoint(hf, folder)
        else:
            hf_models.save_hf(hf, folder)
        model = _load(m, folder)
    seqs, ids, positions, lengths = _packed(r, config.vocab_size)
    out = _our_logits(m, model, r, seqs, ids, positions, lengths)
    ref = hf_models.hf_logits(hf, seqs)
    assert_close(out, ref, what=f"{family} 的 logits（{len(lengths)} 条 packed 序列，长度 {lengths}；{_knobs(config)}）",
                 rand=r, atol=1e-4, rtol=1e-4)


def _knobs(config) -> str:
    """The behaviour-changing config values of this run, for the failure message."""
    keys = ("rms_norm_eps", "head_dim", "hidden_size", "num_attention_heads", "rope_theta", "decoder_sparse_step",
            "mlp_only_layers", "norm_topk_prob", "tie_word_embeddings", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
    values = {k: getattr(config, k) for k in keys if getattr(config, k, None) is not None}
    rope = getattr(config, "rope_parameters", None) or {}
    values.update({k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope})
    return "config " + ", ".join(f"{k}={v}" for k, v in values.items())


class _PrefixKV(torch.nn.Module):
    """Stands in for m04's Attention backend with a per-sequence KV cache (what e04's paged cache provides):
    the keys of a step are every cached key of the sequence followed by its new ones."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale, self.keys, self.values = scale, None, None

    def forward(self, q, k, v, ctx):
        cu_q, cu_k = ctx.cu_seqlens_q.tolist(), ctx.cu_seqlens_k.tolist()
        new_k = [k[a:b] for a, b in zip(cu_q[:-1], cu_q[1:])]
        new_v = [v[a:b] for a, b in zip(cu_q[:-1], cu_q[1:])]
        if self.keys is not None:
            new_k = [torch.cat([old, n]) for old, n in zip(self.keys, new_k)]
            new_v = [torch.cat([old, n]) for old, n in zip(self.values, new_v)]
        self.keys, self.values = new_k, new_v
        lens_k = [x.shape[0] for x in new_k]
        if lens_k != [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]:
            raise AssertionError(f"attention 收到的 ctx.cu_seqlens_k={cu_k} 与缓存里每条序列的 key 数 {lens_k} 不符："
                                 "模型要把 ctx 原样传给每个 attention 层")
        return impl("m04_attention").varlen_attention(q, torch.cat(new_k), torch.cat(new_v), ctx.cu_seqlens_q,
                                                      ctx.cu_seqlens_k, self.scale)


class _Spy(torch.nn.Module):
    """Wraps a GatedDeltaNet layer and records what the model hands it: (cu_seqlens, state) of every call."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []

    def forward(self, hidden_states, cu_seqlens, state=None):
        self.calls.append((cu_seqlens.tolist(), state))
        return self.inner(hidden_states, cu_seqlens, state)


M_GDN_CU_K = ("linear attention 层用了 ctx.cu_seqlens_k：Gated DeltaNet 只看本步新来的 token，"
              "应传 ctx.cu_seqlens_q（前缀已经在 GDN 状态里了）")
M_GDN_STATE = "没有把 gdn_states 里本层的状态交给 linear attention 层：续算时每条序列都从零状态开始了"


@point("hybrid：带 cached prefix 的多条序列续算（q 长度 ≠ k 长度）与 HF 一致")
def test_hybrid_prefix_continuation():
    m = impl(MODULE)
    m05 = impl("m05_gated_deltanet")
    r = Rand()
    family = r.choice(["qwen3_5_text", "qwen3_5_moe_text"])
    config = hf_models.tiny_config(family, r, hard=True)
    hf = hf_models.hf_model(family, config, r)
    with tempfile.TemporaryDirectory() as d:
        model = _load(m, hf_models.save_hf(hf, Path(d)))
    spies = {}
    for i, layer in enumerate(model.model.layers):
        if not getattr(layer, "is_linear", False):
            layer.self_attn.attn = _PrefixKV(layer.self_attn.attn.scale)
        else:
            spies[i] = layer.linear_attn = _Spy(layer.linear_attn)
    batch = r.int(2, 3)
    prefix = [r.int(2, 7) for _ in range(batch)]
    new = [r.int(1, 4) for _ in range(batch)]
    new[0] = prefix[0] + 2                                  # one sequence brings more new tokens than it had cached
    seqs = [r.randint(1, config.vocab_size, (c + n,)) for c, n in zip(prefix, new)]
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim \
        + config.linear_num_value_heads * config.linear_value_head_dim
    states = {i: m05.GDNState(conv=torch.zeros(batch, conv_dim, config.linear_conv_kernel_dim - 1),
                              ssm=torch.zeros(batch, config.linear_num_value_heads, config.linear_key_head_dim,
                                              config.linear_value_head_dim))
              for i in model.linear_layer_ids}
    ctx_mod = impl("m04_attention")

    def handed_over(cu_q: list[int]) -> None:          # what the model passed to its GDN layers in the last step
        for i, spy in spies.items():
            if spy.calls and spy.calls[-1][0] != cu_q:
                raise AssertionError(f"第 {i} 层（linear attention）收到的 cu_seqlens 是 {spy.calls[-1][0]}，"
                                     f"本步的 cu_seqlens_q 是 {cu_q}\n  看起来像易错点：{M_GDN_CU_K}；{r}")
            if spy.calls and spy.calls[-1][1] is not states[i]:
                raise AssertionError(f"第 {i} 层（linear attention）收到的状态不是 gdn_states[{i}]"
                                     f"\n  看起来像易错点：{M_GDN_STATE}；{r}")

    with torch.no_grad(), explain_crash(LOAD_MISTAKES):
        ids = torch.cat([s[:c] for s, c in zip(seqs, prefix)])
        positions = torch.cat([torch.arange(c) for c in prefix])
        model(ids, positions, ctx_mod.AttentionContext.from_seqlens(prefix), states)
        cu_q = torch.tensor([0] + new).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + [c + n for c, n in zip(prefix, new)]).cumsum(0).to(torch.int32)
        ctx = ctx_mod.AttentionContext(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(new),
                                       max_seqlen_k=max(c + n for c, n in zip(prefix, new)))
        ids = torch.cat([s[c:] for s, c in zip(seqs, prefix)])
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(prefix, new)])
        try:
            out = model.compute_logits(model(ids, positions, ctx, states))
        except (RuntimeError, IndexError, ValueError):
            handed_over(cu_q.tolist())
            raise
        handed_over(cu_q.tolist())
    ref = torch.cat([hf_models.hf_logits(hf, [s])[c:] for s, c in zip(seqs, prefix)])
    assert_close(out, ref, what=f"{family} 续算的 logits（cached prefix {prefix}，新 token {new}；{_knobs(config)}）",
                 rand=r, atol=1e-4, rtol=1e-4)


@point("qwen3：packed 多条序列的 logits 与 HF 一致")
def test_qwen3_logits():
    _family_matches_hf("qwen3")


@point("qwen3_moe：dense + MoE 层混合、norm_topk_prob=False，logits 与 HF 一致")
def test_qwen3_moe_logits():
    _family_matches_hf("qwen3_moe")


@point("qwen3_5_text：Gated DeltaNet + gated attention 混合，logits 与 HF 一致")
def test_qwen3_5_logits():
    _family_matches_hf("qwen3_5_text", tie=True)


@point("qwen3_5_moe_text：混合 + MoE + shared expert，logits 与 HF 一致")
def test_qwen3_5_moe_logits():
    _family_matches_hf("qwen3_5_moe_text")


@point("Qwen3-Omni thinker 文本模型（thinker. 前缀、per-expert key）与 HF 一致")
def test_omni_thinker_logits():
    _family_matches_hf("qwen3_omni_moe_text")


@point("tied embeddings：checkpoint 没有 lm_head 时与 embed_tokens 共享")
def test_tied_embeddings():
    _family_matches_hf("qwen3", tie=True)
    m = impl(MODULE)
    model = m.build_model(hf_models.tiny_config("qwen3", Rand(), tie=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight, \
        "tie_word_embeddings=True：lm_head.weight 应与 embed_tokens.weight 是同一个 Parameter"
    # a tied checkpoint that still ships lm_head.weight (some hub checkpoints do; sorted first in its shard): the key
    # is skipped and every key after it is still loaded
    r = Rand()
    config = hf_models.tiny_config("qwen3", r, tie=True)
    hf = hf_models.hf_model("qwen3", config, r)
    with tempfile.TemporaryDirectory() as d:
        hf_models.write_checkpoint(Path(d), config, {k: v.clone() for k, v in hf.state_dict().items()})
        tied = _load(m, Path(d))
    seqs, ids, positions, lengths = _packed(r, config.vocab_size)
    assert_close(_our_logits(m, tied, r, seqs, ids, positions, lengths), hf_models.hf_logits(hf, seqs),
                 what="tied embeddings、checkpoint 里仍带 lm_head.weight 时的 logits", rand=r, atol=1e-4, rtol=1e-4)


@point("Qwen3.5 hub 布局：model.language_model. 前缀、忽略 visual / mtp、fused expert 张量（bf16 与 FP8 各一次）")
def test_qwen3_5_hub_layout():
    m = impl(MODULE)
    r = Rand()
    config = hf_models.tiny_config("qwen3_5_moe_text", r)
    hf = hf_models.hf_model("qwen3_5_moe_text", config, r)
    tensors = {}
    for key, t in hf.state_dict().items():      # module keys: fused experts.gate_up_proj [E, 2I, H]
        tensors[key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key] = t.clone()
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    tensors["mtp.layers.0.mlp.gate.weight"] = torch.zeros(2, 2)
    wrapper = Qwen3_5MoeConfig(text_config=config.to_dict())
    with tempfile.TemporaryDirectory() as d:
        hf_models.write_checkpoint(Path(d), wrapper, tensors)
        model = _load(m, Path(d))
    seqs, ids, positions, lengths = _packed(r, config.vocab_size)
    assert_close(_our_logits(m, model, r, seqs, ids, positions, lengths), hf_models.hf_logits(hf, seqs),
                 what="Qwen3.5-MoE（hub 布局）的 logits", rand=r, atol=1e-4, rtol=1e-4)
    # the same layout in block-FP8: the fused experts [E, 2I, H] quantized expert by expert, scale_inv [E, rows, cols]
    block = r.choice([(16, 8), (8, 16)])
    scale_dtype = r.choice(SCALE_DTYPES)
    fp8, dequantized = hf_models.fp8_tensors(hf.state_dict(), block, scale_dtype)
    record_case("hub:fused-experts-fp8")
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: t for k, t in fp8.items()}
    wrapper.quantization_config = hf_models.fp8_quantization_config(block)
    with tempfile.TemporaryDirectory() as d:
        hf_models.write_checkpoint(Path(d), wrapper, tensors)
        model = _load(m, Path(d))
    hf.load_state_dict(dequantized)
    with _scale_dtype_hint(m, scale_dtype):
        assert_close(_our_logits(m, model, r, seqs, ids, positions, lengths), hf_models.hf_logits(hf, seqs),
                     what=f"Qwen3.5-MoE（hub 布局，FP8，fused experts 按 expert 量化，block {list(block)}，"
                     f"scale 为 {_dtype_name(scale_dtype)}）的 logits", rand=r, atol=1e-4, rtol=1e-4)
    record_case(f"hub:scale-{_dtype_name(scale_dtype)}")


@point("参数带 weight_loader（m07 的张量并行层）时，加载器把整个 checkpoint 张量交给它、按它返回的个数计数")
def test_weight_loader_params():
    m = impl(MODULE)
    r = Rand()
    config = hf_models.tiny_config("qwen3", r)
    hf = hf_models.hf_model("qwen3", config, r)
    model = m.build_model(config)
    calls = []

    def keep_all(param, tensor, shard):                  # a stand-in for m07's loader: keeps the whole tensor
        calls.append((param.shape, tuple(shard)))
        param.data.copy_(tensor)
        return tensor.numel()
    names = ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.o_proj.weight"]
    params = dict(model.named_parameters())
    for name in names:
        params[name].weight_loader = keep_all
    with tempfile.TemporaryDirectory() as d:
        hf_models.save_hf(hf, Path(d))
        with explain_crash(LOAD_MISTAKES):
            m.load_checkpoint(model, d)
    assert sorted((tuple(s), sh) for s, sh in calls) == sorted((tuple(params[n].shape), ()) for n in names), \
        f"带 weight_loader 的 {names} 应各收到一次整个 checkpoint 张量（shard ()），实际调用：{calls}"
    seqs, ids, positions, lengths = _packed(r, config.vocab_size)
    assert_close(_our_logits(m, model, r, seqs, ids, positions, lengths), hf_models.hf_logits(hf, seqs),
                 what="部分参数带 weight_loader 时的 logits", rand=r, atol=1e-4, rtol=1e-4)


def _broken(m, r: Rand, edit, fp8_block: tuple[int, int] | None = None) -> str:
    """Save a tiny qwen3_moe (block-FP8 with fp8_block), apply `edit` to its tensors, load: the CheckpointError's
    message (NO_ERROR when it loads)."""
    config = hf_models.tiny_config("qwen3_moe", r)
    hf = hf_models.hf_model("qwen3_moe", config, r)
    tensors = hf_models.per_expert_state_dict(hf.state_dict())
    if fp8_block is not None:
        tensors, _ = hf_models.fp8_tensors(tensors, fp8_block)
        config.quantization_config = hf_models.fp8_quantization_config(fp8_block)
    edit(tensors)
    with tempfile.TemporaryDirectory() as d:
        hf_models.write_checkpoint(Path(d), config, tensors)
        try:
            m.from_pretrained(d)
        except m.CheckpointError as exc:
            return str(exc)
    return NO_ERROR


NO_ERROR = "（没有报错：加载成功了）"


@point("坏 checkpoint 报清楚的错并点名 key：缺 key、多余 key、形状不符、不支持的 model_type")
def test_bad_checkpoints():
    m = impl(MODULE)
    r = Rand()
    missing = "model.layers.1.mlp.experts.0.up_proj.weight"
    msg = _broken(m, r, lambda t: t.pop(missing))
    assert "missing" in msg and "model.layers.1.mlp.experts.gate_up_proj" in msg, \
        f"缺 key 时的错误信息应说明缺失并点名参数，得到：{msg}"
    msg = _broken(m, r, lambda t: t.update({"model.layers.0.self_attn.rotary.inv_freq": torch.zeros(4)}))
    assert "unexpected" in msg and "model.layers.0.self_attn.rotary.inv_freq" in msg, \
        f"多余 key 时的错误信息应点名它，得到：{msg}"
    key = "model.layers.0.self_attn.k_proj.weight"
    msg = _broken(m, r, lambda t: t.update({key: t[key][:-1]}))
    assert "shape" in msg and key in msg, f"形状不符时的错误信息应点名 key 和形状，得到：{msg}"
    config = hf_models.tiny_config("qwen3", r)
    config.model_type = "llama"
    with pytest.raises(m.CheckpointError, match="llama"):
        m.build_model(config)


@point("registry：model_type 映射到模型类，wrapper config 取出文本部分")
def test_registry():
    m = impl(MODULE)
    r = Rand()
    for family in hf_models.FAMILIES:
        model = m.build_model(hf_models.tiny_config(family, r))
        assert isinstance(model, m.MODEL_REGISTRY[family]), family
        linear = [i for i, layer in enumerate(model.model.layers) if getattr(layer, "is_linear", False)]
        assert (len(linear) > 0) == family.startswith("qwen3_5"), f"{family}: Gated DeltaNet layers {linear}"
    wrapper = Qwen3_5MoeConfig(text_config=hf_models.tiny_config("qwen3_5_moe_text", r).to_dict())
    assert isinstance(m.build_model(wrapper), m.MODEL_REGISTRY["qwen3_5_moe_text"])


@point("dummy 权重：只凭 config 构造，数值有限、按 seed 可复现")
def test_dummy_weights():
    m = impl(MODULE)
    r = Rand()
    for family in ("qwen3", "qwen3_5_moe_text"):
        config = hf_models.tiny_config(family, r)
        a = m.init_dummy_weights(m.build_model(config), seed=1)
        b = m.init_dummy_weights(m.build_model(config), seed=1)
        c = m.init_dummy_weights(m.build_model(config), seed=2)
        seqs, ids, positions, lengths = _packed(r, config.vocab_size)
        la, lb, lc = (_our_logits(m, x, r, seqs, ids, positions, lengths) for x in (a, b, c))
        assert torch.isfinite(la).all(), f"{family}: dummy 权重的 logits 出现 inf/nan"
        assert torch.equal(la, lb), f"{family}: 同一个 seed 的 dummy 权重应给出相同的 logits"
        assert not torch.equal(la, lc), f"{family}: 不同 seed 的 dummy 权重应不同"
        assert 1e-3 < la.std() < 10, f"{family}: dummy logits 的尺度不合理（std={la.std():.3g}）"


@point("卡片例子：key 映射与 qkv_proj / gate_up_proj / experts 的行偏移")
def test_card_key_mapping_and_offsets():
    m = impl(MODULE)
    expected = {
        "model.layers.0.self_attn.q_proj.weight": ("model.layers.0.self_attn.qkv_proj.weight", ("q",)),
        "model.layers.0.self_attn.k_proj.weight": ("model.layers.0.self_attn.qkv_proj.weight", ("k",)),
        "model.layers.0.self_attn.q_norm.weight": ("model.layers.0.self_attn.q_norm.weight", ()),
        "model.layers.0.mlp.up_proj.weight": ("model.layers.0.mlp.gate_up_proj.weight", (1,)),
        "model.layers.1.mlp.gate.weight": ("model.layers.1.mlp.gate.weight", ()),
        "model.layers.1.mlp.experts.7.gate_proj.weight": ("model.layers.1.mlp.experts.gate_up_proj", ("expert", 7, "gate")),
        "model.layers.1.mlp.experts.7.down_proj.weight": ("model.layers.1.mlp.experts.down_proj", ("expert", 7, "down")),
        "model.language_model.embed_tokens.weight": ("model.embed_tokens.weight", ()),
        "model.language_model.layers.3.mlp.experts.gate_up_proj": ("model.layers.3.mlp.experts.gate_up_proj", ()),
        "model.language_model.layers.3.mlp.shared_expert.up_proj.weight":
            ("model.layers.3.mlp.shared_expert.gate_up_proj.weight", (1,)),
        "thinker.model.layers.0.mlp.experts.2.up_proj.weight": ("model.layers.0.mlp.experts.gate_up_proj", ("expert", 2, "up")),
        "thinker.lm_head.weight": ("lm_head.weight", ()),
        "mtp.layers.0.mlp.gate.weight": None,
        "model.visual.blocks.0.attn.qkv.weight": None,
        "talker.model.norm.weight": None,
        "thinker.audio_tower.conv1.weight": None,
    }
    for key, want in expected.items():
        got = m.map_checkpoint_key(key)
        got = None if got is None else (got[0], tuple(got[1]))
        assert got == want, f"map_checkpoint_key({key!r}) 应为 {want}，得到 {got}"
    from transformers import Qwen3Config
    config = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16)
    model = m.build_model(config)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight.data
    name = "model.layers.0.self_attn.qkv_proj.weight"
    for shard, first, rows in ((("q",), 0, 64), (("k",), 64, 32), (("v",), 96, 32)):
        view = m.shard_view(model, name, qkv, shard)
        start = (view.data_ptr() - qkv.data_ptr()) // (qkv.element_size() * qkv.shape[1])
        assert (start, view.shape[0]) == (first, rows), f"qkv_proj 的 {shard} 应占 rows {first}..{first + rows - 1}，得到从 {start} 起 {view.shape[0]} 行"
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight.data
    for shard, first in (((0,), 0), ((1,), 64)):
        view = m.shard_view(model, "model.layers.0.mlp.gate_up_proj.weight", gate_up, shard)
        start = (view.data_ptr() - gate_up.data_ptr()) // (gate_up.element_size() * gate_up.shape[1])
        assert (start, view.shape[0]) == (first, 64), f"gate_up_proj 的 {shard} 应从 row {first} 开始，得到 {start}"


# ----------------------------------------------------------------------------- block-FP8 checkpoints
M_FP8_DIVIDED = "scale_inv 是乘数（w = w_fp8 × scale_inv），不是除数：名字里的 inv 说的是它已经是 1/scale"
M_FP8_GRID = ("按块展开 scale_inv 后与权重对不上：行（输出维 N）按 weight_block_size[0]、列（输入维 K）按 [1] 展开，"
              "最后一块不满时按 ceil 切块再截到 [N, K]；不能用 N // scale 行数反推块大小"
              "（HF 5.17 的 Fp8Dequantize 这样推，只在维度整除时对）")
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # Qwen's FP8 checkpoints ship each (Qwen3-1.7B-FP8: bf16)
M_FP8_SCALE_DTYPE = ("反量化的乘法在 scale_inv 的 dtype（bf16 / f16）里做了：FP8 值（4 位有效位）与 bf16 / f16 的 scale 的乘积"
                     "比 bf16 / f16 的有效位多，被舍入了；scale_inv 可能是 fp32、bf16 或 f16（Qwen 的 FP8 checkpoint 三种都有），"
                     "要先转成 fp32、在 fp32 里乘完再转成 dtype")
M_FP8_FROM_GRID = ("块大小用 N // scale 行数反推了：最后一块不满时推出的块比 weight_block_size 小，scale 的每一行盖住的权重行都错开了"
                   "（HF 5.17 的 Fp8Dequantize 这样推，只在维度整除时对）；不能反推块大小，要用传进来的 block")


def _passes(fn) -> bool:
    try:
        return bool(fn())
    except Exception:                     # noqa: BLE001 - evidence only: a crash is no evidence either way
        return False


@contextlib.contextmanager
def _scale_dtype_hint(m, scale_dtype: torch.dtype):
    """A failure inside names M_FP8_SCALE_DTYPE when dequantize_block_fp8 rounds a product with a scale_dtype scale:
    q * (1 + eps) needs 3 more mantissa bits than scale_dtype has, so a product taken in that dtype is rounded."""
    try:
        yield
    except AssertionError as exc:
        if scale_dtype != torch.float32 and "易错点" not in str(exc):
            q = torch.tensor([[1.875, 1.125], [7.0, 448.0]]).to(torch.float8_e4m3fn)
            s = torch.tensor([[1.0 + torch.finfo(scale_dtype).eps]], dtype=scale_dtype)
            if not _passes(lambda: torch.equal(m.dequantize_block_fp8(q, s, (2, 2)), q.float() * s.float())):
                raise AssertionError(f"{exc}\n  看起来像易错点：{M_FP8_SCALE_DTYPE}") from None
        raise


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _expand(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """scale_inv [..., ceil(N/bn), ceil(K/bk)] -> one scale per weight element [..., N, K], in scale's dtype."""
    return scale.repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]


def _fp8_family_config(family: str, r: Rand):
    """A hard tiny config whose MoE dims are multiples of 16, so HF's dequantization (block = dim // grid) is exact."""
    config = hf_models.tiny_config(family, r, hard=True)
    if getattr(config, "moe_intermediate_size", None):
        config.moe_intermediate_size = 32
    if getattr(config, "shared_expert_intermediate_size", None):
        config.shared_expert_intermediate_size = 16
    return config


@point("dequantize_block_fp8：非方块、最后一块不满、stacked experts、输出 dtype、fp32 / bf16 / f16 的 scale_inv")
def test_dequantize_block_fp8():
    m = impl(MODULE)
    r = Rand()
    bn, bk = r.choice([(16, 8), (8, 32), (32, 16)])               # never square: rows and columns differ
    n = bn * r.int(1, 3) + r.int(1, bn - 1)                        # a partial last block row ...
    k = bk * r.int(1, 3) + r.int(1, bk - 1)                        # ... and column
    w = r.randn(n, k, scale=0.2)
    q, scale32 = hf_models.fp8_quantize(w, (bn, bk))
    for scale_dtype in SCALE_DTYPES:                       # the scale dtypes of Qwen's FP8 checkpoints, every run
        scale = scale32.to(scale_dtype)
        want = hf_models.fp8_dequantize(q, scale, (bn, bk))                 # fp32: q * scale is exact there
        what = (f"dequantize_block_fp8（[{n}, {k}]，block ({bn}, {bk})，scale_inv {list(scale.shape)} "
                f"{_dtype_name(scale_dtype)}）")
        with explain_crash({"must match the size of tensor": M_FP8_GRID}):
            got = m.dequantize_block_fp8(q, scale, (bn, bk))
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, \
            (f"{what}：默认 dtype=torch.float32 时应返回 fp32，得到 {getattr(got, 'dtype', type(got).__name__)}；{r}"
             + (f"\n  看起来像易错点：{M_FP8_SCALE_DTYPE}" if getattr(got, "dtype", None) == scale_dtype else ""))
        looks = [(hf_models.fp8_dequantize(q, 1 / scale.float(), (bn, bk)), M_FP8_DIVIDED)]
        if scale_dtype != torch.float32:
            looks.append(((q.to(scale_dtype) * _expand(scale, (bn, bk), n, k)).float(), M_FP8_SCALE_DTYPE))
        rows, cols = scale.shape
        if n % rows == 0 and k % cols == 0:   # the block read off the grid tiles the weight: wrong values, no crash
            looks.append((hf_models.fp8_dequantize(q, scale, (n // rows, k // cols)), M_FP8_FROM_GRID))
        assert_close(got, want, what=what, rand=r, atol=0, rtol=0, looks_like=looks)
        record_case(f"dequant:scale-{_dtype_name(scale_dtype)}")
    record_case("dequant:partial-blocks")
    experts = r.int(2, 4)
    pairs = [hf_models.fp8_quantize(r.randn(n, k, scale=0.2), (bn, bk)) for _ in range(experts)]
    stacked_q, stacked_s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    for out_dtype, scale_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)):
        with explain_crash({"must match the size of tensor": M_FP8_GRID}):
            got = m.dequantize_block_fp8(stacked_q, stacked_s.to(scale_dtype), (bn, bk), dtype=out_dtype)
        name = _dtype_name(out_dtype)
        assert isinstance(got, torch.Tensor) and got.dtype == out_dtype, \
            f"dequantize_block_fp8(..., dtype=torch.{out_dtype}) 应返回 {name}，得到 {getattr(got, 'dtype', type(got).__name__)}"
        ref = torch.stack([hf_models.fp8_dequantize(q_, s_.to(scale_dtype), (bn, bk)) for q_, s_ in pairs])
        assert_close(got, ref.to(out_dtype), what=f"stacked experts [{experts}, {n}, {k}]（dtype={name}，scale "
                     f"{_dtype_name(scale_dtype)}）的 dequantize_block_fp8", rand=r, atol=0, rtol=0)
        record_case(f"dequant:out-{name}")
    record_case("dequant:stacked")
    card = m.dequantize_block_fp8(torch.tensor([[1.0, 2], [3, 4], [5, 6]]).to(torch.float8_e4m3fn),
                                  torch.tensor([[0.5], [2.0]]), (2, 2))
    assert torch.equal(card, torch.tensor([[0.5, 1], [1.5, 2], [10, 12]])), \
        f"卡片例子：dequantize_block_fp8(block=(2, 2)) 应得 [[0.5, 1], [1.5, 2], [10, 12]]，得到 {card.tolist()}"


def _fp8_matches(family: str, r: Rand, block: tuple[int, int], config, hf_oracle: bool,
                 scale_dtype: torch.dtype = torch.float32) -> None:
    m = impl(MODULE)
    hf = hf_models.hf_model(family, config, r)
    with tempfile.TemporaryDirectory() as d:
        folder, dequantized = hf_models.fp8_checkpoint(hf, Path(d), block, scale_dtype)
        with explain_crash({"must match the size of tensor": M_FP8_GRID}):
            model = _load(m, folder)
        # the oracle: HF 5.17 loading the same FP8 folder (dequantize=True), or, where HF's block arithmetic cannot
        # handle a partial last block among several, HF's model on the weights this check dequantized itself
        ref_model = hf_models.hf_fp8_model(folder) if hf_oracle else hf_models.with_state(hf, dequantized)
    seqs, ids, positions, lengths = _packed(r, config.vocab_size)
    out = _our_logits(m, model, r, seqs, ids, positions, lengths)
    ref = hf_models.hf_logits(ref_model, seqs)
    with _scale_dtype_hint(m, scale_dtype):
        assert_close(out, ref, what=f"FP8 checkpoint（weight_block_size {list(block)}，scale_inv 为 "
                     f"{_dtype_name(scale_dtype)}）加载后 {family} 的 logits（{_knobs(config)}）", rand=r, atol=1e-4, rtol=1e-4)
    record_case(f"load:scale-{_dtype_name(scale_dtype)}")


@point("FP8 checkpoint（非方块 block、多块、单个不满的块）：dense 与 MoE 两族的 logits 与 HF 5.17 加载同一目录一致")
def test_fp8_checkpoint_hf():
    r = Rand()
    block = r.choice([(16, 8), (8, 16)])
    scale_dtypes = r.py.sample([torch.bfloat16, torch.float16], 2)        # each on every run, family by chance
    for family, scale_dtype in zip(("qwen3_moe", "qwen3_5_moe_text"), scale_dtypes):
        _fp8_matches(family, r, block, _fp8_family_config(family, r), hf_oracle=True, scale_dtype=scale_dtype)


@point("FP8 checkpoint：dense qwen3 与 qwen3_5_text（GDN 投影也是 FP8）的 logits 与 HF 5.17 一致")
def test_fp8_checkpoint_hf_dense():
    r = Rand()
    block = r.choice([(16, 8), (8, 16)])
    scale_dtypes = r.py.sample([torch.float32, torch.bfloat16], 2)
    for family, scale_dtype in zip(("qwen3", "qwen3_5_text"), scale_dtypes):
        _fp8_matches(family, r, block, _fp8_family_config(family, r), hf_oracle=True, scale_dtype=scale_dtype)


@point("FP8 checkpoint：维度不是块大小的倍数（最后一块不满、前面还有整块）时 logits 仍然正确")
def test_fp8_partial_blocks():
    r = Rand()
    block = (r.choice([24, 40]), r.choice([24, 40]))      # intermediate 64 = 2 x 24 + 16 = 40 + 24: partial blocks
    family = r.choice(["qwen3", "qwen3_5_text"])
    _fp8_matches(family, r, block, hf_models.tiny_config(family, r, hard=True), hf_oracle=False,
                 scale_dtype=r.choice(SCALE_DTYPES))


M_FP8_STRAY = ("把所有 *_scale_inv key 都跳过了：只有它的权重 X.weight 也在 checkpoint 里时，X.weight_scale_inv 才跟着权重一起读；"
               "没有权重的 scale 要抛 CheckpointError 并点名这个 scale key（否则一个缺了权重或名字写错的 checkpoint 会被悄悄接受）")


@point("坏的 FP8 checkpoint 报错并点名 key：float8 权重缺 scale、scale 形状与块网格不符、没有权重的 scale")
def test_bad_fp8_checkpoints():
    m = impl(MODULE)
    r = Rand()
    key = "model.layers.2.mlp.experts.1.down_proj.weight"
    msg = _broken(m, r, lambda t: t.pop(key + "_scale_inv"), fp8_block=(16, 8))
    assert key in msg, f"float8 权重没有 weight_scale_inv 时应报 CheckpointError 并点名 {key!r}，得到：{msg}"
    record_case("bad:no-scale")
    key = "model.layers.0.self_attn.k_proj.weight"
    msg = _broken(m, r, lambda t: t.update({key + "_scale_inv": t[key + "_scale_inv"][:, :-1]}), fp8_block=(16, 8))
    assert key + "_scale_inv" in msg, f"scale_inv 形状不符时应点名 {key + '_scale_inv'!r}，得到：{msg}"
    record_case("bad:scale-shape")
    # a scale with no weight beside it: the weight was dropped, or the scale's name belongs to no weight at all (a
    # fused-expert scale in a per-expert checkpoint)
    layer = r.int(0, 1)
    dropped = f"model.layers.{layer}.self_attn.o_proj.weight"
    fused = f"model.layers.{1 - layer}.mlp.experts.gate_up_proj_scale_inv"
    for stray, edit, label in ((dropped + "_scale_inv", lambda t: t.pop(dropped), "bad:stray-scale-dropped-weight"),
                               (fused, lambda t: t.update({fused: torch.ones(4, 2, 2)}), "bad:stray-scale-no-weight")):
        msg = _broken(m, r, edit, fp8_block=(16, 8))
        if stray not in msg:
            skipped = msg == NO_ERROR or (stray == dropped + "_scale_inv" and "missing" in msg)
            raise AssertionError(f"checkpoint 里有 {stray!r}，却没有它的权重 {stray.removesuffix('_scale_inv')!r}："
                                 f"应抛 CheckpointError 并点名这个 scale key，得到：{msg}；{r}"
                                 + (f"\n  看起来像易错点：{M_FP8_STRAY}" if skipped else ""))
        record_case(label)
