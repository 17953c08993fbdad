"""Every 易错点 of lessons/m03_sparse_moe.md, planted into a copy of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("topk_before_softmax", "先 top-k logits 再 softmax",
          old="    probs = torch.softmax(logits.float(), dim=-1)               # over ALL experts, in fp32\n"
              "    weights, ids = torch.topk(probs, top_k, dim=-1)             # [N, k] each\n",
          new="    weights, ids = torch.topk(logits.float(), top_k, dim=-1)\n"
              "    weights = torch.softmax(weights, dim=-1)\n",
          expect="先 top-k logits 再 softmax"),
    Plant("repeat_not_interleave", "token id 用 arange(N).repeat(k) 而不是 repeat_interleave(k)",
          old=".repeat_interleave(w.top_k)", new=".repeat(w.top_k)",
          expect="repeat_interleave"),
    Plant("assign_not_index_add", "scatter 用赋值 out[toks] = y",
          old="out.index_add_(0, tokens, y * flat_weight[pairs, None])",
          new="out[tokens] = y * flat_weight[pairs, None]",
          expect="index_add_"),
    Plant("missing_transpose", "gate/up 投影写成 h @ w_gate[e]（少了转置）",
          old="F.linear(F.silu(F.linear(h, w_gate)) * F.linear(h, w_up), w_down)",
          new="F.linear(F.silu(h @ w_gate) * F.linear(h, w_up), w_down)",
          expect="少了转置"),
    Plant("fp32_weights_leak", "路由权重留在 fp32，结果 dtype 被提升",
          old="    return weights.to(x.dtype), ids\n", new="    return weights, ids\n",
          expect="fp32"),
    Plant("matmul_on_empty_experts", "对空 expert 做 matmul",
          old="        if n == 0:\n            continue                                                            # no token chose expert e\n",
          new="",
          expect="对空 expert"),
    Plant("every_expert_on_all_tokens", "每个 expert 在全部 N 个 token 上算再 mask",
          old="        y = swiglu(x[tokens], w.w_gate[e], w.w_up[e], w.w_down[e])              # [n_e, H]\n",
          new="        y = swiglu(x, w.w_gate[e], w.w_up[e], w.w_down[e])[tokens]\n",
          expect="全部 N 个 token"),
    Plant("shared_gate_vector", "shared expert 的门控当成向量",
          old="torch.sigmoid(x @ s.gate.T)", new="torch.sigmoid(x * s.gate)",
          expect="门控当成了向量"),
    Plant("shared_none_not_skipped", "忘了 w.shared is None（thinker）时跳过",
          old="    if w.shared is not None:\n        s = w.shared\n",
          new="    if True:\n        s = w.shared\n",
          expect="w.shared is None"),
]
