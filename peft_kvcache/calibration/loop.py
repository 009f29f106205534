"""Calibration: capture -> statistics -> fit -> `KVMap`, one loop for sibling pairs and for a base model and its
adapters alike (`KVMap.calibrate` and `AdapterMaps.calibrate` delegate here).

The loop (`collect`) runs the models over the calibration chunks of each split and hands their caches to an
accumulator; it checkpoints the accumulator's state (`peft_kvcache.calibration.checkpoint`) so an interrupted run resumes
to the same result, and under ``torchrun`` each process takes its shard of the chunks and the statistics are
summed with one all-reduce. The held-out split is whole texts: no text contributes to both splits.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..errors import CalibrationError, RecordError
from ..maps.adapter_maps import AdapterMaps
from ..maps.config import DEFAULT_LAMBDA_GRID, KINDS, CalibrationConfig, CalibrationRecord, KVMapConfig, ModelSpec
from ..maps.kvmap import KVMap
from ..modeling.adapters import adapter_active, is_activated_lora, is_peft_model
from ..modeling.capture import CapturedKV, batches, run_with_cache
from ..modeling.identity import check_pair
from ..modeling.layout import vocab_size_of
from ..modeling.positions import check_rotary_reach
from .checkpoint import CalibrationCheckpoint, Progress, run_digest
from .fit import basis_problem, check_shards, fit_layers, fit_same_layers
from .statistics import SPLITS, ModelSide, StatisticsRun
from .texts import CalibrationTexts

logger = logging.getLogger(__name__)

BASE = "base"  # the name the base model of a PeftModel has in adapter calibration


# ----- the loop -----


def join_process_group() -> tuple[int, int]:
    """Join torch.distributed's process group when started by ``torchrun`` (``WORLD_SIZE`` > 1; NCCL with GPUs, each
    rank on the GPU ``LOCAL_RANK`` names, gloo on CPUs); returns ``(rank, world_size)``, ``(0, 1)`` for a single
    process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():  # NCCL refuses two ranks on one GPU, and every rank starts on GPU 0
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _shard() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def collect(run_models: Callable[[torch.Tensor, torch.Tensor], dict[str, CapturedKV]], accumulator,
            texts: CalibrationTexts, batch_size: int = 1, *, progress: bool = True, checkpoint_dir=None,
            checkpoint_every: int = 50, checkpoint_key: dict | None = None,
            shard: tuple[int, int] | None = None) -> float:
    """Run the models over every chunk (``run_models(ids, mask) -> {name: CapturedKV}``) and feed the caches to
    ``accumulator.add(split, runs, mask)``, split by split. Returns the wall seconds that earlier runs of a resumed
    checkpoint spent collecting (0.0 for a fresh start): a calibration adds them to its own time, so a map fitted
    from a finished checkpoint records what its statistics cost, not the seconds of its fit.

    With ``checkpoint_dir`` the accumulator's ``state_dict()`` is saved there every ``checkpoint_every`` batches and
    an interrupted run started again with the same arguments resumes where it stopped, with the same result; a
    checkpoint of other data, options or models is refused. Under ``torchrun`` (or with ``shard=(rank, world)``)
    each process runs chunks ``rank::world`` of each split and, with torch.distributed, the accumulator's
    ``all_reduce()`` sums the shards so that every process holds the statistics of all the chunks; a process whose
    share fails says so at that reduction, where the others raise `CalibrationError` instead of waiting for ever
    (torchrun stops them itself; other launchers do not).
    """
    rank, world = shard or _shard()
    if not 0 <= rank < world:
        raise CalibrationError(f"rank must be in 0..{world - 1}, got {rank}")
    if checkpoint_every < 1:
        raise CalibrationError(f"checkpoint_every must be at least 1 batch, got {checkpoint_every}")
    per_split = [texts.split(split)[rank::world] for split in SPLITS]
    checkpoint, done, started = None, Progress(), time.perf_counter()
    if checkpoint_dir is not None:
        digest = run_digest(texts.all_chunks(), {"names": texts.names, "heldout": texts.heldout, "batch": batch_size,
                                                 "rank": rank, "world": world, **(checkpoint_key or {})})
        counts = [-(-len(chunks) // batch_size) for chunks in per_split]
        checkpoint = CalibrationCheckpoint(checkpoint_dir, digest, counts, rank)
        done = checkpoint.load(accumulator.state_dict()) or done
    together = world > 1 and dist.is_available() and dist.is_initialized()
    try:
        for index, (split, chosen) in enumerate(zip(SPLITS, per_split)):
            if done.complete or index < done.split:
                continue
            skip = done.batches if index == done.split else 0
            with tqdm(total=sum(len(s) for s in chosen), desc=f"calibration ({split})", unit="tok",
                      disable=not progress) as bar:
                bar.update(sum(len(s) for s in chosen[: skip * batch_size]))
                for count, (ids, mask) in enumerate(batches(chosen, batch_size), start=1):
                    if count <= skip:
                        continue
                    accumulator.add(split, run_models(ids, mask), mask)
                    bar.update(int(mask.sum()))
                    if checkpoint is not None and count % checkpoint_every == 0:
                        checkpoint.save(accumulator.state_dict(),
                                        Progress(index, count, seconds=done.seconds + time.perf_counter() - started))
            if checkpoint is not None:
                seconds = done.seconds + time.perf_counter() - started
                checkpoint.save(accumulator.state_dict(),
                                Progress(index + 1, 0, complete=index + 1 == len(SPLITS), seconds=seconds))
    except Exception:
        if together:  # the others learn it in the collective they wait in, instead of waiting there for ever
            _any_failed(True)
        raise
    if together:
        if _any_failed(False):
            raise CalibrationError("another process of this calibration failed (its own error says why): the "
                                   "statistics of this one are not reduced")
        accumulator.all_reduce()
    return done.seconds


def _any_failed(failed: bool) -> bool:
    """Whether any process of the group failed its share of the collection (every process calls it once)."""
    flag = torch.tensor([float(failed)])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    return bool(flag.item())


# ----- fit -----


def build_map(run: StatisticsRun, source: str, target: str, config: CalibrationConfig, record: CalibrationRecord,
              vocab_size: int, progress: bool = True) -> KVMap:
    """Fit keys and values of every target layer from ``source``'s statistics and assemble the `KVMap`."""
    src, tgt = run.sides[source], run.sides[target]
    same_shape = _same_shape(src, tgt)
    tensors, fits = {"source.inv_freq": src.rotary.inv_freq, "target.inv_freq": tgt.rotary.inv_freq}, {}
    steps = tgt.layout.num_layers if config.same_layer else src.layout.num_layers
    with tqdm(total=2 * steps, desc="fitting", unit="layer", disable=not progress) as bar:
        for kind in KINDS:
            if config.same_layer:
                fits[kind] = fit_same_layers([run.pair(source, target, t, kind)[:2] for t in run.blocks], target,
                                             tgt.layout, config.lambda_grid, identity_prior=same_shape,
                                             progress=bar.update, head_shards=config.head_shards,
                                             residual_rank=config.residual_rank)
            else:  # with joint_kinds the candidates are the source's keys of every layer, then its values
                candidates = replace(src.layout, num_layers=config.candidate_inputs(src.layout.num_layers))
                identity_offset = src.layout.num_layers if config.joint_kinds and kind == "values" else 0
                fits[kind] = fit_layers(*run.pair(source, target, None, kind), candidates, tgt.layout,
                                        top_k=config.top_k, lambda_grid=config.lambda_grid,
                                        identity_prior=same_shape, progress=bar.update, head_shards=config.head_shards,
                                        identity_offset=identity_offset, basis_rank=config.basis_rank)
            if fits[kind][0].basis is not None:  # one projection of the source shared by every layer
                tensors[f"{kind}.basis"] = fits[kind][0].basis.float()
            for t, layer in enumerate(fits[kind]):
                tensors[f"{kind}.{t}.weight"] = layer.fit.weight.float()
                tensors[f"{kind}.{t}.bias"] = layer.fit.bias.float()
    # a count is the rows' total weight, their number whatever the weighting (each batch's weights average 1)
    record = replace(record, train_tokens=round(run.tokens(source, "train")),
                     heldout_tokens=round(run.tokens(source, "heldout")))
    k, v = fits["keys"], fits["values"]
    map_config = KVMapConfig(
        source_name=src.name, target_name=tgt.name, source_fingerprint=src.fingerprint,
        target_fingerprint=tgt.fingerprint, source_layout=src.layout, target_layout=tgt.layout,
        source_rotary=src.rotary.describe(), target_rotary=tgt.rotary.describe(),
        vocab_size=vocab_size, pair_kind="same_shape" if same_shape else "cross_shape",
        key_layers=[f.source_layers for f in k], value_layers=[f.source_layers for f in v],
        key_r2=[f.fit.r2.tolist() for f in k], value_r2=[f.fit.r2.tolist() for f in v],
        key_lambdas=[f.fit.lambdas.tolist() for f in k], value_lambdas=[f.fit.lambdas.tolist() for f in v],
        key_candidate_r2=[f.candidate_r2 for f in k] if not config.same_layer else [],
        value_candidate_r2=[f.candidate_r2 for f in v] if not config.same_layer else [],
        calibration=record)
    return KVMap(map_config, tensors)


def statistics_options(config: CalibrationConfig) -> dict:
    """The options a checkpoint of statistics is keyed on: those that shape the statistics (not the ridge grid, the
    layer choice, the ranks or the head shards, which only shape the fit from them, so fits with other such options resume from the same
    statistics), where they differ from their defaults (an option added later with a default keeps the checkpoints
    made before it).

    Example:
        >>> statistics_options(CalibrationConfig(top_k=4, max_length=1024))
        {'max_length': 1024}
    """
    shaped, default = replace(config, lambda_grid=DEFAULT_LAMBDA_GRID, top_k=1, residual_rank=0,
                                  basis_rank=0, head_shards=1), CalibrationConfig()
    return {f.name: getattr(shaped, f.name) for f in fields(CalibrationConfig)
            if getattr(shaped, f.name) != getattr(default, f.name)}


def _same_shape(source: ModelSide, target: ModelSide) -> bool:
    """Whether a pair's caches have one layout and one RoPE (a map then corrects the identity, e.g. base -> adapter)."""
    return source.layout == target.layout and torch.equal(source.rotary.inv_freq, target.rotary.inv_freq)


def resolve_config(config: CalibrationConfig | None, options: dict, **defaults) -> CalibrationConfig:
    """``config`` (or the defaults) with ``options`` (field names of `CalibrationConfig`) applied, validated."""
    known = {f.name for f in fields(CalibrationConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise CalibrationError(f"unknown calibration options {unknown}; CalibrationConfig has {sorted(known)}")
    try:
        config = replace(config or CalibrationConfig(**defaults), **options)
        config.validate()  # a config built earlier may have had a field set since
    except RecordError as err:
        raise CalibrationError(str(err)) from None
    return config


def check_fit_options(config: CalibrationConfig, source: ModelSide, target: ModelSide) -> None:
    """Refuse, before any model runs, options a map from ``source`` to ``target`` cannot be fitted with (each would
    fail, or quietly give a worse map, after the capture pass)."""
    same_shape = _same_shape(source, target)
    if config.same_layer and source.layout != target.layout:
        raise CalibrationError("same_layer needs models of the same depth and KV width; use top_k layer selection")
    candidates = config.candidate_inputs(source.layout.num_layers)
    if not config.same_layer and config.top_k > candidates:
        raise CalibrationError(f"top_k {config.top_k} exceeds the source model's {candidates} candidate inputs (its "
                               "layers, or with joint_kinds their keys and values)")
    width = target.layout.layer_width
    if config.residual_rank and not same_shape:
        raise CalibrationError("residual_rank corrects the identity, so it needs a same-shape pair (one KV layout and "
                               "one RoPE, e.g. base -> adapter); pass residual_rank=0")
    if 2 * config.residual_rank >= width:  # the map would run as dense weights, fitted at a reduced rank
        raise CalibrationError(f"residual_rank {config.residual_rank} saves nothing on layers {width} wide (two "
                               f"factors cost as much as the dense weights): pass a rank below {(width + 1) // 2}, or 0")
    for side in (source, target):
        check_shards(side.layout, config.head_shards)
    problem = basis_problem(config.basis_rank, config.top_k, candidates, same_shape, config.head_shards)
    if problem:
        raise CalibrationError(problem)
    widest = min(config.top_k * source.layout.layer_width, target.layout.num_layers * width)
    if config.basis_rank >= widest:
        raise CalibrationError(f"basis_rank {config.basis_rank} saves nothing: the source features are "
                               f"{config.top_k * source.layout.layer_width} wide and the target layers "
                               f"{target.layout.num_layers * width}; pass a rank below both")


def check_positions(texts: CalibrationTexts, sides: dict[str, ModelSide]) -> None:
    """Refuse, before any model runs, chunks reaching past where a side's RoPE changes its frequencies."""
    longest = max((chunk.numel() for chunk in texts.all_chunks()), default=0)
    for side in sides.values():
        if longest:
            check_rotary_reach(side.rotary, longest - 1)


def _rotary_key(side: ModelSide) -> list:
    """What statistics depend on in a side's RoPE (removed from its keys): its summary and its frequencies."""
    return [str(side.rotary.describe()), side.rotary.inv_freq.tolist()]


def _dtypes(*models: torch.nn.Module) -> list[str]:
    return [str(next(m.parameters()).dtype) for m in models]


def calibrate(source_model: torch.nn.Module, target_model: torch.nn.Module, calibration_data, tokenizer=None,
              config: CalibrationConfig | None = None, *, description: str = "", source_spec: ModelSpec | None = None,
              target_spec: ModelSpec | None = None, progress: bool = True, checkpoint_dir=None,
              checkpoint_every: int = 50, **options) -> KVMap:
    """Fit a KV map from ``source_model`` to ``target_model``.

    Args:
        calibration_data: 1-D token id tensors or texts (with ``tokenizer``), or a mapping name -> either (the names,
            e.g. file paths, are recorded in the map).
        config: the fit's options (`CalibrationConfig`); keyword ``options`` override single fields (``top_k=2``).
        description: what the data is, for the card.
        source_spec, target_spec: how to load the models again (recorded for the card's usage snippet).
        checkpoint_dir: checkpoint the statistics there every ``checkpoint_every`` batches; a calibration interrupted
            (crash, Ctrl-C) and started again with the same arguments resumes where it stopped and gives the same
            map. Under ``torchrun`` each process calibrates its shard of the chunks and the statistics are summed.

    Example:
        >>> kv_map = calibrate(small_model, large_model, [torch.randint(0, 100, (256,)) for _ in range(10)], top_k=2)  # doctest: +SKIP
    """
    config = resolve_config(config, options)
    check_pair(source_model, target_model, tokenizer)
    started = time.perf_counter()
    sides = {"source": ModelSide.of(source_model), "target": ModelSide.of(target_model)}
    check_fit_options(config, sides["source"], sides["target"])
    texts = CalibrationTexts.build(calibration_data, tokenizer, config, vocab_size_of(source_model))
    check_positions(texts, sides)
    run = StatisticsRun({"source": ["target"]}, sides, config)
    weighting = config.attention_weighting > 0
    key = {"options": statistics_options(config), "fingerprints": [s.fingerprint for s in sides.values()],
           "dtypes": _dtypes(source_model, target_model), "rotary": [_rotary_key(s) for s in sides.values()]}
    run_models = lambda ids, mask: {"source": run_with_cache(source_model, ids, mask),  # noqa: E731
                                    "target": run_with_cache(target_model, ids, mask, received_attention=weighting)}
    earlier = collect(run_models, run, texts, config.batch_size, progress=progress, checkpoint_dir=checkpoint_dir,
                      checkpoint_every=checkpoint_every, checkpoint_key=key)
    record = CalibrationRecord(options=config, data=texts.record(description), sequences=len(texts.all_chunks()),
                               processes=_shard()[1], source=source_spec, target=target_spec)
    kv_map = build_map(run, "source", "target", config, record, vocab_size_of(source_model), progress)
    kv_map.config.calibration.seconds = round(earlier + time.perf_counter() - started, 2)
    logger.info("calibrated %r in %.1fs", kv_map, kv_map.config.calibration.seconds)
    return kv_map


def calibrate_adapters(model: torch.nn.Module, calibration_data, tokenizer=None, adapters: Sequence[str] | None = None,
                       config: CalibrationConfig | None = None, *, reverse: bool = True, description: str = "",
                       base_spec: str | None = None, adapter_paths: Mapping[str, str] | None = None,
                       progress: bool = True, checkpoint_dir=None, checkpoint_every: int = 50,
                       **options) -> AdapterMaps:
    """Fit base -> adapter maps (and, with ``reverse``, adapter -> base maps) for the adapters of a `PeftModel`,
    in one pass over the calibration data (the base's KV computed once per chunk), through the same loop as
    `calibrate` (checkpointable, sharded under ``torchrun``).

    Args:
        model: a `PeftModel` holding the adapters (``model.load_adapter(path, adapter_name=...)``).
        adapters: adapter names (default: every adapter except Activated LoRAs, whose prefix KV *is* the base's).
        config: as in `calibrate`; by default ``same_layer=True``: each target layer is mapped from the same source
            layer (block-diagonal statistics, ``num_layers`` times less memory; the identity prior makes the same
            layer the natural choice for an adapter). ``same_layer=False`` scores every source layer (``top_k``).
        base_spec, adapter_paths: how to load the base model and each adapter again (for the cards).

    Example:
        >>> maps = calibrate_adapters(peft_model, [torch.randint(0, 100, (64,)) for _ in range(8)])  # doctest: +SKIP
    """
    if not is_peft_model(model):
        raise CalibrationError(f"calibrate_adapters needs a PeftModel, got {type(model).__name__}")
    config = resolve_config(config, options, same_layer=True)
    adapters = list(adapters) if adapters is not None else [a for a in model.peft_config if not is_activated_lora(model, a)]
    if not adapters:
        raise CalibrationError("no adapter to calibrate: load one with model.load_adapter(path, adapter_name=...)")
    unknown = sorted(set(adapters) - set(model.peft_config))
    if unknown:
        raise CalibrationError(f"the model has no adapters {unknown}; it has {sorted(model.peft_config)}")
    started = time.perf_counter()
    sides = {}
    for name in [BASE, *adapters]:
        with adapter_active(model, None if name == BASE else name):
            sides[name] = ModelSide.of(model)
    groups = {BASE: list(adapters), **({a: [BASE] for a in adapters} if reverse else {})}
    for source, targets in groups.items():
        for target in targets:
            check_fit_options(config, sides[source], sides[target])
    texts = CalibrationTexts.build(calibration_data, tokenizer, config, vocab_size_of(model))
    check_positions(texts, sides)
    run = StatisticsRun(groups, sides, config)
    # the models whose attention weights the fit (its targets), measured only when it is weighted
    targets = {t for ts in groups.values() for t in ts} if config.attention_weighting else set()

    def run_models(ids, mask):
        runs = {}
        for name in [BASE, *adapters]:
            with adapter_active(model, None if name == BASE else name):
                runs[name] = run_with_cache(model, ids, mask, received_attention=name in targets)
        return runs

    key = {"options": statistics_options(config), "fingerprints": {n: s.fingerprint for n, s in sides.items()},
           "dtypes": _dtypes(model), "reverse": reverse, "rotary": _rotary_key(sides[BASE])}
    earlier = collect(run_models, run, texts, config.batch_size, progress=progress, checkpoint_dir=checkpoint_dir,
                      checkpoint_every=checkpoint_every, checkpoint_key=key)
    record = CalibrationRecord(options=config, data=texts.record(description), sequences=len(texts.all_chunks()),
                               processes=_shard()[1])
    paths = dict(adapter_paths or {})
    spec = lambda name: ModelSpec(base_spec or sides[BASE].name, None if name == BASE else name,  # noqa: E731
                                  None if name == BASE else paths.get(name))
    maps, vocab = AdapterMaps(), vocab_size_of(model)
    for adapter in adapters:
        maps.to_adapter[adapter] = build_map(run, BASE, adapter, config, replace(
            record, source=spec(BASE), target=spec(adapter)), vocab, progress and not config.same_layer)
        if reverse:
            maps.to_base[adapter] = build_map(run, adapter, BASE, config, replace(
                record, source=spec(adapter), target=spec(BASE)), vocab, progress and not config.same_layer)
    seconds = round(earlier + time.perf_counter() - started, 2)  # with a resumed checkpoint's collection
    fitted = [kv_map for _, _, kv_map in maps.all()]
    for kv_map in fitted:  # one capture pass fitted them all: its time is theirs together
        kv_map.config.calibration.seconds = seconds
        kv_map.config.calibration.maps_in_pass = len(fitted)
    logger.info("calibrated %d adapter maps in %.1fs", len(fitted), seconds)
    return maps


def calibrate_missing(model, tokenizer, adapters: Sequence[str], maps: AdapterMaps, files: int,
                      tokens: int = 512) -> AdapterMaps:
    """Fit the maps of ``adapters`` on the first ``tokens`` tokens of ``files`` calibration-split stdlib files and
    add each direction ``maps`` lacks (a direction it holds keeps its map)."""
    from ..lab.corpus import stdlib_texts

    fitted = calibrate_adapters(model, stdlib_texts("calibration", files), tokenizer, adapters=list(adapters),
                                progress=False, max_length=tokens, chunks_per_text=1,
                                description=f"first {tokens} tokens of {files} calibration-split stdlib files")
    for fitted_maps, kept in ((fitted.to_adapter, maps.to_adapter), (fitted.to_base, maps.to_base)):
        for adapter, kv_map in fitted_maps.items():
            kept.setdefault(adapter, kv_map)  # a direction that loaded keeps its published map
    return maps


__all__ = ["BASE", "build_map", "calibrate", "calibrate_adapters", "calibrate_missing", "collect", "join_process_group",
           "resolve_config"]
