"""Tiny HF causal LMs of every family, every parameter randomised, and checkpoints written from them.

Used by the m06 checks (logits after loading) and the engine checks (greedy generate).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig, Qwen3OmniMoeTextConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

from checks.kit import Rand

transformers.utils.logging.set_verbosity_error()

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_omni_moe_text")


def tiny_config(family: str, r: Rand, vocab: int = 96, tie: bool = False, layers: int | None = None,
                hard: bool = False):
    """A tiny fp32 eager config; sizes vary with the seed. Hybrids get layer_types with a full-attention layer.

    hard=True (the m06 checks): no behaviour-changing value sits at its default, so a loader or model that
    ignores one fails on every run: rms_norm_eps large enough to matter, head_dim != hidden / heads, a
    non-default rope_theta, decoder_sparse_step 2 with mlp_only_layers, nk != nv and dk != dv (dk < dv in
    qwen3_5_text, dk > dv in qwen3_5_moe_text), a conv kernel other than 4, norm_topk_prob False (qwen3_moe)
    and True (Omni thinker).
    """
    heads, kv = r.choice([(4, 2), (4, 1), (2, 2)])
    head_dim = r.choice([8, 16])
    hidden = r.choice([32, 48])
    if hard and head_dim == hidden // heads:
        head_dim = 24 - head_dim                    # the other of 8 / 16: never hidden // heads
    theta = r.choice([5e4, 3e6]) if hard else 1e6
    base = dict(vocab_size=vocab, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=head_dim, max_position_embeddings=512, rms_norm_eps=r.choice([1e-2, 3e-2]) if hard else 1e-6,
                attn_implementation="eager")
    moe = dict(num_experts=r.int(4, 8), num_experts_per_tok=2, moe_intermediate_size=r.choice([16, 24]),
               experts_implementation="eager")
    if family == "qwen3":
        return Qwen3Config(intermediate_size=64, num_hidden_layers=layers or 2, rope_theta=theta,
                           tie_word_embeddings=tie, **base)
    if family == "qwen3_moe":
        # layer 0 dense (mlp_only_layers), the rest MoE; renormalisation off (the Qwen3MoeConfig default)
        if hard:   # layers 0..3; sparse step 2 -> layers 1 and 3; mlp_only_layers -> layer 3 dense again
            return Qwen3MoeConfig(intermediate_size=64, num_hidden_layers=layers or 4, rope_theta=theta,
                                  norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3],
                                  tie_word_embeddings=tie, **base, **moe)
        return Qwen3MoeConfig(intermediate_size=64, num_hidden_layers=layers or 3, rope_theta=1e6,
                              norm_topk_prob=False, mlp_only_layers=[0], tie_word_embeddings=tie, **base, **moe)
    if family == "qwen3_omni_moe_text":
        return Qwen3OmniMoeTextConfig(intermediate_size=64, num_hidden_layers=layers or 2, norm_topk_prob=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                       "mrope_section": _section(head_dim)}, **base, **moe)
    lin = dict(linear_num_key_heads=2, linear_num_value_heads=r.choice([2, 4]), linear_key_head_dim=8,
               linear_value_head_dim=r.choice([8, 16]), linear_conv_kernel_dim=4,
               layer_types=(["linear_attention", "full_attention", "linear_attention"])[:layers or 3])
    if hard:
        dk, dv = (8, 16) if family == "qwen3_5_text" else (16, 8)
        lin.update(linear_num_value_heads=4, linear_key_head_dim=dk, linear_value_head_dim=dv,
                   linear_conv_kernel_dim=r.choice([2, 3, 5]))
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5,
            "mrope_section": _section(head_dim // 2)}
    if family == "qwen3_5_text":
        return Qwen3_5TextConfig(intermediate_size=64, num_hidden_layers=len(lin["layer_types"]),
                                 rope_parameters=rope, tie_word_embeddings=tie, **base, **lin)
    if family == "qwen3_5_moe_text":
        return Qwen3_5MoeTextConfig(shared_expert_intermediate_size=24, num_hidden_layers=len(lin["layer_types"]),
                                    rope_parameters=rope, tie_word_embeddings=tie, **base, **moe, **lin)
    raise ValueError(family)


def _section(rotary_dim: int) -> list[int]:
    half = rotary_dim // 2                      # the sections cover the rotary_dim / 2 frequencies
    return [half - 2 * (half // 3), half // 3, half // 3]


class ThinkerTextLM(torch.nn.Module):
    """The Omni thinker's text model with an LM head (HF has no text-only *ForCausalLM for it)."""

    def __init__(self, config):
        super().__init__()
        self.model = Qwen3OmniMoeThinkerTextModel(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.config = config

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids).last_hidden_state)


