"""Checks for E06 · serving (lessons/e06_serving.md): a live server on 127.0.0.1, driven by the official openai client.

Each check process starts the server in-process (uvicorn on a thread, an ephemeral port) over the offline tiny
dummy Qwen3 with the byte tokenizer; the oracle is `LLM.generate` on a second engine with identical weights and
the same per-request seed. Without fastapi / uvicorn / openai / httpx every check is skipped (never passed).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
import time

import pytest
import transformers  # noqa: F401  imported once per process, outside every check's time limit (CONTRIBUTING)
from transformers import PreTrainedTokenizerFast, Qwen3Config  # noqa: F401  the dummy model's config and tokenizer

from checks import hf_models
from checks.kit import Rand, impl, point, record_case
from course.grader import registry

MODULE = "e06_serving"
MISSING = registry.get("e06").missing_packages
MAX_MODEL_LEN = 1024
MODEL = "tiny"
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(bool(MISSING), reason=f"e06 需要 {', '.join(MISSING)}：pip install fastapi uvicorn "
                                                       "openai httpx（见 pyproject.toml），这台机器上跳过")]


def _e05_llm(family: str = "qwen3", **kwargs):
    """The dummy Qwen3 of ./check.sh run, or a tiny hybrid (Gated DeltaNet) model; both with the byte tokenizer."""
    from course.runtime.serve import dummy_llm
    if family == "qwen3":
        return dummy_llm(impl("e05_engine"), max_model_len=MAX_MODEL_LEN, **kwargs)
    from course.runtime.tiny_tokenizer import byte_tokenizer
    tok = byte_tokenizer()
    config = hf_models.tiny_config(family, Rand(0), vocab=len(tok), layers=2)     # 512 positions
    return impl("e05_engine").LLM(config, tokenizer=tok, max_model_len=512, **kwargs)


_PROBED = []


def _probe() -> None:
    """Call every task once in-process (no HTTP) so that a stub reports 未实现 instead of hanging a client."""
    if _PROBED:
        return
    m = impl(MODULE)
    llm = _e05_llm(max_num_seqs=2, num_kvcache_blocks=16)
    m.parse_request({"model": "x", "prompt": [1, 2]}, False, llm.tokenizer, "x", 64)
    m.TextStream(llm.tokenizer, []).push(40, True)
    engine = m.AsyncEngine(llm)
    engine.running = False
    engine._apply_commands()
    engine._loop()
    engine.running = True
    engine.start()

    async def drain(agen):
        if inspect.iscoroutine(agen):                 # a task still bare: no `yield` yet, so only a coroutine
            await agen
        return [item async for item in agen]

    async def flow():
        for task in (m.run_request, lambda *a: m.sse_frames(*a, "x")):
            req = m.parse_request({"model": "x", "prompt": [1, 2], "max_tokens": 2, "stream": True}, False,
                                  llm.tokenizer, "x", 64)
            await drain(task(engine, await engine.add(req.prompt_ids, req.params), req))

    try:
        asyncio.run(asyncio.wait_for(flow(), 30))
    finally:
        engine.shutdown()
    _PROBED.append(True)


@functools.lru_cache(maxsize=None)
def _server(max_pending: int = 64, max_num_seqs: int = 16, family: str = "qwen3"):
    """(base url, AsyncEngine) of a live server; one per configuration per check process."""
    from course.runtime.serve import BackgroundServer
    m = impl(MODULE)
    llm = _e05_llm(family, max_num_seqs=max_num_seqs, num_kvcache_blocks=256)
    engine = m.AsyncEngine(llm, max_pending=max_pending)
    server = BackgroundServer(m.build_app(engine.start(), MODEL))
    return server.url, engine


def _live(**kwargs) -> str:
    _probe()
    return _server(**kwargs)[0]


@functools.lru_cache(maxsize=None)
def _oracle():
    return _e05_llm(max_num_seqs=64, num_kvcache_blocks=512)


def _reference(prompts: list, params: list) -> list:
    return _oracle().generate(prompts, params)


def _client(url: str, asynchronous: bool = False):
    import openai
    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _health(url: str) -> dict:
    import httpx
    return httpx.get(url + "/health", timeout=10).json()


def _wait_idle(url: str, seconds: float = 20, until_engine_idle: bool = True) -> dict:
    """/health once nothing is in flight; with until_engine_idle, once the engine has no unfinished request and
    the in-flight count has had 2 s to settle (a count that never comes back must fail fast, not time out)."""
    deadline = time.monotonic() + seconds
    settle = None
    while True:
        h = _health(url)
        if (h["unfinished"] == 0 and h["pending"] == 0) or time.monotonic() > deadline:
            return h
        if until_engine_idle and h["unfinished"] == 0:
            settle = settle or time.monotonic() + 2
            if time.monotonic() > settle:
                return h
        time.sleep(0.05)


def _after_steps(url: str, start: int, n: int, seconds: float = 60) -> dict:
    """/health once the engine is idle or has run n steps past `start`."""
    deadline = time.monotonic() + seconds
    while True:
        h = _health(url)
        if h["unfinished"] == 0 or h["steps"] >= start + n or time.monotonic() > deadline:
            return h
        time.sleep(0.02)


def _text(r: Rand, n: int) -> str:
    return "".join(r.choice("abcdefghijklmnopqrstuvwxyz ,.你好世界") for _ in range(n))


def _sampling(r: Rand, max_tokens: int) -> dict:
    """openai-client keyword arguments; the extensions (min_p, top_k, ...) travel in extra_body."""
    return dict(temperature=r.choice([0.7, 1.0, 1.3]), top_p=r.choice([0.9, 1.0]), seed=r.int(0, 10**6),
                max_tokens=max_tokens, extra_body={"min_p": r.choice([0.0, 0.01]), "return_token_ids": True})


def _params(e01, s: dict, **extra):
    keys = ("temperature", "top_p", "min_p", "seed", "max_tokens", "top_k", "stop_token_ids", "ignore_eos")
    return e01.SamplingParams(**{k: v for k, v in {**s, **s["extra_body"], **extra}.items() if k in keys})


def _finish(ref, max_tokens: int) -> str:
    eos = _oracle().scheduler.config.eos_token_id
    return "stop" if ref.token_ids and ref.token_ids[-1] == eos and len(ref.token_ids) <= max_tokens else "length"


def _same(what: str, got_tokens, got_text, ref, r: Rand) -> None:
    assert got_tokens == ref.token_ids, (f"{what}：token 与同一 seed 的 LLM.generate 不同\n  得到 {got_tokens}\n"
                                         f"  期望 {ref.token_ids}\n  {r}")
    if got_text != ref.text:
        tok = _oracle().tokenizer
        per_token = "".join(tok.decode([t], skip_special_tokens=True) for t in ref.token_ids)
        hint = ("\n  看起来像易错点：逐个 token 单独解码再拼接（多字节的 UTF-8 字符被拆成了 U+FFFD）"
                if got_text == per_token or "\ufffd" in got_text and len(got_text) > len(ref.text) else "")
        raise AssertionError(f"{what}：文本与 tokenizer.decode(全部 token) 不同\n  得到 {got_text!r}\n"
                             f"  期望 {ref.text!r}{hint}\n  {r}")


def _parsed(m, body: dict, chat: bool, tok, max_model_len: int):
    try:
        return m.parse_request(body, chat, tok, MODEL, max_model_len)
    except m.RequestError as exc:
        raise AssertionError(f"合法请求被拒绝：parse_request({body!r}) 抛了 RequestError({exc}, param={exc.param!r})") from None


def _fields(got, want: dict, body: dict, hints: dict) -> None:
    """Compare ParsedRequest / SamplingParams fields ('params.max_tokens' style names) with `want`."""
    for name, value in want.items():
        obj = got
        for part in name.split("."):
            obj = getattr(obj, part)
        if obj != value:
            hint = hints.get(name, "")
            raise AssertionError(f"parse_request({body!r})：{name} 应为 {value!r}，得到 {obj!r}"
                                 + (f"\n  看起来像易错点：{hint}" if hint else ""))


@point("parse_request：合法请求的每个字段都按卡片落到 ParsedRequest（缺省值、null、top_k=-1、stop、chat 模板、max_completion_tokens）")
def test_parse_request_fields():
    m, r = impl(MODULE), Rand()
    from course.runtime.tiny_tokenizer import byte_tokenizer
    tok, max_model_len = byte_tokenizer(), r.int(64, 200)
    text = _text(r, r.int(3, 12))
    ids = tok.encode(text)
    body = {"model": MODEL, "prompt": text}
    _fields(_parsed(m, body, False, tok, max_model_len), {
        "prompt_ids": ids, "params.max_tokens": max_model_len - len(ids), "params.temperature": 1.0,
        "params.top_k": 0, "params.seed": None, "stop": [], "stream": False, "include_usage": False,
        "return_token_ids": False, "chat": False}, body,
        {"params.max_tokens": "缺省的 max_tokens 应是 max_model_len − prompt 长度（上下文里剩下的全部）"})
    record_case("parse:defaults")
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream",
                               "stream_options", "stop_token_ids", "ignore_eos", "user")}
    body = {"model": MODEL, "prompt": ids, **nulls}            # clients send null for "not set"
    _fields(_parsed(m, body, False, tok, max_model_len), {
        "prompt_ids": ids, "params.max_tokens": max_model_len - len(ids), "stop": [], "stream": False}, body, {})
    record_case("parse:null-is-unset")
    record_case("parse:prompt-token-ids")
    k, seed, stops = r.int(1, 8), r.int(0, 2**64 - 1), [_text(r, r.int(1, 3)), _text(r, r.int(4, 6))]
    body = {"model": MODEL, "prompt": ids, "max_tokens": k, "temperature": r.choice([0, 1, 0.5]), "top_p": 0.9,
            "top_k": -1, "min_p": 0.05, "seed": seed, "stop": stops, "stop_token_ids": [3], "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, "n": 1, "user": "u"}
    _fields(_parsed(m, body, False, tok, max_model_len), {
        "params.max_tokens": k, "params.temperature": float(body["temperature"]), "params.top_p": 0.9,
        "params.top_k": 0, "params.min_p": 0.05, "params.seed": seed, "params.stop_token_ids": {3},
        "params.ignore_eos": True, "stop": stops, "stream": True, "include_usage": True, "return_token_ids": True},
        body, {"params.top_k": "top_k = -1 是 vLLM 的“关闭”，应换成 e01 的 0"})
    record_case("parse:every-sampling-field")
    record_case("parse:top_k=-1")
    body = {"model": MODEL, "prompt": text, "stop": stops[1]}
    _fields(_parsed(m, body, False, tok, max_model_len), {"stop": [stops[1]]}, body, {})
    record_case("parse:stop-str")
    messages = [{"role": "system", "content": _text(r, 4)}, {"role": "user", "content": _text(r, r.int(2, 9))}]
    chat_ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    k2 = r.int(1, 8)
    body = {"model": MODEL, "messages": messages, "max_completion_tokens": k2, "max_tokens": k2 + r.int(1, 9)}
    _fields(_parsed(m, body, True, tok, max_model_len), {"prompt_ids": chat_ids, "params.max_tokens": k2,
                                                        "chat": True}, body,
            {"params.max_tokens": "chat 的 max_completion_tokens 被忽略了（它是 OpenAI 现在的名字，优先于 max_tokens）",
             "prompt_ids": "chat 的 prompt 应是 apply_chat_template(messages, tokenize=False, add_generation_prompt=True) 再编码"})
    record_case("parse:chat-template")
    record_case("parse:max_completion_tokens-wins")
    # exactly at every bound: MAX_STOP stop strings, one of MAX_STOP_CHARS characters, MAX_STOP_TOKEN_IDS ids, a message
    # with every allowed key (role, content, name)
    stops = [_text(r, 1) + str(i) for i in range(m.MAX_STOP - 1)] + ["x" * m.MAX_STOP_CHARS]
    ids_bound = list(range(m.MAX_STOP_TOKEN_IDS))
    body = {"model": MODEL, "prompt": text, "stop": stops, "stop_token_ids": ids_bound}
    _fields(_parsed(m, body, False, tok, max_model_len), {"stop": stops, "params.stop_token_ids": set(ids_bound)},
            body, {"stop": f"上限是“最多”：恰好 {m.MAX_STOP} 个 stop、恰好 {m.MAX_STOP_CHARS} 个字符的 stop 都合法"})
    stops = [_text(r, 1) + "x" * (m.MAX_STOP_CHARS - 1) for _ in range(m.MAX_STOP_TOTAL // m.MAX_STOP_CHARS)]
    body = {"model": MODEL, "prompt": text, "stop": stops}        # exactly MAX_STOP_TOTAL characters in all
    _fields(_parsed(m, body, False, tok, max_model_len), {"stop": stops}, body,
            {"stop": f"上限是“最多”：合计恰好 {m.MAX_STOP_TOTAL} 个字符的 stop 合法"})
    record_case("parse:stop-bounds-exact")
    named = [{"role": "user", "content": _text(r, 3), "name": "u1"}]
    _parsed(m, {"model": MODEL, "messages": named}, True, tok, max_model_len)
    record_case("parse:message-name")
    # a prompt of token ids holds ints only: a bool or a float among them is a 400 naming the prompt
    for bad in ([ids[0], True], [ids[0], 2.5]):
        try:
            m.parse_request({"model": MODEL, "prompt": bad}, False, tok, MODEL, max_model_len)
        except m.RequestError as exc:
            assert exc.param == "prompt", f"prompt={bad!r} 的错误应点名 prompt，得到 param={exc.param!r}"
        else:
            raise AssertionError(f"prompt={bad!r}（token id 里混了 {type(bad[1]).__name__}）应得到 400，却被收下了；"
                                 f"token id 只能是 int（bool 是 int 的子类，要单独排除）")
        record_case(f"parse:prompt-ids-with-{type(bad[1]).__name__}")

    class Refusing:                                           # a chat template that raises (role order, ...)
        chat_template = "refuses"

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

        def __getattr__(self, name):
            return getattr(tok, name)
    try:
        m.parse_request({"model": MODEL, "messages": messages}, True, Refusing(), MODEL, max_model_len)
    except m.RequestError as exc:
        assert exc.param == "messages", f"chat 模板拒绝 messages 时错误应点名 messages，得到 param={exc.param!r}"
    else:
        raise AssertionError("chat 模板抛异常（例如角色顺序不对）时 parse_request 应转成 RequestError（400，点名 messages）")
    record_case("parse:template-raises")


def _card_deltas(tok, ids: list[int], stops: list[str], hold: int, first_listed: bool = False,
                 from_checked: bool = False) -> tuple[list[str], bool]:
    """The card's TextStream.push rule, step by step, with the given hold (first_listed, from_checked: classic
    mistakes; from_checked looks for each stop only from the end of the text already searched, so a stop that
    straddles the old and the new text is missed)."""
    deltas, sent, checked = [], 0, 0
    for i in range(len(ids)):
        text = tok.decode(ids[:i + 1], skip_special_tokens=True)
        cuts = [j for j in (text.find(s, checked if from_checked else 0) for s in stops) if j >= 0]
        cuts = cuts[:1 if first_listed else None]
        checked = len(text.rstrip("\ufffd"))
        stopped = bool(cuts)
        text = text[:min(cuts)] if cuts else text
        end = len(text) if stopped or i == len(ids) - 1 else len(text.rstrip("\ufffd")) - hold
        deltas.append(text[sent:end] if end > sent else "")
        sent = max(sent, end)
        if stopped:
            return deltas, True
    return deltas, False


UNFINISHED_END = ("结束时没有把剩下的文本全部发出：请求在一个字符的中间结束（最后几个字节凑不成完整的 UTF-8），"
                  "finished 时 end = len(text)，真不完整的字节发成 U+FFFD，和 tokenizer.decode(全部 token) 一致")
SEARCH_START = ("stop 只从上一次查过的位置（checked）之后找：跨过新旧文本边界的 stop（开头几个字符在上一步的文本里）找不到；"
                "stop s 若结束在新文本里，它最早从 checked − len(s) + 1 开始，要从那里找")


@point("TextStream：随机文本与不同长度的 stop 字符串，每一步的增量都按卡片（扣住最长的 stop − 1 个字符，在最早出现的 stop 处截断）")
def test_text_stream_stops():
    m, r = impl(MODULE), Rand()
    from course.runtime.tiny_tokenizer import byte_tokenizer
    tok = byte_tokenizer()
    text = _text(r, r.int(40, 60))
    p = r.int(5, 15)
    long_stop = text[p:p + r.int(4, 7)] + "#"                  # its head appears at p, the whole never does
    q = next(j for j in range(p + 8, len(text) - 2) if "\ufffd" not in text[j:j + 2])
    short = text[q:q + 2]
    o = r.int(3, 12)                                          # Ω and the 3 characters ending in it complete together
    both = text[:o] + "Ω" + text[o + 1:]
    head = next(j for j in range(2, 5) if "\ufffd" not in text[:j] and text[:j] not in text[1:])  # only at 0
    cut = tok.encode(text) + tok.encode(r.choice("你好世界Ω"))[:-1]     # ends inside a character: finished there
    cases = [("hold-longest", text, [short, long_stop]), ("earliest-not-first-listed", text, [long_stop, short]),
             ("held-text-out-when-finished", text, [long_stop]),
             ("stops-complete-together", both, ["Ω", both[o - 2:o + 1], long_stop]),
             ("stop-at-0", text, [long_stop, text[:head]]),
             ("16-stops", text, [f"#{i}" * r.int(1, 9) for i in range(14)] + [long_stop, short]),  # as eval tools send
             ("finished-inside-a-character", cut, [long_stop])]
    for label, text, stops in cases:
        _check_stream(m, tok, text if isinstance(text, list) else tok.encode(text), stops, r)
        record_case(f"stream:{label}")
    record_case("stream:stop-straddles-tokens")                 # byte tokens: every stop found spans two or more
    # a vocabulary of tokens of several characters (as a BPE's): a stop inside the very first token is found there,
    # where checked - len(s) + 1 is still negative
    pieces = ["".join(r.choice(list("abcdefgh")) for _ in range(r.int(4, 6))) for _ in range(r.int(6, 10))]
    words = _PieceTokenizer(pieces)
    _check_stream(m, words, list(range(len(pieces))), [pieces[0][1:3], pieces[3] + "#"], r)
    record_case("stream:multi-char-tokens")


class _PieceTokenizer:
    """A tokenizer whose token i is the string pieces[i] (several characters each)."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def _check_stream(m, tok, ids: list[int], stops: list[str], r: Rand) -> None:
    """TextStream(tok, stops) fed ids one by one gives the card's deltas (the mistake it resembles named)."""
    stream = m.TextStream(tok, stops)
    got = []
    for i, t in enumerate(ids):
        got.append(stream.push(t, finished=i == len(ids) - 1))
        if stream.stopped:
            break
    want, stopped = _card_deltas(tok, ids, stops, max(len(s) for s in stops) - 1)
    if got == want and stream.stopped == stopped:
        return
    hint = ""
    joined, wanted = "".join(got), "".join(want)
    if joined.count("\ufffd") > wanted.count("\ufffd"):
        hint = "逐个 token 单独解码再拼接"
    elif wanted.endswith("\ufffd") and joined == wanted.rstrip("\ufffd"):
        hint = UNFINISHED_END
    elif got == _card_deltas(tok, ids, stops, max(len(s) for s in stops) - 1, from_checked=True)[0]:
        hint = SEARCH_START          # the stub gives hold: a missed straddling stop is the search's start
    elif got == _card_deltas(tok, ids, stops, 0)[0]:
        hint = "流式输出先漏出了 stop 字符串的前半截（没有留出 len(stop) - 1 个字符的缓冲）"
    elif got == _card_deltas(tok, ids, stops, min(len(s) for s in stops) - 1)[0]:
        hint = "按最短的 stop 算了 hold：更长的 stop 还可能正在形成，要扣住 max(len(s)) − 1 个字符"
    elif got == _card_deltas(tok, ids, stops, len(max(stops, key=len)) - 1, first_listed=True)[0]:
        hint = "截在列表里第一个命中的 stop 处，而不是文本里最早出现的那个"
    raise AssertionError(f"TextStream(stop={stops!r}) 逐 token 的增量：\n  得到 {got}\n  期望 {want}"
                         f"（stopped={stopped}）" + (f"\n  看起来像易错点：{hint}" if hint else "") + f"\n  {r}")


