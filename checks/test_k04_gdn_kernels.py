"""Checks for K04 · Gated DeltaNet kernels (lessons/k04_gdn_kernels.md).

Oracles: m05's torch reference (the layer's pieces: conv, gates, l2norm, the rule) and HF transformers 5.17's
pure-torch `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` (through `__wrapped__`) and
`Qwen3_5GatedDeltaNet`. Every check runs on checks.kit.DEVICE: without CUDA the kernels run in the Triton
interpreter (checks/conftest.py sets TRITON_INTERPRET=1) at tiny fp32 shapes; with CUDA the same checks run
natively at real shapes (bf16 inputs, fp32 states, T up to 32k), and the GPU-only checks report skipped
(需要 GPU) elsewhere. Inputs are drawn on the CPU (Rand) and moved to DEVICE.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from checks.kit import DEVICE, TOL, Rand, assert_close, close, impl, needs_cuda, point, record_case

MODULE = "k04_gdn_kernels"
GPU = DEVICE.type == "cuda"                        # real shapes and bf16 natively; tiny fp32 shapes in the interpreter
transformers.utils.logging.set_verbosity_error()

HF_CHUNK = getattr(hf.torch_chunk_gated_delta_rule, "__wrapped__", hf.torch_chunk_gated_delta_rule)
HF_RECURRENT = getattr(hf.torch_recurrent_gated_delta_rule, "__wrapped__", hf.torch_recurrent_gated_delta_rule)

# the 易错点 of the card, as the failure messages name them
STATE_BF16 = "状态用 bf16 携带/计算了：池里的递推状态始终是 fp32，kernel 里 load 之后也要保持 fp32（β=0、g=0 时它应原样穿过）"
READ_BEFORE_DECAY = "读 kᵀS 之前没有先衰减：先 S ← exp(g)·S，再算预测 kᵀS（分块形式里 w 要带 e^γ）"
BETA_V_ONLY = "β 只乘在了 v 上：纠正量是 u = β·(v − kᵀS)，预测项也要乘 β（分块形式里 w = T⁻¹(β·e^γ·k)）"
BETA_BOTH = "β 乘了两遍：L_ij = β_i·e^{γ_i−γ_j}·(k_i·k_j) 只带行 i 的 β，不是 β_i·β_j"
L2_EPS = "l2norm 的 eps 放错了位置：应为 x·rsqrt(Σx² + 1e-6)（eps 在根号里，加在平方和上）"
Q_SCALE = "q 没有乘 dk^-0.5（在 l2norm 之后缩放）"
HEAD_MAP = "value 头到 key 头的映射错了：value 头 hv 读 key 头 hv // (nv/nk)（repeat_interleave），不是 hv % nk"
CONV_SHIFT = "conv_state 滑窗错了：decode 之后应保存含新 token 在内的最后 K−1 个输入（丢掉最旧的一个）"
CHUNKS_MISUSED = ("gdn_prefill 没有照原样使用传入的 chunks：它就是 _chunk_table(cu_seqlens) 的 (seq, start)，"
                  "传入时用它代替自己算的块表，其余一切照旧")
SLOT_WRITTEN = "slot −1（padding 行）也读写了池：这一行的 conv_state 与递推状态都不能碰（被夹到 slot 0 或写到池外）"
CHUNK_BOUNDARY = ("变长序列的块边界错了：每条序列从自己的起点 cu_seqlens[i] 开始每 64 个 token 分一块，"
                  "不能按打包张量的全局 64 对齐（块会跨进上一条序列）")
INIT_IGNORED = "忽略了初始状态：每条序列的递推要从池里（或 initial_state）它自己的状态出发"
CONV_TAIL = ("比 K−1 短的序列写回的 conv_state 丢了旧的尾巴：新状态是最后 K−1 个输入，输入不够时前面接池里旧 "
             "conv_state 的后几个（不是 0）")
OUT_DTYPE = "输出 o 的 dtype 应跟输入（mixed_qkv / v）一致：只有递推状态是 fp32，输出不是"
CONV_BOUNDARY = "prefill 卷积跨过了序列边界：序列开头之前的 K−1 个输入来自池里它自己的 conv_state，不是打包张量里上一条序列的 token"


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=3e-2, rtol=3e-2) if dtype != torch.float32 else dict(atol=2e-4, rtol=2e-4)


# On the GPU the HF-layer check runs a few thousand tokens through slowly decaying heads: HF's chunked torch form
# and the kernel add in different orders, and fp32 drifts by up to ~3e-4 there (2.6e-4 seen at 2,646 tokens)
LONG_HF_TOL = dict(atol=1e-3, rtol=1e-3)


def _check(actual, expected, *, what: str, rand: Rand, dtype=torch.float32, mistakes=lambda: (),
           tol: dict | None = None) -> None:
    """assert_close at the kernel tolerance; the classic wrong answers (costly) are built only on failure."""
    tol = tol or _tol(dtype)
    if isinstance(actual, torch.Tensor) and close(actual.float(), expected.float().to(actual.device), **tol):
        return
    actual = actual.float().cpu() if isinstance(actual, torch.Tensor) else actual
    assert_close(actual, expected.float().cpu(), what=what, rand=rand, **tol,
                 looks_like=[(w.float().cpu(), name) for w, name in mistakes()])


def _same(actual: torch.Tensor, before: torch.Tensor, *, what: str, mistake: str, rand: Rand) -> None:
    if torch.equal(actual.cpu(), before.cpu()):
        return
    if mistake == STATE_BF16 and not torch.allclose(actual.cpu(), before.cpu(), rtol=8e-3, atol=0):   # not a rounding
        raise AssertionError(f"{what}：应保持不变，却被改写了（不是 bf16 舍入的样子：检查初始状态是否读入、"
                             f"每条序列的块边界、写回的 slot）；{rand}")
    raise AssertionError(f"{what}：应保持不变，却被改写了；{rand}\n  看起来像易错点：{mistake}")


# ---------------------------------------------------------------------------------------------- oracles

def _layer_sizes(r: Rand) -> dict:
    if GPU:                                        # Qwen3.5's GDN layer
        return dict(nk=16, nv=32, dk=128, dv=128, K=4)
    # 2 value heads per key head; dk = 12 and K = 3 are not powers of 2 (the kernels' padded columns and taps are
    # masked); K = 4 (Qwen3.5's) runs in the prefill-then-decode and HF layer checks
    return dict(nk=2, nv=4, dk=12, dv=r.choice([8, 12, 16]), K=3)


def _slow_heads(heads: int) -> torch.Tensor:
    """Even heads decay slowly (g ~ -0.01 per token, as real GDN heads mostly do): inside a 64-token chunk every
    pair of tokens still interacts, so the far blocks of the WY solve matter. Odd heads forget fast (g ~ -0.7)."""
    return torch.arange(heads) % 2 == 0


def _log_decay_rate(r: Rand, heads: int) -> torch.Tensor:
    """A_log per head: about -4.5 on the slow heads (exp(A_log) ~ 0.01), about 0 on the fast ones."""
    return torch.where(_slow_heads(heads), -4.5, 0.0) + r.randn(heads, scale=0.5)


def _layer_inputs(r: Rand, n: int, s: dict, dtype: torch.dtype, scale: float = 1.0) -> dict:
    """mixed_qkv / a / b as strided views of one projection output (as the engine passes them), params, fp32."""
    C = 2 * s["nk"] * s["dk"] + s["nv"] * s["dv"]
    proj = r.randn(n, C + 2 * s["nv"] + 8)
    proj[:, :C] *= scale
    proj = proj.to(DEVICE, dtype)
    return dict(mixed=proj[:, :C], a=proj[:, C:C + s["nv"]], b=proj[:, C + s["nv"]:C + 2 * s["nv"]], weight=r.randn(C, s["K"], scale=0.5).to(DEVICE, dtype),
                A_log=_log_decay_rate(r, s["nv"]).to(DEVICE, dtype), dt_bias=r.randn(s["nv"], scale=0.5).to(DEVICE, dtype))


def _pools(r: Rand, slots: int, s: dict, dtype: torch.dtype, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    C = 2 * s["nk"] * s["dk"] + s["nv"] * s["dv"]
    return (r.randn(slots, C, s["K"] - 1, scale=scale).to(DEVICE, dtype), r.randn(slots, s["nv"], s["dk"], s["dv"], scale=0.5).to(DEVICE))


def _qkv(m5, x: torch.Tensor, s: dict, *, eps_outside=False, no_scale=False, tile=False):
    """m05's split / l2norm / dk^-0.5 / repeat_interleave of the conv output x [N, C], with one mistake on."""
    nk, nv, dk, dv = s["nk"], s["nv"], s["dk"], s["dv"]
    q, k, v = x.float().split([nk * dk, nk * dk, nv * dv], -1)
    norm = (lambda t: t / (t.norm(dim=-1, keepdim=True) + 1e-6)) if eps_outside else m5.l2norm
    q = norm(q.reshape(-1, nk, dk)) * (1.0 if no_scale else dk ** -0.5)
    k = norm(k.reshape(-1, nk, dk))
    expand = (lambda t: t.repeat(1, nv // nk, 1)) if tile else (lambda t: t.repeat_interleave(nv // nk, 1))
    return expand(q), expand(k), v.reshape(-1, nv, dv)


def _oracle_decode(m5, inp: dict, conv: torch.Tensor, ssm: torch.Tensor, s: dict, **mistake):
    """m05's decode path in fp32 on copies of the live rows' states -> (o [B, nv, dv], conv, ssm)."""
    conv, ssm = conv.float().clone(), ssm.float().clone()
    x = m5.causal_conv1d_update(inp["mixed"].float(), conv, inp["weight"].float())
    q, k, v = _qkv(m5, x, s, **{k: v for k, v in mistake.items() if k in ("eps_outside", "no_scale", "tile")})
    g, beta = m5.gdn_gates(inp["a"], inp["b"], inp["A_log"], inp["dt_bias"])
    beta = beta.float()
    decay = g.exp()[..., None, None]
    if mistake.get("read_before_decay"):
        pred = torch.einsum("bhk,bhkv->bhv", k, ssm)
        ssm = ssm * decay
    else:
        ssm = ssm * decay
        pred = torch.einsum("bhk,bhkv->bhv", k, ssm)
    u = beta[..., None] * v - pred if mistake.get("beta_v_only") else beta[..., None] * (v - pred)
    ssm = ssm + k[..., :, None] * u[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, ssm), conv, ssm


def _oracle_prefill(m5, inp: dict, cu: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, s: dict,
                    zero_conv=False, zero_ssm=False, **mistake):
    """m05's prefill path in fp32 per sequence from the given states -> (o [N, nv, dv], conv, ssm)."""
    lens = (cu[1:] - cu[:-1]).tolist()
    live = [i for i, n in enumerate(lens) if n > 0]
    if len(live) < len(lens):       # a sequence of length 0 keeps both states as they start (m05 needs >= 1 token)
        o, conv_live, ssm_live = _oracle_prefill(m5, inp, _cu([lens[i] for i in live]), conv[live], ssm[live], s,
                                                 zero_conv=zero_conv, zero_ssm=zero_ssm, **mistake)
        conv_all = torch.zeros_like(conv, dtype=torch.float32) if zero_conv else conv.float().clone()
        ssm_all = torch.zeros_like(ssm) if zero_ssm else ssm.float().clone()
        conv_all[live], ssm_all[live] = conv_live, ssm_live
        return o, conv_all, ssm_all
    conv = torch.zeros_like(conv, dtype=torch.float32) if zero_conv else conv.float()
    ssm = torch.zeros_like(ssm) if zero_ssm else ssm.float().clone()
    x, conv = m5.causal_conv1d(inp["mixed"].float(), inp["weight"].float(), cu, conv)
    q, k, v = _qkv(m5, x, s, **mistake)
    g, beta = m5.gdn_gates(inp["a"], inp["b"], inp["A_log"], inp["dt_bias"])
    o, bounds = torch.empty_like(v), cu.tolist()
    for i in range(len(bounds) - 1):
        a, e = bounds[i], bounds[i + 1]
        o_i, ssm[i:i + 1] = m5.chunk_gated_delta_rule(q[None, a:e], k[None, a:e], v[None, a:e], g[None, a:e],
                                                      beta[None, a:e].float(), ssm[i:i + 1])
        o[a:e] = o_i[0]
    return o, conv, ssm


def _call(fn, inp: dict, *args, s: dict, **kwargs):
    return fn(inp["mixed"], inp["a"], inp["b"], inp["weight"], inp["A_log"], inp["dt_bias"], *args,
              s["nk"], s["dk"], s["dv"], **kwargs)


def _chunk_table_of(lengths: list[int], chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, first token) of every chunk, int32 on the device: what g01 passes as gdn_prefill(chunks=...)."""
    seq, start, t = [], [], 0
    for i, n in enumerate(lengths):
        for c in range(0, n, chunk):
            seq.append(i)
            start.append(t + c)
        t += n
    return (torch.tensor(seq, dtype=torch.int32, device=DEVICE), torch.tensor(start, dtype=torch.int32, device=DEVICE))


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(DEVICE, torch.int32)


# ---------------------------------------------------------------------------------------------- decode

@point("decode 与 m05 一致（conv 更新、门控、l2norm、delta rule 一步，池中原地更新）")
def test_decode_matches_m05():
    m, m5 = impl(MODULE), impl("m05_gated_deltanet")
    r = Rand()
    s = _layer_sizes(r)
    if not GPU:
        s["dv"] = 12                                     # dk = dv = 12: both padded to 16 and masked
    for dtype, scale in ((torch.float32, 1.0), (torch.float32, 1e-3), (torch.bfloat16, 1.0)):
        batch = r.choice([1, 5, 64, 256]) if GPU else r.int(2, 4)
        num_slots = batch + 3
        inp = _layer_inputs(r, batch, s, dtype, scale)
        conv_pool, ssm_pool = _pools(r, num_slots, s, dtype, scale)          # tiny q/k show where eps goes
        slots = torch.randperm(num_slots, generator=r.gen)[:batch].to(DEVICE, torch.int32)
        before = conv_pool.clone(), ssm_pool.clone()
        o = _call(m.gdn_decode, inp, conv_pool, ssm_pool, slots, s=s)
        idx = slots.long()
        ref_o, ref_conv, ref_ssm = _oracle_decode(m5, inp, before[0][idx], before[1][idx], s)
        what = f"gdn_decode（B={batch}，{dtype}，输入尺度 {scale:g}，nk={s['nk']}，nv={s['nv']}）"

        def wrong(i, inp=inp, before=before, idx=idx):
            run = lambda **kw: _oracle_decode(m5, inp, before[0][idx], before[1][idx], s, **kw)[i]  # noqa: E731
            return [(run(eps_outside=True), L2_EPS), (run(no_scale=True), Q_SCALE), (run(tile=True), HEAD_MAP),
                    (run(read_before_decay=True), READ_BEFORE_DECAY), (run(beta_v_only=True), BETA_V_ONLY)]
        _check(o, ref_o, what=f"{what} 的输出 o [B, nv, dv]", rand=r, dtype=dtype, mistakes=lambda: wrong(0))
        if o.dtype != dtype:
            raise AssertionError(f"{what} 的输出 dtype 应为 {dtype}（mixed_qkv 的 dtype），得到 {o.dtype}\n  {OUT_DTYPE}")
        newest_first = torch.cat([inp["mixed"][..., None].to(dtype), before[0][idx][..., :-1]], -1)
        _check(conv_pool[idx], ref_conv, what=f"{what} 之后池中的 conv_state", rand=r, dtype=dtype,
               mistakes=lambda: [(before[0][idx], CONV_SHIFT), (newest_first, CONV_SHIFT)])
        _check(ssm_pool[idx], ref_ssm, what=f"{what} 之后池中的递推状态", rand=r, dtype=dtype,
               mistakes=lambda: wrong(2))
        rest = torch.ones(num_slots, dtype=torch.bool)
        rest[idx.cpu()] = False
        _same(conv_pool[rest.to(DEVICE)], before[0][rest.to(DEVICE)], what="不在 slots 里的池行（conv）", mistake=SLOT_WRITTEN, rand=r)
        _same(ssm_pool[rest.to(DEVICE)], before[1][rest.to(DEVICE)], what="不在 slots 里的池行（ssm）", mistake=SLOT_WRITTEN, rand=r)
        record_case(f"decode:{str(dtype).removeprefix('torch.')},scale={scale:g}")
    record_case("decode:strided-a-b,dk-dv-not-pow2,K=3")


@point("slot -1 的 padding 行不读不写池")
def test_decode_padding_rows():
    m, m5 = impl(MODULE), impl("m05_gated_deltanet")
    r = Rand()
    s = _layer_sizes(r)
    batch = r.choice([8, 64]) if GPU else r.int(3, 5)
    live = sorted(r.py.sample(range(batch), batch - 2))                   # two padded rows
    num_slots = batch + 2
    inp = _layer_inputs(r, batch, s, torch.float32)
    # the pools are views behind a guard slot: slot -1 taken literally writes into the guard
    conv_all, ssm_all = _pools(r, num_slots + 1, s, torch.float32)
    conv_pool, ssm_pool = conv_all[1:], ssm_all[1:]
    chosen = torch.randperm(num_slots - 1, generator=r.gen)[:len(live)] + 1  # slot 0 is never used
    slots = torch.full((batch,), -1, dtype=torch.int32)
    slots[live] = chosen.int()
    slots = slots.to(DEVICE)
    before = conv_all.clone(), ssm_all.clone()
    o = _call(m.gdn_decode, inp, conv_pool, ssm_pool, slots, s=s)
    live_inp = {k: (v[live] if k in ("mixed", "a", "b") else v) for k, v in inp.items()}
    idx = chosen.to(DEVICE).long() + 1
    ref_o, _, ref_ssm = _oracle_decode(m5, live_inp, before[0][idx], before[1][idx], s)
    what = f"gdn_decode（B={batch}，slots={slots.tolist()}）"
    _check(o[live], ref_o, what=f"{what} 有效行的输出", rand=r)
    _check(ssm_pool[idx - 1], ref_ssm, what=f"{what} 有效行的递推状态", rand=r)
    keep = torch.ones(num_slots + 1, dtype=torch.bool)
    keep[idx.cpu()] = False
    keep = keep.to(DEVICE)
    _same(conv_all[keep], before[0][keep], what=f"{what}：slot 0、池外的保护行与未用的 slot（conv）", mistake=SLOT_WRITTEN, rand=r)
    _same(ssm_all[keep], before[1][keep], what=f"{what}：slot 0、池外的保护行与未用的 slot（ssm）", mistake=SLOT_WRITTEN, rand=r)
    record_case("decode:slot-minus-one")


@point("递推状态始终 fp32：β=0、g=0 时池中状态原样穿过（bf16 输入）")
def test_state_stays_fp32():
    m = impl(MODULE)
    r = Rand()
    s = _layer_sizes(r)
    batch = r.choice([4, 64]) if GPU else r.int(2, 3)
    inp = _layer_inputs(r, batch, s, torch.bfloat16)
    inp["a"] = torch.full_like(inp["a"], float("-inf"))                   # softplus(-inf) = 0 -> g = 0
    inp["b"] = torch.full_like(inp["b"], float("-inf"))                   # sigmoid(-inf) = 0 -> beta = 0
    conv_pool, ssm_pool = _pools(r, batch + 1, s, torch.bfloat16)
    slots = torch.randperm(batch + 1, generator=r.gen)[:batch].to(DEVICE, torch.int32)
    before = ssm_pool.clone()
    _call(m.gdn_decode, inp, conv_pool, ssm_pool, slots, s=s)
    _same(ssm_pool, before, what="gdn_decode（bf16，β=0、g=0）之后的递推状态", mistake=STATE_BF16, rand=r)
    record_case("state:decode-bf16,beta=0,g=0")

    lengths = [r.int(1, 3), r.int(65, 80)] if not GPU else [r.int(1, 3), r.int(500, 2000)]
    inp = _layer_inputs(r, sum(lengths), s, torch.bfloat16)
    inp["a"], inp["b"] = torch.full_like(inp["a"], float("-inf")), torch.full_like(inp["b"], float("-inf"))
    slots = slots[:2]
    before = ssm_pool.clone()
    o = _call(m.gdn_prefill, inp, _cu(lengths), conv_pool, ssm_pool, slots, s=s)
    _same(ssm_pool, before, what=f"gdn_prefill（bf16，β=0、g=0，长度 {lengths}）之后的递推状态", mistake=STATE_BF16, rand=r)
    if o.dtype != torch.bfloat16:
        raise AssertionError(f"gdn_prefill（bf16 输入）的输出 dtype 应为 torch.bfloat16，得到 {o.dtype}；{r}\n  {OUT_DTYPE}")
    record_case("state:prefill-bf16,beta=0,g=0")

    # beta = 0 with real decays: the state only decays, S_T = exp(sum g) * S_0, in fp32
    H, T = (s["nv"] if GPU else 1), lengths[1]
    q = F.normalize(r.randn(1, T, H, s["dk"]), dim=-1).to(DEVICE, torch.bfloat16)
    v = r.randn(1, T, H, s["dv"]).to(DEVICE, torch.bfloat16)
    g = (-F.softplus(r.randn(1, T, H)) * 0.01).to(DEVICE)
    h0 = r.randn(1, H, s["dk"], s["dv"]).to(DEVICE)
    o, final = m.chunk_gated_delta_rule(q, q, v, g, torch.zeros(1, T, H, dtype=torch.bfloat16, device=DEVICE), h0)
    expect = h0 * g.sum(1).exp()[0, :, None, None]
    if not close(final.cpu(), expect.cpu(), atol=1e-5, rtol=1e-5):
        assert_close(final.cpu(), expect.cpu(), what=f"chunk_gated_delta_rule（bf16，β=0，T={T}）的最终状态 exp(Σg)·S0",
                     rand=r, atol=1e-5, rtol=1e-5, looks_like=[(expect.bfloat16().float().cpu(), STATE_BF16)])
    if final.dtype != torch.float32:
        raise AssertionError(f"chunk_gated_delta_rule 返回的状态 dtype 应为 fp32，得到 {final.dtype}\n  看起来像易错点：{STATE_BF16}")
    if o.dtype != torch.bfloat16:
        raise AssertionError(f"chunk_gated_delta_rule（bf16 的 v）的输出 dtype 应为 torch.bfloat16，得到 {o.dtype}；{r}\n  {OUT_DTYPE}")
    record_case("state:chunk-bf16,beta=0,decay-only")


# ---------------------------------------------------------------------------------------------- chunked rule

def _rule_inputs(r: Rand, batch: int, steps: int, heads: int, dk: int, dv: int, dtype=torch.float32):
    q_unit = F.normalize(r.randn(batch, steps, heads, dk), dim=-1)
    k = F.normalize(r.randn(batch, steps, heads, dk), dim=-1)
    v = r.randn(batch, steps, heads, dv)
    rate = r.randn(heads, scale=0.5).exp() * torch.where(_slow_heads(heads), 0.02, 1.0)     # head 0 always slow
    g = -rate * F.softplus(r.randn(batch, steps, heads) - 1.0)
    beta = r.randn(batch, steps, heads).sigmoid()
    state = r.randn(batch, heads, dk, dv, scale=0.5)
    q_unit, k, v, beta = (t.to(dtype).float() for t in (q_unit, k, v, beta))   # the oracle sees the rounded inputs
    return [t.to(DEVICE) for t in (q_unit, k, v, g, beta, state)]


def _wrong_rules(q_unit, k, v, g, beta, state):
    """HF's chunked rule with the classic mistakes of the WY form (q_unit unscaled: HF scales it)."""
    dk = k.shape[-1]
    no_init = HF_CHUNK(q_unit, k, v, g, beta, initial_state=None, output_final_state=True)
    no_scale = HF_CHUNK(q_unit * dk ** 0.5, k, v, g, beta, initial_state=state.clone(), output_final_state=True)
    return [(no_init, INIT_IGNORED), (no_scale, "q 又乘了一次 dk^-0.5 或没有乘：传进来的 q 已经缩放过")]


@point("分块 WY kernel 与 HF torch_chunk / torch_recurrent 一致（T 非 64 倍数、初始状态）")
def test_chunk_matches_hf():
    m = impl(MODULE)
    r = Rand()
    cases = ([(torch.float32, r.int(2, 3), r.int(4000, 9000)), (torch.bfloat16, 2, r.int(4000, 9000))] if GPU
             else [(torch.float32, 2, r.int(65, 130))])
    for dtype, batch, steps in cases:
        steps += steps % 64 == 0
        heads, dk, dv = (8, 128, 128) if GPU else (r.int(1, 2), r.choice([8, 16]), r.choice([8, 16]))
        q_unit, k, v, g, beta, state = _rule_inputs(r, batch, steps, heads, dk, dv, dtype)
        ref_o, ref_s = HF_CHUNK(q_unit, k, v, g, beta, initial_state=state.clone(), output_final_state=True)
        o, s = m.chunk_gated_delta_rule((q_unit * dk ** -0.5).to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype),
                                        state.clone())
        what = f"chunk_gated_delta_rule（B={batch}，T={steps}，H={heads}，{dtype}）"
        _check(o, ref_o, what=f"{what} 的输出 o", rand=r, dtype=dtype,
               mistakes=lambda: [(w[0], name) for w, name in _wrong_rules(q_unit, k, v, g, beta, state)])
        _check(s, ref_s, what=f"{what} 的最终状态", rand=r, dtype=dtype,
               mistakes=lambda: [(w[1], name) for w, name in _wrong_rules(q_unit, k, v, g, beta, state)])
        if not GPU:                                                       # the token-by-token form agrees too
            rec_o, rec_s = HF_RECURRENT(q_unit, k, v, g, beta, initial_state=state.clone(), output_final_state=True)
            _check(o, rec_o, what=f"{what} 与 HF torch_recurrent_gated_delta_rule 的输出", rand=r)
            _check(s, rec_s, what=f"{what} 与 HF torch_recurrent_gated_delta_rule 的最终状态", rand=r)
        record_case("chunk:B>1,T-not-64-multiple,initial-state")


@point("变长打包：每条序列从自己的起点分块、带各自的初始状态")
def test_chunk_varlen():
    m = impl(MODULE)
    r = Rand()
    lengths = ([r.int(1, 70), r.int(100, 3000), r.int(1, 5), r.int(3000, 9000)] if GPU
               else [r.int(1, 40), r.int(65, 90), r.int(1, 5)])
    heads, dk, dv = (8, 128, 128) if GPU else (1, r.choice([8, 16]), 8)
    pieces = [_rule_inputs(r, 1, n, heads, dk, dv) for n in lengths]
    q_unit, k, v, g, beta = (torch.cat([p[i] for p in pieces], 1) for i in range(5))
    state = torch.cat([p[5] for p in pieces])
    o, s = m.chunk_gated_delta_rule(q_unit * dk ** -0.5, k, v, g, beta, state.clone(), cu_seqlens=_cu(lengths))
    bounds = _cu(lengths).tolist()
    for i, p in enumerate(pieces):
        ref_o, ref_s = HF_CHUNK(p[0], p[1], p[2], p[3], p[4], initial_state=p[5].clone(), output_final_state=True)
        what = f"chunk_gated_delta_rule（cu_seqlens，长度 {lengths}）第 {i} 条序列"
        no_init = lambda p=p: HF_CHUNK(*p[:5], output_final_state=True)  # noqa: E731
        try:
            _check(o[:, bounds[i]:bounds[i + 1]], ref_o, what=f"{what} 的输出", rand=r,
                   mistakes=lambda: [(no_init()[0], INIT_IGNORED)])
            _check(s[i:i + 1], ref_s, what=f"{what} 的最终状态", rand=r, mistakes=lambda: [(no_init()[1], INIT_IGNORED)])
        except AssertionError as exc:
            if i and "易错点" not in str(exc):                            # the earlier sequences were right
                raise AssertionError(f"{exc}\n  前面的序列都对、这一条错了——看起来像易错点：{CHUNK_BOUNDARY}") from None
            raise
    record_case("chunk:varlen,initial-states")


# ---------------------------------------------------------------------------------------------- prefill layer

@point("gdn_prefill 与 m05 一致（打包序列从池中状态出发，conv 与递推状态写回）")
def test_prefill_matches_m05():
    m, m5 = impl(MODULE), impl("m05_gated_deltanet")
    r = Rand()
    s = _layer_sizes(r)
    cases = ([(torch.float32, [1, 2, r.int(100, 700), r.int(60, 70)]),
              (torch.bfloat16, [r.int(1, 3), r.int(1000, 5000), 1, r.int(64, 200)])] if GPU
             else [(torch.float32, [1, 0, r.int(65, 75), r.int(2, 9)])])       # 1 < K - 1: keeps an old tail
    if not GPU:
        s["dv"] = 12
    for dtype, lengths in cases:
        r.py.shuffle(lengths)
        inp = _layer_inputs(r, sum(lengths), s, dtype)
        num_slots = len(lengths) + 2
        conv_pool, ssm_pool = _pools(r, num_slots, s, dtype)
        slots = torch.randperm(num_slots, generator=r.gen)[:len(lengths)].to(DEVICE, torch.int32)
        idx = slots.long()
        before = conv_pool.clone(), ssm_pool.clone()
        cu = _cu(lengths)
        o = _call(m.gdn_prefill, inp, cu, conv_pool, ssm_pool, slots, s=s)
        ref_o, ref_conv, ref_ssm = _oracle_prefill(m5, inp, cu, before[0][idx], before[1][idx], s)
        what = f"gdn_prefill（长度 {lengths}，{dtype}，nk={s['nk']}，nv={s['nv']}，K={s['K']}）"

        def wrong(i, inp=inp, cu=cu, before=before, idx=idx):
            run = lambda **kw: _oracle_prefill(m5, inp, cu, before[0][idx], before[1][idx], s, **kw)[i]  # noqa: E731
            return [(run(zero_conv=True), CONV_BOUNDARY), (run(zero_ssm=True), INIT_IGNORED),
                    (run(eps_outside=True), L2_EPS), (run(no_scale=True), Q_SCALE), (run(tile=True), HEAD_MAP)]
        _check(o, ref_o, what=f"{what} 的输出 o [N, nv, dv]", rand=r, dtype=dtype, mistakes=lambda: wrong(0))
        _check(conv_pool[idx], ref_conv, what=f"{what} 写回池的 conv_state（每条序列最后 K−1 个输入）", rand=r,
               dtype=dtype, mistakes=lambda: [(_oracle_prefill(m5, inp, cu, before[0][idx], before[1][idx], s,
                                                               zero_conv=True)[1], CONV_TAIL)])
        _check(ssm_pool[idx], ref_ssm, what=f"{what} 写回池的递推状态", rand=r, dtype=dtype,
               mistakes=lambda: wrong(2))
        rest = torch.ones(num_slots, dtype=torch.bool)
        rest[idx.cpu()] = False
        _same(ssm_pool[rest.to(DEVICE)], before[1][rest.to(DEVICE)], what="不在 slots 里的池行", mistake=SLOT_WRITTEN, rand=r)
        # the engine hands over the chunk table it built on the host: the same call with chunks= gives the same result
        conv_again, ssm_again = before[0].clone(), before[1].clone()
        o_again = _call(m.gdn_prefill, inp, cu, conv_again, ssm_again, slots, s=s, chunks=_chunk_table_of(lengths))
        for name, got, want in (("输出 o", o_again, o), ("写回池的递推状态", ssm_again, ssm_pool)):
            if not torch.equal(got.cpu(), want.cpu()):
                raise AssertionError(f"{what}：传入 chunks=（引擎在 host 上算好的块表，等于 _chunk_table(cu_seqlens)）时"
                                     f"{name}与不传时不同；{r}\n  看起来像易错点：{CHUNKS_MISUSED}")
        record_case(f"prefill:{str(dtype).removeprefix('torch.')},from-pool,chunks-given")
        if 1 in lengths:
            record_case("prefill:len-1<K-1")
        if 0 in lengths:
            record_case("prefill:len-0")
        if max(lengths) > 64:
            record_case("prefill:spans-chunks")


def _hf_layer(r: Rand):
    if GPU:
        size = dict(hidden_size=1024, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4)
    else:
        nk = r.int(1, 2)
        size = dict(hidden_size=16, linear_num_key_heads=nk, linear_num_value_heads=nk * r.choice([1, 2]),
                    linear_key_head_dim=r.choice([8, 16]), linear_value_head_dim=8, linear_conv_kernel_dim=4)
    cfg = Qwen3_5TextConfig(num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6, **size)
    layer = r.init_(hf.Qwen3_5GatedDeltaNet(cfg, layer_idx=0).eval(), std=0.1)
    with torch.no_grad():
        layer.norm.weight.copy_(1.0 + r.randn(*layer.norm.weight.shape, scale=0.3))
        layer.A_log.copy_(_log_decay_rate(r, layer.num_v_heads))                 # slow and fast heads
    return layer.to(DEVICE), cfg


@point("gdn_prefill 与 HF Qwen3_5GatedDeltaNet 一致（多条打包序列，最终状态与 HF 缓存一致）")
def test_prefill_matches_hf_layer():
    m = impl(MODULE)
    r = Rand()
    L, cfg = _hf_layer(r)
    s = dict(nk=L.num_k_heads, nv=L.num_v_heads, dk=L.head_k_dim, dv=L.head_v_dim, K=cfg.linear_conv_kernel_dim)
    lengths = [r.int(1, 3), r.int(65, 70)] if not GPU else [r.int(1, 3), r.int(2000, 4000), r.int(65, 70)]
    x = r.randn(sum(lengths), cfg.hidden_size).to(DEVICE)
    cu = _cu(lengths)
    conv_pool, ssm_pool = _pools(r, len(lengths), s, torch.float32)
    conv_pool.zero_(), ssm_pool.zero_()                                   # the engine zeroes a slot at a prefill start
    slots = torch.arange(len(lengths), device=DEVICE, dtype=torch.int32).flip(0)
    with torch.no_grad():
        ab = torch.cat([L.in_proj_a(x), L.in_proj_b(x)], -1)
        o = m.gdn_prefill(L.in_proj_qkv(x), ab[:, :s["nv"]], ab[:, s["nv"]:], L.conv1d.weight[:, 0], L.A_log,
                          L.dt_bias, cu, conv_pool, ssm_pool, slots, s["nk"], s["dk"], s["dv"])
        out = L.out_proj(L.norm(o.reshape(-1, s["dv"]), L.in_proj_z(x).reshape(-1, s["dv"])).reshape(len(x), -1))
        bounds = cu.tolist()
        for i in range(len(lengths)):
            cache = DynamicCache(config=cfg)
            ref = L(x[None, bounds[i]:bounds[i + 1]], cache_params=cache)[0]
            what = f"gdn_prefill + HF 的 norm/out_proj（长度 {lengths}）第 {i} 条序列"
            tol = LONG_HF_TOL if GPU else None
            _check(out[bounds[i]:bounds[i + 1]], ref, what=f"{what} 的层输出", rand=r, tol=tol)
            slot = int(slots[i])
            _check(conv_pool[slot], cache.layers[0].conv_states[0][0][:, 1:], what=f"{what} 的 conv_state（HF 缓存的后 K−1 个）", rand=r)
            _check(ssm_pool[slot], cache.layers[0].recurrent_states[0][0], what=f"{what} 的递推状态（HF 缓存）", rand=r, tol=tol)
    record_case("hf:layer,K=4")


@point("prefill 两段再 decode 1 个 token（状态经池子传递）等于一次性 prefill")
def test_prefill_then_decode():
    m = impl(MODULE)
    r = Rand()
    s = _layer_sizes(r) if GPU else dict(nk=1, nv=2, dk=8, dv=8, K=4)
    lengths = [r.int(4, 9), r.int(66, 72)] if not GPU else [r.int(4, 9), r.int(3000, 5000), r.int(66, 200)]
    inp = _layer_inputs(r, sum(lengths), s, torch.float32)
    num_slots = len(lengths) + 1
    conv_full, ssm_full = (t.zero_() for t in _pools(r, num_slots, s, torch.float32))
    conv_step, ssm_step = conv_full.clone(), ssm_full.clone()
    slots = torch.randperm(num_slots, generator=r.gen)[:len(lengths)].to(DEVICE, torch.int32)
    full = _call(m.gdn_prefill, inp, _cu(lengths), conv_full, ssm_full, slots, s=s)
    bounds = _cu(lengths).tolist()
    cuts = [r.int(1, n - 2) for n in lengths]
    pieces = [[(a, a + c) for a, c in zip(bounds, cuts)], [(a + c, b - 1) for a, b, c in zip(bounds, bounds[1:], cuts)]]
    outs = []
    for piece in pieces:
        rows = torch.cat([torch.arange(a, b) for a, b in piece]).to(DEVICE)
        sub = {k: (v[rows] if k in ("mixed", "a", "b") else v) for k, v in inp.items()}
        outs.append(_call(m.gdn_prefill, sub, _cu([b - a for a, b in piece]), conv_step, ssm_step, slots, s=s))
    last = torch.tensor(bounds[1:], device=DEVICE) - 1
    sub = {k: (v[last] if k in ("mixed", "a", "b") else v) for k, v in inp.items()}
    dec = _call(m.gdn_decode, sub, conv_step, ssm_step, slots, s=s)
    offsets = [0, 0]
    for i, n in enumerate(lengths):
        ref = full[bounds[i]:bounds[i + 1]]
        got = []
        for j, piece in enumerate(pieces):
            size = piece[i][1] - piece[i][0]
            got.append(outs[j][offsets[j]:offsets[j] + size])
            offsets[j] += size
        got.append(dec[i:i + 1])
        _check(torch.cat(got), ref, what=f"序列 {i}（长度 {n}，切在 {cuts[i]} 与 {n - 1}）分段 prefill + decode 的输出，"
               f"与一次性 prefill 比", rand=r)
    _check(ssm_step, ssm_full, what="分段 prefill + decode 之后池中的递推状态", rand=r)
    _check(conv_step, conv_full, what="分段 prefill + decode 之后池中的 conv_state", rand=r)
    record_case("pipeline:prefill-prefill-decode")


# ---------------------------------------------------------------------------------------------- the card

@point("卡片例子：单块 WY 的 u、o 与最终状态，以及 slot 的原地读写")
def test_card_worked_example():
    m = impl(MODULE)
    q = torch.tensor([[0.7071068, 0.0], [0.0, 0.7071068], [0.5, 0.5]])
    k = torch.tensor([[1.0, 0.0], [0.6, 0.8], [1.0, 0.0]])
    v = torch.tensor([[1.0, 2.0], [2.0, -1.0], [3.0, 0.0]])
    g = torch.tensor([0.9, 0.5, 0.8]).log()
    beta = torch.tensor([0.5, 0.8, 0.5])
    shaped = [t[None, :, None].to(DEVICE) for t in (q, k, v, g, beta)]           # B=1, T=3, H=1
    o, s = m.chunk_gated_delta_rule(*shaped)
    ref_o = torch.tensor([[0.3536, 0.7071], [0.8372, -0.5883], [1.4512, -0.3576]])
    ref_s = torch.tensor([[1.9552, -0.0496], [0.9472, -0.6656]])
    assert_close(o[0, :, 0].cpu(), ref_o, what="卡片例子（一块，T=3）的输出 o_1..o_3", atol=1e-4, rtol=0,
                 looks_like=[(torch.tensor([[0.3536, 0.7071], [0.7693, -0.7241], [1.3451, -0.4498]]), READ_BEFORE_DECAY)])
    assert_close(s[0, 0].cpu(), ref_s, what="卡片例子的最终状态 S_3", atol=1e-4, rtol=0)

    # two packed sequences [t1, t2] and [t3]: the second starts from S_2 (decay 0.8 applied to it first)
    s2 = torch.tensor([[1.138, -0.124], [1.184, -0.832]])
    initial = torch.stack([torch.zeros(2, 2), s2])[:, None].to(DEVICE)        # [2, 1, 2, 2]
    o, s = m.chunk_gated_delta_rule(*shaped, initial_state=initial, cu_seqlens=_cu([2, 1]))
    assert_close(o[0, :, 0].cpu(), ref_o, what="卡片例子拆成两条序列（cu_seqlens=[0,2,3]，第二条从 S_2 出发）的输出",
                 atol=1e-4, rtol=0)
    assert_close(s[:, 0].cpu(), torch.stack([s2, ref_s]), what="卡片例子两条序列的最终状态 [S_2, S_3]", atol=1e-4, rtol=0,
                 looks_like=[(torch.stack([s2, torch.tensor([[1.5, 0.0], [0.0, 0.0]])]), INIT_IGNORED)])
    record_case("card:wy")

    # decode through the pool: B=2, slots [2, -1]; 1 head, dk=dv=2, K=2, conv weight [0, 1] (window's newest only)
    mixed = torch.tensor([[3.0, 1.0, 1.0, 0.0, 1.0, -1.0], [9.0, 9.0, 9.0, 9.0, 9.0, 9.0]])
    weight = torch.tensor([[0.0, 1.0]] * 6)
    conv_pool = torch.zeros(3, 6, 1, device=DEVICE)
    ssm_pool = torch.stack([torch.full((1, 2, 2), 7.0), torch.full((1, 2, 2), 7.0), torch.zeros(1, 2, 2)]).to(DEVICE)
    a = torch.full((2, 1), float("-inf"), device=DEVICE)                      # g = 0: no decay
    b = torch.zeros(2, 1, device=DEVICE)                                      # beta = 0.5
    zero = torch.zeros(1, device=DEVICE)                                      # A_log, dt_bias
    o = m.gdn_decode(mixed.to(DEVICE), a, b, weight.to(DEVICE), zero, zero, conv_pool, ssm_pool,
                     torch.tensor([2, -1], dtype=torch.int32, device=DEVICE), 1, 2, 2)
    x = F.silu(torch.tensor([3.0, 1.0, 1.0, 0.0, 1.0, -1.0]))              # q, k, v after conv + silu
    u = 0.5 * x[4:]                                                        # S0 = 0: u = beta * v
    q_n = x[:2] / x[:2].norm() * 2 ** -0.5
    assert_close(ssm_pool[2, 0].cpu(), torch.outer(torch.tensor([1.0, 0.0]), u), what="卡片 decode 例子：slot 2 的新状态 k uᵀ",
                 atol=1e-5, rtol=0)
    assert_close(o[0, 0].cpu(), q_n[0] * u, what="卡片 decode 例子：第 0 行的输出 Sᵀq", atol=1e-5, rtol=0)
    assert_close(conv_pool[2, :, 0].cpu(), torch.tensor([3.0, 1.0, 1.0, 0.0, 1.0, -1.0]),
                 what="卡片 decode 例子：slot 2 的 conv_state（K−1 = 1 个输入：这个 token）", atol=0, rtol=0)
    _same(ssm_pool[:2], torch.full((2, 1, 2, 2), 7.0), what="卡片 decode 例子：slot 0、1 的递推状态（第 1 行 slot=−1）",
          mistake=SLOT_WRITTEN, rand=Rand(0))
    _same(conv_pool[:2], torch.zeros(2, 6, 1), what="卡片 decode 例子：slot 0、1 的 conv_state", mistake=SLOT_WRITTEN,
          rand=Rand(0))
    record_case("card:decode-slot")


# ---------------------------------------------------------------------------------------------- GPU only

@needs_cuda
@point("GPU：T=32k 的单条长序列（bf16 输入、fp32 状态、从池中状态出发）与 m05 一致")
def test_gpu_long_prefill():
    m, m5 = impl(MODULE), impl("m05_gated_deltanet")
    r = Rand()
    s = _layer_sizes(r)
    lengths = [32768 - r.int(1, 63)]
    inp = _layer_inputs(r, lengths[0], s, torch.bfloat16)
    conv_pool, ssm_pool = _pools(r, 2, s, torch.bfloat16)
    slots = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    before = conv_pool.clone(), ssm_pool.clone()
    cu = _cu(lengths)
    o = _call(m.gdn_prefill, inp, cu, conv_pool, ssm_pool, slots, s=s)
    ref_o, ref_conv, ref_ssm = _oracle_prefill(m5, inp, cu, before[0][1:], before[1][1:], s)
    _check(o, ref_o, what=f"gdn_prefill（T={lengths[0]}，bf16）的输出", rand=r, dtype=torch.bfloat16)
    _check(ssm_pool[1:], ref_ssm, what=f"gdn_prefill（T={lengths[0]}，bf16）的最终递推状态", rand=r, dtype=torch.bfloat16)
    _same(ssm_pool[:1], before[1][:1], what="slot 0（未使用）", mistake=SLOT_WRITTEN, rand=r)


@needs_cuda
@point("GPU：decode 可被 CUDA graph 捕获并重放（无 host 同步）")
def test_gpu_decode_cuda_graph():
    m, m5 = impl(MODULE), impl("m05_gated_deltanet")
    r = Rand()
    s = _layer_sizes(r)
    batch = 32
    inp = _layer_inputs(r, batch, s, torch.bfloat16)
    conv_pool, ssm_pool = _pools(r, batch + 4, s, torch.bfloat16)
    slots = torch.randperm(batch + 4, generator=r.gen)[:batch].to(DEVICE, torch.int32)
    _call(m.gdn_decode, inp, conv_pool.clone(), ssm_pool.clone(), slots, s=s)          # compile outside the graph
    torch.cuda.synchronize()
    before = conv_pool.clone(), ssm_pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(m.gdn_decode, inp, conv_pool, ssm_pool, slots, s=s)
    conv_pool.copy_(before[0]), ssm_pool.copy_(before[1])
    graph.replay()
    torch.cuda.synchronize()
    idx = slots.long()
    ref_o, _, ref_ssm = _oracle_decode(m5, inp, before[0][idx], before[1][idx], s)
    _check(out, ref_o, what="CUDA graph 重放的 gdn_decode 输出", rand=r, dtype=torch.bfloat16)
    _check(ssm_pool[idx], ref_ssm, what="CUDA graph 重放之后池中的递推状态", rand=r, dtype=torch.bfloat16)
