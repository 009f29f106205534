"""What a model is (`peft_kvcache.modeling.identity`): fingerprints of a model in memory and of the files it loads from
agree, so a serving engine's model (whose weights the library never holds) is recognised by the maps fitted on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from peft_kvcache.errors import IncompatibleModelsError
from peft_kvcache.modeling.fixtures import converted_path, fixture_available
from peft_kvcache.modeling.identity import fingerprint, fingerprint_files

ROOT = Path(__file__).resolve().parents[1]


def _peft(base, seed: int, name: str = "loud"):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False),
                          adapter_name=name)


@pytest.mark.parametrize("kind, tied", [("llama", False), ("llama", True), ("qwen2", False)])
def test_the_files_fingerprint_is_the_loaded_models(tmp_path, kind, tied):
    model = tiny_model(kind, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "model")
    assert fingerprint_files(tmp_path / "model") == fingerprint(model)
    peft_model = _peft(model, seed=3)
    peft_model.save_pretrained(tmp_path / "adapter")
    on_files = fingerprint_files(tmp_path / "model", tmp_path / "adapter" / "loud")
    assert on_files == fingerprint(peft_model) != fingerprint_files(tmp_path / "model")


def test_another_adapter_or_other_weights_give_another_fingerprint(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    _peft(model, seed=3).save_pretrained(tmp_path / "a")
    _peft(tiny_model("llama"), seed=4).save_pretrained(tmp_path / "b")
    prints = {fingerprint_files(tmp_path / "model", tmp_path / name / "loud") for name in ("a", "b")}
    tiny_model("llama", seed=9).save_pretrained(tmp_path / "other")
    assert len(prints | {fingerprint_files(tmp_path / "model"), fingerprint_files(tmp_path / "other")}) == 4


def test_folders_without_weights_or_with_unsupported_adapters_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(IncompatibleModelsError, match="no \\*.safetensors"):
        fingerprint_files(tmp_path / "empty")
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    _peft(model, seed=3).save_pretrained(tmp_path / "adapter")
    config = tmp_path / "adapter" / "loud" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "modules_to_save": ["lm_head"]}))
    with pytest.raises(IncompatibleModelsError, match="modules_to_save"):
        fingerprint_files(tmp_path / "model", tmp_path / "adapter" / "loud")


@pytest.mark.real_model
@pytest.mark.skipif(not fixture_available("gguf:smollm2-135m-instruct"),
                    reason="run `python -m peft_kvcache.modeling.fixtures` first")
def test_the_published_adapter_maps_recognise_the_fixture_files():
    folder = converted_path("gguf:smollm2-135m-instruct")
    config = json.loads((ROOT / "hub_cards/smollm2-135m-instruct-base-to-shout/config.json").read_text())
    assert fingerprint_files(folder) == config["source_fingerprint"]
    assert fingerprint_files(folder, ROOT / "adapters/shout") == config["target_fingerprint"]


def test_files_are_fingerprinted_from_their_samples_and_again_when_replaced_at_the_same_path(tmp_path, monkeypatch):
    """A serving engine fingerprints what it loads at start and at every new adapter: only the sampled values are
    read (never a whole tensor), and an adapter whose files are replaced at the same path is recognised as new."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    _peft(tiny_model("llama"), seed=3).save_pretrained(tmp_path / "adapter")

    def no_tensor_loads(*args, **kwargs):
        raise AssertionError("a fingerprint loaded a tensor")

    monkeypatch.setattr("safetensors.safe_open", no_tensor_loads)  # the samples' bytes only, from the mapped file
    before = fingerprint_files(tmp_path / "model", tmp_path / "adapter" / "loud")
    _peft(tiny_model("llama"), seed=4).save_pretrained(tmp_path / "adapter")  # new weights, same path
    after = fingerprint_files(tmp_path / "model", tmp_path / "adapter" / "loud")
    assert after != before and after == fingerprint(_peft(tiny_model("llama"), seed=4))


def test_a_fingerprint_asked_again_is_not_computed_again_unless_a_file_changed(tmp_path, monkeypatch):
    """An engine asks for a variant's fingerprint with every request: the same files give the memoized digest; any of
    the files read changing (the adapter's config included) computes it again."""
    from peft_kvcache.modeling import identity

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    _peft(model, seed=3).save_pretrained(tmp_path / "adapter")
    adapter = tmp_path / "adapter" / "loud"
    first = fingerprint_files(tmp_path / "model", adapter)
    computed = []
    original = identity._fingerprint_read
    monkeypatch.setattr(identity, "_fingerprint_read", lambda *args: computed.append(args) or original(*args))
    assert fingerprint_files(tmp_path / "model", adapter) == first and not computed
    config = adapter / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "modules_to_save": ["lm_head"]}))
    with pytest.raises(IncompatibleModelsError, match="modules_to_save"):
        fingerprint_files(tmp_path / "model", adapter)
    assert len(computed) == 1
