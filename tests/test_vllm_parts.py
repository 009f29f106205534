"""The vLLM connector's parts that need no engine (they run here without vLLM): the store's index (bounds, eviction,
variants and salts kept apart), the options, and the choice of the published map that fits two of an engine's
variants by fingerprints, layout and rotary parameters (tests/in_vllm runs the connector in real engines)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peft_kvcache.vllm.options import ConnectorError
from peft_kvcache.modeling.fixtures import converted_path, fixture_available
from peft_kvcache.vllm.options import ConnectorOptions, request_reuse
from peft_kvcache.maps.registry import MapMatch
from peft_kvcache.vllm.pairs import Variant, VariantMaps
from peft_kvcache.vllm.store import StoreIndex

ROOT = Path(__file__).resolve().parents[1]
BASE, SHOUT = Variant(None), Variant("shout", str(ROOT / "adapters/shout"))


def _tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# ----- the index -----


def test_matches_are_whole_blocks_per_variant_and_salt():
    index = StoreIndex(max_bytes=10**6, block_size=4, bytes_per_token=1)
    index.add(BASE, None, _tokens(12))
    index.add(SHOUT, None, _tokens(8))
    index.add(BASE, "tenant", _tokens(12))
    found = index.matches(None, _tokens(10) + [99, 99], limit_blocks=3)
    assert {v: m.blocks for v, m in found.items()} == {(BASE, True): 2, (SHOUT, True): 2}  # block 3 differs
    assert index.matches("other", _tokens(12), limit_blocks=3) == {}  # salted requests share only with their salt
    assert index.matches("tenant", _tokens(12), limit_blocks=2)[BASE, True].blocks == 2  # never past the limit


def test_derived_entries_sit_beside_exact_ones_and_never_replace_them():
    """What a mapped request computed is kept as derived: served as such, superseded by a longer derived prefix or by
    an exact one of at least its length, and never in an exact entry's place."""
    from peft_kvcache.runtime.reuse import Made

    index = StoreIndex(max_bytes=10**6, block_size=4, bytes_per_token=1)
    derived, _ = index.add(SHOUT, None, _tokens(8), Made("mapped", None, 8, 1))
    exact, _ = index.add(SHOUT, None, _tokens(4))
    found = index.matches(None, _tokens(8), limit_blocks=2)
    assert found[SHOUT, False].blocks == 2 and found[SHOUT, True].blocks == 1
    assert index.add(SHOUT, None, _tokens(4), Made("mapped", None, 4, 1)) == (None, [])  # held: exactly
    longer, dropped = index.add(SHOUT, None, _tokens(12))  # exact, longer: both go
    assert set(dropped) == {derived.key, exact.key} and len(index) == 1
    assert index.drop_variant(SHOUT) == [longer.key] and len(index) == 0


def test_a_longer_prefix_supersedes_the_shorter_ones_of_its_variant_and_a_held_one_is_not_stored_twice():
    index = StoreIndex(max_bytes=10**6, block_size=4, bytes_per_token=1)
    short, _ = index.add(BASE, None, _tokens(4))
    other, _ = index.add(SHOUT, None, _tokens(4))
    longer, dropped = index.add(BASE, None, _tokens(8))
    assert dropped == [short.key] and len(index) == 2 and index.nbytes == 12
    assert index.add(BASE, None, _tokens(6)) == (None, [])  # its 1 whole block is held already
    assert other.key in {e.key for e in index._entries.values()}


def test_the_bound_evicts_the_least_recently_used_and_refuses_what_cannot_fit():
    index = StoreIndex(max_bytes=20, block_size=4, bytes_per_token=1)
    a, _ = index.add(BASE, None, _tokens(8))
    b, _ = index.add(BASE, None, _tokens(8, start=100))
    index.touch(a)
    c, evicted = index.add(BASE, None, _tokens(8, start=200))
    assert evicted == [b.key] and index.evictions == 1 and index.nbytes == 16
    assert index.add(BASE, None, _tokens(24, start=300)) == (None, [])  # larger than the whole bound
    for token in range(1, 5):
        assert index.add_sink(SHOUT, [token])[1] == []  # a sink costs one token's bytes: 16 + 4
    key, evicted = index.add_sink(SHOUT, [5])  # past the bound: the least recently used entry goes
    assert evicted == [a.key] and index.has_sink(SHOUT, [5]) and not index.has_sink(BASE, [5])


