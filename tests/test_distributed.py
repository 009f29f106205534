"""Distributed calibration (issue 6): two torchrun processes on the CPU (gloo) fit the same map as one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import random_ids, tiny_model
from peft_kvcache import KVMap
from peft_kvcache.calibrate import collect_statistics
from peft_kvcache.fit import SufficientStatistics, all_reduce_statistics

ROOT = Path(__file__).parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_reduce_is_a_no_op_outside_torch_distributed():
    stats = SufficientStatistics.empty(3, {"t": 2})
    stats.update(torch.ones(2, 3), {"t": torch.ones(2, 2)})
    before = {k: v.clone() for k, v in stats.state_dict().items()}
    all_reduce_statistics({"train": {"keys": stats}})
    assert all(torch.equal(before[k], v) for k, v in stats.state_dict().items())


def test_shards_add_up_to_the_whole_without_torch_distributed():
    """rank r takes sequences r::world_size of each split; summing the shards gives the one-process sums."""
    source, target = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    from peft_kvcache.calibrate import ModelSide
    from peft_kvcache.capture import run_with_cache

    src, tgt = ModelSide.of(source), ModelSide.of(target)
    width = src.layout.num_layers * src.layout.layer_width

    def collect(rank, world):
        return collect_statistics(lambda i, m: run_with_cache(source, i, m),
                                  {"t": lambda i, m: run_with_cache(target, i, m)}, src.rotary, {"t": tgt.rotary},
                                  width, {"t": width}, random_ids(7, 9), 0.3, 1, 2, False,
                                  rank=rank, world_size=world)

    whole, shards = collect(0, 1), [collect(r, 3) for r in range(3)]
    for split in ("train", "heldout"):
        for kind in ("keys", "values"):
            counts = [int(s[split][kind].count) for s in shards]
            assert sum(counts) == int(whole[split][kind].count) and (split == "heldout" or min(counts) > 0)
            summed = shards[0][split][kind].merge(shards[1][split][kind]).merge(shards[2][split][kind])
            for name, value in whole[split][kind].state_dict().items():
                torch.testing.assert_close(summed.state_dict()[name], value, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    source = tiny_model("qwen2", seed=0)
    target = tiny_model("qwen2", seed=1, hidden_size=96, num_hidden_layers=3, num_attention_heads=3,
                        num_key_value_heads=3, intermediate_size=160)
    source.save_pretrained(folder / "source")
    target.save_pretrained(folder / "target")
    return folder / "source", folder / "target"


def test_two_torchrun_processes_fit_the_same_map_as_one(tmp_path, model_folders):
    source_dir, target_dir = model_folders
    sequences = random_ids(10, 24, seed=7)
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps(s.tolist()) + "\n" for s in sequences))
    out, checkpoints = tmp_path / "map", tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), str(ROOT / "scripts" / "calibrate_distributed.py"), "--source", str(source_dir),
               "--target", str(target_dir), "--data", str(data), "--out", str(out), "--max-length", "24",
               "--checkpoint-dir", str(checkpoints)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "[rank 0/2] started" in log and "[rank 1/2] started" in log, log[-2000:]

    # Each process accumulated its own shard (per-rank checkpoints), and the shards add up to the whole.
    shard_counts = [int(load_file(next(checkpoints.glob(f"statistics-rank{r}-*.safetensors")))["train.keys.count"])
                    for r in range(2)]
    assert min(shard_counts) > 0

    torch.set_num_threads(1)
    source = AutoModelForCausalLM.from_pretrained(source_dir).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    single = KVMap.calibrate(source, target, sequences, max_length=24, progress=False)
    distributed = KVMap.from_pretrained(out)
    assert sum(shard_counts) == single.config.calibration["train_tokens"]
    assert distributed.config.calibration["train_tokens"] == single.config.calibration["train_tokens"]
    assert distributed.config.key_layers == single.config.key_layers
    assert distributed.config.value_layers == single.config.value_layers
    for name, tensor in single.tensors.items():
        other = distributed.tensors[name]
        relative = float((other - tensor).norm() / tensor.norm().clamp_min(1e-30))
        assert relative < 1e-6, (name, relative)
