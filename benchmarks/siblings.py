"""Sibling-size maps (Qwen2.5-Coder 0.5B <-> 1.5B): calibrate both directions from one capture, publish
them to hub_cards/, and score them on two tasks with the window-only control beside every row.

    python benchmarks/siblings.py --calibration-files 32 --eval-files 10 --context 1024

Tasks (held-out text, never calibrated on):
- continuation: a stdlib file's next 64 tokens, teacher-forced, after `--context` tokens of it;
- recall: a value assigned at the top of a ~1k-token file, asked for at the end (its answer lies only in
  the far context, so the window-only control must fail).
Writes benchmarks/results/siblings.{md,json} and per-layer charts into the map folders.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from peft_kvcache import KVMap
from peft_kvcache.calibrate import ModelSide, build_map, calibration_sequences, heldout_flags
from peft_kvcache.capture import batches, run_with_cache, stacked_features, fitted_rows
from peft_kvcache.corpus import calibration_texts, corpus_description, evaluation_texts
from peft_kvcache.evaluate import evaluate_retention, token_sequences
from peft_kvcache.fit import SufficientStatistics
from peft_kvcache.fixtures import load_model
from peft_kvcache.models import vocab_size_of
from peft_kvcache.positions import positions_from_mask

SMALL, LARGE = "gguf:qwen2.5-coder-0.5b-instruct", "gguf:qwen2.5-coder-1.5b-instruct"
RESULTS = Path(__file__).parent / "results"
CARDS = Path(__file__).parent.parent / "hub_cards"


def bidirectional_statistics(small, large, sequences, sink_tokens=1, heldout_fraction=0.2):
    """One forward pass of each model per sequence feeds both directions' statistics."""
    sides = {"small": ModelSide.of(small), "large": ModelSide.of(large)}
    width = {k: s.layout.num_layers * s.layout.layer_width for k, s in sides.items()}
    stats = {direction: {split: {kind: SufficientStatistics.empty(width[src], {"target": width[tgt]})
                                 for kind in ("keys", "values")} for split in ("train", "heldout")}
             for direction, (src, tgt) in {"up": ("small", "large"), "down": ("large", "small")}.items()}
    flags = heldout_flags(len(sequences), heldout_fraction)
    for i, ((ids, mask), heldout) in enumerate(zip(batches(sequences, 1), flags)):
        started = time.perf_counter()
        positions, rows = positions_from_mask(mask), fitted_rows(mask, sink_tokens)
        feats = {}
        for key, model in (("small", small), ("large", large)):
            feats[key] = stacked_features(run_with_cache(model, ids, mask), sides[key].rotary, positions, rows)
        split = "heldout" if heldout else "train"
        for direction, (src, tgt) in {"up": ("small", "large"), "down": ("large", "small")}.items():
            for k, kind in enumerate(("keys", "values")):
                stats[direction][split][kind].update(feats[src][k], {"target": feats[tgt][k]})
        print(f"  captured sequence {i + 1}/{len(sequences)} ({ids.shape[1]} tokens) in "
              f"{time.perf_counter() - started:.1f}s", flush=True)
    return stats, sides


def recall_examples(tokenizer, context: int, count: int, seed: int = 0) -> tuple[list[torch.Tensor], int]:
    """Files whose answer lies only at their top: ``NAME = "<value>"``, ~context tokens of held-out code,
    then ``assert NAME == "`` and the value (teacher-forced, scored over the value's tokens)."""
    rng = random.Random(seed)
    fillers = [tokenizer(t, add_special_tokens=False).input_ids for t in evaluation_texts(40)]
    fillers = [f for f in fillers if len(f) >= context]
    answer_len, examples = 5, []
    while len(examples) < count and fillers:
        name = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(6))
        value = "".join(rng.choice("abcdefghijkmnpqrstuvwxyz0123456789") for _ in range(10))
        head = tokenizer(f'{name}_TOKEN = "{value}"\n\n', add_special_tokens=False).input_ids
        question = tokenizer(f'\n\nassert {name}_TOKEN == "', add_special_tokens=False).input_ids
        answer = tokenizer(f'{value}"', add_special_tokens=False).input_ids
        if len(answer) < answer_len:
            continue
        filler = fillers.pop(0)[: context - len(head) - len(question)]
        examples.append(torch.tensor(head + filler + question + answer[:answer_len]))
    return examples, answer_len


