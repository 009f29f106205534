"""`keep_freed_memory`: glibc's malloc serves tensors from its heap instead of fresh mmaps (page faults at every
switch), measured by glibc's own count of mmapped blocks in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peft_kvcache import keep_freed_memory
from peft_kvcache._allocator import _glibc
from peft_kvcache.errors import SettingError

pytestmark = pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"), reason="needs glibc >= 2.33")

# in a fresh process (the setting is process-wide): how many new mmapped blocks a tensor of each size takes
PROBE = """
import ctypes, json, sys, torch
from peft_kvcache import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
out = {"applied": keep_freed_memory() if sys.argv[1] == "kept" else False}
for mib in (2, 24):
    before = libc.mallinfo2().hblks
    tensor = torch.empty(mib << 20, dtype=torch.uint8)
    out[str(mib)] = libc.mallinfo2().hblks - before
    del tensor
print(json.dumps(out))
"""


def probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def test_kept_memory_serves_tensors_from_the_heap_where_glibc_would_mmap_them():
    default, kept = probe("glibc"), probe("kept")
    assert default == {"applied": False, "2": 1, "24": 1}  # the control: glibc maps each tensor afresh
    assert kept == {"applied": True, "2": 0, "24": 0}


def test_another_allocator_preloaded_is_left_alone(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/opt/lib/libtcmalloc_minimal.so.4")
    assert keep_freed_memory() is False


@pytest.mark.parametrize("options", [{"mmap_threshold": 64 << 20}, {"mmap_threshold": 0}, {"trim_threshold": 1 << 31}])
def test_thresholds_glibc_refuses_are_refused_with_the_range(options):
    with pytest.raises(SettingError, match="mmap_threshold <= 33554432"):
        keep_freed_memory(**options)
