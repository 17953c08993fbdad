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
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} = {total} is not divisible by the tensor parallel size {parts}")
    return total // parts


def _loadable(module: nn.Module, *shape: int) -> nn.Parameter:
    """An uninitialised parameter that m06's load_checkpoint fills through module.weight_loader."""
    param = nn.Parameter(torch.empty(*shape))
    param.weight_loader = module.weight_loader
    return param


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T (+ b_r): this rank's output_size / tp rows of W [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        """weight [output_size / tp, input_size], bias [output_size / tp] or None; both with a weight_loader."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_info()
        self.input_size, self.output_size = input_size, output_size
        rows = _divide(output_size, self.tp_size, "output_size")
        self.weight = _loadable(self, rows, input_size)
        self.bias = _loadable(self, rows) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """loaded [output_size, ...] (weight or bias): keep rows rank*rows .. (rank+1)*rows. Returns numel."""
        rows = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * rows, rows))
        return param.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, input_size] (replicated) -> [N, output_size / tp] (this rank's columns of y)."""
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up_proj): local rows = [part 0 slice | part 1 slice]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        """Each output size is split across ranks on its own, so part i of every rank stays aligned."""
        tp_size = tp_info()[1]
        for i, size in enumerate(output_sizes):
            _divide(size, tp_size, f"output_sizes[{i}]")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """shard (i,): loaded is part i in full [output_sizes[i], ...]; its rank slice goes to local part i.
        shard (): loaded packs every part [part 0 | part 1 | ...] (Qwen3.5's in_proj_qkv): each part on its own."""
        if not shard:
            parts = loaded.split(self.output_sizes)
            return sum(self.weight_loader(param, part, (i,)) for i, part in enumerate(parts))
        i = shard[0]
        size = self.output_sizes[i] // self.tp_size                 # this rank's rows of part i
        offset = sum(self.output_sizes[:i]) // self.tp_size          # where part i starts in the local rows
        target = param.data.narrow(0, offset, size)
        target.copy_(loaded.narrow(0, self.tp_rank * size, size))
        return target.numel()


class QKVParallelLinear(ColumnParallelLinear):
    """qkv_proj split by heads: local rows = [q of my heads | k of my kv heads | v of my kv heads]."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, q_head_size_factor: int = 1):
        """num_heads = total_num_heads / tp; num_kv_heads = total_num_kv_heads / tp, or 1 when there are fewer
        KV heads than ranks (kv_replicas = tp / total_num_kv_heads ranks then share each KV head; ValueError
        unless tp is a multiple of it); q rows per head = q_head_size_factor * head_size (2 for gated
        attention, whose q_proj rows are per head [q_h | gate_h])."""
        tp_size = tp_info()[1]
        self.head_size, self.q_head_size_factor = head_size, q_head_size_factor
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
        elif tp_size % total_num_kv_heads:
            raise ValueError(f"num_key_value_heads = {total_num_kv_heads} < tensor parallel size {tp_size}: KV heads "
                             "are replicated, so the tensor parallel size must be a multiple of it")
        else:
            self.num_kv_heads = 1                                     # one KV head per rank, replicated
        self.kv_replicas = tp_size * self.num_kv_heads // total_num_kv_heads
        rows = (total_num_heads * q_head_size_factor + 2 * self.num_kv_heads * tp_size) * head_size
        super().__init__(hidden_size, rows, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """shard ("q",) / ("k",) / ("v",): loaded is the full q_proj / k_proj / v_proj; keep this rank's heads."""
        q_rows = self.num_heads * self.q_head_size_factor * self.head_size
        kv_rows = self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}[shard[0]]
        block = self.tp_rank if shard[0] == "q" else self.tp_rank // self.kv_replicas   # replicas share a KV head
        target = param.data.narrow(0, offset, size)
        target.copy_(loaded.narrow(0, block * size, size))            # heads block*n .. (block+1)*n of this part
        return target.numel()


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: this rank's input_size / tp columns of W; the input is already split."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        """weight [output_size, input_size / tp]; bias [output_size] is replicated and added once."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_info()
        self.input_size, self.output_size = input_size, output_size
        cols = _divide(input_size, self.tp_size, "input_size")
        self.weight = _loadable(self, output_size, cols)
        self.bias = _loadable(self, output_size) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """Weight: keep columns rank*cols .. (rank+1)*cols of loaded [output_size, input_size]; bias: all of it."""
        if param.dim() == 1:
            param.data.copy_(loaded)
        else:
            cols = param.shape[1]
            param.data.copy_(loaded.narrow(1, self.tp_rank * cols, cols))
        return param.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, input_size / tp] (this rank's slice) -> [N, output_size], the same on every rank."""
        y = F.linear(x, self.weight)                                 # [N, out]: a partial sum
        if self.tp_size > 1:
            dist.all_reduce(y)                                       # sum over ranks
        if self.bias is not None:
            y = y + self.bias                                        # once, after the sum
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows vocab_start .. vocab_end of the embedding table (shards of ceil(V / tp) rows, the last zero-padded)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        """weight [ceil(V / tp), embedding_dim] with weight.weight_loader; vocab_start / vocab_end of this rank."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_info()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.shard_size = -(-num_embeddings // self.tp_size)                   # ceil(V / tp)
        self.vocab_start = min(self.tp_rank * self.shard_size, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = _loadable(self, self.shard_size, embedding_dim)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """loaded [V, ...]: rows vocab_start .. vocab_end, then zeros for the padding rows. Returns numel."""
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start:self.vocab_end])
        param.data[rows:].zero_()
        return param.numel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] (any id of the full vocabulary) -> [N, embedding_dim], the same on every rank."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, 0)                     # other ranks' ids read row 0 ...
        y = F.embedding(local, self.weight)                                      # [N, embedding_dim]
        y = y.masked_fill(~mine[:, None], 0)                                     # ... and are zeroed here
        dist.all_reduce(y)                                                       # exactly one rank holds each id
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden W^T over the full vocabulary: each rank computes its shard's columns, then all-gather."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        """The embedding's shard of W [V, H] (tied: the very same Parameter); bias [ceil(V / tp)] if asked."""
        super().__init__(num_embeddings, embedding_dim)
        self.bias = _loadable(self, self.shard_size) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] on every rank."""
        logits = F.linear(hidden, self.weight, self.bias)                       # [N, ceil(V / tp)]
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, logits)
        return torch.cat(parts, dim=-1)[:, :self.num_embeddings]                 # drop the padding columns


class ParallelExperts(nn.Module):
    """m06's fused experts with the intermediate dim split: gate_up_proj [E, 2I/tp, H], down_proj [E, H, I/tp]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        """Local layout per expert: gate_up_proj[e] = [gate rows of this rank | up rows of this rank]."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_info()
        inter = _divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.gate_up_proj = _loadable(self, num_experts, 2 * inter, hidden_size)
        self.down_proj = _loadable(self, num_experts, hidden_size, inter)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """shard ("expert", e, "gate" | "up" | "down"): loaded gate/up [I, H] or down [H, I] of expert e."""
        _, e, part = shard
        inter = self.down_proj.shape[-1]
        if part == "down":                                           # [H, I]: the intermediate dim is dim 1
            target, piece = param.data[e], loaded.narrow(1, self.tp_rank * inter, inter)
        else:                                                        # [I, H]: the intermediate dim is dim 0
            target = param.data[e, :inter] if part == "gate" else param.data[e, inter:]
            piece = loaded.narrow(0, self.tp_rank * inter, inter)
        target.copy_(piece)
        return target.numel()


