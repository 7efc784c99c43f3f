"""Paged KV block allocator with reference counts and prefix caching. Pure Python.

Block ``i`` of a sequence holds the KV of its tokens ``[i * block_size, (i + 1) * block_size)``.
A block whose tokens are all known and computed is identified by a chain hash of
its tokens and every token before it, so a later prompt with the same prefix
reuses the block (reference counted) instead of recomputing it. Partially filled
blocks are never shared. A block's hash becomes findable only once its K/V is
written (``publish``, called after the step that computed it, for the tokens computed
so far: a prompt prefilled in chunks publishes block by block), so a failed or
aborted forward never leaves a hash pointing at K/V that does not exist. Freed
blocks keep their hash, and so stay reusable, until they are handed out again;
the least recently freed block is handed out first.
"""
from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_left
from collections import OrderedDict

from engine.sequence import Sequence


def chain_hash(prefix_hash: bytes, token_ids: list[int]) -> bytes:
    """128-bit blake2b of (hash of the blocks before, this block's token ids).

    Deterministic across processes and TP ranks, unlike the salted builtin hash().
    """
    h = hashlib.blake2b(prefix_hash, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens and every sequence's block table.

    ``ref_counts[i]`` is the number of sequences holding block ``i``. Callers ask
    ``can_allocate`` / ``can_append`` first; preempting a sequence is ``free``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        # request id -> table indices (ascending) of its hashed blocks whose K/V is not yet published
        self._unpublished: dict[str, list[int]] = {}
        self._last_hashes: tuple[Sequence | None, int, list[bytes]] = (None, 0, [])
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def cached_prefix_len(self, seq: Sequence) -> int:
        """Prompt tokens that ``allocate(seq)`` would find cached right now."""
        return len(self._prefix_hits(seq, self._full_block_hashes(seq))) * self.block_size

    def can_allocate(self, seq: Sequence, num_reserved: int = 0) -> bool:
        """True when ``allocate(seq)`` now would leave at least ``num_reserved`` blocks free."""
        hits = self._prefix_hits(seq, self._full_block_hashes(seq))
        return self._num_blocks_taken(seq, hits) + num_reserved <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Set ``seq.block_table`` for its tokens and ``seq.num_cached_tokens``.

        Leading full blocks found in the cache are shared; the block holding the
        last prompt token is always fresh, so a fully cached prompt still computes
        its last block and the model sees at least one new token.
        """
        if seq.block_table:
            raise ValueError(f"{seq.request_id} already holds blocks")
        hashes = self._full_block_hashes(seq)
        hits = self._prefix_hits(seq, hashes)
        if self._num_blocks_taken(seq, hits) > self.num_free_blocks:
            raise ValueError(f"not enough free blocks for {seq.request_id}; ask can_allocate first")
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1
        table = list(hits)
        for i in range(len(hits), self.blocks_for(seq.num_tokens)):
            table.append(self._take_free_block())
            if i < len(hashes):
                self._record_hash(seq, i, table[-1], hashes[i])
        seq.block_table = table
        seq.num_cached_tokens = len(hits) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        """True when ``append_slot(seq)`` can succeed."""
        return len(seq.block_table) * self.block_size >= seq.num_tokens or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make sure the slot of the token at position ``seq.num_tokens - 1`` exists.

        Called once before every decode step; takes a new block when the last one is
        full. A block that this token completes is hashed, and findable after ``publish``.
        """
        pos = seq.num_tokens - 1
        table = seq.block_table
        if pos // self.block_size > len(table):
            raise ValueError(f"{seq.request_id}: append_slot skipped a step (position {pos})")
        if pos // self.block_size == len(table):
            if not self._free:
                raise ValueError(f"no free block for {seq.request_id}; ask can_append first")
            table.append(self._take_free_block())
        if self.enable_prefix_caching and pos % self.block_size == self.block_size - 1:
            prefix_hash = self._block_hash[table[-2]] if len(table) > 1 else b""
            start = pos + 1 - self.block_size
            self._record_hash(seq, len(table) - 1, table[-1], chain_hash(prefix_hash, seq.token_ids[start:pos + 1]))

    def publish(self, seq: Sequence, num_computed_tokens: int) -> None:
        """The K/V of ``seq``'s first ``num_computed_tokens`` tokens is written: its hashed
        blocks within them become prefix-cache hits for later sequences (the rest stay
        unpublished until a later call covers them)."""
        pending = self._unpublished.get(seq.request_id)
        if not pending:
            return
        done = bisect_left(pending, num_computed_tokens // self.block_size)
        for i in pending[:done]:
            block_id = seq.block_table[i]
            self._hash_to_block[self._block_hash[block_id]] = block_id
        if done == len(pending):
            del self._unpublished[seq.request_id]
        else:
            del pending[:done]

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, last block first; blocks reaching zero become free
        (and keep their hash if it was published; an unpublished hash is dropped).
        Clears ``seq.block_table`` and ``seq.num_cached_tokens``."""
        for i in self._unpublished.pop(seq.request_id, ()):
            self._block_hash[seq.block_table[i]] = None
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0

    def _full_block_hashes(self, seq: Sequence) -> list[bytes]:
        """Chain hashes of ``seq``'s full blocks. The last result is kept: admitting a request asks
        three times (cached_prefix_len, can_allocate, allocate), and a request waiting at the head
        of the queue asks again every step."""
        if not self.enable_prefix_caching:
            return []
        last_seq, last_len, last_hashes = self._last_hashes
        if last_seq is seq and last_len == seq.num_tokens:  # tokens only ever append
            return last_hashes
        tokens, size = seq.token_ids, self.block_size
        hashes, h = [], b""
        for start in range(0, len(tokens) - size + 1, size):
            h = chain_hash(h, tokens[start:start + size])
            hashes.append(h)
        self._last_hashes = (seq, seq.num_tokens, hashes)
        return hashes

    def _prefix_hits(self, seq: Sequence, hashes: list[bytes]) -> list[int]:
        """Cached block ids for the leading hashes, never the block of the last prompt token."""
        hits = []
        for h in hashes[:(seq.num_tokens - 1) // self.block_size]:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _num_blocks_taken(self, seq: Sequence, hits: list[int]) -> int:
        """Free blocks that allocating ``seq`` with these prefix hits consumes."""
        revived = sum(1 for block_id in hits if self.ref_counts[block_id] == 0)
        return self.blocks_for(seq.num_tokens) - len(hits) + revived

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        old = self._block_hash[block_id]
        if old is not None and self._hash_to_block.get(old) == block_id:
            del self._hash_to_block[old]
        self._block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def _record_hash(self, seq: Sequence, index: int, block_id: int, h: bytes) -> None:
        """Block ``block_id``, at ``index`` of ``seq``'s table, holds the tokens hashing to ``h``."""
        self._block_hash[block_id] = h
        self._unpublished.setdefault(seq.request_id, []).append(index)
