"""Maps on the Hub: resolving a repo id from a Hugging Face cache the test writes itself (offline), at the
default and at pinned revisions; the hub's own not-found errors; the calibrate -> save -> card -> load round
trip; push_to_hub against a fake HfApi."""

from __future__ import annotations

import copy
import json
import shutil
from fnmatch import fnmatch
from dataclasses import replace
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard, constants
from huggingface_hub.errors import LocalEntryNotFoundError
from transformers import AutoModelForCausalLM, Qwen2Config

from peft_kvcache import ArtifactError, KVMap, MappedCache
from peft_kvcache.maps import storage
from peft_kvcache.maps.config import QualityRecord

REPO = "org/tiny-kvmap"
MAIN_SHA = "1" * 40
PINNED_SHA = "2" * 40


def _tiny(seed: int, layers: int) -> torch.nn.Module:
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def pair():
    """A tiny cross-shape pair and a map calibrated for it."""
    source, target = _tiny(0, 2), _tiny(1, 3)
    torch.manual_seed(2)
    kv_map = KVMap.calibrate(source, target, [torch.randint(0, 128, (64,)) for _ in range(10)], progress=False)
    return source, target, kv_map


@pytest.fixture(scope="module")
def saved_maps(pair, tmp_path_factory) -> dict[str, Path]:
    """Two different saved maps: 'main' (the calibrated one) and 'pinned' (other weights, other figures)."""
    _, _, kv_map = pair
    root = tmp_path_factory.mktemp("maps")
    main = kv_map.save_pretrained(root / "main")
    other = KVMap(kv_map.config, {k: v if k.endswith("inv_freq") else v * 0.5 for k, v in kv_map.tensors.items()})
    other.config = type(kv_map.config).from_dict(dict(kv_map.config.to_dict(), quality={"figures": {"marker": {"value": 2.0, "results": "r.json", "key": "m"}}}))
    pinned = other.save_pretrained(root / "pinned", chart=False)
    return {"main": main, "pinned": pinned}


