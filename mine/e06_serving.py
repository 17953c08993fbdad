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
import dataclasses
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

import torch
from torch import nn

from .e01_sampling import SamplingParams
from .m04_attention import Attention, AttentionContext

NUMBER, INT, BOOL, TEXT = (int, float), int, bool, str
COMMON = {"model": TEXT, "stream": BOOL, "stream_options": dict, "n": INT, "stop": (str, list), "user": TEXT,
          "max_tokens": INT, "temperature": NUMBER, "top_p": NUMBER, "top_k": INT, "min_p": NUMBER, "seed": INT,
          "stop_token_ids": list, "ignore_eos": BOOL, "return_token_ids": BOOL}
FIELDS = {False: {"prompt": (str, list), "logprobs": INT, "echo": BOOL, **COMMON},   # /v1/completions
          True: {"messages": list, "max_completion_tokens": INT, "logprobs": BOOL, "top_logprobs": INT,
                 **COMMON}}                                                          # /v1/chat/completions
RETRY_AFTER_S = 1                                    # what a 503 tells the client to wait
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos")
MAX_BODY_BYTES = 4 * 2**20                           # a larger body is refused (413) before it is read in full
MAX_STOP, MAX_STOP_CHARS = 64, 256                   # stop strings per request, characters of one (OpenAI: 4)
MAX_STOP_TOTAL = 1024                                # characters of all stop strings: each token's search costs this
MAX_STOP_TOKEN_IDS = 256                             # held as a set by SamplingParams: a bound on the request's size
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # the Host headers served unless build_app is told more
MAX_N = 16                                           # samples of one prompt per request (n), each an engine request
MAX_CHOICES = 256                                    # prompts x n of one completions request (lm-eval's batches)
MAX_RUNNING_CHOICES = 16                             # a response's choices in the engine at once; the rest wait
ADMIT_RETRY_S = 0.05                                 # a waiting choice's next try when the engine is full
MAX_TOKENIZE_CHARS = 2**20                           # /tokenize's text (a document, not a prompt), /detokenize's ids
ROWS_PER_CHUNK = 256                                 # prompt logprob rows per logits call (V floats each)
MAX_LOGPROBS = {False: 5, True: 20}                  # completions' logprobs, chat's top_logprobs (OpenAI's bounds)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
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
    # the rest is set by the given code (build_app): n, logprobs, echo (output_options) and one copy per choice
    n: int = 1
    logprobs: int | None = None    # top logprobs per token (0: the sampled token's only); None: no logprobs
    echo: bool = False             # completions: the prompt (and its logprobs) before the completion
    prompt_text: str = ""
    index: int = 0                 # this copy's choice
    response_id: str = ""          # shared by the choices of one response
    group: list[ParsedRequest] = field(default_factory=list)    # every choice of the response (usage)
    tokens: list = field(default_factory=list)                  # LogprobTap's entries: the prompt's, then one per token
    logprobs_sent: int = 0         # entries already sent (streaming sends each token's with its chunk)
    text_offset: int = 0           # completions' text_offset of the next token
    echoed: bool = False           # echo: the prompt text went out (with the first chunk)
    prompt_tokens: int = 0         # a response over several prompts: all of theirs (usage)


def chat_message(m: object, i: int) -> dict:
    """Message i as the chat template takes it: {"role", "content": str[, "name"]} (given code).

    `developer` (OpenAI's newer name for system) becomes `system`; content is a string or a list of
    {"type": "text", "text": str} parts, joined with newlines (vLLM's string content format). Anything else
    (an image part, a number, null, an unknown key) is a RequestError naming messages[i].
    """
    bad = RequestError("each message is {'role': system|developer|user|assistant, 'content': a string or a list of "
                       "{'type': 'text', 'text': str} parts}", f"messages[{i}]")
    if not (isinstance(m, dict) and m.get("role") in ROLES and set(m) <= {"role", "content", "name"}):
        raise bad
    content = m.get("content")
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text" and isinstance(p["text"], str)
            for p in content):
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad
    return {**m, "role": ROLES[m["role"]], "content": content}


