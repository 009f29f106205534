"""The typed records of a map artifact and of a calibration, each declared once.

`KVMapConfig` is ``config.json``: every field is a typed value or record, validated on load by type, range
and known keys (`from_json`), so the mapping path, the quality gate, the card and the CLI can trust what
they read. `CalibrationConfig` holds the options of a fit: the Python API takes it, the CLI derives its
flags from it, distributed runs pass it along and the artifact stores it as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .._version import __version__
from ..errors import ArtifactError, RecordError
from ..modeling.layout import KVLayout
from ..modeling.positions import RotaryRecord
from .recipe import Refresh
from .records import check_fields, from_json, to_json

FORMAT_VERSION = 2
KINDS = ("keys", "values")
PAIR_KINDS = ("same_shape", "cross_shape")
# Ridge strengths tried per head, relative to the mean eigenvalue of the source Gram: the large end reaches the prior
# (identity for same-shape pairs), the small end plain least squares. A calibration option, recorded with each map.
DEFAULT_LAMBDA_GRID = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 10.0, 100.0)
# Refuse configs describing absurd models before allocating anything for them.
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 1024, 1024, 4096


def _help(text: str, **kwargs) -> Any:
    return field(metadata={"help": text}, **kwargs)


# ----- calibration -----


@dataclass
class CalibrationConfig:
    """Options of a calibration. The same dataclass is the Python API's ``config=``, the source of the CLI's
    flags (``--top-k`` ...) and the ``calibration.options`` record of the artifact.

    Example:
        >>> CalibrationConfig(top_k=2).max_length
        512
    """

    top_k: int = _help("source layers feeding each target layer, chosen by held-out R^2", default=1)
    same_layer: bool = _help("map each target layer from the same source layer only (block-diagonal statistics, "
                             "num_layers times less memory; for same-depth pairs such as base -> adapter)",
                             default=False)
    heldout_fraction: float = _help("share of the calibration texts (whole texts) held out to choose ridge "
                                    "strengths and source layers", default=0.2)
    sink_tokens: int = _help("leading tokens left out of the fit; the target computes them itself", default=1)
    max_length: int = _help("texts are cut into chunks of at most this many tokens", default=512)
    chunks_per_text: int = _help("chunks kept per text, from its start (0: all)", default=0)
    batch_size: int = _help("chunks per forward pass", default=1)
    lambda_grid: tuple[float, ...] = _help("ridge strengths tried per head, relative to the mean eigenvalue of the "
                                           "source Gram", default=DEFAULT_LAMBDA_GRID)
    head_shards: int = _help("predict each target KV head from the source KV heads of its own shard only (the heads "
                             "split into this many contiguous groups, as tensor parallelism splits them): a rank maps "
                             "its heads without gathering the others; 1: from every source head", default=1)
    residual_rank: int = _help("same-shape pairs with same_layer: keep each layer's fitted correction of the source "
                               "(the weight minus the identity) to the r directions that carry most of its predictions "
                               "on the calibration texts (reduced-rank regression, closed form from the statistics); "
                               "the map then runs as the identity plus two thin factors, 2r instead of the layer width "
                               "multiply-adds per feature; 0: the full correction", default=0)
    basis_rank: int = _help("cross-shape pairs with top_k all the source layers: keep every target layer's weights "
                            "of a kind to one shared basis of the source features of this rank (reduced-rank "
                            "regression across the target layers, closed form from the statistics), so that the "
                            "source's layers pass through a rank-r projection before each layer's readout; 0: each "
                            "layer's own weights", default=0)
    attention_weighting: float = _help("weight each token in the fit (and in the held-out choice of ridge strengths "
                                       "and layers) by the attention the target gives it: a token counts 1 - a + a * "
                                       "(its received attention / the mean over its batch), so the map is fitted "
                                       "hardest where the target reads; 0: every token alike", default=0.0)
    joint_kinds: bool = _help("predict each kind of the target (keys, values) from the source's keys and values "
                              "together: every source layer offers two candidates to the top_k choice, its keys "
                              "(numbered as the layer) and its values (numbered num_layers + the layer); the "
                              "statistics hold twice the source width, shared by both kinds", default=False)

    def __post_init__(self):
        self.validate()

    def candidate_inputs(self, source_layers: int) -> int:
        """How many source inputs a target layer chooses among: the source's layers, or with ``joint_kinds`` each
        layer's keys and values (`KVMapConfig.source_input`)."""
        return source_layers * (2 if self.joint_kinds else 1)

    def validate(self, where: str = "CalibrationConfig") -> None:
        """Refuse options of the wrong type or out of range (`RecordError`); the message names the field (the CLI
        turns it into its flag). Run when the options are built, and again by calibration (a field set later)."""
        check_fields(self, where)
        checks = [
            ("top_k", self.top_k >= 1, "must be a positive integer"),
            ("heldout_fraction", 0 < self.heldout_fraction < 1, "must be strictly between 0 and 1"),
            ("sink_tokens", self.sink_tokens >= 0, "must be a non-negative integer"),
            ("max_length", self.max_length >= self.sink_tokens + 2, "must exceed sink_tokens + 1"),
            ("chunks_per_text", self.chunks_per_text >= 0, "must be a non-negative integer"),
            ("batch_size", self.batch_size >= 1, "must be a positive integer"),
            ("lambda_grid", len(self.lambda_grid) > 0 and all(v > 0 for v in self.lambda_grid), "must be positive"),
            ("head_shards", self.head_shards >= 1, "must be a positive integer"),
            ("residual_rank", self.residual_rank >= 0, "must be a non-negative integer"),
            ("residual_rank", self.residual_rank == 0 or self.same_layer, "needs same_layer=True (each layer "
             "corrected from its own source layer)"),
            ("residual_rank", self.residual_rank == 0 or self.head_shards == 1, "needs head_shards=1 (a reduced-rank "
             "correction mixes the heads of every shard)"),
            ("basis_rank", self.basis_rank >= 0, "must be a non-negative integer"),
            ("basis_rank", self.basis_rank == 0 or not self.same_layer, "needs same_layer=False (one basis of "
             "every source layer)"),
            ("attention_weighting", 0 <= self.attention_weighting <= 1, "must be between 0 and 1"),
            ("joint_kinds", not (self.joint_kinds and self.same_layer), "needs same_layer=False (each target "
             "layer chooses among the source's keys and values of every layer)"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise RecordError(f"{where}: {name} {message}, got {getattr(self, name)!r}")


@dataclass
class TextRecord:
    """One calibration or evaluation text: its name (a file path relative to its corpus), how many of its
    tokens were used, and its split."""

    name: str
    tokens: int
    split: str = "train"


@dataclass
class DataRecord:
    """What text a fit or a measurement used: a description and every distinct text with its token count."""

    description: str = ""
    texts: list[TextRecord] = field(default_factory=list)

    def names(self, split: str | None = None) -> list[str]:
        """The text names, of one split (``"train"``, ``"heldout"``) or of all."""
        return [t.name for t in self.texts if split is None or t.split == split]


@dataclass
class ModelSpec:
    """How to load one side of a pair: ``model`` is what `peft_kvcache.load_model` takes (a Hub id, a folder or a
    fixture name); ``adapter`` names a PEFT adapter loaded from ``adapter_path`` on top."""

    model: str
    adapter: str | None = None
    adapter_path: str | None = None


@dataclass
class CalibrationRecord:
    """How a map was fitted: the options, the data, token counts and how to load both models."""

    options: CalibrationConfig = field(default_factory=CalibrationConfig)
    data: DataRecord = field(default_factory=DataRecord)
    train_tokens: int = 0
    heldout_tokens: int = 0
    sequences: int = 0
    processes: int = 1
    seconds: float | None = None
    source: ModelSpec | None = None
    target: ModelSpec | None = None
    license: str | None = None


# ----- figures -----


@dataclass
class GateRecord:
    """The quality gate's measurement (`peft_kvcache.calibration.gate.measure_quality`)."""

    predicted_retention: float
    attention_cosine_per_layer: list[float]
    no_context_cosine_per_layer: list[float]
    sequences: int
    query_tokens: int
    data: DataRecord = field(default_factory=DataRecord)


@dataclass
class Figure:
    """One measured figure and where it comes from: the results file that code wrote (a path relative to the
    repository or to the map's folder) and the key of the value in it (`peft_kvcache.lab.provenance.lookup`)."""

    value: float
    results: str
    key: str


@dataclass
class QualityRecord:
    """Measured figures of a map: the quality gate, and figures copied from results files that code wrote."""

    gate: GateRecord | None = None
    figures: dict[str, Figure] = field(default_factory=dict)

    @property
    def predicted_retention(self) -> float | None:
        """The gate's predicted retention, None when no gate was measured."""
        return None if self.gate is None else self.gate.predicted_retention


@dataclass
class BlendRecord:
    """Scale of a same-shape map's correction of the source cache per kind (`peft_kvcache.calibration.blend`)."""

    keys: float
    values: float
    criterion: str
    examples: int
    continuation: int
    grid: list[float]
    scores: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class RankRecord:
    """The residual rank a same-shape map runs at, chosen on held-out text among maps fitted at several ranks
    (`peft_kvcache.calibration.rank`): each candidate's mean next-token KL and its paired difference from the full
    correction."""

    rank: int
    examples: int
    continuation: int
    kl: dict[str, float] = field(default_factory=dict)  # rank ("0": the full correction) -> mean KL
    minus_full: dict[str, list[float]] = field(default_factory=dict)  # rank -> [mean, 95% low, 95% high] of rank - full


@dataclass
class NonlinearCandidate:
    """One layer and kind tried for an MLP head: held-out R² linear vs with the head, and whether it was kept."""

    kind: str
    layer: int
    r2_linear: float
    r2_mlp: float
    steps: int
    kept: bool


@dataclass
class NonlinearRecord:
    """Residual MLP heads (`peft_kvcache.calibration.nonlinear`): the target layers that have one, per kind."""

    keys: list[int] = field(default_factory=list)
    values: list[int] = field(default_factory=list)
    hidden: int = 64
    activation: str = "gelu"
    r2_threshold: float = 0.9
    min_gain: float = 0.01
    max_rows: int = 4096
    steps: int = 400
    candidates: list[NonlinearCandidate] = field(default_factory=list)

    def layers(self, kind: str) -> list[int]:
        """Target layers of ``kind`` ("keys" or "values") that have an MLP head."""
        return list(self.keys if kind == "keys" else self.values)


@dataclass
class DistillationRecord:
    """A low-rank correction trained by the target's next-token KL, folded into the weights
    (`peft_kvcache.calibration.distill`): its options and the held-out KL that chose the step kept."""

    rank: int = 8
    steps: int = 100
    batch_size: int = 4
    learning_rate: float = 1e-3
    recent_tokens: int = 64
    scored_tokens: int = 64
    train_chunks: int = 0
    heldout_chunks: int = 0
    kept_step: int = 0
    heldout_kl: list[list[float]] = field(default_factory=list)  # [step, mean KL] from step 0 (the ridge map)

    @property
    def kept(self) -> bool:
        """Whether a correction was kept (a step after 0 lowered the held-out KL)."""
        return self.kept_step > 0


# ----- the artifact's config -----


@dataclass
class KVMapConfig:
    """Everything about a map except its tensors; serialized as ``config.json``.

    Per-layer lists are indexed by target layer; per-head lists by target KV head.
    """

    source_name: str = _help("what the source model is: Hub id or path, '+adapter' for an active adapter")
    target_name: str = _help("what the target model is, same form")
    source_fingerprint: str = _help("sha256 of the source weights (see peft_kvcache.modeling.identity.fingerprint)")
    target_fingerprint: str = _help("sha256 of the target weights")
    source_layout: KVLayout = _help("source KV cache shape")
    target_layout: KVLayout = _help("target KV cache shape")
    source_rotary: RotaryRecord = _help("source RoPE (inv_freq is in the safetensors)")
    target_rotary: RotaryRecord = _help("target RoPE")
    vocab_size: int = _help("shared vocabulary size")
    pair_kind: str = _help("'same_shape' (e.g. base -> adapter) or 'cross_shape' (siblings)")
    key_layers: list[list[int]] = _help("source layers feeding each target layer's keys")
    value_layers: list[list[int]] = _help("source layers feeding each target layer's values")
    key_r2: list[list[float]] = _help("held-out R^2 per target layer and KV head", default_factory=list)
    value_r2: list[list[float]] = _help("held-out R^2 per target layer and KV head", default_factory=list)
    key_lambdas: list[list[float]] = _help("ridge strength per layer and head", default_factory=list)
    value_lambdas: list[list[float]] = _help("ridge strength per layer and head", default_factory=list)
    key_candidate_r2: list[list[float]] = _help("[target][source] held-out R^2 of single source layers",
                                                default_factory=list)
    value_candidate_r2: list[list[float]] = _help("[target][source] held-out R^2", default_factory=list)
    calibration: CalibrationRecord = _help("options, data and token counts of the fit",
                                           default_factory=CalibrationRecord)
    quality: QualityRecord = _help("the quality gate and measured figures", default_factory=QualityRecord)
    refresh: Refresh | None = _help("the refresh MappedCache.from_source applies by default (None: none)",
                                    default=None)
    nonlinear: NonlinearRecord | None = _help("residual MLP heads (None: a purely linear map)", default=None)
    blend: BlendRecord | None = _help("same-shape maps: the blend toward the source cache folded into the weights",
                                      default=None)
    rank_choice: RankRecord | None = _help("same-shape maps: the residual rank chosen on held-out text among fits at "
                                           "several ranks (None: fitted at one rank)", default=None)
    distillation: DistillationRecord | None = _help("a low-rank correction trained by the target's next-token KL, "
                                                    "folded into the weights (None: the ridge fit as is)",
                                                    default=None)
    sinks: list[list[int]] = _help("conversation starts (their first sink_tokens token ids) whose target KV the map "
                                   "ships (sink.<i>.keys / .values): the target's own attention sink, for an engine "
                                   "that cannot run the target itself", default_factory=list)
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
                    and rotary.rotary_dim % 2 == 0 and rotary.attention_scaling > 0):
                raise RecordError(f"{where}.{side}_rotary is malformed: {rotary} (expects head_dim {layout.head_dim}, an "
                            "even rotary_dim up to it and a positive attention_scaling)")
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


def parameter_count(config: KVMapConfig) -> int:
    """Weights of a map with this config (`is_weight`)."""
    return sum(math.prod(shape) for name, shape in expected_shapes(config).items() if is_weight(name))
