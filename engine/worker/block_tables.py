"""The device block tables: one row per running sequence, written only where its table changed."""
from __future__ import annotations

import math
from itertools import chain

import torch

from engine.model.attention_context import cache_slots
from engine.scheduling.sequence import Sequence
from engine.worker.forward_batch import to_device


class BlockTables:
    """``data`` int32 [num_rows + 1, max_blocks] on ``device``: the KV block ids of the sequence
    holding each row (its ``table_row``), and a last all-zero ``pad_row`` the padding rows of a
    graph-padded decode read. A sequence takes a row at its first step and keeps it until
    ``release``; ``sync`` writes what changed in its table since the last step.
    ``max_draft_tokens``: the most tokens one verify entry drafts (their blocks may be freed and
    others taken the next step, so the last blocks a draft can reach are compared each step)."""

    def __init__(self, num_rows: int, max_blocks: int, block_size: int, device: torch.device,
                 max_draft_tokens: int = 0):
        self.block_size, self.device = block_size, device
        self.pad_row = num_rows
        self.data = torch.zeros(num_rows + 1, max_blocks, dtype=torch.int32, device=device)
        self._row_of: dict[str, int] = {}
        self._written: dict[str, list[int]] = {}  # request id -> its block ids written to its row
        self._retaken_blocks = math.ceil(max_draft_tokens / block_size) + 1 if max_draft_tokens else 0
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def held(self) -> list[str]:
        """The request ids holding a row."""
        return list(self._row_of)

    def sync(self, seqs: list[Sequence]) -> tuple[list[int], list[tuple[int, Sequence]]]:
        """Each sequence's table row, and the (row, sequence) of those that just got theirs. Every
        block appended since the last step, or changed since (the blocks of rejected drafts are
        freed, and others taken for the next drafts), is written into the device table: one copy of
        (row, column, block) triples, one index_put."""
        rows, cols, blocks, new = [], [], [], []
        for seq in seqs:
            rid = seq.request_id
            row = self._row_of.get(rid)
            if row is None:
                if not self._free_rows:
                    raise RuntimeError(f"more sequences than block-table rows ({self.pad_row})")
                row = self._row_of[rid] = self._free_rows.pop()
                self._written[rid] = []
                new.append((row, seq))
            written, table = self._written[rid], seq.block_table
            same = min(len(written), len(table))
            for j in range(max(0, len(written) - self._retaken_blocks), same):
                if table[j] != written[j]:
                    same = j
                    break
            if len(table) > same:
                rows.append([row] * (len(table) - same))
                cols.append(range(same, len(table)))
                blocks.append(table[same:])
            written[same:] = table[same:]
        if rows:
            update = torch.tensor([list(chain.from_iterable(part)) for part in (rows, cols, blocks)], dtype=torch.int64)
            update = to_device(update, self.device)
            self.data[update[0], update[1]] = update[2].to(torch.int32)
        return [self._row_of[s.request_id] for s in seqs], new

    def release(self, seq: Sequence) -> None:
        """Free a finished or preempted sequence's row (no-op if it holds none); a preempted
        sequence gets a fresh row, written from its new table, when it runs again."""
        row = self._row_of.pop(seq.request_id, None)
        if row is not None:
            self._free_rows.append(row)
            del self._written[seq.request_id]

    def slots(self, table_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slots (int64) of tokens at ``positions`` of the sequences in ``table_rows``."""
        return cache_slots(self.data, table_rows, positions, self.block_size)
