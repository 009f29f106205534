"""Tensor parallelism (issue 31): a rank that holds some of the target's KV heads can map them from every source head
(the connector gathers the source heads across the tensor-parallel group) or from its own shard's source heads only
(maps fitted with ``head_shards``: no gather). Both fitted on the same statistics' texts, scored on the same held-out
examples, with what each costs a rank.

- Siblings: Qwen2.5-Coder 0.5B <-> 1.5B (2 KV heads each: TP=2, one head a rank), top-2 source layers.
- Adapters: SmolLM2-135M-Instruct base <-> shout (3 KV heads: TP=3, one head a rank), same layer.

Quality: KL(full || mapped) and normalized retention of the plain switch per held-out example (the evaluation split's
selection-role files: the texts that choose, never the ones the published figures report), dense and per-shard, and
the paired difference (per-shard - dense) with its 95% bootstrap interval. Cost per rank and mapped token: the bytes
the gather moves (the other ranks' source heads, float32 as vLLM's CPU build keeps them; half in bfloat16) and the
map's multiply-adds (a per-shard map reads 1/TP of the source features; the apply function multiplies the dense
weights, zeros included, so the saving is what a per-shard apply would take, not what it takes today).

    python -m benchmarks.tp_shards                 # ~10 min on 2 cores
    python -m benchmarks.tp_shards --files 4 --examples 2 --pairs adapters --output /tmp/tp-shards   # a smoke run

Writes benchmarks/results/tp-shards.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from peft_kvcache import KVMap
from peft_kvcache.calibration.loop import calibrate_adapters
from peft_kvcache.lab.corpus import stdlib_texts, token_ids
from peft_kvcache.lab.provenance import write_results
from peft_kvcache.maps.config import CalibrationConfig
from peft_kvcache.modeling.fixtures import load_model

from . import adapters, siblings
from .common import RESULTS, SMOLLM, start_run, table
from .tasks import continuation_examples

CONTEXT, CONTINUATION = 512, 64
ADAPTER = "shout"
SELECTION_FILES = siblings.ROLES["selection"]["code"]  # evaluation-split files that choose, not report


def selection_examples(tokenizer, count: int) -> tuple[list[torch.Tensor], list[str]]:
    start, stop = SELECTION_FILES
    texts = dict(list(stdlib_texts("evaluation", stop).items())[start:])
    return continuation_examples(tokenizer, texts, CONTEXT, CONTINUATION, count)


def costs(kv_map: KVMap, shards: int) -> dict:
    """Per rank and mapped token: bytes the gather moves (float32) and the map's multiply-adds, dense and per-shard."""
    source, target = kv_map.config.source_layout, kv_map.config.target_layout
    gathered = source.num_layers * 2 * source.layer_width * 4 * (shards - 1) // shards
    rank_columns = target.layer_width // shards
    dense = sum(len(layers) * source.layer_width * rank_columns
                for layers in (*kv_map.config.key_layers, *kv_map.config.value_layers))
    return {"gather_bytes_float32": gathered, "multiply_adds_dense": dense, "multiply_adds_per_shard": dense // shards}


def compare(source, target, maps: dict[str, KVMap], sequences, progress: bool) -> dict:
    report = siblings.score_maps(source, target, maps, sequences, CONTEXT, CONTINUATION, progress=progress)
    rows = {row["variant"]: row for row in report.rows()}
    return {"dense": rows["dense"], "per_shard": rows["per_shard"],
            "kl_difference": report.paired_difference("per_shard", "dense", metric="kl"),
            "normalized_difference": report.paired_difference("per_shard", "dense")}


def sibling_rows(files: int, examples: int, progress: bool) -> dict:
    models, tokenizer = siblings.load_pair()
    sequences, names = selection_examples(tokenizer, examples)
    shards = models["small"].config.num_key_value_heads
    vocab = models["small"].get_input_embeddings().weight.shape[0]
    configs = {label: CalibrationConfig(top_k=2, max_length=512, chunks_per_text=1, head_shards=head_shards)
               for label, head_shards in (("dense", 1), ("per_shard", shards))}
    texts = siblings.calibration_texts(tokenizer, files, configs["dense"])
    fitted: dict[str, dict[str, KVMap]] = {"up": {}, "down": {}}

    def on_scale(scale, run):  # one pass of both models: every fit reads the same statistics
        for direction, maps in fitted.items():
            for label, config in configs.items():
                maps[label] = siblings.fit_direction(run, direction, texts, scale, config, vocab)

    siblings.capture(models, texts, [files], configs["dense"], on_scale, progress=progress)
    out = {}
    for direction, maps in fitted.items():
        source, target = (models[name] for name in siblings.DIRECTIONS[direction])
        out[siblings.pair_name(direction)] = {"tp": shards, **compare(source, target, maps, sequences, progress),
                                              **costs(maps["dense"], shards)}
    return {"rows": out, "texts": names}


def adapter_rows(files: int, examples: int, progress: bool) -> dict:
    model, tokenizer = adapters.load_smollm2((ADAPTER,))
    base, _ = load_model(SMOLLM)
    shards = base.config.num_key_value_heads
    data = {name: token_ids(tokenizer, text, CONTEXT) for name, text in stdlib_texts("calibration", files).items()}
    fitted = {label: calibrate_adapters(model, data, adapters=[ADAPTER], head_shards=head_shards, progress=progress)
              for label, head_shards in (("dense", 1), ("per_shard", shards))}
    sequences, names = selection_examples(tokenizer, examples)
    model.set_adapter(ADAPTER)
    out = {}
    for reverse in (False, True):
        maps = {label: (m.to_base if reverse else m.to_adapter)[ADAPTER] for label, m in fitted.items()}
        source, target = (model, base) if reverse else (base, model)
        name = f"{ADAPTER} -> base" if reverse else f"base -> {ADAPTER}"
        out[name] = {"tp": shards, **compare(source, target, maps, sequences, progress), **costs(maps["dense"], shards)}
    return {"rows": out, "texts": names}


def markdown(payload: dict) -> str:
    def kl(row: dict) -> str:
        return f"{row['kl']:.4f}"

    def interval(d: dict) -> str:
        return f"{d['difference']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"

    rows = []
    for part in payload["parts"].values():
        for name, r in part["rows"].items():
            rows.append([name, r["tp"], kl(r["dense"]), kl(r["per_shard"]), interval(r["kl_difference"]),
                         interval(r["normalized_difference"]), f"{r['gather_bytes_float32']:,}",
                         f"{r['multiply_adds_dense']:,} / {r['multiply_adds_per_shard']:,}"])
    return "\n".join([
        "# Tensor parallelism: gather every source head, or maps fitted per shard", "",
        f"Both fitted on the first {payload['files']} calibration-split files (512 tokens each), scored on "
        f"{payload['examples']} held-out examples ({CONTEXT} tokens of context, {CONTINUATION} scored), the plain "
        "switch; per rank and mapped token: the bytes a gather moves (float32) and the map's multiply-adds.", "",
        table(["map", "TP", "KL dense (gather)", "KL per shard", "per shard - dense: KL [95%]",
               "per shard - dense: normalized retention [95%]", "gather bytes / token", "multiply-adds / token: "
               "dense / per shard"], rows)])


def main(argv=None) -> int:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", choices=("siblings", "adapters"), default=["siblings", "adapters"])
    parser.add_argument("--files", type=int, default=32, help="calibration files of every fit")
    parser.add_argument("--examples", type=int, default=16, help="held-out examples")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS / "tp-shards")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    runners = {"siblings": sibling_rows, "adapters": adapter_rows}
    parts = {name: runners[name](args.files, args.examples, not args.no_progress) for name in args.pairs}
    payload = {"files": args.files, "examples": args.examples, "parts": parts}
    text = markdown(payload)
    print(text)
    write_results(args.output, payload, text, data={name: part["texts"] for name, part in parts.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