def test_what_was_just_added_is_never_what_makes_room_for_itself():
    """An entry that fills the bound with a sink beside it pushes the sink out, not itself (the worker would keep
    tensors the index no longer knows); a sink that does not fit beside the only entry pushes the entry out, and
    says so."""
    index = StoreIndex(max_bytes=8, block_size=4, bytes_per_token=1)
    sink, _ = index.add_sink(SHOUT, [1])
    entry, evicted = index.add(BASE, None, _tokens(8))
    assert entry is not None and evicted == [sink] and len(index) == 1 and index.nbytes == 8
    key, evicted = index.add_sink(BASE, [0])
    assert evicted == [entry.key] and index.has_sink(BASE, [0]) and len(index) == 0 and index.nbytes == 1


# ----- options -----


@pytest.mark.parametrize("extra, match", [
    ({"mode": "sometimes"}, "mode must be one of"), ({"maps": None}, "maps is needed in mode 'map'"),
    ({"maps": "/no/such/folder"}, "not a folder"), ({"store_gib": 0, "mode": "exact"}, "store_gib"),
    ({"store_gib": float("inf"), "mode": "exact"}, "finite"),
    ({"min_mapped_tokens": "256", "mode": "exact"}, "must be an integer"), ({"map": "hub_cards"}, "unknown keys"),
])
def test_options_that_cannot_be_used_are_refused_by_name(extra, match):
    with pytest.raises(ConnectorError, match=match):
        ConnectorOptions.parse(extra).validate()


def test_a_requests_own_choice_is_read_and_a_malformed_one_is_served_exactly_and_named_briefly():
    assert request_reuse(None) == request_reuse({}) == request_reuse({"other": 1}) == ("map", None)
    assert request_reuse({"peft_kvcache": {"reuse": "none"}}) == ("none", None)
    for bad, said in (({"reuse": "sometimes"}, "reuse must be one of"), (3, "must be an object"),
                      ({"reuse": "map", "mode": "fast"}, "unknown keys ['mode']"), ({"x" * 10**6: 1}, "unknown keys"),
                      ({"reuse": "y" * 10**6}, "reuse must be one of")):
        reuse, problem = request_reuse({"peft_kvcache": bad})
        assert reuse == "exact" and said in problem and len(problem) < 200


def test_the_default_min_mapped_tokens_is_the_one_the_load_benchmark_measured():
    from peft_kvcache.vllm.options import DEFAULT_MIN_MAPPED_TOKENS

    results = json.loads((ROOT / "benchmarks" / "results" / "vllm-load.json").read_text())
    assert results["provenance"]["commit"], "the results file records the code it measured"
    assert DEFAULT_MIN_MAPPED_TOKENS == results["threshold"]["recommended_min_mapped_tokens"]
    assert ConnectorOptions.parse({"mode": "exact"}).min_mapped_tokens == DEFAULT_MIN_MAPPED_TOKENS


def test_the_load_benchmark_counts_the_connectors_fallbacks_by_reason_from_its_metrics():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from benchmarks.vllm_report import fallback_cell
    from benchmarks.vllm_traffic import parse_fallbacks

    registry = CollectorRegistry()  # what vLLM's /metrics writes for the connector's counter (two engines)
    fallbacks = Counter("vllm:peft_kvcache_fallbacks", "", ["model_name", "engine", "reason"], registry=registry)
    fallbacks.labels("m", "0", "no_target_sink").inc(2)
    fallbacks.labels("m", "1", "no_target_sink").inc(1)
    fallbacks.labels("m", "0", "multimodal").inc(4)
    Counter("vllm:peft_kvcache_prompt_tokens", "", ["source"], registry=registry).labels("mapped").inc(500)
    counts = parse_fallbacks(generate_latest(registry).decode())
    assert counts == {"no_target_sink": 3, "multimodal": 4}
    assert parse_fallbacks("") == {}
    assert fallback_cell("a", counts) == "no_target_sink 3, multimodal 4" and fallback_cell("a", {}) == "none"
    assert fallback_cell("a", None) == fallback_cell("c", {}) == "-"  # not counted; vLLM alone


