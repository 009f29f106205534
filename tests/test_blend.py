"""Blending a same-shape map toward the source cache (blend.py), on tiny random models."""

import pytest
import torch
from conftest import random_ids, tiny_model

from peft_kvcache import KVMap, MappedCache
from peft_kvcache.calibration.blend import blend_toward_source, choose_blend, source_cache_of
from peft_kvcache.errors import CalibrationError
from peft_kvcache.modeling.capture import run_with_cache


@pytest.fixture(scope="module")
def pair():
    """Two same-shape models: a target that is the source with perturbed K/V projections (a stand-in for an
    adapter), and the ridge map between them."""
    source = tiny_model("llama", seed=0)
    target = tiny_model("llama", seed=0)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in target.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.add_(0.3 * proj.weight.std() * torch.randn(proj.weight.shape, generator=generator))
    target.config._name_or_path = "tiny-llama-perturbed"
    return source, target, KVMap.calibrate(source, target, random_ids(12, 48), progress=False)


def _mapped_states(kv_map, source, target, ids):
    cache = MappedCache.from_source(source, kv_map, target, input_ids=ids, verify_models=False)
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_blend_endpoints_are_the_map_and_the_source_cache(pair, exact_matmuls):
    source, target, kv_map = pair
    ids = random_ids(1, 20, seed=9)[0][None]
    own = _mapped_states(kv_map, source, target, ids)
    for (k1, v1), (k2, v2) in zip(own, _mapped_states(blend_toward_source(kv_map, 1.0, 1.0), source, target, ids)):
        torch.testing.assert_close(k1, k2)
        torch.testing.assert_close(v1, v2)
    copied = _mapped_states(blend_toward_source(kv_map, 0.0, 0.0), source, target, ids)
    captured = run_with_cache(source, ids)
    sink = kv_map.config.sink_tokens
    for (k, v), k_src, v_src in zip(copied, captured.keys, captured.values):  # past the target's own sink
        torch.testing.assert_close(k[:, :, sink:], k_src[:, :, sink:], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v[:, :, sink:], v_src[:, :, sink:], atol=1e-5, rtol=1e-4)
    halfway = _mapped_states(blend_toward_source(kv_map, 0.5, 0.5), source, target, ids)
    for (k, v), (k1, v1), (k0, v0) in zip(halfway, own, copied):  # linear in alpha
        torch.testing.assert_close(v, (v1 + v0) / 2, atol=1e-5, rtol=1e-4)


def test_choose_blend_keeps_the_map_when_it_is_right_and_drops_it_when_it_is_noise(pair):
    source, target, kv_map = pair
    heldout = random_ids(3, 40, seed=11)
    chosen = choose_blend(kv_map, target, heldout, source_cache_of(source), continuation=8, progress=False)
    blend = chosen.config.blend
    scores = blend.scores
    assert blend.examples == 3 and len(scores) == 2 * len(blend.grid) - 1
    assert blend.criterion == "kl"
    assert scores[f"keys={blend.keys},values={blend.values}"]["kl"] == min(s["kl"] for s in scores.values())
    assert scores["keys=1.0,values=1.0"]["kl"] < scores["keys=1.0,values=0.0"]["kl"]  # the map helps here
    # A map whose value correction is pure noise: the blend must fall back to the source's values.
    noisy = dict(kv_map.tensors)
    generator = torch.Generator().manual_seed(0)
    for t in range(kv_map.config.target_layout.num_layers):
        weight = noisy[f"values.{t}.weight"]
        noisy[f"values.{t}.weight"] = weight + 3 * weight.std() * torch.randn(weight.shape, generator=generator)
    bad = KVMap(kv_map.config, noisy)
    assert choose_blend(bad, target, heldout, source_cache_of(source), continuation=8,
                        progress=False).config.blend.values == 0.0
    by_nll = choose_blend(kv_map, target, heldout, source_cache_of(source), continuation=8, criterion="nll",
                          progress=False).config.blend
    assert by_nll.scores[f"keys={by_nll.keys},values={by_nll.values}"]["nll"] == min(
        s["nll"] for s in by_nll.scores.values())


def test_blend_is_refused_where_it_has_no_meaning(pair, sibling_map):
    _, _, kv_map = pair
    with pytest.raises(CalibrationError, match="same-shape"):
        blend_toward_source(sibling_map, 1.0, 0.5)
    with pytest.raises(CalibrationError, match=r"in \[0, 1\]"):
        blend_toward_source(kv_map, 1.5, 1.0)


def test_blend_survives_save_and_load(pair, tmp_path):
    source, target, kv_map = pair
    chosen = choose_blend(kv_map, target, random_ids(2, 30, seed=4), source_cache_of(source), continuation=6,
                          grid=(0.0, 1.0), progress=False)
    chosen.save_pretrained(tmp_path)
    loaded = KVMap.from_pretrained(tmp_path)
    assert loaded.config.blend == chosen.config.blend
    torch.testing.assert_close(loaded.tensors["values.0.weight"], chosen.tensors["values.0.weight"])
    card = (tmp_path / "README.md").read_text()
    blend = chosen.config.blend
    assert f"**{blend.keys}** for keys and **{blend.values}** for values" in card
