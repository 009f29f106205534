"""The refresh (target recomputes the context tokens its new tokens attend to), on tiny random models."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model

from peft_kvcache import MappedCache
from peft_kvcache.calibration.retention import evaluate_retention
from peft_kvcache.errors import CacheMismatchError, RecordError
from peft_kvcache.maps.config import Refresh
from peft_kvcache.modeling._compat import attention_implementation, with_cache
from peft_kvcache.modeling.capture import run_with_cache
from peft_kvcache.runtime.refresh import attention_scores, refresh_positions, select_spans


def _plain(cache: MappedCache) -> MappedCache:
    """The mapped context without its next positions (the refresh's own passes do not continue the context)."""
    return MappedCache(cache.captured())


def _max_error(cache, own) -> float:
    return max(float((layer.keys - k).abs().max()) + float((layer.values - v).abs().max())
               for layer, k, v in zip(cache.layers, own.keys, own.values))


def test_refreshing_every_position_gives_the_targets_own_prefill(sibling_pair, sibling_map):
    source, target = sibling_pair
    ids = random_ids(1, 30, seed=5)[0][None]
    cache = _plain(MappedCache.from_source(source, sibling_map, target, input_ids=ids))
    own = run_with_cache(target, ids)
    assert _max_error(cache, own) > 1e-2  # the map is approximate...
    refresh_positions(target, cache, ids, torch.arange(1, 30))
    assert cache.get_seq_length() == 30
    assert _max_error(cache, own) < 1e-5  # ...and a refresh of everything past the (exact) sink is exact


def test_a_refresh_on_sdpa_attention_is_exact_and_copies_no_kv_head(monkeypatch):
    # transformers' SDPA repeats every KV head for each query head it serves whenever a mask is given; the refresh
    # pass gives one, and on the CPU runs torch's grouped SDPA instead (`_compat.masked_attention`)
    import transformers.integrations.sdpa_attention as sdpa

    model = tiny_model("qwen2", seed=3)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped heads: the case at stake
    ids, other = random_ids(2, 30, seed=5)
    ids = ids[None]
    stale = run_with_cache(model, other[None])  # a cache of other tokens: every refreshed position changes
    chosen = torch.tensor([2, 3, 11, 12, 20])
    eager = MappedCache(stale)
    refresh_positions(model, eager, ids, chosen, append_ids=ids[:, -2:])
    repeats = []
    repeat_kv = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda *a: repeats.append(1) or repeat_kv(*a))
    model.set_attn_implementation("sdpa")
    grouped = MappedCache(stale)
    refresh_positions(model, grouped, ids, chosen, append_ids=ids[:, -2:])
    assert attention_implementation(model) == "sdpa"  # put back
    assert _max_error(grouped, eager.captured()) < 1e-5
    assert (grouped.layers[-1].keys[:, :, chosen] - stale.keys[-1][:, :, chosen]).abs().amin() > 0  # refreshed
    assert not repeats
    failing = MappedCache(stale)
    with pytest.raises(RuntimeError, match="out of memory"):  # a pass that fails midway puts SDPA back too
        handle = model.model.layers[-1].register_forward_pre_hook(_out_of_memory)
        try:
            refresh_positions(model, failing, ids, chosen)
        finally:
            handle.remove()
    assert attention_implementation(model) == "sdpa"
    model.set_attn_implementation("eager")  # the other implementations are left alone
    refresh_positions(model, MappedCache(stale), ids, chosen)
    assert attention_implementation(model) == "eager" and not repeats


