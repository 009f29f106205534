"""The model card: YAML metadata huggingface_hub can parse, the sections the issue asks for, the layer chart,
a usage snippet that is valid Python, license inheritance, and that every folder in hub_cards/ has a card."""

from __future__ import annotations

import ast
import doctest
import re
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from peft_kvcache import KVMap, KVMapConfig, card
from peft_kvcache.models import KVLayout

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_FP, TARGET_FP = "0123456789abcdef" * 4, "fedcba9876543210" * 4
RETENTION = {
    "context_length": 512, "continuation_length": 64, "examples": 20,
    "rows": [
        {"variant": "full", "accuracy": 0.61, "raw_retention": 1.0, "normalized_retention": 1.0},
        {"variant": "mapped@1", "accuracy": 0.5432, "raw_retention": 0.8905, "normalized_retention": 0.8123},
    ],
}


def make_map(**overrides) -> KVMap:
    """A hand-made 2 -> 3 layer map (2 KV heads of 8) with the given config fields replaced."""
    rotary = {"rope_type": "default", "head_dim": 8, "rotary_dim": 8, "attention_scaling": 1.0, "max_position": None}
    fields = dict(
        source_name="Qwen/Qwen2.5-Coder-0.5B-Instruct", target_name="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        source_fingerprint=SOURCE_FP, target_fingerprint=TARGET_FP,
        source_layout=KVLayout(2, 2, 8), target_layout=KVLayout(3, 2, 8), source_rotary=rotary, target_rotary=rotary,
        vocab_size=151936, pair_kind="cross_shape", key_layers=[[0], [1], [1]], value_layers=[[0], [0], [1]],
        key_r2=[[0.9, 0.8], [0.7, 0.6], [0.5, 0.4]], value_r2=[[0.95, 0.85], [0.75, 0.65], [0.55, 0.45]],
        key_candidate_r2=[[0.9, 0.2], [0.3, 0.7], [0.1, 0.5]], value_candidate_r2=[[0.9, 0.2], [0.8, 0.3], [0.2, 0.6]],
        calibration={"description": "Python 3.11 standard library source, calibration split: 32 files",
                     "train_tokens": 123456, "heldout_tokens": 30864, "sequences": 301, "max_length": 512,
                     "top_k": 1, "seconds": 42.5},
        quality={"retention": RETENTION, "speed": {"ttft_speedup_2k": 7.25}},
    )
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
    return make_map(calibration=dict(make_map().config.calibration, license="apache-2.0")).save_pretrained(
        tmp_path / "map", repo_id="my-org/coder-0.5b-to-1.5b-kvmap")


def test_metadata_parses_with_huggingface_hub(saved):
    data = ModelCard.load(saved / "README.md").data
    assert data.library_name == "peft-kvcache"
    assert data.base_model == ["Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"]
    assert {"peft-kvcache", "kv-cache", "cross-shape"} <= set(data.tags)
    assert data.license == "apache-2.0"
    assert {"heldout_key_r2", "normalized_retention", "raw_retention", "ttft_speedup_2k"} <= set(data.metrics)
    assert not {"context_length", "examples"} & set(data.metrics)
    meta = data.to_dict()["peft_kvcache"]
    assert meta["source_fingerprint"] == SOURCE_FP and meta["target_fingerprint"] == TARGET_FP
    figures = meta["figures"]
    assert figures["retention.mapped@1.normalized_retention"] == pytest.approx(0.8123)
    assert figures["speed.ttft_speedup_2k"] == pytest.approx(7.25)
    assert figures["heldout_key_r2"] == pytest.approx(0.65)


def test_the_card_has_every_section(saved):
    text = ModelCard.load(saved / "README.md").text
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    for section in ("What the map does", "The pair", "Calibration", "Layer selection",
                    "Measured quality and speed", "Usage", "Limitations"):
        assert section in headings
    assert SOURCE_FP in text and TARGET_FP in text
    assert "Qwen/Qwen2.5-Coder-0.5B-Instruct" in text and "Qwen/Qwen2.5-Coder-1.5B-Instruct" in text
    assert "Python 3.11 standard library source" in text and "123,456" in text and "30,864" in text
    assert "0.8123" in text and "7.25" in text                      # measured figures
    assert "| 2 | 1 | 1 | 0.450 | 0.500 |" in text                  # layer table: target 2 <- source 1
    assert "same tokenizer" in text                                # limitations
    assert "{{" not in text and "}}" not in text                   # every placeholder was filled


def test_the_layer_chart_is_written_and_linked(saved):
    text = (saved / "README.md").read_text()
    assert "](layer_r2.png)" in text
    assert (saved / "layer_r2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_usage_snippet_is_python_that_loads_this_map(saved):
    text = (saved / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, flags=re.S).group(1)
    tree = ast.parse(snippet)
    calls = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute)}
    assert {"from_pretrained", "from_source", "generate"} <= calls
    assert 'KVMap.from_pretrained("my-org/coder-0.5b-to-1.5b-kvmap")' in snippet
    assert 'from_pretrained("Qwen/Qwen2.5-Coder-1.5B-Instruct"' in snippet


