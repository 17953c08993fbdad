"""Every 易错点 of lessons/k01_triton_basics.md, planted into a copy of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("slot_minus_one_written", "slot = −1 的填充行也写了",
          old="    if slot < 0:                                         # padded row of a CUDA-graph batch\n"
              "        return\n",
          new="",
          expect="slot = −1"),
    Plant("contiguous_token_stride", "把 k/v 当成连续张量（token 步长写成 nKV·D）",
          old="k.stride(0), k.stride(1), v.stride(0), v.stride(1),",
          new="num_kv_heads * head_dim, head_dim, num_kv_heads * head_dim, head_dim,",
          expect="非连续 view"),
    Plant("stats_in_input_dtype", "平方和在 x.dtype 里算",
          old="    h = x.to(tl.float32)\n",
          new="    h = x\n",
          expect="tl.float32"),
    Plant("mean_over_block", "均值除以了 BLOCK_H 而不是 H",
          old="tl.sum(h * h, axis=1) / hidden",
          new="tl.sum(h * h, axis=1) / BLOCK_H",
          expect="BLOCK_H"),
    Plant("cast_order_qwen3", "Qwen3 norm 先乘 w 再 cast（cast 顺序写反）",
          old="out = w * n.to(x.dtype).to(tl.float32)",
          new="out = w * n",
          expect="cast 顺序写反"),
    Plant("gemma_times_w", "(1+w) norm 乘了 w 而不是 1 + w",
          old="out = n * (1.0 + w)",
          new="out = n * w",
          expect="1 + w"),
    Plant("sum_not_rounded", "对未舍入的 fp32 和求统计量",
          old="        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)           # the sum, rounded to x.dtype\n"
              "        tl.store(res_out_ptr + rows * stride_ro + cols, x, mask=mask)\n"
              "    h = x.to(tl.float32)\n",
          new="        h = x.to(tl.float32) + r.to(tl.float32)\n"
              "        x = h.to(x.dtype)\n"
              "        tl.store(res_out_ptr + rows * stride_ro + cols, x, mask=mask)\n"
              "    else:\n"
              "        h = x.to(tl.float32)\n",
          expect="未舍入"),
    Plant("slot_zero_skipped", "把 slot 0 当成了填充行跳过（slot <= 0）",
          old="    if slot < 0:                                         # padded row of a CUDA-graph batch\n",
          new="    if slot <= 0:\n",
          expect="slot 0"),
    Plant("grid_rounded_down", "grid 向下取整（R 不是 ROWS 的整数倍时最后几行没有归一化）",
          old="    grid = (triton.cdiv(num_rows, rows),)\n",
          new="    grid = (max(1, num_rows // rows),)\n",
          expect="cdiv(R, ROWS)"),
    Plant("no_row_mask", "没有行 mask（最后一个 program 多出来的行也读写了）",
          old="    mask = (rows < num_rows) & (cols < hidden)\n",
          new="    mask = (rows >= 0) & (cols < hidden)\n",
          expect="rows < R"),
    Plant("x_row_stride_is_h", "把 x 的行步长当成了 H（列切片输入）",
          old="        x2.stride(0), r2.stride(0), hidden, ro2.stride(0), eps,\n",
          new="        hidden, r2.stride(0), hidden, ro2.stride(0), eps,\n",
          expect="行步长当成了 H"),
    Plant("eps_outside_sqrt", "eps 放在了根号外",
          old="    n = h * tl.math.rsqrt(mean_sq + eps)[:, None]                        # eps inside the sqrt\n",
          new="    n = h / (tl.sqrt(mean_sq) + eps)[:, None]\n",
          expect="eps 放在了根号外"),
    Plant("output_flattened", "输出是 [R, H] 而不是 x 的形状",
          old="    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)\n",
          new="    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)\n",
          expect="同形状"),
    Plant("store_no_dim_mask", "D 不是 2 的幂时补齐的列没有 mask（store_kvcache 写进了下一个头）",
          old="    mask = (heads < num_kv_heads) & (dims < head_dim)\n",
          new="    mask = (heads < num_kv_heads) & (dims >= 0)\n",
          expect=None),
]