class _CountingTokenizer:
    """The byte tokenizer, recording how many token ids each decode call was given."""

    def __init__(self, tok):
        self._tok, self.sizes = tok, []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids, *args, **kwargs):
        self.sizes.append(len(ids))
        return self._tok.decode(ids, *args, **kwargs)


WHOLE_DECODE = ("每个 token 都把全部 token_ids 重新解码：第 n 个 token 的代价是 O(n)，长输出越写越慢（事件循环上的所有请求"
                "一起变慢）；只解码最后一个完整字符之后的那几个 token")


@point("TextStream 每个 token 的代价不随文本变长：只重新解码最后一个完整字符之后的 token，输出与整段解码相同")
def test_text_stream_cost_is_bounded():
    m, r = impl(MODULE), Rand()
    from course.runtime.tiny_tokenizer import byte_tokenizer
    tok = _CountingTokenizer(byte_tokenizer())
    text = _text(r, r.int(300, 400))
    stops = [_text(r, 3) + "#", "Ω" + _text(r, 2)]              # never found: the stream runs to the end
    ids = tok.encode(text)
    stream = m.TextStream(tok, stops)
    got = [stream.push(t, finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    want, _ = _card_deltas(byte_tokenizer(), ids, stops, max(len(s) for s in stops) - 1)
    assert got == want, f"TextStream 逐 token 的增量与整段解码的结果不同：\n  得到 {got}\n  期望 {want}\n  {r}"
    longest = max(tok.sizes, default=0)
    assert 0 < longest <= 8, (f"{len(ids)} 个 token 里，一次 decode 最多拿到了 {longest} 个 token（一个字符至多 4 个字节 = "
                              f"4 个 token，不该超过 8）\n  看起来像易错点：{WHOLE_DECODE}\n  {r}")
    record_case("stream:decode-cost-bounded")


BOOL = "bool 被当成了数字（isinstance(True, int) 为真）"
NUMBERS = "数值只查了下限，没有按引擎放得下的范围校验（seed < 2**64、top_k < 2**63 由 SamplingParams 挡住）"
EMPTY_STOP = "空的 stop 字符串被收下了（\"\" 在任何文本的开头都命中，输出永远是空的）"
SURROGATE = "JSON 里的孤立代理字符（\"\\ud800\"）没有在 tokenizer 之前挡住，变成了 500"
DEEP = "json.loads 的 RecursionError 没有捕获（它不是 JSONDecodeError），变成了 500"
STOP_ITEM = ("stop 列表里的每一项都要查类型（只收非空 str）：非字符串的项漏了过去，"
             "到 .encode / len / text.find 才抛异常（500），或者被悄悄收下")
CONTENT = ("每条消息都要先经过 chat_message（只收 str 或 text 分段的列表）：5、null、图片分段漏了过去，"
           "到 _unicode / len 才抛异常（500），或者被模板渲染成 \"5\"、\"None\" 悄悄收下")
MESSAGE = "每条消息都要先经过 chat_message（先查是不是 JSON 对象）：\"hi\" 这样的消息到 m.get / m[\"role\"] 才抛异常，变成了 500"
USAGE_BOOL = "include_usage 只收 JSON 的 true / false：\"yes\"、1 被当成真值收下了（stream_options 要查 isinstance(..., bool)）"
OVERFLOW = ("超大的整数（10**400，JSON 的整数没有大小限制）转成 float 时抛 OverflowError，不是 ValueError，变成了 500："
            "parse_request 不要自己 float() / math.isfinite，把值原样交给 SamplingParams（e01 把它变成点名字段的 ValueError）")
STOP_COUNT = ("stop 的个数与长度没有上限（MAX_STOP 个、每个 MAX_STOP_CHARS 个字符、合计 MAX_STOP_TOTAL 个字符）：每个 token 都要在文本里找每一个 stop，"
              "350000 个 stop 的请求让同一事件循环上的所有请求一起停住")
STOP_IDS = "stop_token_ids 的个数没有上限：一百万个 id 的请求也被收下了"
MAX_COMPLETION = ("max_completion_tokens 的错误点名了 max_tokens：客户端发的是 max_completion_tokens，"
                  "e01 的 ValueError 里的 max_tokens 要换成客户端用的名字")
HUGE_TOP_K = "合法的超大 top_k 被拒绝了：top_k 的上限是 2**63（放得进 int64），大于词表只是等于不截断"
SURROGATE_PART = ("text 分段里的孤立代理字符没有在模板与 tokenizer 之前挡住：_unicode 要查 chat_message 连接之后的 "
                  "content（分段合起来的文本），只查字符串形式的 content 会漏掉分段")
CHAT_TOO_LONG = "chat 的 prompt 超过上下文时错误点名了 prompt：chat 请求里没有 prompt 字段，应点名 messages"
USAGE_KEYS = ("stream_options 里的未知键被悄悄忽略了：stream_options 只能是 {\"include_usage\": bool}，"
              "别的键（如 continuous_usage_stats）和未知字段一样回 400")
BAD = [  # (what, endpoint, body, the field the error must name, the classic mistake {status or "code": ...}, code)
    ("非法 JSON", "completions", b'{"model": "tiny", "prompt": ', None, None, "invalid_json"),
    ("嵌套 100000 层的 JSON", "completions", b"[" * 100000 + b"]" * 100000, None, {500: DEEP}, "invalid_json"),
    ("body 不是对象", "completions", [1, 2], None, None, None),
    ("缺 model", "completions", {"model": None, "prompt": "hi"}, "model", None, None),
    ("空 prompt", "completions", {"prompt": ""}, "prompt", None, None),
    ("缺 prompt", "completions", {}, "prompt", None, None),
    ("超长 prompt", "completions", {"prompt": "a" * MAX_MODEL_LEN}, "prompt", None, "context_length_exceeded"),
    ("孤立代理字符的 prompt", "completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt", {500: SURROGATE}, None),
    ("孤立代理字符的 message", "chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0]", {500: SURROGATE}, None),
    ("孤立代理字符在 text 分段里", "chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfffb"}]}]}',
     "messages[0]", {200: SURROGATE_PART, 500: SURROGATE_PART, "param": SURROGATE_PART}, None),
    ("孤立代理字符的 stop", "completions", b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}', "stop",
     {500: SURROGATE}, None),
    ("未知字段", "completions", {"prompt": "hi", "temprature": 0.5}, "temprature", "未知字段被悄悄忽略",
     "unknown_parameter"),
    ("temperature < 0", "completions", {"prompt": "hi", "temperature": -1}, "temperature", None, None),
    ("top_p = 0", "completions", {"prompt": "hi", "top_p": 0}, "top_p", None, None),
    ("min_p > 1", "completions", {"prompt": "hi", "min_p": 1.5}, "min_p", None, None),
    ("top_k 是字符串", "completions", {"prompt": "hi", "top_k": "5"}, "top_k", None, "invalid_type"),
    ("top_k = 2**63", "completions", {"prompt": "hi", "top_k": 2**63}, "top_k", {200: NUMBERS, 500: NUMBERS}, None),
    ("max_tokens 是 true", "completions", {"prompt": "hi", "max_tokens": True}, "max_tokens", {"code": BOOL},
     "invalid_type"),
    ("n 是 true", "completions", {"prompt": "hi", "n": True}, "n", {200: BOOL, "code": BOOL}, "invalid_type"),
    ("max_tokens = 0", "completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", None, None),
    ("prompt + max_tokens 超过上下文", "completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens", None,
     "context_length_exceeded"),
    ("seed < 0", "completions", {"prompt": "hi", "seed": -3}, "seed", None, None),
    ("seed = 2**64", "completions", {"prompt": "hi", "seed": 2**64}, "seed", {200: NUMBERS, 500: NUMBERS}, None),
    ("n = 0", "completions", {"prompt": "hi", "n": 0}, "n", None, None),
    ("n = 17", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17}, "n", None, None),
    ("logprobs = 6", "completions", {"prompt": "hi", "logprobs": 6}, "logprobs", None, None),
    ("chat 的 logprobs 是 1", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1},
     "logprobs", None, "invalid_type"),
    ("top_logprobs 没有 logprobs", "chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", None, None),
    ("top_logprobs = 21", "chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs", None,
     None),
    ("chat 里的 echo", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo",
     "未知字段被悄悄忽略", "unknown_parameter"),
    ("stop 是数字", "completions", {"prompt": "hi", "stop": 5}, "stop", None, "invalid_type"),
    ("stop 是空字符串", "completions", {"prompt": "hi", "stop": ""}, "stop", EMPTY_STOP, None),
    ("stop 列表里有数字", "completions", {"prompt": "hi", "stop": ["x", 5]}, "stop",
     {200: STOP_ITEM, 500: STOP_ITEM}, None),
    ("stop 列表里有列表", "completions", {"prompt": "hi", "stop": [["x"]]}, "stop",
     {200: STOP_ITEM, 500: STOP_ITEM}, None),
    ("stream_options 的 include_usage 是 \"yes\"", "completions",
     {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options",
     {200: USAGE_BOOL}, None),
    ("stream_options 的 include_usage 是 1", "completions",
     {"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options",
     {200: USAGE_BOOL}, None),
    ("temperature = 10**400", "completions", {"prompt": "hi", "temperature": 10**400}, "temperature",
     {500: OVERFLOW}, None),
    ("top_p = 10**400", "completions", {"prompt": "hi", "top_p": 10**400}, "top_p", {500: OVERFLOW}, None),
    ("stop 里有空字符串", "completions", {"prompt": "hi", "stop": ["x", ""]}, "stop", EMPTY_STOP, None),
    ("越界的 token id", "completions", {"prompt": [1, 99999]}, "prompt", None, None),
    ("stream 是字符串", "completions", {"prompt": "hi", "stream": "yes"}, "stream", None, "invalid_type"),
    ("stream_options 里有未知的键", "completions",
     {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options", {200: USAGE_KEYS}, None),
    ("stream_options 没有 stream", "completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options", None, None),
    ("空 messages", "chat/completions", {"messages": []}, "messages", None, None),
    ("缺 messages", "chat/completions", {}, "messages", None, None),
    ("超长的 chat prompt（按 token 数）", "chat/completions",
     {"messages": [{"role": "user", "content": "a" * MAX_MODEL_LEN}]}, "messages", {"param": CHAT_TOO_LONG},
     "context_length_exceeded"),
    ("未知的 role", "chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]", None, None),
    ("message 的 content 是数字", "chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0]", {200: CONTENT, 500: CONTENT}, None),
    ("message 的 content 是 null", "chat/completions",
     {"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": None}]},
     "messages[1]", {200: CONTENT, 500: CONTENT}, None),
    ("message 的 content 里有图片分段", "chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0]",
     {200: CONTENT, 500: CONTENT}, None),
    ("message 的 content 是空列表", "chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages[0]",
     {200: CONTENT, 500: CONTENT}, None),
    ("message 不是对象", "chat/completions", {"messages": ["hi"]}, "messages[0]", {500: MESSAGE}, None),
    ("65 个 stop 字符串", "completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}, "stop",
     {200: STOP_COUNT}, None),
    ("合计 1025 个字符的 5 个 stop", "completions", {"prompt": "hi", "stop": ["x" * 205] * 4 + ["y" * 205]}, "stop",
     {200: STOP_COUNT + "（每个都不超过 256，但合计超过 MAX_STOP_TOTAL：只查了单个的长度）"}, None),
    ("350000 个 stop 字符串", "completions", {"prompt": "hi", "stop": ["ab"] * 350000}, "stop", {200: STOP_COUNT}, None),
    ("257 个字符的 stop", "completions", {"prompt": "hi", "stop": ["x" * 257]}, "stop", {200: STOP_COUNT}, None),
    ("一百万个 stop_token_ids", "completions", {"prompt": "hi", "stop_token_ids": [1] * 1000000}, "stop_token_ids",
     {200: STOP_IDS}, None),
    ("max_completion_tokens = 0", "chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens",
     {"param": MAX_COMPLETION}, None),
    ("max_completion_tokens 超过上下文", "chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": MAX_MODEL_LEN},
     "max_completion_tokens", {"param": MAX_COMPLETION}, "context_length_exceeded"),
]


