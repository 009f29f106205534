"""The connector in real vLLM engines (CPU build, float32, SmolLM2-135M with the committed LoRA adapters): what a
request gets, against vLLM's own prefill and against the library's `MappedCache`, and every way it falls back."""

from __future__ import annotations

import pytest
import torch
from conftest import ADAPTERS, SYSTEM, engine, reset, run, source_of

pytest.importorskip("vllm")

MIN_MAPPED = 256  # two blocks: a prefix of one shared block is too short to map


def _first_logprobs(output) -> dict[int, float]:
    return {token: entry.logprob for token, entry in output.outputs[0].logprobs[0].items()}


@pytest.fixture(scope="module")
def mapping(model_folder, maps_folder):
    with engine(model_folder, maps=maps_folder, min_mapped_tokens=MIN_MAPPED) as llm:
        yield llm


def test_the_first_switch_to_an_adapter_on_a_fresh_engine_is_mapped(mapping, prompt):
    """The adapter's own attention sink for the chat template's conversation start ships in its map: the first switch
    after a start needs no earlier request of the adapter."""
    run(mapping, prompt(0), None)
    out = run(mapping, prompt(0), "shout")
    reference = run(mapping, prompt(0), "shout", salt="reference", reuse="none")
    label = out.kv_transfer_params["peft_kvcache"]
    assert label["context_source"] == "mapped:smollm2" and label["loaded_tokens"] >= MIN_MAPPED and "fallback" not in label
    assert out.outputs[0].text == reference.outputs[0].text


def test_a_conversation_start_no_map_ships_waits_for_the_adapters_own_sink(mapping, tokenizer):
    """Text sent without the chat template starts with a token the maps ship no sink for: that switch is prefilled
    (no_target_sink) and teaches the store the adapter's own; the next one that starts so is mapped."""
    from conftest import SYSTEM

    ids = tokenizer(f"Plain text, no template. {SYSTEM}", add_special_tokens=False).input_ids
    run(mapping, ids, None)
    first = run(mapping, ids, "shout").kv_transfer_params["peft_kvcache"]
    assert first["context_source"] == "prefilled" and first["fallback"] == "no_target_sink"
    other = tokenizer(f"Plain text, no template, again. {SYSTEM}", add_special_tokens=False).input_ids
    run(mapping, other, None)
    second = run(mapping, other, "shout").kv_transfer_params["peft_kvcache"]
    assert second["context_source"] == "mapped:smollm2", second


def test_a_switch_maps_the_base_prefix_and_matches_the_adapters_own_prefill(mapping, prompt):
    base = run(mapping, prompt(1), None)
    mapped = run(mapping, prompt(1), "shout")
    reference = run(mapping, prompt(1), "shout", salt="reference", reuse="none")
    label = mapped.kv_transfer_params["peft_kvcache"]
    assert label["context_source"] == "mapped:smollm2" and label["loaded_tokens"] >= MIN_MAPPED
    assert label["loaded_tokens"] % 128 == 0 and label["prefilled_tokens"] >= 1 and label["engine_cached_tokens"] == 0
    assert mapped.num_cached_tokens == label["loaded_tokens"]
    assert source_of(reference) == "prefilled" and reference.num_cached_tokens == 0
    assert mapped.outputs[0].text == reference.outputs[0].text != base.outputs[0].text


def test_mapped_blocks_are_never_served_as_the_adapters_exact_cache(mapping, prompt):
    """vLLM commits loaded blocks to its prefix cache under the adapter's block hashes: the connector takes them out,
    so the same request again is mapped again (and labelled so), never an exact hit on approximate KV."""
    run(mapping, prompt(2), None)
    first = run(mapping, prompt(2), "shout")
    again = run(mapping, prompt(2), "shout")
    for out in (first, again):
        label = out.kv_transfer_params["peft_kvcache"]
        assert label["context_source"] == "mapped:smollm2" and label["engine_cached_tokens"] == 0


def test_a_request_can_ask_for_exact_reuse_only(mapping, prompt):
    run(mapping, prompt("def f(): pass"), None)
    out = run(mapping, prompt("def f(): pass"), "shout", reuse="exact")
    label = out.kv_transfer_params["peft_kvcache"]
    assert label["context_source"] == "prefilled" and label["fallback"] == "exact_only"


def test_identity_injection_of_the_same_variant_gives_vllms_own_greedy_output(mapping, prompt):
    """The base model's stored prefix injected into a base request vLLM no longer holds (its prefix cache reset, the
    store kept) is vLLM's own KV: the greedy reply is identical, token for token."""
    ids = prompt("def greet(name):\n    return f'hello {name}'\n")
    own = run(mapping, ids, None, max_tokens=24)
    reset(mapping)
    injected = run(mapping, ids, None, max_tokens=24)
    label = injected.kv_transfer_params["peft_kvcache"]
    assert label["context_source"] == "reused" and label["loaded_tokens"] > 0 and label["engine_cached_tokens"] == 0
    assert injected.outputs[0].token_ids == own.outputs[0].token_ids