def test_the_streams_summary_pairs_windows_and_adds_up_their_fallbacks_and_cached_tokens():
    from benchmarks.vllm_report import streams_summary

    def window(repetition, condition, gaps, tokens, fallbacks):
        return {"repetition": repetition, "condition": condition, "gaps": gaps, "foreground_ttft": [0.1, 0.2],
                "foreground_tokens": tokens, "fallbacks": fallbacks}

    windows = [window(0, "none", [0.05] * 20, [[100, 96]], {}),
               window(0, "switch", [0.05] * 19 + [1.0], [[100, 64], [50, 0]], {"no_target_sink": 1}),
               window(1, "none", [0.05] * 20, [[100, 96]], {}),
               window(1, "switch", [0.10] * 20, [[100, 96]], {"no_target_sink": 2, "load_error": 1})]
    summary = streams_summary(windows)
    assert "own" not in summary and "own_p95_ratio" not in summary  # a run without the own-cache control
    assert summary["switch"]["itl_max"] == 1.0 and summary["none"]["itl_max"] == 0.05
    assert (summary["switch"]["prompt_tokens"], summary["switch"]["cached_tokens"]) == (250, 160)
    assert summary["switch"]["fallbacks"] == {"no_target_sink": 3, "load_error": 1}
    assert summary["none"]["fallbacks"] == {}
    # each switch window's p95 over the p95 of the none window of its repetition
    assert summary["p95_ratio"]["runs"] == pytest.approx([(0.05 + 0.95 * 0.05) / 0.05, 2.0])
    old = [{k: v for k, v in w.items() if k not in ("foreground_tokens", "fallbacks")} for w in windows]
    assert "fallbacks" not in streams_summary(old)["switch"]  # raw data recorded before these fields still reads
    # the own-cache control: paired with the none and switch windows of its own repetition, in any order
    controlled = [window(1, "own", [0.20] * 20, [[100, 96]], {}), window(0, "own", [0.05] * 20, [[100, 96]], {}),
                  *windows]
    summary = streams_summary(controlled)
    assert summary["own_p95_ratio"]["runs"] == pytest.approx([1.0, 4.0])
    assert summary["switch_to_own_p95_ratio"]["runs"] == pytest.approx([(0.05 + 0.95 * 0.05) / 0.05, 0.5])
    assert summary["p95_ratio"]["runs"] == pytest.approx([(0.05 + 0.95 * 0.05) / 0.05, 2.0])


def test_the_benchmarks_first_token_kl_is_a_lower_bound_from_two_top_lists():
    from benchmarks.vllm_report import first_token_kl

    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        exact = torch.randn(200, generator=generator).log_softmax(0)
        other = (exact + torch.randn(200, generator=generator)).log_softmax(0)
        true_kl = float((exact.exp() * (exact - other)).sum())
        tops = [{str(int(i)): float(d[i]) for i in d.topk(20).indices} for d in (exact, other)]
        assert 0 <= first_token_kl(*tops) <= true_kl + 1e-9
    flatter, sharper = {"a": math.log(0.3), "b": math.log(0.3)}, {"a": math.log(0.5), "b": math.log(0.45)}
    assert first_token_kl(flatter, sharper) > 0.5  # the plain sum over the list is negative here
    assert first_token_kl(flatter, flatter) == 0


# ----- which map fits -----


needs_smollm = pytest.mark.skipif(not fixture_available("gguf:smollm2-135m-instruct"),
                                  reason="run `python -m peft_kvcache.modeling.fixtures` first")


@pytest.fixture(scope="module")
def engine_model():
    from transformers import AutoConfig

    folder = converted_path("gguf:smollm2-135m-instruct")
    return folder, AutoConfig.from_pretrained(folder)


def _maps(tmp_path, *names) -> Path:
    for name in names:
        shutil.copytree(ROOT / "hub_cards" / name, tmp_path / name)
    return tmp_path


@needs_smollm
def test_the_map_is_chosen_by_the_weights_both_variants_load(tmp_path, engine_model):
    folder, config = engine_model
    registry = VariantMaps(_maps(tmp_path, "smollm2-135m-instruct-base-to-shout", "smollm2-135m-instruct-shout-to-base",
                                 "qwen2.5-coder-0.5b-to-1.5b-top2"), folder, config)
    choice = registry.find(BASE, SHOUT)
    assert choice == MapMatch((str(tmp_path / "smollm2-135m-instruct-base-to-shout"),), 1)
    assert _fitted_as_matched(choice)  # what the worker checks the folder against when it loads it
    assert registry.find(SHOUT, BASE).folders[0].endswith("shout-to-base")
    assert registry.find(BASE, Variant("docstring", str(ROOT / "adapters/docstring"))) == "no_map"
    assert registry.find(BASE, Variant("shout", str(ROOT / "adapters/docstring"))) == "no_map"  # a name is not enough