def _openai_error(a, what: str, status: int, mistake: str | None = None) -> dict:
    """The error object of response `a`, which must have `status` and OpenAI's shape with a non-empty code."""
    hint = f"\n  看起来像易错点：{mistake}" if mistake else ""
    assert a.status_code == status, f"{what} 应得到 {status}，得到 {a.status_code}: {a.text[:300]}{hint}"
    try:
        error = a.json().get("error")
    except (ValueError, AttributeError):
        error = None
    assert isinstance(error, dict) and error.get("message") and error.get("type"), \
        (f"{what} 的错误应是 OpenAI 格式 {{'error': {{'message', 'type', 'param', 'code'}}}}，得到 {a.text[:300]}"
         + ("\n  看起来像易错点：FastAPI 默认的 {'detail': ...} 没有换成 OpenAI 的错误格式" if '"detail"' in a.text else ""))
    assert isinstance(error.get("code"), str) and error["code"], \
        f"{what} 的错误应带机器可读的 code（OpenAI 的 model_not_found、invalid_type ……），得到 {error.get('code')!r}"
    return error


def _background_stream(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A streaming request read on a thread; the dict gets 'frames' (or 'error') when it ends."""
    import httpx
    out: dict = {}

    def read():
        body = {"model": MODEL, "prompt": "ok", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
                out["frames"] = [f for f in resp.read().decode().split("\n\n") if f]
        except Exception as exc:   # noqa: BLE001  a cut stream is what the check reports
            out["error"] = repr(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, out


def _assert_stream_completed(out: dict, max_tokens: int, what: str) -> None:
    frames = out.get("frames")
    assert frames is not None, f"{what}：同时在跑的正常流被打断了（{out.get('error')}）：一个坏请求不能连累别人"
    assert frames[-1] == "data: [DONE]", f"{what}：同时在跑的正常流没有以 [DONE] 结束：{frames[-2:]}"
    usage = json.loads(frames[-2][6:]).get("usage") or {}
    assert usage.get("completion_tokens") == max_tokens, f"{what}：同时在跑的正常流应生成 {max_tokens} 个 token：{usage}"


@point("坏请求（类型、范围、超大数字、空 stop、孤立代理字符、过深 JSON、非 JSON、未知路径）各得到 OpenAI 格式的 4xx、点名字段、带 code，同时在跑的流不受影响")
def test_bad_requests_get_400():
    import httpx
    url, r = _live(), Rand()
    cases = r.py.sample(BAD, len(BAD))
    stream, out = _background_stream(url, 64)
    with httpx.Client(base_url=url, timeout=30) as client:
        for what, endpoint, body, field, mistake, code in cases:
            record_case(f"bad:{what}")
            if isinstance(body, dict):
                # a short max_tokens unless the case is about it: a mistake that accepts the request must not
                # spend the check's time generating the whole context
                body = json.dumps({"model": MODEL, "max_tokens": 2, **body}).encode()
            elif not isinstance(body, bytes):
                body = json.dumps(body).encode()
            a = client.post(f"/v1/{endpoint}", content=body, headers={"Content-Type": "application/json"})
            mistake = mistake if isinstance(mistake, dict) else {200: mistake}
            error = _openai_error(a, f"坏请求「{what}」", 400, mistake.get(a.status_code))
            assert error.get("type") == "invalid_request_error", f"「{what}」的 type 应为 invalid_request_error：{a.text}"
            assert error.get("param") == field, (f"「{what}」的错误应点名字段 {field!r}，param 是 {error.get('param')!r}"
                                                 + (f"\n  看起来像易错点：{mistake['param']}"
                                                    if mistake.get("param") else ""))
            if code is None and field is not None:      # a field's value, not its JSON type: the default code
                code = "invalid_value"
                record_case("code:invalid_value-default")
            assert code is None or error["code"] == code, (f"「{what}」的 code 应为 {code!r}，得到 {error['code']!r}"
                                                           + (f"\n  看起来像易错点：{mistake['code']}"
                                                              if mistake.get("code") else ""))
        wrong = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
        error = _openai_error(wrong, "未知模型", 404)
        assert error["param"] == "model" and error["code"] == "model_not_found", f"未知模型：{wrong.text}"
        record_case("model:unknown-404")
        for media in ("text/plain", None):      # a text/plain POST needs no CORS preflight: any web page could send it
            headers = {"Content-Type": media} if media else {}
            a = client.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "hi"}), headers=headers)
            _openai_error(a, f"Content-Type {media or '缺失'} 的请求", 415,
                          "只收 application/json：text/plain 的 POST 不需要 CORS 预检，任何网页都能让浏览器替它发请求")
            record_case(f"media:{media or 'missing'}-415")
        _openai_error(client.post("/v1/nothing", json={}), "未知路径 POST /v1/nothing", 404)
        _openai_error(client.get("/v1/completions"), "GET /v1/completions（方法不对）", 405)
        record_case("route:unknown-404-method-405")
        tokens = []
        for t in (0, 1e-40):                    # 1e-40 is 0 in fp32: logits / T = inf, NaN probabilities
            a = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 6,
                                                     "temperature": t, "ignore_eos": True, "return_token_ids": True})
            assert a.status_code == 200, f"temperature={t}：{a.text[:300]}"
            tokens.append(a.json()["choices"][0]["token_ids"])
        assert tokens[0] == tokens[1], (f"temperature=1e-40 应与 greedy（0）相同，得到 {tokens[1]}，greedy {tokens[0]}"
                                        "\n  看起来像易错点：极小的正 temperature 没有当成 greedy（e01 的 SamplingParams）")
        record_case("temperature:1e-40-is-greedy")
        seed, runs = r.int(0, 10**6), {}
        for k in (0, 2**40, 2**63 - 1):         # larger than the vocabulary: no cut, the same tokens as top_k = 0
            a = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 6, "top_k": k,
                                                     "seed": seed, "ignore_eos": True, "return_token_ids": True})
            refused = a.status_code == 400 and '"top_k"' in a.text
            assert a.status_code == 200, (f"top_k={k}（大于词表 = 不截断）是合法的，得到 {a.status_code}: {a.text[:300]}"
                                          + (f"\n  看起来像易错点：{HUGE_TOP_K}" if refused else ""))
            runs[k] = a.json()["choices"][0]["token_ids"]
        assert runs[2**40] == runs[0] == runs[2**63 - 1], (f"seed={seed}：top_k=2**40、2**63 − 1（大于词表）应与 top_k=0 "
                                                           f"（不截断）采出同样的 token，得到 {runs}\n  {r}")
        record_case("top_k:huge-is-no-cut")
        stream.join(30)
        _assert_stream_completed(out, 64, "坏请求期间")
        record_case("bad:stream-unaffected")
        assert client.get("/health").json()["status"] == "ok", "坏请求之后服务应仍然健康"
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                  "ignore_eos": True})     # random weights may sample eos first
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, f"坏请求之后的正常请求：{ok.text}"


def _raw(url: str, request: bytes, seconds: float = 10) -> tuple[int, dict, bool]:
    """Send `request` on a fresh socket: (status, JSON body or {}, whether the server closed the connection)."""
    import socket
    from urllib.parse import urlsplit
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=seconds) as sock:
        sock.sendall(request)
        data, closed = b"", False
        while True:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, socket.timeout):
                break
            if not chunk:
                closed = True
                break
            data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
            if length and len(body) >= length[0]:
                sock.settimeout(1)                    # the whole answer is here: does the server close?
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = {}
    return int(head.split()[1]) if head else 0, parsed, closed


@point("Host 头只认 localhost / 127.0.0.1 / [::1]（DNS rebinding 得 403），Content-Length 与 chunked 同时出现得 400 并关闭连接")
def test_host_and_framing():
    url, r = _live(), Rand()
    port = url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        status, body, _ = _raw(url, f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        assert status == 200, f"Host: {host} 是本机的名字，/health 应得到 200，得到 {status} {body}"
        record_case("host:loopback:" + host.replace(f":{port}", ""))
    evil = r.choice(["attacker.example", "rebind.attacker.example", "192.168.1.7", "[::2]"])
    for path, method, extra in (("/health", "GET", b""), ("/v1/completions", "POST",
                                b"Content-Type: application/json\r\nContent-Length: 33\r\n\r\n"
                                b'{"model": "tiny", "prompt": "hi"}')):
        request = f"{method} {path} HTTP/1.1\r\nHost: {evil}:{port}\r\n".encode() + (extra or b"\r\n")
        status, body, _ = _raw(url, request)
        error = body.get("error") or {}
        assert status in (400, 403) and error.get("code"), (
            f"{method} {path}，Host: {evil}:{port}（DNS rebinding：网页的域名解析到了 127.0.0.1，浏览器发的仍是网页自己的域名）"
            f"应得到 OpenAI 格式的 400/403，得到 {status} {body}")
        record_case(f"host:rebinding-{method}")
    smuggle = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
               b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    status, body, closed = _raw(url, smuggle)
    assert status == 400 and (body.get("error") or {}).get("code"), \
        f"同时带 Content-Length 与 Transfer-Encoding: chunked 的请求（RFC 9112 §6.1）应得到 400，得到 {status} {body}"
    assert closed, "同时带 Content-Length 与 chunked 的请求被拒绝之后，连接应关闭（后面的字节不能被当成下一个请求）"
    record_case("framing:content-length-and-chunked")
    assert _health(url)["status"] == "ok"


class _WatchedTokenizer:
    """The byte tokenizer, recording the longest text it was asked to encode; a text with SLOW takes `slow` s."""

    def __init__(self, tok):
        self._tok, self.longest, self.slow = tok, 0, 0.0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def _seen(self, text):
        self.longest = max(self.longest, len(text) if isinstance(text, str) else sum(len(m["content"]) for m in text))
        if "SLOW" in str(text):
            time.sleep(self.slow)

    def encode(self, text, *args, **kwargs):
        self._seen(text)
        return self._tok.encode(text, *args, **kwargs)

    def apply_chat_template(self, messages, *args, **kwargs):
        self._seen(messages)
        return self._tok.apply_chat_template(messages, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _watched_server():
    from course.runtime.serve import BackgroundServer
    m = impl(MODULE)
    llm = _e05_llm(max_num_seqs=4, num_kvcache_blocks=64)
    llm.tokenizer = watched = _WatchedTokenizer(llm.tokenizer)
    engine = m.AsyncEngine(llm)
    return BackgroundServer(m.build_app(engine.start(), MODEL)).url, watched


PARTS_BOUND = ("chat 的字符上限没有数 text 分段里的字符：content 可以是 [{\"type\": \"text\", \"text\": ...}] 的列表，"
               "len(content) 数的是段数；上限要数 chat_message 连接之后的文本（每段的 text 合起来）")


@point("大请求不卡住服务：超限的 body 得 413，超长的 prompt 不经 tokenizer 就得 400，tokenize 不在事件循环上")
def test_large_requests():
    import httpx
    m = impl(MODULE)
    _probe()
    url, watched = _watched_server()
    limit = m.MAX_BODY_BYTES
    bound = MAX_MODEL_LEN * max(map(len, watched.get_vocab()))         # characters no prompt that fits can pass
    with httpx.Client(base_url=url, timeout=30) as client:
        a = client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * (limit + 1000)})
        _openai_error(a, f"{limit + 1000} 字节的 body（上限 MAX_BODY_BYTES = {limit}）", 413,
                      "没有限制 body 的大小：整个 body 读进内存、json.loads、再交给 tokenizer")
        record_case("large:body-413")
        n = bound + 1000
        half = [{"type": "text", "text": "a" * (n // 2)}] * 2      # text parts: each half the bound, together over it
        for endpoint, body, field, form in (
                ("completions", {"prompt": "a" * n}, "prompt", "字符串"),
                ("chat/completions", {"messages": [{"role": "user", "content": "a" * n}]}, "messages", "字符串 content"),
                ("chat/completions", {"messages": [{"role": "user", "content": half}]}, "messages",
                 "text 分段的 content（两段各一半）")):
            watched.longest = 0
            a = client.post(f"/v1/{endpoint}", json={"model": MODEL, **body})
            parts = form.startswith("text")
            mistake = PARTS_BOUND if parts and a.status_code == 200 else None
            error = _openai_error(a, f"{n} 个字符的 {field}（{form}）", 400, mistake)
            assert error.get("param") == field and error["code"] == "context_length_exceeded", a.text[:300]
            assert watched.longest < n, (f"{n} 个字符的 {field}（{form}）被交给了 tokenizer（一个 token 最多 "
                                         f"{bound // MAX_MODEL_LEN} 个字符，它不可能放进 {MAX_MODEL_LEN} 个 token）"
                                         f"\n  看起来像易错点：{PARTS_BOUND if parts else 'tokenize 之前没有按字符数挡住超长的 prompt'}")
            record_case(f"large:char-bound-{endpoint.split('/')[0]}-{'parts' if parts else 'string'}")
        fits = "<|im_start|>" * 1000            # 12000 characters but 1000 tokens: characters are not tokens
        a = client.post("/v1/completions", json={"model": MODEL, "prompt": fits, "max_tokens": 2})
        assert a.status_code == 200, (f"12000 个字符、1000 个 token 的 prompt 放得进 {MAX_MODEL_LEN} 的上下文，"
                                      f"却被拒绝：{a.text[:300]}\n  看起来像易错点：把字符数当成了 token 数"
                                      "（字符上限要用 longest_token(tokenizer)，一个特殊 token 就有十几个字符）")
        record_case("large:characters-are-not-tokens")

    watched.slow = 2.0
    slow = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", timeout=30,
                                                      json={"model": MODEL, "prompt": "SLOW", "max_tokens": 2}))
    slow.start()
    time.sleep(0.3)
    waits = []
    for _ in range(3):
        t = time.monotonic()
        httpx.get(url + "/health", timeout=30)
        waits.append(time.monotonic() - t)
    slow.join(30)
    watched.slow = 0.0
    assert max(waits) < 1.0, (f"tokenizer 花 2 s 编码一个 prompt 时，/health 等了 {max(waits):.2f} s：整个服务停住了"
                              "\n  看起来像易错点：在事件循环上 tokenize（json.loads、parse_request 要放到工作线程里）")
    record_case("large:tokenize-off-the-event-loop")


@point("openai 客户端：completion 与 chat、流式与非流式，token 与同一 seed 的 LLM.generate 逐个相同，usage 正确")
def test_openai_client_matches_generate():
    e01 = impl("e01_sampling")
    url, r = _live(), Rand()
    client, tok = _client(url), _oracle().tokenizer
    top_ks = r.py.sample([-1, 0, 50, r.choice([-1, 0, 50])], 4)    # each form of top_k on every run
    for chat in (False, True):
        for stream in (False, True):
            what = f"{'chat' if chat else 'completion'}（stream={stream}）"
            user, s = _text(r, r.int(3, 20)), _sampling(r, r.int(4, 24))
            s["extra_body"]["top_k"] = top_k = top_ks.pop()
            if chat:
                messages = [{"role": "system", "content": "简短回答"}, {"role": "user", "content": user}]
                prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                call = functools.partial(client.chat.completions.create, messages=messages)
            else:
                prompt = user
                call = functools.partial(client.completions.create, prompt=user)
            ref = _reference([prompt], [_params(e01, s, top_k=max(top_k, 0))])[0]
            opts = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            sent = dict(s)
            if chat and stream:                         # chat's own name for it wins over max_tokens
                sent |= {"max_completion_tokens": s["max_tokens"], "max_tokens": s["max_tokens"] + 7}
            out = call(model=MODEL, **sent, **opts)
            if stream:
                chunks = list(out)
                if chat:
                    first = chunks[0].choices[0].delta if chunks[0].choices else None
                    assert first is not None and first.role == "assistant" and not first.content, \
                        f"chat 的流应先发一帧只带 role 的 delta {{'role': 'assistant', 'content': ''}}，得到 {chunks[0]}"
                indices = {ch.index for c in chunks for ch in c.choices}
                assert indices == {0}, f"{what}：n = 1 时每个 chunk 的 choices[].index 都应是 0，得到 {sorted(indices)}"
                early = [c for c in chunks[:-1] if c.usage is not None]
                assert not early, f"{what}：usage 只在最后一个 chunk 里（include_usage 时），前面的 chunk 不带 usage：{early[0]}"
                finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
                assert len(finals) == 1, f"{what}：应有且只有一个带 finish_reason 的 chunk，得到 {len(finals)} 个"
                pieces = [(c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks if c.choices]
                text, choice, usage = "".join(pieces), finals[0], chunks[-1].usage
                assert usage is not None and not chunks[-1].choices, f"{what}：include_usage 时最后一个 chunk 应只带 usage"
            else:
                choice, usage = out.choices[0], out.usage
                text = choice.message.content if chat else choice.text
            _same(what, (choice.model_extra or {}).get("token_ids"), text, ref, r)
            assert choice.finish_reason == _finish(ref, s["max_tokens"]), f"{what}：finish_reason {choice.finish_reason!r}"
            expect = (len(ref.prompt_token_ids), len(ref.token_ids), len(ref.prompt_token_ids) + len(ref.token_ids))
            got = (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
            assert got == expect, f"{what}：usage (prompt, completion, total) 应为 {expect}，得到 {got}"
            record_case(f"client:{'chat' if chat else 'completion'}-{'stream' if stream else 'unary'}")
            record_case(f"client:top_k={top_k}")
            if chat and stream:
                record_case("client:chat-role-frame")
                record_case("client:max_completion_tokens-wins")
    models = client.models.list()
    assert [x.id for x in models.data] == [MODEL], f"/v1/models 应列出 {MODEL!r}：{models}"


KEPT_REQUESTS = ("结束的请求没有从 llm.requests 里删掉：_loop 把 finished 的请求从 handles 和 llm.requests 里都删掉"
                 "（generate 自己会取走结果，服务里没人取），否则每个请求都留下它的 Sequence，内存越用越多")


@point("32 个并发的流式客户端全部完成，各自的输出正确")
def test_concurrent_streams():
    e01 = impl("e01_sampling")
    url, r = _live(), Rand()
    jobs = [(_text(r, r.int(1, 30)), _sampling(r, r.int(4, 32))) for _ in range(32)]
    refs = _reference([p for p, _ in jobs], [_params(e01, s) for _, s in jobs])

    async def one(client, prompt, s):
        stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, **s)
        pieces, ids = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            if chunk.choices[0].finish_reason:
                ids = (chunk.choices[0].model_extra or {}).get("token_ids")
        return "".join(pieces), ids

    async def everyone():
        client = _client(url, asynchronous=True)
        return await asyncio.gather(*(one(client, p, s) for p, s in jobs))

    outs = asyncio.run(everyone())
    for i, ((text, ids), ref) in enumerate(zip(outs, refs)):
        _same(f"并发客户端 {i}", ids, text, ref, r)
    h = _wait_idle(url)
    assert h["free_blocks"] == h["total_blocks"], f"32 个请求结束后 block 没有全部归还：{h}"
    record_case("concurrent:32-streams")


def _leave(url: str, r: Rand, streams: int, unary: bool, max_tokens: int) -> tuple[dict, dict, int]:
    """`streams` streaming clients read 2-6 frames and hang up, one non-streaming client gives up after 0.5 s.

    Returns /health before, /health once the engine ran 400 more steps (or went idle), and that step count.
    """
    import httpx
    before = _wait_idle(url)
    body = lambda i: {"model": MODEL, "prompt": _text(r, r.int(1, 20)), "max_tokens": max_tokens, "ignore_eos": True,
                      "seed": i, "stream": True}

    async def leave(client, i):
        async with client.stream("POST", url + "/v1/completions", json=body(i)) as resp:
            assert resp.status_code == 200, await resp.aread()
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= r.int(2, 6):
                    break                                   # leaving the block closes the connection

    async def leave_unary(client):
        try:
            await client.post(url + "/v1/completions", json={**body(99), "stream": False}, timeout=0.5)
        except httpx.TimeoutException:
            pass

    async def everyone():
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(leave(client, i) for i in range(streams)), *([leave_unary(client)] if unary else []))

    asyncio.run(everyone())
    closed = _health(url)["steps"]
    soon = _after_steps(url, closed, 400)          # counted in engine steps, not seconds: a loaded CPU only slows it
    return before, soon, soon["steps"] - closed


@point("8 个客户端中途断开：请求被 abort，block 与 GDN 状态槽位全部归还")
def test_disconnect_aborts():
    r = Rand()
    for family, streams, unary, max_tokens in (("qwen3", 8, True, 900), ("qwen3_5_text", 8, False, 430)):
        url = _live(family=family)
        before, soon, steps = _leave(url, r, streams, unary, max_tokens)
        what = f"{family}：{streams + unary} 个客户端断开后"
        if soon["unfinished"]:
            mistake = ("非流式请求的客户端断开没有被发现（只有流式响应会被取消，非流式要自己监听 http.disconnect）"
                       if soon["unfinished"] == 1 and unary else "客户端断开（或提前结束）时没有 abort 引擎里的请求")
            raise AssertionError(f"{what}引擎又跑了 {steps} 步，还有 {soon['unfinished']} 个请求在算：请求没有被 abort，"
                                 f"一直算到 max_tokens\n  看起来像易错点：{mistake}")
        h = _wait_idle(url)
        assert h["free_blocks"] == h["total_blocks"] == before["total_blocks"], f"{what}留下了没归还的 block：{h}"
        assert h["pending"] == 0, f"{what}它们仍计在 pending 里：{h}"
        assert h.get("gdn_free_slots", 0) == h.get("gdn_slots", 0), f"{what}GDN 状态槽位没有全部归还：{h}"
        record_case(f"disconnect:{family}-streams" + ("+unary" if unary else ""))
    assert "gdn_slots" in h, f"混合模型的 /health 应报告 GDN 槽位（AsyncEngine.stats）：{h}"
    _leave_before_accept(impl(MODULE))
    record_case("disconnect:before-the-engine-took-it")
    _leave_before_body(impl(MODULE))


def _leave_before_accept(m) -> None:
    """A client that leaves while the engine thread is still taking its request (add_request held for a moment):
    its add() is cancelled, so add itself must release the slot, and the request is aborted once the engine has it."""
    llm = _e05_llm(max_num_seqs=2, num_kvcache_blocks=16)
    taking, go = threading.Event(), threading.Event()
    add_request = llm.add_request

    def slow_add(*args, **kwargs):
        taking.set()
        go.wait(10)
        return add_request(*args, **kwargs)
    llm.add_request = slow_add
    engine = m.AsyncEngine(llm, max_pending=4)
    params = impl("e01_sampling").SamplingParams(max_tokens=400, ignore_eos=True)

    async def scenario():
        task = asyncio.ensure_future(engine.add([1, 2, 3], params))
        while not taking.is_set():
            await asyncio.sleep(0.005)
        task.cancel()                                       # the client is gone before the engine answered
        try:
            await task
        except asyncio.CancelledError:
            pass
        go.set()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not llm.has_unfinished():
                break
        return engine.pending, llm.has_unfinished()
    engine.start()
    try:
        pending, unfinished = asyncio.run(asyncio.wait_for(scenario(), 15))
    finally:
        go.set()
        engine.shutdown()
    assert pending == 0, (f"客户端在引擎线程收下请求之前断开（add 里 await 的那一刻被取消）后 pending = {pending}：add 被取消时"
                          f"自己没有 release，这个名额永远占着（except asyncio.CancelledError: release 再 raise）")
    assert not unfinished, "客户端在引擎收下请求之前断开后，引擎收下它时应把它 abort，它却一直算到 max_tokens"


@point("超过队列上限的突发请求得到 503 + Retry-After，收下的请求全部完成，之后服务照常")
def test_burst_gets_503():
    import httpx
    url, r = _live(max_pending=4, max_num_seqs=2), Rand()
    n = r.int(12, 16)

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            send = lambda i: client.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": _text(r, 8), "max_tokens": 40, "ignore_eos": True, "seed": i})
            return await asyncio.gather(*(send(i) for i in range(n)))

    answers = asyncio.run(burst())
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 503}, f"突发请求只应得到 200 或 503，得到 {codes}"
    busy = [a for a in answers if a.status_code == 503]
    assert busy, f"上限 4 个在途请求，同时来了 {n} 个，却没有一个 503：{codes}"
    assert 4 <= codes.count(200), f"至少应收下 4 个请求（上限），只收下了 {codes.count(200)} 个：{codes}"
    for a in busy:
        assert a.headers.get("retry-after"), "503 应带 Retry-After 头"
        assert a.json()["error"]["message"], f"503 也应是 OpenAI 风格的错误 JSON：{a.text}"
    for a in answers:
        if a.status_code == 200:
            choice = a.json()["choices"][0]
            assert a.json()["usage"]["completion_tokens"] == 40 and choice["finish_reason"] == "length", \
                f"收下的请求应完整生成 40 个 token：{a.text}"
    h = _wait_idle(url, until_engine_idle=True)          # the engine is idle: nothing can still be in flight
    assert h["pending"] == 0, (f"所有请求都结束了，在途计数却是 {h['pending']}：之后的请求会一直被 503"
                               "\n  看起来像易错点：被 503 拒绝的请求也占了名额（计数先加后判断，拒绝时没减回去）")
    later = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert later.status_code == 200, f"突发过后服务应恢复正常，得到 {later.status_code}: {later.text}"
    assert h["free_blocks"] == h["total_blocks"], f"突发过后 block 没有全部归还：{h}"
    record_case("burst:503-retry-after-then-normal")


ADMISSION = "准入的比较差一位：在途恰好 max_pending 个时才算满（pending >= max_pending 时拒绝，判断在 pending += 1 之前）"


@point("准入上限恰好是 max_pending：在途少于上限时照常收下，在途恰好 max_pending 个时下一个得 503")
def test_admission_bound_is_exact():
    import httpx
    url = _live(max_pending=4, max_num_seqs=2)
    engine = _server(max_pending=4, max_num_seqs=2)[1]
    bound, llm = engine.max_pending, engine.llm
    gate, inside = threading.Event(), threading.Event()
    real_step = llm.step

    def step():                                 # the engine stays in its first step: nothing in flight can end
        inside.set()
        gate.wait(14)
        return real_step()

    async def run():
        async with httpx.AsyncClient(timeout=30, base_url=url) as client:
            sent = []

            def send(i):
                sent.append(asyncio.ensure_future(client.post("/v1/completions", json={
                    "model": MODEL, "prompt": f"a{i}", "max_tokens": 2, "ignore_eos": True})))
                return sent[-1]

            try:
                return await admit(send)
            finally:                            # a failed check leaves no request behind
                gate.set()
                for task in sent:
                    task.cancel()
                await asyncio.gather(*sent, return_exceptions=True)

    async def admit(send):
        """Requests 1..bound are admitted while the engine is held; request bound + 1 gets the 503."""
        admitted = []
        for i in range(1, bound + 1):
            task = send(i)
            await _until(lambda: task.done() or _health(url)["pending"] >= i, 5)
            if task.done():
                a = task.result()
                raise AssertionError(f"在途 {i - 1} 个请求（上限 max_pending = {bound}）时，第 {i} 个请求得到 "
                                     f"{a.status_code}：{a.text[:200]}"
                                     + (f"\n  看起来像易错点：{ADMISSION}" if a.status_code == 503 else ""))
            pending = _health(url)["pending"]
            assert pending == i, (f"第 {i} 个请求被收下（引擎停在一步里，它还在等引擎的回答），/health 的在途计数应为 "
                                  f"{i}，得到 {pending}：add 判断名额之后马上 pending += 1，再发命令、等回答")
            admitted.append(task)
            record_case("admission:below-the-bound-admitted")
            if i == 1:
                await _until(inside.is_set, 5)
        extra = send(bound + 1)
        await _until(lambda: extra.done() or _health(url)["pending"] > bound, 5)
        if not extra.done():
            raise AssertionError(f"在途已有 {bound} 个请求（= 上限 max_pending）时，第 {bound + 1} 个请求仍被收下"
                                 f"（/health 在途 {_health(url)['pending']} 个）\n  看起来像易错点：{ADMISSION}")
        over = extra.result()
        _openai_error(over, f"在途 {bound} 个（= 上限）时的第 {bound + 1} 个请求", 503)
        assert over.headers.get("retry-after"), "503 应带 Retry-After 头"
        record_case("admission:at-the-bound-503")
        gate.set()
        return await asyncio.gather(*admitted)

    h = _wait_idle(url, 10, until_engine_idle=True)
    assert h["pending"] == 0, f"检查开始时引擎已空闲，在途计数却是 {h['pending']}（之前的请求没有 release）：{h}"
    try:
        with _Patched(llm, step=step):
            answers = asyncio.run(asyncio.wait_for(run(), 18))
    finally:
        gate.set()
    assert [a.status_code for a in answers] == [200] * bound, \
        f"收下的 {bound} 个请求都应完成：{[(a.status_code, a.text[:100]) for a in answers]}"
    h = _wait_idle(url, 10, until_engine_idle=True)
    assert h["pending"] == 0, (f"{bound} 个请求都完成、1 个得到 503 之后，在途计数应归零，得到 {h['pending']}：{h}" + (
        "\n  看起来像易错点：被 503 拒绝的请求也占了名额（计数先加后判断，拒绝时没减回去）" if h["pending"] == 1 else ""))


IGNORE_EOS = ("ignore_eos 时把 eos 当成了 stop：ignore_eos=True 的请求抽到 eos 不结束，最后一个 token 恰好是 eos "
              "也是按 max_tokens 结束的，finish_reason 应为 'length'")


@point("finish_reason：eos 结束为 stop，ignore_eos 时最后一个 token 恰是 eos 仍为 length，stop_token_ids 里的 token 为 stop")
def test_finish_reason():
    import httpx
    url, r = _live(), Rand()
    llm = _server()[1].llm
    eos = llm.scheduler.config.eos_token_id
    last = {}
    real_step = llm.step

    def step():                                 # the event that ends a request carries the token the case wants
        return [(rid, last["token"] if done else token, done) for rid, token, done in real_step()]

    plain = r.int(40, 120)                      # a printable byte: neither eos nor a stop id
    cases = [  # (what, extra fields, the last token, finish_reason, what a wrong answer means)
        ("ignore_eos=True，最后一个 token 恰是 eos（按 max_tokens 结束）", {"ignore_eos": True}, eos, "length",
         f"\n  看起来像易错点：{IGNORE_EOS}"),
        ("ignore_eos=False，第 max_tokens 个 token 是 eos", {}, eos, "stop",
         "：eos 结束的请求 finish_reason 是 'stop'，哪怕它恰好是第 max_tokens 个（按最后一个 token 判断，不按生成了几个）"),
        ("ignore_eos=True，stop_token_ids 含 eos，最后一个 token 是 eos", {"ignore_eos": True, "stop_token_ids": [eos]},
         eos, "stop", "：stop_token_ids 里的 token 结束的请求 finish_reason 是 'stop'（ignore_eos 只管 eos，不管 stop_token_ids）"),
        ("最后一个 token 是普通 token（按 max_tokens 结束）", {"ignore_eos": True}, plain, "length",
         "：按 max_tokens 结束、最后一个 token 既不是 eos 也不在 stop_token_ids 里，finish_reason 是 'length'"),
    ]
    _wait_idle(url, 10)
    with _Patched(llm, step=step), httpx.Client(base_url=url, timeout=30) as client:
        for what, extra, token, want, why in r.py.sample(cases, len(cases)):
            last["token"] = token
            body = {"model": MODEL, "prompt": _text(r, r.int(2, 8)), "max_tokens": r.int(2, 5), "temperature": 0, **extra}
            a = client.post("/v1/completions", json=body)
            assert a.status_code == 200, f"{what}：{a.status_code} {a.text[:300]}"
            got = a.json()["choices"][0]["finish_reason"]
            assert got == want, f"{what}：finish_reason 应为 {want!r}，得到 {got!r}{why}"
            record_case(f"finish:{what}")
        last["token"] = eos                     # the first case once more, streamed
        body = {"model": MODEL, "prompt": _text(r, r.int(2, 8)), "max_tokens": r.int(2, 5), "temperature": 0,
                **cases[0][1], "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as resp:
            frames = [f for f in resp.read().decode().split("\n\n") if f.startswith("data: {")]
        finishes = [c["choices"][0]["finish_reason"] for c in map(lambda f: json.loads(f[6:]), frames)
                    if c.get("choices") and c["choices"][0].get("finish_reason")]
        assert finishes == ["length"], f"流式的 {cases[0][0]}：finish_reason 应为 ['length']，得到 {finishes}{cases[0][4]}"
        record_case("finish:stream-ignore_eos-eos-length")


EMPTY_FRAMES = ("增量为空也发了帧：run_request 只在 delta 非空时 yield (delta, None)（扣住 stop、半个字符的那几步没有新文本），"
                "结束的那一帧才可以没有文本")


@point("stop 字符串与 stop token id：在 stop 处截断（流式也不漏出前半截），finish_reason 为 stop")
def test_stop_strings_and_ids():
    url, r = _live(), Rand()
    client = _client(url)
    for attempt in range(8):                         # find a run whose text holds a clean 2-character stop string
        s = _sampling(r, 48)
        s["extra_body"]["ignore_eos"] = True
        prompt = _text(r, r.int(2, 12))
        full = client.completions.create(model=MODEL, prompt=prompt, **s).choices[0]
        text, ids = full.text, full.model_extra["token_ids"]
        spots = [p for p in range(2, len(text) - 2) if "\ufffd" not in text[p:p + 2] and text.find(text[p:p + 2]) == p]
        if spots:
            break
    else:
        raise AssertionError(f"8 次运行都没有可用作 stop 的片段（{r}）")
    p = r.choice(spots)
    stop, want = text[p:p + 2], text[:p]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=prompt, stop=[stop, "\x00never"], stream=stream, **s)
        if stream:
            chunks = [c.choices[0] for c in out]
            got, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
            empty = sum(not c.text and not c.finish_reason for c in chunks)
            assert not empty, (f"stop={stop!r} 的流里有 {empty} 帧既没有文本也没有 finish_reason（stop 扣住文本的那几步）"
                               f"\n  看起来像易错点：{EMPTY_FRAMES}")
            record_case("stop-string:no-empty-frames")
        else:
            got, finish = out.choices[0].text, out.choices[0].finish_reason
        hint = ("\n  看起来像易错点：流式输出先漏出了 stop 字符串的前半截（没有留出 len(stop) - 1 个字符的缓冲）"
                if stream and got.startswith(want) and stop.startswith(got[len(want):]) and got != want else "")
        assert got == want and finish == "stop", (f"stop={stop!r}（stream={stream}）：应得到 {want!r} 与 "
                                                  f"finish_reason 'stop'，得到 {got!r} / {finish!r}{hint}\n  {r}")
        record_case(f"stop-string:{'stream' if stream else 'unary'}")
    k = r.int(3, len(ids) - 1)
    cut = ids.index(ids[k]) + 1
    s["extra_body"]["stop_token_ids"] = [ids[k]]
    out = client.completions.create(model=MODEL, prompt=prompt, **s).choices[0]
    assert out.model_extra["token_ids"] == ids[:cut] and out.finish_reason == "stop", \
        f"stop_token_ids=[{ids[k]}]：应停在第 {cut} 个 token（含），得到 {out.model_extra['token_ids']} / {out.finish_reason}"
    record_case("stop-token-id")
    h = _wait_idle(url, seconds=6)    # a count that never drops (requests kept) must fail here, inside the 20 s limit
    # /health's unfinished counts llm.requests: the scheduler done while it is not 0 means finished requests stayed
    kept = h["unfinished"] and not _server()[1].llm.has_unfinished()
    assert h["unfinished"] == 0 and h["free_blocks"] == h["total_blocks"], (
        f"命中 stop 字符串后引擎里的请求应被 abort：{h}\n  看起来像易错点："
        + (f"{KEPT_REQUESTS}（调度器里已经没有请求，llm.requests 里还留着 {h['unfinished']} 个）" if kept else
           "客户端断开（或提前结束）时没有 abort 引擎里的请求"))
    record_case("stop-string:engine-request-aborted")
    record_case("engine:finished-leave-llm.requests")


@point("卡片例子：“你好，世界”逐字节的增量文本与 stop 字符串，以及 3 个 token 的 SSE 帧")
def test_card_example():
    import httpx
    m = impl(MODULE)
    _probe()
    tok = _oracle().tokenizer
    ids = tok.encode("你好，世界")
    assert len(ids) == 15
    stream = m.TextStream(tok, ["，世"])
    deltas = []
    for i, t in enumerate(ids):
        deltas.append(stream.push(t, finished=i == len(ids) - 1))
        if stream.stopped:
            break
    want = ["", "", "", "", "", "你", "", "", "好", "", "", ""]
    hint = ""
    if "".join(deltas).count("\ufffd"):
        hint = "\n  看起来像易错点：逐个 token 单独解码再拼接（多字节的 UTF-8 字符被拆成了 U+FFFD）"
    elif "，" in "".join(deltas):
        hint = "\n  看起来像易错点：流式输出先漏出了 stop 字符串的前半截（没有留出 len(stop) - 1 个字符的缓冲）"
    assert deltas == want and stream.stopped, f"TextStream(stop=['，世']) 逐字节的增量：得到 {deltas}，期望 {want}{hint}"
    record_case("card:text-stream-stop")
    plain = m.TextStream(tok, [])
    got = [plain.push(t, finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    want = ["", "", "你", "", "", "好", "", "", "，", "", "", "世", "", "", "界"]
    assert got == want, f"TextStream(没有 stop) 逐字节的增量：得到 {got}，期望 {want}"
    record_case("card:text-stream-no-stop")

    url = _live()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream"), resp.headers
        raw = resp.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and all(f.startswith("data: ") for f in frames[:-1]), f"SSE 帧应是 'data: ...\\n\\n'：{raw!r}"
    assert frames[-2] == "data: [DONE]", f"流应以 data: [DONE] 结束：{frames[-2:]}"
    chunks = [json.loads(f[6:]) for f in frames[:-2]]
    texts = [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks if c["choices"]]
    assert texts == [("i", None), ("i", None), ("i", "length")], f"卡片例子的 3 个 token：{texts}"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                                                  "total_tokens": 5}, f"usage chunk：{chunks[-1]}"
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1, chunks
    record_case("card:sse-3-tokens-usage")
    del body["stream_options"]                  # the card: no usage frame without stream_options
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
        frames = [f for f in resp.read().decode().split("\n\n") if f]
    chunks = [json.loads(f[6:]) for f in frames[:-1]]
    assert frames[-1] == "data: [DONE]" and not any("usage" in c for c in chunks), (
        f"不带 stream_options 时流里不应有 usage 帧（include_usage 为假），得到 {frames[-2:]}"
        f"\n  看起来像易错点：{USAGE_ALWAYS}")
    record_case("card:sse-no-usage-without-stream-options")
    a = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=30).json()
    assert a.get("object") == "text_completion" and [c["text"] for c in a.get("choices", [])] == ["iii"] \
        and a.get("usage") == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}, \
        f"卡片例子的 \"stream\": false：一个 JSON，choices[0].text = 'iii'，usage 2 + 3 = 5，得到 {a}"
    record_case("card:unary-iii")


USAGE_ALWAYS = "没有 stream_options 也发了 usage 帧：usage 帧只在 include_usage 为真时发（sse_frames 的 else 分支里查 req.include_usage）"


class _Patched:
    """Replace methods of one engine's LLM for the length of a `with` (the engine thread sees the instance attribute)."""

    def __init__(self, llm, **methods):
        self.llm, self.methods = llm, methods

    def __enter__(self):
        for name, fn in self.methods.items():
            setattr(self.llm, name, fn)
        return self

    def __exit__(self, *exc):
        for name in self.methods:
            self.llm.__dict__.pop(name, None)


SECRET = "secret-internal-detail-7f3a"


@point("引擎的某一步抛异常：在途的请求各自得到 500 或 SSE 错误事件 + [DONE]（不外泄异常文本），block 归还，服务照常")
def test_engine_step_failure():
    import httpx
    url = _live()
    llm, armed, fired = _server()[1].llm, threading.Event(), threading.Event()
    real_step = llm.step

    def step():
        if armed.is_set():
            armed.clear()
            fired.set()
            raise RuntimeError(SECRET)
        return real_step()

    body = {"model": MODEL, "prompt": "ok", "max_tokens": 600, "ignore_eos": True}

    async def both():
        async with httpx.AsyncClient(timeout=12) as client:
            async def streamed():
                frames = []
                try:
                    async with client.stream("POST", url + "/v1/completions", json={
                            **body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
                        async for line in resp.aiter_lines():
                            if not line:
                                continue
                            frames.append(line)
                            if len(frames) == 2:            # both requests are in the engine: fail its next step
                                await _until(lambda: _health(url)["unfinished"] == 2)
                                armed.set()
                except httpx.TransportError as exc:
                    frames.append(f"<连接被断开：{exc!r}>")
                return frames

            both = asyncio.gather(streamed(), client.post(url + "/v1/completions", json=body))
            while not both.done():                      # a dead engine thread would leave both waiting forever
                await asyncio.wait({both}, timeout=0.2)
                if fired.is_set() and (await client.get(url + "/health")).json()["status"] != "ok":
                    both.cancel()
                    raise AssertionError("step() 抛异常之后引擎线程退出了，在途和之后的请求都不会再有回应"
                                         "\n  看起来像易错点：_loop 没有捕获 step() 的异常")
            return both.result()

    _wait_idle(url, 5)
    with _Patched(llm, step=step):
        frames, unary = asyncio.run(asyncio.wait_for(both(), 15))
    h = _wait_idle(url, 5, until_engine_idle=True)
    assert SECRET not in unary.text and not any(SECRET in f for f in frames), \
        f"引擎的异常文本被发给了客户端：{unary.text[:200]} / {frames[-2:]}\n  看起来像易错点：500 的 message 用了 str(exc)"
    _openai_error(unary, "step() 失败时在途的非流式请求", 500)
    record_case("step-fails:unary-500-no-text")
    chunks = [json.loads(f[6:]) if f.startswith("data: {") else None for f in frames]
    at = next((i for i, c in enumerate(chunks) if isinstance(c, dict) and "error" in c), None)
    after = frames[at + 1:] if at is not None else []
    assert at is None or after == ["data: [DONE]"], (
        f"SSE 错误事件之后应只有 data: [DONE]，得到 {after}" + (
            "\n  看起来像易错点：错误帧之后又发了 usage 帧（出错的流没有完整的用量：include_usage 的那一帧只在正常结束时发）"
            if any(isinstance(c, dict) and "usage" in c for c in chunks[at + 1:]) else ""))
    tail = frames[-2:]
    error = chunks[-2].get("error") if len(chunks) > 1 and isinstance(chunks[-2], dict) else None
    assert tail[-1:] == ["data: [DONE]"] and isinstance(error, dict) and error.get("message"), (
        f"200 之后出的错要写进流里：一帧 data: {{\"error\": {{...}}}}，再 data: [DONE]；得到最后两帧 {tail}"
        "\n  看起来像易错点：sse_frames 没有把 run_request 的异常变成 SSE 错误事件（流被直接截断）")
    record_case("step-fails:stream-error-frame-then-done")
    leaked = h["free_blocks"] < h["total_blocks"]
    assert h["unfinished"] == 0 and not leaked, (f"step() 失败后在途的请求应被 abort：{h}" + (
        "\n  看起来像易错点：出错的请求没有 llm.abort（答复已经发出，请求却还留在引擎里或占着 block）"
        if h["unfinished"] or leaked else ""))
    assert h["pending"] == 0, f"step() 失败、引擎空闲之后在途计数应归零：{h}"
    ok = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, f"出错之后的正常请求：{ok.text}"
    record_case("step-fails:aborted-then-serves")


async def _until(ready, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not ready() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


ADD_ONLY_VALUE = ("_apply_commands 只捕获了 add_request 的 ValueError：别的异常（引擎自己的 bug、内存不够……）从引擎线程里"
                  "抛出去，线程退出，这个请求和之后的每个请求都等不到回应；要捕获 Exception，ValueError 之外的回 500，线程照常")
ADD_ERROR_400 = ("add_request 的非 ValueError 异常被当成了 400：ValueError 是请求的错（400，点名字段），别的异常是服务器的错"
                 "（500 internal_error，message 不带异常文本）")


@point("引擎的某一步抛异常：在途的请求各自得到 500 或 SSE 错误事件 + [DONE]（不外泄异常文本），block 归还，服务照常")
def test_add_request_failure():
    import httpx
    url = _live(max_pending=5, max_num_seqs=3)                # its own server: a dead engine thread stays here
    llm = _server(max_pending=5, max_num_seqs=3)[1].llm

    def add_request(*args, **kwargs):
        raise RuntimeError(SECRET)                           # not a ValueError: the engine's fault, not the request's

    _wait_idle(url, 5)
    body = {"model": MODEL, "prompt": "ok", "max_tokens": 3, "ignore_eos": True}
    with _Patched(llm, add_request=add_request):
        for stream in (False, True):
            what = f"add_request 抛 RuntimeError（不是 ValueError）时的{'流式' if stream else '非流式'}请求"
            try:
                a = httpx.post(url + "/v1/completions", json={**body, "stream": stream}, timeout=8)
            except httpx.TimeoutException:
                alive = _health(url)["status"] == "ok"
                raise AssertionError(f"{what}：8 s 没有回应，引擎线程{'还活着' if alive else '已经退出'}"
                                     + ("" if alive else f"\n  看起来像易错点：{ADD_ONLY_VALUE}")) from None
            _openai_error(a, what, 500, ADD_ERROR_400 if a.status_code == 400 else None)
            assert SECRET not in a.text, \
                f"{what}：异常文本被发给了客户端：{a.text[:200]}\n  看起来像易错点：500 的 message 用了 str(exc)"
            record_case(f"add-fails:non-value-error-500-{'stream' if stream else 'unary'}")
    h = _wait_idle(url, 5, until_engine_idle=True)
    assert h["status"] == "ok", f"add_request 抛异常之后引擎线程应照常运行：{h}\n  看起来像易错点：{ADD_ONLY_VALUE}"
    assert h["pending"] == 0, (f"两个请求都被引擎拒绝了（500），在途计数却是 {h['pending']}\n  看起来像易错点："
                               "add 收到 add_request 的异常之后没有 release（ValueError 之外的异常也一样）")
    ok = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, \
        f"add_request 抛过异常之后的正常请求应照常完成，得到 {ok.status_code}: {ok.text[:200]}"
    record_case("add-fails:loop-keeps-serving")


@point("被引擎拒绝的请求（400）不占准入名额：连续 9 个之后服务照常收下请求")
def test_refused_requests_free_their_slot():
    import httpx
    url = _live(max_pending=4, max_num_seqs=2)
    _wait_idle(url, until_engine_idle=True)
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(9):                      # valid JSON, refused by llm.add_request: out of the vocabulary
            a = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 10**6 + i]})
            mistake = ("引擎拒绝的请求（add 收到 add_request 的 ValueError）没有 release：每个 400 都永久占掉一个名额"
                       if a.status_code == 503 else None)
            _openai_error(a, f"第 {i + 1} 个越界 token id 的请求", 400, mistake)
        h = _health(url)
        assert h["pending"] == 0, (f"9 个请求都被拒绝了，在途计数却是 {h['pending']}\n  看起来像易错点："
                                   "引擎拒绝的请求（add 收到 add_request 的 ValueError）没有 release")
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200, f"拒绝过的请求之后应照常收下请求，得到 {ok.status_code}: {ok.text[:200]}"
        record_case("refused:value-error-400-releases")


@point("引擎线程在两步之间取完全部命令：同时到达的请求进入同一步")
def test_commands_batched_per_step():
    import httpx
    url, r = _live(), Rand()
    engine = _server()[1]
    llm, gate, inside = engine.llm, threading.Event(), threading.Event()
    real_step, real_add, added = llm.step, llm.add_request, []

    def step():
        if not inside.is_set():                 # the first step waits until the others are queued
            inside.set()
            gate.wait(14)
        return real_step()

    def add_request(*args, **kwargs):
        added.append(llm.stats["steps"])
        return real_add(*args, **kwargs)

    k = r.int(3, 6)

    async def run():
        async with httpx.AsyncClient(timeout=30, base_url=url) as client:
            send = lambda i: client.post("/v1/completions", json={"model": MODEL, "prompt": f"r{i}", "max_tokens": 3,
                                                                  "ignore_eos": True})
            first = asyncio.ensure_future(send(0))
            await _until(inside.is_set)
            rest = [asyncio.ensure_future(send(i)) for i in range(1, k + 1)]
            await _until(lambda: engine.commands.qsize() >= k, 10)
            gate.set()
            return await asyncio.gather(first, *rest)

    assert _wait_idle(url, 10, until_engine_idle=True)["status"] == "ok", "引擎线程已经退出"
    try:
        with _Patched(llm, step=step, add_request=add_request):
            answers = asyncio.run(asyncio.wait_for(run(), 17))
    finally:
        gate.set()
    assert [a.status_code for a in answers] == [200] * (k + 1), [a.text[:100] for a in answers]
    assert len(set(added[1:])) == 1, (f"{k} 个请求在同一步期间到达，应在下一步之前全部 add_request（同一个步数），"
                                      f"实际 add_request 时的步数 {added[1:]}\n  看起来像易错点：_apply_commands 没有一次"
                                      "取完队列里的命令（每次只取一个：要一直取到 queue.Empty），请求一步一个地进入引擎")
    record_case("commands:all-between-two-steps")


N_REFUSED = "n > 1 仍被拒绝：parse_request 不再查 n（n 的范围由给出的 output_options 查，n 个样本由 build_app 拆成 n 个引擎请求）"


@point("n > 1（openai 客户端）：n 个样本是 seed + i 的 n 个引擎请求（重跑相同），每个 choice 带自己的 index，流式交错发出，"
       "prompt 的整块经 prefix cache 共享")
def test_n_choices():
    e01 = impl("e01_sampling")
    url, r = _live(), Rand()
    client, tok = _client(url), _oracle().tokenizer
    n, prompt = r.int(2, 4), _text(r, r.int(40, 60))
    s = _sampling(r, r.int(6, 16))
    s["extra_body"]["ignore_eos"] = True      # every choice runs all its steps in the same batches: the stream interleaves
    refs = _reference([prompt] * n, [_params(e01, s, seed=s["seed"] + i) for i in range(n)])
    before = _wait_idle(url)["prefix_hit_blocks"]
    try:
        out = client.completions.create(model=MODEL, prompt=prompt, n=n, **s)
    except Exception as exc:
        raise AssertionError(f"n = {n} 的请求失败：{exc}\n  看起来像易错点：{N_REFUSED}") from None
    hits = _wait_idle(url)["prefix_hit_blocks"] - before
    assert sorted(c.index for c in out.choices) == list(range(n)), \
        f"n = {n}：choices 的 index 应为 0..{n - 1}，得到 {[c.index for c in out.choices]}"
    for c in sorted(out.choices, key=lambda c: c.index):
        _same(f"n = {n} 的 choice {c.index}（seed + {c.index}）", (c.model_extra or {}).get("token_ids"), c.text,
              refs[c.index], r)
    assert out.usage.completion_tokens == sum(len(ref.token_ids) for ref in refs), f"usage 应计入每个 choice：{out.usage}"
    record_case("n:seed+i-per-choice")
    again = client.completions.create(model=MODEL, prompt=prompt, n=n, **s)
    assert {c.index: c.text for c in again.choices} == {c.index: c.text for c in out.choices}, \
        "同一个带 seed 的 n > 1 请求重跑一次，n 个样本应与第一次相同"
    record_case("n:rerun-same")
    full = (len(tok.encode(prompt)) - 1) // _oracle().config.block_size
    assert hits >= (n - 1) * full, (f"n = {n} 个样本的 prompt 相同（{full} 个可共享的整块），prefix cache 应命中至少 "
                                    f"{(n - 1) * full} 块，得到 {hits}")
    record_case("n:prefix-cache-shared")
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, n=n, stream=True,
                                            stream_options={"include_usage": True}, **s))
    order = [ch.index for c in chunks for ch in c.choices]
    for i in range(n):
        got = "".join(ch.text for c in chunks for ch in c.choices if ch.index == i)
        ids = [(ch.model_extra or {}).get("token_ids") for c in chunks for ch in c.choices
               if ch.index == i and ch.finish_reason]
        assert len(ids) == 1, f"流式 n = {n}：choice {i} 应有且只有一个带 finish_reason 的 chunk，得到 {len(ids)} 个"
        _same(f"流式 n = {n} 的 choice {i}", ids[0], got, refs[i], r)
    # a choice may hold its text back for a step or two (an incomplete UTF-8 character), so the frames of a step need
    # not come in index order; what a sequential server does (one choice to its end, then the next) cannot happen
    grouped = all(set(order[order.index(i):len(order) - order[::-1].index(i)]) == {i} for i in range(n))
    assert not grouped, (f"流式 n = {n}：各个 choice 的帧应交错发出（它们在引擎里同批生成），得到的 index 顺序 {order}："
                         "每个 choice 的帧连成一段，像是一个 choice 生成完才开始下一个")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == out.usage.completion_tokens, \
        f"流式 n = {n}：最后一帧的 usage 应计入每个 choice：{chunks[-1]}"
    assert len({c.id for c in chunks}) == 1, "流式 n > 1：所有帧的 id 应相同"
    record_case("n:stream-interleaved")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], n=n, **s)
    assert sorted(c.index for c in chat.choices) == list(range(n)), f"chat n = {n}：{chat.choices}"
    record_case("n:chat")
    h = _wait_idle(url)
    assert h["pending"] == 0 and h["free_blocks"] == h["total_blocks"], f"n > 1 的请求结束后：{h}"


