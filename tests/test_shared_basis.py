"""All source layers through one shared low-rank basis (``basis_rank``): the closed-form reduction across the target
layers (calibration.fit.share_basis) and the option's checks."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from conftest import random_ids

from peft_kvcache import KVMap
from peft_kvcache.calibration.distill import distill_map
from peft_kvcache.calibration.fit import LayerFit, SufficientStatistics, _Centered, share_basis, solve_ridge
from peft_kvcache.calibration.loop import calibrate
from peft_kvcache.calibration.nonlinear import fit_nonlinear_heads
from peft_kvcache.errors import CalibrationError, RecordError
from peft_kvcache.maps import apply
from peft_kvcache.maps.apply import map_cache
from peft_kvcache.maps.config import CalibrationConfig
from peft_kvcache.modeling.capture import run_with_cache

LAYERS, WIDTH, HEAD = 3, 4, 2  # target layers, their width, head size


@pytest.fixture(scope="module")
def shared():
    """Eight source features; every target layer reads the same two strong directions of them (each through its own
    readout) plus, in the last layer, a third direction of its own: a rank-2 basis serves the first two layers only."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5000, 8, generator=generator, dtype=torch.float64) * torch.linspace(4, 1, 8, dtype=torch.float64)
    basis = torch.randn(8, 2, generator=generator, dtype=torch.float64)
    ys = [x @ basis @ torch.randn(2, WIDTH, generator=generator, dtype=torch.float64) for _ in range(LAYERS)]
    ys[-1] = ys[-1] + 4 * x[:, 7:8] * torch.ones(1, WIDTH, dtype=torch.float64)
    y = torch.cat(ys, dim=1) + 0.05 * torch.randn(5000, LAYERS * WIDTH, generator=generator, dtype=torch.float64)
    return x[4000:], y[4000:], *_fits(x, y)


def _fits(x: torch.Tensor, y: torch.Tensor) -> tuple[_Centered, list[LayerFit]]:
    train, heldout = (SufficientStatistics.empty(x.shape[1], {"y": y.shape[1]}) for _ in range(2))
    train.update(x[:4000], {"y": y[:4000]})
    heldout.update(x[4000:], {"y": y[4000:]})
    stats = _Centered(train, heldout, "y")
    rows = torch.arange(x.shape[1])
    return stats, [LayerFit(list(range(2)), solve_ridge(stats, rows, torch.arange(t * WIDTH, (t + 1) * WIDTH), HEAD,
                                                        lambda_grid=(1e-8,)), []) for t in range(LAYERS)]


def _dense(fit: LayerFit) -> torch.Tensor:
    return fit.fit.weight if fit.basis is None else fit.basis @ fit.fit.weight


