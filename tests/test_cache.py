"""MappedCache end to end through generate() (issue 2's must-shows)."""

import contextlib

import pytest
import torch
from conftest import random_ids, tiny_model

from peft_kvcache import CacheMismatchError, FingerprintMismatchError, KVMap, MappedCache
from peft_kvcache.errors import CalibrationError, IncompatibleModelsError, UnsupportedPositionalSchemeError
from peft_kvcache.modeling._compat import cache_argument, output_cache, with_cache
from peft_kvcache.modeling.capture import run_with_cache


@pytest.fixture
def identity(same_model):
    return same_model, KVMap.calibrate(same_model, same_model, random_ids(10, 40), progress=False)


def _relative_error(a, b):
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def test_same_model_reproduces_next_token_logits_batch_of_one(identity):
    model, kv_map = identity
    prompt = torch.randint(0, 128, (1, 30))
    cache = MappedCache.from_source(model, kv_map, model, input_ids=prompt[:, :-1])
    full = model(prompt).logits[:, -1]
    mapped = model(prompt[:, -1:], **with_cache(model, cache), position_ids=torch.tensor([[29]])).logits[:, -1]
    assert _relative_error(mapped, full) < 1e-3


@torch.no_grad()
def test_same_model_reproduces_logits_and_greedy_output_left_padded_batch(identity):
    model, kv_map = identity
    prompt = torch.randint(0, 128, (2, 24))
    mask = torch.ones_like(prompt)
    mask[0, :7] = 0  # row 0 is left-padded
    full = model.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False)
    cache = MappedCache.from_source(model, kv_map, model, input_ids=prompt[:, :-1], attention_mask=mask[:, :-1])
    mapped = model.generate(prompt, attention_mask=mask, **with_cache(model, cache), max_new_tokens=8, do_sample=False)
    assert torch.equal(mapped, full)

    cache = MappedCache.from_source(model, kv_map, model, input_ids=prompt[:, :-1], attention_mask=mask[:, :-1])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(prompt[:, -1:], attention_mask=mask, **with_cache(model, cache), position_ids=positions[:, -1:]).logits
    reference = model(prompt, attention_mask=mask, position_ids=positions).logits
    assert _relative_error(logits[:, -1], reference[:, -1]) < 1e-3


def test_generate_accepts_both_cache_spellings(identity):
    model, kv_map = identity
    prompt = torch.randint(0, 128, (1, 20))
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    for spelling in ("past_key_values", "cache"):
        cache = MappedCache.from_source(model, kv_map, model, input_ids=prompt[:, :-1])
        renamed = spelling == "past_key_values" and cache_argument(model) == "cache"
        with pytest.warns(FutureWarning, match="past_key_values") if renamed else contextlib.nullcontext():
            out = model.generate(prompt, max_new_tokens=6, do_sample=False, **{spelling: cache})
        assert torch.equal(out, expected), spelling


def test_a_source_cache_can_be_mapped_directly(identity):
    model, kv_map = identity
    prompt = torch.randint(0, 128, (1, 20))
    source_cache = output_cache(model(prompt[:, :-1], use_cache=True))
    cache = MappedCache.from_source(source_cache, kv_map, model, input_ids=prompt[:, :-1])
    out = model.generate(prompt, **with_cache(model, cache), max_new_tokens=6, do_sample=False)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=6, do_sample=False))


def test_cache_as_long_as_the_prompt_is_refused(identity):
    model, kv_map = identity
    prompt = torch.randint(0, 128, (1, 20))
    cache = MappedCache.from_source(model, kv_map, model, input_ids=prompt)
    with pytest.raises(CacheMismatchError, match=r"prompt\[:, :-1\]"):
        model.generate(prompt, **with_cache(model, cache), max_new_tokens=3, do_sample=False)


