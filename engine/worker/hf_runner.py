"""The ``hf`` backend: transformers' ``AutoModelForCausalLM`` under our scheduler and sampler.

A fallback for a model our own runners do not cover, or to cross-check them: no paged KV
cache (each sequence keeps transformers' own cache, and runs alone), the same Sequence /
Scheduler / Sampler / engine loop. Single process only.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from engine.distributed import TPGroup
from engine.model.layers.sampler import Sampler
from engine.scheduling.sequence import Sequence
from engine.scheduling.step import ScheduledBatch
from engine.worker.runner import LaunchedStep, unique_parameter_bytes

if TYPE_CHECKING:
    from engine.core.engine_config import EngineConfig


class HFModelRunner:
    """A ``Runner`` (``engine.worker.runner``) like ``ModelRunner``: ``launch(batch) -> LaunchedStep``,
    ``release(seq)``, ``held``, ``num_blocks`` (here only a token budget for the scheduler:
    ``max_num_seqs x max_model_len``).

    Each step feeds a sequence its scheduled tokens (a whole prompt, a prefill chunk, or the
    decode token) on top of its own transformers cache; ``release`` drops that cache, so a
    preempted sequence starts again from its first token. It runs each step to the end at
    launch and needs every input token known on the host (no step in flight: the engine runs
    this backend without overlap). Built from the resolved ``EngineConfig`` like ``ModelRunner``."""

    def __init__(self, config: EngineConfig, tp: TPGroup):
        import transformers

        if tp.size > 1:
            raise ValueError("the hf backend runs in a single process; use the tp backend under torchrun")
        self.device, self.dtype = config.parallel.device, config.model.dtype
        start = time.perf_counter()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(config.model.model_dir), dtype=self.dtype).to(self.device).eval()
        self.load_seconds = time.perf_counter() - start
        self.weight_bytes = unique_parameter_bytes(self.model)
        sched = config.scheduler
        self.num_blocks = sched.max_num_seqs * math.ceil(sched.max_model_len / config.cache.block_size)
        self.kv_cache_bytes = 0
        self.sampler = Sampler(tp)
        self._caches: dict[str, object] = {}

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        logits = []
        for seq, start, num in zip(batch.seqs, batch.starts, batch.num_tokens):
            if start + num > seq.num_known_tokens:
                raise RuntimeError("the hf backend runs without overlap: every input token must be known")
            ids = [seq.last_token_id] if start == seq.num_known_tokens - 1 else seq.token_ids[start:start + num]
            out = self.model(input_ids=torch.tensor([ids], device=self.device),
                             past_key_values=self._caches[seq.request_id] if start else None, use_cache=True)
            self._caches[seq.request_id] = out.past_key_values
            logits.append(out.logits[0, -1])
        return LaunchedStep(batch, self._sample(torch.stack(logits), batch))

    def _sample(self, logits: torch.Tensor, batch: ScheduledBatch) -> torch.Tensor:
        params = [s.sampling_params for s in batch.seqs]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        output_indices = [start + n - s.num_prompt_tokens
                          for s, start, n in zip(batch.seqs, batch.starts, batch.num_tokens)]
        return self.sampler(logits, column([p.temperature for p in params], torch.float32),
                            column([p.top_k for p in params], torch.int64),
                            column([p.top_p for p in params], torch.float32),
                            column([s.seed for s in batch.seqs], torch.int64), column(output_indices, torch.int64),
                            column([p.min_p for p in params], torch.float32))

    def release(self, seq: Sequence) -> None:
        self._caches.pop(seq.request_id, None)

    @property
    def held(self) -> list[str]:
        """The request ids holding a transformers cache."""
        return list(self._caches)
