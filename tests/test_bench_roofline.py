"""course/bench/roofline.py: the byte counts read off an engine's tensors, and the decode bound summed by hand."""

import pytest

from course.bench.roofline import decode_bound, engine_bytes


def _engine(config):
    from course.grader import select
    select.use({"default": "solutions"})
    return select.load("e05_engine").LLM(config, num_kvcache_blocks=64, block_size=16, max_num_seqs=4,
                                         max_num_batched_tokens=256, max_model_len=512)


def test_engine_bytes_of_a_hybrid_moe_model():
    from course.runtime.run import tiny_hybrid_config
    cfg = tiny_hybrid_config()
    llm = _engine(cfg)
    sizes = engine_bytes(llm.model, llm.runner)
    f32 = 4                                                      # the CPU engine runs fp32
    attn_layers = sum(t == "full_attention" for t in cfg.layer_types)
    assert sizes["kv_per_token"] == attn_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * f32
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    per_layer = conv_dim * (cfg.linear_conv_kernel_dim - 1) * f32 + \
        cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    assert sizes["gdn_per_seq"] == 2 * (len(cfg.layer_types) - attn_layers) * per_layer
    experts = cfg.num_hidden_layers * 3 * cfg.num_experts * cfg.moe_intermediate_size * cfg.hidden_size * f32
    assert sizes["expert_weights"] == experts
    total = sum(p.nbytes for p in llm.model.parameters())
    embed = llm.model.model.embed_tokens.weight.nbytes          # untied: only B rows are gathered, not read whole
    assert sizes["dense_weights"] + experts + embed == total
    assert (sizes["num_experts"], sizes["top_k"]) == (cfg.num_experts, cfg.num_experts_per_tok)
    assert sizes["logits_per_seq"] == 2 * cfg.vocab_size * f32


def test_a_tied_embedding_is_read_once_as_the_lm_head():
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    llm = _engine(cfg)
    sizes = engine_bytes(llm.model, llm.runner)
    assert sizes["dense_weights"] == sum(p.nbytes for p in llm.model.parameters())     # the table counted once
    assert sizes["expert_weights"] == sizes["gdn_per_seq"] == sizes["num_experts"] == 0


def test_decode_bound_sums_the_schedule():
    sizes = dict(kv_per_token=10, gdn_per_seq=100, dense_weights=1000, expert_weights=800, num_experts=4, top_k=2,
                 logits_per_seq=7)
    got = decode_bound(sizes, prompt_lens=[2, 3], out_lens=[2, 4], gb_per_s=1e-9)     # 1 byte a second
    # steps t = 1, 2, 3: both sequences at t = 1 (contexts 3 and 4), then only the second (5, then 6)
    share = [1 - (1 - 2 / 4) ** b for b in (2, 1, 1)]
    want = dict(kv=10 * (3 + 4 + 5 + 6), weights=3 * 1000 + 800 * sum(share), gdn=100 * 4, logits=7 * 4)
    assert got["steps"] == 3
    assert got["bytes"] == pytest.approx(want)
    assert got["seconds"] == pytest.approx(sum(want.values()))


def test_the_qwen3_0_6b_bench_workload_reads_13_9_tb_of_kv():
    """The number §G.1 quotes: the nano-vllm workload's decode reads 13.9 TB of K/V on Qwen3-0.6B (bf16)."""
    from course.bench.common import workload
    prompts, outs = workload(256, 1024, 1024)
    kv = 28 * 2 * 8 * 128 * 2
    got = decode_bound(dict(kv_per_token=kv, gdn_per_seq=0, dense_weights=0, expert_weights=0, num_experts=0, top_k=0,
                            logits_per_seq=0), [len(p) for p in prompts], outs, gb_per_s=4270)
    assert got["steps"] == max(outs) - 1
    assert got["bytes"]["kv"] == pytest.approx(13.85e12, rel=0.01)
    assert got["seconds"] == pytest.approx(13.85e12 / 4.27e12, rel=0.01)


