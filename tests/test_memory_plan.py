"""course/runtime/memory.py on the CPU: the plan's arithmetic and the refusal paragraph (the GPU side, measured
peaks and the 24/48/80 GiB matrix, is tests/test_gpu_memory.py)."""

import pytest

from course.runtime import memory
from course.runtime.memory import GIB, MIB, MemoryPlan, MemoryPlanError


def _plan(weights, gdn_rows=0, row=0):
    return MemoryPlan(card=80 * GIB, budget=48 * GIB, utilization=0.9, outside=GIB // 2, weights=weights,
                      gdn_rows=gdn_rows, gdn_pool=gdn_rows * row, activations=int(1.5 * GIB), block_size=32,
                      block_bytes=3 * MIB)


def test_blocks_fill_what_the_budget_leaves():
    plan = _plan({"experts": (30 * GIB, "float8_e4m3fn"), "dense": (2 * GIB, "bfloat16")})
    blocks = plan.blocks_that_fit()
    free = 48 * GIB * 0.9 - (GIB // 2 + 32 * GIB + int(1.5 * GIB)) - memory.SLACK
    assert blocks == int(free // (3 * MIB))
    plan.num_blocks = blocks
    assert 0 <= plan.left - 48 * GIB * 0.1 < 3 * MIB + memory.SLACK + 1      # the 10 % margin and the slack stay free
    plan.measured["free_after_warmup"] = plan.left + int(0.01 * plan.card)
    assert plan.left_error() == pytest.approx(0.01)
    assert "差 +1.0%" in plan.table()


def test_refusal_names_the_numbers_and_a_max_num_seqs_that_fits():
    row = 61 * MIB
    plan = _plan({"experts": (31 * GIB, "float32+float8_e4m3fn"), "dense": (2 * GIB, "bfloat16")}, 257, row)
    with pytest.raises(MemoryPlanError) as err:
        memory.refuse(plan, "一条 max_model_len 的序列的 KV cache ", 128 * plan.block_bytes, 4096, 256, "加载权重之前")
    text = str(err.value)
    assert "GDN 状态池 15.3 GiB（257 行）" in text and "权重 33.0 GiB" in text
    seqs = int(text.split("max_num_seqs 降到 ")[1].split("（")[0])
    assert 1 <= seqs < 256
    # the suggestion fits: that many GDN rows (+1 spare) leave room for the sequence's K/V
    plan.gdn_rows, plan.gdn_pool = seqs + 1, (seqs + 1) * row
    assert plan.blocks_that_fit() >= 128
    assert "FP8 权重" not in text                         # the weights are FP8 already


def test_refusal_without_gdn_suggests_fp8_and_leaves_the_pool_out():
    plan = _plan({"experts": (57 * GIB, "bfloat16")})
    with pytest.raises(MemoryPlanError) as err:
        memory.refuse(plan, "一条 max_model_len 的序列的 KV cache ", GIB, 4096, 256, "加载权重之前")
    text = str(err.value)
    assert "GDN" not in text and "max_num_seqs 降到" not in text and "FP8 权重" in text
