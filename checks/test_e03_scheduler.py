"""Checks for E03 · Scheduler (lessons/e03_scheduler.md).

There is no HF module to compare with: a scheduler is graded by scenarios and invariants. Every check
drives the learner's Scheduler with the reference BlockManager (e02) and a deterministic fake model
that, like a real one, first stores this step's tokens into their KV slots (through the block tables)
and then reads each sequence's whole context back from the cache; its next token is a hash of that
context. So a token computed twice, a position never computed, or a stale block all change the output,
and recompute after preemption must reproduce exactly the tokens of an unconstrained run.
After every step the harness checks the invariants of the card (budget, max_num_seqs, decodes first,
chunk bookkeeping, preemption of the newest, no starvation, no leak) and names the 易错点 it resembles.
"""

from __future__ import annotations

from checks.kit import Rand, impl, point, record_case

MODULE = "e03_scheduler"
VOCAB = 50
MISTAKE = "\n  看起来像易错点："

M_WHOLE_PROMPT = "把整段 prompt 计入预算 / num_scheduled_tokens：应只算未命中 prefix cache 的 num_tokens - num_cached_tokens"
M_SAMPLE_PARTIAL = "部分 prefill 块之后采样了 token：prompt 还没算完时这一步的 logits 不是“下一个 token”"
M_PREEMPT_OLDEST = "抢占了最老的请求而不是最新的（running[-1]）"
M_PREEMPT_LEAK = "抢占时忘了释放块（deallocate）或把 num_cached_tokens 清零：块泄漏，重算时位置也不对"
M_PREEMPT_BACK = "被抢占的请求应放回 waiting 队首（appendleft），而不是队尾"
M_PREFILL_FIRST = "先接纳 prefill 再排 decode：预算被 prefill 用光，running 的 decode 被饿死"
M_DECODE_FREE = "decode 没有从预算里扣掉：每个 decode 也占 max_num_batched_tokens 里的 1 个 token（budget -= 1）"
M_MAX_SEQS = "没有检查 max_num_seqs：接纳新请求前要看 len(running) < max_num_seqs"
M_MAX_TOKENS = "max_tokens 差一：第 max_tokens 个 completion token 追加后就要结束（>=，不是 >）"
M_NO_SLOT = "decode 的新 token 进入新块时没有 can_append → may_append（块不够就抢占）"
M_NOT_ADVANCED = "postprocess 没有把 num_cached_tokens 推进 num_scheduled_tokens：下一块又从旧位置开始"
M_CHUNK_OFF = "关闭 chunked prefill 时仍按剩余预算切块：整段放不下就该等下一步"
M_CHUNK_OFF_PROMPT = ("关掉 chunked prefill 时，被抢占过的序列重新接纳时被切成了块：预算按 prompt 长度（num_prompt_tokens）"
                      "而不是 num_tokens（prompt + 已生成）算了")
M_REJECT = "add 只看了 prompt：请求最长会长到 min(prompt + max_tokens, max_model_len)，KV 池放不下就该拒绝"
M_CEIL = "add 的块数没有向上取整：最长 L 个 token 要 ceil(L / block_size) = (L + block_size - 1) // block_size 块"
M_SKIP_BREAK = ("以为没算完的 prefill 总在最后：遇到它就 break 了，排在它后面的序列没有处理"
                "（第 1 段的 decode 循环和 postprocess 都应 continue 跳过它）")
M_YIELD_GOES_ON = "需要块的序列自己被抢占（让出）之后没有停下，又去抢占了更老的请求（if victim is seq: break）"
M_ADMIT_AFTER_PREEMPT = ("发生抢占的那一步还接纳了请求：刚被赶出去的请求马上又把块抢回来；本步有抢占就不接纳 waiting"
                         "（vLLM 的 if not preempted_reqs）")
M_PREEMPT_ONCE = "只抢占一次就 may_append：被抢占的请求的块可能还被别人引用、一块也没腾出来，要一直 can_append → 抢占，直到有空闲块"


def fail(message: str, mistake: str | None = None, rand: Rand | None = None):
    seed = f"；{rand}" if rand is not None else ""
    raise AssertionError(message + seed + (MISTAKE + mistake if mistake else ""))


def next_token(context: list, vocab: int = VOCAB) -> int:
    """The fake model: a deterministic hash of the whole context."""
    h = 0
    for t in context:
        h = (h * 1000003 + t + 1) % (2**61 - 1)
    return h % vocab


def reference_tokens(prompt: list[int], params, config) -> list[int]:
    """The unconstrained run: one request alone, one token per step, the card's finishing rules."""
    tokens = list(prompt)
    while True:
        t = next_token(tokens)
        tokens.append(t)
        if ((t == config.eos_token_id and not params.ignore_eos) or t in params.stop_token_ids
                or len(tokens) - len(prompt) >= params.max_tokens or len(tokens) >= config.max_model_len):
            return tokens


