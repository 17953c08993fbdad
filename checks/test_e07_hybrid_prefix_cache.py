"""Checks for E07 · prefix caching for hybrid models (lessons/e07_hybrid_prefix_cache.md).

Unit checks drive chunk_end and StateCache on e02's block manager and e04's state pool (a tiny m06 hybrid);
the engine checks run e05's LLM with prefix caching on for both hybrid families on a multi-turn chat that
shares a system prompt, against caching off and HF `generate` (greedy, eager, fp32).

Every adversarial case is built into the draw, whatever the seed: several snapshots compete in every lookup
(the longest usable one must win), block ids never equal their positions, an uncomputed block sits inside the
hit run before a computed one with a snapshot, the store is full when a row is taken (with dead entries behind
a live LRU front), a prompt ends exactly on a block boundary, and a preempted sequence is recomputed in
multi-token chunks that start inside its prompt and end past it.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from pathlib import Path

import torch

from checks import hf_models
from checks.kit import Rand, assert_equal, explain_crash, impl, point, record_case

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
OFF_BY_ONE = "快照挂错了块（挂到了下一块的哈希上）：边界 j·P 处的状态读完的是第 0..j-1 块，键是第 j-1 块的哈希，不是第 j 块的"
NO_CONV = "restore 只恢复了 recurrent state（ssm），没有恢复 conv state"
NO_SSM = "restore 只恢复了 conv state，没有恢复 recurrent state（ssm）"
NO_TOUCH = "命中后这份快照没有成为最近用过的（LRU 顺序没刷新）：LRU 退化成先进先出，最常用的 system prompt 快照会最先被逐出"
TOUCH_ALL = ("lookup 把命中串里别的快照也刷新了：只有它返回的那份（可用命中末尾的快照）算用过；命中串里更短的快照这次"
             "没被用到，LRU 顺序不该变，否则用不上的旧前缀一直排在队尾，真正常用的反而先被逐出")
EVICT_NEWEST = "预算满时逐出了最新的快照，而不是最久未用的那份：刚拍的、最可能马上用到的快照先没了"
NO_SLOT = "restore 没有先 pool.allocate(seq)：状态拷进了别人的槽位，序列自己从零状态开始"
NO_PURGE = ("快照库满时没有先 purge 就逐出了 LRU 队首：KV 已不在缓存里的快照再也够不着，却留着它们、扔掉了一份还能命中的"
            "（要一行时：先用空行，再用够不着的快照的行，最后才逐出最久未用的）")
PURGE_EARLY = ("还有空行时也先 purge 了（或先用够不着的快照的行）：G5 的取行顺序是先用空行，没有空行才丢掉再也命中不到的快照；"
               "_take_row 只在 free_rows 为空时才 purge")
ROW_LEAK = ("被替换（或被 purge）的快照，行没有还回 free_rows：这一行既不在 entries 里也不在 free_rows 里，再也用不上，"
            "预算一次少一份")
RECAPTURE = ("重拍一个已有快照的哈希时没有复用它那一行、移到 LRU 队尾：同一前缀的状态相同，新的一份应占原来那一行、"
             "成为最近用过的；另取一行会白白逐出别人的快照，留在原位则刚用过的它排在队首先被逐出")
TAKE_FIRST = ("先拿新行、再丢这条序列自己的旧快照：库满时 _take_row 逐出了别人的快照，随后自己的旧快照又丢掉，白白少一份"
              "（它自己的旧快照反正要丢，那一行正好给新快照用，不必逐出任何别人的）")
PROMPT_END = ("恰好落在 block 边界上的 prompt 末尾也算成了 prompt 之后：这份快照读完的只是 prompt，可被以同一段 prompt "
              "开头的请求共用，不该被 decode 的新快照替换；只有读过回答（prompt 之后的 token）的快照才按“每条序列一份”记账")
PAST_PROMPT = ("用“生成过 token”或“这一步只算 1 个 token”判断 prompt 之后：被抢占后重算的序列，prompt 里的 chunk 和回答里的 "
               "chunk 都是多 token 的，序列也早就生成过 token；要看的是这份快照读到了哪里：读过 prompt 之后的 token 才算")
BY_POSITION = ("lookup 把命中串的下标当成了 block id：查的是第 i 号 block 算好没有，而不是 hits[i] 那一块；命中串里放的是 "
               "block id，不是块在序列里的位置")
LAST_ONLY = "lookup 只检查了快照所在那一块算好没有：hits[:n] 的每一块都要算好，中间有一块没算好，后面的快照就都不能用"
SHORTEST = "lookup 返回了最短的命中：几份快照竞争时要取最长的可用前缀，否则每一轮都从更早的快照开始、把后面重算一遍"
CONSUMES = "restore 把快照从表里拿走了：同一份快照要能被好几条请求恢复，restore 只拷贝，不动 entries"
RESTORE_TOUCH = ("restore 改动了 LRU 顺序：这次命中在接纳时（lookup）已经算作一次使用、刷新过了；restore 只拷贝，"
                 "entries 的内容和顺序都不动")
NO_COUNT = "capture 拍了快照却没有给 num_captured 加 1（stats 的 snapshots_captured）"
NO_SNAPSHOT_AT_RESTORE = ("恢复时表里没有这条序列命中位置上的快照：接纳时 lookup 说那里有快照，restore 时却找不到。lookup "
                          "给出的命中要以有快照的块结尾，快照也要留到 restore 之后（restore 只拷贝）；前面 capture / "
                          "restore 与 lookup 的检查直接驱动这些函数，信息更具体")
REGISTER_UNCOMPUTED = ("一块刚算好、它的哈希却登记在另一份还没算好的拷贝上时，没有把登记改到算好的这份（mark_computed）："
                       "几条请求同一步各自登记同一段前缀，最后登记的那份可能算得最少，下一步的请求就命中不到")
REALLOC_COMPUTED = ("分给新主人的块没有清掉 computed（_allocate_block）：块换了主人，里面还是上一位主人的 KV；仍算“算好”，"
                    "命中它的请求就读到旧的或别人的 KV")
REALLOC_WANTED = ("分给新主人的块没有移出 wanted（_allocate_block）：等它的是上一位主人的前缀，新主人的 prefill 会被切在一个"
                  "没人等的地方")
FIRST_WINS = ("_cache_block 让最先登记的拷贝一直生效：只有已登记的那份算好了，新拷贝才只带上哈希；它没算好时照 e02，新登记的"
              "拷贝生效。否则最先登记的请求被抢占（一步没算就 deallocate）时，它的登记跟着它没了，算好这段内容的另一份却没有登记")
SHADOWED = ("没算好的拷贝顶掉了已算好的登记（_cache_block）：新登记的这份还没写 KV，后来的请求命中串到它就断了；"
            "已算好的那份保持登记，新块只带上哈希")
RESTORE_ZERO = "restore 找不到快照时悄悄从零状态（或随便一行）接着算：命中和快照不一致是 bug，要抛 RuntimeError"
OLD_GONE = ("丢旧快照前没有确认它还在表里：newest 记着的上一份快照可能已被 LRU 逐出或被 purge 收走，"
            "它已经不在表里，就没有什么要丢的（也不会抛 KeyError）")
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


def _chunk_end_error(got, start, end, num_tokens, bs, shared, r=None) -> str | None:
    """None when chunk_end returned the right cut, else the failure message (naming the mistake it singles out)."""
    want = _expected_end(start, end, num_tokens, bs, shared)
    if got == want and type(got) is int:
        return None
    case = f"chunk_end(start={start}, end={end}, num_tokens={num_tokens}, block_size={bs}, shared_end={shared})"
    msg = f"{case} 应为 {want}，得到 {got!r}" + (f"；{r}" if r else "")
    if isinstance(got, bool) or not isinstance(got, int):
        return msg + "（应返回 int）"
    if got <= start:
        msg += f"\n  看起来像易错点：{EMPTY}"
    elif got > end:
        msg += f"\n  切点超出了这一块的末尾 end：chunk 只能在 (start, end] 里缩短，不能变长（预算和 token 都只给到 end）"
    elif start < shared < end and got != shared:
        msg += f"\n  看起来像易错点：{NO_BRANCH}"
    elif end < num_tokens and got == end:
        msg += f"\n  看起来像易错点：{NO_ALIGN}"
    elif end == num_tokens and got % bs == 0:
        msg += f"\n  看起来像易错点：{TAIL_CUT}"
    return msg


def _check_chunk_end(m, start, end, num_tokens, bs, shared, r=None):
    msg = _chunk_end_error(m.chunk_end(start, end, num_tokens, bs, shared), start, end, num_tokens, bs, shared, r)
    if msg:
        raise AssertionError(msg)


@contextlib.contextmanager
def _engine_watch(r: Rand):
    """Around an engine run with prefix caching on: every cut HybridScheduler asks chunk_end for is checked as it
    is made (a wrong one fails here, with its arguments, instead of crashing inside the model or stalling the
    engine), and a restore that finds no snapshot at the hit says so plainly."""
    m = impl(MODULE)
    real = m.chunk_end

    def checked(start, end, num_tokens, block_size, shared_end=0):
        got = real(start, end, num_tokens, block_size, shared_end)
        msg = _chunk_end_error(got, start, end, num_tokens, block_size, shared_end, r)
        if msg:
            raise AssertionError(f"引擎里 HybridScheduler 切 prefill chunk 时：{msg}")
        return got

    m.chunk_end = checked                       # HybridScheduler.schedule looks chunk_end up in the module
    try:
        yield
    except RuntimeError as exc:
        if "no snapshot was taken" not in str(exc):
            raise
        raise AssertionError(f"运行出错：{type(exc).__name__}: {exc}\n  {NO_SNAPSHOT_AT_RESTORE}；{r}") from exc
    finally:
        m.chunk_end = real


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
    record_case("chunk_end:branch-point")
    record_case("chunk_end:prompt-end")
    record_case("chunk_end:budget-cut")
    record_case("chunk_end:no-boundary")


# ----------------------------------------------------------------------------- StateCache on e02 + e04
def _parts(r: Rand, num_blocks: int, num_snapshots: int, bs: int, slots: int = 6):
    m, e02, e04, m06 = impl(MODULE), impl("e02_block_manager"), impl("e04_model_runner"), impl("m06_models")
    config = hf_models.tiny_config("qwen3_5_text", r, vocab=64, layers=1)
    model = m06.build_model(config)
    pool = e04.GDNStatePool(model, slots)
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


def _new_state(pool, seq, r: Rand) -> list[torch.Tensor]:
    """What this step's model left in seq's slot: fresh random state (every snapshot differs); returns a copy."""
    slot = pool.slot_of[seq.seq_id]
    for i in pool.conv:
        pool.conv[i][slot] = r.randn(*pool.conv[i][slot].shape)
        pool.ssm[i][slot] = r.randn(*pool.ssm[i][slot].shape)
    return [t.clone() for t in impl(MODULE).state_views(pool, slot)]


def _decode(bm, cache, pool, seq, r: Rand, boundary: int) -> list[torch.Tensor]:
    """Decode steps (append the sampled token, then compute it) until `boundary` tokens are computed; the state
    left at the boundary."""
    state = None
    while seq.num_cached_tokens < boundary:
        seq.append_token(r.int(1, 62))
        bm.may_append(seq)
        state = _new_state(pool, seq, r)
        _step(bm, cache, pool, seq, 1)
    return state


def _key(bm, seq, blocks: int) -> int:
    """The key of the snapshot at boundary blocks * P: the chained hash of the block that ends there."""
    return bm.blocks[seq.block_table[blocks - 1]].hash


def _check_rows(cache, when: str, r: Rand) -> None:
    """Every row of the store is either an entry's or free, and only once."""
    rows = list(cache.entries.values()) + list(cache.free_rows)
    lost = sorted(set(range(cache.num_snapshots)) - set(rows))
    twice = sorted({x for x in rows if rows.count(x) > 1})
    if not lost and not twice:
        return
    msg = (f"{when}：快照库的 {cache.num_snapshots} 行，每一行要么是 entries 里某份快照的行、要么在 free_rows 里，"
           f"只出现一次；得到 entries 的行 {sorted(cache.entries.values())}、free_rows {sorted(cache.free_rows)}")
    if twice:
        msg += f"，行 {twice} 出现了不止一次"
    if lost:
        msg += f"，行 {lost} 哪里都不在；{r}\n  看起来像易错点：{ROW_LEAK}"
    else:
        msg += f"；{r}"
    raise AssertionError(msg)


