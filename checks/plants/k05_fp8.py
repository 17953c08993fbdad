"""Every 易错点 of lessons/k05_fp8.md, planted into a copy of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("scale_is_amax", "scale 取了 amax，少了除以 448",
          old="    scale = tl.where(amax > 0, amax / 448.0, 1.0)                           # an all-zero group: scale 1\n",
          new="    scale = tl.where(amax > 0, amax, 1.0)\n",
          expect="少了除以 448"),
    Plant("zero_group_scale", "全零 group 的 scale 为 0（x / 0 得到 NaN）",
          old="    scale = tl.where(amax > 0, amax / 448.0, 1.0)                           # an all-zero group: scale 1\n",
          new="    scale = amax / 448.0\n",
          expect="scale 为 0"),
    Plant("zero_block_scale", "全零 block 的 scale 为 0（quantize_block_fp8）",
          old="    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))\n",
          new="    scale = amax / FP8_MAX\n",
          expect="scale 为 0"),
    Plant("block_scale_is_amax", "scale 取了 amax，少了除以 448（quantize_block_fp8）",
          old="    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))\n",
          new="    scale = torch.where(amax > 0, amax, torch.ones_like(amax))\n",
          expect="少了除以 448"),
    Plant("per_tensor_scale", "scale 不是按 128×128 block 取的（一个张量一个 scale）",
          old="    amax = blocks.abs().amax(dim=(-3, -1))                                  # [..., nb, kb]\n",
          new="    amax = blocks.abs().amax(dim=(-4, -3, -2, -1))[..., None, None]\n",
          expect="不是按 128×128 block 取的"),
    Plant("no_round_helper", "直接 .to(fp8)，没有先用 _round_e4m3 舍入（解释器里不是最近偶数）",
          old="    q = _round_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0))\n",
          new="    q = tl.clamp(x / scale[:, None], -448.0, 448.0)\n",
          expect="最近偶数"),
    Plant("act_tail_unmasked", "最后一个 group 的 load 没有 mask",
          old="    x = tl.load(x_ptr + r64 * stride_xt + offs[None, :] * stride_xk, mask=ok, other=0.0).to(tl.float32)\n",
          new="    x = tl.load(x_ptr + r64 * stride_xt + offs[None, :] * stride_xk, mask=(rows < T)[:, None], other=0.0)"
              ".to(tl.float32)\n",
          expect="没有 mask"),
    Plant("act_stride_from_shape", "x 的行 stride 按形状推了",
          old="            x, q, s, num_tokens, k, x.stride(0), x.stride(1), q.stride(0),",
          new="            x, q, s, num_tokens, k, k, 1, q.stride(0),",
          expect="stride 按形状推了"),
    Plant("scale_row_forgotten", "scale 只按 K 取了列，漏了行号 n // 128（所有 n 用第 0 行）",
          old="    ws_ptrs = ws_ptr + (offs_n // SCALE_BLOCK) * stride_wsn                                         # [BN]\n",
          new="    ws_ptrs = ws_ptr + (offs_n * 0) * stride_wsn\n",
          expect="block scale 用错了"),
    Plant("scale_strides_swapped", "scale_inv 的行列 stride 用反了",
          old="scale_inv.stride(0), scale_inv.stride(1), xs.stride(0),",
          new="scale_inv.stride(1), scale_inv.stride(0), xs.stride(0),",
          expect="block scale 用错了"),
    Plant("scale_once_at_end", "scale 在 K 循环之后只乘一次（用的是最后一个 K-tile 的 scale 列）",
          old="            acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION) * w_s[None, :]\n",
          new="            acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION)\n"
              "            if k0 + BLOCK_K >= K:\n"
              "                acc = acc * w_s[None, :]\n",
          expect="block scale 用错了"),
    Plant("scale_forgotten", "没有乘 block scale",
          old="            acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION) * w_s[None, :]\n",
          new="            acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION)\n",
          expect="没有乘 block scale"),
    Plant("k_tail_mask", "K 尾部 mask 没有减去 k0",
          old="            k_ok = offs_k < K - k0\n",
          new="            k_ok = offs_k < K\n",
          expect="K 维的尾部"),
    Plant("x_scale_forgotten", "w8a8 没有乘 x_scale",
          old="            acc += tl.dot(a, b) * (x_s[:, None] * w_s[None, :])            # FP8 x FP8, exact products\n",
          new="            acc += tl.dot(a, b) * w_s[None, :]\n",
          expect="没有乘 x_scale"),
    Plant("w8a8_not_quantized", "w8a8 没有量化激活",
          old="    x_fp8, x_scale = quantize_act_fp8(x)\n"
              "    return _launch_linear(x_fp8, x_scale, w_fp8, scale_inv, x.dtype)\n",
          new="    return _launch_linear(x, None, w_fp8, scale_inv, x.dtype)\n",
          expect="没有量化激活"),
    Plant("gate_up_scales_swapped", "s_gate 和 s_up 用反了",
          old="_gate_up_fp8_kernel[grid](x, xs, w_gate, w_up, s_gate, s_up, out,",
          new="_gate_up_fp8_kernel[grid](x, xs, w_gate, w_up, s_up, s_gate, out,",
          expect="用反了"),
    Plant("moe_scale_strides_from_shape", "gate/up 的 scale 按形状推 stride（它们是 strided view）",
          old="*w_gate.stride(), *w_up.stride(), *s_gate.stride(), *s_up.stride(),",
          new="*w_gate.stride(), *w_up.stride(), s_gate.shape[1] * s_gate.shape[2], s_gate.shape[2], 1, "
              "s_up.shape[1] * s_up.shape[2], s_up.shape[2], 1,",
          expect="按形状推 stride"),
    Plant("moe_scale_row_not_block", "MoE down 的 scale 漏了行号 n // 128",
          old="    sd_ptrs = sd_ptr + e * stride_sde + (offs_n // SCALE_BLOCK) * stride_sdh\n",
          new="    sd_ptrs = sd_ptr + e * stride_sde + (offs_n * 0) * stride_sdh\n",
          expect="block scale 用错了"),
    Plant("moe_x_scale_forgotten", "MoE 的 FP8×FP8 dot 之后没有乘 x_scale",
          old="            acc_g += tl.dot(a, g) * (x_s[:, None] * s_g[None, :])\n"
              "            acc_u += tl.dot(a, u) * (x_s[:, None] * s_u[None, :])\n",
          new="            acc_g += tl.dot(a, g) * s_g[None, :]\n"
              "            acc_u += tl.dot(a, u) * s_u[None, :]\n",
          expect="没有乘 x_scale"),
    Plant("moe_h_scale_forgotten", "MoE down 的 FP8×FP8 dot 之后没有乘 h_scale",
          old="            acc += tl.dot(a, d) * (h_s[:, None] * s_d[None, :])\n",
          new="            acc += tl.dot(a, d) * s_d[None, :]\n",
          expect="没有乘 h_scale"),
    Plant("moe_h_not_requantized", "act_fp8 时 h 没有再量化",
          old="    b, b_scale = quantize_act_fp8(h) if act_fp8 else (h, None)\n",
          new="    b, b_scale = h, None\n",
          expect="h 没有再量化"),
    Plant("moe_act_ignored", "act_fp8=True 时没有量化激活",
          old="    a, a_scale = quantize_act_fp8(x) if act_fp8 else (x, None)\n"
              "    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)\n",
          new="    a, a_scale = x, None\n    act_fp8 = False\n"
              "    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)\n",
          expect="没有量化激活"),
    Plant("no_return_past_num_post", "num_post 之后的 block 没有直接 return",
          old="    pid_m, pid_n = tl.program_id(0), tl.program_id(1)\n"
              "    if pid_m * BLOCK_M >= tl.load(num_post_ptr):\n"
              "        return\n"
              "    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)\n"
              "    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))\n"
              "    valid = pairs < num_pairs\n"
              "    tokens",
          new="    pid_m, pid_n = tl.program_id(0), tl.program_id(1)\n"
              "    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)\n"
              "    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))\n"
              "    valid = pairs < num_pairs\n"
              "    tokens",
          expect="没有直接 return"),
    Plant("shared_none_not_skipped", "忘了 w.shared is None 时跳过",
          old="    if w.shared is not None:\n        s = w.shared\n", new="    if True:\n        s = w.shared\n",
          expect="w.shared is None"),
]
