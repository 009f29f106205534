"""Every assumption peft_kvcache makes about transformers internals (`peft_kvcache.modeling._compat`), checked against the
installed version: if one of these fails after an upgrade, the package's behaviour would silently change."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers.cache_utils import DynamicCache

from peft_kvcache import MappedCache
from peft_kvcache.modeling import _compat
from peft_kvcache.modeling.capture import forward, run_with_cache


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_cache_argument_is_the_one_forward_takes(kind):
    model = tiny_model(kind)
    name = _compat.cache_argument(model)
    assert name in inspect.signature(type(model).forward).parameters
    ids = random_ids(1, 6)[0][None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the name chosen raises no deprecation
        out = model(input_ids=ids, use_cache=True, **_compat.with_cache(model, DynamicCache()))
    assert _compat.output_cache(out).get_seq_length() == 6


def test_a_model_whose_forward_takes_the_old_name_gets_it():
    class OldStyle(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return past_key_values

    model = OldStyle()
    assert _compat.cache_argument(model) == "past_key_values"
    cache = DynamicCache()
    assert model(**_compat.with_cache(model, cache)) is cache


def test_the_cache_update_sees_the_positions_of_the_new_tokens(sibling_pair, sibling_map):
    """MappedCache's continuation check reads position_ids from Cache.update's keyword arguments."""
    source, target = sibling_pair
    seen = []

    class Spy(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == 0:
                seen.append(_compat.update_positions(kwargs))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    forward(target, torch.tensor([[5, 6, 7]]), Spy(), position_ids=torch.tensor([[10, 11, 12]]))
    assert seen and seen[0] is not None and seen[0].tolist() == [[10, 11, 12]]
    ids = random_ids(1, 12, seed=3)[0][None]
    cache = MappedCache.from_source(source, sibling_map, target, input_ids=ids[:, :-1])
    target.generate(input_ids=ids, max_new_tokens=2, do_sample=False, **_compat.with_cache(target, cache))
    assert cache._continuation_checked  # the check ran on generate()'s first step


def test_filled_caches_hold_the_given_tensors_without_a_copy():
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    cache = _compat.fill_cache(DynamicCache(), [(keys, values)] * 3)
    assert cache.get_seq_length() == 5 and len(cache.layers) == 3
    assert cache.layers[1].keys.data_ptr() == keys.data_ptr()


def test_a_cache_update_puts_new_tensors_in_the_layer():
    # the refresh writes into the tensors a pass left in the cache (`refresh_positions`): safe only while an update
    # concatenates into new tensors instead of writing into the ones the layer held (which copies may share)
    cache = _compat.fill_cache(DynamicCache(), [(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))])
    keys, values = cache.layers[0].keys, cache.layers[0].values
    cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)
    for new, old in ((cache.layers[0].keys, keys), (cache.layers[0].values, values)):
        assert new.shape[2] == 6 and new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()


def test_replayed_attention_equals_the_modules_own_output():
    model = tiny_model("llama", seed=3)
    ids = random_ids(1, 10, seed=4)[0][None]
    context = run_with_cache(model, ids[:, :7])
    captured = {}

    def hook(module, args, kwargs, output):
        if "out" not in captured:
            captured.update(out=output[0], args=args, kwargs=kwargs, module=module)

    handle = model.model.layers[1].self_attn.register_forward_hook(hook, with_kwargs=True)
    try:
        forward(model, ids[:, 7:], MappedCache(context), position_ids=torch.arange(7, 10)[None])
    finally:
        handle.remove()
    mask = torch.zeros(1, 1, 3, 10)
    mask[..., 7:] = torch.triu(torch.full((3, 3), torch.finfo(torch.float32).min), 1)
    replayed = _compat.replay_attention(captured["module"], captured["args"], captured["kwargs"], context.keys[1],
                                        context.values[1], mask)
    torch.testing.assert_close(replayed, captured["out"], atol=1e-5, rtol=1e-5)


def test_the_attention_implementation_is_read_and_set_back():
    model = tiny_model("qwen2")
    assert _compat.attention_implementation(model) == "eager"
    model.set_attn_implementation("sdpa")
    assert _compat.attention_implementation(model) == "sdpa"


def test_the_weights_version_changes_when_weights_are_replaced_or_written():
    model = tiny_model("qwen2")
    before = _compat.weights_version(model)
    assert _compat.weights_version(model) == before
    model.load_state_dict(tiny_model("qwen2", seed=9).state_dict())
    after_load = _compat.weights_version(model)
    assert after_load != before
    with torch.no_grad():
        next(model.parameters()).mul_(1.0)
    written = _compat.weights_version(model)
    assert written != after_load
    with torch.no_grad():
        list(model.parameters())[-1].mul_(1.0)  # the walk reaches the deepest parameter too
    deep = _compat.weights_version(model)
    assert deep != written
    last = model.model.layers[-1].mlp.down_proj
    last.weight = torch.nn.Parameter(last.weight.detach().clone())  # replaced, equal values
    assert _compat.weights_version(model) != deep
