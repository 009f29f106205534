"""peft-kvcache: skip prefill after a model switch by mapping the KV cache of a sibling model or of the
base model of a PEFT adapter into the target's KV space.

    from peft_kvcache import KVMap, MappedCache
    kv_map = KVMap.calibrate(source_model, target_model, calibration_ids)
    cache = MappedCache.from_source(source_model, kv_map, target_model, input_ids=prompt[:, :-1])
    out = target_model.generate(input_ids=prompt, cache=cache, max_new_tokens=32)
"""

from ._version import __version__  # noqa: F401
from .calibration import loop as _calibrate  # noqa: F401  (attaches KVMap.calibrate)
from .errors import (
    ArtifactError,
    CacheMismatchError,
    CalibrationError,
    CLIUsageError,
    EvaluationError,
    FingerprintMismatchError,
    FixtureError,
    IncompatibleModelsError,
    NumericalError,
    PeftKVCacheError,
    QualityError,
    RequestError,
    ServerError,
    SessionError,
    UnsupportedPositionalSchemeError,
)
from .maps.adapter_maps import AdapterMaps
from .maps.config import CalibrationConfig, KVMapConfig, Refresh
from .maps.kvmap import KVMap
from .runtime.cache import MappedCache
from .runtime.sessions import AdapterSession, SharedPeftModel, TurnResult

__all__ = [
    "AdapterMaps",
    "AdapterSession",
    "CalibrationConfig",
    "KVMap",
    "KVMapConfig",
    "MappedCache",
    "Refresh",
    "SharedPeftModel",
    "TurnResult",
    "PeftKVCacheError",
    "ArtifactError",
    "CacheMismatchError",
    "CalibrationError",
    "CLIUsageError",
    "EvaluationError",
    "FingerprintMismatchError",
    "FixtureError",
    "IncompatibleModelsError",
    "NumericalError",
    "QualityError",
    "RequestError",
    "ServerError",
    "SessionError",
    "UnsupportedPositionalSchemeError",
]
