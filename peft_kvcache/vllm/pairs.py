"""Which published map goes from one of the engine's model variants to another: maps are chosen by what they fit
(the fingerprints of the weights both variants load, the KV layout and the rotary parameters of the engine's model),
never by a folder name. The engine's weights are read from its files (`fingerprint_files`), once per variant."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import PeftKVCacheError
from ..maps.config import KVMapConfig
from ..maps.kvmap import CONFIG_NAME, is_map_folder
from ..modeling.identity import fingerprint_files
from ..modeling.layout import KVLayout
from ..modeling.positions import RotarySpec, rotary_spec_of_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One model the engine serves: the base model (``adapter`` None) or a LoRA adapter loaded from ``path``."""

    adapter: str | None
    path: str | None = None

    @property
    def label(self) -> str:
        return self.adapter or "base"


@dataclass(frozen=True)
class MapChoice:
    """The map folders that take one variant's KV to another's, applied in order (one map, or an adapter's map to
    the base model followed by the base model's map to another adapter), and how many leading tokens the target
    computes itself."""

    folders: tuple[str, ...]
    sink_tokens: int


class MapRegistry:
    """The map folders under ``root`` (each with a valid ``config.json``), matched against the engine's model.

    Args:
        root: a folder of map folders (e.g. ``hub_cards``).
        model_dir: the folder the engine loaded the base model from (its ``*.safetensors`` and ``config.json``).
        hf_config: the base model's transformers config (layout and rotary parameters).
    """

    def __init__(self, root: str | Path, model_dir: str | Path, hf_config):
        self.model_dir = Path(model_dir)
        self.layout = KVLayout.of_config(hf_config)
        self.rotary: RotarySpec | None = None
        self.problem: str | None = None  # why nothing can be mapped on this engine, if so
        try:
            self.rotary = rotary_spec_of_config(hf_config)
        except PeftKVCacheError as err:
            self.problem = f"unsupported positions: {err}"
        self.configs: dict[str, KVMapConfig] = {}
        for folder in sorted(Path(root).expanduser().iterdir()):
            if not is_map_folder(folder, complete=True):
                continue
            try:
                self.configs[str(folder)] = KVMapConfig.from_dict(
                    json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8")), str(folder / CONFIG_NAME))
            except (PeftKVCacheError, ValueError) as err:
                logger.warning("map folder %s is not usable and is skipped: %s", folder, err)
        self._fingerprints: dict[Variant, str | None] = {}
        self._choices: dict[tuple[Variant, Variant], MapChoice | str] = {}

    def fingerprint(self, variant: Variant) -> str | None:
        """The fingerprint of what ``variant`` loads (memoized); None when its files cannot be read."""
        if variant not in self._fingerprints:
            try:
                self._fingerprints[variant] = fingerprint_files(self.model_dir, variant.path if variant.adapter else None)
            except (PeftKVCacheError, OSError, ValueError, KeyError, StopIteration) as err:
                logger.warning("cannot fingerprint %s (%s): its requests are not mapped (%s)", variant.label,
                               variant.path or self.model_dir, err)
                self._fingerprints[variant] = None
        return self._fingerprints[variant]

    def find(self, source: Variant, target: Variant) -> MapChoice | str:
        """The maps from ``source`` to ``target``: the published map between them, else, between two adapters, the
        source's map to the base model and the base model's map to the target (vLLM never computes the base model's
        KV of an adapter's turn, so a switch from one adapter to another has only the first adapter's cache to start
        from). Or why there is none (a fallback reason: ``no_map``, ``map_mismatch`` for a map of these weights fitted
        on another layout or rotary, ``unusable_map`` for a damaged one, ``unsupported_model``); decided once per pair."""
        if (source, target) not in self._choices:
            choice = self._one(source, target)
            base = Variant(None)
            if isinstance(choice, str) and source.adapter is not None and target.adapter is not None:
                first, second = self._one(source, base), self._one(base, target)
                if isinstance(first, MapChoice) and isinstance(second, MapChoice):
                    choice = MapChoice(first.folders + second.folders, second.sink_tokens)
            self._choices[source, target] = choice
        return self._choices[source, target]

    def _one(self, source: Variant, target: Variant) -> MapChoice | str:
        """The one published map from ``source`` to ``target``, or why there is none."""
        if self.problem is not None:
            return "unsupported_model"
        source_print, target_print = self.fingerprint(source), self.fingerprint(target)
        if source_print is None or target_print is None:
            return "unsupported_model"
        fitting = [(folder, c) for folder, c in self.configs.items()
                   if c.source_fingerprint == source_print and c.target_fingerprint == target_print]
        if not fitting:
            return "no_map"
        for folder, config in fitting:
            try:
                if config.source_layout == config.target_layout == self.layout and self._same_rotary(folder, config):
                    return MapChoice((folder,), config.sink_tokens)
            except Exception as err:  # a damaged weights file (safetensors' own error types vary)
                logger.warning("map folder %s is not usable: %s", folder, err)
                return "unusable_map"
        return "map_mismatch"

    def _same_rotary(self, folder: str, config: KVMapConfig) -> bool:
        """The map's stored rotary is the engine model's, on both sides (adapters share the base model's)."""
        from safetensors import safe_open

        with safe_open(Path(folder) / "model.safetensors", framework="pt") as handle:
            stored = [handle.get_tensor(f"{side}.inv_freq").float() for side in ("source", "target")]
        return all(s.shape == self.rotary.inv_freq.shape and torch.allclose(s, self.rotary.inv_freq, rtol=1e-5)
                   for s in stored) and all(r.attention_scaling == self.rotary.attention_scaling
                                            for r in (config.source_rotary, config.target_rotary))