@point("chat 的 content 可以是 text 分段的列表（换行连接），developer 角色按 system 处理（openai 客户端）")
def test_content_parts_and_developer():
    url, r = _live(), Rand()
    client = _client(url)
    # 2-3 parts of 40-80 characters: well inside the context, more than max_model_len / longest_token characters
    parts, system = [_text(r, r.int(40, 80)) for _ in range(r.int(2, 3))], _text(r, r.int(3, 6))
    s = dict(max_tokens=r.int(3, 8), temperature=0, extra_body={"return_token_ids": True})
    try:
        plain = client.chat.completions.create(model=MODEL, **s, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "\n".join(parts)}])
        split = client.chat.completions.create(model=MODEL, **s, messages=[
            {"role": "developer", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "text", "text": p} for p in parts]}])
    except Exception as exc:
        hint = ("放得下的 chat prompt 被当成超长拒绝了：字符数的上限是 max_model_len × longest_token(tokenizer)"
                if getattr(exc, "code", None) == "context_length_exceeded" else
                "parse_request 没有用 chat_message 检查、整理每条消息（developer → system，分段用换行连接）")
        raise AssertionError(f"developer 角色、text 分段的 content 应被收下，得到 {exc}\n  看起来像易错点：{hint}") from None
    assert split.usage.prompt_tokens == plain.usage.prompt_tokens, (
        f"developer + 分段的 content 应与 system + 换行连接的字符串得到同一个 prompt：prompt_tokens "
        f"{split.usage.prompt_tokens} ≠ {plain.usage.prompt_tokens}")
    assert split.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"], "greedy 的输出应相同"
    record_case("chat:text-parts-joined")
    record_case("chat:developer-is-system")


