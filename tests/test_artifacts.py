"""The map artifact on disk (maps/storage.py: save and load). Loading validation: a truncated, tampered or mismatched
artifact gives an `ArtifactError` that names the file and the problem, before anything is allocated or executed;
nothing is ever unpickled or run as remote code. Saving: atomic (a save killed or raising midway leaves the old map
or the new one), with ordinary permissions, through symlinks, and never over a folder that is not a map."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_map, rotary_summary, tiny_model
from safetensors.torch import load_file, save_file

import peft_kvcache
from peft_kvcache import ArtifactError, KVMap
from peft_kvcache.maps.registry import MapRegistry
from peft_kvcache.maps.storage import load_config


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


def test_the_same_weights_save_to_the_same_bytes(tmp_path):
    # safetensors orders the header's metadata by a hash seeded anew per file: unsorted, one map's weights made two
    # files (and two fingerprints for the records that name a map by its file)
    kv_map = make_map()
    saved = {kv_map.save_pretrained(tmp_path / f"map{i}", chart=False).joinpath("model.safetensors").read_bytes()
             for i in range(8)}
    assert len(saved) == 1


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


@pytest.mark.parametrize("text", ["", "{", "not json", '{"format_version": 1,', "\xff\xfe",
                                  '{"format_version": ' + "9" * 5000 + "}"])  # past Python's digit limit
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
    _edit_config(saved, lambda d: d.update(source_layout=huge, source_rotary=rotary_summary(4096)))
    message = _load_error(saved)
    assert "model.safetensors" in message and "shape" in message


@pytest.mark.parametrize("rotary", [
    dict(rotary_summary(8), rotary_dim=7),
    dict(rotary_summary(8), rotary_dim=16),
    dict(rotary_summary(8), head_dim=16),
    dict(rotary_summary(8), attention_scaling="1.0"),
    dict(rotary_summary(8), attention_scaling=float("nan")),
    dict(rotary_summary(8), attention_scaling=0),
    dict(rotary_summary(8), rope_type="dynamic", max_position=-5),
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
    ("pair_kind", "same_shape"),  # between layouts that differ: a cross-shape map
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


def test_a_folder_of_maps_passes_over_a_card_without_weights_and_says_which(tmp_path, saved, caplog):
    maps = tmp_path / "maps"
    shutil.copytree(saved, maps / "whole")
    shutil.copytree(saved, maps / "card-only")  # what git holds of a map whose weights stay out of it
    (maps / "card-only" / "model.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="peft_kvcache.maps.registry"):
        registry = MapRegistry(maps)
    assert list(registry.configs) == [str(maps / "whole")]
    assert "card-only has no model.safetensors" in caplog.text
    assert "kept out of git" in _load_error(maps / "card-only")
    assert load_config(maps / "card-only").to_dict() == make_map().config.to_dict()  # the card alone still reads


def test_a_huge_config_file_is_refused_unread(saved, monkeypatch):
    monkeypatch.setattr("peft_kvcache.maps.storage._MAX_CONFIG_BYTES", 100)
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


def test_another_maps_evaluation_is_dropped_when_its_figures_are_not_cited(saved):
    """A map saved over another keeps the folder's other files but not the old map's ``evaluation.json``, unless
    the new config cites it (figures recorded for these weights)."""
    from peft_kvcache.maps.config import Figure

    (saved / "evaluation.json").write_text('{"retention": {}}')
    cited = make_map()
    cited.config.quality.figures = {"mapped@0.kl": Figure(0.1, "evaluation.json", "retention/rows/variant=mapped@0/kl")}
    cited.save_pretrained(saved, chart=False)
    assert (saved / "evaluation.json").is_file()
    make_map(seed=1).save_pretrained(saved, chart=False)
    assert not (saved / "evaluation.json").exists()


def test_saving_onto_a_file_is_refused(tmp_path):
    path = tmp_path / "map"
    path.write_text("not a folder")
    with pytest.raises(ArtifactError, match="is a file"):
        make_map().save_pretrained(path, chart=False)
    assert path.read_text() == "not a folder"


def test_a_failed_save_leaves_no_folder(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("peft_kvcache.maps.storage.save_file", fail)
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


# ----- saving into folders: model folders, permissions, missing local paths -----


def test_saving_into_a_model_folder_is_refused_unless_told(tmp_path, sibling_map):
    folder = tmp_path / "model"
    tiny_model("qwen2").save_pretrained(folder)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(ArtifactError, match="not a KV map"):
        sibling_map.save_pretrained(folder)
    assert sorted(p.name for p in folder.iterdir()) == before
    sibling_map.save_pretrained(folder, overwrite=True)
    assert KVMap.from_pretrained(folder).config.to_dict() == sibling_map.config.to_dict()


def test_saved_maps_have_ordinary_permissions(tmp_path, sibling_map):
    existing = tmp_path / "shared"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    sibling_map.save_pretrained(existing)
    umask = os.umask(0)
    os.umask(umask)
    assert (existing.stat().st_mode & 0o777) == 0o777 & ~umask
    assert ((existing / "model.safetensors").stat().st_mode & 0o777) == 0o666 & ~umask


def test_a_missing_local_path_is_an_artifact_error_without_a_hub_lookup(monkeypatch, tmp_path):
    monkeypatch.setattr("peft_kvcache.maps.storage.snapshot_download",
                        lambda *a, **k: pytest.fail("looked up the Hub for a local path"))
    for spec in ("./missing", str(tmp_path / "missing"), "a/b/c", "~/nowhere", "not a repo id!"):
        with pytest.raises(ArtifactError, match="no map folder"):
            KVMap.from_pretrained(spec)


# ----- atomic saves: killed or raising midway, through symlinks -----


def _old_and_new_maps() -> tuple[KVMap, KVMap]:
    """Two maps with tensors of the same shapes but different layer selections: the old config with the new
    weights (or the reverse) would load as a valid, silently wrong map."""
    old, new = make_map(seed=0), make_map(seed=1)
    new.config.key_layers = [[1], [0], [0, 1]]
    new.config.value_layers = [[0], [0], [1]]
    return old, new


def _loads_as(folder: Path, expected: KVMap) -> bool:
    loaded = KVMap.from_pretrained(folder)
    same = loaded.config.to_dict() == expected.config.to_dict() and all(
        torch.equal(loaded.tensors[k], v) for k, v in expected.tensors.items())
    assert same, "the folder loads as a map that is neither the old nor the new one"
    return same


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("crash_at", ["weights", "swap", "between_renames", None])
def test_a_save_killed_at_any_step_leaves_the_old_map_or_the_new_one(tmp_path, crash_at):
    """A real hard crash (the process exits with no cleanup) while saving over an existing map. At every step
    the path loads as the old map or the new one; where the system cannot swap folders atomically and the kill
    falls between the two renames, the next load puts the old map back. Leftovers go with the next save."""
    old, new = _old_and_new_maps()
    folder = old.save_pretrained(tmp_path / "map", chart=False)
    (folder / "notes.txt").write_text("keep me")
    pid = os.fork()
    if pid == 0:  # child: save the new map, dying at `crash_at`
        try:
            from peft_kvcache import _files
            from peft_kvcache.maps import storage

            die = lambda *args, **kwargs: os._exit(9)  # noqa: E731
            if crash_at == "weights":
                storage.save_file = die
            elif crash_at == "swap":
                _files.exchange = die
            elif crash_at == "between_renames":
                _files.exchange = lambda a, b: False  # a system without the atomic swap
                real, calls = os.replace, [0]

                def replace(*args, **kwargs):
                    calls[0] += 1
                    if calls[0] == 2:  # the old folder is aside, the new one not yet in
                        os._exit(9)
                    return real(*args, **kwargs)

                os.replace = replace
            new.save_pretrained(folder, chart=False)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == (0 if crash_at is None else 9)
    if crash_at == "between_renames":
        assert not folder.exists() and len(list(tmp_path.glob(".map.old-*"))) == 1
    assert bool(_leftovers(tmp_path)) == (crash_at is not None)  # the dead process's staging (or backup) folder
    expected = new if crash_at is None else old
    assert _loads_as(folder, expected) and (folder / "notes.txt").read_text() == "keep me"
    assert _leftovers(tmp_path) == []  # the next load cleaned up after the dead process


@pytest.mark.parametrize("fail_at", ["weights", "config", "swap"])
def test_a_save_that_raises_midway_keeps_the_old_map(tmp_path, monkeypatch, fail_at):
    old, new = _old_and_new_maps()
    folder = old.save_pretrained(tmp_path / "map", chart=False)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    if fail_at == "weights":
        monkeypatch.setattr("peft_kvcache.maps.storage.save_file", fail)
    elif fail_at == "config":
        monkeypatch.setattr(Path, "write_text", fail)
    else:
        monkeypatch.setattr("peft_kvcache._files.exchange", fail)
    with pytest.raises(OSError, match="disk full"):
        new.save_pretrained(folder, chart=False)
    monkeypatch.undo()
    assert _loads_as(folder, old)
    assert [p.name for p in tmp_path.iterdir()] == ["map"], "staging or backup folders left behind"


def test_saving_through_a_symlink_replaces_the_folder_it_points_to(tmp_path):
    old, new = _old_and_new_maps()
    real = old.save_pretrained(tmp_path / "real", chart=False)
    link = tmp_path / "link"
    link.symlink_to(real)
    new.save_pretrained(link, chart=False)
    assert link.is_symlink() and _loads_as(real, new)


# ----- hostile artifacts: huge layouts and headers, no remote code -----


def _spy_on_tensor_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    real_open = peft_kvcache.maps.storage.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_tensor(self, name):
            reads.append(name)
            return self.inner.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(peft_kvcache.maps.storage, "safe_open", Spy)
    return reads


def test_a_huge_layout_in_config_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    folder = make_map().save_pretrained(tmp_path / "map", chart=False)
    reads = _spy_on_tensor_reads(monkeypatch)
    KVMap.from_pretrained(folder)
    assert reads, "the spy does not see tensor reads"
    reads.clear()
    data = json.loads((folder / "config.json").read_text())
    data["source_layout"] = {"num_layers": 2, "kv_heads": 512, "head_dim": 4096}  # a 2M x 16 weight per layer
    data["source_rotary"]["head_dim"] = data["source_rotary"]["rotary_dim"] = 4096
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="shape"):
        KVMap.from_pretrained(folder)
    assert reads == []


def test_a_header_claiming_a_huge_tensor_that_matches_the_config_is_refused_unread(tmp_path, monkeypatch):
    """The header agrees with a (plausible) config about a 16 GiB weight, but the file holds a few bytes."""
    folder = make_map().save_pretrained(tmp_path / "map", chart=False)
    data = json.loads((folder / "config.json").read_text())
    data["source_layout"] = {"num_layers": 2, "kv_heads": 1024, "head_dim": 2048}
    data["source_rotary"]["head_dim"] = data["source_rotary"]["rotary_dim"] = 2048
    (folder / "config.json").write_text(json.dumps(data))
    config = peft_kvcache.KVMapConfig.from_dict(data)
    header = {name: {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 4 * int(torch.tensor(shape).prod())]}
              for name, shape in peft_kvcache.maps.config.expected_shapes(config).items()}
    offset = 0
    for entry in header.values():  # contiguous offsets, as a real file would have, but no data behind them
        size = entry["data_offsets"][1]
        entry["data_offsets"] = [offset, offset + size]
        offset += size
    blob = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + b"\0" * 64)
    reads = _spy_on_tensor_reads(monkeypatch)
    with pytest.raises(ArtifactError, match="corrupted or truncated"):
        KVMap.from_pretrained(folder)
    assert reads == []


def test_the_package_never_executes_or_trusts_remote_code():
    package = Path(peft_kvcache.__file__).parent
    pattern = r"trust_remote_code\s*=\s*True|(?<![.\w])(eval|exec)\(|__import__\(|marshal\.loads|yaml\.load\("
    offenders = [p.name for p in package.rglob("*.py") if re.search(pattern, p.read_text())]
    assert offenders == []


def test_saving_the_same_weights_again_keeps_the_files_bytes(tmp_path):
    """A card rendered again (same tensors) leaves model.safetensors byte for byte as it was: safetensors' header
    order would otherwise change the file, and with it anything that names a map by its file's hash."""
    from conftest import make_map

    kv_map = make_map()
    folder = kv_map.save_pretrained(tmp_path / "map", chart=False)
    before, written = (folder / "model.safetensors").read_bytes(), (folder / "model.safetensors").stat().st_mtime_ns
    for _ in range(3):
        kv_map.save_pretrained(folder, chart=False, overwrite=True)
        assert (folder / "model.safetensors").read_bytes() == before
        assert (folder / "model.safetensors").stat().st_mtime_ns == written  # kept, not serialized again
    changed = make_map(seed=1)
    changed.save_pretrained(folder, chart=False, overwrite=True)
    assert (folder / "model.safetensors").read_bytes() != before


