"""Shared oracle builders: tiny HF transformers modules with every parameter randomised.

All oracles are fp32 with eager experts / attention (HF gotchas G-1, G-6 in the reference notes).
Transformers is imported here once per grading process.
"""

from __future__ import annotations

import torch
import transformers  # noqa: F401  (imported once per process, before the model modules)
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextConfig,
    Qwen3OmniMoeTextConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextSparseMoeBlock,
    Qwen3OmniMoeThinkerTextSparseMoeBlock,
)

from checks.kit import Rand

transformers.utils.logging.set_verbosity_error()


# ---------------------------------------------------------------------------------------------- MoE

def _moe_kwargs(hidden: int, experts: int, top_k: int, inter: int) -> dict:
    return dict(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=inter, experts_implementation="eager")


def qwen3_moe_block(r: Rand, hidden: int, experts: int, top_k: int, inter: int,
                    norm_topk_prob: bool) -> Qwen3MoeSparseMoeBlock:
    cfg = Qwen3MoeConfig(norm_topk_prob=norm_topk_prob, **_moe_kwargs(hidden, experts, top_k, inter))
    return r.init_(Qwen3MoeSparseMoeBlock(cfg).eval())


def thinker_moe_block(r: Rand, hidden: int, experts: int, top_k: int, inter: int):
    cfg = Qwen3OmniMoeTextConfig(**_moe_kwargs(hidden, experts, top_k, inter))
    return r.init_(Qwen3OmniMoeThinkerTextSparseMoeBlock(cfg).eval())


def talker_moe_block(r: Rand, hidden: int, experts: int, top_k: int, inter: int, shared_inter: int):
    # the talker config does not declare shared_expert_intermediate_size but the block reads it (G-16)
    cfg = Qwen3OmniMoeTalkerTextConfig(shared_expert_intermediate_size=shared_inter,
                                       **_moe_kwargs(hidden, experts, top_k, inter))
    return r.init_(Qwen3OmniMoeTalkerTextSparseMoeBlock(cfg).eval())


def moe_weights_from_hf(block, mod):
    """Build `mod.MoEWeights` (the graded module's dataclass) from an HF sparse MoE block."""
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()   # [E,2I,H], [E,H,I]
    inter = down.shape[-1]
    shared = None
    if hasattr(block, "shared_expert"):
        s = block.shared_expert
        shared = mod.SharedExpert(gate_proj=s.gate_proj.weight.detach(), up_proj=s.up_proj.weight.detach(),
                                  down_proj=s.down_proj.weight.detach(),
                                  gate=block.shared_expert_gate.weight.detach())
    return mod.MoEWeights(router=block.gate.weight.detach(), w_gate=gate_up[:, :inter], w_up=gate_up[:, inter:],
                          w_down=down, top_k=block.gate.top_k, norm_topk_prob=bool(block.gate.norm_topk_prob),
                          shared=shared)


def hf_route(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's own routing decision for x [N, H]: (weights [N, k], ids [N, k])."""
    with torch.no_grad():
        _, weights, ids = block.gate(x)
    return weights, ids


def hf_moe(block, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x[None])[0]
