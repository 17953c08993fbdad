"""M06 · Models and loading: the Qwen3-family decoders built from m01-m05, and an HF checkpoint loader.

Every model takes a packed batch, the engine's layout: input_ids [N], positions [N] and the
AttentionContext of m04 (cu_seqlens of the B sequences). One decoder layer:

    x, residual = input_layernorm(x, residual)            fused add + norm (first layer: residual = x)
    x = self_attn(positions, x, ctx)  |  linear_attn(x, ctx.cu_seqlens_q, gdn_state)
    x, residual = post_attention_layernorm(x, residual)
    x = mlp(x)                                            dense SwiGLU or sparse MoE (m03)

| model_type                         | norm          | token mixer                          | MLP                       |
|------------------------------------|---------------|--------------------------------------|---------------------------|
| qwen3                              | RMSNorm       | Qwen3Attention                       | dense                     |
| qwen3_moe, qwen3_omni_moe_text     | RMSNorm       | Qwen3Attention                       | MoE (decoder_sparse_step) |
| qwen3_5_text                       | (1+w) norm    | GatedDeltaNet / GatedAttention       | dense                     |
| qwen3_5_moe_text                   | (1+w) norm    | GatedDeltaNet / GatedAttention       | MoE + shared expert       |

Loading maps each checkpoint key to a parameter (and, for packed parameters, a shard of it):
q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj, experts.{e}.* -> the fused expert tensors;
`model.language_model.` and `thinker.` prefixes are stripped, vision / audio / mtp / talker keys skipped.

Block-FP8 checkpoints (Qwen3-*-FP8; config.json has a quantization_config with quant_method "fp8"): each
converted linear ships `X.weight` float8_e4m3fn [N, K] and `X.weight_scale_inv` [ceil(N/bn), ceil(K/bk)]
(fp32, bf16 or fp16) for weight_block_size [bn, bk], w[n, k] = w_fp8[n, k] * scale_inv[n // bn, k // bk]
(the last block of a dim that is not a multiple of the block is partial). The loader dequantizes such a pair
before the usual mapping.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .m01_rmsnorm import GemmaRMSNorm, RMSNorm
from .m02_rope import RotaryEmbedding, rope_from_config
from .m03_sparse_moe import MoEWeights, SharedExpert, moe_forward
from .m04_attention import AttentionContext, GatedAttention, Qwen3Attention
from .m05_gated_deltanet import GatedDeltaNet, GDNState

# checkpoint module name -> (our packed module, shard): one matmul where HF has two or three
PACKED_MODULES_MAPPING = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "thinker.audio_tower.", "thinker.visual.", "talker.",
                    "code2wav.")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the key."""


