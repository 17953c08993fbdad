"""Checks for E04 · model runner (lessons/e04_model_runner.md).

Oracles: hand-computed batch tensors (the card's example), m04's dense varlen attention, and the same
m06 model run densely on each sequence's whole prefix (no cache, no state) — itself checked against HF.
"""

from __future__ import annotations

import copy

import torch

from checks import hf_models
from checks.kit import Rand, assert_close, assert_dtype, assert_equal, impl, point, record_case
from checks.sampling_contract import ContractSampler

MODULE = "e04_model_runner"


def _seq(e02, tokens, cached=0, scheduled=0, table=()):
    seq = e02.Sequence(list(tokens))
    seq.num_cached_tokens, seq.num_scheduled_tokens, seq.block_table = cached, scheduled, list(table)
    return seq


@point("prepare_batch：prefill 块、带前缀的块与 decode 混在一批时的张量（卡片例子）")
def test_prepare_batch_card_example():
    m, e02 = impl(MODULE), impl("e02_block_manager")
    # block size 4: A decodes its 7th token, B computes tokens 4..8 after a cached prefix, C is a fresh prompt
    a = _seq(e02, range(100, 107), cached=6, scheduled=1, table=[3, 0])
    b = _seq(e02, range(200, 209), cached=4, scheduled=5, table=[5, 1, 7])
    c_seq = _seq(e02, range(300, 303), cached=0, scheduled=3, table=[2])
    ids, pos, ctx = m.prepare_batch([a, b, c_seq], 4)
    mistakes = {"positions": "positions 从 0 开始而不是从 num_cached_tokens 开始（chunked prefill / decode 的位置错了）"}
    assert_equal(ids, torch.tensor([106, 204, 205, 206, 207, 208, 300, 301, 302]), what="input_ids")
    assert_equal(pos, torch.tensor([6, 4, 5, 6, 7, 8, 0, 1, 2]), what="positions",
                 looks_like=[(torch.tensor([0, 0, 1, 2, 3, 4, 0, 1, 2]), mistakes["positions"])])
    assert_equal(ctx.cu_seqlens_q, torch.tensor([0, 1, 6, 9], dtype=torch.int32), what="cu_seqlens_q")
    assert_equal(ctx.cu_seqlens_k, torch.tensor([0, 7, 16, 19], dtype=torch.int32), what="cu_seqlens_k",
                 looks_like=[(torch.tensor([0, 1, 6, 9], dtype=torch.int32),
                              "cu_seqlens_k 只数了新 token：key 要包括已经在 cache 里的前缀（num_cached_tokens + num_scheduled_tokens）")])
    assert_equal(ctx.slot_mapping, torch.tensor([2, 4, 5, 6, 7, 28, 8, 9, 10]), what="slot_mapping",
                 looks_like=[(torch.tensor([6, 4, 5, 6, 7, 8, 0, 1, 2]),
                              "slot_mapping 用了逻辑位置，没有经过 block table：slot = block_table[t // P] * P + t % P")])
    assert_equal(ctx.block_tables, torch.tensor([[3, 0, -1], [5, 1, 7], [2, -1, -1]], dtype=torch.int32),
                 what="block_tables（按最长的表用 -1 补齐）")
    assert_equal(ctx.context_lens, torch.tensor([7, 9, 3], dtype=torch.int32), what="context_lens")
    assert (ctx.max_seqlen_q, ctx.max_seqlen_k) == (5, 9), "max_seqlen_q / max_seqlen_k"
    record_case("batch:card-example-mixed")
    # the dtypes of the card's table (a kernel backend reads the int32 fields as int32 pointers)
    want = [(ids, torch.int64, "input_ids"), (pos, torch.int64, "positions"),
            (ctx.cu_seqlens_q, torch.int32, "cu_seqlens_q"), (ctx.cu_seqlens_k, torch.int32, "cu_seqlens_k"),
            (ctx.slot_mapping, torch.int64, "slot_mapping"), (ctx.block_tables, torch.int32, "block_tables"),
            (ctx.context_lens, torch.int32, "context_lens")]
    for tensor, dtype, name in want:
        assert_dtype(tensor, dtype, what=name,
                     mistake=f"{name} 的 dtype 与卡片的表不符（{dtype}）：int32 的字段要 .int() / dtype=torch.int32，"
                             "int64 的不要转" if tensor.dtype in (torch.int32, torch.int64) else "")
    record_case("batch:field-dtypes")
    # is_prefill: any q_b > 1 (a kernel backend takes its decode-only path when it is False)
    r = Rand()
    decodes = [_seq(e02, range(n), cached=n - 1, scheduled=1, table=list(range(10 * i, 10 * i + (n + 3) // 4)))
               for i, n in enumerate(r.int(2, 12) for _ in range(r.int(1, 4)))]
    c = r.int(1, 3) * 4                                          # a chunk after a computed prefix: c > 0

    def chunk(q):
        return _seq(e02, range(c + q), cached=c, scheduled=q, table=list(range(50, 50 + (c + q + 3) // 4)))

    by_cached = "is_prefill 按“有没有 c_b == 0 的新 prompt”判断：带前缀的 chunk（c_b > 0、q_b > 1）也是 prefill"
    q = r.int(3, 6)
    cases = [("卡片例子（B 算 5 个、C 算 3 个）", [a, b, c_seq], True, None),
             (f"{len(decodes)} 个 decode（每个 q = 1）", decodes, False, None),
             (f"{len(decodes)} 个 decode + 一个带前缀的 chunk（c = {c}，q = {q}）", decodes + [chunk(q)], True, by_cached),
             (f"{len(decodes)} 个 decode + 一个带前缀的 chunk（c = {c}，q = 2）", decodes + [chunk(2)], True, None)]
    for label, seqs, want, mistake in cases:
        got = m.prepare_batch(seqs, 4)[2].is_prefill
        if bool(got) != want:
            raise AssertionError(f"ctx.is_prefill 应为 {want}（有任何 q_b > 1 就是 True，只有全是 decode 才是 False）："
                                 f"{label}，得到 {got!r}；{r}" + (f"\n  看起来像易错点：{mistake}" if mistake else ""))
        record_case(f"is_prefill:{want}")


@point("paged attention：经 block table 读写的结果与连续 K/V 的 varlen attention 一致")
def test_paged_attention_matches_dense():
    r = Rand()
    block = r.choice([2, 4, 8])
    _paged_attention_case(r, block, torch.float32)
    _paged_attention_case(r, block, torch.bfloat16)          # the dtype the engine runs in on a GPU


def _paged_attention_case(r: Rand, block: int, dtype: torch.dtype) -> None:
    m, m04 = impl(MODULE), impl("m04_attention")
    heads, kv_heads, dim = 4, 2, 8
    num_blocks = 64
    caches = [torch.zeros(num_blocks, block, kv_heads, dim, dtype=dtype) for _ in range(2)]
    backend = m.PagedAttention(heads, dim, dim ** -0.5, kv_heads, *caches)
    free = torch.randperm(num_blocks, generator=r.gen).tolist()           # scattered physical blocks
    # a fresh prompt (c = 0); a chunk after a prefix ending exactly on a block boundary; one ending inside a
    # block; a decode (q = 1) after a prefix of >= 3 tokens
    c1, c2 = r.int(1, 9), r.int(1, 9)
    n2 = r.int(1, 6)
    n2 += (c2 + n2) % block == 0
    cached = [0, c1, c2, r.int(3, 9)]
    new = [r.int(1, 6), -(-(c1 + 1) // block) * block - c1, n2, 1]
    k_full = [r.randn(c + n, kv_heads, dim, dtype=dtype) for c, n in zip(cached, new)]
    v_full = [r.randn(c + n, kv_heads, dim, dtype=dtype) for c, n in zip(cached, new)]
    tables, slot_new = [], []
    for c, n, kf, vf in zip(cached, new, k_full, v_full):
        table = [free.pop() for _ in range((c + n + block - 1) // block)]
        tables.append(table)
        slots = [table[t // block] * block + t % block for t in range(c + n)]
        for t in range(c):                                                # the cached prefix is already there
            caches[0].view(-1, kv_heads, dim)[slots[t]] = kf[t]
            caches[1].view(-1, kv_heads, dim)[slots[t]] = vf[t]
        slot_new += slots[c:]
    width = max(map(len, tables))
    cu_q = torch.tensor([0] + new).cumsum(0).int()
    cu_k = torch.tensor([0] + [c + n for c, n in zip(cached, new)]).cumsum(0).int()
    ctx = m04.AttentionContext(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(new),
                               max_seqlen_k=max(c + n for c, n in zip(cached, new)),
                               slot_mapping=torch.tensor(slot_new),
                               block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables]).int(),
                               context_lens=torch.tensor([c + n for c, n in zip(cached, new)]).int())
    q = r.randn(sum(new), heads, dim, dtype=dtype)
    k_new = torch.cat([kf[c:] for kf, c in zip(k_full, cached)])
    v_new = torch.cat([vf[c:] for vf, c in zip(v_full, cached)])
    out = backend(q, k_new, v_new, ctx)
    # the oracle: m04's dense varlen attention in fp32 on the same (bf16-rounded) inputs
    ref = m04.varlen_attention(q.float(), torch.cat(k_full).float(), torch.cat(v_full).float(), cu_q, cu_k, dim ** -0.5)
    what = f"paged attention（{dtype}，block={block}，前缀 {cached}，新 token {new}）"
    if dtype != torch.float32:
        assert_dtype(out, dtype, what=what,
                     mistake=f"attention 升到 fp32 算完没有转回输入的 dtype：输出要和 q 一样是 {dtype}（模型的 o_proj 是 {dtype}）")
    assert_close(out, ref.to(dtype), what=what, rand=r)
    for kf, table, c, n in zip(k_full, tables, cached, new):
        stored = caches[0].view(-1, kv_heads, dim)[[table[t // block] * block + t % block for t in range(c + n)]]
        assert_close(stored, kf, what=f"写入 cache 的 K（{dtype}，store_kvcache 经 slot_mapping）", rand=r)
    label = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    record_case(f"paged:{label}")
    if label == "fp32":
        record_case("paged:fresh-prompt")
        record_case("paged:context-ends-on-block-boundary")
        record_case("paged:context-ends-inside-block")
        record_case("paged:decode")


def _tiny_model(family: str, r: Rand):
    """Our m06 model with an HF tiny config and dummy weights (the m06 checks tie it to HF)."""
    m06 = impl("m06_models")
    config = hf_models.tiny_config(family, r, vocab=64)
    return m06.init_dummy_weights(m06.build_model(config), seed=r.seed, std=0.15).eval()


def _dense_last_logits(model, tokens: list[int]) -> torch.Tensor:
    ctx = impl("m04_attention").AttentionContext.from_seqlens([len(tokens)])
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), ctx)
        return model.compute_logits(hidden[-1:])[0]


class _Capture:
    """Stands in for the sampler: records the logits it is given and answers greedily (or lets `inner` answer)."""

    def __init__(self, inner=None):
        self.calls, self.inner = [], inner

    def __call__(self, logits, params, generators):
        self.calls.append(logits.clone())
        return logits.argmax(dim=-1) if self.inner is None else self.inner(logits, params, generators)


def _drive(m, e02, model, prompts, budget: int, steps: int, block: int = 4, chunk: int | None = None,
           preempt: dict | None = None, sampler=None, params=None, packed: list | None = None):
    """Run prompts through ModelRunner by hand: chunked prefill then decode, both in mixed batches.

    budget: first come first served under a token budget; chunk: every sequence computes up to `chunk` tokens
    every step instead (so several sequences with a computed prefix run chunks side by side: q-lengths != k-lengths).
    preempt {step: index}: at that step the sequence is preempted by recompute (released, blocks freed,
    recomputed from token 0). sampler: kept as the runner's sampler (default: a greedy capture).
    packed collects, per step, the number of sequences that had a computed prefix and computed > 1 token.
    Returns the runner, the sequences and, per sequence, the list of (prefix tokens, logits) where it sampled.
    """
    runner = m.ModelRunner(model, num_blocks=64, block_size=block, max_num_seqs=8)
    capture = _Capture(sampler)
    runner.sampler = capture
    manager = e02.BlockManager(64, block, enable_prefix_caching=False)
    e02.Sequence.block_size = block
    seqs = [e02.Sequence(p, params[i] if params else None) for i, p in enumerate(prompts)]
    for s in seqs:
        s.block_size = block
        manager.allocate(s)
    seen = {s.seq_id: [] for s in seqs}
    for step in range(steps):
        if preempt and step in preempt:
            victim = seqs[preempt[step]]
            victim.status = e02.SequenceStatus.WAITING
            runner.release(victim)                       # as the engine does for a preempted hybrid sequence
            pool = runner.gdn_pool
            if pool is not None and victim.seq_id in getattr(pool, "slot_of", {}):
                raise AssertionError("被抢占的序列 release 之后还占着 GDN 槽位：ModelRunner.release 应调 gdn_pool.free，"
                                     "重新接纳时 states() 才会给它一个清零的槽位\n  看起来像易错点：抢占时没有归还 GDN 槽位"
                                     "，重算时带着旧的 conv / recurrent 状态")
            manager.deallocate(victim)
            victim.num_cached_tokens = 0
            manager.allocate(victim)
        left, batch = budget, []
        for s in seqs:
            todo = s.num_tokens - s.num_cached_tokens
            if chunk is not None:
                s.num_scheduled_tokens = min(todo, chunk)
                batch.append(s)
            elif todo and left:
                s.num_scheduled_tokens = min(todo, left)
                left -= s.num_scheduled_tokens
                batch.append(s)
        if not batch:
            break
        if packed is not None:
            packed.append(sum(s.num_cached_tokens > 0 and s.num_scheduled_tokens > 1 for s in batch))
        n_before = len(capture.calls)
        tokens = runner.run(batch)
        if len(tokens) != len(batch):
            raise AssertionError(f"ModelRunner.run 应为 batch 的每个序列返回一个 token（{len(batch)} 个），得到 {len(tokens)} 个")
        partial = [(i, t) for i, (s, t) in enumerate(zip(batch, tokens))
                   if s.num_cached_tokens + s.num_scheduled_tokens < s.num_tokens and t != -1]
        if partial:
            i, t = partial[0]
            raise AssertionError(f"batch 第 {i} 个序列本步只算到 prompt 中间（partial prefill），没有下一个 token，run 应返回 -1"
                                 f"（不是合法的 token id），得到 {t!r}")
        sampled = [s for s in batch if s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens]
        logits = capture.calls[n_before] if len(capture.calls) > n_before else torch.empty(0)
        for row, s in enumerate(sampled):
            seen[s.seq_id].append((list(s.token_ids), logits[row]))
        for s, t in zip(batch, tokens):
            s.num_cached_tokens += s.num_scheduled_tokens
            s.num_scheduled_tokens = 0
            if s.num_cached_tokens == s.num_tokens:
                s.append_token(t)
                manager.may_append(s)
    return runner, seqs, seen


def _check_against_dense(family: str) -> None:
    m, e02 = impl(MODULE), impl("e02_block_manager")
    r = Rand()
    model = _tiny_model(family, r)
    dense = copy.deepcopy(model)
    block = r.choice([2, 4, 8])
    prompts = [r.randint(1, 64, (r.int(2, 11),)).tolist() for _ in range(3)]
    runs = [("按预算分块", dict(budget=r.int(5, 9), steps=14, block=block))]
    # every run also packs >= 2 sequences that each have a computed prefix and compute > 1 token in one batch
    # (q-lengths != k-lengths for several sequences at once), and preempts one of them mid-decode
    chunk = r.int(2, 3)
    packed_prompts = [r.randint(1, 64, (r.int(2 * chunk + 1, 4 * chunk),)).tolist() for _ in range(r.int(2, 3))]
    packed: list = []
    runs.append(("每条序列每步一个 chunk（同批多条序列带前缀）",
                 dict(budget=0, steps=10, block=block, chunk=chunk, preempt={6: 0}, packed=packed)))
    total = 0
    for label, kw in runs:
        run_prompts = packed_prompts if "chunk" in kw else prompts
        _, _, seen = _drive(m, e02, copy.deepcopy(dense), run_prompts, **kw)
        for history in seen.values():
            for tokens, logits in history:
                ref = _dense_last_logits(dense, tokens)
                # hybrids: chunk-by-chunk + recurrent decode vs one chunked pass differ by fp32 rounding that the
                # random weights amplify to a few 1e-4 (seen over 25 seeds); a lost state is off by O(1)
                tol = 1e-3 if family.startswith("qwen3_5") else 1e-4
                assert_close(logits, ref, what=f"{family}（{label}，block_size={block}）：第 {len(tokens)} 个位置的 "
                             "logits（与整段重算对比）", rand=r, atol=tol, rtol=tol)
                total += 1
    assert max(packed) >= 2, f"检查本身的问题：没有排出同批 ≥ 2 条带前缀的 chunk（{packed}）"
    assert total >= 6, f"只比较了 {total} 个位置：调度没有推进"
    record_case("runner:budget-chunks-and-decodes")           # partial prefills return -1 (checked in _drive)
    record_case("runner:several-prefix-chunks-in-one-batch")
    record_case("runner:preempted-sequence-recomputed")


@point("dense 模型：chunked prefill + decode 经 ModelRunner 的 logits 与整段重算一致")
def test_runner_dense_model():
    _check_against_dense("qwen3")


@point("混合模型：Gated DeltaNet 状态池跨 chunk / decode 携带状态，logits 与整段重算一致")
def test_runner_hybrid_model():
    _check_against_dense("qwen3_5_text")


@point("GDN 状态池：入场清零、结束或抢占时归还、槽位复用不串状态")
def test_gdn_state_pool():
    m, e02 = impl(MODULE), impl("e02_block_manager")
    r = Rand()
    model = _tiny_model("qwen3_5_text", r)
    dense = copy.deepcopy(model)
    pool = m.GDNStatePool(model, max_num_seqs=2)
    layer = model.linear_layer_ids[0]
    first, second = e02.Sequence([1, 2, 3]), e02.Sequence([4, 5])
    slot_a = pool.allocate(first)
    pool.conv[layer][slot_a].fill_(7.0)
    pool.ssm[layer][slot_a].fill_(7.0)
    pool.allocate(second)
    try:
        pool.allocate(e02.Sequence([6]))
    except RuntimeError:
        pass
    else:
        raise AssertionError("状态池满了还能分配：max_num_seqs 个槽位用完时应报错")
    record_case("pool:full-raises")
    pool.free(first)
    third = e02.Sequence([8, 9])
    slot_c = pool.allocate(third)
    assert slot_c == slot_a, "归还的槽位应能被下一个序列复用"
    assert not pool.conv[layer][slot_c].any() and not pool.ssm[layer][slot_c].any(), \
        "复用的槽位没有清零：新序列会带着上一个序列的 conv / recurrent 状态开始（易错点：入场不清零）"
    record_case("pool:reused-slot-zeroed")
    # a sequence that resumes past token 0 (num_cached_tokens > 0) but has no slot: no state to continue from
    fresh_pool = m.GDNStatePool(model, max_num_seqs=2)
    resumed = e02.Sequence(r.randint(1, 64, (r.int(3, 8),)).tolist())
    resumed.num_cached_tokens = r.int(1, resumed.num_tokens - 1)
    resumed.num_scheduled_tokens = resumed.num_tokens - resumed.num_cached_tokens
    try:
        fresh_pool.states([resumed])
    except RuntimeError:
        pass
    else:
        raise AssertionError(f"states() 拿到一个没有槽位、却 num_cached_tokens = {resumed.num_cached_tokens} > 0 的序列：它的前缀"
                             "从没在这个池子里算过，没有状态可接着用，应报 RuntimeError\n  看起来像易错点：没有槽位的序列一律"
                             "分一个清零的槽位，不看 num_cached_tokens：前缀的状态悄悄从零开始")
    if resumed.seq_id in fresh_pool.slot_of:
        raise AssertionError("states() 报错之前已经给这个序列分了槽位：报错的序列不应占着槽位")
    record_case("pool:resume-without-state-raises")
    # a reused slot through the runner: the second request must not see the first one's state
    _, _, seen = _drive(m, e02, model, [r.randint(1, 64, (5,)).tolist()], budget=8, steps=3)
    runner, _, seen2 = _drive(m, e02, model, [r.randint(1, 64, (4,)).tolist()], budget=8, steps=3)
    for tokens, logits in next(iter(seen2.values())):
        assert_close(logits, _dense_last_logits(dense, tokens), what="复用槽位后的 logits", rand=r, atol=1e-4, rtol=1e-4)
    record_case("pool:runner-reuse-no-leak")


@point("只有算完全部 token 的序列才采样：partial prefill 不消耗随机数，带 seed 的结果与分块无关")
def test_partial_prefill_draws_nothing():
    m, e01, e02 = impl(MODULE), impl("e01_sampling"), impl("e02_block_manager")
    r = Rand()
    model = _tiny_model("qwen3", r)
    prompt = r.randint(1, 64, (9,)).tolist()
    results = []
    for budget in (9, 2):                       # one prefill step vs five chunks
        runner = m.ModelRunner(copy.deepcopy(model), num_blocks=32, block_size=4, max_num_seqs=2)
        manager = e02.BlockManager(32, 4, enable_prefix_caching=False)
        e02.Sequence.block_size = 4
        seq = e02.Sequence(prompt, e01.SamplingParams(temperature=1.0, seed=1234))
        manager.allocate(seq)
        out = []
        while len(out) < 4:
            seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_cached_tokens, budget)
            token = runner.run([seq])[0]
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_cached_tokens == seq.num_tokens:
                seq.append_token(token)
                manager.may_append(seq)
                out.append(token)
        results.append(out)
    assert results[0] == results[1], (f"同一个 seed、只是 prefill 分块不同，采样结果却不同：{results[0]} vs {results[1]}"
                                      "\n  看起来像易错点：partial prefill 的行也做了采样，消耗了请求自己的随机数")
    record_case("sample:partial-prefill-draws-nothing")


@point("带 seed 的请求：跨步、被抢占重算之后，每个 token 仍按 e01 的约定采样（generator 只建一次）")
def test_seeded_across_steps_and_preemption():
    m, e01, e02 = impl(MODULE), impl("e01_sampling"), impl("e02_block_manager")
    r = Rand()
    model = _tiny_model(r.choice(["qwen3", "qwen3_5_text"]), r)
    chunk = r.int(3, 4)
    n = r.int(2, 3)
    prompts = [r.randint(1, 64, (r.int(2 * chunk + 1, 3 * chunk),)).tolist() for _ in range(n)]
    seeds = r.py.sample(range(2**31), n)
    params = [e01.SamplingParams(temperature=_f32(r.py.uniform(0.9, 1.5)), top_k=r.choice([0, r.int(16, 64)]),
                                 seed=seeds[i]) for i in range(n)]
    contract = ContractSampler(e01.Sampler(), "ModelRunner 的采样（带 seed，分块 prefill、decode、抢占重算）", r)
    victim = r.int(0, n - 1)
    _drive(m, e02, model, prompts, budget=0, steps=16, block=r.choice([2, 4]), chunk=chunk, preempt={6: victim},
           sampler=contract, params=params)
    contract.verify()
    counts = [len(contract.samples.get(s, [])) for s in seeds]
    assert min(counts) >= 6, f"检查本身的问题：每条带 seed 的序列应采样 ≥ 6 次（被抢占的前后各几次），得到 {counts}"
    record_case("seed:one-generator-across-steps-and-preemption")


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _line_events(fn, *args) -> int:
    """How many Python lines run inside `fn` (and what it calls in exercise files)."""
    import sys
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_globals.get("__name__", "").startswith("impl."):
            if event == "line":
                count += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return count


@point("prepare_batch 没有逐 token 的 Python 循环：代价不随 prompt 变长而增长")
def test_prepare_batch_has_no_token_loop():
    m, e02 = impl(MODULE), impl("e02_block_manager")

    def batch(scale):
        lens = [3 * scale, 5 * scale, 1]
        seqs = []
        for i, n in enumerate(lens):
            blocks = (n + 3) // 4
            seqs.append(_seq(e02, range(n), cached=0 if i < 2 else n - 1, scheduled=n if i < 2 else 1,
                             table=list(range(10 * i, 10 * i + blocks))))
        return seqs

    short, long = _line_events(m.prepare_batch, batch(2), 4), _line_events(m.prepare_batch, batch(40), 4)
    assert long <= short + 2, (f"prompt 长 20 倍时 prepare_batch 执行的 Python 行数从 {short} 变成 {long}："
                               "看起来像易错点：逐 token 的 Python 循环（positions / slot_mapping 应该用张量运算算出来）")
    record_case("batch:no-token-loop")
