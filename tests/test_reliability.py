"""Reliability (issue 5): calibrations that survive a kill, artifacts that cannot be half-written, numerical
guards, hostile artifacts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_model
from safetensors.torch import save_file
from test_artifacts import make_map

import peft_kvcache
from peft_kvcache import ArtifactError, KVMap
from peft_kvcache.calibration import loop as calibrate_module
from peft_kvcache.calibration.fit import SufficientStatistics, _Centered, fit_layers
from peft_kvcache.errors import CalibrationError, NumericalError
from peft_kvcache.maps.apply import map_cache
from peft_kvcache.modeling.layout import KVLayout

TESTS = Path(__file__).parent
ROOT = TESTS.parent


# ----- resumable calibration -----

def _pair():
    return tiny_model("qwen2", seed=0), tiny_model("llama", seed=1, hidden_size=96, num_attention_heads=3,
                                                    num_key_value_heads=3, num_hidden_layers=3)


SEQUENCES = dict(count=12, length=20)  # 10 train batches and 2 held-out ones at batch_size=1
OPTIONS = dict(progress=False, batch_size=1)


def _assert_same_map(a: KVMap, b: KVMap) -> None:
    assert a.config.key_layers == b.config.key_layers and a.config.value_layers == b.config.value_layers
    for name, tensor in a.tensors.items():
        assert (tensor.double() - b.tensors[name].double()).abs().max() < 1e-10, name


class _CountingRuns:
    """Wraps calibrate's run_with_cache: counts model runs and interrupts at run number ``stop_at``."""

    def __init__(self, real, stop_at=None, interrupt=KeyboardInterrupt):
        self.real, self.stop_at, self.interrupt, self.calls = real, stop_at, interrupt, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.stop_at:
            raise self.interrupt()
        return self.real(*args, **kwargs)


@pytest.fixture(scope="module")
def reference_map():
    source, target = _pair()
    return KVMap.calibrate(source, target, random_ids(**SEQUENCES), **OPTIONS)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    sys.path[:0] = [{tests!r}, {root!r}]
    from conftest import random_ids
    from test_reliability import _pair, SEQUENCES, OPTIONS
    from peft_kvcache import KVMap
    from peft_kvcache.calibration import loop as module

    real, calls = module.run_with_cache, [0]
    def run(*args, **kwargs):
        calls[0] += 1
        if calls[0] == {kill_at}:   # source run of batch 7 (two runs per batch): the last checkpoint is batch 6
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    module.run_with_cache = run
    source, target = _pair()
    KVMap.calibrate(source, target, random_ids(**SEQUENCES), checkpoint_dir=sys.argv[1], checkpoint_every=2,
                    **OPTIONS)
    print("finished without being killed")
