"""The attention bonus: a closed-form key offset that gives a mapped context the attention the target would give it.

A map predicts each key as its expected value given the source (a ridge fit), so a mapped key's logit is the
expected logit, while the weight attention gives a token is ``exp(logit)``, and the mean of an exponential exceeds
the exponential of the mean (with the keys' residual ``e``: ``E[exp(l + e)] = exp(l + var/2)`` for a Gaussian
``e``). The positions the target computes itself (its sink, a recent window, refreshed positions, the new turn) keep
their exact logits, so the mapped context is under-attended against them: the target leans on the few tokens it
computed. The bonus adds ``bonus`` nats to every mapped key's logit instead.

It goes through the keys alone. Per target layer and KV head, a position-free offset ``delta`` such that every query
of the head's group, at every distance up to ``max_distance``, gives ``scaling * q_rot . R(n) delta ~= bonus`` (the
query rotated at its position ``m``, the offset rotated at the key's ``n``): a ridge regression of the constant
``bonus`` on the target's own calibration queries turned by random distances (``z = scaling * s^2 * R(m - n) q``,
``s`` the RoPE's attention scaling), whose low-frequency dims, nearly unturned over a context, carry it. The offset
joins the layer's key bias, so the mapping path, the artifact and every engine (the sessions, the server, vLLM) run
it as any map's, and positions the target computes never carry it. `AttentionBonusRecord` keeps the bonus each head
achieved on its calibration queries and how much it varies over queries and distances.

How large? With a Gaussian residual the mass is restored by half the variance of the logits' residual, which differs
by head: ``bonus="jensen"`` asks each head for its own, ``tr(E[z z^T] E[e e^T]) / 2`` with ``e`` the position-free
residual of the mapped keys against the target's own on the calibration texts (`KeyResiduals`: the source, the map
and the target run over them) and ``z`` the query moments below.

Which ``bonus`` is measured like any lever (``benchmarks.lever_maps --bonus``), on selection texts. The passes over
the target are the costly part and depend on the target alone: `target_query_moments` keeps them (`QueryMoments.save`)
so that every bonus size and every map into that target solves from one set (the offset is linear in the bonus).
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .._files import atomic_write
from ..errors import ArtifactError, CalibrationError
from ..maps.config import BONUS_METHODS, MAX_BONUS, AttentionBonusRecord, QualityRecord
from ..maps.kvmap import KVMap
from ..modeling._compat import recording_queries
from ..modeling.capture import forward, run_with_cache
from ..modeling.identity import cached_fingerprint
from ..modeling.layout import vocab_size_of
from ..modeling.positions import RotarySpec, apply_rotary, position_free_keys, rotary_cos_sin, rotary_spec_of
from ..runtime.mapped import MappedCache
from .texts import CalibrationTexts

logger = logging.getLogger(__name__)


class QueryMoments:
    """Per target layer and KV head, the second moment ``E[z z^T]`` and mean ``E[z]`` of its query heads' logit
    directions ``z = scaling * s^2 * R(distance) q`` (``q`` position-free), at ``draws`` random distances in
    ``[0, max_distance)`` per query, over the queries at positions from ``first`` on (the sink's own queries left
    out: they never see a mapped key). ``target``: the fingerprint of the model whose queries they hold; ``texts``: how
    many calibration chunks it read (both set by `target_query_moments`)."""

    FORMAT = "peft_kvcache.query_moments"

    def __init__(self, layers: int, kv_heads: int, spec: RotarySpec | None, max_distance: int, first: int,
                 draws: int = 1, seed: int = 0, head_dim: int | None = None):
        self.spec, self.kv_heads, self.max_distance, self.first, self.draws = spec, kv_heads, max_distance, first, draws
        self.seed, self.target, self.texts = seed, "", 0
        d = spec.head_dim if spec is not None else head_dim
        self.second = torch.zeros(layers, kv_heads, d, d, dtype=torch.float64)
        self.mean = torch.zeros(layers, kv_heads, d, dtype=torch.float64)
        self.count = torch.zeros(layers, dtype=torch.int64)
        self.generator = torch.Generator().manual_seed(seed)
        self._layer = 0

    def options(self) -> dict:
        """What the moments were read with: they serve a bonus fit asking for the same."""
        return {"target": self.target, "max_distance": self.max_distance, "first": self.first, "draws": self.draws,
                "seed": self.seed, "texts": self.texts}

    def save(self, path: str | Path) -> Path:
        """Write the moments and `options` to one safetensors file (replaced atomically)."""
        path = Path(path)
        tensors = {"second": self.second, "mean": self.mean, "count": self.count}
        metadata = {"format": self.FORMAT, "options": json.dumps(self.options())}
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
        return path

    @classmethod
    def load(cls, path: str | Path) -> QueryMoments:
        """Moments `save` wrote (complete: they solve offsets, they take no more queries). Refuses
        (`ArtifactError`) a file that is not one."""
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
            if metadata.get("format") != cls.FORMAT:
                raise ValueError(f"format {metadata.get('format')!r}")
            options = json.loads(metadata["options"])
            second, mean, count = tensors["second"], tensors["mean"], tensors["count"]
            layers, kv_heads, d = mean.shape
            if second.shape != (layers, kv_heads, d, d) or count.shape != (layers,):
                raise ValueError("tensor shapes disagree")
            moments = cls(layers, kv_heads, None, int(options["max_distance"]), int(options["first"]),
                          int(options["draws"]), int(options["seed"]), head_dim=d)
            moments.target, moments.texts = str(options["target"]), int(options["texts"])
        except (OSError, SafetensorError, ValueError, KeyError, TypeError) as error:
            raise ArtifactError(f"{path} holds no query moments `QueryMoments.save` wrote ({error}): compute them "
                                "again with target_query_moments") from error
        moments.second, moments.mean, moments.count = second.double(), mean.double(), count.long()
        return moments

    def start_pass(self) -> None:
        """A forward pass begins: its attention calls come layer after layer."""
        self._layer = 0

    def add(self, query: torch.Tensor, scaling: float) -> None:
        """One attention call's queries ``[1, heads, n, head_dim]``, rotated at positions ``0..n - 1``."""
        if self.spec is None:
            raise CalibrationError("loaded query moments are complete: they take no more queries")
        layer = self._layer
        self._layer += 1
        if layer >= self.second.shape[0]:
            raise CalibrationError(f"the target ran more attention layers than the map's {self.second.shape[0]}")
        heads, n, d = query.shape[1:]
        if n <= self.first:
            return
        s = self.spec.attention_scaling
        free = position_free_keys(query, self.spec, torch.arange(n)[None])[:, :, self.first:]  # [1, heads, m, d]
        group = heads // self.kv_heads
        for _ in range(self.draws):
            distance = torch.randint(0, self.max_distance, (n - self.first,), generator=self.generator)
            cos, sin = rotary_cos_sin(self.spec, distance[None])  # scaled by s, as the model's
            z = apply_rotary(free, cos, sin)[0] * (scaling * s)  # scaling * s^2 * R(distance) q
            z = z.reshape(self.kv_heads, group * (n - self.first), d)  # query heads j*group.. read KV head j
            self.second[layer] += (z.transpose(1, 2) @ z).double()  # float32 per pass, summed in float64
            self.mean[layer] += z.sum(1).double()
        self.count[layer] += group * (n - self.first) * self.draws

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``E[z z^T]`` ``[layers, kv_heads, head_dim, head_dim]`` and ``E[z]`` ``[layers, kv_heads, head_dim]``."""
        if (self.count == 0).any():
            raise CalibrationError("some target layer saw no query past the sink: pass longer calibration texts")
        count = self.count.to(torch.float64)
        return self.second / count[:, None, None, None], self.mean / count[:, None, None]

    def offsets(self, bonus: float | torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per layer and KV head the offset ``delta`` (``[layers, kv_heads, head_dim]``) of least
        ``E[(z . delta - bonus)^2] + ridge * mean(diag E[z z^T]) * |delta|^2``, the bonus it achieves on average and
        its spread (standard deviation) over the queries and distances. ``bonus``: one for every head, or
        ``[layers, kv_heads]``."""
        second, mean = self.moments()
        eye = torch.eye(second.shape[-1], dtype=torch.float64)
        scale = second.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
        asked = torch.as_tensor(bonus, dtype=torch.float64)
        asked = asked[..., None] if asked.dim() else asked
        delta = torch.linalg.solve(second + ridge * scale * eye, (asked * mean)[..., None])[..., 0]
        achieved = (mean * delta).sum(-1)
        spread = (torch.einsum("lhi,lhij,lhj->lh", delta, second, delta) - achieved**2).clamp(min=0).sqrt()
        return delta, achieved, spread


