"""Every 易错点 of lessons/m04_attention.md, planted into a copy of the reference."""

from checks.plants import Plant

_BLOCK = (
    '        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k[k0:k1].float()) * scale   # [nH, Lq, Lk]\n'
    "        # bottom-right causal: the last query sees every key; a cached prefix shifts the diagonal\n"
    "        visible = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(len_k - len_q)\n"
    '        scores = scores.masked_fill(~visible, float("-inf"))\n'
    "        probs = torch.softmax(scores, dim=-1)                                               # fp32\n"
    '        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v[k0:k1].float()).to(q.dtype)       # [Lq, nH, D]\n'
)

PLANTS = [
    Plant("pack_causal", "把整个 pack 当成一条序列做 causal",
          old="starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()",
          new="starts_q, starts_k = [0, q.shape[0]], [0, k.shape[0]]",
          expect="跨序列"),
    Plant("top_left_mask", "有 cached prefix 时 mask 左上对齐（tril(0)）",
          old=".tril(len_k - len_q)", new=".tril(0)",
          expect="左上对齐"),
    Plant("gqa_repeat", "GQA 用 repeat 而不是 repeat_interleave",
          old="k = k.repeat_interleave(group, dim=1)                       # [Nk, nH, D]\n"
              "    v = v.repeat_interleave(group, dim=1)                       # [Nk, nH, D]\n",
          new="k = k.repeat(1, group, 1)\n"
              "    v = v.repeat(1, group, 1)\n",
          expect="repeat_interleave"),
    Plant("no_qk_norm", "漏了 q_norm / k_norm",
          old="        q, k = self.q_norm(q), self.k_norm(k)                      # per head over D, before RoPE\n",
          new="",
          expect="漏了 q_norm"),
    Plant("norm_after_rope", "q_norm / k_norm 放在 RoPE 之后",
          old="        q, k = self.q_norm(q), self.k_norm(k)                      # per head over D, before RoPE\n"
              "        q, k = self.rotary(positions, q, k)\n",
          new="        q, k = self.rotary(positions, q, k)\n"
              "        q, k = self.q_norm(q), self.k_norm(k)\n",
          expect="RoPE 之后"),
    Plant("scale_one_over_d", "scale 写成 1/D",
          old="self.attn = Attention(num_heads, head_dim, head_dim ** -0.5, num_kv_heads)",
          new="self.attn = Attention(num_heads, head_dim, 1.0 / head_dim, num_kv_heads)",
          expect="scale 用了 1/D"),
    Plant("scale_rotary_dim", "partial rotary 时 scale 用 rotary_dim^-0.5",
          old="scale = head_dim ** -0.5", new="scale = rotary.rotary_dim ** -0.5",
          expect="rotary_dim^-0.5"),
    Plant("bf16_scores", "scores / softmax 在 bf16 里算",
          old=_BLOCK,
          new=_BLOCK.replace("q[q0:q1].float(), k[k0:k1].float()", "q[q0:q1], k[k0:k1]")
                    .replace("v[k0:k1].float()", "v[k0:k1]"),
          expect="bf16 里算"),
    Plant("fp32_output", "返回了 fp32 而不是 q.dtype",
          old="out = torch.empty_like(q)", new="out = torch.empty_like(q, dtype=torch.float32)",
          expect="返回了 fp32"),
    Plant("token_loop", "逐 token 的 Python 循环",
          old=_BLOCK,
          new="        for i in range(len_q):                                  # one query token at a time\n"
              "            last = k0 + len_k - len_q + i + 1\n"
              '            s = torch.einsum("hd,khd->hk", q[q0 + i].float(), k[k0:last].float()) * scale\n'
              '            p = torch.softmax(s, dim=-1)\n'
              '            out[q0 + i] = torch.einsum("hk,khd->hd", p, v[k0:last].float()).to(q.dtype)\n',
          expect="逐 token"),
    Plant("flat_gate_split", "gated：q_proj 输出按 [全部 query | 全部 gate] 切开",
          old="q, gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)",
          new="q, gate = (t.reshape(-1, self.num_heads, self.head_dim) for t in q_gate.chunk(2, dim=-1))",
          expect="全部 query | 全部 gate"),
    Plant("gate_after_o_proj", "gated：gate 乘在 o_proj 之后",
          old="        o = o * torch.sigmoid(gate)                                # output gate, per head and channel\n"
              "        return self.o_proj(o.flatten(1))                           # [N, nH*D] -> [N, H]\n",
          new="        return self.o_proj(o.flatten(1)) * torch.sigmoid(gate.flatten(1))\n",
          expect="gate 乘在了 o_proj 之后"),
    Plant("gate_no_sigmoid", "gated：忘了 sigmoid",
          old="o = o * torch.sigmoid(gate)", new="o = o * gate",
          expect="没过 sigmoid"),
    Plant("plain_norm_gated", "gated：q/k norm 用了普通 RMSNorm（w 而不是 1+w）",
          old="        self.q_norm = GemmaRMSNorm(head_dim, rms_norm_eps)         # zero-centred: x_hat * (1 + w)\n"
              "        self.k_norm = GemmaRMSNorm(head_dim, rms_norm_eps)\n",
          new="        self.q_norm = RMSNorm(head_dim, rms_norm_eps)\n"
              "        self.k_norm = RMSNorm(head_dim, rms_norm_eps)\n",
          expect="普通 RMSNorm"),
    Plant("offset_from_pack_totals", "causal 偏移用了整个 pack 的 Nk − Nq",
          old="tril(len_k - len_q)", new="tril(starts_k[-1] - starts_q[-1])",
          expect="Nk − Nq"),
    Plant("offset_from_max_seqlen", "causal 偏移用了 max_seqlen_k − max_seqlen_q",
          old="tril(len_k - len_q)",
          new="tril(max(y - x for x, y in zip(starts_k, starts_k[1:])) - max(y - x for x, y in zip(starts_q, starts_q[1:])))",
          expect="max_seqlen_k − max_seqlen_q"),
    Plant("keys_sliced_with_cu_q", "k / v 用 cu_seqlens_q 切",
          old="        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]\n",
          new="        q0, q1 = starts_q[b], starts_q[b + 1]\n        k0, k1 = q0, q1\n",
          expect="用 cu_seqlens_q 切了"),
    Plant("qk_norm_default_eps", "q_norm / k_norm 没有用传入的 rms_norm_eps",
          old="        self.q_norm = RMSNorm(head_dim, rms_norm_eps)\n        self.k_norm = RMSNorm(head_dim, rms_norm_eps)\n",
          new="        self.q_norm = RMSNorm(head_dim)\n        self.k_norm = RMSNorm(head_dim)\n",
          expect="rms_norm_eps"),
    Plant("attention_no_cache_attrs", "Attention 没有设 k_cache = v_cache = None",
          old="        self.k_cache = self.v_cache = None\n",
          new="",
          expect="k_cache"),
    Plant("gate_sigmoid_fp32", "gate 的 sigmoid 在 fp32 里算，bf16 模块的结果被提升成 fp32",
          old="        o = o * torch.sigmoid(gate)                                # output gate, per head and channel\n",
          new="        o = o * torch.sigmoid(gate.float())\n",
          expect="bf16 的模块里出现了 fp32 张量"),
]