class ParallelConv1d(nn.Conv1d):
    """Gated DeltaNet's depthwise conv1d over the packed [q | k | v] channels: this rank's channels of each part."""

    def __init__(self, part_sizes: list[int], kernel_size: int):
        """weight [C / tp, 1, K] (C = sum(part_sizes)), no bias, with a weight_loader. A depthwise conv mixes no
        channels, so it splits like a column layer: local channels [q_r | k_r | v_r], the columns of in_proj_qkv."""
        tp_rank, tp_size = tp_info()
        channels = sum(_divide(size, tp_size, "conv1d channels of a part") for size in part_sizes)
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)
        self.tp_rank, self.tp_size, self.part_sizes = tp_rank, tp_size, list(part_sizes)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
        """loaded [C, 1, K] with channels [q_all | k_all | v_all]: each part's rank slice, in that order."""
        pieces = [part.chunk(self.tp_size)[self.tp_rank] for part in loaded.split(self.part_sizes)]
        param.data.copy_(torch.cat(pieces))
        return param.numel()


def _value_head_rows(param: nn.Parameter, loaded: torch.Tensor, shard: tuple = ()) -> int:
    """weight_loader of A_log / dt_bias [nv / tp]: this rank's value heads of the full [nv]."""
    rows = param.shape[0]
    param.data.copy_(loaded.narrow(0, tp_info()[0] * rows, rows))
    return param.numel()


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
    hidden = attn.o_proj.out_features
    factor = 2 if isinstance(attn, GatedAttention) else 1            # gated q rows: per head [q_h | gate_h]
    qkv = QKVParallelLinear(hidden, attn.head_dim, attn.num_heads, attn.num_kv_heads,
                            attn.qkv_proj.bias is not None, factor)
    _swap(attn, "qkv_proj", qkv)
    _swap(attn, "o_proj", RowParallelLinear(attn.o_proj.in_features, hidden, attn.o_proj.bias is not None))
    attn.num_heads, attn.num_kv_heads = qkv.num_heads, qkv.num_kv_heads
    attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    attn.attn.num_heads, attn.attn.num_kv_heads = attn.num_heads, attn.num_kv_heads


