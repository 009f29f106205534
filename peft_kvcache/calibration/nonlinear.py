"""Nonlinear heads: a small residual MLP per target layer on top of the linear map, for layers whose
linear fit is weak.

Per target layer and kind (keys or values), all KV heads at once::

    lin = x @ W + b                                   # the linear map, [n, kv_heads * head_dim]
    out = lin + gelu(lin @ w1 + b1) @ w2 + b2         # the residual MLP, hidden width H

The MLP reads the linear map's own (position-free) output, so its size is ``2 E H`` whatever the number
of source layers feeding the layer (E = kv_heads * head_dim). It is trained with Adam on a fixed-size
uniform sample of calibration tokens (`RowReservoir`, ``max_rows`` train + ``max_rows // 2`` held-out rows
per layer and kind: memory is bounded whatever the calibration size), starts at zero (the linear map),
stops early on one half of the held-out rows and is kept only where the other half says it beats the
linear map by ``min_gain`` of held-out R^2. Input standardization and output scale are folded into
``w1, b1, w2, b2``, which are stored as ``{kind}.{layer}.mlp.{w1,b1,w2,b2}`` in the artifact; the config
field ``nonlinear`` lists the layers that have one.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from ..errors import CalibrationError
from ..maps.apply import SourceFeatures, mlp_residual
from ..maps.config import KINDS, NonlinearCandidate, NonlinearRecord
from ..maps.kvmap import KVMap
from ..modeling.capture import run_with_cache
from ..modeling.layout import layer_features, vocab_size_of
from ..modeling.positions import position_free_keys, positions_from_mask, rotary_spec_of
from .loop import collect
from .texts import CalibrationTexts

logger = logging.getLogger(__name__)

MLP_PARTS = ("w1", "b1", "w2", "b2")


class RowReservoir:
    """A uniform sample without replacement of at most ``capacity`` rows from a stream of row batches
    (priority sampling: every row draws a random key, the rows with the largest keys are kept).

    Example:
        >>> reservoir = RowReservoir(4)
        >>> for _ in range(3):
        ...     reservoir.add(torch.randn(5, 2), torch.randn(5, 3))
        >>> [tuple(t.shape) for t in reservoir.rows()]
        [(4, 2), (4, 3)]
    """

    def __init__(self, capacity: int, seed: int = 0):
        if capacity < 1:
            raise CalibrationError(f"a reservoir needs a capacity of at least 1 row, got {capacity}")
        self.capacity, self.seen = capacity, 0
        self._generator = torch.Generator().manual_seed(seed)
        self._keys: torch.Tensor | None = None
        self._columns: list[torch.Tensor] = []

    def add(self, *columns: torch.Tensor) -> None:
        """Offer rows: tensors ``[n, ...]`` with the same ``n``, stored in float32 on the CPU."""
        n = columns[0].shape[0]
        self.seen += n
        keys = torch.rand(n, generator=self._generator)
        columns = [c.detach().to("cpu", torch.float32) for c in columns]
        if self._keys is not None:
            keys = torch.cat([self._keys, keys])
            columns = [torch.cat([old, new]) for old, new in zip(self._columns, columns)]
        if keys.numel() > self.capacity:
            keep = keys.topk(self.capacity).indices
            keys, columns = keys[keep], [c[keep] for c in columns]
        self._keys, self._columns = keys, columns

    def rows(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._columns)


@dataclass
class MLPFit:
    """A trained residual MLP head of one layer and its held-out evidence."""

    params: dict[str, torch.Tensor]  # w1 [E, H], b1 [H], w2 [H, E], b2 [E], float32, normalization folded in
    r2_linear: float  # held-out R^2 of the linear map on the selection half
    r2_mlp: float  # held-out R^2 with the MLP, same rows
    steps: int  # Adam steps of the kept (early-stopped) state


def _r2(prediction: torch.Tensor, target: torch.Tensor) -> float:
    sse = (target - prediction).double().square().sum()
    sst = (target - target.mean(0)).double().square().sum().clamp_min(1e-30)
    return float(1 - sse / sst)


def train_residual_mlp(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_heldout: torch.Tensor,
    y_heldout: torch.Tensor,
    hidden: int = 64,
    steps: int = 400,
    lr: float = 1e-2,
    batch_size: int = 512,
    eval_every: int = 25,
    seed: int = 0,
) -> MLPFit:
    """Train ``y ~ x + mlp_residual(x)`` where ``x`` is the linear map's output ``[n, E]`` and ``y`` the
    target's features ``[n, E]``.

    The held-out rows are split in two halves: the first chooses the step to keep (early stopping, starting
    from the zero residual, i.e. the linear map), the second measures ``r2_linear`` and ``r2_mlp`` for the
    selection, so the selection is not biased by the stopping.

    Example:
        >>> x = torch.randn(600, 4); y = x + torch.sin(3 * x)
        >>> fit = train_residual_mlp(x[:400], y[:400], x[400:], y[400:], hidden=32, steps=200)
        >>> fit.r2_mlp > fit.r2_linear
        True
    """
    if x_heldout.shape[0] < 2:
        raise CalibrationError(f"an MLP head needs at least 2 held-out rows, got {x_heldout.shape[0]}")
    generator = torch.Generator().manual_seed(seed)
    x_train, y_train = x_train.float(), y_train.float()
    x_heldout, y_heldout = x_heldout.float(), y_heldout.float()
    half = x_heldout.shape[0] // 2
    x_stop, y_stop, x_sel, y_sel = x_heldout[:half], y_heldout[:half], x_heldout[half:], y_heldout[half:]

    mean, scale = x_train.mean(0), x_train.std(0).clamp_min(1e-6)  # input standardization  [E]
    out_scale = (y_train - x_train).std(0).clamp_min(1e-6)  # residual scale per column  [E]
    width = x_train.shape[1]
    w1 = torch.randn(width, hidden, generator=generator) * (2.0 / width) ** 0.5
    b1 = torch.zeros(hidden)
    w2 = torch.zeros(hidden, width)  # zero output layer: training starts at the linear map
    b2 = torch.zeros(width)
    params = [p.requires_grad_() for p in (w1, b1, w2, b2)]
    optimizer = torch.optim.Adam(params, lr=lr)

    def predict(x: torch.Tensor) -> torch.Tensor:
        return x + mlp_residual((x - mean) / scale, w1, b1, w2, b2) * out_scale

    def stop_loss() -> float:
        with torch.no_grad():
            return float((predict(x_stop) - y_stop).div(out_scale).square().mean())

    best_loss, best_state, best_step = stop_loss(), [p.detach().clone() for p in params], 0
    for step in range(1, steps + 1):
        index = torch.randint(0, x_train.shape[0], (min(batch_size, x_train.shape[0]),), generator=generator)
        loss = (predict(x_train[index]) - y_train[index]).div(out_scale).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % eval_every == 0 or step == steps:
            current = stop_loss()
            if current < best_loss:
                best_loss, best_state, best_step = current, [p.detach().clone() for p in params], step
    w1, b1, w2, b2 = best_state
    with torch.no_grad():
        folded = {  # (x - m)/s @ w1 + b1 = x @ (w1 / s) + (b1 - (m / s) @ w1); output scaled per column
            "w1": w1 / scale[:, None], "b1": b1 - (mean / scale) @ w1,
            "w2": w2 * out_scale[None, :], "b2": b2 * out_scale,
        }
        r2_linear = _r2(x_sel, y_sel)
        r2_mlp = _r2(x_sel + mlp_residual(x_sel, **folded), y_sel)
    return MLPFit(params={k: v.contiguous() for k, v in folded.items()}, r2_linear=r2_linear, r2_mlp=r2_mlp,
                  steps=best_step)


def keep_mlp(fit: MLPFit, min_gain: float) -> bool:
    """The selection rule: keep an MLP head only where it beats the linear map by ``min_gain`` of held-out R^2."""
    return fit.r2_mlp >= fit.r2_linear + min_gain


def weak_layers(kv_map: KVMap, kind: str, r2_threshold: float) -> list[int]:
    """Target layers whose linear held-out R^2 (mean over KV heads, from the map's config) is below the
    threshold; every layer when the map records no R^2."""
    rows = kv_map.config.key_r2 if kind == "keys" else kv_map.config.value_r2
    if not rows:
        return list(range(kv_map.config.target_layout.num_layers))
    return [t for t, row in enumerate(rows) if sum(row) / len(row) < r2_threshold]


class MLPRows:
    """An accumulator for `peft_kvcache.calibration.loop.collect`: per split, kind and weak target layer, a uniform sample of (linear
    map output, target features) rows, ``max_rows`` train and ``max_rows // 2`` held-out (position-free, sink
    tokens excluded as in calibration)."""

    def __init__(self, kv_map: KVMap, source_spec, target_spec, layers: dict[str, list[int]], max_rows: int,
                 seed: int = 0):
        self.kv_map, self.source_spec, self.target_spec, self.layers = kv_map, source_spec, target_spec, layers
        self.reservoirs = {(split, kind, t): RowReservoir(capacity, seed=seed + 7919 * t + (kind == "values"))
                           for split, capacity in (("train", max_rows), ("heldout", max(2, max_rows // 2)))
                           for kind, chosen in layers.items() for t in chosen}

    @torch.no_grad()
    def add(self, split: str, runs: dict, mask: torch.Tensor) -> None:
        source, target = runs["source"], runs["target"]
        positions = positions_from_mask(mask)
        rows = mask.bool() & (positions >= self.kv_map.config.sink_tokens)
        if not rows.any():
            return
        features = SourceFeatures(source.keys, source.values, self.source_spec, positions, torch.float32)
        cpu = torch.device("cpu")
        for kind, chosen in self.layers.items():
            for t in chosen:
                x = torch.cat([features.get(*source, cpu) for source in self.kv_map.source_inputs(kind, t)],
                              dim=-1)[rows]
                weight, bias = self.kv_map.layer_weights(kind, t, cpu, torch.float32)
                states = target.keys[t] if kind == "keys" else target.values[t]
                if kind == "keys":
                    states = position_free_keys(states, self.target_spec, positions.to(states.device))
                self.reservoirs[(split, kind, t)].add(torch.addmm(bias, x, weight),
                                                      layer_features(states.float())[rows.to(states.device)])

    def rows(self) -> dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]]:
        return {key: reservoir.rows() for key, reservoir in self.reservoirs.items()}


def fit_nonlinear_heads(
    kv_map: KVMap,
    source_model: torch.nn.Module,
    target_model: torch.nn.Module,
    calibration_data,
    tokenizer=None,
    *,
    r2_threshold: float = 0.9,
    min_gain: float = 0.01,
    hidden: int = 64,
    steps: int = 400,
    lr: float = 1e-2,
    max_rows: int = 4096,
    seed: int = 0,
    progress: bool = True,
) -> KVMap:
    """A new `KVMap`: ``kv_map`` plus residual MLP heads on the target layers (keys and values separately)
    whose linear held-out R^2 is below ``r2_threshold`` and where the MLP beats the linear map on held-out
    rows by ``min_gain`` of R^2 (the linear map is kept everywhere else).

    ``calibration_data`` is cut and split with the map's own calibration options (`CalibrationTexts`, whole texts
    held out), so passing the map's calibration data keeps its held-out split unseen by both fits. Memory:
    ``4 * 1.5 * max_rows * 2 * E`` bytes per weak layer and kind (E = kv_heads * head_dim), whatever the
    number of texts. Cost: one forward pass of each model over the data (the calibration loop), plus ``steps``
    Adam steps per weak layer.

    Example:
        >>> kv_map2 = fit_nonlinear_heads(kv_map, source, target, texts, tokenizer, progress=False)  # doctest: +SKIP
        >>> kv_map2.config.nonlinear.values                                                         # doctest: +SKIP
        [20, 23, 27]
    """
    if kv_map.config.basis_rank:  # the heads read each layer's dense linear output from its source layers
        raise CalibrationError("nonlinear heads extend a map with each layer's own weights; this map reads a shared "
                               f"basis (basis_rank {kv_map.config.basis_rank}): fit them on a map without one")
    if kv_map.config.attention_bonus is not None:  # heads fitted to the target's keys would learn to undo the offset
        raise CalibrationError("this map carries an attention bonus in its key biases, which heads fitted to the "
                               "target's own keys would learn to undo: fit the heads first, then add the bonus "
                               "(peft_kvcache.calibration.bonus)")
    options = kv_map.config.calibration.options
    if options.head_shards > 1:  # the heads' MLP mixes every head: the map would no longer split per shard
        raise CalibrationError(f"nonlinear heads mix all of a layer's heads; this map is fitted per head shard "
                               f"(head_shards {options.head_shards}), which a tensor-parallel engine relies on: "
                               "fit them on a map fitted with head_shards=1")
    kv_map.check_models(source_model, target_model)
    texts = CalibrationTexts.build(calibration_data, tokenizer, options, vocab_size_of(source_model))
    layers = {kind: weak_layers(kv_map, kind, r2_threshold) for kind in KINDS}
    candidates, kept = [], {kind: [] for kind in KINDS}
    tensors = {name: t for name, t in kv_map.tensors.items() if ".mlp." not in name}
    if any(layers.values()):
        accumulator = MLPRows(kv_map, rotary_spec_of(source_model), rotary_spec_of(target_model), layers, max_rows, seed)
        collect(lambda ids, mask: {"source": run_with_cache(source_model, ids, mask),
                                   "target": run_with_cache(target_model, ids, mask)},
                accumulator, texts, options.batch_size, progress=progress, shard=(0, 1))
        rows = accumulator.rows()
        for kind in KINDS:
            for t in layers[kind]:
                x_tr, y_tr = rows[("train", kind, t)]
                x_ho, y_ho = rows[("heldout", kind, t)]
                fit = train_residual_mlp(x_tr, y_tr, x_ho, y_ho, hidden=hidden, steps=steps, lr=lr, seed=seed + t)
                keep = keep_mlp(fit, min_gain)
                candidates.append(NonlinearCandidate(kind, t, round(fit.r2_linear, 5), round(fit.r2_mlp, 5),
                                                     fit.steps, keep))
                if keep:
                    kept[kind].append(t)
                    tensors.update({f"{kind}.{t}.mlp.{part}": fit.params[part] for part in MLP_PARTS})
                logger.info("%s of target layer %d: held-out R^2 linear %.4f, with MLP %.4f -> %s", kind, t,
                            fit.r2_linear, fit.r2_mlp, "kept" if keep else "linear")
    config = copy.deepcopy(kv_map.config)
    config.nonlinear = NonlinearRecord(keys=kept["keys"], values=kept["values"], hidden=hidden, r2_threshold=r2_threshold,
                                       min_gain=min_gain, max_rows=max_rows, steps=steps, candidates=candidates)
    return KVMap(config, tensors)


__all__ = ["MLPFit", "MLPRows", "RowReservoir", "fit_nonlinear_heads", "keep_mlp", "mlp_residual", "train_residual_mlp",
           "weak_layers"]
