"""M07 · Tensor parallel: column / row / QKV / merged parallel linear, vocab-parallel embedding and LM head.

Megatron-style tensor parallelism over tp ranks (rank r of tp). Every rank sees the same input x [N, H];
a weight W [out, in] (F.linear layout) is cut in one of two ways:

    column parallel  W_r = W[r*out/tp : (r+1)*out/tp, :]   y_r = x W_r^T   [N, out/tp]   no communication
    row parallel     W_r = W[:, r*in/tp : (r+1)*in/tp]     y   = all_reduce_r(x_r W_r^T) + b   [N, out]

A column layer followed by a row layer needs exactly one all-reduce: the column output y_r is already
the slice x_r the row layer expects. Attention: qkv_proj by heads (column), o_proj row. MLP: gate_up
column, down row. MoE: every expert's intermediate dim I is split (gate_up [E, 2I/tp, H], down
[E, H, I/tp]); the routed and shared outputs are partial sums, so one all-reduce follows the block.

Packed weights are split per part, never as one tensor: qkv_proj keeps this rank's heads of q, of k and
of v; gate_up_proj keeps this rank's rows of gate and of up. The vocabulary is split in contiguous
shards of ceil(V/tp) rows: the embedding zeroes ids outside its shard and all-reduces, the LM head
all-gathers its logit columns. Each parameter carries weight_loader(param, full_tensor, shard) -> number
of values written, which m06's load_checkpoint calls with the full HF tensor.

Fewer KV heads than ranks (nKV < tp, tp a multiple of nKV): every rank keeps one KV head, rank r the
head r * nKV // tp, so each KV head is replicated on tp / nKV ranks (as vLLM's QKVParallelLinear).

Gated DeltaNet splits by heads as well: rank r keeps key heads r*nk/tp .. and value heads r*nv/tp ..;
value head j reads key head j // (nv/nk), so a key head and its value heads stay on one rank. The packed
in_proj_qkv [q_all | k_all | v_all] and the conv1d channels (same order) are split per part, local
[q_r | k_r | v_r]; in_proj_z / b / a, A_log and dt_bias follow the value heads; the gated RMSNorm weight
[dv] is shared by every head and stays whole; out_proj is row parallel. The recurrent rule runs per value
head, so no communication is added, and each rank's state pool holds only its own heads.

At tp = 1 every layer equals nn.Linear / nn.Embedding and never calls torch.distributed.

Lesson: lessons/m07_tensor_parallel.md (#7 · 书 §M.7).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .m04_attention import GatedAttention
from .m06_models import SparseMoeBlock


def tp_info() -> tuple[int, int]:
    """(rank, world_size) of the default process group when torch.distributed is initialised, else (0, 1)."""
    raise NotImplementedError("m07: 请实现 tp_info（见 lessons/m07_tensor_parallel.md）")


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} = {total} is not divisible by the tensor parallel size {parts}")
    return total // parts


def _loadable(module: nn.Module, *shape: int) -> nn.Parameter:
    """An uninitialised parameter that m06's load_checkpoint fills through module.weight_loader."""
    raise NotImplementedError("m07: 请实现 _loadable（见 lessons/m07_tensor_parallel.md）")


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T (+ b_r): this rank's output_size / tp rows of W [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        """weight [output_size / tp, input_size], bias [output_size / tp] or None; both with a weight_loader."""
        raise NotImplementedError("m07: 请实现 ColumnParallelLinear.__init__（见 lessons/m07_tensor_parallel.md）")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """loaded [output_size, ...] (weight or bias): keep rows rank*rows .. (rank+1)*rows. Returns numel."""
        raise NotImplementedError("m07: 请实现 ColumnParallelLinear.weight_loader（见 lessons/m07_tensor_parallel.md）")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, input_size] (replicated) -> [N, output_size / tp] (this rank's columns of y)."""
        raise NotImplementedError("m07: 请实现 ColumnParallelLinear.forward（见 lessons/m07_tensor_parallel.md）")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up_proj): local rows = [part 0 slice | part 1 slice]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        """Each output size is split across ranks on its own, so part i of every rank stays aligned."""
        raise NotImplementedError("m07: 请实现 MergedColumnParallelLinear.__init__（见 lessons/m07_tensor_parallel.md）")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """shard (i,): loaded is part i in full [output_sizes[i], ...]; its rank slice goes to local part i.
        shard (): loaded packs every part [part 0 | part 1 | ...] (Qwen3.5's in_proj_qkv): each part on its own."""
        raise NotImplementedError("m07: 请实现 MergedColumnParallelLinear.weight_loader（见 lessons/m07_tensor_parallel.md）")


