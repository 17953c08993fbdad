"""Checks for M05 · Gated DeltaNet (lessons/m05_gated_deltanet.md). Oracle: HF transformers 5.17.0 Qwen3.5.

The pure-torch HF functions are taken through `__wrapped__` (HF gotcha G-13: they are swapped for GPU kernels
when fla / causal_conv1d are installed). HF's delta-rule functions scale q by dk^-0.5 themselves, the
exercise's take q already scaled, so the checks hand each its own convention.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from checks.kit import TOL, OpCount, Rand, assert_close, assert_dtype, close, explain_crash, impl, point, record_case

MODULE = "m05_gated_deltanet"
transformers.utils.logging.set_verbosity_error()


def _torch_version(fn):
    return getattr(fn, "__wrapped__", fn)


HF_CONV = _torch_version(hf.causal_conv1d_fn)             # x [B, C, T], weight [C, K]: left pad K-1
HF_CONV_UPDATE = _torch_version(hf.causal_conv1d_update)  # state [B, C, K] (HF keeps K inputs, we keep K-1)
HF_CHUNK = _torch_version(hf.torch_chunk_gated_delta_rule)
HF_RECURRENT = _torch_version(hf.torch_recurrent_gated_delta_rule)
HF_L2NORM = hf.l2norm

# the 易错点 of the card, as the failure messages name them
NOT_CAUSAL = "卷积不是因果的：只能在左边补 K-1 个输入（来自 conv_state，没有就是 0），输出 t 只看输入 t-K+1..t"
STATE_OUTPUTS = "conv_state 存的是卷积输出而不是输入：应保存每条序列最后 K-1 个输入（conv 之前的值）"
STATE_BOUNDARY = "conv_state 跨过了序列边界：短序列的最后 K-1 个输入要由它自己的初始 conv_state 补齐，不能取打包张量里前一条序列的 token"
STATE_IGNORED = "prefill 忽略了传入的 conv_state：每条序列开头要接上它的初始 conv_state"
STATE_STALE = ("单步更新后 conv_state 没变：要原地写回传入的张量（conv_state.copy_(...)），"
               "并且丢掉的是最旧的输入、保留含新 token 在内的最后 K-1 个")
G_SIGN = "g 的符号或 softplus 错了：g = -exp(A_log)·softplus(a + dt_bias) ≤ 0，exp(g) ∈ (0, 1] 是衰减；g > 0 会让状态每步放大"
BETA_SIGMOID = "beta 忘了 sigmoid：beta = sigmoid(b) ∈ (0, 1)"
L2_EPS = "l2norm 的 eps 放错了位置：应为 x·rsqrt(Σx² + 1e-6)（eps 在根号里，加在平方和上）"
L2_MEAN = "l2norm 用了平方的均值（那是 RMSNorm）：应为平方和"
Q_SCALE = "q 没有乘 dk^-0.5（在 l2norm 之后缩放）"
REPEAT = "k/q 头扩到 v 头用了 repeat（整体平铺）而不是 repeat_interleave：v 头 j 应使用 k 头 j // (nv/nk)"
DECAY_AFTER = "delta rule 更新顺序错了：应先衰减 S ← exp(g)·S，再读 kᵀS、写入；你在写入之后才衰减"
READ_BEFORE_DECAY = "delta rule 更新顺序错了：kᵀS 要在衰减之后读（读的是 exp(g)·S），你读的是衰减前的 S"
CHUNK_INIT = "分块形式忘了初始状态（initial_state）：第一块也要读入并衰减它"
CHUNK_DECAY = "分块形式忘了块间衰减：进入下一块前，旧状态要乘 exp(本块 g 之和)"
NORM_ONE_PLUS_W = "RMSNormGated 的权重用成了 (1+w)：门控 norm 是 w·norm(o)·silu(z)（weight 初始化为 1，不是 Gemma 式的 1+w）"
NORM_PER_HEAD = "RMSNormGated 没有按 value head 拆开：o 和 z 都要 reshape 成 [N·nv, dv]，每个头单独算 RMS"
CHUNK_TOKEN_LOOP = ("分块形式里逐 token 循环（直接调用了 recurrent_gated_delta_rule，或块内逐行前代求解）："
                    "块内应当只有矩阵乘和一次 solve_triangular，只有“块”在循环")
STATE_BF16 = "递推状态在块与块之间被存成了 v.dtype（bf16）：状态要一直是 fp32，只有输出 o 最后转回 v.dtype"
NORM_EPS = "RMSNormGated 没有用 config 的 rms_norm_eps（用了默认的 1e-6）：GatedDeltaNet(…, rms_norm_eps) 要传给 norm"
KEEP_DTYPE = ("bf16 模型（引擎喂的 dtype）：卷积输出、v、o 和层输出都要保持输入的 dtype，"
              "只有 g、l2norm 之后的 q/k 和递推状态是 fp32")
BF16 = torch.bfloat16
ONE_TOKEN_PREFILL = ("decode 的判断漏了 state is not None：state=None 时即使每条序列恰好 1 个 token（N == B）也是从零状态开始的 "
                     "prefill，没有 conv_state 可读；只有给了 state 且 N == B 才走单步路径")

CRASHES = {
    "Missing key": "参数名必须与 HF Qwen3_5GatedDeltaNet 一致（in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / conv1d / A_log / dt_bias / norm / out_proj）",
    "Unexpected key": "参数名必须与 HF Qwen3_5GatedDeltaNet 一致，不要多出别的参数或 buffer",
    "size mismatch": "参数形状与 HF 不一致（conv1d.weight 是 [C, 1, K]，norm.weight 是 [dv]）",
    "must match the size of tensor": "形状对不上：检查 q/k/v 的 split 与 view、head 的扩展、RMSNormGated 是否按 value head 拆成 [-1, dv]",
}
BF16_CRASHES = {"same dtype": KEEP_DTYPE,
                "weight type": "卷积的输入与 weight 的 dtype 不一致：拼进来的 conv_state（没有时补的零）要与 x 同 dtype（x.new_zeros）"}


def _assert_close_lazy(actual, expected: torch.Tensor, *, what: str, rand: Rand, mistakes) -> None:
    """assert_close whose classic wrong answers (costly to compute) are built only when the check fails."""
    tol = TOL[torch.float32]
    if close(actual, expected, tol["atol"], tol["rtol"]):
        return
    assert_close(actual, expected, what=what, rand=rand, looks_like=mistakes())


# ---------------------------------------------------------------------------------------------- conv

def _packed(r: Rand, lengths: list[int], channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return r.randn(sum(lengths), channels), cu


def _hf_conv(x_seq: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """HF's causal conv + silu of one sequence x_seq [T, C] after the K-1 inputs in state [C, K-1] -> [T, C]."""
    if state is None:
        return HF_CONV(x_seq.T[None], weight, None, activation="silu")[0].T
    hf_state = F.pad(state, (1, 0))[None].clone()         # HF keeps K inputs; the oldest one is never used
    return HF_CONV_UPDATE(x_seq.T[None], hf_state, weight, None, "silu")[0].T