def _check_taken(bm, cache, seq, blocks: int, what: str, r: Rand, decode: bool = False) -> None:
    """seq's chunk that ended on boundary blocks * P left a snapshot keyed by the hash of block blocks - 1."""
    if _key(bm, seq, blocks) in cache.entries:
        return
    bs = bm.block_size
    off = len(seq.block_table) > blocks and _key(bm, seq, blocks + 1) in cache.entries
    mistake = OFF_BY_ONE if off else DECODE_NEVER if decode else ""
    raise AssertionError(f"{what}算到 {blocks * bs}（block 边界），应以第 {blocks - 1} 块（block_table[{blocks - 1}]）的哈希为键"
                         f"拍一份快照，表里没有；{r}" + (f"\n  看起来像易错点：{mistake}" if mistake else ""))


def _check_restored(pool, slot: int, want: list[torch.Tensor], what: str, r: Rand) -> None:
    """The state in pool row `slot` equals `want` (state_views order: every conv state, then every recurrent one)."""
    got = impl(MODULE).state_views(pool, slot)
    half = len(got) // 2
    for i, (g, w) in enumerate(zip(got, want)):
        kind, mistake = ("conv state", NO_CONV) if i < half else ("recurrent state", NO_SSM)
        assert_equal(g, w, what=f"{what}的 {kind}（state_views 第 {i} 个）", rand=r,
                     looks_like=[(torch.zeros_like(w), mistake)])


def _check_captured(cache, captures: int, r: Rand) -> None:
    got = cache.stats["snapshots_captured"]
    if got != captures:
        raise AssertionError(f"capture 拍了 {captures} 份快照（表里就有），stats['snapshots_captured'] 应为 {captures}，"
                             f"得到 {got}；{r}" + (f"\n  看起来像易错点：{NO_COUNT}" if got == 0 else ""))


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
    record_case("capture:chunk-on-boundary")
    record_case("capture:chunk-mid-block")
    record_case("capture:decode-boundary")
    record_case("capture:newest-replaced")
    record_case("restore:conv-and-ssm")
    record_case("lookup:kv-hit-without-snapshot")


def _check_touched(cache, before: list[int], keys: dict[int, int], hit: int, where: str, r: Rand) -> None:
    """After a lookup that returned `hit` blocks: only that snapshot moved (to the LRU back); every other one
    kept its place (keys: boundary in blocks -> hash)."""
    want = [h for h in before if h != keys[hit]] + [keys[hit]]
    got = list(cache.entries)
    if got == want:
        return
    name = {h: b for b, h in keys.items()}

    def show(order):
        return [name.get(h, "?") for h in order]

    mistake = NO_TOUCH if got == before else TOUCH_ALL if got[-1] == keys[hit] else ""
    raise AssertionError(f"{where}：lookup 返回 {hit}，只有 hits[:{hit}] 的那份快照算用过、移到 LRU 队尾，别的快照保持原来的"
                         f"先后。entries 从 LRU 队首到队尾（以快照结束处的块数标）：lookup 前 {show(before)}，应为 {show(want)}，"
                         f"得到 {show(got)}；{r}" + (f"\n  看起来像易错点：{mistake}" if mistake else ""))


@point("capture / restore：算到 block 边界才拍、挂在结束处那一块的哈希上；decode 也拍，但每条序列在 prompt 之后只留最新一份；命中截到最后一个有快照的块；恢复的 conv 与 recurrent 状态逐元素相等")
def test_lookup_longest_computed_hit():
    r = Rand()
    bs = r.choice([2, 4])
    # a's prompt: n full blocks + 1 token, snapshots at the ends of s1 < s2 < s3 < s4 blocks (s4 < n)
    s1 = r.int(1, 2)
    s2 = s1 + r.int(1, 2)
    s3 = s2 + r.int(3, 4)
    s4 = s3 + r.int(1, 2)
    n = s4 + r.int(1, 2)
    u1 = r.int(s2 + 1, s3 - 2)                 # later: an uncomputed block between s2 and s3 ...
    u2 = s4 - 1                                 # ... and the last block of the s4 prefix
    c = r.int(s2, s3 - 1)                       # the filler's computed blocks (what computed[position] reads)
    filler_blocks = n + r.int(0, 3)
    m, e02, pool, cache, bm = _parts(r, 64, 8, bs)
    # another request mid-prefill holds blocks 0 .. filler_blocks-1 (its first c computed): a's block ids are
    # never their positions
    filler = _seq(e02, [63] * (filler_blocks * bs), bs)
    bm.allocate(filler)
    filler.num_scheduled_tokens = c * bs
    bm.mark_computed(filler)
    filler.num_scheduled_tokens = 0
    prompt = r.randint(1, 63, (n * bs + 1,)).tolist()
    a = _seq(e02, prompt, bs)
    bm.allocate(a)
    assert all(b >= n for b in a.block_table), f"（检查的前提）a 的 block id 应都不等于位置：{a.block_table}"
    pool.allocate(a)
    states = {}
    for lo, hi in ((0, s1), (s1, s2), (s2, s3), (s3, s4)):   # chunks ending on the four boundaries
        states[hi] = _new_state(pool, a, r)
        _step(bm, cache, pool, a, (hi - lo) * bs)
    _new_state(pool, a, r)
    _step(bm, cache, pool, a, (n - s4) * bs + 1)           # the rest of the prompt: no boundary at its end
    for s in (s1, s2, s3, s4):
        _check_taken(bm, cache, a, s, "a 的 prefill 一段", r)
    keys = {s: _key(bm, a, s) for s in (s1, s2, s3, s4)}
    hits = list(a.block_table[:n])
    where = (f"命中串 hits = {hits}（a 的前 {n} 块，block_size {bs}），hits[:{s1}]、hits[:{s2}]、hits[:{s3}]、"
             f"hits[:{s4}] 的末块都有快照")

    order = list(cache.entries)
    got = cache.lookup(hits)                                # every block computed: the longest wins
    if got != s4:
        mistake = {s1: SHORTEST, n: KV_ONLY, s2: BY_POSITION}.get(got)
        extra = (f"（block 0..{filler_blocks - 1} 属于另一条正在 prefill 的请求，其中前 {c} 块算好了："
                 f"按位置查 computed 得到的正是 {s2}）" if got == s2 else "")
        raise AssertionError(f"{where}，hits 的块都已算好：lookup 应返回最长的 {s4}，得到 {got}{extra}；{r}"
                             + (f"\n  看起来像易错点：{mistake}" if mistake else ""))
    _check_touched(cache, order, keys, s4, where, r)

    # the copies of hits[u1] and hits[u2] that a lookup finds were handed to new owners (same content) that
    # have not run yet: only hits[:u1] holds computed KV
    bm.computed[hits[u1]] = bm.computed[hits[u2]] = False
    order = list(cache.entries)
    got = cache.lookup(hits)
    if got != s2:
        mistake = {s1: SHORTEST, s4: STALE, s3: LAST_ONLY, u1: KV_ONLY}.get(got)
        raise AssertionError(f"{where}，但 hits[{u1}] 和 hits[{u2}] 还没算好（computed 为 False）：lookup 应返回 {s2}"
                             f"（前 {u1} 块都算好，其中最长的有快照的前缀），得到 {got}；{r}"
                             + (f"\n  看起来像易错点：{mistake}" if mistake else ""))
    _check_touched(cache, order, keys, s2, f"{where}，hits[{u1}] 和 hits[{u2}] 没算好", r)

    # two requests resume from that one snapshot: restore copies it, the entry stays
    row = cache.entries[keys[s2]]
    for name in ("b", "c"):
        other = _seq(e02, prompt[:n * bs] + r.randint(1, 63, (bs + 1,)).tolist(), bs)
        bm.allocate(other)
        assert other.num_cached_tokens == s2 * bs, \
            f"{name} 与 a 共享前 {n} 块，可用命中是 {s2} 块：num_cached_tokens 应为 {s2 * bs}，得到 {other.num_cached_tokens}；{r}"
        cache.lookup(hits[:s1])                             # another request admitted in the same step hit s1
        before = list(cache.entries.items())
        with explain_crash({"slot_of": NO_SLOT}):
            slot = cache.restore(other, pool)
        if cache.entries.get(keys[s2]) != row:
            gone = keys[s2] not in cache.entries
            raise AssertionError(f"{name} 从 hits[:{s2}] 的快照恢复之后，这份快照应还在表里、还在第 {row} 行，"
                                 f"得到{'它不在表里' if gone else f'它在第 {cache.entries[keys[s2]]} 行'}；{r}"
                                 + (f"\n  看起来像易错点：{CONSUMES}" if gone else ""))
        if list(cache.entries.items()) != before:
            where_of = {h: s * bs for s, h in keys.items()}
            was, got = ([where_of.get(h, "?") for h, _ in items] for items in (before, cache.entries.items()))
            raise AssertionError(f"{name} 恢复前 entries 按 LRU 从旧到新是边界 {was} 的快照，restore 之后变成 {got}；{r}"
                                 f"\n  看起来像易错点：{RESTORE_TOUCH}")
        _check_restored(pool, slot, states[s2], f"{name} 恢复后（应是 a 算到 {s2 * bs} 时的状态）", r)
    assert cache.stats["snapshot_hits"] == 2 and cache.stats["prefill_tokens_saved"] == 2 * s2 * bs, \
        f"两次恢复、各省 {s2 * bs} 个 prefill token，stats 应记下：{cache.stats}；{r}"
    _check_captured(cache, 4, r)
    _check_rows(cache, "4 份快照、两次恢复之后", r)
    record_case("lookup:longest-of-several")
    record_case("lookup:uncomputed-inside-run")
    record_case("lookup:block-ids-not-positions")
    record_case("lru:only-the-hit-touched")
    record_case("restore:entries-unchanged")
    record_case("restore:one-snapshot-twice")


