"""OpenAI's bearer key, asked of every request but the open paths (the chat page asks for it itself)."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from .openai_api import error_body

OPEN_PATHS = ("/", "/health")  # what an API key does not guard: the page (it asks for the key) and the health check


class BearerKey:
    """ASGI middleware: every path but `OPEN_PATHS` needs ``Authorization: Bearer <key>`` (401 otherwise)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                body = error_body("Incorrect or missing API key: send the server's --api-key as 'Authorization: "
                                  "Bearer <key>' (the openai client's api_key)", code="invalid_api_key")
                await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


__all__ = ["BearerKey", "OPEN_PATHS"]