class MLP(nn.Module):
    """Dense SwiGLU with gate and up packed into one matmul: gate_up_proj [2I, H], down_proj [H, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> [N, H]: down(silu(gate) * up), gate and up the two halves of gate_up_proj(x)."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)          # [N, I] each
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    """All routed experts as two fused tensors (HF 5.x layout): gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    """Router `gate` [E, H], the experts, and (Qwen3.5-MoE) a sigmoid-gated shared expert."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool, shared_intermediate_size: int = 0):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = MLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> [N, H] through m03's moe_forward, the weights passed as views (no copies)."""
        gate_up, inter = self.experts.gate_up_proj, self.experts.down_proj.shape[-1]
        shared = None
        if self.shared_expert is not None:
            s_gate, s_up = self.shared_expert.gate_up_proj.weight.chunk(2, dim=0)
            shared = SharedExpert(gate_proj=s_gate, up_proj=s_up, down_proj=self.shared_expert.down_proj.weight,
                                  gate=self.shared_expert_gate.weight)
        w = MoEWeights(router=self.gate.weight, w_gate=gate_up[:, :inter], w_up=gate_up[:, inter:],
                       w_down=self.experts.down_proj, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
                       shared=shared)
        return moe_forward(x, w)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer; which mixer, norm and MLP it holds depends on the model family."""

    def __init__(self, config, layer_idx: int, hybrid: bool, moe_every_layer: bool, rotary: RotaryEmbedding):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        norm = GemmaRMSNorm if hybrid else RMSNorm
        self.input_layernorm, self.post_attention_layernorm = norm(h, eps), norm(h, eps)
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        self.is_linear = hybrid and config.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(h, config.linear_num_key_heads, config.linear_num_value_heads,
                                             config.linear_key_head_dim, config.linear_value_head_dim,
                                             config.linear_conv_kernel_dim, eps)
        else:
            attention = GatedAttention if hybrid else Qwen3Attention
            self.self_attn = attention(h, config.num_attention_heads, config.num_key_value_heads, head_dim, eps,
                                       rotary)
        num_experts = getattr(config, "num_experts", 0) or 0
        sparse = num_experts > 0 and (moe_every_layer or (
            layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and (layer_idx + 1) % config.decoder_sparse_step == 0))
        if sparse:
            self.mlp = SparseMoeBlock(h, num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                                      norm_topk_prob=moe_every_layer or config.norm_topk_prob,
                                      shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0))
        else:
            self.mlp = MLP(h, config.intermediate_size)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                ctx: AttentionContext, gdn_state: GDNState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, H] in, (hidden_states, residual) out; residual is None for the first layer."""
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.is_linear:
            hidden_states = self.linear_attn(hidden_states, ctx.cu_seqlens_q, gdn_state)
        else:
            hidden_states = self.self_attn(positions, hidden_states, ctx)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Backbone(nn.Module):
    """`model.*` of the checkpoint: embed_tokens, layers, norm."""

    def __init__(self, config, hybrid: bool, moe_every_layer: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary = rope_from_config(config)     # one fp32 cos/sin table shared by every attention layer
        self.layers = nn.ModuleList(DecoderLayer(config, i, hybrid, moe_every_layer, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = (GemmaRMSNorm if hybrid else RMSNorm)(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A causal LM over a packed batch. Subclasses fix the family; the registry maps model_type to them."""
    hybrid = False            # Gated DeltaNet + gated attention, (1+w) norms
    moe_every_layer = False   # Qwen3.5-MoE: every layer MoE, router always renormalises, shared expert

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Backbone(config, self.hybrid, self.moe_every_layer)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def linear_layer_ids(self) -> list[int]:
        """Indices of the Gated DeltaNet layers (they need a GDNState each from the engine)."""
        return [i for i, layer in enumerate(self.model.layers) if layer.is_linear]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                gdn_states: dict[int, GDNState] | None = None) -> torch.Tensor:
        """input_ids [N], positions [N] -> final hidden states [N, H] (after the final norm).

        gdn_states maps a linear-attention layer index to the state of the batch's sequences
        (None: every sequence starts from zero and nothing is kept).
        """
        hidden_states, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            state = gdn_states.get(i) if gdn_states is not None else None
            hidden_states, residual = layer(positions, hidden_states, residual, ctx, state)
        hidden_states, _ = self.model.norm(hidden_states, residual)
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V]."""
        return self.lm_head(hidden_states)


class Qwen3ForCausalLM(CausalLM):
    pass


class Qwen3MoeForCausalLM(CausalLM):
    pass


class Qwen3_5ForCausalLM(CausalLM):
    hybrid = True


class Qwen3_5MoeForCausalLM(CausalLM):
    hybrid, moe_every_layer = True, True


MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3_omni_moe_text": Qwen3MoeForCausalLM,   # the Omni thinker's text model is a Qwen3-MoE (text positions)
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
}


def text_config(config):
    """The text part of a wrapper config (qwen3_5 / qwen3_5_moe: text_config; qwen3_omni_moe: the thinker's).

    A wrapper may set tie_word_embeddings at its own level (HF ties from there): it is carried over, and so
    is its quantization_config (an FP8 checkpoint of a wrapper model states it at the top level).
    """
    quantization = getattr(config, "quantization_config", None)
    if getattr(config, "thinker_config", None) is not None:
        config = config.thinker_config
    inner = getattr(config, "text_config", None)
    if inner is not None:
        if getattr(config, "tie_word_embeddings", False):
            inner.tie_word_embeddings = True
        config = inner
    if quantization is not None and getattr(config, "quantization_config", None) is None:
        config.quantization_config = quantization
    return config


def build_model(config) -> CausalLM:
    """The model for config.model_type (a wrapper config is unwrapped first), weights uninitialised."""
    config = text_config(config)
    if config.model_type not in MODEL_REGISTRY:
        raise CheckpointError(f"unsupported model_type {config.model_type!r}; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[config.model_type](config)


def map_checkpoint_key(key: str) -> tuple[str, tuple] | None:
    """A checkpoint key -> (parameter name in our model, shard), or None for keys we skip.

    shard is () for a whole tensor, ("q",) / ("k",) / ("v",) for qkv_proj, (0,) / (1,) for gate/up in
    gate_up_proj, ("expert", e, "gate" | "up" | "down") for one expert of the fused expert tensors.
    """
    if key.startswith(SKIPPED_PREFIXES):
        return None
    key = re.sub(r"^(thinker\.)?model\.language_model\.", "model.", key)
    key = key.removeprefix("thinker.")
    if m := re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", key):
        target = "gate_up_proj" if m.group(3) != "down" else "down_proj"
        return f"{m.group(1)}.{target}", ("expert", int(m.group(2)), m.group(3))
    module, _, param = key.rpartition(".")               # "model.layers.0.self_attn.q_proj", "weight"
    parent, _, leaf = module.rpartition(".")            # "model.layers.0.self_attn", "q_proj"
    if leaf in PACKED_MODULES_MAPPING:                   # q/k/v -> qkv_proj, gate/up -> gate_up_proj
        packed, shard = PACKED_MODULES_MAPPING[leaf]
        return f"{parent}.{packed}.{param}", (shard,)
    return key, ()


def shard_view(model: CausalLM, name: str, param: torch.Tensor, shard: tuple) -> torch.Tensor:
    """The slice of `param` that a shard of a packed checkpoint tensor fills."""
    if not shard:
        return param
    if shard[0] == "expert":
        _, e, part = shard
        if part == "down":
            return param[e]
        inter = param.shape[1] // 2
        return param[e, :inter] if part == "gate" else param[e, inter:]
    if shard[0] in ("q", "k", "v"):
        attn = model.get_submodule(name.rsplit(".", 2)[0])
        q_rows = param.shape[0] - 2 * attn.kv_size
        start = {"q": 0, "k": q_rows, "v": q_rows + attn.kv_size}[shard[0]]
        return param[start:start + (q_rows if shard[0] == "q" else attn.kv_size)]
    half = param.shape[0] // 2
    return param[:half] if shard[0] == 0 else param[half:]


def fp8_block_size(config) -> tuple[int, int]:
    """weight_block_size of the config's quantization_config (a dict or an HF config object); (128, 128) if unset."""
    quantization = getattr(config, "quantization_config", None) or {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    bn, bk = quantization.get("weight_block_size") or (128, 128)
    return int(bn), int(bk)


def dequantize_block_fp8(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_fp8 [..., N, K] float8, scale_inv [..., ceil(N/bn), ceil(K/bk)] -> w [..., N, K] in dtype.

    w[n, k] = w_fp8[n, k] * scale_inv[n // bn, k // bk], computed in fp32; leading dims (stacked experts) pass
    through. The last block row / column is partial when N / K is not a multiple of the block.
    """
    bn, bk = block
    n, k = w_fp8.shape[-2:]
    scale = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (w_fp8.float() * scale).to(dtype)


def load_checkpoint(model: CausalLM, path: str | Path) -> None:
    """Fill every parameter of `model` from the *.safetensors files of an HF folder (sharded or not).

    A parameter with a `weight_loader(param, tensor, shard) -> number of values written` attribute
    (the tensor-parallel layers of m07) receives the full checkpoint tensor and keeps its own part.
    Block-FP8 weights are dequantized first: a key `X.weight` whose sibling `X.weight_scale_inv` exists (in any
    file of the folder) becomes dequantize_block_fp8(weight, scale, the config's weight_block_size) and the scale
    key is consumed with it. Raises CheckpointError naming the key for an unexpected key, a shape mismatch, a
    parameter (or part of a packed one) that no key filled, a float8 weight without its scale, a scale whose
    shape does not match its weight's block grid, or a scale (`*_scale_inv`) with no weight beside it. Scales may
    be stored in fp32, bf16 or f16 (Qwen's FP8 checkpoints ship each).
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    params = dict(model.named_parameters())   # tied weights appear once, under embed_tokens
    filled: dict[str, int] = {name: 0 for name in params}
    block = fp8_block_size(model.config)
    with ExitStack() as stack:
        where = {}                            # key -> (open file, file); a weight and its scale may sit in two files
        for file in files:
            f = stack.enter_context(safe_open(file, framework="pt"))
            where.update({key: (f, file) for key in f.keys()})
        for key, (f, file) in where.items():
            if key.endswith("_scale_inv") and key.removesuffix("_scale_inv") in where:
                continue                      # read together with its weight
            mapped = map_checkpoint_key(key)
            if mapped is None:
                continue
            if key.endswith("_scale_inv"):        # a scale whose weight is not in the checkpoint
                raise CheckpointError(f"stray scale {key!r}: no weight {key.removesuffix('_scale_inv')!r} beside it "
                                      f"in the checkpoint ({file.name})")
            name, shard = mapped
            if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                continue
            if name not in params:
                raise CheckpointError(f"unexpected key {key!r} (mapped to {name!r}) in {file.name}")
            tensor = f.get_tensor(key)
            if key + "_scale_inv" in where:
                scale = where[key + "_scale_inv"][0].get_tensor(key + "_scale_inv")
                grid = [*tensor.shape[:-2], -(-tensor.shape[-2] // block[0]), -(-tensor.shape[-1] // block[1])]
                if list(scale.shape) != grid:
                    raise CheckpointError(f"shape mismatch for {key + '_scale_inv'!r}: {list(scale.shape)}, expected "
                                          f"{grid} for weight {list(tensor.shape)} in blocks of {list(block)}")
                tensor = dequantize_block_fp8(tensor, scale, block)
            elif tensor.dtype == torch.float8_e4m3fn:
                raise CheckpointError(f"float8 weight {key!r} has no {key + '_scale_inv'!r} in the checkpoint")
            loader = getattr(params[name], "weight_loader", None)
            if loader is not None:            # a tensor-parallel parameter (m07) keeps only its own shard
                filled[name] += loader(params[name], tensor, shard)
                continue
            target = shard_view(model, name, params[name].data, shard)
            if tensor.shape != target.shape:
                raise CheckpointError(f"shape mismatch for {key!r}: checkpoint {list(tensor.shape)}, "
                                      f"model {name!r}{list(shard) if shard else ''} {list(target.shape)}")
            target.copy_(tensor)
            filled[name] += target.numel()
    for name, param in params.items():
        if filled[name] != param.numel():
            raise CheckpointError(f"missing key for {name!r}: {filled[name]} of {param.numel()} values loaded")


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build the model of an HF folder (config.json + safetensors) and load its weights."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)            # build in the target dtype: no fp32 copy of a large model
    try:
        model = build_model(config)
    finally:
        torch.set_default_dtype(default)
    load_checkpoint(model, path)
    return model.eval()


def init_dummy_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> CausalLM:
    """Random weights at a sensible scale, for tests and benchmarks that have no checkpoint."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:          # RMSNorm 1 (+noise), (1+w) norms 0 (+noise): both near identity
                base = 0.0 if isinstance(model.get_submodule(name.rsplit(".", 1)[0]), GemmaRMSNorm) else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            elif leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif leaf == "dt_bias":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model
