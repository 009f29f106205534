"""The OpenAI-compatible chat server (peft_kvcache/serving): a tiny model and two
tiny adapters served on 127.0.0.1 at a free port, driven by the official `openai` client."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi", reason="the server's extra: pip install -e '.[serve,test]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

from server_helpers import (  # noqa: E402
    SINK,
    calibration_ids,
    client,
    concurrently,
    free_port,
    tiny_peft,
    tiny_tokenizer,
)

from peft_kvcache import AdapterSession, SharedPeftModel  # noqa: E402
from peft_kvcache.calibration.loop import calibrate_adapters  # noqa: E402
from peft_kvcache.modeling.capture import CapturedKV  # noqa: E402
from peft_kvcache.serving.app import create_app
from peft_kvcache.serving.hosting import running  # noqa: E402
from peft_kvcache.serving.engine import PrefixEngine
from peft_kvcache.serving.store import PrefixStore  # noqa: E402

NAME = "tiny-base"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def stack():
    model = tiny_peft()
    maps = calibrate_adapters(model, calibration_ids(), progress=False, sink_tokens=SINK)
    return SharedPeftModel(model, maps), tiny_tokenizer()


@pytest.fixture(scope="module")
def served(stack):
    shared, tokenizer = stack
    # Every switch mapped (min_mapped_tokens=0): the tiny conversations here are far shorter than the default threshold.
    app = create_app(PrefixEngine(shared, PrefixStore(64 * 2**20), min_mapped_tokens=0), tokenizer, NAME, max_tokens=8)
    with running(app) as url:
        yield url, app.state.server


@pytest.fixture
def fresh(served):
    """The module's server with an empty prefix store."""
    url, server = served
    _entries(server)  # the worker is idle: the last test's caches are kept before they are dropped
    server.engine.store.clear()
    return url, server


def _entries(server) -> list[tuple]:
    """The store's (adapter, ids) once the model worker is idle (a reply is sent before its caches are kept)."""
    server.queue.worker.submit(lambda: None).result(timeout=60)
    return [(e.adapter, e.ids.tolist()) for e in server.engine.store.entries()]


def _prompt_ids(tokenizer, messages) -> torch.Tensor:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)


def _ask(api, model: str, messages: list[dict], stream: bool, max_tokens: int = 6, **options) -> tuple[str, dict, int]:
    """(reply, the peft_kvcache field, usage.prompt_tokens_details.cached_tokens) of one greedy request."""
    if not stream:
        out = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **GREEDY, **options)
        cached = out.usage.prompt_tokens_details.cached_tokens
        return out.choices[0].message.content, out.model_extra["peft_kvcache"], cached
    text, extra, cached = "", None, None
    for chunk in api.chat.completions.create(model=model, messages=messages, max_completion_tokens=max_tokens,
                                             stream=True, stream_options={"include_usage": True}, **GREEDY, **options):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        extra = chunk.model_extra.get("peft_kvcache", extra)
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return text, extra, cached


# (model, user message, stream): base, an adapter, the same adapter, a switch, back to base, a switch by alias
SCRIPT = [(NAME, "Hello there, how are you?", False), ("first", "Tell me more.", True), ("first", "Go on", False),
          ("second", "Now you.", True), (NAME, "And the base?", False), (f"{NAME}:first", "Last one.", True)]


def test_models_lists_the_base_and_each_adapter_with_the_base_as_parent(served):
    models = {m.id: m.model_extra for m in client(served[0]).models.list()}
    none, mapped = {"mapped_from": None, "shared_from": None}, {"mapped_from": NAME, "shared_from": None}
    assert models == {NAME: {"root": NAME, "parent": None, "peft_kvcache": none},
                      "first": {"root": NAME, "parent": NAME, "peft_kvcache": mapped},
                      "second": {"root": NAME, "parent": NAME, "peft_kvcache": mapped}}