def test_a_refresh_on_an_attention_that_cannot_take_its_mask_runs_sdpa_for_the_pass():
    # FlashAttention, and any kernel registered with transformers, reads a 4D mask as a padding mask (wrong attention,
    # or an out-of-range gather on CUDA): the refresh pass runs grouped SDPA instead, and the kernel runs the rest
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    calls = []

    def padding_mask_only(module, query, key, value, attention_mask, **kwargs):
        calls.append(attention_mask is not None and attention_mask.dim() == 4)
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=query.shape[2] > 1, **kwargs)

    AttentionInterface.register("padding_mask_only_test", padding_mask_only)
    AttentionMaskInterface.register("padding_mask_only_test", flash_attention_mask)
    model = tiny_model("qwen2", seed=3)
    ids, other = random_ids(2, 30, seed=5)
    ids = ids[None]
    stale = run_with_cache(model, other[None])
    chosen = torch.tensor([2, 3, 11, 12, 20])
    eager = MappedCache(stale)
    refresh_positions(model, eager, ids, chosen, append_ids=ids[:, -2:])
    model.set_attn_implementation("padding_mask_only_test")
    try:
        kernel = MappedCache(stale)
        refresh_positions(model, kernel, ids, chosen, append_ids=ids[:, -2:])
        assert not calls and attention_implementation(model) == "padding_mask_only_test"  # put back
        assert _max_error(kernel, eager.captured()) < 1e-5
        model(ids)
        assert calls  # the model's own passes still run the kernel
    finally:
        model.set_attn_implementation("eager")


def _out_of_memory(module, args):
    raise RuntimeError("out of memory")


def test_refresh_changes_only_the_chosen_positions(sibling_pair, sibling_map):
    source, target = sibling_pair
    ids = random_ids(1, 30, seed=6)[0][None]
    cache = _plain(MappedCache.from_source(source, sibling_map, target, input_ids=ids))
    before = [layer.keys.clone() for layer in cache.layers]
    chosen = torch.tensor([3, 4, 17])
    refresh_positions(target, cache, ids, chosen)
    for layer, old in zip(cache.layers, before):
        changed = (layer.keys != old).any(-1).any(1)[0]
        assert changed.nonzero().flatten().tolist() == chosen.tolist()
    with pytest.raises(CacheMismatchError, match="sorted"):
        refresh_positions(target, cache, ids, torch.tensor([5, 2]))
    with pytest.raises(CacheMismatchError, match="token ids"):
        refresh_positions(target, cache, ids[:, :10], chosen)


