"""The sibling levers' variants (benchmarks/levers.py): the hybrid recipe's positions (a recent window always, the
rest by attention), and variants that must equal the target's own prefill when they recompute every position."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids

from benchmarks.lever_maps import for_source
from benchmarks.levers import Lever, _positions, score_variants
from peft_kvcache.maps.config import CalibrationConfig, Refresh
from peft_kvcache.runtime.refresh import select_spans

CONTEXT, CONTINUATION = 40, 8


def test_the_hybrid_takes_the_recent_window_and_the_rest_by_attention():
    scores = torch.rand(4, 64, generator=torch.Generator().manual_seed(0))
    scores[-1, 10] = 5.0  # the last probe token reads position 10 sharply
    picked = _positions(scores, Lever(None, Refresh(tokens=24, probe_tokens=4, span=8), recent=16), sink=1)
    assert set(range(48, 64)) <= set(picked.tolist()) and picked.numel() == 24
    assert set(range(9, 17)) <= set(picked.tolist())  # the span starting one before the sharp read
    published = _positions(scores, Lever(None, Refresh(tokens=24, probe_tokens=4, span=8)), sink=1)
    assert torch.equal(published, select_spans(scores[-1], 24, 8, first=1))


def test_compute_is_what_the_control_at_equal_compute_keeps(sibling_map):
    assert Lever(sibling_map, Refresh(tokens=32, probe_tokens=16), recent=8).compute() == 64
    assert Lever(sibling_map, window=64).compute() == Lever(None, window=64).compute() == 64


@pytest.fixture(scope="module")
def scored(sibling_pair, sibling_map):
    source, target = sibling_pair
    sink, probe = sibling_map.config.sink_tokens, 8
    everything = CONTEXT - probe - sink  # every position between the sink and the probe
    variants = {"hybrid, all recent": Lever(sibling_map, Refresh(everything, probe, 8), recent=everything),
                "published": Lever(sibling_map, Refresh(8, probe, 8)),
                "mapped + all exact": Lever(sibling_map, window=CONTEXT - sink),
                "window-only @8": Lever(None, window=8), "plain switch": Lever(sibling_map)}
    return score_variants(source, target, variants, random_ids(3, CONTEXT + CONTINUATION, seed=5), CONTEXT,
                          CONTINUATION, progress=False, sink=sink)


@pytest.mark.parametrize("name", ["hybrid, all recent", "mapped + all exact"])
def test_a_variant_that_recomputes_every_position_is_the_full_prefill(scored, name):
    rows = {r["variant"]: r for r in scored.rows()}
    assert rows[name]["kl"] < 1e-4 and rows[name]["greedy_agreement"] == 1.0
    assert rows["plain switch"]["kl"] > 100 * max(rows[name]["kl"], 1e-7)  # the map's values differ on a random pair


def test_the_window_only_control_is_scored_without_the_map(scored):
    rows = {r["variant"]: r for r in scored.rows()}
    assert rows["window-only @8"]["kl"] != rows["published"]["kl"] and rows["window-only @8"]["kl"] > 0


def test_every_hybrid_variant_computes_at_most_the_recipes_budget(sibling_map):
    from benchmarks.hybrid import PUBLISHED, WINDOW, variants

    before, sibling_map.config.refresh = sibling_map.config.refresh, Refresh(tokens=32, probe_tokens=16, span=8)
    try:
        levers = variants(sibling_map)
    finally:
        sibling_map.config.refresh = before
    budget = levers[PUBLISHED].compute()
    assert budget == 64 and all(lever.compute() <= budget for lever in levers.values())
    assert [lever.compute() for name, lever in levers.items() if name.startswith(WINDOW)] == [budget]
    assert sorted(lever.recent for lever in levers.values() if lever.refresh is not None) == [0, 8, 16, 32]


def test_a_lever_asking_more_source_layers_than_a_direction_has_fits_all_of_them():
    assert for_source(CalibrationConfig(top_k=28), 24).top_k == 24  # going up: the 0.5B's 24 layers
    assert for_source(CalibrationConfig(top_k=28), 28).top_k == 28
    assert for_source(CalibrationConfig(top_k=4), 24).top_k == 4
    assert for_source(CalibrationConfig(top_k=56, joint_kinds=True), 24).top_k == 48  # keys and values of each