def test_a_short_shared_prefix_is_prefilled_exactly(mapping, prompt):
    """One shared block (128 tokens) is below the minimum mapped length: the adapter prefills it itself."""
    system = "You are terse. " * 30 + "Now:"  # about 150 tokens: one whole shared block
    run(mapping, prompt(0, system=system), None)
    out = run(mapping, prompt(1, system=system), "shout")
    label = out.kv_transfer_params["peft_kvcache"]
    assert label["context_source"] == "prefilled" and label["fallback"] == "below_min_length"


def test_mapped_injection_gives_the_librarys_next_token_logits(mapping, prompt, model_folder):
    """vLLM with the connector and the library's MappedCache (transformers + PEFT) map the same prefix with the same
    map, and put the target's own sink in front (the library computes it; the engine keeps it from the adapter's own
    earlier request): the first generated token's log-probabilities agree within 2e-3 nats (fp32; the engines'
    kernels differ)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_kvcache import KVMap, MappedCache, adapter_active, run_with_cache
    from peft_kvcache.modeling._compat import with_cache

    ids = prompt("def head(xs, n=5):\n    return list(xs)[:n]\n")
    # another conversation of shout's, prefilled: the store keeps shout's own sink from it
    run(mapping, prompt("def nothing(): pass", system=f"Another conversation. {SYSTEM}"), "shout", reuse="none")
    run(mapping, ids, None)
    out = run(mapping, ids, "shout")
    loaded = out.kv_transfer_params["peft_kvcache"]["loaded_tokens"]
    assert source_of(out) == "mapped:smollm2"
    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(ADAPTERS["shout"]), adapter_name="shout").eval()
    kv_map = KVMap.from_pretrained(mapping_maps(mapping) / "smollm2-135m-instruct-base-to-shout")
    context = torch.tensor([ids[:loaded]])
    with torch.no_grad():
        with adapter_active(model, None):
            source = run_with_cache(model, context)
        with adapter_active(model, "shout"):
            cache = MappedCache.from_source(source, kv_map, model, input_ids=context, refresh_tokens=0)
            rest = torch.tensor([ids[loaded:]])
            logits = model(input_ids=rest, position_ids=torch.arange(loaded, len(ids))[None],
                           **with_cache(model, cache)).logits[0, -1]
    library = torch.log_softmax(logits.float(), -1)
    engine_logprobs = _first_logprobs(out)
    difference = max(abs(library[token].item() - logprob) for token, logprob in engine_logprobs.items())
    assert len(engine_logprobs) >= 20 and difference < 2e-3, difference


def test_a_switch_mapped_beyond_the_adapters_own_cached_blocks_keeps_them_and_its_positions(mapping, prompt,
                                                                                              model_folder):
    """The adapter's own first blocks are in vLLM's prefix cache (an earlier turn of it shared the system prompt); the
    base model's stored prefix is mapped from the first block vLLM lacks on. The target's sink belongs at position 0,
    which vLLM holds already: nothing is written over the first mapped positions, and the first token's
    log-probabilities are the library's on the same cache (the adapter's own blocks, then the mapped rest)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_kvcache import KVMap, MappedCache, adapter_active, run_with_cache
    from peft_kvcache.modeling._compat import with_cache

    body = "".join(f"    total_{i} = sum(x * {i} for x in values)\n" for i in range(40))
    ids = prompt(f"def totals(values):\n{body}    return total_0\n")
    run(mapping, prompt("def nothing(): pass"), "shout", reuse="none")  # shout's own blocks of the system prompt
    run(mapping, ids, None)
    out = run(mapping, ids, "shout")
    label = out.kv_transfer_params["peft_kvcache"]
    local, loaded = label["engine_cached_tokens"], label["loaded_tokens"]
    assert label["context_source"] == "mapped:smollm2" and local >= 128 and loaded >= MIN_MAPPED, label
    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(ADAPTERS["shout"]), adapter_name="shout").eval()
    kv_map = KVMap.from_pretrained(mapping_maps(mapping) / "smollm2-135m-instruct-base-to-shout")
    context = torch.tensor([ids[: local + loaded]])
    with torch.no_grad():
        with adapter_active(model, None):
            source = run_with_cache(model, context)
        with adapter_active(model, "shout"):
            own = run_with_cache(model, context[:, :local])
            cache = MappedCache.from_source(source, kv_map, model, input_ids=context, refresh_tokens=0)
            for layer, keys, values in zip(cache.layers, own.keys, own.values):
                layer.keys[:, :, :local], layer.values[:, :, :local] = keys, values
            logits = model(input_ids=torch.tensor([ids[local + loaded:]]),
                           position_ids=torch.arange(local + loaded, len(ids))[None],
                           **with_cache(model, cache)).logits[0, -1]
    library = torch.log_softmax(logits.float(), -1)
    engine_logprobs = _first_logprobs(out)
    difference = max(abs(library[token].item() - logprob) for token, logprob in engine_logprobs.items())
    assert difference < 2e-3, difference


