"""Sibling-size maps (Qwen2.5-Coder 0.5B <-> 1.5B): calibrate both directions from one capture, publish
them to hub_cards/, and score them on two tasks with the window-only control beside every row.

    python benchmarks/siblings.py --calibration-files 32 --eval-files 10 --context 1024
    # the published maps, with the refresh and the per-request check, then the switch timed alone:
    python benchmarks/siblings.py --from-cards --eval-files 8 --recall-examples 8 --recall-depth 0 0.5 \
        --windows 1 16 --refresh 32 --check-tokens 16 --ttft-lengths --output siblings-refresh
    python benchmarks/siblings.py --ttft-only --windows 1 16 --refresh 32 --output siblings-refresh-ttft

Tasks (held-out text, never calibrated on):
- continuation: a stdlib file's next 64 tokens, teacher-forced, after `--context` tokens of it;
- recall: a value assigned at the top (or, with `--recall-depth 0.5`, in the middle) of a ~1k-token file,
  asked for at the end (its answer lies only in the far context, so the window-only control must fail).
Every mapped row (mapped@W, and mapped@W+rK with the refresh) is compared with the window-only control at
equal target compute (window@W, window@(2W+K)). Writes benchmarks/results/<output>.{md,json}, the
measured figures into the map folders' cards, and per-layer charts there.
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


def recall_examples(tokenizer, context: int, count: int, seed: int = 0,
                    depth: float = 0.0) -> tuple[list[torch.Tensor], int]:
    """Files whose answer lies only far back: ``NAME = "<value>"`` at ``depth`` (0: the top, 0.5: the
    middle of ~context tokens of held-out code), then ``assert NAME == "`` and the value (teacher-forced,
    scored over the value's tokens)."""
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
        cut = int(depth * len(filler))
        examples.append(torch.tensor(filler[:cut] + head + filler[cut:] + question + answer[:answer_len]))
    return examples, answer_len


def ttft(source, target, kv_map, length: int, windows, refresh=(), refresh_span: int = 8, repeats: int = 2) -> dict:
    """Time to first token after a switch at ``length`` tokens of context: mapping (the source cache
    already exists) + the target's own computation of the last W tokens (and, with ``refresh``, of the K
    positions it refreshes), vs full target prefill."""
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
            def mapped(w=w):
                cache = [(k[:, :, : length - w], v[:, :, : length - w])
                         for k, v in zip(source_cache.keys, source_cache.values)]
                mapped_cache = MappedCache.from_source(cache, kv_map, target, input_ids=ids[:, : length - w])
                target(ids[:, length - w:], past_key_values=mapped_cache, logits_to_keep=1,
                       position_ids=torch.arange(length - w, length)[None])
            t = best(mapped)
            out[f"mapped@{w}_s"] = t
            out[f"speedup@{w}"] = full / t
            for k in refresh:
                def refreshed(w=w, k=k):
                    cache = [(keys[:, :, : length - 1], values[:, :, : length - 1])
                             for keys, values in zip(source_cache.keys, source_cache.values)]
                    mapped_cache = MappedCache.from_source(cache, kv_map, target, input_ids=ids[:, :-1],
                                                           refresh_tokens=k, probe_tokens=w, refresh_span=refresh_span)
                    target(ids[:, -1:], past_key_values=mapped_cache, logits_to_keep=1,
                           position_ids=torch.tensor([[length - 1]]))
                t = best(refreshed)
                out[f"mapped@{w}+r{k}_s"] = t
                out[f"speedup@{w}+r{k}"] = full / t
    return out