def write_hub_cache(cache: Path, repo_id: str, snapshots: dict[str, Path], refs: dict[str, str],
                    files: tuple[str, ...] = ("config.json", "model.safetensors", "README.md")) -> Path:
    """Lay out a Hugging Face cache by hand: blobs, snapshots/<sha>/ symlinks to them, refs/<name> -> sha."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    for sha, folder in snapshots.items():
        snapshot = storage / "snapshots" / sha
        snapshot.mkdir(parents=True)
        for name in files:
            if (folder / name).exists():
                blob = storage / "blobs" / f"{sha[:8]}-{name}"
                blob.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / name, blob)
                (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    for ref, sha in refs.items():
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(sha)
    return storage


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 with the default cache in tmp_path. huggingface_hub reads the variable once, at
    import, into ``constants.HF_HUB_OFFLINE`` (and every request checks ``constants.is_offline_mode()``),
    so the constant is patched too."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert huggingface_hub.is_offline_mode()
    return cache


def _same_tensors(a: KVMap, b: KVMap) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_repo_id_resolves_at_the_default_and_at_pinned_revisions(offline_cache, saved_maps):
    write_hub_cache(offline_cache, REPO, {MAIN_SHA: saved_maps["main"], PINNED_SHA: saved_maps["pinned"]},
                    {"main": MAIN_SHA, "v1": PINNED_SHA})
    main, pinned = KVMap.from_pretrained(saved_maps["main"]), KVMap.from_pretrained(saved_maps["pinned"])
    assert not _same_tensors(main, pinned)

    by_default = KVMap.from_pretrained(REPO)
    assert _same_tensors(by_default, main) and by_default.config.quality == QualityRecord()
    by_commit = KVMap.from_pretrained(REPO, revision=PINNED_SHA)
    assert _same_tensors(by_commit, pinned) and by_commit.config.quality.figures["marker"].value == 2.0
    by_branch = KVMap.from_pretrained(REPO, revision="v1")
    assert _same_tensors(by_branch, pinned)
    assert _same_tensors(KVMap.from_pretrained(REPO, revision=MAIN_SHA), main)


def test_explicit_cache_dir_and_local_files_only(tmp_path, saved_maps, monkeypatch):
    # Not offline by environment: local_files_only alone must keep the lookup off the network.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    cache = tmp_path / "elsewhere"
    write_hub_cache(cache, REPO, {MAIN_SHA: saved_maps["main"]}, {"main": MAIN_SHA})
    loaded = KVMap.from_pretrained(REPO, cache_dir=cache, local_files_only=True)
    assert _same_tensors(loaded, KVMap.from_pretrained(saved_maps["main"]))


def test_a_missing_repo_gives_the_hubs_not_found_error(offline_cache):
    with pytest.raises(LocalEntryNotFoundError) as info:
        KVMap.from_pretrained("org/no-such-map")
    assert "no local folder" in " ".join(getattr(info.value, "__notes__", []))


def test_a_snapshot_missing_the_weights_is_an_artifact_error(offline_cache, saved_maps):
    write_hub_cache(offline_cache, REPO, {MAIN_SHA: saved_maps["main"]}, {"main": MAIN_SHA},
                    files=("config.json", "README.md"))  # no model.safetensors in the snapshot
    with pytest.raises(ArtifactError, match="model.safetensors is missing"):
        KVMap.from_pretrained(REPO)


def test_a_missing_revision_gives_the_hubs_not_found_error(offline_cache, saved_maps):
    write_hub_cache(offline_cache, REPO, {MAIN_SHA: saved_maps["main"]}, {"main": MAIN_SHA})
    with pytest.raises(LocalEntryNotFoundError):
        KVMap.from_pretrained(REPO, revision="v9")
    with pytest.raises(LocalEntryNotFoundError):
        KVMap.from_pretrained(REPO, revision="9" * 40)


def test_a_corrupted_cached_artifact_is_an_artifact_error(offline_cache, saved_maps, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(saved_maps["main"], broken)
    (broken / "config.json").write_text("{")
    write_hub_cache(offline_cache, REPO, {MAIN_SHA: broken}, {"main": MAIN_SHA})
    with pytest.raises(ArtifactError, match="config.json is not valid JSON"):
        KVMap.from_pretrained(REPO)


def _mapped(source, target, kv_map, ids) -> MappedCache:
    return MappedCache.from_source(source, kv_map, target, input_ids=ids)


def test_round_trip_calibrate_save_card_load_gives_the_same_mapped_cache(pair, tmp_path, offline_cache):
    source, target, kv_map = pair
    folder = kv_map.save_pretrained(tmp_path / "map", repo_id=REPO)
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "peft-kvcache"
    assert f'KVMap.from_pretrained("{REPO}")' in card.text
    write_hub_cache(offline_cache, REPO, {MAIN_SHA: folder}, {"main": MAIN_SHA})

    by_path, by_repo = KVMap.from_pretrained(folder), KVMap.from_pretrained(REPO)
    assert by_path.config.to_dict() == kv_map.config.to_dict() == by_repo.config.to_dict()
    torch.manual_seed(3)
    ids = torch.randint(0, 128, (2, 17))
    expected = _mapped(source, target, kv_map, ids)
    assert len(expected.layers) == 3
    for loaded in (by_path, by_repo):
        got = _mapped(source, target, loaded, ids)
        for a, b in zip(expected.layers, got.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


class FakeHub:
    """Stands in for the Hub's write API: records calls and what the uploaded folder held."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.uploaded: dict[str, bytes] = {}
        self.loaded: KVMap | None = None

    def install(self, monkeypatch, namespace: str = "org") -> None:
        hub = self

        def create_repo(api, repo_id, **kwargs):  # a bare name lands in the token's namespace, as on the Hub
            hub.calls.append(("create_repo", dict(kwargs, repo_id=repo_id)))
            full = repo_id if "/" in repo_id else f"{namespace}/{repo_id}"
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{full}")

        def create_branch(api, repo_id, **kwargs):
            hub.calls.append(("create_branch", dict(kwargs, repo_id=repo_id)))

        def upload_folder(api, **kwargs):
            hub.calls.append(("upload_folder", kwargs))
            folder = Path(kwargs["folder_path"])
            hub.uploaded = {p.name: p.read_bytes() for p in folder.iterdir()}
            hub.loaded = KVMap.from_pretrained(folder)
            return huggingface_hub.CommitInfo(
                commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/{'3' * 40}", commit_message="",
                commit_description="", oid="3" * 40)

        def refuse(*args, **kwargs):
            raise AssertionError("the test must not reach the network")

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", create_branch)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_file", refuse)
        monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", refuse)


