"""The statistics one calibration pass accumulates: for each source model, from its KV features (RoPE removed) to
each of its targets', the sums ridge needs (`peft_kvcache.calibration.fit.SufficientStatistics`), per layer block,
split and kind. `peft_kvcache.calibration.loop.collect` feeds a `StatisticsRun` batch by batch; `build_map` fits from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CalibrationError
from ..maps.config import KINDS, CalibrationConfig
from ..modeling.capture import CapturedKV
from ..modeling.identity import cached_fingerprint, model_name
from ..modeling.layout import KVLayout, layer_features
from ..modeling.positions import RotarySpec, position_free_keys, positions_from_mask, rotary_spec_of
from .fit import SufficientStatistics, all_reduce_statistics

SPLITS = ("train", "heldout")
JOINT = "keys+values"  # the one statistic both kinds share with joint_kinds


@dataclass(frozen=True)
class ModelSide:
    """What a map records about one of its two models."""

    name: str
    fingerprint: str
    layout: KVLayout
    rotary: RotarySpec

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelSide":
        """The facts calibration records about ``model``: name, fingerprint, KV layout and rotary."""
        return cls(model_name(model), cached_fingerprint(model), KVLayout.of(model), rotary_spec_of(model))


class StatisticsRun:
    """Streaming statistics of one calibration pass: for each source (by name), from its KV features to each of
    its targets', per layer block (all layers side by side, or each layer alone with ``same_layer``), per split
    and kind. With ``joint_kinds`` the source's keys and values of all layers are one feature row, so both kinds
    share one statistic (its ``X^T X``), its targets named ``<target>:<kind>``."""

    def __init__(self, groups: dict[str, list[str]], sides: dict[str, ModelSide], config: CalibrationConfig):
        if config.attention_weighting and any(len(targets) != 1 for targets in groups.values()):
            raise CalibrationError("attention_weighting weights a source's tokens by what its target attends to: it "
                                   "needs one target per source (fit the targets one at a time)")
        self.groups, self.sides, self.sink_tokens = groups, sides, config.sink_tokens
        self.attention_weighting, self.joint_kinds = config.attention_weighting, config.joint_kinds
        self.blocks: list[int | None] = (list(range(next(iter(sides.values())).layout.num_layers))
                                         if config.same_layer else [None])
        self.stats = {}
        for source, targets in groups.items():
            for block in self.blocks:
                for split in SPLITS:
                    if self.joint_kinds:
                        self.stats[source, block, split, JOINT] = SufficientStatistics.empty(
                            2 * self._width(source, block),
                            {f"{t}:{kind}": self._width(t, block) for t in targets for kind in KINDS})
                        continue
                    for kind in KINDS:
                        self.stats[source, block, split, kind] = SufficientStatistics.empty(
                            self._width(source, block), {t: self._width(t, block) for t in targets})

    def _width(self, name: str, block: int | None) -> int:
        layout = self.sides[name].layout
        return layout.layer_width * (layout.num_layers if block is None else 1)

    def add(self, split: str, runs: dict[str, CapturedKV], mask: torch.Tensor) -> None:
        """Add one batch's features (past the sink, unpadded tokens only) to ``split``'s statistics."""
        positions = positions_from_mask(mask)
        rows = mask.bool() & (positions >= self.sink_tokens)  # the sink is the target's own at inference
        if not rows.any():
            return
        weights = {source: self._weights(runs[targets[0]], rows) for source, targets in self.groups.items()}
        for block in self.blocks:
            features = {name: stacked_features(run, self.sides[name].rotary, positions, rows, block)
                        for name, run in runs.items()}
            for source, targets in self.groups.items():
                if self.joint_kinds:  # keys of every layer, then values of every layer: `KVMapConfig.source_input`
                    self.stats[source, block, split, JOINT].update(
                        torch.cat(features[source], dim=-1),
                        {f"{t}:{kind}": features[t][k] for t in targets for k, kind in enumerate(KINDS)},
                        weights[source])
                    continue
                for k, kind in enumerate(KINDS):
                    self.stats[source, block, split, kind].update(features[source][k],
                                                                 {t: features[t][k] for t in targets}, weights[source])

    def _weights(self, target: CapturedKV, rows: torch.Tensor) -> torch.Tensor | None:
        """Each row's weight in the fit, train and held-out splits alike (so ridge strengths and layers are chosen,
        and held-out R^2 reported, under the same weighting): ``1 - a + a * r / mean(r)`` with ``r`` the attention the
        target gave the token (`ReceivedAttention`), the mean over its own sequence's rows (so a weight does not
        depend on which sequences share a batch, nor on how many processes split the texts), and ``a`` the attention
        weighting (None when 0: every token alike). The weights average 1 per sequence, so counts stay token
        counts."""
        if not self.attention_weighting:
            return None
        if target.received is None:
            raise CalibrationError("attention_weighting needs the target's received attention: run it with "
                                   "run_with_cache(..., received_attention=True)")
        rows = rows.cpu()
        received = target.received.double()
        means = (received * rows).sum(1) / rows.sum(1).clamp(min=1)  # [batch]: each sequence's own rows
        scaled = received / means.clamp(min=torch.finfo(torch.float64).tiny)[:, None]
        a = self.attention_weighting
        return 1 - a + a * scaled[rows]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every statistic as named tensors (the checkpoint's content)."""
        return {f"{source}|{block}|{split}|{kind}|{name}": tensor
                for (source, block, split, kind), entry in self.stats.items()
                for name, tensor in entry.state_dict().items()}

    def all_reduce(self) -> None:
        """Sum the statistics over the processes of a ``torchrun`` job."""
        all_reduce_statistics(list(self.stats.values()))

    def pair(self, source: str, target: str, block: int | None,
             kind: str) -> tuple[SufficientStatistics, SufficientStatistics, str]:
        """The train and held-out statistics from ``source`` to ``kind`` of ``target`` in one layer block, and the
        target's name in them."""
        if self.joint_kinds:
            return self.stats[source, block, "train", JOINT], self.stats[source, block, "heldout", JOINT], \
                f"{target}:{kind}"
        return self.stats[source, block, "train", kind], self.stats[source, block, "heldout", kind], target

    def tokens(self, source: str, split: str) -> float:
        """The rows ``source``'s statistics of ``split`` hold (their total weight: the token count, weighted or not)."""
        return float(self.stats[source, self.blocks[0], split, JOINT if self.joint_kinds else "keys"].count)


def stacked_features(captured: CapturedKV, spec: RotarySpec, positions: torch.Tensor, rows: torch.Tensor,
                     block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of all layers (or of layer ``block``) side by side for the selected token ``rows`` (bool
    ``[batch, seq]``): two ``[n, layers * kv_heads * head_dim]`` float32 matrices, keys without RoPE."""
    layers = range(len(captured.keys)) if block is None else [block]
    keys = torch.cat([layer_features(position_free_keys(captured.keys[i], spec, positions.to(captured.keys[i].device)))
                      [rows.to(captured.keys[i].device)].cpu() for i in layers], dim=-1)
    values = torch.cat([layer_features(captured.values[i].float())[rows.to(captured.values[i].device)].cpu()
                        for i in layers], dim=-1)
    return keys, values


__all__ = ["JOINT", "SPLITS", "ModelSide", "StatisticsRun", "stacked_features"]
