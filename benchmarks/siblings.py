"""Sibling-size maps (Qwen2.5-Coder 0.5B <-> 1.5B): calibration of both directions from one capture, with the
data-scaling curve, and the goal table on held-out text (continuation and far-context recall, on code and prose),
every mapped row beside the window-only control at equal target compute.

    python -m benchmarks.siblings --maps runs/publish/siblings --output siblings   # evaluate fitted maps

`scripts/publish.py` calls `capture` and `evaluate_map` to fit and score the published maps; this module writes
only under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from peft_kvcache import KVMap, MappedCache
from peft_kvcache.calibration.loop import build_map, collect, statistics_options
from peft_kvcache.calibration.statistics import ModelSide, StatisticsRun
from peft_kvcache.calibration.texts import CalibrationTexts
from peft_kvcache.calibration.retention import (
    RetentionReport,
    VariantScores,
    cached_logits,
    evaluate_retention,
    full_logits,
    window_logits,
)
from peft_kvcache.lab.corpus import corpus_description, prose_texts, stdlib_texts
from peft_kvcache import load_model
from peft_kvcache.maps.config import CalibrationConfig, CalibrationRecord, ModelSpec, Refresh
from peft_kvcache.modeling.capture import run_with_cache

from .common import LARGE, SMALL, interval, save, start_run, table
from .tasks import ANSWER_TOKENS, DEPTHS, continuation_examples, recall_examples

logger = logging.getLogger(__name__)
DIRECTIONS = {"up": ("small", "large"), "down": ("large", "small")}
SPECS = {"small": SMALL, "large": LARGE}


def pair_name(direction: str, top_k: int = 2) -> str:
    return f"qwen2.5-coder-{'0.5b-to-1.5b' if direction == 'up' else '1.5b-to-0.5b'}-top{top_k}"


CONFIG = CalibrationConfig(top_k=2, max_length=512, chunks_per_text=1)  # the published sibling maps' calibration


def capture(models: dict, texts: CalibrationTexts, scales: list[int], config: CalibrationConfig,
            on_scale: Callable[[int, StatisticsRun], None], checkpoint_root: Path | None = None,
            progress: bool = True) -> None:
    """One pass of both models over ``texts`` feeds both directions' statistics; after the first ``scale`` texts
    of each scale, ``on_scale(scale, run)`` sees the statistics of exactly those texts (nested: the 16-text fit
    holds the 8 texts of the 8-text fit). Each increment checkpoints under ``checkpoint_root`` and resumes."""
    sides = {name: ModelSide.of(model) for name, model in models.items()}
    run = StatisticsRun({"small": ["large"], "large": ["small"]}, sides, config)
    weighting = config.attention_weighting > 0  # each model is the other's target
    done = 0
    for scale in scales:
        part = CalibrationTexts(texts.names[done:scale], texts.chunks[done:scale], texts.heldout[done:scale])
        collect(lambda ids, mask: {name: run_with_cache(model, ids, mask, received_attention=weighting)
                                   for name, model in models.items()},
                run, part, config.batch_size, progress=progress,
                checkpoint_dir=None if checkpoint_root is None else checkpoint_root / f"upto-{scale}",
                checkpoint_key={"options": statistics_options(config), "upto": scale,
                                "fingerprints": [s.fingerprint for s in sides.values()]})
        on_scale(scale, run)
        done = scale


def fit_direction(run: StatisticsRun, direction: str, texts: CalibrationTexts, scale: int,
                  config: CalibrationConfig, vocab_size: int) -> KVMap:
    """The ``direction`` map from the statistics of the first ``scale`` texts."""
    source, target = DIRECTIONS[direction]
    prefix = CalibrationTexts(texts.names[:scale], texts.chunks[:scale], texts.heldout[:scale])
    record = CalibrationRecord(options=config, data=prefix.record(corpus_description("calibration", scale)),
                               sequences=len(prefix.all_chunks()), source=ModelSpec(SPECS[source]),
                               target=ModelSpec(SPECS[target]), license="apache-2.0")
    return build_map(run, source, target, config, record, vocab_size, progress=False)


def model_config(size: str):
    """The transformers config of ``size`` (``small`` or ``large``), its weights left unread."""
    from transformers import AutoConfig

    from peft_kvcache.modeling.fixtures import converted_path

    return AutoConfig.from_pretrained(converted_path(SPECS[size]))


def load_pair() -> tuple[dict, object]:
    """``({"small": 0.5B, "large": 1.5B}, tokenizer)``."""
    small, tokenizer = load_model(SMALL)
    large, _ = load_model(LARGE)
    return {"small": small, "large": large}, tokenizer


def parse_and_load(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, dict, object]:
    """A sibling benchmark's command line: its own options plus the task sizes and threads; then the pair."""
    parser.add_argument("--continuation-files", type=int, default=16)
    parser.add_argument("--recall-cases", type=int, default=8, help="recall cases per kind and depth")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return (args, *load_pair())


def calibration_texts(tokenizer, files: int, config: CalibrationConfig) -> CalibrationTexts:
    """The first ``files`` calibration-split stdlib files, cut by ``config`` (whole files held out)."""
    return CalibrationTexts.build(stdlib_texts("calibration", files), tokenizer, config)


# ----- evaluation -----


# Held-out text by role, disjoint: "final" scores the published figures; "selection" chooses what is published
# (the calibration data scale, the recommended refresh), so no figure is measured on text that chose it.
ROLES = {"final": {"code": (0, 40), "prose": (0, 34)}, "selection": {"code": (40, 83), "prose": (34, 67)}}


