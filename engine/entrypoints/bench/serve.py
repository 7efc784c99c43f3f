"""``bench serve``: an HTTP load generator for an OpenAI-compatible ``/v1/completions`` server,
with vLLM's benchmark conventions. Requests stream (SSE); prompts are random token ids (or,
for chat routes, text; ``engine.entrypoints.bench.structured`` shapes constrained requests).

Per request: TTFT (send -> first chunk with a choice; a chat stream's opening role chunk does not
count), ITL (gaps between later ones), TPOT
((E2E - TTFT) / (output tokens - 1)), E2E latency; output tokens from the final usage chunk.
Arrivals are a Poisson process of ``request_rate`` per second (inf: all at once), at most
``max_concurrency`` requests in flight."""
from __future__ import annotations

import asyncio
import json
import math
import queue
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from tqdm import tqdm


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""                                         # the text (a chat's content) streamed
    tool_calls: list[dict] = field(default_factory=list)   # chat: {"name", "arguments"} per call, assembled
    finish_reason: str | None = None


def plain_request(prompt: list[int], max_tokens: int) -> tuple[str, dict]:
    """(route, body) of the plain load: a streamed completion of ``max_tokens`` tokens (ignore_eos)."""
    return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                               "stream": True, "stream_options": {"include_usage": True}}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (numpy's default)."""
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return values[low] + (values[high] - values[low]) * (pos - low)


def summary_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": 1e3 * sum(values) / len(values), "median": 1e3 * percentile(values, 50),
            "p99": 1e3 * percentile(values, 99)}


async def send_request(session, url: str, prompt, max_tokens: int, shape=plain_request) -> RequestResult:
    """Stream the request ``shape(prompt, max_tokens)`` ((route, body)) and time it. A prompt
    that is text counts the prompt tokens the server's usage reports."""
    route, body = shape(prompt, max_tokens)
    result = RequestResult(len(prompt))
    start = last = time.perf_counter()
    try:
        async with session.post(f"{url}{route}", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return result
            async for line in response.content:
                data = line.strip().removeprefix(b"data:").strip()
                if not data:
                    continue
                if data == b"[DONE]":
                    result.ok = result.error is None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))[:500]
                    continue
                now = time.perf_counter()
                choices = chunk.get("choices")
                if choices and "role" not in choices[0].get("delta", {}):  # new text, or the finish
                    _take(result, choices[0])                       # (a token may decode to no text yet)
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    if isinstance(prompt, str):
                        result.prompt_len = chunk["usage"]["prompt_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is counted and reported, not fatal
        result.error = f"{type(e).__name__}: {e}"[:500]
    result.e2e = time.perf_counter() - start
    if result.ok and result.output_tokens == 0:
        result.ok, result.error = False, "the stream carried no usage chunk"
    return result


def _take(result: RequestResult, choice: dict) -> None:
    """Add a streamed choice's text, tool-call fragments and finish reason to ``result``."""
    delta = choice.get("delta", choice)
    result.text += delta.get("text") or delta.get("content") or ""
    for call in delta.get("tool_calls") or []:
        while len(result.tool_calls) <= call["index"]:
            result.tool_calls.append({"name": "", "arguments": ""})
        function = call.get("function", {})
        result.tool_calls[call["index"]]["name"] += function.get("name") or ""
        result.tool_calls[call["index"]]["arguments"] += function.get("arguments") or ""
    result.finish_reason = choice.get("finish_reason") or result.finish_reason


def serve_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int):
    """Random token-id prompts and output lengths, uniform in [len * (1 - r), len * (1 + r)]."""
    rng = random.Random(seed)

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))

    prompts = [[rng.randrange(vocab) for _ in range(length(input_len))] for _ in range(num_prompts)]
    return prompts, [length(output_len) for _ in range(num_prompts)]


async def run_load(url: str, prompts: list, output_lens: list[int], request_rate: float,
                   max_concurrency: int | None, seed: int, shape=plain_request,
                   desc: str = "serve") -> tuple[list[RequestResult], float]:
    """Send every request ``shape(prompt, max_tokens)`` (Poisson arrivals, bounded concurrency);
    results and wall seconds."""
    import aiohttp

    rng = random.Random(seed + 1)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        with tqdm(total=len(prompts), desc=desc, unit="req") as bar:
            async def one(prompt, max_tokens):
                if limit is None:
                    result = await send_request(session, url, prompt, max_tokens, shape)
                else:
                    async with limit:
                        result = await send_request(session, url, prompt, max_tokens, shape)
                bar.update()
                return result

            start = time.perf_counter()
            tasks = []
            for prompt, max_tokens in zip(prompts, output_lens):
                tasks.append(asyncio.create_task(one(prompt, max_tokens)))
                if math.isfinite(request_rate):
                    await asyncio.sleep(rng.expovariate(request_rate))
            results = await asyncio.gather(*tasks)
            return results, time.perf_counter() - start


def serve_metrics(results: list[RequestResult], seconds: float) -> dict:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done), "failed": len(failed), "first_error": failed[0].error if failed else None,
        "duration_s": seconds, "input_tokens": input_tokens, "output_tokens": output_tokens,
        "request_throughput": len(done) / seconds, "output_throughput": output_tokens / seconds,
        "total_token_throughput": (input_tokens + output_tokens) / seconds,
        "ttft_ms": summary_ms([r.ttft for r in done]),
        "tpot_ms": summary_ms([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl_ms": summary_ms([gap for r in done for gap in r.itl]),
        "e2el_ms": summary_ms([r.e2e for r in done]),
    }


async def wait_healthy(url: str, timeout_s: float) -> None:
    """Until ``GET /health`` answers 200 (or raise after ``timeout_s``)."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"{url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
            await asyncio.sleep(0.2)


def launch_server(command: list[str], timeout_s: float = 900.0) -> tuple[subprocess.Popen, str]:
    """Start a server process that prints ``serving ... on http://HOST:PORT`` on stderr; returns
    it and that URL once printed (its stderr is passed on to ours throughout)."""
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in server.stderr:
            sys.stderr.write(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline, seen = time.monotonic() + timeout_s, []
    while (line := _next_line(lines, deadline)) is not None:
        seen.append(line)
        found = re.search(r"serving .* on (http://\S+)", line)
        if found:
            return server, found[1]
    server.kill()
    raise RuntimeError(f"the server did not start (exit code {server.wait()}): {''.join(seen[-5:])}")


def _next_line(lines: queue.Queue, deadline: float) -> str | None:
    try:
        return lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        return None


def bench_serve(url: str, prompts, output_lens, request_rate: float, max_concurrency: int | None, seed: int,
                health_timeout_s: float = 60.0) -> dict:
    url = url.rstrip("/")
    asyncio.run(wait_healthy(url, health_timeout_s))
    results, seconds = asyncio.run(run_load(url, prompts, output_lens, request_rate, max_concurrency, seed))
    return serve_metrics(results, seconds)
