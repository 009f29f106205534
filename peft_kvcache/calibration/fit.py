"""Closed-form ridge maps from streaming sufficient statistics.

Features are rows: source ``x`` ``[n, D]`` (all source layers side by side, position-free) and target
``y`` ``[n, E]`` (all target layers side by side). Ridge needs only ``X^T X``, ``X^T Y``, column sums and
column sums of squares, accumulated in float64: memory is O(D^2 + D E) whatever the number of tokens,
and statistics of two shards add (`merge`), which is all distributed calibration needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import CalibrationError, NumericalError
from ..maps.config import DEFAULT_LAMBDA_GRID


@dataclass
class SufficientStatistics:
    """Streaming float64 sums for ridge from source features to one or more named targets.

    The source part (``x_*``) is shared by every target: fitting one base model to several adapters
    accumulates the expensive ``X^T X`` once.

    Example:
        >>> stats = SufficientStatistics.empty(3, {"target": 2})
        >>> stats.update(torch.randn(5, 3), {"target": torch.randn(5, 2)})
        >>> int(stats.count)
        5
    """

    count: torch.Tensor
    x_sum: torch.Tensor
    x_gram: torch.Tensor
    y_sum: dict[str, torch.Tensor] = field(default_factory=dict)
    y_sumsq: dict[str, torch.Tensor] = field(default_factory=dict)
    xy: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def empty(cls, source_dim: int, target_dims: dict[str, int]) -> "SufficientStatistics":
        """Zero statistics for ``source_dim`` features and each named target's width."""
        f64 = torch.float64
        return cls(
            count=torch.zeros((), dtype=f64),
            x_sum=torch.zeros(source_dim, dtype=f64),
            x_gram=torch.zeros(source_dim, source_dim, dtype=f64),
            y_sum={name: torch.zeros(dim, dtype=f64) for name, dim in target_dims.items()},
            y_sumsq={name: torch.zeros(dim, dtype=f64) for name, dim in target_dims.items()},
            xy={name: torch.zeros(source_dim, dim, dtype=f64) for name, dim in target_dims.items()},
        )

    def update(self, x: torch.Tensor, ys: dict[str, torch.Tensor], weights: torch.Tensor | None = None) -> None:
        """Add rows: ``x`` ``[n, D]`` and each target's ``y`` ``[n, E]`` (same rows, any float dtype), each row counted
        ``weights[i]`` times (``[n]``, non-negative; None: once): a row of weight 2 adds what two copies would."""
        x = x.to(device="cpu", dtype=torch.float64)
        if not torch.isfinite(x).all():
            raise NumericalError("source features contain NaN or Inf; the source model's cache is not finite")
        if weights is not None:
            weights = weights.to(device="cpu", dtype=torch.float64).reshape(-1)
            if weights.shape[0] != x.shape[0] or not torch.isfinite(weights).all() or bool((weights < 0).any()):
                raise CalibrationError(f"row weights must be {x.shape[0]} finite non-negative numbers")
        weighted = x if weights is None else x * weights[:, None]
        self.count += x.shape[0] if weights is None else weights.sum()
        self.x_sum += weighted.sum(0)
        self.x_gram.addmm_(weighted.T, x)
        for name, y in ys.items():
            y = y.to(device="cpu", dtype=torch.float64)
            if y.shape[0] != x.shape[0]:
                raise CalibrationError(f"target {name!r} has {y.shape[0]} rows for {x.shape[0]} source rows")
            if not torch.isfinite(y).all():
                raise NumericalError(f"target {name!r} features contain NaN or Inf")
            self.y_sum[name] += y.sum(0) if weights is None else weights @ y
            self.y_sumsq[name] += y.square().sum(0) if weights is None else weights @ y.square()
            self.xy[name].addmm_(weighted.T, y)

    def merge(self, other: "SufficientStatistics") -> "SufficientStatistics":
        """Sum of two sets of statistics (e.g. two chunks or two processes' shards)."""
        merged = self.state_dict()
        for key, value in other.state_dict().items():
            merged[key] = merged[key] + value
        return SufficientStatistics.from_state_dict(merged)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor dict (for safetensors checkpoints and all-reduce)."""
        state = {"count": self.count, "x_sum": self.x_sum, "x_gram": self.x_gram}
        for name in self.xy:
            state[f"y_sum.{name}"] = self.y_sum[name]
            state[f"y_sumsq.{name}"] = self.y_sumsq[name]
            state[f"xy.{name}"] = self.xy[name]
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> "SufficientStatistics":
        """Statistics back from `state_dict` (a checkpoint)."""
        stats = cls(count=state["count"], x_sum=state["x_sum"], x_gram=state["x_gram"])
        for key, value in state.items():
            kind, _, name = key.partition(".")
            if name:
                getattr(stats, kind)[name] = value
        return stats


def all_reduce_statistics(stats: list[SufficientStatistics]) -> None:
    """Sum every process's statistics in place with one ``torch.distributed.all_reduce`` (gloo on the CPU,
    NCCL on GPUs); a no-op when torch.distributed is not initialized or runs a single process.

    Statistics add exactly, so fitting the summed statistics gives the map one process would fit over all
    the sequences.

    Example:
        >>> stats = [SufficientStatistics.empty(3, {"target": 2})]
        >>> all_reduce_statistics(stats)  # outside torchrun: nothing to do
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    tensors = [t for entry in stats for t in entry.state_dict().values()]
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(device)  # one collective for all the sums
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat = flat.cpu()
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


