"""transformers on the same weights in the same process: B=1 greedy decode with ``generate``,
eager (DynamicCache) and static cache + torch.compile (transformers compiles the decode forward
itself when the cache is static; mode reduce-overhead, i.e. CUDA graphs), and batched eager
``generate`` for a throughput subset. Each generated token is read on the host as it comes
(one sync per token, as our engine's steps do)."""
from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer


class TokenClock(BaseStreamer):
    """A streamer recording when each generated token reaches the host."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        value.tolist()
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def hf_decode(hf, prompt: list[int], tokens: int) -> dict:
    """Greedy ``generate`` of ``tokens + 1`` tokens, once to warm up (and compile), then timed:
    decode tok/s over the ``tokens`` after the first."""
    ids = torch.tensor([prompt], device=hf.device)

    def run():
        clock = TokenClock()
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens + 1,
                          min_new_tokens=tokens + 1, do_sample=False, pad_token_id=0, streamer=clock)
        assert out.shape[1] - ids.shape[1] == tokens + 1 == len(clock.times), (out.shape, len(clock.times))
        return start, clock.times

    run()
    start, times = run()
    seconds = times[-1] - times[0]
    return {"prompt_len": len(prompt), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "ms_per_token": 1e3 * seconds / tokens, "ttft_ms": 1e3 * (times[0] - start)}


def compare_decode(hf, prompt: list[int], tokens: int, compile: bool | None = None) -> dict:
    """HF eager and static+compile decode figures (the latter by default on CUDA only); a
    failure of the compiled run is reported as its error."""
    from transformers import CompileConfig

    result = {"eager": hf_decode(hf, prompt, tokens)}
    if not (hf.device.type == "cuda" if compile is None else compile):
        result["static_compile"] = {"skipped": "static cache + torch.compile(mode='reduce-overhead') "
                                               "(CUDA graphs): not asked for (hf-eager), or not on CUDA"}
        return result
    config = hf.generation_config
    config.cache_implementation = "static"
    config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    try:
        figures = hf_decode(hf, prompt, tokens)
        result["static_compile"] = {**figures, "compiled": hasattr(hf, "_compiled_call"),
                                    "compile_config": "fullgraph=True, mode=reduce-overhead"}
    except Exception as e:  # noqa: BLE001 - a benchmark reports what failed and goes on
        result["static_compile"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        config.cache_implementation = config.compile_config = None
    return result


def hf_batch_generate(hf, prompts: list[list[int]], output_len: int) -> dict:
    """Batched greedy eager ``generate`` (left padding) of ``output_len`` tokens per prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)

    def generate(n: int) -> torch.Tensor:
        return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)

    generate(2)
    start = time.perf_counter()
    out = generate(output_len)
    out.tolist()
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    assert tokens == output_len * len(prompts), (tokens, output_len, len(prompts))
    return {"num_seqs": len(prompts), "output_len": output_len, "output_tokens": tokens, "seconds": seconds,
            "output_tok_s": tokens / seconds}
