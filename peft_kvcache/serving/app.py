"""An OpenAI-compatible chat server over a base model and its PEFT adapters, whose prefix cache is shared
across adapters: a conversation that moves from one adapter to another maps the base model's cache of its
history into the next adapter instead of prefilling it again (`prefix_store`).

    peft-kvcache serve --model gguf:smollm2-135m-instruct --adapter shout=adapters/shout \\
        --adapter docstring=adapters/docstring --maps hub_cards --calibrate-missing

Endpoints: ``GET /v1/models`` (the base model, then each adapter with the base as ``parent`` and ``root``),
``POST /v1/chat/completions`` (``model``: the base, an adapter or ``base:adapter``; streamed or not),
``GET /metrics`` (Prometheus), ``GET /health`` and a chat page at ``/``.

Each response says how its context was obtained: the field ``peft_kvcache`` of the body (and of the last
stream chunk) holds ``context_source`` (``"reused"``: a cache of the same model; ``"mapped:<model>"``:
``<model>``'s cache mapped into the adapter; ``"shared:<model>"``: an Activated LoRA reusing ``<model>``'s
cache as is; ``"prefilled"``: nothing cached), ``cached_tokens``, ``ttft_seconds`` (from the request's arrival
to the first generated token, waiting for the model included) and ``queue_seconds``; the headers
``X-PEFT-KVCache-Context``, ``X-PEFT-KVCache-Cached-Tokens`` and ``X-PEFT-KVCache-TTFT`` say the same (a
stream's headers are sent with its first token). ``usage.prompt_tokens_details.cached_tokens`` counts the
prompt tokens that were not prefilled.

Model work runs on one worker thread, in arrival order, under the model's lock; a stream whose client goes
away stops generating, and a request that fails or is cancelled adds nothing to the store.

Example:
    >>> app = create_app(PrefixEngine(shared, PrefixStore(2 * 2**30)), tokenizer)   # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)                                  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from importlib import resources

# The server's own dependencies (pip install "peft-kvcache[serve]"), at module level: FastAPI reads the route
# functions' annotations from this module's namespace.
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from ..errors import RequestError
from ..modeling.identity import base_name
from ..runtime.sessions import TurnResult
from .openai_api import (
    DONE_EVENT,
    TextDeltas,
    chunk_event,
    completion_body,
    decode_json,
    error_body,
    parse_chat_request,
    render_prompt,
    usage,
)
from .prefix_store import PrefixEngine

logger = logging.getLogger(__name__)

HEADER_CONTEXT, HEADER_CACHED, HEADER_TTFT = ("X-PEFT-KVCache-Context", "X-PEFT-KVCache-Cached-Tokens",
                                              "X-PEFT-KVCache-TTFT")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The server's Prometheus metrics, in a registry of their own (several servers may share a process)."""

    def __init__(self, store):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("peft_kvcache_requests", "Chat completion requests by model and HTTP status",
                                ["model", "status"], registry=registry)
        self.ttft = Histogram("peft_kvcache_ttft_seconds", "Seconds from a request's arrival to its first token, by "
                              "context source", ["source"], buckets=TTFT_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("peft_kvcache_prompt_tokens", "Prompt tokens by how their KV was obtained "
                                     "(reused, mapped, prefilled)", ["kind"], registry=registry)
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

        registry.register(StoreCollector())

    def record(self, model: str, result: TurnResult) -> None:
        self.ttft.labels(result.context_source).observe(result.first_token_seconds)
        cached_kind = result.context_source if result.context_source in ("mapped", "shared") else "reused"
        self.prompt_tokens.labels(cached_kind).inc(result.cached_tokens)
        self.prompt_tokens.labels("prefilled").inc(result.prompt_tokens - result.cached_tokens)
        self.completion_tokens.labels(model).inc(result.new_ids.shape[1])


class _Job:
    """One request's link between the event loop and the model worker: the worker pushes events
    (``("first", seconds)``, ``("delta", text)``, ``("done", TurnResult)``, ``("error", exception)``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer, stop: list[str], arrival: float):
        self.loop, self.events, self.arrival = loop, asyncio.Queue(), arrival
        self.cancelled = False
        self.started = arrival  # when the model worker took it
        self.prepared: tuple = ("prefilled", 0, None)  # (source, cached tokens, context_from), before the first token
        self.deltas = TextDeltas(tokenizer, stop, emit=lambda text: self.push("delta", text),
                                 on_first=lambda: self.push("first", time.perf_counter() - arrival))

    def push(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class ChatServer:
    """The routes' state: the engine, the tokenizer, the served model names and the metrics."""

    def __init__(self, engine: PrefixEngine, tokenizer, model_name: str | None = None, max_tokens: int = 512):
        self.engine, self.tokenizer = engine, tokenizer
        self.model_name = model_name or base_name(engine.shared.model)
        self.adapters = engine.shared.adapters
        self.max_tokens = max_tokens
        config = getattr(engine.shared.model, "config", None)
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.metrics = Metrics(engine.store)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peft-kvcache-model")  # FIFO, one at a time
        eos = {tokenizer.eos_token_id, *_as_list(getattr(engine.shared.model.generation_config, "eos_token_id", None))}
        self.eos_ids = sorted(i for i in eos if i is not None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_ids or [0])[0]
        self.created = int(time.time())
        self.jobs: weakref.WeakSet[_Job] = weakref.WeakSet()  # live requests, cancelled at shutdown

    # ----- request -> model work -----

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

    def work(self, job: _Job, adapter: str | None, prompt, kwargs: dict, seed: int | None) -> None:
        """Run on the model worker: generate, report, and keep the caches (after "done" is pushed)."""
        done = False

        def report(result: TurnResult) -> None:
            nonlocal done
            done = True
            job.push("done", result)

        try:
            job.started = time.perf_counter()
            if job.cancelled:  # its client left while it waited
                return
            self.engine.run(adapter, prompt, kwargs, streamer=job.deltas, should_stop=lambda: job.deltas.stop_hit,
                            cancelled=lambda: job.cancelled, started=job.arrival, seed=seed,
                            on_prepared=lambda *prepared: setattr(job, "prepared", prepared), on_generated=report)
        except BaseException as err:  # noqa: BLE001 - reported to the request, never to the worker
            if done:
                logger.exception("keeping the caches of a completed request failed (the store holds only whole "
                                 "entries: the next request prefills what is missing)")
            else:
                job.push("error", err)

    def context_source(self, source: str, cached_tokens: int, context_from: str | None = None) -> str:
        """The public name of a context source (see the module's docstring): ``mapped:<model>`` and
        ``shared:<model>`` name the model whose cache it came from (``context_from``; None: the base model)."""
        if not cached_tokens:
            return "prefilled"
        if source in ("mapped", "shared"):
            return f"{source}:{self.model_name if context_from is None else context_from}"
        return source


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def create_app(engine: PrefixEngine, tokenizer, model_name: str | None = None, max_tokens: int = 512):
    """The FastAPI app serving ``engine``'s model (base name ``model_name``, default the model's name or path) and
    its adapters; ``max_tokens`` is the reply length when a request sets none. ``app.state.server`` is its
    `ChatServer`."""
    server = ChatServer(engine, tokenizer, model_name, max_tokens)

    @asynccontextmanager
    async def lifespan(app):
        yield
        for job in list(server.jobs):  # a generation in progress stops at its next token
            job.cancelled = True
        server.worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="peft-kvcache chat server", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError):
        return JSONResponse(error_body(err), status_code=err.status)

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
        card = {"object": "model", "created": server.created, "owned_by": "peft-kvcache", "root": server.model_name}
        return {"object": "list", "data": [{"id": server.model_name, **card, "parent": None},
                                           *({"id": a, **card, "parent": server.model_name} for a in server.adapters)]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        arrival = time.perf_counter()
        label = "unknown"
        try:
            body = parse_chat_request(decode_json(await request.body()))
            adapter = server.adapter_of(body.model)
            label = adapter or server.model_name
            prompt = render_prompt(tokenizer, body.messages)
            kwargs = server.generation_kwargs(body, prompt.shape[0])
        except RequestError as err:
            server.metrics.requests.labels(label, err.status).inc()
            raise
        job = _Job(asyncio.get_running_loop(), tokenizer, body.stop_strings(), arrival)
        server.jobs.add(job)
        server.worker.submit(server.work, job, adapter, prompt, kwargs, body.seed)
        reply = _Reply(server, job, body, label)
        kind, payload = await job.events.get()
        while kind == "delta" or (kind == "first" and not body.stream):  # a stream starts at its first token
            kind, payload = await job.events.get()
        if kind == "error":
            return JSONResponse(reply.failed(payload), status_code=500)
        if not body.stream:
            extra = reply.extra(payload)
            return JSONResponse(reply.completion(payload),
                                headers=_headers(extra["context_source"], extra["cached_tokens"], extra["ttft_seconds"]))
        ttft = payload if kind == "first" else payload.first_token_seconds
        source, cached, context_from = job.prepared
        headers = _headers(server.context_source(source, cached, context_from), cached, ttft)
        return StreamingResponse(reply.events(None if kind == "first" else payload), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})

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
            self.completed(result)
            extra = self.extra(result)
            yield event({}, self.finish_reason(result), peft_kvcache=extra)
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield event(None, usage=self.usage(result), peft_kvcache=extra)
            finished = True
            yield DONE_EVENT
        finally:
            if not finished:  # the client went away: stop generating; nothing of it is stored
                self.job.cancelled = True
                self.server.metrics.requests.labels(self.label, 499).inc()


@contextmanager
def running(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a background thread (tests, benchmarks, notebooks); yields its base URL
    (``http://127.0.0.1:PORT``; ``port=0``: a free port) and stops the server on exit.

    Example:
        >>> with running(create_app(engine, tokenizer)) as url:                              # doctest: +SKIP
        ...     OpenAI(base_url=url + "/v1", api_key="-").models.list()
    """
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
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