def _parallel_mlp(mlp: nn.Module) -> None:
    """Dense MLP: gate_up_proj -> MergedColumnParallelLinear, down_proj -> RowParallelLinear. SparseMoeBlock:
    experts -> ParallelExperts, the shared expert like a dense MLP, the router `gate` replicated, and one
    all-reduce after the block (register_forward_hook(_all_reduce_output))."""
    if isinstance(mlp, SparseMoeBlock):
        num_experts, _, hidden = mlp.experts.gate_up_proj.shape
        _swap(mlp, "experts", ParallelExperts(num_experts, hidden, mlp.experts.down_proj.shape[-1]))
        if mlp.shared_expert is not None:
            _parallel_mlp(mlp.shared_expert)       # the block reads its weights: down_proj never all-reduces
        mlp.register_forward_hook(_all_reduce_output)   # routed + shared partial sums: one all-reduce
        return
    hidden, inter = mlp.gate_up_proj.in_features, mlp.down_proj.in_features
    _swap(mlp, "gate_up_proj", MergedColumnParallelLinear(hidden, [inter, inter]))
    _swap(mlp, "down_proj", RowParallelLinear(inter, hidden))


def _parallel_gdn(gdn: nn.Module) -> None:
    """A GatedDeltaNet split by heads: in_proj_qkv -> MergedColumnParallelLinear over [key_dim, key_dim,
    value_dim] and conv1d -> ParallelConv1d over the same parts; in_proj_z / b / a -> ColumnParallelLinear
    (by value head); A_log, dt_bias -> this rank's value heads (weight_loader _value_head_rows); norm (one
    [dv] weight shared by every head) unchanged; out_proj -> RowParallelLinear. num_k_heads, num_v_heads,
    key_dim, value_dim and conv_dim become this rank's: the state pool sizes its states from them."""
    tp_size = tp_info()[1]
    hidden = gdn.out_proj.out_features
    num_k_heads = _divide(gdn.num_k_heads, tp_size, "linear_num_key_heads")
    num_v_heads = _divide(gdn.num_v_heads, tp_size, "linear_num_value_heads")
    parts = [gdn.key_dim, gdn.key_dim, gdn.value_dim]                 # [q_all | k_all | v_all]
    _swap(gdn, "in_proj_qkv", MergedColumnParallelLinear(hidden, parts))
    _swap(gdn, "conv1d", ParallelConv1d(parts, gdn.conv1d.kernel_size[0]))
    _swap(gdn, "in_proj_z", ColumnParallelLinear(hidden, gdn.value_dim))
    _swap(gdn, "in_proj_b", ColumnParallelLinear(hidden, gdn.num_v_heads))
    _swap(gdn, "in_proj_a", ColumnParallelLinear(hidden, gdn.num_v_heads))
    for name in ("A_log", "dt_bias"):                                 # [nv] -> [nv / tp]
        param = nn.Parameter(getattr(gdn, name).new_empty(num_v_heads))
        param.weight_loader = _value_head_rows
        setattr(gdn, name, param)
    _swap(gdn, "out_proj", RowParallelLinear(gdn.value_dim, hidden))
    gdn.num_k_heads, gdn.num_v_heads = num_k_heads, num_v_heads
    gdn.key_dim, gdn.value_dim = num_k_heads * gdn.head_k_dim, num_v_heads * gdn.head_v_dim
    gdn.conv_dim = 2 * gdn.key_dim + gdn.value_dim


def tensor_parallel(model: nn.Module, rank: int | None = None, world_size: int | None = None) -> nn.Module:
    """Rewrite an m06 model in place for this rank, before its weights are loaded; returns the same model.

    rank / world_size default to tp_info(). world_size 1: the model is returned untouched (given as 1, not
    even tp_info() is called). Otherwise torch.distributed must already run with exactly this rank and
    world size (else ValueError). Rewrites every self_attn (_parallel_attention), every linear_attn
    (_parallel_gdn), every mlp (_parallel_mlp), model.embed_tokens -> VocabParallelEmbedding and lm_head ->
    ParallelLMHead (tied embeddings: lm_head.weight is embed_tokens.weight again).
    """
    if world_size == 1:
        return model
    actual = tp_info()
    rank = actual[0] if rank is None else rank
    world_size = actual[1] if world_size is None else world_size
    if world_size == 1:
        return model
    if (rank, world_size) != actual:
        raise ValueError(f"tensor_parallel(rank={rank}, world_size={world_size}) needs torch.distributed "
                         f"initialised with that rank and world size first; it runs as {actual}")
    for layer in model.model.layers:
        if layer.is_linear:
            _parallel_gdn(layer.linear_attn)
        else:
            _parallel_attention(layer.self_attn)
        _parallel_mlp(layer.mlp)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    vocab, hidden = model.model.embed_tokens.weight.shape
    _swap(model.model, "embed_tokens", VocabParallelEmbedding(vocab, hidden))
    _swap(model, "lm_head", ParallelLMHead(vocab, hidden, model.lm_head.bias is not None))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
