"""The GPU engine's memory plan: where every byte of the card goes, decided before the KV cache is allocated.

g01's engine calls this module (given machinery: learners do not write it). The order is vLLM's
(vllm/v1/worker/gpu_worker.py: determine_available_memory, a profile run at max_num_batched_tokens):

    1. precheck    before a weight is allocated: the model's bytes are counted on the meta device (FP8 ones as FP8),
                   with the GDN state rows, the snapshots, one max_model_len sequence of K/V and an activation
                   floor. What cannot fit is refused here, with the numbers and the setting to change.
    2. profile     after loading: the activation peak of a prefill of max_num_batched_tokens tokens and of the
                   sampler on max_num_seqs rows is *measured* (torch.cuda.max_memory_allocated), and so is the
                   decode forward at max_num_seqs rows (what the CUDA-graph pool will hold).
    3. KV cache    whatever utilization x budget leaves after 1 and 2; fewer blocks than one max_model_len
                   sequence needs is a refusal, before the cache is allocated.

The budget is the card, or --gpu-memory-gib N (torch.cuda.set_per_process_memory_fraction: a smaller card emulated).
A model that does not fit is refused; max_num_seqs is never lowered behind the user's back (a silently smaller
batch is a different benchmark): the message says which max_num_seqs would fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

GIB = 2 ** 30
MIB = 2 ** 20
ENV_CAP = "COURSE_GPU_MEMORY_GIB"      # --gpu-memory-gib on run / serve / bench / gpu sets it for child processes too
SLACK = 256 * MIB                      # allocator rounding and fragmentation kept out of the KV cache


class MemoryPlanError(RuntimeError):
    """The model and settings do not fit the memory budget: raised before the weights or the KV cache are allocated."""


def budget_bytes(device: torch.device, cap_gib: float | None = None) -> tuple[int, int]:
    """(budget, card): what this engine may use and the card's total. With a cap (argument, else $COURSE_GPU_MEMORY_GIB)
    the process's allocator is limited to it, minus what lies outside the allocator now (CUDA context, other processes),
    so that everything the card holds for this process stays within the cap."""
    if device.index is None:                   # set_per_process_memory_fraction needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    free, card = torch.cuda.mem_get_info(device)
    if cap_gib is None and os.environ.get(ENV_CAP):
        cap_gib = float(os.environ[ENV_CAP])
    if cap_gib is None:
        return card, card
    if not cap_gib > 0:
        raise ValueError(f"gpu_memory_gib must be > 0, got {cap_gib!r}")
    cap = min(int(cap_gib * GIB), card)
    outside = (card - free) - torch.cuda.memory_reserved(device)
    if cap <= outside:     # a fraction of 0 would make the first allocation an OOM traceback: refuse with the numbers
        raise MemoryPlanError(f"显存放不下（加载权重之前）：--gpu-memory-gib {cap_gib:g} 即 {cap / GIB:.2f} GiB，"
                              f"而 allocator 之外（CUDA context、其他进程）已占 {outside / GIB:.2f} GiB，引擎一个字节也分不到。"
                              f"可以改的设置：更大的 --gpu-memory-gib。")
    torch.cuda.set_per_process_memory_fraction((cap - outside) / card, device)
    return cap, card


def used_outside_allocator(device: torch.device) -> int:
    """Bytes of the card held by neither this process's torch allocator nor free: CUDA context, cuBLAS, other processes."""
    free, card = torch.cuda.mem_get_info(device)
    return max((card - free) - torch.cuda.memory_reserved(device), 0)


def free_within(budget: int, device: torch.device) -> int:
    """Free bytes as the budget sees them: the budget minus everything the card holds now (a cap hides the rest)."""
    free, card = torch.cuda.mem_get_info(device)
    return budget - (card - free)


def weight_bytes(model: torch.nn.Module) -> dict[str, tuple[int, str]]:
    """Parameter bytes by kind (embeddings, experts, dense) with their dtypes; works on the meta device. A tied
    lm_head is counted once."""
    kinds: dict[str, list] = {}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        kind = ("embeddings" if "embed_tokens" in name or name.startswith("lm_head") else
                "experts" if ".experts." in name else "dense")
        entry = kinds.setdefault(kind, [0, set()])
        entry[0] += p.numel() * p.element_size()
        entry[1].add(str(p.dtype).removeprefix("torch."))
    return {k: (v[0], "+".join(sorted(v[1]))) for k, v in sorted(kinds.items())}