def test_the_bench_prints_the_bound_beside_the_measured_decode(monkeypatch):
    from course.bench import engine
    monkeypatch.setattr(engine, "hbm_peak", lambda: 1e-9)                       # 1 byte a second
    sizes = dict(kv_per_token=10, gdn_per_seq=0, dense_weights=1000, expert_weights=0, num_experts=0, top_k=0,
                 logits_per_seq=0)
    eng = dict(num_seqs=2, engine_bytes=sizes, output_tokens=6,
               timeline=[(500.0, 2, False), (1000.0, 2, True), (1000.0, 1, True), (1000.0, 1, True)])
    line = engine.roofline_line(eng, [[1, 2], [1, 2, 3]], [2, 4])
    # bound: K/V 10 * 18 + weights 3 * 1000 = 3180 s against 3000 s of measured decode; with 500 s of prefill
    assert "= 3180.00 s; measured decode 3000.00 s (106% of the bound's speed)" in line, line
    assert "bounded at 0 output tok/s" in line and eng["decode_bound"]["steps"] == 3


def test_profile_floors_pair_each_byte_floor_with_the_kernels_that_read_it():
    from course.bench.profile import _classify, decode_floors
    # the k05 FP8 kernels have classes of their own (they fell into "torch elementwise / other" before)
    assert _classify("_gate_up_fp8_kernel") == _classify("_down_fp8_kernel") == "FP8 MoE (k05)"
    assert _classify("_gate_up_kernel") == "fused MoE (k03)"
    assert _classify("_fp8_linear_kernel") == "FP8 linear (k05)"
    assert _classify("_quant_act_kernel") == "activation quantization (k05)"
    assert _classify("sm90_xmma_gemm_bf16bf16_bf16f32") == "GEMM (cuBLAS)"
    sizes = dict(kv_per_token=1000, gdn_per_seq=0, dense_weights=4e9, expert_weights=60e9, num_experts=128, top_k=8,
                 logits_per_seq=2 * 1000 * 2)
    split = dict(wall_ms=10.0, gpu_busy_ms=8.0, by_class={
        "attention decode (k02)": dict(count=48, ms=1.0), "GEMM (cuBLAS)": dict(count=96, ms=1.5),
        "FP8 linear (k05)": dict(count=4, ms=0.5), "FP8 MoE (k05)": dict(count=96, ms=4.0),
        "activation quantization (k05)": dict(count=100, ms=0.5), "sampling (g01)": dict(count=1, ms=0.5)})
    f = decode_floors(split, sizes, batch=256, context_tokens=1_000_000, gb_per_s=2000.0)
    rows = f["rows"]
    assert "GDN states (read + write)" not in rows                     # no GDN bytes, no GDN kernels: no row
    kv = rows["K/V cache"]
    assert kv["bytes"] == 1e9 and kv["floor_ms"] == pytest.approx(0.5) and kv["share"] == pytest.approx(0.5)
    dense = rows["dense weights + logits write"]
    assert dense["ms"] == 2.0                                           # cuBLAS and the FP8 linear together
    assert dense["bytes"] == pytest.approx(4e9 + 256 * 2000)            # + half the logits (the LM head's write)
    hit = 1 - (1 - 8 / 128) ** 256
    assert rows["routed experts (expected distinct)"]["bytes"] == pytest.approx(hit * 60e9)
    assert rows["logits read"]["bytes"] == pytest.approx(256 * 2000)
    assert f["rest_ms"] == 0.5 and f["host_ms"] == 2.0                  # activation quantization has no floor
    total = 1e9 + 4e9 + 2 * 256 * 2000 + hit * 60e9
    assert f["step_floor_ms"] == pytest.approx(total / 2e12 * 1e3)
    assert f["share_of_wall"] == pytest.approx(f["step_floor_ms"] / 10.0)
    assert [r["label"] for r in f["table"]][-2:] == ["every other kernel (no byte floor)", "host (wall - GPU busy)"]
    assert f["table"][0] == dict(label="K/V cache", **kv) and f["table"][-1]["ms"] == 2.0
    from rich.console import Console
    from course.bench.profile import _say_floors
    console = Console(record=True, width=200)
    _say_floors(f, console.print)
    text = console.export_text()
    assert "FP8 linear (k05)" in text and "50%" in text                  # the K/V row's share