@needs_smollm
def test_between_two_adapters_the_maps_go_through_the_base_model(tmp_path, engine_model):
    folder, config = engine_model
    docstring = Variant("docstring", str(ROOT / "adapters/docstring"))
    registry = VariantMaps(_maps(tmp_path, "smollm2-135m-instruct-shout-to-base", "smollm2-135m-instruct-base-to-docstring"),
                           folder, config)
    assert registry.find(SHOUT, docstring) == MapMatch((str(tmp_path / "smollm2-135m-instruct-shout-to-base"),
                                                         str(tmp_path / "smollm2-135m-instruct-base-to-docstring")), 1)
    assert _fitted_as_matched(registry.find(SHOUT, docstring))
    assert registry.find(docstring, SHOUT) == "no_map"  # neither docstring -> base nor base -> shout is here


def _fitted_as_matched(choice: MapMatch) -> bool:
    from peft_kvcache.maps.kvmap import KVMap

    return len(choice.prints) == len(choice.folders) and all(
        KVMap.from_pretrained(folder).fitted_for(*prints) for folder, prints in zip(choice.folders, choice.prints))


@needs_smollm
def test_a_map_for_these_weights_with_other_rotary_parameters_or_damaged_weights_is_not_used(tmp_path, engine_model):
    folder, config = engine_model
    maps = _maps(tmp_path, "smollm2-135m-instruct-base-to-shout")
    weights = maps / "smollm2-135m-instruct-base-to-shout" / "model.safetensors"
    tensors = load_file(weights)
    tensors["target.inv_freq"] = tensors["target.inv_freq"] * 2
    save_file(tensors, weights)
    assert VariantMaps(maps, folder, config).find(BASE, SHOUT) == "map_mismatch"
    weights.write_bytes(weights.read_bytes()[:100])
    assert VariantMaps(maps, folder, config).find(BASE, SHOUT) == "unusable_map"


@needs_smollm
def test_an_engine_model_whose_positions_cannot_be_removed_maps_nothing(tmp_path, engine_model):
    folder, config = engine_model
    windowed = type(config).from_dict({**config.to_dict(), "sliding_window": 64, "layer_types": None})
    registry = VariantMaps(_maps(tmp_path, "smollm2-135m-instruct-base-to-shout"), folder, windowed)
    assert registry.problem and registry.find(BASE, SHOUT) == "unsupported_model"


def test_unreadable_map_folders_are_skipped(tmp_path):
    from transformers import LlamaConfig

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({"source_fingerprint": "x", "format_version": 2}))
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"")
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    registry = VariantMaps(tmp_path, tmp_path, config)
    assert len(registry.registry) == 0 and registry.find(BASE, SHOUT) == "unsupported_model"  # nothing to fingerprint
    assert registry.identity(BASE) is None


# ----- tensor parallelism: which heads a rank holds, and maps fitted per shard -----


@pytest.mark.parametrize("world, heads, groups, held", [(1, 3, 1, [slice(0, 3)]), (2, 2, 2, [slice(0, 1), slice(1, 2)]),
                                                         (2, 4, 2, [slice(0, 2), slice(2, 4)]),
                                                         (4, 2, 2, [slice(0, 1)] * 2 + [slice(1, 2)] * 2)])
def test_each_rank_holds_its_slice_of_the_kv_heads(world, heads, groups, held):
    from peft_kvcache.vllm.parallel import Shard

    assert [Shard(rank, world, heads).heads for rank in range(world)] == held
    assert Shard(0, world, heads).groups == groups