@pytest.mark.parametrize("keep_base", ["prefill", "reverse_map"])
def test_a_conversation_switching_adapters_matches_adapter_session(stack, fresh, keep_base, monkeypatch):
    """Each turn's reply equals AdapterSession's for the same turn (greedy) under the same base catch-up policy,
    switch turns report the history as mapped, and cached_tokens is what the session did not prefill."""
    shared, tokenizer = stack
    monkeypatch.setattr(fresh[1].engine, "keep_base", keep_base)
    api = client(fresh[0])
    session = AdapterSession(shared, keep_base=keep_base, max_new_tokens=6, eos_token_id=[tokenizer.eos_token_id],
                             pad_token_id=tokenizer.pad_token_id)
    messages, seen = [], []
    for model, text, stream in SCRIPT:
        messages.append({"role": "user", "content": text})
        reply, extra, cached = _ask(api, model, messages, stream)
        prompt = _prompt_ids(tokenizer, messages)
        held = session.ids.shape[1]
        assert torch.equal(prompt[:held], session.ids[0])  # the re-rendered history extends the session's
        adapter = None if model == NAME else model.split(":")[-1]
        turn = session.turn(prompt[held:], adapter=adapter)
        assert reply == tokenizer.decode(turn.new_ids[0], skip_special_tokens=True)
        assert (cached, extra["cached_tokens"]) == (turn.cached_tokens, turn.cached_tokens)
        assert extra["context_source"].split(":")[0] == turn.context_source  # one vocabulary for both
        seen.append(extra["context_source"])
        messages.append({"role": "assistant", "content": reply})
    # The third turn continues "first"'s cache, derived from the mapped history: mapped, never "reused" (the session
    # says so too). Under reverse_map the base's cache of the conversation was mapped back from "first" (then
    # extended from "second"): every later turn that starts from it says it came from "first", the model its
    # derivation began with (the label once named the base for the switches, losing the entry's provenance).
    if keep_base == "prefill":
        assert seen == ["prefilled", f"mapped:{NAME}", f"mapped:{NAME}", f"mapped:{NAME}", "reused", f"mapped:{NAME}"]
    else:
        assert seen == ["prefilled", f"mapped:{NAME}", f"mapped:{NAME}", "mapped:first", "mapped:first", "mapped:first"]


def test_headers_say_the_context_source_cached_tokens_and_ttft(fresh):
    api = client(fresh[0])
    messages = [{"role": "user", "content": "Headers please"}]
    first = api.chat.completions.with_raw_response.create(model="first", messages=messages, max_tokens=4, **GREEDY)
    assert first.headers["x-peft-kvcache-context"] == "prefilled"
    assert first.headers["x-peft-kvcache-cached-tokens"] == "0"
    messages += [{"role": "assistant", "content": first.parse().choices[0].message.content},
                 {"role": "user", "content": "Again"}]
    switched = api.chat.completions.with_raw_response.create(model="second", messages=messages, max_tokens=4,
                                                             stream=True, **GREEDY)
    assert switched.headers["x-peft-kvcache-context"] == f"mapped:{NAME}"
    assert int(switched.headers["x-peft-kvcache-cached-tokens"]) > 10
    assert 0 < float(switched.headers["x-peft-kvcache-ttft"]) < 30
    assert "".join(c.choices[0].delta.content or "" for c in switched.parse() if c.choices)


def test_eight_concurrent_clients(stack, fresh):
    """8 clients at once, each a two-turn conversation that switches adapters: all finish in bounded time, each
    gets the replies it would get alone (AdapterSession), and each switch maps its own history."""
    shared, tokenizer = stack
    results, errors = {}, []

    def conversation(i: int) -> list[tuple[str, dict]]:
        api = client(fresh[0])
        messages, out = [{"role": "user", "content": f"{chr(65 + i)} conversation {i}"}], []
        for model in ("first" if i % 2 else NAME, "second"):
            reply, extra, _ = _ask(api, model, messages, stream=bool(i % 2), max_tokens=5)
            out.append((reply, extra))
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and?"}]
        return out

    def worker(i: int) -> None:
        try:
            results[i] = conversation(i)
        except Exception as err:  # surfaced below
            errors.append(err)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(results) == 8 and time.monotonic() - started < 120
    for i, turns in results.items():
        session = AdapterSession(shared, keep_base="prefill", max_new_tokens=5, eos_token_id=[tokenizer.eos_token_id],
                                 pad_token_id=tokenizer.pad_token_id)
        messages = [{"role": "user", "content": f"{chr(65 + i)} conversation {i}"}]
        for adapter, (reply, extra) in zip(("first" if i % 2 else None, "second"), turns):
            prompt = _prompt_ids(tokenizer, messages)
            turn = session.turn(prompt[session.ids.shape[1]:], adapter=adapter)
            assert reply == tokenizer.decode(turn.new_ids[0], skip_special_tokens=True), i
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and?"}]
        assert turns[1][1]["context_source"] == f"mapped:{NAME}" and turns[1][1]["cached_tokens"] > 20


