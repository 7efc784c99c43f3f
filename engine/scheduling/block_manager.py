"""Paged KV block allocator with reference counts and prefix caching. Pure Python.

Block ``i`` of a sequence holds the KV of its tokens ``[i * block_size, (i + 1) * block_size)``.
A full block whose K/V is written is identified by a chain hash of its tokens and
every token before it, so a later prompt with the same prefix reuses the block
(reference counted) instead of recomputing it. Partially filled blocks are never
shared. A block is hashed and becomes findable only in ``publish``, called after the
step that computed it has run, for the tokens computed so far (a prompt prefilled in
chunks publishes block by block): a failed or aborted forward never leaves a hash
pointing at K/V that does not exist, and a token sampled by a step still in flight
(not yet known on the host) is never hashed. Freed blocks keep their hash, and so stay
reusable, until they are handed out again; the least recently freed block is handed
out first. A sequence asking for prompt logprobs shares no cached block (its whole prompt is
computed, so every prompt position gives its logits); its own blocks are published as usual.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.scheduling.sequence import Sequence


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
    ``num_prefix_queries`` / ``num_prefix_hits`` count the prompt tokens allocations looked up in
    the prefix cache and those they found.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        # hash -> the blocks holding that content (two sequences that computed the same prefix
        # side by side hold a block each; one reused for other content must not hide the other)
        self._hash_to_blocks: dict[bytes, dict[int, None]] = {}
        # request id -> chain hashes of its full blocks computed so far, and how many are published
        self._chains: dict[str, list[bytes]] = {}
        self._num_published: dict[str, int] = {}
        # hash -> how many sequences hold an allocated, not yet published prompt block of that hash
        self._coming: dict[bytes, int] = {}
        self._num_coming: dict[str, int] = {}  # request id -> its prompt blocks counted in _coming
        self._last_hashes: tuple[Sequence | None, int, list[bytes]] = (None, 0, [])
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_prefix_queries = self.num_prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def cached_prefix_len(self, seq: Sequence) -> int:
        """Prompt tokens that ``allocate(seq)`` would find cached right now."""
        return len(self._prefix_hits(seq, self._full_block_hashes(seq))) * self.block_size

    def prefix_is_coming(self, seq: Sequence) -> bool:
        """True when the first prompt block of ``seq`` that is not a prefix-cache hit now is being
        computed for another sequence (allocated, not yet published): admitted one step later,
        ``seq`` would share it instead of computing it again."""
        hashes = self._full_block_hashes(seq)
        hits = self._prefix_hits(seq, hashes)
        shareable = min(len(hashes), self._num_shareable(seq))
        return len(hits) < shareable and hashes[len(hits)] in self._coming

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
        seq.block_table = hits + [self._take_free_block() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        seq.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += seq.num_cached_tokens
            self._chains[seq.request_id] = list(hashes)
            self._num_published[seq.request_id] = len(hits)
            self._num_coming[seq.request_id] = len(hashes)
            for h in hashes[len(hits):]:
                self._coming[h] = self._coming.get(h, 0) + 1

    def can_append(self, seq: Sequence) -> bool:
        """True when ``append_slot(seq)`` can succeed."""
        return len(seq.block_table) * self.block_size >= seq.num_tokens or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make sure the slot of the token at position ``seq.num_tokens - 1`` exists (pending
        tokens counted): called once before every decode step; takes a new block when the last
        one is full."""
        pos = seq.num_tokens - 1
        table = seq.block_table
        if pos // self.block_size > len(table):
            raise ValueError(f"{seq.request_id}: append_slot skipped a step (position {pos})")
        if pos // self.block_size == len(table):
            if not self._free:
                raise ValueError(f"no free block for {seq.request_id}; ask can_append first")
            table.append(self._take_free_block())

    def take_slots(self, seq: Sequence, num_tokens: int) -> int:
        """Give ``seq`` blocks for its first ``num_tokens`` positions as far as free blocks allow
        (a verify step's drafted tokens); returns how many positions its table holds now."""
        while len(seq.block_table) * self.block_size < num_tokens and self._free:
            seq.block_table.append(self._take_free_block())
        return len(seq.block_table) * self.block_size

    def release_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Free ``seq``'s blocks past those holding its first ``num_tokens`` positions: blocks
        that hold only rejected drafted tokens (never published, held by ``seq`` alone)."""
        table = seq.block_table
        while len(table) > self.blocks_for(num_tokens):
            block_id = table.pop()
            if self.ref_counts[block_id] != 1:
                raise ValueError(f"{seq.request_id}: block {block_id} is shared, it cannot hold only its drafts")
            self.ref_counts[block_id] = 0
            self._free[block_id] = None

    def publish(self, seq: Sequence, num_computed_tokens: int) -> None:
        """The K/V of ``seq``'s first ``num_computed_tokens`` tokens is written (and those tokens
        are known on the host): its full blocks within them are hashed and become prefix-cache
        hits for later sequences."""
        published = self._num_published.get(seq.request_id)
        full = num_computed_tokens // self.block_size
        if published is None or full <= published:
            return
        chain, size = self._chains[seq.request_id], self.block_size
        if len(chain) < full:
            tokens = seq.token_ids
            if len(tokens) < full * size:
                raise ValueError(f"{seq.request_id}: cannot publish {full * size} tokens, {len(tokens)} are known")
            for i in range(len(chain), full):
                chain.append(chain_hash(chain[-1] if chain else b"", tokens[i * size:(i + 1) * size]))
        for i in range(published, full):
            block_id, h = seq.block_table[i], chain[i]
            self._block_hash[block_id] = h
            self._hash_to_blocks.setdefault(h, {})[block_id] = None
        self._drop_coming(chain, published, min(full, self._num_coming[seq.request_id]))
        self._num_published[seq.request_id] = full

    def num_published(self, seq: Sequence) -> int:
        """How many of ``seq``'s full blocks are published (findable by their prefix hash)."""
        return self._num_published.get(seq.request_id, 0)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, last block first; blocks reaching zero become free
        (keeping the hash they were published with, if any). Clears ``seq.block_table`` and
        ``seq.num_cached_tokens``."""
        chain = self._chains.pop(seq.request_id, None)
        if chain is not None:
            self._drop_coming(chain, self._num_published.pop(seq.request_id), self._num_coming.pop(seq.request_id))
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
        for h in hashes[:self._num_shareable(seq)]:
            holders = self._hash_to_blocks.get(h)
            if not holders:
                break
            # a block in use costs no free block to share; a free one holding it is revived
            hits.append(next((b for b in holders if self.ref_counts[b] > 0), next(iter(holders))))
        return hits

    def _num_shareable(self, seq: Sequence) -> int:
        """Leading blocks ``seq`` may take from the cache: none when it asks for prompt logprobs,
        else never the block of its last token."""
        if seq.sampling_params.prompt_logprobs is not None:
            return 0
        return (seq.num_tokens - 1) // self.block_size

    def _num_blocks_taken(self, seq: Sequence, hits: list[int]) -> int:
        """Free blocks that allocating ``seq`` with these prefix hits consumes."""
        revived = sum(1 for block_id in hits if self.ref_counts[block_id] == 0)
        return self.blocks_for(seq.num_tokens) - len(hits) + revived

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        old = self._block_hash[block_id]
        if old is not None:
            holders = self._hash_to_blocks[old]
            del holders[block_id]
            if not holders:
                del self._hash_to_blocks[old]
        self._block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def _drop_coming(self, chain: list[bytes], start: int, end: int) -> None:
        """Prompt blocks ``chain[start:end]`` of a sequence are published or freed: no longer coming."""
        for h in chain[start:end]:
            if self._coming[h] == 1:
                del self._coming[h]
            else:
                self._coming[h] -= 1
