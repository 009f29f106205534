"""Which variants' files changed since their KV was computed (the scheduler half's staleness side).

An adapter replaced at the same path keeps its name and path: only its files tell. Each variant's KV (stored, or in
vLLM's prefix cache) is tied to the sampled fingerprint of the files it was computed with; a variant whose fingerprint
moved has its KV dropped (`SchedulerSide` drops it: the store's entries, and vLLM's blocks under the hashes tracked
here).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

from ..modeling.identity import fingerprint_files
from .pairs import Variant, local_model_folder

logger = logging.getLogger(__name__)
OTHER_WEIGHTS = "other-weights"  # a request's fingerprint where its LoRA id runs weights of no files on disk
TRACKED_HASHES = 1 << 16  # per variant at least: block hashes of its finished requests (evicted if its files change)


class FileWatch:
    """Fingerprints of the variants' files, and the vLLM block hashes of each variant's finished requests.

    Args:
        model: the engine's model (a folder, or a Hub id in the local cache).
    """

    def __init__(self, model: str):
        self.model_dir = _model_folder(model)
        self.prints: dict[Variant, str] = {}  # the fingerprint each variant's KV was made with
        self.tracked: dict[Variant, OrderedDict] = {}  # vLLM block hashes of each variant's finished requests
        self.loaded: dict[tuple[Variant, int], str] = {}  # an adapter's files when its LoRA id was first seen

    def fingerprint(self, variant: Variant) -> str | None:
        """The sampled fingerprint of the files ``variant`` loads now (memoized by their identity: a few ``stat``
        calls), None where they cannot be read."""
        if self.model_dir is None:
            return None
        try:
            return fingerprint_files(self.model_dir, variant.path if variant.adapter else None)
        except Exception:  # noqa: BLE001 - a file being rewritten reads as anything; never stop the engine for it
            return None

    def seen(self, variant: Variant, lora_id: int | None) -> None:
        """Note the files an adapter's LoRA id runs on: vLLM reads them for the id's first request and keeps those
        weights under the id, whatever its files become (a request of it after they change runs the old ones)."""
        if variant.adapter is not None and lora_id is not None and (variant, lora_id) not in self.loaded:
            now = self.fingerprint(variant)
            if now is not None:
                self.loaded[variant, lora_id] = now

    def of_request(self, variant: Variant, lora_id: int | None) -> str | None:
        """The fingerprint of the files a request's KV is of: its variant's files now (None where they cannot be
        read), unless its LoRA id was first seen on other files: vLLM may run the weights it loaded then, or those it
        reads again after evicting them, so its KV is of no known files (`OTHER_WEIGHTS`: kept nowhere, served
        nothing stored)."""
        now = self.fingerprint(variant)
        first = self.loaded.get((variant, lora_id)) if variant.adapter is not None else None
        return now if first is None or first == now else OTHER_WEIGHTS

    def made_with(self, variant: Variant, fingerprint: str | None) -> None:
        """``variant``'s KV is of the files with ``fingerprint`` (the first one said holds until they change)."""
        if fingerprint not in (None, OTHER_WEIGHTS):
            self.prints.setdefault(variant, fingerprint)

    def changed(self, variant: Variant) -> tuple | None:
        """None if ``variant``'s files are those its KV was made with (or nothing of it is known); else they changed
        (an adapter replaced at the same path): the variant is forgotten, and the block hashes of its finished
        requests are returned, for their blocks to be evicted."""
        if variant not in self.prints:
            return None
        now = self.fingerprint(variant)
        if now is not None and now == self.prints[variant]:
            return None
        logger.warning("peft-kvcache: %s's files changed (%s): its stored KV and vLLM's cached blocks of it are "
                       "dropped", variant.label, variant.path or "the base model")
        del self.prints[variant]
        return tuple(self.tracked.pop(variant, {}))

    def track(self, variant: Variant, block_hashes, pool_blocks: int = 0) -> None:
        """Remember the block hashes of a finished request of ``variant``: the most recent `TRACKED_HASHES`, or
        ``pool_blocks`` (vLLM's block pool) where more: every block the variant can have cached at once."""
        tracked = self.tracked.setdefault(variant, OrderedDict())
        for block_hash in block_hashes:
            tracked[block_hash] = None
            tracked.move_to_end(block_hash)
        while len(tracked) > max(TRACKED_HASHES, pool_blocks):
            tracked.popitem(last=False)


def _model_folder(model: str) -> Path | None:
    """The folder the engine's model was loaded from, or None (its files cannot be fingerprinted: said once)."""
    try:
        return local_model_folder(model)
    except (OSError, ValueError) as err:
        logger.warning("peft-kvcache: cannot find the files of %s (%s): a variant whose files change will not be "
                       "noticed", model, err)
        return None


__all__ = ["OTHER_WEIGHTS", "TRACKED_HASHES", "FileWatch"]
