"""The one place maps are matched to models: a map fits a source and a target when it was fitted for the fingerprints
of their weights and their KV layout and rotary parameters are the ones it stores (`same_rotary`, one tolerance);
its folder's name plays no part. `AdapterMaps.from_pretrained`, ``peft-kvcache serve`` and the vLLM connector all
find their maps here.

A model is described by an `Identity`, taken from a model in memory (`Identity.of_model`) or from the files a serving
engine loads (`Identity.of_files`), so the same map is found for the same weights whoever holds them.

Example:
    >>> registry = MapRegistry(["hub_cards"])                                            # doctest: +SKIP
    >>> match = registry.find(Identity.of_model(base), Identity.of_model(adapter_model))  # doctest: +SKIP
    >>> kv_map = registry.load(match.folders[0])                                         # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..errors import ArtifactError, PeftKVCacheError, UnsupportedPositionalSchemeError
from ..modeling.identity import cached_fingerprint, fingerprint_files
from ..modeling.layout import KVLayout
from ..modeling.positions import RotarySpec, rotary_spec_of, rotary_spec_of_config, same_rotary
from .config import KVMapConfig
from .kvmap import KVMap, rotary_of_record
from .storage import WEIGHTS_NAME, is_map_folder, load_config, resolve_map_folder

logger = logging.getLogger(__name__)

# Why no map serves a pair (the fallback reasons a serving wing reports).
NO_MAP = "no_map"  # no map was fitted for these weights
MAP_MISMATCH = "map_mismatch"  # one was, for another KV layout or other rotary parameters
UNUSABLE_MAP = "unusable_map"  # one was, but its files cannot be read
UNSUPPORTED_MODEL = "unsupported_model"  # the model's positions cannot be removed from its keys


@dataclass(frozen=True)
class Identity:
    """What a map must fit on one side of a switch: the fingerprint of the weights (`modeling.identity`), the KV
    layout and the rotary parameters (None, with ``problem``, where the positional scheme is not supported)."""

    fingerprint: str
    layout: KVLayout
    rotary: RotarySpec | None
    problem: str | None = None

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> "Identity":
        """The identity of a model in memory as it runs now (its active adapters included)."""
        rotary, problem = _rotary(lambda: rotary_spec_of(model))
        return cls(cached_fingerprint(model), KVLayout.of(model), rotary, problem)

    @classmethod
    def of_files(cls, model_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None = None,
                 hf_config=None) -> "Identity":
        """The identity of what a serving engine loads from ``model_dir`` (and the LoRA adapter of ``adapter_dir``),
        read from the files; ``hf_config``: the model's transformers config when the caller holds it."""
        if hf_config is None:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(model_dir)
        rotary, problem = _rotary(lambda: rotary_spec_of_config(hf_config))
        return cls(fingerprint_files(model_dir, adapter_dir), KVLayout.of_config(hf_config), rotary, problem)


def _rotary(read) -> tuple[RotarySpec | None, str | None]:
    try:
        return read(), None
    except UnsupportedPositionalSchemeError as err:
        return None, str(err)


@dataclass(frozen=True)
class MapMatch:
    """The map folders that take one model's KV to another's, applied in order (one map, or a map to a shared model
    and that model's map onward), and how many leading tokens the target computes itself. ``prints``: each folder's
    (source, target) weight fingerprints as matched, for a reader that loads the folder later (`KVMap.fitted_for`
    tells whether it was saved again for other weights since)."""

    folders: tuple[str, ...]
    sink_tokens: int
    prints: tuple[tuple[str, str], ...] = field(default=(), compare=False)