def _conv_not_causal(x: torch.Tensor, weight: torch.Tensor, bounds: list[int]) -> list[torch.Tensor]:
    """The two classic non-causal convs, per sequence: 'same' padding, and left pad K-1 but keep the last T."""
    same, shifted = torch.empty_like(x), torch.empty_like(x)
    channels, width = weight.shape
    for s, e in zip(bounds[:-1], bounds[1:]):
        seq = x[s:e].T[None]
        centred = F.pad(seq, ((width - 1) // 2, width // 2))                       # padding="same"
        same[s:e] = F.silu(F.conv1d(centred, weight[:, None], groups=channels))[0].T
        shifted[s:e] = F.silu(F.conv1d(seq, weight[:, None], padding=width - 1, groups=channels))[0, :, -(e - s):].T
    return [same, shifted]


@point("因果卷积 prefill 与 HF 一致")
def test_conv_prefill_matches_hf():
    m = impl(MODULE)
    r = Rand()
    channels, width = r.int(3, 12), r.int(2, 4)
    lengths = [1] + [r.int(1, 12) for _ in range(r.int(1, 3))] + [r.int(width, 16)]   # a one-token sequence every run
    r.py.shuffle(lengths)
    x, cu = _packed(r, lengths, channels)
    weight = r.randn(channels, width, scale=0.5)
    bounds = cu.tolist()
    out, _ = m.causal_conv1d(x, weight, cu)
    record_case("conv:packed-state-None")
    record_case("conv:one-token-sequence")
    ref = torch.cat([_hf_conv(x[s:e], weight, None) for s, e in zip(bounds[:-1], bounds[1:])])
    assert_close(out, ref, what="causal_conv1d 输出（conv_state=None）", rand=r,
                 looks_like=[(w, NOT_CAUSAL) for w in _conv_not_causal(x, weight, bounds)]
                 + [(F.silu(F.conv1d(x.T[None], weight[:, None], padding=width - 1, groups=channels))[0, :, :x.shape[0]].T,
                     "整个打包张量当成一条序列做卷积：每条序列要单独从 conv_state（或 0）开始，不能看到前一条序列的 token")])

    state = r.randn(len(lengths), channels, width - 1)
    out, _ = m.causal_conv1d(x, weight, cu, state.clone())
    ref = torch.cat([_hf_conv(x[s:e], weight, state[i]) for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))])
    assert_close(out, ref, what="causal_conv1d 输出（带初始 conv_state）", rand=r,
                 looks_like=[(m.causal_conv1d(x, weight, cu)[0], STATE_IGNORED)])
    record_case("conv:initial-state")

    # bf16 (the engine's model dtype, its conv_state pool is bf16 too): bf16 in, bf16 out, without and with a state
    x16, w16, state16 = x.to(BF16), weight.to(BF16), state.to(BF16)
    for initial, name in ((None, "conv_state=None"), (state16, "带 bf16 的初始 conv_state")):
        with explain_crash(BF16_CRASHES):
            out16, new16 = m.causal_conv1d(x16, w16, cu, None if initial is None else initial.clone())
        assert_dtype(out16, BF16, what=f"bf16 输入时 causal_conv1d 的输出（{name}）", mistake=KEEP_DTYPE)
        assert_dtype(new16, BF16, what=f"bf16 输入时 causal_conv1d 返回的 conv_state（{name}）", mistake=KEEP_DTYPE)
        ref16 = torch.cat([_hf_conv(x16[s:e].float(), w16.float(), None if initial is None else initial[i].float())
                           for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))])
        assert_close(out16.float(), ref16, what=f"bf16 输入时 causal_conv1d 的输出（{name}；与 fp32 计算比）", rand=r,
                     atol=2e-2, rtol=2e-2)
    record_case("conv:bf16")