def output_options(body: dict, chat: bool) -> tuple[int, int | None, bool]:
    """(n, top logprobs per token or None, echo) of a body parse_request accepted (given code; the JSON types are
    already checked). Completions: logprobs 0-5, echo; chat: logprobs true with top_logprobs 0-20."""
    n = 1 if body.get("n") is None else body["n"]
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must be an int in [1, {MAX_N}], got {n}", "n")
    name = "top_logprobs" if chat else "logprobs"
    top = body.get(name)
    if top is not None and not 0 <= top <= MAX_LOGPROBS[chat]:
        raise RequestError(f"{name} must be an int in [0, {MAX_LOGPROBS[chat]}], got {top}", name)
    if chat and top is not None and not body.get("logprobs"):
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    if chat:
        return n, (top or 0) if body.get("logprobs") else None, False
    return n, top, bool(body.get("echo"))


def parse_request(body: object, chat: bool, tokenizer, model_name: str, max_model_len: int) -> ParsedRequest:
    """Check an OpenAI request body field by field; raise RequestError(message, param) at the first bad one.

    Unknown fields, wrong JSON types (bool is not a number), an empty or too long prompt and prompt + max_tokens
    beyond max_model_len are refused here; the sampling values by SamplingParams. Messages pass chat_message.
    """
    raise NotImplementedError("e06: 请实现 parse_request（见 lessons/e06_serving.md）")


class TextStream:
    """Incremental detokenization: token ids in, text deltas out; whole characters only, stop strings cut off.

    The decoding and the stop search per token do not grow with the text: only the tokens after the last whole
    character are decoded again (a byte-level BPE's text is the concatenation of its tokens' bytes), and each stop
    string is looked for only where it could end in the new text (from len(s) - 1 characters before it). (Rebuilding the text string still copies it:
    a memcpy, a few microseconds at max_model_len.)
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
        self.tap = LogprobTap(llm)                                  # logprobs and echo (given code)

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


@dataclass
class Watch:
    """LogprobTap's record of one watched choice (given code)."""
    req: ParsedRequest
    loop: asyncio.AbstractEventLoop
    prompt: list | None = None     # a prompt scorer's entries so far (None: this choice does not score its prompt)
    ready: asyncio.Future | None = None    # the scorer's prompt entries, for the prompt's other choices
    done: bool = False             # the prompt's entries went out (with the first sample)


