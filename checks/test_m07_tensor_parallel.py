"""Checks for M07 · Tensor parallel (lessons/m07_tensor_parallel.md).

Oracles: torch's own single-process layers (F.linear = nn.Linear, F.embedding = nn.Embedding) with the
same full weights, and m06's TP=1 model loaded from checkpoints that HF transformers 5.17.0 wrote with
save_pretrained (Qwen3ForCausalLM with nKV = 1 too, Qwen3MoeForCausalLM, Qwen3_5ForCausalLM and
Qwen3_5MoeForCausalLM with Gated DeltaNet layers; fp32, eager, every parameter randomised, sizes drawn per
run). TP=2 runs in 2 processes with the gloo backend (checks/tp_workers.py): all scenarios in one run,
cached for every check. One small TP=4 run (4 processes) covers what tp = 2 cannot show: a KV head shared by
2 and by 4 ranks, and a vocabulary that 4 does not divide. TP=1 checks run in this process, without a process
group. Every run draws V odd (and V % 4 != 0 at tp = 4), so the padded last shard is there on every seed.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig

from checks import hf_models, tp_workers
from checks.kit import Rand, assert_close, impl, point, record_case

MODULE = "m07_tensor_parallel"
TP = tp_workers.WORLD
TP4 = 4

transformers.utils.logging.set_verbosity_error()
torch.set_num_threads(1)

# the card's 易错点, as the failure messages name them
M_NO_ALL_REDUCE = "RowParallelLinear 忘了 all-reduce：每个 rank 只返回了自己的部分和 x_r W_r^T"
M_BIAS_TWICE = "bias 在每个 rank 上都加了：all-reduce 之后变成 tp·b（应在 all-reduce 之后加一次，或只在 rank 0 加）"
M_QKV_HALVES = "QKV 的 weight_loader 把拼接后的 [q|k|v] 整体对半切了（rank 0 拿到全部 q、rank 1 拿到 k 和 v）：应每个 rank 各取自己那几个 head 的 q、k、v"
M_MERGED_ONE = "gate/up 当成一个张量切了：rank 0 拿到整个 gate、rank 1 拿到整个 up；应对 gate、up 各自切，本 rank 的局部行 = [gate 的一段 | up 的一段]"
M_VOCAB_MASK = "词表 mask 没做好：分片外的 id 要先映射到合法行（越界会 IndexError），查完表再把这些行置零，最后 all-reduce"
M_LM_HEAD_LOCAL = "ParallelLMHead 只返回了本 rank 的 logits 分片：忘了 all-gather（每个 rank 都应拿到完整的 [N, V]）"
M_LM_HEAD_PAD = "ParallelLMHead 拼回之后没有去掉补零列：V 不能被 tp 整除时 all-gather 得到 tp·ceil(V/tp) 列，应再取 [:, :V]"
M_VOCAB_FLOOR = "词表分片应为 ceil(V/tp) 行（最后一片补零）：按 V // tp 切时，最后 V % tp 个 id 不属于任何 rank"
M_EXPERTS_DIM = "experts 沿错误的维度切分：gate_up_proj [E, 2I, H] 切 dim 1，down_proj [E, H, I] 切 dim 2（都是中间维 I，不是 H）"
M_BACKEND_HEADS = "attention backend（self_attn.attn）的 num_heads / num_kv_heads 没有除以 tp：logits 照样对，但引擎按它分配的 KV cache 和 paged attention 的形状都错了"
M_MODULE_HEADS = "attention 模块的 num_heads / num_kv_heads / q_size / kv_size 没有除以 tp：qkv_proj 的输出只剩本 rank 的 head"
M_MOE_REDUCE = "MoE block 之后忘了 all-reduce：experts 沿 I 切开后，每个 rank 的 routed + shared 输出都只是部分和"
M_TIED = "tied embeddings：换成 VocabParallelEmbedding / ParallelLMHead 之后，忘了让 lm_head.weight 重新指向 embed_tokens.weight"
M_TOUCH_DIST = "TP=1 时调用了 torch.distributed：world_size=1 应原样返回，不初始化、不通信"
M_KV_REPLICA = ("nKV < tp 时复制 KV head：rank r 应取第 r·nKV/tp 个 KV head（相邻的 tp/nKV 个 rank 共用一个），"
                "不是第 r 个，也不是第 r % nKV 个")
M_KV_ZERO = "nKV < tp 时本 rank 的 num_kv_heads 成了 nKV // tp = 0：KV head 比 rank 少时每个 rank 存 1 个（复制）"
M_KV_REFUSED = "nKV < tp 时应复制 KV head（每个 rank 一个，vLLM 的做法），而不是报“不能整除”"
M_GDN_QKV = "in_proj_qkv 当成一个张量切了：它是 [q_all | k_all | v_all] 三段，每段各自按 head 切，本地行 = [q_r | k_r | v_r]"
M_GDN_CONV = "conv1d 的通道没有按 q、k、v 各自切：通道顺序和 in_proj_qkv 的输出一样是 [q_all | k_all | v_all]，要与本地的 [q_r | k_r | v_r] 一一对应"
M_GDN_GATES = "A_log / dt_bias 没有切：它们和 a、b 一样按 value head 走，本 rank 只留 nv/tp 个"
M_GDN_VHEADS = "value head 分错了 rank（按 j % tp 轮流分）：每个 rank 要拿连续的 nv/tp 个 value head，这样 value head j 和它读的 key head j // (nv/nk) 在同一个 rank 上"
M_GDN_NORM = "门控 RMSNorm 的 weight 被切了：它是 [dv]，每个 value head 共用同一份，每个 rank 都要完整保留"
M_GDN_OUT = "out_proj 不是 row parallel：它的输入是本 rank 的 value head 输出 [N, nv·dv/tp]，要按列切并 all-reduce"
M_LM_HEAD_NEG = ("去掉补零列时用了负的切片 [:, :-pad]：V 能被 tp 整除时 pad = 0，[:, :-0] 是空的；"
                 "应取 [:, :V]")
M_NOT_DIVISIBLE = ("head 数不能被 tp 整除时应报 ValueError（_divide），而不是向下取整：nH、nKV ≥ tp 时的 nKV 都要整除，"
                   "nKV < tp 时 tp 要是 nKV 的倍数；向下取整的 rank 拼不回完整的 attention")
M_EXPLICIT = ("显式给出的 (rank, world_size) 与 tp_info() 不一致（比如忘了 init_process_group）时 tensor_parallel 应报 ValueError，"
              "而不是按给出的 world_size 改写一个没有进程组的模型")
M_GDN_HEADS = "Gated DeltaNet 层的 num_k_heads / num_v_heads / key_dim / value_dim / conv_dim 没有改成本 rank 的：forward 的 split / view 和状态池都按它们走"

SHAPE_ERROR = re.compile(r"size|shape|exceeds|out of range|must match|expand")


def _crash_hint(name: str, err: dict, data: dict, run: dict) -> str | None:
    """The 易错点 a crash singles out, or None: a hint names a mistake only when the evidence points at it (the
    fragment, the function it came from, what the rank recorded before it crashed and, for KV replication, the
    same model family without replication loading fine in the same run)."""
    msg, where = err["message"], err["where"]
    if "index out of range" in msg and "VocabParallelEmbedding" in where:
        return M_VOCAB_MASK
    if "missing key for 'lm_head.weight'" in msg:
        return M_TIED
    family = name.removeprefix("model:")
    config = run["expected"].get(family, {}).get("config")
    if "split_with_sizes" in msg and "Attention.forward" in where and config is not None and data.get("heads"):
        if data["heads"][0][0] == config.num_attention_heads:          # the module still has every head
            return M_MODULE_HEADS
    if "ParallelExperts.weight_loader" in where and SHAPE_ERROR.search(msg):
        return M_EXPERTS_DIM
    if name == "model:qwen3_kv1":                   # nKV = 1 < tp; model:qwen3 (nKV = 2 = tp) is the control
        control = [res.get("model:qwen3") or {} for res in run["results"]]
        if not all(c.get("error") is None and c.get("data", {}).get("stage") == "forward" for c in control):
            return None
        if err["type"] == "ValueError" and data.get("stage") == "tensor_parallel":
            return M_KV_REFUSED
        if data.get("stage") == "load_checkpoint" and "QKVParallelLinear" in where:
            return M_KV_REPLICA
    return None


# ------------------------------------------------------------------------------------------ TP=2 run

_RUNS: dict[int, dict] = {}                     # world size -> its one run of this grading session
MODEL_FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_kv1")


def _linear(r: Rand) -> dict:
    """Gated DeltaNet sizes that split over 2 ranks: nk in {2, 4}, nv = nk or 2 nk but at least 4, dk != dv on most
    runs. nv >= 4 gives every rank >= 2 value heads: with one each, a round-robin split equals the contiguous one."""
    nk = r.choice([2, 4])
    nv = 4 if nk == 2 else nk * r.choice([1, 2])
    return dict(linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=r.choice([8, 16]),
                linear_value_head_dim=r.choice([8, 16]), linear_conv_kernel_dim=r.choice([2, 3, 4]))


def _configs(r: Rand) -> dict:
    """Tiny HF configs whose head counts and intermediate sizes split over 2 ranks (GQA with nKV = 2 or 4;
    qwen3_kv1 has a single KV head, replicated on both ranks)."""
    heads, kv = r.choice([(4, 2), (8, 2), (2, 2), (8, 4), (6, 2)])
    head_dim, hidden = r.choice([8, 16]), r.choice([32, 48])
    base = dict(vocab_size=2 * r.int(24, 48) + 1, hidden_size=hidden,      # V odd: the last shard is padded num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=head_dim, max_position_embeddings=256, rms_norm_eps=1e-6, attn_implementation="eager")
    moe = dict(num_experts=r.int(4, 6), num_experts_per_tok=2, moe_intermediate_size=r.choice([16, 24]),
               experts_implementation="eager")
    half = head_dim // 4                          # rotary_dim / 2 frequencies with partial_rotary_factor 0.5
    rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
    return {
        "qwen3": Qwen3Config(intermediate_size=r.choice([48, 64]), num_hidden_layers=2, rope_theta=1e6,
                             tie_word_embeddings=True, **base),
        "qwen3_moe": Qwen3MoeConfig(intermediate_size=64, num_hidden_layers=2, rope_theta=1e6,
                                    norm_topk_prob=r.choice([True, False]), mlp_only_layers=[0], **base, **moe),
        "qwen3_5_moe_text": Qwen3_5MoeTextConfig(shared_expert_intermediate_size=r.choice([16, 24]),
                                                 num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                                 rope_parameters=rope, **base, **moe, **_linear(r)),
        "qwen3_5_text": Qwen3_5TextConfig(intermediate_size=64, num_hidden_layers=3, rope_parameters=rope,
                                          layer_types=["linear_attention", "full_attention", "linear_attention"],
                                          **base, **_linear(r)),
        "qwen3_kv1": Qwen3Config(intermediate_size=r.choice([48, 64]), num_hidden_layers=2, rope_theta=1e6,
                                 **{**base, "num_attention_heads": r.choice([2, 4, 6]), "num_key_value_heads": 1}),
    }


def _model_job(family: str, config, r: Rand, folder: Path) -> tuple[dict, dict]:
    """Save a randomised HF model, compute the TP=1 reference with m06; (job for the ranks, expectations)."""
    hf = hf_models.hf_model(family.removesuffix("_kv1").removesuffix("_tp4"), config, r)
    hf_models.save_hf(hf, folder)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    lengths = [r.int(1, 7) for _ in range(r.int(2, 3))]
    ids = r.randint(0, config.vocab_size, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    moe_layer = {"qwen3_moe": 1, "qwen3_5_moe_text": 0}.get(family)
    gdn_layer = 0 if family.startswith("qwen3_5") else None
    probe = r.randn(r.int(3, 6), config.hidden_size)
    gdn_lengths = [r.int(1, 6) for _ in range(r.int(2, 3))]
    job = dict(config=config, folder=str(folder), ids=ids, positions=positions, lengths=lengths,
               moe_layer=moe_layer, probe=probe, gdn_layer=gdn_layer, gdn_lengths=gdn_lengths,
               gdn_x=r.randn(sum(gdn_lengths), config.hidden_size), gdn_next=r.randn(len(gdn_lengths), config.hidden_size))
    m06 = impl("m06_models")
    ref = m06.build_model(config)
    m06.load_checkpoint(ref, folder)
    with torch.no_grad():
        ctx = impl("m04_attention").AttentionContext.from_seqlens(lengths)
        expected = {"logits": ref.compute_logits(ref(ids, positions, ctx)), "config": config, "state": state,
                    "numel": sum(p.numel() for p in ref.parameters()),
                    "qkv": next(layer for layer in ref.model.layers if not layer.is_linear).self_attn.qkv_proj.weight}
        if moe_layer is not None:
            expected["probe"] = ref.model.layers[moe_layer].mlp(probe)
        if gdn_layer is not None:
            gdn = ref.model.layers[gdn_layer].linear_attn
            pool = impl("e04_model_runner").GDNStatePool(ref, len(gdn_lengths))
            expected["gdn_full"] = {n: p.detach().clone() for n, p in gdn.named_parameters()}
            expected["gdn_dims"] = (gdn.num_k_heads, gdn.num_v_heads, gdn.key_dim, gdn.value_dim, gdn.conv_dim)
            expected["gdn_steps"] = tp_workers.gdn_steps(gdn, pool.conv[gdn_layer], pool.ssm[gdn_layer], job)
    return job, expected


def _job(r: Rand, folder: Path) -> tuple[dict, dict]:
    """Inputs for every scenario (full weights, configs, checkpoints) and what the parent expects."""
    job, expected = {}, {}
    n_in, n_out = r.choice([6, 8, 10]), 2 * r.int(3, 6)
    job["column_row"] = dict(x=r.randn(r.int(3, 7), n_in), w_col=r.randn(n_out, n_in), b_col=r.randn(n_out),
                             x_row=r.randn(r.int(3, 7), n_out), w_row=r.randn(n_in, n_out), b_row=r.randn(n_in))
    hidden = r.choice([8, 12])
    qkv = dict(x=r.randn(r.int(3, 7), hidden), w_gate=r.randn(2 * r.int(2, 5), hidden))
    qkv["w_up"] = r.randn(*qkv["w_gate"].shape)
    for key, factor in (("gqa", 1), ("gated", 2)):
        heads, kv, head_dim = r.choice([4, 6, 8]), 2, r.choice([2, 4])   # nKV = 2 over 2 ranks: one kv head each
        qkv[key] = dict(hidden=hidden, head_dim=head_dim, heads=heads, kv_heads=kv, factor=factor,
                        w_q=r.randn(heads * factor * head_dim, hidden), w_k=r.randn(kv * head_dim, hidden),
                        w_v=r.randn(kv * head_dim, hidden))
    job["qkv_merged"] = qkv
    job["vocab"] = _vocab_job(r, 2 * r.int(4, 19) + 1, hidden, TP)     # V odd: the last shard is zero-padded
    job["vocab:even"] = _vocab_job(r, 2 * r.int(4, 19), hidden, TP)     # V a multiple of tp: no padding at all
    configs = _configs(r)
    for family in MODEL_FAMILIES:
        job[f"model:{family}"], expected[family] = _model_job(family, configs[family], r, folder / family)
    job["card"] = dict(x=torch.tensor([[1.0, -1.0]]), w1=torch.tensor([[1.0, 2.0], [0.0, 1.0], [-1.0, 1.0], [2.0, 0.0]]),
                       w2=torch.tensor([[1.0, 0.0, -1.0, 2.0], [0.5, 1.0, 0.0, -1.0]]), b2=torch.tensor([0.5, -0.5]),
                       rows_q=torch.arange(0.0, 4.0)[:, None], rows_k=torch.arange(4.0, 6.0)[:, None],
                       rows_v=torch.arange(6.0, 8.0)[:, None], emb=torch.arange(10.0, 15.0)[:, None],
                       ids=torch.tensor([4, 0, 3, 2]))
    job["scenarios"] = ["column_row", "qkv_merged", "vocab", "vocab:even", *(f"model:{f}" for f in MODEL_FAMILIES), "card"]
    return job, expected


def _vocab_job(r: Rand, vocab: int, hidden: int, world: int) -> dict:
    """A table of V rows and ids that include both edges of every shard of ceil(V / world) rows."""
    shard = -(-vocab // world)
    edges = [0, vocab - 1] + [min(k * shard + d, vocab - 1) for k in range(1, world) for d in (-1, 0)]
    ids = torch.cat([torch.tensor(edges), r.randint(0, vocab, (r.int(4, 9),))])
    return dict(weight=r.randn(vocab, hidden), bias=r.randn(vocab), hidden=r.randn(r.int(3, 7), hidden),
                ids=ids[torch.randperm(len(ids), generator=r.gen)])


def _job4(r: Rand, folder: Path) -> tuple[dict, dict]:
    """The small tp = 4 run: QKVParallelLinear with nKV = 4 (the control: one KV head per rank), 2 and 1 (each KV
    head on 2 / 4 ranks) and the card's nH = 4, nKV = 2 rows; a vocabulary that 4 does not divide; a Qwen3 model
    (tied) with nKV = 2, whose logits must equal TP=1."""
    job, expected = {}, {}
    hidden = r.choice([8, 12])
    cases = {}
    for kv in (4, 2, 1):
        heads, head_dim = 4 * r.int(1, 2), r.choice([2, 4])
        cases[f"kv{kv}"] = dict(hidden=hidden, head_dim=head_dim, heads=heads, kv_heads=kv, x=r.randn(r.int(3, 6), hidden),
                                w_q=r.randn(heads * head_dim, hidden), w_k=r.randn(kv * head_dim, hidden),
                                w_v=r.randn(kv * head_dim, hidden))
    cases["card"] = dict(hidden=1, head_dim=1, heads=4, kv_heads=2, x=torch.ones(1, 1), w_q=torch.arange(0.0, 4.0)[:, None],
                         w_k=torch.arange(4.0, 6.0)[:, None], w_v=torch.arange(6.0, 8.0)[:, None])
    # head counts 4 does not split: ValueError when the layer is built (full weights, should a wrong layer take them);
    # head_dim 4 keeps the layer's row count a multiple of 4, so only the head check itself can refuse
    for key, heads, kv in (("bad_heads", 4 * r.int(1, 2) + r.choice([1, 2, 3]), 4), ("bad_kv_ge", 8, r.choice([5, 6, 7])),
                           ("bad_kv_lt", 8, 3)):
        head_dim = 4
        cases[key] = dict(hidden=hidden, head_dim=head_dim, heads=heads, kv_heads=kv, x=r.randn(2, hidden),
                          w_q=r.randn(heads * head_dim, hidden), w_k=r.randn(kv * head_dim, hidden),
                          w_v=r.randn(kv * head_dim, hidden))
    job["qkv_replicated"] = dict(cases=cases)
    job["vocab"] = _vocab_job(r, 4 * r.int(3, 10) + r.choice([1, 2, 3]), hidden, TP4)
    config = Qwen3Config(vocab_size=4 * r.int(12, 24) + r.choice([1, 2, 3]), hidden_size=r.choice([32, 48]),
                         num_attention_heads=r.choice([4, 8]), num_key_value_heads=2, head_dim=r.choice([8, 16]),
                         intermediate_size=r.choice([48, 64]), num_hidden_layers=2, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=256, rms_norm_eps=1e-6,
                         attn_implementation="eager")
    job["model:qwen3_tp4"], expected["qwen3_tp4"] = _model_job("qwen3_tp4", config, r, folder / "qwen3_tp4")
    job["scenarios"] = ["qkv_replicated", "vocab", "model:qwen3_tp4"]
    return job, expected


def _tp_run(world: int = TP) -> dict:
    """The one run at `world` ranks of this grading session (started by the first check that needs it)."""
    run = _RUNS.setdefault(world, {})
    if not run:
        run["world"], run["rand"] = world, Rand()
        run["tmp"] = tmp = tempfile.TemporaryDirectory(prefix="course-m07-")
        run["results"] = None                           # a run cut short by a timeout is not repeated
        run["job"], run["expected"] = (_job if world == TP else _job4)(run["rand"], Path(tmp.name))
        run["results"] = tp_workers.launch(run["job"], world)
    if run.get("results") is None:
        raise AssertionError(f"{world} 进程的 TP 运行没有完成（上一个检查里超时或出错）")
    return run


def _scenario(name: str, partial: bool = False, world: int = TP) -> list[dict]:
    """Every rank's data for a scenario; its failure re-raised here (NotImplementedError stays 未实现)."""
    run = _tp_run(world)
    per_rank = [res.get(name) for res in run["results"]]
    errors = [(rank, res["error"]) for rank, res in enumerate(per_rank) if res is not None and res["error"]]
    for rank, err in errors:
        if err["not_implemented"]:
            raise NotImplementedError(err["message"])
    if errors:
        peer_lost = ("Timed out", "Connection closed", "Connection reset", "gloo/transport")   # a symptom, not the cause
        rank, err = next(((k, e) for k, e in errors if not any(s in e["message"] for s in peer_lost)), errors[0])
        msg = f"TP={world} 的 rank {rank} 运行出错：{err['type']}: {err['message']}"
        msg += f"\n  位置：{err['where']}" if err["where"] else ""
        mistake = _crash_hint(name, err, per_rank[rank]["data"], run)
        if mistake:
            msg += f"\n  看起来像易错点：{mistake}"
        if not partial:
            raise AssertionError(msg + f"；{run['rand']}")
    if any(res is None for res in per_rank):
        raise AssertionError(f"TP={world} 的场景 {name} 没有跑完：某个 rank 卡在 all_reduce / all_gather 里"
                             "（各 rank 调用集合通信的次数或顺序不一致？）")
    return [res["data"] for res in per_rank]


