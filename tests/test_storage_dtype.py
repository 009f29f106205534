"""The storage-dtype benchmark: its two variants differ by the stored weights' rounding alone, on any CPU; its table
says when a map read from a file already stored in bfloat16 compares bfloat16 with itself (its zero difference is no
evidence about rounding)."""

from __future__ import annotations

import os

import torch
from conftest import random_ids

from benchmarks import storage
from peft_kvcache.maps.compute import ENVIRONMENT
from peft_kvcache.maps.config import weights_dtype


def _results(read_as: dict[str, str]) -> dict:
    difference = {"difference": 0.0, "low": 0.0, "high": 0.0}
    maps = {name: {"rows": [{"variant": "float32", "kl": 0.5}], "kl_bfloat16_minus_float32": difference,
                   "choice": "bfloat16", "weights_read_as": dtype} for name, dtype in read_as.items()}
    return {"maps": maps, "choice": {name: "bfloat16" for name in read_as}}


def test_a_map_read_in_bfloat16_is_flagged_and_one_read_in_float32_is_not(sibling_map):
    assert weights_dtype(sibling_map.tensors) == "float32"
    assert weights_dtype(sibling_map.with_weights_dtype(torch.bfloat16).tensors) == "bfloat16"
    text = storage.markdown(_results({"published": "bfloat16", "fitted": "float32"}))
    assert "| published | bfloat16 |" in text and "| fitted | float32 |" in text
    assert "published: read from files already stored in bfloat16" in text
    assert "already stored" not in storage.markdown(_results({"fitted": "float32"}))


def test_the_variants_differ_by_rounding_where_maps_multiply_in_bfloat16(sibling_pair, sibling_map, monkeypatch):
    # a CPU with native bfloat16 dot products multiplies maps in bfloat16, which rounds a float32 map's weights
    # exactly as storing them would: the check multiplies in float32 there too, and leaves the setting as it was
    monkeypatch.setenv(ENVIRONMENT, "bfloat16")
    report = storage.score(*sibling_pair, sibling_map, random_ids(3, 16 + storage.CONTINUATION), 16, progress=False)
    kl = {r["variant"]: r["kl"] for r in report.rows()}
    assert kl["bfloat16"] != kl["float32"]
    difference = report.paired_difference("bfloat16", "float32", metric="kl")
    assert abs(difference["difference"]) < 0.05 * kl["float32"]
    assert os.environ[ENVIRONMENT] == "bfloat16"


def test_the_first_candidate_within_tolerance_is_chosen_and_float32_where_none_is():
    def within(kl: float) -> dict:
        return {"difference": kl, "low": kl / 2, "high": kl}

    assert storage.choose(1.0, {"bfloat16": within(0.005), "float16": within(0.001)}) == "bfloat16"
    assert storage.choose(1.0, {"bfloat16": within(0.02), "float16": within(0.001)}) == "float16"
    assert storage.choose(1.0, {"bfloat16": within(0.02), "float16": within(0.02)}) == "float32"
    assert storage.choose(1.0, {"bfloat16": within(0.02)}) == "float32"  # float16 left out: a weight out of its range


def test_float16_rounds_less_than_bfloat16_and_a_weight_out_of_its_range_leaves_it_out(sibling_pair, sibling_map):
    examples = random_ids(3, 16 + storage.CONTINUATION)
    kl = {r["variant"]: r["kl"] for r in storage.score(*sibling_pair, sibling_map, examples, 16, progress=False).rows()}
    assert {"float32", "bfloat16", "float16"} <= set(kl)
    assert abs(kl["float16"] - kl["float32"]) < abs(kl["bfloat16"] - kl["float32"])  # three more bits per weight
    huge = sibling_map.with_weights_dtype(torch.float32)
    huge.tensors["keys.0.weight"] = huge.tensors["keys.0.weight"] * 1e6
    scored = {r["variant"] for r in storage.score(*sibling_pair, huge, examples, 16, progress=False).rows()}
    assert {"float32", "bfloat16"} <= scored and "float16" not in scored