def gdn_row_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """One row of e04's GDNStatePool (and of e07's snapshot store): every linear layer's conv state in the model
    dtype and its recurrent state in fp32."""
    total = 0
    for i in getattr(model, "linear_layer_ids", []):
        gdn = model.model.layers[i].linear_attn
        width = gdn.conv1d.weight.shape[-1]
        total += gdn.conv_dim * (width - 1) * dtype.itemsize
        total += gdn.num_v_heads * gdn.head_k_dim * gdn.head_v_dim * 4
    return total


def kv_block_bytes(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block in every full-attention layer."""
    total = 0
    for layer in model.model.layers:
        if not layer.is_linear:
            attn = layer.self_attn
            attn = getattr(attn, "inner", attn)
            total += 2 * block_size * attn.attn.num_kv_heads * attn.attn.head_dim * dtype.itemsize
    return total


def activation_floor(config, max_tokens: int, max_num_seqs: int) -> int:
    """A lower bound on the activation peak before it can be measured (precheck only): a few [tokens, width] fp32
    tensors of the largest prefill step and the logits of max_num_seqs rows."""
    inter = max(getattr(config, "intermediate_size", 0) or 0,
                (getattr(config, "moe_intermediate_size", 0) or 0) * (getattr(config, "num_experts_per_tok", 1) or 1))
    return max_tokens * (4 * config.hidden_size + 2 * inter) * 4 + 2 * max_num_seqs * config.vocab_size * 4


@dataclass
class MemoryPlan:
    """Every allocation the GPU engine makes, in bytes. `left` is what stays free of the budget after warm-up."""
    card: int
    budget: int
    utilization: float
    outside: int                                   # CUDA context, cuBLAS, other processes
    weights: dict[str, tuple[int, str]]
    gdn_rows: int
    gdn_pool: int
    snapshot_rows: int = 0
    snapshots: int = 0
    activations: int = 0                           # measured: prefill at max_num_batched_tokens, sampler
    graphs: int = 0                                # measured: decode forward at max_num_seqs (+ MoE graphs' pool)
    block_size: int = 0
    block_bytes: int = 0
    num_blocks: int = 0
    measured: dict[str, int] = field(default_factory=dict)   # after start-up: what the allocator really holds

    @property
    def weight_total(self) -> int:
        return sum(b for b, _ in self.weights.values())

    @property
    def kv(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def fixed(self) -> int:
        """Everything but the KV cache."""
        return self.outside + self.weight_total + self.gdn_pool + self.snapshots + self.activations + self.graphs

    @property
    def left(self) -> int:
        return self.budget - self.fixed - self.kv

    def blocks_that_fit(self) -> int:
        return int((self.budget * self.utilization - self.fixed - SLACK) // max(self.block_bytes, 1))

    def rows(self) -> list[tuple[str, int, str]]:
        rows = [(f"权重 · {kind}", b, dt) for kind, (b, dt) in self.weights.items()]
        if self.gdn_pool:
            rows.append(("GDN 状态池", self.gdn_pool, f"{self.gdn_rows} 行 × {self.gdn_pool // self.gdn_rows / MIB:.1f} MiB"))
        if self.snapshots:
            rows.append(("GDN 状态快照（e07）", self.snapshots, f"{self.snapshot_rows} 行"))
        rows.append(("KV cache", self.kv, f"{self.num_blocks} 块 × {self.block_size} token = "
                                           f"{self.num_blocks * self.block_size:,} token，每块 {self.block_bytes / MIB:.2f} MiB"))
        rows.append(("CUDA graph 内存池", self.graphs, "decode max_num_seqs 行的前向（实测）+ MoE graph"))
        rows.append(("激活峰值", self.activations, "max_num_batched_tokens 的 prefill 与采样（实测）"))
        rows.append(("allocator 之外", self.outside, "CUDA context、cuBLAS、别的进程"))
        rows.append(("剩余", self.left, f"预算的 {1 - self.utilization:.0%} 左右留作余量"))
        return rows

    def table(self) -> str:
        cap = "" if self.budget == self.card else f"（--gpu-memory-gib 限制；整卡 {self.card / GIB:.1f} GiB）"
        lines = [f"显存计划：预算 {self.budget / GIB:.1f} GiB{cap}，gpu_memory_utilization={self.utilization}"]
        for name, b, note in self.rows():
            lines.append(f"  {name:<22} {b / GIB:8.2f} GiB  {note}")
        when = {"free_after_warmup": "引擎启动后", "free_after_bench_warmup": "预热请求后",
                "free_after_timed_runs": "计时运行后"}
        for key, label in when.items():
            if key in self.measured:
                got = self.measured[key]
                lines.append(f"  {label}实测空闲 {got / GIB:.2f} GiB，计划剩余 {self.left / GIB:.2f} GiB，"
                             f"差 {(got - self.left) / self.card:+.1%}（占整卡）")
        return "\n".join(lines)

    def left_error(self) -> float:
        """The largest |measured free - planned left| / card over the free-memory readings taken so far (0 if none)."""
        return max((abs(v - self.left) / self.card for k, v in self.measured.items() if k.startswith("free_after")),
                   default=0.0)

    def as_dict(self) -> dict:
        return {"card_bytes": self.card, "budget_bytes": self.budget, "utilization": self.utilization,
                "outside_bytes": self.outside, "weights": {k: {"bytes": b, "dtype": d} for k, (b, d) in self.weights.items()},
                "gdn_rows": self.gdn_rows, "gdn_pool_bytes": self.gdn_pool, "snapshot_rows": self.snapshot_rows,
                "snapshot_bytes": self.snapshots, "activation_bytes": self.activations, "graph_bytes": self.graphs,
                "block_size": self.block_size, "block_bytes": self.block_bytes, "num_blocks": self.num_blocks,
                "kv_bytes": self.kv, "left_bytes": self.left, "measured": dict(self.measured),
                "left_error_of_card": self.left_error()}


def refuse(plan: MemoryPlan, what: str, need: int, max_model_len: int, max_num_seqs: int, stage: str) -> None:
    """Raise MemoryPlanError: one paragraph with the plan's numbers and the settings that would make it fit."""
    have = plan.budget * plan.utilization - plan.outside
    others = plan.fixed - plan.outside - plan.gdn_pool
    hints = []
    if plan.gdn_rows > 1 and plan.gdn_pool:
        row = plan.gdn_pool / plan.gdn_rows
        spare = have - others - need - SLACK
        seqs = int(spare // row) - 1
        if seqs >= 1 and seqs < max_num_seqs:
            hints.append(f"max_num_seqs 降到 {seqs}（--max-num-seqs {seqs}：GDN 状态池每行 {row / MIB:.0f} MiB）")
    if not any("float8" in dtype for _, dtype in plan.weights.values()):
        hints.append("FP8 权重（--dtype w8a8 或 fp8：专家与线性层的字节减半）")
    hints.append(f"更短的 max_model_len（现在 {max_model_len}）")
    hints.append("更大的卡或更大的 --gpu-memory-gib / gpu_memory_utilization")
    raise MemoryPlanError(
        f"显存放不下（{stage}）：预算 {plan.budget / GIB:.1f} GiB × gpu_memory_utilization {plan.utilization} "
        f"− allocator 之外 {plan.outside / GIB:.1f} GiB = {have / GIB:.1f} GiB；权重 {plan.weight_total / GIB:.1f} GiB、"
        + (f"GDN 状态池 {plan.gdn_pool / GIB:.1f} GiB（{plan.gdn_rows} 行）、" if plan.gdn_rows else "")
        + (f"状态快照 {plan.snapshots / GIB:.1f} GiB、" if plan.snapshots else "")
        + f"激活 {plan.activations / GIB:.1f} GiB、CUDA graph {plan.graphs / GIB:.1f} GiB 之后，{what}还需要 "
        f"{need / GIB:.2f} GiB，不够。可以改的设置：" + "；".join(hints) + "。")
