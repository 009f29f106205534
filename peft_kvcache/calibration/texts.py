"""The calibration data: texts (or token ids) cut into chunks, each text in one split (train or held out, whole
texts, the held-out ones capped by tokens), and the record of what was used."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ..errors import CacheMismatchError, CalibrationError
from ..lab.corpus import token_ids
from ..maps.config import CalibrationConfig, DataRecord, TextRecord
from ..modeling.layout import check_token_ids


def heldout_flags(count: int, heldout_fraction: float) -> list[bool]:
    """Which of ``count`` texts form the held-out split: every ``round(1 / fraction)``-th (at most every second),
    at least one."""
    if not 0 < heldout_fraction < 1:
        raise CalibrationError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if count < 2:
        raise CalibrationError(f"calibration needs at least 2 texts (train and held-out), got {count}")
    period = max(2, round(1 / heldout_fraction))
    flags = [i % period == period - 1 for i in range(count)]
    if not any(flags):
        flags[-1] = True
    return flags


def capped_heldout(chunks: list[list[torch.Tensor]], heldout: list[bool], fraction: float) -> list[list[torch.Tensor]]:
    """``chunks`` (per text) with the held-out texts cut, whole chunks from each text's start, round robin and at least
    one chunk each, to at most ``fraction / (1 - fraction)`` of the training tokens: whole texts of very different
    lengths, split by count, can otherwise hold out more tokens than they train on (and take most of a fit's time).
    Texts of one length (chunks of ``max_length``) keep every chunk."""
    train = sum(len(c) for pieces, held in zip(chunks, heldout) if not held for c in pieces)
    budget = fraction / (1 - fraction) * train
    held = [i for i, flag in enumerate(heldout) if flag]
    if sum(len(c) for i in held for c in chunks[i]) <= budget:
        return chunks
    kept, used, grew = dict.fromkeys(held, 1), sum(len(chunks[i][0]) for i in held), True
    while grew:
        grew = False
        for i in held:
            if kept[i] < len(chunks[i]) and used + len(chunks[i][kept[i]]) <= budget:
                used += len(chunks[i][kept[i]])
                kept[i] += 1
                grew = True
    return [pieces[: kept[i]] if i in kept else pieces for i, pieces in enumerate(chunks)]


@dataclass
class CalibrationTexts:
    """The calibration data cut into chunks; every chunk belongs to one named text and every text to one split."""

    names: list[str]
    chunks: list[list[torch.Tensor]]  # per text
    heldout: list[bool]  # per text

    @classmethod
    def build(cls, data: Mapping[str, str | torch.Tensor] | Iterable[str | torch.Tensor], tokenizer,
              config: CalibrationConfig, vocab_size: int | None = None) -> "CalibrationTexts":
        """Tokenize (texts need ``tokenizer``), cut into chunks of ``config.max_length`` (the first
        ``config.chunks_per_text`` if set; chunks shorter than the sink + 2 tokens are dropped) and split whole
        texts, the held-out ones capped by tokens (`capped_heldout`). A single text is split by chunks instead, each
        chunk named ``<name>#<i>``."""
        items = list(data.items()) if isinstance(data, Mapping) else [(f"text-{i}", x) for i, x in enumerate(data)]
        names, chunks = [], []
        for name, item in items:
            ids = _token_ids(item, tokenizer, vocab_size)
            pieces = [c for c in ids.split(config.max_length) if c.numel() >= config.sink_tokens + 2]
            pieces = pieces[: config.chunks_per_text] if config.chunks_per_text else pieces
            if pieces:
                names.append(str(name))
                chunks.append(pieces)
        if not names:
            raise CalibrationError(f"the calibration set is empty: no text has {config.sink_tokens + 2} tokens")
        if len(names) == 1 and len(chunks[0]) > 1:
            names = [f"{names[0]}#{i}" for i in range(len(chunks[0]))]
            chunks = [[c] for c in chunks[0]]
        flags = heldout_flags(len(names), config.heldout_fraction)
        return cls(names, capped_heldout(chunks, flags, config.heldout_fraction), flags)

    def split(self, split: str) -> list[torch.Tensor]:
        """The chunks of ``split`` (``"train"`` or ``"heldout"``), text by text."""
        return [c for pieces, held in zip(self.chunks, self.heldout) if held == (split == "heldout") for c in pieces]

    def record(self, description: str = "") -> DataRecord:
        """The `DataRecord` of these texts: each text's name, token count and split."""
        texts = [TextRecord(name, sum(len(c) for c in pieces), "heldout" if held else "train")
                 for name, pieces, held in zip(self.names, self.chunks, self.heldout)]
        return DataRecord(description=description, texts=texts)

    def all_chunks(self) -> list[torch.Tensor]:
        """Every chunk of every text, in order (both splits)."""
        return [c for pieces in self.chunks for c in pieces]


def _token_ids(item, tokenizer, vocab_size: int | None) -> torch.Tensor:
    if isinstance(item, str):
        if tokenizer is None:
            raise CalibrationError("calibration texts need a tokenizer: pass tokenizer=...")
        item = token_ids(tokenizer, item)
    if (item.numel() if isinstance(item, torch.Tensor) else len(item) if isinstance(item, (list, tuple)) else 1) == 0:
        return torch.empty(0, dtype=torch.long)  # too short to use: dropped with the other short texts
    try:
        return check_token_ids(item, vocab_size, "calibration token ids", dims=(1,))
    except CacheMismatchError as err:
        raise CalibrationError(str(err)) from None


__all__ = ["CalibrationTexts", "capped_heldout", "heldout_flags"]
