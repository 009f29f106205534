"""The storage-dtype benchmark's table: a map read from a file already stored in bfloat16 is said to compare
bfloat16 with itself (its zero difference is no evidence about rounding)."""

from __future__ import annotations

import torch

from benchmarks import storage
from peft_kvcache.maps.config import weights_dtype


def _results(read_as: dict[str, str]) -> dict:
    difference = {"difference": 0.0, "low": 0.0, "high": 0.0}
    maps = {name: {"rows": [{"variant": "float32", "kl": 0.5}], "kl_bfloat16_minus_float32": difference,
                   "choice": "bfloat16", "weights_read_as": dtype} for name, dtype in read_as.items()}
    return {"maps": maps, "choice": {name: "bfloat16" for name in read_as}}


def test_a_map_read_in_bfloat16_is_flagged_and_one_read_in_float32_is_not(sibling_map):
    assert weights_dtype(sibling_map.tensors) == "float32"
    assert weights_dtype(sibling_map.with_weights_dtype(torch.bfloat16).tensors) == "bfloat16"
    text = storage.markdown(_results({"published": "bfloat16", "fitted": "float32"}))
    assert "| published | bfloat16 |" in text and "| fitted | float32 |" in text
    assert "published: read from files already stored in bfloat16" in text
    assert "already stored" not in storage.markdown(_results({"fitted": "float32"}))
