"""Figures of the kernel-level topics: Triton programs (k01), MoE dispatch and alignment, split-K decode attention, GDN
chunks and kernel grids, CUDA-graph capture and replay."""

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


def split_k_decode() -> Svg:
    s = Svg(760, 360, "split-K decode：每段一遍 online softmax，reduce 按 lse 合并")
    s.text(380, 22, "一条序列、一个 kv 头的 decode：key 切成 num_splits 段，grid (B, nKV, num_splits)，每段一个程序",
           size=12, weight="bold")
    fills = [C["attn"], C["kv"], C["moe"]]
    for t in range(12):
        seg = t // 4
        s.box(30 + t * 58, 40, 54, 26, f"tile {t}", fill=fills[seg], size=10, mono=True)
    s.text(380, 82, "分数乘过 log₂e（m 以 2 为底）；tile = BLOCK_N 个 key（经 block table 读分页 KV）；段长 = ceil(ceil(Lk / num_splits) / BLOCK_N) · BLOCK_N",
           size=10, color="#444")
    for seg in range(3):
        x = 30 + seg * 232
        s.rect(x, 94, 226, 120, fill=fills[seg], rx=8)
        s.text(x + 113, 112, f"程序 (b, h, s = {seg})", size=12, weight="bold")
        s.text(x + 10, 132, "逐 tile：m_new = max(m, max s)", size=10, anchor="start", mono=True)
        s.text(x + 10, 148, "alpha = 2^(m − m_new)", size=10, anchor="start", mono=True)
        s.text(x + 10, 164, "l = l·alpha + Σ p", size=10, anchor="start", mono=True)
        s.text(x + 10, 180, "acc = acc·alpha + p·V", size=10, anchor="start", mono=True)
        s.box(x + 23, 188, 180, 22, f"写 o_{seg} = acc / l，lse_{seg} = m + log₂ l", fill=C["free"], size=10)
        s.arrow(x + 113, 214, 380, 246)
    s.box(180, 248, 400, 58, "reduce kernel（每个 (b, query 头) 一个程序）\nw_s = 2^(lse_s − max lse)\n"
          "o = Σ w_s · o_s / Σ w_s", fill=C["hot"], size=11)
    s.text(380, 326, "每段只读自己那几个 tile：batch 小、上下文长时也有 B · nKV · num_splits 个程序在读 K/V", size=11)
    s.text(380, 344, "num_splits 是静态整数，grid 只取决于形状，所以 decode 能进 CUDA graph；起点超过 Lk 的段直接返回",
           size=11, color="#444")
    return s


