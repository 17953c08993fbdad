"""E07 · Prefix caching for hybrid models: Gated DeltaNet state snapshots keyed by the prefix hash.

A KV block can be shared because attention only needs the keys of the prefix. A Gated DeltaNet layer
needs the *state* after the prefix: the conv state [C, K-1] and the recurrent state [nv, dk, dv] of every
linear layer. So at block boundaries the engine copies a sequence's GDN state into a snapshot cache keyed
by the chained hash (e02) of the block that ends there; a request whose prefix reaches such a block copies
the snapshot into its fresh pool slot (e04) and prefills from there, reusing the KV blocks as before.

    where     the state exists only at the end of a step's chunk. For hybrid models the scheduler cuts a
              prefill chunk at a block boundary where the budget ran out (rounded down) and where the
              request leaves the KV blocks already cached for it (a shared system prompt: the branch
              point); the prompt's last chunk runs to its end, so its first token costs no extra step.
              After the step, a chunk that ended on boundary j*P snapshots the state under block j-1's
              hash. Decodes snapshot at boundaries too, but a sequence keeps only its newest snapshot past
              its prompt: the next turn of a chat starts with this whole answer, so it resumes from there.
    hit       e02's run of KV hits, cut back to its longest prefix whose last block has a valid snapshot:
              KV without the state is useless to a GDN layer, a state without its KV useless to attention.
    valid     the hash names every token before the boundary, so the state is a function of it. A hit also
              needs every KV block of the prefix computed: e02 registers a block when it is allocated, so
              a block registered by a sequence that has not run yet (or handed out again after eviction)
              is no hit. A snapshot whose hash left the KV cache can never be reached; purge drops it.
    budget    num_snapshots rows preallocated like the pool (Qwen3.5-35B-A3B: 30 layers x (8192 x 3 conv +
              32 x 128 x 128 fp32 recurrent) = ~62 MiB each); LRU: a hit or a new snapshot moves an entry
              to the back, a full cache evicts the front, entries whose blocks are gone go first.
    restore   a copy into the pool slot before the step (outside any CUDA graph); preemption and abort free
              the slot as before; snapshots are copies, so nothing points into the pool.

Lesson: lessons/e07_hybrid_prefix_cache.md (书 §E.7).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .e02_block_manager import BlockManager, Sequence
from .e03_scheduler import Scheduler
from .e04_model_runner import GDNStatePool


def chunk_end(start: int, end: int, num_tokens: int, block_size: int, shared_end: int = 0) -> int:
    """Where a prefill chunk [start, end) of a sequence of num_tokens tokens should stop.

    shared_end: tokens of the sequence whose KV blocks were already cached when it was admitted. The
    result is shared_end when it lies inside the chunk; else end itself when the chunk reaches the end of
    the tokens (end == num_tokens: the first token comes this step); else end rounded down to a block
    boundary (the budget ran out), but never <= start (then the chunk is left as it is: a chunk that cannot
    end on a boundary is still computed).
    """
    raise NotImplementedError("e07: 请实现 chunk_end（见 lessons/e07_hybrid_prefix_cache.md）")


def state_views(pool: GDNStatePool, index: int) -> list[torch.Tensor]:
    """Every linear layer's conv state, then every recurrent state, at row `index` of a pool (or of the snapshot
    store, which is one too): the list to hand torch._foreach_copy_, which copies all of them in one call. On a GPU a
    copy_ per tensor is 2 x 30 launches per snapshot for Qwen3.5-35B-A3B, each with its Python dispatch cost."""
    return [pool.conv[i][index] for i in pool.conv] + [pool.ssm[i][index] for i in pool.conv]


class StateCache:
    """GDN state snapshots keyed by the chained hash of the block at whose end they were taken (LRU, budgeted)."""

    def __init__(self, model: nn.Module, num_snapshots: int, dtype: torch.dtype = torch.float32):
        if isinstance(num_snapshots, bool) or not isinstance(num_snapshots, int) or num_snapshots < 1:
            raise ValueError(f"num_state_snapshots must be a positive int, got {num_snapshots!r}")
        self.store = GDNStatePool(model, num_snapshots, dtype)   # same tensors as the pool: one row per snapshot
        self.num_snapshots = num_snapshots
        self.free_rows = list(range(num_snapshots - 1, -1, -1))
        self.entries: OrderedDict[int, int] = OrderedDict()      # prefix hash -> row; front = least recently used
        self.block_manager: HybridBlockManager | None = None     # set by HybridBlockManager
        self.newest: dict[int, int] = {}                         # seq_id -> hash of its newest snapshot past its prompt
        self.num_captured = self.num_restored = self.num_evicted = self.tokens_restored = 0

    @property
    def stats(self) -> dict[str, int]:
        return {"state_snapshots": len(self.entries), "snapshots_captured": self.num_captured,
                "snapshot_hits": self.num_restored, "snapshots_evicted": self.num_evicted,
                "prefill_tokens_saved": self.tokens_restored}

    def purge(self) -> None:
        """Drop the entries whose hash stopped being a KV cache entry: without its blocks a snapshot is never a hit."""
        for h in [h for h in self.entries if h not in self.block_manager.hash_to_block_id]:
            self.free_rows.append(self.entries.pop(h))

    def _take_row(self) -> int:
        """A free row of the store: rows of dead entries first, else the least recently used entry is evicted."""
        raise NotImplementedError("e07: 请实现 StateCache._take_row（见 lessons/e07_hybrid_prefix_cache.md）")

    def lookup(self, hits: list[int]) -> int:
        """How many of the leading KV hits (block ids, in order, from e02's lookup) can be used: the longest
        prefix hits[:n] whose blocks all hold computed KV and whose last block's hash has a snapshot (0 if
        none). The entry found moves to the back of the LRU order."""
        raise NotImplementedError("e07: 请实现 StateCache.lookup（见 lessons/e07_hybrid_prefix_cache.md）")

    def capture(self, seq: Sequence, pool: GDNStatePool) -> bool:
        """After a step (before postprocess): snapshot seq's state if what it computed ended on a block boundary.

        The step computed [num_cached_tokens, num_cached_tokens + num_scheduled_tokens). The entry is keyed by
        the hash of the block that ends at the boundary (it names every token before it); an entry already
        there is refreshed, else a row is taken (LRU). Past the prompt (a decode crosses a boundary every P
        tokens) a sequence keeps one snapshot, its newest: the one it took before is dropped first.
        """
        raise NotImplementedError("e07: 请实现 StateCache.capture（见 lessons/e07_hybrid_prefix_cache.md）")

    def restore(self, seq: Sequence, pool: GDNStatePool) -> int:
        """seq was admitted with num_cached_tokens > 0 from a snapshot hit: give it a pool slot holding that state."""
        raise NotImplementedError("e07: 请实现 StateCache.restore（见 lessons/e07_hybrid_prefix_cache.md）")


class HybridBlockManager(BlockManager):
    """e02's block manager whose prefix hits stop at the last computed block that has a GDN state snapshot."""

    def __init__(self, num_blocks: int, block_size: int, state_cache: StateCache):
        super().__init__(num_blocks, block_size, enable_prefix_caching=True)
        self.state_cache = state_cache
        state_cache.block_manager = self
        self.computed = [False] * num_blocks          # the block holds the KV of all its tokens
        self.shared_tokens: dict[int, int] = {}      # seq_id -> tokens of its KV hit run at admission
        self.wanted: set[int] = set()                # blocks being computed that a waiting request waits for

    def _allocate_block(self) -> int:
        block_id = super()._allocate_block()
        self.computed[block_id] = False               # a new owner: registered now, written by a later step
        self.wanted.discard(block_id)
        return block_id

    def can_allocate(self, seq: Sequence) -> bool:
        """e02's answer, except that a request waits while another request is computing most of what it would
        compute: when its KV hit run ends in a block registered but not computed yet (the owner runs now) and
        that run covers at least half of its uncached tokens. It asks for a snapshot at the run's end (the
        owner's chunk is cut there) and next step resumes after it: a system prompt is computed once, not once
        per request admitted in the same step (SGLang's in-batch prefix caching does the same)."""
        raw = super()._cached_prefix(seq)
        if raw and not self.computed[raw[-1]]:
            usable = self.state_cache.lookup(raw)                 # = len(self._cached_prefix(seq)), hashed once
            if 2 * (len(raw) - usable) * self.block_size >= seq.num_tokens - usable * self.block_size:
                self.wanted.add(raw[-1])
                return False
        return super().can_allocate(seq)

    def branch_point(self, seq: Sequence) -> int:
        """Where seq's next prefill chunk should stop so that its snapshot is shared: the first end of one of
        its uncomputed blocks that a waiting request waits for, else its KV hit run at admission (0: none)."""
        start = seq.num_cached_tokens // self.block_size
        if self.wanted:
            for i in range(start, len(seq.block_table)):
                if seq.block_table[i] in self.wanted:
                    return (i + 1) * self.block_size
        return self.shared_tokens.get(seq.seq_id, 0)

    def _cache_block(self, block_id: int, h: int, token_ids: list[int]) -> None:
        """e02's registration, except that a copy not computed yet never shadows a registered copy that is:
        it carries the hash (snapshots are keyed by it), but lookups keep finding the computed one."""
        old = self.hash_to_block_id.get(h, -1)
        if old != -1 and old != block_id and self.computed[old]:
            self.blocks[block_id].update(h, token_ids)
            return
        super()._cache_block(block_id, h, token_ids)

    def mark_computed(self, seq: Sequence) -> None:
        """After a step: the blocks that seq's tokens [0, num_cached + num_scheduled) fill completely hold their KV.
        A block computed now becomes the registered copy of its content if the registered one is not computed
        (several requests admitted in one step all register the same prefix; the last one may compute least)."""
        done = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        for block_id in seq.block_table[seq.num_cached_tokens // self.block_size:done]:
            self.computed[block_id] = True
            self.wanted.discard(block_id)
            h = self.blocks[block_id].hash
            if h != -1 and not self.computed[self.hash_to_block_id.get(h, block_id)]:
                self.hash_to_block_id[h] = block_id

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        hits = super()._cached_prefix(seq)
        return hits[:self.state_cache.lookup(hits)]

    def allocate(self, seq: Sequence) -> None:
        self.shared_tokens[seq.seq_id] = len(super()._cached_prefix(seq)) * self.block_size
        super().allocate(seq)

    def deallocate(self, seq: Sequence) -> None:
        super().deallocate(seq)
        self.shared_tokens.pop(seq.seq_id, None)
        self.state_cache.newest.pop(seq.seq_id, None)   # its snapshots stay; only the bookkeeping goes


class HybridScheduler(Scheduler):
    """e03's scheduler with every prefill chunk cut by chunk_end, so that chunks end where snapshots are useful."""

    def schedule(self) -> list[Sequence]:
        batch = super().schedule()
        bm = self.block_manager
        for seq in batch:
            if seq.num_scheduled_tokens > 1:
                start = seq.num_cached_tokens
                end = chunk_end(start, start + seq.num_scheduled_tokens, seq.num_tokens, bm.block_size,
                                bm.branch_point(seq))
                seq.num_scheduled_tokens = end - start
        return batch


class SnapshotRunner:
    """A model runner (e04's or g01's) that restores snapshots before a step and captures them after it."""

    def __init__(self, runner, state_cache: StateCache):
        self.runner, self.state_cache = runner, state_cache

    def run(self, seqs: list[Sequence]) -> list[int]:
        pool = self.runner.gdn_pool
        for seq in seqs:                                 # admitted from a snapshot hit: no slot yet
            if seq.num_cached_tokens and seq.seq_id not in pool.slot_of:
                self.state_cache.restore(seq, pool)
        tokens = self.runner.run(seqs)
        for seq in seqs:
            self.state_cache.block_manager.mark_computed(seq)
            self.state_cache.capture(seq, pool)
        return tokens

    def __getattr__(self, name: str):                    # release, gdn_pool, graphs, ... are the runner's
        return getattr(self.runner, name)
