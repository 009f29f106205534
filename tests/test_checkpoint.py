"""Checkpoints and resumable calibration (calibration/checkpoint.py, as the calibration loop uses them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import CALIBRATION_OPTIONS, calibration_pair, random_ids, tiny_model
from safetensors.torch import save_file

from peft_kvcache import KVMap
from peft_kvcache.calibration import loop as calibrate_module
from peft_kvcache.errors import CalibrationError

TESTS = Path(__file__).parent
ROOT = TESTS.parent
SEQUENCES = dict(count=12, length=20)  # 10 train batches and 2 held-out ones at batch_size=1


# ----- a killed or interrupted calibration resumes to the same map -----


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
    source, target = calibration_pair()
    return KVMap.calibrate(source, target, random_ids(**SEQUENCES), **CALIBRATION_OPTIONS)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    sys.path[:0] = [{tests!r}, {root!r}]
    from conftest import CALIBRATION_OPTIONS, calibration_pair, random_ids
    from test_checkpoint import SEQUENCES
    from peft_kvcache import KVMap
    from peft_kvcache.calibration import loop as module

    real, calls = module.run_with_cache, [0]
    def run(*args, **kwargs):
        calls[0] += 1
        if calls[0] == {kill_at}:   # source run of batch 7 (two runs per batch): the last checkpoint is batch 6
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    module.run_with_cache = run
    source, target = calibration_pair()
    KVMap.calibrate(source, target, random_ids(**SEQUENCES), checkpoint_dir=sys.argv[1], checkpoint_every=2,
                    **CALIBRATION_OPTIONS)
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
    source, target = calibration_pair()
    resumed = KVMap.calibrate(source, target, random_ids(**SEQUENCES), checkpoint_dir=checkpoint,
                              checkpoint_every=2, **CALIBRATION_OPTIONS)
    assert runs.calls == 2 * (4 + 2)  # only the 4 train batches after the checkpoint and the 2 held-out ones
    _assert_same_map(resumed, reference_map)
    assert json.loads((checkpoint / "progress-rank0.json").read_text())["complete"] is True


def test_ctrl_c_then_resume_gives_the_same_map_and_a_finished_run_is_not_redone(tmp_path, reference_map,
                                                                             monkeypatch):
    source, target = calibration_pair()
    checkpoint = tmp_path / "ckpt"
    runs = _CountingRuns(calibrate_module.run_with_cache, stop_at=2 * 9 + 1)  # during batch 10 of 10
    monkeypatch.setattr(calibrate_module, "run_with_cache", runs)
    with pytest.raises(KeyboardInterrupt):
        KVMap.calibrate(source, target, random_ids(**SEQUENCES), checkpoint_dir=checkpoint, checkpoint_every=3,
                        **CALIBRATION_OPTIONS)
    runs.stop_at, runs.calls = None, 0
    resumed = KVMap.calibrate(source, target, random_ids(**SEQUENCES), checkpoint_dir=checkpoint,
                              checkpoint_every=3, **CALIBRATION_OPTIONS)
    assert runs.calls == 2 * (1 + 2)  # batch 10 (checkpoint at 9) and the held-out split
    _assert_same_map(resumed, reference_map)
    progress = json.loads((checkpoint / "progress-rank0.json").read_text())
    assert 0 < progress["seconds"] <= resumed.config.calibration.seconds  # the interrupted run's collection counts
    # a crash while fitting: the statistics are complete, nothing is run again, and the map records what they
    # cost (say 1000 s) rather than the seconds of its fit
    (checkpoint / "progress-rank0.json").write_text(json.dumps({**progress, "seconds": 1000.0}))
    runs.calls = 0
    refitted = KVMap.calibrate(source, target, random_ids(**SEQUENCES), checkpoint_dir=checkpoint,
                               **CALIBRATION_OPTIONS)
    _assert_same_map(refitted, reference_map)
    assert runs.calls == 0 and 1000 <= refitted.config.calibration.seconds < 1000 + 60


# ----- foreign or damaged checkpoints, the options, what a checkpoint folder holds -----


@pytest.mark.parametrize("change", ["data", "option", "model", "rope"])
def test_resuming_with_other_data_options_or_models_is_refused(tmp_path, change):
    source, target = calibration_pair()
    KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, **CALIBRATION_OPTIONS)
    data, options = random_ids(6, 12), dict(CALIBRATION_OPTIONS)
    if change == "data":
        data[3] = data[3].flip(0)
    elif change == "option":
        options["sink_tokens"] = 2
    elif change == "model":
        source = tiny_model("qwen2", seed=5)
    else:  # the same weights under another RoPE: other position-free keys
        from peft_kvcache.modeling.identity import cached_fingerprint

        before = cached_fingerprint(source)
        source = tiny_model("qwen2", seed=0, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
        assert cached_fingerprint(source) == before
    with pytest.raises(CalibrationError, match=r"progress-rank0\.json was written by a run over other sequences"):
        KVMap.calibrate(source, target, data, checkpoint_dir=tmp_path, **options)


def test_a_checkpoint_of_other_dtypes_is_refused_and_leftovers_go(tmp_path):
    source, target = tiny_model("qwen2", seed=0), tiny_model("llama", seed=1)
    KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, progress=False)
    (tmp_path / ".statistics-rank0-s0-b3.safetensors.tmp123").write_bytes(b"half written")
    (tmp_path / ".progress-rank0.json.tmp456").write_text("{")
    with pytest.raises(CalibrationError, match="other sequences, options or models"):
        KVMap.calibrate(source.to(torch.bfloat16), target.to(torch.bfloat16), random_ids(6, 12),
                        checkpoint_dir=tmp_path, progress=False)
    assert not list(tmp_path.glob(".*"))  # a killed save's temporaries are removed


@pytest.mark.parametrize("damage", ["json", "statistics", "missing_statistics"])
def test_a_damaged_checkpoint_is_a_calibration_error(tmp_path, damage):
    source, target = calibration_pair()
    KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, **CALIBRATION_OPTIONS)
    stats_file = next(tmp_path.glob("statistics-rank0-*.safetensors"))
    if damage == "json":
        (tmp_path / "progress-rank0.json").write_text("{truncated")
    elif damage == "statistics":
        stats_file.write_bytes(stats_file.read_bytes()[:100])
    else:
        stats_file.unlink()
    with pytest.raises(CalibrationError, match="checkpoint"):
        KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, **CALIBRATION_OPTIONS)


@pytest.mark.parametrize("batches, seconds", [(-50, 1.0), (10**9, 1.0), (1.5, 1.0), ("3", 1.0), (1, -1.0),
                                              (1, "12"), (1, float("nan"))])
def test_a_checkpoint_counter_out_of_range_is_damage(tmp_path, batches, seconds):
    source, target = tiny_model("qwen2", seed=0), tiny_model("llama", seed=1)
    KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)
    record = json.loads((tmp_path / "progress-rank0.json").read_text())
    record.update(split=0, batches=batches, complete=False, seconds=seconds)
    (tmp_path / "progress-rank0.json").write_text(json.dumps(record))
    with pytest.raises(CalibrationError, match="damaged"):
        KVMap.calibrate(source, target, random_ids(6, 12), checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)


def test_checkpoint_every_must_be_positive(tmp_path):
    source, target = calibration_pair()
    with pytest.raises(CalibrationError, match="checkpoint_every"):
        KVMap.calibrate(source, target, random_ids(4, 12), checkpoint_dir=tmp_path, checkpoint_every=0,
                        **CALIBRATION_OPTIONS)


def test_checkpoints_are_safetensors_and_json_only(tmp_path):
    source, target = calibration_pair()
    KVMap.calibrate(source, target, random_ids(4, 10), checkpoint_dir=tmp_path, **CALIBRATION_OPTIONS)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".safetensors"]
    save_file({"x": torch.zeros(1)}, tmp_path / "unused.safetensors")  # stray files are ignored
    KVMap.calibrate(source, target, random_ids(4, 10), checkpoint_dir=tmp_path, **CALIBRATION_OPTIONS)