def moe_align() -> Svg:
    s = Svg(760, 330, "moe_align_block_size：pair 按 expert 排序、每段补齐到 BLOCK_M")
    s.text(380, 22, "例：3 个 token、top-2、E = 5、BLOCK_M = 4；pair p = token · k + j（共 N·k = 6 个），补位的 id = N·k = 6",
           size=12, weight="bold")
    pairs = [(0, 2), (0, 0), (1, 1), (1, 2), (2, 2), (2, 3)]
    efill = [C["attn"], C["kv"], C["moe"], C["gdn"], C["mlp"]]
    s.text(20, 56, "pair → expert", size=11, anchor="start", weight="bold")
    for p, (t, e) in enumerate(pairs):
        s.box(120 + p * 70, 40, 64, 26, f"p{p}: t{t}→e{e}", fill=efill[e], size=10, mono=True)
    s.text(20, 106, "sorted_ids", size=11, anchor="start", weight="bold", mono=True)
    s.text(20, 150, "expert_ids", size=11, anchor="start", weight="bold", mono=True)
    blocks = [(0, [1]), (1, [2]), (2, [0, 3, 4]), (3, [5]), (-1, []), (-1, [])]
    for b, (e, ids) in enumerate(blocks):
        x0 = 120 + b * 104
        for j in range(4):
            real = j < len(ids)
            fill = efill[e] if e >= 0 and real else C["free"]
            s.box(x0 + j * 24, 92, 22, 24, str(ids[j]) if real else "6", fill=fill, size=10, mono=True,
                  dash=not real)
        s.box(x0 + 18, 136, 60, 24, str(e), fill=efill[e] if e >= 0 else C["io"], size=11, mono=True, dash=e < 0)
        s.text(x0 + 48, 178, f"block {b}", size=10, color="#444")
    s.line([(120 + 4 * 104 - 6, 86), (120 + 4 * 104 - 6, 186)], arrow=False, dash=True, color="#a33")
    s.text(740, 200, "num_tokens_post_padded = 16：之后的 block 直接返回", size=10, color="#a33", anchor="end")
    s.text(20, 226, "grouped GEMM 的 grid", size=11, anchor="start", weight="bold")
    s.box(20, 238, 230, 46, "程序 (pid_m, pid_n)\ne = expert_ids[pid_m]", fill=C["gpu"], size=11, mono=True)
    s.box(290, 238, 210, 46, "读 sorted_ids 的一个 block，\ngather token 行 pair // k", fill=C["free"], size=11)
    s.box(540, 238, 200, 46, "W_e 的第 pid_n 列块，\n沿 K 一块块 tl.dot", fill=C["moe"], size=11)
    s.arrow(250, 261, 288, 261)
    s.arrow(500, 261, 538, 261)
    s.text(380, 310, "一个 block 的 BLOCK_M 行都属于同一个 expert，所以它就是一个普通的小 GEMM；补位行（id 6）不读也不写",
           size=11)
    return s


def gdn_grids() -> Svg:
    s = Svg(760, 360, "Gated DeltaNet kernel 的 grid：decode 与分块 prefill")
    s.text(190, 22, "decode：grid (B, nv, dv / BV)", size=13, weight="bold")
    s.text(190, 42, "状态池 ssm_pool [slots, nv, dk, dv]，fp32", size=11, color="#444")
    for k in range(3):
        s.rect(60 + k * 14, 56 + k * 10, 200, 120, fill=C["gdn"] if k < 2 else C["hot"], rx=4)
    x0, y0 = 88, 76
    for j in range(4):
        s.rect(x0 + j * 50, y0, 50, 120, fill=C["hot"] if j == 1 else C["gdn"], rx=0)
        s.text(x0 + j * 50 + 25, y0 + 64, f"dv 块 {j}", size=10)
    s.text(x0 + 100, y0 + 136, "slot = slots[b]：一个序列在池里的槽位", size=10, color="#444")
    s.text(40, y0 + 64, "dk", size=11, mono=True)
    s.box(20, 232, 340, 50, "程序 (b, h, j)：读一次 [dk, BV] 的状态块 →\n衰减、读预测、写纠正、算输出 → 写回原处",
          fill=C["free"], size=11)
    s.text(190, 302, "slots[b] = −1（CUDA graph 补齐的行）：整块掩码掉，", size=10.5, color="#a33")
    s.text(190, 318, "不读也不写池", size=10.5, color="#a33")
    s.arrow(188, 230, 188, 214)
    s.text(570, 22, "prefill：两个 kernel", size=13, weight="bold")
    s.text(570, 42, "① _chunk_prep_kernel，grid (块数, nv)：全部并行", size=11, weight="bold")
    for c in range(6):
        s.box(410 + c * 54, 52, 48, 30, f"块 {c}", fill=C["gdn"], size=10)
    s.text(570, 100, "每块一个程序：γ、L、T、w、u、Aqk（与状态无关）", size=10, color="#444")
    s.text(570, 136, "② _chunk_state_kernel，grid (B, nv, dv / BV)", size=11, weight="bold")
    for c in range(6):
        s.box(410 + c * 54, 148, 48, 30, f"块 {c}", fill=C["free"], size=10)
        if c:
            s.arrow(410 + c * 54 - 6, 163, 410 + c * 54 - 1, 163)
    s.text(570, 196, "一个程序沿一条序列的块顺序走：状态 S [dk, BV] 留在寄存器，", size=10, color="#444")
    s.text(570, 212, "每块一次交接，同时算出这块的输出", size=10, color="#444")
    s.box(420, 232, 300, 50, "并行度 = B · nv · dv / BV 个程序\n[1, 8192, 32, 128]、BV = 32：128 个（H200 有 132 个 SM）",
          fill=C["hot"], size=10.5)
    s.text(380, 348, "decode 是纯带宽问题（状态读一次、写一次）；prefill 把块内的依赖变成矩阵乘，只有块间交接是顺序的",
           size=11)
    return s