def test_differently_shaped_pair_gives_the_targets_shapes_dtype_and_length(sibling_pair, sibling_map):
    source, target = sibling_pair
    assert sibling_map.config.pair_kind == "cross_shape"
    prompt = torch.randint(0, 128, (2, 33))
    target16 = target.to(torch.bfloat16)
    try:
        cache = MappedCache.from_source(source, sibling_map, target16, input_ids=prompt[:, :-1])
        assert len(cache.layers) == target.config.num_hidden_layers == 3
        for layer in cache.layers:
            assert layer.keys.shape == layer.values.shape == (2, 3, 32, 32)  # target: 3 KV heads x head_dim 32
            assert layer.keys.dtype == torch.bfloat16 and layer.keys.device == target16.device
        assert cache.get_seq_length() == 32
        out = target16.generate(prompt, **with_cache(target16, cache), max_new_tokens=5, do_sample=False)
        assert out.shape == (2, 38)
    finally:
        target.to(torch.float32)


@torch.no_grad()
def test_position_offset_gives_the_same_continuation(sibling_pair, sibling_map):
    source, target = sibling_pair
    prompt = torch.randint(0, 128, (1, 25))
    logits = []
    for offset in (0, 37):
        cache = MappedCache.from_source(source, sibling_map, target, input_ids=prompt[:, :-1], position_offset=offset)
        out = target(prompt[:, -1:], **with_cache(target, cache), position_ids=torch.tensor([[24 + offset]]))
        logits.append(out.logits[:, -1])
    assert _relative_error(logits[1], logits[0]) < 1e-4

    # generate() with default positions would continue at 24, not 61: the cache refuses that, every time, and a
    # refused call (several return sequences: generate() runs 3 rows) leaves it as it was
    cache = MappedCache.from_source(source, sibling_map, target, input_ids=prompt[:, :-1], position_offset=37)
    before = [(layer.keys, layer.values) for layer in cache.layers]
    for extra in ({}, {"do_sample": True, "num_return_sequences": 3}, {}):
        with pytest.raises(CacheMismatchError, match="positions"):
            target.generate(prompt, **with_cache(target, cache), max_new_tokens=2, **extra)
        assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, before))
        assert cache.next_positions.tolist() == [24 + 37]


def test_sink_is_computed_by_the_target_itself(sibling_pair, sibling_map):
    source, target = sibling_pair
    prompt = torch.randint(0, 128, (1, 20))
    own = output_cache(target(prompt[:, :1], use_cache=True))
    with_sink = MappedCache.from_source(source, sibling_map, target, input_ids=prompt)
    source_cache = output_cache(source(prompt, use_cache=True))
    without = MappedCache.from_source(source_cache, sibling_map, target)  # no ids: the sink is mapped too
    for layer, mine, bare in zip(own.layers, with_sink.layers, without.layers):
        torch.testing.assert_close(mine.keys[:, :, :1], layer.keys)
        assert not torch.allclose(bare.keys[:, :, :1], layer.keys)
        torch.testing.assert_close(mine.keys[:, :, 1:], bare.keys[:, :, 1:])


def test_wrong_models_for_the_map_are_refused_naming_both(sibling_pair, sibling_map):
    source, target = sibling_pair
    other = tiny_model("qwen2", seed=5, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                       num_key_value_heads=3, intermediate_size=160)
    prompt = torch.randint(0, 128, (1, 10))
    with pytest.raises(FingerprintMismatchError, match="tiny-qwen2-1.*tiny-qwen2-5"):
        MappedCache.from_source(source, sibling_map, other, input_ids=prompt)
    with pytest.raises(FingerprintMismatchError, match="source"):
        MappedCache.from_source(target, sibling_map, target, input_ids=prompt)


def test_source_cache_of_the_wrong_shape_is_refused(sibling_pair, sibling_map):
    _, target = sibling_pair
    wrong = output_cache(target(torch.randint(0, 128, (1, 10)), use_cache=True))  # a target cache, not a source one
    with pytest.raises(CacheMismatchError, match="layers|expects"):
        MappedCache.from_source(wrong, sibling_map, target)


def test_mismatched_vocabularies_are_refused():
    with pytest.raises(IncompatibleModelsError, match="vocabulary"):
        KVMap.calibrate(tiny_model("qwen2"), tiny_model("qwen2", vocab_size=200), random_ids(4, 20), progress=False)


def test_tokenizer_larger_than_the_vocabulary_is_refused():
    class FakeTokenizer:
        def __len__(self):
            return 5000

    with pytest.raises(IncompatibleModelsError, match="tokenizer"):
        KVMap.calibrate(tiny_model(), tiny_model(), ["some text"], tokenizer=FakeTokenizer(), progress=False)


