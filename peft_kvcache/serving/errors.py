"""The server's errors: options it cannot serve with, and requests it cannot serve (answered with an HTTP status)."""

from __future__ import annotations

from ..errors import PeftKVCacheError


class ServerError(PeftKVCacheError, ValueError):
    """The chat server was started with options it cannot serve (unknown model, missing map, bad memory bound)."""


class RequestError(ServerError):
    """A chat request the server cannot serve (unknown model, malformed JSON or fields, a prompt longer than
    the model's context): ``status`` is the HTTP status it is answered with, ``param`` and ``code`` fill the
    OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


__all__ = ["RequestError", "ServerError"]
