"""Token weights from the target's attention (the CacheBridge lever): a weighted row counts as that many copies, the
attention each token receives is what the model's attention weights say, calibration weights each token by it as
configured, records it, and refuses what it cannot weight."""

from __future__ import annotations

import pytest
import torch
from conftest import CALIBRATION_OPTIONS, calibration_pair, random_ids, tiny_model

from peft_kvcache import KVMap
from peft_kvcache.calibration.fit import SufficientStatistics
from peft_kvcache.calibration.loop import statistics_options
from peft_kvcache.calibration.statistics import ModelSide, StatisticsRun
from peft_kvcache.errors import CalibrationError, RecordError
from peft_kvcache.maps.config import CalibrationConfig
from peft_kvcache.modeling.capture import CapturedKV, batches, run_with_cache
from peft_kvcache.modeling.positions import positions_from_mask


def test_a_row_of_weight_two_counts_as_two_copies_and_a_row_of_weight_zero_as_none():
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    weighted = SufficientStatistics.empty(4, {"t": 3})
    weighted.update(x, {"t": y}, torch.tensor([2.0, 1.0, 0.0, 1.0, 3.0]))
    rows = torch.tensor([0, 0, 1, 3, 4, 4, 4])
    copies = SufficientStatistics.empty(4, {"t": 3})
    copies.update(x[rows], {"t": y[rows]})
    for key, value in copies.state_dict().items():
        torch.testing.assert_close(weighted.state_dict()[key], value, rtol=1e-12, atol=1e-9)
    with pytest.raises(CalibrationError, match="weights"):
        weighted.update(x, {"t": y}, torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0]))


def test_received_attention_is_what_the_attention_weights_give_each_token():
    model = tiny_model("qwen2", seed=0)
    sequences = random_ids(2, 12, seed=1)
    sequences[1] = sequences[1][:8]  # left-padded by 4
    ids, mask = next(batches(sequences, 2))
    model.set_attn_implementation("sdpa")
    received = run_with_cache(model, ids, mask, received_attention=True).received
    assert model.config._attn_implementation == "sdpa"  # put back as it was
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                           output_attentions=True).attentions
    for row in range(2):
        n = int(mask[row].sum())
        first = ids.shape[1] - n
        assert torch.equal(received[row, :first], torch.zeros(first))
        for k in range(n):  # each later query's weight times the tokens it sees, over queries, heads, layers
            expected = sum(float(a[row, :, first + q, first + k].mean()) * (q + 1) for a in attentions
                           for q in range(k, n)) / (n - k) / len(attentions)
            assert float(received[row, first + k]) == pytest.approx(expected, rel=1e-4)


def test_attention_modules_that_give_no_weights_are_refused_by_name():
    from peft_kvcache.errors import IncompatibleModelsError
    from peft_kvcache.modeling.capture import ReceivedAttention

    model = tiny_model("qwen2", seed=0)
    recorder = ReceivedAttention(model, torch.ones(1, 4, dtype=torch.long))
    attention = recorder.modules[0]
    with pytest.raises(IncompatibleModelsError, match="no attention weights"):
        recorder._add(attention, (), (torch.zeros(1, 4, 64), None))  # what sdpa or flash attention returns
    with pytest.raises(IncompatibleModelsError, match="0 of 2 layers"):
        recorder.per_token()


def test_calibration_weights_each_token_by_the_attention_its_target_gives_it():
    source, target = calibration_pair()
    config = CalibrationConfig(attention_weighting=0.5, sink_tokens=1)
    sides = {"source": ModelSide.of(source), "target": ModelSide.of(target)}
    run = StatisticsRun({"source": ["target"]}, sides, config)
    ids, mask = next(batches(random_ids(1, 20, seed=4), 1))
    runs = {"source": run_with_cache(source, ids, mask), "target": run_with_cache(target, ids, mask, received_attention=True)}
    received = runs["target"].received[0, 1:].double()
    run.add("train", runs, mask)
    weights = 0.5 + 0.5 * received / received.mean()  # the sink is left out
    plain = StatisticsRun({"source": ["target"]}, sides, CalibrationConfig(sink_tokens=1))
    plain.add("train", runs, mask)
    ours, unweighted = run.stats["source", None, "train", "keys"], plain.stats["source", None, "train", "keys"]
    x_sum = weights @ torch.stack([row for row in _features(runs["source"], sides["source"], mask)])
    torch.testing.assert_close(ours.x_sum, x_sum, rtol=1e-9, atol=1e-9)
    assert float(ours.count) == pytest.approx(19) and not torch.allclose(ours.x_gram, unweighted.x_gram)
    without = dict(runs, target=CapturedKV(runs["target"].keys, runs["target"].values))
    with pytest.raises(CalibrationError, match="received_attention"):
        run.add("train", without, mask)


