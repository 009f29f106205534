"""Which variants' files changed since their KV was computed (the scheduler half's staleness side).

An adapter replaced at the same path keeps its name and path: only its files tell. Each variant's KV (stored, or in
vLLM's prefix cache) is tied to the sampled fingerprint of the files it was computed with (`FileWatch`); a variant
whose fingerprint moved has all of its KV dropped (`StaleKV`): the store's entries, vLLM's cached blocks under the
hashes tracked here, and what its running requests computed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from ..modeling.identity import fingerprint_files
from .evictions import PrefixCacheEvictions
from .pairs import Variant, local_model_folder, lora_id_of, variant_of
from .store import StoreIndex

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


class StaleKV:
    """What the scheduler half does about stale KV: it tells a request whose LoRA id runs weights of no files on disk;
    once a variant's files change it drops all of its KV (the store's entries, vLLM's cached blocks of its finished
    requests, what its running requests computed on the old weights); and at each admission question it takes out of
    vLLM's prefix cache what the variant's running requests on approximate KV computed so far.

    Args:
        files: the variants' fingerprints and tracked block hashes.
        index: the store's index (entries are dropped from it).
        evictions: vLLM's prefix cache (blocks are taken out of it).
        running_of: a variant's running requests, each with its `RequestRecord`.
        drop: hands the dropped entries' keys to the worker (it frees their tensors).
    """

    def __init__(self, files: FileWatch, index: StoreIndex, evictions: PrefixCacheEvictions,
                 running_of: Callable[[Variant], list], drop: Callable[[list], None]):
        self.files, self.index, self.evictions = files, index, evictions
        self.running_of, self.drop = running_of, drop

    def other_weights(self, request) -> bool:
        """Whether vLLM runs the request under a LoRA id first seen on files its adapter no longer has (the files
        changed at the same path before a reload under a new id)."""
        return self.files.of_request(variant_of(request), lora_id_of(request)) == OTHER_WEIGHTS

    def changed(self, variant: Variant) -> bool:
        """Whether ``variant``'s files changed since its KV was computed (an adapter replaced at the same path): then
        its entries are dropped, here and in vLLM's prefix cache (its finished and running requests' blocks)."""
        hashes = self.files.changed(variant)
        if hashes is None:
            return False
        self.drop(self.index.drop_variant(variant))
        self.evictions.hashes(hashes)
        for request, _ in self.running_of(variant):  # still running on the old weights: their blocks so far
            self.evictions.request(request, 0)
        return True

    def evict_running(self, variant: Variant) -> set:
        """Take out of vLLM's prefix cache what ``variant``'s running requests on approximate KV computed so far (a
        request that computed their mapped prefix exactly would chain into it as exact), and all that those running on
        files since replaced computed; the hashes some block was cached under. Every hash from the first approximate
        (or old) block on is looked up each time: vLLM caches a running request's blocks as it goes, with speculative
        tokens or a resumed streaming session ahead of what its counters say."""
        now = self.files.fingerprint(variant)
        block_size = self.evictions.block_size
        return set().union(*(self.evictions.request(request, 0 if record.fingerprint != now else
                                                    record.local_tokens // block_size)
                             for request, record in self.running_of(variant)
                             if record.made.approximate or record.fingerprint != now))


def _model_folder(model: str) -> Path | None:
    """The folder the engine's model was loaded from, or None (its files cannot be fingerprinted: said once)."""
    try:
        return local_model_folder(model)
    except (OSError, ValueError) as err:
        logger.warning("peft-kvcache: cannot find the files of %s (%s): a variant whose files change will not be "
                       "noticed", model, err)
        return None


__all__ = ["OTHER_WEIGHTS", "TRACKED_HASHES", "FileWatch", "StaleKV"]
