"""Facts about a transformers (or PEFT) causal LM that a map depends on: its KV layout, the device and dtype
of each decoder layer, which PEFT adapters act on it, its name and a fingerprint of its weights."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._compat import unwrap_peft, weights_version
from .errors import CacheMismatchError, CLIUsageError, IncompatibleModelsError, SessionError
from .positions import head_dim_of


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV cache: ``num_layers`` layers of ``[batch, kv_heads, seq, head_dim]``."""

    num_layers: int
    kv_heads: int
    head_dim: int

    @property
    def layer_width(self) -> int:
        """Features per token in one layer (all KV heads side by side)."""
        return self.kv_heads * self.head_dim

    @classmethod
    def of(cls, model: torch.nn.Module) -> "KVLayout":
        """Layout of a model from its config (``head_dim`` derived where the config leaves it unset)."""
        config = model.config
        return cls(
            num_layers=int(config.num_hidden_layers),
            kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            head_dim=head_dim_of(config),
        )


def layer_features(states: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads, seq, head_dim]`` -> ``[batch, seq, kv_heads * head_dim]`` (heads side by side)."""
    batch, heads, seq, dim = states.shape
    return states.transpose(1, 2).reshape(batch, seq, heads * dim)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers (``model.model.layers`` for Llama/Qwen2-style models)."""
    decoder = unwrap_peft(model).get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise IncompatibleModelsError(f"cannot find the decoder layers of {type(decoder).__name__}")
    return layers


def layer_placements(model: torch.nn.Module) -> list[tuple[torch.device, torch.dtype]]:
    """(device, dtype) of each decoder layer, read from its own parameters, so that accelerate's
    ``device_map`` placement is honoured whether or not ``hf_device_map`` is set."""
    placements = []
    for layer in decoder_layers(model):
        weight = next(p for p in layer.parameters() if p.is_floating_point())
        placements.append((weight.device, weight.dtype))
    return placements


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's inputs go: the device of its first parameter (the embeddings)."""
    return next(model.parameters()).device


def vocab_size_of(model: torch.nn.Module) -> int:
    """Vocabulary size of the model's input embeddings."""
    return int(unwrap_peft(model).get_input_embeddings().weight.shape[0])


# ----- PEFT adapters -----


def _tuner_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    if "peft" not in sys.modules:  # no PEFT layer can exist before peft is imported
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def active_adapters(model: torch.nn.Module) -> set[str]:
    """Names of the PEFT adapters that currently act on the model's output: empty for a plain model and
    under ``with peft_model.disable_adapter():``. Read from the adapter layers themselves, so the base model
    a `PeftModel` was built on (it holds the same layers) reports the same adapters as the `PeftModel`."""
    layers = _tuner_layers(model)
    if not layers or any(layer.disable_adapters for layer in layers):
        return set()
    return set(layers[0].active_adapters)


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a `PeftModel` (it can switch and disable adapters)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter") and hasattr(model, "set_adapter")


@contextmanager
def adapter_active(model: torch.nn.Module, adapter: str | None) -> Iterator[None]:
    """Run the block with ``adapter`` active on a `PeftModel`, or with every adapter disabled (``None``:
    the base model). The previously active adapter is restored afterwards, also when the block raises.

    PEFT's active adapter is state of the whole model: callers sharing a model between threads hold its
    `model_lock` around the block.

    Example:
        >>> with adapter_active(peft_model, "shout"):          # doctest: +SKIP
        ...     logits = peft_model(input_ids).logits
    """
    if adapter is None:
        with model.disable_adapter():
            yield
        return
    if adapter not in model.peft_config:
        raise SessionError(f"the model has no adapter {adapter!r}; it has {sorted(model.peft_config)}")
    previous = model.active_adapter
    model.set_adapter(adapter)
    try:
        yield
    finally:
        if previous != adapter:
            model.set_adapter(previous)


def load_adapters(base_model: torch.nn.Module, adapters: dict[str, str]) -> torch.nn.Module:
    """A `PeftModel` over ``base_model`` with every adapter of ``adapters`` (name -> folder or Hub id) loaded under
    its name; the first one is active.

    Example:
        >>> model = load_adapters(base, {"shout": "adapters/shout", "docstring": "adapters/docstring"})  # doctest: +SKIP
    """
    from peft import PeftModel

    model = None
    for name, path in adapters.items():
        if model is None:
            model = PeftModel.from_pretrained(base_model, str(path), adapter_name=name)
        else:
            model.load_adapter(str(path), adapter_name=name)
    if model is None:
        raise SessionError("load_adapters needs at least one adapter")
    return model.eval()


def parse_adapter_specs(specs: Sequence[str]) -> dict[str, str]:
    """``{name: folder or Hub id}`` from ``--adapter NAME=PATH`` arguments, checked before any model loads (a
    `CLIUsageError` for a malformed, repeated or unusable one; names hold no ':', which clients use as base:adapter).
    """
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CLIUsageError(f"--adapter {spec!r}: expected NAME=PATH (a folder saved by PEFT or a Hub repo id)")
        if name in adapters:
            raise CLIUsageError(f"--adapter {name!r} is given twice")
        if ":" in name:
            raise CLIUsageError(f"--adapter {name!r}: a name holds no ':' (clients may write base:adapter)")
        local = Path(path).expanduser()
        if local.exists() and not (local / "adapter_config.json").is_file():
            raise CLIUsageError(f"--adapter {spec!r}: {path} holds no adapter_config.json (not a PEFT adapter)")
        if not local.exists() and not is_repo_id(path):
            raise CLIUsageError(f"--adapter {spec!r}: {path} is neither a folder nor a Hub repo id")
        adapters[name] = str(local) if local.exists() else path
    return adapters


