"""E04 · Model runner: one step's batch as tensors, a paged-KV attention backend, the GDN state pool.

A step is one unified batch (e03): sequence b computes its tokens [c_b, c_b + q_b), where
c_b = num_cached_tokens (KV already in the cache) and q_b = num_scheduled_tokens:

    input_ids, positions   [N]       N = sum q_b; positions c_b .. c_b + q_b - 1
    cu_seqlens_q           [B+1]     prefix sums of q_b  (the new tokens)
    cu_seqlens_k           [B+1]     prefix sums of c_b + q_b  (every key the queries see)
    slot_mapping           [N]       where each new token's K/V goes: block_table[t // P] * P + t % P
    block_tables           [B, M]    physical blocks of each sequence, padded with -1
    context_lens           [B]       c_b + q_b

Paged attention (the torch reference backend): write the new K/V into the caches through slot_mapping,
read every sequence's keys back through its block table, then m04's varlen attention (bottom-right
causal, so a cached prefix and a decode token are the same case).

Gated DeltaNet layers keep no KV: each running sequence owns a slot of a state pool (conv state and
recurrent state per linear layer), zeroed when its prefill starts, freed when it finishes or is preempted.
"""

from __future__ import annotations

from itertools import chain

import torch
import torch.nn.functional as F
from torch import nn

from .e01_sampling import Sampler, make_generator
from .e02_block_manager import Sequence
from .m04_attention import AttentionContext, varlen_attention
from .m05_gated_deltanet import GDNState


def prepare_batch(seqs: list[Sequence], block_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
    """The step's (input_ids [N], positions [N], ctx) for sequences with num_scheduled_tokens set.

    Python touches each sequence once (a slice of its token ids, its block table); everything per
    token (positions, slots) is computed by tensor ops, so the cost does not grow with the prompts.
    """
    raise NotImplementedError("e04: 请实现 prepare_batch（见 lessons/e04_model_runner.md）")


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k/v [N, nKV, D] -> the caches [num_blocks, P, nKV, D] at the flat slots slot_mapping [N]."""
    raise NotImplementedError("e04: 请实现 store_kvcache（见 lessons/e04_model_runner.md）")


def gather_slots(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat cache slots of every key of every sequence, in order: [sum(context_lens)]."""
    raise NotImplementedError("e04: 请实现 gather_slots（见 lessons/e04_model_runner.md）")


class PagedAttention(nn.Module):
    """Drop-in for m04's Attention backend, reading and writing one layer's paged KV cache."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.k_cache, self.v_cache = k_cache, v_cache           # [num_blocks, P, nKV, D] each

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q [N, nH, D], k/v [N, nKV, D] (the new tokens) -> [N, nH, D]."""
        raise NotImplementedError("e04: 请实现 PagedAttention.forward（见 lessons/e04_model_runner.md）")


class GDNStatePool:
    """Per-sequence Gated DeltaNet state: a slot per running sequence in fixed tensors per linear layer."""

    def __init__(self, model: nn.Module, max_num_seqs: int, dtype: torch.dtype = torch.float32):
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for i in model.linear_layer_ids:
            gdn = model.model.layers[i].linear_attn
            width = gdn.conv1d.weight.shape[-1]
            self.conv[i] = torch.zeros(max_num_seqs, gdn.conv_dim, width - 1, dtype=dtype)
            self.ssm[i] = torch.zeros(max_num_seqs, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)  # fp32
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.slot_of: dict[int, int] = {}

    def allocate(self, seq: Sequence) -> int:
        """A zeroed slot for a sequence whose prefill starts (num_cached_tokens == 0)."""
        raise NotImplementedError("e04: 请实现 GDNStatePool.allocate（见 lessons/e04_model_runner.md）")

    def free(self, seq: Sequence) -> None:
        raise NotImplementedError("e04: 请实现 GDNStatePool.free（见 lessons/e04_model_runner.md）")

    def states(self, seqs: list[Sequence]) -> tuple[torch.Tensor, dict[int, GDNState]]:
        """Gather the batch's states (copies, in batch order) for the model; commit() writes them back."""
        raise NotImplementedError("e04: 请实现 GDNStatePool.states（见 lessons/e04_model_runner.md）")

    def commit(self, slots: torch.Tensor, states: dict[int, GDNState]) -> None:
        raise NotImplementedError("e04: 请实现 GDNStatePool.commit（见 lessons/e04_model_runner.md）")


class ModelRunner:
    """Owns the model, its paged KV cache, the GDN state pool and the sampler; runs one step."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, max_num_seqs: int):
        self.model, self.block_size = model, block_size
        dtype = next(model.parameters()).dtype
        self.kv_caches = []
        for layer in model.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                continue
            backend = attn.attn
            shape = (num_blocks, block_size, backend.num_kv_heads, backend.head_dim)
            k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            attn.attn = PagedAttention(backend.num_heads, backend.head_dim, backend.scale, backend.num_kv_heads,
                                       k_cache, v_cache)
            self.kv_caches.append((k_cache, v_cache))
        self.gdn_pool = GDNStatePool(model, max_num_seqs, dtype) if model.linear_layer_ids else None
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator | None] = {}

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: its GDN slot goes back (a preempted one restarts at 0)."""
        if self.gdn_pool is not None:
            self.gdn_pool.free(seq)
        if seq.is_finished:
            self.generators.pop(seq.seq_id, None)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[int]:
        """One step: a token for every sequence (meaningless for a partial prefill chunk, which e03 ignores)."""
        raise NotImplementedError("e04: 请实现 ModelRunner.run（见 lessons/e04_model_runner.md）")
