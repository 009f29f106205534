"""Keys and values predicted from the source's keys and values together (`CalibrationConfig.joint_kinds`): each source
layer offers its keys (numbered as the layer) and its values (numbered num_layers + the layer) to the top_k choice, the
statistics hold one feature row for both, and the map reads each input from the kind it names."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model

from peft_kvcache import KVMap
from peft_kvcache.calibration.statistics import JOINT, ModelSide, StatisticsRun
from peft_kvcache.errors import CalibrationError, RecordError
from peft_kvcache.maps.apply import map_cache
from peft_kvcache.maps.config import CalibrationConfig
from peft_kvcache.modeling.capture import batches, run_with_cache


@pytest.mark.parametrize("lambda_grid", [None, (1e4,)])  # fitted from the data; held at its identity prior
def test_a_model_mapped_onto_itself_reads_keys_from_keys_and_values_from_values(lambda_grid, tmp_path):
    model = tiny_model("qwen2", seed=3)
    options = {"lambda_grid": lambda_grid} if lambda_grid else {}
    kv_map = KVMap.calibrate(model, model, random_ids(10, 40), progress=False, joint_kinds=True, **options)
    layers = model.config.num_hidden_layers
    assert kv_map.config.key_layers == [[t] for t in range(layers)]
    assert kv_map.config.value_layers == [[layers + t] for t in range(layers)]  # the values' numbers
    assert kv_map.source_inputs("values", 1) == [("values", 1)]
    assert len(kv_map.config.key_candidate_r2[0]) == 2 * layers

    kv_map.save_pretrained(tmp_path / "map", chart=False)
    loaded = KVMap.from_pretrained(tmp_path / "map")  # 2 * layers candidates pass the artifact's checks
    ids = random_ids(1, 24, seed=9)[0][None]
    source = run_with_cache(model, ids)
    positions = torch.arange(ids.shape[1])[None]
    mapped = map_cache(loaded, source.keys, source.values, positions, positions,
                       [(torch.device("cpu"), torch.float32)] * layers)
    for t, (keys, values) in enumerate(mapped):
        torch.testing.assert_close(keys, source.keys[t].float(), rtol=0, atol=2e-3)
        torch.testing.assert_close(values, source.values[t].float(), rtol=0, atol=2e-3)


def test_both_kinds_share_one_statistic_over_keys_then_values():
    source, target = tiny_model("qwen2", seed=0), tiny_model("llama", seed=1)
    sides = {"source": ModelSide.of(source), "target": ModelSide.of(target)}
    joint = StatisticsRun({"source": ["target"]}, sides, CalibrationConfig(joint_kinds=True))
    plain = StatisticsRun({"source": ["target"]}, sides, CalibrationConfig())
    ids, mask = next(batches(random_ids(1, 20, seed=4), 1))
    runs = {"source": run_with_cache(source, ids, mask), "target": run_with_cache(target, ids, mask)}
    joint.add("train", runs, mask)
    plain.add("train", runs, mask)
    assert set(k[3] for k in joint.stats) == {JOINT}
    layout = sides["source"].layout
    shared, width = joint.stats["source", None, "train", JOINT], layout.num_layers * layout.layer_width
    keys, values = plain.stats["source", None, "train", "keys"], plain.stats["source", None, "train", "values"]
    torch.testing.assert_close(shared.x_gram[:width, :width], keys.x_gram)
    torch.testing.assert_close(shared.x_gram[width:, width:], values.x_gram)
    torch.testing.assert_close(shared.xy["target:values"][width:], values.xy["target"])
    train, _, name = joint.pair("source", "target", None, "keys")
    assert train is shared and name == "target:keys"


def test_joint_kinds_are_refused_where_they_have_no_meaning():
    with pytest.raises(RecordError, match="joint_kinds needs same_layer=False"):
        CalibrationConfig(joint_kinds=True, same_layer=True)
    model = tiny_model("qwen2", seed=3)  # 2 layers: 4 candidates with joint_kinds
    with pytest.raises(CalibrationError, match="top_k 5 exceeds the source model's 4 candidate inputs"):
        KVMap.calibrate(model, model, random_ids(4, 20), progress=False, joint_kinds=True, top_k=5)


def test_the_card_names_each_input_by_its_kind():
    from peft_kvcache.maps.card import render_card, summary_text

    model = tiny_model("qwen2", seed=3)
    kv_map = KVMap.calibrate(model, model, random_ids(10, 40), progress=False, joint_kinds=True)
    assert "| 1 | k1 | v1 |" in render_card(kv_map.config, "org/map").content
    assert "layers vals  0<-v0 1<-v1" in summary_text(kv_map.config)


def test_the_layer_chart_draws_every_input_of_both_kinds():
    from peft_kvcache.maps.card import candidate_grid

    model = tiny_model("qwen2", seed=3)
    kv_map = KVMap.calibrate(model, model, random_ids(10, 40), progress=False, joint_kinds=True)
    layers = model.config.num_hidden_layers
    grid = candidate_grid(kv_map.config, kv_map.config.value_candidate_r2)
    assert len(grid) == 2 * layers and len(grid[0]) == layers
    chosen = max(s for group in kv_map.config.value_layers for s in group)
    assert chosen >= layers and grid[chosen][0] == kv_map.config.value_candidate_r2[0][chosen]
