"""`KVMap`: the fitted artifact. A folder that is exactly what goes to the Hub: ``config.json``,
``model.safetensors`` (never pickle) and a ``README.md`` model card. Imports no model code."""

from __future__ import annotations

import json
import logging
import os
import re
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
CHART_NAME = "layer_r2.png"
KINDS = ("keys", "values")
# Refuse configs describing absurd models before allocating anything for them.
_MAX_LAYERS, _MAX_HEADS, _MAX_HEAD_DIM = 1024, 1024, 4096
_MAX_CONFIG_BYTES = 64 * 2**20
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


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
    nonlinear: dict = field(default_factory=dict, metadata={
        "help": "residual MLP heads: {'keys': [target layers], 'values': [target layers], 'hidden': width, ...}; "
                "empty for a purely linear map (see peft_kvcache.nonlinear)"})
    blend: dict = field(default_factory=dict, metadata={
        "help": "same-shape maps: the scale of the correction of the source cache per kind, chosen on held-out "
                "KL and folded into the weights: {'keys': a, 'values': a, 'scores': {...}, ...} (see peft_kvcache.blend)"})
    format_version: int = FORMAT_VERSION
    library_version: str = __version__

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KVMapConfig":
        """Build and validate a config read from ``config.json``; every problem is an `ArtifactError`
        naming the field, so a tampered or truncated file never fails later inside the mapping path."""
        if not isinstance(data, dict):
            raise ArtifactError(f"{CONFIG_NAME} must hold a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:
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
        for key in ("source_layout", "target_layout"):
            values[key] = _layout_from(key, values[key])
        _check_types(values)
        config = cls(**values)
        config._validate_layers()
        return config

    def _validate_layers(self) -> None:
        for kind, layers in (("key_layers", self.key_layers), ("value_layers", self.value_layers)):
            ok = isinstance(layers, list) and len(layers) == self.target_layout.num_layers and all(
                isinstance(group, list) and 0 < len(group) <= self.source_layout.num_layers and all(
                    _is_int(s) and 0 <= s < self.source_layout.num_layers for s in group)
                for group in layers)
            if not ok:
                raise ArtifactError(
                    f"{CONFIG_NAME} field {kind} must list, for each of {self.target_layout.num_layers} target "
                    f"layers, source layers in 0..{self.source_layout.num_layers - 1}"
                )
        if not _is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ArtifactError(f"{CONFIG_NAME} field sink_tokens must be a non-negative integer")
        for side, rotary, layout in (("source", self.source_rotary, self.source_layout),
                                     ("target", self.target_rotary, self.target_layout)):
            _check_rotary(f"{side}_rotary", rotary, layout)
        for name, rows in (("key_r2", self.key_r2), ("value_r2", self.value_r2),
                           ("key_lambdas", self.key_lambdas), ("value_lambdas", self.value_lambdas)):
            # Optional per-head figures (the card plots them): absent, or one row of numbers per target layer.
            if not _is_optional_table(rows, self.target_layout.num_layers, self.target_layout.kv_heads):
                raise ArtifactError(
                    f"{CONFIG_NAME} field {name} must be empty or list {self.target_layout.kv_heads} numbers for "
                    f"each of {self.target_layout.num_layers} target layers"
                )
        self._validate_nonlinear()
        for name, rows in (("key_candidate_r2", self.key_candidate_r2),
                           ("value_candidate_r2", self.value_candidate_r2)):
            if not _is_optional_table(rows, self.target_layout.num_layers, self.source_layout.num_layers):
                raise ArtifactError(
                    f"{CONFIG_NAME} field {name} must be empty or list, for each of {self.target_layout.num_layers} "
                    f"target layers, one number per source layer ({self.source_layout.num_layers})"
                )


    def _validate_nonlinear(self) -> None:
        """``nonlinear``: empty, or lists of distinct target layers per kind and a positive hidden width."""
        if not self.nonlinear:
            return
        layers = self.target_layout.num_layers
        for kind in KINDS:
            chosen = self.nonlinear.get(kind, [])
            if not (isinstance(chosen, list) and all(_is_int(t) and 0 <= t < layers for t in chosen)
                    and len(set(chosen)) == len(chosen)):
                raise ArtifactError(f"{CONFIG_NAME} field nonlinear.{kind} must list distinct target layers in "
                                    f"0..{layers - 1}, got {chosen!r}")
        if self.mlp_layers("keys") or self.mlp_layers("values"):
            hidden = self.nonlinear.get("hidden")
            if not (_is_int(hidden) and 0 < hidden <= 65536):
                raise ArtifactError(f"{CONFIG_NAME} field nonlinear.hidden must be a positive integer, got {hidden!r}")

    def mlp_layers(self, kind: str) -> list[int]:
        """Target layers whose ``kind`` ('keys' or 'values') has a residual MLP head."""
        return list(self.nonlinear.get(kind, [])) if self.nonlinear else []


def _is_int(value: Any) -> bool:
    return type(value) is int  # JSON true/false are not layer indices


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _layout_from(key: str, value: Any) -> KVLayout:
    """A `KVLayout` from its JSON form, refusing non-integers and absurd sizes before anything is allocated."""
    names = [f.name for f in fields(KVLayout)]
    if not isinstance(value, dict) or sorted(value) != sorted(names) or not all(_is_int(value[n]) for n in names):
        raise ArtifactError(f"{CONFIG_NAME} has a malformed {key}: {value!r} (expects integers {names})")
    layout = KVLayout(**value)
    if not (0 < layout.num_layers <= _MAX_LAYERS and 0 < layout.kv_heads <= _MAX_HEADS
            and 0 < layout.head_dim <= _MAX_HEAD_DIM and layout.head_dim % 2 == 0):
        raise ArtifactError(
            f"{CONFIG_NAME} has an implausible {key}: {value} (at most {_MAX_LAYERS} layers, {_MAX_HEADS} KV heads "
            f"and an even head_dim up to {_MAX_HEAD_DIM})"
        )
    return layout


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "source_name": (str,), "target_name": (str,), "source_fingerprint": (str,), "target_fingerprint": (str,),
    "source_rotary": (dict,), "target_rotary": (dict,), "vocab_size": (int,), "pair_kind": (str,),
    "key_layers": (list,), "value_layers": (list,), "key_r2": (list,), "value_r2": (list,),
    "key_lambdas": (list,), "value_lambdas": (list,), "key_candidate_r2": (list,), "value_candidate_r2": (list,),
    "sink_tokens": (int,), "calibration": (dict,), "quality": (dict,), "library_version": (str,),
    "nonlinear": (dict,), "blend": (dict,),
}
PAIR_KINDS = ("same_shape", "cross_shape")


