"""The model card, rendered from a map's config alone: YAML metadata huggingface_hub can parse, every section,
the layer chart, figures that cite their results file, "held-out" only where it is true, a usage snippet that is
valid Python with every config value quoted as data, and license inheritance."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from peft_kvcache import KVMap, KVMapConfig
from peft_kvcache.maps import card
from peft_kvcache.maps.config import (
    CalibrationConfig,
    CalibrationRecord,
    DataRecord,
    Figure,
    GateRecord,
    ModelSpec,
    QualityRecord,
    Refresh,
    TextRecord,
)
from peft_kvcache.modeling.layout import KVLayout
from peft_kvcache.modeling.positions import RotaryRecord

SOURCE_FP, TARGET_FP = "0123456789abcdef" * 4, "fedcba9876543210" * 4
ROTARY = RotaryRecord("default", 8, 8, 1.0)
CALIBRATION = CalibrationRecord(
    options=CalibrationConfig(top_k=1), train_tokens=123456, heldout_tokens=30864, sequences=301,
    data=DataRecord("Python 3.11 standard library source, calibration split",
                    [TextRecord("json/decoder.py", 512), TextRecord("ast.py", 512, "heldout")]),
    source=ModelSpec("Qwen/Qwen2.5-Coder-0.5B-Instruct"), target=ModelSpec("Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    license="apache-2.0")
QUALITY = QualityRecord(
    gate=GateRecord(0.61, [0.99, 0.98, 0.97], [0.9, 0.9, 0.9], sequences=8, query_tokens=16,
                    data=DataRecord("gate", [TextRecord("random.py", 300)])),
    figures={"continuation.mapped@1.normalized_retention": Figure(0.8123, "benchmarks/results/siblings.json", "a/b"),
             "ttft.speedup_cold_2048": Figure(7.25, "benchmarks/results/ttft-x.json", "rows/context=2048/speedup_cold")})


def make_map(**overrides) -> KVMap:
    """A hand-made 2 -> 3 layer map (2 KV heads of 8) with the given config fields replaced."""
    fields = dict(
        source_name="Qwen/Qwen2.5-Coder-0.5B-Instruct", target_name="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        source_fingerprint=SOURCE_FP, target_fingerprint=TARGET_FP, source_layout=KVLayout(2, 2, 8),
        target_layout=KVLayout(3, 2, 8), source_rotary=ROTARY, target_rotary=ROTARY, vocab_size=151936,
        pair_kind="cross_shape", key_layers=[[0], [1], [1]], value_layers=[[0], [0], [1]],
        key_r2=[[0.9, 0.8], [0.7, 0.6], [0.5, 0.4]], value_r2=[[0.95, 0.85], [0.75, 0.65], [0.55, 0.45]],
        key_candidate_r2=[[0.9, 0.2], [0.3, 0.7], [0.1, 0.5]], value_candidate_r2=[[0.9, 0.2], [0.8, 0.3], [0.2, 0.6]],
        calibration=CALIBRATION, quality=QUALITY)
    fields.update(overrides)
    config = KVMapConfig(**fields)
    width_in, width_out = config.source_layout.layer_width, config.target_layout.layer_width
    tensors = {"source.inv_freq": torch.rand(4), "target.inv_freq": torch.rand(4)}
    for kind, groups in (("keys", config.key_layers), ("values", config.value_layers)):
        for t, group in enumerate(groups):
            tensors[f"{kind}.{t}.weight"] = torch.randn(len(group) * width_in, width_out)
            tensors[f"{kind}.{t}.bias"] = torch.randn(width_out)
    return KVMap(config, tensors)


@pytest.fixture
def saved(tmp_path) -> Path:
    return make_map().save_pretrained(tmp_path / "map", repo_id="my-org/coder-0.5b-to-1.5b-kvmap")


def test_metadata_parses_with_huggingface_hub(saved):
    data = ModelCard.load(saved / "README.md").data
    assert data.library_name == "peft-kvcache"
    assert data.base_model == ["Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"]
    assert {"peft-kvcache", "kv-cache", "cross-shape"} <= set(data.tags)
    assert data.license == "apache-2.0"
    assert {"heldout_key_r2", "normalized_retention", "speedup_cold_2048", "predicted_retention"} <= set(data.metrics)
    meta = data.to_dict()["peft_kvcache"]
    assert meta["source_fingerprint"] == SOURCE_FP and meta["target_fingerprint"] == TARGET_FP
    figures = meta["figures"]
    assert figures["continuation.mapped@1.normalized_retention"] == pytest.approx(0.8123)
    assert figures["heldout_key_r2"] == pytest.approx(0.65) and figures["predicted_retention"] == 0.61


def test_the_card_has_every_section(saved):
    text = ModelCard.load(saved / "README.md").text
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    for section in ("What the map does", "The pair", "Calibration", "Layer selection",
                    "Measured quality and speed", "Usage", "Limitations"):
        assert section in headings
    assert SOURCE_FP in text and TARGET_FP in text
    assert "123,456" in text and "30,864" in text and "2 distinct (1 for fitting, 1 held out whole" in text
    assert "`json/decoder.py`" in text                             # the calibration files are named
    assert "0.8123" in text and "7.25" in text and "0.610" in text  # measured figures and the gate
    assert "`benchmarks/results/siblings.json`" in text and "ttft-x.json" in text  # ... citing where they come from
    assert "| 2 | 1 | 1 | 0.450 | 0.500 |" in text                  # layer table: target 2 <- source 1
    assert "maps the whole context by default" in text             # no refresh recommended
    assert "{{" not in text and "}}" not in text                   # every placeholder was filled


def test_held_out_is_claimed_only_for_disjoint_text():
    assert "disjoint from the calibration texts" in card.evaluation_text(make_map().config)
    overlapping = QualityRecord(gate=GateRecord(0.5, [1.0] * 3, [0.5] * 3, 1, 4, DataRecord("", [TextRecord("ast.py", 1)])),
                                figures={"x": Figure(1.0, "r.json", "x")})
    text = card.evaluation_text(make_map(quality=overlapping).config)
    assert "disjoint" not in text and "`r.json`" in text
    assert card.evaluation_text(make_map(quality=QualityRecord()).config) == ""


def test_the_recommended_recipe_is_stated_by_its_name_and_what_it_computes(tmp_path):
    text = card.recipe_text(make_map(refresh=Refresh(64, 16, 8)).config)
    assert "`refresh@96/p64`" in text and "recomputes the 64 positions" in text and "refresh_tokens=0" in text
    assert "dropped" not in text
    index = card.recipe_text(make_map(refresh=Refresh.named("index@160/p40")).config)
    assert "`index@160/p40`" in index and "with the last 104 tokens" in index and "dropped" in index
    hybrid = card.recipe_text(make_map(refresh=Refresh.named("hybrid@64")).config)
    assert "`hybrid@64`" in hybrid and "computes the last 64 context tokens itself" in hybrid
    assert "no refresh" in card.recipe_text(make_map(refresh=None).config)


def test_the_layer_chart_is_written_and_linked(saved):
    text = (saved / "README.md").read_text()
    assert "](layer_r2.png)" in text
    assert (saved / "layer_r2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_usage_snippet_is_python_that_loads_this_map(saved):
    text = (saved / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, flags=re.S).group(1)
    calls = {node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
             for node in ast.walk(ast.parse(snippet)) if isinstance(node, ast.Call)}
    assert {"from_pretrained", "from_source", "generate", "load_model"} <= calls
    assert 'KVMap.from_pretrained("my-org/coder-0.5b-to-1.5b-kvmap")' in snippet
    assert 'target_model, _ = load_model("Qwen/Qwen2.5-Coder-1.5B-Instruct")' in snippet
    assert "cache=cache" in snippet  # the forward-compatible spelling


def test_config_text_is_quoted_as_data_never_pasted_as_code():
    hostile = '")\nimport os; os.system("echo pwned")  # '
    config = make_map(calibration=CalibrationRecord(source=ModelSpec(hostile), target=ModelSpec("t"))).config
    snippet = card.usage_snippet(config, 'repo"); evil(')
    tree = ast.parse(snippet)
    assert not any(isinstance(node, ast.Import) and node.names[0].name == "os" for node in ast.walk(tree))
    literals = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)]
    assert hostile in literals and 'repo"); evil(' in literals


def test_a_card_saved_without_repo_id_never_names_this_machines_path(tmp_path):
    folder = make_map().save_pretrained(tmp_path / "deep" / "coder-map")
    text = (folder / "README.md").read_text()
    assert 'KVMap.from_pretrained("coder-map")' in text and str(tmp_path) not in text


def test_an_adapter_map_loads_the_adapter_on_the_base_and_disables_it_for_the_source():
    same = dict(source_layout=KVLayout(3, 2, 8), key_layers=[[0], [1], [2]], value_layers=[[0], [1], [2]],
                key_candidate_r2=[], value_candidate_r2=[], pair_kind="same_shape")
    record = CalibrationRecord(source=ModelSpec("gguf:smollm2-135m-instruct"),
                               target=ModelSpec("gguf:smollm2-135m-instruct", "shout", "adapters/shout"))
    snippet = card.usage_snippet(make_map(calibration=record, **same).config, "org/map")
    ast.parse(snippet)
    assert 'base, tokenizer = load_model("gguf:smollm2-135m-instruct")' in snippet
    assert 'PeftModel.from_pretrained(base, "adapters/shout", adapter_name="shout")' in snippet
    assert "with model.disable_adapter()" in snippet.split("MappedCache.from_source")[0]  # the source is the base
    reverse = CalibrationRecord(source=record.target, target=record.source)
    snippet = card.usage_snippet(make_map(calibration=reverse, **same).config, "org/map")
    assert "with model.disable_adapter()" in snippet.split("source_cache = ")[1]  # the target is the base


def test_local_paths_are_not_base_models_and_fixtures_name_their_hub_model():
    data = card.card_data(make_map(calibration=CalibrationRecord(source=ModelSpec("/tmp/models/src"),
                                                                  target=ModelSpec("qwen2"))).config)
    assert data.base_model is None
    fixture = CalibrationRecord(source=ModelSpec("gguf:qwen2.5-coder-0.5b-instruct"), target=ModelSpec("org/target"))
    assert card.card_data(make_map(calibration=fixture).config).base_model == ["Qwen/Qwen2.5-Coder-0.5B-Instruct",
                                                                               "org/target"]


def test_a_map_without_figures_or_license(tmp_path):
    kv_map = make_map(quality=QualityRecord(), key_r2=[], value_r2=[], key_candidate_r2=[], value_candidate_r2=[],
                      calibration=CalibrationRecord())
    folder = kv_map.save_pretrained(tmp_path / "bare")
    loaded = ModelCard.load(folder / "README.md")
    assert loaded.data.license is None and loaded.data.metrics is None
    assert "No figures were recorded" in loaded.text and "keys **not recorded**" in loaded.text
    assert "calibration data was not described" in loaded.text
    assert not (folder / "layer_r2.png").exists() and "layer_r2.png" not in loaded.text


def test_without_matplotlib_the_card_has_no_chart_and_no_stale_one(saved, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    (saved / "layer_r2.png").write_bytes(b"an earlier chart")
    KVMap.from_pretrained(saved).save_pretrained(saved)  # saving over an existing map folder
    assert not (saved / "layer_r2.png").exists()
    assert "layer_r2.png" not in (saved / "README.md").read_text()


def _model_folder(root: Path, name: str, license_: str | None) -> str:
    folder = root / name
    folder.mkdir()
    if license_:
        (folder / "README.md").write_text(f"---\nlicense: {license_}\n---\n# {name}\n")
    return str(folder)


def test_license_is_inherited_when_both_models_agree(tmp_path):
    mit_a, mit_b = _model_folder(tmp_path, "a", "mit"), _model_folder(tmp_path, "b", "mit")
    apache, unknown = _model_folder(tmp_path, "c", "apache-2.0"), _model_folder(tmp_path, "d", None)
    assert card.model_license(mit_a) == "mit" and card.model_license(unknown) is None
    assert card.inherited_license(mit_a, mit_b) == "mit"
    assert card.inherited_license(mit_a, apache) is None
    assert card.inherited_license(mit_a, unknown) is None
    assert card.model_license("org/not-in-any-cache") is None
