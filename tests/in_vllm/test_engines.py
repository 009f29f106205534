"""The connector in engines of their own (each test starts one, so that no other engine shares its metrics): a load
that fails, naive mode, the store's bound, a restart, a quantized cache, preemption."""

from __future__ import annotations

import pytest
import torch
from peft_kvcache._cpu import cpu_flags
from conftest import ADAPTERS, SYSTEM, engine, reset, run, source_of

pytest.importorskip("vllm")

MIN_MAPPED = 256


def test_a_load_that_fails_in_the_worker_is_recomputed_by_the_engine(model_folder, prompt, tmp_path):
    """A map whose key weights overflow what they map into (finite, so it loads; its output is not) fails the load
    that uses it: vLLM recomputes the blocks, the reply is the adapter's own, the label says so, and the request is
    not offered the load again. A map the worker cannot load at all (NaN weights) is never chosen."""
    import shutil

    from conftest import ROOT
    from safetensors.torch import load_file, save_file

    for name, fill in (("smollm2-135m-instruct-base-to-docstring", 1e38), ("smollm2-135m-instruct-base-to-shout", None)):
        shutil.copytree(ROOT / "hub_cards" / name, tmp_path / name)
        tensors = load_file(tmp_path / name / "model.safetensors")
        tensors["keys.3.weight"] = torch.full_like(tensors["keys.3.weight"], float("nan") if fill is None else fill)
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
    with engine(model_folder, maps=tmp_path, min_mapped_tokens=MIN_MAPPED) as llm:
        run(llm, prompt(1), None)
        out = run(llm, prompt(1), "docstring")
        reference = run(llm, prompt(1), "docstring", salt="reference", reuse="none")
        unloadable = run(llm, prompt(1), "shout")
    label = out.kv_transfer_params["peft_kvcache"]
    assert label["context_source"] == "prefilled" and label["fallback"] == "load_error"
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert unloadable.kv_transfer_params["peft_kvcache"]["fallback"] == "unusable_map"


def test_an_admission_that_fails_after_queuing_its_load_is_recomputed_and_the_engine_goes_on(model_folder,
                                                                                              maps_folder, prompt):
    """vLLM asks the connector to admit a request after agreeing to skip its loaded tokens: when the admission raises
    (tests/in_vllm/failing_admission_connector.py, after it queued the load and the evictions), the engine is not
    failed, the half-planned load is withdrawn, the tokens are recomputed (the adapter's own reply, labelled
    ``load_error``), and later requests are served."""
    with engine(model_folder, maps=maps_folder, min_mapped_tokens=MIN_MAPPED,
                transfer_args={"kv_connector_module_path": "failing_admission_connector"}) as llm:
        run(llm, prompt(1), None)
        out = run(llm, prompt(1), "shout")
        reference = run(llm, prompt(1), "shout", salt="reference", reuse="none")
        later = run(llm, prompt(2), None)
    label = out.kv_transfer_params["peft_kvcache"]
    assert label["context_source"] == "prefilled" and label["fallback"] == "load_error", label
    assert label["loaded_tokens"] == 0
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert source_of(later) in ("prefilled", "reused")