@dataclass
class HeadFit:
    """Ridge solution for the columns of some heads: ``y ~ x @ weight + bias``."""

    weight: torch.Tensor  # [D_in, E_cols] float64
    bias: torch.Tensor  # [E_cols]
    lambdas: torch.Tensor  # [heads] absolute ridge strength chosen per head
    r2: torch.Tensor  # [heads] held-out R^2 per head


@dataclass
class LayerFit:
    """The fitted map of one target layer for keys or for values."""

    source_layers: list[int]
    fit: HeadFit  # with a shared basis, ``weight`` is the layer's readout ``[rank, width]`` of the basis
    candidate_r2: list[float]  # held-out mean R^2 of each single source layer (layer-selection evidence)
    basis: torch.Tensor | None = None  # [D, rank]: the projection every target layer shares (`share_basis`)


class _Centered:
    """Train statistics centred at their means, held-out statistics centred at the *train* means (the
    held-out error of a model with a bias fitted on train)."""

    def __init__(self, train: SufficientStatistics, heldout: SufficientStatistics, target: str):
        n, n_ho = float(train.count), float(heldout.count)
        if n < 2 or n_ho < 1:
            raise CalibrationError(
                f"calibration kept {int(n)} train and {int(n_ho)} held-out tokens; give more or longer "
                "sequences (the held-out split is whole sequences)"
            )
        mx, my = train.x_sum / n, train.y_sum[target] / n
        self.mx, self.my = mx, my
        self.sxx = train.x_gram - n * torch.outer(mx, mx)
        self.sxy = train.xy[target] - n * torch.outer(mx, my)
        sx_ho, sy_ho = heldout.x_sum, heldout.y_sum[target]
        self.xx_ho = heldout.x_gram - torch.outer(sx_ho, mx) - torch.outer(mx, sx_ho) + n_ho * torch.outer(mx, mx)
        self.xy_ho = heldout.xy[target] - torch.outer(sx_ho, my) - torch.outer(mx, sy_ho) + n_ho * torch.outer(mx, my)
        self.yy_ho = heldout.y_sumsq[target] - 2 * my * sy_ho + n_ho * my.square()
        self.sst_ho = (heldout.y_sumsq[target] - sy_ho.square() / n_ho).clamp_min(1e-30)
        for label, value in (("train", self.sxx), ("held-out", self.xx_ho), ("held-out", self.yy_ho)):
            if not torch.isfinite(value).all():
                raise NumericalError(f"the {label} calibration statistics are not finite")