@pytest.mark.parametrize("head_shards", [2, 1])
def test_a_map_fitted_per_shard_maps_a_ranks_heads_from_that_rank_alone(head_shards, exact_matmuls):
    """With a map fitted per shard, each rank's heads mapped from its own source heads (the others zeros, no gather)
    equal the same heads mapped from every source head; a map that mixes heads (head_shards 1) needs the gather."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft_kvcache import KVMap
    from peft_kvcache.maps.apply import map_cache
    from peft_kvcache.vllm.parallel import Shard

    def tiny(seed: int):  # 2 KV heads: TP=2 (this file runs beside tests/in_vllm, whose conftest is not ours)
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2)).eval()

    ids = [torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    kv_map = KVMap.calibrate(tiny(0), tiny(1), ids, same_layer=True, head_shards=head_shards, progress=False)
    layout = kv_map.config.source_layout
    generator = torch.Generator().manual_seed(0)
    keys, values = ([torch.randn(1, layout.kv_heads, 40, layout.head_dim, generator=generator)
                     for _ in range(layout.num_layers)] for _ in range(2))
    positions, placements = torch.arange(40)[None], [(torch.device("cpu"), torch.float32)] * layout.num_layers
    gathered = map_cache(kv_map, keys, values, positions, positions, placements)
    differs = False
    for rank in range(2):
        shard = Shard(rank, 2, layout.kv_heads)
        alone = [shard.place([t[0, shard.heads] for t in ts], True) for ts in (keys, values)]
        placed = map_cache(kv_map, *([t[None] for t in ts] for ts in alone), positions, positions, placements)
        same = all(torch.allclose(mine[0, shard.heads], every[0, shard.heads], atol=1e-5)
                   for pair, pair_all in zip(placed, gathered) for mine, every in zip(pair, pair_all))
        assert same or head_shards == 1
        differs |= not same
    assert differs == (head_shards == 1)


def test_the_step_slicer_keeps_its_share_of_the_engines_time_and_the_jobs_order():
    from peft_kvcache.vllm.slices import StepSlicer

    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    log = []

    def job(name: str, slices: int, seconds: float):
        for i in range(slices):
            now[0] += seconds  # each slice takes this long
            log.append((name, i))
            yield

    slicer = StepSlicer(share=0.2, clock=clock)
    slicer.add(job("load", 30, 0.002))
    slicer.add(job("save", 2, 0.002))
    assert slicer.advance() == 1  # nothing measured yet: one slice
    per_step = []
    while not slicer.idle:
        now[0] += 0.040  # the engine's step (a forward) between two calls
        per_step.append(slicer.advance())
    # 20% of the time: 0.040 * 0.2 / 0.8 = 10 ms per step, 2 ms slices -> 5 a step
    assert per_step[:5] == [5, 5, 5, 5, 5] and sum(per_step) == 31
    assert [name for name, _ in log] == ["load"] * 30 + ["save"] * 2  # in order, each job to its end
    now[0] += 0.001  # a step far shorter than a slice still runs one
    slicer.add(job("tiny", 3, 0.002))
    assert slicer.advance() == 1
    now[0] += 30.0  # a long gap (the engine idle, or a long prefill) counts as a one-second step: a quarter second
    slicer.add(job("long", 100, 0.004))
    assert slicer.advance() == 2 + 62  # tiny's last two slices (4 ms), then long's up to 0.25 s (the last overruns)
    now[0] += 5.0  # a five-second prefill step: the same quarter second, never one slice a step
    assert slicer.advance() == 38 and slicer.idle  # the rest of long (38 x 4 ms < 0.25 s)
    slicer.add(job("alone", 4, 0.002))
    now[0] += 0.001  # a step that computed no token (the requests wait for their loads): nothing to hold
    assert slicer.advance(forward=False) == 4 and slicer.idle  # all of alone's (no request waits for it)
    # switches arriving together: a step that computed no token runs the queue up to the end of the first load, so
    # its request computes in the next step; the second load continues within the steps
    slicer.add(job("save", 2, 0.002))
    slicer.add(job("load 1", 3, 0.002), waited_on=True)
    slicer.add(job("load 2", 3, 0.002), waited_on=True)
    del log[:]
    now[0] += 0.001
    assert slicer.advance(forward=False) == 5 and not slicer.idle
    assert [name for name, _ in log] == ["save"] * 2 + ["load 1"] * 3
    now[0] += 0.001
    assert slicer.advance(forward=False) == 3 and slicer.idle
    with pytest.raises(ValueError, match="share"):
        StepSlicer(share=1.0)


def test_the_step_share_option_is_checked_by_name():
    assert ConnectorOptions.parse({"maps": None, "mode": "exact"}).step_share == 0.2
    with pytest.raises(ConnectorError, match="step_share"):
        ConnectorOptions.parse({"maps": None, "mode": "exact", "step_share": 1.0}).validate()


def test_a_switch_waits_for_its_own_map_not_for_every_map_the_loader_reads():
    import threading

    from peft_kvcache.vllm.loaded_maps import LoadedMaps

    maps, second = LoadedMaps(), threading.Event()

    def loader():
        maps.put("a", "map a")
        second.wait(10)  # the loader is slow on the next map
        maps.put("b", "map b")
        maps.finish()

    threading.Thread(target=loader, daemon=True).start()
    read = lambda folder: f"read {folder}"  # noqa: E731
    got: list = []
    asking = threading.Thread(target=lambda: got.append(maps.get("a", read)), daemon=True)
    asking.start()
    asking.join(5)
    assert got == ["map a"] and not second.is_set()  # answered while the loader still works on "b"
    second.set()
    assert maps.get("b", read) == "map b"
    assert maps.get("c", read) == "read c"  # not found at start: read by whoever asks, once the loader is done
    assert maps.get("c", lambda folder: "read again") == "read c"


def test_the_switch_cost_server_can_bound_the_tokens_of_an_engine_step():
    from benchmarks.vllm_servers import server_command

    bounded = server_command("python", ROOT, {"maps": "hub_cards"}, 8000, max_num_batched_tokens=32)
    assert bounded[bounded.index("--max-num-batched-tokens") + 1] == "32"
    assert "--max-num-batched-tokens" not in server_command("python", ROOT, None, 8000)  # vLLM's default otherwise


# ----- a request's record and the worker's reports -----


def test_a_failed_load_after_a_preemption_keeps_the_approximate_admission_before_it():
    """A request ran on mapped KV, was preempted, and its load failed when admitted again: what it computed on the
    mapped prefix may still sit in vLLM's prefix cache, so its record stays approximate (the label, the evictions);
    a first admission whose load fails is exact, prefilled, said so."""
    from peft_kvcache.runtime.reuse import Made
    from peft_kvcache.vllm.records import RequestRecord

    mapped = Made("mapped", None, 384)
    record = RequestRecord(SHOUT, None, "map", 500)
    record.admitted(0, 384, mapped, None)
    record.admitted(128, 256, mapped, None)  # after a preemption: vLLM's own hit, the rest loaded again
    record.load_failed()
    assert record.made == mapped and (record.local_tokens, record.loaded_tokens) == (0, 384)
    first = RequestRecord(SHOUT, None, "map", 500)
    first.admitted(128, 256, mapped, None)
    first.load_failed()
    assert first.made.exact and (first.local_tokens, first.loaded_tokens, first.fallback) == (128, 0, "load_error")
    exact_after = RequestRecord(SHOUT, None, "map", 500)
    exact_after.admitted(0, 384, mapped, None)
    exact_after.admitted(384, 0, Made(), None)  # after a preemption: the exact admission does not replace it
    exact_after.load_failed()  # nor does the failure of its load take the mapped one back
    assert exact_after.made == mapped and (exact_after.local_tokens, exact_after.loaded_tokens) == (0, 384)


def test_a_load_is_reported_done_only_after_the_writes_queued_on_its_stream(monkeypatch):
    """On a GPU the job thread writes a load's blocks on its own stream while vLLM's forward runs on another: the load
    is reported done (vLLM then schedules the request) only once that stream's work is done, failed loads too."""
    from peft_kvcache.vllm import worker as worker_module
    from peft_kvcache.vllm.jobs import LoadJob
    from peft_kvcache.vllm.parallel import Shard

    side = worker_module.WorkerSide(None, shard=Shard())
    side.layers = [torch.zeros(1)]
    synced = []  # what the engine could read while the stream syncs: neither the load's end nor its failure
    monkeypatch.setattr(worker_module, "_copies_done", lambda device: synced.append(
        ("request" in side._loaded, list(side._report.failed_loads), set(side._failed_blocks))))
    job = LoadJob("request", "mapped", ("key",), 0, (0,), (), None, False)
    for _ in side._load_steps(job, report_done=True):  # no layout: the load fails
        pass
    # reported together, in one step: a failure reported a step before the load's end would have the scheduler take
    # the request for done loading, and an abort in between would queue a copy of blocks vLLM then frees
    assert synced == [(False, [], set())]
    # vLLM reads the ends (`finished`) before the report: a failure that ended between them waits for the next ends
    assert side.take_report() is None
    assert side.finished()[1] == {"request"} and side.load_errors() == {0}
    assert side.take_report().failed_loads == ["request"]


