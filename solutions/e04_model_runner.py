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
    cached = torch.tensor([s.num_cached_tokens for s in seqs])                       # [B] c_b
    new = torch.tensor([s.num_scheduled_tokens for s in seqs])                       # [B] q_b
    input_ids = torch.tensor(list(chain.from_iterable(
        s.token_ids[s.num_cached_tokens:s.num_cached_tokens + s.num_scheduled_tokens] for s in seqs)))   # [N]
    width = max(len(s.block_table) for s in seqs)
    block_tables = torch.tensor([s.block_table + [-1] * (width - len(s.block_table)) for s in seqs],
                                dtype=torch.int32)                                   # [B, M], -1 padded
    cu_q = F.pad(new.cumsum(0), (1, 0))                                              # [B+1]
    context_lens = cached + new                                                      # [B]
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), new)             # [N]
    positions = torch.arange(int(cu_q[-1])) - cu_q[seq_of_token] + cached[seq_of_token]   # [N]
    blocks = block_tables.long()[seq_of_token, positions // block_size]              # [N] physical block
    ctx = AttentionContext(
        cu_seqlens_q=cu_q.int(), cu_seqlens_k=F.pad(context_lens.cumsum(0), (1, 0)).int(),
        max_seqlen_q=int(new.max()), max_seqlen_k=int(context_lens.max()),
        slot_mapping=blocks * block_size + positions % block_size, block_tables=block_tables,
        context_lens=context_lens.int(), is_prefill=bool((new > 1).any()))
    return input_ids, positions, ctx


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k/v [N, nKV, D] -> the caches [num_blocks, P, nKV, D] at the flat slots slot_mapping [N]."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def gather_slots(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat cache slots of every key of every sequence, in order: [sum(context_lens)]."""
    lens = context_lens.long()
    seq_of_key = torch.repeat_interleave(torch.arange(len(lens)), lens)              # [K]: owner of each key
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum())) - starts[seq_of_key]                          # [K]: position in its sequence
    blocks = block_tables.long()[seq_of_key, pos // block_size]                       # [K]: physical block
    return blocks * block_size + pos % block_size


class PagedAttention(nn.Module):
    """Drop-in for m04's Attention backend, reading and writing one layer's paged KV cache."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.k_cache, self.v_cache = k_cache, v_cache           # [num_blocks, P, nKV, D] each

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q [N, nH, D], k/v [N, nKV, D] (the new tokens) -> [N, nH, D]."""
        store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        slots = gather_slots(ctx.block_tables, ctx.context_lens, self.k_cache.shape[1])
        keys = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]    # [K, nKV, D]
        values = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]
        return varlen_attention(q, keys, values, ctx.cu_seqlens_q, ctx.cu_seqlens_k, self.scale)


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
        if not self.free_slots:
            raise RuntimeError("GDN state pool exhausted: more running sequences than max_num_seqs")
        slot = self.free_slots.pop()
        # one call for every layer's two states (a zero_ per tensor is 2 launches per linear layer on a GPU)
        torch._foreach_zero_([self.conv[i][slot] for i in self.conv] + [self.ssm[i][slot] for i in self.conv])
        self.slot_of[seq.seq_id] = slot
        return slot

    def free(self, seq: Sequence) -> None:
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def states(self, seqs: list[Sequence]) -> tuple[torch.Tensor, dict[int, GDNState]]:
        """Gather the batch's states (copies, in batch order) for the model; commit() writes them back."""
        for seq in seqs:
            if seq.seq_id not in self.slot_of:
                if seq.num_cached_tokens:
                    raise RuntimeError(f"sequence {seq.seq_id} resumes at token {seq.num_cached_tokens} without a "
                                       "GDN state (prefix caching must be off for hybrid models)")
                self.allocate(seq)
        slots = torch.tensor([self.slot_of[s.seq_id] for s in seqs])
        return slots, {i: GDNState(conv=self.conv[i][slots], ssm=self.ssm[i][slots]) for i in self.conv}

    def commit(self, slots: torch.Tensor, states: dict[int, GDNState]) -> None:
        for i, state in states.items():
            self.conv[i][slots] = state.conv
            self.ssm[i][slots] = state.ssm


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
        input_ids, positions, ctx = prepare_batch(seqs, self.block_size)
        slots, states = self.gdn_pool.states(seqs) if self.gdn_pool is not None else (None, None)
        hidden = self.model(input_ids, positions, ctx, states)                      # [N, H]
        if states is not None:
            self.gdn_pool.commit(slots, states)
        # only sequences whose tokens are now all computed sample; a partial prefill chunk draws nothing,
        # so a seeded request gives the same tokens however its prompt was chunked
        done = [i for i, s in enumerate(seqs) if s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens]
        tokens = [-1] * len(seqs)
        if done:
            last_rows = ctx.cu_seqlens_q[1:].long()[done] - 1                       # last new token of each
            logits = self.model.compute_logits(hidden[last_rows])                  # [B_done, V]
            for i in done:
                if seqs[i].seq_id not in self.generators:
                    self.generators[seqs[i].seq_id] = make_generator(seqs[i].sampling_params.seed)
            sampled = self.sampler(logits, [seqs[i].sampling_params for i in done],
                                   [self.generators[seqs[i].seq_id] for i in done])
            for i, token in zip(done, sampled.tolist()):
                tokens[i] = token
        return tokens