@dataclass
class GramEigen:
    """The eigendecomposition of the train Gram of some source feature ``rows`` and the held-out Gram in its
    basis: all a ridge from those rows needs besides the target columns, shared by every fit that uses them."""

    rows: torch.Tensor
    eigvals: torch.Tensor  # [D] clamped at 0
    eigvecs: torch.Tensor  # [D, D]: gram = Q diag(eig) Q^T
    heldout: torch.Tensor  # [D, D]: Q^T XX_ho Q

    @classmethod
    def of(cls, stats: _Centered, rows: torch.Tensor) -> "GramEigen":
        eigvals, eigvecs = torch.linalg.eigh(stats.sxx[rows][:, rows])
        return cls(rows, eigvals.clamp_min(0), eigvecs, eigvecs.T @ stats.xx_ho[rows][:, rows] @ eigvecs)


def solve_ridge(
    stats: _Centered,
    rows: torch.Tensor | GramEigen,
    cols: torch.Tensor,
    head_size: int,
    prior: torch.Tensor | None = None,
    lambda_grid: tuple[float, ...] = DEFAULT_LAMBDA_GRID,
) -> HeadFit:
    """Ridge ``argmin ||Y - X W||^2 + lam ||W - prior||^2`` for source features ``rows`` and target
    columns ``cols``, with ``lam`` chosen per head (``head_size`` consecutive columns) on held-out error.

    One eigendecomposition of the source Gram serves every lambda: in its eigenbasis the solution is
    ``(Q^T B + lam Q^T P) / (eig + lam)``; pass a `GramEigen` as ``rows`` to share it between fits.
    """
    eigen = rows if isinstance(rows, GramEigen) else GramEigen.of(stats, rows)
    rows, eigvals, eigvecs = eigen.rows, eigen.eigvals, eigen.eigvecs
    scale = float(eigvals.mean()) if float(eigvals.mean()) > 0 else 1.0
    lambdas = torch.tensor(lambda_grid, dtype=torch.float64) * scale  # [G]

    b_eig = eigvecs.T @ stats.sxy[rows][:, cols]  # [D, E]
    p_eig = eigvecs.T @ prior if prior is not None else torch.zeros_like(b_eig)
    h_eig = eigen.heldout  # [D, D]
    g_eig = eigvecs.T @ stats.xy_ho[rows][:, cols]  # [D, E]

    w_eig = (b_eig + lambdas[:, None, None] * p_eig) / (eigvals[None, :, None] + lambdas[:, None, None])  # [G,D,E]
    sse = stats.yy_ho[cols] - 2 * (w_eig * g_eig).sum(1) + (w_eig * (h_eig @ w_eig)).sum(1)  # [G, E]
    heads = cols.numel() // head_size
    sse_heads = sse.view(len(lambdas), heads, head_size).sum(-1)  # [G, heads]
    best = sse_heads.argmin(0)  # [heads]
    r2 = 1 - sse_heads[best, torch.arange(heads)] / stats.sst_ho[cols].view(heads, head_size).sum(-1)

    col_lambda = best.repeat_interleave(head_size)  # [E]
    weight = eigvecs @ w_eig[col_lambda, :, torch.arange(cols.numel())].T  # [D, E]
    bias = stats.my[cols] - stats.mx[rows] @ weight
    return HeadFit(weight=weight, bias=bias, lambdas=lambdas[best], r2=r2)


def reduce_rank(stats: _Centered, fit: HeadFit, prior: torch.Tensor, rank: int, head_size: int) -> HeadFit:
    """The fit's correction of the prior (``weight - prior``) kept to its ``rank`` directions of largest variance over
    the train features (reduced-rank regression: the fitted predictions projected on their top principal directions,
    closed form from the centred Gram), the bias refitted to the train means and the held-out R^2 measured again.
    A ``rank`` of at least the width returns the fit unchanged."""
    correction = fit.weight - prior
    if rank >= min(correction.shape):
        return fit
    _, directions = torch.linalg.eigh(correction.T @ stats.sxx @ correction)  # ascending
    top = directions[:, -rank:]
    weight = prior + correction @ top @ top.T
    sse = stats.yy_ho - 2 * (weight * stats.xy_ho).sum(0) + (weight * (stats.xx_ho @ weight)).sum(0)
    heads = weight.shape[1] // head_size
    r2 = 1 - sse.view(heads, head_size).sum(-1) / stats.sst_ho.view(heads, head_size).sum(-1)
    return HeadFit(weight=weight, bias=stats.my - stats.mx @ weight, lambdas=fit.lambdas, r2=r2)


