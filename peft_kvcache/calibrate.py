"""Calibration: capture -> statistics -> fit -> `KVMap`. `KVMap.calibrate` delegates here."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .capture import CapturedKV, TargetRun, accumulate, batches, run_with_cache
from .checkpoint import CalibrationCheckpoint, Progress, run_digest
from .errors import CalibrationError
from .fit import DEFAULT_LAMBDA_GRID, SufficientStatistics, all_reduce_statistics, fit_layers
from .kvmap import KVMap, KVMapConfig
from .models import KVLayout, check_pair, fingerprint, model_name, vocab_size_of
from .positions import RotarySpec, rotary_spec_of

logger = logging.getLogger(__name__)

SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class ModelSide:
    """What a map records about one of its two models."""

    name: str
    fingerprint: str
    layout: KVLayout
    rotary: RotarySpec

    @classmethod
    def of(cls, model: torch.nn.Module, name: str | None = None) -> "ModelSide":
        return cls(name or model_name(model), fingerprint(model), KVLayout.of(model), rotary_spec_of(model))


def calibration_sequences(data: Iterable, tokenizer=None, max_length: int = 512, min_length: int = 3,
                          vocab_size: int | None = None) -> list[torch.Tensor]:
    """1-D token id tensors from token ids or texts (texts need ``tokenizer``), split into chunks of at
    most ``max_length`` tokens; chunks shorter than ``min_length`` are dropped."""
    sequences = []
    for item in data:
        if isinstance(item, str):
            if tokenizer is None:
                raise CalibrationError("calibration texts need a tokenizer: pass tokenizer=...")
            ids = torch.tensor(tokenizer(item, add_special_tokens=False)["input_ids"], dtype=torch.long)
        else:
            ids = torch.as_tensor(item, dtype=torch.long)
            if ids.dim() != 1:
                raise CalibrationError(f"calibration token ids must be 1-D tensors, got shape {tuple(ids.shape)}")
        if vocab_size is not None and ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            raise CalibrationError(f"calibration token id {int(ids.max())} is outside the vocabulary ({vocab_size})")
        sequences.extend(c for c in ids.split(max_length) if c.numel() >= min_length)
    if not sequences:
        raise CalibrationError(
            f"the calibration set is empty: no sequence of at least {min_length} tokens was given"
        )
    return sequences


def heldout_flags(count: int, heldout_fraction: float) -> list[bool]:
    """Which sequences form the held-out split: every ``round(1 / fraction)``-th, at least one."""
    if not 0 < heldout_fraction < 1:
        raise CalibrationError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if count < 2:
        raise CalibrationError(f"calibration needs at least 2 sequences (train and held-out), got {count}")
    period = max(2, round(1 / heldout_fraction))
    flags = [i % period == period - 1 for i in range(count)]
    if not any(flags):
        flags[-1] = True
    return flags


def collect_statistics(
    source_run: TargetRun,
    target_runs: dict[str, TargetRun],
    source_spec: RotarySpec,
    target_specs: dict[str, RotarySpec],
    source_width: int,
    target_widths: dict[str, int],
    sequences: list[torch.Tensor],
    heldout_fraction: float = 0.2,
    sink_tokens: int = 1,
    batch_size: int = 1,
    progress: bool = True,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 50,
    checkpoint_key: str = "",
    rank: int | None = None,
    world_size: int | None = None,
) -> dict[str, dict[str, SufficientStatistics]]:
    """Run the source once and every target over the sequences; return
    ``{"train"|"heldout": {"keys"|"values": statistics}}``, one statistics entry per target name.

    Args:
        checkpoint_dir: write the statistics there every ``checkpoint_every`` batches (atomically, see
            `peft_kvcache.checkpoint`) and resume from what is there: an interrupted run started again with
            the same arguments continues where it stopped and returns the same statistics. A checkpoint of
            other sequences or options is refused with a `CalibrationError`.
        checkpoint_key: extra text the checkpoint must match (e.g. the models' fingerprints).
        rank, world_size: this process's shard: it runs sequences ``rank::world_size`` of each split. Both
            default to torch.distributed's when it is initialized, in which case the shards' statistics are
            summed with `all_reduce_statistics` before returning, so every process gets the statistics
            of all the sequences.

    Example:
        >>> stats = collect_statistics(src_run, {"target": tgt_run}, src_spec, {"target": tgt_spec}, 256,
        ...                            {"target": 384}, sequences, checkpoint_dir="ckpt")  # doctest: +SKIP
    """
    distributed = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if distributed else 0
    if world_size is None:
        world_size = dist.get_world_size() if distributed else 1
    if not 0 <= rank < world_size:
        raise CalibrationError(f"rank must be in 0..{world_size - 1}, got {rank}")
    if checkpoint_every < 1:
        raise CalibrationError(f"checkpoint_every must be at least 1 batch, got {checkpoint_every}")
    flags = heldout_flags(len(sequences), heldout_fraction)  # over all sequences: same split on every rank
    stats = {split: {kind: SufficientStatistics.empty(source_width, target_widths) for kind in ("keys", "values")}
             for split in SPLITS}
    checkpoint, done = None, Progress()
    if checkpoint_dir is not None:
        digest = run_digest(sequences, {
            "heldout_fraction": heldout_fraction, "sink_tokens": sink_tokens, "batch_size": batch_size,
            "source_width": source_width, "target_widths": target_widths, "rank": rank,
            "world_size": world_size, "key": checkpoint_key})
        checkpoint = CalibrationCheckpoint(checkpoint_dir, digest, rank)
        done = checkpoint.load(stats) or done
    for index, split in enumerate(SPLITS):
        chosen = [s for s, heldout in zip(sequences, flags) if heldout == (split == "heldout")][rank::world_size]
        skip = done.batches if index == done.split else (0 if index > done.split else None)
        if done.complete or skip is None:
            continue
        total = sum(len(s) for s in chosen)
        with tqdm(total=total, desc=f"calibration ({split})", unit="tok", disable=not progress) as bar:
            bar.update(sum(len(s) for s in chosen[: skip * batch_size]))
            for count, (ids, mask) in enumerate(batches(chosen, batch_size), start=1):
                if count <= skip:
                    continue
                source = source_run(ids, mask)
                targets = {name: (run(ids, mask), target_specs[name]) for name, run in target_runs.items()}
                accumulate(stats[split], source, source_spec, targets, mask, sink_tokens)
                bar.update(int(mask.sum()))
                if checkpoint is not None and count % checkpoint_every == 0:
                    checkpoint.save(stats, Progress(index, count))
        if checkpoint is not None:
            checkpoint.save(stats, Progress(index + 1, 0, complete=index + 1 == len(SPLITS)))
    if distributed and world_size > 1:
        all_reduce_statistics(stats)
    return stats


def build_map(
    stats: dict[str, dict[str, SufficientStatistics]],
    target_key: str,
    source: ModelSide,
    target: ModelSide,
    vocab_size: int,
    top_k: int = 1,
    lambda_grid: tuple[float, ...] = DEFAULT_LAMBDA_GRID,
    sink_tokens: int = 1,
    calibration_info: dict | None = None,
    progress: bool = True,
) -> KVMap:
    """Fit keys and values of every target layer from collected statistics and assemble the `KVMap`."""
    same_shape = source.layout == target.layout and torch.equal(source.rotary.inv_freq, target.rotary.inv_freq)
    fits, tensors = {}, {"source.inv_freq": source.rotary.inv_freq, "target.inv_freq": target.rotary.inv_freq}
    with tqdm(total=2 * source.layout.num_layers, desc="fitting", unit="layer", disable=not progress) as bar:
        for kind in ("keys", "values"):
            fits[kind] = fit_layers(stats["train"][kind], stats["heldout"][kind], target_key, source.layout,
                                    target.layout, top_k=top_k, lambda_grid=lambda_grid,
                                    identity_prior=same_shape, progress=bar.update)
            for t, layer in enumerate(fits[kind]):
                tensors[f"{kind}.{t}.weight"] = layer.fit.weight.float()
                tensors[f"{kind}.{t}.bias"] = layer.fit.bias.float()
    info = dict(calibration_info or {})
    info.update(top_k=top_k, lambda_grid=list(lambda_grid),
                train_tokens=int(stats["train"]["keys"].count), heldout_tokens=int(stats["heldout"]["keys"].count))
    config = KVMapConfig(
        source_name=source.name, target_name=target.name,
        source_fingerprint=source.fingerprint, target_fingerprint=target.fingerprint,
        source_layout=source.layout, target_layout=target.layout,
        source_rotary=source.rotary.describe(), target_rotary=target.rotary.describe(),
        vocab_size=vocab_size, pair_kind="same_shape" if same_shape else "cross_shape",
        key_layers=[f.source_layers for f in fits["keys"]], value_layers=[f.source_layers for f in fits["values"]],
        key_r2=[f.fit.r2.tolist() for f in fits["keys"]], value_r2=[f.fit.r2.tolist() for f in fits["values"]],
        key_lambdas=[f.fit.lambdas.tolist() for f in fits["keys"]],
        value_lambdas=[f.fit.lambdas.tolist() for f in fits["values"]],
        key_candidate_r2=[f.candidate_r2 for f in fits["keys"]],
        value_candidate_r2=[f.candidate_r2 for f in fits["values"]],
        sink_tokens=sink_tokens, calibration=info,
    )
    return KVMap(config, tensors)


def calibrate(
    source_model: torch.nn.Module,
    target_model: torch.nn.Module,
    calibration_data: Iterable,
    tokenizer=None,
    *,
    top_k: int = 1,
    lambda_grid: tuple[float, ...] = DEFAULT_LAMBDA_GRID,
    heldout_fraction: float = 0.2,
    sink_tokens: int = 1,
    max_length: int = 512,
    batch_size: int = 1,
    description: str = "",
    progress: bool = True,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 50,
) -> KVMap:
    """Fit a KV map from ``source_model`` to ``target_model``.

    Args:
        calibration_data: iterable of 1-D LongTensors of token ids, or of texts (with ``tokenizer``).
        top_k: source layers concatenated per target layer (chosen by held-out R^2).
        lambda_grid: ridge strengths, relative to the mean eigenvalue of the source Gram, tried per head.
        heldout_fraction: share of sequences kept for choosing lambdas and layers.
        sink_tokens: leading tokens excluded from the fit; the target computes them itself at inference.
        max_length: longer sequences are split into chunks of this many tokens.
        progress: show tqdm bars.
        checkpoint_dir: checkpoint the statistics there every ``checkpoint_every`` batches; a calibration
            interrupted (crash, Ctrl-C) and started again with the same arguments resumes where it stopped
            and gives the same map. Under ``torchrun`` each process calibrates its shard of the sequences and
            the statistics are summed before fitting (see `collect_statistics`).

    Example:
        >>> kv_map = calibrate(small_model, large_model, [torch.randint(0, 100, (256,)) for _ in range(10)])  # doctest: +SKIP
    """
    check_pair(source_model, target_model, tokenizer)
    started = time.perf_counter()
    source, target = ModelSide.of(source_model), ModelSide.of(target_model)
    sequences = calibration_sequences(calibration_data, tokenizer, max_length, sink_tokens + 2,
                                      vocab_size_of(source_model))
    stats = collect_statistics(
        lambda ids, mask: run_with_cache(source_model, ids, mask),
        {"target": lambda ids, mask: run_with_cache(target_model, ids, mask)},
        source.rotary, {"target": target.rotary}, source.layout.num_layers * source.layout.layer_width,
        {"target": target.layout.num_layers * target.layout.layer_width}, sequences,
        heldout_fraction, sink_tokens, batch_size, progress,
        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
        checkpoint_key=f"{source.fingerprint}->{target.fingerprint}",
    )
    kv_map = build_map(stats, "target", source, target, vocab_size_of(source_model), top_k, lambda_grid,
                       sink_tokens, {"description": description, "sequences": len(sequences),
                                     "max_length": max_length}, progress)
    kv_map.config.calibration["seconds"] = round(time.perf_counter() - started, 2)
    logger.info("calibrated %r in %.1fs", kv_map, time.perf_counter() - started)
    return kv_map


__all__ = ["calibrate", "calibration_sequences", "collect_statistics", "build_map", "ModelSide", "CapturedKV"]