@pytest.mark.parametrize("data,match", [([], "empty"), ([torch.tensor([1, 2])], "empty"),
                                        ([torch.arange(20)], "at least 2 texts"),
                                        (["text without tokenizer"], "tokenizer"),
                                        ([torch.full((20,), 999)], "outside the vocabulary")])
def test_bad_calibration_sets_are_refused(data, match):
    model = tiny_model()
    with pytest.raises(CalibrationError, match=match):
        KVMap.calibrate(model, model, data, progress=False)


@pytest.mark.parametrize("options, match", [({"top_k": "2"}, "top_k must be an integer"),
                                             ({"heldout_fraction": 1.5}, "heldout_fraction"),
                                             ({"lambda_grid": (1.0, "x")}, "lambda_grid"), ({"topk": 2}, "unknown")])
def test_calibration_options_of_the_wrong_type_or_range_are_refused_by_name(options, match):
    model = tiny_model()
    with pytest.raises(CalibrationError, match=match):
        KVMap.calibrate(model, model, random_ids(4, 20), progress=False, **options)


def test_more_source_layers_than_the_source_has_are_refused_before_any_capture(monkeypatch):
    import peft_kvcache.calibration.loop as calibrate

    monkeypatch.setattr(calibrate, "collect", lambda *a, **k: pytest.fail("captured before checking top_k"))
    model = tiny_model()
    with pytest.raises(CalibrationError, match="top_k 9"):
        KVMap.calibrate(model, model, random_ids(4, 20), top_k=9, progress=False)


@pytest.mark.parametrize("length, offset, side", [(40, 0, "source"), (30, 20, "target")])
def test_a_context_past_where_the_rotary_changes_is_refused_before_the_source_runs(monkeypatch, length, offset, side):
    # dynamic RoPE changes its frequencies past the model's original length: a mapped cache there would be wrong
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    models = {name: tiny_model("llama", seed=seed, max_position_embeddings=32,
                               **({"rope_parameters": rope} if name == side else {}))
              for name, seed in (("source", 0), ("target", 1))}
    kv_map = KVMap.calibrate(models["source"], models["target"], random_ids(4, 24), progress=False)
    monkeypatch.setattr(models["source"], "forward", lambda *a, **k: pytest.fail("the source ran"))
    with pytest.raises(UnsupportedPositionalSchemeError, match="dynamic"):
        MappedCache.from_source(models["source"], kv_map, models["target"], input_ids=random_ids(1, length)[0][None],
                                position_offset=offset, refresh_tokens=0)


def test_unsupported_positional_scheme_is_refused_at_calibration():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(UnsupportedPositionalSchemeError, match="sliding"):
        KVMap.calibrate(model, model, random_ids(4, 20), progress=False)


def test_a_calibrated_sibling_map_predicts_the_targets_own_cache(sibling_pair, sibling_map):
    """On text the fit never saw, the mapped keys and values are closer to the target's own than no map at all
    (zeros: the whole error, 1.0) and than the map's bias alone (its weights zeroed): the weights carry the
    source's context into the target's space."""
    from peft_kvcache.modeling.capture import run_with_cache

    source, target = sibling_pair
    ids = random_ids(1, 48, seed=21)[0][None]
    own = run_with_cache(target, ids)
    bias_only = KVMap(sibling_map.config, {k: torch.zeros_like(v) if k.endswith(".weight") else v
                                           for k, v in sibling_map.tensors.items()})

    def errors(kv_map) -> list[float]:
        mapped = MappedCache.from_source(source, kv_map, target, input_ids=ids, refresh_tokens=0)
        return [float((got[:, :, 1:] - want[:, :, 1:]).norm() / want[:, :, 1:].norm())
                for layer, keys, values in zip(mapped.layers, own.keys, own.values)
                for got, want in ((layer.keys, keys), (layer.values, values))]

    mapped, bias = errors(sibling_map), errors(bias_only)
    assert max(mapped) < 0.97 and all(m < b for m, b in zip(mapped, bias)), (mapped, bias)


# ----- the cache's own operations -----


def _kv(length: int, layers: int = 2, value: float = 1.0):
    return [(torch.full((1, 2, length, 4), value), torch.full((1, 2, length, 4), -value)) for _ in range(layers)]


