"""Checks for E07 · prefix caching for hybrid models (lessons/e07_hybrid_prefix_cache.md).

Unit checks drive chunk_end and StateCache on e02's block manager and e04's state pool (a tiny m06 hybrid);
the engine checks run e05's LLM with prefix caching on for both hybrid families on a multi-turn chat that
shares a system prompt, against caching off and HF `generate` (greedy, eager, fp32).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from checks import hf_models
from checks.kit import Rand, assert_equal, explain_crash, impl, point

MODULE = "e07_hybrid_prefix_cache"
NO_ALIGN = "预算用完时 chunk 没有退回到 block 边界：状态只在 chunk 末尾存在，落在块中间的状态存不成快照"
TAIL_CUT = ("prompt 的最后一段也退回了 block 边界：剩下不足一块的尾巴要等下一步才算，每条请求的首 token 都晚一步"
            "（end == num_tokens 时原样返回 end；下一轮要的状态由 decode 在块边界拍）")
NO_BRANCH = "没有在共享前缀的分叉点（shared_end）切开：共享 system prompt 的请求之间没有可用的快照"
EMPTY = "切出了空 chunk 或倒退（切点 <= start）：chunk 里没有 block 边界时应原样返回 end"
KV_ONLY = "有 KV 但没有快照的块也算了命中：GDN 层拿不到那个位置的状态"
STALE = ("命中没有要求前缀的 KV 块都已算好（block_manager.computed）：e02 在分配时就登记哈希，块被逐出、"
         "又被一条还没跑过的序列重新登记后，旧快照仍然命中，读到的是没算过的 KV")
DECODE_NEVER = ("decode 走到 block 边界没有拍快照：下一轮对话以这一轮的整段回答开头，只能从 prompt 里更早的快照"
                "重算整段回答")
DECODE_ALL = ("同一条序列在 prompt 之后拍的旧快照没有丢：每 P 个 token 多一份、每份几十 MiB，很快挤掉有用的快照"
              "（prompt 之后每条序列只留最新的一份：newest[seq_id]）")
OFF_BY_ONE = "快照挂错了块：边界 j·P 处的状态属于第 j-1 块（block_table[end // P - 1] 的哈希），不是第 j 块"
NO_CONV = "restore 只恢复了 recurrent state（ssm），没有恢复 conv state"
NO_SSM = "restore 只恢复了 conv state，没有恢复 recurrent state（ssm）"
NO_TOUCH = "命中后没有把快照移到 LRU 队尾（move_to_end）：最常用的 system prompt 快照会最先被逐出"
EVICT_NEWEST = "预算满时逐出了最新的快照（popitem(last=True)），而不是最久未用的（队首）"
NO_SLOT = "restore 没有先 pool.allocate(seq)：状态拷进了别人的槽位，序列自己从零状态开始"
NEW_TOKENS = 5


# ----------------------------------------------------------------------------- chunk_end
def _expected_end(start, end, num_tokens, bs, shared):
    """The rule, written as a search: the branch point inside the chunk, else the chunk's end when it reaches
    the end of the tokens, else the last boundary inside it."""
    if start < shared < end:
        return shared
    if end == num_tokens:
        return end
    return max((b for b in range(start + 1, end + 1) if b % bs == 0), default=end)


def _check_chunk_end(m, start, end, num_tokens, bs, shared, r=None):
    got = m.chunk_end(start, end, num_tokens, bs, shared)
    want = _expected_end(start, end, num_tokens, bs, shared)
    if got == want:
        return
    case = f"chunk_end(start={start}, end={end}, num_tokens={num_tokens}, block_size={bs}, shared_end={shared})"
    msg = f"{case} 应为 {want}，得到 {got}" + (f"；{r}" if r else "")
    if got <= start or got > end:
        msg += f"\n  看起来像易错点：{EMPTY}"
    elif start < shared < end and got != shared:
        msg += f"\n  看起来像易错点：{NO_BRANCH}"
    elif end < num_tokens and got == end:
        msg += f"\n  看起来像易错点：{NO_ALIGN}"
    elif end == num_tokens and got % bs == 0:
        msg += f"\n  看起来像易错点：{TAIL_CUT}"
    raise AssertionError(msg)


@point("chunk_end：预算用完退回 block 边界、在共享前缀的分叉点切开、最后一段算到 prompt 末尾、没有边界时原样返回")
def test_chunk_end():
    m = impl(MODULE)
    # the card's worked example: P = 16, a 1100-token prompt whose first 992 tokens are cached by others
    for args in ((0, 1100, 1100, 16, 992), (992, 1100, 1100, 16, 992), (1088, 1100, 1100, 16, 992),
                 (0, 700, 1100, 16, 0), (0, 10, 1100, 16, 0), (16, 20, 20, 16, 0), (0, 32, 32, 16, 0)):
        _check_chunk_end(m, *args)
    r = Rand()
    cases = 0
    while cases < 200:
        bs = r.choice([2, 4, 16])
        num_tokens = r.int(2, 6 * bs)
        start = r.int(0, num_tokens - 2)
        end = r.int(start + 2, num_tokens)
        shared = r.choice([0, r.int(0, num_tokens // bs) * bs])
        _check_chunk_end(m, start, end, num_tokens, bs, shared, r)
        cases += 1


# ----------------------------------------------------------------------------- StateCache on e02 + e04
def _parts(r: Rand, num_blocks: int, num_snapshots: int, bs: int):
    m, e02, e04, m06 = impl(MODULE), impl("e02_block_manager"), impl("e04_model_runner"), impl("m06_models")
    config = hf_models.tiny_config("qwen3_5_text", r, vocab=64, layers=1)
    model = m06.build_model(config)
    pool = e04.GDNStatePool(model, 6)
    cache = m.StateCache(model, num_snapshots)
    bm = m.HybridBlockManager(num_blocks, bs, cache)
    return m, e02, pool, cache, bm


def _seq(e02, tokens, bs):
    seq = e02.Sequence(list(tokens))
    seq.block_size = bs
    return seq


def _fill(pool, seq, r: Rand) -> None:
    """Give seq a slot holding random state (what its prefill would have left there)."""
    slot = pool.allocate(seq)
    for i in pool.conv:
        pool.conv[i][slot] = r.randn(*pool.conv[i][slot].shape)
        pool.ssm[i][slot] = r.randn(*pool.ssm[i][slot].shape)


def _step(bm, cache, pool, seq, tokens: int) -> bool:
    """One engine step computed seq's next `tokens` tokens: what SnapshotRunner does after the model ran."""
    seq.num_scheduled_tokens = tokens
    bm.mark_computed(seq)
    with explain_crash({"index out of range": OFF_BY_ONE}):
        took = cache.capture(seq, pool)
    seq.num_cached_tokens += tokens
    seq.num_scheduled_tokens = 0
    return took