class LogprobTap:
    """Logprobs for the requests that ask for them, on the engine thread (given code): the log-softmax of the model's
    raw logits, before temperature and top-k/p (vLLM's default logprobs mode, raw_logprobs).

    It wraps the runner's sampler: each watched row (a request's params) gets its sampled token's logprob and its
    top k, taken before the sampler sees the logits. A prompt's logprobs (echo) are taken during its prefill, chunk
    by chunk as the scheduler's token budget admits it: a forward hook reads the hidden states of the scorer's
    prompt rows in each step (position p's logits give token p + 1's logprob). One choice per distinct prompt
    scores it, and it reads no prefix-cache hit, as vLLM skips the cache for prompt_logprobs: a hit would skip those
    positions' forward. Choices admits the prompt's other choices once the entries are in: they start with them,
    and their prefill finds the scorer's blocks in the cache. (A position the hook cannot see, an e07 hybrid cache
    hit, is filled by score(), a forward pass of the prompt alone.)
    Entries go to the request's event loop with call_soon_threadsafe, so each arrives before the token it belongs
    to: (text, logprob, [(text, logprob)] * k); the prompt's first token has (text, None, None).
    """

    def __init__(self, llm):
        self.llm = llm
        self.watched: dict[int, Watch] = {}                         # id(params) -> its choice
        self.texts: dict[int, str] = {}                             # token -> its text (the vocabulary at most)
        runner = llm.runner.__dict__.get("runner", llm.runner)      # e07's SnapshotRunner wraps e04's runner
        self.sampler, runner.sampler = runner.sampler, self.sample
        self.run, runner.run = runner.run, self.step
        self.batch: list | None = None                              # the sequences of the step being run
        runner.model.register_forward_hook(self.prefill)
        manager = llm.block_manager
        if not hasattr(manager, "state_cache"):                     # e02's manager (e07's hybrid one keeps its hits)
            manager._cached_prefix = self._no_hits(manager._cached_prefix)

    def watch(self, req: ParsedRequest, scores_prompt: bool = False) -> None:
        """(event loop) Before req's engine.add: its samples (and, if scores_prompt, its prompt) get logprobs."""
        loop = asyncio.get_running_loop()
        self.watched[id(req.params)] = Watch(req, loop, [(self.text(req.prompt_ids[0]), None, None)],
                                             loop.create_future()) if scores_prompt else Watch(req, loop)

    def unwatch(self, req: ParsedRequest) -> None:
        watch = self.watched.pop(id(req.params), None)
        if watch is not None and watch.ready is not None:
            watch.ready.cancel()

    def prompt_entries(self, req: ParsedRequest) -> asyncio.Future:
        """(event loop) The future of a watched scorer's prompt entries."""
        return self.watched[id(req.params)].ready

    def _no_hits(self, cached_prefix):
        """e02's _cached_prefix, empty for a prompt scorer: it computes every position (its full blocks are still
        registered, so the prompt's other choices, admitted after it, find them all in the cache)."""
        def hits(seq):
            watch = self.watched.get(id(seq.sampling_params))
            return [] if watch is not None and watch.prompt is not None and not watch.done else cached_prefix(seq)
        return hits

    def step(self, seqs: list) -> list[int]:
        self.batch = seqs
        try:
            return self.run(seqs)
        finally:
            self.batch = None

    @torch.inference_mode()
    def prefill(self, model: nn.Module, args: tuple, hidden: torch.Tensor) -> None:
        """(forward hook of the step's model call) Each scorer's prompt rows in this step: their logprobs."""
        seqs, self.batch = self.batch, None                        # score()'s own forward passes find None
        if not seqs or not self.watched:
            return
        cu = None
        for i, seq in enumerate(seqs):
            watch = self.watched.get(id(seq.sampling_params))
            if watch is None or watch.prompt is None or watch.done:
                continue
            if cu is None:
                cu = args[2].cu_seqlens_q.tolist()
            ids, first = watch.req.prompt_ids, seq.num_cached_tokens        # row cu[i] is position `first`
            if first > len(watch.prompt) - 1:                  # positions the step skipped (a cache hit): scored alone
                watch.prompt = self.score(ids[:first + 1], watch.req.logprobs)
            end = min(first + cu[i + 1] - cu[i], len(ids) - 1)
            for start in range(len(watch.prompt) - 1, end, ROWS_PER_CHUNK):   # a preempted sequence's repeats skipped
                stop = min(end, start + ROWS_PER_CHUNK)
                rows = hidden[cu[i] + start - first:cu[i] + stop - first]
                watch.prompt += self.entries(model.compute_logits(rows), ids[start + 1:stop + 1], watch.req.logprobs)

    def sample(self, logits: torch.Tensor, params: list, generators: list) -> torch.Tensor:
        rows = [(i, w) for i, p in enumerate(params) if (w := self.watched.get(id(p))) is not None]
        if not rows:
            return self.sampler(logits, params, generators)
        logprobs = torch.log_softmax(logits[[i for i, _ in rows]].float(), dim=-1)   # raw: before any warping
        tokens = self.sampler(logits, params, generators)
        for (i, watch), row in zip(rows, logprobs):
            entries = []
            if watch.prompt is not None and not watch.done:
                if len(watch.prompt) < len(watch.req.prompt_ids):     # steps the hook did not see
                    watch.prompt = self.score(watch.req.prompt_ids, watch.req.logprobs)
                watch.done, entries = True, list(watch.prompt)
                watch.loop.call_soon_threadsafe(_resolve, watch.ready, watch.prompt)
            entries.append(self.entry(row, int(tokens[i]), watch.req.logprobs))
            watch.loop.call_soon_threadsafe(watch.req.tokens.extend, entries)
        return tokens

    def text(self, token: int) -> str:
        text = self.texts.get(token)
        if text is None:
            tokenizer = self.llm.tokenizer
            text = self.texts[token] = tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"
        return text

    def entry(self, row: torch.Tensor, token: int, k: int) -> tuple:
        top = torch.topk(row, k) if k else None
        pairs = zip(top.indices.tolist(), top.values.tolist()) if k else ()
        return self.text(token), float(row[token]), [(self.text(t), lp) for t, lp in pairs]

    def entries(self, logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple]:
        """entry() of each row of logits [R, V] and its token, with one topk and one copy for all R rows."""
        rows = torch.log_softmax(logits.float(), dim=-1)
        chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0].tolist()
        top = torch.topk(rows, k, dim=-1) if k else None
        tops = zip(top.indices.tolist(), top.values.tolist()) if k else [((), ())] * len(tokens)
        return [(self.text(t), lp, [(self.text(a), b) for a, b in zip(*pairs)])
                for t, lp, pairs in zip(tokens, chosen, tops)]

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], k: int) -> list[tuple]:
        """The entries of prompt_ids by a forward pass of them alone, without the KV cache (the fallback)."""
        model = self.llm.model
        layers = [layer.self_attn for layer in model.model.layers if getattr(layer, "self_attn", None) is not None]
        paged = [attn.attn for attn in layers]
        device, n = next(model.parameters()).device, len(prompt_ids)
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        for attn, backend in zip(layers, paged):                    # no cache: attention over the prompt alone
            attn.attn = Attention(backend.num_heads, backend.head_dim, backend.scale, backend.num_kv_heads)
        try:
            hidden = model(torch.tensor(prompt_ids, device=device), torch.arange(n, device=device),
                           AttentionContext(cu, cu, n, n), None)
        finally:
            for attn, backend in zip(layers, paged):
                attn.attn = backend
        entries = [(self.text(prompt_ids[0]), None, None)]
        for start in range(0, n - 1, ROWS_PER_CHUNK):
            end = min(n - 1, start + ROWS_PER_CHUNK)
            entries += self.entries(model.compute_logits(hidden[start:end]), prompt_ids[start + 1:end + 1], k)
        return entries


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _reply(handle: Handle, item) -> None:
    try:
        handle.loop.call_soon_threadsafe(handle.events.put_nowait, item)
    except RuntimeError:                              # the event loop is closed: the server is shutting down
        pass


