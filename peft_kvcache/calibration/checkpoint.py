"""Resumable calibration: the streaming state of a calibration (its statistics), checkpointed atomically.

A checkpoint folder holds, per process (``rank``), ``statistics-rank<r>-s<split>-b<batches>.safetensors`` (the
run's float64 statistics, flat name -> tensor) and ``progress-rank<r>.json`` (which split, how many batches of
it are in the statistics, and a digest of the sequences, options and model dtypes). Each file is written to a
temporary name and moved into place with ``os.replace``; the JSON names the statistics file it belongs to and
is replaced last, so a crash at any point leaves either the previous checkpoint or the new one, never
statistics and progress that disagree (which would count batches twice or not at all). Temporary files of a
killed save are removed when the same rank loads or saves again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .._files import atomic_write
from ..errors import CalibrationError

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2


def run_digest(sequences: list[torch.Tensor], options: dict) -> str:
    """sha256 of the calibration sequences (their token ids, in order) and of the options that shape the
    statistics (include the models' fingerprints and dtypes); a checkpoint is resumed only by a run with the
    same digest."""
    digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode())
    for seq in sequences:
        ids = seq.to(torch.int64).contiguous().numpy()
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.tobytes())
    return digest.hexdigest()


@dataclass
class Progress:
    """Where a calibration stands: splits before ``split`` are complete, ``batches`` batches of it are in;
    ``seconds``: the wall time its runs spent collecting them (what a resumed run adds to its own)."""

    split: int = 0
    batches: int = 0
    complete: bool = False
    seconds: float = 0.0


class CalibrationCheckpoint:
    """The checkpoint of one process of one calibration run, in ``folder``.

    ``batch_counts[s]`` is the number of batches split ``s`` has for this process: a loaded progress outside
    those bounds is refused as damaged.

    Example:
        >>> ckpt = CalibrationCheckpoint("ckpt", digest="abc", batch_counts=[40, 10])  # doctest: +SKIP
        >>> progress = ckpt.load(state)  # Progress, or None for a fresh start         # doctest: +SKIP
        >>> ckpt.save(state, Progress(split=0, batches=10))                           # doctest: +SKIP
    """

    def __init__(self, folder: str | os.PathLike, digest: str, batch_counts: list[int], rank: int = 0):
        self.folder, self.digest, self.batch_counts, self.rank = Path(folder), digest, batch_counts, rank
        self.progress_path = self.folder / f"progress-rank{rank}.json"

    def load(self, state: dict[str, torch.Tensor]) -> Progress | None:
        """Fill ``state`` (name -> tensor) in place from the checkpoint and return its progress; ``None`` if
        there is none. Raises `CalibrationError` if it belongs to another run or is damaged."""
        self._remove_temporaries()
        if not self.progress_path.is_file():
            return None
        progress, statistics_name = self._read_progress()
        path = self.folder / Path(statistics_name).name
        try:
            saved = load_file(path)
        except (SafetensorError, OSError) as err:
            raise CalibrationError(f"calibration checkpoint statistics {path} are unreadable: {err}") from None
        for name, tensor in state.items():
            value = saved.get(name)
            if value is None or value.shape != tensor.shape or value.dtype != tensor.dtype:
                raise CalibrationError(f"calibration checkpoint {path} lacks or mis-shapes {name} (expected "
                                       f"{tuple(tensor.shape)} {tensor.dtype}); delete the folder to start over")
            tensor.copy_(value)  # in place: the statistics objects stay the ones the caller holds
        logger.info("resuming calibration from %s: split %d, %d batches done", self.folder, progress.split,
                    progress.batches)
        return progress

    def _read_progress(self) -> tuple[Progress, str]:
        try:
            record = json.loads(self.progress_path.read_text(encoding="utf-8"))
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            if record.get("format") != CHECKPOINT_FORMAT:
                raise ValueError(f"format {record.get('format')!r}, expected {CHECKPOINT_FORMAT}")
            split, batches, complete = record["split"], record["batches"], record["complete"]
            if type(split) is not int or type(batches) is not int or type(complete) is not bool:
                raise ValueError("split and batches must be integers, complete a boolean")
            if not 0 <= split <= len(self.batch_counts) or complete != (split == len(self.batch_counts)):
                raise ValueError(f"split {split} is outside 0..{len(self.batch_counts)}")
            limit = self.batch_counts[split] if split < len(self.batch_counts) else 0
            if not 0 <= batches <= limit:
                raise ValueError(f"{batches} batches done of a split of {limit}")
            statistics_name = str(record["statistics"])
            seconds = record.get("seconds", 0.0)  # absent from checkpoints written before it was kept
            if type(seconds) not in (int, float) or not 0 <= seconds < float("inf"):
                raise ValueError(f"seconds must be a non-negative number, got {seconds!r}")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise CalibrationError(f"calibration checkpoint {self.progress_path} is damaged ({err}); delete the "
                                   "folder to start over") from None
        if record.get("digest") != self.digest:
            raise CalibrationError(
                f"calibration checkpoint {self.progress_path} was written by a run over other sequences, options "
                f"or models (digest {str(record.get('digest'))[:12]}, this run {self.digest[:12]}): resume it with "
                "the same data, options, models, dtypes and process count, or pass an empty checkpoint_dir"
            )
        return Progress(split, batches, complete, float(seconds)), statistics_name

    def save(self, state: dict[str, torch.Tensor], progress: Progress) -> None:
        """Write the statistics and then the progress naming them, each atomically."""
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"statistics-rank{self.rank}-s{progress.split}-b{progress.batches}.safetensors"
        contiguous = {key: t.contiguous() for key, t in state.items()}
        atomic_write(self.folder / name, lambda tmp: save_file(contiguous, tmp))
        record = {"format": CHECKPOINT_FORMAT, "digest": self.digest, "split": progress.split,
                  "batches": progress.batches, "complete": progress.complete, "seconds": round(progress.seconds, 3),
                  "statistics": name}
        text = json.dumps(record, indent=2) + "\n"
        atomic_write(self.progress_path, lambda tmp: Path(tmp).write_text(text))
        for old in self.folder.glob(f"statistics-rank{self.rank}-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)

    def _remove_temporaries(self) -> None:
        """Temporary files a killed save of this rank left behind (no other process writes this rank's)."""
        if self.folder.is_dir():
            for prefix in (f".statistics-rank{self.rank}-", f".progress-rank{self.rank}.json."):
                for leftover in self.folder.glob(f"{prefix}*"):
                    leftover.unlink(missing_ok=True)
