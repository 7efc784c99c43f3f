"""One engine's grammar state: a matcher per request with a ``structured`` spec, each step's
token bitmask for the logits rows of those requests, and the grammars advanced by the tokens read
back. It lives where sampling happens (rank 0 under TP) and is the ``grammar`` hook of the
engine's ``BatchSampler``: ``fill`` on the host when a step is planned, ``apply`` on the device
before any other constraint.

A grammar advances only with the tokens that reach its request's output (``advance`` takes the
scheduler's ``SequenceOutput``s, which hold no dropped token), so a step's mask needs the previous
step's token read back: the engine reads it back before it plans such a step.
"""
from __future__ import annotations

from collections.abc import Hashable

import torch

from engine.scheduling.sequence import Sequence
from engine.scheduling.step import SequenceOutput
from engine.scheduling.structured.compiler import GrammarCompiler
from engine.scheduling.structured.matchers import GrammarMatchers, apply_bitmask
from engine.worker.device_copy import to_device


class GrammarRows:
    """The grammars of ``compiler``'s vocabulary for the requests of an engine whose steps sample
    at most ``max_rows`` entries, masking logits on ``device``. ``add(seq)`` compiles and starts a
    request's grammar (raises ``StructuredOutputError``, a ValueError, when it cannot be compiled);
    ``remove(request_id)`` forgets it."""

    def __init__(self, compiler: GrammarCompiler, max_rows: int, device: torch.device):
        self.compiler, self.device = compiler, device
        self.matchers = GrammarMatchers(compiler.tokenizer_info.vocab_size)
        self.bitmask = self.matchers.allocate(max_rows)  # host, int32 [max_rows, ceil(V / 32)]
        self.request_ids: set[Hashable] = set()

    def add(self, seq: Sequence) -> None:
        self.matchers.add(seq.request_id, self.compiler.compile(seq.sampling_params.structured))
        self.request_ids.add(seq.request_id)

    def remove(self, request_id: Hashable) -> None:
        self.matchers.remove(request_id)
        self.request_ids.discard(request_id)

    def fill(self, rows: list[tuple[int, Sequence]]) -> tuple[torch.Tensor, list[int]]:
        """The bitmask of the logits rows ``rows`` ((row, sequence), rows distinct, each sequence's
        grammar up to date with its output) on the device, and those rows."""
        self.matchers.fill([(row, seq.request_id) for row, seq in rows], self.bitmask)
        used = max(row for row, _ in rows) + 1
        return to_device(self.bitmask[:used], self.device), [row for row, _ in rows]

    @staticmethod
    def apply(logits: torch.Tensor, mask: tuple[torch.Tensor, list[int]]) -> None:
        """Set the tokens ``mask`` (``fill``'s) refuses to -inf in ``logits`` [R, V], in place."""
        apply_bitmask(logits, *mask)

    def advance(self, outputs: list[SequenceOutput]) -> list[tuple[str, str, str | None]]:
        """Advance each grammar request's grammar by its new output tokens; returns (request id,
        finish reason, error) for those that must end: "stop" when the grammar is complete (it
        accepted a stop token), "error" when it refused a token (that request alone)."""
        ends = []
        for out in outputs:
            request_id = out.seq.request_id
            if request_id not in self.request_ids:
                continue
            if not self.matchers.accept(request_id, out.new_token_ids):
                ends.append((request_id, "error", f"the grammar refuses the output token(s) {out.new_token_ids}"))
            elif self.matchers.is_terminated(request_id):
                ends.append((request_id, "stop", None))
        return ends
