"""The connector's store of finished requests' KV, in two halves that vLLM runs in different processes.

`StoreIndex` (the scheduler's): which token prefixes are stored, for which model variant (any hashable name: the
connector uses `pairs.Variant`, the base model or a LoRA adapter and its folder) and cache salt, keyed by the chained hashes of their whole blocks, bounded in bytes with the least
recently used entries evicted first; it also knows each variant's own attention sink (the KV of a conversation's
first tokens, which a mapped prefix takes from the target itself). `KVStore` (the worker's): the tensors. Only the
scheduler decides what enters and leaves; the worker does what the connector metadata says, in order, so the two
agree.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from ..runtime.reuse import EXACT, Made


def block_chain(tokens: Sequence[int], block_size: int, blocks: int, salt: str | None) -> list[str]:
    """Chained hashes of the first ``blocks`` whole blocks of ``tokens``: element ``j`` names the prefix of ``j + 1``
    blocks (and the salt, so that salted requests share only with each other)."""
    chain, previous = [], hashlib.sha256(repr(salt).encode()).digest()
    for j in range(blocks):
        block = tokens[j * block_size: (j + 1) * block_size]
        previous = hashlib.sha256(previous + torch.tensor(list(block), dtype=torch.int64).numpy().tobytes()).digest()
        chain.append(previous.hex())
    return chain


@dataclass
class IndexEntry:
    """A stored prefix: ``variant``'s KV of ``blocks`` whole blocks of tokens, made as ``made`` says (exact: computed
    by the variant itself on the exact context; else derived from another variant's mapped prefix)."""

    key: str  # names the variant, the whole prefix (salt included) and whether it is exact
    variant: Hashable
    salt: str | None
    chain: list[str]
    nbytes: int
    made: Made = EXACT

    @property
    def blocks(self) -> int:
        return len(self.chain)


@dataclass
class Match:
    """A stored prefix that a request shares: the entry and how many whole blocks."""

    entry: IndexEntry
    blocks: int


