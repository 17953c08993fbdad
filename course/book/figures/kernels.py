"""Figures of the kernel-level topics: MoE dispatch, GDN chunks, CUDA-graph capture and replay."""

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
    s = Svg(760, 300, "CUDA graph：capture 一次，replay 每一步")
    s.text(190, 24, "capture（启动时，每个 batch 大小一次）", size=13, weight="bold")
    for i, bs in enumerate([1, 2, 4, 8, 16, "…", 512]):
        s.box(20 + i * 52, 40, 46, 28, f"bs={bs}" if bs != "…" else "…", fill=C["gpu"], size=10)
    s.box(20, 90, 360, 34, "静态输入 buffer：input_ids、positions、slot_mapping、block_tables、context_lens",
          fill=C["kv"], size=10.5)
    s.box(20, 136, 360, 34, "model.forward(buffers) 录成一张图：几百个 kernel 的启动参数固定", fill=C["hot"], size=10.5)
    s.box(20, 182, 360, 34, "静态输出 buffer：logits / hidden states", fill=C["kv"], size=10.5)
    s.arrow(200, 124, 200, 134)
    s.arrow(200, 170, 200, 180)
    s.text(570, 24, "replay（每个 decode 步）", size=13, weight="bold")
    steps = ["batch 有 n 个请求：取 ≥ n 的最小 bs", "把本步输入 copy_ 进静态 buffer\n（多出的行填 padding）",
             "graph.replay()：一次启动", "从静态输出取前 n 行 → sampler"]
    for i, t in enumerate(steps):
        s.box(420, 40 + i * 54, 320, 42, t, fill=C["gpu"] if i == 2 else C["free"], size=11)
        if i:
            s.arrow(580, 40 + i * 54 - 12, 580, 40 + i * 54 - 2)
    s.line([(380, 153), (418, 153)], dash=True)
    s.text(380, 252, "为什么：decode 一步的 kernel 都很小，CPU 逐个 launch 的时间比 GPU 计算还长；", size=11)
    s.text(380, 270, "图里的地址和形状都固定，所以输入必须写进同一块 buffer，prefill（形状多变）仍走 eager", size=11)
    return s


FIGURES = {"moe-dispatch": moe_dispatch, "gdn-chunks": gdn_chunks, "cuda-graph": cuda_graph}
