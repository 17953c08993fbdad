"""E07 · Prefix caching for hybrid models: Gated DeltaNet state snapshots keyed by the prefix hash.

A KV block can be shared because attention only needs the keys of the prefix. A Gated DeltaNet layer
needs the *state* after the prefix: the conv state [C, K-1] and the recurrent state [nv, dk, dv] of every
linear layer. So at block boundaries the engine copies a sequence's GDN state into a snapshot cache keyed
by the chained hash (e02) of the block that ends there; a request whose prefix reaches such a block copies
the snapshot into its fresh pool slot (e04) and prefills from there, reusing the KV blocks as before.
The rules, in the words of the card's 定义 table (P = block_size):

    snapshot  after a step that computed t[c, e) with e % P == 0: the GDN state of t[0, e), keyed by the
              hash of block e/P - 1 (it names every token of t[0, e)); prefill and decode alike.
    computed  a block is computed when its KV has been written: not when e02 registers it (at admission),
              but after the step whose tokens fill it; a block handed to a new owner is not computed.
    hit       e02's KV hit run, cut back to its longest prefix hits[:n] whose blocks are all computed and
              whose last block's hash has a snapshot: num_cached_tokens = n * P (0 if there is none).
    wait      at admission: when the KV hit run ends in a block that is not computed (its owner computes it
              in this step) and the run past the usable hit covers at least half of the request's uncached
              tokens (2 * (len(raw) - usable) * P >= num_tokens - usable * P), the request is not admitted
              this step and that block is wanted: its owner's chunk stops at the block's end (the branch
              point) and snapshots there; next step the request resumes from that snapshot.
    lifetime  at most num_snapshots entries, one row of the store each. A new snapshot takes a free row; when
              there is none, purge frees the rows of entries whose hash is no longer a KV cache entry (they
              can never be hit again); when there is still none, the least recently used entry is evicted.
              A hit or a new snapshot makes its entry the most recently used. Past its prompt (e > num
              prompt tokens) a sequence keeps one snapshot, its newest: the one before it leaves first.
    restore   before the step, a copy of the snapshot into the slot pool.allocate(seq) gives (outside any
              CUDA graph); no snapshot at the hit is a bug: RuntimeError, never a zero state.

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
    """Where a prefill chunk [start, end) of a sequence of num_tokens tokens should stop: a value in (start, end].

    shared_end: the branch point from HybridBlockManager.branch_point, a multiple of block_size or 0. The first
    rule that applies: shared_end when start < shared_end < end; end when end == num_tokens (the prompt's last
    chunk: its first token comes this step); the last block boundary b with start < b <= end (the budget ran
    out); end itself when the chunk holds no such boundary (it is computed, no snapshot is taken).
    """
    if start < shared_end < end:
        return shared_end                                   # the branch point of a shared prefix
    if end == num_tokens:
        return end                                          # the prompt's end: its first token comes this step
    cut = end - end % block_size                            # the budget ran out: back to the last boundary
    return cut if cut > start else end


def state_views(pool: GDNStatePool, index: int) -> list[torch.Tensor]:
    """Every linear layer's conv state, then every recurrent state, at row `index` of a pool (or of the snapshot
    store, which is one too): the list to hand torch._foreach_copy_, which copies all of them in one call. On a GPU a
    copy_ per tensor is 2 x 30 launches per snapshot for Qwen3.5-35B-A3B, each with its Python dispatch cost."""
    return [pool.conv[i][index] for i in pool.conv] + [pool.ssm[i][index] for i in pool.conv]


class StateCache:
    """GDN state snapshots keyed by the chained hash of the block at whose end they were taken (LRU, budgeted).

    Invariant after every call: each row of the store is either one entry's (entries.values()) or free
    (free_rows), never both, never twice."""

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
        """Drop every entry that can never be a hit again: its hash is no longer a KV cache entry (not in
        block_manager.hash_to_block_id). Its row becomes free. Not an eviction (num_evicted is unchanged)."""
        for h in [h for h in self.entries if h not in self.block_manager.hash_to_block_id]:
            self.free_rows.append(self.entries.pop(h))

    def _take_row(self) -> int:
        """A row of the store for a new snapshot, taken out of free_rows / entries: a free row if there is one;
        else one that purge frees; else the row of the least recently used entry, which is evicted
        (num_evicted += 1)."""
        if not self.free_rows:
            self.purge()
        if not self.free_rows:
            _, row = self.entries.popitem(last=False)
            self.num_evicted += 1
            return row
        return self.free_rows.pop()

    def lookup(self, hits: list[int]) -> int:
        """How many of the leading KV hits (block ids, in order, from e02's _cached_prefix) can be used: the largest
        n such that the blocks hits[:n] are all computed and the hash of block hits[n-1] has an entry (0 if none).
        That entry becomes the most recently used."""
        bm = self.block_manager
        computed = 0
        while computed < len(hits) and bm.computed[hits[computed]]:
            computed += 1
        for n in range(computed, 0, -1):
            h = bm.blocks[hits[n - 1]].hash
            if h in self.entries:
                self.entries.move_to_end(h)
                return n
        return 0

    def capture(self, seq: Sequence, pool: GDNStatePool) -> bool:
        """After a step (before postprocess), which computed t[c, e) of seq with c = num_cached_tokens and
        e = c + num_scheduled_tokens: take a snapshot when e is a block boundary; returns whether one was taken.

        The snapshot is the state in seq's pool slot, under the hash h of block_table[e // P - 1]; afterwards
        entries[h] holds it and is the most recently used entry (an entry already under h keeps its row), and
        num_captured has grown by 1. Past the prompt (e > num_prompt_tokens) newest[seq_id] = h, and seq's
        previous snapshot past its prompt is gone from entries (its row free) before a row is taken: no other
        entry is evicted while that row is there to use.
        """
        bm = self.block_manager
        end = seq.num_cached_tokens + seq.num_scheduled_tokens
        if end % bm.block_size:
            return False
        h = bm.blocks[seq.block_table[end // bm.block_size - 1]].hash
        if h == -1:
            return False
        if end > seq.num_prompt_tokens:                  # past the prompt: this one replaces the last one taken
            old = self.newest.get(seq.seq_id)
            if old is not None and old != h and old in self.entries:
                self.free_rows.append(self.entries.pop(old))
            self.newest[seq.seq_id] = h
        row = self.entries.pop(h) if h in self.entries else self._take_row()
        torch._foreach_copy_(state_views(self.store, row), state_views(pool, pool.slot_of[seq.seq_id]))
        self.entries[h] = row
        self.num_captured += 1
        return True

    def restore(self, seq: Sequence, pool: GDNStatePool) -> int:
        """seq was admitted from a hit, num_cached_tokens = n * P > 0: give it a pool slot (pool.allocate(seq))
        holding every conv and recurrent state of the snapshot under the hash of block_table[n - 1], and return
        the slot. The snapshot stays in the store (others may resume from it too); num_restored += 1,
        tokens_restored += num_cached_tokens. No snapshot under that hash: RuntimeError, raised before a slot is
        taken (never a zero state)."""
        bm = self.block_manager
        h = bm.blocks[seq.block_table[seq.num_cached_tokens // bm.block_size - 1]].hash
        row = self.entries.get(h)
        if row is None:
            raise RuntimeError(f"sequence {seq.seq_id} resumes at token {seq.num_cached_tokens} but no snapshot "
                               "was taken there")
        slot = pool.allocate(seq)
        torch._foreach_copy_(state_views(pool, slot), state_views(self.store, row))
        self.num_restored += 1
        self.tokens_restored += seq.num_cached_tokens
        return slot


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
        """e02's allocation. The block goes to a new owner that has not run yet: from now on it is not computed,
        and no waiting request waits for it (until its new owner's step, see mark_computed)."""
        block_id = super()._allocate_block()
        self.computed[block_id] = False               # a new owner: registered now, written by a later step
        self.wanted.discard(block_id)
        return block_id

    def can_allocate(self, seq: Sequence) -> bool:
        """e02's answer, unless seq must wait for a prefix another request computes in this step. With raw = e02's
        KV hit run (super()._cached_prefix: registered blocks, computed or not) and usable = the hit lookup
        allows: seq waits when the last block of raw is not computed and 2 * (len(raw) - usable) * P >=
        num_tokens - usable * P; then that block joins wanted and the answer is False."""
        raw = super()._cached_prefix(seq)
        if raw and not self.computed[raw[-1]]:
            usable = self.state_cache.lookup(raw)                 # = len(self._cached_prefix(seq)), hashed once
            if 2 * (len(raw) - usable) * self.block_size >= seq.num_tokens - usable * self.block_size:
                self.wanted.add(raw[-1])
                return False
        return super().can_allocate(seq)

    def branch_point(self, seq: Sequence) -> int:
        """The shared_end of seq's next prefill chunk (see chunk_end): the end of the first of seq's blocks, from
        the one holding token num_cached_tokens on, that is in wanted; else shared_tokens[seq_id]; else 0."""
        start = seq.num_cached_tokens // self.block_size
        if self.wanted:
            for i in range(start, len(seq.block_table)):
                if seq.block_table[i] in self.wanted:
                    return (i + 1) * self.block_size
        return self.shared_tokens.get(seq.seq_id, 0)

    def _cache_block(self, block_id: int, h: int, token_ids: list[int]) -> None:
        """e02's registration of a full block under hash h, except that a registered copy that is computed keeps
        the registration: then the new block only carries the hash and tokens (blocks[block_id].hash = h)."""
        old = self.hash_to_block_id.get(h, -1)
        if old != -1 and old != block_id and self.computed[old]:
            self.blocks[block_id].update(h, token_ids)
            return
        super()._cache_block(block_id, h, token_ids)

    def mark_computed(self, seq: Sequence) -> None:
        """After a step (before postprocess): the blocks that seq's tokens t[0, num_cached_tokens +
        num_scheduled_tokens) fill completely are computed, and nobody waits for them any more.
        Such a block whose hash is registered to a copy that is not computed becomes the registered copy."""
        done = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        for block_id in seq.block_table[seq.num_cached_tokens // self.block_size:done]:
            self.computed[block_id] = True
            self.wanted.discard(block_id)
            h = self.blocks[block_id].hash                # a full block: always hashed
            if not self.computed[self.hash_to_block_id.get(h, block_id)]:
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
