"""`AdapterMaps`: the maps of one `PeftModel`'s adapters, base -> adapter and adapter -> base, saved as one map
folder each and found again by what they fit (`registry`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MapNotFoundError
from .kvmap import KVMap
from .registry import MAP_MISMATCH, NO_MAP, UNSUPPORTED_MODEL, UNUSABLE_MAP, Identity, MapMatch, MapRegistry


def folder_name(prefix: str, adapter: str, reverse: bool) -> str:
    """``<prefix>-base-to-<adapter>`` or, reversed, ``<prefix>-<adapter>-to-base`` (underscores become dashes)."""
    slug = adapter.replace("_", "-")
    return f"{prefix}-{slug}-to-base" if reverse else f"{prefix}-base-to-{slug}"


def default_prefix(base_spec: str) -> str:
    """The folder prefix of a base model's maps: its name, lower case (``gguf:smollm2-135m-instruct`` ->
    ``smollm2-135m-instruct``, ``org/Model-1B`` -> ``model-1b``)."""
    return Path(base_spec.split(":")[-1].rstrip("/")).name.lower()


@dataclass
class AdapterMaps:
    """The maps of one `PeftModel`: ``to_adapter[name]`` (base -> adapter) and ``to_base[name]`` (adapter -> base).

    Example:
        >>> maps = AdapterMaps.from_pretrained("hub_cards", peft_model, ["shout"])  # doctest: +SKIP
        >>> maps.to_adapter["shout"]                                                           # doctest: +SKIP
    """

    to_adapter: dict[str, KVMap] = field(default_factory=dict)
    to_base: dict[str, KVMap] = field(default_factory=dict)
    found: dict[tuple[str, bool], str] = field(default_factory=dict)  # (adapter, reverse) -> where its map came from
    missing: dict[tuple[str, bool], str] = field(default_factory=dict)  # (adapter, reverse) -> why it has none

    @classmethod
    def calibrate(cls, model, calibration_data, tokenizer=None, adapters: Sequence[str] | None = None, config=None,
                  **options) -> "AdapterMaps":
        """Fit base -> adapter (and adapter -> base) maps for the adapters of the `PeftModel` ``model`` in one pass
        over ``calibration_data``; ``adapters`` default to every adapter but Activated LoRAs. See
        `peft_kvcache.calibration.loop.calibrate_adapters` for every option.

        Example:
            >>> maps = AdapterMaps.calibrate(peft_model, texts, tokenizer)   # doctest: +SKIP
            >>> maps.save_pretrained("maps", "smollm2-135m-instruct")        # doctest: +SKIP
        """
        from ..calibration.loop import calibrate_adapters  # fitting is calibration's, imported when asked

        return calibrate_adapters(model, calibration_data, tokenizer, adapters, config, **options)

    def all(self) -> list[tuple[str, bool, KVMap]]:
        """``(adapter, reverse, map)`` for every map, base -> adapter first."""
        return [(a, False, m) for a, m in self.to_adapter.items()] + [(a, True, m) for a, m in self.to_base.items()]

    def save_pretrained(self, root: str | Path, prefix: str, repo_namespace: str | None = None) -> list[Path]:
        """Save every map to ``root/<prefix>-base-to-<adapter>`` and ``root/<prefix>-<adapter>-to-base`` (config.json,
        model.safetensors and a model card each; the cards load ``repo_namespace/<folder>``). Returns the folders."""
        folders = []
        for adapter, reverse, kv_map in self.all():
            folder = Path(root) / folder_name(prefix, adapter, reverse)
            kv_map.save_pretrained(folder, repo_id=f"{repo_namespace}/{folder.name}" if repo_namespace else None)
            folders.append(folder)
        return folders

    @classmethod
    def from_pretrained(cls, maps: str | os.PathLike | Sequence[str | os.PathLike] | MapRegistry, model,
                        adapters: Sequence[str] | None = None, reverse: bool = True,
                        missing_ok: bool = False) -> "AdapterMaps":
        """The maps between the `PeftModel` ``model``'s base and each of its ``adapters`` (default: all), found by
        what they fit (`peft_kvcache.maps.registry`: the fingerprints of the base and of the base with the adapter
        active, the KV layout and the rotary parameters) among ``maps``: folders of map folders such as
        ``hub_cards``, single map folders or Hub repo ids, whatever the folders are named. ``reverse``: the
        adapter -> base maps too. A direction without a map raises `MapNotFoundError` naming why, unless ``missing_ok``
        (then ``missing[(adapter, reverse)]`` says why; ``found[(adapter, reverse)]`` names where each map came from).

        Example:
            >>> maps = AdapterMaps.from_pretrained("hub_cards", peft_model, ["shout"])  # doctest: +SKIP
            >>> maps.to_adapter["shout"]                                              # doctest: +SKIP
        """
        from ..modeling.adapters import adapter_active

        registry = maps if isinstance(maps, MapRegistry) else MapRegistry(maps)
        adapters = list(model.peft_config) if adapters is None else list(adapters)
        identities = {}
        for adapter in [None, *adapters]:
            with adapter_active(model, adapter):
                identities[adapter] = Identity.of_model(model)
        out = cls()
        for adapter in adapters:
            for is_reverse, store in ((False, out.to_adapter), (True, out.to_base)):
                if is_reverse and not reverse:
                    continue
                source, target = (identities[adapter], identities[None]) if is_reverse else \
                    (identities[None], identities[adapter])
                match = registry.find(source, target)
                if isinstance(match, MapMatch):
                    folder = match.folders[0]
                    store[adapter] = registry.load(folder)
                    spec = registry.origin[folder]  # a spec naming one map, else the folder found under it
                    out.found[adapter, is_reverse] = spec if spec in registry.singles else folder
                else:
                    out.missing[adapter, is_reverse] = match
        if out.missing and not missing_ok:
            (adapter, is_reverse), why = next(iter(out.missing.items()))
            direction = f"{adapter} -> base" if is_reverse else f"base -> {adapter}"
            raise MapNotFoundError(f"no {direction} map among {registry.origin and sorted(set(registry.origin.values()))}: "
                               f"{MISSES[why]}; fit one with `peft-kvcache calibrate-adapters` (or pass missing_ok=True)")
        return out


MISSES = {NO_MAP: "none was fitted for these weights", MAP_MISMATCH: "the maps fitted for these weights have "
          "another KV layout or other rotary parameters", UNUSABLE_MAP: "the map fitted for these weights cannot be "
          "read", UNSUPPORTED_MODEL: "the model's positional scheme is not supported"}
