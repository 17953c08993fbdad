"""Planted mistakes for m02 · RoPE family: every 易错点 of lessons/m02_rope.md as an edit of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("gptj_pairing",
          "相邻配对 (2i, 2i+1)（GPT-J 风格），而不是 rotate-half 的 (i, i+R/2)",
          old=("    x1, x2 = x.float().chunk(2, dim=-1)                 # [N, heads, R/2] each: pair (i, i + R/2)\n"
               "    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)\n"),
          new=("    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]\n"
               "    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)\n"),
          expect="相邻配对"),
    Plant("rotate_half_sign",
          "rotate_half 的负号放反（写成 cat(x2, -x1)），等于反向旋转",
          old="    return torch.cat((-x2, x1), dim=-1)\n",
          new="    return torch.cat((x2, -x1), dim=-1)\n",
          expect="负号放反"),
    Plant("cache_prefix_rows",
          "按 cache[:N] 取行（默认位置是 0..N-1），而不是按每个 token 的 positions 取",
          old="cos_sin = self.cos_sin_cache[positions]",
          new="cos_sin = self.cos_sin_cache[: positions.shape[-1]]",
          expect="cache[:N]"),
    Plant("partial_rotates_all_dims",
          "partial rotary 时旋转了全部 head_dim 维",
          old="    rotary_dim = int(head_dim * factor)\n",
          new="    rotary_dim = head_dim\n",
          expect="旋转了全部 head_dim 维"),
    Plant("inv_freq_head_dim_denominator",
          "partial rotary 的 inv_freq 分母用了 head_dim 而不是 rotary_dim",
          old="/ rotary_dim))  # [R/2]",
          new="/ head_dim))  # [R/2]",
          expect="分母用了 head_dim"),
    Plant("cache_stored_bf16",
          "cos/sin 在 bf16 中计算或存储（cache 存成 bf16）",
          old='self.register_buffer("cos_sin_cache", cache, persistent=False)',
          new='self.register_buffer("cos_sin_cache", cache.to(torch.bfloat16), persistent=False)',
          expect="bf16 中计算或存储"),
    Plant("inv_freq_default_dtype",
          "cos/sin 在 bf16 中计算或存储（arange 没写 dtype，默认 dtype 为 bf16 时 inv_freq 成了 bf16）",
          old="torch.arange(0, rotary_dim, 2, dtype=torch.float32)",
          new="torch.arange(0, rotary_dim, 2)",
          expect="bf16 中计算或存储"),
    Plant("mrope_chunked_sections",
          "MRoPE 按段连续切分（Qwen2-VL 的 TTT…HHH…WWW），而不是交错 THWTHW…",
          old=("    i = torch.arange(num_freqs)\n"
               "    axes = torch.zeros(num_freqs, dtype=torch.long)\n"),
          new=("    return torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))[:num_freqs]\n"
               "    i = torch.arange(num_freqs)\n"
               "    axes = torch.zeros(num_freqs, dtype=torch.long)\n"),
          expect="按段连续切分"),
    Plant("mrope_only_t",
          "MRoPE 只用了 t 行位置，忽略了 h/w",
          old="cos_sin = torch.take_along_dim(cos_sin, self.mrope_axis.view(1, 1, -1), dim=0)[0]",
          new="cos_sin = cos_sin[0]",
          expect="只用了 t 行位置"),
    Plant("mrope_bound",
          "交错规则的上界写成 i < sec[k]，应为 i < 3·sec[k]",
          old=("    axes[(i % 3 == 1) & (i < 3 * mrope_section[1])] = 1\n"
               "    axes[(i % 3 == 2) & (i < 3 * mrope_section[2])] = 2\n"),
          new=("    axes[(i % 3 == 1) & (i < mrope_section[1])] = 1\n"
               "    axes[(i % 3 == 2) & (i < mrope_section[2])] = 2\n"),
          expect="上界写成 i < sec[k]"),
]
