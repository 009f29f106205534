"""`KVMap`: the fitted artifact. A folder that is exactly what goes to the Hub: ``config.json``,
``model.safetensors`` (never pickle) and a ``README.md`` model card. Imports no model code."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import __version__
from .errors import ArtifactError, FingerprintMismatchError
from .models import KVLayout, active_adapters, fingerprint, model_name
from .positions import RotarySpec, rotary_spec_of

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
KINDS = ("keys", "values")
# Refuse configs describing absurd models before allocating anything for them.
_MAX_LAYERS, _MAX_HEADS, _MAX_HEAD_DIM = 1024, 1024, 4096


@dataclass
class KVMapConfig:
    """Everything about a map except its tensors; serialized as ``config.json``.

    Per-layer lists are indexed by target layer; per-head lists by target KV head.
    """

    source_name: str = field(metadata={"help": "Hub id or path of the source model"})
    target_name: str = field(metadata={"help": "Hub id or path of the target model (or 'base+adapter')"})
    source_fingerprint: str = field(metadata={"help": "sha256 of the source weights (see models.fingerprint)"})
    target_fingerprint: str = field(metadata={"help": "sha256 of the target weights"})
    source_layout: KVLayout = field(metadata={"help": "source KV cache shape"})
    target_layout: KVLayout = field(metadata={"help": "target KV cache shape"})
    source_rotary: dict = field(metadata={"help": "source RoPE summary (inv_freq is in the safetensors)"})
    target_rotary: dict = field(metadata={"help": "target RoPE summary"})
    vocab_size: int = field(metadata={"help": "shared vocabulary size"})
    pair_kind: str = field(metadata={"help": "'same_shape' (e.g. base -> adapter) or 'cross_shape' (siblings)"})
    key_layers: list = field(metadata={"help": "source layers feeding each target layer's keys"})
    value_layers: list = field(metadata={"help": "source layers feeding each target layer's values"})
    key_r2: list = field(default_factory=list, metadata={"help": "held-out R^2 per target layer and KV head"})
    value_r2: list = field(default_factory=list, metadata={"help": "held-out R^2 per target layer and KV head"})
    key_lambdas: list = field(default_factory=list, metadata={"help": "ridge strength per layer and head"})
    value_lambdas: list = field(default_factory=list, metadata={"help": "ridge strength per layer and head"})
    key_candidate_r2: list = field(default_factory=list, metadata={"help": "[target][source] R^2 of single layers"})
    value_candidate_r2: list = field(default_factory=list, metadata={"help": "[target][source] R^2"})
    sink_tokens: int = field(default=1, metadata={"help": "leading tokens the target computes itself"})
    calibration: dict = field(default_factory=dict, metadata={"help": "data, token counts and options"})
    quality: dict = field(default_factory=dict, metadata={"help": "measured retention / speed figures"})
    format_version: int = FORMAT_VERSION
    library_version: str = __version__

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KVMapConfig":
        if not isinstance(data, dict):
            raise ArtifactError(f"{CONFIG_NAME} must hold a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ArtifactError(
                f"map format_version {version!r} is not supported by peft-kvcache {__version__} "
                f"(expects {FORMAT_VERSION}); upgrade the library or re-calibrate the map"
            )
        known = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - data.keys())
        if missing:
            raise ArtifactError(f"{CONFIG_NAME} is missing keys {missing}")
        values = {k: v for k, v in data.items() if k in known}
        try:
            for key in ("source_layout", "target_layout"):
                layout = KVLayout(**values[key])
                if not (0 < layout.num_layers <= _MAX_LAYERS and 0 < layout.kv_heads <= _MAX_HEADS
                        and 0 < layout.head_dim <= _MAX_HEAD_DIM and layout.head_dim % 2 == 0):
                    raise ArtifactError(f"{CONFIG_NAME} has an implausible {key}: {values[key]}")
                values[key] = layout
        except TypeError as err:
            raise ArtifactError(f"{CONFIG_NAME} has a malformed layout: {err}") from None
        config = cls(**values)
        config._validate_layers()
        return config

    def _validate_layers(self) -> None:
        for kind, layers in (("key_layers", self.key_layers), ("value_layers", self.value_layers)):
            ok = isinstance(layers, list) and len(layers) == self.target_layout.num_layers and all(
                isinstance(group, list) and group and all(
                    isinstance(s, int) and 0 <= s < self.source_layout.num_layers for s in group)
                for group in layers)
            if not ok:
                raise ArtifactError(
                    f"{CONFIG_NAME} field {kind} must list, for each of {self.target_layout.num_layers} target "
                    f"layers, source layers in 0..{self.source_layout.num_layers - 1}"
                )
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ArtifactError(f"{CONFIG_NAME} field sink_tokens must be a non-negative integer")


class KVMap:
    """A fitted source -> target KV map: per target layer and kind (keys/values) a ``[D_in, kv_heads *
    head_dim]`` weight and a bias, applied to the position-free features of the chosen source layers.

    Example:
        >>> kv_map = KVMap.from_pretrained("hub_cards/qwen2.5-coder-0.5b-to-1.5b")   # doctest: +SKIP
        >>> kv_map.save_pretrained("my_map")                                            # doctest: +SKIP
    """

    def __init__(self, config: KVMapConfig, tensors: dict[str, torch.Tensor]):
        self.config = config
        self.tensors = tensors
        self._placed: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._validate_tensors()

    # ----- what the mapping path reads -----

    @property
    def source_rotary(self) -> RotarySpec:
        return _spec(self.config.source_rotary, self.tensors["source.inv_freq"])

    @property
    def target_rotary(self) -> RotarySpec:
        return _spec(self.config.target_rotary, self.tensors["target.inv_freq"])

    def source_layers(self, kind: str, target_layer: int) -> list[int]:
        """Source layers whose features feed ``kind`` ('keys' or 'values') of ``target_layer``."""
        layers = self.config.key_layers if kind == "keys" else self.config.value_layers
        return layers[target_layer]

    def layer_weights(self, kind: str, target_layer: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, bias) of one target layer, cast and placed once per (device, dtype) and reused."""
        key = (kind, target_layer, str(device), dtype)
        if key not in self._placed:
            weight = self.tensors[f"{kind}.{target_layer}.weight"].to(device=device, dtype=dtype)
            bias = self.tensors[f"{kind}.{target_layer}.bias"].to(device=device, dtype=dtype)
            self._placed[key] = (weight, bias)
        return self._placed[key]

    @property
    def num_parameters(self) -> int:
        return sum(t.numel() for name, t in self.tensors.items() if not name.endswith("inv_freq"))

    # ----- checks against models -----

    def check_models(self, source_model: torch.nn.Module | None, target_model: torch.nn.Module) -> None:
        """Refuse models other than the ones this map was fitted for, naming both sides."""
        for role, model, expected, name in (
            ("source", source_model, self.config.source_fingerprint, self.config.source_name),
            ("target", target_model, self.config.target_fingerprint, self.config.target_name),
        ):
            if model is None:
                continue
            actual = _cached_fingerprint(model)
            if actual != expected:
                raise FingerprintMismatchError(
                    f"this map was fitted for {role} {name!r} (fingerprint {expected[:12]}) but the {role} model "
                    f"given is {model_name(model)!r} (fingerprint {actual[:12]}): use the map fitted for this "
                    f"pair, or calibrate one with KVMap.calibrate"
                )
            spec = rotary_spec_of(model)
            stored = self.source_rotary if role == "source" else self.target_rotary
            if spec.rotary_dim != stored.rotary_dim or not torch.allclose(spec.inv_freq, stored.inv_freq):
                raise FingerprintMismatchError(
                    f"the {role} model {model_name(model)!r} uses other RoPE frequencies ({spec.describe()}) "
                    f"than this map was fitted with ({stored.describe()})"
                )

    # ----- save / load -----

    def save_pretrained(self, save_directory: str | os.PathLike, card: bool = True) -> Path:
        """Write ``config.json``, ``model.safetensors`` and (``card=True``) ``README.md`` atomically: the
        folder appears complete or not at all, never half-written."""
        target = Path(save_directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            save_file({k: v.contiguous() for k, v in self.tensors.items()}, staging / WEIGHTS_NAME,
                      metadata={"format": "pt", "peft_kvcache_format": str(FORMAT_VERSION)})
            (staging / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
            if card:
                from .card import render_card  # card rendering needs the hub templates only when asked

                (staging / CARD_NAME).write_text(render_card(self, staging, repo_hint=str(save_directory)))
            if target.exists():
                old = target.with_name(f".{target.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                target.rename(old)
                staging.rename(target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info("saved map %s -> %s to %s", self.config.source_name, self.config.target_name, target)
        return target

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | os.PathLike,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
    ) -> "KVMap":
        """Load a map from a local folder or a Hub repo (resolved through huggingface_hub: its cache,
        revisions, offline mode and tokens). Only JSON and safetensors are read; nothing is executed.

        Example:
            >>> kv_map = KVMap.from_pretrained("org/qwen-0.5b-to-1.5b-kvmap", revision="v1")  # doctest: +SKIP
        """
        folder = Path(path_or_repo_id)
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(
                str(path_or_repo_id), revision=revision, token=token, cache_dir=cache_dir,
                local_files_only=local_files_only, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, "*.png"],
            ))
        return cls._load_folder(folder)

    @classmethod
    def _load_folder(cls, folder: Path) -> "KVMap":
        config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
        for path in (config_path, weights_path):
            if not path.is_file():
                raise ArtifactError(f"{folder} is not a KV map: {path.name} is missing")
        try:
            data = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ArtifactError(f"{config_path} is not valid JSON: {err}") from None
        config = KVMapConfig.from_dict(data)
        expected = _expected_shapes(config)
        tensors = {}
        try:
            with safe_open(weights_path, framework="pt") as handle:
                names = set(handle.keys())
                if names != set(expected):
                    raise ArtifactError(
                        f"{weights_path} holds tensors {sorted(names - set(expected))[:4]} it should not and lacks "
                        f"{sorted(set(expected) - names)[:4]}; the file does not match its config.json"
                    )
                for name, shape in expected.items():
                    # The header gives shapes before any tensor is read: refuse mismatches without allocating.
                    sliced = handle.get_slice(name)
                    if tuple(sliced.get_shape()) != shape or sliced.get_dtype() not in ("F32", "F16", "BF16", "F64"):
                        raise ArtifactError(
                            f"tensor {name!r} in {weights_path} is {sliced.get_dtype()} {tuple(sliced.get_shape())}; "
                            f"config.json implies a float tensor of shape {shape}"
                        )
                    tensors[name] = handle.get_tensor(name).float()
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ArtifactError(f"{weights_path} is corrupted or truncated: {err}") from None
        return cls(config, tensors)

    def push_to_hub(self, repo_id: str, private: bool | None = None, token: str | None = None,
                    commit_message: str = "Upload KV map", revision: str | None = None) -> str:
        """Create (if needed) the Hub repo ``repo_id`` and upload this map's folder with its card.
        Returns the commit URL."""
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        with tempfile.TemporaryDirectory() as tmp:
            folder = self.save_pretrained(Path(tmp) / "map")
            info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message,
                                     revision=revision)
        return str(info)

    @classmethod
    def calibrate(cls, source_model, target_model, calibration_data, **kwargs) -> "KVMap":
        """Fit a map from ``source_model`` to ``target_model`` on calibration data; see
        `peft_kvcache.calibrate.calibrate` for the options."""
        from .calibrate import calibrate

        return calibrate(source_model, target_model, calibration_data, **kwargs)

    def _validate_tensors(self) -> None:
        expected = _expected_shapes(self.config)
        for name, shape in expected.items():
            tensor = self.tensors.get(name)
            if tensor is None or tuple(tensor.shape) != shape:
                got = None if tensor is None else tuple(tensor.shape)
                raise ArtifactError(f"map tensor {name!r} should have shape {shape}, got {got}")
            if not torch.isfinite(tensor).all():
                raise ArtifactError(f"map tensor {name!r} contains NaN or Inf")

    def __repr__(self) -> str:
        c = self.config
        return (f"KVMap({c.source_name!r} -> {c.target_name!r}, {c.pair_kind}, "
                f"{c.target_layout.num_layers} target layers, {self.num_parameters:,} parameters)")


