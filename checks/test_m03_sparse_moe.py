"""Checks for M03 · Sparse MoE (lessons/m03_sparse_moe.md). Oracle: HF transformers 5.17.0 MoE blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from checks import oracles
from checks.kit import Rand, assert_close, assert_dtype, assert_equal, explain_crash, impl, point, record_case

MODULE = "m03_sparse_moe"

CRASHES = {
    "cannot be multiplied": "gate/up/down 投影少了转置：h @ w_gate[e] 是 [n, H] @ [I, H]，应为 h @ w_gate[e].T（或 F.linear）",
    "'NoneType' object has no attribute": "忘了 w.shared is None（thinker / Qwen3-MoE 没有 shared expert）时跳过",
    "must have the same scalar type": "路由权重留在 fp32，和 x.dtype 的专家输出混在一起（应在 route 返回前转回 x.dtype）",
}


M_TOPK_FIRST = "softmax 放在了 top-k 之后（先 top-k 再 softmax）：应先在全部 E 个 expert 上 softmax，再取 top-k"
# with norm_topk_prob=False these two mistakes give the very same weights, so the message names both
M_TOPK_OR_RENORM = ("softmax 放在了 top-k 之后（先 top-k 再 softmax），或 norm_topk_prob=False 时也做了重新归一化"
                    "（两者给出同样的权重，k 个之和为 1）：应先在全部 E 个 expert 上 softmax 再取 top-k，False 时不除以和")
M_NO_RENORM = "norm_topk_prob=True 时没有重新归一化：top-k 的权重要除以它们的和（在 fp32 里）"
M_BF16_RENORM = ("在 bf16 里重新归一化（softmax 在 x.dtype 里算，或先转回 x.dtype 再除以和）："
                 "softmax 与重新归一化都要在 fp32 里做，最后才转回 x.dtype")
M_SHARED_NO_SIGMOID = "shared expert 的门控没有过 sigmoid：应为 sigmoid(x @ gate.T) · SharedExpert(x)"
M_SHARED_UNGATED = "shared expert 没有乘门控：应为 sigmoid(x @ gate.T) · SharedExpert(x)"


def _route_variants(x: torch.Tensor, router: torch.Tensor, top_k: int, norm: bool) -> list:
    """The classic wrong routing weights [N, k] (each with the right ids where the ids agree), in x.dtype."""
    logits = (x @ router.T).float()
    probs = torch.softmax(logits, dim=-1)
    top_p, ids = torch.topk(probs, top_k, dim=-1)
    out = [(torch.softmax(top_p, -1), M_TOPK_FIRST)]
    # norm=True: softmax over the top-k logits is the right answer; norm=False: it equals renormalising
    out.append((top_p, M_NO_RENORM) if norm else (top_p / top_p.sum(-1, keepdim=True), M_TOPK_OR_RENORM))
    if norm and x.dtype != torch.float32:
        low = top_p.to(x.dtype)                                      # cast first, then renormalise in bf16
        out.append((low / low.sum(-1, keepdim=True), M_BF16_RENORM))
        low = torch.topk(torch.softmax(x @ router.T, dim=-1), top_k, dim=-1)[0]   # softmax itself in bf16
        out.append((low / low.sum(-1, keepdim=True), M_BF16_RENORM))
    return [(w.to(x.dtype), msg) for w, msg in out]


def _shape(r: Rand) -> dict:
    """Random tiny sizes; I != H so that a missing transpose cannot go unnoticed."""
    hidden = r.choice([8, 12, 16, 24])
    return dict(hidden=hidden, experts=r.int(4, 10), top_k=r.int(2, 3), inter=hidden * 2 + r.choice([-4, 4]))


def _expert_outputs(x: torch.Tensor, w) -> torch.Tensor:
    """Dense oracle: every expert on every token, [N, E, H] (only used to explain wrong answers)."""
    g = torch.einsum("nh,eih->nei", x, w.w_gate)
    u = torch.einsum("nh,eih->nei", x, w.w_up)
    return torch.einsum("nei,ehi->neh", F.silu(g) * u, w.w_down)


def _looks_like(x: torch.Tensor, w, weights: torch.Tensor, ids: torch.Tensor) -> list:
    """The classic wrong answers of moe_forward, computed from HF's routing decision."""
    n_tok, k = ids.shape
    per_expert = _expert_outputs(x, w)                                     # [N, E, H]
    chosen = per_expert[torch.arange(n_tok)[:, None], ids]                 # [N, k, H]
    contrib = chosen * weights[..., None]                                  # [N, k, H]
    shared = 0
    if w.shared is not None:
        s = w.shared
        mlp = F.linear(F.silu(F.linear(x, s.gate_proj)) * F.linear(x, s.up_proj), s.down_proj)
        shared = torch.sigmoid(x @ s.gate.T) * mlp
        vector_gate = contrib.sum(1) + torch.sigmoid(x * s.gate) * mlp
        no_sigmoid = contrib.sum(1) + (x @ s.gate.T) * mlp
        ungated = contrib.sum(1) + mlp
    # token ids built with repeat(k) (0,1,2,0,1,2) instead of repeat_interleave(k) (0,0,1,1,2,2)
    flat_e, flat_w = ids.reshape(-1), weights.reshape(-1)
    tok = torch.arange(n_tok).repeat(k)
    wrong_tok = torch.zeros_like(x).index_add_(0, tok, per_expert[tok, flat_e] * flat_w[:, None]) + shared
    # assignment instead of index_add_: the expert visited last (highest id) overwrites the others
    last = ids.argmax(dim=1)
    assigned = contrib[torch.arange(n_tok), last] + shared
    mistakes = [
        (wrong_tok, "token id 用了 arange(N).repeat(k)（0,1,2,0,1,2），应为 repeat_interleave(k)（0,0,1,1,2,2）"),
        (assigned, "scatter 用了赋值 out[toks] = y 而不是 index_add_：同一 token 只剩最后一个 expert 的贡献"),
        (contrib.sum(1), "漏掉了 shared expert：out += sigmoid(x @ gate.T) · SharedExpert(x)"),
    ]
    if w.shared is not None:
        mistakes.append((vector_gate, "shared expert 的门控当成了向量：应为 sigmoid(x @ gate.T)（[N, 1]，每 token 一个标量）"))
        mistakes += [(no_sigmoid, M_SHARED_NO_SIGMOID), (ungated, M_SHARED_UNGATED)]
    # routing mistakes (weights only: where a wrong softmax changes the top-k ids it is not named)
    mistakes += [((chosen * alt[..., None]).sum(1) + shared, msg)
                 for alt, msg in _route_variants(x, w.router, k, w.norm_topk_prob)]
    return mistakes


