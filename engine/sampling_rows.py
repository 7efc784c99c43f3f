"""Sampling state on the device, one row per running sequence, and a step's sampling from it.

Each sequence's sampling parameters are written into its table row once, when it gets the row;
a sequence with penalties also gets its output token counts and its prompt's tokens there,
and every token it samples is counted on the device (no host work per token). A step then
applies the penalties (vLLM's order: repetition, then frequency and presence), bans EOS and
the stop token ids of sequences short of ``min_tokens``, samples, and gathers the logprobs
asked for (the log-softmax of the logits before penalties and temperature). Every list and
tensor of a step here is indexed by logits row: each entry's, then each drafted token's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.forward_batch import to_device
from engine.layers.sampler import Sampler
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


@dataclass
class SamplingPlan:
    """A step's sampling, decided on the host from its requests' parameters, by logits row: the
    ``random_rows`` (temperature > 0; the others take the argmax), the ``penalized_rows`` that
    sample a token, the ``banned`` (row, token id) pairs (min_tokens not reached), and the
    ``logprob_rows`` with the most alternatives one of them asks for (``num_logprobs``)."""

    random_rows: list[int]
    penalized_rows: list[int]
    banned: list[tuple[int, int]]
    logprob_rows: list[int]
    num_logprobs: int


@dataclass
class StepLogprobs:
    """Logprobs of the logits ``rows`` that asked for them: the sampled token's (``chosen`` [P]) and
    the most likely tokens' (``top_ids`` / ``top_values`` [P, N]); float32 / int64 tensors."""

    rows: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor


class SamplingRows:
    """``num_rows`` table rows of sampling state over a ``vocab_size`` vocabulary on ``device``; a
    step samples at most ``max_batch`` logits rows. ``write(new)`` when sequences get their table
    rows; ``plan(batch, output_indices)`` on the host; ``sample(logits, step)`` on the device. EOS
    ids (``eos_token_ids``) count as stop ids for min_tokens."""

    def __init__(self, num_rows: int, vocab_size: int, max_batch: int, device: torch.device, sampler: Sampler,
                 eos_token_ids=frozenset()):
        self.num_rows, self.vocab_size, self.device, self.sampler = num_rows, vocab_size, device, sampler
        self.eos_token_ids = frozenset(eos_token_ids)
        # temperature, top_p, presence, frequency, repetition | top_k, seed
        self.floats = torch.zeros(5, num_rows, device=device)
        self.ints = torch.zeros(2, num_rows, dtype=torch.int64, device=device)
        self.output_counts: torch.Tensor | None = None  # int32 [rows, V], made for the first penalised sequence
        self.prompt_seen: torch.Tensor | None = None    # bool [rows, V]
        self._greedy = dict(
            temperatures=torch.zeros(max_batch, device=device), top_ks=torch.zeros(max_batch, dtype=torch.int64,
                                                                                   device=device),
            top_ps=torch.ones(max_batch, device=device), seeds=torch.zeros(max_batch, dtype=torch.int64,
                                                                            device=device),
            output_indices=torch.zeros(max_batch, dtype=torch.int64, device=device))
        self._no_rows = torch.zeros(0, dtype=torch.int64, device=device)

    def write(self, new: list[tuple[int, Sequence]]) -> None:
        """Sequences that just got their table ``row``: parameters into the columns; a penalised
        one's counts of the output it has so far (a recomputed one has some) and its prompt's tokens."""
        params = [seq.sampling_params for _, seq in new]
        rows = to_device(torch.tensor([row for row, _ in new], dtype=torch.int64), self.device)
        self.floats[:, rows] = to_device(torch.tensor(
            [[p.temperature for p in params], [p.top_p for p in params], [p.presence_penalty for p in params],
             [p.frequency_penalty for p in params], [p.repetition_penalty for p in params]], dtype=torch.float32),
            self.device)
        self.ints[:, rows] = to_device(torch.tensor([[p.top_k for p in params], [seq.seed for _, seq in new]],
                                                    dtype=torch.int64), self.device)
        penalized = [(row, seq) for row, seq in new if seq.sampling_params.penalized]
        if not penalized:
            return
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_seen = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        for row, seq in penalized:
            counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64), minlength=self.vocab_size)
            self.output_counts[row] = to_device(counts.to(torch.int32), self.device)
            seen = torch.zeros(self.vocab_size, dtype=torch.bool)
            seen[seq.prompt_token_ids] = True
            self.prompt_seen[row] = to_device(seen, self.device)

    def plan(self, batch: ScheduledBatch, output_indices: list[int]) -> SamplingPlan:
        """The step's sampling from its logits rows' parameters and output indices: one row per
        entry, then one per drafted token (``batch.logits_row_seqs``), which always samples."""
        random_rows, penalized, banned, logprob_rows, num_logprobs = [], [], [], [], 0
        row_samples = batch.samples + [True] * (batch.num_logits_rows - len(batch))
        for i, (seq, samples, index) in enumerate(zip(batch.logits_row_seqs, row_samples, output_indices)):
            params = seq.sampling_params
            if params.temperature > 0:
                random_rows.append(i)
            if not samples:
                continue
            if params.penalized:
                penalized.append(i)
            if index < params.min_tokens:
                stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
                banned += [(i, t) for t in sorted(stops) if t < self.vocab_size]
            if params.logprobs is not None:
                logprob_rows.append(i)
                num_logprobs = max(num_logprobs, params.logprobs)
        return SamplingPlan(random_rows, penalized, banned, logprob_rows, num_logprobs)

    def sample(self, logits: torch.Tensor, step: ForwardBatch) -> tuple[torch.Tensor, StepLogprobs | None]:
        """Token ids [R] for the ``logits`` [R, V] of the step's logits rows (each row's parameters
        from its table row, its output index from ``step.output_indices``), and the logprobs asked
        for (rank 0 only under TP: the others receive the ids). An all-greedy batch is one argmax;
        otherwise only the random rows draw, with the candidate count and top-p pass decided from
        the host-side parameters."""
        plan, table_rows = step.sampling, step.table_rows
        logprob_rows = None
        if plan.logprob_rows and self.sampler.tp.rank == 0:
            logprob_index = to_device(torch.tensor(plan.logprob_rows, dtype=torch.int64), self.device)
            logprob_rows = logits.index_select(0, logprob_index).float().log_softmax(dim=-1)
        penalized_index = None
        if plan.penalized_rows:
            penalized_index = to_device(torch.tensor(plan.penalized_rows, dtype=torch.int64), self.device)
            logits = self._penalize(logits, penalized_index, table_rows.index_select(0, penalized_index))
        if plan.banned:
            rows, tokens = to_device(torch.tensor(plan.banned, dtype=torch.int64).T, self.device)
            logits = logits.float().index_put((rows, tokens), torch.tensor(float("-inf"), device=self.device))
        ids = self._draw(logits, step)
        if penalized_index is not None:
            counted = (table_rows.index_select(0, penalized_index), ids.index_select(0, penalized_index))
            self.output_counts.index_put_(counted, torch.ones_like(counted[0], dtype=torch.int32), accumulate=True)
        if logprob_rows is None:
            return ids, None
        chosen = logprob_rows.gather(1, ids.index_select(0, logprob_index)[:, None])[:, 0]
        top_values, top_ids = logprob_rows.topk(plan.num_logprobs, dim=-1)
        return ids, StepLogprobs(plan.logprob_rows, chosen, top_values, top_ids)

    def _penalize(self, logits: torch.Tensor, penalized: torch.Tensor, table_rows: torch.Tensor) -> torch.Tensor:
        """``logits`` (float32, new tensor) with the penalties of the logits rows ``penalized``
        (table rows ``table_rows``) applied."""
        picked = logits.index_select(0, penalized).float()
        counts = self.output_counts.index_select(0, table_rows)
        present = counts > 0
        presence, frequency, repetition = self.floats[2:5].index_select(1, table_rows)[:, :, None]
        seen = present | self.prompt_seen.index_select(0, table_rows)
        picked = torch.where(seen, torch.where(picked > 0, picked / repetition, picked * repetition), picked)
        picked = picked - frequency * counts - presence * present
        return logits.float().index_copy(0, penalized, picked)

    def _draw(self, logits: torch.Tensor, step: ForwardBatch) -> torch.Tensor:
        random_rows = step.sampling.random_rows
        if not random_rows:
            columns = {name: t[:logits.shape[0]] for name, t in self._greedy.items()}
            return self.sampler(logits, **columns, random_rows=self._no_rows)
        row_seqs = step.batch.logits_row_seqs
        params = [row_seqs[i].sampling_params for i in random_rows]
        floats, ints = self.floats[:2].index_select(1, step.table_rows), self.ints.index_select(1, step.table_rows)
        top_ks = [p.top_k for p in params]
        return self.sampler(logits, floats[0], ints[0], floats[1], ints[1], step.output_indices,
                            random_rows=step.random_rows, max_top_k=max(top_ks) if min(top_ks) > 0 else None,
                            use_top_k=max(top_ks) > 0, use_top_p=any(p.top_p < 1 for p in params))