def share_basis(stats: _Centered, fits: list[LayerFit], rank: int, head_size: int) -> list[LayerFit]:
    """Every target layer's fit, all from the same source rows, kept to one shared ``rank``-dimensional basis of those
    rows: the weights of all target layers side by side (``[D, layers * width]``) projected on the ``rank`` directions
    of largest variance of their predictions over the train features (reduced-rank regression across the target
    layers, closed form from the centred Gram), each layer's bias refitted to the train means and its held-out R^2
    measured again. The fits come back factored: one ``basis`` ``[D, rank]`` shared by every layer (the source
    features' projection, computed once per mapping) and per layer a readout ``[rank, width]`` as its weight."""
    if any(f.source_layers != fits[0].source_layers for f in fits):
        raise CalibrationError("a shared basis needs every target layer fitted from the same source layers: pass "
                               "top_k equal to the source's layers")
    weight = torch.cat([f.fit.weight for f in fits], dim=1)  # [D, layers * width]
    if rank >= min(weight.shape):
        raise CalibrationError(f"basis_rank {rank} saves nothing: the source features are {weight.shape[0]} wide and "
                               f"the target layers {weight.shape[1]}; pass a rank below both")
    _, directions = torch.linalg.eigh(weight.T @ stats.sxx @ weight)  # ascending
    readout = directions[:, -rank:].T  # [rank, layers * width]
    basis = weight @ readout.T  # [D, rank]
    weight = basis @ readout
    sse = stats.yy_ho - 2 * (weight * stats.xy_ho).sum(0) + (weight * (stats.xx_ho @ weight)).sum(0)
    r2 = 1 - sse.view(-1, head_size).sum(-1) / stats.sst_ho.view(-1, head_size).sum(-1)  # [layers * heads]
    bias = stats.my - stats.mx @ weight
    width, heads = weight.shape[1] // len(fits), weight.shape[1] // len(fits) // head_size
    return [LayerFit(source_layers=f.source_layers, candidate_r2=f.candidate_r2, basis=basis, fit=HeadFit(
        weight=readout[:, t * width:(t + 1) * width], bias=bias[t * width:(t + 1) * width], lambdas=f.fit.lambdas,
        r2=r2[t * heads:(t + 1) * heads])) for t, f in enumerate(fits)]


def _block(layer: int, width: int) -> torch.Tensor:
    return torch.arange(layer * width, (layer + 1) * width)


def check_shards(layout, shards: int) -> None:
    """Refuse a split of ``layout``'s KV heads into ``shards`` groups that does not divide them."""
    if shards < 1 or layout.kv_heads % shards:
        raise CalibrationError(f"{layout.kv_heads} KV heads do not split into {shards} shards: pass head_shards "
                               "dividing the KV heads of both models")


def head_shard_of(count: int, layout, shards: int) -> torch.Tensor:
    """The shard (0..``shards`` - 1) of each of ``count`` feature positions laid out as ``layout``'s layers side by
    side: KV heads split into ``shards`` contiguous groups, as tensor parallelism splits them across ranks."""
    check_shards(layout, shards)
    return torch.arange(count) % layout.layer_width // layout.head_dim // (layout.kv_heads // shards)


