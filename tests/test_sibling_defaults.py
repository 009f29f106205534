"""A sibling map's default recipe flows from the texts that choose it to what users get: the selection report's
choice is what the final texts measure and report, the card's config.json carries it, and every card figure and
README cell about it is read from the final report."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from benchmarks import common, recipe_records, recipe_report, recipe_scores, recipes, siblings
from peft_kvcache.errors import RecordError
from peft_kvcache.lab.provenance import lookup
from peft_kvcache.maps.config import GateRecord
from peft_kvcache.maps.records import to_json
from peft_kvcache.maps.recipe import Refresh
from peft_kvcache.maps.storage import save_weights
from scripts import figures, publish

UP, DOWN = siblings.pair_name("up"), siblings.pair_name("down")
VARIANTS = {"full": ("full", 0, 0), "no_context": ("no_context", 1, 0), "plain": ("plain", 1, 0),
            "window@160": ("window", 160, 160), "hybrid@160": ("hybrid", 160, 160),
            "refresh@160/p128": ("refresh", 160, 160), "index@160/p40": ("index", 160, 160)}
PLAN = {"continuation": 6, "recall-code-top": 4}  # what `_records` holds per variant: what a run planned
ACCURACY = {"full": 0.9, "no_context": 0.1, "plain": 0.3, "window@160": 0.6, "hybrid@160": 0.62,
            "refresh@160/p128": 0.5, "index@160/p40": 0.7}


@pytest.fixture
def results(tmp_path, monkeypatch):
    root = tmp_path / "benchmarks" / "results"
    (root / "sibling-recipes").mkdir(parents=True)
    for module in (common, recipes, recipe_report, figures):
        monkeypatch.setattr(module, "RESULTS", root)
    monkeypatch.setattr(recipe_records, "RECORDS", root / "sibling-recipes")
    for stem in (f"ttft-{UP}", f"ttft-{DOWN}", "siblings", "sibling-budget", "adapters", "adapters-reverse",
                 *(f"ttft-{figures.folder_name(figures.PREFIX, a, False)}" for a in common.ADAPTERS)):
        shutil.copy(common.ROOT / "benchmarks" / "results" / f"{stem}.json", root)
    return root


def _records(role: str, accuracy: dict[str, float], map_print: str | None = None) -> list[dict]:
    out = []
    for task, files in (("continuation", 6), ("recall-code-top", 4)):
        for i in range(files):
            for variant, (kind, compute, budget) in VARIANTS.items():
                tokens = 128 if task == "continuation" else 8
                # far facts: recalled by the recipes whose probe picks positions, as often as the full prefill
                rate = accuracy["full"] if task != "continuation" and variant[:5] in ("index", "refre") else \
                    accuracy[variant]
                correct = round(tokens * min(1.0, rate + 0.02 * (i % 3)))
                out.append({"example": f"{task}/{i}", "file": f"f{i}.py", "task": task, "direction": "up",
                            "context": 2048, "variant": variant, "kind": kind, "compute": compute, "budget": budget,
                            "maps": "published", "correct": correct, "tokens": tokens, "kl": 1 - accuracy[variant], "dtype": "float32",
                            "map": map_print if kind in ("plain", "hybrid", "refresh", "index") else None})
    return out


def _report(root, role: str, accuracy: dict[str, float], weights: bytes = b"published") -> dict:
    """The role's report of `_records` measured on maps whose weights are ``weights`` (a folder holds them, as the
    run recorded it: maps no folder holds cannot be chosen)."""
    folder = root / "maps" / weights.decode()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(weights)
    map_print = common.map_fingerprint(folder)
    records = root / "sibling-recipes" / f"{role}-2048.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in _records(role, accuracy, map_print)))
    facts = {"published": {"up": {"folder": str(folder), "fingerprint": map_print, "multiply_adds_per_token": 100}}}
    (root / "sibling-recipes" / "runs.jsonl").write_text(
        json.dumps({"role": role, "context": 2048, "planned": PLAN, "map_sets": facts}) + "\n")
    return recipe_report.report(role, 2048)


def test_the_final_texts_report_the_default_the_selection_texts_chose(results):
    with pytest.raises(RecordError, match="selection"):
        _report(results, "final", ACCURACY)  # nothing chose a default yet
    selection = _report(results, "selection", ACCURACY)
    assert selection["directions"]["up"]["default"] == "index@160/p40"  # best continuation, recall kept
    final_accuracy = {**ACCURACY, "index@160/p40": 0.65, "hybrid@160": 0.8}  # the hybrid does better here:
    final = _report(results, "final", final_accuracy)
    assert final["directions"]["up"]["default"] == "index@160/p40"  # the final texts report, never choose
    assert publish.default_recipe("up") == Refresh.named("index@160/p40")
    assert publish.plain_refresh(publish.default_recipe("up")) is None  # the retention stages cannot measure it

    payload = common.read_results("sibling-recipes-final-2048")
    card = figures.recipe_figures("up")
    for name, figure in card.items():
        assert lookup(payload, figure.key) == figure.value, name
    row = payload["directions"]["up"]["rows"]["index@160/p40"]["continuation"]
    assert card["final_2048.continuation.default.minus_window_control"].value == row["minus_control"]
    assert card["final_2048.continuation.default.minus_window_control_low"].value == row["minus_control_interval"][0]
    assert "final_2048.recall-code-top.default.normalized" in card and "final_2048.recall.window_control.normalized" in card
    assert figures.recipe_figures("down") == {}  # no default reported going down

    figures_of_card = publish.sibling_figures("up", publish.default_recipe("up"))
    assert not any(".recipe." in name for name in figures_of_card)  # the evaluate stage's recipe rows stay out
    readme = figures.readme_table()
    assert "`index@160/p40`" in readme and "vs the control" in readme and "sibling-recipes-final" in readme
    # its card publishes the weights the final run read (the base maps' folder it was given), never hub_cards'
    measured = results / "maps" / "published"
    assert publish.Publisher(results / "work").chosen_folder("up") == measured
    (measured / "model.safetensors").write_bytes(b"fitted again since")
    shutil.copy(common.ROOT / "benchmarks" / "results" / "sibling-scaling.json", results)  # the fallback reads it
    assert publish.Publisher(results / "work").chosen_folder("up") != measured


def test_the_lever_table_states_each_lever_maps_size_as_its_run_recorded_it(results, monkeypatch):
    monkeypatch.setattr(recipe_report, "map_cost_limit", lambda direction: 1000)  # no Qwen config read in CI
    records = _records("selection", ACCURACY)
    for r in [r for r in records if r["variant"] == "hybrid@160"]:
        records.append({**r, "variant": "attn:hybrid@160", "maps": "attn", "map": "a1", "correct": r["correct"] + 1})
    facts = {"folder": "runs/levers/attn/x", "fingerprint": "a1", "parameters": 1234567,
             "multiply_adds_per_token": 890, "options": {"attention_weighting": 0.5}, "distilled": False}
    (results / "sibling-recipes" / "selection-2048.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (results / "sibling-recipes" / "runs.jsonl").write_text(json.dumps(
        {"role": "selection", "context": 2048, "planned": PLAN, "map_sets": {"attn": {"up": facts}}}) + "\n")
    payload = recipe_report.report("selection", 2048)
    lever = payload["directions"]["up"]["levers"][0]
    assert lever["lever"] == "attn" and lever["map"]["parameters"] == 1234567
    assert lever["map"]["options"] == {"attention_weighting": 0.5}
    assert "| 1,234,567 / 890 |" in (results / "sibling-recipes-selection-2048.md").read_text()
    candidate = payload["directions"]["up"]["choice"]["candidates"]["attn:hybrid@160"]  # levers compete for the default
    assert candidate["multiply_adds_per_token"] == 890 and candidate["within_cost"]
    assert payload["directions"]["up"]["choice"]["cost_limit"] == 1000

    # the lever's maps fitted again: while its rows are measured again, the report refuses to choose (the runner-up
    # would win meanwhile) and leaves the report on disk as it was
    written = (results / "sibling-recipes-selection-2048.json").read_text()
    folder = results / "attn-refitted"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"the lever's weights, fitted again")
    refit = common.map_fingerprint(folder)
    again = [{**r, "map": refit} for r in records if r["maps"] == "attn"][:3]
    with open(results / "sibling-recipes" / "selection-2048.jsonl", "a") as out:
        out.write("".join(json.dumps(r) + "\n" for r in again))
    with open(results / "sibling-recipes" / "runs.jsonl", "a") as out:
        out.write(json.dumps({"role": "selection", "context": 2048, "planned": PLAN, "map_sets": {"attn": {"up": {
            **facts, "folder": str(folder), "fingerprint": refit}}}}) + "\n")
    with pytest.raises(RecordError, match="attn:hybrid@160 are scored on fewer examples"):
        recipe_report.report("selection", 2048)
    assert (results / "sibling-recipes-selection-2048.json").read_text() == written
    # the refitted maps deleted before their rows were complete: nothing can complete them, the choice goes on
    (folder / "model.safetensors").unlink()
    choice = recipe_report.report("selection", 2048)["directions"]["up"]["choice"]
    assert choice["waiting"] == [] and choice["candidates"]["attn:hybrid@160"]["maps_gone"]


def test_a_default_on_a_levers_maps_publishes_those_maps(results, monkeypatch, tmp_path):
    monkeypatch.setattr(recipe_report, "map_cost_limit", lambda direction: 1000)
    selection = {"directions": {"up": {"choice": {"default": "attn:index@160/p40", "maps": "attn"}}}}
    (results / "sibling-recipes-selection-2048.json").write_text(json.dumps(selection))
    final_accuracy = {**ACCURACY, "attn:index@160/p40": 0.72}
    VARIANTS["attn:index@160/p40"] = ("index", 160, 160)
    try:
        records = _records("final", final_accuracy)
    finally:
        del VARIANTS["attn:index@160/p40"]
    for r in records:
        r["maps"] = "attn" if r["variant"].startswith("attn:") else "published"
    (results / "sibling-recipes" / "final-2048.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (results / "sibling-recipes" / "runs.jsonl").write_text(json.dumps({"role": "final", "context": 2048, "planned": PLAN}) + "\n")
    assert recipe_report.report("final", 2048)["directions"]["up"]["default"] == "attn:index@160/p40"
    assert publish.default_maps("up") == "attn" and publish.default_maps("down") == "published"
    assert publish.default_recipe("up") == Refresh.named("index@160/p40")
    # the plain switch and the budget curve ran on the capture's maps: not on a card of the lever's weights
    up, down = (publish.sibling_figures(d, publish.default_recipe(d)) for d in ("up", "down"))
    assert any(name.startswith("final_2048.") for name in up)
    assert not any(name.startswith(("budget_curve.", "continuation.plain.")) for name in up), sorted(up)
    assert any(name.startswith("budget_curve.") for name in down) and "continuation.plain.kl" in down
    monkeypatch.setattr(publish.lever_maps, "LEVERS", tmp_path / "levers")
    with pytest.raises(RecordError, match="lever_maps --label attn"):  # never the capture's maps in their place
        publish.Publisher(tmp_path / "work").chosen_folder("up")
    (tmp_path / "levers" / "attn" / UP).mkdir(parents=True)
    assert publish.Publisher(tmp_path / "work").chosen_folder("up") == tmp_path / "levers" / "attn" / UP


def test_a_card_is_never_published_with_figures_measured_on_other_weights(results, monkeypatch, tmp_path):
    """The final texts measured the default on one fit of a lever's maps; the folder now holds another (fitted again
    since): sibling_cards refuses before writing either card, until the final texts measure the weights it holds. It
    refuses as well a final run stopped halfway (the default on fewer examples than its control) and a final report
    of a default the selection texts no longer choose."""
    monkeypatch.setattr(recipe_report, "map_cost_limit", lambda direction: 1000)
    monkeypatch.setattr(publish.lever_maps, "LEVERS", tmp_path / "levers")
    shutil.copy(common.ROOT / "benchmarks" / "results" / "sibling-scaling.json", results)  # down: the capture's maps
    folder = tmp_path / "levers" / "attn" / UP
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"the lever's weights, fitted again")
    selection = {"directions": {"up": {"choice": {"default": "attn:index@160/p40", "maps": "attn"}}}}
    (results / "sibling-recipes-selection-2048.json").write_text(json.dumps(selection))

    def final_report(fingerprint: str) -> dict:
        VARIANTS["attn:index@160/p40"] = ("index", 160, 160)
        try:
            records = _records("final", {**ACCURACY, "attn:index@160/p40": 0.72})
        finally:
            del VARIANTS["attn:index@160/p40"]
        for r in records:
            if r["variant"].startswith("attn:"):
                r["maps"], r["map"] = "attn", fingerprint
        (results / "sibling-recipes" / "final-2048.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (results / "sibling-recipes" / "runs.jsonl").write_text(json.dumps({"role": "final", "context": 2048, "planned": PLAN}) + "\n")
        return recipe_report.report("final", 2048)

    assert final_report("an earlier fit")["directions"]["up"]["default_map"] == "an earlier fit"
    publisher = publish.Publisher(tmp_path / "work")
    monkeypatch.setattr(publisher, "chosen_map", lambda *a, **k: pytest.fail("a card was about to be written"))
    with pytest.raises(RecordError, match="on maps an earlier fit; .* holds [0-9a-f]{16}: measure them"):
        publisher.sibling_cards()
    final_report(common.map_fingerprint(folder))
    publisher.check_final_maps("up")  # measured on the weights it holds: passes
    publisher.check_final_maps("down")  # no default reported going down: nothing to check

    path = results / "sibling-recipes" / "final-2048.jsonl"
    complete = path.read_text()
    stopped = [line for line in complete.splitlines(keepends=True)
               if not ('"attn:index@160/p40"' in line and '"continuation/5"' in line)]
    path.write_text("".join(stopped))
    recipe_report.report("final", 2048)
    with pytest.raises(RecordError, match="ran on 5 continuation examples, its window-only control on 6: run"):
        publisher.check_final_maps("up")
    noted, notes = [], figures.ttft_goal_notes  # the notes under the table read only the reports it shows
    monkeypatch.setattr(figures, "ttft_goal_notes", lambda reports: noted.append(reports) or [])
    readme = figures.readme_table()  # the README withholds it too, and says why
    monkeypatch.setattr(figures, "ttft_goal_notes", notes)
    assert noted == [{UP: {}, DOWN: {}}] and "sibling-recipes-final" not in readme.split("\n\n")[1]
    assert "`attn:index@160/p40`" not in readme.split("\n\n")[0]
    assert (f"Not shown: `sibling-recipes-final-2048.json` for `{UP}`: its 'attn:index@160/p40' ran on 5 "
            "continuation examples, its window-only control on 6;") in readme
    assert "default recipe stays out of this table until a final report of it stands" in readme
    path.write_text(complete)
    recipe_report.report("final", 2048)
    publisher.check_final_maps("up")
    assert "`attn:index@160/p40`" in figures.readme_table() and "Not shown" not in figures.readme_table()
    assert "stays out of this table" not in figures.readme_table()
    # stopped between examples: the default and its control equally short, and the plan says what is missing
    path.write_text("".join(line for line in complete.splitlines(keepends=True) if '"continuation/5"' not in line))
    recipe_report.report("final", 2048)
    with pytest.raises(RecordError, match="ran on 5 continuation examples of the 6 its run planned: run"):
        publisher.check_final_maps("up")
    runs = results / "sibling-recipes" / "runs.jsonl"
    runs.write_text(json.dumps({"role": "final", "context": 2048}) + "\n")  # a run before plans were recorded
    path.write_text(complete)
    recipe_report.report("final", 2048)
    with pytest.raises(RecordError, match="records no planned examples"):
        publisher.check_final_maps("up")
    runs.write_text(json.dumps({"role": "final", "context": 2048, "planned": PLAN}) + "\n")
    recipe_report.report("final", 2048)
    selection["directions"]["up"]["choice"]["fingerprint"] = "another fit"  # chosen on maps fitted otherwise
    (results / "sibling-recipes-selection-2048.json").write_text(json.dumps(selection))
    with pytest.raises(RecordError, match="ran on maps [0-9a-f]{16}; the selection texts chose it on another fit"):
        publisher.check_final_maps("up")
    assert "the selection texts chose it on another fit; it is measured again" in figures.readme_table()
    selection["directions"]["up"]["choice"] = {"default": "attn:hybrid@160", "maps": "attn"}  # chosen again since
    (results / "sibling-recipes-selection-2048.json").write_text(json.dumps(selection))
    with pytest.raises(RecordError, match="it reports 'attn:index@160/p40'; the selection texts chose "
                                          "'attn:hybrid@160'"):
        publisher.check_final_maps("up")


def test_a_levers_maps_carry_their_own_gate_never_the_captures(results, monkeypatch, tmp_path):
    """The card of a default on a lever's maps carries the gate the lever_gate stage measured on those very weights;
    the capture's maps (the published default elsewhere) carry the gate stage's at the chosen scale."""
    monkeypatch.setattr(publish, "default_maps", lambda direction: "attn" if direction == "up" else "published")
    monkeypatch.setattr(publish.lever_maps, "LEVERS", tmp_path / "levers")
    for stem in ("sibling-scaling", "sibling-gates"):
        shutil.copy(common.ROOT / "benchmarks" / "results" / f"{stem}.json", results)
    folder = tmp_path / "levers" / "attn" / UP
    folder.mkdir(parents=True)
    save_weights({"w": torch.ones(2)}, folder / "model.safetensors")
    publisher = publish.Publisher(tmp_path / "work")
    with pytest.raises(RecordError, match="run the lever_gate stage"):
        publisher.sibling_gate("up")  # no gate of the lever's maps measured yet
    gate = GateRecord(0.42, [0.9], [0.1], 8, 16)
    measured = {"gates": {"up": {"attn": to_json(gate)}}, "fingerprints": {"up": {"attn": "another map's"}}}
    (results / "sibling-lever-gates.json").write_text(json.dumps(measured))
    with pytest.raises(RecordError, match="run the lever_gate stage"):
        publisher.sibling_gate("up")  # measured on other weights (the lever refitted since)
    measured["fingerprints"]["up"]["attn"] = common.map_fingerprint(folder)
    (results / "sibling-lever-gates.json").write_text(json.dumps(measured))
    assert publisher.sibling_gate("up").predicted_retention == 0.42
    measured["fingerprints"]["up"]["attn"] = common.map_fingerprints(folder)[1]  # same weights, other header order
    (results / "sibling-lever-gates.json").write_text(json.dumps(measured))
    assert publisher.sibling_gate("up").predicted_retention == 0.42
    scale = str(common.read_results("sibling-scaling")["curve"]["down"]["chosen_files"])
    assert publisher.sibling_gate("down").predicted_retention == \
        common.read_results("sibling-gates")["gates"]["down"][scale]["predicted_retention"]


def test_the_readmes_plain_switch_is_on_the_default_recipes_maps_or_says_whose_it_is(monkeypatch):
    monkeypatch.setattr(figures, "results", lambda stem: {"rows": []})  # no TTFT rows

    def row(normalized: float) -> dict:
        cell = {"normalized": normalized, "interval": [normalized, normalized], "kl": 1 - normalized, "examples": 4,
                "minus_control": 0.1, "minus_control_interval": [0.0, 0.2]}
        return {"compute": 64, "continuation": cell, recipe_scores.RECALL: cell}

    rows = {"plain": row(0.11), "window@64": row(0.5), "attn:refresh@64/p32": row(0.7)}
    reported = {2048: {"rows": rows, "default": "attn:refresh@64/p32"}}
    cells = [r[2] for r in figures._recipe_rows("pair", reported)]
    assert cells == ["0.11 [0.11, 0.11] (base maps)"] * 2  # the run's base maps, said so
    rows["attn:plain"] = row(0.33)
    assert [r[2] for r in figures._recipe_rows("pair", reported)] == ["0.33 [0.33, 0.33]"] * 2  # the default's maps


def test_a_default_that_misses_a_ttft_goal_is_said_so_below_the_table(monkeypatch, tmp_path):
    """The README says, from the TTFT results files, which default misses which goal, with its passes and what its
    budget's sweep measured; a default that meets every goal gets no note."""
    def ttft_row(context: int, speedup: float) -> dict:
        return {"context": context, "speedup_recipe": speedup, "recipe_name": "top4:refresh@64/p32",
                "recipe_passes": {"probe": 0.29, "recompute": 0.47, "first_token": 0.15}, "recipe": {"median": 1.04},
                "full": {"median": 9.28}}

    files = {f"ttft-{DOWN}": {"maps": "top4", "rows": [ttft_row(2048, 8.9), ttft_row(8192, 33.0)]},
             f"ttft-{DOWN}-sweep": {"maps": "top4", "rows": [{"context": 2048, "full": {"median": 13.96}, "recipes": {
                 "refresh@64/p32": {"budget": 64, "speedup": 11.2, "speedup_min": 7.7, "speedup_max": 11.9}}}]}}
    monkeypatch.setattr(figures, "results", files.__getitem__)
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    reports = {UP: {}, DOWN: {2048: {"default": "top4:refresh@64/p32"}}}
    assert figures.ttft_goal_notes(reports) == [
        f"Going down (`{DOWN}`), the default recipe `top4:refresh@64/p32` runs 8.9x faster than the target's prefill "
        f"at 2048 tokens in `ttft-{DOWN}.json`, under the 10x goal (`benchmarks.recipe_budget.TTFT_GOALS`): its "
        "passes over the target's weights (probe / recompute / first token: 0.29 / 0.47 / 0.15 s) make most of its "
        "1.04 s, against a prefill of 9.28 s."]  # no sweep file: nothing said of one; 8192 meets its 30x
    (tmp_path / f"ttft-{DOWN}-sweep.json").write_text("{}")
    assert figures.ttft_goal_notes(reports)[0].endswith(
        f"The TTFT sweep that set its budget (`ttft-{DOWN}-sweep.json`, on the top4 maps) measured 11.2x [7.7x, "
        "11.9x] against a prefill of 13.96 s.")
    slow = {"maps": "top4", "rows": [{"context": 2048, "full": {"median": 12.33}, "recipes": {
        "refresh@64/p32": {"budget": 64, "speedup": 9.2, "speedup_min": 8.8, "speedup_max": 9.8}}}]}
    files[f"ttft-{DOWN}-sweep"] = {**slow, "earlier_runs": [files[f"ttft-{DOWN}-sweep"]]}  # a run missing the goal
    assert figures.ttft_goal_notes(reports)[0].endswith(
        f"Its TTFT sweep (`ttft-{DOWN}-sweep.json`, on the top4 maps) found no budget that meets every goal in each of "
        "its 2 run(s), so the recipes kept the published recipe's budget; its latest run measured this recipe at 9.2x "
        "[8.8x, 9.8x] against a prefill of 12.33 s.")
    files[f"ttft-{DOWN}"]["maps"] = "top8"  # another lever's maps timed: their speed is not the default's
    assert figures.ttft_goal_notes(reports) == []
    files[f"ttft-{DOWN}"]["maps"] = "top4"
    files[f"ttft-{DOWN}"]["rows"][0]["recipe_name"] = "top4:refresh@96/p64"  # a recipe that is not the default
    assert figures.ttft_goal_notes(reports) == []
    files[f"ttft-{DOWN}"]["rows"][0]["recipe_name"] = "top4:refresh@64/p32"
    files[f"ttft-{DOWN}"]["rows"][0]["speedup_recipe"] = 10.0
    assert figures.ttft_goal_notes(reports) == []