class QKVParallelLinear(ColumnParallelLinear):
    """qkv_proj split by heads: local rows = [q of my heads | k of my kv heads | v of my kv heads]."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, q_head_size_factor: int = 1):
        """num_heads = total_num_heads / tp; num_kv_heads = total_num_kv_heads / tp, or 1 when there are fewer
        KV heads than ranks (kv_replicas = tp / total_num_kv_heads ranks then share each KV head; ValueError
        unless tp is a multiple of it); q rows per head = q_head_size_factor * head_size (2 for gated
        attention, whose q_proj rows are per head [q_h | gate_h])."""
        raise NotImplementedError("m07: 请实现 QKVParallelLinear.__init__（见 lessons/m07_tensor_parallel.md）")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """shard ("q",) / ("k",) / ("v",): loaded is the full q_proj / k_proj / v_proj; keep this rank's heads."""
        raise NotImplementedError("m07: 请实现 QKVParallelLinear.weight_loader（见 lessons/m07_tensor_parallel.md）")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: this rank's input_size / tp columns of W; the input is already split."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        """weight [output_size, input_size / tp]; bias [output_size] is replicated and added once."""
        raise NotImplementedError("m07: 请实现 RowParallelLinear.__init__（见 lessons/m07_tensor_parallel.md）")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """Weight: keep columns rank*cols .. (rank+1)*cols of loaded [output_size, input_size]; bias: all of it."""
        raise NotImplementedError("m07: 请实现 RowParallelLinear.weight_loader（见 lessons/m07_tensor_parallel.md）")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, input_size / tp] (this rank's slice) -> [N, output_size], the same on every rank."""
        raise NotImplementedError("m07: 请实现 RowParallelLinear.forward（见 lessons/m07_tensor_parallel.md）")


class VocabParallelEmbedding(nn.Module):
    """Rows vocab_start .. vocab_end of the embedding table (shards of ceil(V / tp) rows, the last zero-padded)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        """weight [ceil(V / tp), embedding_dim] with weight.weight_loader; vocab_start / vocab_end of this rank."""
        raise NotImplementedError("m07: 请实现 VocabParallelEmbedding.__init__（见 lessons/m07_tensor_parallel.md）")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """loaded [V, ...]: rows vocab_start .. vocab_end, then zeros for the padding rows. Returns numel."""
        raise NotImplementedError("m07: 请实现 VocabParallelEmbedding.weight_loader（见 lessons/m07_tensor_parallel.md）")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] (any id of the full vocabulary) -> [N, embedding_dim], the same on every rank."""
        raise NotImplementedError("m07: 请实现 VocabParallelEmbedding.forward（见 lessons/m07_tensor_parallel.md）")


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden W^T over the full vocabulary: each rank computes its shard's columns, then all-gather."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        """The embedding's shard of W [V, H] (tied: the very same Parameter); bias [ceil(V / tp)] if asked."""
        raise NotImplementedError("m07: 请实现 ParallelLMHead.__init__（见 lessons/m07_tensor_parallel.md）")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] on every rank."""
        raise NotImplementedError("m07: 请实现 ParallelLMHead.forward（见 lessons/m07_tensor_parallel.md）")


class ParallelExperts(nn.Module):
    """m06's fused experts with the intermediate dim split: gate_up_proj [E, 2I/tp, H], down_proj [E, H, I/tp]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        """Local layout per expert: gate_up_proj[e] = [gate rows of this rank | up rows of this rank]."""
        raise NotImplementedError("m07: 请实现 ParallelExperts.__init__（见 lessons/m07_tensor_parallel.md）")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """shard ("expert", e, "gate" | "up" | "down"): loaded gate/up [I, H] or down [H, I] of expert e."""
        raise NotImplementedError("m07: 请实现 ParallelExperts.weight_loader（见 lessons/m07_tensor_parallel.md）")


class ParallelConv1d(nn.Conv1d):
    """Gated DeltaNet's depthwise conv1d over the packed [q | k | v] channels: this rank's channels of each part."""

    def __init__(self, part_sizes: list[int], kernel_size: int):
        """weight [C / tp, 1, K] (C = sum(part_sizes)), no bias, with a weight_loader. A depthwise conv mixes no
        channels, so it splits like a column layer: local channels [q_r | k_r | v_r], the columns of in_proj_qkv."""
        raise NotImplementedError("m07: 请实现 ParallelConv1d.__init__（见 lessons/m07_tensor_parallel.md）")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """loaded [C, 1, K] with channels [q_all | k_all | v_all]: each part's rank slice, in that order."""
        raise NotImplementedError("m07: 请实现 ParallelConv1d.weight_loader（见 lessons/m07_tensor_parallel.md）")


def _value_head_rows(param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
    """weight_loader of A_log / dt_bias [nv / tp]: this rank's value heads of the full [nv]."""
    raise NotImplementedError("m07: 请实现 _value_head_rows（见 lessons/m07_tensor_parallel.md）")


def _all_reduce_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the block's output is a partial sum on every rank; make it the full sum."""
    dist.all_reduce(output)
    return output


def _swap(parent: nn.Module, name: str, new: nn.Module) -> None:
    """parent.<name> = new, with new's parameters in the dtype and on the device of the module it replaces."""
    old = next(getattr(parent, name).parameters())
    setattr(parent, name, new.to(device=old.device, dtype=old.dtype))


def _parallel_attention(attn: nn.Module) -> None:
    """qkv_proj -> QKVParallelLinear (q_head_size_factor 2 for GatedAttention), o_proj -> RowParallelLinear;
    num_heads, num_kv_heads, q_size, kv_size and the backend's attn.num_heads / attn.num_kv_heads become this
    rank's (num_heads / tp; num_kv_heads / tp, or 1 when KV heads are replicated)."""
    raise NotImplementedError("m07: 请实现 _parallel_attention（见 lessons/m07_tensor_parallel.md）")


def _parallel_mlp(mlp: nn.Module) -> None:
    """Dense MLP: gate_up_proj -> MergedColumnParallelLinear, down_proj -> RowParallelLinear. SparseMoeBlock:
    experts -> ParallelExperts, the shared expert like a dense MLP, the router `gate` replicated, and one
    all-reduce after the block (register_forward_hook(_all_reduce_output))."""
    raise NotImplementedError("m07: 请实现 _parallel_mlp（见 lessons/m07_tensor_parallel.md）")


def _parallel_gdn(gdn: nn.Module) -> None:
    """A GatedDeltaNet split by heads: in_proj_qkv -> MergedColumnParallelLinear over [key_dim, key_dim,
    value_dim] and conv1d -> ParallelConv1d over the same parts; in_proj_z / b / a -> ColumnParallelLinear
    (by value head); A_log, dt_bias -> this rank's value heads (weight_loader _value_head_rows); norm (one
    [dv] weight shared by every head) unchanged; out_proj -> RowParallelLinear. num_k_heads, num_v_heads,
    key_dim, value_dim and conv_dim become this rank's: the state pool sizes its states from them."""
    raise NotImplementedError("m07: 请实现 _parallel_gdn（见 lessons/m07_tensor_parallel.md）")


def tensor_parallel(model: nn.Module, rank: int | None = None, world_size: int | None = None) -> nn.Module:
    """Rewrite an m06 model in place for this rank, before its weights are loaded; returns the same model.

    rank / world_size default to tp_info(). world_size 1: the model is returned untouched (given as 1, not
    even tp_info() is called). Otherwise torch.distributed must already run with exactly this rank and
    world size (else ValueError). Rewrites every self_attn (_parallel_attention), every linear_attn
    (_parallel_gdn), every mlp (_parallel_mlp), model.embed_tokens -> VocabParallelEmbedding and lm_head ->
    ParallelLMHead (tied embeddings: lm_head.weight is embed_tokens.weight again).
    """
    raise NotImplementedError("m07: 请实现 tensor_parallel（见 lessons/m07_tensor_parallel.md）")
