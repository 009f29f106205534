"""Same-shape maps as the identity plus a reduced-rank correction (``residual_rank``): the closed-form fit
(calibration.fit.reduce_rank), the factored apply path, and the option's checks."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import random_ids, tiny_model
from test_peft import peft_with_adapters

from peft_kvcache import MappedCache
from peft_kvcache.calibration.fit import SufficientStatistics, _Centered, reduce_rank, solve_ridge
from peft_kvcache.calibration.loop import calibrate, calibrate_adapters
from peft_kvcache.errors import CalibrationError
from peft_kvcache.maps.apply import map_cache, map_layer_factored, map_layer_heads, rotates_alike
from peft_kvcache.maps.kvmap import KVMap
from peft_kvcache.maps.provenance import NonlinearRecord
from peft_kvcache.modeling.capture import run_with_cache
from peft_kvcache.modeling.positions import RotarySpec, apply_rotary, position_free_keys, rotary_cos_sin


def _statistics(x: torch.Tensor, y: torch.Tensor, split: int) -> _Centered:
    train, heldout = (SufficientStatistics.empty(x.shape[1], {"y": y.shape[1]}) for _ in range(2))
    train.update(x[:split], {"y": y[:split]})
    heldout.update(x[split:], {"y": y[split:]})
    return _Centered(train, heldout, "y")


def _r2(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    residual = y - x @ weight - bias
    return float(1 - residual.square().sum() / (y - y.mean(0)).square().sum())


@pytest.fixture(scope="module")
def anisotropic():
    """Features with four strong and four faint directions; the target is the identity plus a rank-2 correction
    along the strong ones and a large correction along a faint one (which barely moves any prediction)."""
    generator = torch.Generator().manual_seed(0)
    scales = torch.tensor([10.0, 8.0, 6.0, 5.0, 0.01, 0.01, 0.01, 0.01], dtype=torch.float64)
    x = torch.randn(4000, 8, generator=generator, dtype=torch.float64) * scales
    correction = torch.zeros(8, 8, dtype=torch.float64)
    correction[0, 1], correction[1, 2] = 0.5, 0.4  # moves predictions a lot
    correction[5, 6] = 30.0  # large in the weight, tiny in the predictions
    y = x @ (torch.eye(8, dtype=torch.float64) + correction) + 0.05 * torch.randn(4000, 8, generator=generator,
                                                                                  dtype=torch.float64)
    return x, y, _statistics(x, y, 3000)


def test_reduced_rank_keeps_the_directions_that_carry_predictions(anisotropic):
    x, y, stats = anisotropic
    prior = torch.eye(8, dtype=torch.float64)
    full = solve_ridge(stats, torch.arange(8), torch.arange(8), 4, prior, (1e-8,))
    reduced = reduce_rank(stats, full, prior, 2, 4)
    assert torch.linalg.matrix_rank(reduced.weight - prior) == 2
    held_x, held_y = x[3000:], y[3000:]
    # the data-weighted choice loses (almost) nothing; truncating the weight's own singular values keeps the big,
    # useless correction and loses a predictive one
    assert _r2(reduced.weight, reduced.bias, held_x, held_y) > _r2(full.weight, full.bias, held_x, held_y) - 1e-3
    left, scales, right = torch.linalg.svd(full.weight - prior)
    plain = prior + left[:, :2] * scales[:2] @ right[:2]
    plain_bias = stats.my - stats.mx @ plain
    assert _r2(plain, plain_bias, held_x, held_y) < _r2(reduced.weight, reduced.bias, held_x, held_y) - 0.01


def test_reduced_rank_reports_its_own_held_out_r2(anisotropic):
    x, y, stats = anisotropic
    prior = torch.eye(8, dtype=torch.float64)
    full = solve_ridge(stats, torch.arange(8), torch.arange(8), 4, prior, (1e-8,))
    reduced = reduce_rank(stats, full, prior, 1, 4)
    held_x, held_y = x[3000:], y[3000:]
    for head in range(2):
        columns = slice(4 * head, 4 * head + 4)
        expected = _r2(reduced.weight[:, columns], reduced.bias[columns], held_x, held_y[:, columns])
        assert float(reduced.r2[head]) == pytest.approx(expected, abs=1e-6)
    assert float(reduced.r2.sum()) < float(full.r2.sum())  # rank 1 drops one of the two predictive directions
    assert reduce_rank(stats, full, prior, 8, 4) is full


def test_the_factored_layer_equals_its_dense_weight():
    generator = torch.Generator().manual_seed(1)
    heads, head_dim, rank = 3, 8, 4
    x = torch.randn(2, heads, 10, head_dim, generator=generator)
    down, up = torch.randn(heads * head_dim, rank, generator=generator), torch.randn(rank, heads * head_dim,
                                                                                     generator=generator)
    bias = torch.randn(heads * head_dim, generator=generator)
    dense = map_layer_heads([x], torch.eye(heads * head_dim) + down @ up, bias, heads, head_dim)
    torch.testing.assert_close(map_layer_factored(x, down, up, bias), dense, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rotary_dim, scaling, dtype", [(8, 1.0, torch.float32), (4, 1.3, torch.bfloat16)])
def test_factored_keys_rotated_alike_skip_the_round_trip_and_equal_it(rotary_dim, scaling, dtype):
    """Keys whose source rotation is the target's come out as the source keys plus the rotated correction: the same
    as un-rotating, mapping and rotating again (partial rotary, a yarn-like scaling, 16-bit cached keys)."""
    generator = torch.Generator().manual_seed(2)
    heads, head_dim, rank, seq = 3, 8, 2, 11
    spec = RotarySpec(1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim), scaling, head_dim)
    positions = torch.arange(3, 3 + seq)[None]
    cos, sin = rotary_cos_sin(spec, positions)
    keys = torch.randn(1, heads, seq, head_dim, generator=generator).to(dtype)
    free = position_free_keys(keys, spec, positions)
    down = torch.randn(heads * head_dim, rank, generator=generator)
    up, bias = torch.randn(rank, heads * head_dim, generator=generator), torch.randn(heads * head_dim,
                                                                                     generator=generator)
    round_trip = apply_rotary(map_layer_factored(free, down, up, bias), cos, sin)
    torch.testing.assert_close(map_layer_factored(free, down, up, bias, (keys, cos, sin)), round_trip,
                               atol=1e-4, rtol=1e-4)
    assert rotates_alike(spec, positions, spec, positions.clone())
    assert not rotates_alike(spec, positions, spec, positions + 1)
    other = RotarySpec(spec.inv_freq * 2, scaling, head_dim)
    assert not rotates_alike(spec, positions, other, positions)


@pytest.mark.parametrize("shift", [0, 5])
def test_a_factored_map_equals_its_dense_weights_at_the_same_and_at_other_positions(factored_maps, exact_matmuls,
                                                                                       shift):
    """At the source's own positions the factored keys take the short path; at others they are rotated anew."""
    model, maps = factored_maps
    kv_map = maps.to_adapter["strong"]
    dense_map = KVMap(copy.deepcopy(kv_map.config), kv_map.tensors)
    dense_map.config.calibration.options.residual_rank = 0
    ids = random_ids(1, 30, seed=4)[0][None]
    with model.disable_adapter():
        cache = run_with_cache(model, ids)
    keys, values = cache.keys, cache.values
    positions = torch.arange(ids.shape[1])[None]
    placements = [(torch.device("cpu"), torch.float32)] * len(keys)
    alike = rotates_alike(kv_map.source_rotary, positions, kv_map.target_rotary, positions + shift)
    assert alike == (shift == 0)  # the short path at the same positions, the round trip at others
    factored = map_cache(kv_map, keys, values, positions, positions + shift, placements)
    dense = map_cache(dense_map, keys, values, positions, positions + shift, placements)
    for (fk, fv), (dk, dv) in zip(factored, dense):
        torch.testing.assert_close(fk, dk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fv, dv, atol=1e-4, rtol=1e-4)


