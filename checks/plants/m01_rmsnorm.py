"""Planted mistakes for m01_rmsnorm: every 易错点 of lessons/m01_rmsnorm.md as an edit of the reference."""

from checks.plants import Plant

_RMS_CORE = "    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)      # [..., H] fp32; the mean is [..., 1]\n"
_RMS_SCALE = "    return weight * h.to(x.dtype)                                        # cast first, then scale\n"
_GEMMA_SCALE = "    return (h * (1.0 + weight.float())).to(x.dtype)                      # scale in fp32, then cast\n"
_GATED = "    gated = rms_norm(x, weight, eps) * F.silu(z.float())                 # weight, not 1 + weight; silu on z only\n"
_FUSED = ("        residual = x + residual                                          # in x.dtype, like HF's residual + hidden\n"
          "        return rms_norm(residual, self.weight, self.eps), residual\n")

PLANTS = [
    Plant("eps_outside_sqrt", "eps 放在了 sqrt 外面：x / (sqrt(mean(x²)) + eps)",
          old=_RMS_CORE, new="    h = h / (h.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps)\n",
          expect="eps 放在了 sqrt 外面"),
    Plant("sum_not_mean", "用 sum(x²) 代替 mean(x²)",
          old=_RMS_CORE, new="    h = h * torch.rsqrt(h.pow(2).sum(dim=-1, keepdim=True) + eps)\n",
          expect="用了 sum(x²) 而不是 mean(x²)"),
    Plant("subtract_mean", "减了均值（写成了 LayerNorm）",
          old=_RMS_CORE,
          new=("    h = h - h.mean(dim=-1, keepdim=True)\n"
               "    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)\n"),
          expect="减了均值"),
    Plant("qwen3_scale_in_fp32", "Qwen3 norm 先在 fp32 里乘 w 再 cast",
          old=_RMS_SCALE, new="    return (weight * h).to(x.dtype)\n",
          expect="Qwen3 norm 先在 fp32 里乘 w 再 cast"),
    Plant("gemma_cast_first", "Gemma norm 先 cast 再乘 (1+w)",
          old=_GEMMA_SCALE, new="    return (1.0 + weight) * h.to(x.dtype)\n",
          expect="Gemma norm 先 cast 再乘 (1+w)"),
    Plant("gemma_w_not_one_plus_w", "Gemma norm 乘 w 而不是 (1+w)",
          old=_GEMMA_SCALE, new="    return (h * weight.float()).to(x.dtype)\n",
          expect="乘的是 w 而不是 (1+w)"),
    Plant("gated_one_plus_w", "RMSNormGated 用了 (1+w)",
          old=_GATED, new="    gated = rms_norm(x, 1.0 + weight, eps) * F.silu(z.float())\n",
          expect="RMSNormGated 用了 (1+w)"),
    Plant("gated_no_silu", "RMSNormGated 忘了对 z 做 silu",
          old=_GATED, new="    gated = rms_norm(x, weight, eps) * z.float()\n",
          expect="忘了对 z 做 silu"),
    Plant("gated_silu_on_x", "RMSNormGated 把 silu 用在了 x 上",
          old=_GATED, new="    gated = F.silu(rms_norm(x, weight, eps).float()) * z.float()\n",
          expect="把 silu 用在了 x"),
    Plant("gated_gate_before_norm", "RMSNormGated 先门控再 norm（norm(x·silu(z))）",
          old=_GATED, new="    gated = rms_norm(x.float() * F.silu(z.float()), weight, eps)\n",
          expect="先门控再 norm"),
    Plant("fused_returns_pre_add_residual", "fused 形式返回相加前的 residual",
          old=_FUSED, new="        return rms_norm(x + residual, self.weight, self.eps), residual\n",
          expect="返回了相加前的 residual"),
    Plant("fused_norms_pre_add_x", "fused 形式对相加前的 x 做 norm",
          old=_FUSED, new="        return rms_norm(x, self.weight, self.eps), x + residual\n",
          expect="对相加前的 x 做了 norm"),
    Plant("module_ignores_self_eps", "模块没有用 self.eps（用了默认的 1e-6）",
          old="            return rms_norm(x, self.weight, self.eps)                    # first layer: the caller keeps x\n",
          new="            return rms_norm(x, self.weight, 1e-6)\n",
          expect="self.eps"),
    Plant("fused_residual_fp32", "residual 在 fp32 里相加并以 fp32 返回",
          old=_FUSED,
          new="        residual = x.float() + residual.float()\n"
              "        return rms_norm(residual, self.weight, self.eps).to(x.dtype), residual\n",
          expect="residual 在 fp32 里相加并以 fp32 返回"),
    Plant("fused_norms_unrounded_fp32_sum", "在 fp32 里相加后对未舍入的和做 norm（nano-vllm 的写法）",
          old=_FUSED,
          new="        total = x.float() + residual.float()\n"
              "        return rms_norm(total, self.weight, self.eps).to(x.dtype), total.to(x.dtype)\n",
          expect="对未舍入的和做 norm"),
]
