"""The response to one chat request: a ``chat.completion`` body or its stream of chunks, each saying how its context
was obtained (``peft_kvcache``: the reuse core's label, cached tokens, time to first token), and its metrics."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable

from ..runtime.reuse import Made
from ..runtime.turn import TurnResult
from .jobs import Job
from .metrics import Metrics
from .openai_api import DONE_EVENT, chunk_event, completion_body, error_body, usage

logger = logging.getLogger(__name__)

HEADER_CONTEXT, HEADER_CACHED, HEADER_TTFT = ("X-PEFT-KVCache-Context", "X-PEFT-KVCache-Cached-Tokens",
                                              "X-PEFT-KVCache-TTFT")


def headers(context_label: str, cached_tokens: int, ttft_seconds: float) -> dict:
    """The response headers that say how the context was obtained (a stream sends them with its first token)."""
    return {HEADER_CONTEXT: context_label, HEADER_CACHED: str(cached_tokens), HEADER_TTFT: f"{ttft_seconds:.6f}"}


class Reply:
    """What one request is answered with. ``label(made, cached_tokens)`` names a context (`reuse.label` with the
    served base model's name); ``eos_ids`` end a reply that stopped by itself."""

    def __init__(self, job: Job, body, model_label: str, metrics: Metrics, eos_ids: list[int],
                 label: Callable[[Made, int], str]):
        self.job, self.body, self.model_label, self.metrics = job, body, model_label, metrics
        self.eos_ids, self.label = eos_ids, label
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def extra(self, result: TurnResult) -> dict:
        """The response's ``peft_kvcache`` field."""
        return {"context_source": self.label(result.made, result.cached_tokens),
                "cached_tokens": result.cached_tokens, "ttft_seconds": round(result.first_token_seconds, 6),
                "queue_seconds": round(self.job.started - self.job.arrival, 6),
                "prepare_seconds": round(result.prepare_seconds, 6)}

    def headers(self, result: TurnResult) -> dict:
        return headers(self.label(result.made, result.cached_tokens), result.cached_tokens, result.first_token_seconds)

    def stream_headers(self, ttft_seconds: float) -> dict:
        """A stream's headers, sent with its first token (how its cache was made is known before generation)."""
        made, cached = self.job.prepared
        return headers(self.label(made, cached), cached, ttft_seconds)

    def finish_reason(self, result: TurnResult) -> str:
        ended_on_eos = result.new_ids.numel() > 0 and int(result.new_ids[0, -1]) in self.eos_ids
        return "stop" if self.job.deltas.stop_hit or ended_on_eos else "length"

    def usage(self, result: TurnResult) -> dict:
        return usage(result.prompt_tokens, result.new_ids.shape[1], result.cached_tokens)

    def count(self, status: int) -> None:
        self.metrics.requests.labels(self.model_label, status).inc()

    def completed(self, result: TurnResult) -> None:
        self.count(200)
        self.metrics.record(self.model_label, result)

    def failed(self, err: BaseException) -> dict:
        self.count(500)
        logger.error("a request for %s failed", self.model_label, exc_info=err)
        return error_body(f"generation failed: {type(err).__name__}: {err}", "server_error")

    def cut(self) -> dict:
        self.count(503)
        return error_body("the server shut down before the reply was complete: retry on another one", "server_error",
                          code="server_shutting_down")

    def completion(self, result: TurnResult) -> dict:
        self.completed(result)
        return completion_body(self.id, self.created, self.body.model, self.job.deltas.text, self.finish_reason(result),
                               self.usage(result), self.extra(result))

    async def events(self, result: TurnResult | None, on_end: Callable[[], None]):
        """The stream's server-sent events; a client that leaves cancels the generation. ``on_end`` runs once the
        stream ends, however it ends."""
        def event(delta, finish=None, **fields):
            return chunk_event(self.id, self.created, self.body.model, delta, finish, **fields)

        finished = False
        try:
            yield event({"role": "assistant", "content": ""})
            while result is None:
                kind, payload = await self.job.events.get()
                if kind == "delta":
                    yield event({"content": payload})
                elif kind == "error":
                    finished = True
                    yield f"data: {json.dumps(self.failed(payload))}\n\n"
                    return
                elif kind == "done":
                    result = payload
            if result.cancelled:  # cut by the server's shutdown
                finished = True
                yield f"data: {json.dumps(self.cut())}\n\n"
                return
            self.completed(result)
            finished = True  # counted and complete: a client leaving from here on cancels nothing
            extra = self.extra(result)
            yield event({}, self.finish_reason(result), peft_kvcache=extra)
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield event(None, usage=self.usage(result), peft_kvcache=extra)
            yield DONE_EVENT
        finally:
            on_end()
            if not finished:  # the client went away: stop generating; nothing of it is stored
                self.job.cancelled = True
                self.count(499)


__all__ = ["HEADER_CACHED", "HEADER_CONTEXT", "HEADER_TTFT", "Reply", "headers"]
