"""M01 · The RMSNorm family: Qwen3 RMSNorm, the fused residual form, the Gemma-style (1+w) norm, RMSNormGated.

All three norms share one core, computed in fp32 over the last dim (H):

    n = x_f32 * rsqrt(mean(x_f32^2, -1) + eps)          eps INSIDE the sqrt, MEAN (not sum) of squares

and differ only in the scale and in where the cast back to the input dtype happens:

    Qwen3 / Qwen3-MoE / Omni   (Qwen3RMSNorm)          w * n.to(x.dtype)                 cast first, then scale
    Qwen3-Next / Qwen3.5        (Qwen3_5RMSNorm)        (n * (1 + w.f32)).to(x.dtype)     scale in fp32, then cast
    Gated DeltaNet output       (Qwen3_5RMSNormGated)   ((w * n.to(x.dtype)) * silu(z.f32)).to(x.dtype)

Weights start at ones for the first and the last, at zeros for the (1+w) norm (so every norm starts as the
identity scale). In fp32 the two cast orders agree; in bf16 they differ in the last bit, so each must be
reproduced exactly to be bit-identical to HF.

The fused residual form (vLLM / nano-vllm decoders): norm(x, residual) -> (norm(x + residual), x + residual).
The decoder's first layer calls norm(x) with no residual and keeps x itself as the residual. The sum is taken
in x.dtype, exactly like HF's `hidden_states = residual + hidden_states`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm. x [..., H], weight [H] -> [..., H] (dtype of weight * x, i.e. x.dtype for a model in one dtype)."""
    raise NotImplementedError("m01: 请实现 rms_norm（见 lessons/m01_rmsnorm.md）")


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred (1+w) norm of Qwen3-Next / Qwen3.5. x [..., H], weight [H] (starts at 0) -> [..., H] in x.dtype."""
    raise NotImplementedError("m01: 请实现 gemma_rms_norm（见 lessons/m01_rmsnorm.md）")


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: w * norm(x) * silu(z). x, z [..., D], weight [D] (starts at 1) -> [..., D] in x.dtype."""
    raise NotImplementedError("m01: 请实现 rms_norm_gated（见 lessons/m01_rmsnorm.md）")


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm with the fused residual protocol of vLLM / nano-vllm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> normed [..., H]; with residual [..., H] -> (normed(x + residual), x + residual)."""
        raise NotImplementedError("m01: 请实现 RMSNorm.forward（见 lessons/m01_rmsnorm.md）")


class GemmaRMSNorm(nn.Module):
    """The (1+w) norm (Qwen3-Next / Qwen3.5 layer norms and q/k norms), same residual protocol as RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))            # zeros: 1 + w starts as the identity

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> normed [..., H]; with residual [..., H] -> (normed(x + residual), x + residual)."""
        raise NotImplementedError("m01: 请实现 GemmaRMSNorm.forward（见 lessons/m01_rmsnorm.md）")


class RMSNormGated(nn.Module):
    """The output norm of Gated DeltaNet, applied per value head: w * norm(x) * silu(z)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))             # ones: this one is NOT a (1+w) norm

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x [..., D] (core attention output), z [..., D] (the gate) -> [..., D] in x.dtype."""
        raise NotImplementedError("m01: 请实现 RMSNormGated.forward（见 lessons/m01_rmsnorm.md）")
