import pytest
import torch
from conftest import tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, BloomConfig, GPT2Config, MistralConfig

from peft_kvcache.errors import UnsupportedPositionalSchemeError
from peft_kvcache.modeling.capture import run_with_cache
from peft_kvcache.modeling.positions import (
    apply_rotary,
    find_rotary_embedding,
    position_free_keys,
    positions_from_mask,
    RotarySpec,
    remove_rotary,
    remove_rotary_float,
    rotary_cos_sin,
    rotary_spec_of,
    rotary_spec_of_config,
)

ROPE_VARIANTS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
]


@pytest.mark.parametrize("rope", ROPE_VARIANTS, ids=[r["rope_type"] for r in ROPE_VARIANTS])
def test_cos_sin_match_the_models_own_rotary_module(rope):
    model = tiny_model("llama", rope_parameters=dict(rope))
    spec = rotary_spec_of(model)
    positions = torch.arange(0, 200).repeat(2, 1)
    cos, sin = rotary_cos_sin(spec, positions)
    ref_cos, ref_sin = find_rotary_embedding(model)(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos, ref_cos, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rotary_dim,head_dim", [(16, 16), (8, 16), (4, 32)])
def test_remove_inverts_apply_including_partial_rotary_and_scaling(rotary_dim, head_dim):
    keys = torch.randn(2, 3, 50, head_dim)
    positions = torch.randint(0, 5000, (2, 50))
    freqs = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = positions[..., None].float() * freqs
    angles = torch.cat((angles, angles), -1)
    scale = 1.3
    rotated = apply_rotary(keys, angles.cos() * scale, angles.sin() * scale)
    restored = remove_rotary(rotated, angles.cos() * scale, angles.sin() * scale, scale)
    torch.testing.assert_close(restored, keys, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rotated[..., :rotary_dim], keys[..., :rotary_dim])
    torch.testing.assert_close(rotated[..., rotary_dim:], keys[..., rotary_dim:])  # pass-through dims untouched


@pytest.mark.parametrize("kind", ["llama", "qwen2", "stablelm"])
def test_first_layer_keys_are_position_free_after_removal(kind):
    """Layer-0 keys depend only on the token: with RoPE removed, the same tokens at other positions match."""
    if kind == "stablelm":
        config = AutoConfig.for_model("stablelm", vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      partial_rotary_factor=0.25)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    else:
        model = tiny_model(kind)
    spec = rotary_spec_of(model)
    ids = torch.randint(0, 128, (1, 12))
    at_zero = run_with_cache(model, ids).keys[0]
    shifted_positions = torch.arange(100, 112)[None]
    at_hundred = run_with_cache(model, ids, position_ids=shifted_positions).keys[0]
    assert not torch.allclose(at_zero, at_hundred, atol=1e-3)
    free_zero = position_free_keys(at_zero, spec, torch.arange(12)[None])
    free_hundred = position_free_keys(at_hundred, spec, shifted_positions)
    torch.testing.assert_close(free_zero, free_hundred, rtol=1e-4, atol=1e-5)


def test_positions_follow_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_head_dim_is_derived_when_config_leaves_it_unset():
    model = tiny_model("qwen2", hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    assert getattr(model.config, "head_dim", None) is None
    assert rotary_spec_of(model).head_dim == 32


def _tiny(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("make,scheme", [
    (lambda: _tiny(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)), "ALiBi"),
    (lambda: _tiny(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)), "no rotary embedding"),
    (lambda: _tiny(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, sliding_window=16)), "sliding"),
    (lambda: tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0), "sliding"),
])
def test_unsupported_positional_schemes_are_refused_by_name(make, scheme):
    with pytest.raises(UnsupportedPositionalSchemeError, match=scheme):
        rotary_spec_of(make())


def test_length_dependent_rope_refuses_positions_past_its_original_context():
    model = tiny_model("llama", max_position_embeddings=64,
                       rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    spec = rotary_spec_of(model)
    rotary_cos_sin(spec, torch.arange(64)[None])
    with pytest.raises(UnsupportedPositionalSchemeError, match="dynamic"):
        rotary_cos_sin(spec, torch.arange(65)[None])


@pytest.mark.parametrize("rope", ROPE_VARIANTS, ids=[r["rope_type"] for r in ROPE_VARIANTS])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_config_alone_gives_the_models_rotary_parameters(rope, kind):
    model = tiny_model(kind, rope_parameters=dict(rope))
    own, from_config = rotary_spec_of(model), rotary_spec_of_config(model.config)
    assert torch.equal(own.inv_freq, from_config.inv_freq)
    assert (own.attention_scaling, own.head_dim, own.rope_type, own.max_position) == (
        from_config.attention_scaling, from_config.head_dim, from_config.rope_type, from_config.max_position)



@pytest.mark.parametrize("rotary_dim, scaling, dtype", [(8, 1.0, torch.float32), (4, 1.3, torch.bfloat16)])
def test_removing_the_rotary_into_float32_equals_removing_it_from_a_float_copy(rotary_dim, scaling, dtype):
    """The mapping's un-rotation (read in the cache's dtype, written in float32) is `remove_rotary` of the keys
    as float32, partial rotary and scaling included."""
    spec = RotarySpec(1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim), scaling, 8)
    positions = torch.arange(5, 21)[None]
    cos, sin = rotary_cos_sin(spec, positions)
    keys = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    free = remove_rotary_float(keys, cos, sin, scaling)
    assert free.dtype == torch.float32
    torch.testing.assert_close(free, remove_rotary(keys.float(), cos, sin, scaling), atol=1e-6, rtol=1e-6)