def hf_model(family: str, config, r: Rand) -> torch.nn.Module:
    cls = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "qwen3_5_text": Qwen3_5ForCausalLM,
           "qwen3_5_moe_text": Qwen3_5MoeForCausalLM, "qwen3_omni_moe_text": ThinkerTextLM}[family]
    model = cls(config).eval()
    randomise(model, r)
    return model


def randomise(model: torch.nn.Module, r: Rand) -> None:
    """Every parameter random (G-17): norms around their init (1 or 0) with noise, gates small, the rest N(0, s)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=r.gen)
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(0.2 * noise)
            else:
                p.copy_(noise * (0.3 if p.dim() == 1 else 0.15))


def hf_logits(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """HF logits for each sequence on its own (no padding), concatenated: [sum(len), V]."""
    with torch.no_grad():
        return torch.cat([(out.logits if hasattr(out := model(s[None]), "logits") else out)[0] for s in seqs])


def per_expert_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF module keys -> the on-disk per-expert layout (experts.{e}.{gate,up,down}_proj.weight), G-14."""
    out = {}
    for key, t in state.items():
        if m := re.fullmatch(r"(.*\.experts)\.gate_up_proj", key):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{m.group(1)}.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif m := re.fullmatch(r"(.*\.experts)\.down_proj", key):
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[key] = t.contiguous().clone()
    return out


def save_hf(model, folder: Path, max_shard_size: str = "40KB") -> Path:
    """save_pretrained into `folder` (sharded): on-disk keys exactly as HF writes them."""
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def write_checkpoint(folder: Path, config, tensors: dict[str, torch.Tensor], shards: int = 3) -> Path:
    """A hand-made checkpoint folder: config.json + `shards` safetensors files (for hub-style layouts)."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    keys = sorted(tensors)
    for i in range(shards):
        part = {k: tensors[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: f"model-{i % shards + 1:05d}-of-{shards:05d}.safetensors" for i, k in enumerate(keys)}}))
    return folder


def omni_checkpoint(model: ThinkerTextLM, folder: Path) -> Path:
    """The Omni layout: a qwen3_omni_moe config, keys under `thinker.`, per-expert, plus audio / talker keys."""
    tensors = {f"thinker.model.{k}": v for k, v in per_expert_state_dict(model.model.state_dict()).items()}
    tensors["thinker.lm_head.weight"] = model.lm_head.weight.detach().clone()
    tensors["thinker.audio_tower.conv1.weight"] = torch.zeros(4, 4)
    tensors["talker.model.norm.weight"] = torch.zeros(4)
    config = Qwen3OmniMoeConfig(thinker_config={"text_config": model.config.to_dict()})
    return write_checkpoint(folder, config, tensors)


# ----------------------------------------------------------------------------- block-FP8 checkpoints (Qwen3-*-FP8)
FP8_SKIPPED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "shared_expert_gate", "conv1d")


def fp8_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]): each block's amax maps to 448.

    Written block by block (a loop, unlike the vectorised code under test); the last block of a dim that is not
    a multiple of the block is partial."""
    bn, bk = block
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-n // bn), -(-k // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = max(tile.abs().max().item() / 448.0, 1e-12)
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The check's own dequantization of one [N, K] weight, block by block: w = q * scale_inv[block]."""
    bn, bk = block
    w = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scale[i, j]
    return w