def _held_out_r2(fit: LayerFit, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    residual = (y - x @ _dense(fit) - fit.fit.bias).view(len(y), -1, HEAD).square().sum((0, 2))
    return 1 - residual / (y - y.mean(0)).view(len(y), -1, HEAD).square().sum((0, 2))


def test_a_shared_basis_is_one_projection_of_the_source_for_every_layer(shared):
    x, y, stats, fits = shared
    reduced = share_basis(stats, fits, 3, HEAD)
    assert all(f.basis is reduced[0].basis and f.basis.shape == (8, 3) and f.fit.weight.shape == (3, WIDTH)
               for f in reduced)  # one 3-dimensional basis, a readout per layer
    for t, fit in enumerate(reduced):  # the three directions every layer reads: nothing lost
        columns = slice(t * WIDTH, (t + 1) * WIDTH)
        assert float(_held_out_r2(fit, x, y[:, columns]).min()) > float(_held_out_r2(fits[t], x, y[:, columns]).min()) - 1e-3


def test_too_small_a_basis_loses_what_only_one_layer_reads_and_says_so(shared):
    x, y, stats, fits = shared
    reduced = share_basis(stats, fits, 2, HEAD)
    last = slice((LAYERS - 1) * WIDTH, LAYERS * WIDTH)
    measured = _held_out_r2(reduced[-1], x, y[:, last])
    assert float(measured.mean()) < float(_held_out_r2(fits[-1], x, y[:, last]).mean()) - 0.05
    for t, fit in enumerate(reduced):  # each layer's recorded R^2 is its own held-out R^2
        torch.testing.assert_close(fit.fit.r2, _held_out_r2(fit, x, y[:, t * WIDTH:(t + 1) * WIDTH]),
                                   atol=1e-6, rtol=0)
    with pytest.raises(CalibrationError, match="saves nothing"):
        share_basis(stats, fits, 8, HEAD)


def test_the_basis_follows_the_predictions_not_the_weights():
    """A faint source feature with a huge weight in one layer barely moves any prediction: the basis keeps the two
    directions every layer reads; the weights' own top singular directions would keep the faint one."""
    generator = torch.Generator().manual_seed(2)
    scales = torch.tensor([4.0, 3.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.01], dtype=torch.float64)
    x = torch.randn(5000, 8, generator=generator, dtype=torch.float64) * scales
    basis = torch.randn(8, 2, generator=generator, dtype=torch.float64)
    basis[7] = 0
    ys = [x @ basis @ torch.randn(2, WIDTH, generator=generator, dtype=torch.float64) for _ in range(LAYERS)]
    ys[0] = ys[0] + 50 * x[:, 7:8]
    y = torch.cat(ys, dim=1) + 0.01 * torch.randn(5000, LAYERS * WIDTH, generator=generator, dtype=torch.float64)
    stats, fits = _fits(x, y)
    held_x, held_y = x[4000:], y[4000:]
    reduced = share_basis(stats, fits, 2, HEAD)
    for t in range(LAYERS):
        columns = slice(t * WIDTH, (t + 1) * WIDTH)
        assert float(_held_out_r2(reduced[t], held_x, held_y[:, columns]).min()) > 0.95
    stacked = torch.cat([_dense(f) for f in fits], dim=1)
    _, _, right = torch.linalg.svd(stacked, full_matrices=False)
    plain = stacked @ right[:2].T @ right[:2]  # the weights' own top two directions
    bias = stats.my - stats.mx @ plain
    worst = min(float(_held_out_r2(LayerFit([], replace(fits[t].fit, weight=plain[:, columns], bias=bias[columns]), []),
                                   held_x, held_y[:, columns]).min())
                for t in range(LAYERS) for columns in [slice(t * WIDTH, (t + 1) * WIDTH)])
    assert worst < 0.9


def test_a_shared_basis_needs_one_set_of_source_layers(shared):
    _, _, stats, fits = shared
    mixed = [fits[0], LayerFit([0], fits[1].fit, []), fits[2]]
    with pytest.raises(CalibrationError, match="same source layers"):
        share_basis(stats, mixed, 2, HEAD)


@pytest.fixture(scope="module")
def basis_map(sibling_pair):
    source, target = sibling_pair
    return calibrate(source, target, random_ids(8, 48), top_k=source.config.num_hidden_layers, basis_rank=3,
                     progress=False)


def test_a_basis_map_maps_as_its_dense_weights_and_costs_less(sibling_pair, basis_map, tmp_path):
    """The factored path (the source projected once per kind, a readout per layer) gives what the same map's dense
    weights ``basis @ readout`` give through the per-layer path, survives a save and load, and counts its
    multiply-adds as factored."""
    source, target = sibling_pair
    layers, width = target.config.num_hidden_layers, basis_map.config.target_layout.layer_width
    config = copy.deepcopy(basis_map.config)
    config.calibration.options.basis_rank = 0
    dense = KVMap(config, {name: (basis_map.tensors[f"{name.split('.')[0]}.basis"] @ tensor
                                  if name.endswith(".weight") else tensor)
                           for name, tensor in basis_map.tensors.items() if not name.endswith(".basis")})
    basis_map.save_pretrained(tmp_path / "basis", chart=False)
    loaded = KVMap.from_pretrained(tmp_path / "basis")
    ids = random_ids(1, 40, seed=5)[0][None]
    source_kv = run_with_cache(source, ids)
    positions = torch.arange(ids.shape[1])[None]
    placements = [(torch.device("cpu"), torch.float32)] * layers

    def mapped(kv_map):
        return map_cache(kv_map, source_kv.keys, source_kv.values, positions, positions, placements,
                         compute_dtype=torch.float32)

    for (k, v), (dk, dv) in zip(mapped(loaded), mapped(dense)):
        torch.testing.assert_close(k, dk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, dv, atol=1e-4, rtol=1e-4)
    features = basis_map.tensors["keys.basis"].shape[0]
    assert loaded.multiply_adds_per_token == 2 * (features * 3 + layers * 3 * width)
    assert loaded.multiply_adds_per_token < dense.multiply_adds_per_token


def test_a_basis_map_drops_the_source_features_once_it_has_projected_them(sibling_pair, basis_map, monkeypatch):
    """Every layer reads the projection: the position-free features of the source layers are kept no longer than the
    first layer (not, as the last reader of every source layer, until the last one)."""
    source, target = sibling_pair
    ids = random_ids(1, 24, seed=3)[0][None]
    source_kv = run_with_cache(source, ids)
    positions = torch.arange(ids.shape[1])[None]
    placements = [(torch.device("cpu"), torch.float32)] * target.config.num_hidden_layers
    held = []
    real_heads = apply.SourceFeatures.heads

    def heads(self, kind, layer, device):
        held.append(self)
        return real_heads(self, kind, layer, device)

    monkeypatch.setattr(apply.SourceFeatures, "heads", heads)
    layers = apply.iter_map_cache(basis_map, source_kv.keys, source_kv.values, positions, positions, placements)
    next(layers)
    assert held and held[-1]._cache == {}  # both kinds projected at the first layer, their features gone
    calls = len(held)
    list(layers)
    assert len(held) == calls  # the later layers read the projection alone


def test_a_basis_needs_every_source_layer_and_is_refused_before_the_capture(sibling_pair, monkeypatch):
    source, target = sibling_pair
    monkeypatch.setattr(source, "forward", lambda *a, **k: pytest.fail("the source ran"))
    with pytest.raises(CalibrationError, match="top_k="):
        calibrate(source, target, random_ids(4, 16), top_k=1, basis_rank=3, progress=False)
    with pytest.raises(CalibrationError, match="same-shape"):
        calibrate(source, source, random_ids(4, 16), top_k=source.config.num_hidden_layers, basis_rank=3,
                  progress=False)


def test_a_basis_over_keys_and_values_together_takes_all_their_inputs(sibling_pair):
    """With joint kinds each source layer gives two inputs (its keys, its values): all of them is top_k = 2L."""
    source, target = sibling_pair
    layers = source.config.num_hidden_layers
    with pytest.raises(CalibrationError, match=f"top_k={2 * layers}"):
        calibrate(source, target, random_ids(4, 16), top_k=layers, basis_rank=3, joint_kinds=True, progress=False)
    kv_map = calibrate(source, target, random_ids(8, 48), top_k=2 * layers, basis_rank=3, joint_kinds=True,
                       progress=False)
    assert kv_map.config.basis_rank == 3


def test_a_basis_map_refuses_nonlinear_heads_which_extend_dense_layers(sibling_pair, basis_map):
    source, target = sibling_pair
    with pytest.raises(CalibrationError, match="basis"):
        fit_nonlinear_heads(basis_map, source, target, random_ids(4, 48), progress=False)


def test_distilling_a_basis_map_corrects_its_readouts_and_keeps_its_basis(sibling_pair, basis_map):
    """The correction of a basis map is of each layer's readout (the projection stays as fitted); what training kept
    is what the mapping path then reads: the held-out KL it recorded is the KL inference measures."""
    from test_distill import RECENT, SCORED, inference_kl

    source, target = sibling_pair
    chunk = random_ids(1, 48, seed=7)[0]
    distilled = distill_map(basis_map, source, target, [chunk] * 12, rank=2, steps=20, batch_size=1,
                            learning_rate=3e-3, recent_tokens=RECENT, scored_tokens=SCORED, eval_every=10,
                            progress=False)
    record = distilled.config.distillation
    assert record.kept_step > 0
    assert inference_kl(distilled, source, target, chunk) == pytest.approx(dict(record.heldout_kl)[record.kept_step],
                                                                           rel=1e-3)
    assert inference_kl(distilled, source, target, chunk) < inference_kl(basis_map, source, target, chunk) / 2
    changed = {name for name, t in basis_map.tensors.items() if not torch.equal(distilled.tensors[name], t)}
    assert changed and all(name.endswith((".weight", ".bias")) for name in changed)


def test_a_basis_map_config_reads_one_set_of_source_layers(basis_map):
    config = copy.deepcopy(basis_map.config)
    config.value_layers[0] = config.value_layers[0][:1]
    with pytest.raises(RecordError, match="shared basis"):
        config.validate()


@pytest.mark.parametrize("options, message", [(dict(basis_rank=-1), "non-negative"),
                                              (dict(basis_rank=2, same_layer=True), "needs same_layer=False")])
def test_basis_rank_is_checked(options, message):
    with pytest.raises(RecordError, match=message):
        CalibrationConfig(**options)


def test_a_fit_is_the_same_bytes_every_time(sibling_pair, basis_map):
    """Two calibrations of the same models on the same texts write the same tensors, bit for bit (a map's fingerprint
    is its file's hash: the sibling recipes' records resume only on maps fit as they were)."""
    source, target = sibling_pair
    again = calibrate(source, target, random_ids(8, 48), top_k=source.config.num_hidden_layers, basis_rank=3,
                      progress=False)
    assert again.tensors.keys() == basis_map.tensors.keys()
    assert all(torch.equal(again.tensors[name], t) for name, t in basis_map.tensors.items())
