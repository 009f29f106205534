"""The sibling recipes benchmark's records on disk: one JSON line per (example, direction, variant, map, dtype) in
``benchmarks/results/sibling-recipes/<role>-<context>.jsonl``, appended as each is computed, with ``runs.jsonl``
beside them saying what each run was (`benchmarks.recipes` writes both, `benchmarks.recipe_report` reads them).

A record names its map by the fingerprint of the map's weights file. Until `peft_kvcache.maps.storage.save_weights`
sorted it, safetensors wrote the file's header metadata in an order seeded per process, so one map's weights,
fitted again on the same kind of machine and data (the same values, bit for bit), were recorded under either of two
fingerprints; `rekey` gives such records the fingerprint of the file as it is written now.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from peft_kvcache._files import atomic_write
from peft_kvcache.lab.provenance import provenance
from peft_kvcache.maps.storage import WEIGHTS_NAME, sort_weights_metadata

from .common import RESULTS, map_fingerprints

RECORDS = RESULTS / "sibling-recipes"


def records_path(role: str, context: int) -> Path:
    return RECORDS / f"{role}-{context}.jsonl"


def read_records(path: Path) -> list[dict]:
    """Every complete record of ``path`` (a line cut short by a stop mid-write is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def record_key(example_id: str, direction: str, variant: str, fingerprint: str | None, dtype: str) -> tuple:
    """What makes a record done: a run with the models in another dtype measures it again."""
    return example_id, direction, variant, fingerprint, dtype


def drop_partial_line(path: Path) -> None:
    """Cut a last line that a stop left without its newline, so the next append starts a line of its own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def append(path: Path, record: dict) -> None:
    """One JSON line, flushed and synced: a stop loses at most the line being written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def rekey(folders: list[Path], records: Path = RECORDS) -> dict[str, str]:
    """Give every record (and run line) that names one of ``folders``' maps by another fingerprint of the same weights
    (`map_fingerprints`: the header's metadata in another order) the fingerprint of its file as written now (a file an
    older writer left unsorted is written again first, the same tensors). Each records file is replaced atomically,
    and ``runs.jsonl`` says what was renamed; returns ``{old: new}`` (empty where nothing was to rename)."""
    renames = {}
    for folder in folders:
        sort_weights_metadata(folder / WEIGHTS_NAME)
        own, *others = map_fingerprints(folder)
        renames.update(dict.fromkeys(others, own))
    found = {}
    for path in sorted(records.glob("*.jsonl")):
        lines = path.read_text().splitlines(keepends=True)
        new = [_renamed(line, renames, found) for line in lines]
        if new != lines:
            atomic_write(path, lambda tmp, text="".join(new): Path(tmp).write_text(text))
    if found:
        append(records / "runs.jsonl", {"rekeyed": found, **provenance(),
                                        "why": "the same weights, recorded under another order of their file's "
                                               "header metadata (benchmarks.recipe_records.rekey)"})
    return found


def _renamed(line: str, renames: dict[str, str], found: dict[str, str]) -> str:
    """``line`` with every value that is an old fingerprint in ``renames`` replaced (a line that is not JSON, a stop's
    torn last line, is left as it is); what was replaced goes into ``found``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return line

    def walk(value):
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, str) and value in renames:
            found[value] = renames[value]
            return renames[value]
        return value

    renamed = walk(record)
    return line if renamed == record else json.dumps(renamed) + "\n"
