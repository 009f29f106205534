"""The chat server under clients that misbehave or leave, and at its edges (issue 25, findings 3-5, 8, 9): a body limit
and the template and tokenizer off the event loop, a non-streamed request cancelled when its client leaves, a
bounded queue, deadlines for unfinished headers and bodies, SIGTERM draining within a timeout, the API key, the port
checked before the model loads, and maps chosen by what they fit. Real sockets on 127.0.0.1, every wait bounded."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server's extra: pip install -e '.[serve,test]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

from server_helpers import SINK, calibration_ids, client, free_port, tiny_peft, tiny_tokenizer  # noqa: E402

from peft_kvcache import SharedPeftModel  # noqa: E402
from peft_kvcache.calibration.loop import calibrate_adapters  # noqa: E402
from peft_kvcache.serving.app import create_app
from peft_kvcache.serving.hosting import running  # noqa: E402
from peft_kvcache.serving.engine import PrefixEngine
from peft_kvcache.serving.limits import ServerLimits  # noqa: E402
from peft_kvcache.serving.store import PrefixStore  # noqa: E402

NAME = "tiny-base"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stack():
    model = tiny_peft()
    maps = calibrate_adapters(model, calibration_ids(), progress=False, sink_tokens=SINK)
    return SharedPeftModel(model, maps), tiny_tokenizer()


def _app(stack, api_key: str | None = None, **limits):
    shared, tokenizer = stack
    return create_app(PrefixEngine(shared, PrefixStore(64 * 2**20)), tokenizer, NAME, max_tokens=8, api_key=api_key,
                      limits=ServerLimits(**limits))


@pytest.fixture(scope="module")
def served(stack):
    """A server with the default limits."""
    app = create_app(PrefixEngine(SharedPeftModel(stack[0].model, stack[0].maps), PrefixStore(64 * 2**20)),
                     stack[1], NAME, max_tokens=8)
    with running(app) as url:
        yield url, app.state.server


def _idle(server) -> None:
    server.queue.worker.submit(lambda: None).result(timeout=60)


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _body(content: str = "hi", **fields) -> bytes:
    return json.dumps({"model": NAME, "messages": [{"role": "user", "content": content}], **fields}).encode()


def _post(url: str, body: bytes, timeout: float = 60, headers: dict | None = None) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), {k.lower(): v for k, v in err.headers.items()}


def _metrics(url: str, headers: dict | None = None) -> str:
    request = urllib.request.Request(url + "/metrics", headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


class HealthProbe:
    """Polls /health every 50 ms in a thread while a block runs; ``worst`` is the slowest answer (seconds)."""

    def __init__(self, url: str):
        self.url, self.times, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=30) as response:
                    response.read()
            except OSError:
                pass
            self.times.append(time.monotonic() - started)
            time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=60)

    @property
    def worst(self) -> float:
        return max(self.times, default=float("inf"))


# ----- finding 3: one large body does not freeze the server -----


def test_a_10_mb_body_is_refused_413_quickly_and_health_keeps_answering(served):
    url, server = served
    big = _body("x" * 10_000_000)
    with HealthProbe(url) as probe:
        started = time.monotonic()
        status, answer, headers = _post(url, big)
        seconds = time.monotonic() - started
        time.sleep(0.2)
    assert status == 413 and seconds < 10, (status, seconds)
    assert re.search(r"exceeds this server's limit of 8388608 bytes \(--max-body-bytes\)", answer["error"]["message"])
    assert answer["error"]["code"] == "request_too_large" and headers.get("connection") == "close"
    assert probe.worst < 2.0, probe.times
    assert _post(url, _body(max_tokens=2, temperature=0))[0] == 200


def test_a_large_body_within_the_limit_is_tokenized_off_the_event_loop(stack):
    """10 MB of content under a 16 MiB limit: the template and the tokenizer take seconds, /health answers all along,
    and the request gets its 400 (the prompt is longer than the context)."""
    with running(_app(stack, max_body_bytes=16 * 2**20)) as url, HealthProbe(url) as probe:
        status, answer, _ = _post(url, _body("y" * 10_000_000), timeout=120)
        time.sleep(0.2)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert len(probe.times) > 3 and probe.worst < 2.0, probe.times


# ----- finding 4: a client that leaves costs nothing; the queue is bounded -----


def test_a_non_streamed_request_whose_client_leaves_stops_and_stores_nothing(stack, served):
    shared, _ = stack
    url, server = served
    _idle(server)
    server.engine.store.clear()
    steps = []
    hook = shared.model.get_base_model().model.register_forward_pre_hook(
        lambda module, args, kwargs: steps.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        connection = http.client.HTTPConnection(*_hostport(url), timeout=60)
        connection.request("POST", "/v1/chat/completions", _body("Leave soon", max_tokens=1000, temperature=0),
                           {"Content-Type": "application/json"})
        deadline = time.monotonic() + 30
        while steps.count(1) < 20 and time.monotonic() < deadline:  # generating
            time.sleep(0.01)
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        deadline = time.monotonic() + 30
        while 'model="tiny-base",status="499"' not in _metrics(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        _idle(server)
        decoded = steps.count(1)
    finally:
        hook.remove()
    assert 'peft_kvcache_requests_total{model="tiny-base",status="499"} 1.0' in _metrics(url)
    assert decoded < 600, decoded  # of the 1,000 asked for: generation stopped when the client left
    assert server.engine.store.entries() == []  # nothing of it was kept
    started = time.monotonic()
    assert _post(url, _body(max_tokens=2, temperature=0))[0] == 200 and time.monotonic() - started < 10


def test_a_full_queue_answers_429_with_retry_after(stack, monkeypatch):
    app = _app(stack, max_queue=1)
    server = app.state.server
    release, running_now = threading.Event(), threading.Event()
    real_run = server.engine.run

    def held(*args, **kwargs):
        running_now.set()
        assert release.wait(timeout=60)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(server.engine, "run", held)
    answers = {}

    def ask(key: str) -> None:
        answers[key] = _post(url, _body(key, max_tokens=2, temperature=0))

    with running(app) as url:
        first = threading.Thread(target=ask, args=("running",))
        first.start()
        assert running_now.wait(timeout=30)
        second = threading.Thread(target=ask, args=("waiting",))
        second.start()
        deadline = time.monotonic() + 30
        while server.queue.waiting() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, answer, headers = _post(url, _body("one too many", max_tokens=2))
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert answer["error"]["code"] == "rate_limit_exceeded" and "--max-queue" in answer["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=1)
        release.set()
        first.join(timeout=60)
        second.join(timeout=60)
    assert answers["running"][0] == answers["waiting"][0] == 200


# ----- finding 9: deadlines for unfinished headers and bodies -----


def test_a_client_sending_half_a_body_is_cut_off_within_the_read_timeout(stack):
    with running(_app(stack, read_timeout=1.0)) as url:
        sock = socket.create_connection(_hostport(url), timeout=30)
        body = _body("half of me")
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[: len(body) // 2])
        started = time.monotonic()
        answer = _read_until_closed(sock)
        seconds = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408") and b"--read-timeout" in answer, answer[:300]
    assert 0.5 < seconds < 4, seconds


def test_a_client_sending_half_its_headers_is_disconnected_within_the_read_timeout(stack):
    with running(_app(stack, read_timeout=1.0)) as url:
        sock = socket.create_connection(_hostport(url), timeout=30)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        started = time.monotonic()
        answer = _read_until_closed(sock)
        seconds = time.monotonic() - started
    assert answer == b"" and 0.5 < seconds < 4, (answer, seconds)


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's own timeout bounds each read)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    finally:
        sock.close()
    return data


# ----- finding 8: the API key; models without a map say so -----


def test_an_api_key_guards_everything_but_health_and_the_page(stack):
    with running(_app(stack, api_key="sekret")) as url:
        with pytest.raises(openai.AuthenticationError) as err:
            client(url).models.list()
        assert err.value.body["code"] == "invalid_api_key"
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        allowed = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0, timeout=60)
        assert allowed.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(urllib.error.HTTPError, match="401"):
            _metrics(url)
        assert "peft_kvcache_requests_total" in _metrics(url, {"Authorization": "Bearer sekret"})
        for path in ("/health", "/"):
            with urllib.request.urlopen(url + path, timeout=30) as response:
                assert response.status == 200


def test_models_say_which_adapters_have_no_map(stack):
    shared, tokenizer = stack
    from peft_kvcache import AdapterMaps

    bare = SharedPeftModel(shared.model, AdapterMaps(to_adapter={"first": shared.maps.to_adapter["first"]}))
    with running(create_app(PrefixEngine(bare, PrefixStore(2**26)), tokenizer, NAME)) as url:
        models = {m.id: m.model_extra["peft_kvcache"] for m in client(url).models.list()}
    assert models == {NAME: {"mapped_from": None, "shared_from": None},
                      "first": {"mapped_from": NAME, "shared_from": None},
                      "second": {"mapped_from": None, "shared_from": None}}


# ----- the serve command: startup checks, maps by fingerprint, SIGTERM -----


def _saved_stack(tmp_path: Path, folder_name: str, max_positions: int = 512, slow: bool = False):
    """A tiny model saved to ``tmp_path/folder_name`` and an adapter ``first`` saved beside it: (model folder, adapter
    folder, the PeftModel). ``slow``: a model that never ends a reply on its own (EOS and the ids the tokenizer lacks
    get zero logits) and has room for long ones."""
    import torch
    from conftest import char_tokenizer
    from peft import get_peft_model
    from test_peft import lora
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).eval()
    if slow:
        with torch.no_grad():
            base.lm_head.weight[:3] = 0
            base.lm_head.weight[100:] = 0
    folder = tmp_path / folder_name
    base.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    model = get_peft_model(base, lora(10), adapter_name="first").eval()
    model.save_pretrained(tmp_path / "adapters")
    return folder, tmp_path / "adapters" / "first", model


def test_serve_checks_the_port_before_loading_the_model(monkeypatch, capsys):
    import peft_kvcache.modeling.fixtures as fixtures
    from peft_kvcache.cli import main

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(fixtures, "load_model", load_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "x", "--adapter", "a=org/repo", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port} cannot be bound" in err and "nothing was loaded" in err and "Traceback" not in err


@pytest.mark.parametrize("api_key", [None, "sekret"])
def test_serve_warns_about_a_bind_beyond_the_loopback_without_an_api_key(monkeypatch, capsys, api_key):
    import peft_kvcache.modeling.fixtures as fixtures
    from peft_kvcache.cli import main

    monkeypatch.setattr(fixtures, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.delenv("PEFT_KVCACHE_API_KEY", raising=False)
    with socket.socket() as taken:  # the port is taken: serve stops right after its warning
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        key = [] if api_key is None else ["--api-key", api_key]
        assert main(["serve", "--model", "x", "--adapter", "a=org/repo", "--host", "0.0.0.0", "--port", str(port),
                     *key]) == 2
    err = capsys.readouterr().err
    assert ("WARNING: serving on 0.0.0.0, beyond the loopback, without --api-key" in err) == (api_key is None)


def test_serve_finds_maps_by_what_they_fit_not_by_folder_name(tmp_path):
    """The model's folder is named ``smol``, its maps were saved as ``tiny-*`` beside a published map of another
    model: each map is found by its fingerprints; an adapter without a map is warned about."""
    import shutil

    from peft_kvcache.serving.command import ServeOptions, build

    folder, adapter, model = _saved_stack(tmp_path, "smol")
    maps = calibrate_adapters(model, calibration_ids(8, 32), progress=False)
    maps.save_pretrained(tmp_path / "maps", "tiny")
    shutil.copytree(ROOT / "hub_cards" / "smollm2-135m-instruct-base-to-shout", tmp_path / "maps" / "other-model")
    options = ServeOptions(str(folder), {"first": str(adapter)}, maps=[str(tmp_path / "maps")])
    engine, _, _, lines = build(options)
    text = "\n".join(lines)
    assert set(engine.shared.maps.to_adapter) == set(engine.shared.maps.to_base) == {"first"}
    assert "tiny-base-to-first" in text and "tiny-first-to-base" in text and "WARNING" not in text
    bare_engine, _, _, bare = build(ServeOptions(str(folder), {"first": str(adapter)}))
    assert not bare_engine.shared.maps.to_adapter
    assert any(line.startswith("WARNING: no usable map for adapters ['first']") for line in bare)


def test_sigterm_cuts_the_running_stream_and_answers_the_waiting_within_the_drain_timeout(tmp_path):
    """``peft-kvcache serve`` in a subprocess: a stream that would run for half a minute, two requests waiting behind
    it; SIGTERM: the waiting ones get 503 at once, the stream is cut at the drain timeout, the process exits."""
    folder, adapter, _ = _saved_stack(tmp_path, "slow", max_positions=20_000, slow=True)
    port = free_port()
    drain = 5.0  # the default --drain-timeout
    process = subprocess.Popen(
        [sys.executable, "-m", "peft_kvcache", "serve", "--model", str(folder), "--adapter", f"first={adapter}",
         "--port", str(port), "--max-tokens", "19000"],
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    log, results = [], {}
    reader = threading.Thread(target=lambda: log.extend(iter(process.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("Uvicorn running" in line for line in log):
            assert time.monotonic() < deadline and process.poll() is None, "".join(log)
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"

        def stream() -> None:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            connection.request("POST", "/v1/chat/completions", _body("go", stream=True, temperature=0, max_tokens=19000)
                               .replace(NAME.encode(), b"first"), {"Content-Type": "application/json"})
            response = connection.getresponse()
            results["stream_status"], results["stream"] = response.status, []
            for line in response:  # the events as they come
                if line.startswith(b"data: "):
                    results["stream"].append(line[6:].strip())

        def waiting(key: str) -> None:
            results[key] = _post(url, _body(key, temperature=0, max_tokens=19000).replace(NAME.encode(), b"first"),
                                 timeout=120)[:2]
            results[key + "_at"] = time.monotonic()

        threads = [threading.Thread(target=stream)]
        threads[0].start()
        deadline = time.monotonic() + 60
        while len(results.get("stream", [])) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        threads += [threading.Thread(target=waiting, args=(k,)) for k in ("one", "two")]
        for thread in threads[1:]:
            thread.start()
        time.sleep(1.0)
        assert process.poll() is None
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=drain + 15)
        exited = time.monotonic() - sent
        for thread in threads:
            thread.join(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert exited < drain + 8, (exited, "".join(log[-20:]))
    for key in ("one", "two"):
        status, answer = results[key]
        assert status == 503 and answer["error"]["code"] == "server_shutting_down", results[key]
        assert results[key + "_at"] - sent < 3
    events = results["stream"]
    assert results["stream_status"] == 200 and b"[DONE]" not in events
    assert b"server_shutting_down" in events[-1] and len(events) < 19000


def test_a_stream_the_client_leaves_after_its_last_chunk_is_counted_once_as_done():
    """Its reply was complete (counted 200) when the client left before ``[DONE]``: no 499 beside it; a client that
    leaves before the last chunk still cancels and counts 499 alone."""
    import asyncio

    import torch

    from peft_kvcache.runtime.turn import TurnResult
    from peft_kvcache.serving.jobs import Job
    from peft_kvcache.serving.metrics import Metrics
    from peft_kvcache.serving.openai_api import parse_chat_request
    from peft_kvcache.serving.replies import Reply
    from peft_kvcache.serving.store import PrefixStore

    async def leave(after_chunks: int) -> tuple[dict, bool]:
        metrics = Metrics(PrefixStore(2**20))
        job = Job(asyncio.get_running_loop(), tiny_tokenizer(), [], time.perf_counter(), stream=True)
        body = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        reply = Reply(job, body, "m", metrics, [], lambda made, cached: "prefilled")
        result = TurnResult(None, torch.tensor([[5, 6]]), 3, "prefilled", 0, 0.01, 0.0)
        job.push("done", result)
        events = reply.events(None, on_end=lambda: None)
        for _ in range(after_chunks):
            await events.__anext__()
        await events.aclose()  # the client is gone
        counted = {s.labels["status"]: s.value for m in metrics.registry.collect() for s in m.samples
                   if s.name == "peft_kvcache_requests_total"}
        return counted, job.cancelled

    counted, cancelled = asyncio.run(leave(2))  # the role chunk, then the one with the finish_reason
    assert counted == {"200": 1.0} and not cancelled
    counted, cancelled = asyncio.run(leave(1))  # before the reply was complete
    assert counted == {"499": 1.0} and cancelled


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_stream_whose_client_is_gone_before_its_first_chunk_stops_and_leaves_no_job(stack, spec):
    """Driven at the ASGI level: the client is gone when the stream starts. Under ASGI spec 2.3 (uvicorn's HTTP)
    starlette's disconnect listener finds it at once and cancels the stream; under 2.4 the first send fails. Either
    way the generation stops, the job leaves the queue and the request counts 499 once."""
    import asyncio

    from starlette.requests import ClientDisconnect

    shared, _ = stack
    app = _app(stack)
    server = app.state.server
    steps = []
    hook = shared.model.get_base_model().model.register_forward_pre_hook(
        lambda module, args, kwargs: steps.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    body = _body("Leave at once", max_tokens=1000, temperature=0, stream=True)
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "root_path": "", "query_string": b"", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}

    async def drive() -> list[dict]:
        reads, sent = [], []

        async def receive() -> dict:
            reads.append(len(reads))
            if len(reads) == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            if len(reads) == 2:  # the handler's own watch, cancelled once the stream is handed to starlette
                await asyncio.Future()
            return {"type": "http.disconnect"}  # starlette's listen_for_disconnect: gone already

        async def send(message: dict) -> None:
            if spec == "2.4" and message["type"] == "http.response.body":
                raise OSError("the connection is closed")
            sent.append(message)

        try:
            await app(scope, receive, send)
        except ClientDisconnect:
            assert spec == "2.4"
        return sent

    try:
        asyncio.run(drive())
        deadline = time.monotonic() + 60
        while server.queue.jobs and time.monotonic() < deadline:
            time.sleep(0.05)
        _idle(server)
        decoded = steps.count(1)
        counted = {s.labels["status"]: s.value for m in server.metrics.registry.collect() for s in m.samples
                   if s.name == "peft_kvcache_requests_total"}
    finally:
        hook.remove()
        server.close()
    assert not server.queue.jobs
    assert decoded < 600, decoded  # of the 1,000 asked for: generation stopped when the client left
    assert counted == {"499": 1.0}, counted
    assert server.engine.store.entries() == []
