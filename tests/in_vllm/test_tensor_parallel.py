"""The connector under tensor parallelism, in vLLM's CPU build with two ranks (one thread each): a tiny random Llama
whose 2 KV heads split across them, a random LoRA adapter, and base -> adapter maps calibrated here. Each rank keeps
its own heads; a mapped load gathers every source head across the group (a map mixes heads) and writes its own, or,
with a map fitted per shard (``head_shards=2``), maps its own heads from its own source heads alone. Against the same
engine at TP=1: own-prefix reuse is exact, the mapped switch gives the same first-token logprobs within `TOLERANCE`,
and a fallback stays a fallback. Pipeline parallelism is refused at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import engine, needs_smollm, run, source_of

pytest.importorskip("vllm")

TOLERANCE = 2e-3  # first-token logprob, float32: the gather and the ranks' partial sums reorder additions
MIN_MAPPED = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_folder):
    """A random Llama (4 layers, 4 heads / 2 KV heads of 64: the CPU kernels' smallest head, SmolLM2's tokenizer),
    a random LoRA and its map folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft_kvcache import AdapterMaps

    root = tmp_path_factory.mktemp("tp")
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    base.save_pretrained(root / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_folder / name).is_file():
            shutil.copy(model_folder / name, root / "model" / name)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                            init_lora_weights=False), adapter_name="loud").eval()
    model.save_pretrained(root / "adapters")
    generator = torch.Generator().manual_seed(1)
    data = [torch.randint(3, 49152, (256,), generator=generator) for _ in range(12)]
    for folder, head_shards in (("maps", 1), ("maps-per-shard", 2)):
        maps = AdapterMaps.calibrate(model, data, progress=False, reverse=False, head_shards=head_shards)
        maps.save_pretrained(root / folder, "tiny")
    return root


def _session(llm, prompt: list[int]) -> dict:
    """A base turn, a short request that teaches the store the adapter's sink, then the switch, its exact-only twin
    (a fallback) and the switch again (own-prefix reuse of nothing approximate: it is mapped again)."""
    base = run(llm, prompt, None)
    run(llm, prompt[:5], "loud", max_tokens=1)
    mapped = run(llm, prompt, "loud")
    exact_only = run(llm, prompt, "loud", reuse="exact")
    base_again = run(llm, prompt, None, salt="other")
    return {"base": base, "mapped": mapped, "exact_only": exact_only, "base_again": base_again,
            "labels": {k: source_of(v) for k, v in (("base", base), ("mapped", mapped), ("exact_only", exact_only))}}


def _first_logprobs(output) -> dict[int, float]:
    return {token: entry.logprob for token, entry in output.outputs[0].logprobs[0].items()}


@needs_smollm
@pytest.mark.parametrize("maps", ["maps", "maps-per-shard"])
def test_mapped_switches_under_two_ranks_equal_one_rank_within_the_tolerance(tiny, maps, monkeypatch):
    prompt = [1] + [int(t) for t in torch.randint(3, 49152, (400,), generator=torch.Generator().manual_seed(2))]
    results = {}
    for ranks in (1, 2):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if ranks == 2 else "0-1")
        monkeypatch.setenv("OMP_NUM_THREADS", "1" if ranks == 2 else "2")
        with engine(tiny / "model", adapters={"loud": tiny / "adapters" / "loud"}, served_name="tiny",
                    maps=tiny / maps, min_mapped_tokens=MIN_MAPPED,
                    llm_args={"tensor_parallel_size": ranks, "distributed_executor_backend": "mp"}) as llm:
            results[ranks] = _session(llm, prompt)
    for ranks, result in results.items():
        label = result["mapped"].kv_transfer_params["peft_kvcache"]
        assert label["context_source"] == "mapped:tiny" and label["loaded_tokens"] >= MIN_MAPPED, (ranks, label)
        assert result["labels"]["exact_only"] == "prefilled"  # a fallback stays a fallback
    one, two = (_first_logprobs(results[r]["mapped"]) for r in (1, 2))
    shared = set(one) & set(two)
    assert len(shared) >= 15 and max(abs(one[t] - two[t]) for t in shared) < TOLERANCE
    assert results[1]["mapped"].outputs[0].token_ids[:1] == results[2]["mapped"].outputs[0].token_ids[:1]
    exact = [_first_logprobs(results[r]["exact_only"]) for r in (1, 2)]
    assert max(abs(exact[0][t] - exact[1][t]) for t in set(exact[0]) & set(exact[1])) < TOLERANCE


@needs_smollm
def test_pipeline_parallelism_is_refused_at_start_with_a_reason(tmp_path):
    from types import SimpleNamespace

    from peft_kvcache.vllm.parallel import unsupported_parallelism

    config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2))
    assert "pipeline parallelism (2 stages)" in unsupported_parallelism(config)
    config.parallel_config.pipeline_parallel_size = 1
    assert unsupported_parallelism(config) is None


def test_the_tiny_model_splits_its_kv_heads(tiny):
    assert json.loads((tiny / "model" / "config.json").read_text())["num_key_value_heads"] == 2
    assert Path(tiny / "maps").is_dir()
