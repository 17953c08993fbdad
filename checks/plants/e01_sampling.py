"""Every 易错点 of lessons/e01_sampling.md, planted into a copy of the reference."""

from checks.plants import Plant

_WARP_BODY = """    x = logits / temperature[:, None]                                   # [B, V]: temperature first
    sorted_x, order = torch.sort(x, dim=-1, stable=True)                # [B, V] ascending
"""

_WARP_RETURN = """    probs = x.softmax(dim=-1)                                           # [B, V]
    return x.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), -math.inf)
"""

PLANTS = [
    Plant("unstable_sort", "top-p 的排序不是 stable 的",
          old="    sorted_x, order = torch.sort(x, dim=-1, stable=True)",
          new="    sorted_x, order = torch.sort(x, dim=-1)",
          expect="排序不是 stable 的"),
    Plant("bool_accepted_as_number", "校验没有排除 bool",
          old="            if isinstance(value, bool) or not isinstance(value, numbers.Real):\n",
          new="            if not isinstance(value, numbers.Real):\n",
          expect="没有排除 bool"),
    Plant("temperature_after_filtering", "temperature 在过滤之后才除",
          old=_WARP_BODY + """
    # top-k: the k-th largest is sorted_x[:, V - k]; anything strictly smaller goes (ties survive)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)           # [B], 0 = off = keep all V
    kth = sorted_x.gather(-1, (vocab - k)[:, None].long())              # [B, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, -math.inf)

    # top-p on what top-k left: drop the low tail whose total mass is <= 1 - top_p
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)                       # [B, V], last entry ~ 1
    drop = (cum <= (1 - top_p)[:, None]) & (top_p < 1)[:, None]         # top_p = 1: the warper is off
    drop[:, -1] = False                                                 # the most likely token always stays
    sorted_x = sorted_x.masked_fill(drop, -math.inf)
    x = torch.empty_like(sorted_x).scatter_(-1, order, sorted_x)        # back to vocab order [B, V]

    # min-p: relative to the most likely survivor, not an absolute probability
""" + _WARP_RETURN,
          new="""    x = logits.clone()
    sorted_x, order = torch.sort(x, dim=-1, stable=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = sorted_x.gather(-1, (vocab - k)[:, None].long())
    sorted_x = sorted_x.masked_fill(sorted_x < kth, -math.inf)
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = (cum <= (1 - top_p)[:, None]) & (top_p < 1)[:, None]
    drop[:, -1] = False
    sorted_x = sorted_x.masked_fill(drop, -math.inf)
    x = torch.empty_like(sorted_x).scatter_(-1, order, sorted_x)
    probs = x.softmax(dim=-1)
    x = x.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), -math.inf)
    return x / temperature[:, None]
""",
          expect="temperature 在过滤之后才除"),
    Plant("temperature_missing", "完全没有除以 temperature",
          old="    x = logits / temperature[:, None]                                   # [B, V]: temperature first\n",
          new="    x = logits.clone()\n",
          expect="没有除以 temperature"),
    Plant("top_p_drops_crossing_token", "top-p 差一位：把越过阈值的那个 token 也删了",
          old="cum = sorted_x.softmax(dim=-1).cumsum(dim=-1) ",
          new="cum = sorted_x.softmax(dim=-1).cumsum(dim=-1) - sorted_x.softmax(dim=-1) ",
          expect="top-p 差一位"),
    Plant("top_p_one_not_skipped", "top_p=1 时没有整体跳过 top-p",
          old="drop = (cum <= (1 - top_p)[:, None]) & (top_p < 1)[:, None]",
          new="drop = cum <= (1 - top_p)[:, None]",
          expect="top_p=1 时没有整体跳过"),
    Plant("ties_descending", "并列 logits 按降序排序处理，取舍与 HF 相反",
          old="    sorted_x, order = torch.sort(x, dim=-1, stable=True)                # [B, V] ascending\n",
          new="    sorted_x, order = torch.sort(x.flip(-1), dim=-1, stable=True)\n"
              "    order = vocab - 1 - order\n",
          expect="并列 logits 的取舍与约定相反"),
    Plant("top_k_exactly_k", "top-k 只留恰好 k 个，丢了并列",
          old="sorted_x = sorted_x.masked_fill(sorted_x < kth, -math.inf)",
          new="sorted_x = sorted_x.masked_fill(torch.arange(vocab) < (vocab - k)[:, None], -math.inf)",
          expect="丢了与第 k 大并列"),
    Plant("top_k_zero_masks_everything", "top_k=0 当成 k=0",
          old="k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)",
          new="k = top_k.clamp(max=vocab)",
          expect="top_k=0 应表示“关闭”"),
    Plant("min_p_absolute", "min_p 当成绝对概率",
          old="probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)",
          new="probs < min_p[:, None]",
          expect="min_p 当成了绝对概率阈值"),
    Plant("greedy_rows_sampled", "temperature=0 的行也去采样",
          old="        return torch.where(is_greedy_row, tokens, sampled)\n",
          new="        return sampled\n",
          expect="temperature=0 的行也去采样了"),
    Plant("one_generator_for_all_rows", "所有行共用一个 generator",
          old="exponential_(generator=gen)",
          new="exponential_(generator=next(g for g in generators if g is not None))",
          expect="所有行共用一个 generator"),
    Plant("global_rng_for_seeded_rows", "带 seed 的行没用自己的 generator（用了全局 RNG）",
          old="exponential_(generator=gen)",
          new="exponential_()",
          expect="没有用该行自己的 generator"),
    Plant("softmax_in_bf16", "softmax 在 bf16/fp16 里算",
          old="probs = torch.softmax(x, dim=-1) ",
          new="probs = torch.softmax(x.bfloat16(), dim=-1) ",
          expect="bf16/fp16 里做"),
    Plant("min_p_less_equal", "min_p 的比较用了 <=",
          old="probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)",
          new="probs <= min_p[:, None] * probs.amax(dim=-1, keepdim=True)",
          expect="min_p 的比较用了 <="),
    Plant("top_p_strict_less", "top-p 的边界用了 <",
          old="drop = (cum <= (1 - top_p)[:, None])",
          new="drop = (cum < (1 - top_p)[:, None])",
          expect="top-p 的边界用了 <"),
    Plant("generator_recreated_each_step", "每一步按 seed 重新建 generator",
          old="exponential_(generator=gen)",
          new="exponential_(generator=make_generator(params[row].seed))",
          expect="每一步都按 seed 重新建 generator"),
    Plant("tiny_temperature_not_greedy", "极小的正 temperature 没有当成 greedy",
          old="            self.temperature = 0.0\n",
          new="            pass\n",
          expect="极小的正 temperature 没有当成 greedy"),
    Plant("seed_beyond_generator", "seed 没有上限：2**64 在 step 里才让 manual_seed 溢出",
          old="or not 0 <= self.seed < SEED_LIMIT)",
          new="or self.seed < 0)",
          expect="seed"),
    Plant("top_k_beyond_int64", "top_k 没有上限：2**63 放不进 int64 张量",
          old="        if not 0 <= self.top_k < TOP_K_LIMIT:\n",
          new="        if self.top_k < 0:\n",
          expect="top_k"),
    Plant("huge_int_overflows_float", "超大的整数 temperature / top_p / min_p：float() 抛 OverflowError",
          old="""            try:
                setattr(self, name, float(value))
            except OverflowError:                     # an int beyond float's range (JSON ints have no size limit)
                raise ValueError(f"{name} must be a finite number, got an int too large for a float") from None
""",
          new="            setattr(self, name, float(value))\n",
          expect="转成 float 时抛 OverflowError"),
    Plant("top_k_int32_tensor", "top_k 放进了 int32 张量（溢出报错）",
          old="column([p.top_k for p in params], torch.int64)",
          new="column([p.top_k for p in params], torch.int32)",
          expect="top_k 放进了 int32 张量"),
    Plant("top_k_wrapped_to_int32", "top_k 放进了 int32 张量（悄悄回绕）",
          old="column([p.top_k for p in params], torch.int64)",
          new="column([p.top_k for p in params], torch.int64).to(torch.int32)",
          expect="top_k 放进了 int32 张量"),
    Plant("stop_token_ids_kept_as_list", "stop_token_ids 原样存成了 list",
          old="        self.stop_token_ids = frozenset(self.stop_token_ids)\n",
          new="        self.stop_token_ids = list(self.stop_token_ids)\n",
          expect="stop_token_ids 原样存成了 list"),
    # issue 45: the contract between e01 and e06 (the error's param is the message's first word)
    Plant("message_not_field_first", "ValueError 的消息没有以字段名开头",
          old='raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")',
          new='raise ValueError(f"top_p={self.top_p!r} is not in (0, 1]")',
          expect="没有以字段名开头"),
    Plant("stop_ids_list_only", "stop_token_ids 只对 list 逐个检查了元素",
          old="        for token in self.stop_token_ids:\n",
          new="        for token in (self.stop_token_ids if isinstance(self.stop_token_ids, list) else ()):\n",
          expect="只对 list 逐个检查了元素"),
]
