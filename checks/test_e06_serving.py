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
import time

import pytest

from checks.kit import Rand, impl, point
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
    from checks import hf_models
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


def _wait_idle(url: str, seconds: float = 20, until_engine_idle: bool = False) -> dict:
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


@point("openai 客户端：completion 与 chat、流式与非流式，token 与同一 seed 的 LLM.generate 逐个相同，usage 正确")
def test_openai_client_matches_generate():
    e01 = impl("e01_sampling")
    url, r = _live(), Rand()
    client, tok = _client(url), _oracle().tokenizer
    for chat in (False, True):
        for stream in (False, True):
            what = f"{'chat' if chat else 'completion'}（stream={stream}）"
            user, s = _text(r, r.int(3, 20)), _sampling(r, r.int(4, 24))
            s["extra_body"]["top_k"] = top_k = r.choice([-1, 0, 50])
            if chat:
                messages = [{"role": "system", "content": "简短回答"}, {"role": "user", "content": user}]
                prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                call = functools.partial(client.chat.completions.create, messages=messages)
            else:
                prompt = user
                call = functools.partial(client.completions.create, prompt=user)
            ref = _reference([prompt], [_params(e01, s, top_k=max(top_k, 0))])[0]
            opts = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            out = call(model=MODEL, **s, **opts)
            if stream:
                chunks = list(out)
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
    models = client.models.list()
    assert [x.id for x in models.data] == [MODEL], f"/v1/models 应列出 {MODEL!r}：{models}"


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
    for family, streams, unary, max_tokens in (("qwen3", 8, True, 900), ("qwen3_5_text", 8, False, 480)):
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
    assert "gdn_slots" in h, f"混合模型的 /health 应报告 GDN 槽位（AsyncEngine.stats）：{h}"


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


BAD = [  # (what, endpoint, body, the field the error must name, the classic mistake when it is accepted)
    ("非法 JSON", "completions", b'{"model": "tiny", "prompt": ', None, None),
    ("body 不是对象", "completions", [1, 2], None, None),
    ("缺 model", "completions", {"model": None, "prompt": "hi"}, "model", None),
    ("空 prompt", "completions", {"prompt": ""}, "prompt", None),
    ("缺 prompt", "completions", {}, "prompt", None),
    ("超长 prompt", "completions", {"prompt": "a" * MAX_MODEL_LEN}, "prompt", None),
    ("未知字段", "completions", {"prompt": "hi", "temprature": 0.5}, "temprature", "未知字段被悄悄忽略"),
    ("temperature < 0", "completions", {"prompt": "hi", "temperature": -1}, "temperature", None),
    ("top_p = 0", "completions", {"prompt": "hi", "top_p": 0}, "top_p", None),
    ("min_p > 1", "completions", {"prompt": "hi", "min_p": 1.5}, "min_p", None),
    ("top_k 是字符串", "completions", {"prompt": "hi", "top_k": "5"}, "top_k", None),
    ("max_tokens 是 true", "completions", {"prompt": "hi", "max_tokens": True}, "max_tokens", None),
    ("n 是 true", "completions", {"prompt": "hi", "n": True}, "n", "bool 被当成了数字（isinstance(True, int) 为真）"),
    ("max_tokens = 0", "completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", None),
    ("prompt + max_tokens 超过上下文", "completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens", None),
    ("seed < 0", "completions", {"prompt": "hi", "seed": -3}, "seed", None),
    ("n = 2", "completions", {"prompt": "hi", "n": 2}, "n", None),
    ("stop 是数字", "completions", {"prompt": "hi", "stop": 5}, "stop", None),
    ("越界的 token id", "completions", {"prompt": [1, 99999]}, "prompt", None),
    ("stream 是字符串", "completions", {"prompt": "hi", "stream": "yes"}, "stream", None),
    ("stream_options 没有 stream", "completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options", None),
    ("空 messages", "chat/completions", {"messages": []}, "messages", None),
    ("未知的 role", "chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]", None),
]


@point("20 个坏请求各得到 400，错误信息点名字段，服务照常")
def test_bad_requests_get_400():
    import httpx
    url, r = _live(), Rand()
    cases = r.py.sample(BAD, len(BAD))
    assert len(cases) >= 20
    with httpx.Client(base_url=url, timeout=30) as client:
        for what, endpoint, body, field, mistake in cases:
            if isinstance(body, dict):
                body = json.dumps({"model": MODEL, **body}).encode()
            elif not isinstance(body, bytes):
                body = json.dumps(body).encode()
            a = client.post(f"/v1/{endpoint}", content=body, headers={"Content-Type": "application/json"})
            hint = f"\n  看起来像易错点：{mistake}" if mistake and a.status_code == 200 else ""
            assert a.status_code == 400, f"坏请求「{what}」应得到 400，得到 {a.status_code}: {a.text[:300]}{hint}"
            error = a.json().get("error") or {}
            assert error.get("message") and error.get("type") == "invalid_request_error", \
                f"「{what}」的错误应是 OpenAI 风格 {{'error': {{'message', 'type', 'param', 'code'}}}}：{a.text}"
            assert error.get("param") == field, f"「{what}」的错误应点名字段 {field!r}，param 是 {error.get('param')!r}"
        wrong = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
        assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model", f"未知模型应得到 404：{wrong.text}"
        assert client.get("/health").json()["status"] == "ok", "坏请求之后服务应仍然健康"
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                  "ignore_eos": True})     # random weights may sample eos first
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, f"坏请求之后的正常请求：{ok.text}"


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
        else:
            got, finish = out.choices[0].text, out.choices[0].finish_reason
        hint = ("\n  看起来像易错点：流式输出先漏出了 stop 字符串的前半截（没有留出 len(stop) - 1 个字符的缓冲）"
                if stream and got.startswith(want) and stop.startswith(got[len(want):]) and got != want else "")
        assert got == want and finish == "stop", (f"stop={stop!r}（stream={stream}）：应得到 {want!r} 与 "
                                                  f"finish_reason 'stop'，得到 {got!r} / {finish!r}{hint}\n  {r}")
    k = r.int(3, len(ids) - 1)
    cut = ids.index(ids[k]) + 1
    s["extra_body"]["stop_token_ids"] = [ids[k]]
    out = client.completions.create(model=MODEL, prompt=prompt, **s).choices[0]
    assert out.model_extra["token_ids"] == ids[:cut] and out.finish_reason == "stop", \
        f"stop_token_ids=[{ids[k]}]：应停在第 {cut} 个 token（含），得到 {out.model_extra['token_ids']} / {out.finish_reason}"
    h = _wait_idle(url)
    assert h["unfinished"] == 0 and h["free_blocks"] == h["total_blocks"], \
        f"命中 stop 字符串后引擎里的请求应被 abort：{h}\n  看起来像易错点：客户端断开（或提前结束）时没有 abort 引擎里的请求"


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
    plain = m.TextStream(tok, [])
    got = [plain.push(t, finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    want = ["", "", "你", "", "", "好", "", "", "，", "", "", "世", "", "", "界"]
    assert got == want, f"TextStream(没有 stop) 逐字节的增量：得到 {got}，期望 {want}"

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