def ttft(source, target, kv_map, length: int, windows, repeats: int = 2) -> dict:
    """Time to first token after a switch at ``length`` tokens of context: mapping (the source cache
    already exists) + the target's own computation of the last W tokens, vs full target prefill."""
    from peft_kvcache import MappedCache

    ids = torch.randint(100, 20000, (1, length))
    source_cache = run_with_cache(source, ids[:, :-1])  # exists already at a switch: not timed

    def best(fn):
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return min(times)

    with torch.no_grad():
        full = best(lambda: target(ids, logits_to_keep=1))
        out = {"context": length, "full_prefill_s": full}
        for w in windows:
            def mapped():
                cache = [(k[:, :, : length - w], v[:, :, : length - w])
                         for k, v in zip(source_cache.keys, source_cache.values)]
                mapped_cache = MappedCache.from_source(cache, kv_map, target, input_ids=ids[:, : length - w])
                target(ids[:, length - w:], past_key_values=mapped_cache, logits_to_keep=1,
                       position_ids=torch.arange(length - w, length)[None])
            t = best(mapped)
            out[f"mapped@{w}_s"] = t
            out[f"speedup@{w}"] = full / t
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration-files", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--eval-files", type=int, default=10)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--recall-examples", type=int, default=10)
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--top-k", type=int, nargs="+", default=[2])
    parser.add_argument("--ttft-lengths", type=int, nargs="*", default=[2048])
    parser.add_argument("--directions", nargs="+", default=["up", "down"])
    parser.add_argument("--output", default="siblings", help="results file stem under benchmarks/results/")
    parser.add_argument("--from-cards", action="store_true",
                        help="evaluate the maps already in hub_cards/ instead of calibrating")
    args = parser.parse_args()
    torch.manual_seed(0)

    small, tokenizer = load_model(SMALL)
    large, _ = load_model(LARGE)
    texts = calibration_texts(args.calibration_files)
    sequences = calibration_sequences(texts, tokenizer, args.max_length)[: args.calibration_files]
    started = time.perf_counter()
    if not args.from_cards:
        print(f"calibration: {len(sequences)} sequences, {sum(len(s) for s in sequences)} tokens", flush=True)
        stats, sides = bidirectional_statistics(small, large, sequences)
    capture_s = time.perf_counter() - started

    models = {"small": small, "large": large}
    pairs = {"up": ("small", "large"), "down": ("large", "small")}
    continuation = token_sequences(evaluation_texts(args.eval_files * 3), tokenizer,
                                   args.context + args.continuation)[: args.eval_files]
    recall, answer_len = recall_examples(tokenizer, args.context, args.recall_examples)
    results, lines = {"capture_s": None if args.from_cards else capture_s,
                      "calibration_tokens": sum(len(s) for s in sequences)}, []
    for direction in args.directions:
        src, tgt = pairs[direction]
        for top_k in args.top_k:
            name = f"qwen2.5-coder-{'0.5b-to-1.5b' if direction == 'up' else '1.5b-to-0.5b'}-top{top_k}"
            fit_started = time.perf_counter()
            kv_map = KVMap.from_pretrained(CARDS / name) if args.from_cards else build_map(
                stats[direction], "target", sides[src], sides[tgt], vocab_size_of(small), top_k=top_k,
                calibration_info={"description": corpus_description("calibration", args.calibration_files),
                                  "sequences": len(sequences), "max_length": args.max_length,
                                  "license": "apache-2.0"}, progress=False)
            fit_s = (kv_map.config.calibration.get("fit_s", float("nan")) if args.from_cards
                     else time.perf_counter() - fit_started)
            kv_map.config.calibration["fit_s"] = round(fit_s, 1)
            key = f"{direction}/top{top_k}"
            print(f"== {name}: fitted in {fit_s:.0f}s", flush=True)
            row = {"fit_s": fit_s, "map_parameters": kv_map.num_parameters}
            reports = {}
            for task, seqs, ctx, cont in (("continuation", continuation, args.context, args.continuation),
                                          ("recall", recall, args.context, answer_len)):
                report = evaluate_retention(models[src], models[tgt], kv_map, seqs, ctx, cont,
                                            windows=args.windows, progress=False)
                reports[task] = report
                row[task] = report.to_dict()
                row[task]["paired_vs_window"] = [report.paired_difference(f"mapped@{w}", f"window@{w}")
                                                 for w in args.windows]
                lines += [f"### {name}: {task}", "", report.table(), ""]
                lines += [f"- mapped@{d['a'].split('@')[1]} minus window@{d['b'].split('@')[1]}: normalized "
                          f"{d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
                          for d in row[task]["paired_vs_window"]] + [""]
                print("\n".join(lines[-(len(args.windows) + 8):]), flush=True)
            row["ttft"] = [ttft(models[src], models[tgt], kv_map, n, args.windows) for n in args.ttft_lengths]
            lines += [f"TTFT {name}: " + json.dumps(row["ttft"]), ""]
            print(lines[-2], flush=True)
            results[key] = row
            mapped = {r["variant"]: r for r in reports["continuation"].rows()}
            recalled = {r["variant"]: r for r in reports["recall"].rows()}
            kv_map.config.quality = {
                "context_tokens": args.context,
                "continuation_normalized_retention": round(mapped["mapped@1"]["normalized_retention"], 4),
                "continuation_kl": round(mapped["mapped@1"]["kl"], 4),
                "recall_normalized_retention": round(recalled["mapped@1"]["normalized_retention"], 4),
                "ttft_speedup_2048": round(row["ttft"][0]["speedup@1"], 1) if row["ttft"] else None,
            }
            kv_map.save_pretrained(CARDS / name)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.output}.json").write_text(json.dumps(results, indent=2))
    (RESULTS / f"{args.output}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