def test_a_factored_map_with_a_residual_mlp_head_runs_the_head(factored_maps, exact_matmuls):
    """Nonlinear heads on a reduced-rank map: the map runs its dense weights (identity plus correction) and the heads,
    never the factored path, which has no head."""
    model, maps = factored_maps
    kv_map = maps.to_adapter["strong"]
    width = kv_map.config.target_layout.layer_width
    gen = torch.Generator().manual_seed(0)
    head = {"w1": torch.randn(width, 8, generator=gen), "b1": torch.randn(8, generator=gen),
            "w2": torch.randn(8, width, generator=gen), "b2": torch.randn(width, generator=gen)}
    config = copy.deepcopy(kv_map.config)
    config.nonlinear = NonlinearRecord(keys=[1], values=[0], hidden=8)
    with_heads = KVMap(config, {**kv_map.tensors, **{f"{kind}.{t}.mlp.{p}": v for kind, t in (("keys", 1), ("values", 0))
                                                    for p, v in head.items()}})
    dense_config = copy.deepcopy(config)
    dense_config.calibration.options.residual_rank = 0
    dense = KVMap(dense_config, with_heads.tensors)
    ids = random_ids(1, 30, seed=4)[0][None]
    with model.disable_adapter():
        cache = run_with_cache(model, ids)
    positions = torch.arange(ids.shape[1])[None]
    placements = [(torch.device("cpu"), torch.float32)] * len(cache.keys)
    mapped = map_cache(with_heads, cache.keys, cache.values, positions, positions, placements)
    without = map_cache(kv_map, cache.keys, cache.values, positions, positions, placements)
    for (k, v), (dk, dv) in zip(mapped, map_cache(dense, cache.keys, cache.values, positions, positions, placements)):
        torch.testing.assert_close(k, dk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, dv, atol=1e-4, rtol=1e-4)
    assert with_heads.residual_rank == 0 and kv_map.residual_rank == 4
    assert not torch.allclose(mapped[1][0], without[1][0]) and not torch.allclose(mapped[0][1], without[0][1])
    torch.testing.assert_close(mapped[0][0], without[0][0], atol=1e-4, rtol=1e-4)  # no head: the same mapping


