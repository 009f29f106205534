"""What the connector's two halves tell each other, as plain records (vLLM pickles them between its processes).

The scheduler sends, with each engine step, an ordered list of store operations (keep a finished request's blocks,
keep a variant's attention sink, drop an entry) and the loads of the requests it scheduled; the worker runs the
operations before the step's forward pass (the blocks of a finished request may be handed to a new one in that very
step) and the loads before the layers read them, and reports back what it could not do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SaveJob:
    """Copy ``block_ids`` (whole blocks, in order) into the store as entry ``key``."""

    key: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SinkJob:
    """Copy the first ``tokens`` positions of block ``block_id`` into the store as the sink ``key``."""

    key: tuple
    block_id: int
    tokens: int


@dataclass(frozen=True)
class DropJob:
    """Forget the entry or sink ``key`` (evicted, or superseded by a longer prefix)."""

    key: str | tuple


@dataclass(frozen=True)
class LoadJob:
    """Fill ``block_ids`` of request ``request_id`` with the positions ``start`` onwards of entry ``source_key``:
    as they are (``kind`` "reused": the variant's own; "naive": another variant's, the baseline) or mapped
    by the maps in ``map_folders``, in order (``kind`` "mapped"), the leading positions replaced by the sink
    ``sink_key``."""

    request_id: str
    kind: str
    source_key: str
    start: int
    block_ids: tuple[int, ...]
    map_folders: tuple[str, ...] = ()
    sink_key: tuple | None = None


@dataclass
class WorkerReport:
    """What the worker tells the scheduler after a step: whether it can read and write this engine's cache (and
    why not), the store keys it failed to keep, and the requests whose load failed (vLLM recomputes them)."""

    ready: bool | None = None  # None: nothing new to say
    problem: str | None = None
    failed_keys: list = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)

    def merged(self, other: "WorkerReport") -> "WorkerReport":
        """Two workers' reports as one (ready only if every worker that said something is)."""
        said = [r for r in (self.ready, other.ready) if r is not None]
        return WorkerReport(all(said) if said else None, self.problem or other.problem,
                            self.failed_keys + other.failed_keys, self.failed_loads + other.failed_loads)
