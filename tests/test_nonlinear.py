"""Residual MLP heads: training and selection on synthetic features, the pipeline on tiny models, the
artifact round trip and the batched apply path."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import random_ids, tiny_model

from peft_kvcache import KVMap, MappedCache
from peft_kvcache.calibration.nonlinear import (
    RowReservoir,
    fit_nonlinear_heads,
    keep_mlp,
    train_residual_mlp,
    weak_layers,
)
from peft_kvcache.errors import ArtifactError, CalibrationError
from peft_kvcache.maps.apply import map_cache
from peft_kvcache.modeling._compat import output_cache
from peft_kvcache.modeling.positions import positions_from_mask


def linear_fit(x_train, y_train, x):
    """Least squares with a bias (what the ridge map gives with a small lambda)."""
    ones = lambda a: torch.cat([a, torch.ones(a.shape[0], 1)], 1)  # noqa: E731
    solution = torch.linalg.lstsq(ones(x_train).double(), y_train.double()).solution
    return (ones(x).double() @ solution).float()


def synthetic(kind: str, n: int = 2400, width: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=generator)
    a = torch.randn(width, width, generator=generator)
    y = torch.tanh(1.5 * x) @ a if kind == "hard" else x @ a + 1.0  # saturating target vs an exactly linear one
    train, heldout = slice(0, 1600), slice(1600, n)
    lin = linear_fit(x[train], y[train], x)
    return lin[train], y[train], lin[heldout], y[heldout]


def test_mlp_recovers_held_out_error_where_linear_is_weak():
    fit = train_residual_mlp(*synthetic("hard"), hidden=64, steps=300)
    assert fit.r2_linear < 0.9
    gap = 1 - fit.r2_linear
    assert fit.r2_mlp - fit.r2_linear > 0.5 * gap  # recovers most of the held-out gap
    assert keep_mlp(fit, min_gain=0.01)


def test_mlp_is_not_selected_where_linear_is_exact():
    fit = train_residual_mlp(*synthetic("linear"), hidden=64, steps=300)
    assert fit.r2_linear > 0.9999
    assert not keep_mlp(fit, min_gain=0.01)


def test_reservoir_is_a_bounded_uniform_sample():
    reservoir = RowReservoir(100, seed=0)
    for start in range(0, 10_000, 500):
        reservoir.add(torch.arange(start, start + 500, dtype=torch.float32)[:, None])
    (rows,) = reservoir.rows()
    assert rows.shape == (100, 1) and reservoir.seen == 10_000 and rows.unique().numel() == 100
    assert 3000 < float(rows.mean()) < 7000  # drawn from the whole stream, not its head or tail


@pytest.fixture(scope="module")
def pair():
    source = tiny_model("qwen2", seed=0)
    target = tiny_model("qwen2", seed=1, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                        num_key_value_heads=3, intermediate_size=160)
    sequences = random_ids(10, 40, seed=2)
    return source, target, sequences, KVMap.calibrate(source, target, sequences, progress=False)


@pytest.fixture(scope="module")
def nonlinear_map(pair):
    source, target, sequences, kv_map = pair
    return fit_nonlinear_heads(kv_map, source, target, sequences, r2_threshold=1.1, hidden=32, steps=80,
                               max_rows=512, progress=False)


def test_a_map_fitted_per_head_shard_is_refused_before_any_model_runs(pair):
    _, _, sequences, kv_map = pair
    sharded = copy.deepcopy(kv_map)
    options = sharded.config.calibration.options
    sharded.config.calibration.options = type(options)(**{**vars(options), "head_shards": 3})
    with pytest.raises(CalibrationError, match="head_shards 3"):
        fit_nonlinear_heads(sharded, None, None, sequences, progress=False)  # no model is touched


def test_weak_layers_follow_the_threshold(pair):
    kv_map = pair[3]
    assert weak_layers(kv_map, "keys", 2.0) == [0, 1, 2]
    assert weak_layers(kv_map, "keys", -10.0) == []


def test_fit_on_tiny_models_keeps_only_improving_heads(nonlinear_map):
    info = nonlinear_map.config.nonlinear
    assert len(info.candidates) == 6
    for row in info.candidates:
        assert row.kept == (row.r2_mlp >= row.r2_linear + info.min_gain)
        assert (row.layer in info.layers(row.kind)) == row.kept
    assert info.keys or info.values  # random tiny models: KV are nonlinear in the source's, the MLP helps


def test_linear_map_stays_linear_where_it_is_exact():
    model = tiny_model("llama", seed=4, num_hidden_layers=1)
    sequences = random_ids(6, 24, seed=3)
    kv_map = KVMap.calibrate(model, model, sequences, progress=False)  # same model: identity prior, R^2 ~ 1
    out = fit_nonlinear_heads(kv_map, model, model, sequences, r2_threshold=1.1, hidden=16, steps=40,
                              max_rows=256, progress=False)
    assert out.config.nonlinear.keys == [] and out.config.nonlinear.values == []
    assert not any(".mlp." in name for name in out.tensors)


def test_artifact_round_trip_with_mlp_tensors(nonlinear_map, tmp_path):
    folder = nonlinear_map.save_pretrained(tmp_path / "map", chart=False)
    loaded = KVMap.from_pretrained(folder)
    assert loaded.config.nonlinear == nonlinear_map.config.nonlinear
    assert set(loaded.tensors) == set(nonlinear_map.tensors)
    assert any(".mlp." in name for name in loaded.tensors)
    for name, tensor in nonlinear_map.tensors.items():
        assert torch.equal(loaded.tensors[name], tensor)
    # a config whose hidden width disagrees with the tensors is refused at load time
    config = json.loads((folder / "config.json").read_text())
    config["nonlinear"]["hidden"] += 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="mlp"):
        KVMap.from_pretrained(folder)
    config["nonlinear"]["hidden"] -= 1
    config["nonlinear"]["keys"] = [7]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="nonlinear.keys"):
        KVMap.from_pretrained(folder)


def test_apply_path_adds_the_mlp_residual_only_on_its_layers(pair, nonlinear_map):
    source, target, _, linear = pair
    ids = random_ids(2, 12, seed=9)
    mask = torch.ones(2, 12, dtype=torch.long)
    captured = output_cache(source(input_ids=torch.stack(ids), use_cache=True))
    keys = [layer.keys for layer in captured.layers]
    values = [layer.values for layer in captured.layers]
    positions = positions_from_mask(mask)
    placements = [(torch.device("cpu"), torch.float32)] * 3
    with_mlp = map_cache(nonlinear_map, keys, values, positions, positions, placements)
    plain = map_cache(linear, keys, values, positions, positions, placements)
    info = nonlinear_map.config.nonlinear
    for t, ((k, v), (k0, v0)) in enumerate(zip(with_mlp, plain)):
        assert k.shape == k0.shape == (2, 3, 12, 32) and v.shape == v0.shape
        assert torch.equal(k, k0) != (t in info.keys)
        assert torch.equal(v, v0) != (t in info.values)
    cache = MappedCache.from_source(source, nonlinear_map, target, input_ids=torch.stack(ids))
    assert cache.get_seq_length() == 12


def test_the_comparison_says_which_maps_heads_cannot_extend_and_measures_the_others(nonlinear_map):
    """A map whose layers read a shared basis gets no heads: the benchmark records why instead of failing, and its
    table lists the maps it measured."""
    from benchmarks import nonlinear

    assert nonlinear.skipped("plain", nonlinear_map) is None
    with_basis = SimpleNamespace(config=copy.deepcopy(nonlinear_map.config))  # what skipped reads of a map
    with_basis.config.calibration.options.basis_rank = 4
    entry = nonlinear.skipped("basis", with_basis)
    assert "shared basis (basis_rank 4)" in entry["skipped"]
    difference = {"metric": "normalized", "a": "nonlinear", "difference": 0.01, "low": -0.01, "high": 0.03}
    tried = [{"kind": "keys", "layer": 1, "r2_linear": 0.8, "r2_mlp": 0.85}, {"kind": "values", "layer": 2,
                                                                            "r2_linear": 0.7, "r2_mlp": 0.69}]
    measured = {"map": "top4", "nonlinear": {"keys": [1], "values": [], "candidates": tried},
                "tasks": {"continuation": {"nonlinear_minus_linear": [difference]}}}
    text = nonlinear.markdown([entry, measured])
    assert "| top4 | 2 (largest R^2 gain +0.0500) | 1 / 0 | continuation |" in text
    assert "basis: not measured here; its layers read a shared" in text