def test_a_card_saved_without_repo_id_never_names_this_machines_path(tmp_path):
    folder = make_map().save_pretrained(tmp_path / "deep" / "coder-map")
    text = (folder / "README.md").read_text()
    assert 'KVMap.from_pretrained("coder-map")' in text and str(tmp_path) not in text


def test_fixture_models_get_a_snippet_that_loads_the_fixture():
    kv_map = make_map(calibration={"source_spec": "gguf:qwen2.5-coder-0.5b-instruct",
                                   "target_spec": "gguf:qwen2.5-coder-1.5b-instruct"})
    snippet = card.usage_snippet(kv_map, "org/map")
    ast.parse(snippet)
    assert 'source_model, tokenizer = load_model("gguf:qwen2.5-coder-0.5b-instruct")' in snippet
    assert 'target_model = load_model("gguf:qwen2.5-coder-1.5b-instruct")[0]' in snippet


def test_an_adapter_map_says_so_and_loads_the_adapter(tmp_path):
    same = dict(source_layout=KVLayout(3, 2, 8), key_layers=[[0], [1], [2]], value_layers=[[0], [1], [2]],
                key_candidate_r2=[], value_candidate_r2=[], pair_kind="same_shape",
                target_name="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    unknown = make_map(**same)
    assert "<the adapter this map was fitted for>" in card.usage_snippet(unknown, "org/map")
    known = make_map(**dict(same, calibration={"target_adapter": "org/my-lora"}))
    snippet = card.usage_snippet(known, "org/map")
    ast.parse(snippet)
    base = 'AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-Coder-0.5B-Instruct"'
    assert f"PeftModel.from_pretrained({base}" in snippet
    assert '"org/my-lora")' in snippet
    title = re.search(r"^# (.+)$", card.render_card(known, tmp_path, "org/map"), flags=re.M).group(1)
    assert title.endswith("→ Qwen/Qwen2.5-Coder-0.5B-Instruct (with an adapter)")
    siblings = re.search(r"^# (.+)$", card.render_card(make_map(), tmp_path, "org/map"), flags=re.M).group(1)
    assert "adapter" not in siblings


def test_local_paths_and_architecture_names_are_not_base_models():
    data = card.card_data(make_map(source_name="/tmp/models/src", target_name="qwen2"))
    assert data.base_model is None
    data = card.card_data(make_map(source_name="qwen2", target_name="org/target"))
    assert data.base_model == ["org/target"]


def test_a_map_without_figures_or_license(tmp_path):
    kv_map = make_map(quality={}, key_r2=[], value_r2=[], key_candidate_r2=[], value_candidate_r2=[],
                      calibration={})
    folder = kv_map.save_pretrained(tmp_path / "bare")
    loaded = ModelCard.load(folder / "README.md")
    assert loaded.data.license is None and loaded.data.metrics is None
    assert "No retention or speed figures were recorded" in loaded.text
    assert "keys **not recorded**" in loaded.text
    assert "Calibration data was not described" in loaded.text
    assert not (folder / "layer_r2.png").exists() and "layer_r2.png" not in loaded.text


def test_without_matplotlib_the_card_has_no_chart_and_no_stale_one(saved, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    card.write_card(KVMap.from_pretrained(saved), saved)
    assert not (saved / "layer_r2.png").exists()
    assert "layer_r2.png" not in (saved / "README.md").read_text()
    (saved / "layer_r2.png").write_bytes(b"an earlier chart")
    make_map().save_pretrained(saved)  # saving over an existing map folder
    assert not (saved / "layer_r2.png").exists()


def test_write_card_rewrites_only_the_card(saved):
    weights, config = (saved / "model.safetensors").read_bytes(), (saved / "config.json").read_bytes()
    (saved / "README.md").write_text("stale")
    card.write_card(KVMap.from_pretrained(saved), saved, repo_id="other/repo")
    assert (saved / "model.safetensors").read_bytes() == weights and (saved / "config.json").read_bytes() == config
    assert 'KVMap.from_pretrained("other/repo")' in (saved / "README.md").read_text()


def test_quality_tables_and_values():
    text = card.quality_text({"retention": RETENTION, "note": "a|b", "flag": True})
    assert "| retention.context_length | 512 |" in text
    assert "| variant | accuracy | raw_retention | normalized_retention |" in text
    assert "| mapped@1 | 0.5432 | 0.8905 | 0.8123 |" in text
    assert "a\\|b" in text  # a pipe would break the table
    assert card.quality_text({}).startswith("No retention or speed figures")


def test_the_card_module_docstring_examples():
    results = doctest.testmod(card, optionflags=doctest.ELLIPSIS)
    assert results.attempted >= 1 and results.failed == 0


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


def test_the_template_is_shared_with_hub_cards():
    linked = REPO_ROOT / "hub_cards" / "modelcard_template.md"
    assert linked.read_text() == card.TEMPLATE_PATH.read_text()


def _hub_card_folders() -> list[Path]:
    root = REPO_ROOT / "hub_cards"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


@pytest.mark.parametrize("folder", _hub_card_folders(), ids=lambda p: p.name)
def test_every_published_map_has_a_card(folder):
    kv_map = KVMap.from_pretrained(folder)
    data = ModelCard.load(folder / "README.md").data
    assert data.library_name == "peft-kvcache"
    assert data.to_dict()["peft_kvcache"]["target_fingerprint"] == kv_map.config.target_fingerprint
