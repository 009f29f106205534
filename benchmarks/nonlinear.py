"""Nonlinear heads against the linear map they extend, on the same data: the residual MLPs are trained on rows of
the map's own calibration texts (a uniform sample of ``max_rows`` train and held-out rows from the first
``--files`` of them, never more text than the linear fit saw) and both maps are scored on the same held-out
examples with paired 95% intervals: every pair, wins and losses.

    python -m benchmarks.nonlinear --maps hub_cards
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from peft_kvcache import KVMap
from peft_kvcache.calibration.nonlinear import fit_nonlinear_heads
from peft_kvcache.lab.corpus import stdlib_texts
from peft_kvcache.maps.config import Refresh
from peft_kvcache.maps.records import to_json

from .common import save, start_run, table
from .levers import Lever, score_variants

NONLINEAR = dict(r2_threshold=0.9, min_gain=0.01, hidden=64, steps=400, max_rows=4096)


def compare(name: str, source, target, kv_map: KVMap, texts: dict, tokenizer, task_sets: dict, context: int,
            refresh: Refresh | None, progress: bool = True) -> dict:
    """Fit MLP heads on ``texts`` (the first of the map's own calibration texts, as its fit saw them: every name
    must be one the map records) and score both maps on ``task_sets``."""
    recorded = kv_map.config.calibration.data.names()
    if list(texts) != recorded[: len(texts)]:
        raise ValueError(f"{name}: the MLP texts must be the first of the map's own calibration texts")
    nonlinear = fit_nonlinear_heads(kv_map, source, target, texts, tokenizer, progress=progress, **NONLINEAR)
    variants = {"linear": Lever(kv_map), "nonlinear": Lever(nonlinear)}
    if refresh is not None:
        variants.update({"linear + recipe": Lever(kv_map, refresh), "nonlinear + recipe": Lever(nonlinear, refresh)})
    out = {"map": name, "mlp_training_texts": list(texts), "nonlinear": to_json(nonlinear.config.nonlinear), "tasks": {}}
    for task, (examples, continuation, text_names) in task_sets.items():
        report = score_variants(source, target, variants, examples, context, continuation, progress)
        out["tasks"][task] = {**report.to_dict(), "texts": text_names,
                              "nonlinear_minus_linear": [report.paired_difference(f"nonlinear{s}", f"linear{s}", metric=m)
                                                         for s in ([""] + ([" + recipe"] if refresh else []))
                                                         for m in ("normalized", "kl")]}
    return out


def skipped(name: str, kv_map: KVMap) -> dict | None:
    """The result entry of a map nonlinear heads cannot extend (one whose layers read a shared basis), saying why;
    None where they can."""
    if not kv_map.config.basis_rank:
        return None
    return {"map": name, "skipped": f"its layers read a shared basis (basis_rank {kv_map.config.basis_rank}), and "
                                    "heads extend each layer's own weights: the recipes benchmark measures them as "
                                    "a lever on maps without one (benchmarks.lever_maps --nonlinear --on LABEL)"}


def markdown(results: list[dict]) -> str:
    rows = []
    for entry in (e for e in results if "skipped" not in e):
        kept = entry["nonlinear"]
        tried = kept.get("candidates", [])
        gains = [c["r2_mlp"] - c["r2_linear"] for c in tried]
        trials = f"{len(tried)}" + (f" (largest R^2 gain {max(gains):+.4f})" if gains else "")
        for task, report in entry["tasks"].items():
            for d in report["nonlinear_minus_linear"]:
                unit = "" if d["metric"] == "normalized" else " (KL)"
                rows.append([entry["map"], trials, f"{len(kept['keys'])} / {len(kept['values'])}", task,
                             f"{d['a'].removeprefix('nonlinear')or 'plain switch'}{unit}",
                             f"{d['difference']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"])
    notes = "".join(f"\n\n{e['map']}: not measured here; {e['skipped']}." for e in results if "skipped" in e)
    return ("# Nonlinear heads minus the linear map, same calibration data\n\nPaired 95% intervals; for KL below zero "
            "is better. Layers tried: those whose linear held-out R^2 is under the threshold; a head is kept where it "
            "raises that R^2 by the minimum gain (both in `options`).\n\n"
            + table(["map", "layers tried", "MLP layers kept keys / values", "task", "variant", "nonlinear - linear"],
                    rows)
            + notes)


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", default=str(Path(__file__).resolve().parents[1] / "hub_cards"))
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from . import siblings

    models, tokenizer = siblings.load_pair()
    task_sets = siblings.tasks(tokenizer, 1024, "selection", 16, 4)
    results = []
    for direction in siblings.DIRECTIONS:
        name = siblings.pair_name(direction)
        kv_map = KVMap.from_pretrained(Path(args.maps) / name)
        source, target = (models[n] for n in siblings.DIRECTIONS[direction])
        results.append(skipped(name, kv_map) or compare(name, source, target, kv_map, stdlib_texts(
            "calibration", args.files), tokenizer, task_sets, 1024, kv_map.config.refresh))
    save("nonlinear", {"options": NONLINEAR, "results": results}, markdown(results))


if __name__ == "__main__":
    main()
