"""Loading validation: a truncated, tampered or mismatched artifact gives an `ArtifactError` that names the
file and the problem, before anything is allocated or executed; nothing is ever unpickled."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import peft_kvcache
from peft_kvcache import ArtifactError, KVMap, KVMapConfig
from peft_kvcache.maps.config import CalibrationRecord, DataRecord
from peft_kvcache.modeling.layout import KVLayout
from peft_kvcache.modeling.positions import RotaryRecord

SOURCE, TARGET = KVLayout(2, 2, 8), KVLayout(3, 2, 8)


def _rotary(head_dim: int) -> dict:
    return {"rope_type": "default", "head_dim": head_dim, "rotary_dim": head_dim, "attention_scaling": 1.0,
            "max_position": None}


def make_map(seed: int = 0) -> KVMap:
    """A small map built by hand (no model needed): 2 source layers -> 3 target layers, 2 KV heads of 8."""
    generator = torch.Generator().manual_seed(seed)
    key_layers = [[0], [1], [0, 1]]
    config = KVMapConfig(
        source_name="org/source", target_name="org/target",
        source_fingerprint="a" * 64, target_fingerprint="b" * 64,
        source_layout=SOURCE, target_layout=TARGET,
        source_rotary=RotaryRecord(**_rotary(8)), target_rotary=RotaryRecord(**_rotary(8)), vocab_size=128,
        pair_kind="cross_shape",
        key_layers=key_layers, value_layers=[[1], [1], [0]],
        key_r2=[[0.9, 0.8], [0.7, 0.6], [0.5, 0.4]], value_r2=[[0.95, 0.9], [0.8, 0.7], [0.6, 0.5]],
        key_lambdas=[[1.0, 1.0]] * 3, value_lambdas=[[0.1, 0.1]] * 3,
        key_candidate_r2=[[0.9, 0.5], [0.4, 0.7], [0.5, 0.5]], value_candidate_r2=[[0.2, 0.9], [0.3, 0.8], [0.6, 0.1]],
        calibration=CalibrationRecord(data=DataRecord("hand-made"), train_tokens=1000, heldout_tokens=250),
    )
    tensors = {"source.inv_freq": 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8),
               "target.inv_freq": 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)}
    width_in, width_out = SOURCE.layer_width, TARGET.layer_width
    for kind, groups in (("keys", key_layers), ("values", config.value_layers)):
        for t, group in enumerate(groups):
            tensors[f"{kind}.{t}.weight"] = torch.randn(len(group) * width_in, width_out, generator=generator)
            tensors[f"{kind}.{t}.bias"] = torch.randn(width_out, generator=generator)
    return KVMap(config, tensors)


@pytest.fixture
def saved(tmp_path) -> Path:
    return make_map().save_pretrained(tmp_path / "map", chart=False)


def _edit_config(folder: Path, edit) -> None:
    data = json.loads((folder / "config.json").read_text())
    edit(data)
    (folder / "config.json").write_text(json.dumps(data))


def _load_error(folder: Path) -> str:
    with pytest.raises(ArtifactError) as info:
        KVMap.from_pretrained(folder)
    return str(info.value)


def test_a_saved_map_loads_back_identical(saved):
    original, loaded = make_map(), KVMap.from_pretrained(saved)
    assert loaded.config.to_dict() == original.config.to_dict()
    assert set(loaded.tensors) == set(original.tensors)
    assert all(torch.equal(loaded.tensors[k], original.tensors[k]) for k in original.tensors)


@pytest.mark.parametrize("keep", [0, 5, 8, 100, -40, -1])
def test_truncated_weights_are_refused(saved, keep):
    path = saved / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    message = _load_error(saved)
    assert "model.safetensors" in message and "corrupted or truncated" in message


def test_a_header_announcing_a_huge_size_is_refused_without_allocating(saved):
    path = saved / "model.safetensors"
    path.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    assert "model.safetensors" in _load_error(saved)


def test_a_pickle_in_place_of_the_weights_is_never_executed(saved, tmp_path):
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (saved / "model.safetensors").write_bytes(pickle.dumps({"keys.0.weight": Payload()}))
    (saved / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    assert "model.safetensors" in _load_error(saved)
    (saved / "model.safetensors").unlink()
    make_map().save_pretrained(saved, chart=False)  # a valid map beside a malicious .bin: the .bin is ignored
    KVMap.from_pretrained(saved)
    assert not marker.exists()


def test_loading_never_calls_an_unpickler(saved, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    KVMap.from_pretrained(saved)


def test_the_package_source_contains_no_unpickling():
    package = Path(peft_kvcache.__file__).parent
    offenders = [p.name for p in package.rglob("*.py")
                 if re.search(r"torch\.load\(|pickle\.loads?\(|import pickle|weights_only\s*=\s*False", p.read_text())]
    assert offenders == []


@pytest.mark.parametrize("text", ["", "{", "not json", '{"format_version": 1,', "\xff\xfe"])
def test_invalid_json_config(saved, text):
    (saved / "config.json").write_bytes(text.encode("latin-1"))
    message = _load_error(saved)
    assert "config.json" in message and ("JSON" in message or "UTF" in message)


def test_config_that_is_not_an_object(saved):
    (saved / "config.json").write_text("[1, 2, 3]")
    assert "JSON object" in _load_error(saved)


@pytest.mark.parametrize("version", [1, 3, 0, "2", True, None, 1.5])
def test_unsupported_format_version(saved, version):
    _edit_config(saved, lambda d: d.update(format_version=version))
    message = _load_error(saved)
    assert "format_version" in message and "config.json" in message


def test_missing_format_version(saved):
    _edit_config(saved, lambda d: d.pop("format_version"))
    assert "format_version None" in _load_error(saved)


@pytest.mark.parametrize("key", ["key_layers", "source_layout", "target_fingerprint", "source_rotary"])
def test_missing_keys_are_named(saved, key):
    _edit_config(saved, lambda d: d.pop(key))
    message = _load_error(saved)
    assert "missing keys" in message and key in message


@pytest.mark.parametrize("layers, expected", [
    ([[0], [2], [0]], "source layers in 0..1"),          # source layer 2 of 2 layers
    ([[0], [-1], [0]], "source layers in 0..1"),
    ([[0], [1]], "for each of 3 target layers"),         # one group short
    ([[0], [], [1]], "source layers in 0..1"),           # empty group
    ([[0], [True], [1]], "must be an integer"),          # a boolean is not a layer index
    ([[0], [1.0], [1]], "must be an integer"),
    ("0,1,1", "must be a list"),
])
def test_layer_indices_out_of_range(saved, layers, expected):
    _edit_config(saved, lambda d: d.update(key_layers=layers))
    message = _load_error(saved)
    assert "config.json" in message and "key_layers" in message and expected in message


def test_value_layers_are_checked_too(saved):
    _edit_config(saved, lambda d: d.update(value_layers=[[0], [0], [7]]))
    assert "value_layers" in _load_error(saved)


@pytest.mark.parametrize("layout, expected", [
    ({"num_layers": 10**9, "kv_heads": 2, "head_dim": 8}, "implausible"),
    ({"num_layers": 3, "kv_heads": 10**6, "head_dim": 8}, "implausible"),
    ({"num_layers": 3, "kv_heads": 2, "head_dim": 2**20}, "implausible"),
    ({"num_layers": 3, "kv_heads": 2, "head_dim": 7}, "implausible"),
    ({"num_layers": 0, "kv_heads": 2, "head_dim": 8}, "implausible"),
    ({"num_layers": 3.0, "kv_heads": 2, "head_dim": 8}, "must be an integer"),
    ({"num_layers": "3", "kv_heads": 2, "head_dim": 8}, "must be an integer"),
    ({"num_layers": 3, "kv_heads": 2}, "missing keys ['head_dim']"),
    ({"num_layers": 3, "kv_heads": 2, "head_dim": 8, "extra": 1}, "unknown keys ['extra']"),
    ([3, 2, 8], "must be a JSON object"),
])
def test_absurd_or_malformed_layouts(saved, layout, expected):
    _edit_config(saved, lambda d: d.update(target_layout=layout))
    message = _load_error(saved)
    assert expected in message and "target_layout" in message


def test_a_large_but_plausible_layout_fails_on_the_header_without_allocating(saved):
    # 1024 layers x 1024 heads x 4096 would be a 4M x 4M float weight per layer (64 TB): the safetensors
    # header is compared first, so this must fail fast instead of trying to allocate.
    huge = {"num_layers": 2, "kv_heads": 1024, "head_dim": 4096}
    _edit_config(saved, lambda d: d.update(source_layout=huge, source_rotary=_rotary(4096)))
    message = _load_error(saved)
    assert "model.safetensors" in message and "shape" in message


@pytest.mark.parametrize("rotary", [
    dict(_rotary(8), rotary_dim=7),
    dict(_rotary(8), rotary_dim=16),
    dict(_rotary(8), head_dim=16),
    dict(_rotary(8), attention_scaling="1.0"),
    dict(_rotary(8), attention_scaling=float("nan")),
    dict(_rotary(8), attention_scaling=0),
    "default",
])
def test_malformed_rotary_summary(saved, rotary):
    _edit_config(saved, lambda d: d.update(target_rotary=rotary))
    assert "target_rotary" in _load_error(saved)


@pytest.mark.parametrize("field, value", [
    ("key_r2", [[0.9, 0.8]]),                 # one row for three target layers
    ("value_r2", [[0.9], [0.9], [0.9]]),      # one number for two KV heads
    ("key_lambdas", [[1.0, "x"]] * 3),
    ("key_candidate_r2", [[0.1]] * 3),        # one number for two source layers
    ("key_r2", {"0": [0.9, 0.8]}),
])
def test_malformed_per_head_figures(saved, field, value):
    _edit_config(saved, lambda d: d.update({field: value}))
    assert field in _load_error(saved)


@pytest.mark.parametrize("field, value", [
    ("pair_kind", "sideways"), ("vocab_size", 0), ("calibration", "some text"), ("quality", [1, 2]),
    ("source_name", 3), ("calibration", {"options": {"sink_tokens": -1}}), ("calibration", {"options": {"sink_tokens": 1.5}}),
    ("quality", {"gate": {"predicted_retention": float("nan")}}), ("quality", {"figures": {"x": {"value": "0.9", "results": "r.json", "key": "x"}}}),
    ("refresh", {"tokens": -3}), ("unknown_key", 1),
])
def test_other_tampered_fields(saved, field, value):
    _edit_config(saved, lambda d: d.update({field: value}))
    message = _load_error(saved)
    assert field in message and "config.json" in message


def _rewrite_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t.update({"keys.2.weight": t["keys.2.weight"].T.contiguous()}), "keys.2.weight"),
    (lambda t: t.update({"values.2.bias": t["values.2.bias"][:-1].contiguous()}), "values.2.bias"),
    (lambda t: t.update({"source.inv_freq": torch.ones(3)}), "source.inv_freq"),
    (lambda t: t.update({"keys.1.weight": t["keys.1.weight"].to(torch.int32)}), "I32"),
    (lambda t: t.update({"keys.1.bias": t["keys.1.bias"] > 0}), "BOOL"),
    (lambda t: t.pop("values.1.weight"), "values.1.weight"),
    (lambda t: t.update({"extra": torch.zeros(1)}), "extra"),
])
def test_wrong_tensor_shapes_dtypes_or_names(saved, edit, expected):
    _rewrite_weights(saved, edit)
    message = _load_error(saved)
    assert expected in message and "model.safetensors" in message


def test_non_finite_weights_are_refused(saved):
    def poison(tensors):
        tensors["values.0.weight"][0, 0] = float("nan")

    _rewrite_weights(saved, poison)
    message = _load_error(saved)
    assert "NaN" in message and "values.0.weight" in message


def test_half_precision_weights_keep_their_dtype_and_are_placed_in_float32(saved):
    _rewrite_weights(saved, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    loaded = KVMap.from_pretrained(saved)
    assert loaded.tensors["keys.0.weight"].dtype == torch.bfloat16  # half the memory and file
    assert loaded.tensors["source.inv_freq"].dtype == torch.float32  # rotary frequencies stay exact
    weight, _ = loaded.layer_weights("keys", 0, torch.device("cpu"), torch.float32)
    assert weight.dtype == torch.float32
    torch.testing.assert_close(weight, make_map().tensors["keys.0.weight"], rtol=1e-2, atol=1e-2)


def test_a_folder_without_the_map_files(tmp_path, saved):
    (saved / "model.safetensors").unlink()
    assert "model.safetensors is missing" in _load_error(saved)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "config.json is missing" in _load_error(empty)


def test_a_huge_config_file_is_refused_unread(saved, monkeypatch):
    monkeypatch.setattr("peft_kvcache.maps.kvmap._MAX_CONFIG_BYTES", 100)
    assert "too large" in _load_error(saved)


def test_paths_that_are_neither_folders_nor_repo_ids(tmp_path, saved):
    assert "is a file" in _load_error(saved / "config.json")
    assert "there is no map folder" in _load_error(tmp_path / "no" / "such" / "map")


def test_saving_into_an_existing_folder_keeps_other_files(saved):
    (saved / "benchmark.csv").write_text("context,ttft\n512,0.1\n")
    other = make_map(seed=1)
    other.save_pretrained(saved, chart=False)
    assert (saved / "benchmark.csv").read_text().startswith("context")
    loaded = KVMap.from_pretrained(saved)
    assert torch.equal(loaded.tensors["keys.0.weight"], other.tensors["keys.0.weight"])
    assert not any(p.name.startswith(".") for p in saved.parent.iterdir()), "staging folder left behind"


def test_saving_onto_a_file_is_refused(tmp_path):
    path = tmp_path / "map"
    path.write_text("not a folder")
    with pytest.raises(ArtifactError, match="is a file"):
        make_map().save_pretrained(path, chart=False)
    assert path.read_text() == "not a folder"


def test_a_failed_save_leaves_no_folder(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("peft_kvcache.maps.kvmap.save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        make_map().save_pretrained(tmp_path / "map", chart=False)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("edit, field", [(lambda c: setattr(c, "key_r2", [[float("nan"), 0.8]] * 3), "key_r2"),
                                         (lambda c: setattr(c, "pair_kind", "sideways"), "pair_kind")])
def test_a_map_whose_config_would_not_load_is_never_saved(tmp_path, saved, edit, field):
    kv_map = KVMap.from_pretrained(saved)
    edit(kv_map.config)
    with pytest.raises(ArtifactError, match=field):
        kv_map.save_pretrained(saved, chart=False)
    with pytest.raises(ArtifactError, match=field):
        kv_map.save_pretrained(tmp_path / "new", chart=False)
    assert KVMap.from_pretrained(saved).config.pair_kind == "cross_shape" and not (tmp_path / "new").exists()
