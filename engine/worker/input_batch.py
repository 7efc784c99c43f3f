"""The persistent input batch: every running sequence's device state in one row, written when the
sequence joins and read by index every step.

A row holds a sequence's block table (written only where its table changed since the last step),
its sampling parameters (temperature, top-p, presence / frequency / repetition penalties, min-p,
top-k, seed) and, for a penalised sequence, its output token counts and the tokens of its prompt.
A step reads the rows of the sequences it runs by index (``table_rows``), so a freed row is simply
reused: nothing is moved to keep the rows dense.
"""
from __future__ import annotations

import math
from itertools import chain

import torch

from engine.model.attention_context import cache_slots
from engine.scheduling.sequence import Sequence
from engine.worker.device_copy import to_device


class InputBatch:
    """``num_rows`` rows (and a last all-zero ``pad_row``, which the padding tokens of a
    graph-padded decode read) on ``device`` over a ``vocab_size`` vocabulary; tables of up to
    ``max_blocks`` blocks of ``block_size`` tokens. ``max_draft_tokens``: the most tokens one
    verify entry drafts (their blocks may be freed and others taken the next step, so the last
    blocks a draft can reach are compared each step).

    Device tensors, indexed by row: ``block_tables`` int32 [num_rows + 1, max_blocks];
    ``floats`` float32 [6, num_rows + 1] (temperature, top_p, presence, frequency, repetition,
    min_p); ``ints`` int64 [2, num_rows + 1] (top_k, seed); ``output_counts`` int32
    [num_rows + 1, V] and ``prompt_seen`` bool [num_rows + 1, V], made for the first penalised
    sequence (None until then). A sequence takes a row at its first step (``rows``) and keeps it
    until ``remove``."""

    def __init__(self, num_rows: int, max_blocks: int, block_size: int, vocab_size: int, device: torch.device,
                 max_draft_tokens: int = 0):
        self.block_size, self.vocab_size, self.device = block_size, vocab_size, device
        self.pad_row = num_rows
        self.block_tables = torch.zeros(num_rows + 1, max_blocks, dtype=torch.int32, device=device)
        self.floats = torch.zeros(6, num_rows + 1, device=device)
        self.ints = torch.zeros(2, num_rows + 1, dtype=torch.int64, device=device)
        self.output_counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        self._row_of: dict[str, int] = {}
        self._written: dict[str, list[int]] = {}  # request id -> its block ids written to its row
        self._retaken_blocks = math.ceil(max_draft_tokens / block_size) + 1 if max_draft_tokens else 0
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def held(self) -> list[str]:
        """The request ids holding a row."""
        return list(self._row_of)

    def rows(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's row. A sequence without one takes a free row, and its sampling state is
        written there (``_add``); every block appended to a table since the last step, or changed
        since (the blocks of rejected drafts are freed, and others taken for the next drafts), is
        written into the device tables: one copy of (row, column, block) triples, one index_put.
        Raises RuntimeError when more sequences run than there are rows."""
        new = [seq for seq in seqs if seq.request_id not in self._row_of]
        if new:
            self._add(new)
        rows, cols, blocks = [], [], []
        for seq in seqs:
            rid = seq.request_id
            row, written, table = self._row_of[rid], self._written[rid], seq.block_table
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
            self.block_tables[update[0], update[1]] = update[2].to(torch.int32)
        return [self._row_of[s.request_id] for s in seqs]

    def _add(self, seqs: list[Sequence]) -> None:
        """Rows for ``seqs``, with their sampling parameters; a penalised one's counts of the output
        it has so far (a recomputed one has some) and its prompt's tokens."""
        if len(seqs) > len(self._free_rows):
            raise RuntimeError(f"more sequences than input-batch rows ({self.pad_row})")
        rows = []
        for seq in seqs:
            rows.append(self._free_rows.pop())
            self._row_of[seq.request_id] = rows[-1]
            self._written[seq.request_id] = []
        params = [seq.sampling_params for seq in seqs]
        index = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        self.floats[:, index] = to_device(torch.tensor(
            [[p.temperature for p in params], [p.top_p for p in params], [p.presence_penalty for p in params],
             [p.frequency_penalty for p in params], [p.repetition_penalty for p in params],
             [p.min_p for p in params]], dtype=torch.float32),
            self.device)
        self.ints[:, index] = to_device(torch.tensor([[p.top_k for p in params], [seq.seed for seq in seqs]],
                                                     dtype=torch.int64), self.device)
        penalized = [(row, seq) for row, seq in zip(rows, seqs) if seq.sampling_params.penalized]
        if not penalized:
            return
        if self.output_counts is None:
            shape = (self.pad_row + 1, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        for row, seq in penalized:
            counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64), minlength=self.vocab_size)
            self.output_counts[row] = to_device(counts.to(torch.int32), self.device)
            seen = torch.zeros(self.vocab_size, dtype=torch.bool)
            seen[seq.prompt_token_ids] = True
            self.prompt_seen[row] = to_device(seen, self.device)

    def remove(self, seq: Sequence) -> None:
        """Free a finished or preempted sequence's row (no-op if it holds none); a preempted
        sequence gets a fresh row, written from its new table, when it runs again."""
        row = self._row_of.pop(seq.request_id, None)
        if row is not None:
            self._free_rows.append(row)
            del self._written[seq.request_id]

    def slots(self, table_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slots (int64) of tokens at ``positions`` of the sequences in ``table_rows``."""
        return cache_slots(self.block_tables, table_rows, positions, self.block_size)
