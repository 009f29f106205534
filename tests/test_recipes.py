"""The sibling recipes' runner (benchmarks/recipes.py) and report (benchmarks/recipe_report.py): each variant computes
what its name says, the published split is the library's refresh, records resume, and the bootstrap resamples
whole files."""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections import defaultdict
from dataclasses import replace

import pytest
import torch
from conftest import make_map, random_ids

from benchmarks import (pass_store, recipe_budget, recipe_examples, recipe_records, recipe_report, recipe_scores,
                        recipes)
from benchmarks.common import map_fingerprint, map_fingerprints
from benchmarks.pass_store import PassStore, full_pass
from benchmarks.recipe_examples import Example
from benchmarks.recipes import PROBE, ExampleRun, Variant
from peft_kvcache import MappedCache
from peft_kvcache.calibration.retention import cached_logits, window_logits
from peft_kvcache.errors import CacheMismatchError, RecordError
from peft_kvcache.maps.config import Refresh, parameter_count

CONTEXT, CONTINUATION = 56, 8


@pytest.fixture(scope="module")
def example_run(sibling_pair, sibling_map):
    source, target = sibling_pair
    ids = random_ids(1, CONTEXT + CONTINUATION, seed=3)[0]
    example = Example("continuation/a.py@0", "a.py", "continuation", ids, CONTINUATION)
    full, own = full_pass(target, ids, CONTINUATION)
    _, source_kv = full_pass(source, ids, CONTINUATION)
    return ExampleRun(example, target, own, full, source_kv.prefix(CONTEXT), {"published": sibling_map})


def test_the_published_split_is_the_librarys_refresh(example_run, sibling_map):
    budget = 2 * PROBE + 8
    ids = example_run.example.ids
    cache = MappedCache.from_source(example_run.source_kv, sibling_map, example_run.target, input_ids=ids[None, :CONTEXT],
                                    refresh_tokens=Refresh(8, PROBE, 8), verify_models=False)
    cache.truncate(CONTEXT - 1)
    library = cached_logits(example_run.target, cache, ids, CONTEXT, 1)
    assert torch.allclose(example_run.logits(Variant("refresh", budget, budget - 2 * PROBE)), library, atol=1e-5)


def test_the_target_own_keys_and_values_in_the_mapped_prefix_are_the_full_prefill(example_run):
    both = example_run.logits(Variant("hybrid", 8, oracle="keys+values"))
    assert torch.allclose(both, example_run.full, atol=1e-4)
    plain = example_run.logits(Variant("hybrid", 8))
    for oracle in ("keys", "values"):  # each swap alone changes the answer, and neither is the whole prefill
        one = example_run.logits(Variant("hybrid", 8, oracle=oracle))
        assert not torch.allclose(one, plain, atol=1e-4) and not torch.allclose(one, example_run.full, atol=1e-4)


def test_a_hybrid_computing_the_whole_context_is_the_full_prefill(example_run, sibling_map):
    whole = Variant("hybrid", CONTEXT - sibling_map.config.sink_tokens)
    assert torch.allclose(example_run.logits(whole), example_run.full, atol=1e-4)


def test_index_keeps_the_picked_positions_and_the_recent_window_without_the_mapped_middle(example_run, sibling_map):
    variant = Variant("index", 48, 16)
    cache = example_run.mapped("published")
    cache.truncate(CONTEXT - PROBE)
    picked = example_run.picked(variant, cache)
    assert picked.numel() == 16 and int(picked.max()) < CONTEXT - variant.recent
    expected = window_logits(example_run.target, example_run.example.ids, CONTEXT, variant.recent,
                             sibling_map.config.sink_tokens, also=picked)
    assert torch.equal(example_run.logits(variant), expected)
    refreshed = example_run.logits(Variant("refresh", 48, 16))  # the same positions, over the mapped middle
    assert not torch.allclose(refreshed, expected, atol=1e-4)


def test_compute_counts_the_probe_once_and_every_recipe_at_a_budget_spends_it():
    budget = 160
    assert Variant("refresh", budget, budget - 2 * PROBE).recent == PROBE  # the published recipe: the probe only
    for v in recipes.variants_for(budget, levers=("l2048",)):
        if v.kind in ("refresh", "index"):
            assert v.picked + v.recent + PROBE == v.budget == v.compute and v.recent >= PROBE
    names = [v.name for v in recipes.variants_for(budget, levers=("l2048",))]
    assert len(names) == len(set(names)) and "refresh@160/p128" in names and "l2048:hybrid@160" in names
    assert "window@160" in names and "hybrid@160+true-keys" in names


def test_final_texts_measure_the_chosen_default_beside_its_controls(tmp_path, monkeypatch):
    for name in ("hybrid@160", "refresh@160/p20", "index@160/p40", "basis:refresh@160/p20"):
        assert Variant.recipe(name).name == name and Variant.recipe(name).compute == 160
    assert Variant.recipe("basis:index@160/p40").maps == "basis" and Variant.recipe("hybrid@160").maps == "published"
    names = [v.name for v in recipes.variants_for(160, final=True, chosen="index@160/p40")]
    assert names == ["full", "no_context", "plain", "window@160", "hybrid@160", "refresh@160/p128", "index@160/p40",
                     "hybrid@160+true-keys", "hybrid@160+true-values"]
    with_lever = [v.name for v in recipes.variants_for(160, ("attn", "l2048"), final=True, chosen="attn:index@160/p40")]
    assert with_lever == names[:6] + ["attn:index@160/p40"] + names[7:] + ["attn:hybrid@160", "attn:refresh@160/p128"]
    assert recipes.variants_for(160, ("attn",), final=True, chosen="index@160/p40") == \
        recipes.variants_for(160, final=True, chosen="index@160/p40")  # a lever holding no default: none of its rows
    assert len(recipes.variants_for(160)) > 2 * len(names)  # selection texts: the whole grid
    assert len(recipes.variants_for(160, final=True)) == len(names) - 1  # no default chosen: the controls still run
    monkeypatch.setattr(recipes, "RESULTS", tmp_path)
    with pytest.raises(RecordError, match="selection"):
        recipes.chosen_defaults()
    (tmp_path / "sibling-recipes-selection-2048.json").write_text(
        '{"directions": {"up": {"choice": {"default": "index@160/p40"}}, "down": {"choice": {"default": null}}}}')
    assert recipes.chosen_defaults() == {"up": "index@160/p40"}  # none qualified going down: nothing to report
    with pytest.raises(RecordError, match="chose no default in any direction"):  # before any model, any record
        recipes.run({}, None, {"published": {}}, "final", 2048, 1, 1, 0, directions=("down",), progress=False,
                    records=tmp_path / "final.jsonl")
    (tmp_path / "sibling-recipes-selection-2048.json").write_text(
        '{"directions": {"up": {"choice": {"default": "basis:index@160/p40"}}}}')
    with pytest.raises(RecordError, match="--lever"):  # the default's maps were not given: refused before any model
        recipes.run({}, None, {"published": {}}, "final", 2048, 1, 1, 0, directions=("up",), progress=False,
                    records=tmp_path / "final.jsonl")
    assert not (tmp_path / "final.jsonl").exists()


