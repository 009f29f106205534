"""Property-based tests (hypothesis) of the positions and mapping code over shapes, dtypes, batch sizes,
left padding, position offsets and random tiny model configs."""

from __future__ import annotations

import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peft_kvcache import KVMap, KVMapConfig
from peft_kvcache.maps.apply import map_cache
from peft_kvcache.modeling.capture import run_with_cache
from peft_kvcache.modeling.layout import KVLayout
from peft_kvcache.modeling.positions import (
    RotarySpec,
    apply_rotary,
    position_free_keys,
    positions_from_mask,
    remove_rotary,
    rotary_cos_sin,
    rotary_spec_of,
)

FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODELS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative round-trip tolerance of a rotation computed in each dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@st.composite
def rotary_specs(draw) -> RotarySpec:
    head_dim = 2 * draw(st.integers(1, 16))
    rotary_dim = 2 * draw(st.integers(1, head_dim // 2))  # partial rotary included
    theta = draw(st.sampled_from([100.0, 10_000.0, 1_000_000.0]))
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    return RotarySpec(inv_freq=inv_freq, attention_scaling=draw(st.sampled_from([1.0, 0.7, 1.3])), head_dim=head_dim)


@st.composite
def left_padded_masks(draw, max_batch: int = 3, max_seq: int = 9) -> torch.Tensor:
    batch, seq = draw(st.integers(1, max_batch)), draw(st.integers(1, max_seq))
    lengths = [draw(st.integers(1, seq)) for _ in range(batch)]
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, seq - length:] = 1
    return mask


def _keys(spec: RotarySpec, batch: int, heads: int, seq: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, seq, spec.head_dim, generator=gen).to(dtype)


@FAST
@given(spec=rotary_specs(), mask=left_padded_masks(), heads=st.integers(1, 4), offset=st.integers(0, 5000),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_remove_rotary_inverts_apply_rotary(spec, mask, heads, offset, dtype, seed):
    keys = _keys(spec, mask.shape[0], heads, mask.shape[1], seed, dtype)
    cos, sin = rotary_cos_sin(spec, positions_from_mask(mask) + offset)
    rotated = apply_rotary(keys, cos, sin)
    assert rotated.dtype == dtype and rotated.shape == keys.shape
    back = remove_rotary(rotated.float(), cos, sin, spec.attention_scaling)
    scale = keys.float().abs().max().clamp_min(1.0)
    assert float((back - keys.float()).abs().max() / scale) < TOLERANCE[dtype] * 4
    # Dims past rotary_dim pass through untouched.
    torch.testing.assert_close(rotated[..., spec.rotary_dim:], keys[..., spec.rotary_dim:], rtol=0, atol=0)


@FAST
@given(spec=rotary_specs(), mask=left_padded_masks(), heads=st.integers(1, 3),
       offsets=st.tuples(st.integers(0, 3000), st.integers(0, 3000)), seed=st.integers(0, 2**16))
def test_position_free_keys_do_not_depend_on_where_the_context_sits(spec, mask, heads, offsets, seed):
    plain = _keys(spec, mask.shape[0], heads, mask.shape[1], seed)
    freed = []
    for offset in offsets:
        positions = positions_from_mask(mask) + offset
        cos, sin = rotary_cos_sin(spec, positions)
        cached = apply_rotary(plain, cos, sin) * 1.0  # what a model with this rotary would cache
        freed.append(position_free_keys(cached, spec, positions))
    torch.testing.assert_close(freed[0], freed[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(freed[0], plain, rtol=1e-4, atol=1e-4)


def _map_between(source: KVLayout, target: KVLayout, source_spec: RotarySpec, target_spec: RotarySpec,
                 layers: list[list[int]], identity: bool = False, seed: int = 0) -> KVMap:
    """A hand-built map; ``identity`` copies each source layer to the same target layer."""
    gen = torch.Generator().manual_seed(seed)
    config = KVMapConfig(
        source_name="src", target_name="tgt", source_fingerprint="a" * 64, target_fingerprint="b" * 64,
        source_layout=source, target_layout=target, source_rotary=source_spec.describe(),
        target_rotary=target_spec.describe(), vocab_size=128,
        pair_kind="same_shape" if identity else "cross_shape", key_layers=layers, value_layers=layers)
    tensors = {"source.inv_freq": source_spec.inv_freq, "target.inv_freq": target_spec.inv_freq}
    for kind in ("keys", "values"):
        for t, group in enumerate(layers):
            shape = (len(group) * source.layer_width, target.layer_width)
            tensors[f"{kind}.{t}.weight"] = torch.eye(*shape) if identity else torch.randn(*shape, generator=gen) * 0.1
            tensors[f"{kind}.{t}.bias"] = torch.zeros(shape[1]) if identity else torch.randn(shape[1], generator=gen)
    return KVMap(config, tensors)


@FAST
@given(data=st.data(), source_spec=rotary_specs(), target_spec=rotary_specs(), mask=left_padded_masks(),
       source_dtype=st.sampled_from(DTYPES), offset=st.integers(0, 100))
def test_map_cache_output_always_has_the_targets_shapes_dtypes_and_devices(data, source_spec, target_spec, mask,
                                                                           source_dtype, offset):
    source = KVLayout(data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), source_spec.head_dim)
    target = KVLayout(data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3)), target_spec.head_dim)
    layers = [sorted(data.draw(st.sets(st.integers(0, source.num_layers - 1), min_size=1, max_size=2)))
              for _ in range(target.num_layers)]
    kv_map = _map_between(source, target, source_spec, target_spec, layers, seed=data.draw(st.integers(0, 99)))
    batch, seq = mask.shape
    keys = [_keys(source_spec, batch, source.kv_heads, seq, i, source_dtype) for i in range(source.num_layers)]
    values = [_keys(source_spec, batch, source.kv_heads, seq, 50 + i, source_dtype) for i in range(source.num_layers)]
    placements = [(torch.device("cpu"), data.draw(st.sampled_from(DTYPES))) for _ in range(target.num_layers)]
    positions = positions_from_mask(mask)
    mapped = map_cache(kv_map, keys, values, positions, positions + offset, placements)
    assert len(mapped) == target.num_layers
    for (k, v), (device, dtype) in zip(mapped, placements):
        for states in (k, v):
            assert tuple(states.shape) == (batch, target.kv_heads, seq, target.head_dim)
            assert states.dtype == dtype and states.device == device and torch.isfinite(states).all()


@st.composite
def tiny_configs(draw) -> dict:
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([8, 16]))
    return dict(kind=draw(st.sampled_from(["qwen2", "llama"])), seed=draw(st.integers(0, 9)),
                num_hidden_layers=draw(st.integers(1, 2)), num_attention_heads=heads, num_key_value_heads=kv_heads,
                hidden_size=heads * head_dim, intermediate_size=32)