@point("conv_state 保存每条序列最后 K-1 个输入")
def test_conv_state_keeps_last_inputs():
    m = impl(MODULE)
    r = Rand()
    channels, width = r.int(3, 10), r.int(3, 4)
    lengths = [r.int(width + 1, 12) for _ in range(r.int(2, 3))]
    x, cu = _packed(r, lengths, channels)
    weight = r.randn(channels, width, scale=0.5)
    bounds = cu.tolist()
    ends = bounds[1:]
    out, state = m.causal_conv1d(x, weight, cu)
    ref = torch.stack([x[e - (width - 1):e].T for e in ends])                      # [B, C, K-1]
    pre = torch.stack([F.conv1d(F.pad(x[s:e].T, (width - 1, 0))[None], weight[:, None], groups=channels)[0, :, -(width - 1):]
                       for s, e in zip(bounds[:-1], ends)])
    assert_close(state, ref, what="causal_conv1d 返回的 conv_state（每条序列都不短于 K）", rand=r,
                 looks_like=[(pre, STATE_OUTPUTS), (F.silu(pre), STATE_OUTPUTS)])
    record_case("conv-state:last-inputs")

    # short sequences after the first one: their last K-1 inputs reach into their own initial state
    lengths = [r.int(width, 9)] + [r.int(1, width - 2) for _ in range(r.int(1, 2))] + [r.int(1, 9)]
    x, cu = _packed(r, lengths, channels)
    bounds = cu.tolist()
    initial = r.randn(len(lengths), channels, width - 1)
    _, state = m.causal_conv1d(x, weight, cu, initial.clone())
    ref = torch.stack([torch.cat([initial[i], x[s:e].T], -1)[:, -(width - 1):]
                       for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))])
    crossing = torch.stack([F.pad(x[:e].T, (width - 1, 0))[:, -(width - 1):] for e in bounds[1:]])
    ignored = torch.stack([F.pad(x[s:e].T, (width - 1, 0))[:, -(width - 1):] for s, e in zip(bounds[:-1], bounds[1:])])
    assert_close(state, ref, what=f"causal_conv1d 返回的 conv_state（序列长度 {lengths}，K={width}，带初始状态）", rand=r,
                 looks_like=[(crossing, STATE_BOUNDARY), (ignored, STATE_IGNORED)])
    record_case("conv-state:shorter-than-K-1-keeps-old-tail")


@point("单步 conv 更新与完整卷积一致")
def test_conv_update_matches_full_conv():
    m = impl(MODULE)
    r = Rand()
    batch, channels, width, steps = r.int(2, 3), r.int(3, 10), r.int(2, 4), r.int(2, 6)
    weight = r.randn(channels, width, scale=0.5)
    initial = r.randn(batch, channels, width - 1)
    x = r.randn(batch, steps, channels)
    state = initial.clone()
    outs = []
    for t in range(steps):
        outs.append(m.causal_conv1d_update(x[:, t].clone(), state, weight))
    out = torch.stack(outs, 1)                                                       # [B, steps, C]
    ref = torch.stack([_hf_conv(x[i], weight, initial[i]) for i in range(batch)])
    stale = F.silu((torch.cat([initial[:, None].expand(-1, steps, -1, -1), x[..., None]], -1) * weight).sum(-1))
    assert_close(out, ref, what=f"逐步 causal_conv1d_update 的输出（{steps} 步）", rand=r,
                 looks_like=[(stale, STATE_STALE)])
    full = torch.cat([initial, x.transpose(1, 2)], -1)                               # [B, C, K-1+steps]
    assert_close(state, full[:, :, full.shape[-1] - (width - 1):],
                 what="causal_conv1d_update 之后的 conv_state（应原地更新为最后 K-1 个输入）", rand=r,
                 looks_like=[(initial, STATE_STALE)])
    record_case("update:in-place-steps")

    # bf16 (the engine's conv_state pool and model dtype): one step, bf16 out, the bf16 state updated in place
    x16, w16, state16 = x[:, 0].to(BF16), weight.to(BF16), initial.to(BF16)
    with explain_crash(BF16_CRASHES):
        out16 = m.causal_conv1d_update(x16.clone(), state16, w16)
    assert_dtype(out16, BF16, what="bf16 输入时 causal_conv1d_update 的输出", mistake=KEEP_DTYPE)
    ref16 = torch.stack([_hf_conv(x16[i, None].float(), w16.float(), initial[i].to(BF16).float())[0] for i in range(batch)])
    assert_close(out16.float(), ref16, what="bf16 输入时 causal_conv1d_update 的输出（与 fp32 计算比）", rand=r,
                 atol=2e-2, rtol=2e-2)
    window16 = torch.cat([initial.to(BF16), x16[..., None]], -1)
    assert_close(state16, window16[:, :, 1:], what="bf16 的 conv_state 在单步更新之后（原地）", rand=r, atol=0, rtol=0)
    record_case("update:bf16")


# ---------------------------------------------------------------------------------------------- gates

@point("门控 g、beta 与 HF 一致")
def test_gates_match_hf():
    m = impl(MODULE)
    r = Rand()
    tokens, heads = r.int(3, 20), r.int(1, 6)
    a, b = r.randn(tokens, heads, scale=2.0), r.randn(tokens, heads, scale=2.0)
    A_log, dt_bias = r.randn(heads, scale=0.5), r.randn(heads, scale=0.5)
    g, beta = m.gdn_gates(a, b, A_log, dt_bias)
    ref_g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)                  # as Qwen3_5GatedDeltaNet.forward
    assert_dtype(g, torch.float32, what="gdn_gates 返回的 g")
    assert_close(g, ref_g, what="g（log 衰减）", rand=r,
                 looks_like=[(-ref_g, G_SIGN), (-A_log.exp() * (a + dt_bias), G_SIGN),
                             (A_log.exp() * (a + dt_bias), G_SIGN), (ref_g.exp(), "返回了 exp(g)：g 应是 log 空间的衰减")])
    if (g > 0).any():
        raise AssertionError(f"g 出现了正数：{G_SIGN}；{r}")
    assert_close(beta, b.sigmoid(), what="beta", rand=r, looks_like=[(b, BETA_SIGMOID)])
    record_case("gates:fp32")

    # bf16 model: g is computed in fp32, beta stays in the model dtype
    g16, beta16 = m.gdn_gates(a.bfloat16(), b.bfloat16(), A_log.bfloat16(), dt_bias.bfloat16())
    assert_dtype(g16, torch.float32, what="bf16 输入时的 g", mistake="g 要在 fp32 里算（A_log.float()、a.float()）")
    assert_dtype(beta16, torch.bfloat16, what="bf16 输入时的 beta")
    ref16 = -A_log.bfloat16().float().exp() * F.softplus(a.bfloat16().float() + dt_bias.bfloat16())
    assert_close(g16, ref16, what="bf16 输入时的 g（fp32 计算）", rand=r, atol=1e-5, rtol=1e-5)
    record_case("gates:bf16")


