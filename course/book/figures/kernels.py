"""Figures of the kernel-level topics: MoE dispatch, GDN chunks, CUDA-graph capture and replay, and Track K's
kernels (online softmax and split-K, the fused-MoE align layout, the GDN kernels' grids)."""

from __future__ import annotations

from .svg import COLORS as C, Svg


def moe_dispatch() -> Svg:
    s = Svg(760, 330, "MoE dispatch：align → grouped GEMM → combine")
    s.text(80, 24, "① 路由（top-2）", size=13, weight="bold")
    routes = [("t0", "1, 3"), ("t1", "0, 1"), ("t2", "3, 1"), ("t3", "0, 2")]
    for i, (t, e) in enumerate(routes):
        s.box(20, 40 + i * 40, 120, 30, f"{t} → e{{{e}}}", fill=C["io"], size=12, mono=True)
    s.text(300, 24, "② align：按 expert 排序、分组", size=13, weight="bold")
    groups = [("e0", ["t1", "t3"]), ("e1", ["t0", "t1", "t2"]), ("e2", ["t3"]), ("e3", ["t0", "t2"])]
    for g, (e, toks) in enumerate(groups):
        y = 40 + g * 48
        s.text(200, y + 21, e, size=12, weight="bold")
        for j, t in enumerate(toks):
            s.box(220 + j * 50, y, 44, 30, t, fill=C["moe"], size=12, mono=True)
        for j in range(len(toks), 4):
            s.box(220 + j * 50, y, 44, 30, "pad", fill=C["free"], size=10, dash=True)
    s.text(320, 250, "GPU 版把每组补齐到 BLOCK_M 的倍数", size=11, color="#444")
    s.text(320, 266, "（moe_align_block_size；CPU 版用 argsort + bincount）", size=11, color="#444")
    s.arrow(140, 100, 196, 100)
    s.text(560, 24, "③ grouped GEMM", size=13, weight="bold")
    for g, (e, _) in enumerate(groups):
        y = 40 + g * 48
        s.box(470, y, 170, 30, f"SwiGLU(X_{e}; W_{e})", fill=C["gpu"], size=12, mono=True)
    s.arrow(424, 150, 466, 150)
    s.text(560, 236, "每个 expert 一次矩阵乘，", size=11, color="#444")
    s.text(560, 252, "只算分给它的 token", size=11, color="#444")
    s.text(700, 24, "④ combine", size=13, weight="bold")
    s.box(665, 60, 80, 150, "out[t] +=\nw[t,j] ·\ny[t,j]\n\nindex_add_\n按 token\nscatter 回去", fill=C["mlp"], size=11)
    s.arrow(640, 135, 663, 135)
    s.text(380, 312, "结果与逐 token 循环逐位相同（同样的乘加），但每个 expert 的权重只读一次", size=12)
    return s


def gdn_chunks() -> Svg:
    s = Svg(760, 336, "Gated DeltaNet 的分块结构")
    s.text(380, 22, "序列按 C 个 token 分块：块内并行（WY 形式，矩阵乘），块间递推（状态 S 只传 T/C 次）", size=12,
           weight="bold")
    xs = [30, 270, 510]
    for i, x in enumerate(xs):
        s.rect(x, 40, 220, 180, fill=C["gdn"], rx=8)
        s.text(x + 110, 60, f"chunk {i}（token {i}C … {i + 1}C−1）", size=12, weight="bold")
        for j in range(6):
            s.box(x + 12 + j * 33, 72, 28, 24, f"t{j}", fill=C["free"], size=10, mono=True)
        s.box(x + 12, 104, 196, 30, "解 (I + L)·[U_local, W] =\n[β⊙V, β⊙e^γ⊙K]", fill=C["free"], size=10, mono=True)
        s.box(x + 12, 140, 196, 30, "U = U_local − W·S", fill=C["free"], size=11, mono=True)
        s.box(x + 12, 176, 196, 34, "O = (Q⊙e^γ)·S + ((QKᵀ)⊙D)·U\nS ← e^γc·S + (K⊙e^(γc−γ))ᵀ·U",
              fill=C["free"], size=10, mono=True)
        s.box(x + 60, 250, 100, 34, f"S_{i + 1} [dk, dv]", fill=C["hot"], size=12, mono=True)
        s.arrow(x + 110, 220, x + 110, 248)
        if i:
            s.line([(xs[i - 1] + 160, 267), (x - 20, 267), (x - 20, 190), (x + 10, 190)])
    s.text(380, 304, "第一行与 S 无关：所有块可以同时解（WY 形式）；后两行依次把块首状态 S 传给下一块", size=11,
           color="#444")
    s.text(380, 322, "decode 是 c = 1 的特例（单步递推）；prefill 用分块形式，数学上结果相同", size=11, color="#444")
    return s


