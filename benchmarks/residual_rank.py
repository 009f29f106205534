"""Adapter maps as the identity plus a reduced-rank correction (issue 32: a switch at the decode-step ceiling).

1. Fit: every SmolLM2 adapter map, both directions, from one set of statistics (the published maps' fit data,
   `benchmarks.adapters.calibration_data`, checkpointed under ``--workdir`` so that every rank reads the same
   statistics), dense and at each of ``--ranks`` (`peft_kvcache.calibration.fit.reduce_rank`); no blend, so the
   fits differ by the rank alone. Held-out R^2 of the fit (the calibration's own held-out texts), mean over layers
   and heads.
2. Quality: KL(full || mapped) per example on the held-out examples of the published figures (evaluation-split
   files, 512 tokens of context, 64 of continuation: `benchmarks.adapters.held_out_examples`), and each rank minus
   dense, paired, with its 95% bootstrap interval.
3. Speed: the mapping alone of a ``--tokens`` source cache (random states: the time does not depend on their
   values), the dense map in the library's default matmul dtype against each factored map, median [min, max] of
   ``--repeats``, side by side in one run. Run it on a quiet machine: it times.

    python -m benchmarks.residual_rank                      # ~20 min on 2 cores
    python -m benchmarks.residual_rank --examples 2 --ranks 16 --repeats 2 --output /tmp/rank   # a smoke run

Writes benchmarks/results/residual-rank.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from peft_kvcache.calibration.loop import calibrate_adapters
from peft_kvcache.calibration.retention import evaluate_retention
from peft_kvcache.lab.provenance import write_results
from peft_kvcache.maps.adapter_maps import AdapterMaps
from peft_kvcache.maps.apply import default_compute_dtype, map_cache
from peft_kvcache.modeling.fixtures import load_model

from . import adapters
from .map_speed import random_inputs
from .common import ADAPTERS, RESULTS, SMOLLM, bootstrap_mean, start_run, table, timed

CONTEXT, CONTINUATION = 512, 64  # the adapter maps' published retention (scripts/publish.py)


def fit(model, tokenizer, ranks: list[int], workdir: Path) -> dict[int, AdapterMaps]:
    """Rank (0: dense) -> the adapter maps fitted at it, all from the statistics checkpointed in ``workdir``."""
    data, description = adapters.calibration_data(tokenizer)
    return {rank: calibrate_adapters(model, data, adapters=list(ADAPTERS), description=description,
                                     residual_rank=rank, checkpoint_dir=workdir, progress=rank == 0)
            for rank in [0, *ranks]}


def held_out_r2(maps: AdapterMaps) -> dict[str, dict[str, float]]:
    """Per map, the fit's held-out R^2 of keys and values, mean over target layers and heads."""
    out = {}
    for adapter, reverse, kv_map in maps.all():
        config = kv_map.config
        out[_label(adapter, reverse)] = {kind: float(torch.tensor(rows).mean()) for kind, rows in
                                         (("keys", config.key_r2), ("values", config.value_r2))}
    return out


def quality(model, base, tokenizer, fitted: dict[int, AdapterMaps], examples: int) -> dict:
    """KL(full || mapped) per held-out example, per map and rank, with each rank's paired difference to dense."""
    sequences, names = adapters.held_out_examples(tokenizer, CONTEXT, CONTINUATION, examples)
    kls: dict[str, dict[int, list[float]]] = {}
    for adapter in ADAPTERS:
        model.set_adapter(adapter)
        for reverse in (False, True):
            for rank, maps in fitted.items():
                kv_map = (maps.to_base if reverse else maps.to_adapter)[adapter]
                source, target = (model, base) if reverse else (base, model)
                report = evaluate_retention(source, target, kv_map, sequences, CONTEXT, CONTINUATION,
                                            window_control=False, naive_reuse=False, progress=False)
                kls.setdefault(_label(adapter, reverse), {})[rank] = [float(kl.mean())
                                                                      for kl in report.scores["mapped@1"].kl]
    rows = {label: {str(rank): {"kl": bootstrap_mean(values),
                                "minus_dense": bootstrap_mean([a - b for a, b in zip(values, by_rank[0])]),
                                "kls": values} for rank, values in by_rank.items()}
            for label, by_rank in kls.items()}
    return {"examples": len(sequences), "files": names, "rows": rows}


