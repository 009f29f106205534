"""What a model is: its name (with its active adapters), a fingerprint of its weights, and memos of values
computed from them."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import IncompatibleModelsError
from ._compat import unwrap_peft, weights_version
from .adapters import active_adapters
from .layout import vocab_size_of


def base_name(model: torch.nn.Module) -> str:
    """Hub id or path of the (base) model, else its architecture."""
    config = unwrap_peft(model).config
    return getattr(config, "name_or_path", "") or getattr(config, "model_type", type(model).__name__)


def model_name(model: torch.nn.Module) -> str:
    """Best human-readable id of what the model runs now: its Hub id or path, with ``+adapter`` for each
    active PEFT adapter (``HuggingFaceTB/SmolLM2-135M-Instruct+shout``)."""
    adapters = sorted(active_adapters(model))
    return "+".join([base_name(model), *adapters])


# A fixed number of evenly spaced weights per tensor: enough to tell models apart, cheap for any size.
_SAMPLES_PER_TENSOR = 64


def _canonical_name(name: str) -> str:
    """Parameter name independent of PEFT wrapping (``base_model.model.`` prefix, ``.base_layer``)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def fingerprint(model: torch.nn.Module) -> str:
    """A sha256 that identifies a model's weights, not the way they were loaded.

    Samples a fixed set of elements from every weight and hashes them rounded to bfloat16, so float32 or
    bfloat16 loads, GGUF-dequantized or safetensors copies and any device give the same digest. The active
    PEFT adapters' weights are included (each adapter is its own model); inactive adapters are not.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
        ...                   intermediate_size=32, vocab_size=16)
        >>> _ = torch.manual_seed(0); a = LlamaForCausalLM(cfg)
        >>> _ = torch.manual_seed(1); b = LlamaForCausalLM(cfg)
        >>> fingerprint(a) == fingerprint(a.to(torch.bfloat16)), fingerprint(a) == fingerprint(b)
        (True, False)
    """
    active = active_adapters(model)
    named = []
    for name, param in sorted(model.named_parameters(), key=lambda item: _canonical_name(item[0])):
        if param.device.type == "meta" or not param.is_floating_point():
            continue
        if ".lora_" in name or "lora_embedding" in name:
            adapter = _adapter_of(name)
            if adapter not in active:
                continue
            name = name.replace(f".{adapter}.", ".adapter.")
        named.append((_canonical_name(name), param.detach()))
    return _digest(named)


def fingerprint_files(model_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None = None) -> str:
    """`fingerprint` of the model whose weights a folder holds (its ``*.safetensors``, as ``save_pretrained`` writes
    them), with the PEFT adapter of ``adapter_dir`` active on top, read from the files without building the model:
    what a serving engine that loads those files (vLLM, say) serves. Tied weights count once, as in the model.

    Only the sampled values are read (a few bytes per tensor, whatever the model's size). Each file's samples, and
    the fingerprint of each set of files, are memoized by the files' identity (path, size, modification time, inode): a
    base model read once serves every adapter's fingerprint, a fingerprint asked again costs a few ``stat`` calls, and
    files replaced at the same path are read again.

    Example:
        >>> fingerprint_files("models/smollm2", "adapters/shout") == fingerprint(peft_model)   # doctest: +SKIP
        True
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise IncompatibleModelsError(f"{model_dir} holds no *.safetensors weights to fingerprint")
    read = files + [model_dir / "config.json"]
    if adapter_dir is not None:
        read += [Path(adapter_dir) / "adapter_config.json", Path(adapter_dir) / "adapter_model.safetensors"]
    key = tuple(_file_identity(path) for path in read)  # an engine asks per request: the digest too is memoized
    if key not in _DIGESTS:
        _remember(_DIGESTS, key, _fingerprint_read(model_dir, files, adapter_dir))
    return _DIGESTS[key]


def _fingerprint_read(model_dir: Path, files: list[Path], adapter_dir: str | os.PathLike | None) -> str:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    named = {}
    for path in files:
        for name, sample in _file_samples(path).items():
            if name == "lm_head.weight" and config.get("tie_word_embeddings", False):
                continue  # the model shares the embeddings' tensor: one parameter
            named[_canonical_name(name)] = sample
    if adapter_dir is not None:
        adapter_config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text(encoding="utf-8"))
        if adapter_config.get("peft_type") != "LORA" or adapter_config.get("modules_to_save"):
            raise IncompatibleModelsError(f"{adapter_dir}: only LoRA adapters without modules_to_save can be "
                                          "fingerprinted from their files")
        for name, sample in _file_samples(Path(adapter_dir) / "adapter_model.safetensors").items():
            parts = name.split(".")  # "...q_proj.lora_A.weight": the adapter's name is not in the file
            lora = next(i for i, part in enumerate(parts) if part.startswith("lora_"))
            named[_canonical_name(".".join(parts[: lora + 1] + ["adapter"] + parts[lora + 1:]))] = sample
    return _digest_samples(sorted((n, s) for n, s in named.items() if s is not None))


_FILE_SAMPLES: dict[tuple, dict] = {}
_DIGESTS: dict[tuple, str] = {}
_MEMO_SIZE = 256


def _file_identity(path: Path) -> tuple:
    """What changes when a file is replaced or rewritten at the same path."""
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino


def _remember(memo: dict, key: tuple, value) -> None:
    if len(memo) >= _MEMO_SIZE:
        memo.pop(next(iter(memo)))
    memo[key] = value


def _file_samples(path: Path) -> dict:
    """``{tensor name: (shape, sampled values) or None}`` of one safetensors file, memoized by the file's identity.
    Only the sampled values' bytes are read: the header gives each tensor's offset, and the file is mapped, not read."""
    key = _file_identity(path)
    if key not in _FILE_SAMPLES:
        _remember(_FILE_SAMPLES, key, _read_samples(path))
    return _FILE_SAMPLES[key]


# safetensors dtype names of floating-point tensors -> their torch dtypes (others are not fingerprinted)
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _read_samples(path: Path) -> dict:
    import numpy as np

    with open(path, "rb") as f:
        header_size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_size))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_size)
    samples = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _FLOAT_DTYPES.get(info["dtype"])
        if dtype is None:
            samples[name] = None
            continue
        shape, size = tuple(info["shape"]), dtype.itemsize
        flat = _sample_index(math.prod(shape)).numpy()
        offsets = (info["data_offsets"][0] + flat[:, None] * size + np.arange(size)).reshape(-1)
        values = torch.frombuffer(bytearray(np.asarray(data[offsets]).tobytes()), dtype=dtype)
        samples[name] = (shape, values)
    return samples


def _sample_index(numel: int) -> torch.Tensor:
    """The ``_SAMPLES_PER_TENSOR`` evenly spaced flat positions a fingerprint reads of a tensor of ``numel``."""
    count = min(_SAMPLES_PER_TENSOR, numel)
    return torch.arange(count) * (numel - 1) // max(count - 1, 1)


def _digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (canonical name, shape, ``_SAMPLES_PER_TENSOR`` evenly spaced values rounded to bfloat16)."""
    return _digest_samples([(name, (tuple(tensor.shape), tensor.reshape(-1)[_sample_index(tensor.numel()).to(
        tensor.device)])) for name, tensor in named])


