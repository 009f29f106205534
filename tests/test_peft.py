"""Base <-> adapter maps of a PeftModel (adapter_maps.py, calibrate.calibrate_adapters), on tiny random models
with random LoRA adapters."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model
from peft import LoraConfig, get_peft_model

from peft_kvcache import FingerprintMismatchError, MappedCache
from peft_kvcache.calibration.loop import calibrate_adapters
from peft_kvcache.errors import ModelLoadError
from peft_kvcache import load_model
from peft_kvcache.maps.adapter_maps import AdapterMaps, folder_name
from peft_kvcache.modeling._compat import with_cache
from peft_kvcache.modeling.adapters import adapter_active, load_adapters
from peft_kvcache.modeling.capture import run_with_cache

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(seed: int, scale: float = 1.0, r: int = 8) -> LoraConfig:
    """A random adapter with a real effect (``init_lora_weights=False`` makes B nonzero)."""
    torch.manual_seed(seed)
    return LoraConfig(task_type="CAUSAL_LM", r=r, lora_alpha=r * scale, target_modules=MODULES,
                      init_lora_weights=False)


def peft_with_adapters(scales=(("strong", 1.0), ("mild", 0.3)), seed: int = 0):
    base = tiny_model("llama", seed=seed)
    (first, s0), *rest = scales
    model = get_peft_model(base, lora(10, s0), adapter_name=first)
    for i, (name, scale) in enumerate(rest):
        model.add_adapter(name, lora(11 + i, scale))
    return model.eval()


@pytest.fixture(scope="module")
def peft_pair():
    model = peft_with_adapters()
    maps = calibrate_adapters(model, random_ids(16, 48, seed=3), progress=False)
    return model, maps


def _continuation_kl(model, cache, ids: torch.Tensor, context: int) -> float:
    """KL(full || cached) of the next-token distributions over ``ids[context:]``, adapter as active now."""
    with torch.no_grad():
        full = model(input_ids=ids[None]).logits[0, context:]
        out = model(input_ids=ids[None, context:], position_ids=torch.arange(context, len(ids))[None],
                    use_cache=True, **with_cache(model, cache)).logits[0]
    p, q = full.log_softmax(-1), out.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_one_pass_fits_both_directions_with_adapter_names(peft_pair):
    model, maps = peft_pair
    assert set(maps.to_adapter) == set(maps.to_base) == {"strong", "mild"}
    forward, backward = maps.to_adapter["strong"].config, maps.to_base["strong"].config
    assert forward.target_name.endswith("+strong") and "+" not in forward.source_name
    assert backward.source_name.endswith("+strong") and "+" not in backward.target_name
    assert forward.calibration.target.adapter == "strong" and backward.calibration.source.adapter == "strong"
    assert forward.calibration.source.adapter is None and backward.calibration.target.adapter is None
    assert forward.pair_kind == "same_shape"
    assert forward.key_layers == [[0], [1]]
    # The base side of every map carries the base fingerprint; the adapter side its own.
    assert forward.source_fingerprint == maps.to_adapter["mild"].config.source_fingerprint
    assert forward.target_fingerprint != maps.to_adapter["mild"].config.target_fingerprint
    assert model.active_adapter == "strong"  # calibration restored PEFT's state


@pytest.mark.parametrize("adapter", ["strong", "mild"])
def test_mapped_base_cache_beats_naive_reuse(peft_pair, adapter):
    model, maps = peft_pair
    ids = random_ids(1, 40, seed=99)[0]
    context = 32
    with adapter_active(model, None):
        base = run_with_cache(model, ids[None, :context])
    with adapter_active(model, adapter):
        mapped = MappedCache.from_source(MappedCache(base), maps.to_adapter[adapter],
                                         model, input_ids=ids[None, :context])
        kl_mapped = _continuation_kl(model, mapped, ids, context)
        kl_naive = _continuation_kl(model, MappedCache(base), ids, context)
    assert kl_mapped < 0.7 * kl_naive, (kl_mapped, kl_naive)


def test_reverse_map_beats_naive_reuse(peft_pair):
    model, maps = peft_pair
    ids = random_ids(1, 40, seed=98)[0]
    with adapter_active(model, "strong"):
        own = run_with_cache(model, ids[None, :32])
    with adapter_active(model, None):
        mapped = MappedCache.from_source(MappedCache(own), maps.to_base["strong"],
                                         model, input_ids=ids[None, :32])
        kl_mapped = _continuation_kl(model, mapped, ids, 32)
        kl_naive = _continuation_kl(model, MappedCache(own), ids, 32)
    assert kl_mapped < 0.7 * kl_naive, (kl_mapped, kl_naive)


def test_fingerprint_validation_follows_the_active_adapter(peft_pair):
    model, maps = peft_pair
    ids = random_ids(1, 16, seed=5)[0][None]
    with adapter_active(model, None):
        base = run_with_cache(model, ids)
    cache = lambda: MappedCache(base)  # noqa: E731
    with adapter_active(model, "mild"):
        MappedCache.from_source(cache(), maps.to_adapter["mild"], model, input_ids=ids)  # right adapter: fine
        with pytest.raises(FingerprintMismatchError, match="strong"):
            MappedCache.from_source(cache(), maps.to_adapter["strong"], model, input_ids=ids)
    with adapter_active(model, None), pytest.raises(FingerprintMismatchError):
        MappedCache.from_source(cache(), maps.to_adapter["mild"], model, input_ids=ids)


def test_save_and_load_round_trip(peft_pair, tmp_path):
    model, maps = peft_pair
    folders = maps.save_pretrained(tmp_path, prefix="tiny")
    assert {f.name for f in folders} == {folder_name("tiny", a, r) for a in ("strong", "mild") for r in (False, True)}
    assert all((f / "README.md").is_file() for f in folders)
    for folder in folders:  # found by what they fit, whatever the folders are named
        folder.rename(folder.with_name(f"map-{folders.index(folder)}"))
    loaded = AdapterMaps.from_pretrained(tmp_path, model, ["strong", "mild"])
    for a in ("strong", "mild"):
        for name, tensor in maps.to_adapter[a].tensors.items():
            assert torch.equal(loaded.to_adapter[a].tensors[name], tensor)
        assert loaded.to_base[a].config.calibration.source.adapter == a


def test_the_maps_of_one_capture_pass_say_they_share_its_time(peft_pair):
    """All four maps come from one pass over the texts: each card says its seconds are the pass's, not its own."""
    from peft_kvcache.maps.card import calibration_text

    _, maps = peft_pair
    for _, _, kv_map in maps.all():
        record = kv_map.config.calibration
        assert record.maps_in_pass == 4 and record.seconds > 0
        assert f"{record.seconds:.0f} s (1 process(es), one capture pass fitting 4 maps together)" in \
            calibration_text(kv_map.config)