""")


def test_a_killed_calibration_resumes_and_gives_the_same_map(tmp_path, reference_map, monkeypatch):
    checkpoint = tmp_path / "ckpt"
    script = KILL_SCRIPT.format(tests=str(TESTS), root=str(ROOT), kill_at=13)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script, str(checkpoint)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -9, done.stdout + done.stderr  # really killed, mid-way
    progress = json.loads((checkpoint / "progress-rank0.json").read_text())
    assert (progress["split"], progress["batches"], progress["complete"]) == (0, 6, False)
    assert not [p for p in checkpoint.iterdir() if p.name.startswith(".")], "a temp file was left as the checkpoint"

    runs = _CountingRuns(calibrate_module.run_with_cache)
    monkeypatch.setattr(calibrate_module, "run_with_cache", runs)
    source, target = _pair()
    resumed = KVMap.calibrate(source, target, random_ids(**SEQUENCES), checkpoint_dir=checkpoint,
                              checkpoint_every=2, **OPTIONS)
    assert runs.calls == 2 * (4 + 2)  # only the 4 train batches after the checkpoint and the 2 held-out ones
    _assert_same_map(resumed, reference_map)
    assert json.loads((checkpoint / "progress-rank0.json").read_text())["complete"] is True


def test_ctrl_c_then_resume_gives_the_same_map_and_a_finished_run_is_not_redone(tmp_path, reference_map,
                                                                             monkeypatch):
    source, target = _pair()
    checkpoint = tmp_path / "ckpt"
    runs = _CountingRuns(calibrate_module.run_with_cache, stop_at=2 * 9 + 1)  # during batch 10 of 10
    monkeypatch.setattr(calibrate_module, "run_with_cache", runs)
    with pytest.raises(KeyboardInterrupt):
        KVMap.calibrate(source, target, random_ids(**SEQUENCES), checkpoint_dir=checkpoint, checkpoint_every=3,
                        **OPTIONS)
    runs.stop_at, runs.calls = None, 0
    resumed = KVMap.calibrate(source, target, random_ids(**SEQUENCES), checkpoint_dir=checkpoint,
                              checkpoint_every=3, **OPTIONS)
    assert runs.calls == 2 * (1 + 2)  # batch 10 (checkpoint at 9) and the held-out split
    _assert_same_map(resumed, reference_map)
    runs.calls = 0  # a crash while fitting: the statistics are complete, nothing is run again
    _assert_same_map(KVMap.calibrate(source, target, random_ids(**SEQUENCES), checkpoint_dir=checkpoint,
                                     **OPTIONS), reference_map)
    assert runs.calls == 0


@pytest.mark.parametrize("change", ["data", "option", "model"])
def test_resuming_with_other_data_options_or_models_is_refused(tmp_path, change):
    source, target = _pair()
    KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, **OPTIONS)
    data, options = random_ids(6, 12), dict(OPTIONS)
    if change == "data":
        data[3] = data[3].flip(0)
    elif change == "option":
        options["sink_tokens"] = 2
    else:
        source = tiny_model("qwen2", seed=5)
    with pytest.raises(CalibrationError, match=r"progress-rank0\.json was written by a run over other sequences"):
        KVMap.calibrate(source, target, data, checkpoint_dir=tmp_path, **options)


@pytest.mark.parametrize("damage", ["json", "statistics", "missing_statistics"])
def test_a_damaged_checkpoint_is_a_calibration_error(tmp_path, damage):
    source, target = _pair()
    KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, **OPTIONS)
    stats_file = next(tmp_path.glob("statistics-rank0-*.safetensors"))
    if damage == "json":
        (tmp_path / "progress-rank0.json").write_text("{truncated")
    elif damage == "statistics":
        stats_file.write_bytes(stats_file.read_bytes()[:100])
    else:
        stats_file.unlink()
    with pytest.raises(CalibrationError, match="checkpoint"):
        KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, **OPTIONS)


def test_checkpoint_every_must_be_positive(tmp_path):
    source, target = _pair()
    with pytest.raises(CalibrationError, match="checkpoint_every"):
        KVMap.calibrate(source, target, random_ids(4, 12), checkpoint_dir=tmp_path, checkpoint_every=0, **OPTIONS)


# ----- atomic artifacts -----

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
            from peft_kvcache.maps import kvmap

            die = lambda *args, **kwargs: os._exit(9)  # noqa: E731
            if crash_at == "weights":
                kvmap.save_file = die
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
        monkeypatch.setattr("peft_kvcache.maps.kvmap.save_file", fail)
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


# ----- numerical guards -----

def _hand_cache(batch: int = 2, seq: int = 5, dtype=torch.float32):
    layout = KVLayout(2, 2, 8)  # the source layout of make_map
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(batch, layout.kv_heads, seq, layout.head_dim, generator=gen).to(dtype) for _ in range(2)]
    values = [torch.randn(batch, layout.kv_heads, seq, layout.head_dim, generator=gen).to(dtype) for _ in range(2)]
    positions = torch.arange(seq).expand(batch, seq)
    return keys, values, positions


@pytest.mark.parametrize("kind, value", [("keys", float("nan")), ("values", float("inf")), ("keys", -float("inf"))])
def test_a_non_finite_source_cache_is_refused_naming_the_layers(kind, value):
    kv_map = make_map()  # key sources [[0], [1], [0, 1]], value sources [[1], [1], [0]]
    keys, values, positions = _hand_cache()
    (keys if kind == "keys" else values)[1][1, 0, 3, 2] = value
    placements = [(torch.device("cpu"), torch.float32)] * 3
    with pytest.raises(NumericalError) as info:
        map_cache(kv_map, keys, values, positions, positions, placements)
    first_target = 1 if kind == "keys" else 0
    assert f"mapped {kind} of target layer {first_target}" in str(info.value)
    assert f"source cache's {kind} of layer(s) [1]" in str(info.value)


def test_float16_overflow_in_the_mapping_is_a_numerical_error():
    kv_map = make_map()
    kv_map.tensors["values.2.weight"] = kv_map.tensors["values.2.weight"] * 1e5  # |mapped| ~ 1e5 > 65504
    keys, values, positions = _hand_cache()
    fp32 = map_cache(kv_map, keys, values, positions, positions, [(torch.device("cpu"), torch.float32)] * 3)
    assert all(torch.isfinite(t).all() for layer in fp32 for t in layer)
    bf16 = map_cache(kv_map, keys, values, positions, positions, [(torch.device("cpu"), torch.bfloat16)] * 3)
    assert bf16[2][1].dtype == torch.bfloat16 and torch.isfinite(bf16[2][1]).all()
    with pytest.raises(NumericalError, match=r"mapped values of target layer 2 overflows torch.float16"):
        map_cache(kv_map, keys, values, positions, positions, [(torch.device("cpu"), torch.float16)] * 3)


def test_a_float16_source_cache_maps_like_its_float32_copy():
    kv_map = make_map()
    keys, values, positions = _hand_cache(dtype=torch.float16)
    half = map_cache(kv_map, keys, values, positions, positions, [(torch.device("cpu"), torch.float32)] * 3)
    full = map_cache(kv_map, [k.float() for k in keys], [v.float() for v in values], positions, positions,
                     [(torch.device("cpu"), torch.float32)] * 3)
    for (k1, v1), (k2, v2) in zip(half, full):
        torch.testing.assert_close(k1, k2)
        torch.testing.assert_close(v1, v2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_calibration_statistics_are_refused(bad):
    stats = SufficientStatistics.empty(3, {"t": 2})
    with pytest.raises(NumericalError, match="target 't' features contain NaN or Inf"):
        stats.update(torch.randn(4, 3), {"t": torch.tensor([[0.0, bad]] * 4)})
    # Statistics that became non-finite some other way (a merged shard, an edited checkpoint) are refused too.
    good = SufficientStatistics.empty(3, {"t": 2})
    good.update(torch.randn(10, 3), {"t": torch.randn(10, 2)})
    poisoned = good.state_dict()
    poisoned["x_gram"] = poisoned["x_gram"].clone()
    poisoned["x_gram"][0, 0] = bad
    with pytest.raises(NumericalError, match="calibration statistics are not finite"):
        _Centered(SufficientStatistics.from_state_dict(poisoned), good, "t")


def test_a_target_model_with_nan_weights_fails_calibration_by_name():
    source, target = _pair()
    with torch.no_grad():
        target.model.layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(NumericalError, match="target 'target' features contain NaN or Inf"):
        KVMap.calibrate(source, target, random_ids(4, 10), **OPTIONS)


def _degenerate(case: str, n: int = 40, d: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    if case == "duplicated":
        x[:, d // 2:] = x[:, : d // 2]
    elif case == "constant":
        x[:, 8:] = 7.0  # features no target column depends on: zero variance once centred
    elif case == "zero":
        x.zero_()
    elif case == "fewer_tokens":
        x = x[:5]
    elif case == "huge_range":
        x[:, 0] *= 1e8
        x[:, 1] *= 1e-8
    return x


@pytest.mark.parametrize("case", ["duplicated", "constant", "zero", "fewer_tokens", "huge_range"])
def test_ridge_stays_finite_on_singular_or_ill_conditioned_grams(case):
    x = _degenerate(case)
    gen = torch.Generator().manual_seed(4)
    y = x[:, :8] * 0.5 + 0.01 * torch.randn(x.shape[0], 8, generator=gen, dtype=torch.float64)
    x_ho = _degenerate(case)
    train, heldout = SufficientStatistics.empty(12, {"t": 8}), SufficientStatistics.empty(12, {"t": 8})
    train.update(x, {"t": y})
    heldout.update(x_ho, {"t": x_ho[:, :8] * 0.5})
    layout = KVLayout(1, 2, 4)
    fits = fit_layers(train, heldout, "t", KVLayout(1, 3, 4), layout)
    fit = fits[0].fit
    for tensor in (fit.weight, fit.bias, fit.lambdas, fit.r2):
        assert torch.isfinite(tensor).all()
    if case in ("duplicated", "constant", "fewer_tokens"):  # the signal is there: ridge must still find it
        assert float(fit.r2.min()) > 0.9


def test_calibration_with_fewer_tokens_than_features_gives_a_finite_map():
    source, target = _pair()  # 2 x 2 x 16 = 64 source features per kind; 3 train tokens
    kv_map = KVMap.calibrate(source, target, random_ids(3, 4), **OPTIONS)
    assert all(torch.isfinite(t).all() for t in kv_map.tensors.values())


# ----- hostile artifacts (what tests/test_artifacts.py does not already cover) -----

def _spy_on_tensor_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    real_open = peft_kvcache.maps.kvmap.safe_open

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

    monkeypatch.setattr(peft_kvcache.maps.kvmap, "safe_open", Spy)
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


def test_checkpoints_are_safetensors_and_json_only(tmp_path):
    source, target = _pair()
    KVMap.calibrate(source, target, random_ids(4, 10), checkpoint_dir=tmp_path, **OPTIONS)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".safetensors"]
    save_file({"x": torch.zeros(1)}, tmp_path / "unused.safetensors")  # stray files are ignored
    KVMap.calibrate(source, target, random_ids(4, 10), checkpoint_dir=tmp_path, **OPTIONS)
