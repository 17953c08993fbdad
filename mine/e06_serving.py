"""E06 · Serving: an OpenAI-compatible HTTP server over the engine loop (FastAPI + uvicorn).

    event loop (asyncio, uvicorn)                         engine thread (the only one that touches the LLM)
    POST /v1/completions       parse_request ─ 400        commands ─→ llm.add_request / llm.abort
    POST /v1/chat/completions  engine.add ──── 503 ──────→           llm.step() → (request_id, token, finished)
    SSE / JSON  ←─ TextStream ←─ handle.events ←── loop.call_soon_threadsafe ─┘
    client gone → engine.release(handle) → "abort" → blocks and GDN slot back before the next step

Tokens, not text, cross the thread boundary; the HTTP side decodes them (whole characters only) and cuts stop
strings. Errors follow OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .e01_sampling import SamplingParams

NUMBER, INT, BOOL, TEXT = (int, float), int, bool, str
COMMON = {"model": TEXT, "stream": BOOL, "stream_options": dict, "n": INT, "stop": (str, list), "user": TEXT,
          "max_tokens": INT, "temperature": NUMBER, "top_p": NUMBER, "top_k": INT, "min_p": NUMBER, "seed": INT,
          "stop_token_ids": list, "ignore_eos": BOOL, "return_token_ids": BOOL}
FIELDS = {False: {"prompt": (str, list), **COMMON},                                 # /v1/completions
          True: {"messages": list, "max_completion_tokens": INT, **COMMON}}          # /v1/chat/completions
RETRY_AFTER_S = 1                                    # what a 503 tells the client to wait
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos")


class RequestError(ValueError):
    """A bad request: HTTP 400 (404 for an unknown model) with a message naming the field `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class Overloaded(RuntimeError):
    """Too many requests in flight: HTTP 503 with Retry-After."""


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    chat: bool
    token_ids: list[int] = field(default_factory=list)    # filled while the request runs


def parse_request(body: object, chat: bool, tokenizer, model_name: str, max_model_len: int) -> ParsedRequest:
    """Check an OpenAI request body field by field; raise RequestError(message, param) at the first bad one.

    Unknown fields, wrong JSON types (bool is not a number), an empty or too long prompt, n != 1 and
    prompt + max_tokens beyond max_model_len are refused here; the sampling values by SamplingParams.
    """
    raise NotImplementedError("e06: 请实现 parse_request（见 lessons/e06_serving.md）")


class TextStream:
    """Incremental detokenization: token ids in, text deltas out; whole characters only, stop strings cut off."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.token_ids: list[int] = []
        self.text = ""                 # the decoded completion so far (ends before a stop string)
        self.sent = 0                  # characters of self.text already returned
        self.stopped = False           # a stop string was found: the request is over
        self.hold = max((len(s) for s in stop), default=1) - 1     # a stop string may still be forming here

    def push(self, token_id: int, finished: bool) -> str:
        """Add one token; return the text now safe to send (when finished or stopped: everything left)."""
        raise NotImplementedError("e06: 请实现 TextStream.push（见 lessons/e06_serving.md）")


@dataclass
class Handle:
    """One request as the event loop sees it; the engine thread fills `events` (via call_soon_threadsafe)."""
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int = -1
    finished: bool = False         # the engine sent the last token
    released: bool = False         # engine.release() ran (exactly once)


class AsyncEngine:
    """Steps the LLM on its own thread while requests come and go; the event loop talks to it by commands only."""

    def __init__(self, llm, max_pending: int = 64):
        self.llm, self.max_pending = llm, max_pending
        self.commands: queue.SimpleQueue = queue.SimpleQueue()    # ("add" | "abort", Handle), FIFO
        self.wakeup = threading.Event()
        self.handles: dict[int, Handle] = {}                        # engine thread only
        self.pending = 0                                            # event loop only: admitted, not released
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    def start(self) -> AsyncEngine:
        self.thread.start()
        return self

    def shutdown(self) -> None:
        self.running = False
        self.wakeup.set()
        self.thread.join(timeout=10)

    async def add(self, prompt_ids: list[int], params: SamplingParams) -> Handle:
        """Admit a request (Overloaded beyond max_pending), queue it for the engine thread, await its acceptance."""
        raise NotImplementedError("e06: 请实现 AsyncEngine.add（见 lessons/e06_serving.md）")

    async def tokens(self, handle: Handle) -> AsyncIterator[tuple[int, bool]]:
        """(token, finished) as the engine samples them."""
        while not handle.finished:
            item = await handle.events.get()
            if isinstance(item, Exception):
                handle.finished = True
                raise item
            handle.finished = item[1]
            yield item

    def release(self, handle: Handle) -> None:
        """The HTTP side is done with `handle` (finished, stopped early or the client left): abort if still running."""
        raise NotImplementedError("e06: 请实现 AsyncEngine.release（见 lessons/e06_serving.md）")

    def _send(self, kind: str, handle: Handle) -> None:
        self.commands.put((kind, handle))
        self.wakeup.set()

    def _loop(self) -> None:
        """The engine thread: apply the commands, step, pass each event to its request; sleep while idle."""
        raise NotImplementedError("e06: 请实现 AsyncEngine._loop（见 lessons/e06_serving.md）")

    def _apply_commands(self) -> None:
        """Everything the event loop sent since the last step, in order: add_request or abort."""
        raise NotImplementedError("e06: 请实现 AsyncEngine._apply_commands（见 lessons/e06_serving.md）")

    @property
    def stats(self) -> dict[str, int]:
        pool = self.llm.runner.gdn_pool                   # hybrid models: one state slot per running sequence
        gdn = {} if pool is None else {"gdn_free_slots": len(pool.free_slots), "gdn_slots": self.llm.config.max_num_seqs}
        return {**self.llm.stats, **gdn, "pending": self.pending, "unfinished": len(self.llm.requests)}


def _reply(handle: Handle, item) -> None:
    try:
        handle.loop.call_soon_threadsafe(handle.events.put_nowait, item)
    except RuntimeError:                              # the event loop is closed: the server is shutting down
        pass


async def run_request(engine: AsyncEngine, handle: Handle, req: ParsedRequest) -> AsyncIterator[tuple[str, str | None]]:
    """Async generator of (text delta, finish_reason or None) until the request ends; always releases the handle."""
    raise NotImplementedError("e06: 请实现 run_request（见 lessons/e06_serving.md）")


def _choice(req: ParsedRequest, text: str, finish: str | None) -> dict:
    if not req.chat:
        choice = {"index": 0, "text": text}
    elif req.stream:
        choice = {"index": 0, "delta": {"content": text} if text or not finish else {}}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    choice |= {"logprobs": None, "finish_reason": finish}
    if req.return_token_ids and finish is not None:    # vLLM's extension: the exact completion tokens
        choice["token_ids"] = list(req.token_ids)
    return choice


def _body(req: ParsedRequest, handle: Handle, model: str, choices: list[dict], usage: bool) -> dict:
    """The OpenAI envelope around `choices`; usage counts tokens, prompt and completion."""
    kind = ("chat.completion.chunk" if req.stream else "chat.completion") if req.chat else "text_completion"
    body = {"id": f"{'chatcmpl' if req.chat else 'cmpl'}-{handle.request_id}", "object": kind,
            "created": int(time.time()), "model": model, "choices": choices}
    if usage:
        n = len(req.token_ids)
        body["usage"] = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": n,
                         "total_tokens": len(req.prompt_ids) + n}
    return body


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def sse_frames(engine: AsyncEngine, handle: Handle, req: ParsedRequest, model: str) -> AsyncIterator[str]:
    """Async generator of server-sent events: a chunk per delta, the finish_reason chunk, usage if asked, [DONE].

    If the client disconnects, the server cancels this generator; run_request's finally aborts the request.
    """
    raise NotImplementedError("e06: 请实现 sse_frames（见 lessons/e06_serving.md）")


async def complete(engine: AsyncEngine, handle: Handle, req: ParsedRequest, model: str) -> dict:
    """The non-streaming answer: every delta joined, the finish_reason, usage."""
    parts, finish = [], None
    async for delta, finish in run_request(engine, handle, req):
        parts.append(delta)
    return _body(req, handle, model, [_choice(req, "".join(parts), finish)], True)


def error_response(exc: Exception) -> JSONResponse:
    """OpenAI's error JSON: 400/404 for a RequestError, 503 + Retry-After when overloaded, else 500."""
    if isinstance(exc, RequestError):
        kind, status, param, headers = "invalid_request_error", exc.status, exc.param, None
    elif isinstance(exc, Overloaded):
        kind, status, param, headers = "server_overloaded", 503, None, {"Retry-After": str(RETRY_AFTER_S)}
    else:
        kind, status, param, headers = "internal_error", 500, None, None
    body = {"error": {"message": str(exc), "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    """The HTTP surface: /v1/completions, /v1/chat/completions, /v1/models, /health."""
    app = FastAPI(title="course engine (OpenAI-compatible)")
    max_model_len = engine.llm.config.max_model_len

    async def generate(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(RequestError(f"invalid JSON: {exc}"))
        try:
            req = parse_request(body, chat, engine.llm.tokenizer, model_name, max_model_len)
            handle = await engine.add(req.prompt_ids, req.params)
        except (RequestError, Overloaded) as exc:
            return error_response(exc)
        if req.stream:
            return StreamingResponse(sse_frames(engine, handle, req, model_name), media_type="text/event-stream")
        return await _unless_disconnected(request, complete(engine, handle, req, model_name))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "course",
                                            "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        ok = engine.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped", **engine.stats}, status_code=200 if ok else 503)

    return app


async def _unless_disconnected(request: Request, work) -> JSONResponse | None:
    """Run `work`; if the client hangs up first, cancel it (its finally aborts the request in the engine)."""
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done():
        task.cancel()
        return None
    try:
        return JSONResponse(task.result())
    except Exception as exc:                          # an engine failure: a 500 for this request only
        return error_response(exc)
