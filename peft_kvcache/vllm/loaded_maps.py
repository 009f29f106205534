"""The maps the connector's worker reads at start, off the engine loop (`LoadedMaps`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..maps.kvmap import KVMap


class LoadedMaps:
    """The maps a background loader reads at start, each usable as soon as it is read: a switch waits for its own map,
    not for every map under the root (with a hundred adapters' maps, the first switch would wait for all of them)."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._maps: dict[str, KVMap | str] = {}  # folder -> its map, or why it could not be loaded
        self._finished = False

    def put(self, folder: str, found: KVMap | str) -> None:
        with self._ready:
            self._maps[folder] = found
            self._ready.notify_all()

    def finish(self) -> None:
        """The loader is done: a folder it did not read is read by whoever asks for it."""
        with self._ready:
            self._finished = True
            self._ready.notify_all()

    def get(self, folder: str, read: Callable[[str], KVMap]) -> KVMap | str:
        """``folder``'s map (or why it could not be loaded), waiting until the loader has read it or finished; a folder
        the loader never reads (not found at start) is read now with ``read``."""
        with self._ready:
            self._ready.wait_for(lambda: folder in self._maps or self._finished)
            if folder in self._maps:
                return self._maps[folder]
        found = read(folder)
        self.put(folder, found)
        return found

    def loaded(self) -> int:
        with self._ready:
            return sum(isinstance(m, KVMap) for m in self._maps.values())


__all__ = ["LoadedMaps"]