async def run_request(engine: AsyncEngine, handle: Handle, req: ParsedRequest) -> AsyncIterator[tuple[str, str | None]]:
    """Async generator of (text delta, finish_reason or None) until the request ends; always releases the handle."""
    raise NotImplementedError("e06: 请实现 run_request（见 lessons/e06_serving.md）")


def _choice(req: ParsedRequest, text: str, finish: str | None) -> dict:
    """One choice of a chunk or an answer: `text` and, with logprobs, those of the tokens not yet sent (echo: the
    prompt's first). _body stamps the choice's index."""
    if req.echo and not req.echoed:
        text, req.echoed = req.prompt_text + text, True
    if not req.chat:
        choice = {"index": 0, "text": text}
    elif req.stream:
        choice = {"index": 0, "delta": {"content": text} if text or not finish else {}}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    choice |= {"logprobs": _logprobs(req), "finish_reason": finish}
    if req.return_token_ids and finish is not None:    # vLLM's extension: the exact completion tokens
        choice["token_ids"] = list(req.token_ids)
    return choice


def _logprobs(req: ParsedRequest) -> dict | None:
    """OpenAI's logprobs of the tokens since the last chunk (LogprobTap's entries: text, logprob, top k).
    Completions: tokens, token_logprobs, top_logprobs (the top k and the sampled token), text_offset; chat:
    content, a list of {token, logprob, bytes, top_logprobs}."""
    if req.logprobs is None:
        return None
    end = (len(req.prompt_ids) if req.echo else 0) + len(req.token_ids)    # entries may run ahead of the tokens
    entries, req.logprobs_sent = req.tokens[req.logprobs_sent:end], end
    if req.chat:
        item = lambda text, lp: {"token": text, "logprob": lp, "bytes": list(text.encode())}
        return {"content": [item(t, lp) | {"top_logprobs": [item(*e) for e in top]} for t, lp, top in entries],
                "refusal": None}
    offsets = []
    for text, _, _ in entries:
        offsets.append(req.text_offset)
        req.text_offset += len(text)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [None if top is None else _first_of_each([*top, (t, lp)]) for t, lp, top in entries],
            "text_offset": offsets}


def _first_of_each(pairs: list[tuple[str, float]]) -> dict[str, float]:
    """{text: logprob}, the first (highest) pair of each text: two tokens may decode to one text (U+FFFD)."""
    out: dict[str, float] = {}
    for text, logprob in pairs:
        out.setdefault(text, logprob)
    return out