@pytest.fixture(scope="module")
def factored_maps():
    model = peft_with_adapters()
    return model, calibrate_adapters(model, random_ids(16, 48, seed=3), adapters=["strong"], residual_rank=4,
                                     progress=False)


def test_adapter_maps_fitted_with_a_rank_run_factored_and_equal_their_dense_weights(factored_maps, exact_matmuls):
    model, maps = factored_maps
    kv_map = maps.to_adapter["strong"]
    assert kv_map.residual_rank == 4 and kv_map.config.calibration.options.residual_rank == 4
    width = kv_map.config.target_layout.layer_width
    for name, tensor in kv_map.tensors.items():
        if name.endswith(".weight"):
            assert torch.linalg.matrix_rank(tensor.double() - torch.eye(width), atol=1e-4) <= 4, name
    ids = random_ids(1, 30, seed=9)[0][None]
    model.set_adapter("strong")
    with model.disable_adapter():
        base_cache = run_with_cache(model, ids)
    factored = MappedCache.from_source(base_cache, kv_map, model, input_ids=ids)
    dense_map = KVMap(copy.deepcopy(kv_map.config), kv_map.tensors)
    dense_map.config.calibration.options.residual_rank = 0  # the same weights through the dense path
    dense = MappedCache.from_source(base_cache, dense_map, model, input_ids=ids)
    for a, b in zip(factored.layers, dense.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4)


