import pytest
import torch
from conftest import CALIBRATION_OPTIONS, calibration_pair, random_ids

from peft_kvcache import KVMap
from peft_kvcache.calibration.fit import SufficientStatistics, _Centered, fit_layers, solve_ridge
from peft_kvcache.errors import CalibrationError, NumericalError
from peft_kvcache.modeling.layout import KVLayout


def _stats(x, y):
    stats = SufficientStatistics.empty(x.shape[1], {"t": y.shape[1]})
    stats.update(x, {"t": y})
    return stats


def test_statistics_over_two_chunks_equal_statistics_over_the_whole():
    x, y = torch.randn(300, 6), torch.randn(300, 4)
    whole = _stats(x, y)
    chunked = SufficientStatistics.empty(6, {"t": 4})
    chunked.update(x[:120], {"t": y[:120]})
    chunked.update(x[120:], {"t": y[120:]})
    merged = _stats(x[:120], y[:120]).merge(_stats(x[120:], y[120:]))
    for other in (chunked, merged):
        for key, value in whole.state_dict().items():
            torch.testing.assert_close(other.state_dict()[key], value, rtol=1e-12, atol=1e-9)
    # Memory is fixed by the feature sizes, not by the number of rows.
    assert {k: tuple(v.shape) for k, v in chunked.state_dict().items()} == {
        k: tuple(v.shape) for k, v in SufficientStatistics.empty(6, {"t": 4}).state_dict().items()}


def test_non_finite_features_are_refused():
    stats = SufficientStatistics.empty(3, {"t": 2})
    with pytest.raises(NumericalError):
        stats.update(torch.tensor([[1.0, float("nan"), 0.0]]), {"t": torch.zeros(1, 2)})


