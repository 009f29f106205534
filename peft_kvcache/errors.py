"""The exception hierarchy: every error this library raises on bad input is a `PeftKVCacheError`."""

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


class CLIUsageError(PeftKVCacheError, ValueError):
    """An argument of the command line names something that cannot be used (a missing file, an empty corpus)."""


class ServerError(PeftKVCacheError, ValueError):
    """The chat server was started with options it cannot serve (unknown model, missing map, bad memory bound)."""


class RequestError(ServerError):
    """A chat request the server cannot serve (unknown model, malformed JSON or fields, a prompt longer than
    the model's context): ``status`` is the HTTP status it is answered with, ``param`` and ``code`` fill the
    OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class ConnectorError(PeftKVCacheError, ValueError):
    """The vLLM KV connector was configured with options it cannot use (``kv_connector_extra_config``)."""
