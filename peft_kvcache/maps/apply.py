"""The one function that applies a fitted map to a source cache; calibration-time evaluation and inference
both call it, so what was measured is what runs.

Per target layer: the position-free states of its chosen source layers, one matmul per (source head, target head)
block of its weight (plus bias) in the cache's own layout, keys re-rotated at the target positions in place, cast
and placed on the target layer's device. A map with a shared basis projects the source layers once per kind and
device and each target layer reads that projection instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..errors import CacheMismatchError, NumericalError
from ..modeling.layout import layer_features
from ..modeling.positions import RotarySpec, remove_rotary_float, rotary_cos_sin, rotate_
from .compute import matmul_dtype


class SourceFeatures:
    """Position-free features of a source cache, computed lazily per source layer and kept while a later target
    layer still reads them (several may read one source layer; `release` drops them after the last)."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], spec: RotarySpec,
                 positions: torch.Tensor, dtype: torch.dtype):
        self.keys, self.values, self.spec, self.positions, self.dtype = keys, values, spec, positions, dtype
        self._cache: dict[tuple[str, int], torch.Tensor] = {}
        self._rotations: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # cos/sin once per device

    def heads(self, kind: str, layer: int, device: torch.device) -> torch.Tensor:
        """``[batch, kv_heads, seq, head_dim]`` position-free states of one source layer in the compute dtype,
        contiguous, on ``device`` (the cache's own layout: a head's rows are one matrix)."""
        key = (kind, layer)
        if key not in self._cache:
            states = self.states(kind, layer)
            if kind == "keys":
                if states.device not in self._rotations:
                    self._rotations[states.device] = rotary_cos_sin(self.spec, self.positions, device=states.device)
                cos, sin = self._rotations[states.device]
                states = remove_rotary_float(states, cos, sin, self.spec.attention_scaling)
            self._cache[key] = states.to(self.dtype).contiguous()
        # a copy onto an accelerator may run on while the host goes on; one to the host must be whole before a CPU
        # matmul reads it
        return self._cache[key].to(device, non_blocking=torch.device(device).type != "cpu")

    def states(self, kind: str, layer: int) -> torch.Tensor:
        """One source layer's states as the cache holds them (keys still rotated)."""
        return self.keys[layer] if kind == "keys" else self.values[layer]

    def release(self, kind: str, layer: int) -> None:
        """Drop one source layer's features (no later target layer reads them): the next layer's reuse their memory
        instead of the mapping taking fresh pages for every source layer."""
        self._cache.pop((kind, layer), None)

    def get(self, kind: str, layer: int, device: torch.device) -> torch.Tensor:
        """``[batch, seq, kv_heads * head_dim]`` features of one source layer (heads side by side), on ``device``."""
        return layer_features(self.heads(kind, layer, device))


def mlp_residual(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                 b2: torch.Tensor) -> torch.Tensor:
    """The residual a nonlinear head adds to the linear map's output ``x`` ``[n, E]``:
    ``gelu(x @ w1 + b1) @ w2 + b2`` (see `peft_kvcache.calibration.nonlinear`).

    Example:
        >>> E, H = 4, 8
        >>> mlp_residual(torch.randn(3, E), torch.randn(E, H), torch.zeros(H), torch.zeros(H, E), torch.zeros(E)).abs().max().item()
        0.0
    """
    return torch.addmm(b2, torch.nn.functional.gelu(torch.addmm(b1, x, w1)), w2)


