"""`AdapterMaps`: the maps of one `PeftModel`'s adapters, base -> adapter and adapter -> base, saved as one map
folder each and loaded by adapter name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .kvmap import KVMap, is_map_folder


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
        >>> maps = AdapterMaps.from_pretrained("hub_cards", "smollm2-135m-instruct", ["shout"])  # doctest: +SKIP
        >>> maps.to_adapter["shout"]                                                           # doctest: +SKIP
    """

    to_adapter: dict[str, KVMap] = field(default_factory=dict)
    to_base: dict[str, KVMap] = field(default_factory=dict)

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
    def from_pretrained(cls, root: str | Path, prefix: str, adapters: Sequence[str], reverse: bool = True,
                        missing_ok: bool = False) -> "AdapterMaps":
        """Load the maps saved by `save_pretrained` for ``adapters`` (``missing_ok``: skip absent folders)."""
        maps = cls()
        for adapter in adapters:
            for is_reverse, store in ((False, maps.to_adapter), (True, maps.to_base)):
                if is_reverse and not reverse:
                    continue
                folder = Path(root) / folder_name(prefix, adapter, reverse=is_reverse)
                if missing_ok and not is_map_folder(folder):
                    continue
                store[adapter] = KVMap.from_pretrained(folder)
        return maps
