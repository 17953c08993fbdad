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
]