@point("capture / restore：算到 block 边界才拍、挂在结束处那一块的哈希上；decode 也拍，但每条序列在 prompt 之后只留最新一份；命中截到最后一个有快照的块；恢复的 conv 与 recurrent 状态逐元素相等")
def test_prompt_end_on_boundary_is_kept():
    r = Rand()
    bs = r.choice([2, 4])
    n = r.int(2, 4)                                         # a prompt of exactly n blocks
    k = r.int(1, n - 1)
    m, e02, pool, cache, bm = _parts(r, 32, 8, bs)
    prompt = r.randint(1, 63, (n * bs,)).tolist()
    a = _seq(e02, prompt, bs)
    bm.allocate(a)
    pool.allocate(a)
    _new_state(pool, a, r)
    _step(bm, cache, pool, a, k * bs)                       # a chunk ending on boundary kP
    end_state = _new_state(pool, a, r)
    _step(bm, cache, pool, a, (n - k) * bs)                 # the prompt's last chunk ends on boundary nP
    _check_taken(bm, cache, a, k, "a 的 prefill 第一段", r)
    _check_taken(bm, cache, a, n, f"a 的 prompt 长 {n * bs}，最后一段恰好", r)
    key_k, key_n = _key(bm, a, k), _key(bm, a, n)
    _decode(bm, cache, pool, a, r, (n + 1) * bs)
    _check_taken(bm, cache, a, n + 1, "a 的 decode ", r, decode=True)
    key_n1 = _key(bm, a, n + 1)
    if key_n not in cache.entries:
        raise AssertionError(f"prompt 恰好结束在 block 边界 {n * bs} 上，那里的快照是 prompt 里的（可被共享同一 prompt 的"
                             f"请求用），decode 在 {(n + 1) * bs} 拍新快照时不该丢掉它；{r}"
                             + (f"\n  看起来像易错点：{PROMPT_END}" if key_k in cache.entries and key_n1 in cache.entries
                                else ""))
    _check_rows(cache, f"decode 在 {(n + 1) * bs} 拍快照之后", r)
    _decode(bm, cache, pool, a, r, (n + 2) * bs)
    present = [s for s, key in ((k, key_k), (n, key_n), (n + 1, key_n1), (n + 2, _key(bm, a, n + 2)))
               if key in cache.entries]
    if present != [k, n, n + 2]:
        raise AssertionError(f"decode 走到 {(n + 2) * bs} 之后，表里应是 prompt 里的 {k * bs}、{n * bs} 两份和最新的 "
                             f"{(n + 2) * bs}，得到边界 {[s * bs for s in present]} 的快照；{r}"
                             + (f"\n  看起来像易错点：{DECODE_ALL}" if present == [k, n, n + 1, n + 2] else ""))
    _check_rows(cache, f"decode 在 {(n + 2) * bs} 拍快照、替换 {(n + 1) * bs} 那份之后", r)
    _check_captured(cache, 4, r)
    b = _seq(e02, prompt + r.randint(1, 63, (r.int(1, 2 * bs),)).tolist(), bs)   # the same prompt, a new message
    bm.allocate(b)
    if b.num_cached_tokens != n * bs:
        raise AssertionError(f"b 以 a 的整段 prompt（{n * bs} 个 token）开头，{k * bs} 和 {n * bs} 处都有快照，应从最长的、prompt "
                             f"末尾那份恢复：num_cached_tokens 应为 {n * bs}，得到 {b.num_cached_tokens}；{r}"
                             + (f"\n  看起来像易错点：{SHORTEST}" if b.num_cached_tokens == k * bs else ""))
    with explain_crash({"slot_of": NO_SLOT}):
        slot = cache.restore(b, pool)
    _check_restored(pool, slot, end_state, "b 恢复后（应是 a 算完 prompt 时的状态）", r)
    record_case("capture:prompt-end-on-boundary")


def _past_prompt_trajectories(b1, b2, b3, b4, b5):
    """Which boundary snapshots (in blocks) a recomputed sequence holds after each of its six steps: the rule
    (end > num_prompt_tokens), 'has a completion token', 'computed one token' and 'never drops one'."""
    right = [[b1], [b1, b2], [b1, b3], [b1, b3], [b1, b4], [b1, b5]]
    completion = [[b1], [b2], [b3], [b3], [b4], [b5]]
    one_token = [[b1], [b1, b2], [b1, b2, b3], [b1, b2, b3], [b1, b2, b3, b4], [b1, b2, b3, b5]]
    keep_all = [[b1], [b1, b2], [b1, b2, b3], [b1, b2, b3], [b1, b2, b3, b4], [b1, b2, b3, b4, b5]]
    return right, completion, one_token, keep_all


