"""Where the base -> adapter map loses quality, and how far a better fit of the same kind could go (issue 3).

1. Per layer: KL(full prefill || mapped cache) when one target layer's keys (or values) are taken from the
   adapter's own prefill and every other layer stays mapped: the drop says how much of the mapped cache's
   KL that layer's map carries.
2. Ceiling of the same-layer linear map: the map in hub_cards/, one calibrated on ``--more-files`` stdlib
   files, and an *oracle* calibrated on ``--oracle-files`` files plus the evaluation contexts themselves (a fit
   no deployment can have: an upper bound for this kind of map on this text). The committed results were
   measured when the published maps were fitted on 32 files (they are fitted on 128 since).

All on the same held-out stdlib examples as benchmarks/adapters.py's retention section (context 512,
continuation 64, teacher-forced).

    PYTHONPATH=. python benchmarks/adapter_ceiling.py --adapter shout --threads 2   # ~25 min

Writes benchmarks/results/adapter-ceiling-<adapter>.md / .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from calibrate_adapter_maps import MODEL, calibration_ids, ensure_maps, load_peft_smollm2  # noqa: E402

from peft_kvcache import MappedCache  # noqa: E402
from peft_kvcache.capture import run_with_cache  # noqa: E402
from peft_kvcache.corpus import evaluation_texts  # noqa: E402
from peft_kvcache.evaluate import cached_logits, evaluate_retention, full_logits, token_kl, token_sequences  # noqa: E402
from peft_kvcache.fixtures import load_model  # noqa: E402
from peft_kvcache.peft_maps import adapter_active, calibrate_adapters  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


@torch.no_grad()
def layer_kl(model, kv_map, adapter: str, sequences, context: int) -> dict:
    """Mean per-token KL(full || variant) over the continuation for the mapped cache, naive reuse, and the
    mapped cache with one layer's keys or values replaced by the adapter's own."""
    layers = kv_map.config.target_layout.num_layers
    names = ["mapped", "naive"] + [f"{kind}.{t}" for t in range(layers) for kind in ("keys", "values")]
    totals = dict.fromkeys(names, 0.0)
    for ids in sequences:
        prefix = ids[None, : context - 1]  # the target computes the last context token itself (W = 1)
        with adapter_active(model, None):
            base = run_with_cache(model, prefix)
        with adapter_active(model, adapter):
            own = run_with_cache(model, prefix)
            full = full_logits(model, ids, context)
            mapped = MappedCache.from_source(base.to_cache(), kv_map, model,
                                             input_ids=prefix, verify_models=False)
            keys, values = [layer.keys for layer in mapped.layers], [layer.values for layer in mapped.layers]

            def kl(k, v) -> float:  # the cache is extended by the continuation, so each variant gets a fresh one
                cache = DynamicCache(list(zip([x.clone() for x in k], [x.clone() for x in v])))
                return float(token_kl(full, cached_logits(model, cache, ids, context, 1)).mean())

            totals["mapped"] += kl(keys, values)
            totals["naive"] += kl(base.keys, base.values)
            for t in range(layers):
                totals[f"keys.{t}"] += kl([own.keys[t] if i == t else k for i, k in enumerate(keys)], values)
                totals[f"values.{t}"] += kl(keys, [own.values[t] if i == t else v for i, v in enumerate(values)])
    return {name: total / len(sequences) for name, total in totals.items()}


def mean_r2(kv_map) -> tuple[float, float]:
    config = kv_map.config
    count = config.target_layout.num_layers * config.target_layout.kv_heads
    return sum(map(sum, config.key_r2)) / count, sum(map(sum, config.value_r2)) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default="shout")
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--layer-examples", type=int, default=12, help="examples for the per-layer section")
    parser.add_argument("--more-files", type=int, default=128)
    parser.add_argument("--oracle-files", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    context, continuation = 512, 64

    model, tokenizer, names = load_peft_smollm2()
    published = ensure_maps(model, tokenizer, names, save=False).to_adapter[args.adapter]
    sequences = token_sequences(evaluation_texts(60), tokenizer, context + continuation)[: args.examples]
    out = {"adapter": args.adapter, "threads": args.threads, "examples": len(sequences),
           "layer_examples": args.layer_examples}

    started = time.perf_counter()
    out["layer_kl"] = layer_kl(model, published, args.adapter, sequences[: args.layer_examples], context)
    print(f"per-layer section: {time.perf_counter() - started:.0f} s", flush=True)

    maps = {"published": published}
    fits = {"calibrated on more files": calibration_ids(tokenizer, files=args.more_files),
            "oracle (calibration + the evaluation contexts)": calibration_ids(tokenizer, files=args.oracle_files)
            + [s[:context] for s in sequences]}
    out["calibration_tokens"] = {"published": published.config.calibration["train_tokens"]}
    out["published_calibration"] = published.config.calibration["description"]
    for label, data in fits.items():
        maps[label] = calibrate_adapters(model, data, adapters=[args.adapter], reverse=False,
                                         progress=False).to_adapter[args.adapter]
        out["calibration_tokens"][label] = maps[label].config.calibration["train_tokens"]
    base, _ = load_model(MODEL)
    out["ceiling"] = {}
    with adapter_active(model, args.adapter):
        for label, kv_map in maps.items():
            report = evaluate_retention(base, model, kv_map, sequences, context, continuation, window_control=False,
                                        naive_reuse=label == "published", progress=False)
            mapped = next(r for r in report.rows() if r["variant"] == "mapped@1")
            out["ceiling"][label] = {"heldout_r2": mean_r2(kv_map), "rows": report.rows(), "mapped": mapped}
            print(f"## {label}\n{report.table()}", flush=True)

    stem = RESULTS / f"adapter-ceiling-{args.adapter}"
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(out))


def markdown(out: dict) -> str:
    kl = out["layer_kl"]
    layers = sorted({int(name.split(".")[1]) for name in kl if "." in name})
    lines = [f"# Where the base -> {out['adapter']} map loses quality (SmolLM2-135M-Instruct, {out['threads']} threads)",
             "", f"## 1. Per layer ({out['layer_examples']} held-out stdlib examples, context 512, continuation 64)",
             "", f"KL(full prefill || variant), mean per continuation token: mapped cache {kl['mapped']:.4f}, naive "
             f"reuse {kl['naive']:.4f}. Each row replaces one target layer's keys or values of the mapped cache by "
             "the adapter's own; the drop is the KL that layer's map carries.", "",
             "| layer | keys exact | drop | values exact | drop |", "|---|---|---|---|---|"]
    for t in layers:
        k, v = kl[f"keys.{t}"], kl[f"values.{t}"]
        lines.append(f"| {t} | {k:.4f} | {kl['mapped'] - k:+.4f} | {v:.4f} | {kl['mapped'] - v:+.4f} |")
    drops = sorted(((kl["mapped"] - kl[n], n) for n in kl if "." in n), reverse=True)
    lines += ["", "Largest drops: " + ", ".join(f"{n} {d:+.4f}" for d, n in drops[:6])
              + f"; sum of all single-layer drops {sum(d for d, _ in drops):.4f}.", "",
              f"## 2. Ceiling of the same-layer linear map ({out['examples']} examples)", "",
              f"The published map ({out['published_calibration']}) against one calibrated on more files and an "
              "oracle fitted on the evaluation contexts themselves.", "",
              "| map | train tokens | held-out R^2 keys / values | normalized retention [95% CI] | KL(full‖mapped) | "
              "greedy agreement |", "|---|---|---|---|---|---|"]
    for label, row in out["ceiling"].items():
        m = row["mapped"]
        r2k, r2v = row["heldout_r2"]
        lines.append(f"| {label} | {out['calibration_tokens'][label]} | {r2k:.4f} / {r2v:.4f} | "
                     f"{m['normalized_retention']:.3f} [{m['normalized_low']:.2f}, {m['normalized_high']:.2f}] | "
                     f"{m['kl']:.4f} | {m['greedy_agreement']:.3f} |")
    naive = next(r for r in out["ceiling"]["published"]["rows"] if r["variant"] == "naive@1")
    lines += ["", f"Naive reuse of the base cache on the same examples: normalized {naive['normalized_retention']:.3f} "
              f"[{naive['normalized_low']:.2f}, {naive['normalized_high']:.2f}], KL {naive['kl']:.4f}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