@functools.lru_cache(maxsize=None)
def _hf_server(family: str):
    """A server over an HF checkpoint (tiny, fp32, every weight random) and that HF model, for the logprob oracle."""
    import tempfile
    from pathlib import Path

    from course.runtime.serve import BackgroundServer
    from course.runtime.tiny_tokenizer import byte_tokenizer
    r, tok = Rand(), byte_tokenizer()
    hf = hf_models.hf_model(family, hf_models.tiny_config(family, r, vocab=len(tok), layers=2), r)
    folder = hf_models.save_hf(hf, Path(tempfile.mkdtemp(prefix="e06-hf-")))
    llm = impl("e05_engine").LLM(str(folder), tokenizer=tok, max_model_len=256, max_num_seqs=8, num_kvcache_blocks=64)
    engine = impl(MODULE).AsyncEngine(llm)
    return BackgroundServer(impl(MODULE).build_app(engine.start(), MODEL)).url, hf, r


def _close(what: str, got: list, want, r: Rand, tol: float = 2e-4) -> None:
    import torch
    got_t = torch.tensor(got, dtype=torch.float64)
    want = torch.as_tensor(want, dtype=torch.float64)
    err = (got_t - want).abs().max().item() if len(got) else 0.0
    assert len(got) == len(want) and err < tol, (
        f"{what}：应是模型原始 logits 的 log-softmax（HF 在同一串 token 上的 logits；温度、top-k/p 之前），"
        f"最大误差 {err:.3g}\n  得到 {got[:6]}\n  期望 {want[:6].tolist()}\n  {r}")