@pytest.mark.parametrize("failing_pass", [0, 1])  # the probe's scoring pass, then the recompute pass
def test_a_refresh_that_fails_midway_leaves_the_cache_as_it_was(sibling_pair, sibling_map, failing_pass):
    from peft_kvcache.runtime.refresh import refresh_cache

    source, target = sibling_pair
    ids = random_ids(1, 30, seed=7)[0][None]
    cache = _plain(MappedCache.from_source(source, sibling_map, target, input_ids=ids[:, :-1]))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    passes = []

    def fail_on_the_last_layer(module, args):
        passes.append(1)
        if len(passes) > failing_pass:
            raise RuntimeError("out of memory")

    handle = target.model.layers[-1].register_forward_pre_hook(fail_on_the_last_layer)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            refresh_cache(target, cache, ids[:, :-1], Refresh(tokens=4, probe_tokens=3))
    finally:
        handle.remove()
    assert len(passes) == failing_pass + 1  # it failed in the pass asked for, after the first layers had run
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_a_refresh_whose_move_into_place_fails_leaves_the_cache_as_it_was(sibling_pair, sibling_map, monkeypatch):
    from peft_kvcache.runtime import refresh

    source, target = sibling_pair
    ids = random_ids(1, 30, seed=8)[0][None]
    cache = _plain(MappedCache.from_source(source, sibling_map, target, input_ids=ids))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]

    def fail(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(refresh, "_move_into_place", fail)  # after the pass appended its tokens
    with pytest.raises(RuntimeError, match="out of memory"):
        refresh_positions(target, cache, ids, torch.tensor([3, 4, 17]), append_ids=ids[:, :2])
    assert cache.get_seq_length() == 30
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_attention_scores_match_the_models_own_attention_and_leave_cache_and_model_as_they_were():
    model = tiny_model("llama", seed=2)
    model.set_attn_implementation("sdpa")
    ids = random_ids(1, 24, seed=7)[0][None]
    cache = MappedCache(run_with_cache(model, ids[:, :20]))
    scores = attention_scores(model, cache, ids[:, 20:])
    assert cache.get_seq_length() == 20 and attention_implementation(model) == "sdpa"
    model.set_attn_implementation("eager")
    attentions = model(ids, output_attentions=True).attentions
    expected = torch.stack([a[0, :, -1, :20].amax(dim=0) for a in attentions]).mean(0)
    assert torch.allclose(scores, expected, atol=1e-5)


def test_attention_scores_copy_no_kv_head_and_equal_transformers_eager(monkeypatch):
    # transformers' eager attention (the only one returning weights) repeats every KV head once per query head it
    # serves; the probe pass runs `_compat._grouped_eager`, which multiplies each KV head against its block of queries
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    model = tiny_model("qwen2", seed=3)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped heads: the case at stake
    ids = random_ids(1, 24, seed=7)[0][None]
    attentions = model(ids, output_attentions=True).attentions  # transformers' own eager attention
    expected = torch.stack([a[0, :, -4:, :20].amax(dim=0) for a in attentions]).mean(0)
    repeats = []
    repeat_kv = qwen2.repeat_kv
    monkeypatch.setattr(qwen2, "repeat_kv", lambda *a: repeats.append(1) or repeat_kv(*a))
    model.set_attn_implementation("sdpa")
    cache = MappedCache(run_with_cache(model, ids[:, :20]))
    scores = attention_scores(model, cache, ids[:, 20:], every_probe_token=True)
    assert torch.allclose(scores, expected, atol=1e-6) and not repeats
    assert attention_implementation(model) == "sdpa" and cache.get_seq_length() == 20


def test_a_refresh_leaves_a_copy_of_the_cache_as_it_was(sibling_pair, sibling_map):
    # the refresh moves the recomputed entries into place within the pass's own tensors, never a tensor a copy shares
    source, target = sibling_pair
    ids = random_ids(1, 30, seed=8)[0][None]
    cache = _plain(MappedCache.from_source(source, sibling_map, target, input_ids=ids))
    twin = cache.copy()
    before = [(layer.keys.clone(), layer.values.clone()) for layer in twin.layers]
    refresh_positions(target, cache, ids, torch.tensor([3, 4, 17]), append_ids=ids[:, -3:])
    assert cache.get_seq_length() == 33
    for layer, (keys, values) in zip(twin.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_select_spans_follows_the_scores_within_the_budget():
    scores = torch.zeros(40)
    scores[0], scores[20], scores[9] = 5.0, 1.0, 0.5  # position 0 is the sink: never chosen
    chosen = select_spans(scores, budget=8, span=4, first=1)
    assert chosen.tolist() == [8, 9, 10, 11, 19, 20, 21, 22]
    assert select_spans(scores, budget=3, span=4).tolist() == [19, 20, 21]
    assert select_spans(scores, budget=100, span=4).tolist() == list(range(1, 40))
    assert select_spans(scores, budget=0).numel() == 0


@torch.no_grad()
def test_from_source_refresh_covers_the_whole_context_and_continues(sibling_pair, sibling_map):
    source, target = sibling_pair
    ids = random_ids(1, 33, seed=8)[0][None]
    context = ids[:, :-1]
    own_logits = target(ids).logits[0, -1]
    full = MappedCache.from_source(source, sibling_map, target, input_ids=context, refresh_tokens=Refresh(27, 4))
    assert full.get_seq_length() == 32 and full.refresh.positions.tolist() == list(range(1, 28))
    logits = target(ids[:, -1:], **with_cache(target, full), position_ids=torch.tensor([[32]])).logits[0, -1]
    assert torch.allclose(logits, own_logits, atol=1e-4)  # everything refreshed: the target's own prefill

    plain = MappedCache.from_source(source, sibling_map, target, input_ids=context)
    some = MappedCache.from_source(source, sibling_map, target, input_ids=context, refresh_tokens=Refresh(6, 4))
    assert some.refresh.positions.numel() == 6
    def error(cache) -> float:
        return float((target(ids[:, -1:], **with_cache(target, cache)).logits[0, -1] - own_logits).abs().max())

    assert error(some) < error(plain)
    with pytest.raises(CacheMismatchError, match="next tokens start"):
        target(ids, position_ids=torch.arange(33)[None], **with_cache(target, MappedCache.from_source(
            source, sibling_map, target, input_ids=context, refresh_tokens=Refresh(6, 4))))


def test_the_switch_passes_skip_the_vocabulary_projection(sibling_pair, sibling_map):
    # the sink, probe and refresh passes only fill the cache: a projection onto the vocabulary would cost a
    # quarter of a one-token pass on a small model with a large vocabulary
    source, target = sibling_pair
    ids = random_ids(1, 33, seed=9)[0][None]
    rows = []
    handle = target.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    try:
        MappedCache.from_source(source, sibling_map, target, input_ids=ids[:, :-1], refresh_tokens=Refresh(8, 2))
    finally:
        handle.remove()
    assert rows and set(rows) == {0}  # the target ran (sink, probe, refresh) and projected no position


def test_refresh_errors_are_clear(sibling_pair, sibling_map):
    source, target = sibling_pair
    ids = random_ids(2, 20, seed=9)
    batch = torch.stack(ids)
    with pytest.raises(CacheMismatchError, match="batch 1"):
        MappedCache.from_source(source, sibling_map, target, input_ids=batch, refresh_tokens=4)
    for bad in (-1, 2.5, "4"):
        with pytest.raises(CacheMismatchError, match="refresh_tokens"):
            MappedCache.from_source(source, sibling_map, target, input_ids=batch[:1], refresh_tokens=bad)
    for probe, span in ((0, 8), (2, 0)):  # a Refresh is checked when built, never again at a switch
        with pytest.raises(RecordError, match="probe_tokens and span >= 1"):
            Refresh(4, probe, span)


def test_a_window_that_reaches_the_sink_leaves_nothing_to_pick_and_runs_no_probe(sibling_pair, sibling_map,
                                                                                  monkeypatch, caplog):
    from peft_kvcache.runtime import refresh

    source, target = sibling_pair
    ids = random_ids(1, 20, seed=11)[0][None]
    monkeypatch.setattr(refresh, "probe_pass", lambda *a, **k: pytest.fail("a probe ran with nothing to pick"))
    with caplog.at_level("WARNING", logger="peft_kvcache.runtime.refresh"):
        cache = MappedCache.from_source(source, sibling_map, target, input_ids=ids,
                                        refresh_tokens=Refresh(tokens=6, probe_tokens=4, recent_tokens=100))
    assert "clamped to 0" in caplog.text
    assert cache.refresh.budget == 0 and cache.refresh.probe_seconds == 0 and not cache.refresh.positions.numel()
    assert _max_error(cache, run_with_cache(target, ids)) < 1e-5  # all but the sink computed: the target's own


def test_a_context_too_short_for_a_refresh_records_none(sibling_pair, sibling_map):
    source, target = sibling_pair
    ids = random_ids(1, 2, seed=11)[0][None]
    cache = MappedCache.from_source(source, sibling_map, target, input_ids=ids, refresh_tokens="refresh@40/p8")
    assert cache.refresh is None and cache.get_seq_length() == 2


def test_reading_attention_scores_leaves_the_continuation_check_in_place(sibling_pair, sibling_map):
    source, target = sibling_pair
    prompt = random_ids(1, 25, seed=12)[0][None]
    cache = MappedCache.from_source(source, sibling_map, target, input_ids=prompt[:, :-1], position_offset=7,
                                    refresh_tokens=0)
    attention_scores(target, cache, prompt[:, -1:], position_offset=7)
    assert cache.get_seq_length() == 24
    with pytest.raises(CacheMismatchError, match="positions"):  # default positions continue at 24, not 31
        target.generate(prompt, **with_cache(target, cache), max_new_tokens=2)


def test_a_budget_past_the_context_is_clamped_with_a_warning(sibling_pair, sibling_map, caplog):
    source, target = sibling_pair
    ids = random_ids(1, 20, seed=11)[0][None]
    with caplog.at_level("WARNING", logger="peft_kvcache.runtime.refresh"):
        cache = MappedCache.from_source(source, sibling_map, target, input_ids=ids, refresh_tokens=Refresh(500, 4))
    assert "clamped to 15" in caplog.text
    assert cache.refresh.budget == 15 and cache.refresh.positions.tolist() == list(range(1, 16))
    assert _max_error(cache, run_with_cache(target, ids)) < 1e-5  # the whole context: the target's own prefill


def test_evaluate_scores_refresh_beside_its_equal_compute_control(sibling_pair, sibling_map):
    source, target = sibling_pair
    report = evaluate_retention(source, target, sibling_map, random_ids(3, 40, seed=10), context_length=32,
                                continuation_length=8, windows=(2,), refresh=(4, 60), progress=False)
    names = [row["variant"] for row in report.rows()]
    assert {"mapped@2+r4", "window@8", "mapped@2+r60", "window@2"} <= set(names)
    rows = {row["variant"]: row for row in report.rows()}
    assert rows["mapped@2+r60"]["kl"] < 1e-6  # budget past the context: every position refreshed, exact
    assert rows["mapped@2+r4"]["kl"] < rows["mapped@2"]["kl"]


def test_the_refresh_recomputes_the_positions_the_probe_attends_to(sibling_pair, sibling_map):
    from peft_kvcache.runtime.refresh import refresh_cache

    source, target = sibling_pair
    ids = random_ids(1, 40, seed=13)[0][None]
    mapped = MappedCache.from_source(source, sibling_map, target, input_ids=ids, refresh_tokens=0)
    probe = _plain(mapped)
    probe.truncate(40 - 4)
    expected = select_spans(attention_scores(target, probe, ids[:, 36:]), 6, 3, first=1)
    result = refresh_cache(target, _plain(mapped), ids, Refresh(6, 4, 3), sink_tokens=1)
    assert result.positions.tolist() == expected.tolist()  # chosen by the probe's attention, not at random


def test_a_map_s_recorded_recipe_is_the_default_and_zero_opts_out(sibling_pair, sibling_map):
    """A published map records its refresh; `from_source` with no refresh argument applies exactly that one, and
    ``refresh_tokens=0`` gives the plain mapped cache."""
    source, target = sibling_pair
    context = random_ids(1, 33, seed=9)[0][None, :-1]
    recipe = Refresh(6, 4)
    recorded = sibling_map.config.refresh
    try:
        sibling_map.config.refresh = recipe
        default = MappedCache.from_source(source, sibling_map, target, input_ids=context)
        opted_out = MappedCache.from_source(source, sibling_map, target, input_ids=context, refresh_tokens=0)
    finally:
        sibling_map.config.refresh = recorded
    explicit = MappedCache.from_source(source, sibling_map, target, input_ids=context, refresh_tokens=recipe)
    plain = MappedCache.from_source(source, sibling_map, target, input_ids=context, refresh_tokens=0)
    same = lambda a, b: all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)  # noqa: E731
                            for x, y in zip(a.layers, b.layers))
    assert default.refresh is not None and torch.equal(default.refresh.positions, explicit.refresh.positions)
    assert same(default, explicit) and same(opted_out, plain) and opted_out.refresh is None
    assert not same(default, plain)  # the recipe changed the cache