@point("l2norm 与 HF 一致")
def test_l2norm_matches_hf():
    m = impl(MODULE)
    r = Rand()
    shape = (r.int(2, 6), r.int(1, 4), r.choice([8, 16, 32]))
    for scale in (1.0, 1e-3):                          # tiny vectors make the place of eps visible
        x = r.randn(*shape, scale=scale)
        out = m.l2norm(x)
        ref = HF_L2NORM(x, dim=-1, eps=1e-6)
        norm = x.norm(dim=-1, keepdim=True)
        assert_close(out, ref, what=f"l2norm（输入尺度 {scale:g}）", rand=r,
                     looks_like=[(x / (norm + 1e-6), L2_EPS), (x / norm.clamp_min(1e-6), L2_EPS),
                                 (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), L2_MEAN)])
        record_case("l2norm:tiny-vectors" if scale < 1 else "l2norm:unit-scale")
    out = m.l2norm(x.bfloat16())
    assert_dtype(out, torch.float32, what="bf16 输入时 l2norm 的输出", mistake="l2norm 要在 fp32 里算并返回 fp32")
    record_case("l2norm:bf16-in-fp32-out")


# ---------------------------------------------------------------------------------------------- delta rule

def _rule_inputs(r: Rand, batch: int, steps: int, heads: int, dk: int, dv: int):
    """Realistic inputs: unit q/k (q_hf unscaled, q scaled by dk^-0.5), decays in (0, 1), beta in (0, 1)."""
    q_hf = HF_L2NORM(r.randn(batch, steps, heads, dk))
    k = HF_L2NORM(r.randn(batch, steps, heads, dk))
    v = r.randn(batch, steps, heads, dv)
    g = -r.randn(heads, scale=0.5).exp() * F.softplus(r.randn(batch, steps, heads) - 1.0)
    beta = r.randn(batch, steps, heads).sigmoid()
    state = r.randn(batch, heads, dk, dv, scale=0.5)
    return q_hf, q_hf * dk ** -0.5, k, v, g, beta, state


def _delta_loop(q, k, v, g, beta, state, *, mistake: str = "", chunk: int = 0):
    """The rule token by token in the check's own words (q already scaled), with one classic mistake on.

    mistake: "decay_after" | "read_before_decay" | "no_chunk_decay" (the state at a chunk boundary keeps the
    old state undecayed, i.e. gains (1 - exp(sum of g over the chunk)) * state_at_chunk_start).
    """
    steps = k.shape[1]
    out = torch.empty_like(v)
    start, g_sum = state, 0.0
    for t in range(steps):
        decay = g[:, t].exp()[..., None, None]
        if mistake == "read_before_decay":
            pred = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
            state = state * decay
        else:
            if mistake != "decay_after":
                state = state * decay
            pred = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        u = beta[:, t, :, None] * (v[:, t] - pred)
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        if mistake == "decay_after":
            state = state * decay
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)
        if mistake == "no_chunk_decay":
            g_sum = g_sum + g[:, t]
            if t % chunk == chunk - 1 or t == steps - 1:
                state = state + (1 - g_sum.exp())[..., None, None] * start
                start, g_sum = state, 0.0
    return out, state


def _dims(r: Rand) -> list[tuple[int, int]]:
    """(dk, dv) with dk < dv and with dk > dv, both in every run: a swapped dk / dv cannot pass."""
    small, large = r.choice([4, 6]), r.choice([8, 10])
    return [(small, large), (large, small)]


def _nearer(actual: torch.Tensor, expected: torch.Tensor, wrong: torch.Tensor) -> bool:
    """actual is (at least 10x) closer to the classic wrong answer than to the right one."""
    if not isinstance(actual, torch.Tensor) or actual.shape != wrong.shape:
        return False
    to_wrong = (actual.double() - wrong.double()).abs().max()
    return bool(to_wrong * 10 < (actual.double() - expected.double()).abs().max())


def _state_bf16_between_chunks(q, k, v, g, beta, state, chunk: int):
    """The rule token by token in fp32 whose state is rounded to bf16 at every chunk end (the classic mistake)."""
    steps = k.shape[1]
    out = torch.empty(v.shape)
    for t in range(steps):
        state = state * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)
        if t % chunk == chunk - 1 or t == steps - 1:
            state = state.bfloat16().float()
    return out, state


