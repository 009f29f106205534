"""The connector's worker half (vLLM's worker process): holds the store's tensors, copies finished requests' blocks
into it, and writes loads into vLLM's paged cache, mapping another variant's KV with the library's one apply function
(`peft_kvcache.maps.apply.map_cache`: RoPE removed with the source's rotary, one matmul per target layer, RoPE applied
again at the target positions) and taking the leading positions from the target's own sink.

Nothing heavy holds the engine's step: the maps are loaded at start, off the engine loop, and the copies and loads
run in the order the scheduler sent them while vLLM holds a finished request's blocks until its copy is reported done
and a loading request until its load is. On a CPU engine they run inside the steps, a target layer at a time, within
a share of the engine's time (`slices.StepSlicer`: the forward and a mapping share the cores, so a mapping beside it
would slow every decoding stream); on a GPU they run on a job thread; under tensor parallelism a mapped load gathers
the source heads with a collective of the engine's group, so loads run in the step, after the queued copies. It
reports what it could not do; a load that fails is reported as failed blocks, which vLLM recomputes (the connector sets
``kv_load_failure_policy`` to ``"recompute"``): a request never receives wrong KV, and never fails, because of the
connector.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator

import torch

from .._allocator import keep_freed_memory
from ..errors import CacheMismatchError
from ..maps.apply import iter_map_cache, place_map
from ..maps.kvmap import KVMap
from ..maps.registry import MapRegistry
from ..modeling.layout import KVLayout
from .jobs import UNPLANNED, DropJob, LoadJob, SaveJob, WorkerReport
from .layout import CpuLayout, LogicalLayout, PagedLayout
from .loaded_maps import LoadedMaps
from .parallel import Shard, shard_of, unsupported_parallelism
from .slices import DEFAULT_SHARE, StepSlicer
from .store import KVStore, StoredKV

logger = logging.getLogger(__name__)


class WorkerSide:
    """See the module. ``kv_cache_config``: the engine's (block count); ``shard``: this rank's tensor-parallel place."""

    def __init__(self, vllm_config, kv_cache_config=None, maps_root: str | None = None, shard: Shard | None = None,
                 step_share: float = DEFAULT_SHARE):
        self.vllm_config, self.kv_cache_config, self.maps_root = vllm_config, kv_cache_config, maps_root
        self.step_share = step_share
        self._slicer: StepSlicer | None = None  # a CPU engine's jobs, run within its steps (set at register)
        self.shard = shard or shard_of(vllm_config)
        self.layer_names: list[str] = []
        self.layers: list[torch.Tensor] = []  # per decoder layer, in order
        self.layout: PagedLayout | None = None
        self.problem: str | None = None
        self.store = KVStore()
        self._maps = LoadedMaps()
        self._report = WorkerReport()
        # the job thread's queue and what it finished, read by the engine's thread under the lock
        self.async_loads = self.shard.world == 1
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._saved: set[str] = set()
        self._loaded: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._failed_loads: list[str] = []  # failed loads that ended since `finished` last reported the ends
        self._reportable: set[int] = set()
        self._unwritten: OrderedDict[str, None] = OrderedDict()  # requests whose load failed (loads, saves in order)
        threading.Thread(target=self._serve, name="peft-kvcache-jobs", daemon=True).start()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the engine's layer tensors in decoder-layer order (``model.layers.3.self_attn.attn`` is layer 3), each
        once (layers that share their KV register one tensor under several names)."""
        try:
            ordered = sorted(kv_caches.items(), key=lambda item: _layer_index(item[0]))
        except ValueError:
            self._disable(f"cannot order the cache's layers by name: {sorted(kv_caches)[:3]}")
            self._maps.finish()  # nothing is loaded in the background: a map asked for is read then
            return
        seen: set[int] = set()
        for name, tensor in ordered:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                self.layer_names.append(name)
                self.layers.append(tensor)
        if self.layers and self.layers[0].device.type == "cpu":
            # what vLLM's CPU build does by preloading tcmalloc where it ships one (keep_freed_memory logs it):
            # a mapping's temporaries reuse freed memory, not fresh pages faulted in at every switch
            keep_freed_memory()
            if self.async_loads:
                self._slicer = StepSlicer(self.step_share)
        if self.maps_root is None:
            self._maps.finish()
        else:  # every map this engine's model could use, read off the engine loop
            threading.Thread(target=self._load_maps, name="peft-kvcache-maps", daemon=True).start()

    def _load_maps(self) -> None:
        """Load the maps under ``maps_root`` fitted for this engine's KV layout (a failure is kept as the reason)."""
        try:
            layout = KVLayout.of_config(self.vllm_config.model_config.hf_config)
            registry = MapRegistry([self.maps_root])
            for folder, config in registry.configs.items():
                if config.source_layout == config.target_layout == layout:
                    try:
                        kv_map = KVMap.from_pretrained(folder)
                        if self.layers:  # cast (or factored) now, not at the first switch
                            place_map(kv_map, self.layers[0].device)
                        self._maps.put(folder, kv_map)
                    except Exception as err:  # a damaged map: the scheduler is told, and stops choosing it
                        self._maps.put(folder, f"{type(err).__name__}: {err}")
                        with self._lock:
                            self._report.failed_maps[folder] = f"{type(err).__name__}: {err}"
        finally:  # a switch waiting for a map this loader never reads reads it itself
            self._maps.finish()
        logger.info("peft-kvcache: %d map(s) loaded at start", self._maps.loaded())

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
        """Queue the scheduler's store operations (copies of finished requests' blocks, which vLLM holds until the
        copy is done; drops), in order, for the steps (a CPU engine) or the job thread."""
        self._check_layout()
        for op in ops:
            self._queue(op)

    def load(self, loads: list[LoadJob]) -> None:
        """Queue the step's loads (vLLM holds each request until its load is reported done), or, when loads are
        synchronous (tensor parallelism: the gather is a collective of the engine's group, which only the engine's
        thread may call), run them now, after the queued copies."""
        self._check_layout()
        if self.async_loads:
            for job in loads:
                self._queue(job)
            return
        self._jobs.join()  # the copies they may read are done
        for job in loads:
            for _ in self._load_steps(job, report_done=False):
                pass

    def step(self, forward: bool = True) -> None:
        """After each step's forward: a CPU engine's queued jobs progress within their share of its time, or run in
        full after a step that computed no token (``forward=False``: every request waits, none decodes)."""
        if self._slicer is not None:
            self._slicer.advance(forward)

    def _queue(self, job) -> None:
        if self._slicer is not None:
            self._slicer.add(self._job_steps(job), waited_on=isinstance(job, LoadJob))
        else:
            self._jobs.put(job)

    def _job_steps(self, job) -> Iterator[None]:
        """A store operation or a load, as slices (each ``yield`` ends one)."""
        return self._load_steps(job, report_done=True) if isinstance(job, LoadJob) else self._op_steps(job)

    def _serve(self) -> None:
        """The job thread: store operations and loads, one at a time, in the order the scheduler sent them."""
        while True:
            job = self._jobs.get()
            try:
                for _ in self._job_steps(job):
                    pass
            except Exception:  # the thread must outlive any job: a synchronous load joins the queue it serves
                logger.exception("peft-kvcache: a %s failed", type(job).__name__)
            finally:
                self._jobs.task_done()

    def _op_steps(self, op) -> Iterator[None]:
        stored = set()  # what the store holds of this operation, whatever fails after
        try:
            if isinstance(op, DropJob):
                if op.key is None:  # a reset
                    self.store.entries.clear()
                    self.store.sinks.clear()
                else:
                    self.store.entries.pop(op.key, None)
                    self.store.sinks.pop(op.key, None)
                return
            if self.layout is None:
                raise CacheMismatchError(self.problem or "no layout")
            if op.request_id in self._unwritten:  # its blocks hold what no load wrote
                del self._unwritten[op.request_id]
                raise CacheMismatchError(f"the load of request {op.request_id} failed: its blocks are not its KV")
            if op.key is not None:
                pairs = []
                for layer in self.layers:  # a layer a slice
                    pairs.append(self.layout.read(layer, op.block_ids))
                    yield
                entry = StoredKV([_to_host(k) for k, _ in pairs], [_to_host(v) for _, v in pairs])
                _copies_done(self.layers[0].device)  # a load of it reads the host copies on the CPU
                self.store.entries[op.key] = entry
                stored.add(op.key)
            if op.sink_key is not None:
                if not op.block_ids or op.sink_tokens > self.layout.block_size:
                    raise CacheMismatchError(f"a sink of {op.sink_tokens} token(s) needs the request's first block")
                pairs = [self.layout.read(layer, op.block_ids[:1]) for layer in self.layers]
                sink = StoredKV([_to_host(k[:, :op.sink_tokens]) for k, _ in pairs],
                                [_to_host(v[:, :op.sink_tokens]) for _, v in pairs])
                _copies_done(self.layers[0].device)
                self.store.sinks[op.sink_key] = sink
        except Exception as err:  # never fail the engine: the scheduler forgets what was not stored
            with self._lock:
                self._report.failed_keys.extend(k for k in (getattr(op, "key", None), getattr(op, "sink_key", None))
                                                if k is not None and k not in stored)
            logger.warning("peft-kvcache: could not %s %s: %s", type(op).__name__, getattr(op, "key", None), err)
        finally:
            if isinstance(op, SaveJob):  # vLLM may free its blocks now, whatever happened
                with self._lock:
                    self._saved.add(op.request_id)

    def _load_steps(self, job: LoadJob, report_done: bool) -> Iterator[None]:
        """A load as slices; ``report_done``: say it is done (an asynchronous load) when it ends, failed or not. A
        failure is reported with the load's end, in one step (`finished` hands on both, and the report vLLM takes after
        it carries the failure): reported a step earlier, the scheduler would take the request for done loading, and
        an abort in between would queue a copy of blocks vLLM frees when the load ends."""
        failure = None
        try:
            if job.kind == UNPLANNED:
                raise CacheMismatchError("the scheduler could not plan this load")
            if self.layout is None:
                raise CacheMismatchError(self.problem or "no layout")
            yield from self._load(job)
        except Exception as err:  # vLLM recomputes the failed blocks
            failure = err
        finally:
            if report_done:
                try:
                    if self.layers:  # a GPU's writes, queued on this thread's stream, land before vLLM's forward reads
                        _copies_done(self.layers[0].device)  # the blocks (or recomputes the failed ones) on its stream
                except Exception as err:  # a request never waits forever on its load
                    failure = failure or err
            if failure is not None:
                self._unwritten[job.request_id] = None  # a save of it (aborted, never recomputed) stores nothing
                while len(self._unwritten) > 4096:
                    self._unwritten.popitem(last=False)
                logger.warning("peft-kvcache: the %s load of request %s failed and is recomputed: %s", job.kind,
                               job.request_id, failure)
            with self._lock:  # `finished` hands all three on together
                if failure is not None:
                    self._failed_blocks.update(job.block_ids)
                    if job.request_id not in self._failed_loads:
                        self._failed_loads.append(job.request_id)
                if report_done:
                    self._loaded.add(job.request_id)

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose copy (vLLM may free their blocks) and whose load (vLLM may schedule them) are done
        since the last call; their failed blocks are reported by `load_errors` in the same pass, and their failures by
        the report vLLM takes after this call (`take_report`), never before the loads' ends."""
        with self._lock:
            saved, loaded, self._saved, self._loaded = self._saved, self._loaded, set(), set()
            self._reportable |= self._failed_blocks
            self._failed_blocks = set()
            self._report.failed_loads.extend(r for r in self._failed_loads if r not in self._report.failed_loads)
            self._failed_loads = []
        return saved or None, loaded or None

    def _load(self, job: LoadJob) -> Iterator[None]:
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
        if job.kind != "mapped":
            for layer, k, v in zip(self.layers, keys, values):  # a layer a slice
                self.layout.write(layer, job.block_ids, k, v)
                yield
            return
        device = self.layers[0].device  # the group gathers on the device its communicator runs on
        keys, values = ([t.to(device, non_blocking=True) for t in ts] for ts in (keys, values))
        # maps fitted per shard for this split read this rank's source heads only: no collective
        heads = self.shard.place if job.per_shard else self.shard.gather
        for mapped in self._mapped(job, heads(keys, held), heads(values, held)):
            if mapped is not None:
                t, k, v = mapped
                self.layout.write(self.layers[t], job.block_ids, k, v)
            yield

    def _mapped(self, job: LoadJob, keys: list[torch.Tensor], values: list[torch.Tensor]
                ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor] | None]:
        """The source's KV through the maps, in order (the one apply function, on the device of the layer each target
        layer fills; between two maps the KV stays in float32), every source head gathered across the
        tensor-parallel group first, this rank's target heads kept, the target's own sink in front: one target layer
        a slice, each layer of the last map as ``(layer, keys, values)`` ``[heads, tokens, head_dim]``, None for a
        layer of an earlier map."""
        if len(job.map_prints) != len(job.map_folders):
            raise CacheMismatchError("a mapped load without the fingerprints its maps were matched on")
        maps = [self._map(folder, prints) for folder, prints in zip(job.map_folders, job.map_prints)]
        positions = torch.arange(job.start, job.start + keys[0].shape[1])[None]
        keys, values = [k[None] for k in keys], [v[None] for v in values]  # [1, kv_heads, tokens, head_dim]
        # positions 0.. of the conversation, computed by the target itself
        own_keys, own_values = self._sink(job.sink_key) if job.sink_key is not None else (None, None)
        heads = self.shard.heads
        for i, kv_map in enumerate(maps):
            last = i == len(maps) - 1
            placements = [(layer.device, self.layout.dtype if last else torch.float32) for layer in self.layers]
            layers = iter_map_cache(kv_map, keys, values, positions, positions, placements)
            if not last:
                mapped = []
                for pair in layers:
                    mapped.append(pair)
                    yield None
                keys, values = [k for k, _ in mapped], [v for _, v in mapped]
                continue
            for t, (k, v) in enumerate(layers):
                k, v = k[0, heads], v[0, heads]
                if own_keys is not None:  # the sink's positions 0.. that fall in this load (none once vLLM holds them)
                    k_own, v_own = own_keys[t][:, job.start:], own_values[t][:, job.start:]
                    k[:, : k_own.shape[1]] = k_own.to(k.device, k.dtype)
                    v[:, : v_own.shape[1]] = v_own.to(v.device, v.dtype)
                yield t, k, v

    def _sink(self, sink_key: tuple) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's heads of the target's own sink, per layer ``[heads, tokens, head_dim]``: kept in the store from
        the target's earlier request (``("store", key)``), or shipped in a map (``("map", folder, start)``)."""
        if sink_key[0] == "store":
            sink = self.store.sinks[sink_key[1]]
            return sink.keys, sink.values
        # [layers, all heads, tokens, head_dim]; its folder is the last map's, checked by then
        keys, values = self._map(sink_key[1]).shipped_sink(sink_key[2])
        return list(keys[:, self.shard.heads]), list(values[:, self.shard.heads])

    def _map(self, folder: str, prints: tuple[str, str] | None = None) -> KVMap:
        """A map loaded at start (waiting for the loader to read it if a switch comes first); one it could not load
        fails, and so does one of other weights than ``prints`` (source, target), what the scheduler matched: the
        folder was saved again between the scheduler's read and the worker's."""
        found = self._maps.get(folder, KVMap.from_pretrained)
        if isinstance(found, str):
            raise CacheMismatchError(f"map {folder} could not be loaded at start: {found}")
        if prints is not None and not found.fitted_for(*prints):
            raise CacheMismatchError(f"map {folder} was saved again for other weights since the scheduler matched it")
        return found

    def load_errors(self) -> set[int]:
        """Blocks whose load failed (vLLM recomputes them): reported in the pass that reports the load done (a
        synchronous load's: at once)."""
        with self._lock:
            if not self.async_loads:
                self._reportable |= self._failed_blocks
                self._failed_blocks = set()
            failed, self._reportable = self._reportable, set()
        return failed

    def take_report(self) -> WorkerReport | None:
        """What to tell the scheduler after this step, or None."""
        with self._lock:
            report, self._report = self._report, WorkerReport()
        if report.ready is None and not report.failed_keys and not report.failed_loads and not report.failed_maps:
            return None
        return report


def _layer_index(name: str) -> int:
    """The decoder layer a cache layer's name belongs to (``model.layers.3.self_attn.attn`` -> 3)."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(name)
    return numbers[0]


def _copies_done(device: torch.device) -> None:
    """Wait (on the job thread) until the work queued on its stream of ``device`` is done: `_to_host`'s copies, a load's
    writes (vLLM's forward runs on another stream, which nothing orders after this one)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a cache slice: as it is on the CPU (``read`` returns copies), into pinned memory, without waiting,
    from a GPU."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
