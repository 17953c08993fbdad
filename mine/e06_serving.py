"""E06 · Serving: an OpenAI-compatible HTTP server over the engine loop (FastAPI + uvicorn).

    event loop (asyncio, uvicorn)                         engine thread (the only one that touches the LLM)
    POST /v1/completions       parse_request ─ 400        commands ─→ llm.add_request / llm.abort
    POST /v1/chat/completions  engine.add ──── 503 ──────→           llm.step() → (request_id, token, finished)
    SSE / JSON  ←─ TextStream ←─ handle.events ←── loop.call_soon_threadsafe ─┘
    client gone → engine.release(handle) → "abort" → blocks and GDN slot back before the next step

Tokens, not text, cross the thread boundary; the HTTP side decodes them (whole characters only) and cuts stop
strings. Parsing (JSON, chat template, tokenizer) runs on a worker thread, never on the event loop. Every error follows
OpenAI's shape, {"error": {"message", "type", "param", "code"}}: before the 200 as a JSON response (4xx for bad
input), after it as an SSE error event that ends the stream. One bad request never fails another.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .e01_sampling import SamplingParams

NUMBER, INT, BOOL, TEXT = (int, float), int, bool, str
COMMON = {"model": TEXT, "stream": BOOL, "stream_options": dict, "n": INT, "stop": (str, list), "user": TEXT,
          "max_tokens": INT, "temperature": NUMBER, "top_p": NUMBER, "top_k": INT, "min_p": NUMBER, "seed": INT,
          "stop_token_ids": list, "ignore_eos": BOOL, "return_token_ids": BOOL}
FIELDS = {False: {"prompt": (str, list), **COMMON},                                 # /v1/completions
          True: {"messages": list, "max_completion_tokens": INT, **COMMON}}          # /v1/chat/completions
RETRY_AFTER_S = 1                                    # what a 503 tells the client to wait
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos")
MAX_BODY_BYTES = 4 * 2**20                           # a larger body is refused (413) before it is read in full
MAX_STOP, MAX_STOP_CHARS = 4, 256                    # OpenAI: up to 4 stop strings; each is searched at every token
MAX_STOP_TOKEN_IDS = 256                             # held as a set by SamplingParams: a bound on the request's size
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # the Host headers served unless build_app is told more
log = logging.getLogger("course.serve")


class RequestError(ValueError):
    """A bad request: HTTP 400 (404 unknown model, 413 too large, ...) with a message naming the field `param`
    and OpenAI's machine-readable `code` (unknown_parameter, invalid_type, model_not_found, ...)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class Overloaded(RuntimeError):
    """Too many requests in flight: HTTP 503 with Retry-After."""


class ShuttingDown(RuntimeError):
    """The server is stopping (Ctrl-C): HTTP 503, or an SSE error event + [DONE] for a stream already running."""


