"""A model of the paged KV cache for the block manager and scheduler tests.

The KV at position p depends on tokens 0..p, so each slot records the token
prefix it was computed from (None when a token of it was never known on the host:
a step computed for a sequence that had already finished). Reading a slot that
holds any other prefix means a block was shared, reused or overwritten wrongly.
"""
from __future__ import annotations

from engine.scheduling.sequence import Sequence


class KVOracle:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[int, tuple[int, ...]] = {}

    def slot(self, seq: Sequence, pos: int) -> int:
        block = pos // self.block_size
        assert block < len(seq.block_table), f"{seq.request_id}: no block for position {pos}"
        return seq.block_table[block] * self.block_size + pos % self.block_size

    def write(self, seq: Sequence, start: int, end: int) -> None:
        """Compute positions [start, end) of ``seq`` into its slots."""
        tokens = seq.token_ids
        for pos in range(start, end):
            self.slots[self.slot(seq, pos)] = tuple(tokens[:pos + 1]) if pos < len(tokens) else None

    def check(self, seq: Sequence, end: int) -> None:
        """Every position in [0, end) of ``seq`` reads the KV of its own prefix."""
        tokens = seq.token_ids
        for pos in range(end):
            got = self.slots.get(self.slot(seq, pos))
            assert got == tuple(tokens[:pos + 1]), (
                f"{seq.request_id} position {pos} reads KV of {got}, expected prefix {tokens[:pos + 1]}")
