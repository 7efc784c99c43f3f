"""A step's sampling from the persistent input batch's rows.

Each sequence's sampling parameters, and a penalised one's output token counts and prompt
tokens, live in its row of the ``InputBatch`` (written once, when it joins); every token a
penalised sequence samples is counted there on the device (no host work per token). A step then
applies the constraints its host plan built (a grammar's token bitmask, ``logit_bias``,
``allowed_token_ids``, bad words), the penalties (vLLM's order: repetition, then frequency and
presence), bans EOS and the stop token ids of sequences short of ``min_tokens``, samples
(temperature, min-p, top-k, top-p), and gathers the logprobs asked for (the log-softmax of the
model's logits, before any constraint, penalty or temperature). Every list and tensor of a step
here is indexed by logits row: each entry's, then each drafted token's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.layers.sampler import Sampler
from engine.scheduling.step import ScheduledBatch
from engine.worker.device_copy import to_device, to_device_packed
from engine.worker.forward_batch import ForwardBatch, SamplingPlan
from engine.worker.input_batch import InputBatch


@dataclass
class StepLogprobs:
    """Logprobs of the logits ``rows`` that asked for them: the sampled token's (``chosen`` [P]) and
    the most likely tokens' (``top_ids`` / ``top_values`` [P, N]); float32 / int64 tensors."""

    rows: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor


