"""The apply function (maps/apply.py, map_cache): its numerical guards, on a hand-made map and cache."""

from __future__ import annotations

import pytest
import torch
from conftest import make_map

from peft_kvcache.errors import NumericalError
from peft_kvcache.maps.apply import map_cache
from peft_kvcache.modeling.layout import KVLayout


def _hand_cache(batch: int = 2, seq: int = 5, dtype=torch.float32):
    layout = KVLayout(2, 2, 8)  # the source layout of make_map
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(batch, layout.kv_heads, seq, layout.head_dim, generator=gen).to(dtype) for _ in range(2)]
    values = [torch.randn(batch, layout.kv_heads, seq, layout.head_dim, generator=gen).to(dtype) for _ in range(2)]
    positions = torch.arange(seq).expand(batch, seq)
    return keys, values, positions


@pytest.mark.parametrize("kind, value", [("keys", float("nan")), ("values", float("inf")), ("keys", -float("inf"))])
def test_a_non_finite_source_cache_is_refused_naming_the_layers(kind, value):
    kv_map = make_map()  # key sources [[0], [1], [0, 1]], value sources [[1], [1], [0]]
    keys, values, positions = _hand_cache()
    (keys if kind == "keys" else values)[1][1, 0, 3, 2] = value
    placements = [(torch.device("cpu"), torch.float32)] * 3
    with pytest.raises(NumericalError) as info:
        map_cache(kv_map, keys, values, positions, positions, placements)
    first_target = 1 if kind == "keys" else 0
    assert f"mapped {kind} of target layer {first_target}" in str(info.value)
    assert f"source cache's {kind} of layer(s) [1]" in str(info.value)


def test_float16_overflow_in_the_mapping_is_a_numerical_error():
    kv_map = make_map()
    kv_map.tensors["values.2.weight"] = kv_map.tensors["values.2.weight"] * 1e5  # |mapped| ~ 1e5 > 65504
    keys, values, positions = _hand_cache()
    fp32 = map_cache(kv_map, keys, values, positions, positions, [(torch.device("cpu"), torch.float32)] * 3)
    assert all(torch.isfinite(t).all() for layer in fp32 for t in layer)
    bf16 = map_cache(kv_map, keys, values, positions, positions, [(torch.device("cpu"), torch.bfloat16)] * 3)
    assert bf16[2][1].dtype == torch.bfloat16 and torch.isfinite(bf16[2][1]).all()
    with pytest.raises(NumericalError, match=r"mapped values of target layer 2 overflows torch.float16"):
        map_cache(kv_map, keys, values, positions, positions, [(torch.device("cpu"), torch.float16)] * 3)


def test_a_float16_source_cache_maps_like_its_float32_copy():
    kv_map = make_map()
    keys, values, positions = _hand_cache(dtype=torch.float16)
    half = map_cache(kv_map, keys, values, positions, positions, [(torch.device("cpu"), torch.float32)] * 3)
    full = map_cache(kv_map, [k.float() for k in keys], [v.float() for v in values], positions, positions,
                     [(torch.device("cpu"), torch.float32)] * 3)
    for (k1, v1), (k2, v2) in zip(half, full):
        torch.testing.assert_close(k1, k2)
        torch.testing.assert_close(v1, v2)