def test_the_refresh_accounts_each_pass_it_runs(sibling_pair, sibling_map, monkeypatch):
    """`RefreshResult` times the probe pass and the recompute pass apart (the TTFT benchmark's breakdown reads them):
    a pass slowed down shows in its own figure only, and a recipe without a probe reports no probe time."""
    import time

    from peft_kvcache.runtime import refresh

    def slowed(function):
        def run(*args, **kwargs):
            time.sleep(0.2)
            return function(*args, **kwargs)
        return run

    source, target = sibling_pair
    context = random_ids(1, 33, seed=10)[0][None, :-1]
    monkeypatch.setattr(refresh, "probe_pass", slowed(refresh.probe_pass))
    probed = MappedCache.from_source(source, sibling_map, target, input_ids=context, refresh_tokens=Refresh(6, 4))
    assert probed.refresh.probe_seconds >= 0.2 > probed.refresh.recompute_seconds > 0
    monkeypatch.setattr(refresh, "refresh_positions", slowed(refresh.refresh_positions))
    hybrid = MappedCache.from_source(source, sibling_map, target, input_ids=context, refresh_tokens="hybrid@24")
    assert hybrid.refresh.probe_seconds == 0 and hybrid.refresh.recompute_seconds >= 0.2


@pytest.fixture(scope="module")
def grouped_pair():
    """A source and a target whose query heads share KV heads (the grouped eager attention's own path)."""
    from peft_kvcache import KVMap

    source = tiny_model("qwen2", seed=0)
    target = tiny_model("qwen2", seed=2, hidden_size=96, num_hidden_layers=3, num_attention_heads=6,
                        num_key_value_heads=2, intermediate_size=160)
    return source, target, KVMap.calibrate(source, target, random_ids(12, 48), progress=False)