@torch.no_grad()
def test_truncating_moves_the_next_positions_back_and_the_check_follows(identity):
    model, kv_map = identity
    prompt = torch.randint(0, 128, (1, 20))
    cache = MappedCache.from_source(model, kv_map, model, input_ids=prompt[:, :-1])
    assert cache.next_positions.tolist() == [19]
    for bad in (-1, 2.5, 20, True):  # never a silent cut from the end, nor a raw TypeError
        with pytest.raises(CacheMismatchError, match="whole number of positions in 0..19"):
            cache.truncate(bad)
    assert cache.get_seq_length() == 19
    cache.truncate(12)
    assert cache.get_seq_length() == 12 and cache.next_positions.tolist() == [12]
    with pytest.raises(CacheMismatchError, match="positions up to"):  # continuing at the old end is refused
        model(prompt[:, 19:], position_ids=torch.tensor([[19]]), **with_cache(model, cache))
    cache = MappedCache.from_source(model, kv_map, model, input_ids=prompt[:, :-1])
    cache.truncate(12)
    full = model(prompt).logits[:, -1]
    logits = model(prompt[:, 12:], position_ids=torch.arange(12, 20)[None], **with_cache(model, cache)).logits[:, -1]
    assert _relative_error(logits, full) < 1e-3 and cache.next_positions.tolist() == [20]


@torch.no_grad()
def test_a_copy_shares_the_tensors_but_extending_it_leaves_the_original_alone(identity):
    model, kv_map = identity
    prompt = torch.randint(0, 128, (1, 16))
    cache = MappedCache.from_source(model, kv_map, model, input_ids=prompt[:, :-1])
    twin = cache.copy()
    assert twin.layers[0].keys.data_ptr() == cache.layers[0].keys.data_ptr() and twin.kv_map is kv_map
    model(prompt[:, 15:], position_ids=torch.tensor([[15]]), **with_cache(model, twin))
    assert twin.get_seq_length() == 16 and cache.get_seq_length() == 15
    assert twin.next_positions.tolist() == [16] and cache.next_positions.tolist() == [15]
    with pytest.raises(CacheMismatchError):  # the original still checks its own first extension
        model(prompt[:, 15:], position_ids=torch.tensor([[3]]), **with_cache(model, cache))


def test_restore_puts_back_layers_tensors_and_positions_exactly():
    cache = MappedCache(_kv(5), next_positions=torch.tensor([5]))
    snapshot = cache.snapshot()
    before = [(layer.keys, layer.values) for layer in cache.layers]
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0, position_ids=torch.tensor([[5, 6, 7]]))
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 2)  # a layer the failed pass added
    assert len(cache.layers) == 3 and cache.get_seq_length() == 8
    cache.restore(snapshot)
    assert len(cache.layers) == 2 and cache.next_positions.tolist() == [5]
    assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, before))
    with pytest.raises(CacheMismatchError):  # the continuation check is armed again
        cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0, position_ids=torch.tensor([[9]]))


def test_restored_on_error_rolls_back_only_when_the_block_raises():
    cache = MappedCache(_kv(4))
    with pytest.raises(KeyboardInterrupt), cache.restored_on_error():
        cache.update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), 0)
        raise KeyboardInterrupt
    assert cache.get_seq_length() == 4
    with cache.restored_on_error():
        cache.update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), 0)
    assert cache.get_seq_length() == 6


def test_a_captured_cache_goes_in_as_it_is():
    from peft_kvcache.modeling.capture import CapturedKV

    pairs = _kv(3)
    cache = MappedCache(CapturedKV([k for k, _ in pairs], [v for _, v in pairs]))
    assert cache.layers[1].values.data_ptr() == pairs[1][1].data_ptr() and cache.next_positions is None
    assert torch.equal(cache.captured().keys[0], pairs[0][0])


# ----- input checks before the source runs, and the fingerprint memo -----


