"""`./check.sh serve`: the assembled engine behind an OpenAI-compatible HTTP server (exercise e06).

    ./check.sh serve                                  the offline tiny dummy Qwen3 (byte tokenizer) on 127.0.0.1:8000
    ./check.sh serve --model DIR --port 8001          a real HF folder: weights, tokenizer and chat template
    ./check.sh serve --host 0.0.0.0 --api-key KEY     reachable from the network: clients send "Authorization: Bearer KEY"

There is no authentication unless --api-key is given: anyone who can reach the port can spend the machine's compute.
Needs fastapi, uvicorn (and the openai client for the checks): they are in pyproject.toml.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import threading
import time

from ..grader import registry, select, state
from .run import auto_selection, tiny_dummy_config

PACKAGES = ("fastapi", "uvicorn")
DUMMY_NAME = "qwen3-tiny-dummy"
GRACEFUL_SHUTDOWN_S = 5        # Ctrl-C: open connections get this long, then they are closed (a half-sent body too)


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


def serving_selection() -> tuple[dict[str, str], list[tuple[str, str]]]:
    """auto_selection() plus e06: the learner's server once e06 has passed."""
    selection, report = auto_selection()
    ex = registry.get("e06")
    folder = "mine" if ex.id in state.passed_ids(registry.CATALOGUE) else "solutions"
    selection[ex.module] = folder
    return selection, report + [(ex.id, f"{folder}/{ex.module}.py")]


def dummy_llm(e05, seed: int = 0, **engine_kwargs):
    """The offline tiny Qwen3 with dummy weights and the byte tokenizer (random text, fast on a CPU)."""
    from .tiny_tokenizer import byte_tokenizer
    tokenizer = byte_tokenizer()
    return e05.LLM(tiny_dummy_config(len(tokenizer)), tokenizer=tokenizer, seed=seed, **engine_kwargs)


class BackgroundServer:
    """uvicorn serving `app` on a thread of this process (checks and benchmarks); port 0 = any free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
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
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--api-key", help="require 'Authorization: Bearer API_KEY' on every /v1 request (401 otherwise)")
    args = parser.parse_args(argv)
    missing = missing_packages()
    if missing:
        say(f"[red]./check.sh serve 需要 {', '.join(missing)}：pip install fastapi uvicorn（已写在 pyproject.toml 里）[/]")
        return 2

    selection, report = serving_selection()
    select.use(selection)
    say("[bold]服务由这些文件组装[/]（已通过的练习用你的文件，其余用参考实现）：")
    for ex_id, path in report:
        say(f"  {ex_id}  {path}")
    e05, e06 = select.load("e05_engine"), select.load("e06_serving")
    if args.model:
        llm = e05.LLM(args.model, max_model_len=args.max_model_len, num_kvcache_blocks=1024)
        name = args.model
    else:
        llm = dummy_llm(e05, max_model_len=min(args.max_model_len, 1024))
        name = DUMMY_NAME
        say("模型：离线的迷你 Qwen3（随机 dummy 权重，字节级 tokenizer）——输出是随机文本，只用来验证服务能跑通。")
    engine = e06.AsyncEngine(llm, max_pending=args.max_pending).start()
    app = e06.build_app(engine, name, api_key=args.api_key) if args.api_key else e06.build_app(engine, name)
    if not is_loopback(args.host):
        say(f"[yellow]警告：监听 {args.host} 时，能连上这台机器 {args.port} 端口的任何人都能调用这个服务、占用它的算力"
            + ("（已要求 API key）。[/]" if args.api_key else "；它没有身份验证——请加 --api-key KEY，或只监听 127.0.0.1。[/]"))
    say(f"OpenAI 兼容的服务：http://{args.host}:{args.port}/v1  模型名 {name!r}  （Ctrl-C 停止）")
    auth = " -H 'Authorization: Bearer $API_KEY'" if args.api_key else ""
    say(f"  curl http://{args.host}:{args.port}/v1/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{{\"model\": \"{name}\", \"prompt\": \"你好\", \"max_tokens\": 16}}'", markup=False)
    import uvicorn
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    finally:
        engine.shutdown()
    return 0