def test_without_vllms_block_pool_nothing_is_mapped_and_each_problem_is_said_once(model_folder, maps_folder, prompt,
                                                                                  capfd):
    """A vLLM that never hands the connector its block pool (tests/in_vllm/no_pool_connector.py): mapped blocks could
    not be kept out of vLLM's prefix cache, where a later request of the adapter would take them as its own, so
    switches are prefilled, labelled ``no_block_pool``. The start says which load-failure policy the connector
    overrides (vLLM's default fails a request whose load fails); each problem is logged once, briefly, however many
    requests meet it."""
    with engine(model_folder, maps=maps_folder, min_mapped_tokens=MIN_MAPPED,
                transfer_args={"kv_connector_module_path": "no_pool_connector"}) as llm:
        switches, careless = [], []
        for i in (1, 2):  # contexts of their own: the second switch finds no exact blocks of the first
            run(llm, prompt(i, system=f"Pool {i}. {SYSTEM}"), None)
            switches.append(run(llm, prompt(i, system=f"Pool {i}. {SYSTEM}"), "shout"))
            careless.append(run(llm, prompt(i, system=f"Careless {i}. {SYSTEM}"), "shout",
                                params={"reuse": "y" * 100_000}))
    labels = [out.kv_transfer_params["peft_kvcache"] for out in switches]
    assert all(label["context_source"] == "prefilled" and label["fallback"] == "no_block_pool" for label in labels), \
        labels
    assert all(out.kv_transfer_params["peft_kvcache"]["fallback"] == "invalid_options" for out in careless)
    log = "".join(capfd.readouterr())
    assert "kv_load_failure_policy 'fail' -> 'recompute'" in log
    assert log.count("(no_block_pool; logged once per reason)") == 1, log[-2000:]
    assert log.count("(invalid_options; logged once per reason)") == 1, log[-2000:]
    assert max(len(line) for line in log.splitlines() if "peft-kvcache:" in line) < 500


def test_naive_mode_injects_the_base_prefix_unmapped_and_says_so(model_folder, prompt):
    with engine(model_folder, mode="naive", min_mapped_tokens=MIN_MAPPED) as llm:
        run(llm, prompt(1), None)
        out = run(llm, prompt(1), "shout")
        reference = run(llm, prompt(1), "shout", salt="reference", reuse="none")
    label = out.kv_transfer_params["peft_kvcache"]
    assert label["context_source"] == "naive:smollm2" and label["loaded_tokens"] >= MIN_MAPPED
    assert source_of(reference) == "prefilled"