def test_a_cards_recipe_speedup_is_the_default_recipes_own(results):
    """A TTFT row timed for another recipe (the default changed since) gives the card no recipe speedup."""
    timed = common.read_results(f"ttft-{UP}")["rows"][0]["recipe_name"]
    assert "ttft.speedup_recipe_2048" in figures.ttft_figures(f"ttft-{UP}", recipe=timed)
    maps = timed.rpartition(":")[0]
    other = figures.ttft_figures(f"ttft-{UP}", recipe=f"{maps}:hybrid@160")  # the same maps, another recipe
    assert "ttft.speedup_recipe_2048" not in other and "ttft.speedup_cold_2048" in other
    assert figures.ttft_figures(f"ttft-{UP}", recipe="top8:refresh@64/p32") == {}  # other maps: none of their times


def test_the_final_texts_report_a_default_only_on_the_maps_the_selection_texts_chose_it_on(results):
    m1, m2 = (hashlib.sha256(weights).hexdigest()[:16] for weights in (b"m1", b"m2"))  # two fits' fingerprints
    selection = _report(results, "selection", ACCURACY, weights=b"m1")
    assert selection["directions"]["up"]["choice"]["fingerprint"] == m1
    assert _report(results, "final", ACCURACY, weights=b"m1")["directions"]["up"]["default"] == "index@160/p40"
    with pytest.raises(RecordError, match=f"chose 'index@160/p40' on maps {m1}, the final texts run {m2}"):
        _report(results, "final", ACCURACY, weights=b"m2")  # the maps were refitted in between
    with pytest.raises(RecordError, match=f"on maps {m1}"):  # and a final run refuses before computing anything
        recipes.check_chosen_maps("up", "index@160/p40", m2)
    facts = {"folder": str(results / "maps" / "m1"), "fingerprint": m1, "multiply_adds_per_token": 100}
    (results / "sibling-recipes" / "runs.jsonl").write_text(
        json.dumps({"role": "selection", "context": 2048, "planned": PLAN, "map_sets": {"published": {"up": facts}}}) + "\n")
    assert recipe_report.report("selection", 2048)["directions"]["up"]["default"] == "index@160/p40"  # m1 is held
    written = (results / "sibling-recipes-selection-2048.json").read_text()
    (results / "maps" / "m1" / "model.safetensors").write_bytes(b"m3")  # refitted over the chosen maps' folder
    with pytest.raises(RecordError, match="index@160/p40 is the best candidate, but no folder holds the maps"):
        recipe_report.report("selection", 2048)  # (a clone without the maps alike): never a runner-up chosen
    assert (results / "sibling-recipes-selection-2048.json").read_text() == written


