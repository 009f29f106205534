"""Keep freed tensor memory in the process (glibc's malloc), so that a switch does not pay page faults.

glibc hands every freed block above its mmap threshold back to the kernel, and the next allocation of that size
takes fresh pages, zeroed one page fault at a time. A mapping allocates a few tensors per target layer (1.5 MiB each
for SmolLM2-135M at 2k tokens), a decode step its activations: those faults make a switch more variable and at
times far slower (`benchmarks.allocator`: both allocators side by side). vLLM's CPU build preloads tcmalloc for the
same reason where it ships one. `keep_freed_memory` sets glibc's thresholds so that
blocks up to ``mmap_threshold`` come from the heap and the heap is trimmed only above ``trim_threshold``: freed
memory is reused, at the price of a resident size that stays near its peak (up to ``trim_threshold`` above it).
It changes the whole process, so the library never calls it on import: a serving process calls it at start
(`peft-kvcache serve` does and prints which allocator it runs on; the vLLM connector does on a CPU engine, logged at
INFO by this module).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from .errors import SettingError

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``gnu_get_libc_version``), else None (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Make glibc's malloc keep freed blocks up to ``mmap_threshold`` bytes for reuse and trim its heap only above
    ``trim_threshold`` (see the module). Returns whether the settings were applied: False where the C library is
    not glibc, or where another allocator (tcmalloc, jemalloc) was preloaded (it replaces malloc; nothing to do).

    Example:
        >>> keep_freed_memory() in (True, False)
        True
    """
    if not 0 < mmap_threshold <= MMAP_THRESHOLD or not 0 < trim_threshold < 1 << 31:
        raise SettingError(f"keep_freed_memory takes 0 < mmap_threshold <= {MMAP_THRESHOLD} (glibc's largest) and "
                           f"0 < trim_threshold < 2**31 bytes, got {mmap_threshold} and {trim_threshold}")
    libc = _glibc()
    if libc is None:
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return False
    applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD,
                                                                                         trim_threshold))
    if applied:
        logger.info("peft-kvcache: glibc malloc keeps freed blocks up to %d MiB (mapping without page faults)",
                    mmap_threshold >> 20)
    return applied


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]
