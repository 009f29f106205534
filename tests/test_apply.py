"""The apply function (maps/apply.py, map_cache): its numerical guards, on a hand-made map and cache."""

from __future__ import annotations

import pytest
import torch
from conftest import make_map

from peft_kvcache.errors import NumericalError
from peft_kvcache.maps.apply import SourceFeatures, _mapped_layers, map_cache
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
    assert f"source cache's {kind} of layer 1 contain" in str(info.value)


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



def _reference(kv_map, keys, values, positions):
    """The map's formula written out plainly: per target layer, the position-free features of its source layers side
    by side, one matmul, keys rotated again (float32)."""
    from peft_kvcache.modeling.layout import layer_features
    from peft_kvcache.modeling.positions import apply_rotary, position_free_keys, rotary_cos_sin

    config, out = kv_map.config, []
    cos, sin = rotary_cos_sin(kv_map.target_rotary, positions)
    for t in range(config.target_layout.num_layers):
        layer = []
        for kind, states in (("keys", keys), ("values", values)):
            features = torch.cat([layer_features(position_free_keys(states[s], kv_map.source_rotary, positions)
                                                 if kind == "keys" else states[s])
                                  for s in kv_map.source_layers(kind, t)], dim=-1)
            mapped = features @ kv_map.tensors[f"{kind}.{t}.weight"].float() + kv_map.tensors[f"{kind}.{t}.bias"]
            batch, seq, _ = mapped.shape
            mapped = mapped.view(batch, seq, -1, config.target_layout.head_dim).transpose(1, 2)
            layer.append(apply_rotary(mapped, cos, sin) if kind == "keys" else mapped)
        out.append(tuple(layer))
    return out


def test_the_mapping_in_the_caches_layout_is_the_maps_formula():
    """Per (source head, target head) blocks written in place, keys rotated in place: equal to the formula done
    plainly, for a batch of two and target layers reading one or two source layers."""
    kv_map = make_map()
    keys, values, positions = _hand_cache()
    mapped = map_cache(kv_map, keys, values, positions, positions, [(torch.device("cpu"), torch.float32)] * 3,
                       torch.float32)
    for (k, v), (k_ref, v_ref) in zip(mapped, _reference(kv_map, keys, values, positions)):
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in mapped)
    assert keys[0].equal(_hand_cache()[0][0])  # the source cache is not rotated in place


def test_bfloat16_matmuls_stay_within_their_rounding_of_float32():
    kv_map = make_map()
    keys, values, positions = _hand_cache(seq=64)
    placements = [(torch.device("cpu"), torch.float32)] * 3
    exact = map_cache(kv_map, keys, values, positions, positions, placements, torch.float32)
    rounded = map_cache(kv_map, keys, values, positions, positions, placements, torch.bfloat16)
    for (k, v), (k16, v16) in zip(exact, rounded):
        for a, b in ((k, k16), (v, v16)):
            assert b.dtype == torch.float32 and 0 < float((a - b).norm() / a.norm()) < 2e-2


def test_the_matmul_dtype_follows_the_cpus_bfloat16_support_unless_told(monkeypatch):
    from peft_kvcache.errors import SettingError
    from peft_kvcache.maps import compute

    monkeypatch.delenv(compute.ENVIRONMENT, raising=False)
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(compute, "native_bf16_cpu", lambda native=native: native)
        assert compute.matmul_dtype("cpu") == expected
    assert compute.matmul_dtype("meta") == torch.float32  # accelerators multiply float32 fast enough
    monkeypatch.setenv(compute.ENVIRONMENT, "float32")
    monkeypatch.setattr(compute, "native_bf16_cpu", lambda: True)
    assert compute.matmul_dtype("cpu") == torch.float32
    monkeypatch.setenv(compute.ENVIRONMENT, "fp8")
    with pytest.raises(SettingError, match="float32 or bfloat16"):
        compute.matmul_dtype("cpu")


def test_a_source_layers_features_are_dropped_after_the_last_target_layer_reading_them():
    """A mapping keeps a source layer's position-free features (a float32 copy of its keys) only while a later target
    layer reads them: a same-shape adapter map holds one source layer at a time, not a copy of every layer's keys."""
    kv_map = make_map()  # key sources [[0], [1], [0, 1]], value sources [[1], [1], [0]]
    keys, values, positions = _hand_cache()
    features = SourceFeatures(keys, values, kv_map.source_rotary, positions, torch.float32)
    layers = _mapped_layers(kv_map, features, kv_map.target_rotary, positions,
                            [(torch.device("cpu"), torch.float32)] * 3, torch.float32, False)
    held = [sorted(features._cache) for _ in layers]
    assert held == [[("keys", 0), ("values", 1)], [("keys", 0), ("keys", 1)], []]
