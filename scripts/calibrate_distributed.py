"""Calibrate a KV map over several processes: each runs the models over its shard of the calibration
sequences (rank r takes sequences r::world_size), the float64 statistics are summed with one
torch.distributed all-reduce (gloo on the CPU, NCCL on GPUs) and rank 0 fits and saves the map.

    torchrun --nproc_per_node 2 scripts/calibrate_distributed.py \\
        --source Qwen/Qwen2.5-Coder-0.5B --target Qwen/Qwen2.5-Coder-1.5B --data calib.jsonl --out maps/pair

``--data`` is JSON lines, each a text (tokenized with the source's tokenizer) or a list of token ids.
Launch with torchrun: ``accelerate launch --cpu --num_processes 2`` silently starts a single process here.
Every rank prints ``[rank r/w] ...`` lines so a log shows how many processes really ran.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def read_data(path: str) -> list:
    """Texts or token-id lists, one JSON value per line."""
    items = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, (str, list)):
            raise SystemExit(f"{path}:{number}: each line must be a JSON string or a list of token ids")
        items.append(item if isinstance(item, str) else torch.tensor(item, dtype=torch.long))
    return items


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="source model folder or Hub id")
    parser.add_argument("--target", required=True, help="target model folder or Hub id")
    parser.add_argument("--data", required=True, help="JSON lines: texts or lists of token ids")
    parser.add_argument("--out", required=True, help="folder the map is saved to (by rank 0)")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--heldout-fraction", type=float, default=0.2)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--checkpoint-dir", default=None, help="resumable statistics (one file per rank)")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peft_kvcache import KVMap

    cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        dtype = getattr(torch, args.dtype)
        source = AutoModelForCausalLM.from_pretrained(args.source, dtype=dtype).to(device).eval()
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
        data = read_data(args.data)
        tokenizer = AutoTokenizer.from_pretrained(args.source) if any(isinstance(d, str) for d in data) else None
        print(f"[rank {rank}/{world}] started on {device} with {len(data)} calibration items", flush=True)
        kv_map = KVMap.calibrate(source, target, data, tokenizer=tokenizer, top_k=args.top_k, max_length=args.max_length,
                                 batch_size=args.batch_size, heldout_fraction=args.heldout_fraction,
                                 progress=rank == 0, checkpoint_dir=args.checkpoint_dir,
                                 description=f"{Path(args.data).name}, {world} processes")
        tokens = kv_map.config.calibration["train_tokens"] + kv_map.config.calibration["heldout_tokens"]
        print(f"[rank {rank}/{world}] statistics summed over {tokens} tokens", flush=True)
        if rank == 0:
            kv_map.save_pretrained(args.out)
            print(f"[rank 0/{world}] saved {kv_map} to {args.out}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
