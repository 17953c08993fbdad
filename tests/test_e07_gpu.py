"""e07 on the GPU engine (g01): hybrid prefix caching on CUDA gives the tokens of caching off (skipped without CUDA).

Tiny fp32 hybrids with dummy weights built on the device, CUDA graphs on: a multi-turn chat sharing a system prompt,
and a restore whose request has one token left, so that its first step is a graph replay reading the restored slot.
"""

import pytest
import torch

from checks import hf_models
from checks.kit import Rand
from course.grader import select

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _engine(config, caching: bool):
    g01 = select.load("g01_gpu_engine")
    return g01.LLM(config, device="cuda", dtype=torch.float32, enable_prefix_caching=caching, block_size=16,
                   max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, num_kvcache_blocks=128,
                   num_state_snapshots=16)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_hybrid_prefix_caching_on_cuda_matches_caching_off(family):
    select.use({"default": "solutions"})
    e01 = select.load("e01_sampling")
    greedy = e01.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    r = Rand(0)
    config = hf_models.tiny_config(family, r, vocab=64, layers=3)
    system = r.randint(1, 64, (40,)).tolist()
    history = [system + r.randint(1, 64, (8,)).tolist() for _ in range(3)]
    on, off = _engine(config, True), _engine(config, False)
    for turn in range(3):
        got = [o.token_ids for o in on.generate(history, greedy)]
        want = [o.token_ids for o in off.generate(history, greedy)]
        assert got == want, f"{family} turn {turn + 1}: caching on {got} != off {want}"
        history = [h + g + r.randint(1, 64, (8,)).tolist() for h, g in zip(history, got)]
    assert on.stats["snapshot_hits"] >= 6, on.stats
    # a prompt that is a cached, snapshotted 32-token prefix + 1 token: restored, then one decode-shaped step
    prefix = r.randint(1, 64, (32,)).tolist()
    on.generate([prefix], greedy)
    hits = on.stats["snapshot_hits"]
    got = on.generate([prefix + [5]], greedy)[0].token_ids
    assert on.stats["snapshot_hits"] == hits + 1, on.stats
    assert got == off.generate([prefix + [5]], greedy)[0].token_ids
    assert not on.runner.gdn_pool.slot_of and on.stats["free_blocks"] == on.stats["total_blocks"]
