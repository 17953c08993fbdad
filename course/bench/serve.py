"""`./check.sh bench --serve`: output throughput and time-to-first-token through HTTP, beside the offline engine.

    ./check.sh bench --serve                                 the tiny dummy model on the CPU (a smoke test)
    ./check.sh bench --serve --model DIR --requests 256 --clients 64 --max-in 1024 --max-out 1024

One engine, two runs of the same kind of workload (nano-vllm's bench.py: random token prompts, random output
lengths, ignore_eos; a different seed for each run so the second cannot hit the first one's prefix cache), both
driven from a new thread as the server's engine thread is (torch's per-thread settings, such as the number of
intra-op threads, are then the same for both), so that the ratio measures the serving layer only:
1. offline: `LLM.generate` on every request at once;
2. HTTP: the e06 server on 127.0.0.1 (uvicorn on a thread of this process) and `clients` concurrent streaming
   clients (closed loop: each sends its next request when the previous one ends).
TTFT is the time from sending a request to its first SSE frame with text. `bench_serve` returns the figures as a
dict so that the GPU benchmark can print them beside its own.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..grader import select
from ..runtime.serve import BackgroundServer, DUMMY_NAME, dummy_llm, missing_packages, serving_selection


def workload(n: int, vocab: int, seed: int, min_in: int, max_in: int, min_out: int, max_out: int
             ) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) pairs; prompts first, then output lengths (as nano-vllm's bench.py)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_in, max_in))] for _ in range(n)]
    return [(p, rng.randint(min_out, max_out)) for p in prompts]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


async def _http_run(url: str, model: str, requests: list[tuple[list[int], int]], clients: int) -> dict:
    import httpx
    todo = list(enumerate(requests))
    ttft, tokens, busy, errors = [], 0, 0, []

    async def client(http):
        nonlocal tokens, busy
        while todo:
            i, (prompt, max_tokens) = todo.pop(0)
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            start, first = time.perf_counter(), None
            async with http.stream("POST", url + "/v1/completions", json=body) as resp:
                if resp.status_code == 503:                  # over the server's bound: count it, retry shortly
                    busy += 1
                    todo.append((i, (prompt, max_tokens)))
                    await resp.aread()
                    await asyncio.sleep(min(float(resp.headers.get("retry-after", 1)), 0.05))
                    continue
                if resp.status_code != 200:
                    errors.append(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
                    continue
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                        first = time.perf_counter() - start
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            if first is not None:
                ttft.append(first)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p95_s": _pct(ttft, 0.95), "http_503": busy, "errors": errors}


def _clients_in_own_process(url: str, model: str, requests: list, clients: int) -> dict:
    """Run the load generator in a separate Python process: in the server's process it would take the GIL from it."""
    with tempfile.TemporaryDirectory(prefix="course-bench-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"url": url, "model": model, "requests": requests, "clients": clients}))
        proc = subprocess.run([sys.executable, "-m", "course.bench.serve", str(job)], capture_output=True, text=True,
                              cwd=select.ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"the load generator failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _on_new_thread(fn):
    """fn() on a fresh thread, the way AsyncEngine runs the engine; its result (or its exception)."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as exc:   # noqa: BLE001  re-raised below, on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="bench-offline")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def bench_serve(llm, e01, e06, requests: int = 64, clients: int = 32, min_in: int = 16, max_in: int = 64,
                min_out: int = 16, max_out: int = 64, max_pending: int | None = None, model_name: str = "bench",
                seed: int = 0, vocab: int | None = None) -> dict:
    """Offline LLM.generate, then the same kind of workload through HTTP with `clients` concurrent streams.

    Prompt tokens are drawn from [0, vocab) (default min(vocab_size, 10000), as nano-vllm's bench.py).
    """
    vocab = vocab or min(llm.vocab_size, 10000)
    offline = workload(requests, vocab, seed, min_in, max_in, min_out, max_out)
    params = [e01.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in offline]

    def run_offline():
        llm.generate([[1, 2, 3]], e01.SamplingParams(temperature=0, max_tokens=4))      # warm-up
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in offline], params)
        return time.perf_counter() - start, sum(len(o.token_ids) for o in outs), _threads()

    seconds, done, threads = _on_new_thread(run_offline)
    result = {"offline": {"seconds": seconds, "tokens": done, "tok_s": done / seconds, "torch_threads": threads}}

    engine = e06.AsyncEngine(llm, max_pending=max_pending or requests + clients).start()
    server = BackgroundServer(e06.build_app(engine, model_name))
    try:
        online = workload(requests, vocab, seed + 1, min_in, max_in, min_out, max_out)
        result["http"] = _clients_in_own_process(server.url, model_name, online, clients)
    finally:
        server.stop()
        engine.shutdown()
    result["http"]["clients"] = clients
    result["ratio"] = result["http"]["tok_s"] / result["offline"]["tok_s"]
    return result


def run(args, say) -> int:
    """`./check.sh bench --serve [options]` (args parsed and checked by cli.py)."""
    missing = missing_packages(("fastapi", "uvicorn", "httpx"))
    if missing:
        say(f"[red]bench --serve 需要 {', '.join(missing)}：pip install fastapi uvicorn httpx[/]")
        return 2
    selection, report = serving_selection()
    select.use(selection)
    e01, e05, e06 = select.load("e01_sampling"), select.load("e05_engine"), select.load("e06_serving")
    engine_kwargs = dict(max_num_seqs=args.max_num_seqs, num_kvcache_blocks=args.num_kvcache_blocks,
                         max_num_batched_tokens=max(1024, args.max_in + args.max_num_seqs),
                         max_model_len=args.max_in + args.max_out + 1)
    if args.model:
        import torch
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        llm, name = e05.LLM(args.model, dtype=dtype, **engine_kwargs), args.model
        vocab = None
    else:
        llm, name = dummy_llm(e05, **engine_kwargs), DUMMY_NAME
        vocab = 94      # printable ASCII only: greedy repeats the last prompt byte, so every token is a whole character
    say(f"模型 {name}；{args.requests} 个请求，prompt {args.min_in}–{args.max_in} tokens，输出 {args.min_out}–{args.max_out} "
        f"tokens（ignore_eos），HTTP 并发客户端 {args.clients}")
    r = bench_serve(llm, e01, e06, args.requests, args.clients, args.min_in, args.max_in, args.min_out, args.max_out,
                    args.max_pending, name, vocab=vocab)
    off, http = r["offline"], r["http"]
    say(f"离线 LLM.generate（新线程上，与服务的引擎线程相同；torch 线程数 {off['torch_threads']}）："
        f"{off['tokens']} tokens / {off['seconds']:.2f} s = {off['tok_s']:.0f} tok/s")
    say(f"HTTP（{http['clients']} 个流式客户端）：{http['tokens']} tokens / {http['seconds']:.2f} s = {http['tok_s']:.0f} tok/s"
        f"（离线的 {r['ratio']:.0%}）；TTFT p50 {http['ttft_p50_s'] * 1000:.0f} ms、p95 {http['ttft_p95_s'] * 1000:.0f} ms；"
        f"503 {http['http_503']} 次；错误 {len(http['errors'])} 个")
    for e in http["errors"][:5]:
        say(f"  [red]{e}[/]", markup=False)
    return 0 if not http["errors"] else 1


if __name__ == "__main__":          # the load generator's own process (see _clients_in_own_process)
    job = json.loads(Path(sys.argv[1]).read_text())
    requests = [(prompt, max_tokens) for prompt, max_tokens in job["requests"]]
    print(json.dumps(asyncio.run(_http_run(job["url"], job["model"], requests, job["clients"]))))
