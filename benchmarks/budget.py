"""The refresh budget curve of the sibling maps: how many context positions K the target recomputes after a
switch, against continuation and far-context recall retention and TTFT, both directions, on the "selection"
texts (they choose the recipe the published maps record; the goal table is scored on other texts).

Beside each ``mapped@16+rK`` (probe: the last 16 context tokens, then K positions recomputed in spans of 8):
- ``window@(32+K)``: the window-only control at equal target compute (sink + the last 32+K tokens);
- ``sparse@16+rK``: the same positions, computed by the target beside only the sink and the probe window, no
  mapped context: what the map contributes beyond choosing the positions.

    python -m benchmarks.budget --maps hub_cards --contexts 1024 2048 --budgets 0 16 32 64 128 256

Writes benchmarks/results/sibling-budget.json/.md/.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from peft_kvcache import KVMap
from peft_kvcache.calibration.retention import evaluate_retention
from peft_kvcache.maps.config import Refresh
from peft_kvcache.modeling.capture import run_with_cache

from . import siblings, ttft
from .common import RESULTS, save, start_run, table

PROBE, SPAN = 16, 8
RECALL_GOAL = 0.95


def curve(models: dict, tokenizer, maps: dict[str, KVMap], plan: dict[int, tuple[list[int], int, int]],
          repeats: int = 3, progress: bool = True) -> dict:
    """For each context length of ``plan`` (``context -> (budgets, continuation files, recall cases per kind and
    depth)``), every (direction, task): the report rows with every budget; and TTFT per budget."""
    out = {}
    for context, (budgets, continuation_files, recall_cases) in plan.items():
        task_sets = siblings.tasks(tokenizer, context, "selection", continuation_files, recall_cases)
        for direction, kv_map in maps.items():
            source, target = (models[n] for n in siblings.DIRECTIONS[direction])
            entry = out.setdefault(direction, {}).setdefault(str(context), {"tasks": {}})
            for task, (examples, continuation, names) in task_sets.items():
                report = evaluate_retention(source, target, kv_map, examples, context, continuation, windows=(1, PROBE),
                                            refresh=tuple(k for k in budgets if k), refresh_span=SPAN,
                                            sparse_control=True, progress=progress)
                entry["tasks"][task] = {**report.to_dict(), "texts": names}
            ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(context))
            timing = {}
            for k in budgets:  # the recipe path (cold sink) at each budget; the full prefill is timed once
                kv_map.config.refresh = Refresh(k, PROBE, SPAN) if k else None
                row = ttft.measure(lambda ctx: run_with_cache(source, ctx), target, kv_map, ids, repeats,
                                   full=timing.get("full"))
                timing.setdefault("full", row["full"])
                timing[str(k)] = row.get("recipe", row["cold"])
            kv_map.config.refresh = None
            entry["ttft"] = timing
    return out


def summary(results: dict) -> dict:
    """Per direction and context: per budget the mean normalized retention on continuation and on recall (all
    kinds and depths), the controls', and the TTFT speedup."""
    rows = {}
    for direction, contexts in results.items():
        for context, entry in contexts.items():
            table_rows = []
            for k in (int(b) for b in entry["ttft"] if b != "full"):
                mapped = f"mapped@{PROBE}+r{k}" if k else "mapped@1"
                control = f"window@{2 * PROBE + k}" if k else "window@1"
                sparse = f"sparse@{PROBE}+r{k}" if k else None

                def value(task_filter, variant):
                    vals = [next(r["normalized_retention"] for r in t["rows"] if r["variant"] == variant)
                            for name, t in entry["tasks"].items() if task_filter(name) and
                            any(r["variant"] == variant for r in t["rows"])]
                    return sum(vals) / len(vals) if vals else None

                cont, recall = (lambda n: n == "continuation"), (lambda n: n.startswith("recall"))
                ttft_k = entry["ttft"][str(k)]["median"]
                table_rows.append({
                    "budget": k, "share_of_context": k / int(context),
                    "continuation": value(cont, mapped), "continuation_window": value(cont, control),
                    "continuation_sparse": value(cont, sparse) if sparse else None,
                    "recall": value(recall, mapped), "recall_window": value(recall, control),
                    "recall_sparse": value(recall, sparse) if sparse else None,
                    "ttft_s": ttft_k, "speedup": entry["ttft"]["full"]["median"] / ttft_k})
            rows.setdefault(direction, {})[context] = table_rows
    return rows


