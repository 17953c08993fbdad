"""Every 易错点 of lessons/e04_model_runner.md, planted into a copy of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("positions_from_zero", "chunk / decode 的 positions 从 0 开始",
          old="    positions = torch.arange(int(cu_q[-1])) - cu_q[seq_of_token] + cached[seq_of_token]   # [N]\n",
          new="    positions = torch.arange(int(cu_q[-1])) - cu_q[seq_of_token]\n",
          expect="positions 从 0 开始"),
    Plant("cu_k_new_tokens_only", "cu_seqlens_k 只数了新 token，漏了 cache 里的前缀",
          old="cu_seqlens_k=F.pad(context_lens.cumsum(0), (1, 0)).int(),",
          new="cu_seqlens_k=cu_q.int(),",
          expect="cu_seqlens_k 只数了新 token"),
    Plant("slot_without_block_table", "slot_mapping 没有经过 block table",
          old="slot_mapping=blocks * block_size + positions % block_size,",
          new="slot_mapping=positions,",
          expect="没有经过 block table"),
    Plant("is_prefill_by_cached", "is_prefill 按“有没有新 prompt（c_b == 0）”判断",
          old="is_prefill=bool((new > 1).any()))",
          new="is_prefill=bool((cached == 0).any()))",
          expect="带前缀的 chunk（c_b > 0、q_b > 1）也是 prefill"),
    Plant("gather_div_mod_swapped", "读 cache 时把块号和块内偏移算反",
          old="    blocks = block_tables.long()[seq_of_key, pos // block_size]                       # [K]: physical block\n"
              "    return blocks * block_size + pos % block_size\n",
          new="    blocks = block_tables.long()[seq_of_key, pos % block_size]\n"
              "    return blocks * block_size + pos // block_size\n",
          expect=None),
    Plant("read_before_write", "先读 cache 再写入本步的新 K/V（decode 的 token 看不到自己）",
          old="        store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)\n"
              "        slots = gather_slots(ctx.block_tables, ctx.context_lens, self.k_cache.shape[1])\n"
              "        keys = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]    # [K, nKV, D]\n"
              "        values = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]\n",
          new="        slots = gather_slots(ctx.block_tables, ctx.context_lens, self.k_cache.shape[1])\n"
              "        keys = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]    # [K, nKV, D]\n"
              "        values = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]\n"
              "        store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)\n",
          expect=None),
    Plant("slot_not_zeroed", "GDN 槽位入场时没有清零",
          old="        torch._foreach_zero_([self.conv[i][slot] for i in self.conv] + [self.ssm[i][slot] for i in self.conv])\n",
          new="",
          expect="入场不清零"),
    Plant("state_not_committed", "GDN 状态算完没有写回状态池",
          old="        if states is not None:\n            self.gdn_pool.commit(slots, states)\n",
          new="",
          expect=None),
    Plant("token_loop_positions", "逐 token 的 Python 循环算 positions",
          old="    positions = torch.arange(int(cu_q[-1])) - cu_q[seq_of_token] + cached[seq_of_token]   # [N]\n",
          new="    positions = torch.tensor([t for s in seqs for t in range(s.num_cached_tokens, s.num_cached_tokens + s.num_scheduled_tokens)])\n",
          expect="逐 token 的 Python 循环"),
    Plant("sample_partial_prefill", "partial prefill 的行也做了采样",
          old="        done = [i for i, s in enumerate(seqs) if s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens]\n",
          new="        done = list(range(len(seqs)))\n",
          expect="partial prefill 的行也做了采样"),
    Plant("generator_per_step", "每一步都按 seed 重新建 generator",
          old="                if seqs[i].seq_id not in self.generators:\n"
              "                    self.generators[seqs[i].seq_id] = make_generator(seqs[i].sampling_params.seed)\n",
          new="                self.generators[seqs[i].seq_id] = make_generator(seqs[i].sampling_params.seed)\n",
          expect="generator 被重新建了"),
    Plant("generator_dropped_on_preemption", "抢占时把 generator 也丢了",
          old="        if seq.is_finished:\n            self.generators.pop(seq.seq_id, None)\n",
          new="        self.generators.pop(seq.seq_id, None)\n",
          expect="generator 被重新建了"),
    Plant("gdn_slot_not_released", "release 没有归还 GDN 槽位",
          old="        if self.gdn_pool is not None:\n            self.gdn_pool.free(seq)\n",
          new="",
          expect="没有归还 GDN 槽位"),
    Plant("cu_seqlens_int64", "ctx 的 int32 字段留成了 int64",
          old="        cu_seqlens_q=cu_q.int(), cu_seqlens_k=F.pad(context_lens.cumsum(0), (1, 0)).int(),\n",
          new="        cu_seqlens_q=cu_q, cu_seqlens_k=F.pad(context_lens.cumsum(0), (1, 0)),\n",
          expect="dtype 与卡片的表不符"),
    Plant("attention_left_in_fp32", "attention 升到 fp32 算完没有转回输入的 dtype",
          old="        return varlen_attention(q, keys, values, ctx.cu_seqlens_q, ctx.cu_seqlens_k, self.scale)\n",
          new="        return varlen_attention(q.float(), keys.float(), values.float(), ctx.cu_seqlens_q, ctx.cu_seqlens_k,\n"
              "                                self.scale)\n",
          expect="没有转回输入的 dtype"),
    Plant("resume_without_state_zeroed", "states() 给没有槽位的序列一律分一个清零的槽位",
          old="                if seq.num_cached_tokens:\n"
              "                    raise RuntimeError(f\"sequence {seq.seq_id} resumes at token {seq.num_cached_tokens} without a \"\n"
              "                                       \"GDN state (prefix caching must be off for hybrid models)\")\n",
          new="",
          expect="没有槽位的序列一律"),
]