def _body(req: ParsedRequest, handle: Handle, model: str, choices: list[dict], usage: bool) -> dict:
    """The OpenAI envelope around `choices` (each stamped with req's choice index); usage counts tokens, prompt
    and completion (every choice's)."""
    kind = ("chat.completion.chunk" if req.stream else "chat.completion") if req.chat else "text_completion"
    for choice in choices:
        choice["index"] = req.index
    body = {"id": req.response_id or f"{'chatcmpl' if req.chat else 'cmpl'}-{handle.request_id}", "object": kind,
            "created": int(time.time()), "model": model, "choices": choices}
    if usage:
        n = sum(len(r.token_ids) for r in req.group or [req])
        prompt = req.prompt_tokens or len(req.prompt_ids)
        body["usage"] = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    return body


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def sse_frames(engine: AsyncEngine, handle: Handle, req: ParsedRequest, model: str) -> AsyncIterator[str]:
    """Async generator of server-sent events: a chunk per delta, the finish_reason chunk, usage if asked, [DONE].

    If the client disconnects, the server cancels this generator; run_request's finally aborts the request.
    """
    raise NotImplementedError("e06: 请实现 sse_frames（见 lessons/e06_serving.md）")


def choices_of(reqs: list[ParsedRequest]) -> list[ParsedRequest]:
    """The choices of a response, each its own engine request (given code): n per prompt (a completions request may
    carry a list of prompts, as lm-evaluation-harness sends them), prompt k's sample i at index k * n + i. As vLLM's
    n does, sample i's params are the prompt's with seed + i, so a seeded request gives n different samples that
    repeat on re-run; every copy's params are their own object (LogprobTap tells the rows apart by them). A prompt's
    full blocks are shared through the prefix cache when it is on. reqs[0] carries the response: group (every
    choice) and prompt_tokens (every prompt)."""
    head, seed = reqs[0], reqs[0].params.seed
    if len(reqs) == 1 and head.n == 1:
        head.group = [head]
        return head.group
    group = [dataclasses.replace(req, index=k * req.n + i, include_usage=False, token_ids=[], tokens=[], params=(
        dataclasses.replace(req.params, seed=None if seed is None else (seed + i) % 2**64)))
        for k, req in enumerate(reqs) for i in range(req.n)]
    for choice in (head, *group):
        choice.group = group
    head.prompt_tokens = sum(len(req.prompt_ids) for req in reqs)
    return group


class Choices:
    """The choices of one response on their way into the engine (given code).

    A response may carry MAX_CHOICES choices (lm-evaluation-harness sends a batch of prompts as one request). At most
    MAX_RUNNING_CHOICES of them are in the engine at once; the next one is admitted as one ends, so a large request
    queues behind its own choices instead of filling the engine ahead of everyone else. The first choice is admitted
    before the response starts (Overloaded: a 503); a later one that finds the engine full waits for room (its
    request was admitted already). With echo and logprobs, the first choice of each distinct prompt scores the
    prompt (LogprobTap) and the prompt's other choices are admitted once those entries are in: they start with them.
    """

    def __init__(self, engine: AsyncEngine, group: list[ParsedRequest], in_flight: dict | None = None):
        self.engine, self.group, self.in_flight = engine, group, {} if in_flight is None else in_flight
        self.handles: list[Handle | None] = [None] * len(group)
        self.room = asyncio.Semaphore(MAX_RUNNING_CHOICES)
        self.lead: list[ParsedRequest | None] = []         # the choice that scores choice i's prompt, if not i itself
        scorers: dict[tuple[int, ...], ParsedRequest] = {}
        for choice in group:
            scores = choice.echo and choice.logprobs is not None
            lead = scorers.setdefault(tuple(choice.prompt_ids), choice) if scores else choice
            self.lead.append(None if lead is choice else lead)
            if choice.logprobs is not None:
                engine.tap.watch(choice, scores_prompt=scores and lead is choice)

    async def admit(self, i: int) -> Handle:
        """Choice i's handle: admitted now (or already); it holds one of the response's running places until done(i)."""
        if self.handles[i] is not None:
            return self.handles[i]
        choice, lead = self.group[i], self.lead[i]
        if lead is not None:                                # the prompt's entries first, then its own tokens
            choice.tokens.extend(await asyncio.shield(self.engine.tap.prompt_entries(lead)))
        await self.room.acquire()
        try:
            while True:
                try:
                    handle = await self.engine.add(choice.prompt_ids, choice.params)
                    break
                except Overloaded:
                    if i == 0:                               # before the response: the client is told to retry
                        raise
                    await asyncio.sleep(ADMIT_RETRY_S)
        except BaseException:
            self.room.release()
            raise
        self.handles[i] = self.in_flight[id(handle)] = handle
        return handle

    def done(self, i: int) -> None:
        """Choice i has ended (its run_request released its handle): its running place goes to the next choice."""
        if self.handles[i] is not None:
            self.room.release()

    def close(self) -> None:
        """However the response ends: every admitted choice released, every logprob registration dropped."""
        for handle in self.handles:
            if handle is not None and not handle.released:
                self.engine.release(handle)
        for choice in self.group:
            self.engine.tap.unwatch(choice)


