"""Checks for K03 · Fused MoE (lessons/k03_fused_moe.md).

Oracles: m03's moe_forward (the per-expert torch loop) and HF transformers 5.17.0's sparse MoE blocks.
Every check runs the kernels on checks.kit.DEVICE: without CUDA in Triton's interpreter (checks/conftest.py sets
TRITON_INTERPRET=1; fp32, tiny shapes), with CUDA natively; inputs are drawn on the CPU (Rand) and moved to
DEVICE. With CUDA the real-shape bf16 check runs too (without CUDA it is reported as skipped).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

from checks import oracles
from checks.kit import (DEVICE, Rand, assert_close, assert_dtype, assert_equal, close, explain_crash, impl, point,
                        record_case)

MODULE = "k03_fused_moe"
CRASHES = {
    "'NoneType' object has no attribute": "忘了 w.shared is None（thinker / Qwen3-MoE 没有 shared expert）时跳过",
    "Host synchronization": "decode 路径里有 host 同步（.item() / .tolist() / 依赖数据的形状），进不了 CUDA graph",
}
# set by the first check when a kernel writes a pad row outside its output: every later check would write
# outside a buffer the kernel did not get a margin for, and a corrupted heap aborts the whole grading run
_PAD_WRITES: list[str] = []


def _guard() -> None:
    if _PAD_WRITES:
        raise AssertionError("没有运行：前面的检查发现 kernel 把 pad 条目写到了输出之外（越界写会破坏内存）。\n"
                             f"  看起来像易错点：{_PAD_WRITES[0]}")


def _flat_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """torch version of the alignment: pairs stably sorted by expert, each run padded to block_m with M."""
    flat = topk_ids.reshape(-1).cpu()
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        pairs = (flat == e).nonzero().flatten().tolist()
        pad = -len(pairs) % block_m
        sorted_ids += pairs + [num_pairs] * pad
        expert_ids += [e] * ((len(pairs) + pad) // block_m)
    return torch.tensor(sorted_ids, dtype=torch.int64), torch.tensor(expert_ids, dtype=torch.int64), counts


def _pair_outputs(x, w_gate, w_up, w_down, topk_ids) -> torch.Tensor:
    """Expert_{ids[n, j]}(x[n]) for every pair, [N, k, H], in fp32 (dense einsum oracle)."""
    x, w_gate, w_up, w_down = x.float(), w_gate.float(), w_up.float(), w_down.float()
    g = torch.einsum("nh,nkih->nki", x, w_gate[topk_ids])
    u = torch.einsum("nh,nkih->nki", x, w_up[topk_ids])
    return torch.einsum("nki,nkhi->nkh", F.silu(g) * u, w_down[topk_ids]), g, u


def _looks_like(x, w_gate, w_up, w_down, weights, ids) -> list:
    """The classic wrong answers of fused_experts, from the per-pair expert outputs."""
    per_pair, g, u = _pair_outputs(x, w_gate, w_up, w_down, ids)
    wt = weights.float()[..., None]
    n_tok, k = ids.shape
    swapped = torch.einsum("nki,nkhi->nkh", F.silu(u) * g, w_down.float()[ids])
    by_slot_first = (per_pair * wt).reshape(-1, x.shape[1]).view(k, n_tok, -1).sum(0)
    return [
        ((per_pair * wt * wt).sum(1), "路由权重乘了两次（down 的 epilogue 里乘过，对 k 个 slot 求和时又乘了一次）"),
        (per_pair.sum(1), "忘了乘路由权重"),
        ((per_pair * wt)[:, 0], "没有对 k 个 slot 求和（只留下了第一个 slot）"),
        (by_slot_first, "pair 与 (token, slot) 的对应错了：pair p 是 token p // k 的第 p % k 个 slot（row-major），求和应是 view(N, k, H).sum(1)"),
        ((swapped * wt).sum(1), "SiLU 用在了 up 上：应为 silu(x Wg^T) * (x Wu^T)"),
    ]


def _moe_weights(block, m):
    """m03's MoEWeights (m: the m03 module) from an HF block (gate/up as strided views of gate_up_proj), on DEVICE."""
    w = oracles.moe_weights_from_hf(block, m) if hasattr(block.gate, "norm_topk_prob") else _qwen3_5_weights(block, m)
    for name in ("router", "w_gate", "w_up", "w_down"):
        setattr(w, name, getattr(w, name).to(DEVICE))
    if w.shared is not None:
        for name in ("gate_proj", "up_proj", "down_proj", "gate"):
            setattr(w.shared, name, getattr(w.shared, name).to(DEVICE))
    return w


