"""The published maps (hub_cards/) and the README's figures: every figure in a card's config.json equals the value in
the results file it cites, which records its provenance; calibration data is described truthfully; every map
carries a finite predicted retention; the README's table is the one the results files give. The cards are read from
their config.json: a map whose weights are over git's limit keeps them out of git (they are here where they were
fitted), and every weights file present loads with its config."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from peft_kvcache import KVMap
from peft_kvcache.lab.provenance import lookup
from peft_kvcache.maps.config import KVMapConfig
from peft_kvcache.maps.storage import WEIGHTS_NAME, load_config

ROOT = Path(__file__).resolve().parents[1]
CARDS = sorted(p for p in (ROOT / "hub_cards").iterdir() if p.is_dir())
PROVENANCE = {"commit", "dirty", "command", "date", "machine", "cpu", "cores", "torch_threads", "versions", "data"}


@pytest.fixture(params=CARDS, ids=lambda p: p.name)
def card(request) -> tuple[Path, KVMapConfig]:
    return request.param, load_config(request.param)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)


def test_weights_over_the_git_limit_stay_out_of_git_on_purpose_and_every_present_file_loads():
    from scripts.publish import GIT_WEIGHTS_LIMIT

    listed = _git("ls-files", "-z", "hub_cards")
    if listed.returncode:
        pytest.skip("not a git checkout")
    tracked = set(listed.stdout.split("\0")) - {""}
    assert all((ROOT / path).stat().st_size <= GIT_WEIGHTS_LIMIT for path in tracked)
    for folder in CARDS:
        weights = (folder / WEIGHTS_NAME).relative_to(ROOT).as_posix()
        if weights not in tracked:  # left out on purpose (.gitignore names it), never forgotten
            assert _git("check-ignore", "-q", "--no-index", weights).returncode == 0, weights
        if (folder / WEIGHTS_NAME).is_file():
            assert KVMap.from_pretrained(folder).config.to_dict() == load_config(folder).to_dict()


def test_there_are_published_maps_of_both_kinds():
    kinds = {load_config(p).pair_kind for p in CARDS}
    from benchmarks.common import ADAPTERS

    assert kinds == {"same_shape", "cross_shape"} and len(CARDS) == 2 + 2 * len(ADAPTERS)  # both ways per adapter


def test_every_figure_equals_the_results_file_it_cites(card):
    folder, config = card
    figures = config.quality.figures
    assert figures, "a published map carries measured figures"
    for name, figure in figures.items():
        results = json.loads((ROOT / figure.results).read_text())
        assert PROVENANCE <= set(results["provenance"]), f"{figure.results} lacks provenance"
        assert results["provenance"]["commit"], f"{figure.results} records no commit"
        assert lookup(results, figure.key) == figure.value, name


def test_every_map_carries_a_finite_prediction_from_texts_it_was_not_fitted_on(card):
    _, config = card
    gate = config.quality.gate
    assert gate is not None and math.isfinite(gate.predicted_retention)
    assert set(gate.data.names()).isdisjoint(config.calibration.data.names())


def test_calibration_data_is_described_truthfully(card):
    _, config = card
    record = config.calibration
    names = record.data.names()
    assert len(names) == len(set(names)), "every text is named once"
    files = [n for n in names if not n.startswith("chat:")]
    match = re.search(r"(\d+) distinct files", record.data.description)
    assert match and int(match.group(1)) == len(files)
    assert sum(t.tokens for t in record.data.texts) >= record.train_tokens + record.heldout_tokens
    if config.pair_kind == "cross_shape":
        assert len(files) >= 64 and record.train_tokens + record.heldout_tokens >= 32_000


def test_the_card_shows_the_configs_figures(card):
    folder, config = card
    text = (folder / "README.md").read_text()
    for name, figure in config.quality.figures.items():
        assert f"| {name} | {figure.value:.4g} | `{figure.results}` |" in text


def test_the_readme_tables_are_the_ones_the_results_give():
    from scripts import figures

    text = (ROOT / "README.md").read_text()
    for begin, end, render in figures.README_BLOCKS:
        assert text[text.index(begin) + len(begin): text.index(end)].strip() == render().strip()


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results").glob("*.json")), ids=lambda p: p.name)
def test_results_record_their_command_as_a_reader_would_type_it(path):
    command = json.loads(path.read_text())["provenance"]["command"]
    assert command.startswith("python -m ") and str(ROOT) not in command and " /" not in command, command


def test_every_ratio_where_the_server_does_worse_is_said():
    from scripts.figures import serve_losses

    ratios = {"a/b": {"ttft_p50": 0.5, "ttft_p95": 1.3, "compute_ttft_p50": 1.0, "compute_ttft_p95": 0.9,
                      "tokens_per_second": 0.8},
              "a/c": {"ttft_p50": 0.5, "ttft_p95": 0.6, "compute_ttft_p50": 0.7, "compute_ttft_p95": 0.9,
                      "tokens_per_second": 1.2}}
    assert serve_losses(ratios) == "\n\nWhere this server did worse in this run: a/b: TTFT p95 x1.30, throughput x0.80."
    assert serve_losses({"a/c": ratios["a/c"]}) == ""


def test_the_adapter_maps_that_naive_reuse_beat_are_named():
    from scripts.figures import adapter_losses

    said = adapter_losses([("a-to-b", 0.98, 1.35, 0.05, 0.2), ("b-to-a", 0.99, 0.95, 0.05, 0.04)])
    assert "naive reuse kept more normalized retention than the map on 1 of 2 adapter maps: a-to-b (0.980 against " \
           "1.350)" in said and "a lower KL than the map on 1 of 2: b-to-a (0.050 against 0.040)" in said
    assert "all 1" in adapter_losses([("a-to-b", 0.99, 0.95, 0.05, 0.2)])


def test_the_vllm_targets_are_judged_from_the_figures():
    from scripts.vllm_targets import load_targets, switch_cost_targets

    def stat(mean, low, high, runs=()):
        return {"mean": mean, "low": low, "high": high, "runs": list(runs)}

    servers = {name: {key: stat(value, value, value) for key, value in zip(
        ("switch_ttft_p50", "cold_switch_ttft_median", "warm_switch_ttft_p50", "warm_switch_ttft_p95",
         "tokens_per_second"), values)} for name, values in (("a", (2.3, 4.1, 1.4, 4.7, 10.3)),
                                                              ("b", (2.0, 4.9, 1.8, 4.3, 10.4)))}
    load = {"closed_loop": {"ratios": {"a/c": {"switch_ttft_p50": stat(0.08, 0.04, 0.11, (0.06, 0.12, 0.07))}},
                            "servers": servers},
            "streams": {"a": {"p95_ratio": stat(1.1, 1.0, 1.2)}}}
    said = load_targets(load)
    assert ("(b) naive sharing did better than (a) on switch TTFT p50 (2.00 against 2.30), warm switch TTFT p95 "
            "(4.30 against 4.70), tokens/s (10.40 against 10.30)") in said
    assert "under 1/10 in 2 of 3 runs (the interval's upper end past it), under 1/20 in 0 of 3 runs" in said
    assert "the 1.25x target met" in said and "open loop" not in said
    cost = {"streams": {"p95_ratio": stat(2.4, 1.6, 3.2), "switch_to_own_p95_ratio": stat(1.3, 1.1, 1.5),
                        "none": {"itl_p95": 0.3}, "switch": {"itl_p95": 0.8}},
            "own_cache": {"mapped_to_own": {"max": 1.6}, "mapped_kl": stat(0.0078, 0.0077, 0.0079)},
            "setup": {"repeats": 5}}
    said = switch_cost_targets(cost)
    assert "the 1.25x target missed" in said and "the interval excludes 1, its upper end past 1.25x" in said
    assert "at most 1.60x over 5 repeats (past 1.5x in at least one)" in said


def test_the_timed_calibrate_adapters_command_is_the_readmes_and_parses():
    from benchmarks.calibrate_time import readme_command
    from peft_kvcache.cli import build_parser

    words = readme_command()
    args = build_parser().parse_args(words[1:])  # argparse exits on a word the CLI does not take
    assert args.command == "calibrate-adapters" and args.num_files == 44, args


def test_a_gate_says_how_many_files_it_measured_on():
    from benchmarks.gates import gate_data

    data = gate_data({"a.py": "", "b.py": ""}, 128)
    assert "2 distinct files of" in data.description and "files 128..129" in data.description
    assert [text.name for text in data.texts] == ["a.py", "b.py"]


def test_a_gate_on_texts_a_map_was_fitted_on_is_refused():
    """The quality gate predicts retention on text the map never saw: a gate text among its calibration files is
    refused by name (the gate's skip and the capture's file count are set apart in two places)."""
    from benchmarks.gates import FILES, disjoint
    from peft_kvcache.lab.corpus import stdlib_texts
    from scripts.publish import ADAPTER_FILES, BLEND_FILES

    kv_map = KVMap.from_pretrained(ROOT / "hub_cards" / "smollm2-135m-instruct-base-to-shout")
    fitted = [text.name for text in kv_map.config.calibration.data.texts]
    with pytest.raises(SystemExit, match=re.escape(fitted[0])):
        disjoint({fitted[0]: "", "elsewhere.py": ""}, kv_map, "base -> shout")
    # the files the publish run gates the adapter maps on
    disjoint(stdlib_texts("calibration", FILES, ADAPTER_FILES + BLEND_FILES), kv_map, "base -> shout")


def test_every_publish_stage_is_a_step_with_its_own_products():
    """A stage the table names runs the `Publisher` method of its name, and no two stages make the same results file
    or artifact (which run wrote a file would otherwise depend on the stages chosen)."""
    from scripts.publish import STAGES, Publisher

    assert [s.name for s in STAGES if not callable(getattr(Publisher, s.name, None))] == []
    made = [item for stage in STAGES for item in stage.makes]
    assert len(made) == len(set(made))