def cuda_graph() -> Svg:
    s = Svg(760, 316, "CUDA graph：capture 一次，replay 每一步")
    s.text(190, 24, "capture（启动时，每个 batch 桶一次）", size=13, weight="bold")
    for i, bs in enumerate([1, 2, 4, 8, 16, 32, "…", "max"]):
        s.box(20 + i * 45, 40, 41, 28, "…" if bs == "…" else f"{bs}", fill=C["gpu"], size=10.5, mono=True)
    s.text(200, 84, "桶：1、2、4、8，然后每 16 一个，直到 max_num_seqs", size=10.5, color="#444")
    s.box(20, 96, 360, 44, "静态输入 buffer：input_ids、positions、\nslot_mapping、block_tables、context_lens",
          fill=C["kv"], size=10.5)
    s.box(20, 152, 360, 34, "model.forward(buffers) 录成一张图：kernel 的启动参数固定", fill=C["hot"], size=10.5)
    s.box(20, 198, 360, 34, "静态输出 buffer：logits / hidden states", fill=C["kv"], size=10.5)
    s.arrow(200, 140, 200, 150)
    s.arrow(200, 186, 200, 196)
    s.text(570, 24, "replay（每个 decode 步）", size=13, weight="bold")
    steps = ["batch 有 n 个请求：取 ≥ n 的最小桶 bs", "把本步输入 copy_ 进静态 buffer\n（多出的行 slot = −1）",
             "graph.replay()：一次启动", "从静态输出取前 n 行 → sampler"]
    for i, t in enumerate(steps):
        s.box(420, 40 + i * 54, 320, 42, t, fill=C["gpu"] if i == 2 else C["free"], size=11)
        if i:
            s.arrow(580, 40 + i * 54 - 12, 580, 40 + i * 54 - 2)
    s.line([(380, 169), (418, 169)], dash=True)
    s.text(380, 268, "为什么：decode 一步的 kernel 都很小，CPU 逐个 launch 的时间比 GPU 计算还长；", size=11)
    s.text(380, 286, "图里的地址和形状都固定，所以输入必须写进同一块 buffer，prefill（形状多变）仍走 eager", size=11)
    return s


def online_softmax_splitk() -> Svg:
    s = Svg(760, 300, "online softmax 与 split-K decode 的 reduce")
    s.text(190, 22, "① 一个 program：一块一块地看 key", size=13, weight="bold")
    tiles = ["key 0–15", "key 16–31", "key 32–47"]
    for i, name in enumerate(tiles):
        x = 20 + i * 120
        s.box(x, 36, 110, 28, name, fill=C["kv"], size=11, mono=True)
        s.box(x, 88, 110, 62, f"m, l, acc\n× α = 2^(m−m_new)\n+ 本块", fill=C["free"], size=10.5)
        s.arrow(x + 55, 64, x + 55, 86)
        if i:
            s.arrow(x - 12, 119, x - 1, 119)
    s.box(110, 176, 180, 30, "o = acc / l", fill=C["hot"], size=12, mono=True)
    s.arrow(315, 150, 240, 174)
    s.text(190, 228, "分数矩阵不离开寄存器；每块 K/V 只读一次", size=11, color="#444")
    s.text(190, 246, "m 以 log₂ 为单位（scale 里乘了 log₂e，exp 换成 exp2）", size=11, color="#444")
    s.text(570, 22, "② split-K：一条序列切成 num_splits 段", size=13, weight="bold")
    for i in range(3):
        y = 36 + i * 52
        s.box(400, y, 130, 40, f"split {i}：online softmax\n只看本段的 key", fill=C["gpu"], size=10.5)
        s.box(560, y + 5, 80, 30, f"o_{i}, lse_{i}", fill=C["free"], size=11, mono=True)
        s.arrow(530, y + 20, 558, y + 20)
        s.arrow(640, y + 20, 660, 110)
    s.box(662, 80, 94, 60, "reduce\nw_s =\n2^(lse_s − max)", fill=C["hot"], size=10.5)
    s.text(576, 206, "lse_s = m_s + log₂ l_s（与 m 同一个底）", size=11, mono=True)
    s.text(576, 226, "o = Σ w_s · o_s / Σ w_s", size=11, mono=True)
    s.text(576, 250, "直接平均 o_s 是错的：每段的 softmax 总质量不同", size=11, color="#444")
    s.text(380, 284, "同一个公式合并两段 key 的 softmax：一个 program 内是逐块合并（①），split-K 是跨 program 合并（②）",
           size=11)
    return s