def test_a_workdir_fitted_with_other_options_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """The capture stage skips when its scale folders exist: folders of other calibration options (a change of
    siblings.CONFIG since) would be published as these, so they are refused by name."""
    publisher = publish.Publisher(tmp_path / "work", scales=(8,))
    monkeypatch.setattr(publisher, "sibling_models", lambda: pytest.fail("a model loaded"))
    folder = publisher.scale_folder(8, "down")
    folder.mkdir(parents=True)
    shutil.copy(common.ROOT / "hub_cards" / DOWN / "config.json", folder)  # top-4 maps: not siblings.CONFIG's top-2
    with pytest.raises(SystemExit, match="other calibration options"):
        publisher.capture()
    lever = publisher.lever_folder("top1", "down")  # the levers stage resumes on its folders alike
    lever.mkdir(parents=True)
    shutil.copy(common.ROOT / "hub_cards" / DOWN / "config.json", lever)
    with pytest.raises(SystemExit, match="levers/top1"):
        publisher.levers()


def test_adapter_maps_fitted_on_other_data_are_refused_before_any_model_loads(tmp_path, monkeypatch):
    """The adapter stage skips when its folders exist: the published configs record the data this code fits on (so
    they are taken as fitted), and a folder fitted on other data is refused by name."""
    publisher = publish.Publisher(tmp_path / "work", scales=(8,))
    monkeypatch.setattr(publisher, "adapter_model", lambda: pytest.fail("a model loaded"))
    names = [p.name for p in (common.ROOT / "hub_cards").iterdir() if p.name.startswith(publish.PREFIX)]
    assert len(names) == 2 * len(publish.ADAPTERS)
    for name in names:
        (tmp_path / "work" / "adapters" / name).mkdir(parents=True)
        shutil.copy(common.ROOT / "hub_cards" / name / "config.json", tmp_path / "work" / "adapters" / name)
    publisher.calibrate_adapters()
    config = tmp_path / "work" / "adapters" / names[0] / "config.json"
    data = json.loads(config.read_text())
    data["calibration"]["data"]["description"] += " (another split)"
    config.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=f"{names[0]} was fitted on other data"):
        publisher.calibrate_adapters()