def _check_block(block, r: Rand, what: str, n_tokens: int | None = None) -> None:
    m = impl(MODULE)
    x = r.randn(n_tokens or r.int(5, 24), block.gate.weight.shape[1])
    w = oracles.moe_weights_from_hf(block, m)
    ref = oracles.hf_moe(block, x)
    with explain_crash(CRASHES):
        out = m.moe_forward(x, w)
    weights, ids = oracles.hf_route(block, x)
    looks_like = _looks_like(x, w, weights, ids)
    if w.shared is None:
        looks_like = [(s if "漏掉了 shared" not in msg else None, msg) for s, msg in looks_like]
    assert_close(out, ref, what=f"{what} 输出", rand=r, looks_like=looks_like)


@point("路由与参考完全一致")
def test_route_matches_hf():
    m = impl(MODULE)
    r = Rand()
    s = _shape(r)
    for norm in (True, False):
        block = oracles.qwen3_moe_block(r, norm_topk_prob=norm, **s)
        x = r.randn(r.int(5, 24), s["hidden"])
        ref_w, ref_ids = oracles.hf_route(block, x)
        weights, ids = m.route(x, block.gate.weight.detach(), s["top_k"], norm)
        assert_dtype(ids, torch.int64, what="route 返回的 ids")
        assert_equal(ids, ref_ids, what=f"route 的 expert ids（norm_topk_prob={norm}）", rand=r)
        assert_dtype(weights, x.dtype, what="route 返回的 weights")
        assert_close(weights, ref_w, what=f"route 的权重（norm_topk_prob={norm}）", rand=r,
                     looks_like=_route_variants(x, block.gate.weight.detach(), s["top_k"], norm))
        record_case(f"route:norm_topk_prob={norm}")
    record_case("route:ids-int64-weights-x.dtype")


