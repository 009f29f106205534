"""The prefix store's policy for approximate caches (serving/store.py, serving/engine.py), without HTTP: every entry records how it was
made; an entry derived from a mapped prefix is served as mapped, never as reused; mapping is offered only where it
saves ``min_mapped_tokens`` of prefill; a request may ask for exact reuse only; the default threshold is the one
benchmarks/map_threshold.py measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from server_helpers import SINK, calibration_ids, tiny_peft, tiny_tokenizer

from peft_kvcache import SharedPeftModel
from peft_kvcache.calibration.loop import calibrate_adapters
from peft_kvcache.modeling.capture import CapturedKV
from peft_kvcache.serving.engine import PrefixEngine
from peft_kvcache.serving.store import PrefixStore

ROOT = Path(__file__).resolve().parents[1]
GREEDY = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 1}


@pytest.fixture(scope="module")
def shared():
    model = tiny_peft()
    return SharedPeftModel(model, calibrate_adapters(model, calibration_ids(), progress=False, sink_tokens=SINK))


def _ids(messages: list[dict]) -> torch.Tensor:
    tokenizer = tiny_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)


def _engine(shared, min_mapped_tokens: int, **options) -> PrefixEngine:
    engine = PrefixEngine(shared, PrefixStore(2**26), **options)
    engine.min_mapped_tokens = min_mapped_tokens
    return engine


def _fresh_reply(shared, adapter, prompt) -> torch.Tensor:
    """The reply of a server that never saw anything: a full prefill."""
    return _engine(shared, 0).run(adapter, prompt, GREEDY).new_ids


SYSTEM = {"role": "system", "content": "You answer in one short line, politely, and never more."}  # 60 tokens


def test_a_short_shared_prefix_is_prefilled_not_mapped(shared):
    """Finding 1: another conversation's base cache of the system prompt (shorter than min_mapped_tokens) is not
    mapped into a conversation's first turn: it is prefilled, and its reply is the one it gets alone."""
    engine = _engine(shared, 64)
    other = _ids([SYSTEM, {"role": "user", "content": "Tell me about cats."}])
    engine.run(None, other, GREEDY)  # stores the base model's cache of the system prompt and more
    first_turn = _ids([SYSTEM, {"role": "user", "content": "Dogs?"}])
    result = engine.run("first", first_turn, GREEDY)
    assert (result.context_source, result.cached_tokens) == ("prefilled", 0)
    assert torch.equal(result.new_ids, _fresh_reply(shared, "first", first_turn))


@pytest.mark.parametrize("min_mapped", [0, 1])
def test_a_prefix_is_mapped_exactly_when_it_saves_min_mapped_tokens(shared, min_mapped):
    held = _ids([{"role": "user", "content": "a question"}])
    engine = _engine(shared, 0)
    engine.run(None, held, GREEDY)
    prompt = torch.cat([held, _ids([{"role": "user", "content": "next"}])])
    _, base_length = engine.store.longest(None, prompt, prompt.shape[0] - 1)
    assert base_length > SINK
    engine.min_mapped_tokens = base_length + min_mapped
    result = engine.run("first", prompt, GREEDY)
    assert result.context_source == ("mapped" if min_mapped == 0 else "prefilled")


def test_an_entry_derived_from_a_mapped_prefix_is_served_as_mapped_not_reused(shared):
    """Finding 2: conversation X (base, then "first" mapped from it) leaves "first"'s cache of X, derived from a
    mapped prefix; conversation Y's first turn is X's first prompt under "first": it reuses that entry, and says
    so (mapped, from the base model), and an exact-only request gets the fresh server's reply."""
    engine = _engine(shared, 0)
    x1 = _ids([{"role": "user", "content": "Tell me about cats."}])
    reply = engine.run(None, x1, GREEDY).new_ids[0]
    x2 = torch.cat([x1, reply, _ids([{"role": "user", "content": "More please."}])])
    assert engine.run("first", x2, GREEDY).context_source == "mapped"
    derived = [e for e in engine.store.entries() if e.adapter == "first"]
    mapped_tokens = x1.shape[0] + reply.shape[0] - 1  # the base model's cache of x1 and the reply but its last token
    assert [(e.made.how, e.made.source, e.made.tokens) for e in derived] == [("mapped", None, mapped_tokens)]
    y = engine.run("first", x1, GREEDY)
    assert (y.context_source, y.context_from) == ("mapped", None) and y.cached_tokens == x1.shape[0] - 1
    exact = engine.run("first", x1, GREEDY, reuse="exact")
    assert exact.context_source == "prefilled" and torch.equal(exact.new_ids, _fresh_reply(shared, "first", x1))