@point("capture / restore：算到 block 边界才拍、挂在结束处那一块的哈希上；decode 也拍，但每条序列在 prompt 之后只留最新一份；命中截到最后一个有快照的块；恢复的 conv 与 recurrent 状态逐元素相等")
def test_recomputed_sequence_past_prompt():
    r = Rand()
    bs = r.choice([2, 4])
    a_blocks = r.int(2, 3)
    prompt_len = a_blocks * bs + r.int(1, bs - 1)          # the prompt ends inside block a_blocks
    b1 = r.int(1, a_blocks)                                 # chunk 1 ends inside the prompt
    b2 = a_blocks + 1                                       # chunk 2 starts inside it and ends past it
    b3 = b2 + 1                                             # chunk 3 lies past it
    b4, b5 = b3 + 1, b3 + 2                                 # then decodes reach the next two boundaries
    total = b3 * bs + r.int(1, bs - 1)                      # prompt + the answer before the preemption
    m, e02, pool, cache, bm = _parts(r, 32, 8, bs)
    # a sequence preempted after answering total - prompt_len tokens: its prompt is still prompt_len tokens,
    # and after re-admission (no hits left) all its tokens are prefilled again, in chunks
    a = _seq(e02, r.randint(1, 63, (prompt_len,)).tolist(), bs)
    for t in r.randint(1, 63, (total - prompt_len,)).tolist():
        a.append_token(t)
    bm.allocate(a)
    pool.allocate(a)
    steps = [(b1 * bs, f"重算的第 1 段 [0, {b1 * bs})"),
             ((b2 - b1) * bs, f"第 2 段 [{b1 * bs}, {b2 * bs})（跨过 prompt 末尾 {prompt_len}）"),
             (bs, f"第 3 段 [{b2 * bs}, {b3 * bs})"),
             (total - b3 * bs, f"最后一段 [{b3 * bs}, {total})"),
             (b4, f"decode 走到 {b4 * bs}"),
             (b5, f"decode 走到 {b5 * bs}")]
    right, completion, one_token, keep_all = _past_prompt_trajectories(b1, b2, b3, b4, b5)
    seen = []
    for i, (tokens, what) in enumerate(steps):
        if i >= 4:
            _decode(bm, cache, pool, a, r, tokens * bs)
        else:
            _new_state(pool, a, r)
            _step(bm, cache, pool, a, tokens)
        if i == 0:
            _check_taken(bm, cache, a, b1, "重算的第 1 段", r)
        seen.append([b for b in (b1, b2, b3, b4, b5) if len(a.block_table) >= b and _key(bm, a, b) in cache.entries])
        _check_rows(cache, f"被抢占后重算的序列，{what}之后", r)
    if seen != right:
        i = next(i for i in range(len(right)) if seen[i] != right[i])
        mistake = PAST_PROMPT if seen in (completion, one_token) else DECODE_ALL if seen == keep_all else ""
        raise AssertionError(
            f"一条被抢占的序列（prompt {prompt_len} 个 token，已生成到共 {total} 个）重算：{steps[i][1]}之后，表里应有边界 "
            f"{[b * bs for b in right[i]]} 的快照（prompt 里的 {b1 * bs} 一直留着；end > {prompt_len} 的只留最新一份），"
            f"得到 {[b * bs for b in seen[i]]}；{r}" + (f"\n  看起来像易错点：{mistake}" if mistake else ""))
    _check_captured(cache, 5, r)
    record_case("capture:preempted-recompute")


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
        # g's blocks still marked computed: _allocate_block kept the old owner's flag; else lookup ignored it
        kept = [bm.computed[b] for b in g.block_table]
        raise AssertionError(f"h 的 KV 命中的是 g 刚登记、还没算过的块（g 还没跑过一步，它的块 computed = {kept}），a 的快照不能让它"
                             f"命中：num_cached_tokens 应为 0，得到 {h.num_cached_tokens}；{r}\n  看起来像易错点："
                             + (REALLOC_COMPUTED if any(kept) else STALE))
    bm.deallocate(h)
    bm.deallocate(g)                                          # never computed: e02 drops their hashes
    live = _seq(e02, r.randint(1, 63, (bs + 1,)).tolist(), bs)    # another prefix, its KV still cached
    bm.allocate(live)
    pool.allocate(live)
    _new_state(pool, live, r)
    _step(bm, cache, pool, live, bs)
    evicted = cache.stats["snapshots_evicted"]
    cache.purge()
    _check_rows(cache, "purge 之后", r)
    if list(cache.entries) != [_key(bm, live, 1)]:
        raise AssertionError(f"a 的前缀的 KV 已不在缓存里（快照再也够不着），另一条序列的前缀还在：purge 应只丢掉 a 的那份、"
                             f"留下另一份，得到 {len(cache.entries)} 份（另一份{'在' if _key(bm, live, 1) in cache.entries else '不在'}）；{r}")
    assert cache.stats["snapshots_evicted"] == evicted, \
        f"purge 丢掉够不着的快照不算逐出：snapshots_evicted 从 {evicted} 变成 {cache.stats['snapshots_evicted']}；{r}"
    record_case("lookup:reregistered-uncomputed")
    record_case("purge:unreachable")


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
    record_case("lru:evict-oldest")
    record_case("lru:hit-refreshes")


def _one_block_seqs(e02, bm, pool, r: Rand, count: int, bs: int, tokens=None):
    """count sequences of one full block + 1 token, distinct contents, each allocated with a pool slot."""
    seqs = []
    for t in tokens or r.py.sample(range(1, 63), count):
        s = _seq(e02, [t] * bs + [1], bs)
        bm.allocate(s)
        pool.allocate(s)
        seqs.append(s)
    return seqs


def _store_with_dead(r: Rand, bs: int, size: int, taken: int, dead: list[int]):
    """A store of `size` rows holding `taken` one-block snapshots in LRU order 0..taken-1, of which those in `dead`
    can never be hit again (their sequences finished and their KV blocks went to a new owner), and a sequence
    `new` whose first block is computed next: (pool, cache, bm, new, the snapshots' keys)."""
    m, e02, pool, cache, bm = _parts(r, 2 * (taken + 1) + r.int(0, 4), size, bs, slots=taken + 1)
    *olds, new = _one_block_seqs(e02, bm, pool, r, taken + 1, bs)
    for i, s in enumerate(olds):
        _new_state(pool, s, r)
        _step(bm, cache, pool, s, bs)
        _check_taken(bm, cache, s, 1, f"第 {i} 条序列的 chunk ", r)
    keys = [_key(bm, s, 1) for s in olds]
    for i in dead:                                           # finished; then their blocks are handed out again
        bm.deallocate(olds[i])
        pool.free(olds[i])
    filler = _seq(e02, [63] * (bm.num_free_blocks * bs), bs)
    bm.allocate(filler)
    assert all(keys[i] not in bm.hash_to_block_id for i in dead), "（检查的前提）这些前缀的 KV 块应已被逐出"
    return pool, cache, bm, new, keys


@point("预算与 LRU：快照数不超过 num_snapshots，满了逐出最久未用的；命中刷新 LRU 顺序")
def test_full_store_purges_before_evicting():
    r = Rand()
    bs = r.choice([2, 4])
    size = r.int(3, 5)
    dead = sorted(r.py.sample(range(1, size), r.int(1, size - 1)))     # never the LRU front
    pool, cache, bm, new, keys = _store_with_dead(r, bs, size, size, dead)   # a full store
    evicted = cache.stats["snapshots_evicted"]
    _new_state(pool, new, r)
    _step(bm, cache, pool, new, bs)
    live = [keys[i] for i in range(size) if i not in dead]
    when = (f"快照库满（{size} 份），其中第 {dead} 份（从 LRU 队首数，0 起）的 KV 块已被逐出、再也够不着，"
            f"队首那份还能命中：再拍一份时")
    _check_rows(cache, when, r)
    if not all(k in cache.entries for k in live) or _key(bm, new, 1) not in cache.entries:
        front_gone = keys[0] not in cache.entries
        raise AssertionError(
            f"{when}应先 purge 掉够不着的那 {len(dead)} 份、用空出的行，还能命中的 {len(live)} 份和新拍的一份都留着；"
            f"得到 {len(cache.entries)} 份，队首那份{'被逐出了' if front_gone else '还在'}"
            f"（stats={cache.stats}）；{r}"
            + (f"\n  看起来像易错点：{NO_PURGE}" if front_gone and cache.stats["snapshots_evicted"] > evicted else ""))
    assert not any(keys[i] in cache.entries for i in dead), f"{when}够不着的快照应被 purge 掉；{r}"
    assert cache.stats["snapshots_evicted"] == evicted, \
        f"{when}有够不着的快照可丢，不该逐出任何快照（snapshots_evicted 从 {evicted} 变成 {cache.stats['snapshots_evicted']}）；{r}"
    _check_rows(cache, f"{when}（purge 之后）", r)
    record_case("take_row:full-store-purge-first")


@point("预算与 LRU：快照数不超过 num_snapshots，满了逐出最久未用的；命中刷新 LRU 顺序")
def test_free_row_before_purge():
    r = Rand()
    bs = r.choice([2, 4])
    size = r.int(3, 5)
    taken = r.int(1, size - 1)                               # snapshots before the new one: a free row is left
    dead = sorted(r.py.sample(range(taken), r.int(1, taken)))
    pool, cache, bm, new, keys = _store_with_dead(r, bs, size, taken, dead)
    free, evicted = sorted(cache.free_rows), cache.stats["snapshots_evicted"]
    _new_state(pool, new, r)
    _step(bm, cache, pool, new, bs)
    when = (f"快照库 {size} 行里有 {taken} 份快照、{size - taken} 个空行，其中第 {dead} 份（从 LRU 队首数，0 起）的 KV 块"
            f"已被逐出、再也够不着：再拍一份时")
    _check_rows(cache, when, r)
    _check_taken(bm, cache, new, 1, "新序列的 chunk ", r)
    gone = [i for i in range(taken) if keys[i] not in cache.entries]
    row = cache.entries.get(_key(bm, new, 1))
    if gone or row not in free or cache.stats["snapshots_evicted"] != evicted:
        raise AssertionError(
            f"{when}应直接用一个空行（free_rows {free} 之一）：G5 的取行顺序是先用空行，没有空行才 purge、再没有才逐出；"
            f"已有的 {taken} 份都留着（够不着的那几份等库满时再由 purge 收走）。得到新快照在第 {row} 行，第 {gone} 份不在表里了，"
            f"逐出 {cache.stats['snapshots_evicted'] - evicted} 份；{r}"
            + (f"\n  看起来像易错点：{PURGE_EARLY}" if gone and sorted(gone) == dead else ""))
    record_case("take_row:free-row-with-unreachable")