def test_a_rank_for_a_pair_with_another_rope_is_refused_before_any_model_runs(monkeypatch):
    """Same layout, other RoPE: a cross-shape pair, whose map does not correct an identity."""
    source = tiny_model("llama")
    target = tiny_model("llama", seed=1, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    monkeypatch.setattr(source, "forward", lambda *a, **k: pytest.fail("the source ran"))
    with pytest.raises(CalibrationError, match="same-shape pair"):
        calibrate(source, target, random_ids(4, 16), same_layer=True, residual_rank=2, progress=False)


@pytest.mark.parametrize("options, match", [
    (dict(residual_rank=16), "saves nothing on layers 32 wide"),  # two factors as costly as the dense weights
    (dict(same_layer=False, top_k=99), "top_k 99 exceeds"),
    (dict(same_layer=False, top_k=2, basis_rank=3), "basis_rank shares one basis"),
])
def test_adapter_options_that_cannot_fit_are_refused_before_any_model_runs(monkeypatch, options, match):
    model = peft_with_adapters()
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("the model ran"))
    monkeypatch.setattr(model.base_model.model, "forward", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(CalibrationError, match=match):
        calibrate_adapters(model, random_ids(4, 16), adapters=["strong"], progress=False, **options)


@pytest.mark.parametrize("options, match", [
    (dict(residual_rank=2), "needs same_layer=True"),
    (dict(residual_rank=2, same_layer=True, head_shards=2), "needs head_shards=1"),
    (dict(residual_rank=-1, same_layer=True), "non-negative"),
])
def test_bad_rank_options_are_named(options, match):
    model = tiny_model("llama")
    with pytest.raises(CalibrationError, match=match):
        calibrate(model, model, random_ids(4, 16), progress=False, **options)


def test_a_map_without_a_rank_or_with_a_useless_one_runs_dense(factored_maps):
    _, maps = factored_maps
    kv_map = maps.to_adapter["strong"]
    width = kv_map.config.target_layout.layer_width
    for rank, expected in ((0, 0), (width // 2, 0), (width // 2 - 1, width // 2 - 1)):
        config = copy.deepcopy(kv_map.config)
        config.calibration.options.residual_rank = rank
        assert KVMap(config, kv_map.tensors).residual_rank == expected


def test_fits_of_other_ranks_resume_from_the_same_checkpointed_statistics(tmp_path, monkeypatch):
    model = peft_with_adapters()
    data = random_ids(8, 32, seed=5)
    dense = calibrate_adapters(model, data, adapters=["strong"], reverse=False, checkpoint_dir=tmp_path,
                               progress=False).to_adapter["strong"]
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("the statistics were collected again"))
    progress = json.loads((tmp_path / "progress-rank0.json").read_text())
    assert 0 < progress["seconds"] <= dense.config.calibration.seconds
    # say the capture took 1000 s: the rank fitted from the finished checkpoint records that, not only its own fit
    (tmp_path / "progress-rank0.json").write_text(json.dumps({**progress, "seconds": 1000.0}))
    reduced = calibrate_adapters(model, data, adapters=["strong"], reverse=False, checkpoint_dir=tmp_path,
                                 residual_rank=2, progress=False).to_adapter["strong"]
    assert reduced.residual_rank == 2 and dense.residual_rank == 0
    assert not torch.equal(reduced.tensors["keys.1.weight"], dense.tensors["keys.1.weight"])
    assert 1000 <= reduced.config.calibration.seconds < 1000 + 60


def test_the_card_says_the_map_runs_as_the_identity_plus_factors(factored_maps):
    from peft_kvcache.maps.card import calibration_text

    _, maps = factored_maps
    config = maps.to_adapter["strong"].config
    assert "rank 4" in calibration_text(config)
    dense = copy.deepcopy(config)
    dense.calibration.options.residual_rank = 0
    assert "rank" not in calibration_text(dense)


@pytest.mark.parametrize("rank", [4, 0])
def test_a_map_placed_ahead_leaves_the_first_mapping_nothing_to_cast(factored_maps, rank):
    from peft_kvcache.maps.apply import map_cache, place_map

    _, maps = factored_maps
    config = copy.deepcopy(maps.to_adapter["strong"].config)
    config.calibration.options.residual_rank = rank
    kv_map = KVMap(config, maps.to_adapter["strong"].tensors)
    place_map(kv_map, torch.device("cpu"))
    placed = set(kv_map._placed)
    assert len(placed) == 2 * config.target_layout.num_layers
    layout = config.source_layout
    states = [torch.randn(1, layout.kv_heads, 6, layout.head_dim) for _ in range(layout.num_layers)]
    positions = torch.arange(6)[None]
    map_cache(kv_map, states, states, positions, positions, [(torch.device("cpu"), torch.float32)] * layout.num_layers)
    assert set(kv_map._placed) == placed


def test_a_factored_map_counts_the_multiply_adds_of_its_factors(factored_maps):
    _, maps = factored_maps
    kv_map = maps.to_adapter["strong"]
    layout = kv_map.config.target_layout
    dense = KVMap(copy.deepcopy(kv_map.config), kv_map.tensors)
    dense.config.calibration.options.residual_rank = 0
    assert dense.multiply_adds_per_token == 2 * layout.num_layers * layout.layer_width ** 2
    assert kv_map.multiply_adds_per_token == 2 * layout.num_layers * 2 * 4 * layout.layer_width


def _with_rank(kv_map: KVMap, rank: int, scale: float = 1.0) -> KVMap:
    """``kv_map`` run at residual ``rank``, its correction of the identity scaled by ``scale``."""
    config = copy.deepcopy(kv_map.config)
    config.calibration.options.residual_rank = rank
    width = config.target_layout.layer_width
    tensors = {name: torch.eye(width) + scale * (t - torch.eye(width)) if name.endswith(".weight") else t
               for name, t in kv_map.tensors.items()}
    return KVMap(config, tensors)


@pytest.fixture(scope="module")
def rank_candidates(factored_maps):
    model, _ = factored_maps
    data = random_ids(16, 48, seed=3)
    full = calibrate_adapters(model, data, adapters=["strong"], progress=False)
    near_full = calibrate_adapters(model, data, adapters=["strong"], residual_rank=14, progress=False)
    return model, full, near_full, random_ids(10, 40, seed=21)


def test_the_rank_kept_is_the_smallest_the_held_out_kl_cannot_tell_from_the_full_correction(rank_candidates):
    from peft_kvcache.calibration.rank import choose_adapter_ranks, choose_rank

    model, full, near_full, held_out = rank_candidates
    full_map = full.to_adapter["strong"]
    worse = _with_rank(full_map, 2, scale=3.0)  # a rank-2 correction three times too large: a clearly worse map
    candidates = {0: full, 2: type(full)(to_adapter={"strong": worse},
                                         to_base={"strong": _with_rank(full.to_base["strong"], 2, scale=3.0)}),
                  14: near_full}
    chosen = choose_adapter_ranks(candidates, model, held_out, continuation=8, progress=False)
    record = chosen.to_adapter["strong"].config.rank_choice
    assert record.examples == 10 and set(record.kl) == {"0", "2", "14"}
    assert record.minus_full["2"][1] > 0  # the worse map's KL minus the full's: its whole interval above zero...
    assert record.rank == min([int(r) for r, (_, low, _) in record.minus_full.items() if low <= 0], default=0)
    assert record.rank != 2  # ...so it is never kept
    assert chosen.to_adapter["strong"].residual_rank == record.rank
    kept = candidates[record.rank].to_adapter["strong"]
    assert all(torch.equal(t, kept.tensors[n]) for n, t in chosen.to_adapter["strong"].tensors.items())
    assert full_map.config.rank_choice is None and worse.config.rank_choice is None  # the candidates stay as given
    assert chosen.to_base["strong"].config.rank_choice is not None  # every direction chose
    # a candidate the held-out texts cannot tell from the full correction is kept (here: the same map)
    model.set_adapter("strong")
    same = near_full.to_adapter["strong"]
    picked = choose_rank({0: same, 14: same}, model, held_out, lambda ids: _base_cache(model, ids), continuation=8,
                         progress=False)
    assert picked.config.rank_choice.rank == 14 and picked.config.rank_choice.minus_full["14"] == [0, 0, 0]


def _base_cache(model, ids):
    with model.disable_adapter():
        return run_with_cache(model, ids)


def test_a_rank_choice_without_the_full_correction_or_with_a_mislabelled_rank_is_refused(rank_candidates,
                                                                                         monkeypatch):
    from peft_kvcache.calibration.rank import choose_adapter_ranks, choose_rank

    model, full, near_full, held_out = rank_candidates
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("a model ran"))
    with pytest.raises(CalibrationError, match="residual_rank=0"):
        choose_adapter_ranks({14: near_full}, model, held_out, progress=False)
    with pytest.raises(CalibrationError, match="residual_rank=4"):
        choose_rank({0: full.to_adapter["strong"], 4: near_full.to_adapter["strong"]}, model, held_out,
                    lambda ids: None, progress=False)


def test_the_rank_choice_survives_saving_and_the_card_shows_it(rank_candidates, tmp_path):
    from peft_kvcache.maps.config import RankRecord

    _, full, _, _ = rank_candidates
    kv_map = _with_rank(full.to_adapter["strong"], 14)
    kv_map.config.rank_choice = RankRecord(rank=14, examples=10, continuation=8, kl={"0": 0.01, "14": 0.0101},
                                           minus_full={"14": [0.0001, -0.0002, 0.0004]})
    kv_map.save_pretrained(tmp_path / "map")
    loaded = KVMap.from_pretrained(tmp_path / "map")
    assert loaded.config.rank_choice == kv_map.config.rank_choice and loaded.residual_rank == 14
    card = (tmp_path / "map" / "README.md").read_text()
    assert "rank **14**" in card and "| 14 | 0.01010 | +0.00010 [-0.00020, +0.00040] |" in card