class EngineError(RuntimeError):
    """The engine failed while running this request: HTTP 500, or an SSE error event once the stream has begun.
    The cause goes to the server log, never to the client."""


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer) -> int:
    """The most characters one token can stand for: a text longer than max_model_len * this cannot fit."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def _unicode(text: str, param: str) -> str:
    """`text` itself when it is valid Unicode; JSON's "\\ud800" (a lone surrogate) is not, and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{param} is not valid Unicode (a lone surrogate such as \\ud800)", param) from None
    return text


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
    """Incremental detokenization: token ids in, text deltas out; whole characters only, stop strings cut off.

    The work per token does not grow with the text: only the tokens after the last whole character are decoded
    again (a byte-level BPE's text is the concatenation of its tokens' bytes), and stop strings are looked for
    only where one could end in the new text.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.token_ids: list[int] = []
        self.text = ""                 # the decoded completion so far (ends before a stop string)
        self.sent = 0                  # characters of self.text already returned
        self.stopped = False           # a stop string was found: the request is over
        self.hold = max((len(s) for s in stop), default=1) - 1     # a stop string may still be forming here
        self.done_ids = 0              # token_ids[:done_ids] decode to self.text[:done_chars], whole characters
        self.done_chars = 0
        self.checked = 0               # self.text[:checked] holds no stop string

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


def error_body(exc: Exception) -> tuple[int, dict]:
    """(HTTP status, OpenAI's error object) for `exc`: a RequestError's own status, 503 when overloaded, else 500
    with a fixed message (an engine's exception text stays in the server log)."""
    if isinstance(exc, RequestError):
        status, kind, message, param, code = exc.status, "invalid_request_error", str(exc), exc.param, exc.code
    elif isinstance(exc, Overloaded):
        status, kind, message, param, code = 503, "server_overloaded", str(exc), None, "server_overloaded"
    elif isinstance(exc, ShuttingDown):
        status, kind, message, param, code = 503, "server_shutting_down", str(exc), None, "server_shutting_down"
    else:
        status, kind, param, code = 500, "internal_error", None, "internal_error"
        message = "the engine failed while running this request; the server log has the details"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: Exception) -> Response:
    """OpenAI's error JSON with its status; 503 adds Retry-After. ASCII-escaped: a lone surrogate a client sent
    (in a field name, say) cannot break the answer that refuses it."""
    status, body = error_body(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS) -> FastAPI:
    """The HTTP surface: /v1/completions, /v1/chat/completions, /v1/models, /health.

    With `api_key`, every /v1 route wants "Authorization: Bearer <api_key>" (401 otherwise); /health stays open.
    Every route answers only a Host header in `allowed_hosts` (None: any), against DNS rebinding: a web page whose
    name now resolves to 127.0.0.1 still sends its own name. app.state.shutting_down() ends every request in flight
    with a 503 (SSE: an error event and [DONE]); the server calls it when it is told to stop.
    """
    app = FastAPI(title="course engine (OpenAI-compatible)")
    app.add_middleware(RequestGuard, allowed_hosts=allowed_hosts)
    in_flight: weakref.WeakValueDictionary[int, Handle] = weakref.WeakValueDictionary()

    def shutting_down() -> None:
        for handle in list(in_flight.values()):         # on the event loop: the handles' own queues
            if not handle.finished:
                handle.events.put_nowait(ShuttingDown("the server is shutting down; send the request again later"))

    app.state.shutting_down = shutting_down
    max_model_len = engine.llm.config.max_model_len
    parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parse")    # one thread: the tokenizer's only user

    def parse(raw: bytes, chat: bool) -> ParsedRequest:
        """On the parser thread: JSON (strict: no NaN, depth-bounded), then parse_request (template, tokenizer)."""
        try:
            body = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:    # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise RequestError(f"the body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
        return parse_request(body, chat, engine.llm.tokenizer, model_name, max_model_len)

    def check_client(request: Request, body: bool) -> None:
        """401 without the API key; 415 unless the body is JSON (a text/plain POST needs no CORS preflight)."""
        if api_key is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                                           f"Bearer {api_key}".encode()):
            raise RequestError("a valid API key is needed: Authorization: Bearer <key>", status=401,
                               code="invalid_api_key")
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if body and media != "application/json":
            raise RequestError(f"the body must be application/json, got {media or 'no Content-Type'!r}",
                               status=415, code="unsupported_media_type")

    async def generate(request: Request, chat: bool):
        try:
            check_client(request, body=True)
            raw = await _read_body(request, max_body_bytes)
            req = await asyncio.get_running_loop().run_in_executor(parser, parse, raw, chat)
            handle = await engine.add(req.prompt_ids, req.params)
        except (RequestError, Overloaded, EngineError) as exc:
            return error_response(exc)
        in_flight[id(handle)] = handle
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
    async def models(request: Request):
        try:
            check_client(request, body=False)
        except RequestError as exc:
            return error_response(exc)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "course",
                                            "max_model_len": max_model_len}]}

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):       # unknown path, wrong method: OpenAI's shape
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return error_response(RequestError(f"{request.method} {request.url.path}: {exc.detail}",
                                           status=exc.status_code, code=code))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception):                 # a bug: a 500 in OpenAI's shape, no traceback
        log.exception("unhandled error on %s", request.url.path)
        return error_response(EngineError())

    @app.get("/health")
    async def health():
        ok = engine.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped", **engine.stats}, status_code=200 if ok else 503)

    return app


class RequestGuard:
    """ASGI middleware run before any route: the Host header must be allowed (403), and a request framed twice
    (Content-Length and Transfer-Encoding both: RFC 9112 section 6.1, the request-smuggling shape) gets 400 and
    the connection is closed, so no byte after it is read as another request."""

    def __init__(self, app, allowed_hosts: tuple[str, ...] | None):
        self.app, self.allowed = app, None if allowed_hosts is None else {h.lower() for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        problem = self.problem(scope["headers"]) if scope["type"] == "http" else None
        if problem is None:
            return await self.app(scope, receive, send)
        status, body = error_body(problem)
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"%d" % len(data)), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})

    def problem(self, headers: list[tuple[bytes, bytes]]) -> RequestError | None:
        names = [name.lower() for name, _ in headers]
        if b"content-length" in names and b"transfer-encoding" in names:
            return RequestError("a request may not carry both Content-Length and Transfer-Encoding",
                                code="ambiguous_framing")
        hosts = [value.decode("latin-1").strip().lower() for name, value in headers if name.lower() == b"host"]
        if self.allowed is None:
            return None
        if len(hosts) != 1:
            return RequestError("a request needs exactly one Host header", code="invalid_host")
        host = hosts[0]
        name = host[:host.index("]") + 1] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
        if name not in self.allowed:
            return RequestError(f"the Host {host[:100]!r} is not served here (start the server with --allowed-host "
                                "NAME to add it)", status=403, code="host_not_allowed")
        return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or RequestError 413 as soon as it (or its Content-Length) passes `limit` bytes."""
    too_big = RequestError(f"the request body is larger than {limit} bytes", status=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
    except ClientDisconnect:                          # nobody is left to answer; no traceback for it
        raise RequestError("the client left before sending the whole body") from None
    return bytes(body)


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
