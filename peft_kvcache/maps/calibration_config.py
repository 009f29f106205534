"""`CalibrationConfig`: the options of a fit. The Python API takes it, the CLI derives its flags from it, distributed
runs pass it along and a map's ``config.json`` stores it as is (``calibration.options``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RecordError
from .records import check_fields, help_field

# Ridge strengths tried per head, relative to the mean eigenvalue of the source Gram: the large end reaches the prior
# (identity for same-shape pairs), the small end plain least squares. A calibration option, recorded with each map.
DEFAULT_LAMBDA_GRID = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 10.0, 100.0)


@dataclass
class CalibrationConfig:
    """Options of a calibration. The same dataclass is the Python API's ``config=``, the source of the CLI's
    flags (``--top-k`` ...) and the ``calibration.options`` record of the artifact.

    Example:
        >>> CalibrationConfig(top_k=2).max_length
        512
    """

    top_k: int = help_field("source layers feeding each target layer, chosen by held-out R^2", default=1)
    same_layer: bool = help_field("map each target layer from the same source layer only (block-diagonal statistics, "
                                  "num_layers times less memory; for same-depth pairs such as base -> adapter)",
                                  default=False)
    heldout_fraction: float = help_field("share of the calibration texts (whole texts) held out to choose ridge "
                                         "strengths and source layers", default=0.2)
    sink_tokens: int = help_field("leading tokens left out of the fit; the target computes them itself", default=1)
    max_length: int = help_field("texts are cut into chunks of at most this many tokens", default=512)
    chunks_per_text: int = help_field("chunks kept per text, from its start (0: all)", default=0)
    batch_size: int = help_field("chunks per forward pass", default=1)
    lambda_grid: tuple[float, ...] = help_field("ridge strengths tried per head, relative to the mean eigenvalue of "
                                                "the source Gram", default=DEFAULT_LAMBDA_GRID)
    head_shards: int = help_field("predict each target KV head from the source KV heads of its own shard only (the "
                                  "heads split into this many contiguous groups, as tensor parallelism splits them): a "
                                  "rank maps its heads without gathering the others; 1: from every source head",
                                  default=1)
    residual_rank: int = help_field("same-shape pairs with same_layer: keep each layer's fitted correction of the "
                                    "source (the weight minus the identity) to the r directions that carry most of its "
                                    "predictions on the calibration texts (reduced-rank regression, closed form from "
                                    "the statistics); the map then runs as the identity plus two thin factors, 2r "
                                    "instead of the layer width multiply-adds per feature; 0: the full correction",
                                    default=0)
    basis_rank: int = help_field("cross-shape pairs with top_k all the source layers: keep every target layer's "
                                 "weights of a kind to one shared basis of the source features of this rank "
                                 "(reduced-rank regression across the target layers, closed form from the statistics), "
                                 "so that the source's layers pass through a rank-r projection before each layer's "
                                 "readout; 0: each layer's own weights", default=0)
    attention_weighting: float = help_field("weight each token in the fit (and in the held-out choice of ridge "
                                            "strengths and layers) by the attention the target gives it: a token "
                                            "counts 1 - a + a * (its received attention / the mean over its own "
                                            "sequence), so the map is fitted hardest where the target reads; 0: every "
                                            "token alike",
                                            default=0.0)
    joint_kinds: bool = help_field("predict each kind of the target (keys, values) from the source's keys and values "
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