class KeyResiduals:
    """Per target layer and KV head, the second moment ``E[e e^T]`` of the position-free residual ``e`` of a map's keys
    against the target's own (positions from ``first`` on: the sink is the target's own either way)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, spec: RotarySpec, first: int):
        self.spec, self.first = spec, first
        self.second = torch.zeros(layers, kv_heads, head_dim, head_dim, dtype=torch.float64)
        self.count = 0

    def add(self, own_keys, mapped_keys) -> None:
        """One text's keys per target layer, the target's own and the mapped (``[1, kv_heads, n, head_dim]``, rotated
        at positions ``0..n - 1``)."""
        n = own_keys[0].shape[2]
        if n <= self.first:
            return
        positions = torch.arange(n)[None]
        for t, (own, mapped) in enumerate(zip(own_keys, mapped_keys, strict=True)):
            e = position_free_keys(own.float() - mapped.float(), self.spec, positions)[0, :, self.first:]
            self.second[t] += (e.transpose(1, 2) @ e).double()
        self.count += n - self.first

    def jensen(self, moments: QueryMoments) -> torch.Tensor:
        """``[layers, kv_heads]``: half the variance of each head's logit residual on the mapped keys,
        ``tr(E[z z^T] E[e e^T]) / 2`` (queries and residuals taken as independent)."""
        if not self.count:
            raise CalibrationError("no mapped key past the sink: pass longer calibration texts")
        second, _ = moments.moments()
        return torch.einsum("lhij,lhji->lh", second, self.second / self.count) / 2


def key_residuals(kv_map: KVMap, source_model: torch.nn.Module, target_model: torch.nn.Module, calibration_data,
                  tokenizer=None, progress: bool = True) -> KeyResiduals:
    """`KeyResiduals` of ``kv_map`` over ``calibration_data``'s train split (cut as `target_query_moments` cuts it):
    per chunk the source's cache mapped as inference maps it (no refresh), against the target's own cache."""
    kv_map.check_models(source_model, target_model)
    layout = kv_map.config.target_layout
    residuals = KeyResiduals(layout.num_layers, layout.kv_heads, layout.head_dim, rotary_spec_of(target_model),
                             kv_map.config.sink_tokens)
    for ids in tqdm(_train_chunks(kv_map, target_model, calibration_data, tokenizer), desc="key residuals",
                    unit="chunk", disable=not progress):
        ids = ids[None]
        with torch.no_grad():
            mapped = MappedCache.from_source(source_model, kv_map, target_model, input_ids=ids, refresh_tokens=0,
                                             verify_models=False)
            own = run_with_cache(target_model, ids)
        residuals.add(own.keys, [layer.keys for layer in mapped.layers])
    return residuals


def _train_chunks(kv_map: KVMap, target_model: torch.nn.Module, calibration_data, tokenizer) -> list[torch.Tensor]:
    """The train split of ``calibration_data`` cut by ``kv_map``'s calibration options (whole texts held out)."""
    options = kv_map.config.calibration.options
    chunks = CalibrationTexts.build(calibration_data, tokenizer, options, vocab_size_of(target_model)).split("train")
    if not chunks:
        raise CalibrationError("the calibration data left no train chunk: pass more texts")
    return chunks


