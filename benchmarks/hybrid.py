"""The hybrid recipe on the sibling maps (the first lever of the long-context research): at the published recipe's
target budget in tokens, split between an exact recent window and positions the probe picks far back, against the
published recipe and against the window-only control at equal target compute, both directions, on the "selection"
texts (never the goal table's), paired 95% intervals.

At one budget B = 2 * probe + K (the published recipe's K, probe 16) every variant has the target compute B context
tokens (or fewer):

- ``published recipe``: K positions by the last probe token's attention;
- ``hybrid, last R exact``: the last R context tokens before the probe always recomputed, K - R by attention;
- ``mapped + last B exact``: no probe; the mapped prefix and the last B context tokens computed by the target;
- ``window-only @B``: no mapped context: the sink and the last B context tokens;
- ``plain switch``: the mapped prefix, the target computing only the last context token.

Continuation (code) and far-fact recall (code and prose fillers, every depth, pooled) per context length. Each
example shares the target's full prefill and the source's cache between the variants.

    python -m benchmarks.hybrid --maps hub_cards --contexts 2048 --continuation-files 16 --recall-cases 2

Writes benchmarks/results/sibling-hybrid.json/.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from peft_kvcache import KVMap

from . import siblings
from .common import save, start_run, table
from .levers import Lever, score_variants

PUBLISHED, WINDOW = "published recipe", "window-only"


def variants(kv_map: KVMap) -> dict[str, Lever]:
    """The hybrid family at ``kv_map``'s recipe budget (its ``config.refresh``)."""
    recipe = kv_map.config.refresh
    budget = 2 * recipe.probe_tokens + recipe.tokens
    out = {PUBLISHED: Lever(kv_map, recipe)}
    for recent in sorted({recipe.tokens // 4, recipe.tokens // 2, recipe.tokens} - {0}):
        out[f"hybrid, last {recent} exact + {recipe.tokens - recent} by attention"] = Lever(kv_map, recipe,
                                                                                            recent=recent)
    out[f"mapped + last {budget} exact"] = Lever(kv_map, window=budget)
    out[f"{WINDOW} @{budget}"] = Lever(None, window=budget)
    out["plain switch"] = Lever(kv_map)
    return out


def pooled_tasks(tokenizer, context: int, continuation_files: int, recall_cases: int) -> dict:
    """``{"continuation": ..., "recall": ...}``: the selection texts' continuation set, and every recall set
    (kinds x depths) pooled into one, each ``(examples, continuation length, text names)``."""
    sets = siblings.tasks(tokenizer, context, "selection", continuation_files, recall_cases)
    recall = [s for name, s in sets.items() if name.startswith("recall-")]
    out = {"continuation": sets["continuation"]}
    if recall:
        out["recall"] = ([e for s in recall for e in s[0]], recall[0][1],
                         [f"{name}: {text}" for name, s in sets.items() if name.startswith("recall-") for text in s[2]])
    return out


def run(models: dict, tokenizer, maps: dict[str, KVMap], contexts: list[int], continuation_files: int,
        recall_cases: int, progress: bool = True) -> dict:
    results, data, rows = {}, {}, []
    for context in contexts:
        task_sets = pooled_tasks(tokenizer, context, continuation_files, recall_cases)
        data.update({f"{context}/{task}": names for task, (_, _, names) in task_sets.items()})
        for direction, kv_map in maps.items():
            source, target = (models[n] for n in siblings.DIRECTIONS[direction])
            levers = variants(kv_map)
            window = next(name for name in levers if name.startswith(WINDOW))
            for task, (examples, continuation, _) in task_sets.items():
                report = score_variants(source, target, levers, examples, context, continuation, progress,
                                        sink=kv_map.config.sink_tokens)
                compared = {name: {"versus_window": report.paired_difference(name, window),
                                   "versus_published": report.paired_difference(name, PUBLISHED),
                                   "kl_versus_window": report.paired_difference(name, window, metric="kl")}
                            for name in levers}
                summary = report.to_dict()  # its rows bootstrap every variant: once
                results.setdefault(direction, {}).setdefault(str(context), {})[task] = {
                    **summary, "compute": {name: lever.compute() for name, lever in levers.items()},
                    "compared": compared}
                by_variant = {r["variant"]: r for r in summary["rows"]}
                for name, lever in levers.items():
                    w, p = compared[name]["versus_window"], compared[name]["versus_published"]
                    row = by_variant[name]
                    rows.append([siblings.pair_name(direction), str(context), f"{task} ({summary['examples']})",
                                 name, str(lever.compute()),
                                 f"{row['normalized_retention']:.3f} [{row['normalized_low']:.2f}, "
                                 f"{row['normalized_high']:.2f}]", f"{row['kl']:.3f}",
                                 f"{w['difference']:+.3f} [{w['low']:+.3f}, {w['high']:+.3f}]",
                                 f"{p['difference']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}]"])
    lines = ["# The hybrid recipe on the sibling maps (selection texts)", "",
             "Normalized retention with its 95% bootstrap interval; differences paired over the same examples "
             "(above zero: better than the window-only control at equal target compute / than the published "
             "recipe). Target compute in context tokens.", "",
             table(["map", "context", "task (examples)", "variant", "compute", "normalized [95% CI]", "KL",
                    "minus window-only", "minus published"], rows)]
    save("sibling-hybrid", {"contexts": contexts, "results": results,
                            "recipes": {d: vars(m.config.refresh) for d, m in maps.items()}},
         "\n".join(lines), data=data)
    return results


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", required=True, type=Path, help="folder holding the two map folders (pair_name)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048])
    args, models, tokenizer = siblings.parse_and_load(parser)
    maps = {d: KVMap.from_pretrained(args.maps / siblings.pair_name(d)) for d in siblings.DIRECTIONS}
    missing = [d for d, m in maps.items() if m.config.refresh is None]
    if missing:
        parser.error(f"the maps of {missing} record no refresh recipe: the hybrid splits that recipe's budget")
    run(models, tokenizer, maps, args.contexts, args.continuation_files, args.recall_cases)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