@point("capture / restore：算到 block 边界才拍、挂在结束处那一块的哈希上；decode 也拍，但每条序列在 prompt 之后只留最新一份；命中截到最后一个有快照的块；恢复的 conv 与 recurrent 状态逐元素相等")
def test_capture_restore():
    r = Rand()
    bs = r.choice([2, 4])
    m, e02, pool, cache, bm = _parts(r, 32, 8, bs)
    prompt = r.randint(1, 64, (3 * bs + 1,)).tolist()
    a = _seq(e02, prompt, bs)
    bm.allocate(a)
    _fill(pool, a, r)
    src = pool.slot_of[a.seq_id]
    state = {i: (pool.conv[i][src].clone(), pool.ssm[i][src].clone()) for i in pool.conv}
    took = _step(bm, cache, pool, a, 2 * bs)                  # a chunk ending on boundary 2P
    assert took and len(cache.entries) == 1, f"chunk [0, {2 * bs}) 结束在 block 边界上，capture 应拍一份快照；{r}"
    key = bm.blocks[a.block_table[1]].hash
    if key not in cache.entries:
        wrong = bm.blocks[a.block_table[2]].hash in cache.entries
        raise AssertionError(f"快照应挂在第 1 块（边界 {2 * bs} 结束的那一块）的哈希上；{r}"
                             + (f"\n  看起来像易错点：{OFF_BY_ONE}" if wrong else ""))
    row = cache.entries[key]
    for i in pool.conv:
        assert_equal(cache.store.conv[i][row], state[i][0], what=f"第 {i} 层快照的 conv state", rand=r)
        assert_equal(cache.store.ssm[i][row], state[i][1], what=f"第 {i} 层快照的 recurrent state", rand=r)
    took = _step(bm, cache, pool, a, bs - 1)                  # a chunk that ends inside a block: nothing
    assert not took and len(cache.entries) == 1, f"chunk 结束在块中间（{3 * bs - 1}）不该拍快照；{r}"
    took = _step(bm, cache, pool, a, 2)                       # the prompt's last chunk [3P-1, 3P+1): no boundary
    assert not took and len(cache.entries) == 1, f"chunk [{3 * bs - 1}, {3 * bs + 1}) 里没有落在末尾的块边界，不该拍快照；{r}"

    def decode_to(boundary):
        """Decode steps (append the sampled token, then compute it) until `boundary` tokens are computed."""
        while a.num_cached_tokens < boundary:
            a.append_token(r.int(1, 63))
            bm.may_append(a)
            _step(bm, cache, pool, a, 1)
        return bm.blocks[a.block_table[boundary // bs - 1]].hash

    key4 = decode_to(4 * bs)                                  # the answer crosses boundary 4P
    if key4 not in cache.entries:
        raise AssertionError(f"decode 算完第 {4 * bs} 个 token（block 边界）后应拍一份快照，挂在第 3 块的哈希上；"
                             f"快照表里只有 {len(cache.entries)} 份；{r}\n  看起来像易错点：{DECODE_NEVER}")
    key5 = decode_to(5 * bs)                                  # and then 5P: the 4P one is superseded
    if key5 not in cache.entries:
        raise AssertionError(f"decode 算完第 {5 * bs} 个 token 后应拍一份快照；{r}\n  看起来像易错点：{DECODE_NEVER}")
    if key4 in cache.entries or len(cache.entries) != 2:
        raise AssertionError(f"prompt 之后每条序列只留最新的快照：走到 {5 * bs} 时 {4 * bs} 处那份应丢掉，快照表应为 "
                             f"prompt 里的 1 份 + 最新的 1 份 = 2 份，得到 {len(cache.entries)} 份"
                             f"（{4 * bs} 处的{'还在' if key4 in cache.entries else '已丢'}）；{r}"
                             + (f"\n  看起来像易错点：{DECODE_ALL}" if key4 in cache.entries else ""))
    assert key in cache.entries, f"prompt 里边界 {2 * bs} 处的快照不该因为 decode 的新快照丢掉；{r}"

    # b shares a's first 3 full blocks (KV hits), but only block 1 has a snapshot: b resumes at 2P
    b = _seq(e02, prompt[:3 * bs] + r.randint(1, 64, (bs + 1,)).tolist(), bs)
    assert bm.can_allocate(b)
    bm.allocate(b)
    if b.num_cached_tokens != 2 * bs:
        mistake = KV_ONLY if b.num_cached_tokens == 3 * bs else ""
        raise AssertionError(f"b 的前 3 块 KV 都命中，但只有第 1 块结束处有快照：num_cached_tokens 应为 {2 * bs}，"
                             f"得到 {b.num_cached_tokens}；{r}" + (f"\n  看起来像易错点：{mistake}" if mistake else ""))
    with explain_crash({"slot_of": NO_SLOT}):
        slot = cache.restore(b, pool)
    assert pool.slot_of.get(b.seq_id) == slot, f"restore 应返回 b 在池里的槽位（pool.allocate(b)）；{r}\n  看起来像易错点：{NO_SLOT}"
    for i in pool.conv:
        assert_equal(pool.conv[i][slot], state[i][0], what=f"b 恢复后第 {i} 层的 conv state",
                     rand=r, looks_like=[(torch.zeros_like(pool.conv[i][slot]), NO_CONV)])
        assert_equal(pool.ssm[i][slot], state[i][1], what=f"b 恢复后第 {i} 层的 recurrent state",
                     rand=r, looks_like=[(torch.zeros_like(pool.ssm[i][slot]), NO_SSM)])
    assert cache.stats["snapshot_hits"] == 1 and cache.stats["prefill_tokens_saved"] == 2 * bs, \
        f"一次恢复、省下 {2 * bs} 个 prefill token，stats 应记下：{cache.stats}"


@point("快照与它的 KV 块一起失效：块被逐出、又被一条还没算过它的序列重新登记后，旧快照不再命中；purge 丢掉 KV 已不在缓存里的快照")
def test_snapshot_dies_with_its_blocks():
    r = Rand()
    bs = r.choice([2, 4])
    m, e02, pool, cache, bm = _parts(r, 8, 4, bs)
    prompt = r.randint(1, 64, (2 * bs + 1,)).tolist()
    a = _seq(e02, prompt, bs)                                 # blocks a0 a1 (full) a2 (one token)
    bm.allocate(a)
    _fill(pool, a, r)
    _step(bm, cache, pool, a, 2 * bs)
    _step(bm, cache, pool, a, 1)
    bm.deallocate(a)                                          # free list ... a2 a1 a0: a1 goes before a0
    pool.free(a)
    filler = _seq(e02, [63] * (7 * bs), bs)                   # takes every free block but a0: a1 is evicted
    bm.allocate(filler)
    bm.deallocate(filler)
    g = _seq(e02, prompt[:2 * bs] + [1], bs)                  # misses at a1: takes a0 a1 a2 back as fresh blocks
    bm.allocate(g)
    assert g.num_cached_tokens == 0, f"a1 已被逐出，g 不该命中；{r}"
    h = _seq(e02, prompt[:2 * bs] + [2, 3], bs)               # KV lookup finds g's blocks: registered, not computed
    bm.allocate(h)
    if h.num_cached_tokens:
        raise AssertionError(f"h 的 KV 命中的是 g 刚登记、还没算过的块（g 还没跑过一步），a 的快照不能让它命中："
                             f"num_cached_tokens 应为 0，得到 {h.num_cached_tokens}；{r}\n  看起来像易错点：{STALE}")
    bm.deallocate(h)
    bm.deallocate(g)                                          # never computed: e02 drops their hashes
    cache.purge()
    assert not cache.entries, f"前缀的 KV 已不在缓存里，挂在它哈希上的快照再也够不着，purge 应丢掉它；{r}"
    assert len(cache.free_rows) == cache.num_snapshots, f"purge 后快照行应全部空出：{cache.free_rows}"


@point("预算与 LRU：快照数不超过 num_snapshots，满了逐出最久未用的；命中刷新 LRU 顺序")
def test_lru_budget():
    r = Rand()
    bs = r.choice([2, 4])
    m, e02, pool, cache, bm = _parts(r, 64, 2, bs)
    seqs = []
    for tok in (11, 22, 33, 44):
        s = _seq(e02, [tok] * bs + [1], bs)
        bm.allocate(s)
        _fill(pool, s, r)
        seqs.append(s)
    key = [bm.blocks[s.block_table[0]].hash for s in seqs]

    def kept():
        return [i for i in range(4) if key[i] in cache.entries]

    for i in range(3):                                        # budget 2: the third evicts the oldest (prefix 0)
        _step(bm, cache, pool, seqs[i], bs)
        seqs[i].num_cached_tokens = 0                         # (the same chunk again later: only its state matters)
    if len(cache.entries) > 2:
        raise AssertionError(f"预算 2 份快照，却存了 {len(cache.entries)} 份；{r}")
    if kept() != [1, 2]:
        mistake = EVICT_NEWEST if kept() == [0, 2] else ""
        raise AssertionError(f"依次拍前缀 0、1、2，预算 2：应逐出最久未用的前缀 0，留下 [1, 2]，得到 {kept()}；{r}"
                             + (f"\n  看起来像易错点：{mistake}" if mistake else ""))
    assert cache.lookup([seqs[1].block_table[0]]) == 1, f"前缀 1 有快照，lookup 应返回 1；{r}"
    _step(bm, cache, pool, seqs[3], bs)                       # prefix 1 was just hit: prefix 2 goes now
    if kept() != [1, 3]:
        mistake = NO_TOUCH if kept() == [2, 3] else ""
        raise AssertionError(f"lookup 刚命中前缀 1，再拍前缀 3 时应逐出前缀 2，留下 [1, 3]，得到 {kept()}；{r}"
                             + (f"\n  看起来像易错点：{mistake}" if mistake else ""))
    assert cache.stats["snapshots_evicted"] == 2, f"逐出两次，stats 应记下：{cache.stats}"


# ----------------------------------------------------------------------------- the engine, against HF
@functools.lru_cache(maxsize=None)
def _model(family: str, seed: int):
    r = Rand(seed)
    config = hf_models.tiny_config(family, r, vocab=64, layers=2)
    hf = hf_models.hf_model(family, config, r)
    folder = Path(tempfile.mkdtemp(prefix=f"course-e07-{family}-"))
    hf_models.save_hf(hf, folder)
    return folder, hf


def _greedy(n=NEW_TOKENS):
    return impl("e01_sampling").SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _chat(llm, r: Rand, convs: int, turns: int, bs: int, system: int = 0, message: int = 0, new: int = NEW_TOKENS):
    """A multi-turn chat: every conversation starts with one system prompt; turn t+1 = turn t + answer + a message.
    Returns per turn (prompts, outputs, stats after the turn)."""
    system = r.randint(1, 64, (system or r.int(2 * bs + 1, 4 * bs),)).tolist()
    msg = lambda: r.randint(1, 64, (r.int(1, message or 2 * bs),)).tolist()   # noqa: E731
    history = [system + msg() for _ in range(convs)]
    log = []
    for _ in range(turns):
        outs = llm.generate(history, _greedy(new))
        log.append((history, [o.token_ids for o in outs], dict(llm.stats)))
        history = [h + o.token_ids + msg() for h, o in zip(history, outs)]
    return log


def _hf_generate(hf, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _replay(llm, log, new: int = NEW_TOKENS):
    """The same prompts, turn by turn, through another engine."""
    return [[o.token_ids for o in llm.generate(prompts, _greedy(new))] for prompts, _, _ in log]


def _multiturn(family: str):
    e05 = impl("e05_engine")
    r = Rand()
    folder, hf = _model(family, r.seed)
    bs = r.choice([2, 4])
    kw = dict(block_size=bs, max_num_seqs=3, max_num_batched_tokens=r.int(12, 24))
    with explain_crash({"no snapshot was taken": KV_ONLY}):
        llm = e05.LLM(str(folder), enable_prefix_caching=True, **kw)
        log = _chat(llm, r, convs=3, turns=3, bs=bs)
    off = _replay(e05.LLM(str(folder), enable_prefix_caching=False, **kw), log)
    for t, ((prompts, outs, stats), base) in enumerate(zip(log, off)):
        for i, (p, got, want) in enumerate(zip(prompts, outs, base)):
            if got != want:
                raise AssertionError(f"{family}：第 {t + 1} 轮第 {i} 条（prompt 长 {len(p)}，block_size {bs}）"
                                     f"打开缓存得到 {got}，关闭缓存得到 {want}；{r}")
    for i, (p, got) in enumerate(zip(log[-1][0], log[-1][1])):     # the last turn, the most restored: against HF
        ref = _hf_generate(hf, p)
        assert got == ref, f"{family}：第 {len(log)} 轮第 {i} 条与 HF generate 不同：得到 {got}，期望 {ref}；{r}"
    for t in range(1, len(log)):
        prev, (_, _, before), (_, _, after) = log[t - 1][0], log[t - 1], log[t]
        hits = after["snapshot_hits"] - before["snapshot_hits"]
        saved = after["prefill_tokens_saved"] - before["prefill_tokens_saved"]
        # each turn fed its prompt and all but the last answer token; the newest boundary in there has a snapshot
        floor = sum((len(p) + NEW_TOKENS - 1) // bs * bs for p in prev)
        assert hits >= len(prev), (f"{family}：第 {t + 1} 轮 {len(prev)} 条请求都接着上一轮，只有 {hits} 条从快照恢复"
                                   f"（stats={after}）；{r}")
        if saved < floor:
            prompt_only = sum(len(p) // bs * bs for p in prev)
            raise AssertionError(
                f"{family}：第 {t + 1} 轮省下 {saved} 个 prefill token；上一轮每条都算过 prompt + 回答的前 "
                f"{NEW_TOKENS - 1} 个 token，其中最后一个 block 边界之前共 {floor} 个，应从那里的快照恢复"
                f"（stats={after}）；{r}" + (f"\n  看起来像易错点：{DECODE_NEVER}" if saved <= prompt_only else ""))


@point("多轮对话（qwen3_5_text）：打开缓存后每个输出与关闭缓存、与 HF generate 逐 token 一致；第 2 轮起每条请求都从上一轮回答里最后一个块边界的快照恢复")
def test_multiturn_qwen3_5():
    _multiturn("qwen3_5_text")


@point("多轮对话（qwen3_5_moe_text）：同上，MoE 混合模型")
def test_multiturn_qwen3_5_moe():
    _multiturn("qwen3_5_moe_text")


@point("同一步到达、共享 system prompt 的请求：system prompt 只算一遍——第 1 条在分叉点停下拍快照，其余等一步后都从那里恢复；输出与关闭缓存一致")
def test_shared_prompt_computed_once():
    e05 = impl("e05_engine")
    m = impl(MODULE)
    r = Rand()
    folder, _ = _model("qwen3_5_text", r.seed)
    bs = r.choice([2, 4])
    system = r.randint(1, 64, (r.int(3 * bs, 5 * bs),)).tolist()
    firsts = r.py.sample(range(1, 64), 3)                  # distinct first message tokens: the prompts part at len(system)
    prompts = [system + [f] + r.randint(1, 64, (r.int(0, 2 * bs),)).tolist() for f in firsts]
    shared = len(system) // bs * bs                       # the branch point: the last boundary inside the system prompt
    kw = dict(block_size=bs, max_num_seqs=4, max_num_batched_tokens=256)
    llm = e05.LLM(str(folder), enable_prefix_caching=True, **kw)
    outs = [o.token_ids for o in llm.generate(prompts, _greedy())]
    off = [o.token_ids for o in e05.LLM(str(folder), enable_prefix_caching=False, **kw).generate(prompts, _greedy())]
    assert outs == off, f"共享 system prompt 的 3 条请求，打开缓存得到 {outs}，关闭缓存得到 {off}；{r}"
    stats = llm.stats
    if stats["snapshot_hits"] < 2 or stats["prefill_tokens_saved"] < 2 * shared:
        msg = (f"3 条请求同一步到达、共享 {len(system)} 个 token 的 system prompt（block_size {bs}）：第 1 条应在分叉点 "
               f"{shared} 停下拍快照，第 2、3 条等这一步算完后从那里恢复，共省 {2 * shared} 个 prefill token；实际 "
               f"{stats['snapshot_hits']} 次恢复、省 {stats['prefill_tokens_saved']}（stats={stats}）；{r}")
        n = len(prompts[0])
        if m.chunk_end(0, n, n, bs, shared) != shared:
            msg += f"\n  看起来像易错点：{NO_BRANCH}（chunk_end(0, {n}, {n}, {bs}, {shared}) = {m.chunk_end(0, n, n, bs, shared)}）"
        raise AssertionError(msg)


@point("预算很小（num_state_snapshots=2）：按 LRU 逐出，快照数不超过预算，输出与关闭缓存一致")
def test_small_budget():
    e05 = impl("e05_engine")
    r = Rand()
    folder, _ = _model("qwen3_5_text", r.seed)
    bs = r.choice([2, 4])
    kw = dict(block_size=bs, max_num_seqs=3, max_num_batched_tokens=r.int(12, 24))
    llm = e05.LLM(str(folder), enable_prefix_caching=True, num_state_snapshots=2, **kw)
    log = _chat(llm, r, convs=3, turns=2, bs=bs)
    off = _replay(e05.LLM(str(folder), enable_prefix_caching=False, **kw), log)
    assert [outs for _, outs, _ in log] == off, f"2 份快照的预算下，打开缓存的输出与关闭缓存不同；{r}"
    stats = llm.stats
    assert stats["state_snapshots"] <= 2, f"预算 2 份，却存着 {stats['state_snapshots']} 份（stats={stats}）；{r}"
    assert stats["snapshots_evicted"] > 0, f"6 条请求、2 份预算却从没逐出过（stats={stats}）；{r}"


@point("抢占与 abort：KV 池很小时发生抢占、输出与关闭缓存一致；abort 一条算到一半的请求后 block、GDN 槽位全部归还，它已算好的快照仍可命中")
def test_preemption_and_abort():
    e05 = impl("e05_engine")
    r = Rand()
    folder, _ = _model("qwen3_5_text", r.seed)
    bs = 4        # prompts of 4-5 blocks growing by 2: two fit in 10 blocks, and then one must yield
    kw = dict(block_size=bs, max_num_seqs=3, max_num_batched_tokens=16, num_kvcache_blocks=10)
    llm = e05.LLM(str(folder), enable_prefix_caching=True, **kw)
    log = _chat(llm, r, convs=3, turns=2, bs=bs, system=3 * bs + 1, message=bs, new=8)
    off = _replay(e05.LLM(str(folder), enable_prefix_caching=False, **kw), log, new=8)
    assert [outs for _, outs, _ in log] == off, f"KV 池 {kw['num_kvcache_blocks']} 块、发生抢占时打开缓存的输出与关闭缓存不同；{r}"
    stats = llm.stats
    assert stats["preemptions"] > 0, f"KV 池只有 {kw['num_kvcache_blocks']} 块却没有发生抢占（stats={stats}）"
    pool = llm.runner.gdn_pool
    assert stats["free_blocks"] == stats["total_blocks"], f"结束后 block 没有全部归还（stats={stats}）"
    assert len(pool.free_slots) == kw["max_num_seqs"] and not pool.slot_of, f"结束后 GDN 槽位没有全部归还：{pool.slot_of}"

    # abort a request in the middle of its prefill: nothing of it stays but the snapshots of what it computed
    big = e05.LLM(str(folder), enable_prefix_caching=True, block_size=bs, max_num_seqs=2, max_num_batched_tokens=8)
    prompt = r.randint(1, 64, (5 * bs + 2,)).tolist()
    rid = big.add_request(prompt, _greedy())
    big.step()
    big.step()                                                # two chunks of 8: 16 tokens, two snapshots
    big.abort(rid)
    stats, pool = big.stats, big.runner.gdn_pool
    assert stats["free_blocks"] == stats["total_blocks"], f"abort 后 block 没有全部归还（stats={stats}）"
    assert not pool.slot_of and not big.block_manager.shared_tokens, "abort 后 GDN 槽位或 shared_tokens 还留着"
    assert big.scheduler.is_finished(), "abort 后请求还在 waiting / running 里"
    again = big.generate([prompt], _greedy())[0].token_ids
    want = e05.LLM(str(folder), enable_prefix_caching=False, block_size=bs).generate([prompt], _greedy())[0].token_ids
    assert again == want, f"abort 之后同一条 prompt 从快照恢复，输出 {again}，关闭缓存为 {want}；{r}"
    assert big.stats["snapshot_hits"] >= 1, f"abort 前已算好 16 个 token、拍了快照，再来同一条 prompt 应命中（stats={big.stats}）"
