"""The connector's worker half (vLLM's worker process): holds the store's tensors, copies finished requests' blocks
into it, and writes loads into vLLM's paged cache, mapping another variant's KV with the library's one apply function
(`peft_kvcache.maps.apply.map_cache`: RoPE removed with the source's rotary, one matmul per target layer, RoPE applied
again at the target positions) and taking the leading positions from the target's own stored sink.

It runs what the scheduler sends, in order, and reports what it could not do; a load that fails is reported as
failed blocks, which vLLM recomputes (the connector sets ``kv_load_failure_policy`` to ``"recompute"``): a request
never receives wrong KV, and never fails, because of the connector.
"""

from __future__ import annotations

import logging
import re

import torch

from ..errors import CacheMismatchError
from ..maps.apply import map_cache
from ..maps.kvmap import KVMap
from .jobs import DropJob, LoadJob, SaveJob, SinkJob, WorkerReport
from .layout import PagedLayout
from .store import KVStore, StoredKV

logger = logging.getLogger(__name__)


class WorkerSide:
    """See the module."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.layer_names: list[str] = []
        self.layers: list[torch.Tensor] = []  # per decoder layer, in order
        self.layout: PagedLayout | None = None
        self.problem: str | None = None
        self.store = KVStore()
        self._maps: dict[str, KVMap] = {}
        self._report = WorkerReport()
        self._failed_blocks: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the engine's layer tensors, in decoder-layer order (names such as ``model.layers.3.self_attn.attn``)."""
        try:
            ordered = sorted(kv_caches.items(), key=lambda item: int(re.search(r"\.(\d+)\.", item[0]).group(1)))
        except AttributeError:
            self._disable(f"cannot order the cache's layers by name: {sorted(kv_caches)[:3]}")
            return
        self.layer_names, self.layers = [n for n, _ in ordered], [t for _, t in ordered]

    def _check_layout(self) -> None:
        """Once, before the first job: the kernel and the packing of every layer (they must all agree)."""
        if self.layout is not None or self.problem is not None:
            return
        if not self.layers:
            self._disable("no layer of the engine's cache was registered")
            return
        cache_dtype = self.vllm_config.cache_config.cache_dtype
        if cache_dtype != "auto":
            self._disable(f"the cache stores {cache_dtype!r} (a quantized KV cache), not the model's dtype")
            return
        context = self.vllm_config.compilation_config.static_forward_context
        isas = {getattr(context.get(name), "isa", None) for name in self.layer_names}
        try:
            if len(isas) != 1 or None in isas:
                raise CacheMismatchError(f"the layers' attention kernels are {sorted(map(str, isas))}")
            layouts = {PagedLayout.of(layer, next(iter(isas))) for layer in self.layers}
            if len(layouts) != 1:
                raise CacheMismatchError(f"the layers are packed differently: {layouts}")
        except CacheMismatchError as err:
            self._disable(str(err))
            return
        self.layout = layouts.pop()
        self._report.ready = True
        logger.info("peft-kvcache: the worker reads and writes %s", self.layout)

    def _disable(self, problem: str) -> None:
        self.problem = problem
        self._report.ready, self._report.problem = False, problem
        logger.warning("peft-kvcache: the connector cannot use this engine's cache and maps nothing: %s", problem)

    # ----- each step -----

    def before_forward(self, ops: list) -> None:
        """Run the scheduler's store operations (before the forward pass may overwrite freed blocks)."""
        self._check_layout()
        for op in ops:
            try:
                if self.layout is None:
                    raise CacheMismatchError(self.problem or "no layout")
                self._run(op)
            except Exception as err:  # never fail the engine: the scheduler forgets what was not stored
                if not isinstance(op, DropJob):
                    self._report.failed_keys.append(op.key)
                logger.warning("peft-kvcache: could not %s %s: %s", type(op).__name__, op.key, err)

    def _run(self, op) -> None:
        if isinstance(op, SaveJob):
            pairs = [self.layout.read(layer, op.block_ids) for layer in self.layers]
            self.store.entries[op.key] = StoredKV([k for k, _ in pairs], [v for _, v in pairs])
        elif isinstance(op, SinkJob):
            pairs = [self.layout.read(layer, (op.block_id,)) for layer in self.layers]
            self.store.sinks[op.key] = StoredKV([k[:, :op.tokens].clone() for k, _ in pairs],
                                                [v[:, :op.tokens].clone() for _, v in pairs])
        else:
            self.store.entries.pop(op.key, None)
            self.store.sinks.pop(op.key, None)

    def load(self, loads: list[LoadJob]) -> None:
        """Write the step's loads into their blocks (before the layers read them); a load that fails is reported."""
        for job in loads:
            try:
                if self.layout is None:
                    raise CacheMismatchError(self.problem or "no layout")
                self._load(job)
            except Exception as err:  # vLLM recomputes the failed blocks
                self._failed_blocks.update(job.block_ids)
                self._report.failed_loads.append(job.request_id)
                logger.warning("peft-kvcache: the %s load of request %s failed and is recomputed: %s", job.kind,
                               job.request_id, err)

    def _load(self, job: LoadJob) -> None:
        entry = self.store.entries[job.source_key]
        count = len(job.block_ids) * self.layout.block_size
        if entry.length < job.start + count:
            raise CacheMismatchError(f"the stored prefix holds {entry.length} tokens, the load needs "
                                     f"{job.start + count}")
        keys = [k[:, job.start: job.start + count] for k in entry.keys]  # [kv_heads, tokens, head_dim]
        values = [v[:, job.start: job.start + count] for v in entry.values]
        if job.kind == "mapped":
            keys, values = self._mapped(job, keys, values)
        for layer, k, v in zip(self.layers, keys, values):
            self.layout.write(layer, job.block_ids, k, v)

    def _mapped(self, job: LoadJob, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """The source's KV through the maps, in order (the one apply function; between two maps the KV stays in
        float32), the target's own sink in front."""
        positions = torch.arange(job.start, job.start + keys[0].shape[1])[None]
        keys, values = [k[None] for k in keys], [v[None] for v in values]  # [1, kv_heads, tokens, head_dim]
        for i, folder in enumerate(job.map_folders):
            if folder not in self._maps:
                self._maps[folder] = KVMap.from_pretrained(folder)
            dtype = self.layout.dtype if i == len(job.map_folders) - 1 else torch.float32
            mapped = map_cache(self._maps[folder], keys, values, positions, positions,
                               [(torch.device("cpu"), dtype)] * len(self.layers))
            keys, values = [k for k, _ in mapped], [v for _, v in mapped]
        keys, values = [k[0] for k in keys], [v[0] for v in values]
        if job.sink_key is not None:  # positions 0.. of the conversation, computed by the target itself
            sink = self.store.sinks[job.sink_key]
            for k, v, k_own, v_own in zip(keys, values, sink.keys, sink.values):
                k[:, : sink.length], v[:, : sink.length] = k_own, v_own
        return keys, values

    def load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_report(self) -> WorkerReport | None:
        """What to tell the scheduler after this step, or None."""
        report, self._report = self._report, WorkerReport()
        if report.ready is None and not report.failed_keys and not report.failed_loads:
            return None
        return report
