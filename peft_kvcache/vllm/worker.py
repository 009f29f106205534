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

import torch

from ..errors import CacheMismatchError
from ..maps.apply import map_cache
from ..maps.kvmap import KVMap
from .jobs import DropJob, LoadJob, SaveJob, SinkJob, WorkerReport
from .layout import CpuLayout, LogicalLayout, PagedLayout
from .parallel import Shard, shard_of, unsupported_parallelism
from .store import KVStore, StoredKV

logger = logging.getLogger(__name__)


class WorkerSide:
    """See the module. ``kv_cache_config``: the engine's (block count); ``shard``: this rank's tensor-parallel place."""

    def __init__(self, vllm_config, kv_cache_config=None, shard: Shard | None = None):
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.shard = shard or shard_of(vllm_config)
        self.layer_names: list[str] = []
        self.layers: list[torch.Tensor] = []  # per decoder layer, in order
        self.layout: PagedLayout | None = None
        self.problem: str | None = None
        self.store = KVStore()
        self._maps: dict[str, KVMap] = {}
        self._report = WorkerReport()
        self._failed_blocks: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the engine's layer tensors in decoder-layer order (``model.layers.3.self_attn.attn`` is layer 3), each
        once (layers that share their KV register one tensor under several names)."""
        try:
            ordered = sorted(kv_caches.items(), key=lambda item: _layer_index(item[0]))
        except ValueError:
            self._disable(f"cannot order the cache's layers by name: {sorted(kv_caches)[:3]}")
            return
        seen: set[int] = set()
        for name, tensor in ordered:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                self.layer_names.append(name)
                self.layers.append(tensor)

    def _check_layout(self) -> None:
        """Once, before the first job: what the engine declares its cache to be, checked on every layer."""
        if self.layout is not None or self.problem is not None:
            return
        problem = unsupported_parallelism(self.vllm_config)
        if problem or not self.layers:
            self._disable(problem or "no layer of the engine's cache was registered")
            return
        cache_dtype = self.vllm_config.cache_config.cache_dtype
        if cache_dtype != "auto":
            self._disable(f"the cache stores {cache_dtype!r} (a quantized KV cache), not the model's dtype")
            return
        try:
            layouts = {self._layout_of(name, layer) for name, layer in zip(self.layer_names, self.layers)}
            if len(layouts) != 1:
                raise CacheMismatchError(f"the layers are laid out differently: {layouts}")
        except CacheMismatchError as err:
            self._disable(str(err))
            return
        self.layout = layouts.pop()
        self._report.ready = True
        logger.info("peft-kvcache: the worker reads and writes %s (tensor-parallel rank %d of %d)", self.layout,
                    self.shard.rank, self.shard.world)

    def _layout_of(self, name: str, layer: torch.Tensor) -> PagedLayout:
        """The CPU backend's packing (by the kernel it chose, ``layer.isa``), or a GPU backend's logical view checked
        against the layout the engine resolved."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            isa = getattr(self.vllm_config.compilation_config.static_forward_context.get(name), "isa", None)
            return CpuLayout.of(layer, isa)
        cache = self.vllm_config.cache_config
        return LogicalLayout.of(layer, cache.get_resolved_kv_cache_layout(), self.vllm_config.model_config.get_head_size(),
                                cache.block_size, self.kv_cache_config.num_blocks)

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
            self.store.entries[op.key] = StoredKV([_to_host(k) for k, _ in pairs], [_to_host(v) for _, v in pairs])
        elif isinstance(op, SinkJob):
            pairs = [self.layout.read(layer, (op.block_id,)) for layer in self.layers]
            self.store.sinks[op.key] = StoredKV([_to_host(k[:, :op.tokens]) for k, _ in pairs],
                                                [_to_host(v[:, :op.tokens]) for _, v in pairs])
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
        entry = self.store.entries.get(job.source_key)
        count = len(job.block_ids) * self.layout.block_size
        held = entry is not None and entry.length >= job.start + count
        if held:  # [kv_heads, tokens, head_dim] per layer
            keys = [k[:, job.start: job.start + count] for k in entry.keys]
            values = [v[:, job.start: job.start + count] for v in entry.values]
        elif job.kind == "mapped":  # it still joins the gather, so that no rank waits for another
            keys = values = [torch.zeros(self.layout.kv_heads, count, self.layout.head_dim)] * len(self.layers)
        else:
            raise CacheMismatchError(f"the stored prefix holds {0 if entry is None else entry.length} tokens, the "
                                     f"load needs {job.start + count}")
        if job.kind == "mapped":
            device = self.layers[0].device  # the group gathers on the device its communicator runs on
            keys, values = ([t.to(device, non_blocking=True) for t in ts] for ts in (keys, values))
            keys, values = self._mapped(job, self.shard.gather(keys, held), self.shard.gather(values, held))
        for layer, k, v in zip(self.layers, keys, values):
            self.layout.write(layer, job.block_ids, k, v)

    def _mapped(self, job: LoadJob, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """The source's KV through the maps, in order (the one apply function, on the device of the layer each target
        layer fills; between two maps the KV stays in float32), every source head gathered across the
        tensor-parallel group first, this rank's target heads kept, the target's own sink in front."""
        positions = torch.arange(job.start, job.start + keys[0].shape[1])[None]
        keys, values = [k[None] for k in keys], [v[None] for v in values]  # [1, kv_heads, tokens, head_dim]
        for i, folder in enumerate(job.map_folders):
            last = i == len(job.map_folders) - 1
            placements = [(layer.device, self.layout.dtype if last else torch.float32) for layer in self.layers]
            mapped = map_cache(self._map(folder), keys, values, positions, positions, placements)
            keys, values = [k for k, _ in mapped], [v for _, v in mapped]
        heads = self.shard.heads
        keys, values = [k[0, heads] for k in keys], [v[0, heads] for v in values]
        if job.sink_key is not None:  # positions 0.. of the conversation, computed by the target itself
            sink = self.store.sinks[job.sink_key]
            for k, v, k_own, v_own in zip(keys, values, sink.keys, sink.values):
                k[:, : sink.length], v[:, : sink.length] = k_own.to(k.device), v_own.to(v.device)
        return keys, values

    def _map(self, folder: str) -> KVMap:
        if folder not in self._maps:
            self._maps[folder] = KVMap.from_pretrained(folder)
        return self._maps[folder]

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


def _layer_index(name: str) -> int:
    """The decoder layer a cache layer's name belongs to (``model.layers.3.self_attn.attn`` -> 3)."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(name)
    return numbers[0]


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a cache slice: as it is on the CPU (``read`` returns copies), into pinned memory, without waiting,
    from a GPU."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
