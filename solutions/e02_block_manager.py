"""E02 · Paged KV cache: a block manager with a free list, reference counts and prefix caching.

The KV cache is a pool of `num_blocks` physical blocks of `block_size` token slots each. A sequence owns
a block table: its logical block i (tokens i*bs .. i*bs+bs-1) lives in physical block block_table[i].

    num_blocks(seq) = ceil(len(seq) / bs)
    slot(token t)   = block_table[t // bs] * bs + t % bs

Prefix caching by chained block hashes. Only a FULL block is a cache entry, named by

    h_0 = H(tokens of block 0, -1),    h_i = H(tokens of block i, h_{i-1})

so h_i covers every token up to the end of block i: the KV of a block depends on its whole prefix, not
just on its own tokens. hash_to_block_id maps h_i to the physical block that holds that content.

- allocate: walk the full blocks from block 0; a hit (hash found AND token ids equal) is shared (ref += 1);
  the first miss ends the run; the remaining blocks are fresh. The last block is never a hit, so at
  least one token is left to compute (its logits give the next token).
- ref_count = number of live sequences holding the block. A block reaching 0 goes back to the tail of
  the free list but keeps its hash: it is still a cache entry until the free list hands it out again,
  and only then is its entry evicted. Sequences free their blocks last block first, so a prefix
  outlives its continuations. (A block whose KV was never computed, beyond seq.num_cached_tokens when a
  chunked prefill is preempted, is evicted at once: a cache entry must hold real KV.)
- may_append, after a token was appended: a new block when that token opened one; when it filled the
  last block, the block is registered under its chained hash.

Lesson: lessons/e02_block_manager.md (#9, book §E.2).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import count

from .e01_sampling import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: prompt + completion token ids, its block table and its progress through the cache.

    num_cached_tokens: tokens whose KV is already in the cache (prefix-cache hits + computed in earlier steps).
    num_scheduled_tokens: tokens to compute in the current step (set by the scheduler).
    """
    block_size = 16          # class attribute: the engine sets it to the KV cache block size
    counter = count()        # global source of seq ids

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None):
        if not token_ids:
            raise ValueError("a sequence needs at least one token (empty prompt)")
        self.token_ids = list(token_ids)                 # our own copy: it grows as tokens are generated
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.seq_id = next(Sequence.counter)
        self.status = SequenceStatus.WAITING
        self.last_token = self.token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, num_tokens={self.num_tokens}, "
                f"num_cached_tokens={self.num_cached_tokens}, block_table={self.block_table})")

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of logical block i (the last one may be partial)."""
        assert 0 <= i < self.num_blocks, f"block {i} of a sequence with {self.num_blocks} blocks"
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


def compute_block_hash(token_ids: list[int], prefix_hash: int) -> int:
    """Chained hash of one full block: covers prefix_hash (-1 for block 0) and the block's token ids.

    sha256(prefix_hash as 8 little-endian bytes || token ids as int64 little-endian), first 8 bytes of the
    digest as an unsigned int in [0, 2**64). Equal tokens after different prefixes get different hashes.
    """
    h = hashlib.sha256()
    h.update((prefix_hash % 2**64).to_bytes(8, "little"))     # -1 -> ff..ff, never a real hash (those are >= 0)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest()[:8], "little")


@dataclass(eq=False)
class Block:
    """One physical KV block: how many sequences hold it and, when it is a cache entry, what it holds."""
    block_id: int
    ref_count: int = 0
    hash: int = -1                                        # chained hash of its content; -1 = not a cache entry
    token_ids: list[int] = field(default_factory=list)   # the tokens behind that hash (to verify a hit)

    def update(self, hash: int, token_ids: list[int]) -> None:
        self.hash = hash
        self.token_ids = list(token_ids)

    def reset(self) -> None:
        self.ref_count = 0
        self.hash = -1
        self.token_ids = []


class BlockManager:
    """Free list + reference counts + prefix cache over `num_blocks` blocks of `block_size` tokens.

    enable_prefix_caching=False (the engine's choice for Gated DeltaNet hybrids, whose recurrent state is
    not per block): no lookups, no hashes; blocks are only allocated and freed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # the free list as an ordered set: head = next to hand out (evict), tail = freed last; taking a cached
        # block back from the middle is O(1) (a deque's remove scans the whole list: ~0.7 ms at 78k blocks)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.num_prefix_hits = 0                                      # blocks reused from the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _cache_block(self, block_id: int, h: int, token_ids: list[int]) -> None:
        """Make a full block a cache entry under hash h (a newer block with the same content wins)."""
        self.blocks[block_id].update(h, token_ids)
        self.hash_to_block_id[h] = block_id

    def _uncache_block(self, block_id: int) -> None:
        """Evict: the block stops being a cache entry. Its hash entry is dropped only if the entry still
        points at this block (a newer block may have registered the same content since)."""
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.update(-1, [])

    def _allocate_block(self) -> int:
        """Hand the head of the free list to one new owner (ref_count 1) and return its id.

        A block that still carries a hash is a cache entry: it is evicted now, and not earlier.
        """
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        self._uncache_block(block_id)
        block.reset()
        block.ref_count = 1
        self.used_block_ids.add(block_id)
        return block_id

    def _free_block(self, block_id: int) -> None:
        """A block nobody holds any more goes to the tail of the free list, keeping its hash (still cached)."""
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids[block_id] = None

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the leading run of cache hits of seq (empty when prefix caching is off).

        Block i is a hit when hash_to_block_id has its chained hash AND that block holds the same token ids.
        The run stops at the first miss, and never includes the last block (one token must be computed).
        """
        if not self.enable_prefix_caching:
            return []
        hits, h = [], -1
        for i in range(seq.num_blocks - 1):                          # never the last block
            token_ids = seq.block(i)
            h = compute_block_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break                                                # the first miss ends the run
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Are there free blocks for every block of seq that is not a hit on a block someone already holds?"""
        num_shared = sum(self.blocks[b].ref_count > 0 for b in self._cached_prefix(seq))
        return self.num_free_blocks >= seq.num_blocks - num_shared

    def allocate(self, seq: Sequence) -> None:
        """At admission: blocks for all of seq's current tokens; sets seq.num_cached_tokens to the hits.

        Hits are shared (a cached block on the free list is taken back from it); every other block is
        fresh, and each fresh FULL block is registered under its chained hash.
        """
        assert not seq.block_table, "allocate() is for a sequence that holds no blocks"
        assert seq.block_size == self.block_size, (
            f"sequence {seq.seq_id} has block_size {seq.block_size}, the block manager {self.block_size}: "
            "set seq.block_size when the sequence is created (e05 add_request)")
        hits = self._cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:                                 # cached but unreferenced: on the free list
                del self.free_block_ids[block_id]
                self.used_block_ids.add(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        self.num_prefix_hits += len(hits)
        seq.num_cached_tokens = len(hits) * self.block_size

        h = self.blocks[hits[-1]].hash if hits else -1
        for i in range(len(hits), seq.num_blocks):
            block_id = self._allocate_block()
            seq.block_table.append(block_id)
            token_ids = seq.block(i)
            if self.enable_prefix_caching and len(token_ids) == self.block_size:   # full blocks only
                h = compute_block_hash(token_ids, h)
                self._cache_block(block_id, h, token_ids)

    def deallocate(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks, last block first; blocks reaching 0 go to the free list.

        Such a block stays a cache entry only if its KV was computed (it lies within seq.num_cached_tokens):
        a request preempted in the middle of a chunked prefill leaves registered blocks never written.
        """
        for i, block_id in reversed(list(enumerate(seq.block_table))):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if (i + 1) * self.block_size > seq.num_cached_tokens:   # never fully computed
                    self._uncache_block(block_id)
                self._free_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: Sequence) -> bool:
        """seq just grew by one token: is there a free block if that token needs a new one?"""
        return self.num_free_blocks >= (len(seq.block_table) < seq.num_blocks)

    def may_append(self, seq: Sequence) -> None:
        """After seq.append_token: a new block when the token opened one (len(seq) % bs == 1);
        register the last block's chained hash when the token filled it (len(seq) % bs == 0)."""
        block_table = seq.block_table
        if len(block_table) < seq.num_blocks:                        # the new token is the first of a new block
            block_table.append(self._allocate_block())
        if self.enable_prefix_caching and len(seq) % self.block_size == 0:   # the last block just became full
            prefix = self.blocks[block_table[-2]].hash if len(block_table) > 1 else -1
            token_ids = seq.block(seq.num_blocks - 1)
            self._cache_block(block_table[-1], compute_block_hash(token_ids, prefix), token_ids)
