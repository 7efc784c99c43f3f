"""The runner interface the engine drives, and the step it launches.

``Runner`` is what ``LLMEngine`` needs of a runner: ``launch`` a scheduled batch (the forward and
the sampling queued on the device, fed by the previous step's ids) into a ``LaunchedStep``,
``release`` a sequence's rows, the request ids it holds, and what its summary line reports.
``ModelRunner`` (our model, paged KV cache, CUDA graphs) and ``HFModelRunner`` (transformers'
model, its own cache per sequence) implement it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from engine.scheduling.step import ScheduledBatch
from engine.worker.prompt_logprobs import PromptLogprobsPlan, read_prompt_logprobs

if TYPE_CHECKING:
    from engine.scheduling.sequence import Sequence
    from engine.worker.sampling import StepLogprobs


def unique_parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class LaunchedStep:
    """A batch whose forward and sampling are queued on the device. ``sampled_ids``: int64
    ``[batch.num_logits_rows]`` on the device, one id per batch entry (meaningless for an entry
    that does not sample), then one per drafted token (the token sampled after it), the logprobs
    of the requests that asked for them and the ``prompt_logprobs`` of its ``prompt_plan`` (the
    tensors of ``gather_prompt_logprobs``). On CUDA all start towards pinned host memory at once
    (non-blocking, an event records the copies); ``token_ids()``, ``logprobs()`` and
    ``prompt_logprobs()`` wait for them."""

    def __init__(self, batch: ScheduledBatch, sampled_ids: torch.Tensor, logprobs: StepLogprobs | None = None,
                 prompt_plan: PromptLogprobsPlan | None = None, prompt_logprobs: list[torch.Tensor] | None = None):
        self.batch, self.sampled_ids, self._logprobs, self._prompt_plan = batch, sampled_ids, logprobs, prompt_plan
        self._index_of: dict[str, int] | None = None
        self._host, self._copied = [sampled_ids], None
        if logprobs is not None:
            self._host += [logprobs.chosen, logprobs.top_values, logprobs.top_ids]
        self._num_prompt = len(prompt_logprobs or ())
        self._host += prompt_logprobs or []
        if sampled_ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in self._host]
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(sampled_ids.device))

    def _wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def token_ids(self) -> list[int]:
        """The sampled ids on the host (waits for the step and the copy)."""
        self._wait()
        return self._host[0].tolist()

    def logprobs(self) -> dict[str, tuple[float, list[tuple[int, float]]]]:
        """Request id -> (the sampled token's logprob, [(token id, logprob)] of the most likely
        tokens, most likely first), for the requests that asked."""
        if self._logprobs is None:
            return {}
        self._wait()
        chosen, values, ids = (t.tolist() for t in self._host[1:4])
        seqs = [self.batch.seqs[row] for row in self._logprobs.rows]  # an entry's logits row is its index
        return {seq.request_id: (c, list(zip(i[:seq.sampling_params.logprobs], v[:seq.sampling_params.logprobs])))
                for seq, c, v, i in zip(seqs, chosen, values, ids)}

    def prompt_logprobs(self) -> dict[str, tuple[int, list]]:
        """Request id -> (first target position, [(token id, logprob, [(token id, logprob)])] per
        target) of the prompt logprobs this step computed (``read_prompt_logprobs``; rank 0)."""
        if not self._num_prompt:
            return {}
        self._wait()
        return read_prompt_logprobs(self._prompt_plan, self._host[-self._num_prompt:])

    @property
    def index_of(self) -> dict[str, int]:
        """Request id -> its entry in the batch."""
        if self._index_of is None:
            self._index_of = {seq.request_id: i for i, seq in enumerate(self.batch.seqs)}
        return self._index_of


class Runner(Protocol):
    """What the engine drives. ``num_blocks``: KV blocks for the scheduler's block manager;
    ``model``, ``weight_bytes``, ``kv_cache_bytes``, ``load_seconds``: for the summary line."""
    num_blocks: int
    model: nn.Module
    weight_bytes: int
    kv_cache_bytes: int
    load_seconds: float

    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue ``batch``'s forward and sampling; ``previous`` (the step in flight) feeds the
        tokens it sampled and the host does not know yet."""

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s rows (finished, preempted or rejected)."""

    @property
    def held(self) -> list[str]:
        """The request ids holding rows."""
