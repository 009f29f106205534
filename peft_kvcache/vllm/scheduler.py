"""The connector's scheduler half (vLLM's engine-core process): decides what a request loads, what the store keeps
and how each request is labelled; it never touches a tensor.

A request for variant B (the base model or an adapter) whose prompt vLLM's own prefix cache does not hold gets, in
whole blocks and always leaving the last prompt token to the engine:

- B's own stored prefix, as it is (``reused``);
- else, the longest stored prefix of another variant A, mapped A -> B with the published map that fits both
  (``mapped:<A>``), when it saves at least ``min_mapped_tokens`` of prefill beyond vLLM's own hit and the store holds
  B's own attention sink for the conversation's first tokens (or vLLM holds B's first block itself); in mode
  ``naive`` injected unmapped (``naive:<A>``), as the baseline;
- else nothing: ordinary prefill, and the reason is counted (and logged once).

Approximate blocks (mapped or naive) are never served as exact: they are removed from vLLM's prefix cache as soon as
they are allocated (so a later request of B cannot hit them under B's block hashes), a request that used them is not
kept in the store, and its response says where its context came from (``kv_transfer_params.peft_kvcache``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .jobs import DropJob, LoadJob, SaveJob, SinkJob, WorkerReport
from .options import ConnectorOptions, request_reuse
from ..maps.registry import MapMatch
from ..runtime.reuse import EXACT, Made, label, mapping_pays
from .pairs import Variant, VariantMaps
from .parallel import unsupported_parallelism
from .store import IndexEntry, StoreIndex

logger = logging.getLogger(__name__)


@dataclass
class Plan:
    """What a request would load (until vLLM allocates its blocks), or why it loads nothing."""

    local_blocks: int
    kind: str | None = None  # "reused" | "mapped" | "naive"; None: nothing to load
    entry: IndexEntry | None = None
    blocks: int = 0  # whole blocks of the prefix after the load
    source: Variant | None = None
    choice: MapMatch | None = None
    sink_key: tuple | None = None
    fallback: str | None = None  # why another variant's longer prefix was not used

    @property
    def tokens(self) -> int:
        """Blocks to load beyond vLLM's own hit (in blocks; the caller multiplies by the block size)."""
        return max(0, self.blocks - self.local_blocks)


@dataclass
class RequestRecord:
    """How one request got its context, from allocation to its end."""

    variant: Variant
    salt: str | None
    reuse: str
    prompt_tokens: int
    local_tokens: int = 0
    loaded_tokens: int = 0
    kind: str | None = None
    source: Variant | None = None
    fallback: str | None = None

    @property
    def made(self) -> Made:
        """How its loaded KV was made (the reuse core's record)."""
        if not self.loaded_tokens or self.kind in (None, "reused"):
            return EXACT
        return Made(self.kind, self.source.adapter, self.loaded_tokens)

    @property
    def approximate(self) -> bool:
        """Whether some of its KV is not its variant's own (mapped, or injected unmapped)."""
        return self.made.approximate

    def label(self, base: str) -> dict:
        """The response's ``kv_transfer_params.peft_kvcache``: where the context came from (`reuse.label`, ``base``:
        the served base model's name) and how much of it."""
        cached = self.local_tokens + self.loaded_tokens
        return {"context_source": label(self.made, cached, base), "cached_tokens": cached,
                "engine_cached_tokens": self.local_tokens, "loaded_tokens": self.loaded_tokens,
                "prefilled_tokens": self.prompt_tokens - cached,
                **({"fallback": self.fallback} if self.fallback else {})}


@dataclass
class Counts:
    """Counters since the last report (vLLM's connector stats)."""

    # prompt tokens by where their KV came from: engine (vLLM's own prefix cache), reused (the variant's own, from the
    # store), mapped, naive (another variant's, unmapped), prefilled
    tokens: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)  # by reason
    evictions: int = 0


