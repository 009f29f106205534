"""The attention-sink default, measured: the same map applied with the target computing the first
``sink_tokens`` context tokens itself (0, 1, 4), on held-out continuation examples.

    python benchmarks/sink.py --map hub_cards/qwen2.5-coder-0.5b-to-1.5b-top2 --context 512
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path

from peft_kvcache import KVMap
from peft_kvcache.corpus import evaluation_texts
from peft_kvcache.evaluate import evaluate_retention, token_sequences
from peft_kvcache.fixtures import load_model

FIXTURE_OF = {"Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF-Q5_0": "gguf:qwen2.5-coder-0.5b-instruct",
              "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF-Q4_K_M": "gguf:qwen2.5-coder-1.5b-instruct"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--map", required=True)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--sinks", type=int, nargs="+", default=[0, 1, 4])
    args = parser.parse_args()
    kv_map = KVMap.from_pretrained(args.map)
    source, tokenizer = load_model(FIXTURE_OF.get(kv_map.config.source_name, kv_map.config.source_name))
    target, _ = load_model(FIXTURE_OF.get(kv_map.config.target_name, kv_map.config.target_name))
    sequences = token_sequences(evaluation_texts(3 * args.examples), tokenizer,
                                args.context + args.continuation)[: args.examples]
    rows = []
    for sink in args.sinks:
        variant = copy.copy(kv_map)
        variant.config = dataclasses.replace(kv_map.config, sink_tokens=sink)
        report = evaluate_retention(source, target, variant, sequences, args.context, args.continuation,
                                    window_control=False, naive_reuse=False, progress=False)
        row = {r["variant"]: r for r in report.rows()}["mapped@1"]
        rows.append({"sink_tokens": sink, **row})
        print(f"sink_tokens={sink}: normalized retention {row['normalized_retention']:.3f} "
              f"[{row['normalized_low']:.2f}, {row['normalized_high']:.2f}], KL {row['kl']:.3f}, "
              f"accuracy {row['accuracy']:.3f}", flush=True)
    out = Path(__file__).parent / "results" / "sink.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"map": args.map, "context": args.context, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