def is_repo_id(spec: str) -> bool:
    """Whether ``spec`` reads as a Hub repo id (``owner/name``) rather than a local path: not explicit (``./``,
    ``~``, absolute), one slash, and valid by the Hub's rules. Code that falls back to the Hub asks this first,
    so a missing local folder is reported as missing instead of being looked up."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if spec.startswith((".", "~", os.sep)) or os.path.isabs(spec) or spec.count("/") != 1:
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def is_activated_lora(model: torch.nn.Module, adapter: str) -> bool:
    """Whether ``adapter`` is an Activated LoRA (it reuses the base cache exactly before its invocation)."""
    return bool(getattr(model.peft_config[adapter], "alora_invocation_tokens", None))


_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: torch.nn.Module) -> threading.RLock:
    """The one lock of a model object (and of the transformers model under a `PeftModel`, which holds the same
    weights and adapter state): every wrapper and session that switches adapters or runs the model holds it.

    Example:
        >>> with model_lock(peft_model), adapter_active(peft_model, "shout"):   # doctest: +SKIP
        ...     out = peft_model.generate(ids)
    """
    owner = unwrap_peft(model)
    with _LOCKS_GUARD:
        lock = _LOCKS.get(owner)
        if lock is None:
            lock = _LOCKS[owner] = threading.RLock()
        return lock


# ----- names and fingerprints -----


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
        >>> torch.manual_seed(0); a = LlamaForCausalLM(cfg); torch.manual_seed(1); b = LlamaForCausalLM(cfg)
        >>> fingerprint(a) == fingerprint(a.to(torch.bfloat16)), fingerprint(a) == fingerprint(b)
        (True, False)
    """
    active = active_adapters(model)
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: _canonical_name(item[0])):
        if param.device.type == "meta" or not param.is_floating_point():
            continue
        if ".lora_" in name or "lora_embedding" in name:
            adapter = _adapter_of(name)
            if adapter not in active:
                continue
            name = name.replace(f".{adapter}.", ".adapter.")
        flat = param.detach().reshape(-1)
        count = min(_SAMPLES_PER_TENSOR, flat.numel())
        index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
        sample = flat[index].to(torch.bfloat16).cpu().view(torch.int16)
        digest.update(_canonical_name(name).encode())
        digest.update(str(tuple(param.shape)).encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def _adapter_of(param_name: str) -> str:
    # e.g. "...q_proj.lora_A.my_adapter.weight" -> "my_adapter"
    parts = param_name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("lora_") and i + 1 < len(parts):
            return parts[i + 1]
    return ""


def weights_key(model: torch.nn.Module) -> tuple:
    """What a memo of anything computed from the model's weights is keyed on: the active adapters and the
    weights' version (`_compat.weights_version`), so loading other weights invalidates it."""
    return tuple(sorted(active_adapters(model))), weights_version(model)


class ModelMemo:
    """Values computed from a model, kept outside the user's object: per transformers model (weakly, so the memo
    goes with the model), the ``size`` most recent keys, oldest dropped first."""

    def __init__(self, size: int):
        self.size = size
        self._memos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, model: torch.nn.Module, key, compute: Callable[[], Any]):
        """The value memoized for ``(model, key)``, computed by ``compute()`` the first time."""
        memo = self._memos.setdefault(unwrap_peft(model), {})
        if key not in memo:
            if len(memo) >= self.size:
                memo.pop(next(iter(memo)))
            memo[key] = compute()
        return memo[key]

    def clear(self) -> None:
        """Forget every value (e.g. to time or count a cold pass)."""
        self._memos.clear()


_FINGERPRINTS = ModelMemo(8)


def cached_fingerprint(model: torch.nn.Module) -> str:
    """`fingerprint`, memoized per model object outside it (hashing is cheap but not free on the hot path of
    every switch) and recomputed when its weights or active adapters change."""
    return _FINGERPRINTS.get(model, weights_key(model), lambda: fingerprint(model))


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


def check_token_ids(ids, vocab_size: int | None, name: str = "input_ids", dims: tuple[int, ...] = (2,),
                    error: type[Exception] = CacheMismatchError) -> torch.Tensor:
    """Refuse ids that are not an integer tensor of ``dims`` dimensions, are empty, or lie outside
    ``[0, vocab_size)`` (``None``: any non-negative id), with ``error`` saying what to pass; returns them as a
    long tensor."""
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError) as err:  # ragged lists, strings, objects
            raise error(f"{name} must be a tensor of token ids (or a rectangular list): {err}") from None
    shape = " or ".join({1: "[seq]", 2: "[batch, seq]"}[d] for d in dims)
    if ids.dim() not in dims:
        raise error(f"{name} must be a {shape} tensor of token ids, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise error(f"{name} must hold integer token ids, got {ids.dtype}")
    if ids.numel() == 0:
        raise error(f"{name} is empty; pass at least one token id")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        raise error(f"{name} holds token id {bad}, outside the vocabulary of {vocab_size} tokens")
    return ids.long()
