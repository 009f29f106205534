"""The dtype a map's matmuls run in: bfloat16 on CPUs with native bfloat16 dot products (AVX512-BF16 or AMX, where
a map-sized product runs several times faster than in float32), float32 elsewhere. The choice follows the CPU's flags,
not a timing, so every process on a machine (a library and a serving engine compared token for token) makes the same
one; ``PEFT_KVCACHE_MATMUL_DTYPE=float32`` (or ``bfloat16``) overrides it. A map's own error is orders of magnitude
above bfloat16's rounding (benchmarks/map_speed.py measures both on held-out text); the rotary runs in float32."""

from __future__ import annotations

import os

import torch

from .._cpu import cpu_flags
from ..errors import SettingError

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ENVIRONMENT = "PEFT_KVCACHE_MATMUL_DTYPE"


def matmul_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on a CPU with native bfloat16 dot products, float32 otherwise (and on every accelerator, whose
    float32 matmuls keep up); ``$PEFT_KVCACHE_MATMUL_DTYPE`` overrides."""
    chosen = os.environ.get(ENVIRONMENT)
    if chosen:
        if chosen not in ("float32", "bfloat16"):
            raise SettingError(f"{ENVIRONMENT}={chosen!r}: pass float32 or bfloat16")
        return getattr(torch, chosen)
    if torch.device(device).type == "cpu" and native_bf16_cpu():
        return torch.bfloat16
    return torch.float32


def native_bf16_cpu() -> bool:
    """Whether this CPU reports AVX512-BF16 or AMX-BF16 (False where /proc/cpuinfo cannot be read)."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


__all__ = ["ENVIRONMENT", "matmul_dtype", "native_bf16_cpu"]
