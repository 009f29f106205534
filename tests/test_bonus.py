"""The attention bonus (`peft_kvcache.calibration.bonus`): a key offset that raises every mapped key's logit by what its
record says, measured with the target's own queries and RoPE on a cache the ordinary mapping path made; the positions
the target computes itself keep their keys; maps it cannot extend are refused before any pass."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model

from peft_kvcache import KVMap, MappedCache
from peft_kvcache.calibration.bonus import QueryMoments, add_attention_bonus, target_query_moments
from peft_kvcache.calibration.nonlinear import fit_nonlinear_heads
from peft_kvcache.errors import ArtifactError, CalibrationError, FingerprintMismatchError
from peft_kvcache.maps.config import KVMapConfig
from peft_kvcache.maps.records import to_json
from peft_kvcache.modeling._compat import recording_queries
from peft_kvcache.modeling.capture import forward, run_with_cache

KV_HEADS, GROUP, HEAD_DIM, DISTANCE, LENGTH, LAYERS = 3, 2, 16, 48, 192, 4


@pytest.fixture(scope="module")
def pair():
    """A source and a grouped-query target whose every query is one fixed vector per head (zero q_proj weights, its
    bias set) with its energy in mid-frequency RoPE pairs only, which turn over the distances served: an offset that
    holds the bonus must turn with them the way the model's RoPE does."""
    source = tiny_model("qwen2", seed=0)
    target = tiny_model("qwen2", seed=1, hidden_size=KV_HEADS * GROUP * HEAD_DIM, num_hidden_layers=LAYERS,
                        num_attention_heads=KV_HEADS * GROUP, num_key_value_heads=KV_HEADS, intermediate_size=160)
    generator = torch.Generator().manual_seed(2)
    for layer in target.model.layers:
        q = layer.self_attn.q_proj
        vector = torch.zeros(KV_HEADS * GROUP, HEAD_DIM)
        for pair_index in (3, 4):  # dims j and j + half rotate together; pairs 3 and 4 turn 1.5 / 0.5 rad over 48
            vector[:, pair_index] = torch.randn(KV_HEADS * GROUP, generator=generator) * 4
            vector[:, pair_index + HEAD_DIM // 2] = torch.randn(KV_HEADS * GROUP, generator=generator) * 4
        with torch.no_grad():
            q.weight.zero_()
            q.bias.copy_(vector.reshape(-1))
    return source, target


@pytest.fixture(scope="module")
def fitted(pair):
    source, target = pair
    return KVMap.calibrate(source, target, random_ids(12, 48), progress=False)


@pytest.fixture(scope="module")
def with_bonus(pair, fitted):
    return add_attention_bonus(fitted, pair[1], random_ids(8, 64, seed=5), bonus=1.0, max_distance=DISTANCE,
                               progress=False)


def served_logits(target, ids: torch.Tensor, keys: list[torch.Tensor], sink: int) -> list[torch.Tensor]:
    """Per target layer, the logits the target's own queries over ``ids`` give ``keys`` (per layer ``[1, kv_heads, n,
    head_dim]``, rotated at their positions, as attention reads them) on the pairs the bonus serves: keys past the
    sink, queries after them within DISTANCE -> ``[kv_heads, group, pairs]``."""
    queries = []
    with torch.no_grad(), recording_queries(target, lambda query, scaling: queries.append((query, scaling))):
        forward(target, ids, None)
    m, n = torch.arange(LENGTH)[:, None], torch.arange(LENGTH)[None]
    served = (n >= sink) & (m > n) & (m - n < DISTANCE)
    logits = []
    for (query, scaling), layer_keys in zip(queries, keys, strict=True):
        grouped = query[0].reshape(KV_HEADS, GROUP, LENGTH, HEAD_DIM)  # query heads j*GROUP.. read KV head j
        logits.append((scaling * torch.einsum("hgmd,hnd->hgmn", grouped, layer_keys[0]))[:, :, served])
    return logits


def logit_change(pair, plain: KVMap, bonus: KVMap) -> tuple[torch.Tensor, list]:
    """Per target layer and KV head, the mean change of the target's logits on the mapped keys (queries after them
    within DISTANCE), and the caches' keys of both maps."""
    source, target = pair
    ids = random_ids(1, LENGTH, seed=9)[0][None]
    source_kv = run_with_cache(source, ids)
    caches = [MappedCache.from_source(source_kv, m, target, input_ids=ids, refresh_tokens=0, verify_models=False)
              for m in (plain, bonus)]
    moved = [bonus_layer.keys - plain_layer.keys
             for plain_layer, bonus_layer in zip(*(c.layers for c in caches), strict=True)]
    change = torch.stack([logits.mean(dim=(1, 2)) for logits in served_logits(target, ids, moved,
                                                                             plain.config.sink_tokens)])
    return change, [[(c.layers[t].keys) for c in caches] for t in range(len(moved))]


def test_mapped_keys_gain_the_recorded_bonus_with_the_targets_own_queries_and_rope(pair, fitted, with_bonus):
    record = with_bonus.config.attention_bonus
    achieved = torch.tensor(record.achieved)
    assert achieved.shape == (LAYERS, KV_HEADS) and (achieved > 0.5).all()  # the mid-frequency pairs can carry it
    change, keys = logit_change(pair, fitted, with_bonus)
    assert torch.allclose(change, achieved, atol=0.08), (change, achieved)
    sink = fitted.config.sink_tokens
    for plain_keys, bonus_keys in keys:  # the target's own sink keeps its keys
        assert torch.equal(plain_keys[:, :, :sink], bonus_keys[:, :, :sink])
    assert not torch.equal(plain_keys[:, :, sink:], bonus_keys[:, :, sink:])
    # only the key biases moved, by a position-free offset per head
    for name, tensor in fitted.tensors.items():
        if not name.startswith("keys.") or not name.endswith(".bias"):
            assert torch.equal(tensor, with_bonus.tensors[name]), name
    assert with_bonus.config.quality.gate is None  # measured on the keys before the offset


def test_a_larger_bonus_scales_the_offset(pair, fitted, with_bonus):
    double = add_attention_bonus(fitted, pair[1], random_ids(8, 64, seed=5), bonus=2.0, max_distance=DISTANCE,
                                 progress=False)
    for t in range(LAYERS):
        moved = with_bonus.tensors[f"keys.{t}.bias"] - fitted.tensors[f"keys.{t}.bias"]
        assert torch.allclose(double.tensors[f"keys.{t}.bias"] - fitted.tensors[f"keys.{t}.bias"], 2 * moved,
                              atol=1e-5)
    assert torch.allclose(torch.tensor(double.config.attention_bonus.achieved),
                          2 * torch.tensor(with_bonus.config.attention_bonus.achieved), atol=2e-4)


def test_the_bonus_and_its_record_survive_save_and_load(with_bonus, tmp_path):
    loaded = KVMap.from_pretrained(with_bonus.save_pretrained(tmp_path / "bonus", chart=False))
    assert loaded.config.attention_bonus == with_bonus.config.attention_bonus
    assert all(torch.equal(loaded.tensors[name], tensor) for name, tensor in with_bonus.tensors.items())


def test_maps_the_bonus_cannot_extend_are_refused_before_any_pass(pair, fitted, with_bonus, monkeypatch):
    import peft_kvcache.calibration.bonus as bonus_module

    monkeypatch.setattr(bonus_module, "forward", lambda *a, **k: pytest.fail("a model ran before the refusal"))
    texts = random_ids(2, 64)
    with pytest.raises(CalibrationError, match="carries an attention bonus already"):
        add_attention_bonus(with_bonus, pair[1], texts)
    for bad in (-1.0, float("nan"), 21.0, "1"):
        with pytest.raises(CalibrationError, match="bonus must be a number of nats"):
            add_attention_bonus(fitted, pair[1], texts, bonus=bad)
    with pytest.raises(CalibrationError, match="max_distance and draws must be positive"):
        add_attention_bonus(fitted, pair[1], texts, max_distance=0)
    with pytest.raises(FingerprintMismatchError):
        add_attention_bonus(fitted, pair[0], texts)  # not the map's target
    with pytest.raises(CalibrationError, match="undo"):  # heads fitted to the target's keys would undo the offset
        fit_nonlinear_heads(with_bonus, *pair, texts, progress=False)


def test_a_config_with_a_malformed_bonus_is_refused(with_bonus):
    data = to_json(with_bonus.config)
    per_head = [[1.0] * KV_HEADS] * LAYERS
    for field, value in (("bonus", 50.0), ("achieved", [[1.0]]), ("max_distance", 0), ("ridge", -1.0),
                         ("method", "median"), ("method", "jensen"), ("asked", per_head),  # the two go together
                         ("asked", [[1.0] * KV_HEADS] * (LAYERS - 1) + [[1.0, 1.0, 25.0]])):
        broken = {**data, "attention_bonus": {**data["attention_bonus"], field: value}}
        with pytest.raises(ArtifactError, match="attention_bonus is malformed"):
            KVMapConfig.from_dict(broken)
    assert KVMapConfig.from_dict(data).attention_bonus == with_bonus.config.attention_bonus


def test_saved_query_moments_give_the_same_bonus_without_a_pass(pair, fitted, with_bonus, tmp_path, monkeypatch):
    import peft_kvcache.calibration.bonus as bonus_module

    moments = target_query_moments(fitted, pair[1], random_ids(8, 64, seed=5), max_distance=DISTANCE, progress=False)
    loaded = QueryMoments.load(moments.save(tmp_path / "moments.safetensors"))
    assert loaded.options() == moments.options() and loaded.texts == with_bonus.config.attention_bonus.texts
    monkeypatch.setattr(bonus_module, "forward", lambda *a, **k: pytest.fail("a pass ran although moments were given"))
    again = add_attention_bonus(fitted, pair[1], bonus=1.0, max_distance=DISTANCE, moments=loaded)
    assert again.config.attention_bonus == with_bonus.config.attention_bonus
    assert all(torch.equal(again.tensors[name], tensor) for name, tensor in with_bonus.tensors.items())
    with pytest.raises(CalibrationError, match="take no more queries"):
        loaded.add(torch.zeros(1, KV_HEADS * GROUP, 8, HEAD_DIM), 1.0)


def test_query_moments_read_otherwise_are_refused(pair, fitted, tmp_path):
    moments = target_query_moments(fitted, pair[1], random_ids(2, 64, seed=5), max_distance=DISTANCE, progress=False)
    with pytest.raises(CalibrationError, match="asks for"):  # read at other distances than the bonus serves
        add_attention_bonus(fitted, pair[1], moments=moments, max_distance=2 * DISTANCE)
    with pytest.raises(CalibrationError, match="one of them"):
        add_attention_bonus(fitted, pair[1], random_ids(2, 64), moments=moments, max_distance=DISTANCE)
    with pytest.raises(CalibrationError, match="one of them"):
        add_attention_bonus(fitted, pair[1], max_distance=DISTANCE)
    moments.target = "0" * 64  # another model's queries
    with pytest.raises(CalibrationError, match="another model"):
        add_attention_bonus(fitted, pair[1], moments=moments, max_distance=DISTANCE)
    (tmp_path / "not.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ArtifactError, match="holds no query moments"):
        QueryMoments.load(tmp_path / "not.safetensors")


def test_the_bonus_lever_reads_each_targets_query_moments_once(tmp_path, monkeypatch, pair, fitted):
    """`benchmarks.lever_maps --bonus`: a second bonus size on the same maps, or the bonus on other maps into the same
    target, runs no pass over the target (its moments are kept), and a second size's offset is the first's scaled."""
    import peft_kvcache.calibration.bonus as bonus_module
    from benchmarks import lever_maps, siblings

    source, target = pair
    texts = {f"f{i}.py": ids for i, ids in enumerate(random_ids(12, 48))}
    models = {"small": source, "large": target}
    reverse = KVMap.calibrate(target, source, texts, progress=False)
    other = KVMap.calibrate(source, target, texts, top_k=2, progress=False)  # fitted otherwise, chunked alike
    for direction, kv_map in (("up", fitted), ("down", reverse)):
        kv_map.save_pretrained(tmp_path / "top4" / siblings.pair_name(direction), chart=False)
        (other if direction == "up" else reverse).save_pretrained(tmp_path / "top1" / siblings.pair_name(direction),
                                                                  chart=False)
    monkeypatch.setattr(lever_maps, "LEVERS", tmp_path)
    monkeypatch.setattr(siblings, "load_pair", lambda: (models, None))
    monkeypatch.setattr(lever_maps, "stdlib_texts", lambda split, files: dict(list(texts.items())[:files]))
    one = lever_maps.add_to_maps("b1", "bonus", {"bonus": 1.0, "max_distance": DISTANCE}, files=12, on="top4",
                                 progress=False)
    assert len(list((tmp_path / "query-moments").glob("*.safetensors"))) == 2  # one per target
    def no_pass(*args, **kwargs):
        raise AssertionError("the target's queries were read again")

    monkeypatch.setattr(bonus_module, "forward", no_pass)
    two = lever_maps.add_to_maps("b2", "bonus", {"bonus": 2.0, "max_distance": DISTANCE}, files=12, on="top4",
                                 progress=False)
    lever_maps.add_to_maps("o1", "bonus", {"bonus": 1.0, "max_distance": DISTANCE}, files=12, on="top1",
                           progress=False)  # the other maps into the same targets read the same moments
    for direction, base in (("up", fitted), ("down", reverse)):
        maps = [KVMap.from_pretrained(folder / siblings.pair_name(direction)) for folder in (one, two)]
        for t in range(base.config.target_layout.num_layers):
            name = f"keys.{t}.bias"
            assert torch.allclose(maps[1].tensors[name] - base.tensors[name],
                                  2 * (maps[0].tensors[name] - base.tensors[name]), atol=1e-5)
    jensen = lever_maps.add_to_maps("j", "bonus", {"bonus": lever_maps.bonus_size("jensen"), "max_distance": DISTANCE},
                                    files=12, on="top4", progress=False)  # the kept moments, the map's own residuals
    assert KVMap.from_pretrained(jensen / siblings.pair_name("up")).config.attention_bonus.method == "jensen"
    with pytest.raises(AssertionError, match="read again"):  # other distances: moments of their own
        lever_maps.add_to_maps("b3", "bonus", {"bonus": 1.0, "max_distance": 2 * DISTANCE}, files=12, on="top4",
                               progress=False)


def test_the_jensen_bonus_asks_each_head_half_its_logit_residual_on_the_mapped_keys(pair, fitted):
    """``bonus="jensen"``: each head is asked half the mean square of its logits' residual on the mapped keys (the
    target's own keys minus the map's, seen by its own queries), measured here on another text, and the offset gives
    each head what it asked."""
    source, target = pair
    tensors = dict(fitted.tensors)  # KV head 0's keys made worse in every layer: it must ask more than head 2
    generator = torch.Generator().manual_seed(3)
    for t in range(LAYERS):
        weight = tensors[f"keys.{t}.weight"].clone()
        weight[:, :HEAD_DIM] += torch.randn(weight.shape[0], HEAD_DIM, generator=generator)
        tensors[f"keys.{t}.weight"] = weight
        bias = tensors[f"keys.{t}.bias"].clone()  # and KV head 1's keys off by one fixed position-free vector in a
        bias[HEAD_DIM + 4] += 3.0  # pair the queries read: its residual turns with the key's position, theirs little
        tensors[f"keys.{t}.bias"] = bias
    worse = KVMap(fitted.config, tensors)
    jensen = add_attention_bonus(worse, target, random_ids(16, 96, seed=5), bonus="jensen", max_distance=DISTANCE,
                                 source_model=source, progress=False)
    record = jensen.config.attention_bonus
    asked = torch.tensor(record.asked)
    assert record.method == "jensen" and asked.shape == (LAYERS, KV_HEADS)
    assert record.bonus == pytest.approx(float(asked.mean()), abs=1e-3)
    ids = random_ids(1, LENGTH, seed=9)[0][None]
    own = run_with_cache(target, ids)
    mapped = MappedCache.from_source(run_with_cache(source, ids), worse, target, input_ids=ids, refresh_tokens=0,
                                     verify_models=False)
    residuals = [own_keys - layer.keys for own_keys, layer in zip(own.keys, mapped.layers, strict=True)]
    measured = torch.stack([logits.pow(2).mean(dim=(1, 2)) / 2
                            for logits in served_logits(target, ids, residuals, fitted.config.sink_tokens)])
    assert (measured[:, :2].min(dim=1).values > 3 * measured[:, 2]).all()  # the worse heads' residuals stand out
    assert torch.allclose(asked, measured, rtol=0.35, atol=0.03), (asked, measured)
    change, _ = logit_change(pair, worse, jensen)
    assert ((change - asked).abs() <= 0.1 + 0.1 * asked).all(), (change, asked)  # each head got its own


def test_the_jensen_bonus_needs_the_source_before_any_pass(pair, fitted, monkeypatch):
    import peft_kvcache.calibration.bonus as bonus_module

    monkeypatch.setattr(bonus_module, "forward", lambda *a, **k: pytest.fail("a model ran before the refusal"))
    with pytest.raises(CalibrationError, match="pass source_model and calibration_data"):
        add_attention_bonus(fitted, pair[1], random_ids(2, 64), bonus="jensen")
    with pytest.raises(CalibrationError, match="or 'jensen'"):
        add_attention_bonus(fitted, pair[1], random_ids(2, 64), bonus="median", source_model=pair[0])


def test_a_jensen_bonus_past_the_limit_is_refused_with_its_spread(pair, fitted):
    tensors = dict(fitted.tensors)  # every key far off: half the residual logit's variance is past 20 nats
    tensors.update({f"keys.{t}.bias": tensors[f"keys.{t}.bias"] + 50.0 for t in range(LAYERS)})
    with pytest.raises(CalibrationError, match=r"of \d+ of 12 heads is past 20.0 nats \(largest .*, median"):
        add_attention_bonus(KVMap(fitted.config, tensors), pair[1], random_ids(4, 64), bonus="jensen",
                            max_distance=DISTANCE, source_model=pair[0], progress=False)
