"""Levers on the sibling maps, each against the published recipe on the same held-out examples (the "selection"
texts, never the goal table's), with paired 95% intervals: kept only where the interval is above zero.

- source layers per target layer: ``top_k`` 1 and 4 (fitted from the same 128-file statistics as the
  published top-2 maps, `scripts/publish.py`'s capture);
- where the refresh looks: the mean over every probe token instead of the last one; the last 32 context tokens
  always refreshed, the rest of the budget by attention.

Every variant shares the target's full prefill and the source's cache of each example, so the comparison costs
one pass of each variant.

    python -m benchmarks.levers --maps runs/publish/siblings/levers

The maps of a label ``topK`` lie in ``<maps>/topK/<pair map named for K>`` (`lever_folder`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from peft_kvcache import KVMap, MappedCache
from peft_kvcache.calibration.retention import RetentionReport, VariantScores, cached_logits, full_logits, window_logits
from peft_kvcache.maps.config import Refresh
from peft_kvcache.modeling.capture import run_with_cache
from peft_kvcache.runtime.refresh import attention_scores, refresh_positions, select_spans

from . import siblings
from .common import save, start_run, table

RECENT = 32  # the "always refresh the recent tokens" lever


@dataclass(frozen=True)
class Lever:
    """One way to give the target a switched context, scored by `score_variants`.

    ``kv_map`` None: no mapped context at all, the window-only control (the sink and the last ``window`` context
    tokens, computed by the target). ``refresh`` None: the mapped prefix and the last ``window`` context tokens
    computed by the target (``window`` 1: the plain switch). Otherwise the refresh: the probe's attention (``by``:
    its last token's, or the mean over the probe) picks ``refresh.tokens - recent`` positions and the last
    ``recent`` context tokens before the probe are recomputed always (the hybrid recipe: an exact recent window
    plus positions picked far back, at the same target compute ``2 * probe + tokens``)."""

    kv_map: KVMap | None
    refresh: Refresh | None = None
    by: Literal["last", "mean"] = "last"
    recent: int = 0
    window: int = 1

    def compute(self) -> int:
        """Context tokens the target computes: what a control at equal compute keeps."""
        if self.kv_map is None or self.refresh is None:
            return self.window
        return 2 * self.refresh.probe_tokens + self.refresh.tokens


def lever_folder(root: Path, label: str, direction: str) -> Path:
    """The map folder of the lever ``label`` (``top<K>``: K source layers per target layer) for ``direction``."""
    return root / label / siblings.pair_name(direction, int(label.removeprefix("top")))


def _positions(scores: torch.Tensor, lever: Lever, sink: int) -> torch.Tensor:
    """Context positions to refresh from ``[W, context]`` probe attention, as ``lever`` picks them."""
    policy, length = lever.refresh, scores.shape[1]
    ranked = (scores[-1] if lever.by == "last" else scores.mean(0)).clone()
    recent = torch.arange(max(sink, length - lever.recent), length)
    ranked[recent] = -1.0  # taken anyway: the attention picks the rest of the budget
    chosen = select_spans(ranked, max(policy.tokens - recent.numel(), 0), policy.span, first=sink)
    return torch.unique(torch.cat([chosen[chosen < length - lever.recent], recent]))


@torch.no_grad()
def refreshed(target, lever: Lever, source_kv, ids: torch.Tensor):
    """The mapped cache of ``ids`` ``[1, n]`` with the refresh, positions chosen as ``lever`` picks them."""
    kv_map, policy = lever.kv_map, lever.refresh
    cache = MappedCache.from_source(source_kv, kv_map, target, input_ids=ids, refresh_tokens=0, verify_models=False)
    start, sink = ids.shape[1] - policy.probe_tokens, kv_map.config.sink_tokens
    cache.truncate(start)
    scores = attention_scores(target, cache, ids[:, start:], every_probe_token=True)
    refresh_positions(target, cache, ids[:, :start], _positions(scores, lever, sink), append_ids=ids[:, start:])
    return cache


@torch.no_grad()
def score_variants(source, target, variants: dict[str, Lever], sequences, context: int, continuation: int,
                   progress: bool = True, sink: int = 1) -> RetentionReport:
    """Variants ``name -> Lever`` on the same examples, sharing the full prefill and the source's cache; ``sink``:
    the leading tokens a window-only control keeps."""
    scores = {name: VariantScores() for name in ("full", "no_context", *variants)}
    for ids in tqdm(sequences, desc="levers", disable=not progress):
        labels, full = ids[context:], full_logits(target, ids, context)
        scores["full"].add(full, full, labels)
        scores["no_context"].add(window_logits(target, ids, context, 1, 0), full, labels)
        source_kv = run_with_cache(source, ids[None, :context])
        for name, lever in variants.items():
            if lever.kv_map is None:
                scores[name].add(window_logits(target, ids, context, lever.window, sink), full, labels)
                continue
            if lever.refresh is None:  # the target computes the last `window` context tokens on the mapped prefix
                cache = MappedCache.from_source(source_kv.prefix(context - lever.window), lever.kv_map, target,
                                                input_ids=ids[None, : context - lever.window], refresh_tokens=0,
                                                verify_models=False)
                scores[name].add(cached_logits(target, cache, ids, context, lever.window), full, labels)
                continue
            cache = refreshed(target, lever, source_kv, ids[None, :context])
            cache.truncate(context - 1)  # the last context token's logits predict the first label
            scores[name].add(cached_logits(target, cache, ids, context, 1), full, labels)
    return RetentionReport(scores, context, continuation)


def run(models, tokenizer, maps: dict[str, dict[str, KVMap]], policy: dict[str, Refresh], context: int,
        continuation_files: int, recall_cases: int, progress: bool = True) -> dict:
    """``maps[direction][label]`` (label "top2" is the published choice); every lever against it."""
    task_sets = siblings.tasks(tokenizer, context, "selection", continuation_files, recall_cases)
    results, lines = {}, ["# Levers on the sibling maps (selection texts)", ""]
    for direction, by_label in maps.items():
        source, target = (models[n] for n in siblings.DIRECTIONS[direction])
        recipe = policy[direction]
        variants = {"published: top2 + recipe": Lever(by_label["top2"], recipe)}
        for label in (k for k in by_label if k != "top2"):
            variants[f"{label} + recipe"] = Lever(by_label[label], recipe)
        variants["top2 + recipe, mean over the probe"] = Lever(by_label["top2"], recipe, by="mean")
        variants[f"top2 + recipe, last {RECENT} always"] = Lever(by_label["top2"], recipe, recent=RECENT)
        variants.update({f"{label}, plain switch": Lever(m) for label, m in by_label.items()})
        rows = []
        for task, (examples, cont, names) in task_sets.items():
            report = score_variants(source, target, variants, examples, context, cont, progress)
            results.setdefault(direction, {})[task] = {**report.to_dict(), "texts": names, "versus_published": [
                report.paired_difference(name, "published: top2 + recipe") for name in variants if "published" not in name]}
        for name in variants:
            if "published" in name:
                continue
            cells = []
            for task in ("continuation", "recall"):
                diffs = [d for t, r in results[direction].items() if t.startswith(task) for d in r["versus_published"]
                         if d["a"] == name]
                mean = sum(d["difference"] for d in diffs) / len(diffs)
                wins = sum(d["low"] > 0 for d in diffs)
                cells.append(f"{mean:+.3f} ({wins}/{len(diffs)} above zero)")
            rows.append([name, *cells])
        lines += [f"## {siblings.pair_name(direction)}: lever minus the published recipe (normalized retention)", "",
                  table(["variant", "continuation", "recall (mean over kinds and depths; tasks won)"], rows), ""]
    save("sibling-levers", {"context": context, "results": results, "recipe": {d: vars(p) for d, p in policy.items()}},
         "\n".join(lines), data={name: names for name, (_, _, names) in task_sets.items()})
    return results


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", required=True, help="folder with <label>/<pair map> folders (top1, top2, ...; "
                        "lever_folder)")
    parser.add_argument("--labels", nargs="+", default=["top1", "top2", "top4"])
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    args, models, tokenizer = siblings.parse_and_load(parser)
    maps = {d: {label: KVMap.from_pretrained(lever_folder(Path(args.maps), label, d)) for label in args.labels}
            for d in siblings.DIRECTIONS}
    run(models, tokenizer, maps, {d: Refresh(args.budget) for d in siblings.DIRECTIONS}, args.context,
        args.continuation_files, args.recall_cases)


if __name__ == "__main__":
    main()