def _expected_shapes(config: KVMapConfig) -> dict[str, tuple[int, ...]]:
    src, tgt = config.source_layout, config.target_layout
    shapes = {
        "source.inv_freq": (int(config.source_rotary.get("rotary_dim", src.head_dim)) // 2,),
        "target.inv_freq": (int(config.target_rotary.get("rotary_dim", tgt.head_dim)) // 2,),
    }
    for kind, layers in (("keys", config.key_layers), ("values", config.value_layers)):
        for t, sources in enumerate(layers):
            shapes[f"{kind}.{t}.weight"] = (len(sources) * src.layer_width, tgt.layer_width)
            shapes[f"{kind}.{t}.bias"] = (tgt.layer_width,)
    return shapes


def _spec(summary: dict[str, Any], inv_freq: torch.Tensor) -> RotarySpec:
    return RotarySpec(inv_freq=inv_freq, attention_scaling=float(summary["attention_scaling"]),
                      head_dim=int(summary["head_dim"]), rope_type=summary.get("rope_type", "default"),
                      max_position=summary.get("max_position"))


def _cached_fingerprint(model: torch.nn.Module) -> str:
    """Fingerprint memoized on the model per active adapter (hashing ~300 small samples is cheap but not
    free on the hot path of every switch)."""
    key = tuple(sorted(active_adapters(model)))
    memo = model.__dict__.setdefault("_peft_kvcache_fingerprints", {})
    if key not in memo:
        memo[key] = fingerprint(model)
    return memo[key]