# ----- the policy for approximate caches, over HTTP (issue 25, findings 1-2) -----

SYSTEM = {"role": "system", "content": "You are a terse assistant; answer in one line."}
MIN_MAPPED = 64  # longer than the prefix every conversation shares (the system prompt), shorter than a turn's history
# Per conversation, the model of each turn: switches among the base and both adapters, and a first turn of each kind.
SWITCHES = [(NAME, NAME, "first"), ("first", NAME, "first"), ("second", "second", NAME),
            ("first", "second", NAME), (NAME, NAME, "second"), ("second", "first", "first")]
EXACT = ("reused", "prefilled")


def _policy_app(shared, tokenizer):
    engine = PrefixEngine(shared, PrefixStore(64 * 2**20))
    engine.min_mapped_tokens = MIN_MAPPED
    return create_app(engine, tokenizer, NAME, max_tokens=8)


def _turns(url: str, i: int, replies: list[str] | None = None, after_first=lambda: None) -> list[dict]:
    """Conversation ``i`` (`SWITCHES`), greedy; with ``replies``, a replay asking for exact reuse only, whose
    assistant turns are ``replies`` (the same requests, answered as a full prefill would)."""
    api, messages, turns = client(url), [SYSTEM], []
    options = {} if replies is None else {"extra_body": {"peft_kvcache": {"reuse": "exact"}}}
    for t, model in enumerate(SWITCHES[i]):
        messages.append({"role": "user", "content": f"{chr(65 + i)}{i}: tell me about item {i}, turn {t}"})
        reply, extra, _ = _ask(api, model, messages, stream=bool((i + t) % 2), max_tokens=8, **options)
        turns.append({"model": model, "reply": reply, "source": extra["context_source"],
                      "cached": extra["cached_tokens"]})
        messages.append({"role": "assistant", "content": reply if replies is None else replies[t]})
        if t == 0:
            after_first()
    return turns


def test_concurrent_conversations_get_their_solo_replies_wherever_the_context_is_exact(stack):
    """Six conversations at once against one server (the adapters' conversations start once the base model's have
    answered their first turn: the base's caches of the shared system prompt are there, and no adapter's cache of
    it yet, when the adapters' first turns come), each replayed alone on a fresh server
    asking for exact reuse: every reply whose context the loaded server called exact (reused / prefilled) is the
    solo exact reply, no first turn maps another conversation's system prompt (shorter than min_mapped_tokens), and
    the switches with a longer history map it."""
    shared, tokenizer = stack
    shared_prefix = _prompt_ids(tokenizer, [SYSTEM, {"role": "user", "content": "A"}]).shape[0] - 3  # to "<u>"
    assert SINK < shared_prefix < MIN_MAPPED
    base_first = [i for i, models in enumerate(SWITCHES) if models[0] == NAME]
    answered, ready = [], threading.Event()

    def first_answered() -> None:
        answered.append(True)
        if len(answered) == len(base_first):
            ready.set()

    def conversation(i: int) -> list[dict]:
        if i not in base_first:
            assert ready.wait(timeout=60)
        return _turns(url, i, after_first=first_answered if i in base_first else lambda: None)

    with running(_policy_app(shared, tokenizer)) as url:
        loaded = concurrently(conversation, len(SWITCHES))
    solo_app, solo = _policy_app(shared, tokenizer), {}
    with running(solo_app) as solo_url:
        for i, turns in loaded.items():
            _entries(solo_app.state.server)
            solo_app.state.server.engine.store.clear()  # a fresh server for each conversation
            solo[i] = _turns(solo_url, i, [t["reply"] for t in turns])
    rows = []
    for i, turns in sorted(loaded.items()):
        exact = [t for t, turn in enumerate(turns) if turn["source"] in EXACT]
        same = [t for t in exact if turns[t]["reply"] == solo[i][t]["reply"]]
        mapped = [t for t, turn in enumerate(turns) if turn["source"].startswith("mapped:")]
        rows.append((i, len(turns), len(exact), len(same), len(mapped)))
    total = [sum(r[k] for r in rows) for k in range(1, 5)]
    print(f"\n| conversations | turns | exact turns | identical replies (exact turns) | mapped turns |\n"
          f"|---|---|---|---|---|\n| {len(rows)} | {total[0]} | {total[1]} | {total[2]}/{total[1]} | "
          f"{total[3]} ({total[3] / total[0]:.0%}) |")
    detail = {i: [(t["model"], t["source"], t["cached"], s["source"], s["cached"], t["reply"], s["reply"])
                  for t, s in zip(loaded[i], solo[i])]
              for i in loaded}
    assert all(turns[0]["source"] in EXACT for turns in loaded.values()), detail  # finding 1
    assert total[2] == total[1], detail  # finding 2: what is called exact is exact
    assert all(t["cached"] >= MIN_MAPPED for turns in loaded.values() for t in turns
               if t["source"].startswith("mapped:")), detail
    assert total[3] > 0, detail  # and the switches with a history did map
    assert all(t["source"] in EXACT for turns in solo.values() for t in turns), detail  # the replays are exact


