"""`KVMap`: the fitted artifact, a config and its tensors: what the mapping path reads from them, the check against
the models it was fitted for, and moving it between folders and the Hub (the folder itself: `storage`).

Imports no code that calibrates or runs models: calibration builds a `KVMap` (`KVMap.calibrate` imports it when
called), the mapping path reads one."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch

from ..errors import ArtifactError, FingerprintMismatchError
from ..modeling.identity import cached_fingerprint, model_name
from ..modeling.positions import RotarySpec, rotary_spec_of, same_rotary
from .config import KVMapConfig, expected_shapes, is_weight, parameter_count
from .storage import CONFIG_NAME, WEIGHTS_NAME, is_map_folder, load_map, resolve_map_folder, save_map

logger = logging.getLogger(__name__)


class KVMap:
    """A fitted source -> target KV map: per target layer and kind (keys/values) a ``[D_in, kv_heads *
    head_dim]`` weight and a bias, applied to the position-free features of the chosen source layers.

    `KVMap.calibrate` fits one; `from_pretrained` / `save_pretrained` / `push_to_hub` move it between folders and
    the Hub.

    Example:
        >>> kv_map = KVMap.from_pretrained("hub_cards/qwen2.5-coder-0.5b-to-1.5b-top2")   # doctest: +SKIP
        >>> kv_map.save_pretrained("my_map")                                                 # doctest: +SKIP
    """

    def __init__(self, config: KVMapConfig, tensors: dict[str, torch.Tensor]):
        self.config = config
        self.tensors = tensors
        self._placed: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._validate_tensors()

    @classmethod
    def calibrate(cls, source_model: torch.nn.Module, target_model: torch.nn.Module, calibration_data,
                  tokenizer=None, config=None, **options) -> "KVMap":
        """Fit a map from ``source_model`` to ``target_model`` on ``calibration_data`` (texts with ``tokenizer``, 1-D
        token id tensors, or a mapping name -> either); ``config`` is a `CalibrationConfig` and keyword ``options``
        override its fields (``top_k=2``) or set the loop's own (``checkpoint_dir``, ``progress``, ...). See
        `peft_kvcache.calibration.loop.calibrate` for every option.

        Example:
            >>> kv_map = KVMap.calibrate(small_model, large_model, texts, tokenizer, top_k=2)   # doctest: +SKIP
        """
        from ..calibration.loop import calibrate  # the artifact does not know how it is fitted until asked

        return calibrate(source_model, target_model, calibration_data, tokenizer, config, **options)

    # ----- what the mapping path reads -----

    @property
    def source_rotary(self) -> RotarySpec:
        """The source model's rotary parameters, as recorded in the map."""
        return rotary_of_record(self.config.source_rotary, self.tensors["source.inv_freq"])

    @property
    def target_rotary(self) -> RotarySpec:
        """The target model's rotary parameters, as recorded in the map."""
        return rotary_of_record(self.config.target_rotary, self.tensors["target.inv_freq"])

    def source_layers(self, kind: str, target_layer: int) -> list[int]:
        """Source layers whose features feed ``kind`` ('keys' or 'values') of ``target_layer``."""
        layers = self.config.key_layers if kind == "keys" else self.config.value_layers
        return layers[target_layer]

    def source_inputs(self, kind: str, target_layer: int) -> list[tuple[str, int]]:
        """``(kind, source layer)`` of each input feeding ``kind`` of ``target_layer``, in its weight's row order: the
        same kind of the `source_layers`, or with ``joint_kinds`` keys and values alike (`KVMapConfig.source_input`)."""
        return [self.config.source_input(kind, s) for s in self.source_layers(kind, target_layer)]

    def layer_weights(self, kind: str, target_layer: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, bias) of one target layer, cast and placed once per (device, dtype) and reused."""
        return self._placed_tensors((kind, target_layer), ("weight", "bias"), device, dtype)

    def layer_basis(self, kind: str, device, dtype) -> torch.Tensor:
        """The ``[D, rank]`` projection of the source layers' features that every target layer's readout of ``kind``
        reads, in a map with a shared basis (`KVMapConfig.basis_rank`), placed once per (device, dtype)."""
        key = (kind, "basis", str(device), dtype)
        if key not in self._placed:
            self._placed[key] = (self.tensors[f"{kind}.basis"].to(device=device, dtype=dtype),)
        return self._placed[key][0]

    @property
    def residual_rank(self) -> int:
        """The rank of each layer's correction of the identity where the map was fitted with one (``residual_rank``)
        and runs cheaper so: the identity plus two factors (`layer_factors`); 0 where it runs as dense weights."""
        config = self.config
        rank = config.calibration.options.residual_rank
        width = config.target_layout.layer_width
        linear = not (config.mlp_layers("keys") or config.mlp_layers("values"))
        own_layers = all(sources == [t] for layers in (config.key_layers, config.value_layers)
                         for t, sources in enumerate(layers))
        return rank if config.pair_kind == "same_shape" and linear and own_layers and 0 < 2 * rank < width else 0

    @property
    def multiply_adds_per_token(self) -> int:
        """Multiply-adds of the map's matmuls per mapped token: its weights (and MLP heads, and a shared basis once per
        kind), or with a `residual_rank` r the two factors of each layer (``2 r width``)."""
        if self.residual_rank:
            layout = self.config.target_layout
            return 2 * layout.num_layers * 2 * self.residual_rank * layout.layer_width  # keys and values
        return sum(t.numel() for n, t in self.tensors.items()
                   if n.endswith((".weight", ".basis", ".mlp.w1", ".mlp.w2")))

    def layer_factors(self, kind: str, target_layer: int, device, dtype) -> tuple[torch.Tensor, ...]:
        """(down ``[width, r]``, up ``[r, width]``, bias) of a map with a `residual_rank` r: the layer's weight is the
        identity plus ``down @ up`` (read off the stored weight, whose correction has that rank), placed once per
        (device, dtype) and reused."""
        key = (kind, target_layer, "factors", str(device), dtype)
        if key not in self._placed:
            weight = self.tensors[f"{kind}.{target_layer}.weight"].double()
            correction = weight - torch.eye(weight.shape[0], dtype=weight.dtype)
            left, scales, right = torch.linalg.svd(correction, full_matrices=False)
            rank = self.residual_rank
            factors = (left[:, :rank] * scales[:rank], right[:rank], self.tensors[f"{kind}.{target_layer}.bias"])
            self._placed[key] = tuple(f.to(device=device, dtype=dtype).contiguous() for f in factors)
        return self._placed[key]

    def layer_mlp(self, kind: str, target_layer: int, device, dtype) -> tuple[torch.Tensor, ...] | None:
        """(w1, b1, w2, b2) of the residual MLP head of one target layer, or None where the map is linear."""
        if target_layer not in self.config.mlp_layers(kind):
            return None
        return self._placed_tensors((kind, target_layer), ("mlp.w1", "mlp.b1", "mlp.w2", "mlp.b2"), device, dtype)

    def _placed_tensors(self, where: tuple[str, int], parts: tuple[str, ...], device, dtype) -> tuple[torch.Tensor, ...]:
        key = (*where, parts, str(device), dtype)
        if key not in self._placed:
            kind, layer = where
            self._placed[key] = tuple(self.tensors[f"{kind}.{layer}.{p}"].to(device=device, dtype=dtype) for p in parts)
        return self._placed[key]

    def shipped_sink(self, start) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The target's own keys and values ``[num_layers, kv_heads, sink_tokens, head_dim]`` (keys post-RoPE at
        positions 0..) of a conversation that starts with the token ids ``start``, where the map ships them
        (``config.sinks``); None otherwise."""
        starts = [tuple(s) for s in self.config.sinks]
        if tuple(start) not in starts:
            return None
        i = starts.index(tuple(start))
        return self.tensors[f"sink.{i}.keys"], self.tensors[f"sink.{i}.values"]

    @property
    def num_parameters(self) -> int:
        """Weights of the map (rotary frequencies excluded)."""
        return parameter_count(self.config)

    def with_weights_dtype(self, dtype: torch.dtype) -> "KVMap":
        """The same map with its weights stored in ``dtype`` (e.g. ``torch.bfloat16`` to halve the file); the
        rotary frequencies and the shipped sinks (the target's own KV, not weights) stay float32, and the mapping
        path computes in float32 either way."""
        tensors = {k: v.to(dtype) if is_weight(k) else v for k, v in self.tensors.items()}
        return KVMap(self.config, tensors)

    # ----- checks against models -----

    def fitted_for(self, source_fingerprint: str, target_fingerprint: str) -> bool:
        """Whether this map was fitted for weights with these fingerprints (`modeling.identity.cached_fingerprint`),
        for a caller that reads them itself: one PEFT model on both sides, its adapter active on one."""
        return (source_fingerprint, target_fingerprint) == (self.config.source_fingerprint,
                                                            self.config.target_fingerprint)

    def check_models(self, source_model: torch.nn.Module | None, target_model: torch.nn.Module,
                     target_key: tuple | None = None) -> None:
        """Refuse models other than the ones this map was fitted for, naming both sides (``target_key``: the
        target's `peft_kvcache.modeling.identity.weights_key`, where the caller read it already)."""
        c = self.config
        actual = {"source": None if source_model is None else cached_fingerprint(source_model),
                  "target": cached_fingerprint(target_model, target_key)}
        if actual["target"] == c.source_fingerprint and actual["source"] in (None, c.target_fingerprint) \
                and c.source_fingerprint != c.target_fingerprint:
            raise FingerprintMismatchError(
                f"this map goes {c.source_name!r} -> {c.target_name!r}, but it is applied with "
                f"{model_name(target_model)!r} as the target: did you swap source and target? Use the map of "
                "the other direction")
        for role, model, expected, name in (("source", source_model, c.source_fingerprint, c.source_name),
                                            ("target", target_model, c.target_fingerprint, c.target_name)):
            if model is None:
                continue
            if actual[role] != expected:
                given = model_name(model)
                hint = ""
                if given.split("+")[0] == name.split("+")[0]:
                    hint = (" The base model is the same, the active adapters differ: run the source with the "
                            "adapter disabled (`with peft_model.disable_adapter():`) or activate the adapter the map "
                            "was fitted for (`peft_model.set_adapter(...)`).")
                raise FingerprintMismatchError(
                    f"this map was fitted for {role} {name!r} (fingerprint {expected[:12]}) but the {role} model "
                    f"given is {given!r} (fingerprint {actual[role][:12]}): a map fits the exact weights it was "
                    f"fitted on (other checkpoints of the same model, e.g. the Hub's where the map was fitted on "
                    f"dequantized GGUF weights, are other weights).{hint} {_how_to_fit(c)}")
            spec = rotary_spec_of(model)
            stored = self.source_rotary if role == "source" else self.target_rotary
            if not same_rotary(spec, stored):
                raise FingerprintMismatchError(
                    f"the {role} model {model_name(model)!r} uses other RoPE frequencies ({spec.describe()}) "
                    f"than this map was fitted with ({stored.describe()})")

    # ----- save / load / push -----

    def save_pretrained(self, save_directory: str | os.PathLike, *, repo_id: str | None = None, chart: bool = True,
                        overwrite: bool = False, push_to_hub: bool = False, **push_to_hub_kwargs) -> Path:
        """Write ``config.json``, ``model.safetensors``, ``README.md`` (its usage snippet loads ``repo_id``, default:
        the folder's name) and, with ``chart``, the layer chart. Returns the folder (``push_to_hub=True`` also
        uploads it to ``repo_id``, see `push_to_hub`).

        The folder is replaced atomically: the map is written into a staging folder beside it which then takes
        its place, so a reader finds the complete old map or the complete new one, never a mix (and, where the
        system can swap two folders in one step, as Linux can, never nothing); a save killed halfway is cleaned up
        (or undone) by the next save or load. A config that would not load again is refused before anything is
        written. Files in the folder that are not the map's are kept (an ``evaluation.json`` only while the config
        cites it: another map's figures are not these weights'). A folder that exists and is not a KV map (a
        model's folder, say) is refused unless ``overwrite=True``.

        Example:
            >>> kv_map.save_pretrained("maps/qwen-0.5b-to-1.5b", repo_id="org/qwen-0.5b-to-1.5b-kvmap")  # doctest: +SKIP
        """
        target = save_map(self.config, self.tensors, save_directory, repo_id=repo_id, chart=chart, overwrite=overwrite)
        if push_to_hub:
            self.push_to_hub(repo_id or target.name, **push_to_hub_kwargs)
        return target

    def push_to_hub(self, repo_id: str, *, branch: str | None = None, token: str | None = None,
                    private: bool | None = None, commit_message: str = "Upload KV map",
                    create_pr: bool | None = None) -> str:
        """Create (if needed) the Hub repo ``repo_id`` and the ``branch``, and upload the map's folder with its card
        (whose usage snippet loads ``repo_id``) in one commit. Returns the commit URL.

        Example:
            >>> kv_map.push_to_hub("my-org/qwen-0.5b-to-1.5b-kvmap", private=True)   # doctest: +SKIP
        """
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        with tempfile.TemporaryDirectory() as tmp:
            # saved first: a map that cannot be saved (a config edited into one that would not load) creates no repo
            folder = self.save_pretrained(Path(tmp) / repo_id.split("/")[-1], repo_id=repo_id)
            created = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
            if created != repo_id:  # the Hub added the namespace: the card's snippet names the full id
                repo_id, folder = created, self.save_pretrained(folder, repo_id=created)
            if branch is not None:
                api.create_branch(repo_id, branch=branch, exist_ok=True)
            info = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=folder,
                                     commit_message=commit_message, revision=branch, create_pr=create_pr)
        logger.info("pushed map %s -> %s to %s", self.config.source_name, self.config.target_name, repo_id)
        return str(getattr(info, "commit_url", None) or info)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *, revision: str | None = None,
                        token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
                        local_files_only: bool = False, force_download: bool = False) -> "KVMap":
        """Load a map from a local folder or a Hub repo (resolved by huggingface_hub: its cache, revisions,
        offline mode and tokens). Only JSON and safetensors are read; nothing is executed.

        A local-looking path that does not exist (``./x``, ``/abs/x``, ``a/b/c``) raises `ArtifactError` without a
        Hub lookup; a repo or file the Hub cannot find raises huggingface_hub's own error; a damaged artifact an
        `ArtifactError`.

        Example:
            >>> kv_map = KVMap.from_pretrained("org/qwen-0.5b-to-1.5b-kvmap", revision="v1")  # doctest: +SKIP
        """
        return cls(*load_map(pretrained_model_name_or_path, revision=revision, token=token, cache_dir=cache_dir,
                             local_files_only=local_files_only, force_download=force_download))

    def _validate_tensors(self) -> None:
        for name, shape in expected_shapes(self.config).items():
            tensor = self.tensors.get(name)
            if tensor is None or tuple(tensor.shape) != shape:
                got = None if tensor is None else tuple(tensor.shape)
                raise ArtifactError(f"map tensor {name!r} should have shape {shape}, got {got}")
            if not tensor.is_floating_point():  # saved, it would not load again
                raise ArtifactError(f"map tensor {name!r} is {tensor.dtype}: a map's tensors are floating point")
            if not torch.isfinite(tensor).all():
                raise ArtifactError(f"map tensor {name!r} contains NaN or Inf")

    def __repr__(self) -> str:
        c = self.config
        return (f"KVMap({c.source_name!r} -> {c.target_name!r}, {c.pair_kind}, "
                f"{c.target_layout.num_layers} target layers, {self.num_parameters:,} parameters)")


def _how_to_fit(config: KVMapConfig) -> str:
    """What to run to fit a map like ``config``'s for the user's own weights."""
    if config.pair_kind == "same_shape":
        return ("Fit maps for your weights: peft-kvcache calibrate-adapters --base <your base model> --adapter "
                "NAME=<adapter folder> --data stdlib --output maps (or AdapterMaps.calibrate)")
    return ("Fit a map for your weights: peft-kvcache calibrate --source <source model> --target <target model> "
            "--data stdlib --output maps/<name> (or KVMap.calibrate)")


def rotary_of_record(record, inv_freq: torch.Tensor) -> RotarySpec:
    """The rotary parameters a map's config records for one side, with that side's stored ``inv_freq``."""
    return RotarySpec(inv_freq=inv_freq, attention_scaling=record.attention_scaling, head_dim=record.head_dim,
                      rope_type=record.rope_type, max_position=record.max_position)


# the folder's names and look-ups (`storage`) stay importable from here, where callers have imported them
__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "KVMap", "is_map_folder", "resolve_map_folder", "rotary_of_record"]