@pytest.mark.parametrize("with_prior", [False, True])
def test_ridge_matches_a_direct_least_squares_solution(with_prior):
    """Closed form from statistics == lstsq on the centred, lambda-augmented system built from raw rows."""
    torch.manual_seed(0)
    n, d, e = 400, 8, 8
    x = torch.randn(n, d, dtype=torch.float64) * torch.linspace(0.1, 3, d) + 2.0
    true = torch.randn(d, e, dtype=torch.float64)
    y = x @ true + 0.5 * torch.randn(n, e, dtype=torch.float64) + 1.0
    train, heldout = _stats(x[:300], y[:300]), _stats(x[300:], y[300:])
    stats = _Centered(train, heldout, "t")
    prior = torch.eye(d, dtype=torch.float64) if with_prior else None
    fit = solve_ridge(stats, torch.arange(d), torch.arange(e), head_size=e, prior=prior, lambda_grid=(0.5,))
    lam = float(fit.lambdas[0])

    xc, yc = x[:300] - x[:300].mean(0), y[:300] - y[:300].mean(0)
    p = prior if prior is not None else torch.zeros(d, e, dtype=torch.float64)
    # ||Y - XW||^2 + lam ||W - P||^2 as one least-squares problem on stacked rows.
    a = torch.cat([xc, lam**0.5 * torch.eye(d, dtype=torch.float64)])
    b = torch.cat([yc, lam**0.5 * p])
    direct = torch.linalg.lstsq(a, b).solution
    torch.testing.assert_close(fit.weight, direct, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(fit.bias, y[:300].mean(0) - x[:300].mean(0) @ direct, rtol=1e-8, atol=1e-8)

    pred = x[300:] @ direct + fit.bias
    r2 = 1 - ((y[300:] - pred) ** 2).sum() / ((y[300:] - y[300:].mean(0)) ** 2).sum()
    torch.testing.assert_close(fit.r2[0], r2, rtol=1e-8, atol=1e-8)


def test_lambda_is_chosen_per_head_on_held_out_error():
    """A noisy head needs strong shrinkage, a clean one almost none."""
    torch.manual_seed(1)
    n, d = 200, 30
    x = torch.randn(n, d, dtype=torch.float64)
    clean = x @ torch.randn(d, 2, dtype=torch.float64)
    noisy = 0.05 * x[:, :1].repeat(1, 2) + 3 * torch.randn(n, 2, dtype=torch.float64)
    y = torch.cat([clean, noisy], dim=1)
    stats = _Centered(_stats(x[:60], y[:60]), _stats(x[60:], y[60:]), "t")
    fit = solve_ridge(stats, torch.arange(d), torch.arange(4), head_size=2)
    assert fit.lambdas[0] < fit.lambdas[1]
    assert fit.r2[0] > 0.99


def test_identity_prior_recovers_the_identity_for_identical_features():
    x = torch.randn(50, 6, dtype=torch.float64)
    stats = _Centered(_stats(x[:40], x[:40]), _stats(x[40:], x[40:]), "t")
    fit = solve_ridge(stats, torch.arange(6), torch.arange(6), head_size=3, prior=torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(fit.weight, torch.eye(6, dtype=torch.float64), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("top_k", [1, 2])
def test_layer_selection_finds_the_source_layers_that_predict_each_target_layer(top_k):
    torch.manual_seed(2)
    src, tgt = KVLayout(4, 2, 4), KVLayout(3, 1, 6)
    n = 600
    x = torch.randn(n, src.num_layers * src.layer_width, dtype=torch.float64)
    drivers = {0: [3], 1: [0], 2: [2]} if top_k == 1 else {0: [1, 3], 1: [0, 2], 2: [2, 3]}
    ys = []
    for t in range(tgt.num_layers):
        inputs = torch.cat([x[:, s * 8:(s + 1) * 8] for s in drivers[t]], dim=1)
        ys.append(inputs @ torch.randn(inputs.shape[1], 6, dtype=torch.float64) + 0.01 * torch.randn(n, 6))
    y = torch.cat(ys, dim=1)
    fits = fit_layers(_stats(x[:450], y[:450]), _stats(x[450:], y[450:]), "t", src, tgt, top_k=top_k)
    assert [f.source_layers for f in fits] == [sorted(drivers[t]) for t in range(3)]
    assert all(float(f.fit.r2.min()) > 0.99 for f in fits)


def test_too_few_tokens_for_a_held_out_split_is_a_calibration_error():
    x = torch.randn(5, 4)
    with pytest.raises(CalibrationError, match="held-out"):
        _Centered(_stats(x, x), SufficientStatistics.empty(4, {"t": 4}), "t")


def test_batched_calibration_ignores_the_padding():
    """Left-padded batches of unequal sequences give the statistics (and the map) of one sequence at a time."""
    from conftest import random_ids, tiny_model

    from peft_kvcache import KVMap

    source, target = tiny_model("qwen2", seed=0), tiny_model("llama", seed=1, num_hidden_layers=3)
    data = [ids[: 20 + 7 * (i % 4)] for i, ids in enumerate(random_ids(10, 48, seed=3))]  # 4 different lengths
    one = KVMap.calibrate(source, target, data, batch_size=1, progress=False)
    batched = KVMap.calibrate(source, target, data, batch_size=4, progress=False)
    assert one.config.calibration.train_tokens == batched.config.calibration.train_tokens
    for name, tensor in one.tensors.items():
        torch.testing.assert_close(batched.tensors[name], tensor, rtol=1e-4, atol=1e-4)


def test_target_layers_choosing_the_same_source_layers_share_one_eigendecomposition(monkeypatch):
    """One eigendecomposition per distinct set of chosen source layers (plus one per scanned source layer), and
    the shared fits equal the ones solved alone, bit for bit."""
    torch.manual_seed(3)
    src, tgt = KVLayout(3, 1, 4), KVLayout(5, 1, 4)
    x = torch.randn(300, 12)
    y = torch.cat([x[:, :4] @ torch.randn(4, 4) + 0.01 * torch.randn(300, 4) for _ in range(5)], dim=1)
    train, heldout = _stats(x[:240], y[:240]), _stats(x[240:], y[240:])
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda m: calls.append(m.shape) or eigh(m))
    fits = fit_layers(train, heldout, "t", src, tgt, top_k=1)
    chosen = {tuple(f.source_layers) for f in fits}
    assert chosen == {(0,)} and len(calls) == src.num_layers + len(chosen)
    stats = _Centered(train, heldout, "t")
    for t, fit in enumerate(fits):
        alone = solve_ridge(stats, torch.arange(0, 4), torch.arange(4 * t, 4 * t + 4), 4)
        assert torch.equal(alone.weight, fit.fit.weight) and torch.equal(alone.bias, fit.fit.bias)


# ----- guards: non-finite statistics, singular grams, fewer tokens than features -----


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_calibration_statistics_are_refused(bad):
    stats = SufficientStatistics.empty(3, {"t": 2})
    with pytest.raises(NumericalError, match="target 't' features contain NaN or Inf"):
        stats.update(torch.randn(4, 3), {"t": torch.tensor([[0.0, bad]] * 4)})
    # Statistics that became non-finite some other way (a merged shard, an edited checkpoint) are refused too.
    good = SufficientStatistics.empty(3, {"t": 2})
    good.update(torch.randn(10, 3), {"t": torch.randn(10, 2)})
    poisoned = good.state_dict()
    poisoned["x_gram"] = poisoned["x_gram"].clone()
    poisoned["x_gram"][0, 0] = bad
    with pytest.raises(NumericalError, match="calibration statistics are not finite"):
        _Centered(SufficientStatistics.from_state_dict(poisoned), good, "t")


def _degenerate(case: str, n: int = 40, d: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    if case == "duplicated":
        x[:, d // 2:] = x[:, : d // 2]
    elif case == "constant":
        x[:, 8:] = 7.0  # features no target column depends on: zero variance once centred
    elif case == "zero":
        x.zero_()
    elif case == "fewer_tokens":
        x = x[:5]
    elif case == "huge_range":
        x[:, 0] *= 1e8
        x[:, 1] *= 1e-8
    return x


@pytest.mark.parametrize("case", ["duplicated", "constant", "zero", "fewer_tokens", "huge_range"])
def test_ridge_stays_finite_on_singular_or_ill_conditioned_grams(case):
    x = _degenerate(case)
    gen = torch.Generator().manual_seed(4)
    y = x[:, :8] * 0.5 + 0.01 * torch.randn(x.shape[0], 8, generator=gen, dtype=torch.float64)
    x_ho = _degenerate(case)
    train, heldout = SufficientStatistics.empty(12, {"t": 8}), SufficientStatistics.empty(12, {"t": 8})
    train.update(x, {"t": y})
    heldout.update(x_ho, {"t": x_ho[:, :8] * 0.5})
    layout = KVLayout(1, 2, 4)
    fits = fit_layers(train, heldout, "t", KVLayout(1, 3, 4), layout)
    fit = fits[0].fit
    for tensor in (fit.weight, fit.bias, fit.lambdas, fit.r2):
        assert torch.isfinite(tensor).all()
    if case in ("duplicated", "constant", "fewer_tokens"):  # the signal is there: ridge must still find it
        assert float(fit.r2.min()) > 0.9


def test_calibration_with_fewer_tokens_than_features_gives_a_finite_map():
    source, target = calibration_pair()  # 2 x 2 x 16 = 64 source features per kind; 3 train tokens
    kv_map = KVMap.calibrate(source, target, random_ids(3, 4), **CALIBRATION_OPTIONS)
    assert all(torch.isfinite(t).all() for t in kv_map.tensors.values())


# ----- head shards: each target head from its own tensor-parallel shard's source heads -----


def test_head_shards_fit_each_shard_alone_and_leave_the_weights_between_shards_zero():
    """A target head driven by a source head of another shard is predicted by the dense fit and not by the sharded
    one, whose weights between shards are zero and whose blocks are the ridge on each shard's features alone."""
    torch.manual_seed(4)
    layout = KVLayout(2, 2, 3)  # 2 layers of 2 heads: shard 0 holds head 0, shard 1 head 1
    x = torch.randn(500, 12, dtype=torch.float64)
    y = torch.cat([x[:, 3:6] @ torch.randn(3, 3, dtype=torch.float64),  # layer 0, head 0 <- source head 1 (shard 1)
                   x[:, 3:6] @ torch.randn(3, 3, dtype=torch.float64),  # layer 0, head 1 <- its own shard
                   x[:, 6:12] @ torch.randn(6, 6, dtype=torch.float64)], dim=1) + 0.01 * torch.randn(500, 12)
    train, heldout = _stats(x[:400], y[:400]), _stats(x[400:], y[400:])
    dense = fit_layers(train, heldout, "t", layout, layout, top_k=1)
    sharded = fit_layers(train, heldout, "t", layout, layout, top_k=1, head_shards=2)
    assert float(dense[0].fit.r2[0]) > 0.99 and float(sharded[0].fit.r2[0]) < 0.1  # the driver is in the other shard
    assert float(sharded[0].fit.r2[1]) > 0.99
    for layer in sharded:
        rows = torch.arange(len(layer.source_layers) * 6) % 6 // 3
        weight = layer.fit.weight
        assert torch.all(weight[rows == 0][:, 3:] == 0) and torch.all(weight[rows == 1][:, :3] == 0)
    stats = _Centered(train, heldout, "t")
    for shard in range(2):
        source = torch.cat([torch.arange(6 * s + 3 * shard, 6 * s + 3 * shard + 3) for s in sharded[1].source_layers])
        alone = solve_ridge(stats, source, torch.arange(6 + 3 * shard, 9 + 3 * shard), head_size=3)
        mine = torch.arange(3 * shard, 3 * shard + 3)
        rows = torch.arange(len(sharded[1].source_layers) * 6) % 6 // 3 == shard
        torch.testing.assert_close(sharded[1].fit.weight[rows][:, mine], alone.weight)
        torch.testing.assert_close(sharded[1].fit.bias[mine], alone.bias)


def test_head_shards_that_do_not_divide_the_heads_are_refused_before_any_model_runs():
    source, target = calibration_pair()
    calls = []
    source.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(CalibrationError, match="do not split into 3 shards"):
        KVMap.calibrate(source, target, random_ids(4, 32), head_shards=3, **CALIBRATION_OPTIONS)
    assert not calls
