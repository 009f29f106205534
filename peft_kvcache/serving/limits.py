"""The server's limits, defined once: the app enforces them and ``peft-kvcache serve`` derives its flags' defaults
from them (this module imports nothing of the ``serve`` extra)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ServerError


@dataclass(frozen=True)
class ServerLimits:
    """What one client may ask of the server. Checked when built (`ServerError` naming the field).

    Example:
        >>> ServerLimits().max_queue
        32
    """

    max_body_bytes: int = 8 * 2**20  # far above any prompt a model's context holds, far below what stalls a server
    max_queue: int = 32  # requests that may wait for the model; more get 429 with Retry-After
    read_timeout: float = 30.0  # seconds a client may take to send a request's headers, and then its body
    drain_timeout: float = 5.0  # seconds the running request may go on at shutdown

    def __post_init__(self):
        if type(self.max_body_bytes) is not int or self.max_body_bytes < 1024:
            raise ServerError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes!r}")
        if type(self.max_queue) is not int or self.max_queue < 0:
            raise ServerError(f"max_queue must be at least 0, got {self.max_queue!r}")
        for name in ("read_timeout", "drain_timeout"):
            value = getattr(self, name)
            low_ok = value > 0 if name == "read_timeout" else value >= 0
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not low_ok or value >= 86400:
                raise ServerError(f"{name} must be a number of seconds ({'> 0' if name == 'read_timeout' else '>= 0'}"
                                  f", under a day), got {value!r}")


__all__ = ["ServerLimits"]