@point("预算与 LRU：快照数不超过 num_snapshots，满了逐出最久未用的；命中刷新 LRU 顺序")
def test_recapture_reuses_its_row():
    r = Rand()
    bs = r.choice([2, 4])
    size = r.int(3, 5)
    k = r.int(1, size - 2)                                   # neither the LRU front nor its back
    m, e02, pool, cache, bm = _parts(r, 4 * (size + 2), size, bs, slots=size + 2)
    tokens = r.py.sample(range(1, 63), size + 1)
    olds = _one_block_seqs(e02, bm, pool, r, size, bs, tokens[:size])
    # twin: the same first block as olds[k], admitted in the same step (no hit yet): it computes that block too
    twin, later = _one_block_seqs(e02, bm, pool, r, 2, bs, [tokens[k], tokens[size]])
    for i, s in enumerate(olds):                             # a full store, LRU order = olds
        _new_state(pool, s, r)
        _step(bm, cache, pool, s, bs)
        _check_taken(bm, cache, s, 1, f"第 {i} 条序列的 chunk ", r)
    keys = [_key(bm, s, 1) for s in olds]
    if list(cache.entries) != keys:
        raise AssertionError(f"预算 {size} 份，依次拍了 {size} 份快照：表里应按拍的顺序（LRU 队首在前）放着这 {size} 份，得到第 "
                             f"{[keys.index(h) if h in keys else '?' for h in cache.entries]} 份；{r}")
    row = cache.entries[keys[k]]
    evicted = cache.stats["snapshots_evicted"]
    state = _new_state(pool, twin, r)
    _step(bm, cache, pool, twin, bs)                         # the same hash again
    when = (f"快照库满（{size} 份，LRU 顺序 0..{size - 1}），第 {k} 份的前缀被另一条序列又算了一遍、重拍同一个哈希时")
    if keys[k] not in cache.entries:
        raise AssertionError(f"{when}，这份快照应留在表里，得到它不见了；{r}")
    if cache.entries[keys[k]] != row or cache.stats["snapshots_evicted"] != evicted:
        raise AssertionError(f"{when}应复用它原来的第 {row} 行、不逐出任何快照；得到第 {cache.entries[keys[k]]} 行，"
                             f"逐出 {cache.stats['snapshots_evicted'] - evicted} 份；{r}\n  看起来像易错点：{RECAPTURE}")
    want = keys[:k] + keys[k + 1:] + [keys[k]]
    if list(cache.entries) != want:
        stayed = list(cache.entries) == keys
        raise AssertionError(f"{when}，它刚被用过，应移到 LRU 队尾；得到的顺序是第 "
                             f"{[keys.index(h) for h in cache.entries if h in keys]} 份；{r}"
                             + (f"\n  看起来像易错点：{RECAPTURE}" if stayed else ""))
    for got_t, want_t in zip(m.state_views(cache.store, row), state):
        assert_equal(got_t, want_t, what="重拍后这一行的状态（应是刚算完的那份）", rand=r)
    _check_rows(cache, when, r)
    _new_state(pool, later, r)
    _step(bm, cache, pool, later, bs)                        # a new prefix: now the front (0) goes
    if keys[0] in cache.entries or keys[k] not in cache.entries:
        newest_gone = keys[0] in cache.entries and keys[k] not in cache.entries
        raise AssertionError(f"第 {k} 份重拍（移到 LRU 队尾）之后再拍一份新的：应逐出 LRU 队首第 0 份，留下刚重拍的第 {k} 份；"
                             f"得到表里有第 {[keys.index(h) for h in cache.entries if h in keys]} 份；{r}"
                             + (f"\n  看起来像易错点：{EVICT_NEWEST}" if newest_gone else ""))
    record_case("capture:recapture-same-hash")


@point("预算与 LRU：快照数不超过 num_snapshots，满了逐出最久未用的；命中刷新 LRU 顺序")
def test_own_old_snapshot_goes_first():
    r = Rand()
    bs = r.choice([2, 4])
    size = r.int(3, 5)
    before = r.int(1, size - 2)                              # others captured before a's first answer snapshot
    m, e02, pool, cache, bm = _parts(r, 4 * (size + 2), size, bs, slots=size + 1)
    others = _one_block_seqs(e02, bm, pool, r, size - 1, bs)
    a = _seq(e02, r.randint(1, 63, (bs + r.int(1, bs - 1),)).tolist(), bs)   # the prompt ends inside block 1
    bm.allocate(a)
    pool.allocate(a)
    _new_state(pool, a, r)
    _step(bm, cache, pool, a, a.num_tokens)                 # the whole prompt: no boundary at its end
    for i, s in enumerate(others[:before]):
        _new_state(pool, s, r)
        _step(bm, cache, pool, s, bs)
        _check_taken(bm, cache, s, 1, f"第 {i} 条序列的 chunk ", r)
    _decode(bm, cache, pool, a, r, 2 * bs)                  # a's answer crosses 2P: its newest snapshot
    _check_taken(bm, cache, a, 2, "a 的 decode ", r, decode=True)
    for i, s in enumerate(others[before:], before):         # the store is full now, a's snapshot in the middle
        _new_state(pool, s, r)
        _step(bm, cache, pool, s, bs)
        _check_taken(bm, cache, s, 1, f"第 {i} 条序列的 chunk ", r)
    keys = [_key(bm, s, 1) for s in others]
    old = _key(bm, a, 2)
    if len(cache.entries) != size or old not in cache.entries:
        raise AssertionError(f"预算 {size} 份，拍了 {size} 份快照（a 在 {2 * bs} 的一份、别的序列 {size - 1} 份）："
                             f"表里应正好是这 {size} 份，得到 {len(cache.entries)} 份"
                             f"（a 的那份{'在' if old in cache.entries else '不在'}）；{r}")
    evicted = cache.stats["snapshots_evicted"]
    _decode(bm, cache, pool, a, r, 3 * bs)                  # 3P: replaces a's 2P one
    when = (f"快照库满（{size} 份），a 在 prompt 之后的快照（边界 {2 * bs}）排在 LRU 第 {before} 位；"
            f"a 的 decode 走到 {3 * bs} 拍新快照时")
    _check_rows(cache, when, r)
    if old in cache.entries:
        raise AssertionError(f"{when}，a 在 {2 * bs} 的旧快照应丢掉；得到它还在；{r}\n  看起来像易错点：{DECODE_ALL}")
    _check_taken(bm, cache, a, 3, "a 的 decode ", r, decode=True)
    if not all(h in cache.entries for h in keys):
        front_gone = keys[0] not in cache.entries
        raise AssertionError(
            f"{when}应先丢掉 a 自己的旧快照、用它那一行，别的序列的 {size - 1} 份都留着；得到 LRU 队首那份"
            f"{'被逐出了' if front_gone else '还在'}（stats={cache.stats}）；{r}"
            + (f"\n  看起来像易错点：{TAKE_FIRST}" if front_gone and cache.stats["snapshots_evicted"] > evicted else ""))
    assert cache.stats["snapshots_evicted"] == evicted, \
        f"{when}不该逐出任何快照（snapshots_evicted 从 {evicted} 变成 {cache.stats['snapshots_evicted']}）；{r}"
    record_case("capture:own-old-first-when-full")


# ----------------------------------------------------------------------------- waiting, branch points, computed
WAIT_POINT = ("等待与分叉点：共享前缀正被别人算着、等来的至少占要算的一半时不接纳，并让算它的一方知道停在哪；"
              "等不来或不值得等时照常接纳；branch_point 给出下一段该停的分叉点")
COMPUTED_POINT = ("computed 与登记：写满 KV 的块才算好；换了主人的块不算好、不再被等；"
                  "同一内容有算好的拷贝时，登记指向算好的那份")


def _wait_predictions(raw: int, usable: int, last_computed: bool, num_tokens: int, bs: int,
                      num_prompt: int | None = None) -> dict[str, bool]:
    """Whether each rule (the right one and the classic wrong ones) makes a request wait: raw = blocks of its
    KV hit run, usable = blocks of its usable hit; num_prompt < num_tokens for a preempted request (it has
    generated tokens and went back to waiting)."""
    uncomputed = not last_computed
    num_prompt = num_tokens if num_prompt is None else num_prompt
    right = uncomputed and 2 * (raw - usable) * bs >= num_tokens - usable * bs
    return {"right": right,
            "never": False,
            "strict": uncomputed and 2 * (raw - usable) * bs > num_tokens - usable * bs,
            "whole": uncomputed and 2 * raw * bs >= num_tokens,
            "computed_too": 2 * (raw - usable) * bs >= num_tokens - usable * bs,
            "prompt_only": uncomputed and 2 * (raw - usable) * bs >= num_prompt - usable * bs,
            "fresh_only": right and num_prompt == num_tokens}


WAIT_MISTAKES = {
    "never": ("从来不等：先接纳的请求还没算好的共享前缀（正在算），后来的请求照样接纳了。两个常见原因：判断用的不是"
              "原始命中串（截到可用命中处的那条，末块总是算好的）；或者只认主人这一步的 chunk 够不够到（chunk 被截断、"
              "之后几步才算到的块也是正在算）"),
    "strict": ("等来的 token 正好是它要算的 token 的一半时没有等：值得等的门槛含正好一半"),
    "whole": ("门槛没有扣掉可用命中：已经能从快照恢复的那一段既不是等来的、也不用算，"
              "比的应是可用命中之后的部分（等来的 vs 要算的）"),
    "computed_too": "命中串末块已经算好了还在等：那一块没有人会再算、也不会再拍快照，请求会一直等下去",
    "prompt_only": ("等待门槛里“要算的”只数了 prompt（num_prompt_tokens）：被抢占的请求回到等待队列时已经生成过 "
                    "token，重新接纳后要算的是它全部的 token（num_tokens），可用命中之后的全部"),
    "fresh_only": ("只让新请求等、被抢占的请求从来不等：被抢占的请求回到等待队列，要的前缀正被别人算着时同样适用 G1"
                   "（它重新接纳后一样要从头算那段前缀）"),
}


