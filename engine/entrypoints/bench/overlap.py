"""``python -m engine bench overlap``: the overlapped engine step against the synchronous one, on
a simulated device, in seconds on a CPU.

The engine is real — scheduler, the runner's host side (``ModelRunner.prepare``: table rows,
sampling plan, pending-token moves, the step's inputs copied to the device), postprocessing and
detokenisation with the demo model's tokenizer — but the device is a timeline: a launched step
occupies it for ``gpu_ms`` after the previous step, and reading the step's tokens back waits
until it is done. With overlap a step should take about max(host, device) time; without,
host + device. Tokens are pseudo-random ids (a hash of the
request's seed and the output index), every request ignores EOS, so the work is the same in
both modes.
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from engine.entrypoints.bench.offline import random_prompt
from engine.scheduling.sequence import SamplingParams
from engine.scheduling.step import ScheduledBatch
from engine.worker.model_runner import ModelRunner
from engine.worker.runner import LaunchedStep


class SimulatedStep(LaunchedStep):
    """A launched step on the simulated device: ``token_ids()`` waits until the device is done."""

    def __init__(self, batch: ScheduledBatch, token_ids: list[int], done_at: float):
        super().__init__(batch, torch.tensor(token_ids, dtype=torch.int64))
        self.done_at = done_at

    def token_ids(self) -> list[int]:
        delay = self.done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return super().token_ids()


class SimulatedDevice:
    """Replaces a ModelRunner's ``launch``: the runner's ``prepare`` runs for real, the forward is
    ``gpu_ms(batch size)`` on a device timeline (linear from ``gpu_ms_one`` at one sequence to
    ``gpu_ms_full`` at ``full_batch``)."""

    def __init__(self, runner: ModelRunner, vocab_size: int, gpu_ms_one: float, gpu_ms_full: float, full_batch: int):
        self.runner, self.vocab_size = runner, vocab_size
        self.gpu_ms_one, self.gpu_ms_full, self.full_batch = gpu_ms_one, gpu_ms_full, full_batch
        self.busy_until = 0.0
        self.busy_seconds = 0.0

    def gpu_seconds(self, batch_size: int) -> float:
        fraction = (batch_size - 1) / max(1, self.full_batch - 1)
        return 1e-3 * (self.gpu_ms_one + fraction * (self.gpu_ms_full - self.gpu_ms_one))

    def launch(self, batch: ScheduledBatch, previous=None) -> SimulatedStep:
        self.runner.prepare(batch, previous)
        seconds = self.gpu_seconds(len(batch))
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + seconds
        self.busy_seconds += seconds
        tokens = [hash((seq.seed, start_ + n)) % self.vocab_size
                  for seq, start_, n in zip(batch.seqs, batch.starts, batch.num_tokens)]
        return SimulatedStep(batch, tokens, self.busy_until)


def run_mode(engine, device: SimulatedDevice, num_seqs: int, prompt_len: int, output_len: int, seed: int) -> dict:
    """``num_seqs`` requests at once until all finish; per-step wall, host and device time of the
    steady part (every request decoding: the steps after the first ``num_seqs`` steps' prefill)."""
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    ids = [engine.add_request(random_prompt(rng, prompt_len, vocab),
                              SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, seed=i))
           for i in range(num_seqs)]
    while not all(engine.request_output(rid).token_ids for rid in ids):
        engine.step()  # prefill: every request has its first token
    steps, host, busy = engine.num_steps, engine.host_seconds, device.busy_seconds
    wall = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - start)
    steps = engine.num_steps - steps
    texts = [engine.pop_request(rid).text for rid in ids]
    assert all(texts), "a request produced no text"
    host_ms = 1e3 * (engine.host_seconds - host) / len(wall)
    gpu_ms = 1e3 * (device.busy_seconds - busy) / steps
    step_ms = 1e3 * sum(wall) / len(wall)
    return {"overlap": engine.overlap, "steps": len(wall), "step_ms": step_ms,
            "step_ms_median": 1e3 * statistics.median(wall), "host_ms_per_step": host_ms, "gpu_ms_per_step": gpu_ms,
            "device_busy_pct": 100 * (device.busy_seconds - busy) / sum(wall)}


def bench_overlap(num_seqs_list: list[int], gpu_ms_one: float, gpu_ms_full: float, prompt_len: int,
                  output_len: int, seed: int) -> dict:
    """Both modes at each batch size, with the floors each should reach: overlap about
    max(host, gpu) per step, synchronous about host + gpu."""
    from engine.core.llm_engine import LLMEngine

    full = max(num_seqs_list)
    results = []
    for num_seqs in num_seqs_list:
        for overlap in (False, True):
            # the pool holds max_num_seqs x max_model_len tokens: one block of room beyond the requests' own
            # keeps the free-block watermark from holding the last one back
            engine = LLMEngine(max_num_seqs=full, max_model_len=prompt_len + output_len + 16, dtype="bfloat16",
                               overlap=overlap, max_num_batched_tokens=max(8192, full * prompt_len))
            device = SimulatedDevice(engine.runner, engine.config.vocab_size, gpu_ms_one, gpu_ms_full, full)
            engine.runner.launch = device.launch
            row = {"num_seqs": num_seqs, **run_mode(engine, device, num_seqs, prompt_len, output_len, seed)}
            row["floor_ms"] = (max if overlap else sum)((row["host_ms_per_step"], row["gpu_ms_per_step"]))
            row["step_vs_floor"] = row["step_ms"] / row["floor_ms"]
            results.append(row)
    for sync, over in zip(results[::2], results[1::2]):
        over["speedup_vs_sync"] = sync["step_ms"] / over["step_ms"]
    return {"simulated_device": {"gpu_ms_at_1": gpu_ms_one, "gpu_ms_at_full": gpu_ms_full, "full_batch": full},
            "prompt_len": prompt_len, "output_len": output_len, "results": results}