def fp8_tensors(state: dict[str, torch.Tensor], block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An on-disk state dict -> (the FP8 checkpoint's tensors, the same weights dequantized). Fused expert tensors
    (`experts.gate_up_proj` [E, 2I, H], hub layout) are quantized expert by expert: scale_inv [E, grid rows, cols].
    scale_dtype: the dtype the scales are stored in (Qwen's FP8 checkpoints ship fp32, bf16 or f16 scales); the
    dequantized weights use the stored (rounded) scales.

    As Qwen's FP8 checkpoints: every linear `X.weight` of attention, MLP, experts, shared expert and Gated
    DeltaNet becomes float8 + `X.weight_scale_inv`; embeddings, norms, router (mlp.gate), shared_expert_gate,
    conv1d and lm_head stay as they are."""
    tensors, dequantized = {}, {}
    for key, t in state.items():
        if re.fullmatch(r".*\.experts\.(gate_up|down)_proj", key):     # fused experts (hub layout): expert by expert
            pairs = [(q, scale.to(scale_dtype)) for q, scale in (fp8_quantize(w, block) for w in t)]
            tensors[key] = torch.stack([q for q, _ in pairs])
            tensors[key + "_scale_inv"] = torch.stack([scale for _, scale in pairs])
            dequantized[key] = torch.stack([fp8_dequantize(q, scale, block) for q, scale in pairs])
        elif key.endswith(".weight") and t.dim() == 2 and not any(s in key for s in FP8_SKIPPED):
            q, scale = fp8_quantize(t, block)
            scale = scale.to(scale_dtype)
            tensors[key], tensors[key + "_scale_inv"] = q, scale
            dequantized[key] = fp8_dequantize(q, scale, block)
        else:
            tensors[key] = dequantized[key] = t
    return tensors, dequantized


def fp8_quantization_config(block: tuple[int, int]) -> dict:
    """config.json's quantization_config of a Qwen FP8 checkpoint."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def fp8_checkpoint(model, folder: Path, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
                   ) -> tuple[Path, dict[str, torch.Tensor]]:
    """A block-FP8 checkpoint of an HF model (per-expert keys, sharded, weight and scale possibly in two files),
    scales stored in scale_dtype: (folder, the dequantized per-expert state dict)."""
    tensors, dequantized = fp8_tensors(per_expert_state_dict(model.state_dict()), block, scale_dtype)
    config = type(model.config).from_dict(model.config.to_dict())
    config.quantization_config = fp8_quantization_config(block)
    write_checkpoint(folder, config, tensors)
    return folder, dequantized


def hf_fp8_model(folder: Path):
    """HF 5.17's own loading of a block-FP8 folder on the CPU: dequantized at load time to fp32.

    FineGrainedFP8Config(dequantize=True) is what lets it load without a GPU (it needs accelerate installed).
    HF derives the block from the scale grid (rows // scale rows): it is exact only when every dim is a multiple
    of the block or smaller than it; a partial last block among several is dequantized with the wrong block."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                dtype=torch.float32, attn_implementation="eager").eval()


def with_state(model, per_expert: dict[str, torch.Tensor]):
    """`model` with its weights replaced by a per-expert state dict (fused back into HF's module layout)."""
    state = {}
    for key in model.state_dict():
        if m := re.fullmatch(r"(.*\.experts)\.gate_up_proj", key):
            n = model.state_dict()[key].shape[0]
            state[key] = torch.stack([torch.cat([per_expert[f"{m.group(1)}.{e}.gate_proj.weight"],
                                                 per_expert[f"{m.group(1)}.{e}.up_proj.weight"]]) for e in range(n)])
        elif m := re.fullmatch(r"(.*\.experts)\.down_proj", key):
            n = model.state_dict()[key].shape[0]
            state[key] = torch.stack([per_expert[f"{m.group(1)}.{e}.down_proj.weight"] for e in range(n)])
        else:
            state[key] = per_expert[key]
    model.load_state_dict(state)
    return model
