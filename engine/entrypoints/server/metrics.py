"""The server's Prometheus metrics (``/metrics``) and its periodic stats line in the log.

Each engine core reports its ``EngineStats`` after every step (``observe``); every gauge and counter
is exposed as the sum over the cores (no label) and per core (label ``core``). The latency
histograms are observed by the front as requests produce tokens and finish, over all cores. One
registry per server, so several servers can live in one process.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from itertools import zip_longest

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.core.engine_core import EngineStats

log = logging.getLogger("engine.entrypoints.server")

PREFIX = "agent_infer:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
# EngineStats field -> (metric name, kind, help)
ENGINE_METRICS = {
    "running": ("num_requests_running", GaugeMetricFamily, "Requests running on the engine."),
    "waiting": ("num_requests_waiting", GaugeMetricFamily, "Requests waiting to run."),
    "kv_usage": ("kv_cache_usage_perc", GaugeMetricFamily,
                 "Fraction of the KV cache blocks in use (0-1; the mean over the cores)."),
    "prefix_queries": ("prefix_cache_queries", CounterMetricFamily, "Prompt tokens looked up in the prefix cache."),
    "prefix_hits": ("prefix_cache_hits", CounterMetricFamily, "Prompt tokens found in the prefix cache."),
    "prompt_tokens": ("prompt_tokens", CounterMetricFamily, "Prompt tokens of the requests admitted."),
    "generation_tokens": ("generation_tokens", CounterMetricFamily, "Tokens generated."),
}
# speculative decoding's counters, labelled with its method (and per core, as the others)
SPEC_METRICS = {
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Verify entries that drafted (speculative decoding)."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Drafted tokens verified (speculative decoding)."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",
                                        "Drafted tokens accepted (speculative decoding)."),
}
PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos",
                "Drafts accepted at each draft position, 0 first (speculative decoding).")


class _EngineCollector:
    """The cores' latest stats as Prometheus families: the total, then one sample per core."""

    def __init__(self, stats: dict[int, EngineStats]):
        self.stats = stats

    def collect(self):
        cores = sorted(self.stats.items())
        for field, (name, family, help_text) in ENGINE_METRICS.items():
            metric = family(PREFIX + name, help_text, labels=["core"])
            values = [getattr(stats, field) for _, stats in cores]
            total = sum(values) / len(values) if field == "kv_usage" and values else sum(values)
            metric.add_metric([], total)
            for (core, _), value in zip(cores, values):
                metric.add_metric([str(core)], value)
            yield metric
        method = next((stats.spec_decode_method for _, stats in cores if stats.spec_decode_method), "")
        if not method:
            return
        for field, (name, help_text) in SPEC_METRICS.items():
            metric = CounterMetricFamily(PREFIX + name, help_text, labels=["method", "core"])
            values = [getattr(stats, field) for _, stats in cores]
            metric.add_metric([method], sum(values))
            for (core, _), value in zip(cores, values):
                metric.add_metric([method, str(core)], value)
            yield metric
        metric = CounterMetricFamily(PREFIX + PER_POSITION[0], PER_POSITION[1], labels=["method", "position"])
        per_core = (stats.spec_decode_num_accepted_per_position for _, stats in cores)
        for position, counts in enumerate(zip_longest(*per_core, fillvalue=0)):
            metric.add_metric([method, str(position)], sum(counts))
        yield metric


class ServerMetrics:
    """``observe(stats, core)`` after every iteration of a core (the stats line every
    ``stats_interval_s`` while busy); ``first_token`` / ``next_tokens`` / ``finished`` per request;
    ``render()`` is the Prometheus text exposition."""

    def __init__(self, stats_interval_s: float = 10.0):
        self.registry = registry = CollectorRegistry()
        self.stats: dict[int, EngineStats] = {}
        registry.register(_EngineCollector(self.stats))
        self.requests = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                                ["finished_reason"], registry=registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.stats_interval_s = stats_interval_s
        self._stats_at, self._stats_tokens = time.monotonic(), (0, 0)

    def observe(self, stats: EngineStats, core: int = 0) -> None:
        self.stats[core] = stats
        now = time.monotonic()
        if now - self._stats_at >= self.stats_interval_s:
            total = {f.name: sum(getattr(s, f.name) for s in self.stats.values())
                     for f in dataclasses.fields(EngineStats) if f.type in ("int", "float")}
            tokens = (total["prompt_tokens"], total["generation_tokens"])
            if total["running"] or total["waiting"] or tokens != self._stats_tokens:
                seconds = now - self._stats_at
                log.info("running %d, waiting %d, KV cache %.1f%% used, prompt %.1f tok/s, generation %.1f tok/s",
                         total["running"], total["waiting"], 100 * total["kv_usage"] / len(self.stats),
                         (tokens[0] - self._stats_tokens[0]) / seconds, (tokens[1] - self._stats_tokens[1]) / seconds)
            self._stats_at, self._stats_tokens = now, tokens

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
