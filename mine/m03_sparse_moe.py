"""M03 · Sparse MoE: routing, grouped per-expert compute, the sigmoid-gated shared expert.

Routing (identical to HF transformers):
    logits = x @ router.T                        [N, E]
    probs  = softmax(logits, fp32) over all E    [N, E]
    w, ids = topk(probs, k)                      softmax first, then top-k
    w      = w / w.sum(-1) if norm_topk_prob     renormalise in fp32, then cast to x.dtype

    out[n] = sum_j w[n, j] * Expert_{ids[n, j]}(x[n]),   Expert(h) = (silu(h Wg^T) * (h Wu^T)) Wd^T
    talker: out += sigmoid(x @ gate.T) * SharedExpert(x)  (one scalar gate per token)

The serving way (a CPU version of vLLM's FusedMoE "align tokens to experts + grouped GEMM"): sort the
N*k (token, slot) pairs by expert, count them per expert, run one SwiGLU per expert on exactly the
tokens routed to it, and scatter-add the weighted results back to their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SharedExpert:
    """The talker's shared expert: a SwiGLU MLP every token goes through, scaled by a scalar gate."""
    gate_proj: torch.Tensor   # [I_s, H]
    up_proj: torch.Tensor     # [I_s, H]
    down_proj: torch.Tensor   # [H, I_s]
    gate: torch.Tensor        # [1, H]: sigmoid(x @ gate.T) is one scalar per token


@dataclass
class MoEWeights:
    """Everything one sparse MoE block needs; weights are in F.linear layout [out, in]."""
    router: torch.Tensor      # [E, H]
    w_gate: torch.Tensor      # [E, I, H]
    w_up: torch.Tensor        # [E, I, H]
    w_down: torch.Tensor      # [E, H, I]
    top_k: int
    norm_topk_prob: bool
    shared: SharedExpert | None = None   # None for the Omni thinker and Qwen3-MoE


def route(x: torch.Tensor, router: torch.Tensor, top_k: int,
          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H], router [E, H] -> (weights [N, k] in x.dtype, ids [N, k] int64).

    Softmax in fp32 over ALL E experts, then top-k; renormalise the k weights (in fp32) when
    norm_topk_prob is set; return the weights in x.dtype.
    """
    raise NotImplementedError("m03: 请实现 route（见 lessons/m03_sparse_moe.md）")


def swiglu(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """h [n, H], w_gate/w_up [I, H], w_down [H, I] -> [n, H]: (silu(h Wg^T) * (h Wu^T)) Wd^T."""
    raise NotImplementedError("m03: 请实现 swiglu（见 lessons/m03_sparse_moe.md）")


def moe_forward(x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """x [N, H] -> [N, H]: routed experts (+ the gated shared expert when w.shared is set).

    The serving way: flatten the N*k (token, slot) pairs, stable-argsort them by expert id, bincount
    per expert, run one swiglu per non-empty expert on exactly its tokens, scale by the routing
    weight and index_add_ back into out. No loop over tokens; no expert computes on all N tokens.
    """
    raise NotImplementedError("m03: 请实现 moe_forward（见 lessons/m03_sparse_moe.md）")