def test_new_weights_in_the_same_model_object_are_noticed(sibling_pair, sibling_map):
    source, target = sibling_pair
    other = tiny_model("qwen2", seed=1, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                       num_key_value_heads=3, intermediate_size=160)
    model = tiny_model("qwen2", seed=1, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                       num_key_value_heads=3, intermediate_size=160)
    ids = random_ids(1, 12, seed=40)[0][None]
    first = MappedCache.from_source(source, sibling_map, model, input_ids=ids)  # memoizes fingerprint and sink
    model.load_state_dict(tiny_model("qwen2", seed=9, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                                     num_key_value_heads=3, intermediate_size=160).state_dict())
    with pytest.raises(FingerprintMismatchError):
        MappedCache.from_source(source, sibling_map, model, input_ids=ids)
    model.load_state_dict(other.state_dict())  # back to the right weights: accepted, sink recomputed
    again = MappedCache.from_source(source, sibling_map, model, input_ids=ids)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(first.layers, again.layers))


def test_a_mapping_reads_the_targets_weights_version_once(sibling_pair, sibling_map, monkeypatch):
    """The fingerprint check and the sink memo share one `weights_key` (each read walks every parameter)."""
    from peft_kvcache.modeling import identity

    source, target = sibling_pair
    ids = random_ids(1, 12, seed=41)[0][None]
    MappedCache.from_source(source, sibling_map, target, input_ids=ids)  # memoizes fingerprints and the sink
    walks = []
    real = identity.weights_version
    monkeypatch.setattr(identity, "weights_version", lambda model: walks.append(model) or real(model))
    MappedCache.from_source(run_with_cache(source, ids), sibling_map, target, input_ids=ids)  # a held cache
    assert walks == [target]


@pytest.mark.parametrize("ids, match", [
    (torch.arange(10), "input_ids must be a \\[batch, seq\\]"),
    (torch.rand(1, 10), "integer token ids"),
    (torch.tensor([[1, 2, 500]]), "outside the vocabulary"),
    (torch.tensor([[1, -2, 3]]), "outside the vocabulary"),
    (torch.zeros(1, 0, dtype=torch.long), "empty"),
    ([[1, 2, 3], [4, 5]], "rectangular"),
])
def test_bad_ids_are_refused_before_the_source_runs(sibling_pair, sibling_map, monkeypatch, ids, match):
    source, target = sibling_pair
    monkeypatch.setattr(source, "forward", lambda *a, **k: pytest.fail("the source ran"))
    with pytest.raises(CacheMismatchError, match=match):
        MappedCache.from_source(source, sibling_map, target, input_ids=ids)


def test_bad_masks_and_offsets_are_refused_before_the_source_runs(sibling_pair, sibling_map, monkeypatch):
    source, target = sibling_pair
    monkeypatch.setattr(source, "forward", lambda *a, **k: pytest.fail("the source ran"))
    ids = torch.randint(0, 128, (2, 10))
    for mask, match in ((torch.ones(2, 9), "shape"), (torch.full((2, 10), 2), "0s and 1s"),
                        (torch.tensor([[1] * 5 + [0] * 5] * 2), "left-padded")):
        with pytest.raises(CacheMismatchError, match=match):
            MappedCache.from_source(source, sibling_map, target, input_ids=ids, attention_mask=mask)
    with pytest.raises(CacheMismatchError, match="position_offset"):
        MappedCache.from_source(source, sibling_map, target, input_ids=ids, position_offset=-3)


def test_a_source_that_is_neither_a_model_nor_a_cache_is_refused_and_captured_states_are_a_cache(sibling_pair,
                                                                                                  sibling_map):
    source, target = sibling_pair
    ids = random_ids(1, 12, seed=40)[0][None]
    with pytest.raises(CacheMismatchError, match="source model or its cache"):
        MappedCache.from_source("org/source", sibling_map, target, input_ids=ids)
    from_states = MappedCache.from_source(run_with_cache(source, ids), sibling_map, target, input_ids=ids)
    from_model = MappedCache.from_source(source, sibling_map, target, input_ids=ids)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(from_states.layers, from_model.layers))


def test_generate_with_a_prompt_no_longer_than_the_cache_says_so(sibling_pair, sibling_map):
    source, target = sibling_pair
    ids = random_ids(1, 20, seed=41)[0][None]
    cache = MappedCache.from_source(source, sibling_map, target, input_ids=ids[:, :-1])
    with pytest.raises(CacheMismatchError, match="whole conversation"):
        target.generate(input_ids=ids[:, -1:], **with_cache(target, cache), max_new_tokens=2)