@pytest.mark.parametrize("sink_tokens, offset, recipe", [(1, 0, "refresh@40/p6"), (3, 5, "refresh@40/p6"),
                                                         (3, 0, "index@40/p6"), (3, 5, "hybrid@40")])
def test_a_cold_sink_is_computed_inside_the_probe_pass_with_the_same_result(grouped_pair, sink_tokens, offset, recipe):
    """Where the target's sink is not memoized, the refresh's first pass (the probe's, or the hybrid's only one)
    computes it (one pass over the target's weights fewer): the cache, the picked positions and the memoized sink
    match a switch whose sink was computed alone beforehand."""
    from peft_kvcache.runtime.target_sink import clear_target_sinks, sink_is_memoized, target_sink

    source, target, kv_map = grouped_pair
    context = random_ids(1, 48, seed=11)[0][None, :-1]
    ones = torch.ones(1, sink_tokens, dtype=torch.long)
    calls = []
    hook = target.register_forward_hook(lambda module, args, out: calls.append(1))
    options = kv_map.config.calibration.options  # the sink the map was fitted without, set for this test
    recorded = options.sink_tokens
    switch = lambda: MappedCache.from_source(source, kv_map, target, input_ids=context,  # noqa: E731
                                             position_offset=offset, refresh_tokens=recipe)
    try:
        options.sink_tokens = sink_tokens
        clear_target_sinks()
        cold = switch()
        cold_passes = len(calls)
        assert sink_is_memoized(target, context[:, :sink_tokens], ones, offset)
        memo = target_sink(target, context[:, :sink_tokens], ones, offset)
        clear_target_sinks()
        alone = target_sink(target, context[:, :sink_tokens], ones, offset)  # the sink alone, then a warm switch
        calls.clear()
        warm = switch()
    finally:
        options.sink_tokens = recorded
        hook.remove()
        clear_target_sinks()
    passes = 1 if recipe.startswith("hybrid") else 2  # the probe (with the sink) and the recompute: warm the same
    assert cold_passes == len(calls) == passes
    assert torch.equal(cold.refresh.positions, warm.refresh.positions)
    assert max(float((a.keys - b.keys).abs().max()) + float((a.values - b.values).abs().max())
               for a, b in zip(cold.layers, warm.layers)) < 1e-5
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(memo.keys + memo.values, alone.keys + alone.values))
    assert max(float((c.keys[:, :, :sink_tokens] - k).abs().max())  # the cold cache holds the target's own sink
               for c, k in zip(cold.layers, alone.keys)) < 1e-5


