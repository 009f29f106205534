"""Every place peft-kvcache depends on how transformers (or torch) behave inside, in one small module.

transformers 5.24 renamed the cache argument of ``forward``/``generate`` from ``past_key_values`` to
``cache`` (the old name warns and goes away in 5.40 / 6.0); the name is detected once per model class, so a
model class that still takes ``past_key_values`` works too. The other functions read state transformers does
not document as public; ``tests/test_compat.py`` checks each against the installed version and fails loudly
when one breaks.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from ..errors import IncompatibleModelsError

logger = logging.getLogger(__name__)


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a `PeftModel` (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@lru_cache(maxsize=None)
def _cache_argument_of(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_argument(model: torch.nn.Module) -> str:
    """``"cache"`` where the model's ``forward`` and ``generate`` take it (transformers >= 5.24), else
    ``"past_key_values"``.

    Example:
        >>> model(input_ids=ids, **{cache_argument(model): cache})   # doctest: +SKIP
    """
    return _cache_argument_of(type(unwrap_peft(model)))


def with_cache(model: torch.nn.Module, cache: Cache | None) -> dict:
    """The keyword argument that hands ``cache`` to ``model(...)`` or ``model.generate(...)``."""
    return {cache_argument(model): cache}


def output_cache(output) -> Cache:
    """The cache a forward pass returned (``output.cache`` since 5.24, ``output.past_key_values`` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def update_positions(update_kwargs: dict) -> torch.Tensor | None:
    """The ``position_ids`` of the tokens a ``Cache.update`` call appends: attention modules forward their
    keyword arguments to ``update`` as ``kwargs=...``; ``None`` where they do not."""
    forwarded = update_kwargs.get("kwargs")
    position_ids = update_kwargs.get("position_ids")
    if position_ids is None and isinstance(forwarded, dict):
        position_ids = forwarded.get("position_ids")
    return position_ids if isinstance(position_ids, torch.Tensor) else None


def attention_implementation(model: torch.nn.Module) -> str:
    """The attention implementation a model runs (``"eager"``, ``"sdpa"``, ...)."""
    return unwrap_peft(model).config._attn_implementation


@contextmanager
def _attention_as(model: torch.nn.Module, implementation: str) -> Iterator[bool]:
    """Run the block with the model's attention set to ``implementation`` (yields whether the model took it), then put
    its previous implementation back. The model's state changes meanwhile: no other thread may run it (the library
    holds its `model_lock` where models are shared)."""
    previous = attention_implementation(model)
    model.set_attn_implementation(implementation)  # transformers only warns where a model cannot switch
    try:
        yield attention_implementation(model) == implementation
    finally:
        model.set_attn_implementation(previous)


GROUPED_EAGER = "peft_kvcache_grouped_eager"


def _grouped_eager(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention (the one that returns the attention weights) without copying KV heads: each KV
    head is multiplied against the block of query heads it serves, where transformers repeats every KV head once per
    query head (at 8k tokens of context, Qwen2.5-1.5B's probe pass copied 6x its whole cache per layer). A model whose
    attention adds to the plain softmax (a softcap, sinks) runs its own eager attention."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if own is None:
            raise IncompatibleModelsError(f"{type(module).__name__} has no eager attention function to read attention "
                                          "weights from; load the model with attn_implementation='eager'")
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    batch, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    scaling = head_dim ** -0.5 if scaling is None else scaling
    # query heads j * groups .. (j + 1) * groups - 1 read KV head j: one [groups * length] block per KV head
    blocks = query.reshape(batch, kv_heads, groups * length, head_dim)
    weights = torch.matmul(blocks, key.transpose(2, 3)).view(batch, heads, length, -1) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights.view(batch, kv_heads, groups * length, -1), value)
    return output.view(batch, heads, length, head_dim).transpose(1, 2).contiguous(), weights


AttentionInterface.register(GROUPED_EAGER, _grouped_eager)
AttentionMaskInterface.register(GROUPED_EAGER, eager_mask)


@contextmanager
def eager_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the block with the model's attention computing attention weights (`_grouped_eager`: transformers' eager
    attention without copying KV heads; transformers' own eager where a model cannot take it), then put its
    implementation back (`_attention_as`). A model that can run neither raises `IncompatibleModelsError`."""
    with _attention_as(model, GROUPED_EAGER) as grouped:
        if grouped:
            yield
            return
    with _attention_as(model, "eager") as switched:
        if not switched:
            raise IncompatibleModelsError(f"{type(unwrap_peft(model)).__name__} cannot run eager attention, which gives "
                                          "the attention weights needed here; load it with attn_implementation='eager'")
        yield


GROUPED_SDPA = "peft_kvcache_grouped_sdpa"


def _grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that on the CPU an explicit mask over grouped KV heads goes to torch's
    SDPA with ``enable_gqa``: transformers copies every KV head once per query head it serves whenever a mask is
    given (CUDA's fast kernels take no mask with grouped heads), and for a refresh pass over an 8k-token context
    (Qwen2.5-1.5B: 6 query heads per KV head) that copy took as long as the attention itself."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = kwargs.get("softcap") is None and kwargs.get("position_bias") is None and not kwargs.get("output_attentions")
    if attention_mask is None or not grouped or not plain or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                              dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


@contextmanager
def masked_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the block with an attention that honours an explicit ``[batch, 1, queries, keys]`` additive mask, then put
    the model's own back (`_attention_as`): eager attention stays; any other (SDPA, FlashAttention, flex, a kernel
    registered with transformers) runs `_grouped_sdpa` meanwhile (FlashAttention reads a 4D mask as a padding mask:
    wrong attention, or an out-of-range gather on CUDA), or plain SDPA where a model cannot take it. A model that can
    run neither raises `IncompatibleModelsError`."""
    implementation = attention_implementation(model)
    if implementation in ("eager", GROUPED_EAGER):
        yield
        return
    with _attention_as(model, GROUPED_SDPA) as grouped:
        if grouped or implementation == "sdpa":
            yield
            return
    with _attention_as(model, "sdpa") as switched:
        if not switched:
            raise IncompatibleModelsError(f"{type(unwrap_peft(model)).__name__} runs {implementation!r} attention, "
                                          "which cannot take the mask a refresh pass needs, and cannot switch to "
                                          "SDPA; load it with attn_implementation='sdpa' or 'eager'")
        yield


QUERY_RECORDER = "peft_kvcache_query_recorder"
_RECORDERS: list = []  # the record functions of the `recording_queries` blocks running now, innermost last


def _recorded_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, handing its query states (rotated, ``[batch, heads, queries, head_dim]``) and
    the scaling of its logits to the innermost `recording_queries` block first."""
    if _RECORDERS:
        scaling = kwargs.get("scaling")
        _RECORDERS[-1](query, query.shape[-1] ** -0.5 if scaling is None else scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(QUERY_RECORDER, _recorded_attention)
AttentionMaskInterface.register(QUERY_RECORDER, sdpa_mask)


@contextmanager
def recording_queries(model: torch.nn.Module, record) -> Iterator[None]:
    """Run the block with every attention call of ``model`` handing ``record(query, scaling)`` its query states as the
    attention reads them (after the model's own projections, norms and RoPE), layer after layer, then put the model's
    own attention back (`_attention_as`; the same thread-safety caveat). A model that cannot switch attention raises
    `IncompatibleModelsError`."""
    with _attention_as(model, QUERY_RECORDER) as switched:
        if not switched:
            raise IncompatibleModelsError(f"{type(unwrap_peft(model)).__name__} cannot switch its attention "
                                          "implementation, through which its queries are read")
        _RECORDERS.append(record)
        try:
            yield
        finally:
            _RECORDERS.pop()


def fill_cache(cache: DynamicCache, layers_kv) -> DynamicCache:
    """Put per-layer ``(keys, values)`` into an empty `DynamicCache` without copying them (``update`` would
    concatenate each onto an empty tensor: a copy of the whole context)."""
    for keys, values in layers_kv:
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


def replay_attention(module: torch.nn.Module, args: tuple, kwargs: dict, keys: torch.Tensor, values: torch.Tensor,
                     attention_mask: torch.Tensor) -> torch.Tensor:
    """Run an attention module again on the inputs of the call a forward hook (``with_kwargs=True``) just saw,
    attending to the fixed context ``keys``/``values`` ``[batch, kv_heads, ctx, head_dim]`` plus the call's own
    tokens, under ``attention_mask``. Returns its attention output."""
    call = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "past_key_value")}
    call["attention_mask"] = attention_mask
    # the module writes its own layer of the cache: give every layer up to it the fixed context
    context = fill_cache(DynamicCache(), [(keys, values)] * (module.layer_idx + 1))
    return module(*args, **call, **{_cache_argument_of(type(module)): context})[0]


def weights_version(model: torch.nn.Module) -> tuple:
    """Changes whenever a parameter of ``model`` is replaced or written in place (``load_state_dict``,
    ``copy_``, an optimizer step): each tensor's storage address and torch's in-place version counter. A write through
    ``.data`` moves neither: `peft_kvcache.modeling.identity.forget_weights` is for that.

    It is read on every switch, so it walks the modules' own dicts instead of ``model.parameters()``, whose generators
    build every module's dotted name (a PEFT model with three adapters: 3,489 modules, ~5 ms instead of ~7.5 ms)."""
    versions, stack, seen = [], [model], {id(model)}
    while stack:
        module = stack.pop()
        for parameter in module._parameters.values():
            if parameter is not None:
                versions += (parameter.data_ptr(), parameter._version)
        for child in module._modules.values():
            if child is not None and id(child) not in seen:  # a module registered twice is read once
                seen.add(id(child))
                stack.append(child)
    return tuple(versions)