def test_a_load_whose_stream_cannot_be_synced_is_reported_failed_and_the_job_thread_goes_on(monkeypatch):
    """A device error while a load's writes are synced: the load is reported done and failed (vLLM recomputes its
    blocks; a request never waits forever on it), and the job thread serves the jobs queued after it."""
    import threading

    from peft_kvcache.vllm import worker as worker_module
    from peft_kvcache.vllm.jobs import LoadJob
    from peft_kvcache.vllm.parallel import Shard

    side = worker_module.WorkerSide(None, shard=Shard())
    side.layers = [torch.zeros(1)]
    calls = []

    def sync_fails_once(device):
        calls.append(device)
        if len(calls) == 1:
            raise RuntimeError("a device error")

    monkeypatch.setattr(worker_module, "_copies_done", sync_fails_once)
    for block, request_id in enumerate(("first", "second")):  # no layout: both loads fail, and are reported
        side._queue(LoadJob(request_id, "mapped", ("key",), 0, (block,), (), None, False))
    waiter = threading.Thread(target=side._jobs.join, daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "the job thread stopped serving"
    assert side.finished()[1] == {"first", "second"} and side.load_errors() == {0, 1}
    assert side.take_report().failed_loads == ["first", "second"]


def test_a_map_folder_saved_again_for_other_weights_after_the_scheduler_matched_it_is_not_applied(tmp_path):
    """The scheduler matched a folder's map at start; the folder is then saved again with a map of other weights
    before the worker reads it (a lazy read): the worker refuses to apply it (the load fails, vLLM recomputes)."""
    from peft_kvcache.maps.registry import MapRegistry
    from peft_kvcache.vllm import worker as worker_module
    from peft_kvcache.errors import CacheMismatchError
    from peft_kvcache.vllm.jobs import LoadJob
    from peft_kvcache.vllm.parallel import Shard

    folder = tmp_path / "map"
    shutil.copytree(ROOT / "hub_cards" / "smollm2-135m-instruct-base-to-shout", folder)
    matched = MapRegistry([str(folder)]).configs[str(folder)]  # what the scheduler read at start
    prints = ((matched.source_fingerprint, matched.target_fingerprint),)
    shutil.rmtree(folder)
    shutil.copytree(ROOT / "hub_cards" / "smollm2-135m-instruct-base-to-docstring", folder)  # saved again

    side = worker_module.WorkerSide(None, shard=Shard())
    side._maps.finish()  # the folder is read when a load asks for it
    job = LoadJob("request", "mapped", ("key",), 0, (0,), (str(folder),), None, False, prints)
    with pytest.raises(CacheMismatchError, match="saved again"):
        next(side._mapped(job, [], []))
    unchecked = LoadJob("request", "mapped", ("key",), 0, (0,), (str(folder),), None, False)
    with pytest.raises(CacheMismatchError, match="fingerprints"):
        next(side._mapped(unchecked, [], []))


@needs_smollm
def test_a_lora_id_first_seen_on_other_files_runs_weights_of_no_known_files(tmp_path, engine_model):
    """vLLM keeps the weights it loaded under a LoRA id, whatever the adapter's files become: a request of that id after
    the files change (before a reload under a new id) computes the old weights' KV, which must be kept as nobody's;
    the new id runs the new files."""
    from peft_kvcache.vllm.pairs import Variant
    from peft_kvcache.vllm.staleness import OTHER_WEIGHTS, FileWatch

    folder = tmp_path / "hot"
    shutil.copytree(ROOT / "adapters" / "shout", folder)
    watch, variant = FileWatch(str(engine_model[0])), Variant("hot", str(folder))
    watch.seen(variant, 1)
    old = watch.of_request(variant, 1)
    assert old is not None and watch.of_request(variant, 1) == watch.fingerprint(variant)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(ROOT / "adapters" / "docstring" / name, folder / name)
    assert watch.fingerprint(variant) != old
    watch.seen(variant, 1)  # seen again: still the files it was first seen on
    assert watch.of_request(variant, 1) == OTHER_WEIGHTS  # the old id: the old weights, of no files on disk
    watch.made_with(variant, OTHER_WEIGHTS)
    assert variant not in watch.prints  # nobody's KV: no variant's
    watch.seen(variant, 2)  # reloaded under a new id: the files now
    assert watch.of_request(variant, 2) == watch.fingerprint(variant)
    base = Variant(None)
    watch.seen(base, None)
    assert watch.of_request(base, None) == watch.fingerprint(base)
    # an adapter loaded in place: vLLM reads its files again whenever it activates the id, so no id binds them
    from types import SimpleNamespace

    from peft_kvcache.vllm.pairs import lora_id_of

    lora = SimpleNamespace(lora_name="hot", lora_path=str(folder), lora_int_id=1, load_inplace=True)
    assert lora_id_of(SimpleNamespace(lora_request=lora)) is None
    assert watch.of_request(variant, None) == watch.fingerprint(variant)


def test_a_variants_tracked_hashes_cover_every_block_the_pool_can_cache():
    from peft_kvcache.vllm.pairs import Variant
    from peft_kvcache.vllm.staleness import TRACKED_HASHES, FileWatch

    watch, variant = FileWatch.__new__(FileWatch), Variant("a", "/a")
    watch.tracked = {}
    watch.track(variant, range(TRACKED_HASHES + 10))
    assert len(watch.tracked[variant]) == TRACKED_HASHES and 10 in watch.tracked[variant]
    watch.track(variant, range(TRACKED_HASHES + 10, TRACKED_HASHES + 20), pool_blocks=TRACKED_HASHES + 20)
    assert len(watch.tracked[variant]) == TRACKED_HASHES + 20 - 10  # nothing dropped: the pool could cache them all


def test_an_engine_cache_other_than_full_attention_in_one_group_is_refused_by_name():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import torch as _torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from peft_kvcache.vllm.layout import unsupported_attention

    full = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=_torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=_torch.float32, sliding_window=256)
    config = lambda *specs: SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])  # noqa: E731
    assert unsupported_attention(config(full)) is None and unsupported_attention(None) is None
    assert "SlidingWindowSpec in 1 group(s)" in unsupported_attention(config(window))
    assert "FullAttentionSpec, SlidingWindowSpec in 2 group(s)" in unsupported_attention(config(full, window))


