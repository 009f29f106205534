"""How well the quality gate predicts measured retention, over every current map with both: the gate on its own
texts (`benchmarks.gates`), the retention on texts disjoint from them (the sibling maps of every scale on the
selection texts, `benchmarks.scaling`; the base <-> adapter maps on the final texts, `benchmarks.adapters`);
Pearson r with a Fisher-z 95% interval. Reads results files only; runs no model.

    python -m benchmarks.gate_correlation

Writes benchmarks/results/gate-correlation.json/.md.
"""

from __future__ import annotations

import argparse
import math
import statistics

from peft_kvcache.lab.provenance import lookup
from peft_kvcache.maps.adapter_maps import folder_name

from .adapters import PREFIX, results_stem
from .common import ADAPTERS, read_results, save, start_run, table


def pearson_interval(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """Pearson r of ``x`` and ``y`` and its 95% interval (Fisher z)."""
    r = statistics.correlation(x, y)
    z, se = math.atanh(max(min(r, 0.999999), -0.999999)), 1 / math.sqrt(max(len(x) - 3, 1))
    return r, math.tanh(z - 1.96 * se), math.tanh(z + 1.96 * se)


def run(sibling_gates: dict, scaling_curve: dict, adapter_gates: dict, adapter_retention: dict[bool, dict],
        adapters: tuple[str, ...] = ADAPTERS) -> dict:
    """The correlation from the results payloads: ``sibling_gates`` (sibling-gates.json's ``gates``),
    ``scaling_curve`` (sibling-scaling.json's ``curve``), ``adapter_gates`` (adapter-gates.json's ``gates``) and
    ``adapter_retention[reverse]`` (adapters.json / adapters-reverse.json); writes ``gate-correlation``."""
    points = []
    for direction, entry in scaling_curve.items():
        for p in entry["points"]:
            points.append({"map": f"{entry['map']} ({p['files']} files)", "measured_on": "sibling-scaling.json",
                           "predicted": sibling_gates[direction][str(p["files"])]["predicted_retention"],
                           "measured": p["normalized_retention"]})
    for adapter, reverse in ((a, r) for a in adapters for r in (False, True)):
        points.append({"map": folder_name(PREFIX, adapter, reverse), "measured_on": f"{results_stem(reverse)}.json",
                       "predicted": adapter_gates[folder_name(PREFIX, adapter, reverse)]["predicted_retention"],
                       "measured": lookup(adapter_retention[reverse],
                                          f"retention/{adapter}/rows/variant=mapped@1/normalized_retention")})
    r, low, high = pearson_interval([p["predicted"] for p in points], [p["measured"] for p in points])
    results = {"pearson_r": r, "low": low, "high": high, "maps": len(points), "points": points}
    save("gate-correlation", results, markdown(results))
    return results


def markdown(results: dict) -> str:
    points = results["points"]
    return (f"# The quality gate against measured retention\n\nPearson r = {results['pearson_r']:.3f} "
            f"[{results['low']:.3f}, {results['high']:.3f}] over {results['maps']} distinct maps (gate texts "
            "disjoint from the retention texts).\n\n" + table(
                ["map", "predicted", "measured", "measured in"],
                [[p["map"], f"{p['predicted']:.3f}", f"{p['measured']:.3f}", p["measured_on"]] for p in points]))


def from_results_files() -> dict:
    """`run` on the results files benchmarks/results/ holds now."""
    return run(read_results("sibling-gates")["gates"], read_results("sibling-scaling")["curve"],
               read_results("adapter-gates")["gates"], {r: read_results(results_stem(r)) for r in (False, True)})


def main() -> None:
    start_run()
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    from_results_files()


if __name__ == "__main__":
    main()