def test_records_resume_where_a_run_stopped(tmp_path, sibling_pair, sibling_map, monkeypatch):
    source, target = sibling_pair
    monkeypatch.setattr(sibling_map.config, "refresh", Refresh(8, PROBE, 8))
    for direction in ("up", "down"):
        sibling_map.save_pretrained(tmp_path / "maps" / recipes.siblings.pair_name(direction), chart=False)
    ids = random_ids(3, CONTEXT + CONTINUATION, seed=9)
    items = [Example(f"continuation/{i}.py@0", f"{i}.py", "continuation", x, CONTINUATION) for i, x in enumerate(ids)]
    monkeypatch.setattr(recipes, "examples", lambda *args: items)
    plan = [Variant("full"), Variant("no_context"), Variant("window", 40), Variant("hybrid", 40)]
    asked = []  # the budgets the plan was asked for
    monkeypatch.setattr(recipes, "variants_for",
                        lambda budget, levers=(), final=False, chosen=None: asked.append(budget) or plan)
    path = tmp_path / "records.jsonl"
    maps = {"published": {d: tmp_path / "maps" / recipes.siblings.pair_name(d) for d in ("up", "down")}}
    run = lambda: recipes.run({"small": source, "large": target}, None, maps, "selection", CONTEXT, 3, 1, 0,
                              directions=("up",), progress=False, records=path,
                              passes=PassStore(tmp_path / "passes"))
    run()
    first = recipes.read_records(path)
    assert len(first) == 3 * len(plan) and {r["map"] for r in first if r["variant"] == "hybrid@40"} != {None}
    entry = json.loads(path.with_name("runs.jsonl").read_text().splitlines()[-1])
    assert entry["planned"] == {"continuation": 3}  # what a report counts complete: every planned example
    assert entry["budgets"] == {"up": sibling_map.config.refresh.compute}  # no budgets given: the published recipe's
    assert entry["budget_sources"]["up"]["from"] == "the published recipe"
    facts = entry["map_sets"]["published"]["up"]
    assert facts["fingerprint"] == first[-1]["map"] and facts["parameters"] == parameter_count(sibling_map.config)
    assert facts["options"] == {}  # the sibling fixture's map is fitted with the default options
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])  # a stop mid-write
    with open(path.with_name("runs.jsonl"), "a") as out:  # of both files
        out.write(json.dumps(entry)[:40])
    computed = pass_store.full_pass
    monkeypatch.setattr(pass_store, "full_pass", lambda *args: pytest.fail("a kept pass was computed again"))
    run()
    assert json.loads(path.with_name("runs.jsonl").read_text().splitlines()[-1])["planned"] == {"continuation": 3}
    monkeypatch.setattr(pass_store, "full_pass", computed)
    again = recipes.read_records(path)
    assert len(again) == 3 * len(plan)
    # recomputed exactly as before, from the passes the first run kept
    assert [(r["correct"], r["kl"]) for r in again] == [(r["correct"], r["kl"]) for r in first]
    assert {r["digest"] for r in again if r["example"] == items[0].id} == {items[0].digest}
    items[0] = replace(items[0], ids=random_ids(1, CONTEXT + CONTINUATION, seed=10)[0])  # the text changed under its id
    runs_before = path.with_name("runs.jsonl").read_text()
    with pytest.raises(RecordError, match="other tokens"):
        run()
    assert recipes.read_records(path) == again  # refused before any record, and before it recorded a run
    assert path.with_name("runs.jsonl").read_text() == runs_before
    items[0] = replace(items[0], ids=ids[0])
    for given, budget, said in (({"budget": 40, "from": "the TTFT sweep"}, 40, "the TTFT sweep"),
                                ({"budget": None, "sweep": "ttft-x-sweep"}, sibling_map.config.refresh.compute,
                                 "the published recipe (no swept budget meets the TTFT goals)")):
        recipes.run({"small": source, "large": target}, None, maps, "selection", CONTEXT, 3, 1, 0, directions=("up",),
                    progress=False, records=path, budgets={"up": given})
        entry = json.loads(path.with_name("runs.jsonl").read_text().splitlines()[-1])
        assert asked[-1] == entry["budgets"]["up"] == budget and entry["budget_sources"]["up"]["from"] == said