@point(WAIT_POINT)
def test_wait_for_a_prefix_computed_this_step():
    r = Rand()
    bs = r.choice([2, 4])
    s = r.int(3, 4)                                          # the shared prefix: s full blocks
    u = s - 1                                                # later: all but its last block computed, a snapshot there
    m, e02, pool, cache, bm = _parts(r, 64, 8, bs)
    system = r.randint(1, 31, (s * bs,)).tolist()
    a = _seq(e02, system + r.randint(1, 31, (r.int(1, 3 * bs),)).tolist(), bs)
    bm.allocate(a)                                           # admitted in this step: s registered blocks, none computed
    pool.allocate(a)
    last = a.block_table[s - 1]
    observed, cases = [], []

    def ask(t: int, usable: int, last_computed: bool, what: str, generated: int = 0) -> None:
        """A request sharing the s blocks, then t tokens of its own: can it be admitted now? generated > 0: it was
        preempted after generating that many tokens (they follow its prompt; it holds no blocks again)."""
        b = _seq(e02, system + r.randint(32, 63, (t,)).tolist(), bs)
        for tok in r.randint(32, 63, (generated,)).tolist():
            b.append_token(tok)
        free, wanted = bm.num_free_blocks, set(bm.wanted)
        got = bm.can_allocate(b)
        if type(got) is not bool:
            raise AssertionError(f"can_allocate 应返回 bool，得到 {got!r}；{r}")
        if b.block_table or bm.num_free_blocks != free:
            raise AssertionError(f"can_allocate 只回答能不能接纳，不该分配 block（{what}）；{r}")
        added = bm.wanted - wanted
        if not got and added != {last}:
            raise AssertionError(f"{what}：can_allocate 返回 False（等），应把原始命中串的末块（block {last}，a 的第 {s - 1} 块）"
                                 f"记进 wanted，得到新加入的 {sorted(added)}；{r}")
        if got and added:
            raise AssertionError(f"{what}：can_allocate 返回 True（接纳），wanted 不该变，得到新加入的 {sorted(added)}；{r}")
        bm.wanted = wanted                                   # every question starts from the same wanted set
        observed.append(not got)
        cases.append((what, _wait_predictions(s, usable, last_computed, b.num_tokens, bs, b.num_prompt_tokens)))

    nothing = f"a 这一步刚接纳、还没算（前 {s} 块已登记，都没算好）"
    for t in (1, s * bs, s * bs + 1):
        ask(t, 0, False, f"{nothing}，b = 共享的 {s * bs} 个 token + 自己的 {t} 个")
    # preempted requests (generated tokens, back in waiting): the tokens to compute are all of them
    g = r.int(1, bs)
    ask(s * bs, 0, False, f"{nothing}，b 是被抢占的请求：prompt = 共享的 {s * bs} 个 token + 自己的 {s * bs} 个，"
                          f"已生成 {g} 个", generated=g)
    ask(1, 0, False, f"{nothing}，b 是被抢占的请求：prompt = 共享的 {s * bs} 个 token + 自己的 1 个，已生成 1 个",
        generated=1)
    _new_state(pool, a, r)
    _step(bm, cache, pool, a, u * bs)                         # a computed its first u blocks: a snapshot at uP
    part = f"a 算好了前 {u} 块、在 {u * bs} 拍了快照，第 {u}..{s - 1} 块还没算好"
    for t in ((s - u) * bs, (s - u) * bs + 1):
        ask(t, u, False, f"{part}，b = 共享的 {s * bs} 个 token + 自己的 {t} 个")
    _new_state(pool, a, r)
    _step(bm, cache, pool, a, (s - u) * bs + 1)               # all s blocks computed, no snapshot at sP
    done = f"a 的前 {s} 块都算好了（快照只在 {u * bs}）"
    ask(1, u, True, f"{done}，b = 共享的 {s * bs} 个 token + 自己的 1 个")

    for (what, want), got in zip(cases, observed):
        if got == want["right"]:
            continue
        rule = "应等（返回 False）" if want["right"] else "应接纳（返回 e02 的回答 True）"
        msg = f"{what}：{rule}，得到{'等' if got else '接纳'}；{r}"
        match = [k for k in WAIT_MISTAKES if [p[k] for _, p in cases] == observed]
        if match:
            msg += f"\n  看起来像易错点：{WAIT_MISTAKES[match[0]]}"
        raise AssertionError(msg)
    b = _seq(e02, system + r.randint(32, 63, (1,)).tolist(), bs)
    bm.allocate(b)
    assert b.num_cached_tokens == u * bs, f"{done}：b 接纳后应从 {u * bs} 的快照恢复，得到 num_cached_tokens {b.num_cached_tokens}；{r}"
    record_case("wait:fresh")
    record_case("wait:preempted")
    record_case("wait:exactly-half")
    record_case("wait:after-usable-hit")
    record_case("wait:last-block-computed")


@point(WAIT_POINT)
def test_branch_point():
    r = Rand()
    bs = r.choice([2, 4])
    k = r.int(1, 2)                                          # x registers k blocks that a's prefix hits
    n = k + r.int(3, 4)                                      # a: n full blocks + 1 token
    m, e02, pool, cache, bm = _parts(r, 64, 8, bs)
    prefix = r.randint(1, 63, (k * bs,)).tolist()
    x = _seq(e02, prefix + [1], bs)
    bm.allocate(x)
    a = _seq(e02, prefix + r.randint(1, 63, ((n - k) * bs + 1,)).tolist(), bs)
    bm.allocate(a)                                           # (admitted anyway: its KV hit run is x's k blocks)
    j1 = r.int(k, n - 3)
    j2 = r.int(j1 + 1, n - 1)
    shared = k * bs
    stranger = _seq(e02, r.randint(1, 63, (3 * bs,)).tolist(), bs)
    checks = [(set(), 0, shared, f"wanted 为空：应是 a 接纳时 KV 命中串的长度 shared_tokens = {shared}"),
              ({a.block_table[j2], a.block_table[j1]}, 0, (j1 + 1) * bs,
               f"wanted 里有 a 的第 {j1}、{j2} 块：应是第一块（第 {j1} 块）的末尾"),
              ({a.block_table[j2], a.block_table[j1]}, j1 * bs + r.int(1, bs - 1), (j1 + 1) * bs,
               f"a 已算到第 {j1} 块中间、wanted 里有第 {j1}、{j2} 块：第 {j1} 块还没算完，仍是它的末尾"),
              ({a.block_table[j2], a.block_table[j1]}, (j1 + 1) * bs, (j2 + 1) * bs,
               f"a 已算完第 {j1} 块、wanted 里有第 {j1}、{j2} 块：只看还没算完的块，应是第 {j2} 块的末尾"),
              ({a.block_table[j2]}, (j2 + 1) * bs, shared,
               f"a 已算完第 {j2} 块（wanted 里只有它）：没有要等的块了，应是 shared_tokens = {shared}")]
    for wanted, cached, want, what in checks:
        bm.wanted = set(wanted)
        a.num_cached_tokens = cached
        got = bm.branch_point(a)
        if got != want:
            raise AssertionError(f"branch_point(a)（block_size {bs}，num_cached_tokens {cached}，a 的 block_table "
                                 f"{a.block_table}，wanted {sorted(wanted)}）：{what}，得到 {got!r}；{r}")
    bm.wanted = set()
    got = bm.branch_point(stranger)
    assert got == 0, f"一条没有接纳过（没有 shared_tokens）、wanted 为空的序列，branch_point 应为 0，得到 {got!r}；{r}"
    record_case("branch_point:wanted")
    record_case("branch_point:shared-tokens")
    record_case("branch_point:never-admitted")


def _computed_of(bm, seq) -> list[bool]:
    return [bm.computed[b] for b in seq.block_table]


@point(COMPUTED_POINT)
def test_computed_blocks():
    r = Rand()
    bs = r.choice([2, 4])
    n = r.int(3, 5)
    m, e02, pool, cache, bm = _parts(r, 4 * n + 8, 8, bs)
    a = _seq(e02, r.randint(1, 63, (n * bs + r.int(1, bs - 1),)).tolist(), bs)
    bm.allocate(a)
    pool.allocate(a)
    if any(_computed_of(bm, a)):
        raise AssertionError(f"a 刚接纳、一步都没跑：它的块都不该算好（e02 在接纳时就登记哈希，KV 还没写），得到 computed "
                             f"{_computed_of(bm, a)}；{r}")
    ends = [r.int(1, bs - 1), bs + r.int(1, bs - 1), 2 * bs, a.num_tokens]   # mid-block, mid-block, a boundary, the end
    for end in ends:
        bm.wanted = {b for b in a.block_table if not bm.computed[b]}   # waited for until computed
        _new_state(pool, a, r)
        _step(bm, cache, pool, a, end - a.num_cached_tokens)
        want = [(i + 1) * bs <= end for i in range(len(a.block_table))]
        got = _computed_of(bm, a)
        if got != want:
            raise AssertionError(f"a（block_size {bs}）的 prefill 算到 {end} 之后，t[0, {end}) 填满的块才算好：computed 应为 "
                                 f"{want}，得到 {got}；{r}")
        left = [i for i, b in enumerate(a.block_table) if b in bm.wanted]
        if left != [i for i, w in enumerate(want) if not w]:
            raise AssertionError(f"a 没算好的块都在 wanted 里，prefill 算到 {end} 之后，算好的块不该再被等：wanted 里应剩 a 的第 "
                                 f"{[i for i, w in enumerate(want) if not w]} 块，得到第 {left} 块；{r}")
    old = list(a.block_table)
    bm.deallocate(a)
    pool.free(a)
    bm.wanted = set(old)
    filler = _seq(e02, [63] * (bm.num_free_blocks * bs), bs)  # hands every free block, a's too, to a new owner
    bm.allocate(filler)
    got = [bm.computed[b] for b in old]
    still = sorted(set(old) & bm.wanted)
    if any(got) or still:
        # each half names its own mistake: computed left True, or the block left in wanted (_allocate_block)
        named = [m for bad, m in ((any(got), REALLOC_COMPUTED), (bool(still), REALLOC_WANTED)) if bad]
        raise AssertionError(f"a 结束后它的块 {old} 又分给了一条还没跑过的序列：这些块不该再算好（得到 computed {got}），"
                             f"也不该还在 wanted 里（得到 {still}）；{r}"
                             + "".join(f"\n  看起来像易错点：{m}" for m in named))
    record_case("computed:partial-block")
    record_case("computed:new-owner")


