"""What real traffic brings the connector, in real engines: a conversation that switches at every turn, resets,
adapters replaced at the same path, preemption, requests that are not plain token ids, careless options. Each case
once served stale or foreign KV, or mislabelled or miscounted it."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import ADAPTERS, SYSTEM, engine, reset, run

pytest.importorskip("vllm")

MIN_MAPPED = 256


@pytest.fixture(scope="module")
def served(model_folder, maps_folder):
    with engine(model_folder, maps=maps_folder, min_mapped_tokens=MIN_MAPPED,
                llm_args={"enable_prompt_embeds": True}) as llm:
        yield llm


def _label(output) -> dict:
    return output.kv_transfer_params["peft_kvcache"]


def test_a_conversation_switching_at_every_turn_prefills_only_its_new_tokens(served, tokenizer):
    """Turn after turn, base and shout alternate. The first switch maps the base model's KV; later ones take the
    longest of the variant's own KV (vLLM's, or what its last mapped turn computed, kept as derived) and the other's
    stored KV mapped, which pays only when it saves ``min_mapped_tokens``: either way the tokens computed per turn
    stay those of the turn, never the growing history."""
    messages = [{"role": "system", "content": f"Conversation of turns. {SYSTEM}"}]
    prefilled, sources, labels = [], [], []
    for turn in range(8):
        messages.append({"role": "user", "content": f"Question {turn}: what does function number {turn} return?"})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        out = run(served, ids, None if turn % 2 == 0 else "shout", max_tokens=12)
        label = _label(out)
        labels.append(label)
        prefilled.append(label["prefilled_tokens"])
        sources.append(label["context_source"])
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    assert sources[0] == "prefilled" and sources[1] == "mapped:smollm2", sources
    assert all(source in ("reused", "mapped:smollm2") for source in sources[2:]), sources
    # derived KV says how many maps it passed through (a turn extending a mapped one keeps its count), exact KV nothing
    assert all(("hops" in label) == label["context_source"].startswith("mapped") for label in labels), labels
    assert all(1 <= label.get("hops", 1) <= 2 for label in labels), labels
    # the variant's own KV and a turn's new tokens, until mapping the other's saves min_mapped_tokens: a switch maps
    # again then, and the tokens computed fall back (a saw-tooth bounded by the policy, whatever the history)
    assert "mapped:smollm2" in sources[3:] and max(prefilled[1:]) < MIN_MAPPED + 128, (sources, prefilled)


def test_a_reset_drops_the_store(served, prompt):
    run(served, prompt(0), None)
    reset(served, connector=True)
    label = _label(run(served, prompt(0), "shout"))
    assert label["context_source"] == "prefilled" and label["loaded_tokens"] == 0


def test_an_adapter_replaced_at_the_same_path_is_served_nothing_of_its_old_weights(served, prompt, tmp_path):
    """vLLM keys an adapter's cached blocks by its name and path, not its weights: after the files change at the same
    path (reloaded under a new LoRA id), neither vLLM's prefix cache nor the store may serve the old weights' KV."""
    folder = tmp_path / "hot"
    shutil.copytree(ADAPTERS["shout"], folder)
    served.peft_kvcache_adapters["hot"] = folder
    try:
        run(served, prompt(1), None)
        first = _label(run(served, prompt(1), "hot", lora_id=20))
        assert first["context_source"] == "mapped:smollm2" or first["fallback"] == "no_map"
        again = _label(run(served, prompt(1), "hot", lora_id=20))  # vLLM's own cache or the store: the same weights
        assert again["cached_tokens"] > 0
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy(ADAPTERS["docstring"] / name, folder / name)
        replaced = run(served, prompt(1), "hot", lora_id=21)
        reference = run(served, prompt(1), "hot", lora_id=21, salt="reference", reuse="none")
    finally:
        del served.peft_kvcache_adapters["hot"]
    label = _label(replaced)
    assert label["engine_cached_tokens"] == 0 and label["context_source"] != "reused", label
    assert replaced.outputs[0].token_ids == reference.outputs[0].token_ids


def test_a_request_of_the_old_lora_id_after_the_files_change_leaves_nothing_for_the_new_one(served, prompt, tmp_path):
    """The files change at the same path, and a request still comes under the adapter's old LoRA id before the reload:
    vLLM runs the weights it loaded under that id, the old ones, so what the request computes is of no files on disk:
    kept nowhere, and the request of the reloaded adapter (a new id) reads nothing of it."""
    folder = tmp_path / "late"
    shutil.copytree(ADAPTERS["shout"], folder)
    served.peft_kvcache_adapters["late"] = folder
    try:
        run(served, prompt(1), "late", lora_id=50)
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy(ADAPTERS["docstring"] / name, folder / name)
        late = run(served, prompt(1), "late", lora_id=50)  # the old id: shout's weights, still loaded under it
        replaced = run(served, prompt(1), "late", lora_id=51)
        reference = run(served, prompt(1), "late", lora_id=51, salt="reference", reuse="none")
        again = run(served, prompt(1), "late", lora_id=50)  # the old id once more, beside the new one's KV
    finally:
        del served.peft_kvcache_adapters["late"]
    assert _label(late)["fallback"] == "stale_lora_id" and _label(late)["cached_tokens"] == 0, _label(late)
    label = _label(replaced)
    assert label["engine_cached_tokens"] == 0 and label["context_source"] != "reused", label
    assert replaced.outputs[0].token_ids == reference.outputs[0].token_ids
    # nor is the old id served the new files' KV (vLLM's prefix cache holds it under the adapter's name and path)
    assert _label(again)["cached_tokens"] == 0 and _label(again)["fallback"] == "stale_lora_id", _label(again)
    assert again.outputs[0].token_ids == late.outputs[0].token_ids


def test_an_adapter_no_map_reads_replaced_at_the_same_path_is_served_nothing_of_its_old_weights(served, prompt,
                                                                                                  tmp_path):
    """The same for an adapter whose KV no map reads (the store keeps nothing of it, vLLM's prefix cache does)."""
    folder = tmp_path / "unmapped"
    shutil.copytree(ADAPTERS["shout"], folder)  # no map of this engine reads it, and this conversation is new
    served.peft_kvcache_adapters["unmapped"] = folder
    try:
        run(served, prompt(2), "unmapped", lora_id=40)
        again = _label(run(served, prompt(2), "unmapped", lora_id=40))
        assert again["engine_cached_tokens"] > 0  # vLLM's own prefix cache: the same weights
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy(ADAPTERS["docstring"] / name, folder / name)
        replaced = run(served, prompt(2), "unmapped", lora_id=41)
        reference = run(served, prompt(2), "unmapped", lora_id=41, salt="reference", reuse="none")
    finally:
        del served.peft_kvcache_adapters["unmapped"]
    label = _label(replaced)
    assert label["engine_cached_tokens"] == 0 and label["context_source"] != "reused", label
    assert replaced.outputs[0].token_ids == reference.outputs[0].token_ids


def test_requests_that_are_not_plain_token_ids_are_never_served_from_the_store(served, model_folder, prompt):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    ids = prompt(2)
    run(served, ids, None)
    embeddings = AutoModelForCausalLM.from_pretrained(model_folder).get_input_embeddings()
    with torch.no_grad():
        embeds = embeddings(torch.tensor(ids)).float()
    out = served.generate([{"prompt_embeds": embeds}], SamplingParams(temperature=0.0, max_tokens=4),
                          lora_request=LoRARequest("shout", 1, str(ADAPTERS["shout"])), use_tqdm=False)[0]
    label = _label(out)
    assert label["context_source"] == "prefilled" and label["fallback"] == "multimodal"
    # nor kept there: a prompt-embeds request's token ids are placeholders (zeros), under which a plain request of
    # those ids would be served its KV (mapped, once shout's own sink for a first token 0 is known)
    served.generate([{"prompt_embeds": embeds}], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    zeros = [0] * len(ids)
    run(served, zeros[:8] + ids, "shout", reuse="none")
    plain = _label(run(served, zeros, "shout"))
    assert plain["context_source"] == "prefilled", plain


def test_careless_options_are_read_as_exact_and_named_briefly(served, prompt):
    run(served, prompt(0, system=f"Careless. {SYSTEM}"), None)
    for params in ({"reuse": "map", "x" * 100_000: 1}, {"reuse": "y" * 100_000}, "nope"):
        label = _label(run(served, prompt(0, system=f"Careless. {SYSTEM}"), "shout", params=params))
        assert label["fallback"] == "invalid_options" and label["context_source"] in ("prefilled", "reused")


def test_an_adapter_replaced_while_its_request_runs_serves_nothing_of_that_request(served, prompt, tmp_path):
    """A request runs on the old weights while the files change at the same path (a reload under a new LoRA id
    comes after it: this vLLM fails a step that holds two ids of one adapter name). The request of the new weights
    reads nothing of the old weights' blocks (vLLM would hit them by the adapter's name and path), and nothing the
    old request computed is kept."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    folder = tmp_path / "running"
    shutil.copytree(ADAPTERS["shout"], folder)
    served.peft_kvcache_adapters["running"] = folder
    ids = prompt(1)
    engine = served.llm_engine
    try:
        engine.add_request("old-weights", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
                           lora_request=LoRARequest("running", 70, str(folder)))
        for _ in range(3):  # prefilled, decoding
            engine.step()
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy(ADAPTERS["docstring"] / name, folder / name)
        while engine.has_unfinished_requests():
            engine.step()
        after = run(served, ids, "running", lora_id=71)
        reference = run(served, ids, "running", lora_id=71, salt="reference", reuse="none")
    finally:
        del served.peft_kvcache_adapters["running"]
    label = _label(after)
    assert label["engine_cached_tokens"] == 0 and label["context_source"] != "reused", label
    assert after.outputs[0].token_ids == reference.outputs[0].token_ids