def moe_align() -> Svg:
    s = Svg(760, 300, "fused MoE 的对齐：sorted_ids 按 expert 分段、每段补齐到 BLOCK_M")
    s.text(380, 22, "ids = [[2, 0], [1, 2], [2, 3]]（N = 3 个 token，k = 2），E = 5，BLOCK_M = 4", size=12,
           weight="bold", mono=True)
    s.text(120, 52, "pair p = token·k + j", size=11, color="#444")
    pairs = [(0, 2), (1, 0), (2, 1), (3, 2), (4, 2), (5, 3)]
    for i, (p, e) in enumerate(pairs):
        s.box(20 + i * 38, 62, 34, 34, f"p{p}\ne{e}", fill=C["moe"], size=10, mono=True)
    s.text(500, 52, "sorted_ids：按 expert 稳定排序，每段补齐（6 = N·k 是空位）", size=11, color="#444")
    sorted_ids = [1, 6, 6, 6, 2, 6, 6, 6, 0, 3, 4, 6, 5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6]
    expert_ids = [0, 1, 2, 3, -1, -1]
    for b in range(6):
        x = 20 + b * 123
        past = b >= 4
        s.rect(x - 3, 108, 121, 92, fill="#fafafa" if past else C["free"], dash=past, rx=4)
        for j in range(4):
            v = sorted_ids[b * 4 + j]
            s.box(x + j * 29, 116, 26, 28, str(v), fill=C["free"] if v == 6 else C["moe"], size=11, mono=True,
                  dash=v == 6)
        s.text(x + 57, 164, f"block {b}", size=11)
        s.text(x + 57, 186, f"expert_ids = {expert_ids[b]}", size=10.5, mono=True)
    s.line([(20 + 4 * 123 - 8, 104), (20 + 4 * 123 - 8, 222)], arrow=False, color="#c0392b", sw=2)
    s.text(20 + 4 * 123 - 8, 238, "num_tokens_post_padded = 16", size=11, color="#c0392b", mono=True)
    s.text(628, 222, "超出的 block：kernel 读到 16 直接 return", size=10.5, color="#444")
    s.text(250, 222, "一个 block = 一个 expert 的普通小 GEMM", size=10.5, color="#444")
    s.text(380, 266, "缓冲区长度只能按上界分配：N·k + min(E, N·k)·(BLOCK_M − 1) = 6 + 5·3 = 21 → 取 6 个 block；", size=11)
    s.text(380, 284, "空位 id = N·k 在 load / store 时被 pairs < N·k 掩掉", size=11)
    return s


def gdn_grids() -> Svg:
    s = Svg(760, 292, "Gated DeltaNet kernel 的 grid：prefill 两个 kernel，decode 两个 kernel")
    s.text(190, 22, "prefill（一个 chunk = 64 个 token）", size=13, weight="bold")
    for i in range(4):
        s.box(20 + i * 88, 40, 82, 40, f"chunk {i}\n(块, v 头)", fill=C["gdn"], size=10.5)
    s.text(190, 100, "_chunk_prep_kernel：grid (块数, nv)，所有块同时算", size=10.5)
    s.text(190, 116, "γ、L、T = (I+L)⁻¹、w、u、Aqk 写到显存（与状态无关）", size=10.5, color="#444")
    for i in range(4):
        s.box(20 + i * 88, 134, 82, 34, f"S{i} → S{i + 1}", fill=C["hot"], size=11, mono=True)
        if i:
            s.arrow(20 + i * 88 - 6, 151, 20 + i * 88 - 1, 151)
    s.text(190, 188, "_chunk_state_kernel：grid (B, nv, dv/BV)", size=10.5)
    s.text(190, 204, "每个程序把 S [dk, BV] 放在寄存器里，沿块顺序走，顺路算 o", size=10.5, color="#444")
    s.text(570, 22, "decode（每条序列 1 个 token）", size=13, weight="bold")
    s.box(400, 40, 340, 40, "_conv_update_kernel：grid (B, C/BC)\n卷积窗口滑一格 → silu → x_conv [B, C]", fill=C["gdn"],
          size=10.5)
    s.arrow(570, 80, 570, 96)
    s.box(400, 98, 340, 52, "递推 kernel：每个程序一条序列、一个 v 头、dv 的一块\nS ← e^g S；u = β(v − kᵀS)；S ← S + k uᵀ；o = Sᵀq",
          fill=C["hot"], size=10.5)
    s.text(570, 170, "状态 ssm_pool[slot] 原地读写；slot = −1 的 padding 行全掩掉", size=10.5, color="#444")
    s.text(570, 188, "拆成两个 kernel：一个 key 头的卷积通道被多个程序共用，", size=10.5, color="#444")
    s.text(570, 204, "在同一个 kernel 里滑窗口会被别的程序读到滑过之后的值", size=10.5, color="#444")
    s.text(380, 256, "顺序推进状态的 kernel（prefill 的 _chunk_state_kernel、decode 的递推）都只有 B·nv·dv/BV 个程序：", size=11)
    s.text(380, 274, "batch 小时它们填不满 H200 的 132 个 SM", size=11)
    return s


FIGURES = {"moe-dispatch": moe_dispatch, "gdn-chunks": gdn_chunks, "cuda-graph": cuda_graph,
           "k02-online-softmax": online_softmax_splitk, "k03-align": moe_align, "k04-grids": gdn_grids}