def test_options_it_could_not_read_label_a_request_whatever_it_loaded():
    """A request whose options were read as "exact" is told so even where the store served it (its sender must learn
    its options were not used); a fallback met while looking for a longer prefix is dropped once one was loaded."""
    from peft_kvcache.vllm.records import Plan
    from peft_kvcache.vllm.scheduler import _fallback

    assert _fallback(Plan(0, fallback="invalid_options"), loaded=True) == "invalid_options"
    assert _fallback(Plan(0, fallback="no_target_sink"), loaded=True) is None
    assert _fallback(Plan(0, fallback="no_target_sink"), loaded=False) == "no_target_sink"


def test_the_store_gauges_are_reported_when_only_the_store_changed():
    """A reset empties the store without a counter moving: its size is reported all the same (the gauges on
    /metrics would keep the old size)."""
    from peft_kvcache.runtime.reuse import Made
    from peft_kvcache.vllm.records import Counts
    from peft_kvcache.vllm.scheduler import SchedulerSide

    side = SchedulerSide.__new__(SchedulerSide)
    side.index, side.counts, side._reported_size = StoreIndex(1 << 20, 4, 8), Counts(), (0, 0)
    side.index.add(Variant(None), None, _tokens(8), Made())
    stats = side.stats()
    assert stats["store_entries"] == 1 and stats["store_bytes"] > 0
    assert side.stats() is None  # nothing moved since
    side.index.clear()
    assert side.stats() == {"tokens": {}, "fallbacks": {}, "evictions": 0, "store_bytes": 0, "store_entries": 0}


