"""The published maps (hub_cards/) and the README's figures: every figure in a card's config.json equals the value in
the results file it cites, which records its provenance; calibration data is described truthfully; every map
carries a finite predicted retention; the README's table is the one the results files give."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from peft_kvcache import KVMap
from peft_kvcache.lab.provenance import lookup

ROOT = Path(__file__).resolve().parents[1]
CARDS = sorted(p for p in (ROOT / "hub_cards").iterdir() if p.is_dir())
PROVENANCE = {"commit", "dirty", "command", "date", "machine", "cpu", "cores", "torch_threads", "versions", "data"}


@pytest.fixture(params=CARDS, ids=lambda p: p.name)
def card(request) -> tuple[Path, KVMap]:
    return request.param, KVMap.from_pretrained(request.param)


def test_there_are_published_maps_of_both_kinds():
    kinds = {KVMap.from_pretrained(p).config.pair_kind for p in CARDS}
    from benchmarks.common import ADAPTERS

    assert kinds == {"same_shape", "cross_shape"} and len(CARDS) == 2 + 2 * len(ADAPTERS)  # both ways per adapter


def test_every_figure_equals_the_results_file_it_cites(card):
    folder, kv_map = card
    figures = kv_map.config.quality.figures
    assert figures, "a published map carries measured figures"
    for name, figure in figures.items():
        results = json.loads((ROOT / figure.results).read_text())
        assert PROVENANCE <= set(results["provenance"]), f"{figure.results} lacks provenance"
        assert results["provenance"]["commit"], f"{figure.results} records no commit"
        assert lookup(results, figure.key) == figure.value, name


def test_every_map_carries_a_finite_prediction_from_texts_it_was_not_fitted_on(card):
    _, kv_map = card
    gate = kv_map.config.quality.gate
    assert gate is not None and math.isfinite(gate.predicted_retention)
    assert set(gate.data.names()).isdisjoint(kv_map.config.calibration.data.names())


def test_calibration_data_is_described_truthfully(card):
    _, kv_map = card
    record = kv_map.config.calibration
    names = record.data.names()
    assert len(names) == len(set(names)), "every text is named once"
    files = [n for n in names if not n.startswith("chat:")]
    match = re.search(r"(\d+) distinct files", record.data.description)
    assert match and int(match.group(1)) == len(files)
    assert sum(t.tokens for t in record.data.texts) >= record.train_tokens + record.heldout_tokens
    if kv_map.config.pair_kind == "cross_shape":
        assert len(files) >= 64 and record.train_tokens + record.heldout_tokens >= 32_000


def test_the_card_shows_the_configs_figures(card):
    folder, kv_map = card
    text = (folder / "README.md").read_text()
    for name, figure in kv_map.config.quality.figures.items():
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


def test_the_timed_calibrate_adapters_command_is_the_readmes_and_parses():
    from benchmarks.calibrate_time import readme_command
    from peft_kvcache.cli import build_parser

    words = readme_command()
    args = build_parser().parse_args(words[1:])  # argparse exits on a word the CLI does not take
    assert args.command == "calibrate-adapters" and args.num_files == 44, args