def _per_rank(tensor: torch.Tensor, dim: int = 0, world: int = TP) -> list[torch.Tensor]:
    return list(tensor.chunk(world, dim=dim))


# ------------------------------------------------------------------------------------------ TP=1 (in process)

_DIST_CALLS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "broadcast", "barrier",
               "gather", "reduce", "init_process_group", "new_group", "get_rank", "get_world_size")


@contextlib.contextmanager
def _no_dist(also_query: bool = False):
    """Make every torch.distributed call (and, with also_query, is_available / is_initialized) fail loudly."""
    names = _DIST_CALLS + (("is_available", "is_initialized") if also_query else ())
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def forbid(name):
        def call(*args, **kwargs):
            raise AssertionError(f"调用了 torch.distributed.{name}\n  看起来像易错点：{M_TOUCH_DIST}")
        return call

    for n in saved:
        setattr(dist, n, forbid(n))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


@point("tp_info 与 TP=1：各层等于 nn.Linear / nn.Embedding，不调用 torch.distributed")
def test_tp1_layers_match_torch():
    m = impl(MODULE)
    r = Rand()
    assert not dist.is_initialized()
    assert m.tp_info() == (0, 1), f"没有初始化 torch.distributed 时 tp_info() 应为 (0, 1)，得到 {m.tp_info()}"
    record_case("tp_info:no-process-group")
    h, n = r.choice([8, 12]), r.int(3, 9)
    x = r.randn(n, h)
    with _no_dist():
        w, b = r.randn(2 * h, h), r.randn(2 * h)
        col = m.ColumnParallelLinear(h, 2 * h, bias=True)
        assert col.weight.weight_loader(col.weight, w, ()) == w.numel(), "weight_loader 应返回写入的元素个数"
        col.bias.weight_loader(col.bias, b, ())
        assert_close(col(x), F.linear(x, w, b), what="TP=1 ColumnParallelLinear", rand=r)
        record_case("tp1:column")
        row = m.RowParallelLinear(2 * h, h, bias=True)
        row.weight.weight_loader(row.weight, w.T.contiguous(), ())
        row.bias.weight_loader(row.bias, b[:h], ())
        x2 = r.randn(n, 2 * h)
        assert_close(row(x2), F.linear(x2, w.T, b[:h]), what="TP=1 RowParallelLinear", rand=r)
        record_case("tp1:row")
        wq, wk, wv = r.randn(4 * 2, h), r.randn(2 * 2, h), r.randn(2 * 2, h)
        qkv = m.QKVParallelLinear(h, 2, 4, 2)
        count = sum(qkv.weight.weight_loader(qkv.weight, t, (p,)) for t, p in ((wq, "q"), (wk, "k"), (wv, "v")))
        assert count == qkv.weight.numel(), f"QKV 的三次 weight_loader 应共写入 {qkv.weight.numel()} 个值，得到 {count}"
        assert_close(qkv(x), F.linear(x, torch.cat([wq, wk, wv])), what="TP=1 QKVParallelLinear", rand=r)
        record_case("tp1:qkv")
        merged = m.MergedColumnParallelLinear(h, [h, h])
        merged.weight.weight_loader(merged.weight, w[:h], (0,))
        merged.weight.weight_loader(merged.weight, w[h:], (1,))
        assert_close(merged(x), F.linear(x, w), what="TP=1 MergedColumnParallelLinear", rand=r)
        record_case("tp1:merged")
        vocab = r.int(9, 30)
        table, ids = r.randn(vocab, h), r.randint(0, vocab, (n,))
        emb = m.VocabParallelEmbedding(vocab, h)
        emb.weight.weight_loader(emb.weight, table, ())
        assert_close(emb(ids), F.embedding(ids, table), what="TP=1 VocabParallelEmbedding", rand=r)
        record_case("tp1:vocab-embedding")
        head = m.ParallelLMHead(vocab, h)
        head.weight.weight_loader(head.weight, table, ())
        assert_close(head(x), F.linear(x, table), what="TP=1 ParallelLMHead", rand=r)
        record_case("tp1:lm-head")


