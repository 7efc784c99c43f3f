"""Sampling state on the device, one row per running sequence, and a step's sampling from it.

Each sequence's sampling parameters are written into its row once, when it gets the row;
a sequence with penalties also gets its output token counts and its prompt's tokens there,
and every token it samples is counted on the device (no host work per token). A step then
applies the penalties (vLLM's order: repetition, then frequency and presence), bans EOS and
the stop token ids of sequences short of ``min_tokens``, samples, and gathers the logprobs
asked for (the log-softmax of the logits before penalties and temperature).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.sampler import Sampler
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.staging import to_device


@dataclass
class SamplingPlan:
    """A step's sampling, decided on the host from its entries' parameters: the ``sampled``
    entries (temperature > 0; the others take the argmax), the ``penalized`` entries that sample a
    token, the ``banned`` (entry, token id) pairs (min_tokens not reached), and the ``logprobs``
    entries with the most alternatives one of them asks for (``num_logprobs``)."""

    sampled: list[int]
    penalized: list[int]
    banned: list[tuple[int, int]]
    logprobs: list[int]
    num_logprobs: int


@dataclass
class StepLogprobs:
    """Logprobs of the ``entries`` that asked for them: the sampled token's (``chosen`` [P]) and
    the most likely tokens' (``top_ids`` / ``top_values`` [P, N]); float32 / int64 tensors."""

    entries: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor


class SamplingRows:
    """``num_rows`` rows of sampling state over a ``vocab_size`` vocabulary on ``device``; a step
    samples at most ``max_batch`` logits rows (its sampled rows: entries and drafted tokens).
    ``write(new)`` when sequences get their rows; ``plan(batch, steps)`` on the host;
    ``sample(...)`` on the device. EOS ids (``eos_token_ids``) count as stop ids for min_tokens."""

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
            steps=torch.zeros(max_batch, dtype=torch.int64, device=device))
        self._no_rows = torch.zeros(0, dtype=torch.int64, device=device)

    def write(self, new: list[tuple[int, Sequence]]) -> None:
        """Sequences that just got their ``row``: parameters into the columns; a penalised one's
        counts of the output it has so far (a recomputed one has some) and its prompt's tokens."""
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

    def plan(self, batch: ScheduledBatch, steps: list[int]) -> SamplingPlan:
        """The step's sampling from its rows' parameters and output indexes (``steps``): one row
        per entry, then one per drafted token (``batch.row_seqs``), which always samples."""
        sampled, penalized, banned, logprobs, num_logprobs = [], [], [], [], 0
        row_samples = batch.samples + [True] * (batch.num_rows - len(batch))
        for i, (seq, samples, step) in enumerate(zip(batch.row_seqs, row_samples, steps)):
            params = seq.sampling_params
            if params.temperature > 0:
                sampled.append(i)
            if not samples:
                continue
            if params.penalized:
                penalized.append(i)
            if step < params.min_tokens:
                stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
                banned += [(i, t) for t in sorted(stops) if t < self.vocab_size]
            if params.logprobs is not None:
                logprobs.append(i)
                num_logprobs = max(num_logprobs, params.logprobs)
        return SamplingPlan(sampled, penalized, banned, logprobs, num_logprobs)

    def sample(self, logits: torch.Tensor, batch: ScheduledBatch, plan: SamplingPlan, rows: torch.Tensor,
               steps: torch.Tensor, sampled_rows: torch.Tensor) -> tuple[torch.Tensor, StepLogprobs | None]:
        """Token ids [R] for the ``logits`` [R, V] of the batch's sampled rows (each row's
        parameters from its table row ``rows``, its output index from ``steps``; ``sampled_rows`` =
        ``plan.sampled`` on the device), and the
        logprobs asked for (rank 0 only under TP: the others receive the ids). An all-greedy batch
        is one argmax; otherwise only the sampled entries draw, with the candidate count and top-p
        pass decided from the host-side parameters."""
        logprob_rows = None
        if plan.logprobs and self.sampler.tp.rank == 0:
            logprob_index = to_device(torch.tensor(plan.logprobs, dtype=torch.int64), self.device)
            logprob_rows = logits.index_select(0, logprob_index).float().log_softmax(dim=-1)
        penalized_index = None
        if plan.penalized:
            penalized_index = to_device(torch.tensor(plan.penalized, dtype=torch.int64), self.device)
            logits = self._penalize(logits, penalized_index, rows.index_select(0, penalized_index))
        if plan.banned:
            entries, tokens = to_device(torch.tensor(plan.banned, dtype=torch.int64).T, self.device)
            logits = logits.float().index_put((entries, tokens), torch.tensor(float("-inf"), device=self.device))
        ids = self._draw(logits, batch, plan.sampled, rows, steps, sampled_rows)
        if penalized_index is not None:
            counted = (rows.index_select(0, penalized_index), ids.index_select(0, penalized_index))
            self.output_counts.index_put_(counted, torch.ones_like(counted[0], dtype=torch.int32), accumulate=True)
        if logprob_rows is None:
            return ids, None
        chosen = logprob_rows.gather(1, ids.index_select(0, logprob_index)[:, None])[:, 0]
        top_values, top_ids = logprob_rows.topk(plan.num_logprobs, dim=-1)
        return ids, StepLogprobs(plan.logprobs, chosen, top_values, top_ids)

    def _penalize(self, logits: torch.Tensor, entries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``logits`` (float32, new tensor) with the penalties of the ``entries`` (rows ``rows``) applied."""
        picked = logits.index_select(0, entries).float()
        counts = self.output_counts.index_select(0, rows)
        present = counts > 0
        presence, frequency, repetition = self.floats[2:5].index_select(1, rows)[:, :, None]
        seen = present | self.prompt_seen.index_select(0, rows)
        picked = torch.where(seen, torch.where(picked > 0, picked / repetition, picked * repetition), picked)
        picked = picked - frequency * counts - presence * present
        return logits.float().index_copy(0, entries, picked)

    def _draw(self, logits, batch: ScheduledBatch, sampled: list[int], rows, steps, sampled_rows) -> torch.Tensor:
        if not sampled:
            columns = {name: t[:logits.shape[0]] for name, t in self._greedy.items()}
            return self.sampler(logits, **columns, sampled_rows=self._no_rows)
        row_seqs = batch.row_seqs
        params = [row_seqs[i].sampling_params for i in sampled]
        floats, ints = self.floats[:2].index_select(1, rows), self.ints.index_select(1, rows)
        top_ks = [p.top_k for p in params]
        return self.sampler(logits, floats[0], ints[0], floats[1], ints[1], steps, sampled_rows=sampled_rows,
                            max_top_k=max(top_ks) if min(top_ks) > 0 else None,
                            use_top_k=max(top_ks) > 0, use_top_p=any(p.top_p < 1 for p in params))
