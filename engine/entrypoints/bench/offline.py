"""Offline benchmarks on an LLMEngine: B=1 latency (decode tok/s, TTFT) and nano-vllm-shaped
throughput, plus the host/GPU split of a decode step. Prompts are random token ids from a
seeded ``random.Random``; every request ignores EOS, so token counts are what was asked."""
from __future__ import annotations

import random
import statistics
import time

import torch
from tqdm import tqdm

from engine.scheduling.sequence import SamplingParams


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_to_end(engine) -> int:
    """Step until nothing is unfinished; returns the number of steps."""
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps


def warm_up(engine, rng: random.Random) -> None:
    """One short request (prefill + a few decode steps): kernels compiled, allocator warm."""
    rid = engine.add_request(random_prompt(rng, 16, engine.config.vocab_size), greedy(8), detokenize=False)
    run_to_end(engine)
    engine.pop_request(rid)


def measure_ttft(engine, rng: random.Random, requested: int, repeats: int) -> dict:
    """Time to first token of a ``requested``-token prompt (clamped to what the engine admits):
    add_request until the engine reports the one-token request finished (its token read back),
    median of ``repeats`` fresh random prompts (no prefix-cache hits)."""
    length = min(requested, engine.max_model_len - 1, engine.scheduler.max_num_batched_tokens)
    times = []
    for _ in range(repeats):
        prompt = random_prompt(rng, length, engine.config.vocab_size)
        start = time.perf_counter()
        rid = engine.add_request(prompt, greedy(1), detokenize=False)
        run_to_end(engine)
        times.append(time.perf_counter() - start)
        out = engine.pop_request(rid)
        assert out.finished and len(out.token_ids) == 1, out
    return {"requested_prompt_len": requested, "prompt_len": length, "ms": 1e3 * statistics.median(times),
            "ms_all": [1e3 * t for t in times]}


def measure_decode(engine, prompt: list[int], tokens: int) -> dict:
    """B=1 decode: from the first output token read back to the last, ``tokens`` more tokens
    (one decode step each; with overlapped steps each step launches the next decode before it
    reads the last one back)."""
    rid = engine.add_request(prompt, greedy(tokens + 1), detokenize=False)
    while not engine.request_output(rid).token_ids:
        engine.step()  # the prefill, read back: the first output token
    steps_before, start = engine.num_steps, time.perf_counter()
    with tqdm(total=tokens, desc="decode B=1", unit="tok") as bar:
        while engine.has_unfinished_requests():
            bar.update(sum(len(out.token_ids) for out in engine.step()))
    seconds = time.perf_counter() - start
    out = engine.pop_request(rid)
    decoded = len(out.token_ids) - 1
    assert decoded == tokens, (decoded, tokens)
    return {"batch_size": 1, "prompt_len": len(prompt), "tokens": decoded, "steps": engine.num_steps - steps_before,
            "overlap": engine.overlap, "seconds": seconds, "tok_s": decoded / seconds,
            "ms_per_token": 1e3 * seconds / decoded}


