"""Every 易错点 of lessons/g01_gpu_engine.md, planted into a copy of the reference (graded on a CUDA machine)."""

from checks.plants import Plant

PLANTS = [
    Plant("stale_graph_input", "replay 前没有把本步的 positions 拷进 graph 的静态 buffer（graph 读的是 capture 时的地址）",
          old='        s["pos"][:bs].copy_(pos)\n', new='        s["pos"] = pos\n',
          expect="静态 buffer"),
    Plant("padding_writes_cache", "padding 行的 slot 用 0 而不是 -1：补齐的行把 K/V 写进了 block 0",
          old="        slots = np.full(rows, -1, np.int64)\n", new="        slots = np.zeros(rows, np.int64)\n",
          expect="padding"),
    Plant("padding_gdn_slot", "padding 行的 GDN 槽位用 0 而不是 -1：补齐的行改写了 0 号槽位的递推状态",
          old="        gdn = np.full(rows, -1, np.int64)\n", new="        gdn = np.zeros(rows, np.int64)\n",
          expect="padding"),
    Plant("host_sync_in_capture", "capture 区域里有 host 同步（.item()）",
          old="            with torch.cuda.graph(graph, pool):\n",
          new="            with torch.cuda.graph(graph, pool):\n                longest = int(s[\"lens\"][:bs].max())\n",
          expect="host 同步"),
    Plant("bucket_too_small", "选 bucket 时取了 < b 的最大 bucket（批里后面的序列被截掉）",
          old="        bs = next((b for b in sorted(self.graphs) if b >= n), None)\n",
          new="        bs = next((b for b in sorted(self.graphs, reverse=True) if b <= n), None)\n",
          expect=None),
    Plant("sampler_tie_last", "单遍 argmax 跨块比较用了 >=：并列最大值取了后面的下标",
          old="        take = x > best_val ", new="        take = x >= best_val ",
          expect="并列最大值"),
    Plant("sampler_gumbel_sign", "Gumbel 噪声的符号反了：x/T + log(-log U)",
          old="            x = x / t - tl.log(-tl.log(u))", new="            x = x / t + tl.log(-tl.log(u))",
          expect="符号反了"),
    Plant("sampler_no_temperature", "忘了除以温度：x - log(-log U)",
          old="            x = x / t - tl.log(-tl.log(u))", new="            x = x - tl.log(-tl.log(u))",
          expect="没有除以温度"),
]