class Harness:
    """A Scheduler under test, the reference BlockManager, and the fake model; checks every step."""

    def __init__(self, rand: Rand, *, block_size: int, num_blocks: int, prefix_caching: bool = True, **config):
        self.m, self.e02, self.e01 = impl(MODULE), impl("e02_block_manager"), impl("e01_sampling")
        self.r, self.bs = rand, block_size
        self.e02.Sequence.block_size = block_size
        self.bm = self.e02.BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.config = self.m.SchedulerConfig(**config)
        self.sched = self.m.Scheduler(self.config, self.bm)
        self.kv: dict[int, int] = {}          # slot -> token id written there by the fake model
        self.names: dict[int, str] = {}
        self.seqs: list = []
        self.num_steps = 0
        self.free_after_schedule = num_blocks
        self.preempted: list[str] = []        # names, in the order the harness saw them preempted
        # chunked prefill off: a waiting head whose prompt alone exceeded the budget left waited although seats and
        # blocks were free, so the scheduler does compare the budget with the whole prompt (it is not simply chunking)
        self.prompt_waited = False

    def name(self, seq) -> str:
        return self.names.get(seq.seq_id, f"seq{seq.seq_id}")

    def add(self, name: str, prompt: list[int], **params):
        seq = self.e02.Sequence(list(prompt), self.e01.SamplingParams(**params))
        self.names[seq.seq_id] = name
        self.sched.add(seq)
        self.seqs.append(seq)
        return seq

    def step(self) -> tuple[list[tuple[str, int, int]], list[str]]:
        """One engine step. Returns the batch as (name, first position, num tokens) and the finished names."""
        s = self.sched
        running = list(s.running)
        waiting = list(s.waiting)
        remaining = {id(q): q.num_tokens - q.num_cached_tokens for q in running}
        free, owed = self.bm.num_free_blocks, sum(len(q.block_table) < q.num_blocks for q in running)
        batch = s.schedule()
        self.num_steps += 1
        self.free_after_schedule = self.bm.num_free_blocks
        self._check_batch(batch, running, waiting, remaining, free, owed)
        entries = [(self.name(q), q.num_cached_tokens, q.num_scheduled_tokens) for q in batch]
        sizes = [(q, q.num_tokens, q.num_cached_tokens, q.num_cached_tokens + q.num_scheduled_tokens) for q in batch]
        tokens = self._model(batch)
        finished = s.postprocess(batch, tokens)
        self._check_postprocess(sizes, finished)
        return entries, [self.name(q) for q in finished]

    def run(self, max_steps: int = 5000, arrivals=None) -> None:
        """Step until every request finished; arrivals(step) may add requests before a step."""
        while True:
            if arrivals is not None:
                arrivals(self.num_steps + 1)
            if self.sched.is_finished() and (arrivals is None or getattr(arrivals, "done", True)):
                break
            if self.num_steps >= max_steps:
                fail(f"{max_steps} 步后仍有请求没完成（waiting {len(self.sched.waiting)} 个，running "
                     f"{len(self.sched.running)} 个）：死锁或饥饿", rand=self.r)
            self.step()
        self.check_no_leak()

    def check_no_leak(self) -> None:
        total = len(self.bm.blocks)
        if self.bm.num_free_blocks != total or self.bm.used_block_ids:
            held = {self.name(q): list(q.block_table) for q in self.seqs if q.block_table}
            fail(f"所有请求都结束了，但只有 {self.bm.num_free_blocks}/{total} 个块回到空闲链表（仍被持有：{held}）",
                 "结束或抢占时没有释放块（deallocate）", self.r)

    # --- the fake model: store this step's KV, then read every context back through the block table
    def _slot(self, seq, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def _model(self, batch) -> list[int]:
        for q in batch:
            for pos in range(q.num_cached_tokens, q.num_cached_tokens + q.num_scheduled_tokens):
                self.kv[self._slot(q, pos)] = q.token_ids[pos]
        tokens = []
        for q in batch:
            end = q.num_cached_tokens + q.num_scheduled_tokens
            context = [self.kv.get(self._slot(q, pos)) for pos in range(end)]
            if context != q.token_ids[:end]:
                pos = next(i for i in range(end) if context[i] != q.token_ids[i])
                fail(f"{self.name(q)}：位置 {pos} 从 KV cache（块 {q.block_table[pos // self.bs]}）读回的不是它的 token："
                     f"num_cached_tokens={q.num_cached_tokens} 声称已算过的位置其实没算过，或被别的请求覆盖了",
                     f"{M_PREEMPT_LEAK}；或 {M_NOT_ADVANCED}", self.r)
            tokens.append(next_token(context))
        return tokens

    # --- invariants after schedule()
    def _check_batch(self, batch, running, waiting, remaining, free, owed) -> None:
        s, cfg, r = self.sched, self.config, self.r
        RUNNING, WAITING = self.e02.SequenceStatus.RUNNING, self.e02.SequenceStatus.WAITING
        if not isinstance(batch, list):
            fail(f"schedule() 应返回 list[Sequence]，得到 {type(batch).__name__}", rand=r)
        if len({id(q) for q in batch}) != len(batch):
            fail("同一个序列在一个 batch 里出现了两次", rand=r)
        total = sum(q.num_scheduled_tokens for q in batch)
        if total > cfg.max_num_batched_tokens:
            decodes = [q for q in batch if remaining.get(id(q)) == 1 and q.num_scheduled_tokens == 1]
            hits_counted = [q for q in batch if q.num_cached_tokens and q.num_scheduled_tokens == q.num_tokens]
            mistake = (M_DECODE_FREE if decodes and total - len(decodes) <= cfg.max_num_batched_tokens else
                       M_WHOLE_PROMPT if hits_counted else None)
            fail(f"第 {self.num_steps} 步调度了 {total} 个 token，超过 max_num_batched_tokens={cfg.max_num_batched_tokens}"
                 f"（{[(self.name(q), q.num_scheduled_tokens) for q in batch]}）", mistake, r)
        if len(batch) > cfg.max_num_seqs or len(s.running) > cfg.max_num_seqs:
            fail(f"batch 有 {len(batch)} 个序列、running 有 {len(s.running)} 个，超过 max_num_seqs={cfg.max_num_seqs}",
                 M_MAX_SEQS, r)
        for q in batch:
            start, n = q.num_cached_tokens, q.num_scheduled_tokens
            if q.status != RUNNING or q not in s.running:
                later = running[running.index(q) + 1:] if q in running else []
                again = q.status == WAITING and q in running      # preempted in the step that scheduled it
                # every request newer than q was preempted before q: the one that needed a block (newer than q,
                # since q was scheduled already) preempted itself, and the loop went on to older ones
                fail(f"{self.name(q)} 在 batch 里，但不是 RUNNING / 不在 running 里"
                     + ("：它排进本步的 batch 之后又被抢占了" if again else ""),
                     M_YIELD_GOES_ON if again and later and all(x.status == WAITING for x in later) else None, r)
            if n < 1:
                fail(f"{self.name(q)} 的 num_scheduled_tokens={n}：batch 里每个序列至少算 1 个 token", rand=r)
            if start + n > q.num_tokens:
                fail(f"{self.name(q)} 从位置 {start} 起要算 {n} 个 token，但它只有 {q.num_tokens} 个 token",
                     M_WHOLE_PROMPT, r)
            if len(q.block_table) * self.bs < start + n:
                fail(f"{self.name(q)} 要算到位置 {start + n - 1}，但 block_table 只有 {len(q.block_table)} 个块"
                     f"（block_size={self.bs}）：这个位置没有 KV 槽位", M_NO_SLOT, r)
            if not cfg.enable_chunked_prefill and start + n < q.num_tokens:
                generated = q.num_tokens - q.num_prompt_tokens
                if q not in waiting or not generated:
                    fail(f"enable_chunked_prefill=False，但 {self.name(q)} 只算了 {n}/{q.num_tokens - start} 个待算 token",
                         M_CHUNK_OFF, r)
                # re-admitted after a preemption: its prompt alone fitting the budget left (the learner compared it with
                # num_prompt_tokens) tells it from no check at all only once a too-long prompt was seen waiting
                by_prompt = q.num_prompt_tokens - start <= n and self.prompt_waited
                fail(f"enable_chunked_prefill=False，但被抢占过的 {self.name(q)} 重新接纳时只算了 {n}/{q.num_tokens - start} 个"
                     f"待算 token：它要把 prompt {q.num_prompt_tokens} 个 + 已生成 {generated} 个 = {q.num_tokens} 个 token "
                     f"整段重算，剩余预算 {n} 放不下就该等下一步",
                     M_CHUNK_OFF_PROMPT if by_prompt else M_CHUNK_OFF if q.num_prompt_tokens - start > n else None, r)

        preempted = [q for q in running if q.status != RUNNING]
        if preempted:
            names = [self.name(q) for q in preempted]
            newest = [self.name(q) for q in running[len(running) - len(preempted):]]
            if names != newest:
                fail(f"第 {self.num_steps} 步被抢占的是 {names}，应是最新接纳的 {newest}（running 按接纳顺序：{[self.name(q) for q in running]}）",
                     M_PREEMPT_OLDEST, r)
            for q in preempted:
                if q.status != WAITING or q.block_table or q.num_cached_tokens:
                    fail(f"{self.name(q)} 被抢占后：status={q.status.name}，block_table={q.block_table}，"
                         f"num_cached_tokens={q.num_cached_tokens}（应为 WAITING、[]、0）", M_PREEMPT_LEAK, r)
            if list(s.waiting)[:len(preempted)] != preempted:
                fail(f"被抢占的 {names} 应按原顺序排在 waiting 最前面，waiting = {[self.name(q) for q in s.waiting]}",
                     M_PREEMPT_BACK, r)
            self.preempted += names

        in_batch = {id(q) for q in batch}
        for q in running:
            if remaining[id(q)] == 1 and q.status == RUNNING and id(q) not in in_batch:
                prefill_ate = (sum(x.num_scheduled_tokens for x in batch) == cfg.max_num_batched_tokens
                               and all(x.num_scheduled_tokens > 1 or id(x) not in remaining for x in batch))
                ahead = [x for x in running[:running.index(q)] if remaining[id(x)] > 1 and x.status == RUNNING]
                fail(f"第 {self.num_steps} 步 running 里的 decode {self.name(q)} 没被调度"
                     f"（batch：{[(self.name(x), x.num_scheduled_tokens) for x in batch]}"
                     + (f"；排在它前面的 {self.name(ahead[0])} 是没算完的 prefill" if ahead else "") + "）",
                     M_PREFILL_FIRST if prefill_ate else M_SKIP_BREAK if ahead and total < cfg.max_num_batched_tokens
                     else None, r)

        admitted = [q for q in waiting if id(q) in in_batch]
        if admitted != waiting[:len(admitted)]:
            fail(f"接纳了 {[self.name(q) for q in admitted]}，但 waiting 的顺序是 {[self.name(q) for q in waiting]}："
                 "后来的请求插了队（先来先服务，队首放不下就一起等）", rand=r)
        if waiting and not admitted and not preempted:
            head = waiting[0]
            left = cfg.max_num_batched_tokens - total
            if (not cfg.enable_chunked_prefill and head.num_prompt_tokens > left and len(s.running) < cfg.max_num_seqs
                    and self.bm.num_free_blocks >= head.num_blocks):
                self.prompt_waited = True
            fits = left >= (1 if cfg.enable_chunked_prefill else head.num_tokens)
            if fits and len(running) < cfg.max_num_seqs and free - owed >= head.num_blocks:
                fail(f"第 {self.num_steps} 步队首 {self.name(head)} 没被接纳，可是预算还剩 {left}、空闲块 {free - owed}"
                     f"（它最多要 {head.num_blocks} 个）、running {len(running)} < max_num_seqs：饥饿", rand=r)

    # --- invariants after postprocess()
    def _check_postprocess(self, sizes, finished) -> None:
        r = self.r
        FINISHED = self.e02.SequenceStatus.FINISHED
        done = {id(q) for q in finished}
        partial_before = None                                     # a partial chunk earlier in the batch
        for q, num_tokens, start, end in sizes:
            if end < num_tokens:                                  # a partial prefill chunk
                if q.num_tokens != num_tokens:
                    fail(f"{self.name(q)} 这一步只算到位置 {end - 1}（共 {num_tokens} 个 token），却追加了 token",
                         M_SAMPLE_PARTIAL, r)
                if q.num_cached_tokens != end:
                    fail(f"{self.name(q)} 算完位置 {end - 1} 后 num_cached_tokens 应为 {end}，得到 {q.num_cached_tokens}",
                         M_NOT_ADVANCED, r)
                partial_before = partial_before or q
                continue
            if id(q) not in done and q.num_cached_tokens != end:
                untouched = partial_before is not None and q.num_cached_tokens == start and q.num_tokens == num_tokens
                fail(f"{self.name(q)} 算完位置 {end - 1} 后 num_cached_tokens 应为 {end}，得到 {q.num_cached_tokens}"
                     + (f"（postprocess 根本没处理它：batch 里排在它前面的 {self.name(partial_before)} 是部分 prefill 块）"
                        if untouched else ""),
                     M_SKIP_BREAK if untouched else M_NOT_ADVANCED, r)
            if q.num_tokens != num_tokens + 1:
                fail(f"{self.name(q)} 的 token 全部算完，应追加 1 个采样出的 token（{num_tokens} → {num_tokens + 1}），"
                     f"得到 {q.num_tokens} 个", rand=r)
            if id(q) in done:
                if q.status != FINISHED or q.block_table or q in self.sched.running:
                    fail(f"{self.name(q)} 结束后应为 FINISHED、块已释放、不在 running 里", "结束时没有释放块 / 没移出 running", r)
            elif q.status == FINISHED:
                fail(f"{self.name(q)} 已是 FINISHED，但 postprocess 没有把它放进返回的列表", rand=r)

    def check_tokens(self) -> None:
        for q in self.seqs:
            ref = reference_tokens(q.prompt_token_ids, q.sampling_params, self.config)
            if q.token_ids != ref:
                got, want = q.num_completion_tokens, len(ref) - q.num_prompt_tokens
                mistake = M_MAX_TOKENS if got == want + 1 and q.token_ids[:len(ref)] == ref else None
                fail(f"{self.name(q)} 生成了 {got} 个 token {q.completion_token_ids}，无约束运行是 {want} 个 "
                     f"{ref[q.num_prompt_tokens:]}（max_tokens={q.sampling_params.max_tokens}）", mistake, self.r)


def _tokens(r: Rand, n: int) -> list[int]:
    return [r.int(1, VOCAB - 1) for _ in range(n)]


@point("单个请求：一步 prefill，之后每步 decode 1 个 token，到 max_tokens 结束并归还全部块")
def test_single_request():
    r = Rand()
    bs = r.choice([2, 4, 8])
    h = Harness(r, block_size=bs, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    prompt_len, max_tokens = r.int(3, 20), r.int(2, 8)
    h.add("A", _tokens(r, prompt_len), max_tokens=max_tokens, ignore_eos=True)
    log = []
    while not h.sched.is_finished() and h.num_steps < max_tokens + 3:
        log.append(h.step())
    expected = [([("A", 0, prompt_len)], [])] + [([("A", prompt_len + k, 1)], []) for k in range(max_tokens - 1)]
    expected[-1] = (expected[-1][0], ["A"])
    if log != expected:
        if len(log) == max_tokens + 1 and log[:-1] == [(b, []) for b, _ in expected]:
            fail(f"max_tokens={max_tokens} 的请求跑了 {len(log)} 步", M_MAX_TOKENS, r)
        fail(f"每步的 (请求, 起始位置, token 数) 与 结束的请求：\n  得到 {log}\n  期望 {expected}", rand=r)
    h.check_tokens()
    h.check_no_leak()
    record_case("single:prefill-decodes-finish-free")


@point("结束条件：eos（ignore_eos 时不算）、stop token、max_tokens、max_model_len")
def test_finishing_rules():
    r = Rand()
    prompt = _tokens(r, r.int(4, 10))
    first = reference_tokens(prompt, impl("e01_sampling").SamplingParams(max_tokens=3, ignore_eos=True),
                             impl(MODULE).SchedulerConfig(max_model_len=10**6))[len(prompt):]   # the 3 tokens it makes
    cases = [  # (label, config, params, expected number of completion tokens)
        ("eos", dict(eos_token_id=first[1]), dict(max_tokens=3), 2 if first[0] != first[1] else 1),
        ("ignore-eos", dict(eos_token_id=first[1]), dict(max_tokens=3, ignore_eos=True), 3),
        ("stop-token", dict(), dict(max_tokens=3, stop_token_ids=[first[0]]), 1),
        ("max-model-len", dict(max_model_len=len(prompt) + 2), dict(max_tokens=3), 2),
        ("max-tokens", dict(), dict(max_tokens=1), 1),
    ]
    for label, config, params, want in cases:
        config = dict(dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64), **config)
        h = Harness(r, block_size=4, num_blocks=16, **config)
        seq = h.add("A", prompt, **params)
        h.run(max_steps=8)
        if seq.num_completion_tokens != want:
            mistake = M_MAX_TOKENS if seq.num_completion_tokens == want + 1 == params["max_tokens"] + 1 else None
            fail(f"SchedulerConfig({config}) + SamplingParams({params})：应生成 {want} 个 token 后结束，"
                 f"得到 {seq.num_completion_tokens} 个 {seq.completion_token_ids}（模型会依次给出 {first}）", mistake, r)
        h.check_tokens()
        record_case(f"finish:{label}")


@point("continuous batching：别的请求在 decode 时接纳新请求，同一个 batch 里一起算")
def test_admits_while_decoding():
    r = Rand()
    h = Harness(r, block_size=4, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    la, lb, lc = r.int(2, 8), r.int(2, 8), r.int(2, 10)
    h.add("A", _tokens(r, la), max_tokens=6, ignore_eos=True)
    h.add("B", _tokens(r, lb), max_tokens=6, ignore_eos=True)
    log = [h.step()[0], h.step()[0]]
    h.add("C", _tokens(r, lc), max_tokens=3, ignore_eos=True)
    log.append(h.step()[0])
    expected = [[("A", 0, la), ("B", 0, lb)], [("A", la, 1), ("B", lb, 1)], [("A", la + 1, 1), ("B", lb + 1, 1), ("C", 0, lc)]]
    if sorted(log[2]) != sorted(expected[2]) or log[:2] != expected[:2]:
        fail(f"A、B 在 decode，第 3 步到达的 C 应在同一步被接纳：\n  得到 {log}\n  期望 {expected}", rand=r)
    h.run(max_steps=20)
    h.check_tokens()
    record_case("batching:admit-while-decoding")


@point("decode 优先：预算先给 running 的 decode，再给 prefill 块")
def test_decodes_before_prefill():
    r = Rand()
    budget = r.int(6, 10)
    h = Harness(r, block_size=4, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64)
    h.add("A", _tokens(r, 3), max_tokens=12, ignore_eos=True)
    h.add("B", _tokens(r, 2), max_tokens=12, ignore_eos=True)
    h.step()
    long_len = r.int(3 * budget, 4 * budget)
    h.add("C", _tokens(r, long_len), max_tokens=2, ignore_eos=True)
    batch, _ = h.step()
    want = [("A", 3, 1), ("B", 2, 1), ("C", 0, budget - 2)]
    if sorted(batch) != sorted(want):
        mistake = (M_DECODE_FREE if sorted(batch) == sorted([("A", 3, 1), ("B", 2, 1), ("C", 0, budget)]) else
                   M_PREFILL_FIRST if batch == [("C", 0, budget)] else None)
        fail(f"A、B 各要 decode 1 个 token，长 prompt C 只能拿剩下的 {budget - 2} 个：得到 {batch}，期望 {want}",
             mistake, r)
    h.run(max_steps=40)
    h.check_tokens()
    record_case("budget:decodes-first")


@point("chunked prefill：长 prompt 按预算切块，每块从上一块结束处接着算，块中间不采样")
def test_chunked_prefill():
    r = Rand()
    budget = r.int(4, 9)
    h = Harness(r, block_size=r.choice([2, 4, 8]), num_blocks=40, max_num_seqs=2, max_num_batched_tokens=budget,
                max_model_len=128)
    n = r.int(2 * budget + 1, 5 * budget)
    seq = h.add("A", _tokens(r, n), max_tokens=2, ignore_eos=True)
    chunks = []
    while seq.num_completion_tokens == 0 and h.num_steps < 20:
        batch, _ = h.step()
        chunks += [(start, k) for name, start, k in batch]
    want = [(i, min(budget, n - i)) for i in range(0, n, budget)]
    if chunks != want:
        fail(f"{n} 个 token 的 prompt、预算 {budget}：各块 (起始位置, token 数) 应为 {want}，得到 {chunks}", rand=r)
    h.run(max_steps=20)
    h.check_tokens()
    record_case("chunk:continues-no-sample-mid-prompt")

    # the decodes leave exactly 1 token of the budget: X is admitted with a 1-token chunk and continues 1 by 1
    budget = r.int(3, 8)
    h = Harness(r, block_size=r.choice([2, 4, 8]), num_blocks=80, max_num_seqs=budget, max_num_batched_tokens=budget,
                max_model_len=64)
    n = r.int(3, 8)
    for i in range(budget - 1):                            # one-token prompts: decodes from step 2 on
        h.add(f"D{i}", _tokens(r, 1), max_tokens=n + 2, ignore_eos=True)
    seq = h.add("X", _tokens(r, n), max_tokens=2, ignore_eos=True)
    chunks = []
    while seq.num_completion_tokens == 0 and h.num_steps < n + 5:
        batch, _ = h.step()
        chunks += [(start, k) for name, start, k in batch if name == "X"]
    want = [(i, 1) for i in range(n)]
    if chunks != want:
        fail(f"预算 {budget}，{budget - 1} 个 decode 每步只留下 1 个 token：{n} 个 token 的 X 应在第 1 步就被接纳、每步算 1 个，"
             f"各块 (起始位置, token 数) 应为 {want}，得到 {chunks}（预算 > 0 就切一块，n = min(剩余, 预算) 可以是 1）", rand=r)
    h.run(max_steps=40)
    h.check_tokens()
    record_case("chunk:budget-of-one")


@point("关闭 chunked prefill：放不下的 prompt 整段等到预算够的那一步，后来的请求不插队；被抢占过的按 prompt + 已生成的全部 token 算")
def test_no_chunking_waits():
    r = Rand()
    budget = r.int(16, 24)
    h = Harness(r, block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=budget,
                enable_chunked_prefill=False)
    h.add("A", _tokens(r, 3), max_tokens=3, ignore_eos=True)
    h.add("B", _tokens(r, 2), max_tokens=5, ignore_eos=True)
    h.step()
    h.add("C", _tokens(r, budget - 1), max_tokens=1, ignore_eos=True)     # needs the whole budget but one
    h.add("D", _tokens(r, 2), max_tokens=1, ignore_eos=True)
    log = []
    while not h.sched.is_finished() and h.num_steps < 30:
        log.append(h.step()[0])
    # A finishes in step 3; from step 4 only B decodes, and C (budget - 1 tokens) fits next to it
    start_c = next(i for i, b in enumerate(log) if any(e[0] == "C" for e in b)) + 2
    start_d = next(i for i, b in enumerate(log) if any(e[0] == "D" for e in b)) + 2
    if start_c != 4 or start_d < start_c:
        fail(f"C（{budget - 1} 个 token，预算 {budget}）第 2、3 步放不下（A、B 各占 1），第 4 步 A 已结束才整段放进去；"
             f"D 排在它后面不能先走：C 在第 {start_c} 步、D 在第 {start_d} 步被接纳。各步：{log}", rand=r)
    h.check_tokens()
    record_case("chunk-off:whole-prompt-waits-no-overtaking")

    # a preempted sequence is re-admitted whole too: prompt + generated, num_tokens in all, not just its prompt.
    # A, D, E and P fill the pool (1 + 1 + 1 + k blocks); in step s P's decode opens block k + 1 and P, the newest,
    # yields itself; E finishes in that step. In step s + 1 A and D decode, which leaves budget - 2 >= P's prompt
    # but < P's budget - 1 tokens (and its k + 1 blocks are free): P waits. A finishes in step s + 1, so in step
    # s + 2 only D decodes and P is prefilled again in one piece; it then reaches max_model_len and finishes.
    bs, k = r.choice([4, 8]), r.int(2, 3)
    budget = k * bs + 2                                     # = max_model_len
    p = r.int(budget - bs + 1, budget - 3)                 # P's prompt: k blocks; fits next to A, D, E, and next to 2 decodes
    s = budget - p                                          # P has budget - 1 tokens in step s, 3 <= s < bs
    first = h
    h = Harness(r, block_size=bs, num_blocks=k + 3, prefix_caching=False, max_num_seqs=4,
                max_num_batched_tokens=budget, max_model_len=budget, enable_chunked_prefill=False)
    h.prompt_waited = first.prompt_waited                  # the case above: a too-long prompt waited, no blind chunking
    h.add("A", _tokens(r, 1), max_tokens=s + 1, ignore_eos=True)
    h.add("D", _tokens(r, 1), max_tokens=s + 3, ignore_eos=True)
    h.add("E", _tokens(r, 1), max_tokens=s, ignore_eos=True)
    h.add("P", _tokens(r, p), max_tokens=budget, ignore_eos=True)
    got = []
    while not h.sched.is_finished() and h.num_steps < s + 8:
        batch, _ = h.step()
        got += [(h.num_steps, start, n) for name, start, n in batch if name == "P"]
    want = [(1, 0, p)] + [(i, p + i - 2, 1) for i in range(2, s)] + [(s + 2, 0, budget - 1)]
    if got != want or h.preempted != ["P"]:
        fail(f"关闭 chunked prefill，预算 = max_model_len = {budget}，block_size {bs}：P（prompt {p} 个）第 {s} 步有 "
             f"{budget - 1} 个 token（已生成 {budget - 1 - p} 个），decode 要开新块而池子已满，它是最新的、让出自己；"
             f"第 {s + 1} 步 A、D 两个 decode 之后只剩 {budget - 2} 个预算，放得下它的 prompt、放不下它的 {budget - 1} 个 "
             f"token，它整段等待；第 {s + 2} 步 A 已结束，{budget - 1} 个 token 整段重新 prefill。P 的 (步, 起始位置, token 数) "
             f"应为 {want}，得到 {got}；被抢占的应为 ['P']，得到 {h.preempted}", rand=r)
    h.check_tokens()
    record_case("chunk-off:preempted-counts-num-tokens")


@point("max_num_seqs：running 与 batch 都不超过上限，有请求结束就接纳下一个")
def test_max_num_seqs():
    r = Rand()
    limit = r.int(1, 3)
    h = Harness(r, block_size=4, num_blocks=64, max_num_seqs=limit, max_num_batched_tokens=64, max_model_len=64)
    for i in range(limit + 2):
        h.add(f"R{i}", _tokens(r, r.int(2, 6)), max_tokens=r.int(1, 4), ignore_eos=True)
    h.run(max_steps=40)
    h.check_tokens()
    record_case("max_num_seqs:limit-then-next")


@point("prefix cache 命中：只把未命中的 token 计入预算，命中部分不重算")
def test_prefix_hits_count_only_uncached():
    r = Rand()
    bs = 4
    h = Harness(r, block_size=bs, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    shared = _tokens(r, 3 * bs)
    h.add("A", shared, max_tokens=1, ignore_eos=True)
    h.run(max_steps=10)                                    # A computed (and freed) its 3 blocks: they stay cached
    tail = r.int(1, 4)
    h.add("B", shared[:2 * bs] + _tokens(r, tail), max_tokens=2, ignore_eos=True)   # hits A's first 2 blocks
    h.add("C", _tokens(r, 8 - tail), max_tokens=2, ignore_eos=True)
    batch, _ = h.step()
    want = [("B", 2 * bs, tail), ("C", 0, 8 - tail)]
    if sorted(batch) != sorted(want):
        fail(f"B 命中 A 的前 {2 * bs} 个 token，只需算 {tail} 个；预算 8 还够 C 的 {8 - tail} 个：得到 {batch}，期望 {want}",
             M_WHOLE_PROMPT, r)
    h.run(max_steps=10)
    h.check_tokens()
    record_case("prefix-hit:only-uncached-in-budget")


@point("抢占：块不够时最新的请求让出块、回到 waiting 队首，重算后 token 与无约束运行完全一致")
def test_preemption_by_recompute():
    r = Rand()
    bs = 4
    h = Harness(r, block_size=bs, num_blocks=6, max_num_seqs=3, max_num_batched_tokens=32, max_model_len=64)
    for name in "ABC":                                     # 2 blocks each: the pool is full after step 1
        h.add(name, _tokens(r, 2 * bs - r.int(1, 2)), max_tokens=bs + 2, ignore_eos=True)
    h.run(max_steps=60)
    if h.sched.num_preemptions < 1 or not h.preempted:
        fail(f"6 个块、3 个各占 2 块的请求一起 decode，跨块时必须抢占：num_preemptions={h.sched.num_preemptions}",
             M_NO_SLOT, r)
    if h.preempted[0] != "C":
        fail(f"第一次被抢占的是 {h.preempted[0]}，应是最新的 C", M_PREEMPT_OLDEST, r)
    if h.sched.num_preemptions != len(h.preempted):
        fail(f"num_preemptions={h.sched.num_preemptions}，但实际抢占了 {len(h.preempted)} 次（{h.preempted}）", rand=r)
    h.check_tokens()
    record_case("preempt:newest-to-front-recompute")

    # no admission in a step that preempted, even when the head of waiting (the request just preempted) would fit:
    # V's prompt is S's prompt plus the token S generates first, so V runs one token ahead of S with the same
    # tokens. V fills its last block first, then S fills the same content and registers it last (the entry points at
    # S's block). In that step V (newest) needs a new block and the pool is full: V yields itself, freeing its own
    # block; re-admitted it would hit every full block on S's blocks (held, ref > 0) and need only the one free block.
    bs, k = r.choice([4, 8]), r.int(1, 2)
    p = _tokens(r, k * bs + r.int(1, bs - 2))
    pool = k + 2                                           # S: k shared + 1, V: 1 of its own: full after step 1
    h = Harness(r, block_size=bs, num_blocks=pool, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    s_seq = h.add("S", p, max_tokens=pool * bs - len(p), ignore_eos=True)
    v = h.add("V", p + [next_token(p)], max_tokens=pool * bs - len(p) - 1, ignore_eos=True)
    critical = (k + 1) * bs - len(p) + 1                   # the step in which S's last token fills block k
    for step in range(1, critical + 1):
        batch, _ = h.step()
        if step < critical and h.preempted:
            fail(f"检查本身的问题：第 {step} 步就发生了抢占 {h.preempted}", rand=r)
    # (a V preempted and re-admitted in the same step is RUNNING again: the harness's list misses it, the count not)
    readmitted = (h.sched.num_preemptions == 1 and not h.preempted and s_seq in h.sched.running
                  and any(name == "V" for name, _, _ in batch))
    if readmitted:
        fail(f"第 {critical} 步 V（最新的）让出自己之后又在同一步被重新接纳了：发生抢占的这一步不应再接纳 waiting 的请求"
             f"（哪怕 V 重新接纳时只要 1 个空闲块）。得到 batch {batch}", M_ADMIT_AFTER_PREEMPT, r)
    if h.preempted != ["V"] or list(h.sched.waiting) != [v]:
        fail(f"第 {critical} 步 S 写满第 {k} 块、V 的新 token 要开新块而池子已满：最新的 V 应让出自己、留在 waiting 队首，"
             f"得到被抢占 {h.preempted}、batch {batch}、waiting {[h.name(q) for q in h.sched.waiting]}", rand=r)
    if batch != [("S", s_seq.num_tokens - 2, 1)] and sorted(batch) != [("S", s_seq.num_tokens - 2, 1)]:
        fail(f"第 {critical} 步的 batch 应只有 S 的 decode，得到 {batch}", rand=r)
    h.run(max_steps=80)
    h.check_tokens()
    record_case("preempt:no-admission-in-that-step")


@point("抢占腾不出块：块还被别人引用时继续抢占下一个最新的；需要块的正是最新的，就让出自己并停下")
def test_preemption_that_frees_nothing():
    r = Rand()
    bs = r.choice([2, 4])
    status = impl("e02_block_manager").SequenceStatus
    WAITING, RUNNING = status.WAITING, status.RUNNING

    def hold_blocks_of(h, seq):
        """Someone outside the scheduler holds seq's blocks (a sequence allocated directly in the block manager
        that hits all of them): preempting seq frees none of them."""
        holder = h.e02.Sequence(list(seq.token_ids[:seq.num_prompt_tokens]) + [r.int(1, VOCAB - 1)])
        h.bm.allocate(holder)
        if holder.num_cached_tokens != seq.num_prompt_tokens or h.bm.num_free_blocks:
            fail(f"检查本身的问题：外部持有者应命中 {seq.num_prompt_tokens} 个 token、用掉最后一个空闲块", rand=r)
        return holder

    def critical_step(h, want_batch, want_preempted, stopped_early=lambda: False):
        try:
            batch, _ = h.step()
        except KeyError as exc:                            # e02's _allocate_block: popitem of an empty free list
            fail(f"第 {h.num_steps + 1} 步 schedule() 在没有空闲块时分配了块（KeyError: {exc}）："
                 f"抢占之后空闲块可能仍是 0，may_append 之前要再问 can_append",
                 M_PREEMPT_ONCE if stopped_early() else None, r)
        if sorted(batch) != sorted(want_batch) or h.preempted != want_preempted:
            fail(f"第 {h.num_steps} 步：batch 应为 {want_batch}、被抢占的（按 running 顺序）应为 {want_preempted}；"
                 f"得到 batch {batch}、被抢占 {h.preempted}", rand=r)

    # 1) S (oldest) needs a block; the newest V frees nothing when preempted (its blocks are held by someone
    #    else), so M is preempted too, and only then S gets its block
    j, k = r.int(1, 2), r.int(1, 2)
    lm = r.int(bs + 1, 2 * bs - 1)                         # M: 2 blocks, its next token still fits
    h = Harness(r, block_size=bs, num_blocks=j + 2 + k + 1, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    h.add("S", _tokens(r, j * bs), max_tokens=bs + 1, ignore_eos=True)   # its first decode token opens a block
    m = h.add("M", _tokens(r, lm), max_tokens=bs, ignore_eos=True)
    v = h.add("V", _tokens(r, k * bs), max_tokens=bs, ignore_eos=True)
    h.step()
    holder = hold_blocks_of(h, v)
    critical_step(h, [("S", j * bs, 1)], ["M", "V"],
                  stopped_early=lambda: v.status == WAITING and m.status == RUNNING)   # V preempted, M not
    h.bm.deallocate(holder)
    h.run(max_steps=60)
    h.check_tokens()
    record_case("preempt:frees-nothing-next-newest")

    # 2) the newest V needs a block and yields itself, but frees nothing: it stops there; A (older) keeps running
    la, k = r.int(bs + 1, 2 * bs - 1), r.int(1, 3)
    h = Harness(r, block_size=bs, num_blocks=2 + k + 1, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    h.add("A", _tokens(r, la), max_tokens=bs, ignore_eos=True)
    v = h.add("V", _tokens(r, k * bs), max_tokens=bs, ignore_eos=True)
    h.step()
    holder = hold_blocks_of(h, v)
    critical_step(h, [("A", la, 1)], ["V"])
    if list(h.sched.waiting) != [v]:
        fail(f"V 让出自己后应在 waiting 队首，waiting = {[h.name(q) for q in h.sched.waiting]}", rand=r)
    h.bm.deallocate(holder)
    h.run(max_steps=60)
    h.check_tokens()
    record_case("preempt:yields-itself-and-stops")


@point("切短的 prefill 块（e07 的 HybridScheduler）：没算完的 prefill 不在最后时，后面的 decode 与序列照常处理")
def test_prefill_cut_short_by_a_subclass():
    r = Rand()
    bs = r.choice([2, 4])
    h = Harness(r, block_size=bs, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)

    class CutAtBlockEnd(h.m.Scheduler):
        """As e07's HybridScheduler: after schedule(), every prefill chunk ends at the next block boundary."""

        def schedule(self):
            batch = super().schedule()
            for q in batch:
                if q.num_scheduled_tokens > 1:
                    start = q.num_cached_tokens
                    q.num_scheduled_tokens = min(q.num_scheduled_tokens, (start // bs + 1) * bs - start)
            return batch

    h.sched = CutAtBlockEnd(h.config, h.bm)
    lx, ly = r.int(bs + 2, 3 * bs), r.int(2, bs)
    h.add("X", _tokens(r, lx), max_tokens=3, ignore_eos=True)      # cut to one block: a prefill still in progress
    h.add("Y", _tokens(r, ly), max_tokens=3, ignore_eos=True)      # whole in one chunk: decodes from step 2 on
    log = [h.step()[0], h.step()[0]]
    want = [[("X", 0, bs), ("Y", 0, ly)], [("Y", ly, 1), ("X", bs, min(bs, lx - bs))]]
    if [sorted(b) for b in log] != [sorted(b) for b in want]:
        fail(f"X 的 prefill 块被切短（每块到块边界为止），它在 running 里排在 Y 前面却还没算完：前两步应为 {want}，得到 {log}",
             rand=r)
    h.run(max_steps=30)
    h.check_tokens()
    record_case("cut:partial-prefill-not-last")


@point("add 拒绝 KV 池永远放不下的请求（ValueError），调度器照常工作")
def test_rejects_what_never_fits():
    r = Rand()
    bs, num_blocks = 4, r.int(3, 6)
    h = Harness(r, block_size=bs, num_blocks=num_blocks, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    capacity = bs * num_blocks
    grow = r.int(1, 3)
    cases = [("prompt-too-long", capacity + bs + r.int(0, 2), 1, None),              # the prompt alone does not fit
             ("grows-past-pool", capacity - 2, r.int(bs + 2, 2 * bs + 2), M_REJECT),  # fits, but grows past the pool
             ("one-block-too-many", capacity + 1 - grow, grow, M_CEIL)]  # grows to capacity + 1 tokens
    for label, prompt_len, max_tokens, mistake in cases:
        seq = h.e02.Sequence(_tokens(r, prompt_len), h.e01.SamplingParams(max_tokens=max_tokens))
        try:
            h.sched.add(seq)
        except ValueError:
            record_case(f"add:reject-{label}")
            continue
        longest = prompt_len + max_tokens
        fail(f"KV 池 {num_blocks}×{bs} = {capacity} 个 token；prompt {prompt_len} + max_tokens {max_tokens} 的请求最长 "
             f"{longest} 个 token = {-(-longest // bs)} 块，应被 add 拒绝（ValueError），否则它会永远等块或抢占自己",
             mistake, r)
    if h.sched.waiting or h.sched.running:
        fail("被拒绝的请求不应进入 waiting / running", rand=r)
    h.add("ok", _tokens(r, capacity - 3), max_tokens=3, ignore_eos=True)   # exactly the pool: accepted and served
    h.run(max_steps=10)
    h.check_tokens()
    record_case("add:exact-pool-served")


@point("随机模拟：全部完成且与无约束运行一致，预算与上限从不超，无饥饿，块全部归还")
def test_random_simulation():
    r = Rand()
    bs = r.choice([2, 4, 8])
    num_blocks = r.int(6, 20)
    max_model_len = r.int(12, 40)
    chunked = r.py.random() < 0.7
    max_num_seqs = r.int(1, 6)
    budget = r.int(max_num_seqs, 40) if chunked else r.int(max_model_len, max_model_len + 16)
    # prompts share a few prefixes, so prefix-cache hits (and recompute after preemption) read KV written by others
    h = Harness(r, block_size=bs, num_blocks=num_blocks, prefix_caching=True, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget, max_model_len=max_model_len, eos_token_id=0,
                enable_chunked_prefill=chunked)
    prefixes = [_tokens(r, r.int(0, 2 * bs)) for _ in range(3)]
    requests = []
    for _ in range(r.int(200, 300)):
        prompt = (r.choice(prefixes) + _tokens(r, r.int(1, 16)))[:max_model_len - 1]
        max_tokens = r.int(1, 16)
        while -(-min(len(prompt) + max_tokens, max_model_len) // bs) > num_blocks:   # keep it servable
            prompt, max_tokens = prompt[:max(1, len(prompt) - bs)], max(1, max_tokens - bs)
        stop = [r.int(1, VOCAB - 1)] if r.py.random() < 0.3 else []
        requests.append((prompt, dict(max_tokens=max_tokens, ignore_eos=r.py.random() < 0.3, stop_token_ids=stop)))

    pending = list(requests)

    def arrivals(step):
        for _ in range(r.choice([0, 0, 1, 1, 2, 3])):
            if pending:
                prompt, params = pending.pop(0)
                h.add(f"R{len(requests) - len(pending) - 1}", prompt, **params)
        arrivals.done = not pending

    arrivals.done = False
    h.run(max_steps=20000, arrivals=arrivals)
    if len(h.seqs) != len(requests) or not all(q.is_finished for q in h.seqs):
        fail(f"只有 {sum(q.is_finished for q in h.seqs)}/{len(requests)} 个请求完成", rand=r)
    h.check_tokens()
    record_case("random:matches-unconstrained")


@point("卡片例子：逐步图的 8 步调度表（chunked prefill、decode 优先、两次抢占、重算）")
def test_card_example():
    r = Rand()
    h = Harness(r, block_size=4, num_blocks=6, prefix_caching=False, max_num_seqs=3, max_num_batched_tokens=8,
                max_model_len=64)
    h.add("A", [1, 2, 3, 4, 5], max_tokens=5)
    h.add("B", list(range(11, 21)), max_tokens=4)
    want = [
        ([("A", 0, 5), ("B", 0, 3)], [], 1),
        ([("A", 5, 1), ("B", 3, 7)], [], 1),
        ([("A", 6, 1), ("B", 10, 1), ("C", 0, 3)], [], 0),
        ([("A", 7, 1), ("B", 11, 1), ("C", 3, 1)], [], 0),
        ([("A", 8, 1)], ["A"], 3),
        ([("B", 0, 8)], [], 2),
        ([("B", 8, 5), ("C", 0, 3)], ["B"], 0),
        ([("C", 3, 2)], ["C"], 4),
    ]
    got = []
    while not h.sched.is_finished() and h.num_steps < 12:
        if h.num_steps == 1:
            h.add("C", [21, 22, 23], max_tokens=3)
        batch, finished = h.step()
        got.append((batch, finished, h.free_after_schedule))
    for i, (g, w) in enumerate(zip(got, want), 1):
        if g != w:
            fail(f"卡片例子第 {i} 步：得到 (batch, 结束, 空闲块) = {g}，卡片上是 {w}\n  全部：{got}", rand=r)
    if len(got) != len(want):
        fail(f"卡片例子应在 {len(want)} 步内跑完，得到 {len(got)} 步：{got}", rand=r)
    if h.sched.num_preemptions != 2 or sorted(h.preempted) != ["B", "C"] or h.sched.num_steps != 8:
        fail(f"卡片例子：第 5 步先抢占 C、再抢占 B（B 自己成了最新的），num_preemptions=2，num_steps=8；"
             f"得到 抢占 {h.preempted}、num_preemptions={h.sched.num_preemptions}、num_steps={h.sched.num_steps}", rand=r)
    h.check_tokens()
    tokens = {h.name(q): q.completion_token_ids for q in h.seqs}
    if tokens != {"A": [27, 26, 34, 8, 12], "B": [3, 16, 15, 47], "C": [41, 6, 49]}:
        fail(f"卡片例子的 completion token 应为 A [27, 26, 34, 8, 12]、B [3, 16, 15, 47]、C [41, 6, 49]，得到 {tokens}", rand=r)
    record_case("card:8-steps")
