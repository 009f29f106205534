"""The engine's model variants (the base model and its LoRA adapters) and the maps between them, found by the reuse
core's registry (`peft_kvcache.maps.registry`: the fingerprints of the files both variants load, the KV layout and
the rotary parameters, one tolerance), never by a folder name."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..errors import PeftKVCacheError
from ..maps.registry import UNSUPPORTED_MODEL, Identity, MapMatch, MapRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One model the engine serves: the base model (``adapter`` None) or a LoRA adapter loaded from ``path``."""

    adapter: str | None
    path: str | None = None

    @property
    def label(self) -> str:
        return self.adapter or "base"


class VariantMaps:
    """The maps between the engine's variants: each variant's `Identity` read from the files the engine loads (once),
    and the registry's route between two (an adapter's map to the base model, then the base model's map onward:
    vLLM never computes the base model's KV of an adapter's turn).

    Args:
        root: a folder of map folders (e.g. ``hub_cards``).
        model_dir: the folder the engine loaded the base model from.
        hf_config: the base model's transformers config.
    """

    def __init__(self, root: str | Path, model_dir: str | Path, hf_config):
        self.registry = MapRegistry([root])
        self.model_dir, self.hf_config = Path(model_dir), hf_config
        self._identities: dict[Variant, Identity | None] = {}
        self._choices: dict[tuple[Variant, Variant], MapMatch | str] = {}
        base = self.identity(Variant(None))
        self.problem = None if base is None else base.problem  # why nothing can be mapped on this engine, if so

    def identity(self, variant: Variant) -> Identity | None:
        """What ``variant`` loads (memoized); None when its files cannot be read."""
        if variant not in self._identities:
            try:
                self._identities[variant] = Identity.of_files(self.model_dir, variant.path if variant.adapter else None,
                                                              self.hf_config)
            except (PeftKVCacheError, OSError, ValueError, KeyError, StopIteration) as err:
                logger.warning("cannot fingerprint %s (%s): its requests are not mapped (%s)", variant.label,
                               variant.path or self.model_dir, err)
                self._identities[variant] = None
        return self._identities[variant]

    def find(self, source: Variant, target: Variant) -> MapMatch | str:
        """The maps from ``source`` to ``target`` (through the base model between two adapters), or why there are
        none (the registry's reasons); decided once per pair."""
        if (source, target) not in self._choices:
            ids = [self.identity(v) for v in (source, target, Variant(None))]
            if None in ids:
                choice: MapMatch | str = UNSUPPORTED_MODEL
            else:
                via = ids[2] if source.adapter is not None and target.adapter is not None else None
                choice = self.registry.route(ids[0], ids[1], via)
            self._choices[source, target] = choice
        return self._choices[source, target]