@point("thinker MoE 与 HF 一致")
def test_thinker_block_matches_hf():
    r = Rand()
    block = oracles.thinker_moe_block(r, **_shape(r))
    _check_block(block, r, "Qwen3OmniMoeThinkerTextSparseMoeBlock")
    record_case("block:thinker-shared-None")


@point("talker MoE（含 shared）与 HF 一致")
def test_talker_block_matches_hf():
    r = Rand()
    s = _shape(r)
    block = oracles.talker_moe_block(r, shared_inter=s["inter"] + 8, **s)
    _check_block(block, r, "Qwen3OmniMoeTalkerTextSparseMoeBlock")
    record_case("block:talker-shared")

    # swiglu on its own (k03 / k05 call it for the shared expert): [n, H] with F.linear weights [I, H], [H, I]
    m = impl(MODULE)
    hid, inter = s["hidden"], s["inter"]
    h = r.randn(r.int(1, 6), hid)
    wg, wu, wd = r.randn(inter, hid, scale=0.3), r.randn(inter, hid, scale=0.3), r.randn(hid, inter, scale=0.3)
    with explain_crash(CRASHES):
        got = m.swiglu(h, wg, wu, wd)
    assert_close(got, (F.silu(h @ wg.T) * (h @ wu.T)) @ wd.T, what=f"swiglu(h {list(h.shape)}, w_gate [I={inter}, H={hid}])",
                 rand=r, looks_like=[(((h @ wg.T) * F.silu(h @ wu.T)) @ wd.T, "swiglu 把 silu 用在了 up 投影上，应为 silu(h Wg^T) ⊙ (h Wu^T)")])
    record_case("swiglu:direct")


@point("Qwen3-MoE block 与 HF 一致")
def test_qwen3_moe_block_matches_hf():
    r = Rand()
    block = oracles.qwen3_moe_block(r, norm_topk_prob=True, **_shape(r))
    _check_block(block, r, "Qwen3MoeSparseMoeBlock")
    record_case("block:qwen3-moe-norm_topk_prob=True")


@point("norm_topk_prob=False 变体")
def test_no_renormalisation():
    m = impl(MODULE)
    r = Rand()
    s = _shape(r)
    block = oracles.qwen3_moe_block(r, norm_topk_prob=False, **s)
    x = r.randn(r.int(5, 24), s["hidden"])
    logits = x @ block.gate.weight.detach().T
    top_logits, _ = torch.topk(logits, s["top_k"], dim=-1)
    weights, _ = m.route(x, block.gate.weight.detach(), s["top_k"], False)
    ref_w, _ = oracles.hf_route(block, x)
    assert_close(weights, ref_w, what="route 的权重（norm_topk_prob=False，k 个权重之和应 < 1）", rand=r,
                 looks_like=[(torch.softmax(top_logits, -1), M_TOPK_OR_RENORM),
                             (torch.softmax(ref_w, -1), M_TOPK_FIRST)])
    record_case("route:norm_topk_prob=False-sum<1")
    _check_block(block, r, "Qwen3MoeSparseMoeBlock（norm_topk_prob=False）", n_tokens=x.shape[0])
    record_case("block:qwen3-moe-norm_topk_prob=False")


@point("单 token 与 batch 一致")
def test_batch_invariance():
    m = impl(MODULE)
    r = Rand()
    s = _shape(r)
    block = oracles.talker_moe_block(r, shared_inter=s["inter"], **s)
    w = oracles.moe_weights_from_hf(block, m)
    x = r.randn(r.int(6, 16), s["hidden"])
    # both against HF (an independent oracle), never one of the learner's outputs against the other
    ref = oracles.hf_moe(block, x)
    with explain_crash(CRASHES):
        batched = m.moe_forward(x, w)
        alone = [m.moe_forward(x[i:i + 1], w) for i in range(x.shape[0])]
    assert_close(batched, ref, what=f"moe_forward(x)（batch，N={x.shape[0]}）与 HF", rand=r)
    record_case("batch:N>1")
    for i, one in enumerate(alone):
        assert_close(one, ref[i:i + 1], what=f"moe_forward(x[{i}:{i + 1}])（单 token，N=1 的 decode）与 HF 对同一 token 的输出",
                     rand=r, atol=1e-5, rtol=1e-5)
    record_case("decode:N=1")