def test_calibrate_adapters_refuses_a_plain_model():
    from peft_kvcache.errors import CalibrationError

    with pytest.raises(CalibrationError, match="PeftModel"):
        calibrate_adapters(tiny_model("llama"), random_ids(4, 16))


def test_the_plain_base_model_is_a_valid_source(peft_pair):
    """A serving stack may hold the base as a separate model: its fingerprint is the map's source's."""
    model, maps = peft_pair
    with adapter_active(model, "mild"):
        maps.to_adapter["mild"].check_models(tiny_model("llama", seed=0), model)
        with pytest.raises(FingerprintMismatchError):
            maps.to_adapter["mild"].check_models(tiny_model("llama", seed=1), model)


def test_same_layer_statistics_give_the_maps_of_full_layer_selection(peft_pair):
    """Where the full cross-layer selection picks the same layer, the cheap block-diagonal statistics
    (the default) give the same fit."""
    model, maps = peft_pair
    full = calibrate_adapters(model, random_ids(16, 48, seed=3), adapters=["strong"], reverse=False,
                              same_layer=False, progress=False).to_adapter["strong"]
    same = [(kind, t) for kind in ("keys", "values") for t in range(2) if full.source_layers(kind, t) == [t]]
    assert len(same) >= 3
    for kind, t in same:
        for part in ("weight", "bias"):
            name = f"{kind}.{t}.{part}"
            torch.testing.assert_close(full.tensors[name], maps.to_adapter["strong"].tensors[name], atol=1e-4,
                                       rtol=1e-4)


