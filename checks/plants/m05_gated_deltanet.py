"""Planted mistakes for M05 · Gated DeltaNet: every 易错点 of lessons/m05_gated_deltanet.md as an edit of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("conv_same_padding",
          "卷积不是因果的（两边补零 / padding='same'）",
          old="        y = F.conv1d(seq[None], weight[:, None, :], groups=num_channels)[0]    # [C, T]: no padding, y_t sees t-K+1..t\n",
          new="        y = F.conv1d(F.pad(x[start:end].T, ((width - 1) // 2, width // 2))[None], weight[:, None, :],\n"
              "                     groups=num_channels)[0]\n",
          expect="卷积不是因果的"),
    Plant("conv_missing_left_pad",
          "卷积不是因果的（补了 K-1 却取了最后 T 个输出，窗口看到了未来）",
          old="        y = F.conv1d(seq[None], weight[:, None, :], groups=num_channels)[0]    # [C, T]: no padding, y_t sees t-K+1..t\n",
          new="        y = F.conv1d(x[start:end].T[None], weight[:, None, :], padding=width - 1,\n"
              "                     groups=num_channels)[0, :, -(end - start):]\n",
          expect="卷积不是因果的"),
    Plant("conv_state_outputs",
          "conv_state 存的是卷积输出而不是输入",
          old="        new_state[i] = seq[:, seq.shape[1] - (width - 1):]                     # last K-1 INPUTS (not outputs)\n",
          new="        new_state[i] = y[:, y.shape[1] - (width - 1):]\n",
          expect="conv_state 存的是卷积输出"),
    Plant("conv_state_crosses_boundary",
          "conv_state 跨过了序列边界（取打包张量里的最后 K-1 行）",
          old="        new_state[i] = seq[:, seq.shape[1] - (width - 1):]                     # last K-1 INPUTS (not outputs)\n",
          new="        new_state[i] = F.pad(x[:end].T, (width - 1, 0))[:, -(width - 1):]\n",
          expect="conv_state 跨过了序列边界"),
    Plant("conv_update_keeps_oldest",
          "单步更新后 conv_state 留错了 K-1 个输入（丢掉的是新 token）",
          old="    conv_state.copy_(window[:, :, 1:])                                         # drop the oldest input\n",
          new="    conv_state.copy_(window[:, :, :-1])\n",
          expect="conv_state 没变"),
    Plant("g_positive",
          "g 的符号错了（衰减 > 1）",
          old="    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())\n",
          new="    g = torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())\n",
          expect="g 的符号或 softplus"),
    Plant("g_no_softplus",
          "g 少了 softplus",
          old="    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())\n",
          new="    g = -torch.exp(A_log.float()) * (a.float() + dt_bias.float())\n",
          expect="g 的符号或 softplus"),
    Plant("beta_no_sigmoid",
          "beta 忘了 sigmoid",
          old="    beta = torch.sigmoid(b)\n",
          new="    beta = b\n",
          expect="beta 忘了 sigmoid"),
    Plant("l2norm_eps_outside",
          "l2norm 的 eps 放错了位置",
          old="    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)\n",
          new="    return x / (x.norm(dim=-1, keepdim=True) + eps)\n",
          expect="l2norm 的 eps"),
    Plant("q_not_scaled",
          "q 没有乘 dk^-0.5",
          old="        q = l2norm(q.view(num_tokens, nk, dk)) * dk ** -0.5                   # [N, nk, dk] fp32\n",
          new="        q = l2norm(q.view(num_tokens, nk, dk))\n",
          expect="q 没有乘 dk^-0.5"),
    Plant("repeat_not_interleave",
          "k 头扩到 v 头用了 repeat 而不是 repeat_interleave",
          old="        q = q.repeat_interleave(nv // nk, dim=1)                               # [N, nv, dk]: v head j <- k head j // (nv/nk)\n"
              "        k = k.repeat_interleave(nv // nk, dim=1)\n",
          new="        q = q.repeat(1, nv // nk, 1)\n"
              "        k = k.repeat(1, nv // nk, 1)\n",
          expect="repeat_interleave"),
    Plant("decay_after_update",
          "delta rule 更新顺序错了（写入之后才衰减）",
          old="        state = state * g[:, t].exp()[..., None, None]                         # 1. decay       [B, H, dk, dv]\n"
              "        pred = torch.einsum(\"bhk,bhkv->bhv\", k[:, t], state)                   # 2. k^T S       [B, H, dv]\n"
              "        u = beta[:, t, :, None] * (v[:, t] - pred)                             #    correction  [B, H, dv]\n"
              "        state = state + k[:, t, :, :, None] * u[:, :, None, :]                 # 3. S += k u^T\n",
          new="        pred = torch.einsum(\"bhk,bhkv->bhv\", k[:, t], state)\n"
              "        u = beta[:, t, :, None] * (v[:, t] - pred)\n"
              "        state = state + k[:, t, :, :, None] * u[:, :, None, :]\n"
              "        state = state * g[:, t].exp()[..., None, None]\n",
          expect="写入之后才衰减"),
    Plant("read_before_decay",
          "delta rule 更新顺序错了（kᵀS 在衰减之前读）",
          old="        state = state * g[:, t].exp()[..., None, None]                         # 1. decay       [B, H, dk, dv]\n"
              "        pred = torch.einsum(\"bhk,bhkv->bhv\", k[:, t], state)                   # 2. k^T S       [B, H, dv]\n",
          new="        pred = torch.einsum(\"bhk,bhkv->bhv\", k[:, t], state)\n"
              "        state = state * g[:, t].exp()[..., None, None]\n",
          expect="kᵀS 要在衰减之后读"),
    Plant("chunk_forgets_initial_state",
          "分块形式忘了初始状态",
          old="    if initial_state is None:\n"
              "        state = q.new_zeros(batch, heads, dk, dv)\n"
              "    else:\n"
              "        state = initial_state.float()\n"
              "    out = torch.empty_like(v)\n",
          new="    state = q.new_zeros(batch, heads, dk, dv)\n"
              "    out = torch.empty_like(v)\n",
          expect="忘了初始状态"),
    Plant("chunk_forgets_inter_chunk_decay",
          "分块形式忘了块间衰减",
          old="        state = state * chunk_decay[:, :, c] + k_write[:, :, c].transpose(-1, -2) @ u\n",
          new="        state = state + k_write[:, :, c].transpose(-1, -2) @ u\n",
          expect="忘了块间衰减"),
    Plant("norm_one_plus_w",
          "RMSNormGated 的权重用成了 (1+w)",
          old="        o = self.norm(o.reshape(-1, dv), z.reshape(-1, dv))                  # per value head: [N*nv, dv]\n",
          new="        o = F.rms_norm(o.reshape(-1, dv), (dv,), eps=self.norm.eps) * (1 + self.norm.weight) * F.silu(z.reshape(-1, dv))\n",
          expect="(1+w)"),
    Plant("norm_not_per_head",
          "RMSNormGated 没有按 value head 拆开",
          old="        o = self.norm(o.reshape(-1, dv), z.reshape(-1, dv))                  # per value head: [N*nv, dv]\n",
          new="        o = F.rms_norm(o.reshape(num_tokens, -1), (nv * dv,), eps=self.norm.eps) * self.norm.weight.repeat(nv) * F.silu(z)\n",
          expect="没有按 value head 拆开"),
    Plant("chunk_calls_recurrent",
          "分块形式逐 token 循环（直接调用递推形式）",
          old="    batch, steps, heads, dk = k.shape\n    dv, dtype, size = v.shape[-1], v.dtype, chunk_size\n",
          new="    return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)\n"
              "    batch, steps, heads, dk = k.shape\n    dv, dtype, size = v.shape[-1], v.dtype, chunk_size\n",
          expect="分块形式里逐 token 循环"),
    Plant("chunk_row_loop",
          "分块形式块内逐行前代（而不是一次 solve_triangular）",
          old="    system = torch.eye(size, device=q.device) + (k_beta @ k.transpose(-1, -2) * decay).tril(-1)\n"
              "    u_local = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False)           # [.., c, dv]\n"
              "    w = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False)      # [.., c, dk]\n",
          new="    lower = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)\n"
              "    u_local, w = v * beta[..., None], k_beta * gamma.exp()[..., None]\n"
              "    for i in range(1, size):\n"
              "        u_local[..., i, :] = u_local[..., i, :] - (lower[..., i, :i, None] * u_local[..., :i, :]).sum(-2)\n"
              "        w[..., i, :] = w[..., i, :] - (lower[..., i, :i, None] * w[..., :i, :]).sum(-2)\n",
          expect="分块形式里逐 token 循环"),
    Plant("chunk_state_bf16",
          "递推状态在块与块之间存成了 bf16",
          old="        state = state * chunk_decay[:, :, c] + k_write[:, :, c].transpose(-1, -2) @ u\n",
          new="        state = (state * chunk_decay[:, :, c] + k_write[:, :, c].transpose(-1, -2) @ u).to(dtype).float()\n",
          expect="递推状态在块与块之间"),
    Plant("norm_eps_ignored",
          "RMSNormGated 没有用 config 的 rms_norm_eps",
          old="        self.norm = RMSNormGated(head_v_dim, eps=rms_norm_eps)\n",
          new="        self.norm = RMSNormGated(head_v_dim)\n",
          expect="rms_norm_eps"),
    Plant("q_scaled_by_dv",
          "q 乘了 dv^-0.5（dk 与 dv 弄混）",
          old="        q = l2norm(q.view(num_tokens, nk, dk)) * dk ** -0.5                   # [N, nk, dk] fp32\n",
          new="        q = l2norm(q.view(num_tokens, nk, dk)) * dv ** -0.5\n",
          expect=None),
    Plant("conv_kernel_hardcoded",
          "卷积核宽度写死成 4（忽略 conv_kernel_size）",
          old="        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim,\n",
          new="        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, 4, groups=self.conv_dim,\n",
          expect="参数形状"),
]