def map_layer(features: Sequence[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor, head_dim: int,
              mlp: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """All heads of one target layer in one matmul per source layer: ``sum_s features[s] @ weight[rows of s]
    + bias`` (the source layers' features ``[batch, seq, D_s]`` are accumulated, never concatenated) ->
    ``[batch, kv_heads, seq, head_dim]``; ``mlp`` (w1, b1, w2, b2), where the layer has a residual MLP head,
    adds ``gelu(lin @ w1 + b1) @ w2 + b2`` to the linear output ``lin`` (all heads at once)."""
    batch, seq, _ = features[0].shape
    mapped, row = None, 0
    for x in features:
        x = x.reshape(batch * seq, -1)
        rows = weight[row: row + x.shape[1]]
        mapped = torch.addmm(bias.to(x.dtype), x, rows) if mapped is None else mapped.addmm_(x, rows)
        row += x.shape[1]
    if row != weight.shape[0]:
        raise CacheMismatchError(f"the layer's features have {row} columns but its weight has {weight.shape[0]} rows")
    if mlp is not None:
        mapped = mapped + mlp_residual(mapped, *(p.to(mapped.dtype) for p in mlp))
    # one copy into the cache layout; the rotary and the cast then run on contiguous memory
    return mapped.view(batch, seq, -1, head_dim).transpose(1, 2).contiguous()


def map_layer_heads(features: Sequence[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor, heads: int,
                    head_dim: int) -> torch.Tensor:
    """`map_layer` without a residual MLP, read from and written in the cache's own layout: each target head's
    ``[seq, head_dim]`` block accumulates one matmul per source head (``features``: per source layer ``[batch,
    kv_heads, seq, head_dim]``), so no features or outputs are transposed -> ``[batch, heads, seq, head_dim]``."""
    batch, _, seq, _ = features[0].shape
    out = torch.empty(batch, heads, seq, head_dim, dtype=features[0].dtype, device=features[0].device)
    bias = bias.to(out.dtype)
    for b in range(batch):
        for j in range(heads):
            columns, target, row = slice(j * head_dim, (j + 1) * head_dim), out[b, j], 0
            for x in features:
                for i in range(x.shape[1]):
                    rows = weight[row: row + x.shape[3], columns]
                    if row == 0:
                        torch.addmm(bias[columns], x[b, i], rows, out=target)
                    else:
                        target.addmm_(x[b, i], rows)
                    row += x.shape[3]
            if row != weight.shape[0]:
                raise CacheMismatchError(f"the layer's features have {row} columns but its weight has "
                                         f"{weight.shape[0]} rows")
    return out


def map_layer_factored(x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, bias: torch.Tensor,
                       rotated: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A same-shape layer whose weight is the identity plus ``down @ up`` (rank r), in the cache's own layout: the
    source heads ``x`` ``[batch, heads, seq, head_dim]`` plus the bias, plus each head's share of ``(x @ down) @ up``
    (2r multiply-adds per feature instead of the layer width) -> ``[batch, heads, seq, head_dim]``.

    ``rotated`` (the source keys as cached, cos, sin at the target positions): keys whose source rotation is the
    target's (same RoPE, same positions) come out rotated, as the source keys plus the rotated correction, so their
    identity part is never rotated back and forth."""
    batch, heads, _, head_dim = x.shape
    if down.shape[0] != heads * head_dim or up.shape[1] != heads * head_dim:
        raise CacheMismatchError(f"the layer's features have {heads * head_dim} columns but its factors are "
                                 f"{tuple(down.shape)} and {tuple(up.shape)}")
    # The bias is added outside the products: a column of ones carrying it through them (r + 1 columns) runs the
    # thin products ~1.5x slower than r columns (BLAS kernels tile by 8 or 16 columns).
    out = torch.empty_like(x)
    for b in range(batch):
        low = torch.mm(x[b, 0], down[:head_dim])  # [seq, r]: the features through the down factor
        for i in range(1, heads):
            low.addmm_(x[b, i], down[i * head_dim: (i + 1) * head_dim])
        for j in range(heads):
            columns = slice(j * head_dim, (j + 1) * head_dim)
            if rotated is None:  # the identity and the bias in one pass, the correction accumulated onto them
                torch.add(x[b, j], bias[columns], out=out[b, j]).addmm_(low, up[:, columns])
            else:  # the correction and its bias alone: `add_rotated` rotates it onto the source keys
                torch.addmm(bias[columns], low, up[:, columns], out=out[b, j])
    return out if rotated is None else add_rotated(*rotated, out)


def add_rotated(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """``keys + R(correction)`` (R: `apply_rotary` with ``cos``/``sin``) into a new tensor of the correction's dtype,
    two passes per half of the rotary dims: mapped keys whose identity part is already rotated."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    c, s = cos[:, None, :, :half], sin[:, None, :, :half]
    x1, x2 = correction[..., :half], correction[..., half:rotary_dim]
    out = torch.empty_like(correction)
    torch.addcmul(keys[..., :half], x1, c, out=out[..., :half]).addcmul_(x2, s, value=-1.0)
    torch.addcmul(keys[..., half:rotary_dim], x2, c, out=out[..., half:rotary_dim]).addcmul_(x1, s)
    if rotary_dim < keys.shape[-1]:  # partial rotary: the rest passes through
        torch.add(keys[..., rotary_dim:], correction[..., rotary_dim:], out=out[..., rotary_dim:])
    return out


def project_basis(inputs: Sequence[torch.Tensor], basis: torch.Tensor) -> torch.Tensor:
    """The source layers' features ``inputs`` (per layer ``[batch, kv_heads, seq, head_dim]``) through a map's shared
    basis ``[D, rank]`` -> ``[batch, 1, seq, rank]``: what every target layer's readout of the kind reads (the
    readout is then `map_layer_heads` with this as its one input)."""
    return map_layer_heads(inputs, basis, basis.new_zeros(basis.shape[1]), 1, basis.shape[1])


def default_compute_dtype(kv_map, device: torch.device) -> torch.dtype:
    """The dtype `map_cache` multiplies in by default: float32 for a map with a `KVMap.residual_rank` (the identity
    carries the source exactly; its thin factors cost little), else `peft_kvcache.maps.compute.matmul_dtype`."""
    return torch.float32 if kv_map.residual_rank else matmul_dtype(device)


def place_map(kv_map, device: torch.device) -> None:
    """Cast and place every layer's weights (or factors) on ``device`` in the dtype `map_cache` multiplies in by
    default, as the first mapping there would: a server does it at start, off the first switch's path."""
    dtype = default_compute_dtype(kv_map, device)
    for t in range(kv_map.config.target_layout.num_layers):
        for kind in ("keys", "values"):
            if kv_map.residual_rank:
                kv_map.layer_factors(kind, t, device, dtype)
            else:
                if kv_map.config.basis_rank:
                    kv_map.layer_basis(kind, device, dtype)
                kv_map.layer_weights(kind, t, device, dtype)
                kv_map.layer_mlp(kind, t, device, dtype)


def iter_map_cache(
    kv_map,
    source_keys: Sequence[torch.Tensor],
    source_values: Sequence[torch.Tensor],
    source_positions: torch.Tensor,
    target_positions: torch.Tensor,
    placements: Sequence[tuple[torch.device, torch.dtype]],
    compute_dtype: torch.dtype | None = None,
    source_rotary: RotarySpec | None = None,
    target_rotary: RotarySpec | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Map a source cache into the target's KV space, one target layer at a time: each ``(keys, values)`` is
    computed when it is asked for (the connector spreads a mapping over engine steps); `map_cache` maps them all.
    The arguments are checked before the first layer.

    Args:
        kv_map: a `KVMap`.
        source_keys, source_values: per source layer ``[batch, kv_heads, seq, head_dim]`` (keys post-RoPE).
        source_positions, target_positions: ``[batch, seq]`` absolute positions of each cached token.
        placements: per target layer (device, dtype) the mapped tensors must have.
        compute_dtype: dtype of the matmuls; by default bfloat16 where this device multiplies it markedly
            faster (`peft_kvcache.maps.compute.matmul_dtype`), else float32, and float32 for a map with a
            `KVMap.residual_rank` (the identity carries the source exactly; its thin factors cost little); the
            rotary always runs in float32.
        source_rotary, target_rotary: the models' own rotary parameters when the models are at hand (a model
            cast to bfloat16 rotates with rounded frequencies); the map's stored ones otherwise.

    Returns:
        Per target layer ``(keys, values)`` of shape ``[batch, kv_heads, seq, head_dim]``.
    """
    config = kv_map.config
    if len(source_keys) != config.source_layout.num_layers:
        raise CacheMismatchError(
            f"the source cache has {len(source_keys)} layers but map {config.source_name!r} -> "
            f"{config.target_name!r} expects {config.source_layout.num_layers}"
        )
    expected = (config.source_layout.kv_heads, config.source_layout.head_dim)
    for i, k in enumerate(source_keys):
        if tuple(k.shape[1:2]) + tuple(k.shape[3:]) != expected or k.shape != source_values[i].shape:
            raise CacheMismatchError(
                f"source cache layer {i} has keys {tuple(k.shape)} and values {tuple(source_values[i].shape)}; "
                f"the map expects [batch, {expected[0]}, seq, {expected[1]}]"
            )
    factored = kv_map.residual_rank > 0
    compute_dtype = compute_dtype or default_compute_dtype(kv_map, source_keys[0].device)
    features = SourceFeatures(source_keys, source_values, source_rotary or kv_map.source_rotary, source_positions,
                              compute_dtype)
    return _mapped_layers(kv_map, features, target_rotary or kv_map.target_rotary, target_positions, placements,
                          compute_dtype, factored)


def last_readers(kv_map) -> dict[tuple[str, int], int]:
    """``(kind, source layer) -> the last target layer that reads it`` (its features can go after that layer)."""
    last = {}
    for t in range(kv_map.config.target_layout.num_layers):
        for kind in ("keys", "values"):
            for source in kv_map.source_inputs(kind, t):
                last[source] = t
    return last


@torch.no_grad()  # inference: a cache is mapped, never trained through (a generator: at every layer it computes)
def _mapped_layers(kv_map, features: SourceFeatures, target_spec: RotarySpec, target_positions: torch.Tensor,
                   placements: Sequence[tuple[torch.device, torch.dtype]], compute_dtype: torch.dtype,
                   factored: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    heads, head_dim = kv_map.config.target_layout.kv_heads, kv_map.config.target_layout.head_dim
    last = last_readers(kv_map)
    same_rotation = factored and rotates_alike(features.spec, features.positions, target_spec, target_positions)
    rotations = {}
    projected = {}  # (kind, device) -> the source through the shared basis, once for every layer placed there
    devices = {device for device, _ in placements}
    for t, (device, dtype) in enumerate(placements):
        if device not in rotations:  # one cos/sin per device, shared by the layers placed there
            rotations[device] = rotary_cos_sin(target_spec, target_positions, device=device)
        cos, sin = rotations[device]
        layer = []
        for kind in ("keys", "values"):
            sources = kv_map.source_inputs(kind, t)
            if kv_map.config.basis_rank:  # every layer reads one projection of the source layers per device
                if (kind, device) not in projected:
                    projected[kind, device] = project_basis([features.heads(*s, device) for s in sources],
                                                            kv_map.layer_basis(kind, device, compute_dtype))
                    if all((k, d) in projected for k in ("keys", "values") for d in devices):
                        for source in {s for k in ("keys", "values") for s in kv_map.source_inputs(k, t)}:
                            features.release(*source)  # no layer reads the features any more
                inputs, read = None, [projected[kind, device]]
            else:
                inputs = [features.heads(*source, device) for source in sources]
                read = inputs  # what the layer's weight multiplies
            rotated = None  # keys the factored layer returns rotated already
            if factored:  # the one input is source layer t
                if kind == "keys" and same_rotation:  # the source keys are rotated as the target's must be
                    rotated = (features.keys[t].to(device), cos, sin)
                states = map_layer_factored(inputs[0], *kv_map.layer_factors(kind, t, device, compute_dtype), rotated)
            else:
                weight, bias = kv_map.layer_weights(kind, t, device, compute_dtype)
                mlp = kv_map.layer_mlp(kind, t, device, compute_dtype)
                if mlp is None:
                    states = map_layer_heads(read, weight, bias, heads, head_dim)
                else:  # the residual MLP reads every head at once
                    states = map_layer([layer_features(x) for x in inputs], weight, bias, head_dim, mlp)
            if kind == "keys" and rotated is None:
                states = rotate_(states.float(), cos, sin)
            layer.append(_cast_checked(states, dtype, t, kind, {s: features.states(*s) for s in sources}))
        for source in {s for kind in ("keys", "values") for s in kv_map.source_inputs(kind, t)}:
            if last[source] == t:
                features.release(*source)
        yield layer[0], layer[1]


def rotates_alike(source: RotarySpec, source_positions: torch.Tensor, target: RotarySpec,
                  target_positions: torch.Tensor) -> bool:
    """Whether keys rotated by ``source`` at ``source_positions`` are rotated exactly as ``target`` rotates them at
    ``target_positions`` (same frequencies, scaling and rotary dims; same positions)."""
    return (source.rotary_dim == target.rotary_dim and source.attention_scaling == target.attention_scaling
            and torch.equal(source.inv_freq.cpu().float(), target.inv_freq.cpu().float())
            and source_positions.shape == target_positions.shape
            and torch.equal(source_positions.cpu(), target_positions.cpu()))


def map_cache(kv_map, *args, **kwargs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`iter_map_cache` (same arguments), every target layer at once: ``[(keys, values), ...]``."""
    return list(iter_map_cache(kv_map, *args, **kwargs))


def _cast_checked(states: torch.Tensor, dtype: torch.dtype, layer: int, kind: str,
                  inputs: dict[tuple[str, int], torch.Tensor] | None = None) -> torch.Tensor:
    """Cast to the target dtype, refusing NaN/Inf (from a bad source cache or float16 overflow); the error
    names the source inputs whose states were not finite (``inputs``: (kind, source layer) -> its states)."""
    cast = states.to(dtype)
    # A cheap reduction first (a NaN/Inf anywhere makes the sum non-finite), the elementwise check only to confirm.
    if not torch.isfinite(cast.sum(dtype=torch.float32)) and not torch.isfinite(cast).all():
        bad_sources = [s for s, f in (inputs or {}).items() if not torch.isfinite(f).all()]
        if bad_sources:
            named = ", ".join(f"{source_kind} of layer {s}" for source_kind, s in bad_sources)
            cause = f"is NaN/Inf: the source cache's {named} contain NaN or Inf"
        elif torch.isfinite(states).all():
            largest = float(states.abs().max())
            cause = f"overflows {dtype} (largest magnitude {largest:.3g}); load the target in bfloat16 or float32"
        else:
            cause = "is NaN/Inf although the source cache is finite (overflow in the mapping's compute dtype)"
        raise NumericalError(f"mapped {kind} of target layer {layer} {cause}")
    return cast
