"""What this machine's CPU can do: its feature flags (Linux's /proc/cpuinfo), read once per process. The dtype a map
multiplies in follows them (`peft_kvcache.maps.compute`), and every results file records the ones that decide which
kernels a timing ran on (`peft_kvcache.lab.provenance`: two machines of one model name may differ in them)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

# the flags that change which kernels torch and vLLM run: float32 matmul width, native bfloat16 dot products
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def speed_flags() -> list[str]:
    """Which of `SPEED_FLAGS` this CPU has, in that order.

    Example:
        >>> set(speed_flags()) <= set(SPEED_FLAGS)
        True
    """
    return [flag for flag in SPEED_FLAGS if flag in cpu_flags()]
