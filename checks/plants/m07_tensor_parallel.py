"""Every 易错点 of lessons/m07_tensor_parallel.md, planted into a copy of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("row_no_all_reduce", "RowParallelLinear 忘了 all-reduce",
          old="        if self.tp_size > 1:\n            dist.all_reduce(y)                                       # sum over ranks\n",
          new="",
          expect="忘了 all-reduce"),
    Plant("bias_every_rank", "bias 在每个 rank 上都加",
          old="        y = F.linear(x, self.weight)                                 # [N, out]: a partial sum\n"
              "        if self.tp_size > 1:\n"
              "            dist.all_reduce(y)                                       # sum over ranks\n"
              "        if self.bias is not None:\n"
              "            y = y + self.bias                                        # once, after the sum\n",
          new="        y = F.linear(x, self.weight, self.bias)                      # bias in every partial sum\n"
              "        if self.tp_size > 1:\n"
              "            dist.all_reduce(y)\n",
          expect="bias 在每个 rank 上都加了"),
    Plant("qkv_halves", "QKV 的 weight_loader 把拼接后的 [q|k|v] 整体对半切",
          old="        offset, size = {\"q\": (0, q_rows), \"k\": (q_rows, kv_rows), \"v\": (q_rows + kv_rows, kv_rows)}[shard[0]]\n"
              "        block = self.tp_rank if shard[0] == \"q\" else self.tp_rank // self.kv_replicas   # replicas share a KV head\n"
              "        target = param.data.narrow(0, offset, size)\n"
              "        target.copy_(loaded.narrow(0, block * size, size))            # heads block*n .. (block+1)*n of this part\n"
              "        return target.numel()\n",
          new="        rows, total_q = param.shape[0], q_rows * self.tp_size\n"
              "        start = {\"q\": 0, \"k\": total_q, \"v\": total_q + kv_rows * self.tp_size}[shard[0]]\n"
              "        lo, hi = max(start, self.tp_rank * rows), min(start + loaded.shape[0], (self.tp_rank + 1) * rows)\n"
              "        if hi <= lo:\n"
              "            return 0\n"
              "        param.data[lo - self.tp_rank * rows:hi - self.tp_rank * rows].copy_(loaded[lo - start:hi - start])\n"
              "        return (hi - lo) * param.shape[1]\n",
          expect="整体对半切"),
    Plant("merged_as_one_tensor", "gate/up 当成一个张量切（rank 0 拿到整个 gate、rank 1 拿到整个 up）",
          old="        size = self.output_sizes[i] // self.tp_size                 # this rank's rows of part i\n"
              "        offset = sum(self.output_sizes[:i]) // self.tp_size          # where part i starts in the local rows\n"
              "        target = param.data.narrow(0, offset, size)\n"
              "        target.copy_(loaded.narrow(0, self.tp_rank * size, size))\n"
              "        return target.numel()\n",
          new="        rows, start = param.shape[0], sum(self.output_sizes[:i])\n"
              "        lo, hi = max(start, self.tp_rank * rows), min(start + loaded.shape[0], (self.tp_rank + 1) * rows)\n"
              "        if hi <= lo:\n"
              "            return 0\n"
              "        param.data[lo - self.tp_rank * rows:hi - self.tp_rank * rows].copy_(loaded[lo - start:hi - start])\n"
              "        return (hi - lo) * param.shape[1]\n",
          expect="整个 gate"),
    Plant("vocab_rows_not_zeroed", "词表 mask 没做好：分片外的 id 读到本分片的错误行（没置零）",
          old="        y = y.masked_fill(~mine[:, None], 0)                                     # ... and are zeroed here\n",
          new="",
          expect="词表 mask"),
    Plant("vocab_no_mask", "词表 mask 没做好：分片外的 id 直接减 vocab_start 去查表（越界）",
          old="        local = torch.where(mine, ids - self.vocab_start, 0)                     # other ranks' ids read row 0 ...\n",
          new="        local = ids - self.vocab_start\n",
          expect="词表 mask"),
    Plant("lm_head_local_shard", "ParallelLMHead 只返回本 rank 的分片（忘了 all-gather）",
          old="        if self.tp_size == 1:\n            return logits\n        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]\n",
          new="        return logits\n        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]\n",
          expect="all-gather"),
    Plant("experts_wrong_dim", "experts 沿错误的维度切分（down_proj 也切 dim 1）",
          old="loaded.narrow(1, self.tp_rank * inter, inter)",
          new="loaded.narrow(0, self.tp_rank * inter, inter)",
          expect="experts 沿错误的维度切分"),
    Plant("experts_wrong_shape", "experts 沿错误的维度切分（gate_up_proj 切了 H）",
          old="        self.gate_up_proj = _loadable(self, num_experts, 2 * inter, hidden_size)\n",
          new="        self.gate_up_proj = _loadable(self, num_experts, 2 * inter * self.tp_size, hidden_size // self.tp_size)\n",
          expect="experts 沿错误的维度切分"),
    Plant("backend_heads_not_divided", "attention backend 的 head 数没有除以 tp",
          old="    attn.attn.num_heads, attn.attn.num_kv_heads = attn.num_heads, attn.num_kv_heads\n",
          new="",
          expect="attention backend"),
    Plant("module_heads_not_divided", "attention 模块的 head 数 / q_size 没有除以 tp",
          old="    attn.num_heads, attn.num_kv_heads = qkv.num_heads, qkv.num_kv_heads\n"
              "    attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim\n",
          new="",
          expect="attention 模块的"),
    Plant("moe_no_all_reduce", "MoE block 之后忘了 all-reduce",
          old="        mlp.register_forward_hook(_all_reduce_output)   # routed + shared partial sums: one all-reduce\n",
          new="",
          expect="MoE block 之后忘了 all-reduce"),
    Plant("tied_not_retied", "tied embeddings：换层之后忘了让 lm_head 重新共享 embed_tokens 的权重",
          old="    if tied:\n        model.lm_head.weight = model.model.embed_tokens.weight\n",
          new="",
          expect="tied embeddings"),
    Plant("tp1_touches_dist", "TP=1 时调用了 torch.distributed",
          old="    if world_size == 1:\n        return model\n    actual = tp_info()\n",
          new="    actual = tp_info()\n",
          expect="TP=1 时调用了 torch.distributed"),
    Plant("kv_replica_wrong_head", "nKV < tp 时 rank r 去取第 r 个 KV head（应取第 r·nKV/tp 个，几个 rank 共用一个）",
          old="        block = self.tp_rank if shard[0] == \"q\" else self.tp_rank // self.kv_replicas   # replicas share a KV head\n",
          new="        block = self.tp_rank\n",
          expect="nKV < tp 时复制 KV head"),
    Plant("kv_replica_modulo", "nKV < tp 时 rank r 取第 r % nKV 个 KV head（tp = 2 时看不出来，tp = 4、nKV = 2 时 rank 1 拿错）",
          old="        block = self.tp_rank if shard[0] == \"q\" else self.tp_rank // self.kv_replicas   # replicas share a KV head\n",
          new="        block = self.tp_rank if shard[0] == \"q\" else self.tp_rank % (loaded.shape[0] // size)\n",
          expect="nKV < tp 时复制 KV head"),
    Plant("lm_head_not_trimmed", "ParallelLMHead 拼回之后没有去掉补零列（V 不能被 tp 整除时多出 tp·ceil(V/tp) − V 列）",
          old="        return torch.cat(parts, dim=-1)[:, :self.num_embeddings]                 # drop the padding columns\n",
          new="        return torch.cat(parts, dim=-1)\n",
          expect="没有去掉补零列"),
    Plant("vocab_floor_shard", "词表分片按 V // tp 行切（应为 ceil(V/tp)，最后一片补零）",
          old="        self.shard_size = -(-num_embeddings // self.tp_size)                   # ceil(V / tp)\n",
          new="        self.shard_size = num_embeddings // self.tp_size\n",
          expect="ceil(V/tp)"),
    Plant("kv_not_replicated", "nKV < tp 时报“不能整除”而不是复制 KV head",
          old="        if total_num_kv_heads >= tp_size:\n"
              "            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, \"num_key_value_heads\")\n"
              "        elif tp_size % total_num_kv_heads:\n",
          new="        if True:\n"
              "            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, \"num_key_value_heads\")\n"
              "        elif tp_size % total_num_kv_heads:\n",
          expect="nKV < tp 时应复制 KV head"),
    Plant("gdn_qkv_one_tensor", "in_proj_qkv 当成一个张量切（应按 q、k、v 三段各自切）",
          old="        if not shard:\n"
              "            parts = loaded.split(self.output_sizes)\n"
              "            return sum(self.weight_loader(param, part, (i,)) for i, part in enumerate(parts))\n",
          new="        if not shard:\n"
              "            rows = param.shape[0]\n"
              "            param.data.copy_(loaded.narrow(0, self.tp_rank * rows, rows))\n"
              "            return param.numel()\n",
          expect="in_proj_qkv 当成一个张量切了"),
    Plant("gdn_conv_one_tensor", "conv1d 的通道没有按 q、k、v 各自切",
          old="        pieces = [part.chunk(self.tp_size)[self.tp_rank] for part in loaded.split(self.part_sizes)]\n"
              "        param.data.copy_(torch.cat(pieces))\n",
          new="        param.data.copy_(loaded.chunk(self.tp_size)[self.tp_rank])\n",
          expect="conv1d 的通道没有按 q、k、v 各自切"),
    Plant("gdn_gates_not_sliced", "A_log / dt_bias 没有按 value head 切",
          old="    for name in (\"A_log\", \"dt_bias\"):                                 # [nv] -> [nv / tp]\n"
              "        param = nn.Parameter(getattr(gdn, name).new_empty(num_v_heads))\n"
              "        param.weight_loader = _value_head_rows\n"
              "        setattr(gdn, name, param)\n",
          new="",
          expect="A_log / dt_bias 没有切"),
    Plant("gdn_value_heads_round_robin", "value head 按 j % tp 轮流分给 rank（离开了它的 key head）",
          old="    param.data.copy_(loaded.narrow(0, tp_info()[0] * rows, rows))\n",
          new="    rank, tp_size = tp_info()\n"
              "    param.data.copy_(loaded[rank::tp_size])\n",
          expect="value head 分错了 rank"),
    Plant("gdn_norm_sliced", "门控 RMSNorm 的 weight 也按 rank 切了（它被所有 head 共用）",
          old="    _swap(gdn, \"out_proj\", RowParallelLinear(gdn.value_dim, hidden))\n",
          new="    _swap(gdn, \"out_proj\", RowParallelLinear(gdn.value_dim, hidden))\n"
              "    gdn.norm.weight = nn.Parameter(gdn.norm.weight.new_empty(gdn.head_v_dim // tp_size))\n"
              "    gdn.norm.weight.weight_loader = _value_head_rows\n",
          expect="门控 RMSNorm 的 weight 被切了"),
    Plant("gdn_out_proj_not_row", "out_proj 没有换成 row parallel",
          old="    _swap(gdn, \"out_proj\", RowParallelLinear(gdn.value_dim, hidden))\n",
          new="",
          expect="out_proj 不是 row parallel"),
    Plant("gdn_heads_not_divided", "Gated DeltaNet 层的 head 数 / key_dim / value_dim / conv_dim 没有改成本 rank 的",
          old="    gdn.num_k_heads, gdn.num_v_heads = num_k_heads, num_v_heads\n"
              "    gdn.key_dim, gdn.value_dim = num_k_heads * gdn.head_k_dim, num_v_heads * gdn.head_v_dim\n"
              "    gdn.conv_dim = 2 * gdn.key_dim + gdn.value_dim\n",
          new="",
          expect="Gated DeltaNet 层的 num_k_heads"),
    # issue 45 (contract table): V a multiple of tp, the ValueErrors the card names
    Plant("lm_head_negative_trim", "LM head 去掉补零列时用了负的切片 [:, :-pad]（V 能被 tp 整除时 pad = 0，输出为空）",
          old="        return torch.cat(parts, dim=-1)[:, :self.num_embeddings]",
          new="        return torch.cat(parts, dim=-1)[:, :-(self.shard_size * self.tp_size - self.num_embeddings)]",
          expect="负的切片"),
    Plant("heads_floored", "head 数不能被 tp 整除时向下取整（没有报 ValueError）",
          old="        self.num_heads = _divide(total_num_heads, tp_size, \"num_attention_heads\")\n",
          new="        self.num_heads = total_num_heads // tp_size\n",
          expect="应报 ValueError"),
    Plant("kv_heads_floored", "nKV >= tp 却不能整除时向下取整（没有报 ValueError）",
          old="            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, \"num_key_value_heads\")\n",
          new="            self.num_kv_heads = total_num_kv_heads // tp_size\n",
          expect="应报 ValueError"),
    Plant("explicit_world_unchecked", "显式给出的 (rank, world_size) 与 tp_info() 不一致时没有报 ValueError",
          old="    if (rank, world_size) != actual:\n",
          new="    if False:\n",
          expect="tensor_parallel 应报 ValueError"),
]
