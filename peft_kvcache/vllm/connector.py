"""`PeftKVCacheConnector`: the KV connector vLLM loads by module path, giving cross-adapter prefix reuse.

    python -m vllm.entrypoints.openai.api_server --model MODEL_FOLDER --enable-lora --max-lora-rank 64 \\
        --lora-modules shout=adapters/shout docstring=adapters/docstring --enable-prompt-tokens-details \\
        --kv-transfer-config '{"kv_connector": "PeftKVCacheConnector",
                               "kv_connector_module_path": "peft_kvcache.vllm.connector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"maps": "hub_cards"}}'

vLLM builds one instance in its scheduler process and one in its worker process; each delegates to its half
(`scheduler.SchedulerSide`, `worker.WorkerSide`), and they talk only through the connector metadata
(`jobs`). Options: `options.ConnectorOptions`. Every whole (non-streamed) response carries
``kv_transfer_params.peft_kvcache``: where its context came from (`peft_kvcache.runtime.reuse.label`: ``reused``,
``mapped:<variant>``, ``naive:<variant>`` or ``prefilled``) and how many tokens; vLLM sends no ``kv_transfer_params``
with a stream's chunks, so streamed requests are counted only in the metrics.
Metrics: vLLM's connector stats and Prometheus (``vllm:peft_kvcache_*`` on ``/metrics``).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from .options import ConnectorOptions, check_vllm_version

check_vllm_version()  # before vLLM's internals are imported: another release may have moved them

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from .jobs import LoadJob, WorkerReport  # noqa: E402
from .scheduler import SchedulerSide  # noqa: E402
from .worker import WorkerSide  # noqa: E402

logger = logging.getLogger(__name__)


class PeftKVCacheMetadata(KVConnectorMetadata):
    """One step's store operations and loads, scheduler -> worker; ``forward``: whether the step computes any token
    (without one, nothing is decoding and a CPU engine's queued jobs run in full)."""

    def __init__(self, ops: list, loads: list[LoadJob], forward: bool = True):
        self.ops, self.loads, self.forward = ops, loads, forward


class PeftKVCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's worker report, worker -> scheduler."""

    def __init__(self, report: WorkerReport):
        self.report = report

    def aggregate(self, other: "PeftKVCacheWorkerMetadata") -> "PeftKVCacheWorkerMetadata":
        return PeftKVCacheWorkerMetadata(self.report.merged(other.report))


class PeftKVCacheStats(KVConnectorStats):
    """The scheduler's counters over an interval: prompt tokens by source, fallbacks by reason, evictions, and the
    store's size at its end."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> "PeftKVCacheStats":
        mine, theirs = self.data or {}, other.data or {}
        merged = {name: dict(Counter(mine.get(name, {})) + Counter(theirs.get(name, {})))
                  for name in ("tokens", "fallbacks")}
        merged["evictions"] = mine.get("evictions", 0) + theirs.get("evictions", 0)
        for gauge in ("store_bytes", "store_entries"):  # the later reading
            merged[gauge] = theirs.get(gauge, mine.get(gauge, 0))
        return PeftKVCacheStats(merged)

    def reduce(self) -> dict[str, int | float]:
        data = self.data or {}
        flat = {f"tokens_{kind}": n for kind, n in sorted(data.get("tokens", {}).items())}
        flat.update({f"fallback_{reason}": n for reason, n in sorted(data.get("fallbacks", {}).items())})
        flat.update({name: data.get(name, 0) for name in ("evictions", "store_bytes", "store_entries")})
        return flat


class PeftKVCachePromMetrics(KVConnectorPromMetrics):
    """``vllm:peft_kvcache_prompt_tokens{source}``, ``vllm:peft_kvcache_fallbacks{reason}``,
    ``vllm:peft_kvcache_store_evictions`` and the gauges ``vllm:peft_kvcache_store_bytes`` / ``_store_entries``, per
    engine (vLLM's offline ``LLM.get_metrics()`` reads only names under ``vllm:``)."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.tokens = self._counter_cls(name="vllm:peft_kvcache_prompt_tokens", labelnames=labelnames + ["source"],
                                        documentation="Prompt tokens by where their KV came from (engine: vLLM's own "
                                                      "prefix cache; reused, mapped, naive: the connector; prefilled)")
        self.fallbacks = self._counter_cls(name="vllm:peft_kvcache_fallbacks", labelnames=labelnames + ["reason"],
                                           documentation="Requests served by ordinary prefill instead of a mapped "
                                                         "prefix, by reason (invalid_options: whatever they were "
                                                         "served)")
        self.evictions = self._counter_cls(name="vllm:peft_kvcache_store_evictions", labelnames=labelnames,
                                           documentation="Store entries evicted (least recently used first)")
        self.store_bytes = self._gauge_cls(name="vllm:peft_kvcache_store_bytes", labelnames=labelnames,
                                           documentation="Bytes held by the connector's store", multiprocess_mode="mostrecent")
        self.store_entries = self._gauge_cls(name="vllm:peft_kvcache_store_entries", labelnames=labelnames,
                                             documentation="Entries held by the connector's store",
                                             multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for kind, count in transfer_stats_data.get("tokens", {}).items():
            self.tokens.labels(*labels, kind).inc(count)
        for reason, count in transfer_stats_data.get("fallbacks", {}).items():
            self.fallbacks.labels(*labels, reason).inc(count)
        self.evictions.labels(*labels).inc(transfer_stats_data.get("evictions", 0))
        self.store_bytes.labels(*labels).set(transfer_stats_data.get("store_bytes", 0))
        self.store_entries.labels(*labels).set(transfer_stats_data.get("store_entries", 0))


class PeftKVCacheConnector(KVConnectorBase_V1):
    """See the module. vLLM calls every method; each half answers its own."""

    _cache_hit_source = CacheHitSource.HOST  # vLLM's hit metrics attribute the connector's tokens to host memory

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        options = ConnectorOptions.parse(self._kv_transfer_config.kv_connector_extra_config)
        options.validate()
        async_loads = vllm_config.parallel_config.tensor_parallel_size == 1
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # the scheduler reads it right after building the connector
                logger.warning("peft-kvcache: kv_load_failure_policy %r -> 'recompute': a load the connector cannot "
                               "complete (a damaged map, a store entry lost) is recomputed by the engine instead of "
                               "failing the request", self._kv_transfer_config.kv_load_failure_policy)
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self.scheduler = SchedulerSide(vllm_config, options, async_loads, kv_cache_config)
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config, options.maps if options.mode == "map" else None,
                                     step_share=options.step_share)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a preempted request's in-flight output is never stale because of the connector

    # ----- scheduler side -----

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self.scheduler.evictions.pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            tokens = self.scheduler.matched_tokens(request, num_computed_tokens)
        except Exception:  # a request is never failed because of the connector: it is prefilled
            logger.exception("peft-kvcache: matching request %s failed; it is prefilled", request.request_id)
            self.scheduler.plans.pop(request.request_id, None)
            return 0, False
        return tokens, bool(tokens) and self.scheduler.async_loads

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        ops, loads = self.scheduler.take_jobs()
        return PeftKVCacheMetadata(ops, loads, forward=scheduler_output.total_num_scheduled_tokens > 0)

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, PeftKVCacheWorkerMetadata):
            try:
                self.scheduler.worker_said(meta.report)
            except Exception:  # never fail the engine for a report (its failed loads are recomputed by vLLM anyway)
                logger.exception("peft-kvcache: taking in the worker's report failed")

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        try:
            hold, label = self.scheduler.finished(request, block_ids)
            return hold, {"peft_kvcache": label}
        except Exception:
            logger.exception("peft-kvcache: keeping request %s failed; nothing of it is stored", request.request_id)
            return False, None

    def reset_cache(self) -> bool:
        return self.scheduler.reset()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler is None:
            return None
        data = self.scheduler.stats()
        return None if data is None else PeftKVCacheStats(data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KVConnectorStats | None:
        return PeftKVCacheStats(data) if data else None

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return PeftKVCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ----- worker side -----

    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if isinstance(kv_connector_metadata, PeftKVCacheMetadata):
            self.worker.before_forward(kv_connector_metadata.ops)
            kv_connector_metadata.ops = []  # each operation is queued once

    def start_load_kv(self, forward_context, **kwargs) -> None:
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(metadata, PeftKVCacheMetadata) and metadata.loads:
            self.worker.load(metadata.loads)
            metadata.loads = []  # start_load_kv may run again in a step; each load is queued once

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a loading request waits outside the step until its load is done (or, synchronous, it is written)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # finished requests are copied after the forward (or on a job thread) while vLLM holds their blocks

    def wait_for_save(self) -> None:
        if self.worker is not None:  # after every step's forward (and in steps with none)
            metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
            self.worker.step(forward=not isinstance(metadata, PeftKVCacheMetadata) or metadata.forward)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.finished() if self.worker is not None else (None, None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self.worker.take_report() if self.worker is not None else None
        return None if report is None else PeftKVCacheWorkerMetadata(report)