class StepTimer:
    """Host and GPU time of engine steps, through forward hooks on the runner's model (start)
    and sampler (end). Host: ``perf_counter`` from the model's forward to the end of the
    sampler's (dispatch only: a decode step has no host sync before its result is read), and
    to the end of the model's forward (the decoder stack). GPU (CUDA): events around the same
    span, with a GPU sleep queued first so that every kernel of the step is queued before the
    GPU reaches the first, and the events time the kernels without host gaps."""

    def __init__(self, runner):
        self.runner, self.device = runner, runner.device
        self.cuda = self.device.type == "cuda"
        self.clear()
        self.sleep_cycles = 0
        if self.cuda:
            self._events = []
            self.cycles_per_ms = self._calibrate_sleep()

    def clear(self) -> None:
        """Forget the samples so far (the sleep length stays)."""
        self.host_step, self.host_forward, self.gpu_step = [], [], []

    def _calibrate_sleep(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / start.elapsed_time(end)

    def _model_pre(self, module, inputs):
        if self.cuda:
            torch.cuda._sleep(self.sleep_cycles)
            self._events = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            self._events[0].record()
        self._t0 = time.perf_counter()

    def _model_post(self, module, inputs, output):
        self._t_forward = time.perf_counter()

    def _sampler_post(self, module, inputs, output):
        now = time.perf_counter()
        if self.cuda:
            self._events[1].record()
        self.host_forward.append(self._t_forward - self._t0)
        self.host_step.append(now - self._t0)

    def time_steps(self, engine, steps: int) -> None:
        """Run ``steps`` engine steps (decode steps of what is running) under the hooks."""
        handles = [self.runner.model.register_forward_pre_hook(self._model_pre),
                   self.runner.model.register_forward_hook(self._model_post),
                   self.runner.sampling.sampler.register_forward_hook(self._sampler_post)]
        try:
            for _ in range(steps):
                engine.step()
                if self.cuda:
                    self._events[1].synchronize()
                    self.gpu_step.append(self._events[0].elapsed_time(self._events[1]) / 1e3)
                    # the next sleep outlasts twice the longest dispatch seen: kernels queue ahead of the GPU
                    self.sleep_cycles = int(2 * 1e3 * max(self.host_step) * self.cycles_per_ms)
        finally:
            for handle in handles:
                handle.remove()


def measure_step_split(engine, rng: random.Random, prompt_len: int, steps: int, batch: int = 1) -> dict:
    """Host dispatch and GPU time of a decode step at ``batch`` sequences (median over
    ``steps`` after one untimed step, which also calibrates the GPU sleep)."""
    vocab = engine.config.vocab_size
    ids = [engine.add_request(random_prompt(rng, prompt_len, vocab), greedy(steps + 3), detokenize=False)
           for _ in range(batch)]
    engine.step()  # prefill
    engine.step()  # one plain decode step (its input fed on the device when steps overlap)
    timer = StepTimer(engine.runner)
    timer.time_steps(engine, 1)  # sizes the GPU sleep from this step's dispatch time
    timer.clear()
    timer.time_steps(engine, steps)
    run_to_end(engine)
    for rid in ids:
        engine.pop_request(rid)
    layers = engine.config.num_hidden_layers
    host_step, host_forward = statistics.median(timer.host_step), statistics.median(timer.host_forward)
    result = {"batch_size": batch, "context_len": prompt_len, "steps": steps, "num_layers": layers,
              "host_dispatch_us_per_step": 1e6 * host_step, "host_dispatch_us_forward": 1e6 * host_forward,
              "cpu_dispatch_us_per_layer": 1e6 * host_forward / layers}
    if timer.cuda:
        result["gpu_us_per_step"] = 1e6 * statistics.median(timer.gpu_step)
    else:
        result["gpu_us_per_step"] = None
        result["note"] = "no GPU: the host runs every kernel itself, so host time is the whole step"
    return result


def throughput_workload(num_seqs: int, min_len: int, max_len: int, vocab: int, max_model_len: int, seed: int):
    """nano-vllm's bench shape: prompts of random ids and random lengths in [min_len, max_len],
    output lengths in [min_len, max_len]; an output is cut where prompt + output would pass
    max_model_len."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(min_len, max_len), vocab) for _ in range(num_seqs)]
    outputs = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, [max(1, min(n, max_model_len - len(p))) for p, n in zip(prompts, outputs)]


def measure_throughput(engine, prompts: list[list[int]], output_lens: list[int], temperature: float,
                       desc: str = "throughput") -> dict:
    """Submit every request at once and step until all finish (prefills and decodes timed);
    ``host_ms_per_step``: the engine's host time per step, waits for the device excluded;
    ``monotonic_window``: the timed part's start and end in ``time.monotonic()`` seconds (the
    window ``GpuMonitor.report`` takes), ``seconds`` apart."""
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate(output_lens)]
    steps_before, host_before = engine.num_steps, engine.host_seconds
    start = time.monotonic()
    ids = [engine.add_request(p, sp, detokenize=False) for p, sp in zip(prompts, params)]
    with tqdm(total=len(ids), desc=desc, unit="req") as bar:
        while engine.has_unfinished_requests():
            bar.update(sum(out.finished for out in engine.step()))
    end = time.monotonic()
    seconds, window = end - start, (start, end)
    outputs = [engine.pop_request(rid) for rid in ids]
    rejected = [o.reject_reason for o in outputs if o.finish_reason == "rejected"]
    if rejected:
        raise ValueError(f"{len(rejected)} requests rejected, e.g. {rejected[0]}; lower --max-len or raise "
                         f"--max-model-len")
    output_tokens = sum(len(o.token_ids) for o in outputs)
    assert output_tokens == sum(output_lens), (output_tokens, sum(output_lens))
    input_tokens = sum(map(len, prompts))
    steps = engine.num_steps - steps_before
    return {"num_seqs": len(prompts), "input_tokens": input_tokens, "output_tokens": output_tokens,
            "steps": steps, "seconds": seconds, "output_tok_s": output_tokens / seconds,
            "total_tok_s": (input_tokens + output_tokens) / seconds, "overlap": engine.overlap,
            "host_ms_per_step": 1e3 * (engine.host_seconds - host_before) / steps, "monotonic_window": window}
