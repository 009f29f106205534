"""The chat server under clients that misbehave or leave, and at its edges (issue 25, findings 3, 4, 8, 9): a body limit
and the template and tokenizer off the event loop, a non-streamed request cancelled when its client leaves, a
bounded queue, deadlines for unfinished headers and bodies, the API key. Real sockets on 127.0.0.1, every wait
bounded."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server's extra: pip install -e '.[serve,test]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

from server_helpers import SINK, calibration_ids, client, tiny_peft, tiny_tokenizer  # noqa: E402

from peft_kvcache import SharedPeftModel  # noqa: E402
from peft_kvcache.calibration.loop import calibrate_adapters  # noqa: E402
from peft_kvcache.serving.app import create_app, running  # noqa: E402
from peft_kvcache.serving.prefix_store import PrefixEngine, PrefixStore  # noqa: E402

NAME = "tiny-base"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stack():
    model = tiny_peft()
    maps = calibrate_adapters(model, calibration_ids(), progress=False, sink_tokens=SINK)
    return SharedPeftModel(model, maps), tiny_tokenizer()


def _app(stack, **limits):
    shared, tokenizer = stack
    return create_app(PrefixEngine(shared, PrefixStore(64 * 2**20)), tokenizer, NAME, max_tokens=8, **limits)


@pytest.fixture(scope="module")
def served(stack):
    """A server with the default limits."""
    app = create_app(PrefixEngine(SharedPeftModel(stack[0].model, stack[0].maps), PrefixStore(64 * 2**20)),
                     stack[1], NAME, max_tokens=8)
    with running(app) as url:
        yield url, app.state.server


def _idle(server) -> None:
    server.worker.submit(lambda: None).result(timeout=60)


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
        while server.waiting() < 1 and time.monotonic() < deadline:
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