def test_the_store_is_bounded_and_evicts_the_least_recently_used(model_folder, prompt):
    """A store that holds one long prefix: keeping a second evicts the first, which is then prefilled again."""
    first, second = prompt(0), prompt(1, system="Answer in one line. " * 80)
    per_token = 30 * 2 * 3 * 64 * 4  # layers x (keys, values) x KV heads x head size x float32
    bound = 1.5 * (len(first) // 128) * 128 * per_token
    assert len(second) // 128 >= len(first) // 128
    with engine(model_folder, mode="exact", store_gib=bound / 2**30) as llm:
        run(llm, first, None)
        reset(llm)
        assert source_of(run(llm, first, None)) == "reused"  # from the store
        run(llm, second, None)
        reset(llm)
        assert source_of(run(llm, first, None)) == "prefilled"  # evicted
        evictions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:peft_kvcache_store_evictions")
    assert evictions >= 1


def test_a_switch_aborted_while_its_load_runs_leaves_the_engine_serving(model_folder, maps_folder, prompt):
    """A client that leaves while its switch's mapped load still runs (a CPU engine spreads a load over the steps of
    a stream that keeps decoding): vLLM holds the request's blocks until the load is reported done, so the connector
    keeps nothing of it (a copy would report the same request twice: vLLM frees it at the first report and fails an
    assertion at the second, killing the engine). The stream decodes to its end, and the next switch is mapped."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    with engine(model_folder, maps=maps_folder, min_mapped_tokens=MIN_MAPPED) as llm:
        core = llm.llm_engine
        run(llm, prompt(1), None)  # the base model's KV of the context, stored
        stream = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        core.add_request("stream", {"prompt_token_ids": prompt(0, system=f"Stream. {SYSTEM}")}, stream)
        for _ in range(3):
            core.step()
        # docstring is a map's source (docstring -> base): what its requests compute would be kept
        adapter = LoRARequest("docstring", 2, str(ADAPTERS["docstring"]))
        core.add_request("switch", {"prompt_token_ids": prompt(1)}, SamplingParams(temperature=0.0, max_tokens=8),
                         lora_request=adapter)
        core.step()  # admitted: its load starts
        core.abort_request(["switch"])
        outputs = {}
        while core.has_unfinished_requests():
            for out in core.step():
                outputs[out.request_id] = out
        assert len(outputs["stream"].outputs[0].token_ids) == 48
        after = run(llm, prompt(1), "docstring")
    assert source_of(after).startswith("mapped:"), after.kv_transfer_params


def test_a_source_adapter_replaced_at_the_same_path_is_never_mapped_from_its_old_kv(model_folder, prompt, tmp_path):
    """The store keeps the KV of an adapter (the docstring adapter's weights); its files are then replaced by another
    adapter's (shout's) at the same path. A switch to the base model must not map the old weights' KV with the map the
    new files match (shout -> base): the stale entries are dropped and the switch is prefilled."""
    import shutil

    from conftest import ROOT

    for name in ("smollm2-135m-instruct-docstring-to-base", "smollm2-135m-instruct-shout-to-base"):
        shutil.copytree(ROOT / "hub_cards" / name, tmp_path / "maps" / name)
    folder = tmp_path / "hot"
    shutil.copytree(ADAPTERS["docstring"], folder)
    adapters = {"hot": folder}
    ids = prompt(1)
    with engine(model_folder, maps=tmp_path / "maps", adapters=adapters, min_mapped_tokens=MIN_MAPPED) as llm:
        assert source_of(run(llm, ids, "hot")) == "prefilled"  # kept: a map takes the docstring adapter's KV to base
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy(ADAPTERS["shout"] / name, folder / name)
        switched = run(llm, ids, None).kv_transfer_params["peft_kvcache"]
    assert switched["context_source"] == "prefilled" and switched["loaded_tokens"] == 0, switched


def test_an_engine_restart_loses_only_the_store(model_folder, maps_folder, prompt):
    """The store lives in the engine's processes: a new engine starts with nothing to load, and maps again once it
    holds a base prefix (the adapter's sink ships in its map)."""
    from conftest import SYSTEM

    for _ in range(2):
        with engine(model_folder, maps=maps_folder, min_mapped_tokens=MIN_MAPPED) as llm:
            out = run(llm, prompt(0, system=f"First of all. {SYSTEM}"), "shout")
            label = out.kv_transfer_params["peft_kvcache"]
            assert label["context_source"] == "prefilled" and "fallback" not in label and out.num_cached_tokens == 0
            run(llm, prompt(1), None)
            assert source_of(run(llm, prompt(1), "shout")) == "mapped:smollm2"


# vLLM's CPU build cannot start an engine with an fp8 KV cache without AVX-512 or AMX ("FP8 KV cache on CPU requires
# x86 with AVX-512 or AMX"): there is no quantized cache to refuse on such a CPU.
@pytest.mark.skipif(not cpu_flags() & {"avx512f", "amx_bf16"}, reason="vLLM's fp8 KV cache needs AVX-512 or AMX")
def test_a_quantized_kv_cache_is_refused_by_the_worker_and_served_by_prefill(model_folder, maps_folder, prompt):
    """An fp8 cache packs blocks in no layout the connector knows: it maps nothing, and every request is the
    engine's own prefill."""
    with engine(model_folder, maps=maps_folder, dtype="bfloat16", llm_args={"kv_cache_dtype": "fp8"},
                min_mapped_tokens=MIN_MAPPED) as llm:
        run(llm, prompt(1), None)
        out = run(llm, prompt(1), "shout")
        fallbacks = {m.labels.get("reason") for m in llm.get_metrics() if m.name == "vllm:peft_kvcache_fallbacks"}
    assert source_of(out) == "prefilled" and out.outputs[0].text
    assert "unsupported_layout" in fallbacks


def test_preempted_requests_keep_their_label_and_are_counted_once(model_folder, maps_folder, prompt):
    """A cache of a few blocks for four long switches at once: vLLM preempts some (and prefills them again); every
    label still says where its context came from, and the tokens counted by source add up to the prompts'."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    with engine(model_folder, maps=maps_folder, min_mapped_tokens=MIN_MAPPED,
                llm_args={"num_gpu_blocks_override": 14, "max_num_seqs": 4, "max_model_len": 1536}) as llm:
        prompts = [prompt(i % 3, system=f"Preemption {i}. {SYSTEM}") for i in range(4)]
        for ids in prompts:
            run(llm, ids, None, max_tokens=1)
        # about 400 prompt tokens (4 blocks) each, growing past 512 (a fifth block): three run at once, and the
        # blocks they grow into are not there
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                            SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
                            lora_request=LoRARequest("shout", 1, str(ADAPTERS["shout"])), use_tqdm=False)
        by_source, preemptions = _prompt_tokens_and_preemptions(llm)
    assert preemptions >= 1
    assert all(source_of(out).startswith("mapped:") for out in outs), [source_of(o) for o in outs]
    total = sum(len(ids) for ids in prompts) * 2  # the base turns and the switches
    assert sum(by_source.values()) == total, by_source


def test_short_prompts_with_long_replies_preempted_count_no_more_than_their_prompts(model_folder, maps_folder, tokenizer):
    """Preempted after part of its reply, a request is admitted again with vLLM's own prefix-cache hit over its prompt
    and the reply so far: more tokens than its prompt. Its label and the counters still add up to its prompt (a
    negative count would stop the engine: prometheus refuses to decrease a counter)."""
    from vllm import SamplingParams

    with engine(model_folder, maps=maps_folder, min_mapped_tokens=MIN_MAPPED,
                llm_args={"num_gpu_blocks_override": 8, "max_num_seqs": 4, "max_model_len": 640}) as llm:
        prompts = [tokenizer(f"Count to a thousand, number {i}:", add_special_tokens=False).input_ids
                   for i in range(4)]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                            SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), use_tqdm=False)
        by_source, preemptions = _prompt_tokens_and_preemptions(llm)
    assert preemptions >= 1
    for ids, out in zip(prompts, outs):
        label = out.kv_transfer_params["peft_kvcache"]
        assert len(out.outputs[0].token_ids) == 400
        assert label["cached_tokens"] <= len(ids) and label["prefilled_tokens"] == len(ids) - label["cached_tokens"]
    assert sum(by_source.values()) == sum(len(ids) for ids in prompts), by_source


def test_in_exact_mode_an_adapter_replaced_at_the_same_path_is_served_nothing_of_its_old_weights(model_folder,
                                                                                                  prompt, tmp_path):
    """Without maps (mode "exact") the store still keeps each variant's KV, and vLLM's prefix cache its blocks: a
    variant whose files change loses both there too."""
    import shutil

    folder = tmp_path / "hot"
    shutil.copytree(ADAPTERS["shout"], folder)
    with engine(model_folder, adapters={"hot": folder}, mode="exact") as llm:
        run(llm, prompt(0), "hot", lora_id=1)
        assert run(llm, prompt(0), "hot", lora_id=1).kv_transfer_params["peft_kvcache"]["cached_tokens"] > 0
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy(ADAPTERS["docstring"] / name, folder / name)
        replaced = run(llm, prompt(0), "hot", lora_id=2)
        reference = run(llm, prompt(0), "hot", lora_id=2, salt="reference", reuse="none")
    label = replaced.kv_transfer_params["peft_kvcache"]
    assert label["cached_tokens"] == 0 and label["context_source"] == "prefilled", label
    assert replaced.outputs[0].token_ids == reference.outputs[0].token_ids


def _prompt_tokens_and_preemptions(llm) -> tuple[dict[str, float], float]:
    """The connector's prompt tokens by source, and vLLM's preemptions, from the engine's metrics."""
    by_source, preemptions = {}, 0
    for m in llm.get_metrics():
        if m.name == "vllm:peft_kvcache_prompt_tokens":
            by_source[m.labels["source"]] = by_source.get(m.labels["source"], 0) + m.value
        preemptions += m.value if m.name == "vllm:num_preemptions" else 0
    return by_source, preemptions