def _qwen3_5_weights(block, m):
    """Qwen3.5-MoE's router always renormalises and has no norm_topk_prob attribute."""
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    inter, s = down.shape[-1], block.shared_expert
    shared = m.SharedExpert(gate_proj=s.gate_proj.weight.detach(), up_proj=s.up_proj.weight.detach(),
                            down_proj=s.down_proj.weight.detach(), gate=block.shared_expert_gate.weight.detach())
    return m.MoEWeights(router=block.gate.weight.detach(), w_gate=gate_up[:, :inter], w_up=gate_up[:, inter:],
                        w_down=down, top_k=block.gate.top_k, norm_topk_prob=True, shared=shared)


def _shape(r: Rand) -> dict:
    hidden = r.choice([8, 12, 16, 24])
    return dict(hidden=hidden, experts=r.int(4, 10), top_k=r.int(2, 3), inter=hidden * 2 + r.choice([-4, 4]))


def _check_block(block, r: Rand, what: str) -> None:
    m = impl(MODULE)
    _guard()
    x = r.randn(r.int(5, 24), block.gate.weight.shape[1])
    ref = oracles.hf_moe(block, x)
    w = _moe_weights(block, impl("m03_sparse_moe"))
    with explain_crash(CRASHES):
        out = m.fused_moe_forward(x.to(DEVICE), w)
    weights, ids = oracles.hf_route(block, x)
    looks = _looks_like(x, w.w_gate.cpu(), w.w_up.cpu(), w.w_down.cpu(), weights, ids)
    if w.shared is not None:
        s = w.shared
        mlp = F.linear(F.silu(F.linear(x, s.gate_proj.cpu())) * F.linear(x, s.up_proj.cpu()), s.down_proj.cpu())
        shared = torch.sigmoid(x @ s.gate.cpu().T) * mlp
        routed = ref - shared
        looks = [(wrong + shared, msg) for wrong, msg in looks]
        looks += [(routed + (x @ s.gate.cpu().T) * mlp, "shared expert 的门控没有过 sigmoid：应为 sigmoid(x @ gate.T)"),
                  (routed + mlp, "shared expert 没有乘门控 sigmoid(x @ gate.T)"),
                  (routed, "漏掉了 shared expert：out += sigmoid(x @ gate.T) · SharedExpert(x)")]
    assert_close(out.cpu(), ref, what=f"{what} 输出", rand=r, looks_like=looks)
    record_case(f"block:{what}")


@point("pad 条目被 mask：kernel 只写真实 pair 的行")
def test_pad_rows_never_written():
    m = impl(MODULE)
    r = Rand()
    hidden, inter, experts, k = 16, 24, r.int(5, 8), 2
    n_tok = r.int(3, 9)
    ids = torch.stack([torch.randperm(experts, generator=r.gen)[:k] for _ in range(n_tok)])
    num_pairs, block_m = n_tok * k, 16
    with explain_crash(CRASHES):
        sorted_ids, expert_ids, num_post = m.moe_align_block_size(ids.to(DEVICE), experts, block_m)
    canary = 12345.0
    # every buffer gets 2 canary rows before and block_m after it, so a pad write lands in them
    x_buf = torch.full((n_tok + 2 + block_m, hidden), float("nan"), device=DEVICE)
    x = x_buf[2:2 + n_tok]
    x.copy_(r.randn(n_tok, hidden))
    h_buf = torch.full((num_pairs + 2 + block_m, inter), canary, device=DEVICE)
    y_buf = torch.full((num_pairs + 2 + block_m, hidden), canary, device=DEVICE)
    wts_buf = torch.full((num_pairs + block_m,), float("nan"), device=DEVICE)
    wts = wts_buf[:num_pairs]
    wts.copy_(torch.rand(num_pairs, generator=r.gen))
    w_gate, w_up = r.randn(experts, inter, hidden, scale=0.3).to(DEVICE), r.randn(experts, inter, hidden, scale=0.3).to(DEVICE)
    w_down = r.randn(experts, hidden, inter, scale=0.3).to(DEVICE)
    with explain_crash(CRASHES):
        m.gate_up_silu(x, w_gate, w_up, sorted_ids, expert_ids, num_post, k, block_m, h_buf[2:2 + num_pairs])
        m.down_weighted(h_buf[2:2 + num_pairs], w_down, wts, sorted_ids, expert_ids, num_post, block_m,
                        y_buf[2:2 + num_pairs])
    for buf, name in ((h_buf, "gate_up_silu 的输出 h"), (y_buf, "down_weighted 的输出 y")):
        outside = torch.cat([buf[:2], buf[2 + num_pairs:]])
        if not bool((outside == canary).all()):
            _PAD_WRITES.append("pad 条目没有 mask：store 时要用 pairs < N·k 屏蔽 pad 行（pad 的 id 是 N·k，"
                               "按它写就越界）")
            raise AssertionError(f"{name} 的缓冲区之外被写了（[M, ·] 之前或之后的 canary 行被改动）；{r}\n"
                                 f"  看起来像易错点：{_PAD_WRITES[0]}")
    per_pair, _, _ = _pair_outputs(x.cpu(), w_gate.cpu(), w_up.cpu(), w_down.cpu(), ids)
    assert_close(y_buf[2:2 + num_pairs].cpu(), (per_pair * wts.cpu().view(n_tok, k, 1)).reshape(num_pairs, hidden),
                 what="down_weighted 的逐 pair 输出 y[p] = w[p] · Expert(x[p // k])", rand=r, atol=1e-4, rtol=1e-4,
                 looks_like=[((per_pair).reshape(num_pairs, hidden), "忘了乘路由权重")])
    record_case("launch:pad-rows-masked,block_m=16")