def test_a_cache_mapped_into_an_adapter_is_served_and_counted_as_mapped_then_exact_on_request(fresh):
    """Finding 2 as the issue found it: X asks the base, then "first" (mapped); Y asks "first" what X asked first.
    Y's context comes from X's "first" cache, derived from a mapped prefix: mapped, counted as mapped; asked for
    exact reuse (extra_body), Y gets the reply a fresh server gives."""
    url, server = fresh
    api = client(url)
    x = [{"role": "user", "content": "Tell me about cats."}]
    reply, _, _ = _ask(api, NAME, x, stream=False)
    x += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More please."}]
    assert _ask(api, "first", x, stream=False)[1]["context_source"] == f"mapped:{NAME}"
    _entries(server)
    before = _prompt_token_counts(url)
    y = [{"role": "user", "content": "Tell me about cats."}]
    reply_y, extra, cached = _ask(api, "first", y, stream=True)
    assert extra["context_source"] == f"mapped:{NAME}" and cached > 0
    _entries(server)
    after = _prompt_token_counts(url)
    assert after["mapped"] - before["mapped"] == cached and after["reused"] == before["reused"]
    out = api.chat.completions.create(model="first", messages=y, max_tokens=6, extra_body={"peft_kvcache": {
        "reuse": "exact"}}, **GREEDY)
    assert out.model_extra["peft_kvcache"]["context_source"] == "prefilled"
    _entries(server)  # the worker is idle: nothing is kept after the clear
    server.engine.store.clear()
    assert out.choices[0].message.content == _ask(api, "first", y, stream=False)[0]


def _prompt_token_counts(url: str) -> dict[str, float]:
    text = _metrics(url)
    return {kind: float(m.group(1)) if (m := re.search(rf'peft_kvcache_prompt_tokens_total\{{kind="{kind}"\}} '
                                                        r"([0-9.e+]+)", text)) else 0.0
            for kind in ("reused", "mapped", "prefilled")}


def test_stop_strings_sampling_seeds_and_finish_reasons(served):
    api = client(served[0])
    messages = [{"role": "user", "content": "Stop somewhere"}]
    full = api.chat.completions.create(model="first", messages=messages, max_tokens=8, **GREEDY)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    stop = text[3:5]
    cut = api.chat.completions.create(model="first", messages=messages, max_tokens=8, stop=[stop], **GREEDY)
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model="first", messages=messages, max_tokens=8, stop=stop, stream=True, **GREEDY) if c.choices)
    assert streamed == text[: text.index(stop)]  # the held-back tail that began the stop string is never sent
    sampled = [api.chat.completions.create(model="second", messages=messages, max_tokens=8, temperature=1.5,
                                           top_p=0.9, seed=seed).choices[0].message.content for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] and len(set(sampled)) == 2


# ----- bad input: OpenAI-style errors, and the server keeps serving -----