def add_speedups(quality: dict, ttft_rows: list[dict], length: int = 2048) -> None:
    """Write the TTFT speedup at ``length`` tokens of every timed variant into a card's figures."""
    for timing in (r for r in ttft_rows if r["context"] == length):
        for name, speedup in timing.items():
            if name.startswith("speedup@"):
                variant = quality.setdefault("variants", {}).setdefault("mapped@" + name.removeprefix("speedup@"), {})
                variant[f"ttft_speedup_{length}"] = round(speedup, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration-files", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--eval-files", type=int, default=10)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--recall-examples", type=int, default=10)
    parser.add_argument("--tasks", nargs="+", default=["continuation", "recall"], choices=["continuation", "recall"])
    parser.add_argument("--recall-depth", type=float, nargs="+", default=[0.0],
                        help="where the value is stated: 0 = the top of the context, 0.5 = its middle")
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--refresh", type=int, nargs="*", default=[],
                        help="budgets K: the target recomputes the K context positions the last W attend to most")
    parser.add_argument("--refresh-span", type=int, default=8)
    parser.add_argument("--check-tokens", type=int, default=0,
                        help="W (one of --windows): run the per-request check on every example and report "
                             "how many bad contexts (mapped@W below window@W) it flags")
    parser.add_argument("--top-k", type=int, nargs="+", default=[2])
    parser.add_argument("--ttft-lengths", type=int, nargs="*", default=[2048])
    parser.add_argument("--directions", nargs="+", default=["up", "down"])
    parser.add_argument("--output", default="siblings", help="results file stem under benchmarks/results/")
    parser.add_argument("--from-cards", action="store_true",
                        help="evaluate the maps already in hub_cards/ instead of calibrating")
    parser.add_argument("--keep-cards", action="store_true",
                        help="leave hub_cards/ as they are (a re-check, not figures to publish)")
    parser.add_argument("--ttft-only", action="store_true",
                        help="only time the switch for the maps in hub_cards/ and add the speedups to their cards")
    args = parser.parse_args()
    args.from_cards = args.from_cards or args.ttft_only
    if args.check_tokens and args.check_tokens not in args.windows:
        parser.error("--check-tokens must be one of --windows (its catch rate compares mapped@W with window@W)")
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
    recall = {depth: recall_examples(tokenizer, args.context, args.recall_examples, depth=depth)
              for depth in args.recall_depth}
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
            key = f"{direction}/top{top_k}"
            if not args.from_cards:
                fit_s = kv_map.config.calibration["fit_s"] = round(time.perf_counter() - fit_started, 1)
                print(f"== {name}: fitted in {fit_s:.0f}s", flush=True)
            row = {"fit_s": kv_map.config.calibration.get("fit_s"), "map_parameters": kv_map.num_parameters}

            def time_switches() -> None:
                row["ttft"] = [ttft(models[src], models[tgt], kv_map, n, args.windows, args.refresh, args.refresh_span)
                               for n in args.ttft_lengths]
                lines.extend([f"TTFT {name}: " + json.dumps(row["ttft"]), ""])
                print(lines[-2], flush=True)
                results[key] = row

            if args.ttft_only:
                time_switches()
                add_speedups(kv_map.config.quality, row["ttft"])
                if not args.keep_cards:
                    kv_map.save_pretrained(CARDS / name)
                write_results(args.output, results, lines)
                continue
            reports = {}
            tasks = [("continuation", continuation, args.context, args.continuation)] * ("continuation" in args.tasks)
            tasks += [("recall" if depth == 0 else f"recall@depth{depth:g}", seqs, args.context, answer_len)
                      for depth, (seqs, answer_len) in recall.items() if "recall" in args.tasks]
            for task, seqs, ctx, cont in tasks:
                report = evaluate_retention(models[src], models[tgt], kv_map, seqs, ctx, cont,
                                            windows=args.windows, refresh=args.refresh,
                                            refresh_span=args.refresh_span, check_tokens=args.check_tokens,
                                            progress=False)
                reports[task] = report
                row[task] = report.to_dict()
                # every mapped row against the window-only control at equal target compute
                pairs_vs_control = [(f"mapped@{w}", f"window@{w}") for w in args.windows]
                pairs_vs_control += [(f"mapped@{w}+r{k}", f"window@{2 * w + k}") for w in args.windows
                                     for k in args.refresh if 2 * w + k < ctx]
                row[task]["paired_vs_window"] = [report.paired_difference(a, b) for a, b in pairs_vs_control]
                row[task]["paired_vs_window_kl"] = [report.paired_difference(a, b, metric="kl")
                                                    for a, b in pairs_vs_control]
                first_line = len(lines)
                lines += [f"### {name}: {task}", "", report.table(), ""]
                lines += [f"- {d['a']} minus {d['b']}: normalized {d['difference']:+.3f} [{d['low']:+.3f}, "
                          f"{d['high']:+.3f}]; KL {dk['difference']:+.4f} [{dk['low']:+.4f}, {dk['high']:+.4f}]"
                          for d, dk in zip(row[task]["paired_vs_window"], row[task]["paired_vs_window_kl"])] + [""]
                if args.check_tokens:
                    row[task]["context_check"] = c = report.check_catch_rate(args.check_tokens)
                    lines += [f"- per-request check (W={args.check_tokens}, margin 0.25 nats): flagged "
                              f"{c['bad_flagged']} of {c['bad']} bad contexts (mapped@{args.check_tokens} below "
                              f"window@{args.check_tokens}) and {c['good_flagged']} of {c['good']} good ones", ""]
                print("\n".join(lines[first_line:]), flush=True)
            time_switches()
            for stale in ("continuation_normalized_retention", "continuation_kl", "recall_normalized_retention",
                          "ttft_speedup_2048"):  # the single-variant figures of earlier runs
                kv_map.config.quality.pop(stale, None)
            quality = kv_map.config.quality
            quality["context_tokens"] = args.context
            for task, report in reports.items():  # merged into the card's figures: a run may score some tasks
                quality.setdefault("evaluation_examples", {})[task] = report.to_dict()["examples"]
                for r in (r for r in report.rows() if r["variant"].startswith("mapped@")):
                    figures = quality.setdefault("variants", {}).setdefault(r["variant"], {})
                    figures[f"{task}_normalized_retention"] = round(r["normalized_retention"], 4)
                    figures[f"{task}_kl"] = round(r["kl"], 4)
            add_speedups(kv_map.config.quality, row["ttft"])
            if not args.keep_cards:
                kv_map.save_pretrained(CARDS / name)
            write_results(args.output, results, lines)  # after every map: a long run keeps what it measured


def write_results(stem: str, results: dict, lines: list[str]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2))
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