def tasks(tokenizer, context: int, role: str, continuation_files: int, recall_cases: int) -> dict:
    """The held-out task sets of ``role``: ``{name: (examples, continuation_length, text names)}``: continuation
    of evaluation-split stdlib files, and recall at every depth on code (the same files) and on prose."""
    (code_from, code_to), (prose_from, prose_to) = ROLES[role]["code"], ROLES[role]["prose"]
    code = stdlib_texts("evaluation", code_to - code_from, code_from)
    examples, names = continuation_examples(tokenizer, code, context, 64, continuation_files)
    out = {"continuation": (examples, 64, names)}
    if recall_cases:
        prose = prose_texts(prose_to - prose_from, prose_from)
        for seed, (label, depth) in enumerate(DEPTHS.items()):
            for kind, fillers in (("code", code), ("prose", prose)):
                examples, names = recall_examples(tokenizer, fillers, context, recall_cases, depth, kind == "prose",
                                                  seed=seed)
                out[f"recall-{kind}-{label}"] = (examples, ANSWER_TOKENS, names)
    return out


def evaluate_map(models: dict, direction: str, kv_map: KVMap, task_sets: dict, context: int,
                 refresh: list[Refresh], progress: bool = True) -> dict:
    """Every task on ``kv_map``: full prefill, no context, the plain switch (``mapped@1``), each refresh in
    ``refresh`` (``mapped@W+rK``), and the window-only control at equal target compute beside each, with paired
    95% bootstrap intervals. Returns JSON-ready rows per task."""
    source, target = (models[name] for name in DIRECTIONS[direction])
    out = {}
    for task, (examples, continuation, names) in task_sets.items():
        windows = sorted({1, *(r.probe_tokens for r in refresh)})
        report = evaluate_retention(source, target, kv_map, examples, context, continuation, windows=tuple(windows),
                                    refresh=tuple(sorted({r.tokens for r in refresh})), refresh_span=refresh[0].span
                                    if refresh else 8, progress=progress)
        pairs = [("mapped@1", "window@1")] + [(f"mapped@{r.probe_tokens}+r{r.tokens}",
                                               f"window@{2 * r.probe_tokens + r.tokens}") for r in refresh]
        out[task] = {**report.to_dict(), "texts": names,
                     "versus_window": [report.paired_difference(a, b) for a, b in pairs],
                     "versus_window_kl": [report.paired_difference(a, b, metric="kl") for a, b in pairs]}
    return out


@torch.no_grad()
def score_maps(source, target, maps: dict[str, KVMap], sequences, context: int, continuation: int,
               progress: bool = True) -> RetentionReport:
    """The plain switch (``mapped@1``) of several maps of one pair on the same examples, sharing the target's
    full prefill and the source's cache: variants ``full``, ``no_context`` and ``<label>`` per map."""
    from tqdm.auto import tqdm

    scores = {name: VariantScores() for name in ("full", "no_context", *maps)}
    for ids in tqdm(sequences, desc="scoring maps", disable=not progress):
        labels, full = ids[context:], full_logits(target, ids, context)
        scores["full"].add(full, full, labels)
        scores["no_context"].add(window_logits(target, ids, context, 1, 0), full, labels)
        source_kv = run_with_cache(source, ids[None, : context - 1])
        for label, kv_map in maps.items():
            cache = MappedCache.from_source(source_kv, kv_map, target, input_ids=ids[None, : context - 1],
                                            refresh_tokens=0)
            scores[label].add(cached_logits(target, cache, ids, context, 1), full, labels)
    return RetentionReport(scores, context, continuation)


def markdown(results: dict) -> str:
    lines = []
    for name, tasks_ in results.items():
        lines += [f"## {name}", ""]
        for task, report in tasks_.items():
            rows = [[r["variant"], f"{r['accuracy']:.3f}", interval(r["normalized_retention"], r["normalized_low"],
                                                                   r["normalized_high"]), f"{r['kl']:.4f}"]
                    for r in report["rows"]]
            lines += [f"### {task} ({report['examples']} examples, context {report['context_length']})", "",
                      table(["variant", "top-1", "normalized [95% CI]", "KL(full‖variant)"], rows), ""]
            lines += [f"- {d['a']} minus {d['b']}: normalized {d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]; "
                      f"KL {k['difference']:+.4f} [{k['low']:+.4f}, {k['high']:+.4f}]"
                      for d, k in zip(report["versus_window"], report["versus_window_kl"])] + [""]
    return "\n".join(lines)


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", required=True, help="folder holding the two map folders (pair_name)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--continuation-files", type=int, default=32)
    parser.add_argument("--recall-cases", type=int, default=24)
    parser.add_argument("--refresh", type=int, nargs="*", default=[32], help="refresh budgets K (probe 16, span 8)")
    parser.add_argument("--output", default="siblings")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models, tokenizer = load_pair()
    task_sets = tasks(tokenizer, args.context, "final", args.continuation_files, args.recall_cases)
    results = {}
    for direction in DIRECTIONS:
        kv_map = KVMap.from_pretrained(Path(args.maps) / pair_name(direction))
        results[pair_name(direction)] = evaluate_map(models, direction, kv_map, task_sets, args.context,
                                                     [Refresh(k) for k in args.refresh])
    save(args.output, {"results": results}, markdown(results),
         data={name: names for name, (_, _, names) in task_sets.items()})


if __name__ == "__main__":
    main()
