"""generate()'s decoding modes on the library's caches: every mode gives, on a cache of the prompt's context, what
it gives with no cache at all (the model's own cache, and a cache mapped through an exact identity map), and on an
approximate mapped cache the exact speculative modes (prompt lookup, a draft model) give greedy's tokens.
transformers 5.24 does not expand a cache it is given (beams, several return sequences) and runs the whole prompt
again on it in assisted decoding (a plain DynamicCache then gives wrong tokens with no error); `ContextCache` handles
both."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model

from peft_kvcache import ContextCache, KVMap, MappedCache
from peft_kvcache.modeling.capture import run_with_cache

MODES = {"greedy": {}, "prompt lookup": {"prompt_lookup_num_tokens": 3}, "draft model": "assistant",
         "beam search": {"num_beams": 3}, "several sequences": {"do_sample": True, "num_return_sequences": 2, "top_k": 5},
         "sampling": {"do_sample": True, "top_k": 5}, "repetition penalty": {"repetition_penalty": 1.3}}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def draft():
    return tiny_model("llama", seed=3)


def _kwargs(mode: str, draft) -> dict:
    return {"assistant_model": draft} if MODES[mode] == "assistant" else dict(MODES[mode])


def _prompts(count: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    prompts = []
    for _ in range(count):
        ids = torch.randint(3, 100, (1, 40), generator=generator)
        ids[0, 20:30] = ids[0, 5:15]  # a repeat prompt lookup can draft from
        prompts.append(ids)
    return prompts


def _generate(model, ids, cache, kwargs):
    torch.manual_seed(7)
    return model.generate(ids, max_new_tokens=10, pad_token_id=0, **({"cache": cache} if cache is not None else {}),
                          **kwargs)


def identity_map(model) -> KVMap:
    """A map from the model to itself that changes nothing (W = I, b = 0, each layer from itself)."""
    from conftest import random_ids

    kv_map = KVMap.calibrate(model, model, random_ids(6, 24), progress=False)
    config = copy.deepcopy(kv_map.config)
    layers, width = config.target_layout.num_layers, config.target_layout.layer_width
    config.key_layers = config.value_layers = [[t] for t in range(layers)]
    tensors = {k: v for k, v in kv_map.tensors.items() if k.endswith("inv_freq")}
    for kind in ("keys", "values"):
        for t in range(layers):
            tensors[f"{kind}.{t}.weight"], tensors[f"{kind}.{t}.bias"] = torch.eye(width), torch.zeros(width)
    return KVMap(config, tensors)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cache_kind", ["own", "mapped by an identity map"])
def test_every_mode_on_a_cache_of_the_context_equals_no_cache(model, draft, mode, cache_kind, exact_matmuls):
    kwargs = _kwargs(mode, draft)
    kv_map = identity_map(model) if cache_kind != "own" else None
    for ids in _prompts():
        context = ids[:, :-1]
        if kv_map is None:
            cache = ContextCache(run_with_cache(model, context), next_positions=torch.tensor([context.shape[1]]))
        else:
            cache = MappedCache.from_source(model, kv_map, model, input_ids=context, refresh_tokens=0)
        assert torch.equal(_generate(model, ids, cache, kwargs), _generate(model, ids, None, kwargs)), mode


@pytest.mark.parametrize("mode", ["prompt lookup", "draft model"])
def test_speculative_modes_on_an_approximate_mapped_cache_give_greedys_tokens(sibling_pair, sibling_map, draft, mode):
    source, target = sibling_pair
    helper = tiny_model("qwen2", seed=5, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                        num_key_value_heads=3, intermediate_size=160)  # a draft for the target's vocabulary
    kwargs = {"assistant_model": helper} if mode == "draft model" else _kwargs(mode, None)
    for ids in _prompts():
        context = ids[:, :-1]

        def mapped():
            return MappedCache.from_source(source, sibling_map, target, input_ids=context, refresh_tokens=0)

        greedy = _generate(target, ids, mapped(), {})
        assert torch.equal(_generate(target, ids, mapped(), kwargs), greedy)
        assert not torch.equal(greedy, _generate(target, ids, None, {}))  # the mapped context does matter


def test_several_sequences_expand_the_cache_and_its_positions(model):
    ids = _prompts(1)[0]
    cache = ContextCache(run_with_cache(model, ids[:, :-1]), next_positions=torch.tensor([ids.shape[1] - 1]))
    out = _generate(model, ids, cache, {"do_sample": True, "num_return_sequences": 4})
    assert out.shape[0] == 4 and cache.layers[0].keys.shape[0] == 4
    assert cache.next_positions.tolist() == [out.shape[1] - 1] * 4


def test_a_drop_in_cache_still_refuses_a_prompt_that_does_not_extend_it(model):
    from peft_kvcache.errors import CacheMismatchError

    ids = _prompts(1)[0]
    cache = ContextCache(run_with_cache(model, ids), next_positions=torch.tensor([ids.shape[1]]))
    with pytest.raises(CacheMismatchError, match="no token beyond"):
        model.generate(ids, cache=cache, max_new_tokens=2, pad_token_id=0, prompt_lookup_num_tokens=3)
    # refused, the cache is back to plain decoding: a prompt that extends it gives what no cache gives
    longer = torch.cat([ids, ids[:, :3]], dim=1)
    assert torch.equal(_generate(model, longer, cache, {}), _generate(model, longer, None, {}))
