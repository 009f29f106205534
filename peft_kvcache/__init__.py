"""peft-kvcache: skip prefill after a model switch by mapping the KV cache of a sibling model or of the
base model of a PEFT adapter into the target's KV space.

    from peft_kvcache import KVMap, MappedCache
    kv_map = KVMap.calibrate(source_model, target_model, calibration_ids)
    cache = MappedCache.from_source(source_model, kv_map, target_model, input_ids=prompt[:, :-1])
    out = target_model.generate(input_ids=prompt, past_key_values=cache, max_new_tokens=32)
"""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    ArtifactError,
    CacheMismatchError,
    CalibrationError,
    EvaluationError,
    FingerprintMismatchError,
    IncompatibleModelsError,
    NumericalError,
    PeftKVCacheError,
    QualityError,
    UnsupportedPositionalSchemeError,
)
from .kvmap import KVMap, KVMapConfig  # noqa: E402
from .cache import MappedCache  # noqa: E402

__all__ = [
    "KVMap",
    "KVMapConfig",
    "MappedCache",
    "PeftKVCacheError",
    "ArtifactError",
    "CacheMismatchError",
    "CalibrationError",
    "EvaluationError",
    "FingerprintMismatchError",
    "IncompatibleModelsError",
    "NumericalError",
    "QualityError",
    "UnsupportedPositionalSchemeError",
]