class MapRegistry:
    """The maps under ``specs``: folders of map folders (e.g. ``hub_cards``), single map folders or Hub repo ids of
    one map. Only the configs are read until a map is `load`-ed.

    Raises `ArtifactError` for a spec that is neither a folder nor a Hub repo, or a single map whose config cannot be
    read (a folder of map folders passes over the damaged ones with a warning)."""

    def __init__(self, specs: str | os.PathLike | Sequence[str | os.PathLike]):
        specs = [specs] if isinstance(specs, (str, os.PathLike)) else list(specs)
        self.configs: dict[str, KVMapConfig] = {}  # folder -> its config
        self.origin: dict[str, str] = {}  # folder -> the spec it was found under
        self.singles: list[str] = []  # specs naming one map (a serving command insists that they fit)
        self._maps: dict[str, KVMap] = {}
        for spec in map(str, specs):
            path = Path(spec).expanduser()
            if path.is_dir() and not is_map_folder(path):
                for folder in sorted(path.iterdir()):
                    if is_map_folder(folder, complete=True):
                        self._add(folder, spec, strict=False)
                    elif is_map_folder(folder):
                        logger.warning("map folder %s has no %s (a card whose weights are kept out of git): "
                                       "skipped; put its weights there to use it", folder, WEIGHTS_NAME)
            else:
                self.singles.append(spec)
                self._add(resolve_map_folder(spec), spec, strict=True)

    def _add(self, folder: Path, spec: str, strict: bool) -> None:
        try:
            config = load_config(folder)
        except PeftKVCacheError as err:
            if strict:
                raise ArtifactError(f"map {spec!r} cannot be read: {err}") from None
            logger.warning("map folder %s is not usable and is skipped: %s", folder, err)
            return
        self.configs[str(folder)] = config
        self.origin[str(folder)] = spec

    def __len__(self) -> int:
        return len(self.configs)

    def find(self, source: Identity, target: Identity) -> MapMatch | str:
        """The map from ``source`` to ``target``, or why there is none (`NO_MAP`, `MAP_MISMATCH`, `UNUSABLE_MAP`,
        `UNSUPPORTED_MODEL`)."""
        if source.rotary is None or target.rotary is None:
            return UNSUPPORTED_MODEL
        fitted = [folder for folder, c in self.configs.items()
                  if (c.source_fingerprint, c.target_fingerprint) == (source.fingerprint, target.fingerprint)]
        if not fitted:
            return NO_MAP
        reason = MAP_MISMATCH
        for folder in fitted:
            config = self.configs[folder]
            if (config.source_layout, config.target_layout) != (source.layout, target.layout):
                continue
            try:
                stored = _stored_rotary(folder, config)
            except (ArtifactError, OSError, SafetensorError) as err:
                logger.warning("map folder %s is not usable: %s", folder, err)
                reason = UNUSABLE_MAP
                continue
            if same_rotary(stored[0], source.rotary) and same_rotary(stored[1], target.rotary):
                return MapMatch((folder,), config.sink_tokens,
                                ((config.source_fingerprint, config.target_fingerprint),))
        return reason

    def route(self, source: Identity, target: Identity, via: Identity | None = None) -> MapMatch | str:
        """`find`, else (with ``via``, e.g. the base model between two adapters) the map ``source -> via`` followed by
        ``via -> target``; the reason of the direct lookup when neither exists."""
        direct = self.find(source, target)
        if isinstance(direct, MapMatch) or via is None or via.fingerprint in (source.fingerprint, target.fingerprint):
            return direct
        first, second = self.find(source, via), self.find(via, target)
        if isinstance(first, MapMatch) and isinstance(second, MapMatch):
            return MapMatch(first.folders + second.folders, second.sink_tokens, first.prints + second.prints)
        return direct

    def load(self, folder: str) -> KVMap:
        """The map of a folder this registry matched (loaded once), refused (`ArtifactError`) where another map was
        saved there since: it would be applied to the pair the first one was matched for."""
        if folder not in self._maps:
            kv_map = KVMap.from_pretrained(folder)
            matched = self.configs.get(folder)
            if matched is not None and _pair_of(kv_map.config) != _pair_of(matched):
                raise ArtifactError(f"{folder} holds another map than the one this registry matched (saved again "
                                    "since): build the registry again to use it")
            self._maps[folder] = kv_map
        return self._maps[folder]

    def loaded(self) -> list[str]:
        """The folders loaded so far."""
        return list(self._maps)


def _pair_of(config: KVMapConfig) -> tuple:
    """What a registry matched a map on, and what a match hands out: the fingerprints of the weights at both ends, the
    two KV layouts and rotary records, the sink's length."""
    return (config.source_fingerprint, config.target_fingerprint, config.source_layout, config.target_layout,
            config.source_rotary, config.target_rotary, config.sink_tokens)


def _stored_rotary(folder: str, config: KVMapConfig) -> tuple[RotarySpec, RotarySpec]:
    """The source's and the target's rotary parameters a map stores (the two ``inv_freq`` tensors only are read)."""
    from safetensors import safe_open

    with safe_open(Path(folder) / WEIGHTS_NAME, framework="pt") as handle:
        source, target = (handle.get_tensor(f"{side}.inv_freq").float() for side in ("source", "target"))
    return rotary_of_record(config.source_rotary, source), rotary_of_record(config.target_rotary, target)


__all__ = ["Identity", "MAP_MISMATCH", "MapMatch", "MapRegistry", "NO_MAP", "UNSUPPORTED_MODEL", "UNUSABLE_MAP"]
