"""E07 · Prefix caching for hybrid models: Gated DeltaNet state snapshots keyed by the prefix hash.

A KV block can be shared because attention only needs the keys of the prefix. A Gated DeltaNet layer
needs the *state* after the prefix: the conv state [C, K-1] and the recurrent state [nv, dk, dv] of every
linear layer. So at block boundaries the engine copies a sequence's GDN state into a snapshot cache keyed
by the chained hash (e02) of the block that ends there; a request whose prefix reaches such a block copies
the snapshot into its fresh pool slot (e04) and prefills from there, reusing the KV blocks as before.

The terms and the goals are the card's (术语, 目标与约束); each task's docstring is its contract: what it is
given, what it returns, what must hold afterwards. How to get there is the exercise. P = block_size.

    snapshot    the GDN state after t[0, j*P), keyed by the chained hash of block j-1 (it names all of t[0, j*P)).
    computed    a block whose KV holds all of its P tokens. e02 registers a full block's hash at admission,
                before anything is computed; a block handed to a new owner holds someone else's old KV.
    registered  the copy of a content that hash_to_block_id names; other copies only carry the hash.
    raw hit     e02's KV hit run (super()._cached_prefix): registered blocks, computed or not.
    usable hit  the leading part of it a request can resume from (lookup).
    wanted      blocks a waiting request waits for: their owner stops its chunk at their end.
    branch point  where a sequence's next prefill chunk stops so that others can resume there (branch_point).

Never: a hit on KV or state that was not computed; more snapshots than num_snapshots; a row of the store lost
or in two places; a restore that goes on from a zero state.

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

    shared_end: the branch point from HybridBlockManager.branch_point, a multiple of block_size or 0. The card's
    four cases, first match wins: a branch point strictly inside the chunk; the prompt's last chunk (end ==
    num_tokens); a chunk the budget cut short; a chunk with no block boundary to stop at.
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
        """A row of the store for a new snapshot; afterwards it is in neither free_rows nor entries (N3). Which row
        it may take is the card's G5 (要一行时). num_evicted (stats: snapshots_evicted) counts the entries it drops
        that could still be hit; an entry dropped by purge is not an eviction."""
        if not self.free_rows:
            self.purge()
        if not self.free_rows:
            _, row = self.entries.popitem(last=False)
            self.num_evicted += 1
            return row
        return self.free_rows.pop()

    def lookup(self, hits: list[int]) -> int:
        """hits: a raw hit run (card: 原始命中串; block ids in the sequence's order, from e02's _cached_prefix).
        Returns how many of its leading blocks make the usable hit (card: 可用命中), 0 when there is none: the
        card's N1 and G4. The snapshot it resumes from counts as used (G5)."""
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
        """After a step (before postprocess) that computed t[c, e) of seq (c = num_cached_tokens,
        e = c + num_scheduled_tokens) and left its state in seq's pool slot: take the snapshot (card: 快照) that
        this chunk's end allows, if any; returns whether one was taken.

        Records: the snapshot in a row of store, under its key in entries, counted as used (G5); num_captured
        (stats: snapshots_captured) += 1 per snapshot taken; newest[seq_id] = the key of seq's newest snapshot
        past its prompt (card: prompt 之后). Replacing seq's own older snapshot or re-taking a key already in entries
        is not an eviction (num_evicted is unchanged). Responsible for the card's G5 (which snapshots stay, which
        row a new one takes) and N3.
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
        """seq was admitted from a usable hit, num_cached_tokens = n * P > 0: give it a pool slot (pool.allocate(seq))
        holding every conv and recurrent state of the snapshot it resumes from (card: 快照, its key), and return
        the slot. Records: num_restored += 1, tokens_restored += num_cached_tokens (stats: snapshot_hits,
        prefill_tokens_saved); entries is left as it is (G5). No snapshot to resume from: the card's N4."""
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
        """e02's allocation: every block e02 hands out comes from here. Afterwards the block belongs to a new
        owner that has not run yet, and computed and wanted agree with the card's definitions for it
        (算好, wanted; N1)."""
        block_id = super()._allocate_block()
        self.computed[block_id] = False               # a new owner: registered now, written by a later step
        self.wanted.discard(block_id)
        return block_id

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether seq may be admitted now: False when e02 says so, or when seq waits (when, and the pay-off
        threshold: the card's G1; N2). Records: when it answers False because seq waits, the block that ends the
        prefix seq waits for is in wanted (card: wanted); otherwise wanted is unchanged. It only answers: no
        block is allocated."""
        raw = super()._cached_prefix(seq)
        if raw and not self.computed[raw[-1]]:
            usable = self.state_cache.lookup(raw)                 # = len(self._cached_prefix(seq)), hashed once
            if 2 * (len(raw) - usable) * self.block_size >= seq.num_tokens - usable * self.block_size:
                self.wanted.add(raw[-1])
                return False
        return super().can_allocate(seq)

    def branch_point(self, seq: Sequence) -> int:
        """seq's branch point (card: 分叉点, from wanted and shared_tokens): the shared_end that HybridScheduler
        hands chunk_end for seq's next prefill chunk, a multiple of block_size, 0 when seq has none. Responsible
        for the card's G1 (the request computing a prefix stops where a waiting one wants it) and, with
        chunk_end, G2."""
        start = seq.num_cached_tokens // self.block_size
        if self.wanted:
            for i in range(start, len(seq.block_table)):
                if seq.block_table[i] in self.wanted:
                    return (i + 1) * self.block_size
        return self.shared_tokens.get(seq.seq_id, 0)

    def _cache_block(self, block_id: int, h: int, token_ids: list[int]) -> None:
        """e02's registration of a full block under hash h, at admission (its KV is not computed yet).
        Afterwards blocks[block_id] carries h and token_ids, whether or not it is the registered copy
        (card: 登记), and the card's G3 holds."""
        old = self.hash_to_block_id.get(h, -1)
        if old != -1 and old != block_id and self.computed[old]:
            self.blocks[block_id].update(h, token_ids)
            return
        super()._cache_block(block_id, h, token_ids)

    def mark_computed(self, seq: Sequence) -> None:
        """After a step (before postprocess) that computed t[c, e) of seq (c = num_cached_tokens,
        e = c + num_scheduled_tokens): afterwards computed and wanted agree with the card's definitions
        (算好, wanted; N1) for seq's blocks, and the card's G3 holds for their hashes."""
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