def test_a_map_saved_again_while_it_is_read_is_read_from_one_folder(saved, tmp_path, monkeypatch):
    """A save swaps the whole folder: a read that took the config of one map and the weights of the next is read
    again, never mixed."""
    from peft_kvcache.maps import storage

    newer = make_map(seed=5)
    newer.config.source_name = "another-source"  # a config that tells the two maps apart
    read_config, saves = storage.load_config, []

    def config_then_a_save(folder):
        config = read_config(folder)
        if not saves:
            saves.append(newer.save_pretrained(saved, chart=False))
        return config

    monkeypatch.setattr(storage, "load_config", config_then_a_save)
    loaded = KVMap.from_pretrained(saved)
    assert saves and loaded.config.to_dict() == newer.config.to_dict()
    assert all(torch.equal(loaded.tensors[name], tensor) for name, tensor in newer.tensors.items())


def test_a_map_tensor_that_is_not_floating_point_is_refused_before_saving(tmp_path):
    kv_map = make_map()
    name = next(iter(kv_map.tensors))
    with pytest.raises(ArtifactError, match="floating point"):
        KVMap(kv_map.config, {**kv_map.tensors, name: kv_map.tensors[name].to(torch.int64)})



def test_a_route_through_a_model_that_is_one_end_is_the_direct_lookup(tmp_path):
    """Identities are compared by their weights' fingerprint (two read apart hold equal rotary tensors, which do not
    compare as one truth value)."""
    from peft_kvcache.maps.registry import Identity
    from peft_kvcache.modeling.positions import RotarySpec

    def identity(fingerprint: str) -> Identity:
        return Identity(fingerprint, make_map().config.target_layout, RotarySpec(torch.ones(4), 1.0, 8))

    registry = MapRegistry([tmp_path])
    direct = registry.find(identity("a"), identity("b"))
    assert registry.route(identity("a"), identity("b"), via=identity("a")) == direct


def test_a_saved_map_reaches_the_disk_before_it_replaces_the_old_one(saved, monkeypatch):
    """The staged files are fsynced before the swap: after a crash the folder holds whole files, not empty ones."""
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real_fsync(fd))
    folder = make_map(seed=3).save_pretrained(saved, chart=False)
    for name in ("config.json", "model.safetensors", "README.md"):
        assert (folder / name).stat().st_ino in synced, name


def test_a_registry_refuses_a_folder_saved_again_with_another_map_since_it_matched(saved):
    registry = MapRegistry([saved.parent])
    newer = make_map(seed=4)
    newer.config.source_fingerprint = "f" * 16  # another source's map, saved where the matched one was
    newer.save_pretrained(saved, chart=False)
    with pytest.raises(ArtifactError, match="another map than the one this registry matched"):
        registry.load(str(saved))
    assert MapRegistry([saved.parent]).load(str(saved)).config.source_fingerprint == "f" * 16
