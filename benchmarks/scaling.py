"""The data-scaling curve of the sibling maps (Qwen2.5-Coder 0.5B <-> 1.5B): held-out R² and the plain switch's
retention of maps fitted on nested calibration sets (the first N calibration-split files), scored on the
"selection" texts (never the published figures' texts). The published maps take the scale with the lowest KL
among those of at least `MIN_PUBLISHED_FILES` files.

    python -m benchmarks.scaling --maps runs/publish/siblings --scales 8 16 32 64 128

The maps come from `scripts/publish.py`'s capture (`scale_folder`). Writes benchmarks/results/sibling-scaling.json,
.md and .png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from peft_kvcache import KVMap

from . import siblings
from .common import RESULTS, save, start_run, table

SCALES = (8, 16, 32, 64, 128)  # calibration files of the curve's maps; the published maps use one of them
CONTEXT, FILES = 1024, 16  # the selection texts that choose the scale: context tokens, evaluation files
MIN_PUBLISHED_FILES = 64  # the published sibling maps are fitted on at least this many distinct files
STEM = "sibling-scaling"


def scale_folder(root: Path, scale: int, direction: str) -> Path:
    """The folder of the ``direction`` map fitted on the first ``scale`` calibration files."""
    return root / f"files-{scale}" / siblings.pair_name(direction)


def run(models: dict, tokenizer, maps: dict[str, dict[int, KVMap]], context: int = CONTEXT, files: int = FILES,
        progress: bool = True) -> dict:
    """The curve of ``maps[direction][scale]`` (every direction fitted at the same scales, with one config); writes
    `STEM` and its plot. Returns ``{"context", "curve", "setup"}`` (``setup``: what the markdown states)."""
    examples, continuation, names = siblings.tasks(tokenizer, context, "selection", files, 0)["continuation"]
    curve = {}
    for direction, by_scale in maps.items():
        labelled = {f"{scale} files": kv_map for scale, kv_map in by_scale.items()}
        source, target = (models[n] for n in siblings.DIRECTIONS[direction])
        report = siblings.score_maps(source, target, labelled, examples, context, continuation, progress)
        rows = {row["variant"]: row for row in report.rows()}
        points = []
        for scale, (label, kv_map) in zip(by_scale, labelled.items()):
            c = kv_map.config
            points.append({"files": scale, "train_tokens": c.calibration.train_tokens,
                           "heldout_tokens": c.calibration.heldout_tokens,
                           "key_r2": _mean(c.key_r2), "value_r2": _mean(c.value_r2), **rows[label]})
        eligible = [p for p in points if p["files"] >= MIN_PUBLISHED_FILES] or points
        chosen = min(eligible, key=lambda p: p["kl"])["files"]
        curve[direction] = {"map": siblings.pair_name(direction), "points": points, "chosen_files": chosen,
                            "full": rows["full"], "no_context": rows["no_context"]}
    options = next(iter(next(iter(maps.values())).values())).config.calibration.options
    results = {"context": context, "curve": curve, "setup": {
        "examples": len(examples), "continuation": continuation, "max_length": options.max_length,
        "heldout_every": round(1 / options.heldout_fraction)}}
    save(STEM, {"context": context, "curve": curve}, markdown(results), data={"selection_continuation": names})
    plot(curve, RESULTS / f"{STEM}.png")
    return results


def markdown(results: dict) -> str:
    setup, lines = results["setup"], []
    for entry in results["curve"].values():
        points = entry["points"]
        lines += [f"## {entry['map']}", "", table(
            ["files", "train / held-out tokens", "held-out R² keys / values", "normalized [95% CI]", "KL"],
            [[p["files"], f"{p['train_tokens']:,} / {p['heldout_tokens']:,}", f"{p['key_r2']:.3f} / {p['value_r2']:.3f}",
              f"{p['normalized_retention']:.3f} [{p['normalized_low']:.2f}, {p['normalized_high']:.2f}]",
              f"{p['kl']:.4f}"] for p in points]), "", f"Published: the {entry['chosen_files']}-file map (lowest KL "
              f"among maps of at least {MIN_PUBLISHED_FILES} files).", ""]
    header = (f"# Sibling maps: the data-scaling curve\n\nNested calibration sets (the first N calibration-split stdlib "
              f"files, the first {setup['max_length']} tokens of each, every {setup['heldout_every']}th "
              f"file held out whole); the plain switch scored on {setup['examples']} selection-role evaluation files, "
              f"context {results['context']}, continuation {setup['continuation']}.\n\n")
    return header + "\n".join(lines)


def plot(curve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for direction, entry in curve.items():
        files = [p["files"] for p in entry["points"]]
        left.plot(files, [p["key_r2"] for p in entry["points"]], marker="o", label=f"{direction}: keys")
        left.plot(files, [p["value_r2"] for p in entry["points"]], marker="s", ls="--", label=f"{direction}: values")
        right.plot(files, [p["kl"] for p in entry["points"]], marker="o", label=entry["map"])
    left.set(xscale="log", xlabel="calibration files", ylabel="held-out R² (mean)", title="fit")
    right.set(xscale="log", xlabel="calibration files", ylabel="KL(full ‖ mapped)", title="plain switch, selection texts")
    left.legend(fontsize="small")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mean(rows: list[list[float]]) -> float:
    values = [v for row in rows for v in row]
    return sum(values) / len(values)


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", type=Path, required=True, help="folder holding files-<N>/<pair map> folders")
    parser.add_argument("--scales", type=int, nargs="+", default=list(SCALES))
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--files", type=int, default=FILES, help="selection-role evaluation files scored")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    maps = {d: {s: KVMap.from_pretrained(scale_folder(args.maps, s, d)) for s in args.scales} for d in siblings.DIRECTIONS}
    models, tokenizer = siblings.load_pair()
    run(models, tokenizer, maps, args.context, args.files)


if __name__ == "__main__":
    main()
