"""Distributed calibration: sharded statistics add up to the whole for sibling and adapter maps alike, and
``peft-kvcache calibrate`` under torchrun (two CPU processes, gloo) fits the same map as one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_ids, save_tiny_model, tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_kvcache import KVMap
from peft_kvcache.calibration.fit import SufficientStatistics, all_reduce_statistics
from peft_kvcache.calibration.loop import collect
from peft_kvcache.calibration.statistics import ModelSide, StatisticsRun
from peft_kvcache.calibration.texts import CalibrationTexts
from peft_kvcache.maps.config import CalibrationConfig
from peft_kvcache.modeling.capture import run_with_cache

ROOT = Path(__file__).parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_reduce_is_a_no_op_outside_torch_distributed():
    stats = SufficientStatistics.empty(3, {"t": 2})
    stats.update(torch.ones(2, 3), {"t": torch.ones(2, 2)})
    before = {k: v.clone() for k, v in stats.state_dict().items()}
    all_reduce_statistics([stats])
    assert all(torch.equal(before[k], v) for k, v in stats.state_dict().items())


def _assert_shards_sum_to_whole(make_run, run_models, texts, world=3):
    whole, shards = make_run(), [make_run() for _ in range(world)]
    collect(run_models, whole, texts, 2, progress=False, shard=(0, 1))
    for r, shard in enumerate(shards):
        collect(run_models, shard, texts, 2, progress=False, shard=(r, world))
    for key, entry in whole.stats.items():
        parts = [s.stats[key] for s in shards]
        if key[2] == "train":
            assert min(int(p.count) for p in parts) > 0  # every rank got some of the train split
        summed = parts[0].merge(parts[1]).merge(parts[2])
        for name, value in entry.state_dict().items():
            torch.testing.assert_close(summed.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_sibling_shards_add_up_to_the_whole():
    """rank r takes chunks r::world of each split; summing the shards gives the one-process sums."""
    source, target = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    sides = {"source": ModelSide.of(source), "target": ModelSide.of(target)}
    texts = CalibrationTexts.build(random_ids(10, 9), None, CalibrationConfig(heldout_fraction=0.3))
    _assert_shards_sum_to_whole(lambda: StatisticsRun({"source": ["target"]}, sides, CalibrationConfig()),
                                lambda i, m: {"source": run_with_cache(source, i, m),
                                              "target": run_with_cache(target, i, m)}, texts)


def test_adapter_shards_add_up_to_the_whole():
    """The adapter calibration (base -> adapters and back, per layer block) goes through the same loop."""
    from peft import LoraConfig, get_peft_model

    from peft_kvcache.modeling.adapters import adapter_active

    base = tiny_model("llama", seed=2)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["k_proj", "v_proj"], init_lora_weights=False),
                           adapter_name="loud").eval()
    sides = {}
    for name, adapter in (("base", None), ("loud", "loud")):
        with adapter_active(model, adapter):
            sides[name] = ModelSide.of(model)

    def run_models(ids, mask):
        runs = {}
        for name, adapter in (("base", None), ("loud", "loud")):
            with adapter_active(model, adapter):
                runs[name] = run_with_cache(model, ids, mask)
        return runs

    texts = CalibrationTexts.build(random_ids(10, 9, seed=5), None, CalibrationConfig(heldout_fraction=0.3))
    _assert_shards_sum_to_whole(lambda: StatisticsRun({"base": ["loud"], "loud": ["base"]}, sides,
                                                              CalibrationConfig(same_layer=True)), run_models,
                                texts)


FAILING_RANK = """
import time
from conftest import random_ids, tiny_model
from peft_kvcache.calibration.loop import collect, join_process_group
from peft_kvcache.calibration.statistics import ModelSide, StatisticsRun
from peft_kvcache.calibration.texts import CalibrationTexts
from peft_kvcache.maps.config import CalibrationConfig
from peft_kvcache.modeling.capture import run_with_cache

rank, world = join_process_group()
source, target = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
run = StatisticsRun({"source": ["target"]}, {"source": ModelSide.of(source), "target": ModelSide.of(target)},
                    CalibrationConfig())
texts = CalibrationTexts.build(random_ids(10, 9), None, CalibrationConfig(heldout_fraction=0.3))

def run_models(ids, mask):
    if rank == 1:
        raise ValueError("rank 1 cannot read its data")
    return {"source": run_with_cache(source, ids, mask), "target": run_with_cache(target, ids, mask)}

try:
    collect(run_models, run, texts, 2, progress=False)
except Exception as error:
    print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
    if rank == 1:  # a caller that goes on with something else: its process stays up, so gloo never breaks
        time.sleep(300)
"""


def test_a_process_that_fails_its_share_stops_the_others_outside_torchrun():
    # launched as a scheduler (slurm, mpirun) would: no torchrun agent stops the others when one fails, and one that
    # stays up leaves them waiting in the reduction (gloo breaks only when its process exits)
    port, env = _free_port(), dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "tests"))
    ranks = [subprocess.Popen([sys.executable, "-c", FAILING_RANK], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    try:
        first = ranks[0].communicate(timeout=120)[0]  # rank 1 stays up: rank 0 must stop by itself
    finally:
        for process in ranks:
            process.kill()
    logs = [first, ranks[1].communicate()[0]]
    assert "rank 1: ValueError: rank 1 cannot read its data" in logs[1], logs[1][-2000:]
    assert "rank 0: CalibrationError: another process of this calibration failed" in logs[0], logs[0][-2000:]


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    return save_tiny_model(folder / "source", 2, 0), save_tiny_model(folder / "target", 3, 1)


def test_calibrate_under_torchrun_fits_the_same_map_as_one_process(tmp_path, model_folders):
    source_dir, target_dir = model_folders
    data = tmp_path / "data"
    data.mkdir()
    for f in range(5):
        (data / f"part{f}.txt").write_text("".join(f"def f{f}_{i}(x):\n    return x * {i} - {f}\n" for i in range(6)))
    out, checkpoints = tmp_path / "map", tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), "-m", "peft_kvcache.cli", "calibrate", "--source", str(source_dir), "--target",
               str(target_dir), "--data", str(data), "--output", str(out), "--max-length", "24",
               "--checkpoint-dir", str(checkpoints), "--no-progress"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "(2 process(es))" in log, log[-2000:]

    # Each process accumulated its own shard (per-rank checkpoints), and the shards add up to the whole.
    shard_counts = [int(load_file(next(checkpoints.glob(f"statistics-rank{r}-*.safetensors")))
                        ["source|None|train|keys|count"]) for r in range(2)]
    assert min(shard_counts) > 0

    torch.set_num_threads(1)
    source = AutoModelForCausalLM.from_pretrained(source_dir).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    texts = {p.name: p.read_text() for p in sorted(data.iterdir())}
    single = KVMap.calibrate(source, target, texts, AutoTokenizer.from_pretrained(source_dir), max_length=24,
                             progress=False)
    distributed = KVMap.from_pretrained(out)
    assert distributed.config.calibration.processes == 2
    assert sum(shard_counts) == single.config.calibration.train_tokens == distributed.config.calibration.train_tokens
    assert distributed.config.key_layers == single.config.key_layers
    assert distributed.config.value_layers == single.config.value_layers
    for name, tensor in single.tensors.items():
        other = distributed.tensors[name]
        relative = float((other - tensor).norm() / tensor.norm().clamp_min(1e-30))
        assert relative < 1e-6, (name, relative)
