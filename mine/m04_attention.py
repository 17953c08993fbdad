"""M04 · Attention: QK-norm GQA attention on packed variable-length sequences, and gated attention.

A prefill batch is packed: the tokens of B sequences are concatenated into one [N, ...] tensor and
cu_seqlens ([B+1], int32, prefix sums of the lengths) says where each sequence starts. Attention is
causal inside each sequence and never crosses sequences. With a cached prefix a sequence has Lq new
queries but Lk >= Lq keys; the mask is aligned bottom-right (flash-attn's convention):

    query i of a sequence sees key j  <=>  j <= (Lk - Lq) + i
    o = softmax(q k^T * D^-0.5 + mask) v          scores and softmax in fp32, output in q.dtype
    GQA: kv head j serves query heads j*g .. j*g+g-1   (g = nH // nKV, repeat_interleave)

Qwen3Attention (Qwen3 / Qwen3-MoE / Omni):
    q, k, v = split(x W_qkv^T);  q = RMSNorm_D(q), k = RMSNorm_D(k)  (per head, BEFORE RoPE)
    q, k = RoPE(q, k);  o = attn(q, k, v);  out = o_proj(o)
GatedAttention (Qwen3-Next / Qwen3.5 full-attention layers):
    q_proj rows are interleaved per head: [q_0 | gate_0 | q_1 | gate_1 | ...], each D wide
    q/k norms are (1+w) GemmaRMSNorm, RoPE may be partial (rotary_dim = D/4), the scale stays D^-0.5
    out = o_proj(attn(q, k, v) * sigmoid(gate))      the gate acts before o_proj

Lesson: lessons/m04_attention.md (#4 · 书 §M.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .m01_rmsnorm import GemmaRMSNorm, RMSNorm
from .m02_rope import RotaryEmbedding


@dataclass
class AttentionContext:
    """Per-step batch metadata (flash-attn keyword names). The engine's model runner fills it."""
    cu_seqlens_q: torch.Tensor              # [B+1] int32: query rows of sequence b are cu_q[b]:cu_q[b+1]
    cu_seqlens_k: torch.Tensor              # [B+1] int32: == cu_seqlens_q when there is no cached prefix
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: torch.Tensor | None = None    # paged-KV fields, filled by the model runner (e04)
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    is_prefill: bool = True

    @classmethod
    def from_seqlens(cls, seqlens: list[int]) -> AttentionContext:
        """Packed prefill without a cached prefix: [3, 5] -> cu_seqlens [0, 3, 8]."""
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seqlens, dtype=torch.int32).cumsum(0)
        longest = max(seqlens, default=0)
        return cls(cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=longest, max_seqlen_k=longest)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Nq, nH, D], k/v [Nk, nKV, D], cu_seqlens_q/k [B+1] -> [Nq, nH, D] in q.dtype.

    Causal inside each sequence, aligned bottom-right (query i of a sequence with Lq queries and Lk
    keys sees keys j <= Lk - Lq + i), nothing across sequences; GQA (kv head j serves query heads
    j*g .. j*g+g-1); scores and softmax in fp32. Loops over sequences, never over tokens.
    """
    raise NotImplementedError("m04: 请实现 varlen_attention（见 lessons/m04_attention.md）")


class Attention(nn.Module):
    """The attention backend (nano-vllm's layers/attention.Attention): packed q/k/v in, packed o out.

    Here it is the torch reference that runs anywhere; the engine later gives it a paged KV cache
    (k_cache / v_cache, filled through ctx.slot_mapping) or swaps in a Triton backend.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        """Keep num_heads, head_dim, scale, num_kv_heads; k_cache = v_cache = None until the engine binds a cache."""
        raise NotImplementedError("m04: 请实现 Attention.__init__（见 lessons/m04_attention.md）")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q [N, nH, D], k/v [N, nKV, D] -> [N, nH, D]: varlen_attention over ctx's cu_seqlens."""
        raise NotImplementedError("m04: 请实现 Attention.forward（见 lessons/m04_attention.md）")


class Qwen3Attention(nn.Module):
    """Qwen3 self-attention on a packed batch: qkv_proj -> per-head q/k RMSNorm -> RoPE -> GQA -> o_proj."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rms_norm_eps: float, rotary: RotaryEmbedding):
        """qkv_proj [(nH + 2 nKV) D, H] (rows = cat[q_proj, k_proj, v_proj]), o_proj [H, nH D],
        q_norm / k_norm = RMSNorm(D), rotary, attn = Attention(nH, D, D^-0.5, nKV)."""
        raise NotImplementedError("m04: 请实现 Qwen3Attention.__init__（见 lessons/m04_attention.md）")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """positions [N], hidden_states [N, H] (a packed batch described by ctx) -> [N, H]."""
        raise NotImplementedError("m04: 请实现 Qwen3Attention.forward（见 lessons/m04_attention.md）")


class GatedAttention(nn.Module):
    """Qwen3-Next / Qwen3.5 full attention: per-head [query | gate] q_proj, (1+w) q/k norms, sigmoid gate."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rms_norm_eps: float, rotary: RotaryEmbedding):
        """qkv_proj [(2 nH + 2 nKV) D, H] (rows = cat[q_proj (per head [q_h | gate_h]), k_proj, v_proj]),
        o_proj [H, nH D], q_norm / k_norm = GemmaRMSNorm(D), rotary, attn = Attention(nH, D, D^-0.5, nKV)."""
        raise NotImplementedError("m04: 请实现 GatedAttention.__init__（见 lessons/m04_attention.md）")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """positions [N] or [3, N], hidden_states [N, H] -> [N, H]."""
        raise NotImplementedError("m04: 请实现 GatedAttention.forward（见 lessons/m04_attention.md）")
