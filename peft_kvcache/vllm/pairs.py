"""The engine's model variants (the base model and its LoRA adapters) and the maps between them, found by the reuse
core's registry (`peft_kvcache.maps.registry`: the fingerprints of the files both variants load, the KV layout and
the rotary parameters, one tolerance), never by a folder name."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..errors import PeftKVCacheError
from ..maps.registry import UNSUPPORTED_MODEL, UNUSABLE_MAP, Identity, MapMatch, MapRegistry
from ..modeling.identity import fingerprint_files

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One model the engine serves: the base model (``adapter`` None) or a LoRA adapter loaded from ``path``."""

    adapter: str | None
    path: str | None = None

    @property
    def label(self) -> str:
        return self.adapter or "base"


def variant_of(request) -> Variant:
    """The variant a vLLM request asks for (its LoRA request's name and path; the base model without one)."""
    lora = request.lora_request
    return Variant(None) if lora is None else Variant(lora.lora_name, lora.lora_path)


def lora_id_of(request) -> int | None:
    """The LoRA id vLLM runs the request's adapter under (a reload takes a new one); None for the base model, and for
    an adapter loaded in place (``load_inplace``: vLLM reads its files again whenever it activates the id, so it runs
    the files on disk)."""
    lora = request.lora_request
    return None if lora is None or getattr(lora, "load_inplace", False) else lora.lora_int_id


class VariantMaps:
    """The maps between the engine's variants: each variant's `Identity` read from the files the engine loads (its
    sampled fingerprint memoized by the files' identity, so a variant whose files change is seen to change), and the
    registry's route between two (an adapter's map to the base model, then the base model's map onward: vLLM never
    computes the base model's KV of an adapter's turn).

    Args:
        root: a folder of map folders (e.g. ``hub_cards``).
        model_dir: the folder the engine loaded the base model from.
        hf_config: the base model's transformers config.
    """

    def __init__(self, root: str | Path, model_dir: str | Path, hf_config):
        self.registry = MapRegistry([root])
        self.model_dir = Path(model_dir)
        self._choices: dict[tuple[str, str], MapMatch | str] = {}
        self._unusable: set[str] = set()  # folders the worker could not load
        self._base: Identity | None = None  # its layout and rotary are every variant's
        try:
            self._base = Identity.of_files(self.model_dir, None, hf_config)
            self.problem = self._base.problem  # why nothing can be mapped on this engine, if so
        except (PeftKVCacheError, OSError, ValueError) as err:
            self.problem = f"the engine's model cannot be fingerprinted: {err}"

    def identity(self, variant: Variant) -> Identity | None:
        """What ``variant`` loads now (adapters keep the base's layout and rotary); None when its files cannot be
        read."""
        if self._base is None:
            return None
        try:
            fingerprint = fingerprint_files(self.model_dir, variant.path if variant.adapter else None)
            return Identity(fingerprint, self._base.layout, self._base.rotary, self._base.problem)
        except (PeftKVCacheError, OSError, ValueError, KeyError, StopIteration) as err:
            logger.warning("cannot fingerprint %s (%s): its requests are not mapped (%s)", variant.label,
                           variant.path or self.model_dir, err)
            return None

    def find(self, source: Variant, target: Variant) -> MapMatch | str:
        """The maps from ``source`` to ``target`` (through the base model between two adapters), or why there are
        none (the registry's reasons); decided once per pair of weights."""
        ids = [self.identity(v) for v in (source, target, Variant(None))]
        if None in ids:
            return UNSUPPORTED_MODEL
        key = (ids[0].fingerprint, ids[1].fingerprint)
        if key not in self._choices:
            via = ids[2] if source.adapter is not None and target.adapter is not None else None
            choice = self.registry.route(ids[0], ids[1], via)
            if isinstance(choice, MapMatch) and self._unusable.intersection(choice.folders):
                choice = UNUSABLE_MAP
            self._choices[key] = choice
        return self._choices[key]

    def set_unusable(self, folder: str) -> None:
        """Never choose ``folder`` again (the worker could not load it): its pairs fall back as `UNUSABLE_MAP`."""
        self._unusable.add(folder)
        self._choices.clear()

    def useful(self, variant: Variant, side: str = "source") -> bool:
        """Whether some map takes ``variant``'s KV to another variant (``side`` "source": only then is its KV worth
        keeping), or another's to it (``side`` "target": only then is its own sink)."""
        identity = self.identity(variant)
        return identity is not None and any(getattr(c, f"{side}_fingerprint") == identity.fingerprint
                                            for c in self.registry.configs.values())


def local_model_folder(model: str) -> Path:
    """The folder the engine loads ``model`` from: the path itself, or its snapshot in the Hub cache."""
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))
