"""The server's store of token-prefix caches, shared by every conversation: per model (the base or an adapter),
entries of KV with the record of how each was made (`peft_kvcache.runtime.reuse.Made`), bounded in bytes with
least-recently-used eviction. An entry is keyed by its adapter and is never served to another one; entries are read
through fresh caches built from slices of their tensors (generate() extends a cache by rebinding each layer to a new
tensor, so an entry is never written)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..modeling.capture import CapturedKV
from ..runtime.reuse import EXACT, Made
from .errors import ServerError

logger = logging.getLogger(__name__)


@dataclass
class Entry:
    """One stored cache: ``adapter``'s KV (``None``: the base model) of the tokens ``ids``, made as ``made`` says."""

    adapter: str | None
    ids: torch.Tensor  # [n] token ids
    kv: CapturedKV  # per layer [1, kv_heads, n, head_dim]
    nbytes: int
    made: Made = EXACT


class PrefixStore:
    """Caches of token prefixes per adapter (or the base model), bounded to ``max_bytes`` with LRU eviction; thread-safe.

    Example:
        >>> store = PrefixStore(max_bytes=2**20)
        >>> kv = CapturedKV([torch.zeros(1, 1, 3, 2)], [torch.zeros(1, 1, 3, 2)])
        >>> store.add("shout", torch.tensor([5, 6, 7]), kv, Made("mapped", None, 3))
        True
        >>> entry, k = store.longest("shout", torch.tensor([5, 6, 9, 9]), limit=3); k, entry.made.how
        (2, 'mapped')
        >>> store.longest("shout", torch.tensor([5, 6, 9, 9]), limit=3, exact=True)[1]   # only exact entries
        0
        >>> store.longest(None, torch.tensor([5, 6, 9, 9]), limit=3)[1]   # never served to another adapter
        0
    """

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ServerError(f"the prefix store needs a positive memory bound in bytes, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.evictions = 0
        self._entries: OrderedDict[tuple, Entry] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.RLock()

    @property
    def nbytes(self) -> int:
        """Bytes the stored caches hold."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, adapter: str | None, ids: torch.Tensor, limit: int, exact: bool = False
                ) -> tuple[Entry | None, int]:
        """The entry of ``adapter`` sharing the longest prefix with ``ids`` ``[n]`` and that prefix's length
        (at most ``limit``); ``exact``: among the exact entries only. At equal length an exact entry is preferred.
        ``(None, 0)`` when none shares a token."""
        best, best_length = None, 0
        with self._lock:
            for entry in self._entries.values():
                if entry.adapter != adapter or (exact and not entry.made.exact):
                    continue
                m = min(entry.ids.shape[0], ids.shape[0], limit)
                differ = (entry.ids[:m] != ids[:m]).nonzero()
                length = int(differ[0, 0]) if differ.numel() else m
                if length > best_length or (length == best_length > 0 and entry.made.exact and not best.made.exact):
                    best, best_length = entry, length
        return best, best_length

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` as just used (it is evicted last)."""
        with self._lock:
            key = _key(entry.adapter, entry.ids, entry.made)
            if key in self._entries:
                self._entries.move_to_end(key)

    def add(self, adapter: str | None, ids: torch.Tensor, kv: CapturedKV, made: Made = EXACT) -> bool:
        """Store ``adapter``'s cache ``kv`` of ``ids`` ``[n]`` (``kv`` covers exactly those tokens), made as ``made``
        says, replacing the entries of that adapter it extends (an exact entry is replaced only by an exact one),
        then evict the least recently used entries beyond the bound. Returns False when the entry alone exceeds
        the bound (it is not stored)."""
        if kv.length != ids.shape[0]:
            raise ServerError(f"a prefix entry of {ids.shape[0]} tokens came with a cache of {kv.length}")
        kv = CapturedKV([_owned(k) for k in kv.keys], [_owned(v) for v in kv.values])
        nbytes = sum(t.nbytes for t in kv.keys + kv.values)
        if nbytes > self.max_bytes:
            logger.warning("a %d-token cache (%.1f MiB) exceeds the prefix store's bound (%.1f MiB): not stored",
                           ids.shape[0], nbytes / 2**20, self.max_bytes / 2**20)
            return False
        ids = ids.detach().cpu().clone()
        with self._lock:
            # already held, as an entry or a prefix of one, as well made (a derived cache adds nothing to any)
            longer, length = self.longest(adapter, ids, ids.shape[0], exact=made.exact)
            if longer is not None and length == ids.shape[0]:
                self.touch(longer)
                return True
            for key, entry in list(self._entries.items()):
                if entry.adapter != adapter or entry.ids.shape[0] > ids.shape[0] or (entry.made.exact and not made.exact):
                    continue
                if torch.equal(entry.ids, ids[: entry.ids.shape[0]]):  # a prefix of the new entry: redundant
                    self._remove(key)
            self._entries[_key(adapter, ids, made)] = Entry(adapter, ids, kv, nbytes, made)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self.evictions += 1
        return True

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def entries(self) -> list[Entry]:
        """The entries, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._entries.values())

    def _remove(self, key: tuple) -> None:
        self._bytes -= self._entries.pop(key).nbytes


def _key(adapter: str | None, ids: torch.Tensor, made: Made) -> tuple:
    return adapter, made.exact, ids.shape[0], ids.numpy().tobytes()


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself if it owns its whole storage, else a compact copy (a view would pin, and hide from
    the memory bound, the larger tensor it is cut from)."""
    tensor = tensor.detach()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.contiguous().clone()


__all__ = ["Entry", "PrefixStore"]