@point("logprobs（completions 0–5 + echo，chat logprobs + top_logprobs）：模型原始 logits 的 log-softmax，与 HF 的 logits "
       "相同；echo 给出 prompt 每个 token 的 logprob（prefix cache 命中时也是），流式逐帧给出")
def test_logprobs_match_hf():
    import torch
    _probe()
    for family in ("qwen3", "qwen3_5_text"):
        url, hf, _ = _hf_server(family)
        r, client = Rand(), _client(url)
        prompt = [r.int(0, 255) for _ in range(r.int(34, 60))]
        first, temps = r.choice([False, True]), r.py.sample([0.5, 1.5], 2)
        for attempt, stream in ((0, first), (1, not first)):   # both modes on every run; the second hits the cache
            k = r.int(1, 5)
            # ignore_eos: exactly max_tokens tokens, a count that comes from the request, not from the answer
            s = dict(max_tokens=r.int(3, 8), temperature=temps[attempt], seed=r.int(0, 10**6), logprobs=k,
                     echo=True, extra_body={"return_token_ids": True, "top_k": 3, "ignore_eos": True})
            what = f"{family}：completions logprobs={k} echo（第 {attempt + 1} 次，stream={stream}）"
            out = client.completions.create(model=MODEL, prompt=prompt, stream=stream, **s)
            chunks = list(out) if stream else [out]
            choices = [c.choices[0] for c in chunks if c.choices]
            completion = [t for c in choices for t in ((c.model_extra or {}).get("token_ids") or [])]
            text = "".join(c.text for c in choices)
            lp = [x for c in choices if c.logprobs for x in c.logprobs.token_logprobs]
            tokens = [x for c in choices if c.logprobs for x in c.logprobs.tokens]
            ids = prompt + completion
            ref = torch.log_softmax(hf_models.hf_logits(hf, [torch.tensor(ids)]).double(), -1)    # [L, V]
            n_new = s["max_tokens"]
            assert len(completion) == n_new, (
                f"{what}：ignore_eos 时正好生成 max_tokens = {n_new} 个 token，return_token_ids 应给出 {n_new} 个 id，"
                f"得到 {len(completion)} 个" + ("\n  （流式时 token_ids 放在 finish_reason 那一帧里）" if stream else ""))
            assert len(lp) == len(prompt) + n_new and lp[0] is None, (
                f"{what}：echo 时 token_logprobs 应有 prompt + completion = {len(ids)} 项、第一项是 null，"
                f"得到 {len(lp)} 项，第一项 {lp[:1]}")
            assert text.startswith(_oracle().tokenizer.decode(prompt)), f"{what}：echo 的文本应以 prompt 开头"
            assert len(tokens) == len(ids), f"{what}：tokens 应与 token_logprobs 一样长"
            _close(what, lp[1:], ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], r)
            tops = [t for c in choices if c.logprobs for t in c.logprobs.top_logprobs][1:]
            _close(f"{what} 的 top_logprobs 之首", [max(t.values()) for t in tops], ref[:-1].max(-1).values, r)
            record_case(f"logprobs:{family}-echo-{'stream' if stream else 'unary'}")
            record_case(f"logprobs:temperature-{s['temperature']}")
            if attempt:
                record_case("logprobs:echo-prefix-cache-hit")
        if family == "qwen3":                     # lm-evaluation-harness's local-completions: a batch of prompts
            batch = [[r.int(0, 255) for _ in range(r.int(5, 20))] for _ in range(r.int(2, 3))]
            out = client.completions.create(model=MODEL, prompt=batch, echo=True, logprobs=1, max_tokens=1,
                                            temperature=0, extra_body={"return_token_ids": True})
            what = f"lm-eval 的一组 {len(batch)} 个 prompt（echo、logprobs=1、max_tokens=1）"
            assert sorted(c.index for c in out.choices) == list(range(len(batch))), f"{what}：{out.choices}"
            assert out.usage.prompt_tokens == sum(map(len, batch)), f"{what}：usage 应计入每个 prompt：{out.usage}"
            for c in out.choices:
                ids = batch[c.index] + c.model_extra["token_ids"]
                ref = torch.log_softmax(hf_models.hf_logits(hf, [torch.tensor(ids)]).double(), -1)
                assert c.logprobs.token_logprobs[0] is None, f"{what}：choice {c.index} 的第一项应是 null"
                _close(f"{what} 的 choice {c.index}", c.logprobs.token_logprobs[1:],
                       ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], r)
            record_case("logprobs:lm-eval-batch-of-prompts")
        messages = [{"role": "user", "content": _text(r, r.int(3, 12))}]
        k = r.int(0, 20)
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=r.int(3, 6), temperature=1.3,
                                             seed=r.int(0, 10**6), logprobs=True, top_logprobs=k,
                                             extra_body={"return_token_ids": True})
        tok = _oracle().tokenizer
        chat_ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        completion = out.choices[0].model_extra["token_ids"]
        content = out.choices[0].logprobs.content
        ref = torch.log_softmax(hf_models.hf_logits(hf, [torch.tensor(chat_ids + completion)]).double(), -1)
        ref = ref[len(chat_ids) - 1:-1]
        what = f"{family}：chat logprobs top_logprobs={k}"
        assert len(content) == len(completion), f"{what}：每个生成的 token 一项，应有 {len(completion)} 项，得到 {len(content)}"
        _close(what, [c.logprob for c in content], ref[torch.arange(len(completion)), torch.tensor(completion)], r)
        for i, c in enumerate(content):
            assert len(c.top_logprobs) == k, f"{what}：第 {i} 个 token 的 top_logprobs 应有 {k} 项，得到 {len(c.top_logprobs)}"
            _close(f"{what} 第 {i} 个 token 的 top_logprobs", [t.logprob for t in c.top_logprobs],
                   ref[i].topk(k).values, r)
        record_case(f"logprobs:{family}-chat-top_logprobs")


