"""An OpenAI-compatible chat server over a base model and its PEFT adapters, whose prefix cache is shared
across adapters: a conversation that moves from one adapter to another maps the base model's cache of its
history into the next adapter instead of prefilling it again (`prefix_store`).

    peft-kvcache serve --model gguf:smollm2-135m-instruct --adapter shout=adapters/shout \\
        --adapter docstring=adapters/docstring --maps hub_cards --calibrate-missing

Endpoints: ``GET /v1/models`` (the base model, then each adapter with the base as ``parent`` and ``root``, and
``peft_kvcache.mapped_from``: the model whose cache a switch to it maps, None where it has no map),
``POST /v1/chat/completions`` (``model``: the base, an adapter or ``base:adapter``; streamed or not),
``GET /metrics`` (Prometheus), ``GET /health`` and a chat page at ``/``. With an API key every endpoint but
``/health`` and the page needs OpenAI's ``Authorization: Bearer <key>`` header (401 otherwise).

Each response says how its context was obtained: the field ``peft_kvcache`` of the body (and of the last
stream chunk) holds ``context_source`` (``"reused"``: a cache the same model computed on the exact context;
``"mapped:<model>"``: ``<model>``'s cache mapped into the requested one, or a cache derived from such a mapped
prefix; ``"shared:<model>"``: an Activated LoRA reusing ``<model>``'s cache as is; ``"prefilled"``: nothing
cached), ``cached_tokens``, ``ttft_seconds`` (from the request's arrival to the first generated token, waiting for
the model included) and ``queue_seconds``; the headers ``X-PEFT-KVCache-Context``, ``X-PEFT-KVCache-Cached-Tokens``
and ``X-PEFT-KVCache-TTFT`` say the same (a stream's headers are sent with its first token).
``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens that were not prefilled. A request's own
``peft_kvcache`` field may ask for exact reuse only (``{"reuse": "exact"}``).

Model work runs on one worker thread, in arrival order, under the model's lock; reading a body (at most
``max_body_bytes``, within ``read_timeout``), the chat template and the tokenizer run off the event loop, so one
large request never stalls the others or ``/health``. At most ``max_queue`` requests wait for the model (429 with
``Retry-After`` beyond). A client that goes away (streamed or not) stops its generation, and a request that fails or
is cancelled adds nothing to the store. At shutdown (SIGTERM, or uvicorn's ``should_exit``) waiting requests are
answered 503 at once and the running one is cut after ``drain_timeout`` seconds.

Example:
    >>> app = create_app(PrefixEngine(shared, PrefixStore(2 * 2**30)), tokenizer)   # doctest: +SKIP
    >>> uvicorn_server(app, "127.0.0.1", 8000).run()                                  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from importlib import resources

# The server's own dependencies (pip install "peft-kvcache[serve]"), at module level: FastAPI reads the route
# functions' annotations from this module's namespace.
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import RequestError
from ..modeling.adapters import is_activated_lora
from ..modeling.identity import base_name
from ..runtime.sessions import TurnResult
from .openai_api import (
    DONE_EVENT,
    PromptRenderer,
    TextDeltas,
    chunk_event,
    completion_body,
    decode_json,
    error_body,
    parse_chat_request,
    usage,
)
from .prefix_store import PrefixEngine

logger = logging.getLogger(__name__)

HEADER_CONTEXT, HEADER_CACHED, HEADER_TTFT = ("X-PEFT-KVCache-Context", "X-PEFT-KVCache-Cached-Tokens",
                                              "X-PEFT-KVCache-TTFT")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # far above any prompt a model's context holds, far below what stalls a server
DEFAULT_MAX_QUEUE = 32
DEFAULT_READ_TIMEOUT = 30.0  # seconds a client may take to send a request's headers, and then its body
DEFAULT_DRAIN_TIMEOUT = 5.0  # seconds the running request may go on at shutdown
PREPARE_THREADS = 2  # threads that decode bodies and render prompts, off the event loop
OPEN_PATHS = ("/", "/health")  # what an API key does not guard: the page (it asks for the key) and the health check


class Metrics:
    """The server's Prometheus metrics, in a registry of their own (several servers may share a process)."""

    def __init__(self, store, waiting=lambda: 0):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("peft_kvcache_requests", "Chat completion requests by model and HTTP status",
                                ["model", "status"], registry=registry)
        self.ttft = Histogram("peft_kvcache_ttft_seconds", "Seconds from a request's arrival to its first token, by "
                              "context source", ["source"], buckets=TTFT_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("peft_kvcache_prompt_tokens", "Prompt tokens by how their KV was obtained "
                                     "(reused, mapped, shared, prefilled)", ["kind"], registry=registry)
        self.completion_tokens = Counter("peft_kvcache_completion_tokens", "Generated tokens by model", ["model"],
                                         registry=registry)

        class StoreCollector:  # read at scrape time: the store keeps its own counts
            def collect(self):
                yield CounterMetricFamily("peft_kvcache_store_evictions", "Prefix store entries evicted (LRU)",
                                          value=store.evictions)
                yield GaugeMetricFamily("peft_kvcache_store_bytes", "Bytes held by the prefix store",
                                        value=store.nbytes)
                yield GaugeMetricFamily("peft_kvcache_store_max_bytes", "The prefix store's bound (--cache-memory)",
                                        value=store.max_bytes)
                yield GaugeMetricFamily("peft_kvcache_store_entries", "Caches held by the prefix store",
                                        value=len(store))
                yield GaugeMetricFamily("peft_kvcache_requests_waiting", "Requests waiting for the model "
                                        "(--max-queue bounds them)", value=waiting())

        registry.register(StoreCollector())

    def record(self, model: str, result: TurnResult) -> None:
        self.ttft.labels(result.context_source).observe(result.first_token_seconds)
        cached_kind = result.context_source if result.context_source in ("mapped", "shared") else "reused"
        self.prompt_tokens.labels(cached_kind).inc(result.cached_tokens)
        self.prompt_tokens.labels("prefilled").inc(result.prompt_tokens - result.cached_tokens)
        self.completion_tokens.labels(model).inc(result.new_ids.shape[1])


class _Job:
    """One request's link between the event loop and the model worker: the worker pushes events
    (``("first", seconds)`` and ``("delta", text)`` for a stream, then one of ``("done", TurnResult)``,
    ``("error", exception)``, ``("cancelled", None)``: it was cancelled before it started), the server's shutdown
    ``("shutdown", None)`` to a job still waiting."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer, stop: list[str], arrival: float, stream: bool):
        self.loop, self.events, self.arrival = loop, asyncio.Queue(), arrival
        self.cancelled = False  # stop generating at the next token, store nothing (the client left, or shutdown)
        self.shutdown = False  # cancelled by the server's shutdown (answered 503)
        self.state = "queued"  # -> "running" -> "done" (set by the worker)
        self.started = arrival  # when the model worker took it
        self.prepared: tuple = ("prefilled", 0, None)  # (source, cached tokens, context_from), before the first token
        self.deltas = TextDeltas(tokenizer, stop, emit=(lambda text: self.push("delta", text)) if stream else None,
                                 on_first=(lambda: self.push("first", time.perf_counter() - arrival)) if stream else None)

    def push(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed: nobody waits for it any more
            pass

    def cut(self) -> None:
        """Cancel it for the server's shutdown."""
        self.cancelled = self.shutdown = True
        if self.state == "queued":
            self.push("shutdown", None)


class _ClientGone(Exception):
    """The client disconnected before its request was read or answered."""


def _refusal(message: str, status: int, code: str, headers: dict | None = None) -> RequestError:
    """A `RequestError` answered with ``headers`` too (``Retry-After``, ``Connection: close``)."""
    err = RequestError(message, status, None, code)
    err.headers = headers or {}
    return err


class ChatServer:
    """The routes' state: the engine, the tokenizer, the served model names, the limits and the metrics."""

    def __init__(self, engine: PrefixEngine, tokenizer, model_name: str | None = None, max_tokens: int = 512, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_queue: int = DEFAULT_MAX_QUEUE,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT):
        self.engine, self.tokenizer = engine, tokenizer
        self.model_name = model_name or base_name(engine.shared.model)
        self.adapters = engine.shared.adapters
        self.max_tokens = max_tokens
        self.max_body_bytes, self.max_queue = max_body_bytes, max_queue
        self.read_timeout, self.drain_timeout = read_timeout, drain_timeout
        config = getattr(engine.shared.model, "config", None)
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.render = PromptRenderer(tokenizer)
        self.jobs: set[_Job] = set()  # requests handed to the worker and not answered yet
        self.metrics = Metrics(engine.store, self.waiting)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peft-kvcache-model")  # FIFO, one at a time
        self.preparer = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="peft-kvcache-prepare")
        eos = {tokenizer.eos_token_id, *_as_list(getattr(engine.shared.model.generation_config, "eos_token_id", None))}
        self.eos_ids = sorted(i for i in eos if i is not None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_ids or [0])[0]
        self.created = int(time.time())
        self.closing = False  # shutting down: new requests are answered 503
        self.service_seconds = 1.0  # a running mean of a request's time on the model (for Retry-After)

    # ----- reading and checking a request (event loop, then a preparer thread) -----

    async def read_body(self, request: Request) -> bytes:
        """The body of ``request``, at most ``max_body_bytes`` (else 413: the rest of an oversized body, up to four
        times the limit, is read and dropped so the client can read the answer, then the connection is closed),
        received within ``read_timeout`` seconds (else 408, the connection closed). `_ClientGone` if it leaves."""
        limit, close = self.max_body_bytes, {"Connection": "close"}
        too_large = _refusal(f"the request body exceeds this server's limit of {limit} bytes (--max-body-bytes)", 413,
                             "request_too_large", close)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > 4 * limit:
            raise too_large
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        chunks, size, more = [], 0, True
        while more and size <= 4 * limit:
            try:
                message = await asyncio.wait_for(request.receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise _refusal(f"the request body did not arrive within {self.read_timeout:g} s (--read-timeout)", 408,
                               "request_timeout", close) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
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
                               "the completion).", param="max_tokens", code="context_length_exceeded")
        kwargs = {"max_new_tokens": asked or min(self.max_tokens, room or self.max_tokens),
                  "eos_token_id": self.eos_ids or None, "pad_token_id": self.pad_id}
        temperature = 1.0 if request.temperature is None else request.temperature  # OpenAI's default
        if temperature == 0:
            return {**kwargs, "do_sample": False}
        return {**kwargs, "do_sample": True, "temperature": temperature, "top_p": request.top_p or 1.0, "top_k": 0}

    # ----- the queue -----

    def waiting(self) -> int:
        """Requests handed to the worker that it has not started."""
        return sum(job.state == "queued" for job in list(self.jobs))

    def admit(self) -> None:
        """Refuse a request that would wait behind more than ``max_queue`` others (429 with ``Retry-After``), or any
        once the server is shutting down (503)."""
        if self.closing:
            raise _refusal("the server is shutting down: retry on another one", 503, "server_shutting_down")
        waiting = self.waiting()
        busy = waiting or any(job.state == "running" for job in list(self.jobs))
        if busy and waiting + 1 > self.max_queue:
            retry = max(1, math.ceil(self.service_seconds * (waiting + 1)))
            raise _refusal(f"the server is busy: {waiting} requests wait for the model, at most {self.max_queue} may "
                           f"(--max-queue); retry in {retry} s", 429, "rate_limit_exceeded", {"Retry-After": str(retry)})

    # ----- model work (the worker thread) -----

    def work(self, job: _Job, adapter: str | None, prompt, kwargs: dict, seed: int | None, reuse: str) -> None:
        """Run on the model worker: generate, report, and keep the caches (after "done" is pushed)."""
        done = False

        def report(result: TurnResult) -> None:
            nonlocal done
            done = True
            job.push("done", result)

        try:
            job.started = time.perf_counter()
            if job.cancelled:  # its client left, or the server shut down, while it waited
                job.push("cancelled", None)
                return
            job.state = "running"
            self.engine.run(adapter, prompt, kwargs, streamer=job.deltas, should_stop=lambda: job.deltas.stop_hit,
                            cancelled=lambda: job.cancelled, started=job.arrival, seed=seed, reuse=reuse,
                            on_prepared=lambda *prepared: setattr(job, "prepared", prepared), on_generated=report)
            self.service_seconds = 0.8 * self.service_seconds + 0.2 * (time.perf_counter() - job.started)
        except BaseException as err:  # noqa: BLE001 - reported to the request, never to the worker
            if done:
                logger.exception("keeping the caches of a completed request failed (the store holds only whole "
                                 "entries: the next request prefills what is missing)")
            else:
                job.push("error", err)
        finally:
            job.state = "done"

    # ----- shutdown -----

    def begin_shutdown(self) -> None:
        """Refuse new requests, answer the waiting ones 503 now and cut the running one after ``drain_timeout``
        seconds (at its next token; it stores nothing). Called on the event loop when uvicorn starts shutting down."""
        if self.closing:
            return
        self.closing = True
        for job in list(self.jobs):
            if job.state == "queued":
                job.cut()
        running = [job for job in self.jobs if job.state != "done"]
        if running:
            logger.warning("shutting down: the running request has %.1f s to finish (--drain-timeout)",
                           self.drain_timeout)

        def cut() -> None:
            for job in list(self.jobs):
                job.cut()

        asyncio.get_running_loop().call_later(max(0.0, self.drain_timeout), cut)

    def close(self) -> None:
        """Cancel what is left and stop the threads (the lifespan's end)."""
        for job in list(self.jobs):
            job.cut()
        self.worker.shutdown(wait=False, cancel_futures=True)
        self.preparer.shutdown(wait=False, cancel_futures=True)

    def context_source(self, source: str, cached_tokens: int, context_from: str | None = None) -> str:
        """The public name of a context source (see the module's docstring): ``mapped:<model>`` and
        ``shared:<model>`` name the model whose cache it came from (``context_from``; None: the base model)."""
        if not cached_tokens:
            return "prefilled"
        if source in ("mapped", "shared"):
            return f"{source}:{self.model_name if context_from is None else context_from}"
        return source

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