class BatchSampler:
    """Samples the steps of an engine over the rows of ``rows`` (its ``InputBatch``): a step
    samples at most ``max_batch`` logits rows. ``plan(batch, output_indices)`` on the host;
    ``sample(logits, step)`` on the device. EOS ids (``eos_token_ids``) count as stop ids for
    min_tokens. Every constraint acts on the logits before the draw: ``logit_bias`` is added to
    them (float32), banned tokens (bad words, stop ids before min_tokens, ids outside
    ``allowed_token_ids``, a grammar's refusals) become -inf; logprobs are read before any of it.

    ``grammar`` (None: no request has a grammar; set by the engine where sampling happens, rank 0
    under TP) is the grammar state of the requests with ``structured`` params: ``fill(rows)``
    takes the (logits row, Sequence) of the step's grammar rows on the host and returns a mask,
    ``apply(logits, mask)`` sets the tokens the mask refuses to -inf in place on the device."""

    def __init__(self, rows: InputBatch, max_batch: int, sampler: Sampler, eos_token_ids=frozenset()):
        self.rows, self.vocab_size, self.device, self.sampler = rows, rows.vocab_size, rows.device, sampler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammar = None
        device = self.device
        self._greedy = dict(
            temperatures=torch.zeros(max_batch, device=device), top_ks=torch.zeros(max_batch, dtype=torch.int64,
                                                                                   device=device),
            top_ps=torch.ones(max_batch, device=device), seeds=torch.zeros(max_batch, dtype=torch.int64,
                                                                            device=device),
            output_indices=torch.zeros(max_batch, dtype=torch.int64, device=device))
        self._no_rows = torch.zeros(0, dtype=torch.int64, device=device)

    def plan(self, batch: ScheduledBatch, output_indices: list[int]) -> SamplingPlan:
        """The step's sampling from its logits rows' parameters and output indices: one row per
        entry, then one per drafted token (``batch.logits_row_seqs``), which always samples. A bad
        word's last token is banned where the output before the row's index ends with the word's
        other tokens (a request whose bad words read the output has them all on the host)."""
        plan = SamplingPlan([], [], [], [], 0)
        grammar_rows = []
        row_samples = batch.samples + [True] * (batch.num_logits_rows - len(batch))
        for i, (seq, samples, index) in enumerate(zip(batch.logits_row_seqs, row_samples, output_indices)):
            params = seq.sampling_params
            if params.temperature > 0:
                plan.random_rows.append(i)
            if not samples:
                continue
            if params.penalized:
                plan.penalized_rows.append(i)
            if index < params.min_tokens:
                stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
                plan.banned += [(i, t) for t in sorted(stops) if t < self.vocab_size]
            if params.logprobs is not None:
                plan.logprob_rows.append(i)
                plan.num_logprobs = max(plan.num_logprobs, params.logprobs)
            if params.constrained:
                if params.structured is not None:
                    grammar_rows.append((i, seq))
                plan.biased += [(i, t, b) for t, b in params.logit_bias]
                if params.allowed_token_ids is not None:
                    plan.allowed_rows.append(i)
                    plan.allowed += [(i, t) for t in params.allowed_token_ids]
                if params.bad_words_token_ids:
                    bans = _bad_word_bans(params.bad_words_token_ids, seq.output_token_ids[:index])
                    plan.banned += [(i, t) for t in bans]
        if grammar_rows and self.grammar is not None:
            plan.grammar_mask = self.grammar.fill(grammar_rows)
        return plan

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
        logits = self._constrain(logits, plan)
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
            self.rows.output_counts.index_put_(counted, torch.ones_like(counted[0], dtype=torch.int32), accumulate=True)
        if logprob_rows is None:
            return ids, None
        chosen = logprob_rows.gather(1, ids.index_select(0, logprob_index)[:, None])[:, 0]
        top_values, top_ids = logprob_rows.topk(plan.num_logprobs, dim=-1)
        return ids, StepLogprobs(plan.logprob_rows, chosen, top_values, top_ids)

    def _constrain(self, logits: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
        """``logits`` with the plan's grammar mask (in place), biases and allowed-token masks
        applied (a new float32 tensor when there are biases or allowed rows)."""
        if plan.grammar_mask is not None:
            self.grammar.apply(logits, plan.grammar_mask)
        if plan.biased:
            rows, tokens = to_device(torch.tensor([(r, t) for r, t, _ in plan.biased], dtype=torch.int64).T,
                                     self.device)
            biases = to_device(torch.tensor([b for _, _, b in plan.biased], dtype=torch.float32), self.device)
            logits = logits.float().index_put((rows, tokens), biases, accumulate=True)
        if plan.allowed:
            d = to_device_packed({"rows": torch.tensor(plan.allowed_rows, dtype=torch.int64),
                                  "pairs": torch.tensor(plan.allowed, dtype=torch.int64).T.flatten()}, self.device)
            refused = torch.zeros(logits.shape, dtype=torch.bool, device=self.device)
            refused[d["rows"]] = True
            refused[tuple(d["pairs"].view(2, -1))] = False
            logits = logits.float().masked_fill(refused, float("-inf"))
        return logits

    def _penalize(self, logits: torch.Tensor, penalized: torch.Tensor, table_rows: torch.Tensor) -> torch.Tensor:
        """``logits`` (float32, new tensor) with the penalties of the logits rows ``penalized``
        (table rows ``table_rows``) applied."""
        picked = logits.index_select(0, penalized).float()
        counts = self.rows.output_counts.index_select(0, table_rows)
        present = counts > 0
        presence, frequency, repetition = self.rows.floats[2:5].index_select(1, table_rows)[:, :, None]
        seen = present | self.rows.prompt_seen.index_select(0, table_rows)
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
        floats = self.rows.floats.index_select(1, step.table_rows)
        ints = self.rows.ints.index_select(1, step.table_rows)
        top_ks = [p.top_k for p in params]
        return self.sampler(logits, floats[0], ints[0], floats[1], ints[1], step.output_indices, floats[5],
                            random_rows=step.random_rows, max_top_k=max(top_ks) if min(top_ks) > 0 else None,
                            use_top_k=max(top_ks) > 0, use_top_p=any(p.top_p < 1 for p in params),
                            use_min_p=any(p.min_p > 0 for p in params))


def _bad_word_bans(bad_words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The tokens the bad words ban after ``output`` (vLLM's rule): a one-token word's token
    always, a longer word's last token when ``output`` ends with its other tokens."""
    return sorted({word[-1] for word in bad_words
                   if len(word) == 1 or (len(output) >= len(word) - 1 and tuple(output[1 - len(word):]) == word[:-1])})
