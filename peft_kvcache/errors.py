"""The exception hierarchy: every error this library raises on bad input is a `PeftKVCacheError`. The errors of the
library's layers live here; each surface keeps its own (the command line: `peft_kvcache.cli.CLIUsageError`, the
server: `peft_kvcache.serving.errors`, the vLLM connector: `peft_kvcache.vllm.options.ConnectorError`)."""

from __future__ import annotations


class PeftKVCacheError(Exception):
    """Root of every error raised by peft-kvcache; catch this to handle them all."""


class IncompatibleModelsError(PeftKVCacheError, ValueError):
    """The source and target models cannot be paired (vocabulary, tokenizer or architecture)."""


class UnsupportedPositionalSchemeError(PeftKVCacheError, ValueError):
    """A model's positional scheme cannot be removed from its cached keys (ALiBi, sliding windows, ...)."""


class FingerprintMismatchError(PeftKVCacheError, ValueError):
    """A map is applied to models other than the ones it was fitted for."""


class ArtifactError(PeftKVCacheError, ValueError):
    """A map artifact on disk is missing, corrupted, tampered with or of an unknown format."""


class CalibrationError(PeftKVCacheError, ValueError):
    """Calibration cannot run on the data or options given (empty, too short, non-finite statistics)."""


class CacheMismatchError(PeftKVCacheError, ValueError):
    """A cache or the ids given with it do not fit what they are used with: shapes, lengths, devices, token
    ids outside the vocabulary, or a prompt that does not continue the cached context."""


class NumericalError(PeftKVCacheError, ArithmeticError):
    """NaN or Inf appeared in a cache or in statistics, or a value overflowed the target dtype."""


class EvaluationError(PeftKVCacheError, ValueError):
    """An evaluation cannot run on the data or options given."""


class QualityError(PeftKVCacheError, ValueError):
    """A map's predicted quality or a per-request context check fails the user's bar and the chosen
    fallback cannot run (or the fallback chosen is to raise)."""


class SessionError(PeftKVCacheError, ValueError):
    """A session was asked for something it cannot do (unknown adapter, missing map, malformed turn)."""


class ModelLoadError(PeftKVCacheError, OSError):
    """A model or a PEFT adapter could not be loaded (no such folder or Hub repo, not a model, an adapter trained on
    another base model); the message names what was asked for."""


class FixtureError(PeftKVCacheError, RuntimeError):
    """A fixture model could not be fetched, verified or converted."""


class RecordError(PeftKVCacheError, ValueError):
    """A typed record (a map's config, calibration options, connector options) holds a field of the wrong type or out
    of range; the message names the dotted field."""


class AdapterError(PeftKVCacheError, ValueError):
    """A PEFT adapter was named that the model does not have, or none was given where one is needed."""


class DataError(PeftKVCacheError, ValueError):
    """Text for calibration or evaluation cannot be read (a missing file, an empty folder, a corpus too small)."""


class MapNotFoundError(PeftKVCacheError, LookupError):
    """No map among those given fits the models (their fingerprints, KV layout and rotary parameters)."""


class SettingError(PeftKVCacheError, ValueError):
    """An environment variable the library reads holds a value it cannot use."""
