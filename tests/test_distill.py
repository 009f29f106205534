"""Distillation (`peft_kvcache.calibration.distill`): the correction is trained on what inference runs (the map's KV
of the context, the target's own sink, the last tokens computed over them), starts at the ridge map, is kept only
where held-out texts say it lowers the KL, and is folded into weights the ordinary mapping path reads."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import random_ids

from peft_kvcache import KVMap
from peft_kvcache.calibration.distill import distill_map
from peft_kvcache.errors import CalibrationError, RecordError
from peft_kvcache.maps.apply import map_cache
from peft_kvcache.maps.config import Figure
from peft_kvcache.modeling._compat import fill_cache, output_cache
from peft_kvcache.modeling.capture import cache_states, forward, run_with_cache
from peft_kvcache.modeling.layout import layer_placements
from transformers.cache_utils import DynamicCache

RECENT, SCORED = 8, 8


def inference_kl(kv_map, source, target, chunk: torch.Tensor) -> float:
    """The hybrid recipe as inference runs it, no autograd: the map's KV of the context (map_cache), the target's own
    sink, the last RECENT context tokens and SCORED tokens computed over them; KL to the target's own prefill."""
    ids = chunk[None]
    end, sink = ids.shape[1] - RECENT - SCORED, kv_map.config.sink_tokens
    with torch.no_grad():
        own = forward(target, ids, None, logits_to_keep=SCORED)
        teacher = torch.log_softmax(own.logits[0].float(), -1)
        src = run_with_cache(source, ids[:, :end])
        positions = torch.arange(end)[None]
        mapped = map_cache(kv_map, src.keys, src.values, positions, positions, layer_placements(target),
                           compute_dtype=torch.float32)
        pairs = [(torch.cat([own_k[:, :, :sink], k[:, :, sink:]], 2), torch.cat([own_v[:, :, :sink], v[:, :, sink:]], 2))
                 for (own_k, own_v), (k, v) in zip(cache_states(output_cache(own)).pairs(), mapped)]
        out = forward(target, ids[:, end:], fill_cache(DynamicCache(), pairs),
                      position_ids=torch.arange(end, ids.shape[1])[None], logits_to_keep=SCORED)
        student = torch.log_softmax(out.logits[0].float(), -1)
    return float((teacher.exp() * (teacher - student)).sum(-1).mean())


@pytest.fixture(scope="module")
def distilled(sibling_pair, sibling_map):
    """The map distilled on one chunk under 12 names: the held-out texts are copies of the training ones, so training
    the objective must lower the held-out KL (what generalizes is measured on the real pairs: benchmarks/lever_maps)."""
    source, target = sibling_pair
    chunk = random_ids(1, 48, seed=7)[0]
    published = KVMap(copy.deepcopy(sibling_map.config), sibling_map.tensors)
    published.config.quality.figures["continuation"] = Figure(0.9, "results.json", "continuation")
    with torch.no_grad():  # as a benchmark calls it: training turns autograd on for itself
        return chunk, distill_map(published, source, target, [chunk] * 12, rank=4, steps=30, batch_size=1,
                                  learning_rate=3e-3, recent_tokens=RECENT, scored_tokens=SCORED, eval_every=10,
                                  progress=False)


def test_training_lowers_the_kl_inference_measures_and_the_kept_step_is_folded_in(sibling_pair, sibling_map,
                                                                                  distilled):
    source, target = sibling_pair
    chunk, kv_map = distilled
    record = kv_map.config.distillation
    curve = dict(record.heldout_kl)
    before, after = inference_kl(sibling_map, source, target, chunk), inference_kl(kv_map, source, target, chunk)
    assert curve[0] == pytest.approx(before, rel=1e-4)  # step 0 is the ridge map, measured as inference runs it
    # the best step, folded as trained: folding rounds in float32 (a few 1e-4 of a KL this small on some CPUs), far
    # less than a step of training moves it
    assert record.kept_step == 30 and after == pytest.approx(curve[30], abs=before * 1e-3)
    assert after < before / 5
    assert record.train_chunks + record.heldout_chunks == 12
    assert all(p.requires_grad for p in target.parameters())  # frozen only while training
    assert not kv_map.config.quality.figures  # the ridge map's figures do not describe the corrected weights


def test_a_correction_that_does_not_help_is_not_kept(sibling_pair, sibling_map):
    source, target = sibling_pair
    kv_map = distill_map(sibling_map, source, target, random_ids(12, 48), rank=2, steps=2, batch_size=1,
                         learning_rate=10.0, recent_tokens=RECENT, scored_tokens=SCORED, eval_every=1, progress=False)
    record = kv_map.config.distillation
    assert not record.kept  # a learning rate this large only makes things worse
    for name, tensor in sibling_map.tensors.items():
        torch.testing.assert_close(kv_map.tensors[name], tensor)


def test_bad_options_and_short_texts_are_refused_before_any_model_runs(sibling_pair, sibling_map):
    source, target = sibling_pair
    with pytest.raises(CalibrationError, match="positive rank"):
        distill_map(sibling_map, None, None, random_ids(12, 48), rank=0)  # no model is touched
    with pytest.raises(CalibrationError, match="chunks of at least 18 tokens"):
        distill_map(sibling_map, source, target, random_ids(12, 12), recent_tokens=RECENT, scored_tokens=SCORED,
                    progress=False)


