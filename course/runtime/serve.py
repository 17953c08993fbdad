"""`./check.sh serve`: the assembled engine behind an OpenAI-compatible HTTP server (exercise e06).

    ./check.sh serve                                  the offline tiny dummy Qwen3 (byte tokenizer) on 127.0.0.1:8000
    ./check.sh serve --model DIR --port 8001          a real HF folder: weights, tokenizer and chat template
    ./check.sh serve --host 0.0.0.0 --api-key KEY     reachable from the network: clients send "Authorization: Bearer KEY"
    ./check.sh serve --allowed-host my.box            also answer requests whose Host header is my.box
    ./check.sh serve --device cuda [--gpu-memory-gib N]  g01's GPU engine, its memory plan printed at start-up

There is no authentication unless --api-key is given: anyone who can reach the port can spend the machine's compute.
Only the Host names localhost, 127.0.0.1 and [::1] are served (against DNS rebinding), plus the --host it binds
(any name when that is 0.0.0.0 or ::) and each --allowed-host. A connection gets HEADER_TIMEOUT_S to send its request
headers and BODY_TIMEOUT_S more for the body; beyond max_connections() open connections the oldest idle one is closed,
else the one whose unfinished body arrives slowest, so neither idle sockets nor half-sent bodies can use up the open
files or the connections. --max-model-len is capped at the model's max_position_embeddings.
Needs fastapi, uvicorn (and the openai client for the checks): they are in pyproject.toml.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import resource
import socket
import threading
import time
from pathlib import Path

from ..grader import registry, select, state
from . import device
from .run import auto_selection, tiny_dummy_config

PACKAGES = ("fastapi", "uvicorn")
DUMMY_NAME = "qwen3-tiny-dummy"
GRACEFUL_SHUTDOWN_S = 5        # Ctrl-C: open connections get this long, then they are closed (a half-sent body too)
HEADER_TIMEOUT_S = 10          # a connection that has not sent its request headers by then is closed
BODY_TIMEOUT_S = 60            # a request whose body has not fully arrived this long after its headers: closed
MAX_CONNECTIONS = 1024         # open connections at most (and at most a quarter of the process's open-file limit)
LISTEN_BACKLOG = 2048           # connections the kernel queues before accept (uvicorn's default)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def max_connections() -> int:
    """The connection limit: MAX_CONNECTIONS, or a quarter of the open-file limit when that is lower (sockets are
    accepted in batches before the oldest idle ones are closed: the rest is headroom for them)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(8, min(MAX_CONNECTIONS, soft // 4)) if soft != resource.RLIM_INFINITY else MAX_CONNECTIONS


def raise_file_limit(target: int = 65536) -> None:
    """Lift the soft open-file limit towards the hard one (as vLLM's set_ulimit does): 1024 is a common default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def model_max_len(folder: str, requested: int) -> int:
    """`requested`, but never beyond the model's max_position_embeddings (config.json, or its text_config: positions
    past it were never trained, and /v1/models must not promise them)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return requested
    for part in (config, config.get("text_config") or {}, (config.get("thinker_config") or {}).get("text_config") or {}):
        limit = part.get("max_position_embeddings") if isinstance(part, dict) else None
        if isinstance(limit, int) and limit > 0:
            return min(requested, limit)
    return requested


def allowed_hosts(host: str, extra: list[str] | tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The Host header names the server answers: loopback, the bound host, each --allowed-host; None = any name
    (bound to every interface, the clients may use any name of this machine)."""
    if host in WILDCARD_HOSTS:
        return None
    names = ["localhost", "127.0.0.1", "[::1]", *extra]
    if not is_loopback(host):
        names.append(f"[{host}]" if ":" in host else host)
    return tuple(dict.fromkeys(n.lower() for n in names))


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:              # a host name: it may resolve to anything
        return False


def missing_packages(names=PACKAGES) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def serving_selection(gpu: bool = False) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """auto_selection(gpu) plus e06: the learner's server once e06 has passed."""
    selection, report = auto_selection(gpu)
    ex = registry.get("e06")
    folder = "mine" if ex.id in state.passed_ids(registry.CATALOGUE) else "solutions"
    selection[ex.module] = folder
    return selection, report + [(ex.id, f"{folder}/{ex.module}.py")]


def dummy_llm(engine, seed: int = 0, **engine_kwargs):
    """The offline tiny Qwen3 with dummy weights and the byte tokenizer (random text, fast on a CPU). engine: e05's
    module, or an LLM class (g01's on the GPU)."""
    from .tiny_tokenizer import byte_tokenizer
    tokenizer = byte_tokenizer()
    LLM = getattr(engine, "LLM", engine)
    return LLM(tiny_dummy_config(len(tokenizer)), tokenizer=tokenizer, seed=seed, **engine_kwargs)


def guarded_server(app, host: str, port: int, limit: int | None = None, body_timeout: float = BODY_TIMEOUT_S, **config):
    """A uvicorn.Server for `app` whose connections are bounded (guarded_protocol) and whose shutdown first ends the
    requests in flight (app.state.shutting_down: each open stream gets an error event and [DONE])."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            for server in self.servers:            # the kernel's queue back to 2048; asyncio's batch stays small
                for sock in server.sockets:
                    with socket.socket(fileno=os.dup(sock.fileno())) as same:
                        same.listen(LISTEN_BACKLOG)

        async def shutdown(self, sockets=None):
            hook = getattr(app.state, "shutting_down", None)
            if hook is not None:
                hook()
            await super().shutdown(sockets)

    limit = max_connections() if limit is None else limit
    # asyncio accepts up to `backlog` sockets in one go before any of them can close another: keep the batch small
    # so that the limit plus a few batches stays below the open-file limit
    return Server(uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limit=limit, body_timeout=body_timeout),
                                 backlog=max(8, limit // 8), **config))


def guarded_protocol(header_timeout: float = HEADER_TIMEOUT_S, limit: int | None = None,
                     body_timeout: float = BODY_TIMEOUT_S):
    """uvicorn's h11 protocol with deadlines and a bound on open connections. The request headers must arrive within
    `header_timeout` of the connection, a request's body within `body_timeout` of its headers (else the connection
    is closed: the route sees a disconnect). Beyond `limit` connections a new one closes the oldest idle connection
    (no request running), else the one receiving a body at the lowest rate (bytes per second since it opened),
    else itself: a crowd of half-sent bodies cannot keep others out."""
    from uvicorn.protocols.http.h11_impl import H11Protocol
    limit = max_connections() if limit is None else limit

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.opened, self.received, self.timed, self.body_deadline = self.loop.time(), 0, None, None
            if len(self.connections) > limit:             # the oldest idle connection makes room, else the slowest body
                others = [c for c in self.connections if c is not self and not c.transport.is_closing()]
                idle = [c for c in others if c._idle()]
                receiving = [c for c in others if c._receiving()]
                victim = (min(idle, key=lambda c: c.opened) if idle else
                          min(receiving, key=lambda c: c._rate()) if receiving else self)
                victim.transport.close()
            self.header_deadline = self.loop.call_later(header_timeout, self._headers_overdue)

        def data_received(self, data: bytes) -> None:
            self.received += len(data)
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self.timed:     # a new request: its body's deadline
                self.timed = self.cycle
                if self.body_deadline is not None:
                    self.body_deadline.cancel()
                self.body_deadline = self.loop.call_later(body_timeout, self._body_overdue, self.cycle)

        def _idle(self) -> bool:                       # no request running, and not already being closed
            return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

        def _receiving(self) -> bool:                  # a request whose body has not all arrived
            return self.cycle is not None and self.cycle.more_body and not self.cycle.response_complete

        def _rate(self) -> float:
            return self.received / max(self.loop.time() - self.opened, 1e-3)

        def _headers_overdue(self):
            if self.cycle is None:                     # the first request's headers never arrived
                self.transport.close()

        def _body_overdue(self, cycle):
            if self.cycle is cycle and cycle.more_body and not cycle.response_complete:
                self.transport.close()

        def connection_lost(self, exc):
            self.header_deadline.cancel()
            if self.body_deadline is not None:
                self.body_deadline.cancel()
            super().connection_lost(exc)

    return GuardedH11Protocol


class BackgroundServer:
    """uvicorn serving `app` on a thread of this process (checks and benchmarks); port 0 = any free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, **guards):
        self.server = guarded_server(app, host, port, log_level="warning", access_log=False, timeout_graceful_shutdown=1,
                                     **guards)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.host = host
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def main(argv: list[str], say) -> int:
    parser = argparse.ArgumentParser(prog="./check.sh serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an HF model folder (config.json, *.safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-pending", type=int, default=256, help="requests in flight before HTTP 503")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="the context served (capped at the model's max_position_embeddings)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer API_KEY' on every /v1 request (401 otherwise)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="also serve requests whose Host header is NAME (repeatable; loopback names always)")
    device.add_options(parser)
    args = parser.parse_args(argv)
    missing = missing_packages()
    if missing:
        say(f"[red]./check.sh serve 需要 {', '.join(missing)}：pip install fastapi uvicorn（已写在 pyproject.toml 里）[/]")
        return 2
    problem = device.check_options(args, "serve")
    if problem:
        say(problem, style="red", markup=False)
        return 2

    selection, report = serving_selection(gpu=args.device == "cuda")
    select.use(selection)
    say("[bold]服务由这些文件组装[/]（已通过的练习用你的文件，其余用参考实现）：")
    for ex_id, path in report:
        say(f"  {ex_id}  {path}")
    e06 = select.load("e06_serving")
    LLM, on_device = device.engine(args, select)
    blocks = {} if args.device == "cuda" else {"num_kvcache_blocks": 1024}   # on the GPU the memory plan sizes it
    if args.model:
        llm = device.build(lambda: LLM(args.model, max_model_len=model_max_len(args.model, args.max_model_len),
                                       **blocks, **on_device), say)
        name = args.model
    else:
        llm = device.build(lambda: dummy_llm(LLM, max_model_len=min(args.max_model_len, 1024), **on_device), say)
        name = DUMMY_NAME
        say("模型：离线的迷你 Qwen3（随机 dummy 权重，字节级 tokenizer）——输出是随机文本，只用来验证服务能跑通。")
    if llm is None:
        return device.REFUSED
    engine = e06.AsyncEngine(llm, max_pending=args.max_pending).start()
    app = e06.build_app(engine, name, api_key=args.api_key, allowed_hosts=allowed_hosts(args.host, args.allowed_host))
    if not is_loopback(args.host):
        say(f"[yellow]警告：监听 {args.host} 时，能连上这台机器 {args.port} 端口的任何人都能调用这个服务、占用它的算力"
            + ("（已要求 API key）。[/]" if args.api_key else "；它没有身份验证——请加 --api-key KEY，或只监听 127.0.0.1。[/]"))
    say(f"OpenAI 兼容的服务：http://{args.host}:{args.port}/v1  模型名 {name!r}  （Ctrl-C 停止）")
    auth = " -H 'Authorization: Bearer $API_KEY'" if args.api_key else ""
    say(f"  curl http://{args.host}:{args.port}/v1/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{{\"model\": \"{name}\", \"prompt\": \"你好\", \"max_tokens\": 16}}'", markup=False)
    raise_file_limit()
    try:
        guarded_server(app, args.host, args.port, log_level="info", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S).run()
    finally:
        engine.shutdown()
    return 0
