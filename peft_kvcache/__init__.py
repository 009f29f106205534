"""peft-kvcache: skip prefill after a model switch by mapping the KV cache of a sibling model or of the
base model of a PEFT adapter into the target's KV space.

    from peft_kvcache import KVMap, MappedCache
    kv_map = KVMap.calibrate(source_model, target_model, calibration_ids)
    cache = MappedCache.from_source(source_model, kv_map, target_model, input_ids=prompt[:, :-1])
    out = target_model.generate(input_ids=prompt, cache=cache, max_new_tokens=32)

The package's parts (each subpackage's docstring says what it owns and what it may import): ``modeling`` (facts
about a model, loading and running it), ``maps`` (the artifact, which map fits which models, and the one apply
function), ``runtime`` (what runs at a switch, and the reuse core both serving wings stand on), ``calibration``
(fitting and measuring maps), ``serving`` (the OpenAI-compatible server), ``vllm`` (the vLLM KV connector), ``lab``
(text and provenance for measurements), ``cli`` (the command line). Errors not exported here are in
`peft_kvcache.errors`.
"""

from ._version import __version__  # noqa: F401
from .errors import (
    ArtifactError,
    CacheMismatchError,
    FingerprintMismatchError,
    PeftKVCacheError,
    QualityError,
    SessionError,
)
from .maps.adapter_maps import AdapterMaps
from .maps.config import CalibrationConfig, KVMapConfig, Refresh
from .maps.kvmap import KVMap
from .modeling.adapters import adapter_active, load_adapters
from .modeling.capture import CapturedKV, run_with_cache
from .modeling.identity import forget_weights
from ._allocator import keep_freed_memory
from .runtime.cache import ContextCache
from .runtime.mapped import MappedCache
from .runtime.check import ContextCheck, check_context, meets_quality, prefill_context
from .runtime.sessions import AdapterSession
from .runtime.turn import SharedPeftModel, TurnResult

__all__ = [
    # the artifact and the cache
    "KVMap", "KVMapConfig", "CalibrationConfig", "Refresh", "MappedCache", "ContextCache", "CapturedKV",
    "run_with_cache", "load_model", "forget_weights",
    # PEFT adapters
    "AdapterMaps", "AdapterSession", "SharedPeftModel", "TurnResult", "adapter_active", "load_adapters",
    # quality at a switch
    "meets_quality", "ContextCheck", "check_context", "prefill_context",
    # a serving process's allocator (switches without page faults)
    "keep_freed_memory",
    # the errors users catch (the rest: peft_kvcache.errors)
    "PeftKVCacheError", "ArtifactError", "CacheMismatchError", "FingerprintMismatchError", "QualityError",
    "SessionError",
]


def __getattr__(name: str):
    # `load_model` is imported on first use: imported here eagerly, `python -m peft_kvcache.modeling.fixtures` would
    # find its own module imported already and run it a second time (runpy's RuntimeWarning)
    if name == "load_model":
        from .modeling.fixtures import load_model
        return load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