def _check_reading(max_distance: int, draws: int) -> None:
    """Refuse distances or draws the query moments cannot be read with."""
    if max_distance < 1 or draws < 1:
        raise CalibrationError(f"max_distance and draws must be positive, got {max_distance}, {draws}")


def _check_bonus_options(bonus, max_distance: int, ridge: float, draws: int) -> None:
    if bonus not in BONUS_METHODS[1:] and not (isinstance(bonus, (int, float)) and math.isfinite(bonus)
                                               and 0 <= bonus <= MAX_BONUS):
        raise CalibrationError(f"bonus must be a number of nats in 0..{MAX_BONUS} or 'jensen', got {bonus!r}")
    _check_reading(max_distance, draws)
    if ridge < 0:
        raise CalibrationError(f"ridge must be >= 0, got {ridge}")


def target_query_moments(
    kv_map: KVMap,
    target_model: torch.nn.Module,
    calibration_data,
    tokenizer=None,
    *,
    max_distance: int = 4096,
    draws: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> QueryMoments:
    """The passes of `add_attention_bonus`: the target's query moments over ``calibration_data``'s train split, cut
    by ``kv_map``'s calibration options (checked against ``kv_map``'s target by fingerprint before any pass). Save
    them (`QueryMoments.save`) and hand them to `add_attention_bonus` (``moments=``) to try several bonus sizes, or
    maps into the same target calibrated alike, for one set of passes."""
    _check_reading(max_distance, draws)
    config = kv_map.config
    kv_map.check_models(None, target_model)
    options, layout = config.calibration.options, config.target_layout
    chunks = _train_chunks(kv_map, target_model, calibration_data, tokenizer)
    spec = rotary_spec_of(target_model)
    moments = QueryMoments(layout.num_layers, layout.kv_heads, spec, max_distance, options.sink_tokens, draws, seed)
    moments.target, moments.texts = cached_fingerprint(target_model), len(chunks)
    with torch.no_grad(), recording_queries(target_model, moments.add):  # one chunk per pass: a batch of one
        for ids in tqdm(chunks, desc="target queries", unit="chunk", disable=not progress):
            moments.start_pass()
            forward(target_model, ids[None], None, position_ids=torch.arange(ids.numel())[None])
    return moments


def add_attention_bonus(
    kv_map: KVMap,
    target_model: torch.nn.Module,
    calibration_data=None,
    tokenizer=None,
    *,
    bonus: float | str = 1.0,
    max_distance: int = 4096,
    ridge: float = 1e-3,
    draws: int = 1,
    seed: int = 0,
    moments: QueryMoments | None = None,
    source_model: torch.nn.Module | None = None,
    progress: bool = True,
) -> KVMap:
    """A new `KVMap`: ``kv_map`` whose mapped keys carry ``bonus`` nats more logit with every query of the target
    (see the module's docstring), fitted on the target's own queries over ``calibration_data`` (its train split,
    cut by the map's calibration options: whole texts held out stay unseen).

    Args:
        kv_map: a map without nonlinear heads (they read the linear output the offset would change) and without a
            bonus already.
        target_model: the map's target (checked by fingerprint before any pass).
        calibration_data: texts, ``{name: text}`` or token ids, as `KVMap.calibrate` takes them (none with
            ``moments``).
        bonus: the logit added to every mapped key, in nats (0 .. `MAX_BONUS`), or ``"jensen"``: each head's own,
            half the variance of its logits' residual on the mapped keys (`KeyResiduals`; needs ``source_model`` and
            ``calibration_data``, over which the source, the map and the target run: on texts the map was fitted on
            its residual is smaller than elsewhere, so texts it never saw ask a truer bonus).
        max_distance: distances between a query and a mapped key the offset serves (drawn uniformly below it):
            RoPE turns the offset's dims apart over longer ones, so its bonus drifts past it.
        ridge: the offset's ridge, relative to the mean query energy per dim.
        draws: random distances per query.
        moments: `target_query_moments` of this target read with the same ``max_distance``, ``draws``, ``seed`` and
            sink: no pass over the target's queries runs.
        source_model: the map's source, for ``bonus="jensen"``.

    Example:
        >>> bonus_map = add_attention_bonus(kv_map, target, texts, tokenizer, bonus=1.0)   # doctest: +SKIP
        >>> bonus_map.config.attention_bonus.achieved[0]                                    # doctest: +SKIP
        [0.99, 0.98]
    """
    config = kv_map.config
    _check_bonus_options(bonus, max_distance, ridge, draws)
    if config.attention_bonus is not None:
        raise CalibrationError(f"this map carries an attention bonus already ({config.attention_bonus.bonus} nats); "
                               "add one to the map without it")
    if config.mlp_layers("keys"):  # the heads read the linear keys: an offset before them is not an offset after
        raise CalibrationError("this map has nonlinear key heads, which read the linear output the offset would move: "
                               "add the bonus to a map without them")
    jensen = bonus == "jensen"
    if jensen and (source_model is None or calibration_data is None):
        raise CalibrationError("bonus='jensen' measures the mapped keys' residual: pass source_model and "
                               "calibration_data")
    if not jensen and (moments is None) == (calibration_data is None):
        raise CalibrationError("pass calibration_data (the target's queries are read over it) or moments (read "
                               "already), one of them")
    if moments is None:
        moments = target_query_moments(kv_map, target_model, calibration_data, tokenizer, max_distance=max_distance,
                                       draws=draws, seed=seed, progress=progress)
    else:
        _check_moments(moments, kv_map, target_model, max_distance=max_distance, draws=draws, seed=seed)
    asked = float(bonus) if not jensen else key_residuals(kv_map, source_model, target_model, calibration_data,
                                                          tokenizer, progress).jensen(moments)
    if jensen and not bool(((asked >= 0) & (asked <= MAX_BONUS)).all()):
        past = int((asked > MAX_BONUS).sum())
        raise CalibrationError(f"the Jensen bonus of {past} of {asked.numel()} heads is past {MAX_BONUS} nats (largest "
                               f"{float(asked.max()):.3g}, median {float(asked.median()):.3g}): those heads' mapped keys "
                               "are too far from the target's for a bonus to help; use a constant bonus")
    delta, achieved, spread = moments.offsets(asked, ridge)
    layout = config.target_layout
    tensors = dict(kv_map.tensors)
    for t in range(layout.num_layers):
        bias = tensors[f"keys.{t}.bias"]
        tensors[f"keys.{t}.bias"] = (bias.double() + delta[t].reshape(-1)).to(bias.dtype)
    config = copy.deepcopy(config)
    config.quality = QualityRecord()  # the gate and figures measured the keys before the offset
    config.attention_bonus = AttentionBonusRecord(
        bonus=float(torch.as_tensor(asked).mean()), method="jensen" if jensen else "constant",
        asked=_rounded(asked) if jensen else [], max_distance=max_distance, ridge=ridge, texts=moments.texts,
        queries=int(moments.count[0]) // draws, achieved=_rounded(achieved), spread=_rounded(spread))
    logger.info("attention bonus %.2f nats (%s): achieved %.3f on average (%.3f..%.3f), spread %.3f",
                config.attention_bonus.bonus, config.attention_bonus.method, float(achieved.mean()),
                float(achieved.min()), float(achieved.max()), float(spread.mean()))
    return KVMap(config, tensors)


def _rounded(rows: torch.Tensor) -> list[list[float]]:
    """A ``[layers, kv_heads]`` tensor as the record keeps it."""
    return [[round(float(x), 4) for x in row] for row in rows]


def _check_moments(moments: QueryMoments, kv_map: KVMap, target_model: torch.nn.Module, **asked) -> None:
    """Refuse (`CalibrationError`) moments another target's queries gave, or read otherwise than asked."""
    kv_map.check_models(None, target_model)
    layout = kv_map.config.target_layout
    if moments.target != cached_fingerprint(target_model):
        raise CalibrationError(f"the query moments were read from another model (fingerprint {moments.target[:12]}) "
                               "than the target given: compute them with this target")
    read = {"first": moments.first, **{name: getattr(moments, name) for name in asked}}
    wanted = {"first": kv_map.config.sink_tokens, **asked}
    shape = (layout.num_layers, layout.kv_heads, layout.head_dim)
    if read != wanted or tuple(moments.mean.shape) != shape:
        raise CalibrationError(f"the query moments were read with {read} over {tuple(moments.mean.shape)} (layers, KV "
                               f"heads, head dim); this bonus asks for {wanted} over {shape}: pass the same options "
                               "or compute them again")


__all__ = ["KeyResiduals", "QueryMoments", "add_attention_bonus", "key_residuals", "target_query_moments"]