def test_blocks_computed_on_a_mapped_prefix_are_never_an_exact_hit_later(mapping, prompt):
    """A mapped request's own full blocks (its reply's, here) hold KV computed over mapped KV: once another request of
    the adapter re-caches the prefix exactly, vLLM would chain into them as exact. They leave vLLM's prefix cache when
    the mapped request ends: an exact-only request on the next turn reads exact blocks alone and gets the prefill's
    log-probabilities."""
    ids = prompt(2)
    run(mapping, ids, None)
    first = run(mapping, ids, "shout", max_tokens=140, ignore_eos=True)  # its reply fills a block past the prompt
    assert source_of(first) == "mapped:smollm2"
    turn = ids + list(first.outputs[0].token_ids) + ids[-12:]  # the next turn, on the same conversation
    exact = run(mapping, turn, "shout", reuse="none")
    again = run(mapping, turn, "shout", reuse="exact")
    label = again.kv_transfer_params["peft_kvcache"]
    assert label["engine_cached_tokens"] > len(ids), label  # vLLM's own hit reaches into the first reply
    difference = max(abs(_first_logprobs(exact)[t] - lp) for t, lp in _first_logprobs(again).items())
    assert difference < 1e-4, difference


def mapping_maps(llm):
    """The maps folder the engine's connector was started with."""
    from pathlib import Path

    return Path(llm.llm_engine.vllm_config.kv_transfer_config.kv_connector_extra_config["maps"])


def test_an_adapter_without_a_map_is_prefilled(mapping, prompt, tmp_path_factory, model_folder):
    """A LoRA adapter no published map was fitted for: its switches are ordinary prefills (and never receive the
    base model's KV unmapped)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("unmapped")
    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    torch.manual_seed(0)
    get_peft_model(base, LoraConfig(r=8, target_modules=["k_proj", "v_proj"], init_lora_weights=False),
                   adapter_name="unmapped").save_pretrained(folder)
    mapping.peft_kvcache_adapters["unmapped"] = folder / "unmapped"
    try:
        run(mapping, prompt(0), None)
        out = run(mapping, prompt(0), "unmapped")
        reference = run(mapping, prompt(0), "unmapped", salt="reference", reuse="none")
    finally:
        del mapping.peft_kvcache_adapters["unmapped"]
    label = out.kv_transfer_params["peft_kvcache"]
    assert label["context_source"] == "prefilled" and label["fallback"] == "no_map"
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids


def test_a_switch_from_one_adapter_to_another_maps_through_the_base_model(mapping, prompt):
    """vLLM never computes the base model's KV of an adapter's turn: a switch from docstring to shout maps docstring's
    stored prefix to the base model and on to shout (two published maps), and keeps the adapter's own reply.
    """
    run(mapping, prompt(1), "docstring")  # the conversation starts with an adapter: no base KV of it exists
    out = run(mapping, prompt(1), "shout")
    reference = run(mapping, prompt(1), "shout", salt="reference", reuse="none")
    label = out.kv_transfer_params["peft_kvcache"]
    assert label["context_source"] == "mapped:docstring" and label["loaded_tokens"] >= MIN_MAPPED
    assert out.outputs[0].text == reference.outputs[0].text


def test_the_connectors_metrics_count_tokens_by_source_and_fallbacks(mapping):
    metrics = {(m.name, tuple(sorted(getattr(m, "labels", {}).items()))): m for m in mapping.get_metrics()}
    names = {name for name, _ in metrics}
    assert {"vllm:peft_kvcache_prompt_tokens", "vllm:peft_kvcache_fallbacks", "vllm:peft_kvcache_store_bytes"} <= names

    def value(name, **labels):
        return sum(getattr(m, "value", 0) for (n, ls), m in metrics.items()
                   if n == name and all(dict(ls).get(k) == v for k, v in labels.items()))

    assert value("vllm:peft_kvcache_prompt_tokens", source="mapped") >= 3 * MIN_MAPPED
    assert value("vllm:peft_kvcache_prompt_tokens", source="reused") > 0 and value("vllm:peft_kvcache_store_bytes") > 0
    for reason in ("no_target_sink", "exact_only", "below_min_length", "no_map"):
        assert value("vllm:peft_kvcache_fallbacks", reason=reason) >= 1, reason