def test_a_tokens_weight_does_not_depend_on_the_sequences_beside_it():
    """Weights are normalized per sequence: the same text gets the same statistics batched with one text or another,
    and so under any number of torchrun processes (which shard the texts before batching)."""
    source, target = calibration_pair()
    sides = {"source": ModelSide.of(source), "target": ModelSide.of(target)}
    texts = random_ids(3, 20, seed=5)
    texts[2] = texts[2] * 0 + 7  # a text of one repeated token: its attention sits elsewhere
    stats = []
    for pair in ((texts[0], texts[1]), (texts[0], texts[2])):
        ids, mask = next(batches(list(pair), 2))
        runs = {"source": run_with_cache(source, ids, mask),
                "target": run_with_cache(target, ids, mask, received_attention=True)}
        run = StatisticsRun({"source": ["target"]}, sides, CalibrationConfig(attention_weighting=0.5, sink_tokens=1))
        stats.append(run._weights(runs["target"], mask.bool() & (positions_from_mask(mask) >= 1))[:19])
    torch.testing.assert_close(stats[0], stats[1], rtol=1e-12, atol=1e-12)


def _features(captured, side, mask):
    from peft_kvcache.calibration.statistics import stacked_features

    positions = positions_from_mask(mask)
    return stacked_features(captured, side.rotary, positions, mask.bool() & (positions >= 1))[0].double()


def test_a_weighted_map_records_its_weighting_and_tokens_and_differs_from_the_plain_one():
    source, target = calibration_pair()
    texts = random_ids(6, 40, seed=2)
    plain = KVMap.calibrate(source, target, texts, **CALIBRATION_OPTIONS)
    weighted = KVMap.calibrate(source, target, texts, attention_weighting=1.0, **CALIBRATION_OPTIONS)
    assert weighted.config.calibration.options.attention_weighting == 1.0
    assert weighted.config.calibration.train_tokens == plain.config.calibration.train_tokens
    assert not torch.equal(weighted.tensors["keys.0.weight"], plain.tensors["keys.0.weight"])
    assert statistics_options(weighted.config.calibration.options)["attention_weighting"] == 1.0  # checkpoints differ
    assert "attention_weighting" not in statistics_options(plain.config.calibration.options)


def test_weighting_is_refused_where_it_has_no_single_target_or_no_meaning():
    with pytest.raises(RecordError, match="attention_weighting"):
        CalibrationConfig(attention_weighting=1.5)
    source, target = calibration_pair()
    sides = {"a": ModelSide.of(source), "b": ModelSide.of(target), "c": ModelSide.of(target)}
    with pytest.raises(CalibrationError, match="one target per source"):
        StatisticsRun({"a": ["b", "c"]}, sides, CalibrationConfig(attention_weighting=0.5))


def test_lever_maps_are_the_published_calibration_but_for_the_lever(tmp_path, monkeypatch, sibling_pair):
    from benchmarks import lever_maps, siblings
    from peft_kvcache.calibration.texts import CalibrationTexts

    source, target = sibling_pair
    monkeypatch.setattr(lever_maps, "LEVERS", tmp_path)
    monkeypatch.setattr(siblings, "load_pair", lambda: ({"small": source, "large": target}, None))
    texts = {f"f{i}.py": ids for i, ids in enumerate(random_ids(6, 40, seed=5))}
    monkeypatch.setattr(siblings, "calibration_texts", lambda tokenizer, files, config: CalibrationTexts.build(
        dict(list(texts.items())[:files]), None, config))
    folder = lever_maps.fit("attention", {"attention_weighting": 0.5}, files=5, progress=False)
    for direction in siblings.DIRECTIONS:
        kv_map = KVMap.from_pretrained(folder / siblings.pair_name(direction))
        options = kv_map.config.calibration.options
        assert options.attention_weighting == 0.5 and options.top_k == siblings.CONFIG.top_k
        assert options.max_length == siblings.CONFIG.max_length
        assert len(kv_map.config.calibration.data.names()) == 5
    assert lever_maps.fit("attention", {"attention_weighting": 0.5}, files=5, progress=False) == folder  # kept
    with pytest.raises(RecordError, match="other options"):
        lever_maps.fit("attention", {"attention_weighting": 0.25}, files=5, progress=False)

    def no_forward(*args, **kwargs):
        raise AssertionError("a lever that only fits differently reuses the captured statistics")

    monkeypatch.setattr(siblings, "run_with_cache", no_forward)
    top1 = lever_maps.fit("attention-top1", {"attention_weighting": 0.5, "top_k": 1}, files=5, progress=False)
    for direction in siblings.DIRECTIONS:
        kv_map = KVMap.from_pretrained(top1 / siblings.pair_name(direction))
        assert {len(layers) for layers in kv_map.config.key_layers} == {1}