@point("bf16 输入保持 bf16 输出")
def test_bf16_keeps_dtype():
    m = impl(MODULE)
    r = Rand()
    s = _shape(r)
    leak = "路由权重留在 fp32，没有在 route 返回前转回 x.dtype"
    # first: bf16 routing with renormalisation, bit for bit against HF's bf16 router (softmax and renorm in fp32),
    # so that a precision mistake is named here rather than by the looser end-to-end comparison below
    rblock = oracles.qwen3_moe_block(r, norm_topk_prob=True, **s).to(torch.bfloat16)
    x16 = r.randn(64, s["hidden"]).to(torch.bfloat16)
    ref_w, ref_ids = oracles.hf_route(rblock, x16)
    router = rblock.gate.weight.detach()
    weights, ids = m.route(x16, router, s["top_k"], True)
    assert_dtype(weights, torch.bfloat16, what="bf16 输入时 route 的 weights", mistake=leak)
    assert_equal(weights, ref_w, what="bf16 输入时 route 的权重（norm_topk_prob=True，与 HF 的 bf16 router 逐位比较）",
                 rand=r, looks_like=_route_variants(x16, router, s["top_k"], True))
    assert_equal(ids, ref_ids, what="bf16 输入时 route 的 expert ids（norm_topk_prob=True）", rand=r)
    record_case("bf16:route-norm_topk_prob=True")

    block = oracles.talker_moe_block(r, shared_inter=s["inter"], **s)
    x32 = r.randn(r.int(5, 16), s["hidden"])
    block16 = block.to(torch.bfloat16)
    ref = oracles.hf_moe(block16, x32.to(torch.bfloat16)).float()   # same dtype, so the same routing decisions
    w16, x16 = oracles.moe_weights_from_hf(block16, m), x32.to(torch.bfloat16)
    weights, ids = m.route(x16, w16.router, w16.top_k, w16.norm_topk_prob)
    assert_dtype(weights, torch.bfloat16, what="bf16 输入时 route 的 weights", mistake=leak)
    assert_dtype(ids, torch.int64, what="route 的 ids")
    with explain_crash(CRASHES):
        out = m.moe_forward(x16, w16)
    assert_dtype(out, torch.bfloat16, what="bf16 输入时 moe_forward 的输出",
                 mistake="fp32 的路由权重把结果 dtype 提升了")
    assert_close(out.float(), ref, what="bf16 的 moe_forward（与 bf16 的 HF 对比）", rand=r, atol=3e-2, rtol=2e-2)
    if not w16.norm_topk_prob:                      # the talker's config: no renormalisation
        record_case("bf16:route-norm_topk_prob=False")
    record_case("bf16:moe_forward-shared")


