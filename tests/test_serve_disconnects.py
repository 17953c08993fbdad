"""e06's reference server under 200 clients that leave at random moments (issue 34): afterwards nothing is pending,
every KV block (and every GDN state slot of a hybrid model) is free and the server still answers."""

import asyncio
import json
import random
import time

import pytest

from course.grader import registry, select

MISSING = registry.get("e06").missing_packages
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"e06 needs {', '.join(MISSING)}")
MODEL = "tiny"


def _server(family: str):
    from course.runtime.serve import BackgroundServer, dummy_llm
    from course.runtime.tiny_tokenizer import byte_tokenizer
    e05, e06 = select.load("e05_engine"), select.load("e06_serving")
    if family == "qwen3":
        llm = dummy_llm(e05, max_model_len=512, max_num_seqs=16, num_kvcache_blocks=128)
    else:
        from transformers import Qwen3_5TextConfig
        tok = byte_tokenizer()
        config = Qwen3_5TextConfig(vocab_size=len(tok), hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=16, intermediate_size=64, num_hidden_layers=2,
                                   layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                   linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                   max_position_embeddings=512)
        llm = e05.LLM(config, tokenizer=tok, max_model_len=512, max_num_seqs=16, num_kvcache_blocks=128)
    engine = e06.AsyncEngine(llm, max_pending=400)
    return BackgroundServer(e06.build_app(engine.start(), MODEL)).url, engine


async def _client(http, url: str, rng: random.Random, i: int) -> str:
    """One client: a random request (completions or chat, streaming or not, n 1-3, logprobs, echo) that it reads to
    the end, or leaves after a few frames, or gives up on after a random timeout."""
    import httpx
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    body = {"model": MODEL, "max_tokens": rng.randint(4, 120), "seed": i, "n": rng.choice([1, 1, 2, 3]),
            "stream": stream, "ignore_eos": True}
    text = "".join(rng.choice("abc xyz,你好") for _ in range(rng.randint(1, 40)))
    if chat:
        body["messages"] = [{"role": rng.choice(["user", "developer"]), "content": text}]
        if rng.random() < 0.3:
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
    else:
        body["prompt"] = text
        if rng.random() < 0.3:
            body |= {"logprobs": rng.randint(0, 5), "echo": rng.random() < 0.5}
    path = url + ("/v1/chat/completions" if chat else "/v1/completions")
    leave = rng.choice(["read", "frames", "timeout"])
    try:
        if stream:
            async with http.stream("POST", path, json=body,
                                   timeout=rng.uniform(0.05, 1.0) if leave == "timeout" else 60) as resp:
                if resp.status_code != 200:
                    return str(resp.status_code)
                seen, limit = 0, rng.randint(0, 5)
                async for line in resp.aiter_lines():
                    seen += line.startswith("data: ")
                    if leave == "frames" and seen > limit:
                        return "left"
                    if line.startswith("data: {\"error\""):
                        return "error"
            return "done"
        resp = await http.post(path, json=body, timeout=rng.uniform(0.05, 1.0) if leave != "read" else 60)
        return str(resp.status_code) if resp.status_code != 200 else ("done" if json.loads(resp.text) else "?")
    except httpx.TimeoutException:
        return "left"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_200_clients_leave_at_random(family):
    import httpx
    url, engine = _server(family)
    rng = random.Random(34)
    start = time.monotonic()

    async def everyone():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits) as http:
            return await asyncio.gather(*(_client(http, url, rng, i) for i in range(200)))

    outcomes = asyncio.run(everyone())
    counts = {k: outcomes.count(k) for k in set(outcomes)}
    assert set(counts) <= {"done", "left", "503"}, counts
    assert counts.get("left", 0) >= 20 and counts.get("done", 0) >= 20, counts
    deadline = time.monotonic() + 30
    while True:
        h = httpx.get(url + "/health", timeout=10).json()
        idle = h["pending"] == 0 and h["unfinished"] == 0 and h["free_blocks"] == h["total_blocks"] \
            and h.get("gdn_free_slots", 0) == h.get("gdn_slots", 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, (counts, h)
    assert not engine.tap.watched, f"logprob registrations left behind: {len(engine.tap.watched)}"
    if family != "qwen3":
        assert "gdn_slots" in h, h
    after = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
    assert after.status_code == 200, after.text
    print(family, counts, f"{time.monotonic() - start:.1f} s")