def _digest_samples(samples: list[tuple[str, tuple[tuple[int, ...], torch.Tensor]]]) -> str:
    digest = hashlib.sha256()
    for name, (shape, values) in samples:
        digest.update(name.encode())
        digest.update(str(shape).encode())
        digest.update(values.to(torch.bfloat16).cpu().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def _adapter_of(param_name: str) -> str:
    # e.g. "...q_proj.lora_A.my_adapter.weight" -> "my_adapter"
    parts = param_name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("lora_") and i + 1 < len(parts):
            return parts[i + 1]
    return ""


def weights_key(model: torch.nn.Module, version: tuple | None = None) -> tuple:
    """What a memo of anything computed from the model's weights is keyed on: the active adapters and the
    weights' version (`_compat.weights_version`, read here unless given: switching adapters leaves it as it is), so
    loading other weights invalidates it."""
    return tuple(sorted(active_adapters(model))), weights_version(model) if version is None else version


class ModelMemo:
    """Values computed from a model, kept outside the user's object: per transformers model (weakly, so the memo
    goes with the model), the ``size`` most recent keys, oldest dropped first."""

    def __init__(self, size: int):
        self.size = size
        self._memos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        _EVERY_MEMO.add(self)

    def get(self, model: torch.nn.Module, key, compute: Callable[[], Any]):
        """The value memoized for ``(model, key)``, computed by ``compute()`` the first time."""
        memo = self._memos.setdefault(unwrap_peft(model), {})
        if key not in memo:
            if len(memo) >= self.size:
                memo.pop(next(iter(memo)))
            memo[key] = compute()
        return memo[key]

    def holds(self, model: torch.nn.Module, key) -> bool:
        """Whether a value is memoized for ``(model, key)``."""
        return key in self._memos.get(unwrap_peft(model), {})

    def clear(self) -> None:
        """Forget every value (e.g. to time or count a cold pass)."""
        self._memos.clear()

    def forget(self, model: torch.nn.Module) -> None:
        """Forget the values of one model."""
        self._memos.pop(unwrap_peft(model), None)


_EVERY_MEMO: "weakref.WeakSet[ModelMemo]" = weakref.WeakSet()  # what `forget_weights` clears


def forget_weights(model: torch.nn.Module) -> None:
    """Forget everything the library memoized from ``model``'s weights (its fingerprint, the attention sinks it
    computed). Call it after writing the weights in a way torch does not count: the memos are keyed on each
    parameter's storage and torch's in-place version counter (`weights_key`), which an optimizer step, ``copy_`` or
    ``load_state_dict`` moves but a write through ``.data`` (an EMA update, weight surgery) does not.

    Example:
        >>> model.model.layers[0].self_attn.k_proj.weight.data.mul_(2)   # doctest: +SKIP
        >>> forget_weights(model)                                          # doctest: +SKIP
    """
    for memo in list(_EVERY_MEMO):
        memo.forget(model)


_FINGERPRINTS = ModelMemo(8)


def cached_fingerprint(model: torch.nn.Module, key: tuple | None = None) -> str:
    """`fingerprint`, memoized per model object outside it (hashing is cheap but not free on the hot path of
    every switch) and recomputed when its weights or active adapters change; ``key``: the model's `weights_key`
    where the caller holds it already (reading it walks every parameter)."""
    return _FINGERPRINTS.get(model, weights_key(model) if key is None else key, lambda: fingerprint(model))


def check_pair(source_model: torch.nn.Module, target_model: torch.nn.Module, tokenizer=None) -> None:
    """Refuse a source/target pair that cannot share token ids (different vocabularies or tokenizer)."""
    source_vocab, target_vocab = vocab_size_of(source_model), vocab_size_of(target_model)
    if source_vocab != target_vocab:
        raise IncompatibleModelsError(
            f"source {model_name(source_model)!r} has a vocabulary of {source_vocab} tokens and target "
            f"{model_name(target_model)!r} has {target_vocab}: a KV map needs models that share one tokenizer"
        )
    if tokenizer is not None and len(tokenizer) > source_vocab:
        raise IncompatibleModelsError(
            f"the tokenizer has {len(tokenizer)} tokens but {model_name(source_model)!r} embeds only "
            f"{source_vocab}: it is not these models' tokenizer"
        )


