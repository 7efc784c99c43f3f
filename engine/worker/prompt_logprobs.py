"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's semantics): for each prompt token
after the first, its log-probability given the tokens before it and the most likely tokens',
computed on the device during the request's prefill chunks.

Target ``t`` (the prompt token at position ``t >= 1``) is read from the logits of the token at
``t - 1`` (float32 log-softmax, before any constraint, penalty or temperature). A chunk of ``n``
tokens from ``start`` gives the targets ``start + 1 .. min(start + n, P - 1)`` (P: the prompt's
length): the logits of the prompt's last token predict the first output token, which is
sampled, not a prompt logprob. A request asking for them reuses no cached prefix (the block manager gives
it no hits), so its chunks cover the whole prompt; a recomputed one (preempted) gives them again
and the output processor keeps the first. Only the chosen value and the top-N ids / values per
target are read back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.scheduling.step import ScheduledBatch

SLICE_ROWS = 1024  # targets whose float32 log-softmax is held at once


@dataclass
class PromptLogprobsPlan:
    """A step's prompt logprobs, decided on the host: ``entries`` (request id, first target
    position, number of targets, alternatives it asks for) in target order, ``token_indices`` [Q] (the step tokens whose
    logits give each target), ``targets`` [Q] (the target token ids) and ``num_logprobs`` (the
    most alternatives a request asks for). The runner adds ``rows`` [Q] (int64 on the device: the
    logits rows of ``token_indices``) and ``target_ids`` [Q] (int64 on the device)."""

    entries: list[tuple[str, int, int, int]]
    token_indices: list[int]
    targets: list[int]
    num_logprobs: int
    rows: torch.Tensor | None = None
    target_ids: torch.Tensor | None = None


def plan_prompt_logprobs(batch: ScheduledBatch, token_offsets: list[int]) -> PromptLogprobsPlan | None:
    """The batch's prompt logprobs (None: no entry gives any). ``token_offsets[i]``: the index
    among the step's tokens of entry i's first token."""
    plan = PromptLogprobsPlan([], [], [], 0)
    for seq, start, n, offset in zip(batch.seqs, batch.starts, batch.num_tokens, token_offsets):
        asked = seq.sampling_params.prompt_logprobs
        end = min(start + n, seq.num_prompt_tokens - 1)  # targets start + 1 .. end
        if asked is None or end <= start:
            continue
        plan.entries.append((seq.request_id, start + 1, end - start, asked))
        plan.token_indices += range(offset, offset + end - start)
        plan.targets += seq.prompt_token_ids[start + 1:end + 1]
        plan.num_logprobs = max(plan.num_logprobs, asked)
    return plan if plan.entries else None


def gather_prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobsPlan) -> list[torch.Tensor]:
    """[chosen [Q] float32, top_values [Q, N] float32, top_ids [Q, N] int64] from the step's
    ``logits`` [rows, V] at ``plan.rows``, ``SLICE_ROWS`` targets at a time."""
    parts = []
    for rows, targets in zip(plan.rows.split(SLICE_ROWS), plan.target_ids.split(SLICE_ROWS)):
        logprobs = logits.index_select(0, rows).float().log_softmax(dim=-1)
        parts.append((logprobs.gather(1, targets[:, None])[:, 0], *logprobs.topk(plan.num_logprobs, dim=-1)))
    return [torch.cat(column) for column in zip(*parts)]


def read_prompt_logprobs(plan: PromptLogprobsPlan, host: list[torch.Tensor]) -> dict[str, tuple[int, list]]:
    """Request id -> (its first target position, [(token id, logprob, [(token id, logprob)] of
    the most likely tokens it asks for, most likely first)] per target) from the read-back
    ``host`` tensors of ``gather_prompt_logprobs``."""
    chosen, values, ids = (t.tolist() for t in host)
    out, at = {}, 0
    for request_id, first, count, n in plan.entries:
        out[request_id] = (first, [(token, chosen[j], list(zip(ids[j][:n], values[j][:n])))
                                   for token, j in zip(plan.targets[at:at + count], range(at, at + count))])
        at += count
    return out
