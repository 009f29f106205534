"""A map's folder, which is exactly what goes to the Hub: ``config.json``, ``model.safetensors`` (never pickle) and
a ``README.md`` model card, saved atomically and resolved from the Hub with ``snapshot_download`` (huggingface_hub owns
the Hub; this module only says what goes in the folder). `KVMap.save_pretrained` and `KVMap.from_pretrained` are
`save_map` and `load_map`. No huggingface_hub ``ModelHubMixin``: its ``from_pretrained`` parses config.json itself
before any hook runs and its ``save_pretrained`` deletes config.json in the live folder before writing, which would
break the validation and the atomic save below."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .._files import UMASK, atomic_write, is_repo_id, recover_folder, replace_folder, staging_folder
from ..errors import ArtifactError
from .card import CHART_NAME, plot_layer_selection, render_card
from .config import FORMAT_VERSION, KVMapConfig, expected_shapes, weights_dtype

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
MAP_FILES = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, CHART_NAME)
EVALUATION_NAME = "evaluation.json"  # the measured figures of these weights (`record_figures`), which the config cites
_MAX_CONFIG_BYTES = 64 * 2**20
_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def save_map(config: KVMapConfig, tensors: dict[str, torch.Tensor], save_directory: str | os.PathLike, *,
             repo_id: str | None = None, chart: bool = True, overwrite: bool = False) -> Path:
    """Write a map's folder atomically and return it (`KVMap.save_pretrained` says what goes in and how)."""
    target = check_save_target(save_directory, overwrite)
    config_text = json.dumps(config.to_dict(), indent=2) + "\n"
    # a map built in Python (e.g. an edited config) must load again: the check `from_pretrained` will run
    KVMapConfig.from_dict(json.loads(config_text), "the map's config (not saved)")
    staging = staging_folder(target)
    try:
        has_chart = chart and plot_layer_selection(config, staging / CHART_NAME) is not None
        if target.is_dir() and _holds_tensors(target / WEIGHTS_NAME, tensors):
            # the same weights (a card rendered again): keep the file's bytes, which safetensors' header order
            # would otherwise shuffle
            shutil.copy2(target / WEIGHTS_NAME, staging / WEIGHTS_NAME)
        else:
            save_weights(tensors, staging / WEIGHTS_NAME)
        (staging / CONFIG_NAME).write_text(config_text)
        render_card(config, repo_id or target.name, chart=has_chart, weights_dtype=weights_dtype(tensors)).save(
            staging / CARD_NAME)
        for path in staging.iterdir():  # safetensors writes its file 0600: give every file the umask's mode
            os.chmod(path, 0o666 & ~UMASK)
        if target.is_dir():
            # another map's evaluation is not this one's: kept only while the config still cites it
            cited = {figure.results for figure in config.quality.figures.values()}
            _keep_other_files(target, staging, skip=() if EVALUATION_NAME in cited else (EVALUATION_NAME,))
        replace_folder(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("saved map %s -> %s to %s", config.source_name, config.target_name, target)
    return target


def check_save_target(save_directory: str | os.PathLike, overwrite: bool = False) -> Path:
    """The folder a map will be saved to, refused (`ArtifactError`) where it cannot be: a file, or a folder that is
    not a map's (unless ``overwrite``); a swap a crash left half done is finished first. Cheap: callers run it before
    any model does (a calibration's hours are not lost to a bad ``--output``)."""
    target = Path(save_directory)
    if target.is_symlink():
        target = target.resolve()
    if target.exists() and not target.is_dir():
        raise ArtifactError(f"cannot save a map to {target}: it is a file, not a folder")
    recover_folder(target, _complete)
    if target.is_dir() and any(target.iterdir()) and not is_map_folder(target) and not overwrite:
        raise ArtifactError(f"{target} exists and is not a KV map folder (no peft-kvcache config.json): "
                            "refusing to replace it; pass overwrite=True or choose another folder")
    return target


def load_map(path_or_repo_id: str | os.PathLike, *, revision: str | None = None,
             **hub_options) -> tuple[KVMapConfig, dict[str, torch.Tensor]]:
    """The validated config and tensors of the map in a local folder or a Hub repo (`KVMap.from_pretrained` says
    what is checked); ``hub_options`` go to ``snapshot_download`` (`resolve_map_folder`)."""
    folder = resolve_map_folder(path_or_repo_id, revision=revision, **hub_options)
    weights_path = folder / WEIGHTS_NAME
    if (folder / CONFIG_NAME).is_file() and not weights_path.is_file():
        raise ArtifactError(f"{folder} is not a KV map: {WEIGHTS_NAME} is missing (a card whose weights are kept "
                            "out of git holds its config.json and README.md: load the map from where it was published)")
    for _ in range(READ_ATTEMPTS):  # a save swaps the whole folder: a read that saw two folders is read again
        before = _folder_identity(folder)
        config = load_config(folder)
        tensors = _read_tensors(weights_path, expected_shapes(config))
        if _folder_identity(folder) == before:
            return config, tensors
    raise ArtifactError(f"{folder} was replaced while it was read, {READ_ATTEMPTS} times: load it again once the "
                        "process writing it is done")


READ_ATTEMPTS = 3


def _folder_identity(folder: Path) -> tuple[int, int] | None:
    """The folder's device and inode (`replace_folder` swaps in a new folder: the config and the weights are read
    from one only if these did not change in between)."""
    try:
        info = os.stat(folder)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def load_config(folder: Path) -> KVMapConfig:
    """The validated config of the map in a local ``folder``, its weights not read (nor needed)."""
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise ArtifactError(f"{folder} is not a KV map: {CONFIG_NAME} is missing")
    if config_path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ArtifactError(f"{config_path} is {config_path.stat().st_size:,} bytes, too large for a map config")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ArtifactError(f"{config_path} cannot be read: {err}") from None
    except (ValueError, RecursionError) as err:  # JSON and UTF-8 errors, and integers past Python's digit limit
        raise ArtifactError(f"{config_path} is not valid JSON: {err}") from None
    return KVMapConfig.from_dict(data, where=str(config_path))


def _read_tensors(weights_path: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The map's tensors, their names, shapes and dtypes checked against the header before any is read."""
    tensors = {}
    try:
        with safe_open(weights_path, framework="pt") as handle:
            names = set(handle.keys())
            if names != set(expected):
                raise ArtifactError(
                    f"{weights_path} holds tensors {sorted(names - set(expected))[:4]} it should not and lacks "
                    f"{sorted(set(expected) - names)[:4]}; the file does not match its config.json")
            for name, shape in expected.items():
                sliced = handle.get_slice(name)  # the header gives shapes: refuse mismatches without allocating
                if tuple(sliced.get_shape()) != shape or sliced.get_dtype() not in _FLOAT_DTYPES:
                    raise ArtifactError(f"tensor {name!r} in {weights_path} is {sliced.get_dtype()} "
                                        f"{tuple(sliced.get_shape())}; config.json implies a float tensor of shape {shape}")
                tensor = handle.get_tensor(name)
                # stored weights keep their dtype (bfloat16 halves the file); inv_freq is always float32
                tensors[name] = tensor.float() if name.endswith("inv_freq") or tensor.dtype == torch.float64 else tensor
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ArtifactError(f"{weights_path} is corrupted or truncated: {err}") from None
    return tensors


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write a map's weights to ``path``, the same bytes for the same tensors (`sort_weights_metadata`)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, path,
              metadata={"format": "pt", "peft_kvcache_format": str(FORMAT_VERSION)})
    _sort_metadata(path)


def sort_weights_metadata(path: Path) -> bool:
    """Write the weights file ``path`` again, atomically, with its header's metadata in sorted order where an older
    writer left it otherwise (the same tensors and bytes else); returns whether it changed. safetensors orders that
    metadata by a hash seeded per process, so one map's weights made either of two files (and fingerprints)."""
    metadata = list(weights_header(path)[1].get("__metadata__", {}))
    if metadata == sorted(metadata):
        return False
    atomic_write(path, lambda tmp: (shutil.copyfile(path, tmp), _sort_metadata(Path(tmp))))
    return True


def weights_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header: its length in bytes and its JSON (metadata and each tensor's entry); a length past
    the file's size reads what the file holds (the JSON then fails to parse: ValueError)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return length, json.loads(f.read(min(length, path.stat().st_size)))


def header_bytes(header: dict, length: int) -> bytes:
    """``header`` (`weights_header`'s JSON, its entries reordered) as safetensors writes it: compact JSON padded with
    spaces to ``length`` bytes, so the tensors' offsets stay as they are."""
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > length:  # safetensors' own JSON is as compact: not expected for the same entries
        raise ArtifactError(f"a weights header of {len(text)} bytes does not fit the {length} the file holds")
    return text.ljust(length)


def _sort_metadata(path: Path) -> None:
    """Sort the header's metadata of the weights file ``path`` in place (the same keys: the header keeps its length)."""
    length, header = weights_header(path)
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(header_bytes(header, length))


def _holds_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the safetensors file ``path`` holds exactly ``tensors`` (names, dtypes and values)."""
    try:
        with safe_open(path, framework="pt") as handle:
            if set(handle.keys()) != set(tensors):
                return False
            return all(torch.equal(handle.get_tensor(name), tensor) and handle.get_tensor(name).dtype == tensor.dtype
                       for name, tensor in tensors.items())
    except (SafetensorError, OSError, RuntimeError):
        return False


def is_map_folder(folder: Path, complete: bool = False) -> bool:
    """Whether ``folder`` holds a peft-kvcache map (its ``config.json`` carries our keys); with ``complete``, its
    weights file too."""
    config = folder / CONFIG_NAME
    try:
        if not config.is_file() or config.stat().st_size > _MAX_CONFIG_BYTES:
            return False
        if complete and not (folder / WEIGHTS_NAME).is_file():
            return False
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return _is_map_config(data)


def _is_map_config(data) -> bool:
    return isinstance(data, dict) and "source_fingerprint" in data and "format_version" in data


def _complete(folder: Path) -> bool:
    return is_map_folder(folder, complete=True)


def _keep_other_files(old: Path, staging: Path, skip: tuple[str, ...] = ()) -> None:
    """Hard-link (or copy) the files of the old folder that are not the map's (nor named in ``skip``) into the
    staging folder."""
    for entry in old.iterdir():
        if entry.name in MAP_FILES or entry.name in skip or (staging / entry.name).exists():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, staging / entry.name, symlinks=True)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), staging / entry.name)
        else:
            try:
                os.link(entry, staging / entry.name)
            except OSError:
                shutil.copy2(entry, staging / entry.name)


def resolve_map_folder(path_or_repo_id: str | os.PathLike, *, revision: str | None = None, **hub_options) -> Path:
    """The local folder holding a map: ``path_or_repo_id`` itself when it is a folder (undoing a save killed
    halfway there), else the Hub snapshot of repo ``path_or_repo_id`` at ``revision`` (``snapshot_download`` of
    the map's files, one commit).

    Example:
        >>> resolve_map_folder("org/qwen-0.5b-to-1.5b-kvmap", local_files_only=True)   # doctest: +SKIP
        PosixPath('~/.cache/huggingface/hub/models--org--qwen-0.5b-to-1.5b-kvmap/snapshots/<commit>')
    """
    spec = str(path_or_repo_id)
    path = Path(spec).expanduser()
    recover_folder(path, _complete)
    if path.is_dir():
        return path
    if path.exists():
        raise ArtifactError(f"{path} is a file; a KV map is a folder holding {CONFIG_NAME} and {WEIGHTS_NAME}")
    if not is_repo_id(spec):
        raise ArtifactError(f"there is no map folder at {spec!r} (and it is not a Hub repo id): check the path")
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    def fetch(patterns: list[str], at: str | None) -> Path:
        try:
            return Path(snapshot_download(spec, revision=at, allow_patterns=patterns, repo_type="model", **hub_options))
        except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled) as err:  # the Hub's own errors pass
            err.add_note(f"peft-kvcache: there is no local folder {spec!r} either, so it was looked up on the Hub")
            raise
        except (ValueError, OSError) as err:
            raise ArtifactError(f"{spec!r} cannot be resolved from the Hub cache: {err}") from None

    # config.json first: a model's repo id passed as a map's is refused before its weights (gigabytes) download
    snapshot = fetch([CONFIG_NAME], revision)
    cache = Path(hub_options.get("cache_dir") or constants.HF_HUB_CACHE).resolve()
    if not snapshot.resolve().is_relative_to(cache):  # a tampered refs/<revision> file
        raise ArtifactError(f"the Hub cache's revision of {spec!r} points outside the cache ({snapshot}); delete "
                            f"{cache / ('models--' + spec.replace('/', '--'))} and download it again")
    if _another_config(snapshot / CONFIG_NAME):
        raise ArtifactError(f"{spec!r} is not a KV map: its {CONFIG_NAME} lacks a map's keys (a model's repo? pass the "
                            "map's repo id, as a map card's usage snippet names it)")
    return fetch(list(MAP_FILES), snapshot.name)  # the commit whose config was read


def _another_config(path: Path) -> bool:
    """Whether ``path`` is a readable JSON object that is not a map's config (a model's, say); a damaged one is left
    to `load_config`, which says what is wrong with it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.stat().st_size <= _MAX_CONFIG_BYTES else None
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and not _is_map_config(data)
