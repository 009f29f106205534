"""Base <-> adapter maps for every adapter of a PEFT model, fitted in one calibration pass.

The base model's KV is computed once per calibration batch (``with model.disable_adapter():``) and every
adapter's KV through PEFT's own switching (``model.set_adapter(name)``); the same statistics feed every
base -> adapter map (the expensive source Gram is shared) and, per adapter, the reverse adapter -> base
map. Same-shape pairs get ridge shrunk toward the identity automatically (`calibrate.build_map`).

Example:
    >>> maps = calibrate_adapters(peft_model, calibration_texts(32), tokenizer)          # doctest: +SKIP
    >>> maps.to_adapter["shout"].config.target_name                                      # doctest: +SKIP
    'HuggingFaceTB/SmolLM2-135M-Instruct-GGUF-Q4_1+shout'
    >>> maps.save_pretrained("hub_cards", prefix="smollm2-135m-instruct")                # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .calibrate import ModelSide, build_map, calibration_sequences, heldout_flags
from .capture import CapturedKV, accumulate, batches, run_with_cache
from .errors import CalibrationError
from .fit import DEFAULT_LAMBDA_GRID, SufficientStatistics
from .kvmap import KVMap, KVMapConfig
from .models import KVLayout, fingerprint, model_name, vocab_size_of
from .positions import rotary_spec_of

logger = logging.getLogger(__name__)

BASE = "base"  # the name the reverse maps give their target in the statistics


@contextmanager
def adapter_active(model: torch.nn.Module, adapter: str | None) -> Iterator[None]:
    """Run the block with ``adapter`` active on a `PeftModel`, or with every adapter disabled (``None``:
    the base model). The previously active adapter is restored afterwards.

    PEFT's active adapter is state of the whole model: callers sharing a model between threads must hold
    a lock around the block (`sessions.SharedPeftModel` does).

    Example:
        >>> with adapter_active(peft_model, "shout"):          # doctest: +SKIP
        ...     logits = peft_model(input_ids).logits
    """
    if adapter is None:
        with model.disable_adapter():
            yield
        return
    if adapter not in model.peft_config:
        raise CalibrationError(f"the model has no adapter {adapter!r}; it has {sorted(model.peft_config)}")
    previous = model.active_adapter
    model.set_adapter(adapter)
    try:
        yield
    finally:
        if previous != adapter:
            model.set_adapter(previous)


def is_activated_lora(model: torch.nn.Module, adapter: str) -> bool:
    """Whether ``adapter`` is an Activated LoRA (it reuses the base cache exactly before its invocation)."""
    return bool(getattr(model.peft_config[adapter], "alora_invocation_tokens", None))


def adapter_side(model: torch.nn.Module, adapter: str | None) -> ModelSide:
    """What a map records about the base (``None``) or one adapter: name ``base+adapter``, the fingerprint
    with that adapter active, layout and rotary."""
    base_name = model_name(model)
    with adapter_active(model, adapter):
        return ModelSide(base_name if adapter is None else f"{base_name}+{adapter}", fingerprint(model),
                         KVLayout.of(model), rotary_spec_of(model))


@dataclass
class AdapterMaps:
    """The maps of one `PeftModel`: ``to_adapter[name]`` (base -> adapter) and ``to_base[name]``
    (adapter -> base)."""

    to_adapter: dict[str, KVMap] = field(default_factory=dict)
    to_base: dict[str, KVMap] = field(default_factory=dict)

    def save_pretrained(self, root: str | Path, prefix: str, repo_namespace: str | None = None) -> list[Path]:
        """Save every map to ``root/<prefix>-base-to-<adapter>`` and ``root/<prefix>-<adapter>-to-base``
        (config.json, model.safetensors and a model card each). Returns the folders."""
        folders = []
        for adapter, kv_map in self.to_adapter.items():
            folders.append(_save(kv_map, Path(root) / folder_name(prefix, adapter, reverse=False), repo_namespace))
        for adapter, kv_map in self.to_base.items():
            folders.append(_save(kv_map, Path(root) / folder_name(prefix, adapter, reverse=True), repo_namespace))
        return folders

    @classmethod
    def from_pretrained(cls, root: str | Path, prefix: str, adapters: Sequence[str],
                        reverse: bool = True, missing_ok: bool = False) -> "AdapterMaps":
        """Load the maps saved by `save_pretrained` for ``adapters`` (``missing_ok``: skip absent folders).

        Example:
            >>> maps = AdapterMaps.from_pretrained("hub_cards", "smollm2-135m-instruct", ["shout"])  # doctest: +SKIP
        """
        maps = cls()
        for adapter in adapters:
            for is_reverse, store in ((False, maps.to_adapter), (True, maps.to_base)):
                if is_reverse and not reverse:
                    continue
                folder = Path(root) / folder_name(prefix, adapter, reverse=is_reverse)
                if missing_ok and not (folder / "config.json").is_file():
                    continue
                store[adapter] = KVMap.from_pretrained(folder)
        return maps


def folder_name(prefix: str, adapter: str, reverse: bool) -> str:
    """``<prefix>-base-to-<adapter>`` or, reversed, ``<prefix>-<adapter>-to-base`` (underscores become dashes)."""
    slug = adapter.replace("_", "-")
    return f"{prefix}-{slug}-to-base" if reverse else f"{prefix}-base-to-{slug}"


def _save(kv_map: KVMap, folder: Path, repo_namespace: str | None) -> Path:
    repo_id = f"{repo_namespace}/{folder.name}" if repo_namespace else None
    return kv_map.save_pretrained(folder, repo_id=repo_id)


def calibrate_adapters(
    model: torch.nn.Module,
    calibration_data: Iterable,
    tokenizer=None,
    adapters: Sequence[str] | None = None,
    *,
    reverse: bool = True,
    same_layer: bool = True,
    top_k: int = 1,
    lambda_grid: tuple[float, ...] = DEFAULT_LAMBDA_GRID,
    heldout_fraction: float = 0.2,
    sink_tokens: int = 1,
    max_length: int = 512,
    batch_size: int = 1,
    description: str = "",
    progress: bool = True,
) -> AdapterMaps:
    """Fit base -> adapter maps (and, with ``reverse``, adapter -> base maps) for the adapters of a
    `PeftModel` in one pass over the calibration data.

    Args:
        model: a `PeftModel` holding the adapters (``model.load_adapter(path, adapter_name=...)``).
        calibration_data: token id tensors, or texts with ``tokenizer`` (see `calibrate.calibrate`).
        adapters: adapter names (default: every adapter except Activated LoRAs, whose prefix KV *is* the
            base's, so no map is needed).
        reverse: also fit the adapter -> base maps (their statistics cost as much again).
        same_layer: map each target layer from the same source layer only (block-diagonal statistics:
            ``num_layers`` times less memory and Gram compute; for SmolLM2-135M 0.3 MB instead of ~7 GB of
            float64 statistics for two adapters both ways). The identity prior makes the same layer the
            natural choice for an adapter; ``False`` scores every source layer (`calibrate.build_map` layer
            selection, ``top_k``) from full cross-layer statistics.
        top_k, lambda_grid, heldout_fraction, sink_tokens, max_length, batch_size: as in `calibrate.calibrate`.

    Returns:
        `AdapterMaps`; each map's ``target_name`` (or ``source_name``) reads ``base+adapter`` and its
        ``calibration`` records ``target_adapter`` (or ``source_adapter``).

    Example:
        >>> maps = calibrate_adapters(peft_model, [torch.randint(0, 100, (64,)) for _ in range(8)])  # doctest: +SKIP
    """
    if not hasattr(model, "peft_config") or not hasattr(model, "disable_adapter"):
        raise CalibrationError(f"calibrate_adapters needs a PeftModel, got {type(model).__name__}")
    if adapters is None:
        adapters = [a for a in model.peft_config if not is_activated_lora(model, a)]
    adapters = list(adapters)
    if not adapters:
        raise CalibrationError("no adapter to calibrate: load one with model.load_adapter(path, adapter_name=...)")
    started = time.perf_counter()
    base = adapter_side(model, None)
    sides = {a: adapter_side(model, a) for a in adapters}
    spec, width = base.rotary, base.layout.num_layers * base.layout.layer_width
    sequences = calibration_sequences(calibration_data, tokenizer, max_length, sink_tokens + 2, vocab_size_of(model))
    flags = heldout_flags(len(sequences), heldout_fraction)

    # Statistics per block: the whole model side by side (layer selection), or one block per layer.
    blocks = list(range(base.layout.num_layers)) if same_layer else [None]
    block_width = base.layout.layer_width if same_layer else width

    def empty(targets: Sequence[str]) -> dict[str, SufficientStatistics]:
        return {kind: SufficientStatistics.empty(block_width, {t: block_width for t in targets})
                for kind in ("keys", "values")}

    forward = {b: {split: empty(adapters) for split in ("train", "heldout")} for b in blocks}
    backward = {(a, b): {split: empty([BASE]) for split in ("train", "heldout")}
                for a in (adapters if reverse else []) for b in blocks}
    for split in ("train", "heldout"):
        chosen = [s for s, heldout in zip(sequences, flags) if heldout == (split == "heldout")]
        with tqdm(total=sum(len(s) for s in chosen), desc=f"adapter calibration ({split})", unit="tok",
                  disable=not progress) as bar:
            for ids, mask in batches(chosen, batch_size):
                runs = _run_all(model, adapters, ids, mask)
                for b in blocks:
                    part = {name: _block(run, b) for name, run in runs.items()}
                    accumulate(forward[b][split], part[None], spec, {a: (part[a], spec) for a in adapters}, mask,
                               sink_tokens)
                    for a in adapters if reverse else []:
                        accumulate(backward[(a, b)][split], part[a], spec, {BASE: (part[None], spec)}, mask,
                                   sink_tokens)
                bar.update(int(mask.sum()))

    info = {"description": description, "sequences": len(sequences), "max_length": max_length,
            "calibration_pass": f"one pass for adapters {adapters} (base KV computed once)",
            "layer_selection": "same layer (block-diagonal statistics)" if same_layer else f"best {top_k} of all"}
    maps, vocab = AdapterMaps(), vocab_size_of(model)

    def fit(stats_of, key, source, target, extra):
        args = (vocab, top_k if not same_layer else 1, lambda_grid, sink_tokens, dict(info, **extra),
                progress and not same_layer)
        if not same_layer:
            return build_map(stats_of(None), key, source, target, *args)
        one = lambda side: ModelSide(side.name, side.fingerprint,  # noqa: E731
                                     KVLayout(1, side.layout.kv_heads, side.layout.head_dim), side.rotary)
        return _stack_layers([build_map(stats_of(b), key, one(source), one(target), *args) for b in blocks],
                             source, target)

    for a in adapters:
        maps.to_adapter[a] = fit(lambda b: forward[b], a, base, sides[a], {"target_adapter": a})
        if reverse:
            maps.to_base[a] = fit(lambda b, a=a: backward[(a, b)], BASE, sides[a], base, {"source_adapter": a})
    seconds = round(time.perf_counter() - started, 2)
    for kv_map in [*maps.to_adapter.values(), *maps.to_base.values()]:
        kv_map.config.calibration["seconds"] = seconds
    logger.info("calibrated %d adapter maps in %.1fs", len(maps.to_adapter) + len(maps.to_base), seconds)
    return maps


def choose_adapter_blends(maps: AdapterMaps, model: torch.nn.Module, sequences: Sequence[torch.Tensor], *,
                          continuation: int = 64, criterion: str = "kl", progress: bool = True) -> AdapterMaps:
    """Every map of ``maps`` blended toward its source cache (`blend.choose_blend`) on held-out ``sequences``
    (not the calibration data): the source side's caches are computed first under its own adapter state, then
    the target side scores the grid under its own.

    Example:
        >>> maps = choose_adapter_blends(calibrate_adapters(model, data), model, heldout_ids)  # doctest: +SKIP
    """
    from .blend import choose_blend

    sequences = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    chosen = AdapterMaps()
    for adapter in sorted({*maps.to_adapter, *maps.to_base}):
        for source, target, store, result in ((None, adapter, maps.to_adapter, chosen.to_adapter),
                                              (adapter, None, maps.to_base, chosen.to_base)):
            if adapter not in store:
                continue
            with adapter_active(model, source), torch.no_grad():
                caches = {}
                for ids in sequences:
                    prefix = ids[None, : ids.numel() - continuation - 1]
                    caches[prefix.numpy().tobytes()] = run_with_cache(model, prefix)
            with adapter_active(model, target):
                result[adapter] = choose_blend(store[adapter], model, sequences,
                                               lambda prefix: caches[prefix.numpy().tobytes()],
                                               continuation=continuation, criterion=criterion, progress=progress)
    return chosen


def _block(captured: CapturedKV, layer: int | None) -> CapturedKV:
    return captured if layer is None else CapturedKV([captured.keys[layer]], [captured.values[layer]])


def _stack_layers(per_layer: list[KVMap], source: ModelSide, target: ModelSide) -> KVMap:
    """One map from single-layer maps (layer t of ``per_layer`` maps source layer t to target layer t)."""
    first = per_layer[0].config
    tensors = {"source.inv_freq": source.rotary.inv_freq, "target.inv_freq": target.rotary.inv_freq}
    for t, layer_map in enumerate(per_layer):
        for kind in ("keys", "values"):
            for part in ("weight", "bias"):
                tensors[f"{kind}.{t}.{part}"] = layer_map.tensors[f"{kind}.0.{part}"]
    rows = lambda field_name: [getattr(m.config, field_name)[0] for m in per_layer]  # noqa: E731
    calibration = dict(first.calibration)
    config = KVMapConfig(
        source_name=source.name, target_name=target.name, source_fingerprint=source.fingerprint,
        target_fingerprint=target.fingerprint, source_layout=source.layout, target_layout=target.layout,
        source_rotary=source.rotary.describe(), target_rotary=target.rotary.describe(),
        vocab_size=first.vocab_size, pair_kind=first.pair_kind,
        key_layers=[[t] for t in range(len(per_layer))], value_layers=[[t] for t in range(len(per_layer))],
        key_r2=rows("key_r2"), value_r2=rows("value_r2"), key_lambdas=rows("key_lambdas"),
        value_lambdas=rows("value_lambdas"), sink_tokens=first.sink_tokens, calibration=calibration,
    )
    return KVMap(config, tensors)


@torch.no_grad()
def _run_all(model, adapters: Sequence[str], ids: torch.Tensor, mask: torch.Tensor) -> dict[str | None, CapturedKV]:
    """The base's KV (key ``None``) and every adapter's over one batch."""
    runs: dict[str | None, CapturedKV] = {}
    for adapter in [None, *adapters]:
        with adapter_active(model, adapter):
            runs[adapter] = run_with_cache(model, ids, mask)
    return runs


__all__ = ["AdapterMaps", "adapter_active", "adapter_side", "calibrate_adapters", "choose_adapter_blends", "folder_name",
           "is_activated_lora"]