@point("递推 delta rule 与 HF 一致（初始状态进、最终状态出）")
def test_recurrent_matches_hf():
    m = impl(MODULE)
    r = Rand()
    for first, (dk, dv) in zip((True, False), _dims(r)):
        # the first draw has several sequences and heads every run; the second keeps them random
        batch, steps, heads = (2, r.int(5, 12), r.int(2, 3)) if first else (r.int(1, 2), r.int(5, 12), r.int(1, 3))
        q_hf, q, k, v, g, beta, state = _rule_inputs(r, batch, steps, heads, dk, dv)
        ref_o, ref_s = HF_RECURRENT(q_hf, k, v, g, beta, initial_state=state.clone(), output_final_state=True)
        o, s = m.recurrent_gated_delta_rule(q, k, v, g, beta, state.clone())
        wrong = {name: _delta_loop(q, k, v, g, beta, state, mistake=name) for name in ("decay_after", "read_before_decay")}
        no_init = HF_RECURRENT(q_hf, k, v, g, beta, initial_state=None, output_final_state=True)
        what = f"recurrent_gated_delta_rule（dk={dk}，dv={dv}）"
        assert_close(o, ref_o, what=f"{what} 的输出 o", rand=r,
                     looks_like=[(wrong["decay_after"][0], DECAY_AFTER), (wrong["read_before_decay"][0], READ_BEFORE_DECAY),
                                 (no_init[0], "忘了用 initial_state（从零状态开始了）"),
                                 (HF_RECURRENT(q, k, v, g, beta, initial_state=state.clone())[0],
                                  "q 又乘了一次 dk^-0.5：传进来的 q 已经缩放过")])
        assert_dtype(s, torch.float32, what=f"{what} 返回的状态")
        assert_close(s, ref_s, what=f"{what} 的最终状态 [B, H, dk, dv]", rand=r,
                     looks_like=[(wrong["decay_after"][1], DECAY_AFTER), (wrong["read_before_decay"][1], READ_BEFORE_DECAY),
                                 (ref_s.transpose(-1, -2) if dk == dv else None, "状态的轴放反了：应为 [B, H, dk, dv]")])

        # bf16 v (a bf16 model): the rule still runs in fp32; o is rounded once, the state stays fp32
        v16 = v.bfloat16()
        o16, s16 = m.recurrent_gated_delta_rule(q, k, v16, g, beta, state.clone())
        assert_dtype(o16, torch.bfloat16, what="v 为 bf16 时的输出 o", mistake="o 要转回 v.dtype")
        assert_dtype(s16, torch.float32, what="v 为 bf16 时的状态", mistake="状态始终是 fp32")
        ref_o16, ref_s16 = HF_RECURRENT(q_hf, k, v16.float(), g, beta, initial_state=state.clone(), output_final_state=True)
        assert_close(o16.float(), ref_o16.bfloat16().float(), what=f"{what}，v 为 bf16 时的输出 o（与 HF 的 fp32 计算比）",
                     rand=r, atol=1e-6, rtol=2 ** -7)
        assert_close(s16, ref_s16, what=f"{what}，v 为 bf16 时的最终状态（应全程 fp32）", rand=r)
        record_case("recurrent:dk<dv" if dk < dv else "recurrent:dk>dv")
        if first:
            record_case("recurrent:B>=2,H>=2,initial-state")
    record_case("recurrent:bf16-v")


@point("分块 WY 形式与 HF、与递推一致（T 非 chunk 倍数、初始状态）")
def test_chunk_matches_hf_and_recurrent():
    m = impl(MODULE)
    r = Rand()
    heads = r.int(1, 2)
    # T not a multiple of the default 64 (several sequences), then T an exact multiple of a small chunk_size
    small = r.choice([2, 4, 8])
    cases = ((r.int(70, 150), 64, 2), (small * r.int(3, 6), small, 1))
    for (steps, chunk, batch), (dk, dv) in zip(cases, _dims(r)):
        if chunk == 64 and steps % chunk == 0:
            steps += 1
        q_hf, q, k, v, g, beta, state = _rule_inputs(r, batch, steps, heads, dk, dv)
        ref_o, ref_s = HF_CHUNK(q_hf, k, v, g, beta, chunk_size=chunk, initial_state=state.clone(),
                                output_final_state=True)
        o, s = m.chunk_gated_delta_rule(q, k, v, g, beta, state.clone(), chunk_size=chunk)

        def mistakes(i: int, q_hf=q_hf, q=q, k=k, v=v, g=g, beta=beta, state=state, chunk=chunk):
            no_init = HF_CHUNK(q_hf, k, v, g, beta, chunk_size=chunk, initial_state=None, output_final_state=True)
            no_decay = _delta_loop(q, k, v, g, beta, state, mistake="no_chunk_decay", chunk=chunk)
            return [(no_init[i], CHUNK_INIT), (no_decay[i], CHUNK_DECAY)]

        what = f"chunk_gated_delta_rule（T={steps}，chunk_size={chunk}，dk={dk}，dv={dv}）"
        _assert_close_lazy(o, ref_o, what=f"{what} 的输出 o", rand=r, mistakes=lambda: mistakes(0))
        assert_dtype(s, torch.float32, what=f"{what} 返回的状态")
        _assert_close_lazy(s, ref_s, what=f"{what} 的最终状态", rand=r, mistakes=lambda: mistakes(1))
        rec_o, rec_s = m.recurrent_gated_delta_rule(q, k, v, g, beta, state.clone())
        assert_close(o, rec_o, what=f"{what} 与 recurrent_gated_delta_rule 的输出", rand=r)
        assert_close(s, rec_s, what=f"{what} 与 recurrent_gated_delta_rule 的最终状态", rand=r)
        record_case("chunk:T-not-multiple-of-64,B=2,initial-state" if chunk == 64 else "chunk:T-multiple-of-chunk_size")

    # bf16 v over many short chunks: the state crosses every boundary in fp32, o is rounded once at the end
    dk, dv = _dims(r)[r.int(0, 1)]
    steps, chunk = r.int(40, 60), r.choice([2, 4])
    q_hf, q, k, v, g, beta, state = _rule_inputs(r, 1, steps, heads, dk, dv)
    state = state * 8.0                                       # a large state: its bf16 rounding is far above fp32 noise
    v16 = v.bfloat16()
    ref_o, ref_s = HF_CHUNK(q_hf, k, v16.float(), g, beta, chunk_size=chunk, initial_state=state.clone(),
                            output_final_state=True)
    o16, s16 = m.chunk_gated_delta_rule(q, k, v16, g, beta, state.clone(), chunk_size=chunk)
    what = f"chunk_gated_delta_rule，v 为 bf16（T={steps}，chunk_size={chunk}）"
    assert_dtype(o16, torch.bfloat16, what=f"{what} 的输出 o", mistake="o 要转回 v.dtype")
    assert_dtype(s16, torch.float32, what=f"{what} 的最终状态", mistake=STATE_BF16)
    if not close(s16, ref_s, 1e-5, 1e-5):
        wrong_o, wrong_s = _state_bf16_between_chunks(q, k, v16.float(), g, beta, state, chunk)
        named = _nearer(s16, ref_s, wrong_s)
        raise AssertionError(f"{what} 的最终状态与 HF（fp32 计算）不一致，最大误差 "
                             f"{(s16 - ref_s).abs().max().item():.3g}" + (f"\n  看起来像易错点：{STATE_BF16}" if named else "")
                             + f"；{r}")
    assert_close(o16.float(), ref_o.bfloat16().float(), what=f"{what} 的输出 o（与 HF 的 fp32 计算舍入到 bf16 比）",
                 rand=r, atol=1e-6, rtol=2 ** -7)
    record_case("chunk:bf16-v-state-fp32")


