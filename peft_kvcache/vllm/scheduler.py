"""The connector's scheduler half (vLLM's engine-core process): decides what a request loads, what the store keeps
and how each request is labelled; it never touches a tensor.

A request for variant B (the base model or an adapter) whose prompt vLLM's own prefix cache does not hold gets, in
whole blocks and always leaving the last prompt token to the engine, the longest of:

- B's own stored prefix, as it is: exact (``reused``), or derived from a mapped prefix (``mapped:<model>``: what an
  earlier mapped request of B computed, kept so that a conversation switching at every turn prefills only its new
  tokens);
- another variant A's stored prefix, mapped A -> B with the published maps that fit both (``mapped:<A>``; in mode
  ``naive`` injected unmapped, ``naive:<A>``, the baseline), when it saves at least ``min_mapped_tokens`` of prefill
  beyond the exact options, has passed through at most ``max_hops`` maps, and B's own attention sink for the
  conversation's first tokens is known (shipped in the map for its chat template's starts, kept from an earlier
  request of B, or in vLLM's own first block);
- else nothing: ordinary prefill, and the reason is counted (and logged once).

The reuse core decides and names it all (`peft_kvcache.runtime.reuse`: `Made`, `mapping_pays`, `label`). Approximate
blocks are never served as exact: they are taken out of vLLM's prefix cache once vLLM has hashed them, a request
that used them is kept only as derived, and its response says where its context came from. Nothing stale is
served: a variant whose files changed (file identity and sampled fingerprint) loses its entries, here and in vLLM's
prefix cache, and `reset` drops everything. A request with multimodal inputs or prompt embeddings is never served
from the store (its tokens do not say what it holds).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..runtime.reuse import EXACT, Made, mapping_pays
from .evictions import PrefixCacheEvictions
from .jobs import UNPLANNED, DropJob, LoadJob, SaveJob, WorkerReport
from .layout import unsupported_attention
from .options import ConnectorOptions, request_reuse
from .pairs import Variant, VariantMaps, local_model_folder, lora_id_of, variant_of
from .records import Counts, Plan, RequestRecord
from .parallel import head_groups, unsupported_parallelism
from .staleness import FileWatch, StaleKV
from .store import IndexEntry, StoreIndex

logger = logging.getLogger(__name__)


class SchedulerSide:
    """See the module. ``vllm_config``: the engine's; ``async_loads``: loads complete between steps (vLLM's
    ``load_kv_async``); ``kv_cache_config``: the engine's cache groups (anything but full attention is refused).
    vLLM's block pool is bound after construction (`evictions`)."""

    def __init__(self, vllm_config, options: ConnectorOptions, async_loads: bool = True, kv_cache_config=None):
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        self.options, self.async_loads = options, async_loads
        self.block_size = vllm_config.cache_config.block_size
        per_token = (model.get_num_layers(parallel) * 2 * model.get_num_kv_heads(parallel) * model.get_head_size()
                     * torch.empty(0, dtype=model.dtype).element_size())
        self.index = StoreIndex(options.store_bytes, self.block_size, per_token)
        self.base_name = model.served_model_name or model.model
        self.files = FileWatch(model.model)  # every mode: a variant whose files change loses its KV
        self.evictions = PrefixCacheEvictions(self.block_size)
        self.stale = StaleKV(self.files, self.index, self.evictions, self._running_of, self._drop)
        self.maps: VariantMaps | None = None
        if options.mode == "map":  # the base model's identity is read here, at start
            self.maps = VariantMaps(options.maps, self.files.model_dir or local_model_folder(model.model),
                                    model.hf_config)
            if self.maps.problem:
                logger.warning("peft-kvcache: nothing will be mapped on this engine: %s", self.maps.problem)
            logger.info("peft-kvcache: %d map folder(s) under %s", len(self.maps.registry), options.maps)
        configs = self.maps.registry.configs.values() if self.maps else ()
        self.sink_tokens = max([c.sink_tokens for c in configs] or [1])
        self.worker_ready = False
        self.worker_problem: str | None = None  # why the worker cannot use the engine's cache, once it said so
        self.head_groups = head_groups(vllm_config)  # maps fitted per shard for this split need no gather
        # said at start; every request falls back with the reason: (fallback, why) or None
        self.refused = next(((reason, why) for reason, why in (
            ("unsupported_parallelism", unsupported_parallelism(vllm_config)),
            ("unsupported_attention", unsupported_attention(kv_cache_config))) if why), None)
        if self.refused:
            logger.warning("peft-kvcache: the connector reuses nothing on this engine (%s): %s", *self.refused)
        self.plans: dict[str, Plan] = {}
        self.records: dict[str, RequestRecord] = {}
        self.running: dict[str, object] = {}  # vLLM's requests admitted and not finished (their block hashes)
        self.loading: set[str] = set()  # requests whose asynchronous load vLLM still waits on
        self.ops: list = []  # store operations for the next step, in order
        self.loads: list[LoadJob] = []
        self.counts = Counts()
        self._reported_size = (0, 0)  # the store's bytes and entries as `stats` last reported them
        self._logged: set[str] = set()

    # ----- a new request -----

    def matched_tokens(self, request, local_tokens: int) -> int | None:
        """Tokens beyond vLLM's own hit (``local_tokens``) the connector will write (whole blocks; 0 for none), or
        None: ask again next step (vLLM's hit was on a variant whose files changed, or read blocks taken out of its
        cache just now: approximate ones). Side-effect free but for the plan it keeps and those evictions: vLLM may ask
        again for the same request."""
        variant = variant_of(request)
        self.files.seen(variant, lora_id_of(request))
        if self.stale.changed(variant) and local_tokens:
            return None
        other_weights = self.stale.other_weights(request)
        # vLLM's hit, cached under the adapter's name and path, is of the files on disk, not of the weights this
        # request runs: out, and vLLM asks again (only where something was taken out: never a loop)
        if local_tokens and other_weights:
            if self.evictions.hashes(request.block_hashes[: local_tokens // self.block_size]):
                return None
        if local_tokens:  # approximate blocks vLLM cached since: out, and where its hit read one, it asks again
            evicted = self.evictions.hashed_later(variant) | self.stale.evict_running(variant)
            if evicted & set(request.block_hashes[: local_tokens // self.block_size]):
                return None
        plan = self._plan(request, variant, local_tokens, other_weights)
        self.plans[request.request_id] = plan
        return plan.tokens * self.block_size

    def _plan(self, request, variant: Variant, local_tokens: int, other_weights: bool) -> Plan:
        local_blocks = local_tokens // self.block_size
        plan = Plan(local_blocks)
        prompt = list(request.prompt_token_ids or [])
        limit = (len(prompt) - 1) // self.block_size  # vLLM must compute at least the last prompt token
        reuse, problem = request_reuse(request.kv_transfer_params)
        if problem:
            self._say("invalid_options", problem)
            plan.fallback = "invalid_options"
        if self.refused:
            plan.fallback = self.refused[0]
            return plan
        if _not_its_tokens(request):
            plan.fallback = "multimodal"  # its placeholder tokens would match another input's KV
            return plan
        if other_weights:
            plan.fallback = "stale_lora_id"  # its weights are of no files on disk: nothing stored is theirs
            return plan
        if self.worker_problem:
            plan.fallback = "unsupported_layout"
            return plan
        record = self.records.get(request.request_id)
        if record is not None and record.fallback == "load_error":  # vLLM recomputes it: nothing is offered again
            plan.fallback = "load_error"
            return plan
        if not self.worker_ready or reuse == "none" or limit <= local_blocks:
            return plan
        matches = self.index.matches(request.cache_salt, prompt, limit)
        # another variant's entry holds KV of the files it had then: mapped with the map its files match now, it
        # would be foreign KV (an adapter replaced at the same path); its entries are dropped instead
        changed = {other for other in {match.entry.variant for match in matches.values()} - {variant}
                   if self.stale.changed(other)}
        matches = {key: match for key, match in matches.items() if match.entry.variant not in changed}
        exact = matches.pop((variant, True), None)
        if exact is not None and exact.blocks > local_blocks:
            plan = Plan(local_blocks, "reused", exact.entry, exact.blocks, fallback=plan.fallback)
        floor = max(local_blocks, plan.blocks)  # what the exact options give
        for match in sorted(matches.values(), key=lambda m: -m.blocks):  # longest prefix first
            if match.blocks <= floor:
                break
            way = self._way(variant, match, floor, reuse, prompt, local_blocks * self.block_size)
            if isinstance(way, str):
                plan.fallback = plan.fallback or way
                continue
            kind, made, choice, sink_key = way
            return Plan(local_blocks, kind, match.entry, match.blocks, made, choice, sink_key, plan.fallback)
        return plan

    def _way(self, target: Variant, match, floor: int, reuse: str, prompt: list[int], held: int):
        """How ``match`` (a stored prefix of ``target`` itself, derived, or of another variant) can serve
        ``target`` beyond the ``floor`` blocks the exact options give: ``(kind, made, map choice, sink key)``, or why it
        cannot (a fallback reason). ``held``: the tokens vLLM's own prefix cache holds of the target (a mapping needs
        the target's own sink only where they do not cover it)."""
        entry, blocks = match.entry, match.blocks
        if reuse == "exact" or self.options.mode == "exact":
            return "exact_only"
        if self.evictions.pool is None:
            return "no_block_pool"  # approximate blocks could not be kept out of vLLM's prefix cache
        own = entry.variant == target
        saved = (blocks - floor) * self.block_size
        made = entry.made.cut(blocks * self.block_size) if own else self._made_for(entry, blocks)
        if not mapping_pays(made, saved, self.options.min_mapped_tokens):
            return "below_min_length"  # too few tokens saved to justify approximate KV
        if own:  # what an earlier mapped request of this variant computed: as stored, labelled as derived
            return "reused", made, None, None
        if self.options.mode == "naive":
            return "naive", Made("naive", entry.variant.adapter, blocks * self.block_size), None, None
        choice = self.maps.find(entry.variant, target)
        if isinstance(choice, str):
            return choice
        made = Made("mapped", made.source, made.tokens, made.hops + len(choice.folders) - 1)
        if made.hops > self.options.max_hops:
            return "max_hops"
        sink_key = None
        if choice.sink_tokens > held:  # the target's own first tokens, which vLLM does not hold
            start = tuple(prompt[: choice.sink_tokens])
            shipped = {tuple(s) for s in self.maps.registry.configs[choice.folders[-1]].sinks}
            if self.index.has_sink(target, start):  # kept from the target's own earlier request
                sink_key = ("store", (target, start))
            elif start in shipped:  # shipped in the map for the chat template's (and BOS's) conversation starts
                sink_key = ("map", choice.folders[-1], start)
            else:
                return "no_target_sink"
        return "mapped", made, choice, sink_key

    def _made_for(self, entry: IndexEntry, blocks: int) -> Made:
        """How ``blocks`` blocks of another variant's entry are made once mapped (one map more than it passed)."""
        tokens = blocks * self.block_size
        if entry.made.exact:
            return Made("mapped", entry.variant.adapter, tokens, 1)
        return entry.made.mapped_again(tokens)

    def allocated(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks (``block_ids``: all of them) and will skip ``num_external_tokens``: queue
        the load, and take approximate blocks out of vLLM's prefix cache once vLLM has hashed them (a synchronous load
        now; an asynchronous one when vLLM calls again after it, with no external tokens)."""
        rid = request.request_id
        if not num_external_tokens:  # vLLM calls again, with none, once an asynchronous load is done
            self.evictions.take_later(rid)
            self.loading.discard(rid)
        plan = self.plans.pop(rid, None)
        if plan is None:
            return
        before = self.records.get(rid)
        before = None if before is None else replace(before)  # what a failed admission's record goes back to
        try:
            self._admit(request, plan, block_ids, num_external_tokens)
        except Exception:  # never fail the engine; vLLM skips the external tokens whatever happened here
            logger.exception("peft-kvcache: admitting request %s failed; its loaded tokens are recomputed", rid)
            self._admission_failed(request, plan, block_ids, num_external_tokens, before)

    def _admit(self, request, plan: Plan, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        loaded = bool(num_external_tokens and plan.kind is not None)
        ids: tuple[int, ...] = ()
        if loaded:  # first of all: vLLM will skip these tokens, so they must be written (or reported as failed)
            ids = self._external_blocks(plan, block_ids, num_external_tokens)
            folders, prints = (plan.choice.folders, plan.choice.prints) if plan.choice else ((), ())
            per_shard = bool(folders) and all(self.maps.registry.configs[f].calibration.options.head_shards
                                              == self.head_groups for f in folders)
            self.loads.append(LoadJob(rid, plan.kind, plan.entry.key, plan.local_blocks * self.block_size, ids, folders,
                                      plan.sink_key, per_shard, prints))
            self.index.touch(plan.entry)
            if self.async_loads:
                self.loading.add(rid)
            if plan.made.approximate:
                if self.async_loads:
                    self.evictions.later_for(rid, variant_of(request), ids)
                else:
                    self.evictions.blocks(ids)
        record = self.records.get(rid) or self._first_record(request, plan, loaded)
        record.admitted(plan.local_blocks * self.block_size, num_external_tokens if loaded else 0,
                        plan.made if loaded else EXACT, _fallback(plan, loaded))

    def _external_blocks(self, plan: Plan, block_ids: list[int], num_external_tokens: int) -> tuple[int, ...]:
        """The blocks of the tokens vLLM skips: those after vLLM's own hit."""
        first = plan.local_blocks
        return tuple(block_ids[first: first + num_external_tokens // self.block_size])

    def _first_record(self, request, plan: Plan, loaded: bool) -> RequestRecord:
        """The record of a request admitted for the first time (its fallback counted, said once)."""
        rid, variant = request.request_id, variant_of(request)
        reuse, _ = request_reuse(request.kv_transfer_params)
        record = self.records[rid] = RequestRecord(variant, request.cache_salt, reuse, request.num_prompt_tokens,
                                                   fingerprint=self.files.of_request(variant, lora_id_of(request)))
        self.running[rid] = request
        self.files.made_with(variant, record.fingerprint)  # the files its blocks are of, from its first block on
        if _fallback(plan, loaded):
            self.counts.fallbacks[plan.fallback] += 1
            self._say(plan.fallback, f"{record.variant.label} request {rid}")
        return record

    def _admission_failed(self, request, plan: Plan, block_ids: list[int], num_external_tokens: int,
                          before: RequestRecord | None) -> None:
        """`_admit` raised halfway: what it queued for the request is withdrawn, and the tokens vLLM will skip are
        handed to the worker as a load that fails, so that vLLM recomputes them (labelled ``load_error``); then the
        record goes back to ``before`` (the record as it was) and takes the planned admission, which the worker's
        failure report takes back as for any failed load."""
        rid, first = request.request_id, plan.local_blocks
        self.loads = [job for job in self.loads if job.request_id != rid]
        self.evictions.cancel_later(rid)
        self.loading.discard(rid)
        if num_external_tokens:  # first: nothing below may keep vLLM from recomputing them
            ids = self._external_blocks(plan, block_ids, num_external_tokens)
            self.loads.append(LoadJob(rid, UNPLANNED, "", first * self.block_size, ids))
            if self.async_loads:
                self.loading.add(rid)
        if before is None:  # as it was (or none): what the failed admission recorded is not what runs
            self.records.pop(rid, None)
        else:
            self.records[rid] = before
        try:
            record = before or self._first_record(request, plan, bool(num_external_tokens))
            record.admitted(first * self.block_size, num_external_tokens, plan.made if num_external_tokens else EXACT,
                            _fallback(plan, bool(num_external_tokens)))
        except Exception:  # never fail the engine: a request without a record is counted as prefilled when it ends
            logger.exception("peft-kvcache: recording request %s failed", rid)

    def _running_of(self, variant: Variant) -> list[tuple[object, RequestRecord]]:
        """``variant``'s running requests, each with its record."""
        return [(self.running[rid], record) for rid, record in self.records.items()
                if record.variant == variant and rid in self.running]

    # ----- a finished request -----

    def finished(self, request, block_ids: list[int]) -> tuple[bool, dict]:
        """Count the request, keep what it computed (whole blocks: exact, or derived from a mapped prefix within
        ``max_hops``) and its variant's sink if the store lacks it; returns whether vLLM must hold its blocks until
        the worker has copied them, and its label for the response."""
        record = self.records.pop(request.request_id, None)
        self.plans.pop(request.request_id, None)
        self.running.pop(request.request_id, None)
        loading = request.request_id in self.loading
        self.loading.discard(request.request_id)
        self.evictions.take_later(request.request_id)  # ended before vLLM called again after its load, say
        now = self.files.fingerprint(variant_of(request))
        if record is None:  # never admitted through the connector (aborted while waiting)
            record = RequestRecord(variant_of(request), request.cache_salt, "map", request.num_prompt_tokens,
                                   fingerprint=now)
        self.counts.tokens["engine"] += record.local_tokens
        if record.loaded_tokens:
            self.counts.tokens[record.made.context_source] += record.loaded_tokens
        self.counts.tokens["prefilled"] += record.prompt_tokens - record.local_tokens - record.loaded_tokens
        if loading:  # ended (aborted) while its load ran: its blocks are not all written, and vLLM frees them when the
            # worker reports the load (holding them for a copy too would have them freed twice)
            return False, record.label(self.base_name)
        if record.fingerprint != now:  # its variant's files changed since its weights were read: old weights' KV
            self._say("changed_while_running", f"{record.variant.label}'s files changed since request "
                      f"{request.request_id}'s weights were read: nothing it computed is kept")
            self.evictions.request(request, 0, block_ids)
            return False, record.label(self.base_name)
        if record.made.approximate:  # what it computed over approximate KV is derived too: never an exact hit later
            self.evictions.request(request, record.local_tokens // self.block_size, block_ids)
        # every variant's fingerprint, kept or not: vLLM's prefix cache keeps its blocks whatever the store keeps
        self.files.made_with(record.variant, now)
        pool = self.evictions.pool
        self.files.track(record.variant, getattr(request, "block_hashes", ()), getattr(pool, "num_gpu_blocks", 0))
        return self._keep(request, record, block_ids), record.label(self.base_name)

    def _keep(self, request, record: RequestRecord, block_ids: list[int]) -> bool:
        """Queue the copy of the request's whole computed blocks (and the variant's sink); whether one was queued."""
        if self.refused or _not_its_tokens(request):  # its KV is never served from the store: nor kept there
            return False
        mapping = self.maps is not None and self.options.mode == "map"
        # in mode "map", only what a map can take somewhere (vLLM's own cache keeps a variant's exact prefixes) and the
        # sinks of variants a map leads to; derived KV only within the bound on maps passed
        keep_entry = (not mapping or self.maps.useful(record.variant)) and record.made.hops <= self.options.max_hops
        keep_sink = record.made.exact and (not mapping or self.maps.useful(record.variant, "target"))
        # what its processed steps wrote: under async scheduling (vLLM's default on GPUs) the counter runs ahead by
        # the steps still in flight, whose writes a copy on another stream could read before they land
        processed = max(0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0))  # 0: preempted
        computed = min(processed, len(block_ids) * self.block_size)
        tokens = list(request.all_token_ids)[:computed]
        blocks = computed // self.block_size if keep_entry else 0
        entry = None
        if blocks:
            entry, dropped = self.index.add(record.variant, record.salt, tokens[: blocks * self.block_size],
                                            record.made.cut(blocks * self.block_size))
            self._drop(dropped)
        sink = None
        if keep_sink and computed >= self.sink_tokens and block_ids:
            first = tokens[: self.sink_tokens]
            if not self.index.has_sink(record.variant, first):
                sink, evicted = self.index.add_sink(record.variant, first)
                self._drop(evicted)
                if entry is not None and entry.key in evicted:  # the sink took its room: nothing of it to save
                    entry, blocks = None, 0
        if entry is None and sink is None:
            return False
        # the sink is read from the first block, which a sink kept alone must carry too
        self.ops.append(SaveJob(request.request_id, entry.key if entry else None, tuple(block_ids[: blocks or 1]),
                                sink, self.sink_tokens))
        return True

    def _drop(self, keys: list) -> None:
        self.ops.extend(DropJob(key) for key in keys)
        self.counts.evictions += sum(1 for key in keys if key)

    # ----- a reset -----

    def reset(self) -> bool:
        """Drop every stored entry and sink (vLLM resets its prefix cache: a weight update, sleep and wake); the worker
        frees their tensors with the next step. The files' fingerprints are kept: vLLM calls this even where its own
        reset failed (running requests hold blocks), and a variant whose files change later must still be recognised."""
        self.ops.append(DropJob(None))  # None: everything
        self.index.clear()
        logger.info("peft-kvcache: the store was reset")
        return True

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
                self.worker_problem = report.problem or "the worker cannot use this engine's cache"
                self._say("unsupported_layout", self.worker_problem)
        for key in report.failed_keys:
            self.index.remove(key)
        for folder, why in report.failed_maps.items():  # never chosen again: its switches are prefilled
            self.maps.set_unusable(folder)
            self._say("unusable_map", f"the worker could not load map {folder}: {why[:200]}")
        for request_id in set(report.failed_loads):  # vLLM recomputes the request's loaded blocks
            record = self.records.get(request_id)
            self.evictions.cancel_later(request_id)
            self.loading.discard(request_id)
            if record is not None:
                record.load_failed()
            self.counts.fallbacks["load_error"] += 1
            self._say("load_error", f"request {request_id}")

    def stats(self) -> dict | None:
        """Counters since the last call and the store's size, or None when nothing happened (the size included: a
        reset empties the store without a counter moving)."""
        counts, self.counts = self.counts, Counts()
        size, self._reported_size = self._reported_size, (self.index.nbytes, len(self.index))
        if not (counts.tokens or counts.fallbacks or counts.evictions) and size == self._reported_size:
            return None
        return {"tokens": dict(counts.tokens), "fallbacks": dict(counts.fallbacks), "evictions": counts.evictions,
                "store_bytes": self.index.nbytes, "store_entries": len(self.index)}

    def _say(self, reason: str, detail: str) -> None:
        """Log a fallback or a problem once per reason (details shortened by the caller)."""
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("peft-kvcache: %s (%s; logged once per reason)", detail, reason)


def _fallback(plan: Plan, loaded: bool) -> str | None:
    """The fallback a request's label and counters carry: why a longer prefix was not used where nothing was loaded;
    options it could not read whatever it loaded (its sender must learn they were read as "exact")."""
    return plan.fallback if not loaded or plan.fallback == "invalid_options" else None


def _not_its_tokens(request) -> bool:
    """Whether a request's KV is of more than its token ids (multimodal inputs behind placeholder tokens, prompt
    embeddings behind placeholder ids): KV kept under its tokens would be another input's."""
    return bool(getattr(request, "mm_features", None)) or getattr(request, "prompt_embeds", None) is not None


__all__ = ["Counts", "Plan", "RequestRecord", "SchedulerSide"]