def test_push_to_hub_creates_the_repo_and_uploads_the_whole_folder(pair, monkeypatch):
    _, _, kv_map = pair
    hub = FakeHub()
    hub.install(monkeypatch)
    url = kv_map.push_to_hub(REPO, private=True, commit_message="first map")
    assert url == f"https://huggingface.co/{REPO}/commit/{'3' * 40}"
    (name, create), (name2, upload) = hub.calls
    assert name == "create_repo" and create["repo_id"] == REPO and create["private"] is True and create["exist_ok"]
    assert name2 == "upload_folder" and upload["repo_id"] == REPO and upload["commit_message"] == "first map"
    assert {"config.json", "model.safetensors", "README.md"} <= set(hub.uploaded)
    readme = hub.uploaded["README.md"].decode()
    assert f'KVMap.from_pretrained("{REPO}")' in readme and "/tmp" not in readme
    assert _same_tensors(hub.loaded, kv_map)


def test_a_map_that_cannot_be_saved_creates_no_repo(pair, monkeypatch):
    _, _, kv_map = pair
    hub = FakeHub()
    hub.install(monkeypatch)
    broken = copy.copy(kv_map)  # a config edited into one that would not load again
    broken.config = replace(kv_map.config, source_layout=replace(kv_map.config.source_layout, num_layers=-1))
    with pytest.raises(ArtifactError, match="source_layout is implausible"):
        broken.push_to_hub(REPO)
    assert hub.calls == []


def test_a_repo_id_without_namespace_gets_the_hubs_full_id_in_its_card(pair, monkeypatch):
    _, _, kv_map = pair
    hub = FakeHub()
    hub.install(monkeypatch, namespace="me")
    kv_map.push_to_hub("tiny-kvmap")
    assert hub.calls[-1][1]["repo_id"] == "me/tiny-kvmap"
    assert 'KVMap.from_pretrained("me/tiny-kvmap")' in hub.uploaded["README.md"].decode()


def test_push_to_a_branch_creates_it_first(pair, monkeypatch):
    _, _, kv_map = pair
    hub = FakeHub()
    hub.install(monkeypatch)
    kv_map.push_to_hub(REPO, branch="v2")
    names = [name for name, _ in hub.calls]
    assert names.index("create_repo") < names.index("create_branch") < names.index("upload_folder")
    assert hub.calls[names.index("create_branch")][1]["branch"] == "v2"
    assert hub.calls[names.index("upload_folder")][1]["revision"] == "v2"


def _hub_serving(remote: Path, tmp_path: Path, monkeypatch) -> list[tuple]:
    """The Hub as `snapshot_download` sees it, serving the files of ``remote`` at one commit; returns what each call
    asked for (revision and the files it downloaded)."""
    calls, snapshot = [], tmp_path / "hub" / "models--org--m" / "snapshots" / ("4" * 40)

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        snapshot.mkdir(parents=True, exist_ok=True)
        wanted = sorted(f.name for f in remote.iterdir() if any(fnmatch(f.name, p) for p in allow_patterns))
        for name in wanted:
            shutil.copy(remote / name, snapshot)
        calls.append((revision, wanted))
        return str(snapshot)

    monkeypatch.setattr(storage, "snapshot_download", snapshot_download)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return calls


def test_a_models_repo_id_is_refused_before_its_weights_download(tmp_path, monkeypatch):
    remote = tmp_path / "remote"  # a model's repo: a transformers config and weights under the map's file name
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 896}))
    (remote / "model.safetensors").write_bytes(b"gigabytes")
    calls = _hub_serving(remote, tmp_path, monkeypatch)
    with pytest.raises(ArtifactError, match="'org/m' is not a KV map"):
        KVMap.from_pretrained("org/m")
    assert calls == [(None, ["config.json"])]


def test_a_maps_files_come_from_the_commit_whose_config_was_read(tmp_path, monkeypatch, saved_maps):
    calls = _hub_serving(saved_maps["main"], tmp_path, monkeypatch)
    loaded = KVMap.from_pretrained("org/m", revision="main")
    assert _same_tensors(loaded, KVMap.from_pretrained(saved_maps["main"]))
    assert calls == [("main", ["config.json"]), ("4" * 40, ["README.md", "config.json", "layer_r2.png", "model.safetensors"])]


def test_a_cache_whose_refs_point_outside_it_is_refused(tmp_path, monkeypatch):
    storage = tmp_path / "hub" / "models--org--m"
    (storage / "refs").mkdir(parents=True)
    (storage / "snapshots").mkdir()
    (storage / "refs" / "main").write_text("../../../../..")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ArtifactError, match="outside the cache"):
        KVMap.from_pretrained("org/m", cache_dir=tmp_path / "hub")