def _check_types(values: dict[str, Any]) -> None:
    for name, types in _FIELD_TYPES.items():
        if name in values and (type(values[name]) not in types):
            raise ArtifactError(
                f"{CONFIG_NAME} field {name} must be a {' or '.join(t.__name__ for t in types)}, "
                f"got {type(values[name]).__name__}"
            )
    if values["pair_kind"] not in PAIR_KINDS:
        raise ArtifactError(f"{CONFIG_NAME} field pair_kind is {values['pair_kind']!r}; expected one of {PAIR_KINDS}")
    if values["vocab_size"] <= 0:
        raise ArtifactError(f"{CONFIG_NAME} field vocab_size must be positive, got {values['vocab_size']}")


def _check_rotary(name: str, rotary: dict, layout: KVLayout) -> None:
    head_dim, rotary_dim, scaling = rotary.get("head_dim"), rotary.get("rotary_dim"), rotary.get("attention_scaling")
    ok = (_is_int(head_dim) and head_dim == layout.head_dim and _is_int(rotary_dim) and 0 < rotary_dim <= head_dim
          and rotary_dim % 2 == 0 and _is_number(scaling) and 0 < scaling < float("inf")
          and isinstance(rotary.get("rope_type", "default"), str)
          and (rotary.get("max_position") is None or _is_int(rotary.get("max_position"))))
    if not ok:
        raise ArtifactError(
            f"{CONFIG_NAME} field {name} is malformed: {rotary!r} (expects head_dim {layout.head_dim}, an even "
            f"rotary_dim up to it and a positive attention_scaling)"
        )


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

    def layer_mlp(self, kind: str, target_layer: int, device, dtype) -> tuple[torch.Tensor, ...] | None:
        """(w1, b1, w2, b2) of the residual MLP head of one target layer, or None where the map is linear."""
        if target_layer not in self.config.mlp_layers(kind):
            return None
        key = ("mlp", kind, target_layer, str(device), dtype)
        if key not in self._placed:
            self._placed[key] = tuple(self.tensors[f"{kind}.{target_layer}.mlp.{part}"].to(device=device, dtype=dtype)
                                      for part in ("w1", "b1", "w2", "b2"))
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
            # rtol of bfloat16: model.to(bfloat16) also rounds the rotary buffers.
            if spec.rotary_dim != stored.rotary_dim or not torch.allclose(spec.inv_freq, stored.inv_freq, rtol=1e-2):
                raise FingerprintMismatchError(
                    f"the {role} model {model_name(model)!r} uses other RoPE frequencies ({spec.describe()}) "
                    f"than this map was fitted with ({stored.describe()})"
                )

    # ----- save / load -----

    def save_pretrained(self, save_directory: str | os.PathLike, card: bool = True,
                        repo_id: str | None = None) -> Path:
        """Write ``config.json``, ``model.safetensors`` and (``card=True``) ``README.md`` with its chart.

        The folder appears complete or not at all: everything is written into a staging folder beside it,
        which then takes the folder's place. Saving over an existing map keeps the files there that are
        not ours (benchmark tables, notes) by linking them into the staging folder, moves the old folder
        aside and renames the staging folder in; a crash between those two renames leaves no folder
        (loading fails with `ArtifactError`) and the old map intact in ``.<name>.old-*`` beside it — never
        new weights with an old config, which could load as a silently wrong map. ``repo_id`` is what the
        card's usage snippet loads (default: ``save_directory``).

        Example:
            >>> kv_map.save_pretrained("maps/qwen-0.5b-to-1.5b")   # doctest: +SKIP
        """
        target = Path(save_directory)
        if target.is_symlink():
            target = target.resolve()
        if target.exists() and not target.is_dir():
            raise ArtifactError(f"cannot save a map to {target}: it is a file, not a folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            save_file({k: v.contiguous() for k, v in self.tensors.items()}, staging / WEIGHTS_NAME,
                      metadata={"format": "pt", "peft_kvcache_format": str(FORMAT_VERSION)})
            (staging / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
            if card:
                from .card import render_card  # card rendering needs the hub templates only when asked

                # a card is published: its usage names the repo, never this machine's absolute path
                (staging / CARD_NAME).write_text(render_card(self, staging, repo_hint=repo_id or target.name))
            if target.exists():
                _swap_in(staging, target, drop_stale_chart=card)
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

        A repo or file that cannot be found raises huggingface_hub's own error (``RepositoryNotFoundError``,
        ``EntryNotFoundError``, ``LocalEntryNotFoundError`` offline); a damaged artifact an `ArtifactError`.

        Example:
            >>> kv_map = KVMap.from_pretrained("org/qwen-0.5b-to-1.5b-kvmap", revision="v1")  # doctest: +SKIP
        """
        folder = resolve_map_folder(path_or_repo_id, revision=revision, token=token, cache_dir=cache_dir,
                                    local_files_only=local_files_only)
        return cls._load_folder(folder)

    @classmethod
    def _load_folder(cls, folder: Path) -> "KVMap":
        config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
        for path in (config_path, weights_path):
            if not path.is_file():
                raise ArtifactError(f"{folder} is not a KV map: {path.name} is missing")
        if config_path.stat().st_size > _MAX_CONFIG_BYTES:
            raise ArtifactError(f"{config_path} is {config_path.stat().st_size:,} bytes, too large for a map config")
        try:
            data = json.loads(config_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise ArtifactError(f"{config_path} is not valid JSON: {err}") from None
        try:
            config = KVMapConfig.from_dict(data)
        except ArtifactError as err:
            raise ArtifactError(f"{config_path}: {err}") from None
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
                    if tuple(sliced.get_shape()) != shape or sliced.get_dtype() not in _FLOAT_DTYPES:
                        raise ArtifactError(
                            f"tensor {name!r} in {weights_path} is {sliced.get_dtype()} {tuple(sliced.get_shape())}; "
                            f"config.json implies a float tensor of shape {shape}"
                        )
                    tensors[name] = handle.get_tensor(name).float()
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ArtifactError(f"{weights_path} is corrupted or truncated: {err}") from None
        try:
            return cls(config, tensors)
        except ArtifactError as err:
            raise ArtifactError(f"{weights_path}: {err}") from None

    def push_to_hub(self, repo_id: str, private: bool | None = None, token: str | None = None,
                    commit_message: str = "Upload KV map", revision: str | None = None) -> str:
        """Create (if needed) the Hub repo ``repo_id`` and upload this map's folder with its card (whose
        usage snippet loads ``repo_id``). Returns the commit URL.

        Example:
            >>> kv_map.push_to_hub("my-org/qwen-0.5b-to-1.5b-kvmap", private=True)   # doctest: +SKIP
        """
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        repo_id = getattr(repo_url, "repo_id", None) or repo_id  # the hub resolves a bare name to "user/name"
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        with tempfile.TemporaryDirectory() as tmp:
            folder = self.save_pretrained(Path(tmp) / "map", repo_id=repo_id)
            info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message,
                                     revision=revision, repo_type="model")
        logger.info("pushed map %s -> %s to %s", self.config.source_name, self.config.target_name, repo_id)
        return str(getattr(info, "commit_url", None) or info)

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


def resolve_map_folder(
    path_or_repo_id: str | os.PathLike,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> Path:
    """The local folder holding a map: ``path_or_repo_id`` itself when it is a folder, else the Hub cache
    snapshot of repo ``path_or_repo_id`` at ``revision`` (``config.json`` and ``model.safetensors`` fetched
    with ``hf_hub_download``, both from the same commit).

    Example:
        >>> resolve_map_folder("org/qwen-0.5b-to-1.5b-kvmap", local_files_only=True)   # doctest: +SKIP
        PosixPath('~/.cache/huggingface/hub/models--org--qwen-0.5b-to-1.5b-kvmap/snapshots/<commit>')
    """
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ArtifactError(f"{path} is a file; a KV map is a folder holding {CONFIG_NAME} and {WEIGHTS_NAME}")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id = str(path_or_repo_id)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ArtifactError(f"{repo_id!r} is neither an existing folder nor a valid Hub repo id") from None
    options = dict(token=token, cache_dir=cache_dir, local_files_only=local_files_only, repo_type="model")
    try:
        config_path = Path(hf_hub_download(repo_id, CONFIG_NAME, revision=revision, **options))
        # The config lies in snapshots/<commit>/: fetch the weights from that very commit, even if the
        # branch moves in between.
        commit = config_path.parent.name
        pinned = commit if _COMMIT_HASH.fullmatch(commit) else revision
        weights_path = Path(hf_hub_download(repo_id, WEIGHTS_NAME, revision=pinned, **options))
    except Exception as err:  # the hub's own not-found errors pass through, with a hint about local paths
        if hasattr(err, "add_note") and not path.is_absolute():
            err.add_note(f"peft-kvcache: there is no local folder {str(path)!r} either, so {repo_id!r} was "
                         "looked up as a Hub repo id")
        raise
    if weights_path.parent != config_path.parent:
        raise ArtifactError(f"{repo_id}: {CONFIG_NAME} and {WEIGHTS_NAME} resolved to different folders "
                            f"({config_path.parent} and {weights_path.parent})")
    return config_path.parent


def _swap_in(staging: Path, target: Path, drop_stale_chart: bool) -> None:
    """Replace folder ``target`` by ``staging``, carrying over ``target``'s files that ``staging`` lacks.

    Two renames (old folder aside, staging in): between them there is no folder at ``target``, so an
    interruption can never leave a mix of old and new map files there.
    """
    for entry in os.listdir(target):
        if (staging / entry).exists() or (entry == CHART_NAME and drop_stale_chart):
            continue  # ours, rewritten; or the chart of an earlier card (a new card brings its own)
        source = target / entry
        if source.is_dir() and not source.is_symlink():
            shutil.copytree(source, staging / entry, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(source, staging / entry)
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, backup)  # onto the empty folder just made
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(backup, target)  # put the old map back
        raise
    shutil.rmtree(backup, ignore_errors=True)


def _link_or_copy(source, destination) -> None:
    """Hard-link a file (no copy of large unrelated files), copying where links are not possible."""
    if os.path.islink(source):
        os.symlink(os.readlink(source), destination)
        return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


_COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")


def _is_optional_table(rows, num_rows: int, num_columns: int) -> bool:
    """An empty list, or ``num_rows`` lists of ``num_columns`` numbers each."""
    return isinstance(rows, list) and (not rows or (len(rows) == num_rows and all(
        isinstance(row, list) and len(row) == num_columns and all(_is_number(v) for v in row) for row in rows)))


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
        hidden = config.nonlinear.get("hidden") if config.nonlinear else None
        for t in config.mlp_layers(kind):  # residual MLP heads (peft_kvcache.nonlinear)
            shapes.update({f"{kind}.{t}.mlp.w1": (tgt.layer_width, hidden), f"{kind}.{t}.mlp.b1": (hidden,),
                           f"{kind}.{t}.mlp.w2": (hidden, tgt.layer_width), f"{kind}.{t}.mlp.b2": (tgt.layer_width,)})
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
