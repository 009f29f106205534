"""A deterministic text corpus that nobody here wrote: the Python standard library's own source files.

Files are split by a hash of their path, so the calibration and evaluation sets never share a file, and
ordered by that hash, so ``calibration_texts(n)`` is the same n files on every machine with the same
Python version (the version is part of `corpus_description`).
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from functools import lru_cache
from pathlib import Path

# One file in EVALUATION_SHARE goes to evaluation, by hash of its relative path.
EVALUATION_SHARE = 4
MIN_BYTES = 4000  # skip tiny files: contexts of 1-2k tokens need long files
_SKIPPED_PARTS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__", "ensurepip", "turtledemo",
                  "encodings"}  # encodings: codec tables, not prose or code


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _key(relative: str) -> str:
    return hashlib.sha256(relative.encode()).hexdigest()


@lru_cache(maxsize=None)
def stdlib_files(split: str) -> tuple[Path, ...]:
    """Stdlib ``.py`` files of one split (``"calibration"`` or ``"evaluation"``), in a fixed hashed order."""
    if split not in ("calibration", "evaluation"):
        raise ValueError(f"split must be 'calibration' or 'evaluation', got {split!r}")
    root = stdlib_root()
    chosen = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root).as_posix()
        if _SKIPPED_PARTS & set(relative.split("/")) or path.stat().st_size < MIN_BYTES:
            continue
        is_eval = int(_key(relative), 16) % EVALUATION_SHARE == 0
        if is_eval == (split == "evaluation"):
            chosen.append((_key(relative), path))
    return tuple(path for _, path in sorted(chosen))


def _texts(split: str, num_files: int) -> list[str]:
    files = stdlib_files(split)
    if num_files > len(files):
        raise ValueError(f"the {split} split has {len(files)} files, {num_files} were asked for")
    return [path.read_text(encoding="utf-8", errors="replace") for path in files[:num_files]]


def calibration_texts(num_files: int = 32) -> list[str]:
    """The first ``num_files`` calibration files' text.

    Example:
        >>> len(calibration_texts(2))
        2
    """
    return _texts("calibration", num_files)


def evaluation_texts(num_files: int = 20) -> list[str]:
    """The first ``num_files`` evaluation files' text (disjoint from every calibration file)."""
    return _texts("evaluation", num_files)


def corpus_description(split: str = "calibration", num_files: int | None = None) -> str:
    """One line saying what the corpus is, for map configs and cards."""
    files = stdlib_files(split)
    count = len(files) if num_files is None else num_files
    return (f"Python {platform.python_version()} standard library source, {split} split: {count} of "
            f"{len(files)} files (>= {MIN_BYTES} bytes, tests excluded), ordered by sha256 of the path; "
            f"1 file in {EVALUATION_SHARE} is held out for evaluation")
