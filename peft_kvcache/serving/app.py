"""An OpenAI-compatible chat server over a base model and its PEFT adapters, whose prefix cache is shared
across adapters: a conversation that moves from one adapter to another maps the base model's cache of its
history into the next adapter instead of prefilling it again (`engine`).

    peft-kvcache serve --model gguf:smollm2-135m-instruct --adapter shout=adapters/shout \\
        --adapter docstring=adapters/docstring --maps hub_cards --calibrate-missing

Endpoints: ``GET /v1/models`` (the base model, then each adapter with the base as ``parent`` and ``root``, and
``peft_kvcache.mapped_from``: the model whose cache a switch to it maps, None where it has no map),
``POST /v1/chat/completions`` (``model``: the base, an adapter or ``base:adapter``; streamed or not),
``GET /metrics`` (Prometheus), ``GET /health`` and a chat page at ``/``. With an API key every endpoint but
``/health`` and the page needs OpenAI's ``Authorization: Bearer <key>`` header (401 otherwise: `auth`).

Each response says how its context was obtained: the field ``peft_kvcache`` of the body (and of the last
stream chunk) holds ``context_source`` (the reuse core's label, `peft_kvcache.runtime.reuse.label`: ``"reused"``, a
cache the same model computed on the exact context; ``"mapped:<model>"``, ``<model>``'s cache mapped into the
requested one, or a cache derived from such a mapped prefix; ``"shared:<model>"``, an Activated LoRA reusing
``<model>``'s cache as is; ``"prefilled"``: nothing cached), ``cached_tokens``, ``ttft_seconds`` (from the request's
arrival to the first generated token, waiting for the model included) and ``queue_seconds``; the headers
``X-PEFT-KVCache-Context``, ``X-PEFT-KVCache-Cached-Tokens`` and ``X-PEFT-KVCache-TTFT`` say the same (a stream's
headers are sent with its first token). ``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens that
were not prefilled. A request's own ``peft_kvcache`` field may ask for exact reuse only (``{"reuse": "exact"}``).

Model work runs on one worker thread, in arrival order, under the model's lock (`jobs`); reading a body (at most
``max_body_bytes``, within ``read_timeout``), the chat template and the tokenizer run off the event loop, so one
large request never stalls the others or ``/health``. A client that goes away (streamed or not) stops its
generation, and a request that fails or is cancelled adds nothing to the store. Limits: `limits.ServerLimits`.

Example:
    >>> app = create_app(PrefixEngine(shared, PrefixStore(2 * 2**30)), tokenizer)   # doctest: +SKIP
    >>> hosting.uvicorn_server(app, "127.0.0.1", 8000).run()                          # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import resources

# The server's own dependencies (pip install "peft-kvcache[serve]"), at module level: FastAPI reads the route
# functions' annotations from this module's namespace.
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..modeling.adapters import is_activated_lora
from ..modeling.identity import base_name
from ..runtime.reuse import Made, label
from .auth import BearerKey
from .engine import PrefixEngine
from .errors import RequestError
from .jobs import ClientGone, Job, JobQueue, refusal
from .limits import ServerLimits
from .metrics import Metrics
from .openai_api import MIN_TEMPERATURE, PromptRenderer, decode_json, error_body, parse_chat_request
from .replies import Reply

logger = logging.getLogger(__name__)

PREPARE_THREADS = 2  # threads that decode bodies and render prompts, off the event loop


class ChatServer:
    """The routes' state: the engine, the tokenizer, the served model names, the limits, the queue and the metrics."""

    def __init__(self, engine: PrefixEngine, tokenizer, model_name: str | None = None, max_tokens: int = 512,
                 limits: ServerLimits = ServerLimits()):
        self.engine, self.tokenizer, self.limits = engine, tokenizer, limits
        self.model_name = model_name or base_name(engine.shared.model)
        self.adapters = engine.shared.adapters
        self.max_tokens = max_tokens
        config = getattr(engine.shared.model, "config", None)
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.render = PromptRenderer(tokenizer)
        self.queue = JobQueue(limits.max_queue, limits.drain_timeout)
        self.metrics = Metrics(engine.store, self.queue.waiting)
        self.preparer = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="peft-kvcache-prepare")
        eos = {tokenizer.eos_token_id, *_as_list(getattr(engine.shared.model.generation_config, "eos_token_id", None))}
        self.eos_ids = sorted(i for i in eos if i is not None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_ids or [0])[0]
        self.created = int(time.time())

    def label(self, made: Made, cached_tokens: int) -> str:
        """A context's public name (`peft_kvcache.runtime.reuse.label`, the base model under its served name)."""
        return label(made, cached_tokens, self.model_name)

    # ----- reading and checking a request (event loop, then a preparer thread) -----

    async def read_body(self, request: Request) -> bytes:
        """The body of ``request``, at most ``max_body_bytes`` (else 413: the rest of an oversized body, up to four
        times the limit, is read and dropped so the client can read the answer, then the connection is closed),
        received within ``read_timeout`` seconds (else 408, the connection closed). `ClientGone` if it leaves."""
        limit, timeout, close = self.limits.max_body_bytes, self.limits.read_timeout, {"Connection": "close"}
        too_large = refusal(f"the request body exceeds this server's limit of {limit} bytes (--max-body-bytes)", 413,
                            "request_too_large", close)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > 4 * limit:
            raise too_large
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        chunks, size, more = [], 0, True
        while more and size <= 4 * limit:
            try:
                message = await asyncio.wait_for(request.receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise refusal(f"the request body did not arrive within {timeout:g} s (--read-timeout)", 408,
                              "request_timeout", close) from None
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
        if size > limit:
            raise too_large
        return b"".join(chunks)

    def prepare(self, raw: bytes, where: dict):
        """Run in a preparer thread: the checked request, its adapter, its prompt ids and generate()'s options
        (`RequestError` for a bad one; ``where["label"]`` names the model once known, for the metrics)."""
        try:
            body = parse_chat_request(decode_json(raw))
            adapter = self.adapter_of(body.model)
            where["label"] = adapter or self.model_name
            prompt = self.render(body.messages)
            return body, adapter, prompt, self.generation_kwargs(body, prompt.shape[0])
        except RecursionError:
            raise RequestError("the request nests too deeply to be read") from None

    def adapter_of(self, model: str) -> str | None:
        """The adapter named by ``model`` (None: the base model); a `RequestError` (404) for an unknown one."""
        if model == self.model_name:
            return None
        name = model.removeprefix(self.model_name + ":")
        if name in self.adapters:
            return name
        raise RequestError(f"The model `{model}` does not exist. This server has {[self.model_name, *self.adapters]}.",
                           status=404, param="model", code="model_not_found")

    def generation_kwargs(self, request, prompt_tokens: int) -> dict:
        room = None if self.context_length is None else self.context_length - prompt_tokens
        if room is not None and room <= 0:
            raise RequestError(f"This model's maximum context length is {self.context_length} tokens, but the messages "
                               f"take {prompt_tokens} tokens.", param="messages", code="context_length_exceeded")
        asked = request.max_new_tokens()
        if asked is not None and room is not None and asked > room:
            raise RequestError(f"This model's maximum context length is {self.context_length} tokens, but "
                               f"{prompt_tokens + asked} were requested ({prompt_tokens} in the messages, {asked} for "
                               "the completion).", code="context_length_exceeded",
                               param="max_tokens" if request.max_completion_tokens is None else "max_completion_tokens")
        kwargs = {"max_new_tokens": asked or min(self.max_tokens, room or self.max_tokens),
                  "eos_token_id": self.eos_ids or None, "pad_token_id": self.pad_id}
        temperature = 1.0 if request.temperature is None else request.temperature  # OpenAI's default
        if temperature < MIN_TEMPERATURE:
            return {**kwargs, "do_sample": False}
        return {**kwargs, "do_sample": True, "temperature": temperature, "top_p": request.top_p or 1.0, "top_k": 0}

    # ----- model work (the worker thread) -----

    def work(self, job: Job, adapter: str | None, prompt, kwargs: dict, seed: int | None, reuse: str) -> None:
        """Generate on the model worker; ``("done", result)`` is pushed before the caches are kept."""
        self.engine.run(adapter, prompt, kwargs, streamer=job.deltas, should_stop=lambda: job.deltas.stop_hit,
                        cancelled=lambda: job.cancelled, started=job.arrival, seed=seed, reuse=reuse,
                        on_prepared=lambda *prepared: setattr(job, "prepared", prepared),
                        on_generated=lambda result: job.push("done", result))

    def close(self) -> None:
        """Cancel what is left and stop the threads (the lifespan's end)."""
        self.queue.close()
        self.preparer.shutdown(wait=False, cancel_futures=True)

    def model_cards(self) -> list[dict]:
        """``GET /v1/models``'s entries: the base, then each adapter (``peft_kvcache``: what a switch to it starts
        from: ``mapped_from`` the base where it has a map, ``shared_from`` for an Activated LoRA)."""
        card = {"object": "model", "created": self.created, "owned_by": "peft-kvcache", "root": self.model_name}
        shared = self.engine.shared
        cards = [{"id": self.model_name, **card, "parent": None,
                  "peft_kvcache": {"mapped_from": None, "shared_from": None}}]
        for adapter in self.adapters:
            alora = is_activated_lora(shared.model, adapter)
            mapped = adapter in shared.maps.to_adapter and not alora and self.engine.reuse == "map"
            cards.append({"id": adapter, **card, "parent": self.model_name, "peft_kvcache": {
                "mapped_from": self.model_name if mapped else None,
                "shared_from": self.model_name if alora and self.engine.reuse == "map" else None}})
        return cards


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


async def _client_gone(request: Request) -> None:
    """Returns once the client of ``request`` (whose body was read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(engine: PrefixEngine, tokenizer, model_name: str | None = None, max_tokens: int = 512, *,
               api_key: str | None = None, limits: ServerLimits = ServerLimits()):
    """The FastAPI app serving ``engine``'s model (base name ``model_name``, default the model's name or path) and
    its adapters; ``max_tokens`` is the reply length when a request sets none; ``api_key``: OpenAI's bearer key
    every endpoint but the page and ``/health`` needs; ``limits``: `ServerLimits`. ``app.state.server`` is its
    `ChatServer`; serve it with `uvicorn_server` (or `running`), which add the header deadline and the drain at
    shutdown."""
    server = ChatServer(engine, tokenizer, model_name, max_tokens, limits)

    @asynccontextmanager
    async def lifespan(app):
        yield
        server.close()

    app = FastAPI(title="peft-kvcache chat server", lifespan=lifespan)
    app.state.server = server
    if api_key:
        app.add_middleware(BearerKey, key=api_key)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError):
        return JSONResponse(error_body(err), status_code=err.status, headers=getattr(err, "headers", None))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        return JSONResponse(error_body(str(err.detail)), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception):
        logger.exception("request %s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(f"the server failed: {type(err).__name__}: {err}", "server_error"), 500)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return (resources.files("peft_kvcache.serving") / "static" / "chat.html").read_text(encoding="utf-8")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": server.model_cards()}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        arrival = time.perf_counter()
        where = {"label": "unknown"}
        loop = asyncio.get_running_loop()
        try:
            raw = await server.read_body(request)
            server.queue.admit()  # before the work of preparing it
            body, adapter, prompt, kwargs = await loop.run_in_executor(server.preparer, server.prepare, raw, where)
            server.queue.admit()
        except RequestError as err:
            server.metrics.requests.labels(where["label"], err.status).inc()
            raise
        except ClientGone:
            server.metrics.requests.labels(where["label"], 499).inc()
            return Response(status_code=499)
        job = Job(loop, tokenizer, body.stop_strings(), arrival, body.stream)
        reply = Reply(job, body, where["label"], server.metrics, server.eos_ids, server.label)
        gone = asyncio.ensure_future(_client_gone(request))
        streaming = False
        try:
            try:
                server.queue.submit(job, lambda job: server.work(job, adapter, prompt, kwargs, body.seed, body.reuse()))
            except RuntimeError:  # the worker was shut down
                return JSONResponse(reply.cut(), status_code=503)
            kind, payload = await job.next_event(gone)
            while kind == "delta":
                kind, payload = await job.next_event(gone)
            if kind == "gone":
                reply.count(499)
                return Response(status_code=499)
            if kind == "error":
                return JSONResponse(reply.failed(payload), status_code=500)
            if kind in ("shutdown", "cancelled") or (kind == "done" and payload.cancelled):
                return JSONResponse(reply.cut(), status_code=503)
            if not body.stream:
                return JSONResponse(reply.completion(payload), headers=reply.headers(payload))
            ttft = payload if kind == "first" else payload.first_token_seconds
            streaming = True
            return StreamingResponse(reply.events(None if kind == "first" else payload,
                                                  on_end=lambda: server.queue.jobs.discard(job)),
                                     media_type="text/event-stream",
                                     headers={**reply.stream_headers(ttft), "Cache-Control": "no-cache"})
        finally:
            gone.cancel()
            if not streaming:
                server.queue.jobs.discard(job)

    return app


__all__ = ["ChatServer", "create_app"]