@point("world_size 1：tensor_parallel 原样返回同一个模型，不碰 torch.distributed")
def test_world_size_one_is_untouched():
    m = impl(MODULE)
    r = Rand()
    m06 = impl("m06_models")
    model = m06.build_model(_configs(r)["qwen3_moe"])
    modules = {name: id(mod) for name, mod in model.named_modules()}
    params = {name: id(p) for name, p in model.named_parameters()}
    with _no_dist(also_query=True):
        out = m.tensor_parallel(model, 0, 1)
    assert out is model, "tensor_parallel(model, 0, 1) 应返回传入的同一个模型对象"
    with _no_dist():
        out = m.tensor_parallel(model)               # world_size from tp_info(): (0, 1) without a process group
    assert out is model, "没有初始化 torch.distributed 时 tensor_parallel(model) 应返回同一个模型对象"
    after = {name: id(mod) for name, mod in model.named_modules()}
    assert after == modules, "world_size 1 时不应替换任何子模块（TP=1 的引擎直接用 m06 的 nn.Linear / nn.Embedding）"
    assert {name: id(p) for name, p in model.named_parameters()} == params, "world_size 1 时参数应保持原样"
    record_case("tp1:explicit-world-size-1")
    record_case("tp1:from-tp_info")
    fresh = m06.build_model(_configs(r)["qwen3"])
    world = r.choice([2, 4])
    try:
        m.tensor_parallel(fresh, r.int(0, world - 1), world)
    except ValueError:
        record_case("tp:explicit-rank-world-mismatch")
    else:
        raise AssertionError(f"没有初始化 torch.distributed 时 tensor_parallel(model, rank, world_size={world}) 应报 ValueError"
                             f"\n  看起来像易错点：{M_EXPLICIT}")