def test_a_map_fitted_per_head_shard_is_refused_before_any_model_runs(sibling_map):
    # its correction would mix the shards' heads, which a tensor-parallel engine maps apart
    sharded = copy.deepcopy(sibling_map)
    options = sharded.config.calibration.options
    sharded.config.calibration.options = type(options)(**{**vars(options), "head_shards": 2})
    with pytest.raises(CalibrationError, match="head_shards 2"):
        distill_map(sharded, None, None, random_ids(12, 48))  # no model is touched


def test_the_lever_distills_each_published_map_once_and_resumes(tmp_path, monkeypatch, sibling_pair, sibling_map):
    from benchmarks import lever_maps, siblings

    source, target = sibling_pair
    texts = {f"f{i}.py": ids for i, ids in enumerate(random_ids(12, 48))}
    models = {"small": source, "large": target}
    for direction, (src, tgt) in siblings.DIRECTIONS.items():
        kv_map = sibling_map if (src, tgt) == ("small", "large") else \
            KVMap.calibrate(models[src], models[tgt], texts, progress=False)
        kv_map.save_pretrained(tmp_path / "levers" / "capture" / siblings.pair_name(direction), chart=False)
    monkeypatch.setattr(lever_maps, "LEVERS", tmp_path / "levers")
    monkeypatch.setattr(siblings, "load_pair", lambda: (models, None))
    monkeypatch.setattr(lever_maps, "stdlib_texts", lambda split, files: dict(list(texts.items())[:files]))
    options = {"rank": 2, "steps": 2, "learning_rate": 1e-3}
    monkeypatch.setitem(lever_maps.ADDITIONS, "distill", lambda *a, **k: distill_map(*a, recent_tokens=RECENT,
                                                                                       scored_tokens=SCORED, **k))
    folder = lever_maps.add_to_maps("distill", "distill", options, files=12, on="capture", progress=False)
    for direction in siblings.DIRECTIONS:
        assert KVMap.from_pretrained(folder / siblings.pair_name(direction)).config.distillation.rank == 2
    monkeypatch.setattr(siblings, "load_pair", lambda: pytest.fail("both directions are done: nothing runs again"))
    assert lever_maps.add_to_maps("distill", "distill", options, files=12, on="capture", progress=False) == folder
    with pytest.raises(RecordError, match="made otherwise"):
        lever_maps.add_to_maps("distill", "distill", {**options, "rank": 4}, files=12, on="capture", progress=False)
    with pytest.raises(RecordError, match="fitted on 12 files, not 5"):
        lever_maps.add_to_maps("other", "distill", options, files=5, on="capture", progress=False)
    # the maps it added to fitted again since: what was done from the old ones is not resumed as theirs
    up = tmp_path / "levers" / "capture" / siblings.pair_name("up")
    KVMap.calibrate(source, target, dict(list(texts.items())[:10]), progress=False).save_pretrained(up, chart=False)
    with pytest.raises(RecordError, match="made otherwise"):
        lever_maps.add_to_maps("distill", "distill", options, files=12, on="capture", progress=False)
    # on a lever's maps (the distilled ones here): read from runs/levers/<on>, said in lever.json
    monkeypatch.setattr(siblings, "load_pair", lambda: (models, None))
    given = []
    monkeypatch.setitem(lever_maps.ADDITIONS, "distill", lambda kv_map, *a, **k: given.append(kv_map) or kv_map)
    on_lever = lever_maps.add_to_maps("again", "distill", options, files=12, on="distill", progress=False)
    assert [m.config.distillation.rank for m in given] == [2, 2]  # the lever's (distilled) maps, not the published
    assert json.loads((on_lever / siblings.pair_name("up") / "lever.json").read_text())["on"] == "distill"
    with pytest.raises(RecordError, match="write over"):
        lever_maps.add_to_maps("distill", "distill", options, files=12, on="distill", progress=False)
    with pytest.raises(RecordError, match="fit the 'missing' lever first"):
        lever_maps.add_to_maps("third", "distill", options, files=12, on="missing", progress=False)

    def with_basis(folder):  # maps whose layers read a shared basis (a basis_rank fit)
        kv_map = KVMap.from_pretrained(folder)
        kv_map.config.calibration.options.basis_rank = 4
        return kv_map

    monkeypatch.setattr(lever_maps, "KVMap", SimpleNamespace(from_pretrained=with_basis))
    monkeypatch.setattr(siblings, "load_pair", lambda: pytest.fail("refused before any model loads"))
    with pytest.raises(RecordError, match="reads a shared basis"):
        lever_maps.add_to_maps("heads", "nonlinear", {}, files=12, on="distill", progress=False)


def test_the_card_says_what_was_distilled_and_what_it_gained(distilled):
    from peft_kvcache.maps.card import render_card

    _, kv_map = distilled
    curve = dict(kv_map.config.distillation.heldout_kl)
    text = render_card(kv_map.config, "org/map").content
    assert "a rank-4 correction of every layer" in text
    assert f"the correction of step 30 is folded into the weights (held-out KL {curve[0]:.4f} -> {curve[30]:.4f})" \
        in text
