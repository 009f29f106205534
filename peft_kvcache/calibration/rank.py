"""How many directions a same-shape map's correction keeps, chosen by what the target does with it.

A same-shape map (base -> LoRA adapter) fitted with ``residual_rank`` r runs as the identity plus two thin factors of
rank r per layer (`peft_kvcache.maps.kvmap.KVMap.residual_rank`): ``2 r`` multiply-adds per feature instead of the
layer width, so a switch's mapping multiplies less (the rotary, the casts and the memory it reads stay). What a smaller
rank costs is the target's: its
next-token KL against its own prefill. `choose_rank` scores maps fitted at several ranks from the same statistics on
held-out text (never the evaluation texts) and keeps the smallest rank whose KL the held-out texts cannot tell from
the full correction's: the paired 95% bootstrap interval of (rank - full), over sequences, reaches zero or below.
Every candidate's figures go into ``config.rank_choice`` (`RankRecord`), which the model card shows.

    candidates = {r: calibrate_adapters(model, data, residual_rank=r, checkpoint_dir=work) for r in (0, 16, 32, 48)}
    maps = choose_adapter_ranks(candidates, model, heldout_ids)     # then choose_adapter_blends, as before
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from ..errors import CalibrationError
from ..maps.adapter_maps import AdapterMaps
from ..maps.config import RankRecord
from ..maps.kvmap import KVMap
from ..modeling.adapters import adapter_active
from ..modeling.capture import CapturedKV
from .blend import adapter_source_caches, example_scores, held_out_examples
from .bootstrap import bootstrap_interval

DEFAULT_RANK_GRID = (16, 32, 48)


def _require_full_correction(candidates: Mapping[int, object]) -> None:
    if 0 not in candidates:
        raise CalibrationError("choosing a rank compares each candidate with the full correction: pass the map(s) "
                               "fitted with residual_rank=0 as candidates[0]")


def choose_rank(candidates: Mapping[int, KVMap], target_model: torch.nn.Module, sequences: Sequence[torch.Tensor],
                source_cache: Callable[[torch.Tensor], CapturedKV], *, continuation: int = 64,
                progress: bool = True) -> KVMap:
    """The candidate of smallest residual rank whose held-out KL is not above the full correction's (see the module
    docstring), with every candidate's figures recorded in its ``config.rank_choice``.

    Args:
        candidates: residual rank (0: the full correction, required) -> the map fitted at it, all from the same
            statistics (`peft_kvcache.calibration.loop.calibrate` with ``residual_rank`` and one ``checkpoint_dir``).
        target_model: the target, in the state the maps map into (for an adapter map, its adapter active).
        sequences: held-out token ids (1-D), not used to fit the maps; the last ``continuation`` tokens of each
            are scored.
        source_cache: ``ids [1, n] -> CapturedKV`` of the source model (see `peft_kvcache.calibration.blend`).

    Cost: one target prefill and one source pass per sequence, then one mapped pass per sequence and candidate.
    """
    _require_full_correction(candidates)
    for rank, kv_map in candidates.items():
        if rank and kv_map.residual_rank != rank:
            raise CalibrationError(f"candidates[{rank}] runs with residual rank {kv_map.residual_rank}: pass maps "
                                   f"fitted with residual_rank={rank} (a same-shape pair, each layer from its own)")
    full = candidates[0]
    examples = held_out_examples(target_model, sequences, source_cache, continuation, full.config.sink_tokens,
                                 progress, "rank")
    kl = {rank: torch.tensor(example_scores(kv_map, target_model, examples, continuation)["kl"])
          for rank, kv_map in tqdm(sorted(candidates.items()), desc="rank: candidates", disable=not progress)}
    intervals = {rank: bootstrap_interval(kl[rank] - kl[0]) for rank in kl if rank}
    kept = min((rank for rank, (low, _) in intervals.items() if low <= 0), default=0)
    chosen = KVMap(copy.deepcopy(candidates[kept].config), dict(candidates[kept].tensors))  # the candidates stay as given
    chosen.config.rank_choice = RankRecord(
        rank=kept, examples=len(examples), continuation=continuation,
        kl={str(rank): round(float(values.mean()), 6) for rank, values in kl.items()},
        minus_full={str(rank): [round(float((kl[rank] - kl[0]).mean()), 6), round(low, 6), round(high, 6)]
                    for rank, (low, high) in intervals.items()})
    return chosen


def choose_adapter_ranks(candidates: Mapping[int, AdapterMaps], model: torch.nn.Module,
                         sequences: Sequence[torch.Tensor], *, continuation: int = 64,
                         progress: bool = True) -> AdapterMaps:
    """Every map direction of ``candidates[0]`` at the rank `choose_rank` keeps on held-out ``sequences``, among the
    same direction's maps in ``candidates`` (residual rank -> `AdapterMaps` fitted at it from the same statistics).

    Example:
        >>> candidates = {r: calibrate_adapters(model, data, residual_rank=r, checkpoint_dir=work) for r in (0, 32)}  # doctest: +SKIP
        >>> maps = choose_adapter_ranks(candidates, model, heldout_ids)  # doctest: +SKIP
    """
    _require_full_correction(candidates)  # before any source cache is computed
    sequences = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    chosen = AdapterMaps()
    for adapter, reverse, full in candidates[0].all():
        store = chosen.to_base if reverse else chosen.to_adapter
        direction = {rank: (maps.to_base if reverse else maps.to_adapter).get(adapter) for rank, maps in
                     candidates.items()}
        missing = sorted(rank for rank, kv_map in direction.items() if kv_map is None)
        if missing:
            raise CalibrationError(f"the candidates of ranks {missing} have no map for adapter {adapter!r} "
                                   f"({'to the base' if reverse else 'from the base'})")
        source_cache = adapter_source_caches(model, adapter, reverse, full, sequences, continuation)
        with adapter_active(model, None if reverse else adapter):
            store[adapter] = choose_rank(direction, model, sequences, source_cache, continuation=continuation,
                                         progress=progress)
    return chosen


__all__ = ["DEFAULT_RANK_GRID", "choose_adapter_ranks", "choose_rank"]