# ------------------------------------------------------------------------------------------ TP=2 (2 processes)

@point("TP=2：ColumnParallelLinear 拼接、RowParallelLinear all-reduce（bias 只加一次）等于单进程 nn.Linear")
def test_column_and_row():
    impl(MODULE)
    data = _scenario("column_row")
    r, j = _RUNS[TP]["rand"], _RUNS[TP]["job"]["column_row"]
    w_cols, b_cols = _per_rank(j["w_col"]), _per_rank(j["b_col"])
    for rank, d in enumerate(data):
        assert d["col_shape"] == tuple(w_cols[rank].shape), \
            f"rank {rank} 的 ColumnParallelLinear.weight 形状应为 {list(w_cols[rank].shape)}（[out/tp, in]），得到 {list(d['col_shape'])}"
        assert d["col_count"] == w_cols[rank].numel() + b_cols[rank].numel(), "weight_loader 应返回本 rank 写入的元素个数"
        assert_close(d["col_y"], F.linear(j["x"], w_cols[rank], b_cols[rank]),
                     what=f"rank {rank} 的 ColumnParallelLinear 输出（全量输出的第 {rank} 段列）", rand=r)
    assert_close(torch.cat([d["col_y"] for d in data], -1), F.linear(j["x"], j["w_col"], j["b_col"]),
                 what="两个 rank 的 ColumnParallelLinear 输出拼起来", rand=r)
    full = F.linear(j["x_row"], j["w_row"], j["b_row"])
    partial = [F.linear(x, w) for x, w in zip(_per_rank(j["x_row"], -1), _per_rank(j["w_row"], 1))]
    for rank, d in enumerate(data):
        assert d["row_shape"] == (j["w_row"].shape[0], j["w_row"].shape[1] // TP), \
            f"rank {rank} 的 RowParallelLinear.weight 形状应为 [out, in/tp]，得到 {list(d['row_shape'])}"
        assert_close(d["row_y"], full, what=f"rank {rank} 的 RowParallelLinear 输出", rand=r,
                     looks_like=[(partial[rank] + j["b_row"], M_NO_ALL_REDUCE),
                                 (partial[rank], M_NO_ALL_REDUCE),
                                 (full + (TP - 1) * j["b_row"], M_BIAS_TWICE)])
    record_case("tp2:column-concat")
    record_case("tp2:row-all-reduce-bias-once")


@point("TP=2：QKVParallelLinear（GQA nKV=2、gated q）与 MergedColumnParallelLinear 的分片落在正确的行")
def test_qkv_and_merged():
    impl(MODULE)
    data = _scenario("qkv_merged")
    r, j = _RUNS[TP]["rand"], _RUNS[TP]["job"]["qkv_merged"]
    x = j["x"]
    for key in ("gqa", "gated"):
        c = j[key]
        what = "QKVParallelLinear（GQA）" if key == "gqa" else "QKVParallelLinear（gated：q_head_size_factor=2）"
        parts = [_per_rank(c[f"w_{p}"]) for p in "qkv"]        # heads are contiguous row blocks of each part
        halves = _per_rank(torch.cat([c["w_q"], c["w_k"], c["w_v"]]))
        for rank, d in enumerate(data):
            assert d[f"{key}_heads"] == (c["heads"] // TP, c["kv_heads"] // TP), \
                f"rank {rank} 的 {what} 应有 {c['heads'] // TP} 个 q head、{c['kv_heads'] // TP} 个 kv head，得到 {d[f'{key}_heads']}"
            local = torch.cat([p[rank] for p in parts])
            assert d[f"{key}_count"] == local.numel(), \
                f"{what} 的 q/k/v 三次 weight_loader 应共写入 {local.numel()} 个值，得到 {d[f'{key}_count']}"
            assert_close(d[f"{key}_y"], F.linear(x, local), rand=r,
                         what=f"rank {rank} 的 {what} 输出（本 rank 的 [q | k | v] head）",
                         looks_like=[(F.linear(x, halves[rank]), M_QKV_HALVES)])
        record_case(f"tp2:qkv-{key}")
    gate, up = _per_rank(j["w_gate"]), _per_rank(j["w_up"])
    one = _per_rank(torch.cat([j["w_gate"], j["w_up"]]))
    for rank, d in enumerate(data):
        local = torch.cat([gate[rank], up[rank]])
        assert d["merged_count"] == local.numel(), f"gate/up 两次 weight_loader 应共写入 {local.numel()} 个值"
        assert_close(d["merged_y"], F.linear(x, local), what=f"rank {rank} 的 MergedColumnParallelLinear 输出（[gate 段 | up 段]）",
                     rand=r, looks_like=[(F.linear(x, one[rank]), M_MERGED_ONE)])
    record_case("tp2:merged-gate-up")


@point("TP=2：VocabParallelEmbedding 屏蔽分片外的 id，ParallelLMHead 拼回完整 logits")
def test_vocab_embedding_and_lm_head():
    impl(MODULE)
    _check_vocab(TP)
    record_case("vocab:V-not-a-multiple-of-tp")
    record_case("vocab:ids-on-shard-edges")
    _check_vocab(TP, "vocab:even")
    record_case("vocab:V-a-multiple-of-tp")


def _lm_head_hint(width: int, vocab: int, world: int) -> str:
    """The 易错点 a wrong logits width singles out, as a message tail ("" when it names none)."""
    shard = -(-vocab // world)
    wrong = {vocab // world * world: M_VOCAB_FLOOR, shard: M_LM_HEAD_LOCAL, shard * world: M_LM_HEAD_PAD}
    if vocab % world == 0:                          # no padding: the widths above are V itself, but [:, :-0] is empty
        wrong = {0: M_LM_HEAD_NEG}
    mistake = wrong.get(width) if width != vocab else None
    return f"\n  看起来像易错点：{mistake}" if mistake else ""


def _check_vocab(world: int, name: str = "vocab") -> None:
    """A vocab scenario of the run at `world` ranks (V does not divide by world unless the name says even), ids on
    every shard's edges."""
    data = _scenario(name, world=world)
    run = _RUNS[world]
    r, j = run["rand"], run["job"][name]
    table, ids = j["weight"], j["ids"]
    vocab, shard = table.shape[0], -(-table.shape[0] // world)
    padded = torch.cat([table, table.new_zeros(shard * world - vocab, table.shape[1])])
    unmasked = sum(F.embedding(torch.where((ids >= k * shard) & (ids < (k + 1) * shard), ids - k * shard, 0),
                               padded[k * shard:(k + 1) * shard]) for k in range(world))
    floor = F.embedding(ids, table).masked_fill((ids >= vocab // world * world)[:, None], 0)
    logits = F.linear(j["hidden"], table, j["bias"])
    for rank, d in enumerate(data):
        assert d["emb_count"] == d["emb_numel"] == shard * table.shape[1], (
            f"TP={world} rank {rank}：VocabParallelEmbedding.weight 应为 [ceil(V/tp) = {shard}, H]（V={vocab}），"
            f"weight_loader 返回写入的元素个数（含补零行）；得到 {d['emb_numel']} 个元素、返回 {d['emb_count']}"
            + (f"\n  看起来像易错点：{M_VOCAB_FLOOR}" if d["emb_numel"] == vocab // world * table.shape[1] else ""))
        assert_close(d["emb_y"], F.embedding(ids, table), rand=r,
                     what=f"TP={world} rank {rank} 的 VocabParallelEmbedding 输出（V={vocab}，ids 落在每个分片的两端）",
                     looks_like=[(unmasked, M_VOCAB_MASK), (floor, M_VOCAB_FLOOR)])
        got = d["head_y"]
        if got.shape != logits.shape:
            raise AssertionError(f"TP={world} rank {rank} 的 ParallelLMHead 输出形状是 {list(got.shape)}，应为 "
                                 f"{list(logits.shape)}（V={vocab}，每片 ceil(V/tp) = {shard} 列）"
                                 f"{_lm_head_hint(got.shape[-1], vocab, world)}；{r}")
        assert_close(got, logits, what=f"TP={world} rank {rank} 的 ParallelLMHead 输出（完整 [N, V]，V={vocab}）", rand=r)
        assert d["head_count"] == d["head_numel"], "ParallelLMHead 的 weight_loader 应返回写入的元素个数"


def _heads(config, world: int = TP) -> tuple[int, int, int, int]:
    nh, nkv, d = config.num_attention_heads // world, max(1, config.num_key_value_heads // world), config.head_dim
    return nh, nkv, nh * d, nkv * d


def _check_heads(where: str, d: dict, config, world: int) -> None:
    """Every attention layer's (num_heads, num_kv_heads, q_size, kv_size) and its backend's head counts."""
    want, full = _heads(config, world), _heads(config, 1)
    for i, got in enumerate(d["heads"]):
        got = tuple(got)
        hint = M_MODULE_HEADS if got == full else M_KV_ZERO if got[1] == 0 < got[0] else None
        assert got == want, (f"{where} 第 {i} 层 self_attn 的 (num_heads, num_kv_heads, q_size, kv_size) 应为 {want}，"
                             f"得到 {got}" + (f"\n  看起来像易错点：{hint}" if hint else ""))
    for i, got in enumerate(d["backend_heads"]):
        got = tuple(got)
        hint = f"\n  看起来像易错点：{M_BACKEND_HEADS}" if got == full[:2] else ""
        assert got == want[:2], f"{where} 第 {i} 层 self_attn.attn 的 (num_heads, num_kv_heads) 应为 {want[:2]}，得到 {got}{hint}"


@point("TP=2：tensor_parallel 之后 head 数（含 attention backend）除以 tp、experts 沿中间维切分、router 保持完整")
def test_structure_after_rewrite():
    impl(MODULE)
    r = _tp_run()["rand"]
    for family in ("qwen3_moe", "qwen3_5_moe_text"):
        data = _scenario(f"model:{family}", partial=True)
        exp = _RUNS[TP]["expected"][family]
        config, state = exp["config"], exp["state"]
        for rank, d in enumerate(data):
            if "heads" not in d:
                _scenario(f"model:{family}")                  # raises the rank's error
            assert d["returned_same"], "tensor_parallel 应原地改写并返回同一个模型对象"
            _check_heads(f"{family} rank {rank}", d, config, TP)
            e, inter, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
            want = ((e, 2 * inter // TP, hidden), (e, hidden, inter // TP), (e, hidden))
            got = tuple(map(tuple, d["expert_shapes"]))
            if got != want:
                hint = ("router gate.weight [E, H] 每个 rank 都完整保留" if got[2] != want[2] else
                        "experts 没有切分：gate_up_proj / down_proj 还是完整的（没有换成 ParallelExperts？）"
                        if got[:2] == ((e, 2 * inter, hidden), (e, hidden, inter)) else M_EXPERTS_DIM)
                raise AssertionError(f"{family}：(experts.gate_up_proj, experts.down_proj, gate.weight) 的形状应为 "
                                     f"{want}，得到 {got}\n  看起来像易错点：{hint}")
            if "expert_local" not in d:
                _scenario(f"model:{family}")
            layer = _RUNS[TP]["job"][f"model:{family}"]["moe_layer"]
            gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"][0]
            down = state[f"model.layers.{layer}.mlp.experts.down_proj"][0]
            gate, up = _per_rank(gate_up[:inter]), _per_rank(gate_up[inter:])
            assert_close(d["expert_local"][0], torch.cat([gate[rank], up[rank]]), rand=r,
                         what=f"{family} rank {rank} 加载后的 experts.gate_up_proj[0]（[gate 段 | up 段]）",
                         looks_like=[(_per_rank(gate_up)[rank], M_MERGED_ONE)])
            assert_close(d["expert_local"][1], _per_rank(down, 1)[rank], rand=r,
                         what=f"{family} rank {rank} 加载后的 experts.down_proj[0]（[H, I/tp]）")
        record_case(f"structure:{family}")


def _check_model(family: str, world: int = TP) -> None:
    impl(MODULE)
    data = _scenario(f"model:{family}", world=world)
    run = _RUNS[world]
    exp, r = run["expected"][family], run["rand"]
    lengths = run["job"][f"model:{family}"]["lengths"]
    vocab = exp["config"].vocab_size
    for rank, d in enumerate(data):
        assert d["numel"] < (1 / world + 0.2) * exp["numel"], (
            f"{family} rank {rank}：tensor_parallel 之后本 rank 有 {d['numel']} 个参数，TP=1 是 {exp['numel']}："
            f"TP={world} 时每个 rank 应只持有约 1/{world}（只有 norm、router 和复制的 KV head 是完整的），看起来没有切分")
        if "probe" in exp:
            probe = d["moe_probe"]
            partials = sum(x["moe_probe"] for x in data)
            assert_close(probe, exp["probe"], what=f"{family} rank {rank} 的 MoE block 输出", rand=r,
                         looks_like=[(exp["probe"] - partials + probe, M_MOE_REDUCE)])
        width = d["logits"].shape[-1]
        assert width == vocab, (f"{family} rank {rank} 的 TP={world} logits 有 {width} 列，应为 V = {vocab}"
                                f"{_lm_head_hint(width, vocab, world)}；{r}")
        tol = 1e-4 if family.startswith("qwen3_5") else 1e-5   # the chunked delta rule adds fp32 rounding noise
        assert_close(d["logits"], exp["logits"], rand=r, atol=tol, rtol=tol,
                     what=f"{family} rank {rank} 的 TP={world} logits（与 TP=1 比，{len(lengths)} 条 packed 序列 {lengths}）")


@point("TP=2：Qwen3（tied embeddings）整模型 logits 等于 TP=1")
def test_qwen3_model():
    _check_model("qwen3")
    data = _scenario("model:qwen3")
    assert all(d["tied"] for d in data), f"{M_TIED}（tie_word_embeddings=True 时两者应是同一个 Parameter）"
    record_case("model:qwen3-tied")


@point("TP=2：Qwen3-MoE（dense + MoE 层）与 Qwen3.5-MoE（gated attention + shared expert）整模型 logits 等于 TP=1")
def test_moe_models():
    _check_model("qwen3_moe")
    record_case("model:qwen3_moe")
    _check_model("qwen3_5_moe_text")
    record_case("model:qwen3_5_moe_text-moe")


@point("TP=2：Qwen3.5 dense 混合模型与 Qwen3.5-MoE 混合模型（Gated DeltaNet + gated attention）整模型 logits 等于 TP=1")
def test_hybrid_models():
    _check_model("qwen3_5_text")
    record_case("model:qwen3_5_text-hybrid")
    _check_model("qwen3_5_moe_text")
    record_case("model:qwen3_5_moe_text-hybrid")


def _strided(t: torch.Tensor, heads: int, rank: int) -> torch.Tensor:
    """Value heads rank, rank + tp, ... of t [heads * rows_per_head, ...]: the round-robin split (wrong)."""
    return t.reshape(heads, -1, *t.shape[1:])[rank::TP].reshape(-1, *t.shape[1:])


def _gdn_expected(full: dict, dims: tuple, rank: int) -> dict[str, tuple[torch.Tensor, list]]:
    """The rank's slice of every GatedDeltaNet parameter, with the classic wrong slices beside it."""
    nk, nv, key_dim, value_dim, _ = dims
    parts = [key_dim, key_dim, value_dim]
    per_part = {n: torch.cat([p.chunk(TP)[rank] for p in full[n].split(parts)]) for n in ("in_proj_qkv.weight", "conv1d.weight")}
    out = {"in_proj_qkv.weight": (per_part["in_proj_qkv.weight"], [(full["in_proj_qkv.weight"].chunk(TP)[rank], M_GDN_QKV)]),
           "conv1d.weight": (per_part["conv1d.weight"], [(full["conv1d.weight"].chunk(TP)[rank], M_GDN_CONV)]),
           "norm.weight": (full["norm.weight"], []),
           "out_proj.weight": (full["out_proj.weight"].chunk(TP, dim=1)[rank], [])}
    for n in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        out[n] = (full[n].chunk(TP)[rank], [(_strided(full[n], nv, rank), M_GDN_VHEADS)])
    return out


@point("TP=2：Gated DeltaNet 按 head 切——in_proj_qkv 与 conv1d 按 q、k、v 各自切，z/b/a/A_log/dt_bias 跟着 value head，norm 不切，out_proj 按行切；状态池只存本 rank 的 head")
def test_gdn_sharding():
    impl(MODULE)
    r = _tp_run()["rand"]
    for family in ("qwen3_5_text", "qwen3_5_moe_text"):
        data = _scenario(f"model:{family}", partial=True)
        exp, j = _RUNS[TP]["expected"][family], _RUNS[TP]["job"][f"model:{family}"]
        nk, nv, key_dim, value_dim, conv_dim = exp["gdn_dims"]
        full = exp["gdn_full"]
        dk, dv, width = key_dim // nk, value_dim // nv, full["conv1d.weight"].shape[-1]
        want_dims = (nk // TP, nv // TP, key_dim // TP, value_dim // TP, conv_dim // TP)
        for rank, d in enumerate(data):
            if "gdn_dims" not in d:
                _scenario(f"model:{family}")                  # raises the rank's error
            where = f"{family} rank {rank} 第 {j['gdn_layer']} 层 linear_attn"
            assert tuple(d["gdn_dims"]) == want_dims, (
                f"{where} 的 (num_k_heads, num_v_heads, key_dim, value_dim, conv_dim) 应为 {want_dims}，得到 "
                f"{tuple(d['gdn_dims'])}\n  看起来像易错点：{M_GDN_HEADS}")
            shapes = d["gdn_shapes"]
            checks = [("A_log", (nv // TP,), {(nv,): M_GDN_GATES}), ("dt_bias", (nv // TP,), {(nv,): M_GDN_GATES}),
                      ("norm.weight", (dv,), {(dv // TP,): M_GDN_NORM}),
                      ("out_proj.weight", (full["out_proj.weight"].shape[0], value_dim // TP),
                       {(full["out_proj.weight"].shape[0], value_dim): M_GDN_OUT,
                        (full["out_proj.weight"].shape[0] // TP, value_dim): M_GDN_OUT}),
                      ("conv1d.weight", (conv_dim // TP, 1, width), {})]
            for name, want, wrong in checks:
                got = tuple(shapes.get(name, ()))
                if got != want:
                    hint = f"\n  看起来像易错点：{wrong[got]}" if got in wrong else ""
                    raise AssertionError(f"{where}.{name} 的形状应为 {list(want)}，得到 {list(got)}{hint}")
            want_pool = ((len(j["gdn_lengths"]), conv_dim // TP, width - 1), (len(j["gdn_lengths"]), nv // TP, dk, dv))
            assert tuple(map(tuple, d["pool_shapes"])) == want_pool, (
                f"{where}：e04 GDNStatePool 的 (conv, ssm) 形状应为 {want_pool}（本 rank 的 head），得到 {d['pool_shapes']}"
                f"\n  看起来像易错点：{M_GDN_HEADS}")
            if "gdn_local" not in d:
                _scenario(f"model:{family}")
            for name, (want, looks_like) in _gdn_expected(full, exp["gdn_dims"], rank).items():
                assert_close(d["gdn_local"][name], want, rand=r, atol=0, rtol=0,
                             what=f"{where}.{name} 加载后的本地分片", looks_like=looks_like)
            if "gdn_steps" not in d:
                _scenario(f"model:{family}")
            for step, got, want in zip(("prefill", "带状态 decode 一步"), d["gdn_steps"], exp["gdn_steps"]):
                assert_close(got, want, rand=r, atol=1e-4, rtol=1e-4,
                             what=f"{where} 在 GDNStatePool 状态上的 {step} 输出（与 TP=1 比）")
        record_case(f"gdn:{family}")


@point("TP=2：nKV=1 < tp 时每个 rank 复制那一个 KV head，整模型 logits 等于 TP=1")
def test_replicated_kv_heads():
    impl(MODULE)
    _check_model("qwen3_kv1")
    exp = _RUNS[TP]["expected"]["qwen3_kv1"]
    config = exp["config"]
    q_rows = config.num_attention_heads * config.head_dim
    q, kv = exp["qkv"][:q_rows], exp["qkv"][q_rows:]
    for rank, d in enumerate(_scenario("model:qwen3_kv1")):
        _check_heads(f"nKV=1 的 Qwen3 rank {rank}", d, config, TP)
        assert_close(d["qkv_local"], torch.cat([q.chunk(TP)[rank], kv]), atol=0, rtol=0, rand=_RUNS[TP]["rand"],
                     what=f"rank {rank} 第 0 层 qkv_proj 的本地行（[我的 q head | 那一个 k head | 那一个 v head]）")
    record_case("tp2:nkv1-replicated")


def _qkv_case_error(key: str, c: dict, err: dict, control_ok: bool) -> str:
    """The failure message of a QKVParallelLinear case that crashed on some rank, with the mistake the evidence
    singles out: replication (nKV < tp) failing while the control (nKV = tp) went through the same stage."""
    hint = None
    if c["kv_heads"] < TP4 and control_ok:
        if err["stage"] == "init" and err["type"] == "ValueError":
            hint = M_KV_REFUSED
        elif err["stage"] == "load" and "QKVParallelLinear" in err["where"]:
            hint = M_KV_REPLICA
    return (f"TP=4、nH={c['heads']}、nKV={c['kv_heads']} 的 QKVParallelLinear 出错（{err['stage']}）："
            f"{err['type']}: {err['message']}" + (f"\n  位置：{err['where']}" if err["where"] else "")
            + (f"\n  看起来像易错点：{hint}" if hint else ""))


@point("TP=4：nKV=4、2、1 时 KV head 各 rank 一个、每个复制 2 份、复制 4 份；V 不能被 4 整除的词表与 LM head；nKV=2 的 Qwen3 整模型 logits 等于 TP=1")
def test_tp4_replication_and_vocab():
    impl(MODULE)
    data = _scenario("qkv_replicated", world=TP4)
    run = _RUNS[TP4]
    r, cases = run["rand"], run["job"]["qkv_replicated"]["cases"]
    control_ok = not any(d.get("kv4_error") for d in data)
    for key in ("kv4", "kv2", "kv1", "card"):                    # the control first
        c = cases[key]
        kv = c["kv_heads"]
        blocks = min(kv, TP4)                                    # KV blocks over the ranks; rank r has r·blocks//tp
        for rank, d in enumerate(data):
            if d.get(f"{key}_error"):
                raise AssertionError(_qkv_case_error(key, c, d[f"{key}_error"], control_ok) + f"；{r}")
            want = (c["heads"] // TP4, max(1, kv // TP4))
            got = tuple(d[f"{key}_heads"])
            assert got == want, (f"TP=4 rank {rank}：nH={c['heads']}、nKV={kv} 的 QKVParallelLinear (num_heads, num_kv_heads) "
                                 f"应为 {want}，得到 {got}" + (f"\n  看起来像易错点：{M_KV_ZERO}" if got[1] == 0 else ""))
            k_block = rank * blocks // TP4
            local = torch.cat([c["w_q"].chunk(TP4)[rank], c["w_k"].chunk(blocks)[k_block], c["w_v"].chunk(blocks)[k_block]])
            modulo = torch.cat([c["w_q"].chunk(TP4)[rank], c["w_k"].chunk(blocks)[rank % kv], c["w_v"].chunk(blocks)[rank % kv]])
            what = (f"卡片例子（nH=4、nKV=2、D=1，行号 q 0..3 | k 4 5 | v 6 7）TP=4 rank {rank} 的 qkv_proj 局部行" if key == "card"
                    else f"TP=4 rank {rank} 的 QKVParallelLinear（nH={c['heads']}、nKV={kv}）本地行 [q 的第 {rank} 段 | 第 {k_block} 个 KV 块的 k | v]")
            assert_close(d[f"{key}_rows"], local, atol=0, rtol=0, rand=r, what=what,
                         looks_like=[(modulo, M_KV_REPLICA)] if kv < TP4 else [])
            assert d[f"{key}_count"] == local.numel(), \
                f"TP=4 rank {rank}：nKV={kv} 的 q/k/v 三次 weight_loader 应共写入 {local.numel()} 个值，得到 {d[f'{key}_count']}"
            assert_close(d[f"{key}_y"], F.linear(c["x"], local), rand=r, what=f"{what}：输出")
        record_case(f"tp4:qkv-{key}")
    for key, what in (("bad_heads", "nH 不能被 tp 整除"), ("bad_kv_ge", "nKV ≥ tp 却不能被 tp 整除"),
                      ("bad_kv_lt", "nKV < tp 而 tp 不是 nKV 的倍数")):
        c = cases[key]
        for rank, d in enumerate(data):
            err = d.get(f"{key}_error")
            assert err and err["type"] == "ValueError" and err["stage"] == "init", (
                f"TP=4、nH={c['heads']}、nKV={c['kv_heads']}（{what}）：QKVParallelLinear 构造时应报 ValueError，"
                + (f"rank {rank} 得到 {err['type']}（{err['stage']}）: {err['message']}" if err else
                   f"rank {rank} 却收下了（num_heads, num_kv_heads = {d.get(f'{key}_heads')}）")
                + (f"\n  看起来像易错点：{M_NOT_DIVISIBLE}" if not err or err["stage"] != "init" else ""))
        record_case(f"qkv:value-error-{key.removeprefix('bad_')}")
    _check_vocab(TP4)
    record_case("tp4:vocab-V-not-a-multiple-of-4")
    _check_model("qwen3_tp4", TP4)
    exp = run["expected"]["qwen3_tp4"]
    for rank, d in enumerate(_scenario("model:qwen3_tp4", world=TP4)):
        _check_heads(f"TP=4 nKV=2 的 Qwen3 rank {rank}", d, exp["config"], TP4)
        assert d["tied"], f"TP=4 rank {rank}：{M_TIED}（tie_word_embeddings=True 时两者应是同一个 Parameter）"
    record_case("tp4:qwen3-nkv2-logits")


@point("卡片例子：4×2 权重的 Column→Row 部分和与 all-reduce、QKV 的行号、V=5 的词表分片、GDN 与复制 KV head 的行号")
def test_card_example():
    impl(MODULE)
    data = _scenario("card")
    h = [torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, 2.0]])]
    wrong_rows = [torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0, 7.0])]
    for rank, d in enumerate(data):
        assert_close(d["h"], h[rank], what=f"卡片例子 rank {rank} 的 Column 输出 h_{rank}", atol=1e-6, rtol=0)
        assert_close(d["y"], torch.tensor([[5.5, -4.0]]), what=f"卡片例子 rank {rank} 的 Row 输出", atol=1e-6, rtol=0,
                     looks_like=[(torch.tensor([[-0.5, -2.0]]) if rank == 0 else torch.tensor([[6.5, -2.5]]), M_NO_ALL_REDUCE),
                                 (torch.tensor([[6.0, -4.5]]), M_BIAS_TWICE)])
        assert_close(d["qkv_rows"], torch.tensor([[0.0, 1.0, 4.0, 6.0], [2.0, 3.0, 5.0, 7.0]])[rank],
                     what=f"卡片例子 rank {rank} 的 qkv_proj 局部行（全量行号）", atol=0, rtol=0,
                     looks_like=[(wrong_rows[rank], M_QKV_HALVES)])
        assert_close(d["emb_y"], torch.tensor([[14.0], [10.0], [13.0], [12.0]]), what="卡片例子 V=5 的 embedding 查表",
                     atol=1e-6, rtol=0, looks_like=[(torch.tensor([[24.0], [23.0], [23.0], [25.0]]), M_VOCAB_MASK)])
        gdn = torch.tensor([[0.0, 2.0, 4.0, 5.0], [1.0, 3.0, 6.0, 7.0]])[rank]
        halves = torch.arange(8.0).chunk(TP)[rank]
        for got, name, mistake in zip(d["gdn_rows"], ("in_proj_qkv", "conv1d"), (M_GDN_QKV, M_GDN_CONV)):
            assert_close(got, gdn, what=f"卡片例子 rank {rank} 的 {name} 局部行（nk=2, nv=4，全量行号）", atol=0, rtol=0,
                         looks_like=[(halves, mistake)])
        assert_close(d["kv1_rows"], torch.tensor([[0.0, 2.0, 3.0], [1.0, 2.0, 3.0]])[rank], atol=0, rtol=0,
                     what=f"卡片例子 rank {rank} 的 qkv_proj 局部行（nH=2, nKV=1：两个 rank 都存 kv head 0）")
    record_case("card:tp2")
