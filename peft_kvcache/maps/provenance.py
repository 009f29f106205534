"""The provenance records of a map: what its ``config.json`` records about how it was made and measured. How it was
fitted (`CalibrationRecord`: the options, the texts, both models), what was measured on it (`QualityRecord`: the
quality gate and figures cited from results files) and what chose its final form (`BlendRecord`, `RankRecord`,
`NonlinearRecord`, `DistillationRecord`). `KVMapConfig` holds them; `peft_kvcache.maps.config` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .calibration_config import CalibrationConfig

# ----- calibration -----


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
    """How a map was fitted: the options, the data, token counts and how to load both models. ``seconds`` is the
    whole calibration's time; ``maps_in_pass`` maps were fitted from its one capture pass together (the base <->
    adapter maps of `peft_kvcache.calibration.loop.calibrate_adapters`), so their seconds are shared, not each's."""

    options: CalibrationConfig = field(default_factory=CalibrationConfig)
    data: DataRecord = field(default_factory=DataRecord)
    train_tokens: int = 0
    heldout_tokens: int = 0
    sequences: int = 0
    processes: int = 1
    seconds: float | None = None
    maps_in_pass: int = 1
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
class AttentionBonusRecord:
    """The mapped keys' attention bonus (`peft_kvcache.calibration.bonus`), folded into the key biases: the logit
    ``bonus`` (nats) asked of every mapped key, and per target layer and KV head the bonus the offset gives the
    target's calibration queries on average (``achieved``) and its spread over queries and distances (``spread``).
    ``method`` ``"jensen"``: each head was asked its own bonus (``asked``, per target layer and KV head: half the
    variance of its logits' residual on the mapped keys), ``bonus`` their mean."""

    bonus: float = 1.0
    method: str = "constant"
    asked: list[list[float]] = field(default_factory=list)
    max_distance: int = 2048
    ridge: float = 1e-3
    texts: int = 0
    queries: int = 0
    achieved: list[list[float]] = field(default_factory=list)
    spread: list[list[float]] = field(default_factory=list)


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

