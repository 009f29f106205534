"""The TTFT benchmark's table on tiny random models: the recipe's time is split into its passes and named with the
maps it ran on."""

from __future__ import annotations

from conftest import random_ids

from benchmarks import ttft
from peft_kvcache.maps.config import Refresh
from peft_kvcache.modeling.capture import run_with_cache


def test_the_recipe_row_splits_its_time_into_the_passes_it_ran(sibling_pair, sibling_map):
    source, target = sibling_pair
    recorded = sibling_map.config.refresh
    try:
        sibling_map.config.refresh = Refresh(6, 4)
        row = ttft.measure(lambda ids: run_with_cache(source, ids), target, sibling_map, random_ids(1, 40)[0][None],
                           repeats=2, maps="basis512")
    finally:
        sibling_map.config.refresh = recorded
    # named as the recipes benchmark names a default on a lever's maps, which the README matches it against
    assert row["recipe_name"] == f"basis512:{Refresh(6, 4).name}"
    stages = row["recipe_passes"]
    assert list(stages) == ["probe", "recompute", "first_token"] and all(s > 0 for s in stages.values())
    assert sum(stages.values()) < row["recipe"]["max"]  # parts of the timed runs, not extra time
    line = ttft.markdown("tiny", [row], {"bandwidth_bytes_per_s": 1e10, "matmul_flops_per_s": 1e11}).splitlines()[-1]
    parts = line.split(" | ")[7].removesuffix(" s").split(" / ")
    assert parts[:3] == [f"{s:.2f}" for s in stages.values()]
    assert parts[3] == f"{row['recipe']['median'] - sum(stages.values()):.2f}"
    # the warm switch over the target's own cache, read round by round (not a ratio of two medians)
    ratios = sorted(w / o for w, o in zip(row["warm"]["runs"], row["own"]["runs"], strict=True))
    assert len(ratios) == 2 and row["warm_to_own"]["median"] == (ratios[0] + ratios[1]) / 2
    assert line.split(" | ")[8] == f"{row['warm_to_own']['median']:.2f}x [{ratios[0]:.2f}, {ratios[1]:.2f}]"
    for name in ("cold", "warm", "recipe"):  # each speedup: the prefill over the switch in the same round
        speedups = sorted(f / s for f, s in zip(row["full"]["runs"], row[name]["runs"], strict=True))
        assert row[f"speedup_{name}"] == (speedups[0] + speedups[1]) / 2


def test_a_sweep_times_each_recipe_against_one_full_prefill(sibling_pair, sibling_map):
    source, target = sibling_pair
    row = ttft.sweep(lambda ids: run_with_cache(source, ids), target, sibling_map, random_ids(1, 48)[0][None],
                     ["hybrid@24", "refresh@36/p4"], repeats=2)
    hybrid, refresh = row["recipes"]["hybrid@24"], row["recipes"]["refresh@36/p4"]
    assert (hybrid["budget"], refresh["budget"]) == (24, 36)
    assert hybrid["passes"]["probe"] == 0 < refresh["passes"]["probe"]  # only the refresh runs a probe pass
    for r in (hybrid, refresh):  # paired by round: the prefill's time over the recipe's in the same round
        ratios = sorted(f / t for f, t in zip(row["full"]["runs"], r["timing"]["runs"]))
        assert len(ratios) == 2 and r["speedup"] == (ratios[0] + ratios[1]) / 2
        assert (r["speedup_min"], r["speedup_max"]) == (ratios[0], ratios[1])
    lines = ttft.sweep_markdown("tiny", {"rows": [row]}).splitlines()
    assert [line.split(" | ")[2] for line in lines[-2:]] == ["hybrid@24", "refresh@36/p4"]
    earlier = {"provenance": {"date": "2026-12-01T00:00:00", "commit": "abcdef0123"}, "rows": [row]}
    text = ttft.sweep_markdown("tiny", {"rows": [row], "earlier_runs": [earlier]})
    assert "An earlier run of the same maps (2026-12-01T00:00:00, commit abcdef0" in text
    assert text.count("| refresh@36/p4 |") == 2  # each run's table