def test_adapter_blends_are_scored_with_each_side_in_its_own_adapter_state(peft_pair):
    from peft_kvcache.calibration.blend import choose_adapter_blends

    model, maps = peft_pair
    active = model.active_adapter
    sequences, continuation = random_ids(2, 40, seed=7), 8
    chosen = choose_adapter_blends(maps, model, sequences, continuation=continuation, criterion="kl", progress=False)
    assert model.active_adapter == active
    assert set(chosen.to_adapter) == set(chosen.to_base) == {"strong", "mild"}
    context = 40 - continuation
    for source, target, kv_map in ((None, "strong", chosen.to_adapter["strong"]),
                                   ("strong", None, chosen.to_base["strong"])):
        blend = kv_map.config.blend
        recorded = blend.scores[f"keys={blend.keys},values={blend.values}"]["kl"]
        kls = []
        for ids in sequences:  # the recorded score, recomputed with the sides' adapter states set by hand
            prefix = ids[None, : context - 1]
            with adapter_active(model, source):
                captured = run_with_cache(model, prefix)
            with adapter_active(model, target):
                cache = MappedCache.from_source(MappedCache(captured), kv_map,
                                                model, input_ids=prefix)
                kls.append(_continuation_kl(model, cache, ids[:-1], context - 1))
        assert abs(sum(kls) / len(kls) - recorded) < 1e-4 * max(1.0, recorded)


def test_an_adapter_of_another_base_is_a_model_load_error(tmp_path):
    trained_on = get_peft_model(tiny_model("llama", seed=0), lora(10), adapter_name="strong")
    trained_on.save_pretrained(tmp_path)
    wider = tiny_model("llama", seed=0, hidden_size=96, num_attention_heads=4)
    with pytest.raises(ModelLoadError, match="adapter 'strong'") as caught:
        load_adapters(wider, {"strong": str(tmp_path / "strong")})
    assert isinstance(caught.value, OSError) and "tiny-llama-0" in str(caught.value)


def test_a_model_that_is_not_there_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"))


def test_a_switch_restores_the_adapter_state_it_found():
    """Several active adapters, adapters disabled, each adapter frozen: a block under one adapter leaves them so."""
    from peft_kvcache.modeling.adapters import active_adapters

    model = peft_with_adapters()
    for config in model.peft_config.values():
        config.inference_mode = True  # loaded for inference: a switch must not make them trainable
    model.base_model.set_adapter(["strong", "mild"], inference_mode=True)
    ids = random_ids(1, 12)[0][None]
    trainable = lambda: [name for name, p in model.named_parameters() if p.requires_grad and "lora_" in name]  # noqa: E731
    with torch.no_grad():
        both = model(ids).logits
        with adapter_active(model, "mild"):
            assert active_adapters(model) == {"mild"}
        assert active_adapters(model) == {"strong", "mild"} and torch.equal(model(ids).logits, both)
        with adapter_active(model, None):
            assert active_adapters(model) == set()
        assert active_adapters(model) == {"strong", "mild"} and not trainable()
        with model.disable_adapter():
            plain = model(ids).logits
            with adapter_active(model, "strong"):  # asked for by name: it runs, disabled or not
                assert active_adapters(model) == {"strong"} and model._adapters_disabled is False  # hooks run too
                assert not torch.equal(model(ids).logits, plain)
            assert model._adapters_disabled is True
            with adapter_active(model, None):
                assert active_adapters(model) == set()
            assert active_adapters(model) == set() and torch.equal(model(ids).logits, plain)
    with pytest.raises(Exception, match="no adapter"):
        with adapter_active(model, ["strong"]):
            pass
