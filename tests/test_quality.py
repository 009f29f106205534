"""The quality gate (per-layer attention cosine, predicted retention), the min_quality fallback and the
per-request context check, on tiny random models."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import random_ids, tiny_model

from peft_kvcache import KVMap, MappedCache
from peft_kvcache.calibration.gate import measure_quality, predicted_retention
from peft_kvcache.errors import QualityError
from peft_kvcache.maps.config import GateRecord
from peft_kvcache.modeling._compat import with_cache
from peft_kvcache.modeling.capture import run_with_cache
from peft_kvcache.runtime.check import ContextCheck, check_context, meets_quality, prefill_context


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=3)


@pytest.fixture(scope="module")
def identity_map(model):
    """An exact identity map from the model to itself (source layer t -> target layer t, W = I, b = 0)."""
    kv_map = KVMap.calibrate(model, model, random_ids(6, 24), progress=False)
    config = copy.deepcopy(kv_map.config)
    layers = config.target_layout.num_layers
    config.key_layers = [[t] for t in range(layers)]
    config.value_layers = [[t] for t in range(layers)]
    width = config.target_layout.layer_width
    tensors = {k: v for k, v in kv_map.tensors.items() if k.endswith("inv_freq")}
    for kind in ("keys", "values"):
        for t in range(layers):
            tensors[f"{kind}.{t}.weight"] = torch.eye(width)
            tensors[f"{kind}.{t}.bias"] = torch.zeros(width)
    return KVMap(config, tensors)


def noisy(kv_map: KVMap, scale: float, seed: int = 0) -> KVMap:
    generator = torch.Generator().manual_seed(seed)
    tensors = {k: (v + scale * torch.randn(v.shape, generator=generator) if k.endswith(".weight") else v.clone())
               for k, v in kv_map.tensors.items()}
    return KVMap(copy.deepcopy(kv_map.config), tensors)


def _with_prediction(kv_map: KVMap, value: float) -> KVMap:
    layers = kv_map.config.target_layout.num_layers
    kv_map.config.quality.gate = GateRecord(value, [1.0] * layers, [0.5] * layers, sequences=1, query_tokens=4)
    return kv_map


def test_gate_cosine_is_one_for_identity_and_lower_for_a_noisy_map(model, identity_map):
    sequences = random_ids(3, 28, seed=5)
    good = measure_quality(identity_map, model, model, sequences, query_tokens=8, progress=False, write=False)
    assert all(c > 0.9999 for c in good.attention_cosine_per_layer)
    assert good.predicted_retention == pytest.approx(1.0, abs=1e-3)
    bad_map = noisy(identity_map, 1.0)
    bad = measure_quality(bad_map, model, model, sequences, query_tokens=8, progress=False)
    assert all(b < g - 0.01 for b, g in zip(bad.attention_cosine_per_layer, good.attention_cosine_per_layer))
    assert bad.predicted_retention < good.predicted_retention - 0.05
    assert bad_map.config.quality.predicted_retention == bad.predicted_retention  # written to the config


def test_gate_figures_survive_save_and_show_on_the_card(model, identity_map, tmp_path):
    kv_map = noisy(identity_map, 0.0)
    measure_quality(kv_map, model, model, random_ids(2, 20, seed=6), query_tokens=4, progress=False)
    folder = kv_map.save_pretrained(tmp_path / "map")
    loaded = KVMap.from_pretrained(folder)
    assert loaded.config.quality.predicted_retention == kv_map.config.quality.predicted_retention
    assert "predicted_retention" in (folder / "README.md").read_text()


def test_predicted_retention_formula():
    assert predicted_retention([1.0, 1.0], [0.5, 0.9]) == 1.0
    assert predicted_retention([0.5], [0.5]) == 0.0
    assert predicted_retention([0.4], [0.6]) < 0


def test_below_the_bar_the_targets_own_prefill_serves(model, identity_map):
    kv_map = _with_prediction(noisy(identity_map, 0.5), 0.2)
    prompt = random_ids(1, 16, seed=7)[0][None]
    assert not meets_quality(kv_map, 0.5) and meets_quality(kv_map, 0.1) and meets_quality(kv_map, 0.2)
    cache = prefill_context(model, prompt[:, :-1])
    own = run_with_cache(model, prompt[:, :-1])
    for layer, k, v in zip(cache.layers, own.keys, own.values):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    with torch.no_grad():
        logits = model(input_ids=prompt[:, -1:], **with_cache(model, cache)).logits[0, -1]
        full = model(input_ids=prompt).logits[0, -1]
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bar", [float("nan"), "0.5", None, True])
def test_the_bar_itself_must_be_a_number(identity_map, bar):
    with pytest.raises(QualityError, match="min_quality"):
        meets_quality(_with_prediction(noisy(identity_map, 0.0), 0.9), bar)


def test_a_missing_or_non_finite_prediction_never_passes_the_bar(identity_map):
    with pytest.raises(QualityError, match="measure_quality"):
        meets_quality(identity_map, 0.5)
    kv_map = _with_prediction(noisy(identity_map, 0.0), 0.9)
    kv_map.config.quality.gate.predicted_retention = float("nan")  # in memory: load refuses it already
    with pytest.raises(QualityError, match="no finite predicted retention"):
        meets_quality(kv_map, 0.5)


def corrupted(kv_map: KVMap) -> KVMap:
    """Keys that grab all the attention and huge random values: a confidently wrong mapped context."""
    generator = torch.Generator().manual_seed(1)
    tensors = {k: v.clone() for k, v in kv_map.tensors.items()}
    for name in list(tensors):
        if name.startswith("keys.") and name.endswith(".weight"):
            tensors[name] *= 20
        if name.startswith("values.") and name.endswith(".bias"):
            tensors[name] = 200 * torch.randn(tensors[name].shape, generator=generator)
    return KVMap(copy.deepcopy(kv_map.config), tensors)


def test_context_check_passes_a_good_map_and_flags_a_corrupted_one(model, identity_map, caplog):
    # A random tiny model predicts near-uniformly (loss ~ log 128 whatever the context), so the margin is
    # scaled down to its logit range: the corrupted map costs ~0.15 nats here, the identity map ~0.
    prompt = random_ids(1, 33, seed=9)[0][None]
    context = prompt[:, :-1]
    check = ContextCheck(tokens=8, margin=0.05)
    mapped = MappedCache.from_source(model, identity_map, model, input_ids=context)
    good = check_context(mapped, model, context, check)
    assert good.action == "mapped" and not good.flagged and good.cache.get_seq_length() == context.shape[1]
    bad = MappedCache.from_source(model, corrupted(identity_map), model, input_ids=context)
    with caplog.at_level(logging.WARNING, logger="peft_kvcache.runtime.check"):
        fallback = check_context(bad, model, context, check)
    assert fallback.action == "prefill" and fallback.flagged
    assert any("fallback" in r.getMessage() for r in caplog.records)
    own = run_with_cache(model, context)
    assert all(torch.equal(layer.keys, k) for layer, k in zip(fallback.cache.layers, own.keys))
    dropped = check_context(bad, model, context, ContextCheck(8, 0.05, "drop_middle"))
    assert dropped.kept_positions.tolist() == [0] + list(range(24, 32))
    # it stands for the whole context and holds 9 positions of it, so generate() continues at the true position
    assert dropped.cache.get_seq_length() == 32 and dropped.cache.dropped_positions == 32 - 9
    with torch.no_grad():
        direct = model(input_ids=prompt[:, -1:], position_ids=dropped.next_positions[:, None],
                       **with_cache(model, dropped.cache.copy())).logits[0, -1].argmax()
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=dropped.cache,
                         max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == prompt.shape[1] + 3 and out[0, prompt.shape[1]] == direct
    with pytest.raises(QualityError, match="per-request check"):
        check_context(bad, model, context, ContextCheck(8, 0.05, "raise"))
    assert bad.get_seq_length() == context.shape[1]  # the mapped cache itself is left as it was


def test_a_source_cache_placed_at_an_offset_is_mapped_from_its_own_positions(model, identity_map, exact_matmuls):
    """A library cache knows where it sits (prefilled at a position_offset): its keys are un-rotated there, not at 0,
    so the identity map gives them back (the sink aside: the target computes it); a cache of another kind, or one at
    offset 0, maps as before."""
    from peft_kvcache.errors import CacheMismatchError

    ids = random_ids(1, 20, seed=5)[0][None]
    for offset in (0, 7):
        source = prefill_context(model, ids, position_offset=offset)
        mapped = MappedCache.from_source(source, identity_map, model, input_ids=ids, position_offset=offset,
                                         refresh_tokens=0)
        assert mapped.next_positions.tolist() == [20 + offset]
        for ours, theirs in zip(mapped.layers, source.layers):
            torch.testing.assert_close(ours.keys[:, :, 1:], theirs.keys[:, :, 1:], atol=1e-4, rtol=1e-4)
    held = prefill_context(model, ids)
    held.hold_only(torch.tensor([0, 18, 19]), [(layer.keys[:, :, [0, 18, 19]], layer.values[:, :, [0, 18, 19]])
                                               for layer in held.layers])
    with pytest.raises(CacheMismatchError, match="only some"):
        MappedCache.from_source(held, identity_map, model, input_ids=ids, refresh_tokens=0)