@point("卡片例子：moe_align_block_size（N=3，k=2，E=5，BLOCK_M=4）")
def test_card_align_example():
    m = impl(MODULE)
    ids = torch.tensor([[2, 0], [1, 2], [2, 3]], device=DEVICE)
    with explain_crash(CRASHES):
        sorted_ids, expert_ids, num_post = m.moe_align_block_size(ids, 5, 4)
    expected = torch.tensor([1, 6, 6, 6, 2, 6, 6, 6, 0, 3, 4, 6, 5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6])
    zeros_pad = torch.tensor([1, 0, 0, 0, 2, 0, 0, 0, 0, 3, 4, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    unpadded = torch.tensor([1, 2, 0, 3, 4, 5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6])
    assert_equal(num_post.reshape(-1).cpu().long(), torch.tensor([16]), what="卡片例子的 num_tokens_post_padded")
    assert_equal(sorted_ids.cpu().long(), expected, what="卡片例子的 sorted_ids",
                 looks_like=[(zeros_pad, "pad 条目用 0 填充：pad 的 id 应为 N·k（= 6），0 是真实的 pair 0"),
                             (unpadded, "每个 expert 的段没有 pad 到 BLOCK_M 的倍数")])
    assert_equal(expert_ids.cpu().long(), torch.tensor([0, 1, 2, 3, -1, -1]), what="卡片例子的 expert_ids（每个 block 一个）",
                 looks_like=[(torch.tensor([0, 1, 2, 2, 3, -1]), "block 的 expert 按未 pad 的 counts 前缀和算了")])
    record_case("card:align")


@point("moe_align_block_size：按 expert 稳定排序、每段 pad 到 BLOCK_M、每个 block 的 expert 正确")
def test_align_random():
    m = impl(MODULE)
    r = Rand()
    # a BLOCK_M other than the decode default 16 (smaller or a prefill size), then E > N*k with 16
    for label, (experts, n_tok, k, block_m) in (("block_m!=16", (r.int(4, 12), r.int(1, 40), r.int(1, 4),
                                                                 r.choice([4, 8, 64]))),
                                                ("E>N*k,block_m=16", (r.int(30, 64), r.int(1, 3), 2, 16))):
        k = min(k, experts)
        ids = torch.stack([torch.randperm(experts, generator=r.gen)[:k] for _ in range(n_tok)])
        with explain_crash(CRASHES):
            sorted_ids, expert_ids, num_post = m.moe_align_block_size(ids.to(DEVICE), experts, block_m)
        ref_sorted, ref_experts, _ = _flat_reference(ids, experts, block_m)
        num_pairs, used = n_tok * k, len(ref_sorted)
        bound = num_pairs + min(experts, num_pairs) * (block_m - 1)          # the most any routing can need
        allowed = -(-(num_pairs + experts * (block_m - 1)) // block_m) * block_m   # the card's interface limit
        where = f"（E={experts}，N={n_tok}，k={k}，BLOCK_M={block_m}）"
        assert_equal(num_post.reshape(-1).cpu().long(), torch.tensor([used]), what=f"num_tokens_post_padded{where}", rand=r)
        if sorted_ids.numel() < bound // block_m * block_m or sorted_ids.numel() > allowed:
            raise AssertionError(f"sorted_ids 的长度应在 M + min(E, M)·(BLOCK_M−1) = {bound}（任何路由最多需要这么多）"
                                 f"与 M + E·(BLOCK_M−1) 向上取整到 BLOCK_M = {allowed} 之间，得到 {sorted_ids.numel()}{where}；{r}")
        if expert_ids.numel() * block_m < sorted_ids.numel():
            raise AssertionError(f"expert_ids 应覆盖 sorted_ids 的每个 block（{sorted_ids.numel()} / {block_m} 个），"
                                 f"得到 {expert_ids.numel()} 个{where}；{r}")
        assert_equal(sorted_ids[:used].cpu().long(), ref_sorted, what=f"sorted_ids 的前 num_tokens_post_padded 项{where}", rand=r,
                     looks_like=[(torch.where(ref_sorted == num_pairs, 0, ref_sorted), "pad 条目用 0 填充：pad 的 id 应为 N·k")])
        tail = sorted_ids[used:].cpu()
        if not bool((tail == num_pairs).all()):
            raise AssertionError(f"sorted_ids 在 num_tokens_post_padded 之后也应全是 pad id N·k = {num_pairs}{where}；{r}")
        assert_equal(expert_ids[:used // block_m].cpu().long(), ref_experts, what=f"expert_ids（block 的 expert）{where}", rand=r)
        record_case(f"align:{label}")


@point("输出大小只由形状决定（无 host 同步，可进 CUDA graph）")
def test_static_shapes_no_sync():
    m = impl(MODULE)
    r = Rand()
    experts, n_tok, k = 8, r.int(3, 12), 2
    skewed = torch.tensor([[0, 1]] * n_tok)                       # two experts take every pair
    spread = torch.stack([torch.randperm(experts, generator=r.gen)[:k] for _ in range(n_tok)])
    with explain_crash(CRASHES):
        a = m.moe_align_block_size(skewed.to(DEVICE), experts, 16)
        b = m.moe_align_block_size(spread.to(DEVICE), experts, 16)
    for ta, tb, name in zip(a, b, ("sorted_ids", "expert_ids", "num_tokens_post_padded")):
        if ta.shape != tb.shape:
            raise AssertionError(f"{name} 的形状随路由结果变化（{list(ta.shape)} vs {list(tb.shape)}）：大小必须只由 N、k、E、"
                                 f"BLOCK_M 决定（固定上界），否则要 host 同步、进不了 CUDA graph；{r}\n"
                                 "  看起来像易错点：按实际 num_tokens_post_padded 截断（.item() / .tolist()），decode 路径有 host 同步")
        assert_dtype(ta, torch.int32, what=f"{name} 的 dtype")
    record_case("align:static-shape,int32")
    if DEVICE.type == "cuda":                                     # the real thing: no sync anywhere in fused_experts
        w_gate = torch.randn(experts, 32, 16, device="cuda")
        x, weights = torch.randn(n_tok, 16, device="cuda"), torch.rand(n_tok, k, device="cuda")
        ids = spread.cuda()                          # a blocking H2D copy syncs: do it before the watched region
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with explain_crash({"synchroniz": "decode 路径里有 host 同步（.item() / .tolist() / 依赖数据的形状）"}):
                m.fused_experts(x, w_gate, w_gate, w_gate.transpose(1, 2), weights, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@point("fused_experts 与 m03 一致：空 expert、只有一个 token 的 expert、N=1、N 不是 BLOCK_M 的倍数")
def test_fused_experts_edge_cases():
    m = impl(MODULE)
    m03 = impl("m03_sparse_moe")
    _guard()
    r = Rand()
    hidden, inter, experts, k = r.choice([8, 16]), 24, 6, 2
    w_gate, w_up = r.randn(experts, inter, hidden, scale=0.3), r.randn(experts, inter, hidden, scale=0.3)
    w_down = r.randn(experts, hidden, inter, scale=0.3)
    n_big = r.choice([17, 19, 23, 37])                            # not a multiple of any BLOCK_M
    # expert 0: no token; expert 1: exactly one (token 0); experts 2..5 share the rest
    ids_big = torch.tensor([[1, 2]] + [[2 + i % 3, 5] for i in range(n_big - 1)])
    cases = [("N=1", torch.tensor([[r.int(0, 2), r.int(3, 5)]])),
             (f"N={n_big}：expert 0 没有 token，expert 1 只有一个", ids_big)]
    for what, ids in cases:
        x = r.randn(ids.shape[0], hidden)
        weights = torch.softmax(r.randn(*ids.shape), -1)
        ref = torch.zeros_like(x)
        for j in range(k):                                        # m03's swiglu, pair by pair
            for n in range(ids.shape[0]):
                e = int(ids[n, j])
                ref[n] += weights[n, j] * m03.swiglu(x[n:n + 1], w_gate[e], w_up[e], w_down[e])[0]
        with explain_crash(CRASHES):
            out = m.fused_experts(x.to(DEVICE), w_gate.to(DEVICE), w_up.to(DEVICE), w_down.to(DEVICE),
                                  weights.to(DEVICE), ids.to(DEVICE))
        assert_close(out.cpu(), ref, what=f"fused_experts（{what}）", rand=r, atol=1e-5, rtol=1e-4,
                     looks_like=_looks_like(x, w_gate, w_up, w_down, weights, ids))
        record_case("fused:N=1" if ids.shape[0] == 1 else "fused:empty-expert,one-token-expert,N-not-multiple")


M_K_TAIL = ("K 维的尾部没有 mask 对：H 或 I 大于 BLOCK_K 且不是它的整数倍时，最后一次循环只剩 K − k0 列"
            "（mask 是 offs_k < K − k0，或者每次循环都用 k0 + offs_k < K），多读的列属于下一行")
M_PAST_POST = ("pid_m·BLOCK_M ≥ num_tokens_post_padded 的 block 没有直接 return：那之后的 sorted_ids / expert_ids "
               "不保证是 pad（接口只约定前 num_post 项），读了就会按错的 expert 重算、覆盖真实 pair 的行")


@point("H、I 大于 BLOCK_K 且不是它的整数倍（K 尾部 mask）时 fused_experts 与 m03 一致")
def test_k_tail():
    m = impl(MODULE)
    _guard()
    r = Rand()
    experts, k = r.int(4, 6), 2
    # <= 12 pairs per expert: BLOCK_M 16, BLOCK_K 128; > 24: BLOCK_M 64, BLOCK_K 64 (the prefill tiles)
    cases = [("decode,H-tail,I-tail", r.int(3, 7), 128 + r.choice([8, 24, 40]), 128 + r.choice([16, 56])),
             ("decode,H-whole,I-whole", r.int(3, 7), 256, 128),
             ("prefill,H-tail,I-tail", 13 * experts + r.int(0, 5), 128 + r.choice([8, 24, 40]), 64 + r.choice([16, 56]))]
    for label, n_tok, hidden, inter in cases:
        _k_tail_case(m, r, experts, k, n_tok, hidden, inter, label)
        record_case(f"fused:{label}")


def _k_tail_case(m, r: Rand, experts: int, k: int, n_tok: int, hidden: int, inter: int, label: str) -> None:
    w_gate, w_up = r.randn(experts, inter, hidden, scale=0.1), r.randn(experts, inter, hidden, scale=0.1)
    w_down = r.randn(experts, hidden, inter, scale=0.1)
    x = r.randn(n_tok, hidden)
    ids = torch.stack([torch.randperm(experts, generator=r.gen)[:k] for _ in range(n_tok)])
    weights = torch.softmax(r.randn(n_tok, k), -1)
    ref = (_pair_outputs(x, w_gate, w_up, w_down, ids)[0] * weights[..., None]).sum(1)
    with explain_crash(CRASHES):
        out = m.fused_experts(*(t.to(DEVICE) for t in (x, w_gate, w_up, w_down, weights, ids))).cpu()
    if close(out, ref, 1e-4, 1e-4):
        return
    if "whole" in label:                        # no tail here: the whole-tile path (no K mask) itself is wrong
        assert_close(out, ref, what=f"fused_experts（H={hidden}，I={inter}，都是 BLOCK_K = 128 的整数倍：不需要 K mask 的路径）",
                     rand=r, atol=1e-4, rtol=1e-4, looks_like=_looks_like(x, w_gate, w_up, w_down, weights, ids))
    # the same problem zero-padded to H = I = 256 (a whole number of tiles) has the same answer
    pad = lambda t, *size: F.pad(t, [0, size[-1] - t.shape[-1], 0, size[-2] - t.shape[-2]] if len(size) > 1  # noqa: E731
                                 else [0, size[-1] - t.shape[-1]])
    with explain_crash(CRASHES):
        padded = m.fused_experts(*(t.to(DEVICE) for t in (pad(x, 256), pad(w_gate, 256, 256), pad(w_up, 256, 256),
                                                           pad(w_down, 256, 256), weights, ids))).cpu()[:, :hidden]
    block_k = 128 if label.startswith("decode") else 64
    with _hint_if(close(padded, ref, 1e-4, 1e-4), M_K_TAIL):                 # whole tiles right, the tail wrong
        assert_close(out, ref, what=f"fused_experts（{label.split(',')[0]}，N={n_tok}，H={hidden}，I={inter}，"
                     f"BLOCK_K={block_k}：最后一次 K 循环只剩一部分列）",
                     rand=r, atol=1e-4, rtol=1e-4, looks_like=_looks_like(x, w_gate, w_up, w_down, weights, ids))


@contextlib.contextmanager
def _hint_if(evidence: bool, mistake: str):
    """A failure inside names `mistake` when `evidence` singles it out (and no other hint was given)."""
    try:
        yield
    except AssertionError as exc:
        if evidence and "易错点" not in str(exc):
            raise AssertionError(f"{exc}\n  看起来像易错点：{mistake}") from None
        raise


@point("num_tokens_post_padded 之后的 block 直接返回（不读那里的 sorted_ids / expert_ids）")
def test_blocks_past_num_post():
    m = impl(MODULE)
    _guard()
    r = Rand()
    hidden, inter, experts, k, block_m = 16, 24, r.int(4, 6), 2, 16
    n_tok = r.int(3, 9)
    ids = torch.stack([torch.randperm(experts, generator=r.gen)[:k] for _ in range(n_tok)])
    num_pairs = n_tok * k
    ref_sorted, ref_experts, _ = _flat_reference(ids, experts, block_m)
    used = len(ref_sorted)
    size = -(-(num_pairs + experts * (block_m - 1)) // block_m) * block_m     # the longest the card allows
    x = r.randn(n_tok, hidden)
    # one spare expert in front of the weights: a block whose expert id is -1 reads it instead of foreign memory
    w_gate = r.randn(experts + 1, inter, hidden, scale=0.3)
    w_up = r.randn(experts + 1, inter, hidden, scale=0.3)
    w_down = r.randn(experts + 1, hidden, inter, scale=0.3)
    wts = torch.rand(num_pairs, generator=r.gen)
    per_pair = _pair_outputs(x, w_gate[1:], w_up[1:], w_down[1:], ids)[0]
    want = (per_pair * wts.view(n_tok, k, 1)).reshape(num_pairs, hidden)
    tails = {"pad": (torch.full((size - used,), num_pairs), torch.full((size // block_m - len(ref_experts),), -1)),
             "garbage": (torch.randint(0, num_pairs, (size - used,), generator=r.gen),
                         torch.randint(0, experts, (size // block_m - len(ref_experts),), generator=r.gen))}
    got = {}
    for name, (sorted_tail, expert_tail) in tails.items():
        sorted_ids = torch.cat([ref_sorted, sorted_tail]).int().to(DEVICE)
        expert_ids = torch.cat([ref_experts, expert_tail]).int().to(DEVICE)
        num_post = torch.tensor([used], dtype=torch.int32, device=DEVICE)
        h = torch.zeros(num_pairs, inter, device=DEVICE)
        y = torch.zeros(num_pairs, hidden, device=DEVICE)
        with explain_crash(CRASHES):
            m.gate_up_silu(x.to(DEVICE), w_gate.to(DEVICE)[1:], w_up.to(DEVICE)[1:], sorted_ids, expert_ids, num_post,
                           k, block_m, h)
            m.down_weighted(h, w_down.to(DEVICE)[1:], wts.to(DEVICE), sorted_ids, expert_ids, num_post, block_m, y)
        got[name] = y.cpu()
    with _hint_if(close(got["pad"], want, 1e-4, 1e-4), M_PAST_POST):        # right when the tail is pad, wrong here
        assert_close(got["garbage"], want, what=f"gate_up_silu + down_weighted（sorted_ids 长 {size}，num_post = {used}，"
                     "之后是任意的 pair id 与 expert id）", rand=r, atol=1e-4, rtol=1e-4)
    record_case("launch:past-num-post")


@point("gate/up 是 gate_up_proj [E, 2I, H] 的两半（strided view）时也正确")
def test_strided_gate_up_views():
    m = impl(MODULE)
    _guard()
    r = Rand()
    hidden, inter, experts, k, n_tok = 16, r.choice([12, 20]), r.int(4, 8), 2, r.int(4, 20)
    gate_up = r.randn(experts, 2 * inter, hidden, scale=0.3).to(DEVICE)
    w_down = r.randn(experts, hidden, inter, scale=0.3).to(DEVICE)
    x = r.randn(n_tok, hidden).to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=r.gen)[:k] for _ in range(n_tok)]).to(DEVICE)
    weights = torch.softmax(r.randn(n_tok, k), -1).to(DEVICE)
    with explain_crash(CRASHES):
        views = m.fused_experts(x, gate_up[:, :inter], gate_up[:, inter:], w_down, weights, ids)
        copies = m.fused_experts(x, gate_up[:, :inter].contiguous(), gate_up[:, inter:].contiguous(),
                                 w_down.contiguous(), weights, ids)
    ref = (_pair_outputs(x.cpu(), gate_up[:, :inter].cpu(), gate_up[:, inter:].cpu(), w_down.cpu(), ids.cpu())[0]
           * weights.cpu()[..., None]).sum(1)
    assert_close(copies.cpu(), ref, what="fused_experts（连续的权重）", rand=r, atol=1e-5, rtol=1e-4)
    try:
        assert_close(views.cpu(), ref, what="fused_experts（w_gate / w_up 是 gate_up_proj 的 strided view）", rand=r,
                     atol=1e-5, rtol=1e-4)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n  看起来像易错点：把 w_gate / w_up 当成了连续张量（按形状推 stride）；它们是 "
                             "gate_up_proj 的两半，expert 之间相隔 2·I·H，stride 要用 .stride() 传进 kernel") from None
    record_case("fused:strided-gate-up")


@point("Qwen3-MoE block 与 HF 一致")
def test_qwen3_moe_block():
    r = Rand()
    for norm in (True, False):                                     # both every run: a hard-coded flag fails
        block = oracles.qwen3_moe_block(r, norm_topk_prob=norm, **_shape(r))
        _check_block(block, r, f"Qwen3MoeSparseMoeBlock（norm_topk_prob={norm}）")


@point("thinker MoE 与 HF 一致")
def test_thinker_block():
    r = Rand()
    _check_block(oracles.thinker_moe_block(r, **_shape(r)), r, "Qwen3OmniMoeThinkerTextSparseMoeBlock")


@point("talker MoE（含 sigmoid 门控的 shared expert）与 HF 一致")
def test_talker_block():
    r = Rand()
    s = _shape(r)
    _check_block(oracles.talker_moe_block(r, shared_inter=s["inter"] + 8, **s), r, "Qwen3OmniMoeTalkerTextSparseMoeBlock")


@point("Qwen3.5-MoE block（含 shared expert）与 HF 一致")
def test_qwen3_5_moe_block():
    r = Rand()
    s = _shape(r)
    cfg = Qwen3_5MoeTextConfig(hidden_size=s["hidden"], num_experts=s["experts"], num_experts_per_tok=s["top_k"],
                               moe_intermediate_size=s["inter"], shared_expert_intermediate_size=s["inter"] + 4,
                               experts_implementation="eager")
    block = r.init_(Qwen3_5MoeSparseMoeBlock(cfg).eval())
    _check_block(block, r, "Qwen3_5MoeSparseMoeBlock")


@point("卡片例子：标量版 fused_moe_forward（m03 的例子）")
def test_card_scalar_example():
    m = impl(MODULE)
    m03 = impl("m03_sparse_moe")
    _guard()
    col = lambda *v: torch.tensor(v, device=DEVICE)[:, None, None]   # noqa: E731  [E, 1, 1]
    w = m03.MoEWeights(router=torch.tensor([[1.0], [0.0], [-1.0]], device=DEVICE), w_gate=col(1.0, 2.0, 0.5),
                       w_up=col(1.0, 1.0, 2.0), w_down=col(1.0, -1.0, 3.0), top_k=2, norm_topk_prob=True)
    x = torch.tensor([[2.0], [-1.0]], device=DEVICE)
    with explain_crash(CRASHES):
        out = m.fused_moe_forward(x, w)
    assert_close(out.cpu(), torch.tensor([[2.1667], [0.7639]]), what="卡片标量例子 fused_moe_forward", atol=1e-4, rtol=0,
                 looks_like=[(torch.tensor([[2.6217], [0.5881]]), "路由权重乘了两次（down 的 epilogue 里乘过，求和时又乘了一次）"),
                             (torch.tensor([[3.1032], [0.8280]]), "没有对 k 个 slot 求和（只留下了第一个 slot）")])
    one = torch.ones(1, 1, device=DEVICE)
    w.shared = m03.SharedExpert(gate_proj=one, up_proj=one, down_proj=one, gate=torch.zeros(1, 1, device=DEVICE))
    with explain_crash(CRASHES):
        out = m.fused_moe_forward(x, w)
    assert_close(out.cpu(), torch.tensor([[3.9283], [0.8984]]), what="卡片标量例子 + shared expert（门控 sigmoid(0) = 0.5）",
                 atol=1e-4, rtol=0, looks_like=[(torch.tensor([[2.1667], [0.7639]]), "shared expert 的门控没有过 sigmoid：sigmoid(0) = 0.5，不是 0")])
    record_case("card:scalar")


@point("CUDA：真实形状 bf16（E=128/256，k=8，H=2048，I=768/512，含 shared expert）")
def test_real_shapes_cuda():
    m = impl(MODULE)
    m03 = impl("m03_sparse_moe")
    with explain_crash(CRASHES):                                  # an untouched stub is 未实现 here too
        m.moe_align_block_size(torch.tensor([[0, 1]], device=DEVICE), 2, 16)
    if DEVICE.type != "cuda":
        pytest.skip("需要 GPU：没有 CUDA，真实形状的 bf16 检查没有运行")
    r = Rand()
    gen = torch.Generator(device="cuda").manual_seed(r.seed)
    for experts, inter, shared in ((128, 768, False), (256, 512, True)):
        hidden, k = 2048, 8
        rnd = lambda *s, std=0.02: (torch.randn(*s, device="cuda", generator=gen) * std).bfloat16()  # noqa: E731
        gate_up = rnd(experts, 2 * inter, hidden)
        w = m03.MoEWeights(router=rnd(experts, hidden), w_gate=gate_up[:, :inter], w_up=gate_up[:, inter:],
                           w_down=rnd(experts, hidden, inter), top_k=k, norm_topk_prob=True,
                           shared=m03.SharedExpert(rnd(512, hidden), rnd(512, hidden), rnd(hidden, 512), rnd(1, hidden))
                           if shared else None)
        w32 = m03.MoEWeights(router=w.router.float(), w_gate=w.w_gate.float(), w_up=w.w_up.float(),
                             w_down=w.w_down.float(), top_k=k, norm_topk_prob=True,
                             shared=m03.SharedExpert(*(t.float() for t in (w.shared.gate_proj, w.shared.up_proj,
                                                                           w.shared.down_proj, w.shared.gate)))
                             if shared else None)
        for n_tok in (1, 7, 64, 256, 1000):
            x = torch.randn(n_tok, hidden, device="cuda", generator=gen).bfloat16()
            with explain_crash(CRASHES):
                out = m.fused_moe_forward(x, w)
            assert_dtype(out, torch.bfloat16, what="bf16 输入时 fused_moe_forward 的输出")
            weights, ids = m03.route(x, w.router, k, True)
            exact = m03.moe_forward(x.float(), w32)              # fp32 math on the same bf16 weights and routing
            loop16 = m03.moe_forward(x, w).float()
            err, base = (out.float() - exact).abs().max().item(), (loop16 - exact).abs().max().item()
            scale = exact.abs().max().item()
            if not err <= 2 * base + 1e-3 * scale:
                raise AssertionError(f"E={experts}，I={inter}，N={n_tok}：bf16 的最大误差 {err:.3g}，m03 的 bf16 torch 循环是 "
                                     f"{base:.3g}（输出量级 {scale:.3g}）：fused kernel 应和 torch 一样准（fp32 累加）；{r}")