def cuda_graph() -> Svg:
    s = Svg(760, 310, "CUDA graph：capture 一次，replay 每一步")
    s.text(200, 24, "capture（启动时，每个 batch 桶一次）", size=13, weight="bold")
    for i, bs in enumerate([1, 2, 4, 8, 16, 32, 48, "…"]):
        s.box(20 + i * 34, 40, 30, 28, str(bs), fill=C["gpu"], size=10)
    s.box(292, 40, 88, 28, "max_num_seqs", fill=C["gpu"], size=10, mono=True)
    s.text(200, 82, "桶：1、2、4、8，之后每 16 一个，直到 max_num_seqs", size=10, color="#444")
    s.box(20, 92, 360, 38, "静态输入 buffer：input_ids、positions、\nslot_mapping、block_tables、context_lens",
          fill=C["kv"], size=10.5)
    s.box(20, 142, 360, 34, "model.forward(buffers) 录成一张图：几百个 kernel 的启动参数固定", fill=C["hot"], size=10.5)
    s.box(20, 188, 360, 34, "静态输出 buffer：logits / hidden states", fill=C["kv"], size=10.5)
    s.arrow(200, 130, 200, 140)
    s.arrow(200, 176, 200, 186)
    s.text(580, 24, "replay（每个 decode 步）", size=13, weight="bold")
    steps = ["batch 有 n 个请求：取 ≥ n 的最小桶 bs", "把本步输入 copy_ 进静态 buffer\n（多出的行填 padding）",
             "graph.replay()：一次启动", "从静态输出取前 n 行 → sampler"]
    for i, t in enumerate(steps):
        s.box(420, 40 + i * 54, 320, 42, t, fill=C["gpu"] if i == 2 else C["free"], size=11)
        if i:
            s.arrow(580, 40 + i * 54 - 12, 580, 40 + i * 54 - 2)
    s.line([(380, 159), (418, 159)], dash=True)
    s.text(380, 272, "为什么：decode 一步的 kernel 都很小，CPU 逐个 launch 的时间比 GPU 计算还长；", size=11)
    s.text(380, 290, "图里的地址和形状都固定，所以输入必须写进同一块 buffer，prefill（形状多变）仍走 eager", size=11)
    return s