async def complete(engine: AsyncEngine, run: Choices, req: ParsedRequest, model: str) -> dict:
    """The non-streaming answer: each choice's deltas joined with its finish_reason; usage over every choice."""
    async def one(i: int, choice: ParsedRequest) -> dict:
        handle = await run.admit(i)
        try:
            parts, finish = [], None
            async for delta, finish in run_request(engine, handle, choice):
                parts.append(delta)
        finally:
            run.done(i)
        return _choice(choice, "".join(parts), finish) | {"index": choice.index}

    async with asyncio.TaskGroup() as group:          # one failing choice cancels the others
        tasks = [group.create_task(one(i, c)) for i, c in enumerate(req.group)]
    return _body(req, run.handles[0], model, [], True) | {"choices": [t.result() for t in tasks]}


DONE = "data: [DONE]\n\n"


async def interleaved(engine: AsyncEngine, run: Choices, req: ParsedRequest, model: str) -> AsyncIterator[str]:
    """Several choices, streaming (given code): every choice's sse_frames at once, their frames in the order they come (each
    carries its choice's index); then one usage frame over every choice (if asked) and one [DONE]. A choice's
    error frame ends the whole stream."""
    frames: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, choice: ParsedRequest) -> None:
        try:
            handle = await run.admit(i)
            try:
                async for frame in sse_frames(engine, handle, choice, model):
                    frames.put_nowait(frame)
            finally:
                run.done(i)
        except Exception as exc:                      # a later choice the engine refused: an error event
            frames.put_nowait(_sse(error_body(exc)[1]))
        finally:
            frames.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(req.group)]
    try:
        running, failed = len(tasks), False
        while running and not failed:
            frame = await frames.get()
            if frame is None:
                running -= 1
            elif frame != DONE:
                failed = frame.startswith('data: {"error"')
                yield frame
        if req.include_usage and not failed:
            yield _sse(_body(req, run.handles[0], model, [], True))
        yield DONE
    finally:                                          # the client left: every choice's run_request releases
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ReleasingStream(StreamingResponse):
    """A StreamingResponse that calls `done` however it ends (given code): also when the client left before the
    body started, so that its generator (and run_request's finally) never ran."""

    def __init__(self, content, done, **kwargs):
        super().__init__(content, **kwargs)
        self.done = done

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.done()


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

    def parse(raw: bytes, chat: bool) -> list[ParsedRequest]:
        """On the parser thread: JSON (strict: no NaN, depth-bounded), every list's length (check_lengths, before
        any item is looked at), then parse_request (template, tokenizer) for each prompt (completions: a list of
        strings or of token-id lists is several prompts), then output_options."""
        body = _json(raw)
        check_lengths(body, chat, max_model_len)
        prompts = body.get("prompt") if isinstance(body, dict) and not chat else None
        bodies = [body]
        if isinstance(prompts, list) and prompts and all(isinstance(p, (str, list)) for p in prompts):
            bodies = [body | {"prompt": p} for p in prompts]
        reqs = [parse_request(b, chat, engine.llm.tokenizer, model_name, max_model_len) for b in bodies]
        n, logprobs, echo = output_options(body, chat)
        for req in reqs:
            req.n, req.logprobs, req.echo = n, logprobs, echo
            if echo:
                tokenizer = engine.llm.tokenizer
                req.prompt_text = tokenizer.decode(req.prompt_ids) if tokenizer is not None else ""
        return reqs

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
        run = None

        def done() -> None:                               # however the request ends: every choice released
            if run is not None:
                run.close()

        try:
            check_client(request, body=True)
            raw = await _read_body(request, max_body_bytes)
            reqs = await asyncio.get_running_loop().run_in_executor(parser, parse, raw, chat)
            req = reqs[0]                                 # the response's fields (stream, usage, group)
            run = Choices(engine, choices_of(reqs), in_flight)   # n engine requests per prompt
            await run.admit(0)                            # the first now: a full engine is a 503 before the 200
        except (RequestError, Overloaded, EngineError) as exc:
            done()
            return error_response(exc)
        except BaseException:
            done()
            raise
        for choice in (req, *run.group):
            choice.response_id = f"{'chatcmpl' if chat else 'cmpl'}-{run.handles[0].request_id}"
        if req.stream:
            frames = sse_frames(engine, run.handles[0], req, model_name) if len(run.group) == 1 else \
                interleaved(engine, run, req, model_name)
            return ReleasingStream(frames, done, media_type="text/event-stream")
        try:
            return await _unless_disconnected(request, complete(engine, run, req, model_name))
        finally:
            done()

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

    def tokenize(raw: bytes) -> dict:
        """/tokenize on the parser thread (vLLM's shape): {"prompt": str} or {"messages": [...]} (the chat template
        with add_generation_prompt, default true), add_special_tokens (default true for a prompt, false for
        messages), return_token_strs -> {"count", "max_model_len", "tokens", "token_strs"}. Unlike a completion the
        text may be longer than the context (evaluation tools cut long documents into windows themselves)."""
        body, tokenizer = _fields(_json(raw), TOKENIZE_FIELDS, model_name), engine.llm.tokenizer
        if tokenizer is None:
            raise RequestError("this model has no tokenizer", "prompt")
        chat = "messages" in body
        if chat == ("prompt" in body):
            raise RequestError("send either prompt (a string) or messages", "prompt")
        if chat:
            messages = body["messages"]
            if not messages or len(messages) > MAX_TOKENIZE_CHARS // 16:
                raise RequestError(f"messages holds 1 to {MAX_TOKENIZE_CHARS // 16} messages", "messages")
            messages = [chat_message(m, i) for i, m in enumerate(messages)]
            for i, m in enumerate(messages):
                _unicode(m["content"], f"messages[{i}]")
            if sum(len(m["content"]) for m in messages) > MAX_TOKENIZE_CHARS:
                raise RequestError(f"the messages have more than {MAX_TOKENIZE_CHARS} characters", "messages")
            if not getattr(tokenizer, "chat_template", None):
                raise RequestError("this model has no chat template", "messages")
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.get(
                    "add_generation_prompt", True) is not False)
            except Exception as exc:
                raise RequestError(f"the chat template refused these messages: {exc}", "messages") from None
        else:
            text = _unicode(body["prompt"], "prompt")
            if len(text) > MAX_TOKENIZE_CHARS:
                raise RequestError(f"the prompt has more than {MAX_TOKENIZE_CHARS} characters", "prompt")
        special = body.get("add_special_tokens")
        ids = list(tokenizer.encode(text, add_special_tokens=(not chat) if special is None else special))
        strs = tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(raw: bytes) -> dict:
        """/detokenize on the parser thread: {"tokens": [ids]} -> {"prompt": their text}."""
        body, tokenizer = _fields(_json(raw), DETOKENIZE_FIELDS, model_name), engine.llm.tokenizer
        ids = body.get("tokens")
        if ids is None or len(ids) > MAX_TOKENIZE_CHARS:
            raise RequestError(f"tokens is a list of at most {MAX_TOKENIZE_CHARS} token ids", "tokens")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.llm.vocab_size for t in ids):
            raise RequestError(f"tokens holds token ids in [0, {engine.llm.vocab_size})", "tokens")
        if tokenizer is None:
            raise RequestError("this model has no tokenizer", "tokens")
        return {"prompt": tokenizer.decode(ids)}

    async def tokenizer_route(request: Request, work):
        try:
            check_client(request, body=True)
            body = await _read_body(request, max_body_bytes)
            return JSONResponse(await asyncio.get_running_loop().run_in_executor(parser, work, body))
        except RequestError as exc:
            return error_response(exc)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenizer_route(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await tokenizer_route(request, detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """vLLM's /tokenizer_info: the tokenizer's init_kwargs (file paths dropped, special tokens as their text),
        tokenizer_class and chat_template; lm-evaluation-harness's remote tokenizer reads eos_token, bos_token,
        pad_token and chat_template from it."""
        try:
            check_client(request, body=False)
            tokenizer = engine.llm.tokenizer
            if tokenizer is None:
                raise RequestError("this model has no tokenizer", status=404, code="not_found")
        except RequestError as exc:
            return error_response(exc)
        info = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
        for name in ("eos_token", "bos_token", "pad_token"):
            info.setdefault(name, getattr(tokenizer, name, None))
        info = json.loads(json.dumps(info, default=lambda v: getattr(v, "content", None)))   # AddedToken: its text
        template = getattr(tokenizer, "chat_template", None)
        return info | {"tokenizer_class": type(tokenizer).__name__} | (
            {"chat_template": template} if isinstance(template, str) else {})

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


def _json(raw: bytes) -> object:
    """The body as JSON (strict: no NaN or Infinity; too deep a nesting is a 400, not a RecursionError's 500)."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:        # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError(f"the body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None


TOKENIZE_FIELDS = {"model": TEXT, "prompt": TEXT, "messages": list, "add_special_tokens": BOOL,
                   "add_generation_prompt": BOOL, "return_token_strs": BOOL}
DETOKENIZE_FIELDS = {"model": TEXT, "tokens": list}


def _fields(body: object, fields: dict, model_name: str) -> dict:
    """`body` when it is a JSON object of known fields of the right JSON types, naming `model_name` if any model."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name, value in body.items():
        kind = fields.get(name)
        if kind is None:
            raise RequestError(f"unknown field {name!r}", name, code="unknown_parameter")
        ok = type(value) is bool if kind is BOOL else isinstance(value, kind) and type(value) is not bool
        if value is not None and not ok:
            raise RequestError(f"{name} has the wrong type ({type(value).__name__})", name, code="invalid_type")
    if body.get("model") not in (None, model_name):
        raise RequestError(f"the model {body['model']!r} does not exist; this server has {model_name!r}",
                           "model", status=404, code="model_not_found")
    return {k: v for k, v in body.items() if v is not None}


def check_lengths(body: object, chat: bool, max_model_len: int) -> None:
    """Every list of a body has a bounded length, checked before any item is looked at (given code), so that the work
    of parsing one request stays bounded however its 4 MiB are spent: completions carry at most MAX_CHOICES samples
    (prompts x n) and a prompt of token ids fewer than max_model_len ids; chat at most max_model_len messages (each
    takes a token at least). parse_request bounds stop and stop_token_ids before reading their items."""
    if not isinstance(body, dict):
        return
    prompt = body.get("messages" if chat else "prompt")
    if not isinstance(prompt, list) or not prompt:
        return
    if chat:
        if len(prompt) > max_model_len:
            raise RequestError(f"messages holds {len(prompt)} messages; this model's context is {max_model_len} tokens",
                               "messages", code="context_length_exceeded")
        return
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1
    several = isinstance(prompt[0], (str, list))                  # a list of prompts, not one of token ids
    if several and len(prompt) * n > MAX_CHOICES:
        raise RequestError(f"{len(prompt)} prompts x n = {n} is more than {MAX_CHOICES} samples", "prompt")
    for ids in prompt if several else [prompt]:
        if isinstance(ids, list) and len(ids) >= max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model's context is {max_model_len}", "prompt",
                               code="context_length_exceeded")


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
        body = task.result()
    except Exception as exc:                          # an engine failure: a 500 for this request only
        return error_response(exc)
    # a response of many choices with logprobs runs to megabytes: rendered on a worker thread, not the event loop
    return await asyncio.get_running_loop().run_in_executor(None, JSONResponse, body)