@point("分块形式真的分块：块内不逐 token 循环")
def test_chunk_is_chunked():
    m = impl(MODULE)
    r = Rand()
    heads, dk, dv = 2, 4, 6
    counts = []
    for size in (4, 32):                       # one chunk each: 8x the tokens, the same number of chunks
        _, q, k, v, g, beta, state = _rule_inputs(r, 1, size, heads, dk, dv)
        log = OpCount()
        with torch.no_grad(), log:
            o, s = m.chunk_gated_delta_rule(q, k, v, g, beta, state.clone(), chunk_size=size)
        ref_o, _ = _delta_loop(q, k, v, g, beta, state)                         # the check's own token loop
        assert_close(o, ref_o, what=f"chunk_gated_delta_rule（T={size}，chunk_size={size}）与逐 token 递推的输出", rand=r)
        counts.append(log.count)
    if counts[1] > counts[0] + 16:
        raise AssertionError(f"chunk_gated_delta_rule 在一个块里有 4 个 token 时执行了 {counts[0]} 个 torch 算子，32 个 token 时 "
                             f"{counts[1]} 个：块数相同，算子数却随 token 数增长\n  看起来像易错点：{CHUNK_TOKEN_LOOP}；{r}")
    record_case("chunked:ops-independent-of-tokens")


# ---------------------------------------------------------------------------------------------- the layer

def _hf_layer(r: Rand, wide_v: bool):
    """A tiny Qwen3_5GatedDeltaNet with every parameter random (norm weight around 1), and its sizes.

    No default hides a mistake: nv > nk (>= 2 key heads), dk != dv (wide_v: dk < dv, else dk > dv), a conv
    kernel other than the default 4 and an rms_norm_eps large enough to change the gated norm's output.
    """
    nk = r.int(2, 3)                                # repeat and repeat_interleave only differ with >= 2 key heads
    small, large = r.choice([4, 6]), 8
    size = dict(hidden_size=r.choice([16, 24, 32]), linear_num_key_heads=nk, linear_num_value_heads=nk * r.choice([2, 3]),
                linear_key_head_dim=small if wide_v else large, linear_value_head_dim=large if wide_v else small,
                linear_conv_kernel_dim=r.choice([2, 3, 5]))
    cfg = Qwen3_5TextConfig(num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=r.choice([0.05, 0.1]),
                            **size)
    layer = r.init_(hf.Qwen3_5GatedDeltaNet(cfg, layer_idx=0).eval())
    with torch.no_grad():
        layer.norm.weight.copy_(1.0 + r.randn(*layer.norm.weight.shape, scale=0.3))
    return layer, cfg


def _ours(m, hf_layer, cfg):
    layer = m.GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                            cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                            cfg.rms_norm_eps)
    with explain_crash(CRASHES):
        layer.load_state_dict(hf_layer.state_dict())
    return layer.eval()


