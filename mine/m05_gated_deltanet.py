"""M05 · Gated DeltaNet: causal conv, the gated delta rule (recurrent and chunked WY form), the layer.

The token mixer of Qwen3.5's linear-attention layers. Per value head it keeps a fixed-size state
S [dk, dv] instead of a growing KV cache:

    g_t    = -exp(A_log) * softplus(a_t + dt_bias)              log-decay, fp32, <= 0
    beta_t = sigmoid(b_t)                                       write strength in (0, 1)
    q_t, k_t = l2norm(q_t) * dk^-0.5, l2norm(k_t)               eps 1e-6 inside the rsqrt of the SUM
    S      = exp(g_t) * S                                       1. decay
    u_t    = beta_t * (v_t - k_t^T S)                           2. read what S predicts for k_t: the error
    S      = S + k_t u_t^T                                      3. write the correction
    o_t    = S^T q_t                                            4. read with the query

The chunked (WY) form computes the same thing chunk by chunk with a few matmuls: inside a chunk the
corrections u solve a unit lower-triangular system, and only the state crosses chunk boundaries.

Before the rule: a causal depthwise conv1d (kernel K, no bias) + silu over the packed [q | k | v]
channels, whose decode form keeps the last K-1 inputs of each sequence (conv_state).
After it: RMSNormGated per value head (w * norm(o) * silu(z)) and out_proj.

Shapes: N packed tokens of B sequences (cu_seqlens [B+1]), C = 2*nk*dk + nv*dv conv channels,
nk/nv key/value heads, dk/dv head dims, H (in the rule functions) = number of heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .m01_rmsnorm import RMSNormGated


def causal_conv1d(x: Tensor, weight: Tensor, cu_seqlens: Tensor,
                  conv_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Prefill: x [N, C] packed tokens, weight [C, K], cu_seqlens [B+1], conv_state [B, C, K-1] or None.

    Returns (silu(causal depthwise conv(x)) [N, C], new conv_state [B, C, K-1]). Output t of a
    sequence sees its inputs t-K+1..t, reaching into conv_state (zeros when None) before its start;
    the new state is the last K-1 inputs of each sequence, initial state included when it is short.
    """
    raise NotImplementedError("m05: 请实现 causal_conv1d（见 lessons/m05_gated_deltanet.md）")


def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor) -> Tensor:
    """Decode: x [B, C] (one token per sequence), conv_state [B, C, K-1] updated in place, weight [C, K].

    Returns silu(conv) [B, C] over the window [conv_state, x].
    """
    raise NotImplementedError("m05: 请实现 causal_conv1d_update（见 lessons/m05_gated_deltanet.md）")


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """a, b [N, nv]; A_log, dt_bias [nv] -> (g [N, nv] fp32 log-decay <= 0, beta [N, nv] in b.dtype)."""
    raise NotImplementedError("m05: 请实现 gdn_gates（见 lessons/m05_gated_deltanet.md）")


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x [..., d] -> fp32 x * rsqrt(sum(x^2, -1) + eps)."""
    raise NotImplementedError("m05: 请实现 l2norm（见 lessons/m05_gated_deltanet.md）")


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule (the decode form).

    q, k [B, T, H, dk] (L2-normalised; q already scaled by dk^-0.5), v [B, T, H, dv], g, beta [B, T, H],
    initial_state [B, H, dk, dv] or None (zeros). Returns (o [B, T, H, dv] in v.dtype, final state fp32).
    """
    raise NotImplementedError("m05: 请实现 recurrent_gated_delta_rule（见 lessons/m05_gated_deltanet.md）")


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The same rule in chunked WY form (the prefill form): matmuls inside a chunk, a loop over chunks.

    Same arguments and results as recurrent_gated_delta_rule. T need not be a multiple of chunk_size.
    """
    raise NotImplementedError("m05: 请实现 chunk_gated_delta_rule（见 lessons/m05_gated_deltanet.md）")


@dataclass
class GDNState:
    """Per-sequence state of one GatedDeltaNet layer for the B sequences of a batch, updated in place."""
    conv: Tensor   # [B, C, K-1]     last K-1 conv inputs of each sequence
    ssm: Tensor    # [B, nv, dk, dv] recurrent state, fp32


class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear-attention layer on packed sequences; parameter names as HF Qwen3_5GatedDeltaNet."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel_size: int, rms_norm_eps: float):
        """Parameters (names and shapes as HF, so loading a checkpoint is a name lookup):
        in_proj_qkv [C, hidden] (C = 2*nk*dk + nv*dv, rows [q_all | k_all | v_all]), in_proj_z [nv*dv, hidden],
        in_proj_b / in_proj_a [nv, hidden] (nn.Linear, no bias); conv1d depthwise nn.Conv1d, weight [C, 1, K],
        no bias; A_log, dt_bias [nv]; norm = RMSNormGated(dv, eps); out_proj [hidden, nv*dv].
        """
        raise NotImplementedError("m05: 请实现 GatedDeltaNet.__init__（见 lessons/m05_gated_deltanet.md）")

    def forward(self, hidden_states: Tensor, cu_seqlens: Tensor, state: GDNState | None = None) -> Tensor:
        """hidden_states [N, hidden] (B packed sequences, cu_seqlens [B+1]) -> [N, hidden].

        state None: every sequence starts from zeros and nothing is kept. Otherwise state holds each
        sequence's conv / recurrent state and is overwritten with its final state; when every
        sequence brings exactly one token (decode) the single-step forms are used.
        """
        raise NotImplementedError("m05: 请实现 GatedDeltaNet.forward（见 lessons/m05_gated_deltanet.md）")
