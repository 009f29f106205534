"""Resumable calibration: the streaming statistics of a calibration, checkpointed atomically.

A checkpoint folder holds, per process (``rank``), ``statistics-rank<r>.safetensors`` (every
`SufficientStatistics` of the run, float64) and ``progress-rank<r>.json`` (which split, how many batches
of it are in the statistics, and a digest of the sequences and options). Each file is written to a
temporary name and moved into place with ``os.replace``; the JSON names the statistics file it belongs to
and is replaced last, so a crash at any point leaves either the previous checkpoint or the new one, never
statistics and progress that disagree (which would count batches twice or not at all).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import CalibrationError
from .fit import SufficientStatistics

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
Statistics = dict[str, dict[str, SufficientStatistics]]


def run_digest(sequences: list[torch.Tensor], options: dict) -> str:
    """sha256 of the calibration sequences (their token ids, in order) and of the options that shape the
    statistics; a checkpoint is resumed only by a run with the same digest."""
    digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode())
    for seq in sequences:
        ids = seq.to(torch.int64).contiguous().numpy()
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.tobytes())
    return digest.hexdigest()


@dataclass
class Progress:
    """Where a calibration stands: splits before ``split`` are complete, ``batches`` batches of it are in."""

    split: int = 0
    batches: int = 0
    complete: bool = False


class CalibrationCheckpoint:
    """The checkpoint of one process of one calibration run, in ``folder``.

    Example:
        >>> ckpt = CalibrationCheckpoint("ckpt", digest="abc", rank=0)          # doctest: +SKIP
        >>> loaded = ckpt.load(stats)  # Progress, or None for a fresh start  # doctest: +SKIP
        >>> ckpt.save(stats, Progress(split=0, batches=10))                    # doctest: +SKIP
    """

    def __init__(self, folder: str | os.PathLike, digest: str, rank: int = 0):
        self.folder, self.digest, self.rank = Path(folder), digest, rank
        self.progress_path = self.folder / f"progress-rank{rank}.json"

    def load(self, stats: Statistics) -> Progress | None:
        """Fill ``stats`` in place from the checkpoint and return its progress; ``None`` if there is none.

        Raises `CalibrationError` if the checkpoint belongs to other sequences or options, or is damaged.
        """
        if not self.progress_path.is_file():
            return None
        try:
            record = json.loads(self.progress_path.read_text(encoding="utf-8"))
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            if record.get("format") != CHECKPOINT_FORMAT:
                raise ValueError(f"format {record.get('format')!r}, expected {CHECKPOINT_FORMAT}")
            progress = Progress(int(record["split"]), int(record["batches"]), bool(record["complete"]))
            statistics_name = str(record["statistics"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise CalibrationError(f"calibration checkpoint {self.progress_path} is damaged ({err}); delete the "
                                   "folder to start over") from None
        if record.get("digest") != self.digest:
            raise CalibrationError(
                f"calibration checkpoint {self.progress_path} was written by a run over other sequences or options "
                f"(digest {str(record.get('digest'))[:12]}, this run {self.digest[:12]}): resume it with the same "
                "data, max_length, batch_size, heldout_fraction, sink_tokens, models and process count, or pass "
                "an empty checkpoint_dir"
            )
        path = self.folder / Path(statistics_name).name
        try:
            state = load_file(path)
        except (SafetensorError, OSError) as err:
            raise CalibrationError(f"calibration checkpoint statistics {path} are unreadable: {err}") from None
        for split, kinds in stats.items():
            for kind, entry in kinds.items():
                prefix = f"{split}.{kind}."
                expected = entry.state_dict()
                for name, tensor in expected.items():
                    saved = state.get(prefix + name)
                    if saved is None or saved.shape != tensor.shape or saved.dtype != tensor.dtype:
                        raise CalibrationError(
                            f"calibration checkpoint {path} lacks or mis-shapes {prefix + name} (expected "
                            f"{tuple(tensor.shape)} {tensor.dtype}); delete the folder to start over"
                        )
                    tensor.copy_(saved)  # in place: the statistics objects stay the ones the caller holds
        logger.info("resuming calibration from %s: split %d, %d batches done", self.folder, progress.split,
                    progress.batches)
        return progress

    def save(self, stats: Statistics, progress: Progress) -> None:
        """Write the statistics and then the progress naming them, each atomically."""
        self.folder.mkdir(parents=True, exist_ok=True)
        state = {f"{split}.{kind}.{name}": t.contiguous()
                 for split, kinds in stats.items() for kind, entry in kinds.items()
                 for name, t in entry.state_dict().items()}
        name = f"statistics-rank{self.rank}-s{progress.split}-b{progress.batches}.safetensors"
        _atomic_write(self.folder / name, lambda tmp: save_file(state, tmp))
        record = {"format": CHECKPOINT_FORMAT, "digest": self.digest, "split": progress.split,
                  "batches": progress.batches, "complete": progress.complete, "statistics": name}
        text = json.dumps(record, indent=2) + "\n"
        _atomic_write(self.progress_path, lambda tmp: Path(tmp).write_text(text))
        for old in self.folder.glob(f"statistics-rank{self.rank}-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)


def _atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then ``os.replace`` onto ``path`` (after an fsync), removing the temp on failure."""
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
