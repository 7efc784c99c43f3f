"""The server's Prometheus metrics (``/metrics``) and its periodic stats line in the log.

Gauges are read from the engine after each step; counters follow the engine's cumulative
counts; the latency histograms are observed by the engine loop as requests produce tokens
and finish. One registry per server, so several servers can live in one process.
"""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("engine.entrypoints.server")

PREFIX = "agent_infer:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    """``observe(engine)`` after every engine iteration (gauges, counters, the stats line every
    ``stats_interval_s`` while busy); ``first_token`` / ``next_tokens`` / ``finished`` per request;
    ``render()`` is the Prometheus text exposition."""

    def __init__(self, stats_interval_s: float = 10.0):
        self.registry = registry = CollectorRegistry()
        self.running = Gauge(PREFIX + "num_requests_running", "Requests running on the engine.", registry=registry)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to run.", registry=registry)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of the KV cache blocks in use (0-1).",
                              registry=registry)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=registry)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the requests admitted.",
                                     registry=registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=registry)
        self.spec_decode_num_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens",
                                                    "Drafted tokens verified (speculative decoding).",
                                                    registry=registry)
        self.spec_decode_num_accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens",
                                                       "Drafted tokens accepted (speculative decoding).",
                                                       registry=registry)
        self.requests = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                                ["finished_reason"], registry=registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.stats_interval_s = stats_interval_s
        self._seen = dict.fromkeys(("prefix_queries", "prefix_hits", "prompt_tokens", "generation_tokens",
                                    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"), 0)
        self._stats_at, self._stats_tokens = time.monotonic(), (0, 0)

    def observe(self, engine) -> None:
        scheduler, bm = engine.scheduler, engine.block_manager
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        kv_usage = 1 - bm.num_free_blocks / bm.num_blocks
        self.kv_usage.set(kv_usage)
        totals = {"prefix_queries": bm.num_prefix_queries, "prefix_hits": bm.num_prefix_hits,
                  "prompt_tokens": engine.num_prompt_tokens, "generation_tokens": engine.num_generation_tokens,
                  "spec_decode_num_draft_tokens": scheduler.num_draft_tokens,
                  "spec_decode_num_accepted_tokens": scheduler.num_accepted_tokens}
        for name, total in totals.items():
            getattr(self, name).inc(total - self._seen[name])
            self._seen[name] = total
        now = time.monotonic()
        if now - self._stats_at >= self.stats_interval_s:
            busy = scheduler.has_unfinished() or self._stats_tokens != (totals["prompt_tokens"],
                                                                         totals["generation_tokens"])
            if busy:
                seconds = now - self._stats_at
                log.info("running %d, waiting %d, KV cache %.1f%% used, prompt %.1f tok/s, generation %.1f tok/s",
                         len(scheduler.running), len(scheduler.waiting), 100 * kv_usage,
                         (totals["prompt_tokens"] - self._stats_tokens[0]) / seconds,
                         (totals["generation_tokens"] - self._stats_tokens[1]) / seconds)
            self._stats_at, self._stats_tokens = now, (totals["prompt_tokens"], totals["generation_tokens"])

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_tokens(self, count: int, seconds: float) -> None:
        """``count`` more tokens of one request arrived ``seconds`` after its previous ones."""
        for _ in range(count):
            self.itl.observe(seconds / count)

    def finished(self, reason: str, seconds: float) -> None:
        self.requests.labels(reason).inc()
        self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