def _leave_before_body(m) -> None:
    """A client that is gone when the streaming answer starts (after add() returned, before the body's first
    byte): Starlette then never starts the body, so only the response's own cleanup can release the request."""
    llm = _e05_llm(max_num_seqs=4, num_kvcache_blocks=64)
    engine = m.AsyncEngine(llm, max_pending=8).start()
    app = m.build_app(engine, MODEL)

    async def leave(n: int):
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True,
                           "n": n}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())]}
        read = []

        async def receive():
            if not read:
                read.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)

        async def send(message):
            raise OSError("the client is gone")           # what uvicorn's send does on a closed connection

        try:
            await app(scope, receive, send)
        except Exception:
            pass
        for _ in range(200):
            await asyncio.sleep(0.02)
            if not llm.has_unfinished():
                break
        return engine.pending, llm.has_unfinished()

    try:
        for n in (1, 3):
            pending, unfinished = asyncio.run(asyncio.wait_for(leave(n), 20))
            assert pending == 0 and not unfinished, (
                f"n = {n}：客户端在 add 之后、流式响应开始之前离开（Starlette 不再启动响应体），pending = {pending}，"
                f"引擎里{'还有请求在算' if unfinished else '已经空闲'}：响应体的生成器从没运行，run_request 的 finally 也就不会运行；"
                "给出的 ReleasingStream 在响应结束时（无论怎样结束）release 每个 choice")
            record_case(f"disconnect:before-the-body-n={n}")
    finally:
        engine.shutdown()
