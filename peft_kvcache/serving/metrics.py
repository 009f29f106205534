"""The server's Prometheus metrics, in a registry of their own (several servers may share a process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..runtime.turn import TurnResult
from .store import PrefixStore

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """Requests by model and status, time to first token by context source, prompt tokens by how their KV was
    obtained, generated tokens; the store and the queue read at scrape time."""

    def __init__(self, store: PrefixStore, waiting: Callable[[], int] = lambda: 0):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("peft_kvcache_requests", "Chat completion requests by model and HTTP status",
                                ["model", "status"], registry=registry)
        self.ttft = Histogram("peft_kvcache_ttft_seconds", "Seconds from a request's arrival to its first token, by "
                              "context source", ["source"], buckets=TTFT_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("peft_kvcache_prompt_tokens", "Prompt tokens by how their KV was obtained "
                                     "(reused, mapped, shared, prefilled)", ["kind"], registry=registry)
        self.completion_tokens = Counter("peft_kvcache_completion_tokens", "Generated tokens by model", ["model"],
                                         registry=registry)

        class StoreCollector:  # read at scrape time: the store keeps its own counts
            def collect(self):
                yield CounterMetricFamily("peft_kvcache_store_evictions", "Prefix store entries evicted (LRU)",
                                          value=store.evictions)
                yield GaugeMetricFamily("peft_kvcache_store_bytes", "Bytes held by the prefix store",
                                        value=store.nbytes)
                yield GaugeMetricFamily("peft_kvcache_store_max_bytes", "The prefix store's bound (--cache-memory)",
                                        value=store.max_bytes)
                yield GaugeMetricFamily("peft_kvcache_store_entries", "Caches held by the prefix store",
                                        value=len(store))
                yield GaugeMetricFamily("peft_kvcache_requests_waiting", "Requests waiting for the model "
                                        "(--max-queue bounds them)", value=waiting())

        registry.register(StoreCollector())

    def record(self, model: str, result: TurnResult) -> None:
        """A completed request's figures."""
        self.ttft.labels(result.context_source).observe(result.first_token_seconds)
        cached_kind = result.context_source if result.context_source in ("mapped", "shared") else "reused"
        self.prompt_tokens.labels(cached_kind).inc(result.cached_tokens)
        self.prompt_tokens.labels("prefilled").inc(result.prompt_tokens - result.cached_tokens)
        self.completion_tokens.labels(model).inc(result.new_ids.shape[1])


__all__ = ["Metrics", "TTFT_BUCKETS"]