def test_exact_only_requests_never_get_a_mapped_or_derived_cache_and_keep_their_own(shared):
    engine = _engine(shared, 0)
    x1 = _ids([{"role": "user", "content": "exact please"}])
    engine.run("first", x1, GREEDY)  # "first"'s exact cache of x1
    reply = engine.run(None, x1, GREEDY).new_ids[0]
    x2 = torch.cat([x1, reply, _ids([{"role": "user", "content": "go on"}])])
    assert engine.run("first", x2, GREEDY).context_source == "mapped"  # a longer, derived entry of "first"
    kinds = sorted((e.made.how, e.ids.shape[0]) for e in engine.store.entries() if e.adapter == "first")
    assert [k for k, _ in kinds] == ["exact", "mapped"]  # the derived entry did not replace the exact one
    again = engine.run("first", x2, GREEDY, reuse="exact")
    assert again.context_source == "reused" and x1.shape[0] - 1 <= again.cached_tokens < x2.shape[0] - 8
    none = engine.run("first", x2, GREEDY, reuse="none")
    assert (none.context_source, none.cached_tokens) == ("prefilled", 0)
    assert torch.equal(again.new_ids, none.new_ids)


def test_base_entries_mapped_back_from_an_adapter_are_labelled_with_it(shared):
    """Under keep_base="reverse_map" the base cache of a conversation is partly mapped back from the adapter: a base
    request on it says mapped from that adapter."""
    engine = _engine(shared, 0, keep_base="reverse_map")
    x1 = _ids([{"role": "user", "content": "A long enough first message"}])
    reply = engine.run(None, x1, GREEDY).new_ids[0]
    x2 = torch.cat([x1, reply, _ids([{"role": "user", "content": "switch"}])])
    reply2 = engine.run("second", x2, GREEDY).new_ids[0]
    x3 = torch.cat([x2, reply2, _ids([{"role": "user", "content": "back"}])])
    back = engine.run(None, x3, GREEDY)
    assert (back.context_source, back.context_from) == ("mapped", "second")
    assert engine.run(None, x3, GREEDY, reuse="exact").context_source == "reused"  # the base's own cache of x2


def test_store_keeps_exact_entries_beside_derived_ones():
    def kv(n):
        return CapturedKV([torch.zeros(1, 1, n, 2)], [torch.zeros(1, 1, n, 2)])

    from peft_kvcache.runtime.reuse import Made

    store = PrefixStore(2**20)
    ids = torch.arange(12)
    store.add("a", ids[:10], kv(10))
    store.add("a", ids, kv(12), Made("mapped", None, 12))
    assert sorted((e.made.how, len(e.ids)) for e in store.entries()) == [("exact", 10), ("mapped", 12)]
    assert store.longest("a", ids, 12, exact=True)[1] == 10 and store.longest("a", ids, 12)[1] == 12
    store.add("a", ids[:8], kv(8), Made("mapped", None, 8))  # a derived prefix of what is held: nothing new
    assert len(store) == 2
    store.add("a", ids, kv(12))  # an exact cache of it all replaces both
    assert [(e.made.how, len(e.ids)) for e in store.entries()] == [("exact", 12)]


def test_the_default_threshold_is_the_one_the_benchmark_measured():
    from peft_kvcache.serving.engine import DEFAULT_MIN_MAPPED_TOKENS

    results = json.loads((ROOT / "benchmarks" / "results" / "map-threshold.json").read_text())
    assert results["provenance"]["commit"], "the results file records the code it measured"
    assert DEFAULT_MIN_MAPPED_TOKENS == results["recommended_min_mapped_tokens"]
    assert f"Recommended `--min-mapped-tokens`: {DEFAULT_MIN_MAPPED_TOKENS}**" in (
        ROOT / "benchmarks" / "results" / "map-threshold.md").read_text()


def test_entries_computed_with_weights_since_changed_are_never_served(shared, caplog):
    """An adapter's weights written in place (or loaded again under its name) make every stored entry stale: the
    next request prefills instead of reusing the old KV as exact."""
    engine = _engine(shared, 0)
    first = _ids([SYSTEM, {"role": "user", "content": "Dogs?"}])
    engine.run("first", first, GREEDY)
    again = _ids([SYSTEM, {"role": "user", "content": "Dogs?"}, {"role": "assistant", "content": "Yes."},
                  {"role": "user", "content": "Cats?"}])
    assert engine.run("first", again, GREEDY).context_source == "reused"  # the same weights: reused
    lora_b = next(p for name, p in shared.model.named_parameters() if "lora_B.first" in name)
    kept = lora_b.detach().clone()
    with torch.no_grad():
        lora_b.add_(0.5)
    try:
        with caplog.at_level("WARNING", logger="peft_kvcache.serving.engine"):
            result = engine.run("first", again, GREEDY)
        assert (result.context_source, result.cached_tokens) == ("prefilled", 0)
        assert any("weights changed" in r.getMessage() for r in caplog.records)
    finally:
        with torch.no_grad():
            lora_b.copy_(kept)
