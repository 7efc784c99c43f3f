"""A step as the device runs it (``ForwardBatch``), its host-side sampling plan (``SamplingPlan``),
and how its host inputs get there: one host -> device copy per step (``DecodeInputs``; the copies
themselves are ``engine.worker.device_copy``'s)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.model.attention_context import AttentionContext

if TYPE_CHECKING:
    from engine.scheduling.step import ScheduledBatch
    from engine.worker.prompt_logprobs import PromptLogprobsPlan


@dataclass
class SamplingPlan:
    """A step's sampling, decided on the host from its requests' parameters, by logits row: the
    ``random_rows`` (temperature > 0; the others take the argmax), the ``penalized_rows`` that
    sample a token, the ``banned`` (row, token id) pairs (a bad word's token, or min_tokens not
    reached), the ``biased`` (row, token id, bias) triples, the ``allowed`` (row, token id) pairs
    of the ``allowed_rows`` (every other token of those rows is masked), the ``logprob_rows`` with
    the most alternatives one of them asks for (``num_logprobs``), and ``grammar_mask``: what the
    grammar hook's ``fill`` made for the rows of grammar requests (None: no such row)."""

    random_rows: list[int]
    penalized_rows: list[int]
    banned: list[tuple[int, int]]
    logprob_rows: list[int]
    num_logprobs: int
    biased: list[tuple[int, int, float]] = field(default_factory=list)
    allowed: list[tuple[int, int]] = field(default_factory=list)
    allowed_rows: list[int] = field(default_factory=list)
    grammar_mask: Any = None


class DecodeInputs:
    """A decode step's integer inputs: one named row each of one int64 ``buffer`` [7, max_rows], so
    they reach the device in one copy. Per decode row (a decode step's decode rows are its logits
    rows): the token ``input_ids``, ``positions``, ``table_rows`` (its request's block-table row)
    and ``output_indices`` (the output index it samples); the pending-token moves ``move_to`` (a
    decode row) and ``move_from`` (an index into the previous step's sampled ids); ``random_rows``
    (the rows drawn at random, temperature > 0). The runner keeps two host copies (pinned on CUDA)
    and one on the device, whose rows CUDA graphs read."""

    FIELDS = ("input_ids", "positions", "table_rows", "output_indices", "move_to", "move_from", "random_rows")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        (self.input_ids, self.positions, self.table_rows, self.output_indices, self.move_to, self.move_from,
         self.random_rows) = buffer

    @classmethod
    def zeros(cls, max_rows: int, device: torch.device | None = None, pin_memory: bool = False) -> DecodeInputs:
        return cls(torch.zeros(len(cls.FIELDS), max_rows, dtype=torch.int64, device=device, pin_memory=pin_memory))

    def write(self, count: int, **fields: list[int]) -> None:
        """The first ``count`` columns of consecutive ``fields`` (in ``FIELDS`` order), in one copy."""
        first = self.FIELDS.index(next(iter(fields)))
        if tuple(fields) != self.FIELDS[first:first + len(fields)]:
            raise ValueError(f"fields {tuple(fields)} are not consecutive in {self.FIELDS}")
        self.buffer[first:first + len(fields), :count] = torch.tensor(list(fields.values()), dtype=torch.int64)

    def pad(self, start: int, end: int, table_row: int) -> None:
        """Columns ``[start, end)`` become padding rows: token 0 at position 0 of ``table_row``."""
        self.buffer[:2, start:end] = 0  # input_ids, positions
        self.table_rows[start:end] = table_row


@dataclass
class ForwardBatch:
    """One step as the device runs it, built once by ``ModelRunner.prepare`` from the scheduled
    ``batch``. The model's inputs: ``input_ids`` / ``positions`` [T] and the ``attention`` context
    (None when a captured decode graph replays: the graph builds its own from the static inputs,
    ``graph_size`` rows of them). Per logits row (each entry's last token, then each drafted
    token): ``logits_indices`` [R] (the token whose hidden state it reads; None: token i is row i,
    a decode step), ``table_rows`` [R] (its request's block-table and sampling row) and
    ``output_indices`` [R] (the output index it samples). ``random_rows`` [S]: the logits rows
    drawn at random (temperature > 0; the others take the argmax), and ``sampling`` the rest of
    the host-side sampling plan. ``prompt_logprobs``: the prompt logprobs the step gives (None:
    none; in a mixed step their logits rows follow the sampled ones). Tensors are on the runner's
    device."""

    batch: ScheduledBatch
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionContext | None
    logits_indices: torch.Tensor | None
    table_rows: torch.Tensor
    output_indices: torch.Tensor
    random_rows: torch.Tensor
    sampling: SamplingPlan
    graph_size: int | None = None
    prompt_logprobs: PromptLogprobsPlan | None = None
