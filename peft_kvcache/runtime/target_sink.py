"""The target's own attention sink in a mapped cache: the leading tokens of a context attend only to themselves, so
the target computes their KV exactly for a few tokens' cost, memoized per model, weights and tokens."""

from __future__ import annotations

import torch

from ..modeling.capture import CapturedKV, run_with_cache
from ..modeling.identity import ModelMemo, weights_key
from ..modeling.positions import positions_from_mask


@torch.no_grad()
def with_target_sink(mapped, target_model, input_ids, attention_mask, sink_tokens, position_offset,
                      target_key: tuple | None = None) -> None:
    """Replace the leading columns (left padding + ``sink_tokens`` real tokens) by the target's own KV, in
    place: those tokens attend only to themselves, so the target computes them exactly for a few tokens' cost."""
    real_start = int((attention_mask.shape[1] - attention_mask.sum(1)).max())
    columns = min(real_start + sink_tokens, attention_mask.shape[1])
    if columns == 0:
        return
    own = target_sink(target_model, input_ids[:, :columns], attention_mask[:, :columns], position_offset, target_key)
    for (k, v), k_own, v_own in zip(mapped, own.keys, own.values):  # fresh tensors from map_cache
        k[:, :, :columns] = k_own
        v[:, :, :columns] = v_own


# The sink's KV depends only on its token ids, their positions and the target's weights, and a chat template
# starts every conversation with the same tokens: memoize it (outside the user's model object, keyed on the
# weights' version) instead of paying a full pass over the target's weights at every switch.
_SINKS = ModelMemo(16)


def _sink_key(target_model, ids: torch.Tensor, mask: torch.Tensor, position_offset: int,
              target_key: tuple | None) -> tuple:
    return (weights_key(target_model) if target_key is None else target_key, ids.numpy().tobytes(), tuple(ids.shape),
            mask.numpy().tobytes(), position_offset)


def target_sink(target_model, ids: torch.Tensor, mask: torch.Tensor, position_offset: int,
                target_key: tuple | None = None) -> CapturedKV:
    """The target's own KV of the leading ``ids`` (memoized; ``target_key``: the model's `weights_key`, where the
    caller read it already)."""
    positions = positions_from_mask(mask) + position_offset
    return _SINKS.get(target_model, _sink_key(target_model, ids, mask, position_offset, target_key),
                      lambda: run_with_cache(target_model, ids, mask, position_ids=positions))


def sink_is_memoized(target_model, ids: torch.Tensor, mask: torch.Tensor, position_offset: int,
                     target_key: tuple | None = None) -> bool:
    """Whether `target_sink` holds these leading ``ids`` already (a switch whose refresh runs the target otherwise
    computes the sink inside the refresh's first pass: `peft_kvcache.runtime.refresh.refresh_cache`)."""
    return _SINKS.holds(target_model, _sink_key(target_model, ids, mask, position_offset, target_key))


def remember_sink(target_model, ids: torch.Tensor, mask: torch.Tensor, position_offset: int, sink: CapturedKV,
                  target_key: tuple | None = None) -> None:
    """Memoize ``sink``, the target's own KV of the leading ``ids`` computed elsewhere (a refresh's first pass)."""
    _SINKS.get(target_model, _sink_key(target_model, ids, mask, position_offset, target_key), lambda: sink)


def clear_target_sinks() -> None:
    """Forget every memoized target sink (to time or count a cold switch: the next one computes its sink again)."""
    _SINKS.clear()


__all__ = ["clear_target_sinks", "remember_sink", "sink_is_memoized", "target_sink", "with_target_sink"]