class _MatmulLog(TorchDispatchMode):
    """Records the [rows, inner, cols] of every matrix multiply that runs inside it."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            self.shapes.extend([(a.shape[-2], a.shape[-1], b.shape[-1])] * batch)
        return func(*args, **(kwargs or {}))


@point("按 expert 分组计算：每个 expert 一次 SwiGLU，只算路由给它的 token，跳过空 expert")
def test_grouped_per_expert():
    m = impl(MODULE)
    r = Rand()
    hidden, inter, experts, k = 16, 24, 8, 2
    block = oracles.qwen3_moe_block(r, hidden=hidden, experts=experts, top_k=k, inter=inter, norm_topk_prob=True)
    w = oracles.moe_weights_from_hf(block, m)
    for n_tokens in (r.int(12, 20), 2):           # many tokens per expert; then at least 4 empty experts
        x = r.randn(n_tokens, hidden)
        _, ids = oracles.hf_route(block, x)
        busy = int((torch.bincount(ids.reshape(-1), minlength=experts) > 0).sum())
        log = _MatmulLog()
        with explain_crash(CRASHES), torch.no_grad(), log:
            m.moe_forward(x, w)
        if any(0 in shape for shape in log.shapes):
            raise AssertionError("对空 expert 做了 matmul（出现了 0 行的矩阵乘）：bincount 为 0 的 expert 应直接跳过\n"
                                 f"  看起来像易错点：对空 expert 做 matmul；{r}")
        flops = sum(2 * a * b * c for a, b, c in log.shapes)
        expected = 2 * n_tokens * hidden * experts + n_tokens * k * 3 * 2 * hidden * inter
        if flops > expected * 1.01:
            raise AssertionError(f"矩阵乘的计算量是 {flops}，按 expert 分组时应为 {expected}（约 {flops / expected:.1f} 倍）："
                                 "每个 expert 只应在路由给它的那批 token 上算，而不是在全部 N 个 token 上算再 mask；"
                                 f"{r}")
        calls, limit = len(log.shapes), 1 + 3 * busy
        if calls > limit:
            raise AssertionError(f"moe_forward 做了 {calls} 次矩阵乘，按 expert 分组最多 {limit} 次"
                                 f"（router 1 次 + {busy} 个非空 expert × 3）：像是在逐 token / 逐 slot 循环；{r}")
        record_case("grouped:empty-experts" if busy < experts else "grouped:all-experts-busy")
    record_case("grouped:one-swiglu-per-expert")


@point("卡片例子：route（E=4，router=eye，top-2）")
def test_card_route_example():
    m = impl(MODULE)
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, 3.0, -0.5]])
    weights, ids = m.route(x, torch.eye(4), 2, True)
    assert_equal(ids, torch.tensor([[0, 1], [2, 1]]), what="卡片例子的 top-2 ids")
    assert_close(weights, torch.tensor([[0.7311, 0.2689], [0.9241, 0.0759]]), what="卡片例子 norm_topk_prob=True 的权重",
                 atol=1e-4, rtol=0)
    weights, _ = m.route(x, torch.eye(4), 2, False)
    assert_close(weights, torch.tensor([[0.6439, 0.2369], [0.8605, 0.0706]]), what="卡片例子 norm_topk_prob=False 的权重",
                 atol=1e-4, rtol=0, looks_like=[(torch.tensor([[0.7311, 0.2689], [0.9241, 0.0759]]),
                                                 M_TOPK_OR_RENORM)])
    record_case("card:route")


@point("卡片例子：标量版 moe_forward 与 shared expert")
def test_card_scalar_example():
    m = impl(MODULE)
    col = lambda *v: torch.tensor(v)[:, None, None]   # noqa: E731  [E, 1, 1]
    w = m.MoEWeights(router=torch.tensor([[1.0], [0.0], [-1.0]]), w_gate=col(1.0, 2.0, 0.5), w_up=col(1.0, 1.0, 2.0),
                     w_down=col(1.0, -1.0, 3.0), top_k=2, norm_topk_prob=True)
    x = torch.tensor([[2.0], [-1.0]])
    with explain_crash(CRASHES):
        out = m.moe_forward(x, w)
    assert_close(out, torch.tensor([[2.1667], [0.7639]]), what="卡片标量例子 moe_forward", atol=1e-4, rtol=0,
                 looks_like=[(torch.tensor([[-0.9365], [0.8280]]),
                              "scatter 用了赋值 out[toks] = y 而不是 index_add_：token0 只剩 expert 1 的贡献")])
    one = torch.ones(1, 1)
    w.shared = m.SharedExpert(gate_proj=one, up_proj=one, down_proj=one, gate=torch.zeros(1, 1))
    with explain_crash(CRASHES):
        out = m.moe_forward(x, w)
    assert_close(out, torch.tensor([[3.9283], [0.8984]]), what="卡片标量例子 + shared expert", atol=1e-4, rtol=0)
    record_case("card:scalar-moe-shared")
