"""The calibration loop (calibration/loop.py): guards on what the models produce while it runs."""

from __future__ import annotations

import pytest
import torch
from conftest import CALIBRATION_OPTIONS, calibration_pair, random_ids, tiny_model

from peft_kvcache import KVMap
from peft_kvcache.errors import CalibrationError, NumericalError, UnsupportedPositionalSchemeError


def test_a_target_model_with_nan_weights_fails_calibration_by_name():
    source, target = calibration_pair()
    with torch.no_grad():
        target.model.layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(NumericalError, match="target 'target' features contain NaN or Inf"):
        KVMap.calibrate(source, target, random_ids(4, 10), **CALIBRATION_OPTIONS)



def test_the_held_out_split_is_capped_by_tokens_when_texts_differ_in_length():
    """Whole texts split by count: one long held-out text would hold out more tokens than the rest train on; its
    chunks are capped (round robin, at least one per held-out text) to fraction / (1 - fraction) of the training
    tokens. Texts of one length keep every chunk."""
    from peft_kvcache.calibration.texts import capped_heldout, heldout_flags

    lengths = [3, 3, 3, 3, 40, 3, 3, 3, 3, 30]  # chunks per text; texts 4 and 9 are held out (every 5th)
    chunks = [[torch.zeros(10, dtype=torch.long)] * n for n in lengths]
    flags = heldout_flags(len(chunks), 0.2)
    assert [i for i, f in enumerate(flags) if f] == [4, 9]
    capped = capped_heldout(chunks, flags, 0.2)
    train = sum(10 * n for n, f in zip(lengths, flags) if not f)
    held = sum(10 * len(capped[i]) for i in (4, 9))
    assert held <= 0.25 * train < held + 20 and abs(len(capped[4]) - len(capped[9])) <= 1  # round robin
    assert [len(capped[i]) for i, f in enumerate(flags) if not f] == [n for n, f in zip(lengths, flags) if not f]
    even = [[torch.zeros(10, dtype=torch.long)] for _ in range(10)]
    assert capped_heldout(even, flags, 0.2) is even


@pytest.mark.parametrize("options, error, match", [
    (dict(max_length=64), UnsupportedPositionalSchemeError, "past position 32"),  # dynamic RoPE past its length
    (dict(top_k=2, basis_rank=10**6), CalibrationError, "basis_rank 1000000 saves nothing"),
])
def test_options_that_fail_after_the_capture_are_refused_before_any_model_runs(options, error, match):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    source = tiny_model("qwen2", seed=0, max_position_embeddings=32, rope_parameters=rope)
    target = tiny_model("llama", seed=1, hidden_size=96, num_attention_heads=3, num_key_value_heads=3,
                        num_hidden_layers=3)
    calls = []
    source.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(error, match=match):
        KVMap.calibrate(source, target, random_ids(4, 60), **options, **CALIBRATION_OPTIONS)
    assert not calls