def test_a_report_takes_its_budget_from_the_runs_whose_records_it_holds_and_its_plan_from_the_latest(results):
    """A run that stopped before its first record (or one that found everything measured) adds no record: the budget
    the records were compared at is the runs' that wrote them; what a complete run scores is the latest plan (the
    next run's examples), and a line cut short mid-write is skipped."""
    folder = results / "maps" / "published"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"published")
    map_print = common.map_fingerprint(folder)
    records = [{**r, "run": "r1"} for r in _records("selection", ACCURACY, map_print)]
    (results / "sibling-recipes" / "selection-2048.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    facts = {"published": {"up": {"folder": str(folder), "fingerprint": map_print, "multiply_adds_per_token": 100}}}
    measured = {"run": "r1", "role": "selection", "context": 2048, "budgets": {"up": 160}, "planned": PLAN,
                "map_sets": facts}
    stopped = {"run": "r2", "role": "selection", "context": 2048, "budgets": {"up": 64},
               "planned": {**PLAN, "continuation": 7}}
    (results / "sibling-recipes" / "runs.jsonl").write_text(
        json.dumps(measured) + "\n" + json.dumps(stopped) + "\n" + json.dumps(measured)[:30])
    with pytest.raises(RecordError, match="fewer examples than the control or the run planned"):
        recipe_report.report("selection", 2048)  # the latest plan: 7 continuation windows, 6 measured
    stopped["planned"] = PLAN
    (results / "sibling-recipes" / "runs.jsonl").write_text(
        json.dumps(measured) + "\n" + json.dumps(stopped) + "\n" + json.dumps(measured)[:30])
    payload = recipe_report.report("selection", 2048)
    assert payload["directions"]["up"]["budget"] == 160 and payload["directions"]["up"]["planned"]["continuation"] == 6
    assert [run["run"] for run in common.read_results("sibling-recipes-selection-2048")["runs"]] == ["r1", "r2"]
    assert payload["directions"]["up"]["default"] == "index@160/p40"  # complete on the plan


def test_a_cards_ttft_figures_carry_the_goals_their_run_recorded(monkeypatch):
    """A TTFT run that records its goals gives a card the goal beside each speedup it judges (a missed goal shows)."""
    payload = {"maps": "published", "goals": {"2048": 10, "8192": 30},
               "rows": [{"context": 2048, "speedup_cold": 12.0, "speedup_recipe": 8.9, "recipe_name": "refresh@64/p32"}]}
    monkeypatch.setattr(figures, "results", lambda stem: payload)
    got = figures.ttft_figures("ttft-x", recipe="refresh@64/p32")
    assert got["ttft.speedup_recipe_2048"].value == 8.9 and got["ttft.goal_speedup_2048"].value == 10
    assert got["ttft.goal_speedup_8192"].key == "goals/8192"
    del payload["goals"]
    assert not [name for name in figures.ttft_figures("ttft-x", recipe="refresh@64/p32") if "goal" in name]

