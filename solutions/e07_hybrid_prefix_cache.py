"""E07 · Prefix caching for hybrid models: Gated DeltaNet state snapshots keyed by the prefix hash.

A KV block can be shared because attention only needs the keys of the prefix. A Gated DeltaNet layer
needs the *state* after the prefix: the conv state [C, K-1] and the recurrent state [nv, dk, dv] of every
linear layer. So at block boundaries the engine copies a sequence's GDN state into a snapshot cache keyed
by the chained hash (e02) of the block that ends there; a request whose prefix reaches such a block copies
the snapshot into its fresh pool slot (e04) and prefills from there, reusing the KV blocks as before.

    where     the state exists only at the end of a step's chunk. For hybrid models the scheduler cuts a
              prefill chunk at a block boundary: where the budget ran out (rounded down), at the prompt's
              last boundary (the tail runs in the next step), and where the request leaves the KV blocks
              already cached for it (a shared system prompt: the branch point). After the step, a chunk
              that ended on boundary j*P snapshots the state under block j-1's hash. Decodes never do.
    hit       e02's run of KV hits, cut back to its longest prefix whose last block has a valid snapshot:
              KV without the state is useless to a GDN layer, a state without its KV useless to attention.
    valid     a snapshot records the block ids it was taken with; it is a hit only while the KV lookup
              finds exactly those blocks (never after one of them was evicted, never on blocks another
              sequence registered but has not computed yet).
    budget    num_snapshots rows preallocated like the pool (Qwen3.5-35B-A3B: 30 layers x (8192 x 3 conv +
              32 x 128 x 128 fp32 recurrent) = ~62 MiB each); LRU: a hit or a new snapshot moves an entry
              to the back, a full cache evicts the front, entries whose blocks are gone go first.
    restore   a copy into the pool slot before the step (outside any CUDA graph); preemption and abort free
              the slot as before; snapshots are copies, so nothing points into the pool.

Lesson: lessons/e07_hybrid_prefix_cache.md (书 §E.7).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from .e02_block_manager import BlockManager, Sequence
from .e03_scheduler import Scheduler
from .e04_model_runner import GDNStatePool


def chunk_end(start: int, end: int, num_tokens: int, block_size: int, shared_end: int = 0) -> int:
    """Where a prefill chunk [start, end) of a sequence of num_tokens tokens should stop.

    shared_end: tokens of the sequence whose KV blocks were already cached when it was admitted. The
    result is shared_end when it lies inside the chunk; otherwise end rounded down to a block boundary
    (end < num_tokens: the budget ran out) or the prompt's last boundary (end == num_tokens); never <= start
    (then the chunk is left as it is: a chunk that cannot end on a boundary is still computed).
    """
    if start < shared_end < end:
        return shared_end                                   # the branch point of a shared prefix
    if end < num_tokens:
        cut = end - end % block_size                        # the budget ran out: back to the last boundary
    else:
        cut = num_tokens - num_tokens % block_size          # the prompt's last boundary; the tail runs next step
    return cut if cut > start else end


@dataclass
class Snapshot:
    """One cache entry: a row of the snapshot store and the KV blocks of the prefix it was taken after."""
    row: int
    block_ids: tuple[int, ...]


class StateCache:
    """GDN state snapshots keyed by the chained hash of the block at whose end they were taken (LRU, budgeted)."""

    def __init__(self, model: nn.Module, num_snapshots: int, dtype: torch.dtype = torch.float32):
        if isinstance(num_snapshots, bool) or not isinstance(num_snapshots, int) or num_snapshots < 1:
            raise ValueError(f"num_state_snapshots must be a positive int, got {num_snapshots!r}")
        self.store = GDNStatePool(model, num_snapshots, dtype)   # same tensors as the pool: one row per snapshot
        self.num_snapshots = num_snapshots
        self.free_rows = list(range(num_snapshots - 1, -1, -1))
        self.entries: OrderedDict[int, Snapshot] = OrderedDict()  # prefix hash -> snapshot; front = least recent
        self.block_manager: BlockManager | None = None           # set by HybridBlockManager
        self.num_captured = self.num_restored = self.num_evicted = self.tokens_restored = 0

    @property
    def stats(self) -> dict[str, int]:
        return {"state_snapshots": len(self.entries), "snapshots_captured": self.num_captured,
                "snapshot_hits": self.num_restored, "snapshots_evicted": self.num_evicted,
                "prefill_tokens_saved": self.tokens_restored}

    def _registered(self, block_ids: tuple[int, ...]) -> bool:
        """Is every block still the cache entry that a lookup of its hash finds?"""
        bm = self.block_manager
        return all(bm.blocks[b].hash != -1 and bm.hash_to_block_id.get(bm.blocks[b].hash) == b for b in block_ids)

    def purge(self) -> None:
        """Drop the entries whose blocks stopped being cache entries (evicted, or re-registered elsewhere)."""
        for h in [h for h, snap in self.entries.items() if not self._registered(snap.block_ids)]:
            self.free_rows.append(self.entries.pop(h).row)

    def _take_row(self) -> int:
        """A free row: dead entries first, then the least recently used one is evicted."""
        if not self.free_rows:
            self.purge()
        if not self.free_rows:
            _, snap = self.entries.popitem(last=False)
            self.num_evicted += 1
            return snap.row
        return self.free_rows.pop()

    def lookup(self, hits: list[int]) -> int:
        """How many of the leading KV hits (block ids, in order) can be used: the longest prefix hits[:n] whose
        last block's hash has a snapshot taken with exactly those blocks (0 if none). A hit is moved to the
        back of the LRU order."""
        bm = self.block_manager
        for n in range(len(hits), 0, -1):
            h = bm.blocks[hits[n - 1]].hash
            snap = self.entries.get(h)
            if snap is not None and snap.block_ids == tuple(hits[:n]):
                self.entries.move_to_end(h)
                return n
        return 0

    def capture(self, seq: Sequence, pool: GDNStatePool) -> bool:
        """After a step (before postprocess): snapshot seq's state if its prefill chunk ended on a block boundary.

        The chunk computed [num_cached_tokens, num_cached_tokens + num_scheduled_tokens). Decodes (one token)
        never snapshot. The entry is keyed by the hash of the block ending at the boundary and records the
        block ids up to it; when those blocks are not the registered cache entries, nothing is taken.
        """
        bm = self.block_manager
        end = seq.num_cached_tokens + seq.num_scheduled_tokens
        if seq.num_scheduled_tokens < 2 or end % bm.block_size:
            return False
        block_ids = tuple(seq.block_table[:end // bm.block_size])   # blocks 0 .. j-1 for boundary j*P
        if not self._registered(block_ids):
            return False
        h = bm.blocks[block_ids[-1]].hash
        old = self.entries.pop(h, None)
        row = old.row if old is not None else self._take_row()
        src = pool.slot_of[seq.seq_id]
        for i in pool.conv:
            self.store.conv[i][row].copy_(pool.conv[i][src])
            self.store.ssm[i][row].copy_(pool.ssm[i][src])
        self.entries[h] = Snapshot(row, block_ids)
        self.num_captured += 1
        return True

    def restore(self, seq: Sequence, pool: GDNStatePool) -> int:
        """seq was admitted with num_cached_tokens > 0 from a snapshot hit: give it a pool slot holding that state."""
        bm = self.block_manager
        n = seq.num_cached_tokens // bm.block_size
        snap = self.entries.get(bm.blocks[seq.block_table[n - 1]].hash)
        if snap is None or snap.block_ids != tuple(seq.block_table[:n]):
            raise RuntimeError(f"sequence {seq.seq_id} resumes at token {seq.num_cached_tokens} but no snapshot "
                               "was taken there with its blocks")
        slot = pool.allocate(seq)
        for i in pool.conv:
            pool.conv[i][slot].copy_(self.store.conv[i][snap.row])
            pool.ssm[i][slot].copy_(self.store.ssm[i][snap.row])
        self.num_restored += 1
        self.tokens_restored += seq.num_cached_tokens
        return slot


class HybridBlockManager(BlockManager):
    """e02's block manager whose prefix hits stop at the last block that has a GDN state snapshot."""

    def __init__(self, num_blocks: int, block_size: int, state_cache: StateCache):
        super().__init__(num_blocks, block_size, enable_prefix_caching=True)
        self.state_cache = state_cache
        state_cache.block_manager = self
        self.shared_tokens: dict[int, int] = {}      # seq_id -> tokens of its KV hit run at admission

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        hits = super()._cached_prefix(seq)
        return hits[:self.state_cache.lookup(hits)]

    def allocate(self, seq: Sequence) -> None:
        self.shared_tokens[seq.seq_id] = len(super()._cached_prefix(seq)) * self.block_size
        super().allocate(seq)

    def deallocate(self, seq: Sequence) -> None:
        super().deallocate(seq)
        self.shared_tokens.pop(seq.seq_id, None)


class HybridScheduler(Scheduler):
    """e03's scheduler with every prefill chunk cut by chunk_end, so that chunks end where snapshots are useful."""

    def schedule(self) -> list[Sequence]:
        batch = super().schedule()
        bm = self.block_manager
        for seq in batch:
            if seq.num_scheduled_tokens > 1:
                start = seq.num_cached_tokens
                end = chunk_end(start, start + seq.num_scheduled_tokens, seq.num_tokens, bm.block_size,
                                bm.shared_tokens.get(seq.seq_id, 0))
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
            self.state_cache.capture(seq, pool)
        return tokens

    def __getattr__(self, name: str):                    # release, gdn_pool, graphs, ... are the runner's
        return getattr(self.runner, name)