async def _next_event(job: _Job, gone: asyncio.Future) -> tuple[str, object]:
    """The job's next event, or ``("gone", None)`` once its client disconnected (the job is then cancelled)."""
    get = asyncio.ensure_future(job.events.get())
    done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    job.cancelled = True
    return "gone", None


class _BearerKey:
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


def create_app(engine: PrefixEngine, tokenizer, model_name: str | None = None, max_tokens: int = 512, *,
               api_key: str | None = None, **limits):
    """The FastAPI app serving ``engine``'s model (base name ``model_name``, default the model's name or path) and
    its adapters; ``max_tokens`` is the reply length when a request sets none; ``api_key``: OpenAI's bearer key
    every endpoint but `OPEN_PATHS` needs; ``limits``: `ChatServer`'s ``max_body_bytes``, ``max_queue``,
    ``read_timeout`` and ``drain_timeout``. ``app.state.server`` is its `ChatServer`; serve it with
    `uvicorn_server` (or `running`), which add the header deadline and the drain at shutdown."""
    server = ChatServer(engine, tokenizer, model_name, max_tokens, **limits)

    @asynccontextmanager
    async def lifespan(app):
        yield
        server.close()

    app = FastAPI(title="peft-kvcache chat server", lifespan=lifespan)
    app.state.server = server
    if api_key:
        app.add_middleware(_BearerKey, key=api_key)

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
            server.admit()  # before the work of preparing it
            body, adapter, prompt, kwargs = await loop.run_in_executor(server.preparer, server.prepare, raw, where)
            server.admit()
        except RequestError as err:
            server.metrics.requests.labels(where["label"], err.status).inc()
            raise
        except _ClientGone:
            server.metrics.requests.labels(where["label"], 499).inc()
            return Response(status_code=499)
        job = _Job(loop, tokenizer, body.stop_strings(), arrival, body.stream)
        server.jobs.add(job)
        reply = _Reply(server, job, body, where["label"])
        gone = asyncio.ensure_future(_client_gone(request))
        streaming = False
        try:
            try:
                server.worker.submit(server.work, job, adapter, prompt, kwargs, body.seed, body.reuse())
            except RuntimeError:  # the worker was shut down
                return JSONResponse(reply.cut(), status_code=503)
            kind, payload = await _next_event(job, gone)
            while kind == "delta":
                kind, payload = await _next_event(job, gone)
            if kind == "gone":
                server.metrics.requests.labels(reply.label, 499).inc()
                return Response(status_code=499)
            if kind == "error":
                return JSONResponse(reply.failed(payload), status_code=500)
            if kind in ("shutdown", "cancelled") or (kind == "done" and payload.cancelled):
                return JSONResponse(reply.cut(), status_code=503)
            if not body.stream:
                extra = reply.extra(payload)
                return JSONResponse(reply.completion(payload), headers=_headers(
                    extra["context_source"], extra["cached_tokens"], extra["ttft_seconds"]))
            ttft = payload if kind == "first" else payload.first_token_seconds
            source, cached, context_from = job.prepared
            headers = _headers(server.context_source(source, cached, context_from), cached, ttft)
            streaming = True
            return StreamingResponse(reply.events(None if kind == "first" else payload),
                                     media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        finally:
            gone.cancel()
            if not streaming:
                server.jobs.discard(job)

    return app


class _Reply:
    """The response to one chat request: a ``chat.completion`` body or its stream of chunks."""

    def __init__(self, server: ChatServer, job: _Job, body, label: str):
        self.server, self.job, self.body, self.label = server, job, body, label
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def extra(self, result: TurnResult) -> dict:
        return {"context_source": self.server.context_source(result.context_source, result.cached_tokens,
                                                             result.context_from),
                "cached_tokens": result.cached_tokens, "ttft_seconds": round(result.first_token_seconds, 6),
                "queue_seconds": round(self.job.started - self.job.arrival, 6),
                "prepare_seconds": round(result.prepare_seconds, 6)}

    def finish_reason(self, result: TurnResult) -> str:
        ended_on_eos = result.new_ids.numel() > 0 and int(result.new_ids[0, -1]) in self.server.eos_ids
        return "stop" if self.job.deltas.stop_hit or ended_on_eos else "length"

    def usage(self, result: TurnResult) -> dict:
        return usage(result.prompt_tokens, result.new_ids.shape[1], result.cached_tokens)

    def completed(self, result: TurnResult) -> None:
        self.server.metrics.requests.labels(self.label, 200).inc()
        self.server.metrics.record(self.label, result)

    def failed(self, err: BaseException) -> dict:
        self.server.metrics.requests.labels(self.label, 500).inc()
        logger.error("a request for %s failed", self.label, exc_info=err)
        return error_body(f"generation failed: {type(err).__name__}: {err}", "server_error")

    def cut(self) -> dict:
        self.server.metrics.requests.labels(self.label, 503).inc()
        return error_body("the server shut down before the reply was complete: retry on another one", "server_error",
                          code="server_shutting_down")

    def completion(self, result: TurnResult) -> dict:
        self.completed(result)
        return completion_body(self.id, self.created, self.body.model, self.job.deltas.text, self.finish_reason(result),
                               self.usage(result), self.extra(result))

    async def events(self, result: TurnResult | None):
        """The stream's server-sent events; a client that leaves cancels the generation."""
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
            extra = self.extra(result)
            yield event({}, self.finish_reason(result), peft_kvcache=extra)
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield event(None, usage=self.usage(result), peft_kvcache=extra)
            finished = True
            yield DONE_EVENT
        finally:
            self.server.jobs.discard(self.job)
            if not finished:  # the client went away: stop generating; nothing of it is stored
                self.job.cancelled = True
                self.server.metrics.requests.labels(self.label, 499).inc()


# ----- serving it: uvicorn with a deadline for request headers and the drain at shutdown -----


def _protocol_with_header_deadline(seconds: float) -> type:
    """uvicorn's h11 protocol with a deadline for each request's headers, counted from the connection (or the end of
    the previous response): a client that has not sent them in ``seconds`` is disconnected."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # before the next request is read, which may already be here (it disarms)
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


class _DrainingServer(uvicorn.Server):
    """uvicorn's server that starts the chat server's drain (`ChatServer.begin_shutdown`) as soon as it begins to shut
    down (SIGTERM, Ctrl-C or ``should_exit``), not after every connection closed."""

    def __init__(self, config: uvicorn.Config, chat: ChatServer):
        super().__init__(config)
        self.chat = chat

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if sockets is not None and self.started:  # uvicorn says where it runs only for the sockets it binds itself
            self._log_started_message(sockets)

    async def shutdown(self, sockets=None) -> None:
        self.chat.begin_shutdown()
        await super().shutdown(sockets=sockets)


def uvicorn_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for ``app`` (from `create_app`): h11 with a deadline for request headers (the app's
    ``read_timeout``), idle connections closed after 5 s, and at shutdown the drain of `ChatServer.begin_shutdown`
    (connections still open ``drain_timeout`` + 5 s later are cancelled). Run it with ``.run()``, or ``.run(sockets=
    [sock])`` on a socket bound before the model loaded.

    Example:
        >>> uvicorn_server(create_app(engine, tokenizer), port=8000).run()   # doctest: +SKIP
    """
    chat: ChatServer = app.state.server
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            http=_protocol_with_header_deadline(chat.read_timeout), timeout_keep_alive=5,
                            timeout_graceful_shutdown=max(0.0, chat.drain_timeout) + 5)
    return _DrainingServer(config, chat)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (``SO_REUSEADDR``, as uvicorn binds); ``OSError`` if it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@contextmanager
def running(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0) -> Iterator[str]:
    """Serve ``app`` with `uvicorn_server` in a background thread (tests, benchmarks, notebooks); yields its base URL
    (``http://127.0.0.1:PORT``; ``port=0``: a free port) and stops the server on exit.

    Example:
        >>> with running(create_app(engine, tokenizer)) as url:                              # doctest: +SKIP
        ...     OpenAI(base_url=url + "/v1", api_key="-").models.list()
    """
    sock = bind(host, port)
    server = uvicorn_server(app, host, sock.getsockname()[1], log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="peft-kvcache-http")
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the server did not start on {host}:{sock.getsockname()[1]}")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def _headers(context_source: str, cached_tokens: int, ttft_seconds: float) -> dict:
    """The response headers that say how the context was obtained (a stream sends them with its first token)."""
    return {HEADER_CONTEXT: context_source, HEADER_CACHED: str(cached_tokens), HEADER_TTFT: f"{ttft_seconds:.6f}"}