def test_a_kept_pass_is_read_back_bit_for_bit_and_never_for_other_weights_or_text(tmp_path, sibling_pair,
                                                                                 monkeypatch):
    source, target = sibling_pair
    ids = random_ids(2, CONTEXT + CONTINUATION, seed=5)
    store = PassStore(tmp_path)
    logits, kv = store.full_pass(target, ids[0], CONTINUATION)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    computed = pass_store.full_pass
    monkeypatch.setattr(pass_store, "full_pass", lambda *args: pytest.fail("a kept pass was computed again"))
    again, kv_again = store.full_pass(target, ids[0], CONTINUATION)
    assert torch.equal(again, logits) and all(torch.equal(a, b) for a, b in zip(kv_again.keys + kv_again.values,
                                                                                 kv.keys + kv.values))
    assert len(kv_again.keys) == len(kv.keys)
    monkeypatch.setattr(pass_store, "full_pass", computed)
    store.full_pass(target, ids[1], CONTINUATION)  # other text
    store.full_pass(source, ids[0], CONTINUATION)  # other weights
    store.full_pass(target, ids[0], CONTINUATION - 1)  # another continuation
    assert len(list(tmp_path.glob("*.safetensors"))) == 4
    other = copy.deepcopy(target)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    keys = {store.key(m, ids[0], CONTINUATION) for m in (target, other, copy.deepcopy(target).to(torch.bfloat16))}
    assert len(keys) == 3  # other weights of the same architecture, another dtype
    files[0].write_bytes(files[0].read_bytes()[:100])  # a torn file: computed again and replaced
    torn, _ = store.full_pass(target, ids[0], CONTINUATION)
    assert torch.equal(torn, logits) and files[0].stat().st_size > 100
    full = PassStore(tmp_path, limit_bytes=sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")))
    kept, _ = full.full_pass(target, ids[1], CONTINUATION - 1)  # at its limit: computed, not kept
    assert len(list(tmp_path.glob("*.safetensors"))) == 4 and kept.shape[0] == CONTINUATION - 1
    crowded = PassStore(tmp_path, min_free_bytes=shutil.disk_usage(tmp_path).free)  # any pass would cross the floor
    kept, _ = crowded.full_pass(target, ids[1], CONTINUATION - 1)
    assert len(list(tmp_path.glob("*.safetensors"))) == 4 and kept.shape[0] == CONTINUATION - 1


def test_the_bootstrap_resamples_whole_files():
    weights = recipe_scores.cluster_weights(["a", "a", "b", "c", "c", "c"], count=200)
    assert torch.equal(weights[:, 0], weights[:, 1]) and torch.equal(weights[:, 3], weights[:, 5])
    assert torch.equal(weights[:, [0, 2, 3]].sum(1), torch.full((200,), 3.0))  # three files drawn per resample
    assert not torch.equal(weights[:, 0], weights[:, 2])


def _scores(gaps: dict[str, float]) -> recipe_scores.Scores:
    """One example per file, full - no context = ``gaps[file]``, the variant and the control halfway and a quarter."""
    scores = recipe_scores.Scores(defaultdict(dict), defaultdict(dict), {})
    for file, gap in gaps.items():
        for name, accuracy in (("full", 0.2 + gap), ("no_context", 0.2), ("mapped", 0.2 + gap / 2),
                               ("window", 0.2 + gap / 4)):
            scores.accuracy[name][file], scores.kl[name][file] = accuracy, 0.0
        scores.files[file] = file
    return scores


def test_resamples_where_the_context_does_not_help_the_full_prefill_void_the_interval_instead_of_dropping_out():
    healthy = recipe_scores.summary(_scores({f"f{i}": 0.3 for i in range(8)}), "mapped", "window")
    assert healthy["degenerate_resamples"] == 0 and healthy["interval"] == pytest.approx([0.5, 0.5])
    # two files of eight without any gap: a resample drawing only those (1 in 4^8) is rare; half of them, often
    shaky = recipe_scores.summary(_scores({**{f"f{i}": 0.3 for i in range(4)}, **{f"z{i}": 0.0 for i in range(4)}}),
                                  "mapped", "window")
    assert shaky["degenerate_resamples"] > 0
    rare = recipe_scores.summary(_scores({**{f"f{i}": 0.3 for i in range(6)}, "z0": 0.0, "z1": 0.0}), "mapped", "window")
    assert rare["degenerate_resamples"] <= recipe_scores.DEGENERATE_SHARE * recipe_scores.BOOTSTRAP
    assert rare["interval"] == pytest.approx([0.5, 0.5])  # the ratio holds wherever the gap does
    tiny = _scores({f"z{i}": 0.001 for i in range(8)})  # a gap of a tenth of a point: any ratio is noise
    tiny.accuracy["mapped"] = {e: 0.21 for e in tiny.files}  # ten times the gap, a finite and meaningless 10.0
    none = recipe_scores.summary(tiny, "mapped", "window")
    assert none["degenerate_resamples"] == recipe_scores.BOOTSTRAP and all(map(math.isnan, none["interval"]))
    assert all(map(math.isnan, none["minus_control_interval"]))
    assert math.isnan(none["normalized"]) and math.isnan(none["minus_control"])  # the point estimate too
    few = recipe_scores.summary(_scores({f"f{i}": 0.3 for i in range(recipe_scores.MIN_FILES - 1)}), "mapped", "window")
    assert few["normalized"] == pytest.approx(0.5)  # the point estimate stands; the interval does not
    assert all(map(math.isnan, few["interval"] + few["minus_control_interval"]))
    enough = recipe_scores.summary(_scores({f"f{i}": 0.3 for i in range(recipe_scores.MIN_FILES)}), "mapped", "window")
    assert enough["interval"] == pytest.approx([0.5, 0.5])


def _row(kind: str, compute: int, continuation: float, interval: tuple, recall: float, examples=(40, 48)) -> dict:
    return {"kind": kind, "compute": compute,
            "continuation": {"examples": examples[0], "normalized": continuation, "minus_control": sum(interval) / 2,
                             "minus_control_interval": list(interval)},
            recipe_scores.RECALL: {"examples": examples[1], "normalized": recall}}


def test_the_default_is_the_best_recipe_not_below_the_control_that_keeps_recall():
    rows = {"hybrid@160": _row("hybrid", 160, 0.80, (0.01, 0.1), 0.40),  # best continuation, loses recall
            "refresh@160/p64": _row("refresh", 160, 0.75, (-0.02, 0.05), 0.97),
            "refresh@160/p128": _row("refresh", 160, 0.70, (0.00, 0.08), 1.00),
            "index@160/p32": _row("index", 160, 0.78, (-0.12, -0.01), 0.99),  # below the control
            "hybrid@160+true-keys": _row("hybrid", 160, 0.95, (0.1, 0.3), 1.0),  # an oracle is no recipe
            "hybrid@320": _row("hybrid", 320, 0.90, (0.1, 0.2), 1.0),  # another budget
            "attn:refresh@160/p64": {**_row("refresh", 160, 0.9, (0.1, 0.2), 1.0), "maps": "attn"},  # a lever's maps
            "window@160": _row("window", 160, 0.72, (0, 0), 0.0),  # the control, scored on 40 / 48 examples
            "refresh@160/p96": _row("refresh", 160, 0.85, (0.05, 0.2), 1.0, examples=(39, 48))}  # one window short
    choice = recipe_report.choose_default(rows, 160)  # no cost limit: a lever's maps do not compete
    assert set(choice["candidates"]) == {"hybrid@160", "refresh@160/p64", "refresh@160/p128", "index@160/p32",
                                         "refresh@160/p96"}
    assert not choice["candidates"]["refresh@160/p96"]["complete"]  # best on its examples, not yet on all of them
    assert choice["default"] is None and choice["waiting"] == ["refresh@160/p96"]  # no runner-up meanwhile
    rows["refresh@160/p96"]["continuation"]["examples"] = 40
    assert recipe_report.choose_default(rows, 160)["default"] == "refresh@160/p96"
    del rows["refresh@160/p96"]
    choice = recipe_report.choose_default(rows, 160)
    assert choice["default"] == "refresh@160/p64" and choice["maps"] == "published" and choice["waiting"] == []
    # a run stopped halfway leaves the control as short as every candidate: its plan says they all wait
    choice = recipe_report.choose_default(rows, 160, planned={"continuation": 48, recipe_scores.RECALL: 48})
    assert choice["default"] is None and "refresh@160/p64" in choice["waiting"]
    assert recipe_report.choose_default(rows, 160, planned={"continuation": 40, recipe_scores.RECALL: 48})[
        "default"] == "refresh@160/p64"
    runs = [{"planned": {"continuation": 9}, "budgets": {"up": 160, "down": 64}},
            {"planned": {"continuation": 40, "recall-code-top": 24, "recall-prose-end": 24}, "budgets": {"up": 160}},
            {}]
    assert recipe_report.planned_examples(runs, "up") == \
        {"continuation": 40, recipe_scores.RECALL: 48}  # the latest run that recorded a plan, recall pooled
    assert recipe_report.planned_examples(runs, "down") == {"continuation": 9, recipe_scores.RECALL: 0}  # its own
    assert recipe_report.planned_examples([{}], "up") is None
    # with a limit, a lever's maps compete where their multiply-adds per token stay within it
    costs = {"published": 100, "attn": 400}
    choice = recipe_report.choose_default(rows, 160, costs, cost_limit=400)
    assert choice["default"] == "attn:refresh@160/p64" and choice["maps"] == "attn"
    assert choice["candidates"]["attn:refresh@160/p64"]["multiply_adds_per_token"] == 400
    choice = recipe_report.choose_default(rows, 160, costs, cost_limit=399)
    assert choice["default"] == "refresh@160/p64" and not choice["candidates"]["attn:refresh@160/p64"]["within_cost"]
    assert recipe_report.choose_default(rows, 160, {"published": 100}, cost_limit=400)["default"] == \
        "refresh@160/p64"  # maps whose cost nobody recorded never win
    # a lever scored on fewer examples blocks the choice, unless its maps are gone (nothing can complete it)
    rows["top8:refresh@160/p64"] = {**_row("refresh", 160, 0.99, (0.2, 0.3), 1.0, examples=(40, 20)), "maps": "top8"}
    costs["top8"] = 100
    assert recipe_report.choose_default(rows, 160, costs, cost_limit=400)["waiting"] == ["top8:refresh@160/p64"]
    choice = recipe_report.choose_default(rows, 160, costs, cost_limit=400, gone=frozenset({"top8"}))
    assert choice["default"] == "attn:refresh@160/p64" and choice["waiting"] == []
    assert choice["candidates"]["top8:refresh@160/p64"]["maps_gone"]
    rows["top8:refresh@160/p64"]["continuation"]["examples"] = 40  # complete and best, but nothing can publish it
    rows["top8:refresh@160/p64"][recipe_scores.RECALL]["examples"] = 48
    choice = recipe_report.choose_default(rows, 160, costs, cost_limit=400, gone=frozenset({"top8"}))
    assert choice["default"] is None and choice["gone_best"] == "top8:refresh@160/p64"  # never the runner-up instead
    assert not choice["candidates"]["top8:refresh@160/p64"]["qualifies"]
    rows["top8:refresh@160/p64"]["continuation"]["normalized"] = 0.5  # gone, and beaten: the best still wins
    choice = recipe_report.choose_default(rows, 160, costs, cost_limit=400, gone=frozenset({"top8"}))
    assert choice["default"] == "attn:refresh@160/p64" and choice["gone_best"] is None
    del rows["top8:refresh@160/p64"]
    unscored = {name: {k: v for k, v in row.items() if k != recipe_scores.RECALL} for name, row in rows.items()}
    assert recipe_report.choose_default(unscored, 160)["default"] is None  # recall never scored: none keeps it
    rows["refresh@160/p64"]["continuation"]["minus_control_interval"] = [-0.2, -0.01]
    assert recipe_report.choose_default(rows, 160)["default"] == "refresh@160/p128"


def test_a_prefill_costs_its_layers_linear_weights_and_its_attention_per_token():
    from transformers import AutoModelForCausalLM, Qwen2Config

    from benchmarks.ttft import prefill_multiply_adds_per_token

    config = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    model = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert prefill_multiply_adds_per_token(config, 0) == linear  # one multiply-add per weight and token
    # each token's query scores and weighs length / 2 positions on average: length * query width per layer
    assert prefill_multiply_adds_per_token(config, 100) - linear == 3 * 64 * 100


def test_the_trade_off_runs_from_the_window_to_more_picked_positions_per_budget(tmp_path):
    rows = {"window@160": _row("window", 160, 0.84, (0, 0), 0.10),
            "index@160/p80": _row("index", 160, 0.80, (-0.1, 0.0), 0.97),
            "index@160/p20": _row("index", 160, 0.89, (-0.02, 0.2), 0.93),
            "refresh@160/p20": _row("refresh", 160, 0.79, (-0.1, 0.0), 0.95),
            "hybrid@160": _row("hybrid", 160, 0.74, (-0.2, 0.1), 0.04),
            "hybrid@160+true-keys": _row("hybrid", 160, 0.77, (-0.1, 0.1), 0.98),  # an oracle: no point
            "index@320/p80": _row("index", 320, 0.88, (-0.05, 0.05), 0.97),
            "top4:refresh@160/p20": {**_row("refresh", 160, 0.9, (0.0, 0.1), 0.99), "maps": "top4"}}
    for name, row in rows.items():
        row["budget"] = row["compute"]
    curve = recipe_report.trade_off(rows)
    assert [p["variant"] for p in curve["160"]["top4:refresh"]] == ["window@160", "top4:refresh@160/p20"]
    assert [p["variant"] for p in curve["160"]["index"]] == ["window@160", "index@160/p20", "index@160/p80"]
    assert [p["picked"] for p in curve["160"]["refresh"]] == [0, 20]
    assert [p["variant"] for p in curve["160"]["hybrid"]] == ["hybrid@160"]
    assert [p["variant"] for p in curve["320"]["index"]] == ["index@320/p80"]  # no window row at 320 here
    assert curve["160"]["index"][1] == {"variant": "index@160/p20", "picked": 20, "continuation": 0.89,
                                        "recall": 0.93}
    payload = {"role": "selection", "context": 2048,
               "directions": {"up": {"pair": "up-pair", "trade_off": curve}, "down": {"pair": "p", "trade_off": {}}}}
    recipe_report.plot_trade_off(payload, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000


@pytest.mark.parametrize("name", ["hybrid@24", "refresh@48/p8", "refresh@40/p8", "index@48/p8", "index@40/p8"])
def test_a_named_recipe_in_the_library_is_the_benchmarks_variant(example_run, sibling_map, name):
    """What `from_source` runs for a recipe name is what the recipes benchmark measured under that name."""
    ids = example_run.example.ids
    policy = Refresh.named(name)
    cache = MappedCache.from_source(example_run.source_kv, sibling_map, example_run.target, input_ids=ids[None, :CONTEXT],
                                    refresh_tokens=name, verify_models=False)
    held = cache.layers[0].keys.shape[2]
    assert held == (CONTEXT if policy.mapped_middle else sibling_map.config.sink_tokens + policy.compute - PROBE)
    assert cache.get_seq_length() == int(cache.next_positions[0]) == CONTEXT  # the context it stands for
    assert cache.dropped_positions == CONTEXT - held
    if policy.tokens:  # picked past the sink, before the recent window
        picked = cache.refresh.positions
        assert picked.numel() == policy.tokens and int(picked.min()) >= sibling_map.config.sink_tokens
        assert int(picked.max()) < CONTEXT - PROBE - policy.recent_tokens
    kind, rest = name.split("@")
    budget, _, picked = rest.partition("/p")
    benchmark = example_run.logits(Variant(kind, int(budget), int(picked or 0)))
    # generate() slices the prompt and numbers new positions by the cache's length, whatever the cache holds
    out = example_run.target.generate(ids[None, :CONTEXT + 1], cache=cache.copy(), max_new_tokens=1,
                                      do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert torch.allclose(out.scores[0][0], benchmark[1], atol=1e-4)
    cache.truncate(CONTEXT - 1)  # the last context token's logits predict the first label: run it again
    with torch.no_grad():  # no positions nor mask given: the model takes both from the cache, over 8 new tokens
        library = example_run.target(input_ids=ids[None, CONTEXT - 1:-1], cache=cache).logits[0]
    assert torch.allclose(library, benchmark, atol=1e-4)


def test_recipe_names_are_checked_and_name_what_they_compute():
    assert Refresh.named("refresh@64/p32") == Refresh(32)  # the published recipe's form
    for name in ("hybrid@160", "refresh@160/p20", "index@160/p20"):
        assert Refresh.named(name).name == name and Refresh.named(name).compute == 160
    for bad in ("index@160", "hybrid@16", "window@160", "refresh@40/p20", "refresh@x/p1"):
        with pytest.raises(RecordError, match="recipe"):
            Refresh.named(bad)


def test_positions_are_picked_before_the_recent_window_even_where_attention_peaks_inside_it(
        example_run, sibling_map, monkeypatch):
    from peft_kvcache.runtime import refresh

    policy = Refresh.named("refresh@56/p8")  # a recent window of 16 before the probe: positions 24..39
    window_start = CONTEXT - PROBE - policy.recent_tokens

    real_probe_pass = refresh.probe_pass

    def peaked(target, cache, probe_ids, offset=0, sink_ids=None):
        probed = real_probe_pass(target, cache, probe_ids, offset, sink_ids=sink_ids)  # the pass runs (the sink)
        scores = torch.zeros(cache.get_seq_length())
        scores[window_start:] = 1.0  # the probe attends only to its recent window
        scores[8:16] = 0.5
        return replace(probed, scores=scores)

    monkeypatch.setattr(refresh, "probe_pass", peaked)
    ids = example_run.example.ids
    cache = MappedCache.from_source(example_run.source_kv, sibling_map, example_run.target, input_ids=ids[None, :CONTEXT],
                                    refresh_tokens=policy, verify_models=False)
    picked = cache.refresh.positions
    assert picked.numel() == 8 and int(picked.max()) < window_start and len(set(picked.tolist()) & set(range(8, 16))) >= 4


def test_each_direction_has_its_own_recipe_budget():
    def record(direction, variant, budget):
        return {"direction": direction, "variant": variant, "budget": budget, "maps": "published"}

    records = [record("up", f"refresh@160/p{p}", 160) for p in (20, 40, 80)] + [record("up", "refresh@80/p20", 80)]
    records += [record("down", f"refresh@64/p{p}", 64) for p in (8, 16)] + [record("down", "refresh@128/p32", 128)]
    records += [record("down", "refresh@64/p8", 64)] * 5  # one variant measured on many examples counts once
    assert recipe_report.recipe_budget(records, [], "up") == 160  # runs that recorded no budget: the records say
    assert recipe_report.recipe_budget(records, [], "down") == 64
    assert recipe_report.recipe_budget(records, [], "sideways") == 0
    runs = [{"budgets": {"up": 160, "down": 64}}, {}, {"budgets": {"up": 80}}]  # the latest run's budget holds
    assert recipe_report.recipe_budget(records, runs, "up") == 80
    assert recipe_report.recipe_budget(records, runs, "down") == 64


def test_a_cache_holding_part_of_its_context_refuses_what_would_read_it_whole(example_run, sibling_map):
    ids = example_run.example.ids[None, :CONTEXT]
    cache = MappedCache.from_source(example_run.source_kv, sibling_map, example_run.target, input_ids=ids,
                                    refresh_tokens="index@48/p8", verify_models=False)
    with pytest.raises(CacheMismatchError, match="index recipe"):
        cache.captured()  # its KV is not the context's: never stored nor mapped again
    with pytest.raises(CacheMismatchError, match="cannot be cut"):
        cache.truncate(sibling_map.config.sink_tokens + 1)  # inside what it dropped
    with pytest.raises(CacheMismatchError, match="assisted decoding"):
        cache.activate_past_recording()
    whole = MappedCache.from_source(example_run.source_kv, sibling_map, example_run.target, input_ids=ids,
                                    refresh_tokens=0, verify_models=False)
    snapshot = whole.snapshot()
    whole.hold_only(torch.arange(8, CONTEXT), [(layer.keys[:, :, 8:], layer.values[:, :, 8:]) for layer in whole.layers])
    assert (whole.dropped_positions, whole.get_seq_length()) == (8, CONTEXT)
    with pytest.raises(CacheMismatchError, match="cannot be cut"):
        whole.truncate(4)  # the first 8 positions are not held: nothing before them to keep
    with pytest.raises(CacheMismatchError, match="increasing"):
        whole.hold_only(torch.tensor([3, 2]), [(layer.keys[:, :, :2], layer.values[:, :, :2]) for layer in whole.layers])
    with pytest.raises(CacheMismatchError, match="each of"):
        whole.hold_only(torch.tensor([2, 3]), [(layer.keys, layer.values) for layer in whole.layers])
    whole.restore(snapshot)  # a refresh that fails after dropping puts the whole context back
    assert (whole.dropped_positions, whole.layers[0].keys.shape[2]) == (0, CONTEXT)


def test_a_lever_is_paired_with_the_published_maps_and_credited_with_the_oracle_gap_it_closes():
    accuracy = {"full": 1.0, "no_context": 0.0, "hybrid@160": 0.5, "hybrid@160+true-keys": 0.9,
                "hybrid@160+true-values": 0.6, "attn:hybrid@160": 0.7, "attn:plain": 0.3, "plain": 0.2}
    examples = [f"e{i}" for i in range(6)]
    jitter = {e: 0.01 * i for i, e in enumerate(examples)}  # the same for every variant: paired differences are exact
    scores = recipe_scores.Scores({v: {e: a * (1 - jitter[e]) + jitter[e] * (v == "full") for e in examples}
                                   for v, a in accuracy.items()},
                                  {v: dict.fromkeys(examples, 0.1) for v in accuracy}, {e: f"{e}.py" for e in examples})
    gains = {g["recipe"]: g for g in recipe_report.lever_gains(scores, 160)}
    assert set(gains) == {"hybrid@160", "plain"} and gains["plain"]["lever"] == "attn"
    hybrid = gains["hybrid@160"]
    assert hybrid["minus_published"] == pytest.approx(0.2, abs=0.02)
    assert hybrid["keys_gap_closed"] == pytest.approx(0.5, abs=0.05)  # 0.2 of the 0.4 the target's own keys add
    assert hybrid["values_gap_closed"] == pytest.approx(2.0, abs=0.2)  # beyond what the values oracle adds
    assert "keys_gap_closed" not in gains["plain"]  # the oracle swaps are the hybrid's
    assert "on" not in hybrid
    # distillation on the attn lever's maps: paired against those as well (what the addition gains)
    scores.accuracy["attn-distill:hybrid@160"] = {e: 0.75 * (1 - jitter[e]) for e in examples}
    scores.kl["attn-distill:hybrid@160"] = dict.fromkeys(examples, 0.1)
    distilled = next(g for g in recipe_report.lever_gains(scores, 160, {"attn-distill": "attn"})
                     if g["lever"] == "attn-distill")
    assert distilled["on"] == "attn" and distilled["minus_on"] == pytest.approx(0.05, abs=0.01)
    assert distilled["minus_published"] == pytest.approx(0.25, abs=0.02)


def test_records_of_maps_since_replaced_are_dropped_not_mixed_with_the_new_ones():
    def record(example, variant, maps, fingerprint, correct, dtype="float32"):
        return {"direction": "up", "example": example, "file": f"{example}.py", "task": "continuation",
                "variant": variant, "maps": maps, "map": fingerprint, "correct": correct, "tokens": 4, "kl": 0.0,
                "dtype": dtype}

    records = [record("e0", "window@160", "published", None, 1), record("e0", "attn:hybrid@160", "attn", "old", 1),
               record("e1", "attn:hybrid@160", "attn", "old", 2), record("e0", "hybrid@160", "published", "p", 3),
               record("e0", "attn:hybrid@160", "attn", "new", 4)]  # the lever's maps were fitted again
    scores = recipe_scores.group(records, "up")["continuation"]
    assert scores.accuracy["attn:hybrid@160"] == {"e0": 1.0}  # e1 was measured with the old maps only
    assert scores.accuracy["hybrid@160"] == {"e0": 0.75} and scores.accuracy["window@160"] == {"e0": 0.25}
    records.append(record("e1", "window@160", "published", None, 2, dtype="bfloat16"))  # the models in bfloat16
    scores = recipe_scores.group(records, "up")["continuation"]
    assert scores.accuracy == {"window@160": {"e1": 0.5}}  # the float32 records are not mixed in
    assert recipes.record_key("e1", "up", "window@160", None, "bfloat16") != \
        recipes.record_key("e1", "up", "window@160", None, "float32")  # a run in another dtype measures again


def test_a_lever_fitted_again_is_compared_with_its_previous_fit_on_the_same_examples():
    def record(example, variant, maps, fingerprint, correct, task="continuation"):
        return {"direction": "up", "example": f"{task}/{example}", "file": f"{example}.py", "task": task,
                "variant": variant, "maps": maps, "map": fingerprint, "correct": correct, "tokens": 4, "kl": 0.0,
                "dtype": "float32"}

    examples = [f"e{i}" for i in range(6)]
    records = [r for e in examples for r in (record(e, "full", "published", None, 4),
                                             record(e, "no_context", "published", None, 0),
                                             record(e, "hybrid@64", "published", "p", 2),
                                             record(e, "attn:hybrid@64", "attn", "old", 3))]
    assert recipe_scores.refit_differences(records, "up") == []  # fitted once: nothing to compare
    records[-1]["correct"] = 1  # the previous fit's last example, which the new fit has not reached: not compared
    records += [record(e, "attn:hybrid@64", "attn", "new", 2) for e in examples[:4]]  # fitted again, 4 examples so far
    (entry,) = recipe_scores.refit_differences(records, "up")
    assert (entry["maps"], entry["variant"], entry["previous"], entry["current"]) == \
        ("attn", "attn:hybrid@64", "old", "new")
    moved = entry["continuation"]
    assert moved["examples"] == 4  # paired: only the examples both fits were measured on
    assert (moved["previous"], moved["current"], moved["difference"]) == pytest.approx((0.75, 0.5, -0.25))
    assert "recall (pooled)" not in entry
    assert recipe_scores.group(records, "up")["continuation"].accuracy["attn:hybrid@64"] == dict.fromkeys(
        [f"continuation/{e}" for e in examples[:4]], 0.5)  # the tables count the current fit only


def test_the_ttft_budget_is_the_largest_refresh_budget_meeting_every_goal():
    def row(context, full, times):
        return {"context": context, "full": {"median": full},
                "recipes": {name: {"budget": budget, "speedup": full / t} for name, (budget, t) in times.items()}}

    sweep = {"rows": [row(2048, 50.0, {"refresh@64/p32": (64, 4.0), "refresh@96/p64": (96, 4.9),
                                       "refresh@128/p96": (128, 5.5), "hybrid@160": (160, 4.0)}),
                      row(8192, 240.0, {"refresh@64/p32": (64, 6.0), "refresh@96/p64": (96, 7.9),
                                        "refresh@128/p96": (128, 7.0)}),
                      row(4096, 90.0, {"refresh@96/p64": (96, 90.0)})]}  # no goal at 4k: not a constraint
    choice = recipe_budget.ttft_budget(sweep, {2048: 10, 8192: 30})
    assert choice["budget"] == 96  # 128 misses 10x at 2k; the hybrid (no probe pass) is no refresh
    assert choice["budgets"][128] == {"speedups": {2048: 50.0 / 5.5, 8192: 240.0 / 7.0}, "untimed": [],
                                      "meets": False}
    assert (choice["checked"], choice["unchecked"]) == ([2048, 8192], [])
    assert recipe_budget.ttft_budget(sweep, {2048: 13})["budget"] is None
    sweep["rows"][0]["recipes"]["refresh@160/p128"] = {"budget": 160, "speedup": 10.5}  # above a miss: noise
    assert recipe_budget.ttft_budget(sweep, {2048: 10})["budget"] == 96
    sweep["rows"][0]["recipes"]["refresh@96/p32"] = {"budget": 96, "speedup": 9.0}  # a slower refresh at 96
    choice = recipe_budget.ttft_budget(sweep, {2048: 10, 16384: 60})
    assert choice["budget"] == 64 and choice["budgets"][96]["speedups"][2048] == 9.0
    assert choice["unchecked"] == [16384]  # a goal at a length the sweep did not time is said, not met
    untimed = {"rows": [row(2048, 50.0, {"refresh@64/p32": (64, 4.0), "refresh@96/p64": (96, 4.5)}),
                        row(8192, 240.0, {"refresh@64/p32": (64, 7.0)})]}  # 96 never timed at 8k
    choice = recipe_budget.ttft_budget(untimed, {2048: 10, 8192: 30})
    assert choice["budget"] == 64 and choice["budgets"][96]["untimed"] == [8192]
    untimed["rows"][1]["recipes"]["refresh@128/p96"] = {"budget": 128, "speedup": 35.0}  # timed at 8k, not 2k
    untimed["rows"][0]["recipes"]["refresh@128/p96"] = {"budget": 128, "speedup": 10.5}  # now at both
    assert recipe_budget.ttft_budget(untimed, {2048: 10, 8192: 30})["budget"] == 128  # 96, untimed, stops nothing
    untimed["rows"][0]["recipes"]["refresh@96/p64"]["speedup"] = 9.0  # 96 misses at 2k: a stop, timed or not at 8k
    assert recipe_budget.ttft_budget(untimed, {2048: 10, 8192: 30})["budget"] == 64


def test_a_direction_s_budget_comes_from_its_sweep_and_is_refused_without_one(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe_budget, "RESULTS", tmp_path)
    with pytest.raises(RecordError, match="--sweep"):
        recipe_budget.direction_budget("up")
    stem = recipe_budget.sweep_stem("up")
    row = {"context": 2048, "full": {"median": 40.0}, "recipes": {"refresh@64/p32": {"budget": 64, "speedup": 11.0},
                                                                   "refresh@96/p64": {"budget": 96, "speedup": 9.0}}}
    sweep = {"maps": "basis512", "map_multiply_adds_per_token": 400, "rows": [row]}
    (tmp_path / f"{stem}.json").write_text(json.dumps(sweep))
    monkeypatch.setattr(recipe_budget, "read_results", lambda name: json.loads((tmp_path / f"{name}.json").read_text()))
    assert recipe_budget.direction_budget("up") == {"budget": 64, "sweep": stem, "runs": 1, "maps": "basis512",
                                                    "checked": [2048], "unchecked": [8192],
                                                    "multiply_adds_per_token": 400}
    sweep["rows"][0]["recipes"]["refresh@64/p32"]["speedup"] = 9.5
    (tmp_path / f"{stem}.json").write_text(json.dumps(sweep))
    assert recipe_budget.direction_budget("up")["budget"] is None  # none meets the goals: the published budget stays


def test_a_budget_must_meet_the_goals_in_every_run_of_the_same_maps(tmp_path, monkeypatch):
    def run(maps, parameters, speedups, context=2048, threads=2):
        recipes = {f"refresh@{b}/p32": {"budget": b, "speedup": x} for b, x in speedups.items()}
        return {"provenance": {"date": "d", "torch_threads": threads}, "maps": maps, "map_parameters": parameters,
                "map_multiply_adds_per_token": parameters, "rows": [{"context": context, "recipes": recipes}]}

    stem = recipe_budget.sweep_stem("up")
    monkeypatch.setattr(recipe_budget, "read_results", lambda name: json.loads((tmp_path / f"{name}.json").read_text()))

    def budget(*runs) -> dict:  # the runs newest first, as the sweep files them
        sweep = None
        for r in reversed(runs):
            sweep = recipe_budget.with_earlier_runs(r, sweep)
        (tmp_path / f"{stem}.json").write_text(json.dumps(sweep))
        return recipe_budget.direction_budget("up")

    first = run("basis512", 10, {64: 11.0, 96: 9.2})  # the slower hour: 96 misses 10x
    second = run("basis512", 10, {64: 35.0, 96: 33.0}, context=8192)
    third = run("basis512", 10, {64: 12.0, 96: 11.8})
    assert recipe_budget.with_earlier_runs(third, recipe_budget.with_earlier_runs(second, first))["earlier_runs"] == [
        second, first]  # kept across runs, newest first
    choice = budget(third, second, first)
    assert (choice["budget"], choice["runs"], choice["checked"], choice["unchecked"]) == (64, 3, [2048, 8192], [])
    assert budget(third, second)["budget"] == 96  # without the slower hour's run
    # runs of other maps or threads are kept in the file but not read; a run without a goal length decides nothing
    assert budget(third, run("top4", 6, {64: 12.0, 96: 8.0}), run("basis512", 10, {96: 5.0}, threads=1),
                  run("basis512", 10, {96: 1.0}, context=512)) == {**budget(third), "runs": 2}
    assert budget(third, run("basis512", 10, {128: 9.0}))["budget"] == 96  # a miss above every swept budget
    assert budget(run("basis512", 10, {64: 9.9}), third)["budget"] is None  # one run misses at the smallest


def test_the_report_says_where_each_budget_came_from():
    runs = [{"budget_sources": {"up": {"budget": 160, "from": "the published recipe"}}},
            {"budget_sources": {"up": {"budget": 64, "from": "the TTFT sweep", "sweep": "ttft-up-sweep",
                                       "maps": "basis512", "checked": [2048], "unchecked": [8192]}}}]
    assert recipe_report.budget_note(runs, "up") == ("The budget, 64, comes from the TTFT sweep (`ttft-up-sweep.md`, "
                                                     "timed with the basis512 maps; goals checked at 2048, not at 8192).")
    assert recipe_report.budget_note(runs[:1], "up") == "The budget, 160, comes from the published recipe."
    runs[1]["budget_sources"]["up"].update(runs=2, unchecked=[])
    assert recipe_report.budget_note(runs, "up") == ("The budget, 64, comes from the TTFT sweep (`ttft-up-sweep.md`, "
                                                     "timed with the basis512 maps, met in each of 2 runs; goals checked "
                                                     "at 2048).")
    runs[1]["budget_sources"]["up"].update(budget=160, **{"from": "the published recipe (no swept budget meets)"})
    assert "met in each" not in recipe_report.budget_note(runs, "up")
    assert recipe_report.budget_note(runs, "down") == ""


def test_a_defaults_maps_cost_no_more_than_the_maps_its_budgets_sweep_timed(monkeypatch):
    monkeypatch.setattr(recipe_report, "map_cost_limit", lambda direction: 1000)
    timed = {"budget_sources": {"up": {"budget": 64, "from": "the TTFT sweep", "sweep": "s", "maps": "basis512",
                                       "multiply_adds_per_token": 400, "checked": [2048], "unchecked": []}}}
    assert recipe_report.cost_limit([timed], "up") == 400  # a costlier map's recipe was not timed at this budget
    assert recipe_report.cost_limit([timed], "down") == 1000
    timed["budget_sources"]["up"]["multiply_adds_per_token"] = 5000
    assert recipe_report.cost_limit([timed], "up") == 1000  # the TTFT goal's own bound still holds


def test_map_facts_come_from_a_run_of_the_maps_the_records_hold():
    runs = [{"map_sets": {"attn": {"up": {"fingerprint": "a1", "parameters": 10}}}},
            {"map_sets": {"attn": {"up": {"fingerprint": "a2", "parameters": 20}}}}]  # stopped before any record
    assert recipe_report.latest_map_facts(runs, "up")["attn"]["parameters"] == 20
    assert recipe_report.latest_map_facts(runs, "up", {"attn": "a1"})["attn"]["parameters"] == 10


def test_a_full_pass_keeps_no_autograd_graph_whoever_calls_it(sibling_pair):
    # called with autograd on (a script outside the benchmark's no_grad), the logits held the pass's activations:
    # a probe over a dozen 2k-token examples of the 1.5B ran out of memory
    _, target = sibling_pair
    assert torch.is_grad_enabled()
    logits, kv = full_pass(target, random_ids(1, 12, seed=4)[0], 3)
    assert not logits.requires_grad and not kv.keys[0].requires_grad


def test_a_text_under_two_paths_is_one_file_for_continuation_windows_and_recall_fillers(monkeypatch):
    code = {"a.py": "x = 1\n" * 40, "copy/a.py": "x = 1\n" * 40, "c.py": "y = 2\n" * 40}
    monkeypatch.setattr(recipe_examples, "stdlib_texts", lambda *args: dict(code))
    monkeypatch.setattr(recipe_examples, "prose_texts", lambda *args: {"p.txt": "words " * 40, "q.txt": "words " * 40})
    monkeypatch.setattr(recipe_examples, "token_ids", lambda tokenizer, text: torch.tensor([ord(c) for c in text]))
    fillers = []
    monkeypatch.setattr(recipe_examples, "recall_examples",
                        lambda tokenizer, texts, *args, **kwargs: fillers.append(list(texts)) or ([], []))
    found = recipe_examples.examples(None, "selection", 100 - recipe_examples.CONTINUATION, 10, 1, 1)
    assert [e.file for e in found] == ["a.py", "c.py"]  # one window per distinct text
    assert ["a.py", "c.py"] in fillers and all("copy/a.py" not in f for f in fillers)
    assert ["p.txt"] in fillers and all("q.txt" not in f for f in fillers)  # prose fillers too


def test_supersede_moves_a_tasks_records_aside_and_a_stop_between_its_writes_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe_records, "RECORDS", tmp_path)
    monkeypatch.setattr(recipes, "RESULTS", tmp_path)
    reports = [tmp_path / f"sibling-recipes-{role}-2048.json" for role in ("final", "selection")]
    for report in reports:
        report.write_text("{}")
    records = [{"example": f"{task}/{i}", "task": task, "variant": "full", "correct": i}
               for task in ("continuation", "recall-prose-top", "recall-code-top", "recall-prose-end") for i in range(2)]
    path = recipes.records_path("final", 2048)
    original = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(original)
    with pytest.raises(RecordError, match="a reason"):
        recipes.supersede("final", 2048, "recall-prose", "")
    assert recipes.supersede("final", 2048, "recall-prose", "answers tokenized with the question") == 4
    assert [r["task"] for r in recipes.read_records(path)] == ["continuation"] * 2 + ["recall-code-top"] * 2
    assert not reports[0].exists() and reports[1].exists()  # the report that counted them is gone, the other kept
    archive = tmp_path / "final-2048.superseded.jsonl"
    moved = recipes.read_records(archive)
    assert [r["example"] for r in moved] == ["recall-prose-top/0", "recall-prose-top/1", "recall-prose-end/0",
                                             "recall-prose-end/1"]
    assert {r["superseded"] for r in moved} == {"answers tokenized with the question"}
    assert recipes.supersede("final", 2048, "recall-prose", "again") == 0  # nothing left to move
    path.write_text(original)  # as if a stop came after the archive was written, before the records were
    assert recipes.supersede("final", 2048, "recall-prose", "answers tokenized with the question") == 4
    assert recipes.read_records(archive) == moved  # no line twice
    assert len(recipes.read_records(path)) == 4


def test_maps_are_gone_where_no_folder_holds_the_weights_their_rows_were_measured_on(tmp_path):
    kept, refitted = tmp_path / "kept", tmp_path / "refitted"
    for folder, weights in ((kept, b"weights"), (refitted, b"refitted weights")):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(weights)
    facts = {"published": {"folder": str(kept), "fingerprint": map_fingerprint(kept)},
             "refit": {"folder": str(refitted), "fingerprint": map_fingerprint(kept)},
             "deleted": {"folder": str(tmp_path / "deleted"), "fingerprint": "0" * 16}}
    labels = {"published", "refit", "deleted", "unrecorded"}
    assert recipe_report.maps_gone(labels, facts) == {"refit", "deleted", "unrecorded"}


def test_a_run_refuses_records_measured_with_other_models_or_probe(tmp_path):
    runs = tmp_path / "runs.jsonl"
    setup = {"models": {"large": "l1", "small": "s1"}, "probe": 16, "span": 8}
    live = {"r0", "r1", "r2"}
    recipes.check_same_setup(runs, "final", 2048, setup, live)  # no run yet
    runs.write_text(json.dumps({"run": "r0", "role": "final", "context": 2048}) + "\n"  # before setups were recorded
                    + json.dumps({"run": "r1", "role": "final", "context": 2048, **setup}) + "\n"
                    + json.dumps({"run": "r2", "role": "final", "context": 4096, **setup, "probe": 32}) + "\n")
    recipes.check_same_setup(runs, "final", 2048, setup, live)
    with pytest.raises(RecordError, match="measured with models .*'l1'.*this run has .*'l2'.*supersede"):
        recipes.check_same_setup(runs, "final", 2048, {**setup, "models": {"large": "l2", "small": "s1"}}, live)
    with pytest.raises(RecordError, match="measured with probe 16, this run has 32"):
        recipes.check_same_setup(runs, "final", 2048, {**setup, "probe": 32}, live)
    recipes.check_same_setup(runs, "final", 4096, {**setup, "probe": 32}, live)  # that context's own records
    recipes.check_same_setup(runs, "final", 2048, {**setup, "probe": 32}, {"r0", "r2"})  # r1's records moved aside


def test_a_run_records_which_lever_an_addition_was_made_on(sibling_map, tmp_path):
    sibling_map.save_pretrained(tmp_path / "plain", chart=False)
    assert "added_to" not in recipes.map_facts(tmp_path / "plain", sibling_map, "f")
    sibling_map.save_pretrained(tmp_path / "distilled", chart=False)
    (tmp_path / "distilled" / "lever.json").write_text(json.dumps({"addition": "distill", "on": "basis512"}))
    assert recipes.map_facts(tmp_path / "distilled", sibling_map, "f")["added_to"] == "basis512"


def test_a_run_records_which_machine_fitted_a_levers_maps(sibling_map, tmp_path):
    # a fit's weights follow the CPU's kernels (AVX-512 and AVX2 machines fitted maps apart at rounding)
    from benchmarks import lever_maps
    from peft_kvcache.lab.provenance import provenance

    folder = sibling_map.save_pretrained(tmp_path / "lever", chart=False)
    assert "fitted_on" not in recipes.map_facts(folder, sibling_map, "f")  # maps fitted before it was recorded
    lever_maps.write_fitted(folder)
    here = provenance()
    assert recipes.map_facts(folder, sibling_map, "f")["fitted_on"] == {"cpu": here["cpu"],
                                                                        "cpu_features": here["cpu_features"]}
    sibling_map.save_pretrained(folder, chart=False)  # a card rendered again keeps it
    assert lever_maps.fitted_on(folder) is not None


def test_records_of_the_same_weights_under_the_other_header_order_take_the_files_fingerprint(tmp_path):
    folder = make_map().save_pretrained(tmp_path / "maps" / "up", chart=False)
    own = map_fingerprint(folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()  # the file an older writer could leave: the header's metadata in the other order
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header["__metadata__"] = dict(reversed(header["__metadata__"].items()))
    weights.write_bytes(data[:8] + json.dumps(header, separators=(",", ":")).encode().ljust(length) + data[8 + length:])
    old, other = map_fingerprint(folder), "0123456789abcdef"  # other: records of other weights
    assert old != own and map_fingerprints(folder) == [old, own]
    records = tmp_path / "records"
    records.mkdir()
    lines = [json.dumps({"example": "e1", "map": old}), json.dumps({"example": "e2", "map": other}),
             json.dumps({"example": "e3", "map": None})]
    (records / "final-2048.jsonl").write_text("\n".join(lines) + '\n{"example": "e4", "ma')  # a stop's torn line
    run = {"run": "r1", "map_sets": {"b": {"up": {"fingerprint": old}}}}
    (records / "runs.jsonl").write_text(json.dumps(run) + "\n")

    assert recipe_records.rekey([folder], records) == {old: own}
    assert map_fingerprint(folder) == own  # the file written again, its metadata sorted
    assert [r["map"] for r in recipes.read_records(records / "final-2048.jsonl")] == [own, other, None]
    assert (records / "final-2048.jsonl").read_text().endswith('\n{"example": "e4", "ma')
    runs = recipes.read_records(records / "runs.jsonl")
    assert runs[0]["map_sets"]["b"]["up"]["fingerprint"] == own and runs[-1]["rekeyed"] == {old: own}
    assert recipe_records.rekey([folder], records) == {}  # nothing left to rename, nothing said
    assert len(recipes.read_records(records / "runs.jsonl")) == 2