def _two_sharing(e02, r: Rand, s: int, bs: int):
    """A prefix of s full blocks and two sequences that share it and then go on far longer (neither waits for the
    other); the chained hashes of the prefix's blocks."""
    system = r.randint(1, 31, (s * bs,)).tolist()
    a, b = (_seq(e02, system + r.randint(32, 63, (2 * s * bs + r.int(1, bs),)).tolist(), bs) for _ in range(2))
    hashes = []
    for i in range(s):
        hashes.append(e02.compute_block_hash(system[i * bs:(i + 1) * bs], hashes[-1] if hashes else -1))
    return system, a, b, hashes


@point(COMPUTED_POINT)
def test_registration_follows_computed():
    r = Rand()
    bs = r.choice([2, 4])
    s = r.int(3, 4)
    u = r.int(1, s - 1)
    m, e02, pool, cache, bm = _parts(r, 64, 8, bs)
    system, a, b, hashes = _two_sharing(e02, r, s, bs)
    # a and b admitted in the same step (b's shared part is short: it does not wait); a computes the prefix, b less
    bm.allocate(a)
    pool.allocate(a)
    if not bm.can_allocate(b):
        raise AssertionError(f"b 共享 {s * bs} 个 token、自己还有 {b.num_tokens - s * bs} 个：不到一半，不该等；{r}")
    bm.allocate(b)
    pool.allocate(b)
    _new_state(pool, b, r)
    _step(bm, cache, pool, b, u * bs)
    _new_state(pool, a, r)
    _step(bm, cache, pool, a, s * bs + 1)
    reg = [bm.hash_to_block_id.get(h) for h in hashes]
    want = [b.block_table[i] if i < u else a.block_table[i] for i in range(s)]
    what = (f"a、b 同一步接纳、共享前 {s} 块（各自登记一份），这一步 b 算了前 {u} 块、a 算完了前 {s} 块：每块的登记应指向"
            f"算好的那份（第 0..{u - 1} 块 b 的或 a 的都行，第 {u}..{s - 1} 块只能是 a 的）")
    bad = [i for i in range(s) if reg[i] is None or not bm.computed[reg[i]]]
    if bad:
        raise AssertionError(f"{what}；得到第 {bad} 块登记在没算好的拷贝上（hash_to_block_id 指向 {[reg[i] for i in bad]}，a 的是 "
                             f"{[a.block_table[i] for i in bad]}）；{r}\n  看起来像易错点：{REGISTER_UNCOMPUTED}")
    c = _seq(e02, system + r.randint(32, 63, (1,)).tolist(), bs)
    bm.allocate(c)                                           # c: s computed blocks, the snapshot at uP
    if c.num_cached_tokens != u * bs:
        raise AssertionError(f"{what}；c 以同样的 {s} 块开头，应从 {u * bs} 的快照恢复，得到 num_cached_tokens "
                             f"{c.num_cached_tokens}；{r}")
    fresh = c.block_table[u:s]                               # c's own copies of blocks u..s-1: not computed yet
    for i, blk in zip(range(u, s), fresh):
        if bm.blocks[blk].hash != hashes[i]:
            raise AssertionError(f"c 自己那份第 {i} 块（block {blk}）也要带上它的哈希（快照按它取键），得到 hash "
                                 f"{bm.blocks[blk].hash}；{r}")
    reg = [bm.hash_to_block_id.get(hashes[i]) for i in range(u, s)]
    if reg != [a.block_table[i] for i in range(u, s)] and reg != want[u:]:
        raise AssertionError(f"c 登记自己还没算的第 {u}..{s - 1} 块时，已算好的 a 那几份应保持登记（hash_to_block_id 指向 "
                             f"{want[u:]}），得到 {reg}；{r}\n  看起来像易错点：{SHADOWED}")
    record_case("register:computed-copy")


@point(COMPUTED_POINT)
def test_registration_survives_a_preempted_owner():
    r = Rand()
    bs = r.choice([2, 4])
    s = r.int(2, 3)
    u = r.int(1, s - 1)
    num_blocks = 48
    m, e02, pool, cache, bm = _parts(r, num_blocks, 8, bs)
    # the pool's last two blocks (ids num_blocks - 2, num_blocks - 1) hold a finished request's computed, cached KV,
    # at the tail of the free list: every block handed out below comes before them
    held = _seq(e02, [63] * ((num_blocks - 2) * bs), bs)
    bm.allocate(held)
    old = _seq(e02, r.randint(32, 63, (2 * bs,)).tolist(), bs)
    bm.allocate(old)
    old.num_scheduled_tokens = 2 * bs
    bm.mark_computed(old)
    old.num_cached_tokens, old.num_scheduled_tokens = 2 * bs, 0
    bm.deallocate(held)
    bm.deallocate(old)
    system, a, b, hashes = _two_sharing(e02, r, s, bs)
    bm.allocate(a)                                           # a and b admitted in the same step, neither computed
    reg = [bm.hash_to_block_id.get(h) for h in hashes]
    if reg != a.block_table[:s]:
        raise AssertionError(f"a 接纳时登记它的前 {s} 块（哈希还没有人登记过）：hash_to_block_id 应指向 {a.block_table[:s]}，"
                             f"得到 {reg}（池子末尾两块 {num_blocks - 2}、{num_blocks - 1} 是别的请求算好、已释放的块）；{r}")
    bm.allocate(b)
    pool.allocate(b)
    reg = [bm.hash_to_block_id.get(h) for h in hashes]
    if reg != b.block_table[:s]:
        raise AssertionError(f"a、b 同一步接纳、各自登记同一段前 {s} 块，两份都还没算：算好的拷贝一份都没有时照 e02，新登记的 b 那份"
                             f"生效（hash_to_block_id 应指向 b 的 {b.block_table[:s]}），得到 {reg}（a 的是 {a.block_table[:s]}）；{r}"
                             + (f"\n  看起来像易错点：{FIRST_WINS}" if reg == a.block_table[:s] else ""))
    bm.deallocate(a)                                         # preempted before its first step: it computed nothing
    _new_state(pool, b, r)
    _step(bm, cache, pool, b, u * bs)
    _new_state(pool, b, r)
    _step(bm, cache, pool, b, (s - u) * bs + 1)
    reg = [bm.hash_to_block_id.get(h) for h in hashes]
    if reg != b.block_table[:s]:
        raise AssertionError(f"a、b 同一步接纳、各自登记同一段前 {s} 块；a 一步没算就被抢占（deallocate），b 算完了这 {s} 块：登记应"
                             f"指向 b 的 {b.block_table[:s]}，得到 {reg}（None = 这段内容没有登记，后来的请求命中不到）；{r}")
    c = _seq(e02, system + r.randint(32, 63, (1,)).tolist(), bs)
    bm.allocate(c)
    assert c.num_cached_tokens == u * bs, \
        f"c 以同样的 {s} 块开头，b 在 {u * bs} 拍了快照：应从那里恢复，得到 num_cached_tokens {c.num_cached_tokens}；{r}"
    record_case("register:newest-uncomputed-copy")
    record_case("register:preempted-owner")


@point("capture / restore：算到 block 边界才拍、挂在结束处那一块的哈希上；decode 也拍，但每条序列在 prompt 之后只留最新一份；命中截到最后一个有快照的块；恢复的 conv 与 recurrent 状态逐元素相等")
def test_restore_without_snapshot_raises():
    r = Rand()
    bs = r.choice([2, 4])
    m, e02, pool, cache, bm = _parts(r, 32, 8, bs)
    a = _seq(e02, r.randint(1, 63, (3 * bs + 1,)).tolist(), bs)
    bm.allocate(a)
    a.num_cached_tokens = r.int(1, 3) * bs                    # claims a hit at a boundary where nothing was taken
    free = list(pool.free_slots)
    try:
        slot = cache.restore(a, pool)
    except RuntimeError:
        if list(pool.free_slots) != free or a.seq_id in pool.slot_of:
            raise AssertionError(f"restore 找不到快照、抛出 RuntimeError 之前不该占用槽位：free_slots 从 {free} 变成 "
                                 f"{list(pool.free_slots)}；{r}") from None
        record_case("restore:no-snapshot-raises")
        return
    raise AssertionError(f"a 的 num_cached_tokens = {a.num_cached_tokens}，但表里没有第 {a.num_cached_tokens // bs - 1} 块哈希的"
                         f"快照：restore 应抛 RuntimeError，得到返回槽位 {slot!r}；{r}\n  看起来像易错点：{RESTORE_ZERO}")