def _hf_forward(hf_layer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_layer(x[None])[0]


def _hf_layer_like(hf_layer, x: torch.Tensor, *, q_scale=True, tile=False, norm="w", eps=None) -> torch.Tensor:
    """Qwen3_5GatedDeltaNet.forward on one sequence x [T, hidden], rebuilt from HF's pieces with one mistake on."""
    L = hf_layer
    steps, nk, nv, dk, dv = x.shape[0], L.num_k_heads, L.num_v_heads, L.head_k_dim, L.head_v_dim
    with torch.no_grad():
        xb = x[None]
        mixed = HF_CONV(L.in_proj_qkv(xb).transpose(1, 2), L.conv1d.weight[:, 0], None, activation="silu").transpose(1, 2)
        q, k, v = mixed.split([L.key_dim, L.key_dim, L.value_dim], dim=-1)
        q, k, v = q.reshape(1, steps, nk, dk), k.reshape(1, steps, nk, dk), v.reshape(1, steps, nv, dv)
        expand = (lambda t: t.repeat(1, 1, nv // nk, 1)) if tile else (lambda t: t.repeat_interleave(nv // nk, 2))
        q, k = HF_L2NORM(expand(q)), HF_L2NORM(expand(k))
        if not q_scale:
            q = q * dk ** 0.5                      # undo the kernel's own dk^-0.5
        g = -L.A_log.float().exp() * F.softplus(L.in_proj_a(xb).float() + L.dt_bias)
        beta = L.in_proj_b(xb).sigmoid()
        o, _ = HF_CHUNK(q, k, v, g, beta)
        z, w = L.in_proj_z(xb), L.norm.weight
        if norm == "flat":
            o, z, w = o.reshape(steps, -1), z.reshape(steps, -1), w.repeat(nv)
        else:
            o, z = o.reshape(-1, dv), z.reshape(-1, dv)
            w = 1 + w if norm == "1+w" else w
        eps = L.norm.variance_epsilon if eps is None else eps
        h = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w * F.silu(z)
        return L.out_proj(h.reshape(steps, -1))


def _layer_mistakes(hf_layer, x: torch.Tensor, bounds: list[int]) -> list:
    def per_seq(**kw):
        return torch.cat([_hf_layer_like(hf_layer, x[s:e], **kw) for s, e in zip(bounds[:-1], bounds[1:])])
    return [(per_seq(q_scale=False), Q_SCALE), (per_seq(tile=True), REPEAT),
            (per_seq(norm="1+w"), NORM_ONE_PLUS_W), (per_seq(norm="flat"), NORM_PER_HEAD), (per_seq(eps=1e-6), NORM_EPS)]


@point("GatedDeltaNet 层与 HF Qwen3_5GatedDeltaNet 一致（多条打包序列）")
def test_layer_matches_hf():
    m = impl(MODULE)
    r = Rand()
    hf_layer, cfg = _hf_layer(r, wide_v=True)
    ours = _ours(m, hf_layer, cfg)
    lengths = [1, r.int(4, 20), r.int(65, 72)]           # a one-token sequence and one over a 64-token chunk, every run
    r.py.shuffle(lengths)
    x, cu = _packed(r, lengths, cfg.hidden_size)
    bounds = cu.tolist()
    with explain_crash(CRASHES), torch.no_grad():
        out = ours(x, cu)
    ref = torch.cat([_hf_forward(hf_layer, x[s:e]) for s, e in zip(bounds[:-1], bounds[1:])])
    _assert_close_lazy(out, ref, what=f"GatedDeltaNet 输出（序列长度 {lengths}）", rand=r,
                       mistakes=lambda: _layer_mistakes(hf_layer, x, bounds))
    record_case("layer:packed-state-None")

    # state=None and every sequence exactly one token (N == B): still a prefill from zero states, not a decode
    ones = x[:3]
    with explain_crash({**CRASHES, "has no attribute 'conv'": ONE_TOKEN_PREFILL}), torch.no_grad():
        out = ours(ones, torch.arange(4, dtype=torch.int32))
    assert_close(out, torch.cat([_hf_forward(hf_layer, ones[i:i + 1]) for i in range(3)]),
                 what="GatedDeltaNet 输出（state=None，3 条序列各 1 个 token）", rand=r)
    record_case("layer:state-None-one-token-each")
    record_case("layer:one-token-sequence")
    record_case("layer:sequence-over-one-chunk")
    record_case("layer:nv>nk>=2,dk<dv,K!=4,eps-non-default")


@point("prefill T-1 个 token 再 decode 1 个（携带 conv 与递推状态）等于完整前向")
def test_prefill_then_decode_matches_full_forward():
    m = impl(MODULE)
    r = Rand()
    hf_layer, cfg = _hf_layer(r, wide_v=False)
    ours = _ours(m, hf_layer, cfg)
    batch = r.int(2, 3)
    lengths = [r.int(3, 18) for _ in range(batch)]
    x = [r.randn(n, cfg.hidden_size) for n in lengths]
    cuts = [r.int(1, n - 2) for n in lengths]               # chunk 1: [0, cut), chunk 2: [cut, n-1), decode: n-1
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    state = m.GDNState(conv=torch.zeros(batch, conv_dim, cfg.linear_conv_kernel_dim - 1),
                       ssm=torch.zeros(batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))
    def run(layer, xs, state, crashes):
        pieces = [[xi[:c] for xi, c in zip(xs, cuts)], [xi[c:-1] for xi, c in zip(xs, cuts)], [xi[-1:] for xi in xs]]
        outs = []
        with explain_crash(crashes), torch.no_grad():
            for step in pieces:
                cu = torch.tensor([0] + [p.shape[0] for p in step]).cumsum(0).to(torch.int32)
                outs.append(layer(torch.cat(step), cu, state).split([p.shape[0] for p in step]))
        return outs

    outs = run(ours, x, state, CRASHES)
    for i in range(batch):
        ref = _hf_forward(hf_layer, x[i])
        n, c = lengths[i], cuts[i]
        for (lo, hi), got, name in (((0, c), outs[0][i], "第一段 prefill"), ((c, n - 1), outs[1][i], "第二段 prefill（接着上一段的状态）"),
                                    ((n - 1, n), outs[2][i], "decode 的 1 个 token")):
            assert_close(got, ref[lo:hi], what=f"序列 {i}（长度 {n}）{name} 的输出，与完整前向的 [{lo}:{hi}] 比", rand=r)
        cache = DynamicCache(config=cfg)
        with torch.no_grad():
            hf_layer(x[i][None], cache_params=cache)
        hf_conv, hf_ssm = cache.layers[0].conv_states[0][0], cache.layers[0].recurrent_states[0][0]
        assert_close(state.conv[i], hf_conv[:, 1:], what=f"序列 {i} 最终的 conv_state（HF 缓存的最后 K-1 个输入）", rand=r)
        assert_close(state.ssm[i], hf_ssm, what=f"序列 {i} 最终的递推状态 [nv, dk, dv]", rand=r)
    record_case("layer:chunked-prefill-resumes-state")
    record_case("layer:decode-N==B")
    record_case("layer:state-overwritten-in-place")
    record_case("layer:dk>dv")

    # the engine's dtypes: a bf16 layer, a bf16 conv_state and an fp32 recurrent state, the same three steps;
    # against HF in fp32 on the same rounded weights and inputs (the loose tolerance covers bf16 intermediates)
    ours16, hf_r = copy.deepcopy(ours).to(BF16), copy.deepcopy(hf_layer).to(BF16).float()
    x16 = [xi.to(BF16) for xi in x]
    state16 = m.GDNState(conv=torch.zeros_like(state.conv, dtype=BF16), ssm=torch.zeros_like(state.ssm))
    outs16 = run(ours16, x16, state16, {**CRASHES, **BF16_CRASHES})
    for i in range(batch):
        got = torch.cat([outs16[0][i], outs16[1][i], outs16[2][i]])
        assert_dtype(got, BF16, what=f"bf16 层（bf16 conv_state、fp32 递推状态）序列 {i} 的输出", mistake=KEEP_DTYPE)
        assert_close(got.float(), _hf_forward(hf_r, x16[i].float()),
                     what=f"bf16 层序列 {i}（长度 {lengths[i]}）两段 prefill + decode 的输出（与 HF 在 fp32 里、同样舍入过的权重和输入上比）",
                     rand=r, atol=2e-2, rtol=2e-2)
    assert_dtype(state16.ssm, torch.float32, what="bf16 层之后的递推状态 state.ssm", mistake="递推状态始终是 fp32")
    assert_dtype(state16.conv, BF16, what="bf16 层之后的 state.conv", mistake=KEEP_DTYPE)
    record_case("layer:bf16-module-bf16-conv-state")


# ---------------------------------------------------------------------------------------------- the card

@point("卡片例子：K=3 卷积与 1 头 delta rule 的逐步数值")
def test_card_worked_example():
    m = impl(MODULE)
    weight = torch.tensor([[0.5, -1.0, 2.0]])
    out, state = m.causal_conv1d(torch.tensor([[1.0], [2.0], [3.0]]), weight, torch.tensor([0, 3]))
    assert_close(out[:, 0], torch.tensor([1.7616, 2.8577, 4.4506]), what="卡片卷积例子的输出", atol=1e-4, rtol=0)
    assert_close(state[0, 0], torch.tensor([2.0, 3.0]), what="卡片卷积例子的 conv_state", atol=1e-6, rtol=0,
                 looks_like=[(torch.tensor([2.8577, 4.4506]), STATE_OUTPUTS)])
    step = m.causal_conv1d_update(torch.tensor([[4.0]]), state, weight)
    assert_close(step[0], torch.tensor([5.9852]), what="卡片 decode 一步（x=4）的输出", atol=1e-4, rtol=0)
    assert_close(state[0, 0], torch.tensor([3.0, 4.0]), what="卡片 decode 一步之后的 conv_state", atol=1e-6, rtol=0)
    record_case("card:conv-K=3")

    a = torch.tensor([[-math.log(9.0)], [0.0], [-math.log(4.0)]])
    b = torch.tensor([[0.0], [math.log(4.0)], [0.0]])
    g, beta = m.gdn_gates(a, b, torch.zeros(1), torch.zeros(1))
    assert_close(g.exp()[:, 0], torch.tensor([0.9, 0.5, 0.8]), what="卡片例子的衰减 exp(g)", atol=1e-5, rtol=0,
                 looks_like=[(torch.tensor([1 / 0.9, 2.0, 1.25]), G_SIGN)])
    assert_close(beta[:, 0], torch.tensor([0.5, 0.8, 0.5]), what="卡片例子的 beta", atol=1e-5, rtol=0,
                 looks_like=[(b[:, 0], BETA_SIGMOID)])
    record_case("card:gates")

    q = m.l2norm(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])) * 2 ** -0.5
    assert_close(q, torch.tensor([[0.7071, 0.0], [0.0, 0.7071], [0.5, 0.5]]), what="卡片例子 l2norm(q)·dk^-0.5",
                 atol=1e-4, rtol=0)
    k = torch.tensor([[1.0, 0.0], [0.6, 0.8], [1.0, 0.0]])
    v = torch.tensor([[1.0, 2.0], [2.0, -1.0], [3.0, 0.0]])
    args = (q[None, :, None], k[None, :, None], v[None, :, None], g[None], beta[None])   # B=1, T=3, H=1
    ref_o = torch.tensor([[0.3536, 0.7071], [0.8372, -0.5883], [1.4512, -0.3576]])
    ref_s = torch.tensor([[1.9552, -0.0496], [0.9472, -0.6656]])
    o, s = m.recurrent_gated_delta_rule(*args)
    assert_close(o[0, :, 0], ref_o, what="卡片例子递推形式的输出 o_1..o_3", atol=1e-4, rtol=0,
                 looks_like=[(torch.tensor([[0.3182, 0.6364], [0.3915, -0.3485], [0.9495, -0.1810]]), DECAY_AFTER),
                             (torch.tensor([[0.3536, 0.7071], [0.7693, -0.7241], [1.3451, -0.4498]]), READ_BEFORE_DECAY)])
    assert_close(s[0, 0], ref_s, what="卡片例子递推形式的最终状态 S_3", atol=1e-4, rtol=0)
    record_case("card:recurrent-initial-state-None")
    o, s = m.chunk_gated_delta_rule(*args, chunk_size=2)
    assert_close(o[0, :, 0], ref_o, what="卡片例子分块形式（chunk_size=2）的输出", atol=1e-4, rtol=0)
    assert_close(s[0, 0], ref_s, what="卡片例子分块形式（chunk_size=2）的最终状态", atol=1e-4, rtol=0,
                 looks_like=[(torch.tensor([[2.1828, -0.0744], [1.1840, -0.8320]]), CHUNK_DECAY)])
    record_case("card:chunk-size-2-initial-state-None")
