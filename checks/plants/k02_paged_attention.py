"""Every 易错点 of lessons/k02_paged_attention.md, planted into a copy of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("top_left_causal", "有缓存前缀时 causal mask 左上对齐",
          old="    diag = Lk - Lq                                    # bottom-right causal: row i sees j <= diag + i\n",
          new="    diag = 0\n",
          expect="左上对齐"),
    Plant("no_rescale_prefill", "running max 变大后没有重新缩放 acc（prefill）",
          old="    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)\n"
              "    return",
          new="    acc = acc + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)\n"
              "    return",
          expect="running max"),
    Plant("no_rescale_decode", "running max 变大后没有重新缩放 acc 和 l（decode）",
          old="        l_i = l_i * alpha + tl.sum(p, axis=1)\n"
              "        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)\n",
          new="        l_i = l_i + tl.sum(p, axis=1)\n"
              "        acc = acc + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)\n",
          expect="running max"),
    Plant("reduce_plain_average", "reduce 时没有按 exp(lse_s − max lse) 加权",
          old="    w = tl.where(live, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)",
          new="    w = tl.where(live, 1.0, 0.0)",
          expect="加权"),
    Plant("decode_drops_last_key", "长度差一：漏掉了最后一个 key",
          old="    end = tl.minimum(start + part, Lk)\n",
          new="    end = tl.minimum(start + part, Lk - 1)\n",
          expect="最后一个 key"),
    Plant("tail_tile_unmasked", "最后一个不满的 key tile 没有 mask",
          old="        sc = tl.where((j < end)[None, :], sc, float(\"-inf\"))\n",
          new="",
          expect="不满的 key tile"),
    Plant("gqa_tiled_prefill", "GQA 头映射写成 h % nKV（prefill）",
          old="    kvh = h // GROUP ",
          new="    kvh = h % (tl.num_programs(2) // GROUP) ",
          expect="GQA 头映射"),
    Plant("gqa_tiled_decode", "GQA 头映射写成 h % nKV（decode）",
          old="    heads = g * GROUP + tl.arange(0, BLOCK_G) ",
          new="    heads = g + tl.arange(0, BLOCK_G) * tl.num_programs(1) ",
          expect="GQA 头映射"),
    Plant("fp16_scores", "分数在 fp16 里累加",
          old="s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32) * qk_scale",
          new="s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32).to(q.dtype) * qk_scale",
          expect="65504"),
    Plant("lse_mixed_log_base", "lse 混用了对数的底（m 是 log₂ 单位，却写成 m + ln l）",
          old="    tl.store(lse_part_ptr + part_rows, m_i + tl.log2(l_i), mask=tl.arange(0, BLOCK_G) < GROUP)\n",
          new="    tl.store(lse_part_ptr + part_rows, m_i + tl.log(l_i), mask=tl.arange(0, BLOCK_G) < GROUP)\n",
          expect="混用了对数的底"),
    Plant("reduce_weights_natural_exp", "reduce 的权重用了 exp 而不是 exp2（lse 是 log₂ 单位）",
          old="    w = tl.where(live, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)",
          new="    w = tl.where(live, tl.exp(lse - tl.max(lse, axis=0)), 0.0)",
          expect="混用了对数的底"),
]