def test_a_finished_request_keeps_only_what_its_processed_steps_wrote():
    """Under async scheduling (vLLM's default on GPUs) a finished request's computed-token counter includes a step
    still in flight: a copy on another stream could read its last block before that step's write lands, so only the
    blocks of processed steps are kept."""
    from types import SimpleNamespace

    from peft_kvcache.runtime.reuse import Made
    from peft_kvcache.vllm.records import Counts, RequestRecord
    from peft_kvcache.vllm.scheduler import SchedulerSide

    side = SchedulerSide.__new__(SchedulerSide)
    side.refused, side.maps, side.options = None, None, ConnectorOptions(mode="exact")
    side.block_size, side.sink_tokens, side.ops, side.counts = 4, 1, [], Counts()
    side.index = StoreIndex(1 << 20, 4, 8)
    record = RequestRecord(Variant(None), None, "map", 8, made=Made())
    for in_flight, kept in ((0, 3), (1, 2)):  # 12 tokens counted, the 12th written by a step in flight
        side.index.clear()
        request = SimpleNamespace(request_id="r", num_computed_tokens=12, num_in_flight_tokens=in_flight,
                                  all_token_ids=_tokens(13), mm_features=None, prompt_embeds=None)
        assert side._keep(request, record, [0, 1, 2, 3])
        assert side.ops[-1].block_ids == (0, 1, 2)[:kept]
    side.index.clear()  # preempted (its counter reset) with a step still in flight, then aborted: nothing to keep
    request = SimpleNamespace(request_id="r", num_computed_tokens=0, num_in_flight_tokens=1,
                              all_token_ids=_tokens(13), mm_features=None, prompt_embeds=None)
    assert not side._keep(request, record, [0, 1, 2, 3]) and len(side.index) == 0
