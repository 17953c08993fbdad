"""Figures of Track M: the decoder layer of each family, tensor-parallel splits."""

from __future__ import annotations

from .svg import COLORS as C, Svg


def _layer_column(s: Svg, x: float, title: str, mixer: str, mixer_fill: str, ffn: str, ffn_fill: str,
                  norm: str, note: str) -> None:
    w, cx = 200, x + 100
    s.text(cx, 28, title, size=14, weight="bold")
    s.box(x + 40, 44, 120, 28, "hidden stream", fill=C["io"], size=12)
    y = 90
    s.arrow(cx, 72, cx, y + 2)
    s.box(x + 30, y, 140, 30, f"input_layernorm\n{norm}", fill=C["norm"], size=11)
    s.arrow(cx, y + 30, cx, y + 46)
    s.box(x, y + 46, w, 64, mixer, fill=mixer_fill, size=11)
    s.circle(cx, y + 132, 10, "+")
    s.arrow(cx, y + 110, cx, y + 122)
    # residual path around the mixer
    s.line([(x + 40, 58), (x + 8, 58), (x + 8, y + 132), (cx - 10, y + 132)], dash=True)
    s.arrow(cx, y + 142, cx, y + 160)
    s.box(x + 30, y + 160, 140, 30, f"post_attention_layernorm\n{norm}", fill=C["norm"], size=10)
    s.arrow(cx, y + 190, cx, y + 206)
    s.box(x, y + 206, w, 64, ffn, fill=ffn_fill, size=11)
    s.arrow(cx, y + 270, cx, y + 282)
    s.circle(cx, y + 292, 10, "+")
    s.line([(cx + 10, y + 132), (x + w - 6, y + 132), (x + w - 6, y + 292), (cx + 10, y + 292)], dash=True)
    s.arrow(cx, y + 302, cx, y + 318)
    s.box(x + 40, y + 318, 120, 26, "next layer", fill=C["io"], size=12)
    s.text(cx, y + 366, note, size=11, color="#444")


def decoder_layers() -> Svg:
    s = Svg(700, 500, "三个家族的 decoder 层：Qwen3、Qwen3-MoE / Omni、Qwen3.5")
    _layer_column(s, 20, "Qwen3（dense）", "Attention (GQA)\nq_norm / k_norm → RoPE\n→ softmax(QKᵀ/√D)V → o_proj",
                  C["attn"], "SwiGLU MLP\ndown(silu(gate x) ⊙ up x)", C["mlp"], "w · n", "norm: w · n（先 cast 再乘）")
    _layer_column(s, 250, "Qwen3-MoE / Omni", "Attention (GQA)\nq_norm / k_norm → RoPE\n（与 Qwen3 相同）",
                  C["attn"], "Sparse MoE\nrouter → top-k experts\n（talker：+ σ(g·x)·shared）", C["moe"], "w · n",
                  "每层都是 MoE（mlp_only_layers 除外）")
    _layer_column(s, 480, "Qwen3.5（hybrid）", "3 层 Gated DeltaNet : 1 层\ngated attention\n(q_proj 输出 = query ‖ gate)",
                  C["gdn"], "MLP 或 Sparse MoE\n（Qwen3.5-MoE：+ shared）", C["mlp"], "(1 + w) · n",
                  "layer_types 决定每层的 mixer")
    s.text(350, 488, "虚线：残差流。三者的骨架相同，差在 mixer、FFN 和 norm 的写法。", size=12, color="#333")
    return s


def tensor_parallel() -> Svg:
    s = Svg(740, 420, "Tensor parallel：列切、行切与词表切分（tp = 2）")
    # column parallel
    s.text(185, 24, "ColumnParallelLinear（q/k/v、gate_up）", size=13, weight="bold")
    s.box(20, 50, 70, 120, "x\n[N, H]\n每卡完整", fill=C["io"], size=11)
    s.box(130, 40, 110, 60, "W₀  [O/2, H]\nGPU 0", fill=C["gpu"], size=11)
    s.box(130, 120, 110, 60, "W₁  [O/2, H]\nGPU 1", fill=C["gpu"], size=11)
    s.arrow(90, 90, 128, 70)
    s.arrow(90, 130, 128, 150)
    s.box(270, 40, 90, 60, "y₀ [N, O/2]", fill=C["mlp"], size=11)
    s.box(270, 120, 90, 60, "y₁ [N, O/2]", fill=C["mlp"], size=11)
    s.arrow(240, 70, 268, 70)
    s.arrow(240, 150, 268, 150)
    s.text(185, 200, "输出按列切开，留在各卡上：不通信", size=11, color="#444")
    # row parallel
    s.text(555, 24, "RowParallelLinear（o_proj、down_proj）", size=13, weight="bold")
    s.box(400, 40, 80, 60, "y₀ [N, I/2]", fill=C["mlp"], size=11)
    s.box(400, 120, 80, 60, "y₁ [N, I/2]", fill=C["mlp"], size=11)
    s.box(505, 40, 100, 60, "W₀ [H, I/2]\nGPU 0", fill=C["gpu"], size=11)
    s.box(505, 120, 100, 60, "W₁ [H, I/2]\nGPU 1", fill=C["gpu"], size=11)
    s.arrow(480, 70, 503, 70)
    s.arrow(480, 150, 503, 150)
    s.box(640, 80, 80, 60, "all-reduce\nΣ 部分和", fill=C["hot"], size=11)
    s.arrow(605, 70, 638, 100)
    s.arrow(605, 150, 638, 120)
    s.text(555, 200, "输入按行切（上一层的列切输出），部分和要相加", size=11, color="#444")
    # vocab parallel
    s.text(370, 246, "VocabParallelEmbedding 与 ParallelLMHead（V 个词按卡切成两段）", size=13, weight="bold")
    s.box(30, 270, 150, 50, "ids（每卡完整）", fill=C["io"], size=11)
    s.box(220, 262, 200, 30, "GPU 0：词 [0, V/2)，其余行置 0", fill=C["gpu"], size=11)
    s.box(220, 300, 200, 30, "GPU 1：词 [V/2, V)，其余行置 0", fill=C["gpu"], size=11)
    s.arrow(180, 290, 218, 277)
    s.arrow(180, 300, 218, 315)
    s.box(460, 270, 110, 50, "all-reduce\n（embedding）", fill=C["hot"], size=11)
    s.arrow(420, 277, 458, 290)
    s.arrow(420, 315, 458, 300)
    s.box(600, 270, 120, 50, "LM head：gather\nlogits [N, V]", fill=C["hot"], size=11)
    s.text(370, 360, "一个 decoder 层：列切 qkv → 本卡的头做 attention → 行切 o_proj → all-reduce；", size=11)
    s.text(370, 380, "列切 gate_up → 本卡的 I/tp 做 SwiGLU → 行切 down → all-reduce。每层两次 all-reduce。", size=11)
    return s


FIGURES = {"decoder-layers": decoder_layers, "tensor-parallel": tensor_parallel}
