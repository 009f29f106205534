"""What every benchmark shares: the fixture models, the start of a run, one timer, one results writer and reader,
table formatting."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from peft_kvcache.calibration.bootstrap import bootstrap_interval
from peft_kvcache.lab.provenance import code_state, write_results
from peft_kvcache.maps.compute import ENVIRONMENT
from peft_kvcache.maps.storage import header_bytes, weights_header

RESULTS = Path(__file__).resolve().parent / "results"
SMALL, LARGE = "gguf:qwen2.5-coder-0.5b-instruct", "gguf:qwen2.5-coder-1.5b-instruct"
SMOLLM = "gguf:smollm2-135m-instruct"
ADAPTERS = ("docstring", "shout", "reverse")
ROOT = RESULTS.parents[1]


def start_run() -> dict:
    """Read the code this run starts with (commit, dirty; `code_state`): every results file the run writes records
    it, even if a commit lands while the run goes on. Call it first in a benchmark's ``main`` (and publish's)."""
    return code_state()


def timed(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, before: Callable[[], None] | None = None) -> dict:
    """Wall seconds of ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones (``before()`` runs untimed
    ahead of each, e.g. to clear a memo for a cold measurement). Returns median, min, max and every run; CUDA
    work is synchronized before the clock stops."""
    runs = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        started = time.perf_counter()
        fn()
        synchronize()
        if i >= warmup:
            runs.append(time.perf_counter() - started)
    return spread(runs)


def rounds(fns: dict[str, Callable[[], object]], repeats: int, before: dict[str, Callable[[], None]] | None = None,
           warmup: int = 1) -> dict[str, list[float]]:
    """Wall seconds of each of ``fns`` timed in rounds (each once per round, in order; ``warmup`` untimed rounds
    first), so a drift in the machine's speed moves them together and their ratios are read round by round (`ratio`);
    ``before[name]()`` runs untimed ahead of that one. Returns every timed run per name."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(warmup + repeats):
        for name, fn in fns.items():
            seconds = timed(fn, 1, warmup=0, before=(before or {}).get(name))["median"]
            if round_ >= warmup:
                runs[name].append(seconds)
    return runs


def ratio(numerators: list[float], denominators: list[float]) -> dict:
    """`spread` of the round-by-round ratios of two `rounds` timings."""
    return spread([n / d for n, d in zip(numerators, denominators, strict=True)])


def spread(values: list[float]) -> dict:
    """Median, min, max and every value (what `timed` returns)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


@contextmanager
def matmuls_in(dtype: str) -> Iterator[None]:
    """Maps multiply in ``dtype`` (``float32`` or ``bfloat16``) in this process while inside, whatever the CPU
    (`peft_kvcache.maps.compute`); the setting is restored after."""
    chosen = os.environ.get(ENVIRONMENT)
    os.environ[ENVIRONMENT] = dtype
    try:
        yield
    finally:
        if chosen is None:
            os.environ.pop(ENVIRONMENT)
        else:
            os.environ[ENVIRONMENT] = chosen


def synchronize() -> None:
    """Wait for queued CUDA work (no-op without CUDA): a clock read after it counts the work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def save(stem: str, payload: dict, markdown: str, **provenance) -> Path:
    """Write ``benchmarks/results/<stem>.json`` (``payload`` + provenance) and ``<stem>.md``; print the markdown."""
    path = write_results(RESULTS / f"{stem}.json", payload, markdown, **provenance)
    print(markdown, flush=True)
    return path


def read_results(stem: str) -> dict:
    """The results file ``benchmarks/results/<stem>.json`` (payload and provenance)."""
    return json.loads((RESULTS / f"{stem}.json").read_text())


def interval(point: float, low: float, high: float, digits: int = 2) -> str:
    return f"{point:.{digits + 1}f} [{low:.{digits}f}, {high:.{digits}f}]"


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# Student's t quantiles t(0.975, df) for df = 1..30 (above 30 the normal's 1.96 is within 4%)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_interval(values: list[float]) -> dict:
    """Mean of a few independent runs with its 95% t-interval (``low`` = ``high`` = the value for one run)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": mean, "low": mean, "high": mean, "runs": list(values)}
    half = (_T975[len(values) - 2] if len(values) <= 31 else 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return {"mean": mean, "low": mean - half, "high": mean + half, "runs": list(values)}


def bootstrap_mean(values: list[float], resamples: int = 2000, seed: int = 0) -> dict:
    """Mean of per-sample values (or of paired differences) with its 95% percentile-bootstrap interval."""
    data = torch.tensor(values, dtype=torch.float64)
    low, high = bootstrap_interval(data, resamples, seed)
    return {"mean": float(data.mean()), "low": low, "high": high, "samples": len(values)}


def map_fingerprint(folder: Path) -> str:
    """The first 16 hex digits of the sha256 of a map folder's weights (what a record was measured with)."""
    digest = hashlib.sha256()
    with open(folder / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def map_fingerprints(folder: Path) -> list[str]:
    """`map_fingerprint` of a map folder's weights, then of the same file with its header's metadata in each other
    order: the fingerprints the same weights were recorded under while safetensors wrote that metadata in an order
    seeded per process (`benchmarks.recipe_records.rekey`)."""
    path = folder / "model.safetensors"
    prints = [map_fingerprint(folder)]
    try:
        length, header = weights_header(path)
        metadata = header.pop("__metadata__", {})
    except (ValueError, AttributeError):  # not a safetensors header: the file's own fingerprint only
        return prints
    for order in itertools.permutations(metadata.items()) if metadata else ():
        reordered = header_bytes({"__metadata__": dict(order), **header}, length)
        digest = hashlib.sha256(length.to_bytes(8, "little") + reordered)
        with open(path, "rb") as f:
            f.seek(8 + length)
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest()[:16] not in prints:
            prints.append(digest.hexdigest()[:16])
    return prints

