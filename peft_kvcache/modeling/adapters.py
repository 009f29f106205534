"""PEFT adapters of one model: which act on it now, running a block under one (or none), loading them, and the
one lock every user of a model's adapter state holds."""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..errors import AdapterError, ModelLoadError
from ._compat import unwrap_peft


def _first_tuner_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    if "peft" not in sys.modules:  # no PEFT layer can exist before peft is imported
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    return next((m for m in model.modules() if isinstance(m, BaseTunerLayer)), None)


def active_adapters(model: torch.nn.Module) -> set[str]:
    """Names of the PEFT adapters that currently act on the model's output: empty for a plain model and
    under ``with peft_model.disable_adapter():``. Read from the adapter layers themselves, so the base model
    a `PeftModel` was built on (it holds the same layers) reports the same adapters as the `PeftModel`. PEFT sets
    and disables adapters on every layer at once, so the first layer speaks for all (found without walking the
    whole model: this runs at every switch)."""
    layer = _first_tuner_layer(model)
    if layer is None or layer.disable_adapters:
        return set()
    return set(layer.active_adapters)


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a `PeftModel` (it can switch and disable adapters)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter") and hasattr(model, "set_adapter")


@contextmanager
def adapter_active(model: torch.nn.Module, adapter: str | None) -> Iterator[None]:
    """Run the block with ``adapter`` active on a `PeftModel`, or with every adapter disabled (``None``:
    the base model). The adapter state as it was is restored afterwards, also when the block raises: the active
    adapters (several, where the user set several), whether they were disabled (``adapter`` runs inside
    ``with peft_model.disable_adapter():`` too), and each adapter frozen or trainable as its config says.

    PEFT's active adapter is state of the whole model: callers sharing a model between threads hold its
    `model_lock` around the block.

    Example:
        >>> with adapter_active(peft_model, "shout"):          # doctest: +SKIP
        ...     logits = peft_model(input_ids).logits
    """
    if adapter is not None and (not isinstance(adapter, str) or adapter not in model.peft_config):
        raise AdapterError(f"the model has no adapter {adapter!r}; it has {sorted(model.peft_config)}")
    layer = _first_tuner_layer(model)
    previous = list(layer.active_adapters) if layer is not None else [model.active_adapter]
    disabled = bool(layer is not None and layer.disable_adapters)
    if adapter is None:
        if disabled:  # already the base model (PEFT's context would enable the adapters on leaving)
            yield
            return
        try:
            with model.disable_adapter():
                yield
        finally:
            _set_active(model, previous)  # PEFT enables them trainable on leaving: frozen again where they were
        return
    if previous == [adapter] and not disabled:
        yield
        return
    flagged = getattr(model, "_adapters_disabled", None)  # PeftModel's own flag, which gates its forward hooks
    try:
        if disabled:
            model.base_model.enable_adapter_layers()
            if flagged is not None:
                model._adapters_disabled = False
        _set_active(model, [adapter])
        yield
    finally:
        _set_active(model, previous)
        if disabled:
            model.base_model.disable_adapter_layers()
            if flagged is not None:
                model._adapters_disabled = flagged


def _set_active(model: torch.nn.Module, names: list[str]) -> None:
    """Make ``names`` the active adapters, frozen where every one's config says inference (PEFT's ``set_adapter``
    makes an adapter trainable unless told otherwise)."""
    frozen = all(getattr(model.peft_config.get(name), "inference_mode", True) for name in names)
    target = model if len(names) == 1 else model.base_model  # a PeftModel takes one name
    mode = {"inference_mode": frozen} if _takes_inference_mode(type(target)) else {}
    target.set_adapter(names[0] if len(names) == 1 else names, **mode)


@functools.lru_cache(maxsize=None)
def _takes_inference_mode(cls: type) -> bool:
    """Whether ``cls.set_adapter`` takes ``inference_mode`` (read once per class: a switch runs this)."""
    return "inference_mode" in inspect.signature(cls.set_adapter).parameters


def load_adapters(base_model: torch.nn.Module, adapters: dict[str, str]) -> torch.nn.Module:
    """A `PeftModel` over ``base_model`` with every adapter of ``adapters`` (name -> folder or Hub id) loaded under
    its name; the first one is active.

    Example:
        >>> model = load_adapters(base, {"shout": "adapters/shout", "docstring": "adapters/docstring"})  # doctest: +SKIP
    """
    from peft import PeftModel

    model = None
    for name, path in adapters.items():
        try:
            if model is None:
                model = PeftModel.from_pretrained(base_model, str(path), adapter_name=name)
            else:
                model.load_adapter(str(path), adapter_name=name)
        except (OSError, ValueError, RuntimeError) as err:  # e.g. an adapter trained on another base model
            detail = " ".join(str(err).split())
            raise ModelLoadError(f"adapter {name!r} ({path}) cannot be loaded on "
                                 f"{getattr(base_model.config, 'name_or_path', 'the base model')}: {detail}") from None
    if model is None:
        raise AdapterError("load_adapters needs at least one adapter")
    return model.eval()


def is_activated_lora(model: torch.nn.Module, adapter: str) -> bool:
    """Whether ``adapter`` is an Activated LoRA (it reuses the base cache exactly before its invocation)."""
    return bool(getattr(model.peft_config[adapter], "alora_invocation_tokens", None))


def activated_from(model: torch.nn.Module, adapter: str | None, ids: torch.Tensor) -> int | None:
    """Where an Activated LoRA ``adapter`` starts acting on a request's token ids ``ids`` ``[n]``: PEFT's rule, the
    start of the last occurrence of its invocation tokens (``n`` where they do not occur: it acts nowhere). Every
    position before it holds the base model's KV, every one from it the adapter's, so a cache of the adapter's made
    for another request (another last invocation) is not this request's; None for any other adapter."""
    if adapter is None or not is_activated_lora(model, adapter):
        return None
    from peft.tuners.lora.variants import calculate_alora_offsets  # PEFT's own search, read only for an aLoRA

    from_end = calculate_alora_offsets(model.peft_config, adapter, ids.cpu().long()[None])[0]
    return len(ids) - from_end if from_end is not None else len(ids)


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


