"""The calibration loop (calibration/loop.py): guards on what the models produce while it runs."""

from __future__ import annotations

import pytest
import torch
from conftest import CALIBRATION_OPTIONS, calibration_pair, random_ids

from peft_kvcache import KVMap
from peft_kvcache.errors import NumericalError


def test_a_target_model_with_nan_weights_fails_calibration_by_name():
    source, target = calibration_pair()
    with torch.no_grad():
        target.model.layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(NumericalError, match="target 'target' features contain NaN or Inf"):
        KVMap.calibrate(source, target, random_ids(4, 10), **CALIBRATION_OPTIONS)

