"""`KVMapConfig`: a map artifact's ``config.json``, declared once.

Every field is a typed value or record, validated on load by type, range and known keys (`from_json`), so the
mapping path, the quality gate, the card and the CLI can trust what they read. The records it holds of how the map
was made and measured live in `provenance`, the options of a fit (`CalibrationConfig`) in `calibration_config`;
both are re-exported here, where callers import them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .._version import __version__
from ..errors import ArtifactError, RecordError
from ..modeling.layout import KVLayout
from ..modeling.positions import RotaryRecord
from .calibration_config import DEFAULT_LAMBDA_GRID, CalibrationConfig
from .provenance import (
    AttentionBonusRecord,
    BlendRecord,
    CalibrationRecord,
    DataRecord,
    DistillationRecord,
    Figure,
    GateRecord,
    ModelSpec,
    NonlinearCandidate,
    NonlinearRecord,
    QualityRecord,
    RankRecord,
    TextRecord,
)
from .recipe import Refresh
from .records import from_json, help_field, to_json

FORMAT_VERSION = 2
KINDS = ("keys", "values")
PAIR_KINDS = ("same_shape", "cross_shape")
# Refuse configs describing absurd models before allocating anything for them.
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 1024, 1024, 4096
MAX_BONUS = 20.0  # nats: an attention bonus past it would drown every exact position
BONUS_METHODS = ("constant", "jensen")  # one bonus for every head, or each head's own (`calibration.bonus`)


@dataclass
class KVMapConfig:
    """Everything about a map except its tensors; serialized as ``config.json``.

    Per-layer lists are indexed by target layer; per-head lists by target KV head.
    """

    source_name: str = help_field("what the source model is: Hub id or path, '+adapter' for an active adapter")
    target_name: str = help_field("what the target model is, same form")
    source_fingerprint: str = help_field("sha256 of the source weights (see "
                                         "peft_kvcache.modeling.identity.fingerprint)")
    target_fingerprint: str = help_field("sha256 of the target weights")
    source_layout: KVLayout = help_field("source KV cache shape")
    target_layout: KVLayout = help_field("target KV cache shape")
    source_rotary: RotaryRecord = help_field("source RoPE (inv_freq is in the safetensors)")
    target_rotary: RotaryRecord = help_field("target RoPE")
    vocab_size: int = help_field("shared vocabulary size")
    pair_kind: str = help_field("'same_shape' (e.g. base -> adapter) or 'cross_shape' (siblings)")
    key_layers: list[list[int]] = help_field("source layers feeding each target layer's keys")
    value_layers: list[list[int]] = help_field("source layers feeding each target layer's values")
    key_r2: list[list[float]] = help_field("held-out R^2 per target layer and KV head", default_factory=list)
    value_r2: list[list[float]] = help_field("held-out R^2 per target layer and KV head", default_factory=list)
    key_lambdas: list[list[float]] = help_field("ridge strength per layer and head", default_factory=list)
    value_lambdas: list[list[float]] = help_field("ridge strength per layer and head", default_factory=list)
    key_candidate_r2: list[list[float]] = help_field("[target][source] held-out R^2 of single source layers",
                                                     default_factory=list)
    value_candidate_r2: list[list[float]] = help_field("[target][source] held-out R^2", default_factory=list)
    calibration: CalibrationRecord = help_field("options, data and token counts of the fit",
                                                default_factory=CalibrationRecord)
    quality: QualityRecord = help_field("the quality gate and measured figures", default_factory=QualityRecord)
    refresh: Refresh | None = help_field("the refresh MappedCache.from_source applies by default (None: none)",
                                         default=None)
    nonlinear: NonlinearRecord | None = help_field("residual MLP heads (None: a purely linear map)", default=None)
    blend: BlendRecord | None = help_field("same-shape maps: the blend toward the source cache folded into the weights",
                                           default=None)
    rank_choice: RankRecord | None = help_field("same-shape maps: the residual rank chosen on held-out text among fits "
                                                "at several ranks (None: fitted at one rank)", default=None)
    distillation: DistillationRecord | None = help_field("a low-rank correction trained by the target's next-token KL, "
                                                         "folded into the weights (None: the ridge fit as is)",
                                                         default=None)
    attention_bonus: AttentionBonusRecord | None = help_field(
        "a key offset per target layer and KV head, folded into the key biases, that raises every mapped key's logit "
        "(peft_kvcache.calibration.bonus; None: none)", default=None)
    sinks: list[list[int]] = help_field("conversation starts (their first sink_tokens token ids) whose target KV the "
                                        "map ships (sink.<i>.keys / .values): the target's own attention sink, for an "
                                        "engine that cannot run the target itself", default_factory=list)
    format_version: int = FORMAT_VERSION
    library_version: str = __version__

    @property
    def sink_tokens(self) -> int:
        """Leading tokens the target computes itself (left out of the fit)."""
        return self.calibration.options.sink_tokens

    @property
    def source_candidates(self) -> int:
        """How many source inputs a target layer chooses among (`CalibrationConfig.candidate_inputs`)."""
        return self.calibration.options.candidate_inputs(self.source_layout.num_layers)

    @property
    def basis_rank(self) -> int:
        """The rank of the basis every target layer's weights share where the map was fitted with one
        (``calibration.options.basis_rank``): its layers then read one projection of the source layers' features
        (``<kind>.basis``) through a ``[rank, width]`` readout each; 0 where each layer has its own weights."""
        return self.calibration.options.basis_rank

    def source_input(self, kind: str, index: int) -> tuple[str, int]:
        """``(kind, source layer)`` of input ``index`` of a ``kind`` map: the same kind of that layer, or with
        ``joint_kinds`` the source's keys of layer ``index`` or its values of layer ``index - num_layers``.

        Example:
            >>> config = KVMapConfig.__new__(KVMapConfig)
            >>> config.source_layout = KVLayout(num_layers=4, kv_heads=1, head_dim=8)
            >>> config.calibration = CalibrationRecord(options=CalibrationConfig(joint_kinds=True))
            >>> config.source_input("keys", 1), config.source_input("keys", 5)
            (('keys', 1), ('values', 1))
        """
        if not self.calibration.options.joint_kinds:
            return kind, index
        layers = self.source_layout.num_layers
        return ("keys", index) if index < layers else ("values", index - layers)

    def mlp_layers(self, kind: str) -> list[int]:
        """Target layers whose ``kind`` ('keys' or 'values') has a residual MLP head."""
        return [] if self.nonlinear is None else self.nonlinear.layers(kind)

    def to_dict(self) -> dict:
        """The config as JSON-ready data (what ``config.json`` holds)."""
        return to_json(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "config.json") -> "KVMapConfig":
        """Build and validate a config read from ``config.json``; every problem is an `ArtifactError` naming the
        field, so a tampered or truncated file never fails later inside the mapping path."""
        if not isinstance(data, dict):
            raise ArtifactError(f"{where} must hold a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:
            raise ArtifactError(f"{where}: map format_version {version!r} is not supported by peft-kvcache "
                                f"{__version__} (expects {FORMAT_VERSION}); re-calibrate or re-publish the map")
        try:
            return from_json(cls, data, where)
        except RecordError as err:
            raise ArtifactError(str(err)) from None

    def validate(self, where: str = "config.json") -> None:
        """Refuse (`RecordError`) shapes, layer lists, rotary and per-head figures that do not fit together, naming the
        field."""
        for name, layout in (("source_layout", self.source_layout), ("target_layout", self.target_layout)):
            if not (0 < layout.num_layers <= MAX_LAYERS and 0 < layout.kv_heads <= MAX_HEADS
                    and 0 < layout.head_dim <= MAX_HEAD_DIM and layout.head_dim % 2 == 0):
                raise RecordError(f"{where}.{name} is implausible: {layout} (at most {MAX_LAYERS} layers, {MAX_HEADS} KV "
                            f"heads and an even head_dim up to {MAX_HEAD_DIM})")
        if self.pair_kind not in PAIR_KINDS:
            raise RecordError(f"{where}.pair_kind is {self.pair_kind!r}; expected one of {PAIR_KINDS}")
        if self.pair_kind == "same_shape" and self.source_layout != self.target_layout:
            raise RecordError(f"{where}.pair_kind is 'same_shape' but the layouts differ ({self.source_layout} -> "
                              f"{self.target_layout}): a map between other shapes is 'cross_shape'")
        if self.vocab_size <= 0:
            raise RecordError(f"{where}.vocab_size must be positive, got {self.vocab_size}")
        sources, targets = self.source_candidates, self.target_layout.num_layers
        for name, groups in (("key_layers", self.key_layers), ("value_layers", self.value_layers)):
            if len(groups) != targets or not all(0 < len(g) <= sources and all(0 <= s < sources for s in g)
                                                 for g in groups):
                raise RecordError(f"{where}.{name} must list, for each of {targets} target layers, source layers in "
                            f"0..{sources - 1}")
        for side, rotary, layout in (("source", self.source_rotary, self.source_layout),
                                     ("target", self.target_rotary, self.target_layout)):
            if not (rotary.head_dim == layout.head_dim and 0 < rotary.rotary_dim <= rotary.head_dim
                    and rotary.rotary_dim % 2 == 0 and rotary.attention_scaling > 0
                    and (rotary.max_position is None or rotary.max_position > 0)):
                raise RecordError(f"{where}.{side}_rotary is malformed: {rotary} (expects head_dim {layout.head_dim}, an "
                            "even rotary_dim up to it, a positive attention_scaling and a positive max_position "
                            "or none)")
        heads = self.target_layout.kv_heads
        for name, width in (("key_r2", heads), ("value_r2", heads), ("key_lambdas", heads),
                            ("value_lambdas", heads), ("key_candidate_r2", sources), ("value_candidate_r2", sources)):
            rows = getattr(self, name)
            if rows and (len(rows) != targets or any(len(row) != width for row in rows)):
                raise RecordError(f"{where}.{name} must be empty or list {width} numbers for each of {targets} target layers")
        if self.nonlinear is not None:
            for kind in KINDS:
                chosen = self.nonlinear.layers(kind)
                if len(set(chosen)) != len(chosen) or not all(0 <= t < targets for t in chosen):
                    raise RecordError(f"{where}.nonlinear.{kind} must list distinct target layers in 0..{targets - 1}")
            if not 0 < self.nonlinear.hidden <= 65536:
                raise RecordError(f"{where}.nonlinear.hidden must be in 1..65536, got {self.nonlinear.hidden}")
        bonus = self.attention_bonus
        if bonus is not None and not (math.isfinite(bonus.bonus) and 0 <= bonus.bonus <= MAX_BONUS
                                      and bonus.max_distance > 0 and bonus.ridge >= 0
                                      and all(len(rows) in (0, targets) and all(len(row) == heads for row in rows)
                                              for rows in (bonus.achieved, bonus.spread, bonus.asked))
                                      and all(0 <= b <= MAX_BONUS for row in bonus.asked for b in row)
                                      and bonus.method in BONUS_METHODS
                                      and (len(bonus.asked) > 0) == (bonus.method == "jensen")):
            raise RecordError(f"{where}.attention_bonus is malformed: a bonus in 0..{MAX_BONUS} nats, a positive "
                              f"max_distance, a ridge >= 0, achieved / spread lists of {heads} numbers for each of "
                              f"{targets} target layers (or none), a method of {BONUS_METHODS} and, for 'jensen' "
                              f"only, the asked bonus per layer and head in 0..{MAX_BONUS}")
        self.calibration.options.validate(f"{where}.calibration.options")
        if self.basis_rank and (any(g != self.key_layers[0] for g in self.key_layers + self.value_layers)
                                or self.nonlinear is not None):
            raise RecordError(f"{where}: a map with a shared basis (basis_rank {self.basis_rank}) reads the same source "
                              "layers in every target layer, keys and values alike, and has no nonlinear heads")
        if any(len(start) != self.sink_tokens or min(start, default=0) < 0 or max(start, default=0) >= self.vocab_size
               for start in self.sinks) or len(set(map(tuple, self.sinks))) != len(self.sinks):
            raise RecordError(f"{where}.sinks must list distinct starts of {self.sink_tokens} token ids in "
                              f"0..{self.vocab_size - 1}")
        gate = self.quality.gate
        if gate is not None and len(gate.attention_cosine_per_layer) != targets:
            raise RecordError(f"{where}.quality.gate lists {len(gate.attention_cosine_per_layer)} layer cosines for "
                        f"{targets} target layers")


def expected_shapes(config: KVMapConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a map with this config holds (``model.safetensors``)."""
    src, tgt = config.source_layout, config.target_layout
    shapes = {"source.inv_freq": (config.source_rotary.rotary_dim // 2,),
              "target.inv_freq": (config.target_rotary.rotary_dim // 2,)}
    hidden = config.nonlinear.hidden if config.nonlinear is not None else 0
    rank = config.basis_rank
    for kind, layers in (("keys", config.key_layers), ("values", config.value_layers)):
        if rank:  # one projection of the source layers' features, then a readout per target layer
            shapes[f"{kind}.basis"] = (len(layers[0]) * src.layer_width, rank)
        for t, sources in enumerate(layers):
            shapes[f"{kind}.{t}.weight"] = (rank or len(sources) * src.layer_width, tgt.layer_width)
            shapes[f"{kind}.{t}.bias"] = (tgt.layer_width,)
        for t in config.mlp_layers(kind):  # residual MLP heads (peft_kvcache.calibration.nonlinear)
            shapes.update({f"{kind}.{t}.mlp.w1": (tgt.layer_width, hidden), f"{kind}.{t}.mlp.b1": (hidden,),
                           f"{kind}.{t}.mlp.w2": (hidden, tgt.layer_width), f"{kind}.{t}.mlp.b2": (tgt.layer_width,)})
    for i, start in enumerate(config.sinks):  # the target's own KV of each shipped conversation start
        for kind in ("keys", "values"):
            shapes[f"sink.{i}.{kind}"] = (tgt.num_layers, tgt.kv_heads, len(start), tgt.head_dim)
    return shapes


def is_weight(name: str) -> bool:
    """Whether the map's tensor ``name`` is a fitted weight: not the rotary frequencies, not a shipped sink (the
    target's own KV)."""
    return not name.endswith("inv_freq") and not name.startswith("sink.")


def weights_dtype(tensors: dict) -> str:
    """The dtype a map's weights are held in (``"float32"``, ``"bfloat16"``): its first layer's key weight."""
    return str(tensors["keys.0.weight"].dtype).removeprefix("torch.")


def parameter_count(config: KVMapConfig) -> int:
    """Weights of a map with this config (`is_weight`)."""
    return sum(math.prod(shape) for name, shape in expected_shapes(config).items() if is_weight(name))


__all__ = [
    "FORMAT_VERSION", "KINDS", "PAIR_KINDS", "MAX_LAYERS", "MAX_HEADS", "MAX_HEAD_DIM",
    "KVMapConfig", "expected_shapes", "is_weight", "parameter_count",
    # re-exported, as callers import them from here: the options of a fit, the records config.json holds, Refresh
    "DEFAULT_LAMBDA_GRID", "CalibrationConfig", "TextRecord", "DataRecord", "ModelSpec", "CalibrationRecord",
    "GateRecord", "Figure", "QualityRecord", "BlendRecord", "RankRecord", "NonlinearCandidate", "NonlinearRecord",
    "AttentionBonusRecord", "DistillationRecord", "Refresh",
]
