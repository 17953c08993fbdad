"""M02 · RoPE family: cos/sin cache, rotate-half, partial rotary, interleaved MRoPE (lesson m02, 书 §M.2).

Plain RoPE (HF Qwen3RotaryEmbedding + apply_rotary_pos_emb; vLLM RotaryEmbedding, neox style):
    R            = rotary_dim (= head_dim unless partial)
    inv_freq[i]  = 1 / base^(2i / R)                      i = 0 .. R/2 - 1, fp32
    angle[p, i]  = p * inv_freq[i]                        fp32, computed once for p = 0 .. max_position - 1
    cache[p]     = [cos(angle[p, :]) | sin(angle[p, :])]  [max_position, R]
    x = [x1 | x2] (the two halves of the first R dims of one head):
        out1 = x1 * cos - x2 * sin
        out2 = x2 * cos + x1 * sin                        = x * [cos|cos] + rotate_half(x) * [sin|sin]
    Dim i is paired with dim i + R/2 ("rotate-half", NeoX style), not with its neighbour (2i, 2i+1).

Partial rotary (Qwen3.5: partial_rotary_factor 0.25): R = int(head_dim * factor); the frequencies use R,
not head_dim, and dims R .. head_dim-1 pass through untouched.

Interleaved MRoPE (Qwen3.5 sections [11, 11, 10], Qwen3-Omni thinker [24, 20, 20]): every token has
three positions (t, h, w); frequency i takes its angle from axis
    H if i % 3 == 1 and i < 3 * sec[1];   W if i % 3 == 2 and i < 3 * sec[2];   T otherwise.
Text tokens have t = h = w, so every frequency sees the same position: exactly 1-D RoPE.

Serving layout: q [N, heads, head_dim] packs the tokens of many sequences; positions [N] (or [3, N])
says where each token sits in its own sequence, so one cache lookup serves prefill and decode alike.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# HF's default sections when a config does not spell them out (Qwen3.5 text, Qwen3-Omni thinker text)
DEFAULT_MROPE_SECTION = {
    "qwen3_5_text": [11, 11, 10],
    "qwen3_5_moe_text": [11, 11, 10],
    "qwen3_omni_moe_text": [24, 20, 20],
}


def rotate_half(x: Tensor) -> Tensor:
    """x [..., R] -> [..., R]: [x1 | x2] -> [-x2 | x1], halves of the last dim (HF's rotate_half)."""
    raise NotImplementedError("m02: 请实现 rotate_half（见 lessons/m02_rope.md）")


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, heads, R], cos/sin [N, R // 2] fp32 -> [N, heads, R] in x.dtype.

    Rotate-half pairing: dim i and dim i + R/2 form one 2-D pair turned by angle i; every head of a
    token uses the same angles. The arithmetic runs in fp32 and the result is cast back to x.dtype.
    """
    raise NotImplementedError("m02: 请实现 apply_rotary（见 lessons/m02_rope.md）")


def mrope_axes(num_freqs: int, mrope_section: list[int]) -> Tensor:
    """[num_freqs] int64 in {0, 1, 2}: the axis (T, H, W) whose position drives each frequency.

    Interleaved rule (HF Qwen3.5 / Qwen3-Omni): H if i % 3 == 1 and i < 3 * sec[1],
    W if i % 3 == 2 and i < 3 * sec[2], T otherwise. [2, 1, 1] -> [0, 1, 2, 0].
    """
    raise NotImplementedError("m02: 请实现 mrope_axes（见 lessons/m02_rope.md）")


class RotaryEmbedding(nn.Module):
    """RoPE for packed q/k: one fp32 cos/sin table, looked up by each token's position.

    Attributes: head_dim, rotary_dim, max_position, base, mrope_section (None for 1-D RoPE);
    buffer cos_sin_cache [max_position, rotary_dim] fp32 = [cos | sin]; with mrope_section also
    buffer mrope_axis [rotary_dim] int64 (the axis of each cache column).
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 mrope_section: list[int] | None = None):
        """Build the fp32 cos/sin cache once; explicit fp32 so a bf16 default dtype cannot leak in."""
        raise NotImplementedError("m02: 请实现 RotaryEmbedding.__init__（见 lessons/m02_rope.md）")

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """positions [N] int64 (or [3, N] t/h/w with mrope_section); q [N, nH, head_dim], k [N, nKV, head_dim].

        Returns (q, k) rotated, in their input dtypes; only the first rotary_dim dims of each head
        rotate, the rest pass through. Positions are per token: packed sequences and decode tokens
        at any position work the same way.
        """
        raise NotImplementedError("m02: 请实现 RotaryEmbedding.forward（见 lessons/m02_rope.md）")


def rope_from_config(config) -> RotaryEmbedding:
    """The RotaryEmbedding of an HF text config (Qwen3, Qwen3-MoE, Qwen3.5 (MoE) text, Omni thinker text).

    head_dim: config.head_dim, else hidden_size // num_attention_heads. rotary_dim: int(head_dim *
    partial_rotary_factor) (from rope_parameters, else the attribute, else 1.0). base: rope_parameters
    ["rope_theta"]. mrope_section: rope_parameters["mrope_section"], else HF's default for the model type.
    """
    raise NotImplementedError("m02: 请实现 rope_from_config（见 lessons/m02_rope.md）")