def _post(url: str, body: bytes | str, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _chat(**fields) -> str:
    return json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("body, status, pattern", [
    (_chat(model="nope"), 404, r"The model `nope` does not exist"),
    ("{not json", 400, r"not valid JSON"),
    ("[1, 2]", 400, r"must be a JSON object"),
    (json.dumps({"model": NAME}), 400, r"^messages: Field required"),
    (_chat(messages=[]), 400, r"^messages: List should have at least 1 item"),
    (_chat(messages=[{"role": "wizard", "content": "hi"}]), 400, r"^messages\.0\.role"),
    (_chat(temperature=5), 400, r"^temperature: .*less than or equal to 2"),
    (_chat(max_tokens=0), 400, r"^max_tokens: .*greater than or equal to 1"),
    (_chat(n=2), 400, r"^n: not supported by this server"),
    (_chat(logprobs=True), 400, r"^logprobs: not supported"),
    (_chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, r"^tools: not supported"),
    (_chat(stop=["a", "b", "c", "d", "e"]), 400, r"^stop: give at most 4"),
    (_chat(stop=["a", "x" * 257]), 400, r"^stop: .* of at most 256 characters"),  # searched after every token
    (_chat(cache_salt="tenant-a"), 400, r"^cache_salt: not supported by this server"),  # no isolation: said, not faked
    (_chat(stream_options={"include_usage": True}), 400, r"^stream_options: only with stream: true"),
    (_chat()[:-1] + ', "x": ' + "9" * 5000 + "}", 400, r"^the request body cannot be read"),  # too long an int
    (_chat(stream="yes please"), 400, r"^stream: "),
    # finding 9: strict types, finite numbers, unsupported fields refused by name
    (_chat(max_tokens="5"), 400, r"^max_tokens: Input should be a valid integer"),
    (_chat(max_tokens=True), 400, r"^max_tokens: Input should be a valid integer"),
    (_chat(stream="yes"), 400, r"^stream: Input should be a valid boolean"),
    (_chat()[:-1] + ', "temperature": NaN}', 400, r"^temperature: Input should be a finite number"),
    (_chat(response_format={"type": "json_object"}), 400, r"^response_format: not supported by this server"),
    (_chat(tool_choice="auto"), 400, r"^tool_choice: not supported by this server"),
    (_chat(top_logprobs=3), 400, r"^top_logprobs: not supported by this server"),
    # finding 6: client mistakes that were 500s
    (_chat(seed=2**70), 400, r"^seed: Input should be less than or equal to 18446744073709551615"),
    (_chat(messages=[{"role": "user", "content": "\ud800abc"}]), 400,
     r"^messages\.0\.content: not valid Unicode text: a lone surrogate '\\ud800' at character 0"),
    pytest.param(_chat()[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}", 400, r"nests JSON too deeply",
                 id="JSON-nested-5000-deep"),
    (_chat(peft_kvcache={"reuse": "sometimes"}), 400, r"^peft_kvcache\.reuse: Input should be 'map', 'exact' or"),
    (_chat(messages=[{"role": "user", "content": "x" * 1100}]), 400, r"maximum context length is 1024 tokens"),
    (_chat(max_tokens=5000), 400, r"maximum context length is 1024 tokens.*5000 for the completion"),
])
def test_bad_requests_get_openai_style_errors(served, body, status, pattern):
    url, server = served
    entries = _entries(server)
    code, answer = _post(url, body)
    assert code == status and set(answer["error"]) == {"message", "type", "param", "code"}
    assert re.search(pattern, answer["error"]["message"]), answer
    assert answer["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert _entries(server) == entries  # no model ran
    assert _post(url, _chat(max_tokens=2, temperature=0))[0] == 200  # and the server still serves


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_context_length_refusal_names_the_field_the_client_sent(served, field):
    code, answer = _post(served[0], _chat(**{field: 5000}))
    assert code == 400 and answer["error"]["param"] == field


def test_a_temperature_too_small_to_divide_by_is_greedy(served):
    url, _ = served
    greedy = _post(url, _chat(max_tokens=4, temperature=0))
    tiny = _post(url, _chat(max_tokens=4, temperature=1e-40))  # the logits divided by it overflowed: a 500
    assert greedy[0] == tiny[0] == 200
    assert tiny[1]["choices"][0]["message"] == greedy[1]["choices"][0]["message"]


def test_the_openai_client_sees_the_errors(served):
    api = client(served[0])
    with pytest.raises(openai.NotFoundError) as err:
        api.chat.completions.create(model="missing", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="context length"):
        api.chat.completions.create(model="first", messages=[{"role": "user", "content": "y" * 2000}])
    assert _post(served[0], b"", path="/v1/nothing")[0] == 404


def test_a_request_that_fails_is_answered_500_and_changes_nothing(stack, fresh, monkeypatch):
    shared, tokenizer = stack
    url, server = fresh
    api = client(url)
    messages = [{"role": "user", "content": "Keep this"}]
    reference = _ask(api, "first", messages, stream=False)
    before = _entries(server)
    assert before

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(shared.model, "generate", broken)
    code, answer = _post(url, json.dumps({"model": "second", "messages": messages, "max_tokens": 6, **GREEDY}))
    assert code == 500 and "out of memory (simulated)" in answer["error"]["message"]
    monkeypatch.undo()
    assert _entries(server) == before
    again = _ask(api, "first", messages, stream=True)
    assert again[0] == reference[0] and again[1]["context_source"] == "reused"


def test_a_client_that_leaves_mid_stream_stops_its_generation_and_loses_nothing(stack, fresh):
    """The stream is closed after two events: generation stops (far fewer decode steps than asked), nothing
    of it is stored, and the conversation's next request is served as if it never happened."""
    shared, tokenizer = stack
    url, server = fresh
    api = client(url)
    messages = [{"role": "user", "content": "Start here"}]
    reply, _, _ = _ask(api, NAME, messages, stream=False)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "then switch"}]
    expected = _ask(api, "first", messages, stream=False)
    server.engine.store.clear()
    _ask(api, NAME, messages[:1], stream=False)
    entries = _entries(server)

    steps = []
    hook = shared.model.get_base_model().model.register_forward_pre_hook(
        lambda module, args, kwargs: steps.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "first", "messages": messages, "max_tokens": 900, "stream": True, **GREEDY}),
            {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("X-PEFT-KVCache-Context") == f"mapped:{NAME}"
        assert response.readline().startswith(b"data: ")
        connection.sock.shutdown(2)
        connection.close()
        deadline = time.monotonic() + 30
        while 'status="499"' not in _metrics(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _entries(server) == entries  # the cancelled generation stored nothing
        again = _ask(api, "first", messages, stream=False)
    finally:
        hook.remove()
    assert 'peft_kvcache_requests_total{model="first",status="499"} 1.0' in _metrics(url)
    assert steps.count(1) < 300  # decode steps: the cancelled request's ~900 stopped early
    assert again[0] == expected[0] and again[1]["context_source"] == f"mapped:{NAME}"


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        return response.read().decode()


def test_metrics_count_requests_sources_tokens_and_the_store(fresh):
    url, server = fresh
    api = client(url)
    messages = [{"role": "user", "content": "Count me"}]
    reply, _, _ = _ask(api, NAME, messages, stream=False)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    _, extra, cached = _ask(api, "second", messages, stream=True)
    server.queue.worker.submit(lambda: None).result(timeout=60)  # the worker keeps the caches after the reply ends
    text = _metrics(url)
    assert re.search(r'peft_kvcache_requests_total\{model="second",status="200"\} [1-9]', text)
    assert re.search(r'peft_kvcache_ttft_seconds_count\{source="mapped"\} [1-9]', text)
    mapped = float(re.search(r'peft_kvcache_prompt_tokens_total\{kind="mapped"\} ([0-9.e+]+)', text).group(1))
    assert mapped >= cached > 0
    assert f"peft_kvcache_store_bytes {float(server.engine.store.nbytes)}" in text
    assert re.search(r"peft_kvcache_store_entries [1-9]", text) and "peft_kvcache_store_evictions_total" in text


# ----- the prefix store and the engine, without HTTP -----


def _kv(length: int, value: float = 0.0) -> CapturedKV:
    return CapturedKV([torch.full((1, 2, length, 4), value)], [torch.full((1, 2, length, 4), value)])


def test_store_longest_prefix_lru_eviction_and_adapters():
    store = PrefixStore(max_bytes=3 * _kv(10).keys[0].nbytes * 2)  # three 10-token entries
    ids = torch.arange(10)
    store.add("a", ids, _kv(10))
    store.add("b", ids, _kv(10))
    assert store.longest("a", torch.tensor([0, 1, 2, 9]), limit=9)[1] == 3
    assert store.longest(None, ids, limit=9) == (None, 0)  # never served to another adapter
    assert store.longest("a", ids, limit=4)[1] == 4
    store.add("a", torch.arange(12), _kv(12))  # extends ("a", 0..9): replaces it
    assert [(e.adapter, len(e.ids)) for e in store.entries()] == [("b", 10), ("a", 12)]
    store.touch(store.entries()[0])  # "b" used: "a" is now the least recent
    store.add("c", ids + 50, _kv(10))
    assert [e.adapter for e in store.entries()] == ["b", "c"] and store.evictions == 1
    assert store.nbytes == sum(e.nbytes for e in store.entries()) <= store.max_bytes
    assert store.add("d", torch.arange(40), _kv(40)) is False  # larger than the bound: refused
    with pytest.raises(Exception, match="came with a cache of"):
        store.add("a", torch.arange(3), _kv(2))


def test_generate_never_writes_into_a_stored_entry(stack):
    """The engine hands generate() caches made of slices of stored tensors: they must come back untouched."""
    shared, tokenizer = stack
    engine = PrefixEngine(shared, PrefixStore(2**26), min_mapped_tokens=0)
    prompt = _prompt_ids(tokenizer, [{"role": "user", "content": "untouched please"}])
    engine.run("first", prompt, {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 1})
    saved = [(e, [k.clone() for k in e.kv.keys + e.kv.values]) for e in engine.store.entries()]
    assert {e.adapter for e, _ in saved} == {"first", None}
    sources = [engine.run(adapter, prompt, {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 1}).context_source
               for adapter in ("first", None, "second", "first")]
    assert sources == ["reused", "reused", "mapped", "reused"]  # every request read a stored entry
    for entry, tensors in saved:  # replaced or not, no tensor handed out was written
        assert all(torch.equal(now, then) for now, then in zip(entry.kv.keys + entry.kv.values, tensors))


def test_a_streamer_that_raises_leaves_the_store_as_it_was(stack):
    shared, tokenizer = stack
    engine = PrefixEngine(shared, PrefixStore(2**26), min_mapped_tokens=0)
    greedy = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 1}
    history = _prompt_ids(tokenizer, [{"role": "user", "content": "one"}])
    first = engine.run(None, history, greedy)
    prompt = torch.cat([history, first.new_ids[0], _prompt_ids(tokenizer, [{"role": "user", "content": "two"}])])
    reference = PrefixEngine(shared, PrefixStore(2**26), min_mapped_tokens=0)
    reference.run(None, history, greedy)
    expected = reference.run("second", prompt, greedy)
    snapshot = [(e.adapter, e.ids.clone(), [k.clone() for k in e.kv.keys]) for e in engine.store.entries()]

    class Failing:
        puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:
                raise KeyboardInterrupt  # a Ctrl-C mid-generation

        def end(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        engine.run("second", prompt, greedy, streamer=Failing())
    after = engine.store.entries()
    assert [(v, i.tolist()) for v, i, _ in snapshot] == [(e.adapter, e.ids.tolist()) for e in after]
    assert all(torch.equal(a, b) for (_, _, keys), e in zip(snapshot, after) for a, b in zip(keys, e.kv.keys))
    again = engine.run("second", prompt, greedy)
    assert torch.equal(again.new_ids, expected.new_ids) and again.context_source == expected.context_source == "mapped"


def test_exact_and_no_reuse_modes(stack):
    """The benchmark's baselines: "exact" reuses only the same adapter's caches (a switch prefills), "none"
    never reuses; both give the same greedy replies as full prefill for the same prompt."""
    shared, tokenizer = stack
    greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 1}
    prompt = _prompt_ids(tokenizer, [{"role": "user", "content": "modes"}])
    exact, none = PrefixEngine(shared, PrefixStore(2**26), "exact"), PrefixEngine(shared, PrefixStore(2**26), "none")
    for engine in (exact, none):
        base = engine.run(None, prompt, greedy)
        follow = torch.cat([prompt, base.new_ids[0], _prompt_ids(tokenizer, [{"role": "user", "content": "next"}])])
        switched, same = engine.run("first", follow, greedy), engine.run(None, follow, greedy)
        assert switched.context_source == "prefilled" and switched.cached_tokens == 0
        assert (same.context_source, same.cached_tokens > 0) == (("reused", True) if engine is exact else ("prefilled", False))
    assert len(none.store) == 0 and {e.adapter for e in exact.store.entries()} == {None, "first"}


# ----- the command line -----


def test_serve_refuses_bad_options_before_loading_anything(tmp_path):
    from peft_kvcache.cli import main

    assert main(["serve", "--model", "x", "--adapter", "nodelimiter"]) == 2
    assert main(["serve", "--model", "x", "--adapter", f"a={tmp_path}"]) == 2  # no adapter_config.json
    assert main(["serve", "--model", "x", "--adapter", "a=org/repo", "--cache-memory", "0"]) == 2
    assert main(["serve", "--model", "x", "--adapter", "a:b=org/repo"]) == 2
    assert main(["serve", "--model", "x", "--adapter", "a=org/repo", "--calibrate-missing", "--calibration-files",
                 "100000"]) == 2


def test_calibrating_missing_maps_keeps_every_direction_that_loaded(monkeypatch):
    import peft_kvcache.calibration.loop as calibrate
    from peft_kvcache import AdapterMaps
    from peft_kvcache.calibration.loop import calibrate_missing

    published, fitted = object(), {"to": object(), "back": object()}
    monkeypatch.setattr(calibrate, "calibrate_adapters", lambda *a, **k: AdapterMaps(
        to_adapter={"first": fitted["to"]}, to_base={"first": fitted["back"]}))
    maps = calibrate_missing(None, None, ["first"], AdapterMaps(to_base={"first": published}), files=2)
    assert maps.to_adapter["first"] is fitted["to"] and maps.to_base["first"] is published


def test_serve_command_starts_says_which_maps_and_answers(tmp_path):
    """``peft-kvcache serve`` in a subprocess on a saved tiny model, its adapters and a folder of maps."""
    from conftest import save_tiny_model
    from peft import get_peft_model
    from test_peft import lora

    from peft_kvcache import load_model

    folder = save_tiny_model(tmp_path / "tiny", layers=2, seed=0)
    base, _ = load_model(str(folder))
    model = get_peft_model(base, lora(10), adapter_name="first").eval()
    model.save_pretrained(tmp_path / "adapters")
    maps = calibrate_adapters(model, calibration_ids(8, 32), progress=False)
    maps.save_pretrained(tmp_path / "maps", "tiny")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "peft_kvcache", "serve", "--model", str(folder), "--adapter",
         f"first={tmp_path / 'adapters' / 'first'}", "--maps", str(tmp_path / "maps"), "--port", str(port)],
        stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        lines = []
        deadline = time.monotonic() + 120
        while not any("Uvicorn running" in line for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stderr.readline())
        log = "".join(lines)
        assert "first: forward" in log and "tiny-base-to-first" in log and "tiny-first-to-base" in log
        api = client(f"http://127.0.0.1:{port}")
        assert [m.id for m in api.models.list()][1:] == ["first"]
        out = api.chat.completions.create(model="first", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        # a random tiny model may draw its end token early (its weights differ across transformers releases)
        stopped = out.choices[0].finish_reason == "stop"
        assert 1 <= out.usage.completion_tokens <= 3 and (stopped or out.usage.completion_tokens == 3)
    finally:
        process.terminate()
        process.wait(timeout=30)


# ----- the chat page, in a real browser -----


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.mark.skipif(_chromium() is None,
                    reason="no chromium and chromedriver (apt-get install chromium chromium-driver)")
def test_chat_page_in_headless_chromium(fresh):
    """Two messages from the page: the first to an adapter, the second to the other adapter; each reply shows
    its TTFT and context source, the switch's being mapped."""
    pytest.importorskip("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser, driver_path = _chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(fresh[0] + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
        for i, (model, text) in enumerate((("first", "Hi from the page"), ("second", "Switch now"))):
            Select(driver.find_element(By.ID, "model")).select_by_value(model)
            driver.find_element(By.ID, "input").send_keys(text)
            driver.find_element(By.ID, "send").click()
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant .meta[data-source]")) == i + 1)
        metas = driver.find_elements(By.CSS_SELECTOR, ".assistant .meta")
        assert [m.get_attribute("data-source") for m in metas] == ["prefilled", f"mapped:{NAME}"]
        assert all(float(m.get_attribute("data-ttft")) > 0 and "TTFT" in m.text for m in metas)
        assert "context: mapped:" in metas[1].text
        assert all(r.text for r in driver.find_elements(By.CSS_SELECTOR, ".assistant .text"))
    finally:
        driver.quit()