def triton_programs() -> Svg:
    """K.1: how the two kernels split their work into programs, and what one program reads and writes."""
    s = Svg(760, 430, "Triton 的 program：add_rms_norm 一个 program 几行，store_kvcache 一个 program 一个 token")
    s.text(380, 22, "① add_rms_norm：[R, H] 看成 R 行，grid = (⌈R / ROWS⌉,)；H = 12 时 BLOCK_H = 16，多出的 4 列由 mask 挡住",
           size=11.5, weight="bold")
    rows, h, block = 6, 12, 16
    for r in range(rows):
        y = 40 + r * 18
        s.rect(40, y, 12 * h, 15, fill=[C["norm"], C["attn"], C["mlp"]][r // 2], rx=1, sw=0.8)
        s.rect(40 + 12 * h, y, 12 * (block - h), 15, fill="#fff", rx=1, dash=True, sw=0.8)
        s.text(32, y + 12, f"row {r}", size=9.5, anchor="end", color="#555", mono=True)
    for g in range(3):
        s.text(250, 40 + g * 36 + 21, f"program {g}（ROWS = 2）", size=10.5, anchor="start", color="#333")
    s.text(136, 160, "mask = cols < H", size=10, color="#a33", mono=True)
    steps = ["load x, residual\n（mask，other = 0）", "s = x + residual\n舍入回 x.dtype", "store s\n（新的 residual）",
             "fp32：mean(s²)\nrsqrt(· + eps)", "× w（Qwen3：先转\nx.dtype 再乘）", "store normed"]
    for i, t in enumerate(steps):
        x = 400 + (i % 3) * 120
        y = 40 + (i // 3) * 62
        s.box(x, y, 110, 44, t, fill=C["gpu"] if i in (0, 2, 5) else C["norm"], size=10)
        if i % 3:
            s.arrow(x - 10, y + 22, x - 1, y + 22)
    s.line([(730, 84), (740, 84), (740, 94), (390, 94), (390, 124), (399, 124)])
    s.text(580, 180, "一个 program 里：读 2 份、写 2 份，中间全在寄存器里", size=10.5, color="#444")
    s.text(580, 196, "torch eager：9 个算子，[N, H] 在显存里来回 9 趟", size=10.5, color="#a33")
    s.line([(20, 214), (740, 214)], arrow=False, dash=True, color="#bbb")
    s.text(380, 238, "② store_kvcache：grid = (N,)，program t 把第 t 个 token 的 k、v 各 nKV·D 个元素搬进 paged cache",
           size=11.5, weight="bold")
    s.text(30, 266, "qkv 投影的输出 [N, (nH + 2nKV)·D]", size=10.5, anchor="start")
    for t in range(3):
        y = 274 + t * 26
        for j, (w, label, fill) in enumerate(((150, "q", C["attn"]), (60, "k", C["kv"]), (60, "v", C["mlp"]))):
            x = 30 + sum((150, 60, 60)[:j])
            s.box(x, y, w, 20, f"{label}[{t}]", fill=fill, size=10, mono=True, rx=1)
    s.text(165, 364, "k = qkv[:, nH·D : (nH+nKV)·D]：相邻 token 的 k 相隔一整行", size=10, color="#a33")
    s.text(165, 380, "地址用 k.stride(0)，不是 nKV·D", size=10, color="#a33")
    s.text(410, 266, "slot_mapping", size=10.5, mono=True)
    for t, slot in enumerate((9, 2, -1)):
        s.box(380, 274 + t * 26, 60, 20, str(slot), fill=C["hot"] if slot >= 0 else C["free"], size=10, mono=True, rx=1,
              dash=slot < 0)
        s.arrow(300, 284 + t * 26, 378, 284 + t * 26, color="#999")
    s.text(600, 266, "k_cache [blocks, P = 4, nKV, D]", size=10.5)
    for b in range(3):
        for r in range(4):
            slot = b * 4 + r
            x, y = 500 + b * 80, 274 + r * 20
            s.box(x, y, 70, 17, f"{slot}", fill=C["kv"] if slot in (9, 2) else "#fff", size=9, mono=True, rx=1)
    s.curve(440, 284, 520, 240, 650, 294)
    s.curve(440, 310, 460, 300, 548, 315)
    s.text(600, 372, "block = slot // P，行 = slot % P", size=10.5, mono=True)
    s.text(600, 390, "slot = −1（CUDA graph 的填充行）：整个 program 跳过", size=10.5, color="#a33")
    s.text(380, 420, "两个 kernel 几乎不计算：时间 = 搬的字节 / 显存带宽，衡量标准是占 device-to-device copy 的几成", size=11)
    return s


FIGURES = {"moe-dispatch": moe_dispatch, "moe-align": moe_align, "split-k-decode": split_k_decode,
           "gdn-chunks": gdn_chunks, "gdn-grids": gdn_grids, "cuda-graph": cuda_graph,
           "triton-programs": triton_programs}