class SchedulerSide:
    """See the module. ``block_pool`` is vLLM's (bound after construction); ``vllm_config`` the engine's."""

    def __init__(self, vllm_config, options: ConnectorOptions):
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        self.options = options
        self.block_size = vllm_config.cache_config.block_size
        per_token = (model.get_num_layers(parallel) * 2 * model.get_num_kv_heads(parallel) * model.get_head_size()
                     * torch.empty(0, dtype=model.dtype).element_size())
        self.index = StoreIndex(options.store_bytes, self.block_size, per_token)
        self.base_name = model.served_model_name or model.model
        self.maps: VariantMaps | None = None
        if options.mode == "map":
            self.maps = VariantMaps(options.maps, local_model_folder(model.model), model.hf_config)
            if self.maps.problem:
                logger.warning("peft-kvcache: nothing will be mapped on this engine: %s", self.maps.problem)
            logger.info("peft-kvcache: %d map folder(s) under %s", len(self.maps.registry), options.maps)
        configs = self.maps.registry.configs.values() if self.maps else ()
        self.sink_tokens = max([c.sink_tokens for c in configs] or [1])
        self.block_pool = None
        self.worker_ready = False
        self.refused = unsupported_parallelism(vllm_config)  # said at start; every request falls back with a reason
        if self.refused:
            logger.warning("peft-kvcache: the connector reuses nothing on this engine (unsupported_parallelism): %s",
                           self.refused)
        self.plans: dict[str, Plan] = {}
        self.records: dict[str, RequestRecord] = {}
        self.ops: list = []  # store operations for the next step, in order
        self.loads: list[LoadJob] = []
        self.counts = Counts()
        self._logged: set[str] = set()

    # ----- a new request -----

    def matched_tokens(self, request, local_tokens: int) -> int:
        """Tokens beyond vLLM's own hit (``local_tokens``) the connector will write (whole blocks; 0 for none).
        Side-effect free but for the plan it keeps: vLLM may ask again for the same request."""
        plan = self._plan(request, local_tokens)
        self.plans[request.request_id] = plan
        return plan.tokens * self.block_size

    def _plan(self, request, local_tokens: int) -> Plan:
        variant, salt, prompt = _variant(request), request.cache_salt, list(request.prompt_token_ids or [])
        local_blocks = local_tokens // self.block_size
        plan = Plan(local_blocks)
        limit = (len(prompt) - 1) // self.block_size  # vLLM must compute at least the last prompt token
        reuse = request_reuse(request.kv_transfer_params)
        if self.refused:
            plan.fallback = "unsupported_parallelism"
            return plan
        if not self.worker_ready or reuse == "none" or limit <= local_blocks:
            return plan
        matches = self.index.matches(salt, prompt, limit)
        own = matches.pop(variant, None)
        if own is not None and own.blocks > local_blocks:
            plan = Plan(local_blocks, "reused", own.entry, own.blocks)
        for source, match in sorted(matches.items(), key=lambda item: -item[1].blocks):  # longest prefix first
            if match.blocks <= max(local_blocks, plan.blocks):
                break
            way = self._way(variant, source, match.blocks, local_blocks, reuse, prompt)
            if isinstance(way, str):
                plan.fallback = plan.fallback or way
                continue
            kind, choice, sink_key = way
            return Plan(local_blocks, kind, match.entry, match.blocks, source, choice, sink_key, plan.fallback)
        return plan

    def _way(self, target: Variant, source: Variant, blocks: int, local_blocks: int, reuse: str, prompt: list[int]):
        """How ``source``'s stored prefix of ``blocks`` blocks can serve ``target``: ``(kind, map choice, sink key)``,
        or why it cannot (a fallback reason)."""
        if reuse == "exact" or self.options.mode == "exact":
            return "exact_only"
        saved = (blocks - local_blocks) * self.block_size
        if not mapping_pays(Made("mapped", source.adapter, saved), saved, self.options.min_mapped_tokens):
            return "below_min_length"  # too few tokens saved to justify approximate KV
        if self.options.mode == "naive":
            return "naive", None, None
        choice = self.maps.find(source, target)
        if isinstance(choice, str):
            return choice
        sink_key = None
        if local_blocks == 0 and choice.sink_tokens > 0:  # the target's own first tokens, from the store
            sink_key = (target, tuple(prompt[: choice.sink_tokens]))
            if not self.index.has_sink(*sink_key):
                return "no_target_sink"
        return "mapped", choice, sink_key

    def allocated(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks (``block_ids``: all of them) and will skip ``num_external_tokens``: queue
        the load, and take approximate blocks out of vLLM's prefix cache."""
        plan = self.plans.pop(request.request_id, None) or Plan(0)
        loaded = bool(num_external_tokens and plan.kind is not None)
        if loaded:  # first of all: vLLM will skip these tokens, so they must be written (or reported as failed)
            first = plan.local_blocks
            ids = tuple(block_ids[first: first + num_external_tokens // self.block_size])
            self.loads.append(LoadJob(request.request_id, plan.kind, plan.entry.key, first * self.block_size, ids,
                                      plan.choice.folders if plan.choice else (), plan.sink_key))
        try:
            self._record(request, plan, num_external_tokens if loaded else 0, ids if loaded else ())
        except Exception:  # bookkeeping only: the load above stands
            logger.exception("peft-kvcache: recording request %s failed", request.request_id)

    def _record(self, request, plan: Plan, loaded_tokens: int, loaded_ids: tuple[int, ...]) -> None:
        variant = _variant(request)
        record = RequestRecord(variant, request.cache_salt, request_reuse(request.kv_transfer_params),
                               len(request.prompt_token_ids or []), plan.local_blocks * self.block_size,
                               fallback=plan.fallback)
        self.records[request.request_id] = record
        if loaded_tokens:
            self.index.touch(plan.entry)
            record.loaded_tokens, record.kind, record.source, record.fallback = (
                loaded_tokens, plan.kind, plan.source, None)
            if record.approximate and self.block_pool is not None:
                self.block_pool.evict_blocks(set(loaded_ids))  # never an exact-cache hit for a later request
        elif record.fallback:
            self._fallback(record.fallback, f"{variant.label} request {request.request_id}")
        self.counts.tokens["engine"] += record.local_tokens
        if record.loaded_tokens:
            self.counts.tokens[record.kind] += record.loaded_tokens
        self.counts.tokens["prefilled"] += record.prompt_tokens - record.local_tokens - record.loaded_tokens

    # ----- a finished request -----

    def finished(self, request, block_ids: list[int]) -> dict:
        """Keep the request's KV (whole blocks of what it computed) unless it holds approximate blocks, and its
        variant's sink if the store lacks it; returns its label for the response."""
        record = self.records.pop(request.request_id, None)
        self.plans.pop(request.request_id, None)
        if record is None:
            record = RequestRecord(_variant(request), request.cache_salt, "map", len(request.prompt_token_ids or []))
        if not record.approximate:
            self._keep(request, record, block_ids)
        return record.label(self.base_name)

    def _keep(self, request, record: RequestRecord, block_ids: list[int]) -> None:
        computed = min(request.num_computed_tokens, len(block_ids) * self.block_size)
        tokens = list(request.all_token_ids)[:computed]
        blocks = computed // self.block_size
        if blocks:
            entry, dropped = self.index.add(record.variant, record.salt, tokens[: blocks * self.block_size])
            if entry is not None:
                self.ops.append(SaveJob(entry.key, tuple(block_ids[:blocks])))
            self._drop(dropped)
        if computed >= self.sink_tokens and block_ids:
            first = tokens[: self.sink_tokens]
            if not self.index.has_sink(record.variant, first):
                key, evicted = self.index.add_sink(record.variant, first)
                self.ops.append(SinkJob(key, block_ids[0], self.sink_tokens))
                self._drop(evicted)

    def _drop(self, keys: list) -> None:
        self.ops.extend(DropJob(key) for key in keys)
        self.counts.evictions += sum(1 for key in keys if key)

    # ----- each step -----

    def take_jobs(self) -> tuple[list, list[LoadJob]]:
        """The store operations and loads for this step (each handed out once)."""
        ops, loads, self.ops, self.loads = self.ops, self.loads, [], []
        return ops, loads

    def worker_said(self, report: WorkerReport) -> None:
        """Take in what the worker reported after a step."""
        if report.ready is not None:
            self.worker_ready = report.ready
            if not report.ready:
                self._fallback("unsupported_layout", report.problem or "the worker cannot use this engine's cache")
        for key in report.failed_keys:
            self.index.remove(key)
        for request_id in report.failed_loads:  # vLLM recomputes the request's loaded blocks
            record = self.records.get(request_id)
            if record is not None:
                self.counts.tokens["prefilled"] += record.loaded_tokens
                record.loaded_tokens, record.kind, record.fallback = 0, None, "load_error"
            self._fallback("load_error", f"request {request_id}")

    def stats(self) -> dict | None:
        """Counters since the last call and the store's size, or None when nothing happened."""
        counts, self.counts = self.counts, Counts()
        if not (counts.tokens or counts.fallbacks or counts.evictions):
            return None
        return {"tokens": dict(counts.tokens), "fallbacks": dict(counts.fallbacks), "evictions": counts.evictions,
                "store_bytes": self.index.nbytes, "store_entries": len(self.index)}

    def _fallback(self, reason: str, detail: str) -> None:
        self.counts.fallbacks[reason] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("peft-kvcache: %s falls back to ordinary prefill (%s; logged once per reason)", detail,
                           reason)


def _variant(request) -> Variant:
    lora = request.lora_request
    return Variant(None) if lora is None else Variant(lora.lora_name, lora.lora_path)


def local_model_folder(model: str) -> Path:
    """The folder the engine loads ``model`` from: the path itself, or its snapshot in the Hub cache."""
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))