def choose(rows: list[dict], cap: int = 128) -> int:
    """The recommended budget from the selection texts: the smallest K <= ``cap`` whose recall reaches
    `RECALL_GOAL` and whose continuation is within 0.02 of the best K <= ``cap``; else ``cap``."""
    candidates = [r for r in rows if r["budget"] <= cap]
    best = max(r["continuation"] for r in candidates)
    for r in sorted(candidates, key=lambda r: r["budget"]):
        if (r["recall"] or 0) >= RECALL_GOAL and r["continuation"] >= best - 0.02:
            return r["budget"]
    return cap


def markdown(rows: dict, chosen: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["# The refresh budget curve (selection texts)", "",
             "Normalized retention (mean over the task's rows), mapped@16+rK vs the window-only control at equal "
             "target compute and the sparse control (same positions, no mapped context); TTFT with a cold sink.", ""]
    for direction, contexts in rows.items():
        for context, table_rows in contexts.items():
            lines += [f"## {siblings.pair_name(direction)}, context {context}", "", table(
                ["K", "% of context", "continuation: mapped / window / sparse", "recall: mapped / window / sparse",
                 "TTFT", "speedup"],
                [[r["budget"], f"{100 * r['share_of_context']:.1f}%",
                  f"{fmt(r['continuation'])} / {fmt(r['continuation_window'])} / {fmt(r['continuation_sparse'])}",
                  f"{fmt(r['recall'])} / {fmt(r['recall_window'])} / {fmt(r['recall_sparse'])}",
                  f"{r['ttft_s']:.2f} s", f"{r['speedup']:.1f}x"] for r in table_rows]), ""]
        lines += [f"Recommended for {siblings.pair_name(direction)}: K = {chosen[direction]} (the rule: `choose`).", ""]
    return "\n".join(lines)


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(d, c) for d in rows for c in rows[d]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (direction, context) in zip(axes[0], panels):
        data = rows[direction][context]
        ks = [r["budget"] for r in data]
        for key, label, style in (("continuation", "continuation", "-o"), ("continuation_window", "window control",
                                  ":o"), ("recall", "recall", "-s"), ("recall_window", "recall: window control", ":s"),
                                  ("recall_sparse", "recall: sparse control", "--s")):
            ax.plot(ks, [r[key] if r[key] is not None else float("nan") for r in data], style, label=label)
        ax.set(xscale="symlog", xlabel="recomputed positions K", ylabel="normalized retention",
               title=f"{direction}, ctx {context}", ylim=(-0.1, 1.05))
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(models, tokenizer, maps, plan: dict[int, tuple[list[int], int, int]], repeats=3, progress=True) -> dict:
    """The curve, its summary and the recommended budget per direction (chosen at the first context of ``plan``)."""
    results = curve(models, tokenizer, maps, plan, repeats, progress)
    rows = summary(results)
    chosen = {d: choose(rows[d][str(next(iter(plan)))]) for d in rows}
    data = {f"{name}@{c}": t["texts"] for d in results.values() for c, e in d.items() for name, t in e["tasks"].items()}
    save("sibling-budget", {"results": results, "summary": rows, "recommended": chosen, "probe": PROBE, "span": SPAN},
         markdown(rows, chosen), data=data)
    plot(rows, RESULTS / "sibling-budget.png")
    return {"summary": rows, "recommended": chosen}


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", default=str(RESULTS.parents[1] / "hub_cards"))
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 32, 64, 128, 256])
    args, models, tokenizer = siblings.parse_and_load(parser)
    maps = {d: KVMap.from_pretrained(Path(args.maps) / siblings.pair_name(d)) for d in siblings.DIRECTIONS}
    run(models, tokenizer, maps, {c: (args.budgets, args.continuation_files, args.recall_cases) for c in args.contexts})


if __name__ == "__main__":
    main()