@point("预算与 LRU：快照数不超过 num_snapshots，满了逐出最久未用的；命中刷新 LRU 顺序")
def test_own_old_snapshot_already_evicted():
    r = Rand()
    bs = r.choice([2, 4])
    m, e02, pool, cache, bm = _parts(r, 32, 2, bs)
    a = _seq(e02, r.randint(1, 63, (bs + r.int(1, bs - 1),)).tolist(), bs)   # the prompt ends inside block 1
    bm.allocate(a)
    pool.allocate(a)
    _new_state(pool, a, r)
    _step(bm, cache, pool, a, a.num_tokens)
    _decode(bm, cache, pool, a, r, 2 * bs)                   # a's answer crosses 2P: its newest snapshot
    _check_taken(bm, cache, a, 2, "a 的 decode ", r, decode=True)
    old = _key(bm, a, 2)
    for i, o in enumerate(_one_block_seqs(e02, bm, pool, r, 2, bs)):   # budget 2: the second one evicts a's
        _new_state(pool, o, r)
        _step(bm, cache, pool, o, bs)
        _check_taken(bm, cache, o, 1, f"第 {i} 条别的序列的 chunk ", r)
    assert old not in cache.entries, f"（检查的前提）预算 2 份，a 在 {2 * bs} 的快照应已被 LRU 逐出；{r}"
    when = (f"a 在 prompt 之后的上一份快照（边界 {2 * bs}）已被 LRU 逐出（newest 里还记着它），a 的 decode 走到 {3 * bs} "
            f"拍新快照时")
    try:
        _decode(bm, cache, pool, a, r, 3 * bs)
    except KeyError as exc:
        if exc.args and exc.args[0] == old:
            raise AssertionError(f"{when}：capture 抛出 KeyError {old}（那份旧快照的哈希）；{r}\n  看起来像易错点：{OLD_GONE}") from None
        raise
    _check_rows(cache, when, r)
    _check_taken(bm, cache, a, 3, "a 的 decode ", r, decode=True)
    assert cache.newest.get(a.seq_id) == _key(bm, a, 3), f"{when}：newest[a] 应记下新快照的哈希；{r}"
    record_case("capture:own-old-already-evicted")

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
    Returns per turn (prompts, outputs, stats after the turn, the snapshot keys in the store after the turn)."""
    system = r.randint(1, 64, (system or r.int(2 * bs + 1, 4 * bs),)).tolist()
    msg = lambda: r.randint(1, 64, (r.int(1, message or 2 * bs),)).tolist()   # noqa: E731
    history = [system + msg() for _ in range(convs)]
    log = []
    for _ in range(turns):
        outs = llm.generate(history, _greedy(new))
        cache = getattr(llm.block_manager, "state_cache", None)
        keys = set(cache.entries) if cache is not None else set()
        log.append((history, [o.token_ids for o in outs], dict(llm.stats), keys))
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
    return [[o.token_ids for o in llm.generate(prompts, _greedy(new))] for prompts, *_ in log]


def _multiturn(family: str):
    e05 = impl("e05_engine")
    r = Rand()
    folder, hf = _model(family, r.seed)
    bs = r.choice([2, 4])
    kw = dict(block_size=bs, max_num_seqs=3, max_num_batched_tokens=r.int(12, 24))
    with _engine_watch(r):
        llm = e05.LLM(str(folder), enable_prefix_caching=True, **kw)
        log = _chat(llm, r, convs=3, turns=3, bs=bs)
    off = _replay(e05.LLM(str(folder), enable_prefix_caching=False, **kw), log)
    for t, ((prompts, outs, _, _), base) in enumerate(zip(log, off)):
        for i, (p, got, want) in enumerate(zip(prompts, outs, base)):
            if got != want:
                raise AssertionError(f"{family}：第 {t + 1} 轮第 {i} 条（prompt 长 {len(p)}，block_size {bs}）"
                                     f"打开缓存得到 {got}，关闭缓存得到 {want}；{r}")
    for i, (p, got) in enumerate(zip(log[-1][0], log[-1][1])):     # the last turn, the most restored: against HF
        ref = _hf_generate(hf, p)
        assert got == ref, f"{family}：第 {len(log)} 轮第 {i} 条与 HF generate 不同：得到 {got}，期望 {ref}；{r}"
    e02 = impl("e02_block_manager")
    for t in range(1, len(log)):
        (prev, answers, before, keys), (_, _, after, _) = log[t - 1], log[t]
        hits = after["snapshot_hits"] - before["snapshot_hits"]
        saved = after["prefill_tokens_saved"] - before["prefill_tokens_saved"]
        # each turn fed its prompt and all but the last answer token: the newest boundary in there was reached by a
        # decode step (NEW_TOKENS - 1 >= P), so it has a snapshot, and this turn resumes there
        ends = [(len(p) + NEW_TOKENS - 1) // bs * bs for p in prev]
        if hits >= len(prev) and saved >= sum(ends):
            continue
        msg = (f"{family}：第 {t + 1} 轮 {len(prev)} 条请求都接着上一轮，应各自从上一轮回答里最后一个 block 边界 {ends} "
               f"的快照恢复（共省 {sum(ends)} 个 prefill token）；实际 {hits} 次恢复、省 {saved} 个（stats={after}）；{r}")
        missing = []
        for i, (p, out, e) in enumerate(zip(prev, answers, ends)):
            h, tokens = -1, p + out
            for j in range(e // bs):
                h = e02.compute_block_hash(tokens[j * bs:(j + 1) * bs], h)
            if h not in keys:
                missing.append(i)
        if missing and before["snapshots_evicted"] == 0:
            msg += (f"\n  上一轮结束时第 {missing} 条在边界 {[ends[i] for i in missing]}（decode 算到的）没有快照，"
                    f"也没有逐出过任何快照\n  看起来像易错点：{DECODE_NEVER}")
        elif missing:
            msg += f"\n  上一轮结束时第 {missing} 条在边界 {[ends[i] for i in missing]} 没有快照（逐出过 {before['snapshots_evicted']} 份）"
        else:
            msg += ("\n  上一轮结束时这些边界的快照都在表里，这一轮却没有都从那里恢复：lookup 应返回 hits 里最长的、"
                    "前面的块都已算好、末块有快照的前缀")
        raise AssertionError(msg)


@point("多轮对话（qwen3_5_text）：打开缓存后每个输出与关闭缓存、与 HF generate 逐 token 一致；第 2 轮起每条请求都从上一轮回答里最后一个块边界的快照恢复")
def test_multiturn_qwen3_5():
    _multiturn("qwen3_5_text")
    record_case("engine:multiturn-qwen3_5")


@point("多轮对话（qwen3_5_moe_text）：同上，MoE 混合模型")
def test_multiturn_qwen3_5_moe():
    _multiturn("qwen3_5_moe_text")
    record_case("engine:multiturn-qwen3_5_moe")


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
    with _engine_watch(r):
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
    record_case("engine:shared-prompt-same-step")


@point("预算很小（num_state_snapshots=2）：按 LRU 逐出，快照数不超过预算，输出与关闭缓存一致")
def test_small_budget():
    e05 = impl("e05_engine")
    r = Rand()
    folder, _ = _model("qwen3_5_text", r.seed)
    bs = r.choice([2, 4])
    kw = dict(block_size=bs, max_num_seqs=3, max_num_batched_tokens=r.int(12, 24))
    with _engine_watch(r):
        llm = e05.LLM(str(folder), enable_prefix_caching=True, num_state_snapshots=2, **kw)
        log = _chat(llm, r, convs=3, turns=2, bs=bs)
    off = _replay(e05.LLM(str(folder), enable_prefix_caching=False, **kw), log)
    assert [outs for _, outs, *_ in log] == off, f"2 份快照的预算下，打开缓存的输出与关闭缓存不同；{r}"
    stats = llm.stats
    assert stats["state_snapshots"] <= 2, f"预算 2 份，却存着 {stats['state_snapshots']} 份（stats={stats}）；{r}"
    assert stats["snapshots_evicted"] > 0, f"6 条请求、2 份预算却从没逐出过（stats={stats}）；{r}"
    record_case("engine:small-budget")


@point("抢占与 abort：KV 池很小时发生抢占、输出与关闭缓存一致；abort 一条算到一半的请求后 block、GDN 槽位全部归还，它已算好的快照仍可命中")
def test_preemption_and_abort():
    e05 = impl("e05_engine")
    r = Rand()
    folder, _ = _model("qwen3_5_text", r.seed)
    bs = 4        # prompts of 4-5 blocks growing by 2: two fit in 10 blocks, and then one must yield
    kw = dict(block_size=bs, max_num_seqs=3, max_num_batched_tokens=16, num_kvcache_blocks=10)
    with _engine_watch(r):
        llm = e05.LLM(str(folder), enable_prefix_caching=True, **kw)
        log = _chat(llm, r, convs=3, turns=2, bs=bs, system=3 * bs + 1, message=bs, new=8)
    off = _replay(e05.LLM(str(folder), enable_prefix_caching=False, **kw), log, new=8)
    assert [outs for _, outs, *_ in log] == off, f"KV 池 {kw['num_kvcache_blocks']} 块、发生抢占时打开缓存的输出与关闭缓存不同；{r}"
    stats = llm.stats
    assert stats["preemptions"] > 0, f"KV 池只有 {kw['num_kvcache_blocks']} 块却没有发生抢占（stats={stats}）"
    pool = llm.runner.gdn_pool
    assert stats["free_blocks"] == stats["total_blocks"], f"结束后 block 没有全部归还（stats={stats}）"
    assert len(pool.free_slots) == kw["max_num_seqs"] and not pool.slot_of, f"结束后 GDN 槽位没有全部归还：{pool.slot_of}"

    # abort a request in the middle of its prefill: nothing of it stays but the snapshots of what it computed
    big = e05.LLM(str(folder), enable_prefix_caching=True, block_size=bs, max_num_seqs=2, max_num_batched_tokens=8)
    prompt = r.randint(1, 64, (5 * bs + 2,)).tolist()
    rid = big.add_request(prompt, _greedy())
    with _engine_watch(r):
        big.step()
        big.step()                                            # two chunks of 8: 16 tokens, two snapshots
    big.abort(rid)
    stats, pool = big.stats, big.runner.gdn_pool
    assert stats["free_blocks"] == stats["total_blocks"], f"abort 后 block 没有全部归还（stats={stats}）"
    assert not pool.slot_of and not big.block_manager.shared_tokens, "abort 后 GDN 槽位或 shared_tokens 还留着"
    assert big.scheduler.is_finished(), "abort 后请求还在 waiting / running 里"
    with _engine_watch(r):
        again = big.generate([prompt], _greedy())[0].token_ids
    want = e05.LLM(str(folder), enable_prefix_caching=False, block_size=bs).generate([prompt], _greedy())[0].token_ids
    assert again == want, f"abort 之后同一条 prompt 从快照恢复，输出 {again}，关闭缓存为 {want}；{r}"
    assert big.stats["snapshot_hits"] >= 1, f"abort 前已算好 16 个 token、拍了快照，再来同一条 prompt 应命中（stats={big.stats}）"
    record_case("engine:preemption")
    record_case("engine:abort")