class StoreIndex:
    """What the worker's store holds (see the module). ``bytes_per_token``: all layers' keys and values of one token.

    Example:
        >>> index = StoreIndex(max_bytes=10**6, block_size=2, bytes_per_token=8)
        >>> entry, evicted = index.add(None, None, [1, 2, 3, 4])
        >>> index.matches(None, [1, 2, 3, 9, 9], limit_blocks=2)[None, True].blocks
        1
    """

    def __init__(self, max_bytes: int, block_size: int, bytes_per_token: int):
        self.max_bytes, self.block_size, self.bytes_per_token = max_bytes, block_size, bytes_per_token
        self.evictions = 0
        self._entries: OrderedDict[str, IndexEntry] = OrderedDict()  # least recently used first
        self._holders: dict[str, set[str]] = {}  # prefix hash -> keys of the entries that contain that prefix
        self._sinks: OrderedDict[tuple, int] = OrderedDict()  # (variant, first tokens) -> bytes
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes the worker's store holds (entries and sinks)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def matches(self, salt: str | None, tokens: Sequence[int], limit_blocks: int) -> dict[tuple[Hashable, bool], Match]:
        """Per variant and exactness (``(variant, made.exact)``), its stored entry sharing the most whole blocks with
        ``tokens`` (at most ``limit_blocks``)."""
        found: dict[tuple[Hashable, bool], Match] = {}
        for depth, prefix in enumerate(block_chain(tokens, self.block_size, limit_blocks, salt), start=1):
            holders = self._holders.get(prefix)
            if not holders:
                break
            for key in holders:
                entry = self._entries[key]
                found[entry.variant, entry.made.exact] = Match(entry, depth)
        return found

    def touch(self, entry: IndexEntry) -> None:
        """Mark ``entry`` as just used (it is evicted last)."""
        if entry.key in self._entries:
            self._entries.move_to_end(entry.key)

    def add(self, variant: Hashable, salt: str | None, tokens: Sequence[int], made: Made = EXACT
            ) -> tuple[IndexEntry | None, list]:
        """Record ``variant``'s KV of ``tokens`` (whole blocks), made as ``made`` says, as stored: returns the new entry
        (None when an entry as exact holds that prefix already, or when it alone exceeds the bound) and the keys of
        what it evicts or supersedes (the same variant's shorter prefixes of it, made no better), which the worker
        must drop. A derived entry never replaces an exact one."""
        blocks = len(tokens) // self.block_size
        chain = block_chain(tokens, self.block_size, blocks, salt)
        nbytes = blocks * self.block_size * self.bytes_per_token
        if not chain or nbytes > self.max_bytes:
            return None, []
        held = self.matches(salt, tokens, blocks)
        for exact in {True, made.exact}:  # an exact entry serves a derived one's place too
            match = held.get((variant, exact))
            if match is not None and match.blocks == blocks:
                self.touch(match.entry)
                return None, []
        dropped = [key for key, e in self._entries.items()
                   if e.variant == variant and e.salt == salt and e.blocks < blocks and e.chain[-1] == chain[e.blocks - 1]
                   and (made.exact or not e.made.exact)]
        for key in dropped:
            self._remove(key)
        key = hashlib.sha256(repr((variant, made.exact, chain[-1])).encode()).hexdigest()
        entry = IndexEntry(key, variant, salt, chain, nbytes, made)
        self._entries[entry.key] = entry
        for prefix in chain:
            self._holders.setdefault(prefix, set()).add(entry.key)
        self._bytes += nbytes
        return entry, dropped + self._evict(keep=entry.key)

    def drop_variant(self, variant: Hashable) -> list:
        """Forget every entry and sink of ``variant`` (its files changed); returns their keys for the worker."""
        keys = [key for key, e in self._entries.items() if e.variant == variant]
        for key in keys:
            self._remove(key)
        sinks = [key for key in self._sinks if key[0] == variant]
        for key in sinks:
            self._bytes -= self._sinks.pop(key)
        return keys + sinks

    def clear(self) -> None:
        """Forget everything (a reset)."""
        self._entries.clear()
        self._holders.clear()
        self._sinks.clear()
        self._bytes = 0

    def remove(self, key: str | tuple) -> None:
        """Forget an entry or a sink (the worker could not store it)."""
        if key in self._entries:
            self._remove(key)
        elif key in self._sinks:
            self._bytes -= self._sinks.pop(key)

    # ----- attention sinks -----

    # A sink is not salted: a model's KV of a conversation's first tokens is a function of its weights and those
    # tokens alone (any client can compute it), so sharing it across salts tells a tenant nothing.

    def has_sink(self, variant: Hashable, tokens: Sequence[int]) -> bool:
        """Whether ``variant``'s own KV of the leading ``tokens`` of a conversation is stored."""
        key = (variant, tuple(tokens))
        if key in self._sinks:
            self._sinks.move_to_end(key)
            return True
        return False

    def add_sink(self, variant: Hashable, tokens: Sequence[int]) -> tuple[tuple, list]:
        """Record ``variant``'s KV of the leading ``tokens`` as stored; returns its key and the keys evicted."""
        key = (variant, tuple(tokens))
        self._sinks[key] = len(tokens) * self.bytes_per_token
        self._bytes += self._sinks[key]
        return key, self._evict(keep=key)

    # -----

    def _evict(self, keep) -> list:
        """Drop least recently used entries, then sinks, until the bound holds, never ``keep`` (what was just added:
        the caller stores it); returns their keys."""
        evicted = []
        while self._bytes > self.max_bytes:
            key = next((k for k in self._entries if k != keep), None)
            if key is not None:
                self._remove(key)
            else:
                key = next((k for k in self._sinks if k != keep), None)
                if key is None:
                    break
                self._bytes -= self._sinks.pop(key)
            evicted.append(key)
            self.evictions += 1
        return evicted

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        for prefix in entry.chain:
            holders = self._holders.get(prefix)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._holders[prefix]
        self._bytes -= entry.nbytes


@dataclass
class StoredKV:
    """The worker's copy of one entry: per layer keys and values ``[kv_heads, tokens, head_dim]`` (keys post-RoPE)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]


@dataclass
class KVStore:
    """The worker's half: entries and sinks by the keys the scheduler's index gave them."""

    entries: dict[str, StoredKV] = field(default_factory=dict)
    sinks: dict[tuple, StoredKV] = field(default_factory=dict)