@pytest.mark.parametrize("refresh_tokens", [Refresh(tokens=4, probe_tokens=3), 0])
def test_a_mapping_runs_under_the_models_lock(sibling_pair, sibling_map, refresh_tokens):
    """A refresh's passes switch the target's attention implementation, and the target's sink is memoized under the
    weights (the adapter) it was computed with: from_source holds the model's lock from reading those weights to the
    end, so a thread running the model under that lock (a session, the server) never sees a switch, nor switches the
    adapter in between."""
    import threading

    from peft_kvcache.modeling.adapters import model_lock

    source, target = sibling_pair
    ids = random_ids(1, 30, seed=11)[0][None]
    held, done = threading.Event(), threading.Event()

    def hold():
        with model_lock(target):
            held.set()
            done.wait(timeout=60)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(timeout=60)
    mapped = []
    worker = threading.Thread(target=lambda: mapped.append(MappedCache.from_source(
        source, sibling_map, target, input_ids=ids, refresh_tokens=refresh_tokens)))
    worker.start()
    worker.join(timeout=1.0)
    assert worker.is_alive() and not mapped  # waiting for the lock
    done.set()
    worker.join(timeout=60)
    holder.join(timeout=60)
    assert len(mapped) == 1 and (mapped[0].refresh is not None) == (refresh_tokens != 0)
