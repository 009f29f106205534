"""Levers on the base -> adapter map quality (issue 3): layer selection with top_k=2 from full cross-layer
statistics vs the published same-layer map, on one adapter; retention table of both on the same examples.

    PYTHONPATH=. python benchmarks/adapters_levers.py --adapter shout     # ~10 min on 1 thread

Writes benchmarks/results/adapters_levers.md / .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from calibrate_adapter_maps import MODEL, calibration_ids, ensure_maps, load_peft_smollm2  # noqa: E402

from peft_kvcache.corpus import evaluation_texts  # noqa: E402
from peft_kvcache.evaluate import evaluate_retention, token_sequences  # noqa: E402
from peft_kvcache.fixtures import load_model  # noqa: E402
from peft_kvcache.peft_maps import calibrate_adapters  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--adapter", default="shout")
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--files", type=int, default=32,
                        help="calibration files (32: the committed results, measured when the published maps used 32)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, names = load_peft_smollm2()
    published = ensure_maps(model, tokenizer, names).to_adapter[args.adapter]
    started = time.perf_counter()
    variant = calibrate_adapters(model, calibration_ids(tokenizer, files=args.files), adapters=[args.adapter], reverse=False,
                                 same_layer=False, top_k=args.top_k).to_adapter[args.adapter]
    seconds = time.perf_counter() - started
    base, _ = load_model(MODEL)
    sequences = token_sequences(evaluation_texts(60), tokenizer, 576)[: args.examples]
    model.set_adapter(args.adapter)
    out = {"adapter": args.adapter, "calibration_seconds": round(seconds, 1),
           "key_layers": variant.config.key_layers, "value_layers": variant.config.value_layers}
    lines = [f"# Map levers on adapter {args.adapter} (SmolLM2-135M-Instruct, 1 thread)", ""]
    # The published map's table on the same examples is in benchmarks/results/adapters.md.
    for label, kv_map in ((f"full cross-layer statistics, top_k={args.top_k}", variant),):
        r2k = sum(map(sum, kv_map.config.key_r2)) / (3 * 30)
        r2v = sum(map(sum, kv_map.config.value_r2)) / (3 * 30)
        report = evaluate_retention(base, model, kv_map, sequences, 512, 64, window_control=False)
        out[label] = {"heldout_r2_keys": r2k, "heldout_r2_values": r2v, **report.to_dict(),
                      "map_mb": round(sum(t.numel() * 4 for t in kv_map.tensors.values()) / 2**20, 1)}
        lines += [f"## {label}", "", f"held-out R^2 keys {r2k:.4f}, values {r2v:.4f}; "
                  f"map {out[label]['map_mb']} MB", "", report.table(), ""]
        print("\n".join(lines[-6:]), flush=True)
    r2k = sum(map(sum, published.config.key_r2)) / (3 * 30)
    r2v = sum(map(sum, published.config.value_r2)) / (3 * 30)
    lines += [f"Published same-layer map: held-out R^2 keys {r2k:.4f}, values {r2v:.4f} (its retention table: "
              "benchmarks/results/adapters.md, same 16 examples).", "",
              f"Chosen source layers (keys): {variant.config.key_layers}",
              f"Chosen source layers (values): {variant.config.value_layers}"]
    results = ROOT / "benchmarks" / "results"
    (results / "adapters_levers.json").write_text(json.dumps(out, indent=1) + "\n")
    (results / "adapters_levers.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
