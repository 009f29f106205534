"""What the connector's two halves tell each other, as plain records (vLLM pickles them between its processes).

The scheduler sends, with each engine step, an ordered list of store operations (copy a finished request's blocks and
its variant's attention sink, drop an entry) and the loads of the requests it scheduled; the worker runs them in
order, off the engine loop (vLLM holds a finished request's blocks until its copy is done, and a loading request
waits for its load), and reports back what it finished and what it could not do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SaveJob:
    """Copy a finished request's ``block_ids`` (whole blocks, in order) into the store as entry ``key`` (None: no
    entry), and the first ``sink_tokens`` positions of its first block as the sink ``sink_key`` (None: no sink); vLLM
    holds the blocks until the worker says the request's copy is done."""

    request_id: str
    key: str | None
    block_ids: tuple[int, ...]
    sink_key: tuple | None = None
    sink_tokens: int = 1


@dataclass(frozen=True)
class DropJob:
    """Forget the entry or sink ``key`` (evicted, superseded by a longer prefix, or of a variant whose files changed);
    None: everything (a reset)."""

    key: str | tuple | None


UNPLANNED = "unplanned"  # a LoadJob kind: the scheduler could not plan the load, which the worker reports failed


@dataclass(frozen=True)
class LoadJob:
    """Fill ``block_ids`` of request ``request_id`` with the positions ``start`` onwards of entry ``source_key``:
    as they are (``kind`` "reused": the variant's own; "naive": another variant's, the baseline) or mapped by the
    maps in ``map_folders``, in order (``kind`` "mapped"), the leading positions replaced by the target's own sink:
    ``("store", key)`` kept from its earlier request, or ``("map", folder, start)`` shipped in a map; or not at all
    (`UNPLANNED`: the worker reports the load failed, and vLLM recomputes the blocks).
    ``per_shard``: every map was fitted per shard for the engine's split of the KV heads, so each rank maps its own
    heads without gathering the others' (decided here, once, so that every rank takes the same path).
    ``map_prints``: each map's (source, target) weight fingerprints as the scheduler matched it: a folder saved again
    since holds a map of other weights, which the worker refuses to apply (the load fails; vLLM recomputes)."""

    request_id: str
    kind: str
    source_key: str
    start: int
    block_ids: tuple[int, ...]
    map_folders: tuple[str, ...] = ()
    sink_key: tuple | None = None
    per_shard: bool = False
    map_prints: tuple[tuple[str, str], ...] = ()


@dataclass
class WorkerReport:
    """What the worker tells the scheduler after a step: whether it can read and write this engine's cache (and
    why not), the store keys it failed to keep, and the requests whose load failed (vLLM recomputes them)."""

    ready: bool | None = None  # None: nothing new to say
    problem: str | None = None
    failed_keys: list = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)
    failed_maps: dict[str, str] = field(default_factory=dict)  # map folder -> why the worker could not load it

    def merged(self, other: "WorkerReport") -> "WorkerReport":
        """Two workers' reports as one (ready only if every worker that said something is; each rank reports the
        same failed load: once)."""
        said = [r for r in (self.ready, other.ready) if r is not None]
        return WorkerReport(all(said) if said else None, self.problem or other.problem,
                            list(dict.fromkeys(self.failed_keys + other.failed_keys)),
                            list(dict.fromkeys(self.failed_loads + other.failed_loads)),
                            {**self.failed_maps, **other.failed_maps})