@MODELS
@given(config=tiny_configs(), mask=left_padded_masks(max_seq=7), offset=st.integers(0, 50),
       seed=st.integers(0, 2**16))
def test_the_identity_map_of_a_model_reproduces_its_own_cache(config, mask, offset, seed):
    """Random tiny models, batch sizes and left padding: de-rotate, copy, re-rotate gives back the cache; at
    an offset it gives the keys the model itself caches at those positions."""
    model = tiny_model(config.pop("kind"), config.pop("seed"), **config)
    spec, layout = rotary_spec_of(model), KVLayout.of(model)
    kv_map = _map_between(layout, layout, spec, spec, [[i] for i in range(layout.num_layers)], identity=True)
    ids = torch.randint(0, 128, mask.shape, generator=torch.Generator().manual_seed(seed))
    positions = positions_from_mask(mask)
    cache = run_with_cache(model, ids, mask)
    placements = [(torch.device("cpu"), torch.float32)] * layout.num_layers
    # float32 matmuls: the formula exactly (bfloat16's own rounding is measured against it in test_apply)
    mapped = map_cache(kv_map, cache.keys, cache.values, positions, positions, placements, torch.float32)
    for (k, v), k_own, v_own in zip(mapped, cache.keys, cache.values):
        torch.testing.assert_close(k, k_own, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, v_own, rtol=0, atol=0)
    shifted = run_with_cache(model, ids, mask, position_ids=positions + offset)
    moved = map_cache(kv_map, cache.keys, cache.values, positions, positions + offset, placements, torch.float32)
    # Layer 0 keys depend on the tokens only, so the model's own keys at the offset are the reference.
    torch.testing.assert_close(moved[0][0], shifted.keys[0], rtol=1e-4, atol=1e-4)
