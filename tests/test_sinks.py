"""Target sinks shipped in a map (`peft_kvcache.calibration.sinks`): the target's own KV of a conversation's first
tokens, computed with the map's target, saved and loaded with the map, refused for the wrong model."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model
from test_peft import peft_with_adapters

from peft_kvcache import KVMap
from peft_kvcache.calibration.loop import calibrate_adapters
from peft_kvcache.calibration.sinks import conversation_starts, ship_target_sinks
from peft_kvcache.errors import ArtifactError, FingerprintMismatchError
from peft_kvcache.modeling.adapters import adapter_active
from peft_kvcache.modeling.capture import run_with_cache


@pytest.fixture(scope="module")
def adapter_map():
    model = peft_with_adapters()
    maps = calibrate_adapters(model, random_ids(8, 32, seed=3), progress=False, adapters=["strong"], reverse=False)
    return model, maps.to_adapter["strong"]


def test_the_shipped_sink_is_the_targets_own_kv_and_survives_a_save(adapter_map, tmp_path):
    model, kv_map = adapter_map
    with adapter_active(model, "strong"):
        shipped = ship_target_sinks(kv_map, model, [[5], [7]])
        own = run_with_cache(model, torch.tensor([[7]]))
    keys, values = shipped.shipped_sink([7])
    assert torch.equal(keys, torch.stack([k[0] for k in own.keys])) and torch.equal(values, torch.stack([v[0] for v in own.values]))
    assert shipped.shipped_sink([9]) is None and kv_map.shipped_sink([7]) is None  # the original map is unchanged
    assert all(torch.equal(shipped.tensors[n], t) for n, t in kv_map.tensors.items())  # weights unchanged
    loaded = KVMap.from_pretrained(shipped.save_pretrained(tmp_path / "map", chart=False))
    assert loaded.config.sinks == [[5], [7]] and torch.equal(loaded.shipped_sink([7])[0], keys)
    halved = shipped.with_weights_dtype(torch.bfloat16)  # storage dtype is for weights: the sink stays exact
    assert halved.tensors["keys.0.weight"].dtype == torch.bfloat16 and torch.equal(halved.shipped_sink([7])[1], values)
    with adapter_active(model, None):  # the base's KV is not the adapter's sink
        with pytest.raises(FingerprintMismatchError):
            ship_target_sinks(kv_map, model, [[5]])


def test_a_config_with_malformed_starts_is_refused(adapter_map, tmp_path):
    import json

    model, kv_map = adapter_map
    with adapter_active(model, "strong"):
        folder = ship_target_sinks(kv_map, model, [[5]]).save_pretrained(tmp_path / "map", chart=False)
    config = json.loads((folder / "config.json").read_text())
    for sinks in ([[5, 6]], [[5], [5]], [[10**9]]):  # the wrong length, a repeat, outside the vocabulary
        (folder / "config.json").write_text(json.dumps({**config, "sinks": sinks}))
        with pytest.raises(ArtifactError, match="sinks"):
            KVMap.from_pretrained(folder)


def test_conversation_starts_are_the_chat_templates_and_bos_first_tokens():
    from conftest import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}#{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    starts = conversation_starts(tokenizer, 1)
    assert starts == [tokenizer("#", add_special_tokens=False).input_ids[:1]]
    assert conversation_starts(tokenizer, 2)[0] == tokenizer("#s", add_special_tokens=False).input_ids


def test_forget_weights_drops_what_was_memoized_from_weights_written_through_data():
    from peft_kvcache import forget_weights
    from peft_kvcache.modeling.identity import cached_fingerprint
    from peft_kvcache.runtime.target_sink import target_sink

    model = tiny_model("llama", seed=3)
    ids = torch.tensor([[1, 2, 3]])
    mask = torch.ones_like(ids)
    before, printed = target_sink(model, ids, mask, 0), cached_fingerprint(model)
    model.model.layers[0].self_attn.k_proj.weight.data.mul_(2)  # torch counts no version: the memos cannot see it
    assert target_sink(model, ids, mask, 0) is before
    forget_weights(model)
    after = target_sink(model, ids, mask, 0)
    assert after is not before and torch.equal(after.keys[0], run_with_cache(model, ids).keys[0])
    assert cached_fingerprint(model) != printed