def speed(fitted: dict[int, AdapterMaps], tokens: int, repeats: int) -> list[dict]:
    """The mapping alone of ``tokens`` positions through base -> the first adapter's map at every rank, the ranks
    interleaved within each round (so that a slow spell of the machine falls on all of them)."""
    maps = {rank: m.to_adapter[ADAPTERS[0]] for rank, m in fitted.items()}
    inputs = random_inputs(maps[0], tokens)  # every rank's map has the dense map's shapes
    runs: dict[int, list[float]] = {rank: [] for rank in maps}
    for round_ in range(repeats + 1):  # the first round warms up
        for rank, kv_map in maps.items():
            seconds = timed(lambda m=kv_map: map_cache(m, *inputs), 1, 0)
            if round_:
                runs[rank] += seconds["runs"]
    return [{"rank": rank, "tokens": tokens, "multiply_adds_per_token": kv_map.multiply_adds_per_token,
             "matmul_dtype": str(default_compute_dtype(kv_map, torch.device("cpu"))).removeprefix("torch."),
             "seconds": {"median": statistics.median(runs[rank]), "min": min(runs[rank]), "max": max(runs[rank]),
                         "runs": runs[rank]}} for rank, kv_map in maps.items()]


def _label(adapter: str, reverse: bool) -> str:
    return f"{adapter} -> base" if reverse else f"base -> {adapter}"


def markdown(payload: dict) -> str:
    def interval(t: dict, digits: int = 5) -> str:
        return f"{t['mean']:+.{digits}f} [{t['low']:+.{digits}f}, {t['high']:+.{digits}f}]"

    ranks = [str(r) for r in payload["ranks"]]
    name = {"0": "dense"} | {r: f"rank {r}" for r in ranks[1:]}
    q = payload["quality"]
    lines = [f"# Adapter maps as the identity plus a reduced-rank correction ({payload['threads']} threads)", "",
             f"## Quality: KL(full || mapped), {q['examples']} held-out examples ({CONTEXT} + {CONTINUATION} tokens), "
             "mean; each rank minus dense, paired [95% bootstrap]", "",
             table(["map", *(name[r] for r in ranks), *(f"{name[r]} - dense" for r in ranks[1:])],
                   [[label, *(f"{row[r]['kl']['mean']:.5f}" for r in ranks),
                     *(interval(row[r]["minus_dense"]) for r in ranks[1:])] for label, row in q["rows"].items()]),
             "", "## The fit's held-out R^2 (calibration's held-out texts), mean over layers and heads: keys / values",
             "", table(["map", *(name[r] for r in ranks)],
                       [[label, *(f"{payload['r2'][r][label]['keys']:.4f} / {payload['r2'][r][label]['values']:.4f}"
                                  for r in ranks)] for label in q["rows"]]),
             "", f"## Speed: the mapping alone of {payload['speed'][0]['tokens']} tokens (base -> {ADAPTERS[0]}), "
                 "median [min, max]", "",
             table(["map", "matmul dtype", "multiply-adds per token", "seconds", "dense / this"],
                   [[name[str(r["rank"])], r["matmul_dtype"], f"{r['multiply_adds_per_token']:,}",
                     f"{r['seconds']['median'] * 1e3:.1f} [{r['seconds']['min'] * 1e3:.1f}, "
                     f"{r['seconds']['max'] * 1e3:.1f}] ms",
                     f"{payload['speed'][0]['seconds']['median'] / r['seconds']['median']:.2f}x"]
                    for r in payload["speed"]])]
    return "\n".join(lines)


def main(argv=None) -> int:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 48])
    parser.add_argument("--examples", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("runs/residual-rank"),
                        help="where the calibration statistics are checkpointed (reused by a run started again)")
    parser.add_argument("--output", type=Path, default=RESULTS / "residual-rank")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = adapters.load_smollm2(ADAPTERS)
    base, _ = load_model(SMOLLM)
    fitted = fit(model, tokenizer, args.ranks, args.workdir)
    payload = {"threads": args.threads, "ranks": [0, *args.ranks],
               "r2": {str(rank): held_out_r2(maps) for rank, maps in fitted.items()},
               "quality": quality(model, base, tokenizer, fitted, args.examples),
               "speed": speed(fitted, args.tokens, args.repeats)}
    text = markdown(payload)
    print(text)
    write_results(args.output, payload, text, data={
        "fit": fitted[0].to_adapter[ADAPTERS[0]].config.calibration.data.description,
        "quality": payload["quality"]["files"], "speed": "random source states (seed 0)"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