class ShardedRidge:
    """Ridge fits from source feature rows to target columns where, with ``shards`` > 1, each target KV head is
    predicted from the source KV heads of its own shard only (a tensor-parallel rank maps its heads without
    gathering the others): one ridge per shard, the weights between shards zero. Eigendecompositions are kept by
    (``key``, shard), so fits that use the same source rows share them."""

    def __init__(self, stats: _Centered, source_layout, target_layout, shards: int = 1):
        self.stats, self.source, self.target, self.shards = stats, source_layout, target_layout, shards
        self.eigens: dict = {}
        for layout in (source_layout, target_layout):
            check_shards(layout, shards)  # before any fit

    def solve(self, rows: torch.Tensor, cols: torch.Tensor, prior: torch.Tensor | None,
              lambda_grid: tuple[float, ...], key=None) -> HeadFit:
        head = self.target.head_dim
        if self.shards == 1:
            return solve_ridge(self.stats, self._eigen(rows, key, 0), cols, head, prior, lambda_grid)
        row_shard = head_shard_of(len(rows), self.source, self.shards)
        col_shard = head_shard_of(len(cols), self.target, self.shards)
        f64 = torch.float64
        weight, bias = torch.zeros(len(rows), len(cols), dtype=f64), torch.zeros(len(cols), dtype=f64)
        lambdas, r2 = torch.zeros(len(cols) // head, dtype=f64), torch.zeros(len(cols) // head, dtype=f64)
        for shard in range(self.shards):
            r, c = (row_shard == shard).nonzero()[:, 0], (col_shard == shard).nonzero()[:, 0]
            fit = solve_ridge(self.stats, self._eigen(rows[r], key, shard), cols[c], head,
                              None if prior is None else prior[r][:, c], lambda_grid)
            weight[r[:, None], c] = fit.weight
            bias[c] = fit.bias
            heads = c[::head] // head
            lambdas[heads], r2[heads] = fit.lambdas, fit.r2
        return HeadFit(weight=weight, bias=bias, lambdas=lambdas, r2=r2)

    def _eigen(self, rows: torch.Tensor, key, shard: int) -> torch.Tensor | GramEigen:
        if key is None:
            return rows
        if (key, shard) not in self.eigens:
            self.eigens[key, shard] = GramEigen.of(self.stats, rows)
        return self.eigens[key, shard]


def basis_problem(basis_rank: int, top_k: int, layers: int, same_shape: bool, head_shards: int) -> str | None:
    """Why ``basis_rank`` cannot be fitted with these options (None where it can): one basis of every source layer
    is shared by the target layers, so it needs ``top_k`` = all ``layers``, a cross-shape pair and one head shard."""
    if basis_rank and (top_k != layers or same_shape or head_shards != 1):
        return (f"basis_rank shares one basis of every source layer between the target layers: it needs top_k={layers} "
                f"(all of them), a cross-shape pair and head_shards=1 (got top_k={top_k}, "
                f"{'a same-shape' if same_shape else 'a cross-shape'} pair, head_shards={head_shards})")
    return None


def fit_layers(
    train: SufficientStatistics,
    heldout: SufficientStatistics,
    target: str,
    source_layout,
    target_layout,
    top_k: int = 1,
    lambda_grid: tuple[float, ...] = DEFAULT_LAMBDA_GRID,
    identity_prior: bool = False,
    progress=None,
    head_shards: int = 1,
    identity_offset: int = 0,
    basis_rank: int = 0,
) -> list[LayerFit]:
    """Per target layer: score every source layer by held-out R^2, keep the best ``top_k`` and refit on
    their concatenation, with a ridge per target KV head.

    ``identity_prior`` (same-shape pairs, e.g. base -> adapter) shrinks toward copying the same layer's
    heads instead of toward zero: target layer t copies source layer ``t + identity_offset`` (a value map
    whose candidates list the source's keys first). ``progress`` is an optional callable advanced once per source layer.
    ``head_shards`` > 1 predicts each target head from its own shard's source heads only (`ShardedRidge`).
    ``basis_rank`` > 0 (with ``top_k`` all the source layers) keeps all target layers to one shared basis of that
    rank (`share_basis`).
    """
    if top_k < 1 or top_k > source_layout.num_layers:
        raise CalibrationError(f"top_k must be in 1..{source_layout.num_layers}, got {top_k}")
    problem = basis_problem(basis_rank, top_k, source_layout.num_layers, identity_prior, head_shards)
    if problem:
        raise CalibrationError(problem)
    stats = _Centered(train, heldout, target)
    ridge = ShardedRidge(stats, source_layout, target_layout, head_shards)
    d_src, d_tgt = source_layout.layer_width, target_layout.layer_width
    all_cols = torch.arange(target_layout.num_layers * d_tgt)

    def prior_for(sources: list[int], target_layer: int | None) -> torch.Tensor | None:
        if not identity_prior:
            return None
        targets = range(target_layout.num_layers) if target_layer is None else [target_layer]
        prior = torch.zeros(len(sources) * d_src, len(targets) * d_tgt, dtype=torch.float64)
        for i, s in enumerate(sources):
            for j, t in enumerate(targets):
                if s == t + identity_offset:
                    prior[i * d_src : (i + 1) * d_src, j * d_tgt : (j + 1) * d_tgt] = torch.eye(d_src)
        return prior

    # Score each single source layer against all target layers at once: one eigendecomposition each. A
    # coarse grid (every third lambda) ranks layers as well as the full one at a third of the cost; the
    # chosen layers are refitted with the full grid.
    scan_grid = tuple(lambda_grid[::3]) if len(lambda_grid) > 3 else tuple(lambda_grid)
    scores = torch.empty(source_layout.num_layers, target_layout.num_layers, dtype=torch.float64)
    for s in range(source_layout.num_layers):
        single = ridge.solve(_block(s, d_src), all_cols, prior_for([s], None), scan_grid)
        scores[s] = single.r2.view(target_layout.num_layers, target_layout.kv_heads).mean(-1)
        if progress is not None:
            progress()

    fits = []  # target layers choosing the same source layers share one eigendecomposition (keyed by the choice)
    for t in range(target_layout.num_layers):
        chosen = sorted(scores[:, t].topk(top_k).indices.tolist())
        fit = ridge.solve(torch.cat([_block(s, d_src) for s in chosen]), _block(t, d_tgt), prior_for(chosen, t),
                          lambda_grid, key=tuple(chosen))
        fits.append(LayerFit(source_layers=chosen, fit=fit, candidate_r2=scores[:, t].tolist()))
    return share_basis(stats, fits, basis_rank, target_layout.head_dim) if basis_rank else fits


def fit_same_layers(
    blocks: list[tuple[SufficientStatistics, SufficientStatistics]],
    target: str,
    layout,
    lambda_grid: tuple[float, ...] = DEFAULT_LAMBDA_GRID,
    identity_prior: bool = False,
    progress=None,
    head_shards: int = 1,
    residual_rank: int = 0,
) -> list[LayerFit]:
    """Per layer ``t``: ridge from source layer ``t`` to target layer ``t`` on that layer's own (train,
    held-out) statistics ``blocks[t]`` (block-diagonal statistics of same-depth pairs); ``identity_prior``
    shrinks toward copying the source layer. ``progress`` is advanced once per layer. ``head_shards`` > 1
    predicts each target head from its own shard's source heads only (`ShardedRidge`). ``residual_rank`` > 0
    (with ``identity_prior``) keeps each layer's correction of the identity to that rank (`reduce_rank`)."""
    width = layout.layer_width
    columns = torch.arange(width)
    prior = torch.eye(width, dtype=torch.float64) if identity_prior else None
    if residual_rank and (prior is None or head_shards != 1):
        raise CalibrationError("residual_rank corrects the identity of a same-shape pair, with head_shards=1")
    fits = []
    for t, (train, heldout) in enumerate(blocks):
        stats = _Centered(train, heldout, target)
        fit = ShardedRidge(stats, layout, layout, head_shards).solve(columns, columns, prior, lambda_grid)
        if residual_rank:
            fit = reduce_rank(stats, fit, prior, residual_rank, layout.head_dim)
        fits.append(LayerFit(source_layers=[t], fit=fit, candidate_r2=[]))
        if progress is not None:
            progress()
    return fits
