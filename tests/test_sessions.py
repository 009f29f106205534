"""Adapter-switching sessions (runtime/sessions.py) on tiny random models: switching, threads, a turn that fails
midway, one lock per model, what a turn accepts, the one-model PEFT pattern."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import random_ids, tiny_model
from peft import LoraConfig, get_peft_model
from test_peft import MODULES, peft_with_adapters

from peft_kvcache import AdapterSession, FingerprintMismatchError, MappedCache, SessionError, SharedPeftModel
from peft_kvcache.calibration.loop import calibrate_adapters
from peft_kvcache.modeling._compat import unwrap_peft
from peft_kvcache.modeling.adapters import adapter_active
from peft_kvcache.modeling.capture import run_with_cache
from peft_kvcache.modeling.identity import model_name
from peft_kvcache.runtime.target_sink import clear_target_sinks

GEN = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0)  # fixed reply length: no early stop


def zero_adapters():
    """Two adapters with no effect (LoRA B = 0): the exact maps are identities."""
    model = get_peft_model(tiny_model("llama", seed=2), LoraConfig(task_type="CAUSAL_LM", target_modules=MODULES),
                           adapter_name="first")
    model.add_adapter("second", LoraConfig(task_type="CAUSAL_LM", target_modules=MODULES))
    return model.eval()


@pytest.fixture(scope="module")
def zero_shared():
    model = zero_adapters()
    return SharedPeftModel(model, calibrate_adapters(model, random_ids(8, 32, seed=4), progress=False))


@pytest.fixture(scope="module")
def real_shared():
    model = peft_with_adapters()
    return SharedPeftModel(model, calibrate_adapters(model, random_ids(16, 48, seed=3), progress=False))


SCRIPT = [(20, "first"), (5, "second"), (7, None), (4, "first"), (3, "first"), (6, "second")]
STRONG_MILD = {"first": "strong", "second": "mild", None: None}


def _messages(seed: int) -> list[torch.Tensor]:
    return [ids[None] for ids in random_ids(len(SCRIPT), 20, seed=seed)]


def _full_reprefill(model, ids: torch.Tensor, adapter) -> torch.Tensor:
    with adapter_active(model, adapter), torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, **GEN)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("keep_base", ["prefill", "reverse_map"])
def test_switching_matches_full_reprefill_when_maps_are_exact(zero_shared, keep_base):
    session = AdapterSession(zero_shared, keep_base=keep_base, **GEN)
    sources = []
    for (length, adapter), message in zip(SCRIPT, _messages(7)):
        before = session.ids
        turn = session.turn(message[:, :length], adapter=adapter)
        expected = _full_reprefill(zero_shared.model, torch.cat([before, message[:, :length]], 1), adapter)
        assert torch.equal(turn.new_ids, expected), (adapter, turn.context_source)
        sources.append(turn.context_source)
    # a cache that began mapped stays mapped when the same adapter continues it; the base cache is the base model's
    # own under "prefill", mapped back from the adapters under "reverse_map"
    base = "reused" if keep_base == "prefill" else "mapped"
    assert sources == ["prefilled", "mapped", base, "mapped", "mapped", "mapped"]
    assert session.base_cached_tokens == session.ids.shape[1] - 1


def test_a_switch_never_prefills_the_history(real_shared):
    counted = []
    hook = unwrap_peft(real_shared.model).model.register_forward_pre_hook(
        lambda module, args, kwargs: counted.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        session = AdapterSession(real_shared, keep_base="prefill", **GEN)
        session.turn(random_ids(1, 60, seed=1)[0], adapter="strong")  # a long first turn: the history
        for adapter in ("mild", "strong", None, "mild"):
            m, counted[:] = 5, []
            clear_target_sinks()  # count the sink's own pass
            turn = session.turn(random_ids(1, m, seed=2)[0], adapter=adapter)
            g = turn.new_ids.shape[1]
            # sink (mapped turns) + the new message and the last reply token + decode steps + base catch-up
            sink = 1 if turn.context_source == "mapped" else 0
            catch_up = m + g if adapter is not None else 0
            assert sum(counted) == sink + (m + 1) + (g - 1) + catch_up, (adapter, counted)
            assert max(counted) <= m + g < 60
    finally:
        hook.remove()


def test_reverse_map_policy_catches_up_without_the_model(real_shared):
    session = AdapterSession(real_shared, keep_base="reverse_map", **GEN)
    session.turn(random_ids(1, 30, seed=1)[0], adapter="strong")  # first turn: prefilled (it holds the sink)
    turn = session.turn(random_ids(1, 5, seed=2)[0], adapter="mild")
    assert turn.model_tokens["keep_base"] == 0
    assert session.base_cached_tokens == session.ids.shape[1] - 1


def test_the_reverse_maps_weights_check_walks_the_weights_once(real_shared, monkeypatch):
    # every reverse-map turn checks both ends' fingerprints: switching adapters keeps the weights' version, so one walk
    from peft_kvcache.modeling import identity
    from peft_kvcache.runtime import turn as turn_module

    walks, real = [], identity.weights_version
    for module in (identity, turn_module):
        monkeypatch.setattr(module, "weights_version", lambda model: walks.append(1) or real(model))
    reverse = real_shared.maps.to_base["strong"]
    assert turn_module._fits(reverse, real_shared.model, "strong")
    assert len(walks) == 1


def test_sessions_in_threads_match_their_solo_runs(real_shared):
    scripts = {seed: list(zip([STRONG_MILD[a] for _, a in SCRIPT], _messages(seed))) for seed in (11, 12, 13, 14)}

    def run(seed: int) -> list[torch.Tensor]:
        session = AdapterSession(real_shared, **GEN)
        return [session.turn(message[:, :8], adapter=adapter).new_ids for adapter, message in scripts[seed]]

    solo = {seed: run(seed) for seed in scripts}
    threaded, errors = {}, []

    def worker(seed: int) -> None:
        try:
            threaded[seed] = run(seed)
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in scripts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for seed in scripts:
        assert all(torch.equal(a, b) for a, b in zip(solo[seed], threaded[seed])), seed
    assert real_shared.model.active_adapter == "strong"  # every turn restored PEFT's active adapter


def test_unknown_adapter_and_empty_turn_are_refused(real_shared):
    session = AdapterSession(real_shared, **GEN)
    with pytest.raises(SessionError, match="unknown adapter"):
        session.turn(torch.tensor([[1, 2]]), adapter="nope")
    with pytest.raises(SessionError, match="at least one"):
        session.turn(torch.zeros((1, 0), dtype=torch.long), adapter=None)


def test_feed_gives_the_full_prefill_logits_when_maps_are_exact(zero_shared, exact_matmuls):
    session = AdapterSession(zero_shared, **GEN)
    model = zero_shared.model
    for (length, adapter), message in zip(SCRIPT, _messages(8)):
        logits = session.feed(message[:, :length], adapter=adapter)
        with adapter_active(model, adapter), torch.no_grad():
            full = model(input_ids=session.ids).logits[:, -length:]
        torch.testing.assert_close(logits, full, atol=2e-4, rtol=1e-3)
    assert session.base_cached_tokens == session.ids.shape[1]


def test_the_reverse_map_policy_maps_back_and_serves_base_turns(real_shared):
    """keep_base="reverse_map": no model tokens for the catch-up after an adapter's turn, and the base model's
    turn then runs on the mapped-back cache (only its new tokens are computed), which it says."""
    session = AdapterSession(real_shared, keep_base="reverse_map", **GEN)
    session.turn(random_ids(1, 30, seed=1)[0], adapter=None)
    turn = session.turn(random_ids(1, 5, seed=2)[0], adapter="strong")
    assert turn.model_tokens["keep_base"] == 0 and turn.context_source == "mapped"
    turn = session.turn(random_ids(1, 5, seed=3)[0], adapter=None)
    assert turn.context_source == "mapped" and turn.model_tokens["prefill"] == 6
    # where it came from: the adapter whose KV was mapped back, not the base model (the label once said the base)
    assert turn.context_from == "strong" and turn.label("tiny") == "mapped:strong"


def test_sessions_and_the_server_count_model_tokens_by_the_same_phases(real_shared):
    from peft_kvcache.serving.engine import PrefixEngine
    from peft_kvcache.serving.store import PrefixStore

    ids = random_ids(1, 30, seed=4)[0]
    session_turn = AdapterSession(real_shared, **GEN).turn(ids, adapter="strong")
    server_turn = PrefixEngine(real_shared, PrefixStore(2**24)).run("strong", ids, GEN)
    assert set(session_turn.model_tokens) == set(server_turn.model_tokens) == {"prepare", "prefill", "generated",
                                                                              "keep_base"}
    assert session_turn.model_tokens == server_turn.model_tokens


def test_generation_gets_the_prompt_and_its_mask_on_the_models_device():
    # generate derives positions from the mask, so a mask left on the CPU breaks a model on an accelerator

    from peft_kvcache.runtime.turn import generate_on_cache

    class OnMeta(torch.nn.Module):  # a model whose weights live off the CPU
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(1, device="meta"))
            self.seen = {}

        def forward(self, input_ids, cache=None):
            raise AssertionError("generate is called, not forward")

        def generate(self, input_ids, attention_mask, **kwargs):
            self.seen = {"ids": input_ids.device, "mask": attention_mask.device, "cache": "cache" in kwargs}
            return torch.zeros(1, input_ids.shape[1] + 1, dtype=torch.long)

    model = OnMeta()
    output = generate_on_cache(model, torch.ones(1, 4, dtype=torch.long), MappedCache(), max_new_tokens=1)
    assert model.seen == {"ids": torch.device("meta"), "mask": torch.device("meta"), "cache": True}
    assert output.device == torch.device("cpu")


def test_sessions_keep_an_exact_base_cache_by_default_as_the_server_does(real_shared):
    """The default keep_base is "prefill" for sessions and the server alike: after an adapter's turn the base
    model runs over the new tokens, and its next turn continues an exact base cache."""
    from peft_kvcache.serving.engine import PrefixEngine
    from peft_kvcache.serving.store import PrefixStore

    session = AdapterSession(real_shared, **GEN)
    assert session.keep_base == PrefixEngine(real_shared, PrefixStore(2**20)).keep_base == "prefill"
    session.turn(random_ids(1, 30, seed=1)[0], adapter=None)
    turn = session.turn(random_ids(1, 5, seed=2)[0], adapter="strong")
    assert turn.model_tokens["keep_base"] > 0 and session.base_cached_tokens == session.ids.shape[1] - 1


# ----- a turn failing midway, one lock per model, a turn's ids, the one-model PEFT pattern -----


GREEDY = dict(max_new_tokens=5, do_sample=False)  # peft_setup's sessions: up to five greedy tokens


@pytest.fixture(scope="module")
def peft_setup():
    base = tiny_model("llama", seed=3)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["k_proj", "v_proj", "o_proj"], init_lora_weights=False),
                           adapter_name="strong")
    model.add_adapter("mild", LoraConfig(r=2, target_modules=["k_proj", "v_proj"], init_lora_weights=False))
    model.eval()
    return base, model, calibrate_adapters(model, random_ids(10, 40, seed=4), progress=False)


class Boom(Exception):
    pass


class FailingStreamer:
    """A generate() streamer that raises after ``after`` puts (a client gone, a failing callback)."""

    def __init__(self, after: int, error: type[BaseException] = Boom):
        self.after, self.error, self.puts = after, error, 0

    def put(self, value):
        self.puts += 1
        if self.puts > self.after:
            raise self.error()

    def end(self):
        pass


def _state(session: AdapterSession):
    caches = [session._base_cache] + ([session._last[1]] if session._last else [])
    return session.ids.clone(), [[(layer.keys.clone(), layer.values.clone()) for layer in c.layers] for c in caches]


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("adapter", [None, "strong", "mild"])
def test_a_turn_that_fails_midway_leaves_the_session_as_it_was(peft_setup, error, adapter):
    _, model, maps = peft_setup
    shared = SharedPeftModel(model, maps)
    turns = [(random_ids(1, 12, seed=20)[0], "strong"), (random_ids(1, 6, seed=21)[0], None)]
    survivor, witness = AdapterSession(shared, **GREEDY), AdapterSession(shared, **GREEDY)
    for ids, who in turns:
        survivor.turn(ids, adapter=who)
        witness.turn(ids, adapter=who)
    before = _state(survivor)
    with pytest.raises(error):
        survivor.turn(random_ids(1, 7, seed=22)[0], adapter=adapter, streamer=FailingStreamer(2, error))
    after = _state(survivor)
    assert torch.equal(before[0], after[0])
    assert all(torch.equal(a, b) for x, y in zip(before[1], after[1]) for pa, pb in zip(x, y) for a, b in zip(pa, pb))
    assert model.active_adapter == "strong"  # PEFT's state restored
    new = random_ids(1, 5, seed=23)[0]
    assert torch.equal(survivor.turn(new, adapter="mild").new_ids, witness.turn(new, adapter="mild").new_ids)


def test_every_wrapper_of_one_model_shares_its_lock_and_threads_match_solo_runs(peft_setup):
    base, model, maps = peft_setup
    first, second = SharedPeftModel(model, maps), SharedPeftModel(model, maps)
    assert first.lock is second.lock
    script = [(random_ids(1, 9, seed=30 + i)[0], ("strong", "mild", None)[i % 3]) for i in range(3)]

    def play(shared) -> list[torch.Tensor]:
        session = AdapterSession(shared, **GREEDY)
        return [session.turn(ids, adapter=who).new_ids for ids, who in script]

    solo = play(first)
    results, errors = {}, []

    def worker(index):
        try:
            results[index] = play(first if index % 2 else second)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 6
    assert all(torch.equal(a, b) for outputs in results.values() for a, b in zip(outputs, solo))
    assert model.active_adapter == "strong"


@pytest.mark.parametrize("ids, match", [(torch.randint(0, 128, (2, 5)), "one conversation"),
                                        (torch.rand(1, 5), "integer"), (torch.tensor([[1, 999]]), "vocabulary"),
                                        (torch.zeros(1, 0, dtype=torch.long), "empty")])
def test_a_turn_takes_one_conversations_integer_ids_only(peft_setup, ids, match):
    _, model, maps = peft_setup
    session = AdapterSession(SharedPeftModel(model, maps), **GREEDY)
    with pytest.raises(SessionError, match=match):
        session.turn(ids, adapter="strong")
    assert session.ids.numel() == 0


@pytest.mark.parametrize("asked", [{"num_return_sequences": 2, "do_sample": True}, {"num_beams": 2},
                                   {"input_ids": torch.zeros(1, 3, dtype=torch.long)}, {"past_key_values": None},
                                   {"return_dict_in_generate": True}])
def test_a_turn_gives_one_reply_and_refuses_to_ask_for_more(peft_setup, asked):
    _, model, maps = peft_setup
    session = AdapterSession(SharedPeftModel(model, maps), **GREEDY)
    session.turn(torch.randint(0, 128, (1, 6)), adapter="strong")
    before = session.ids.clone()
    with pytest.raises(SessionError, match=next(iter(asked))):  # before any model runs
        session.turn(torch.randint(0, 128, (1, 4)), adapter=None, **asked)
    assert torch.equal(session.ids, before)
    with pytest.raises(SessionError, match=next(iter(asked))):
        AdapterSession(SharedPeftModel(model, maps), **{**GREEDY, **asked})
    assert session.turn(torch.randint(0, 128, (1, 4)), adapter=None).new_ids.shape[0] == 1  # the session goes on


def test_one_model_serves_as_source_with_its_adapter_disabled_and_errors_say_what_to_do(peft_setup):
    base, model, maps = peft_setup
    kv_map = maps.to_adapter["strong"]
    ids = random_ids(1, 14, seed=42)[0][None]
    model.set_adapter("strong")
    assert model_name(base).endswith("+strong") and model_name(model).endswith("+strong")
    with pytest.raises(FingerprintMismatchError, match="disable_adapter"):  # base holds the adapter's layers
        MappedCache.from_source(base, kv_map, model, input_ids=ids)
    with model.disable_adapter():
        source_cache = run_with_cache(model, ids)
        assert "+" not in model_name(base)
    cache = MappedCache.from_source(source_cache, kv_map, model, input_ids=ids)
    assert cache.get_seq_length() == 14
    strong_cache = run_with_cache(model, ids)  # the adapter's own cache, to be mapped back to the base...
    with adapter_active(model, None), pytest.raises(FingerprintMismatchError, match="swap source and target"):
        MappedCache.from_source(strong_cache, kv_map, model, input_ids=ids)  # ...with base -> strong


def test_an_index_recipe_switch_continues_and_keeps_the_base_in_sessions_and_the_server(real_shared, monkeypatch):
    """A map whose default recipe drops the mapped middle (index@B/pP): its cache holds some positions only, so it is
    never stored as a prefix's KV nor mapped back; the base catches up by a pass, and the conversation goes on."""
    from peft_kvcache.maps.recipe import Refresh
    from peft_kvcache.serving.engine import PrefixEngine
    from peft_kvcache.serving.store import PrefixStore

    monkeypatch.setattr(real_shared.maps.to_adapter["strong"].config, "refresh", Refresh.named("index@40/p8"))
    session = AdapterSession(real_shared, keep_base="reverse_map", **GEN)
    session.turn(random_ids(1, 40, seed=1)[0], adapter=None)
    turn = session.turn(random_ids(1, 5, seed=2)[0], adapter="strong")
    assert turn.context_source == "mapped" and session._last[1].dropped_positions > 0
    assert turn.model_tokens["keep_base"] == 5 + turn.new_ids.shape[1]  # a pass, not the reverse map
    again = session.turn(random_ids(1, 4, seed=3)[0], adapter="strong")  # continues the index cache
    assert again.model_tokens["prefill"] == 4 + 1 and session.base_cached_tokens == session.ids.shape[1] - 1

    engine = PrefixEngine(real_shared, PrefixStore(2**24), min_mapped_tokens=1)
    history = random_ids(1, 40, seed=4)[0]
    engine.run(None, history, GEN)
    served = engine.run("strong", torch.cat([history, random_ids(1, 5, seed=5)[0]]), GEN)
    assert served.context_source == "mapped"
    assert {e.adapter for e in engine.store.entries()} == {None}  # the base caught up; the index cache not stored


@pytest.mark.parametrize("keep_base", ["prefill", "reverse_map"])
def test_caches_of_weights_since_changed_are_dropped_and_the_next_turn_prefills(real_shared, keep_base, caplog):
    """An adapter loaded again under its name (here: its weights written in place) makes every cache of the old
    weights stale: the next turn prefills the conversation, and its reply is the new weights' full prefill's."""
    model = real_shared.model
    session = AdapterSession(real_shared, keep_base=keep_base, **GEN)
    session.turn(random_ids(1, 30, seed=1)[0], adapter="strong")
    weight = next(p for name, p in model.named_parameters() if "lora_B" in name and ".strong" in name)
    kept = weight.detach().clone()
    with torch.no_grad():
        weight.add_(0.05)
    try:
        message = random_ids(1, 5, seed=2)[0][None]
        before = session.ids
        with caplog.at_level("WARNING", logger="peft_kvcache"):
            turn = session.turn(message, adapter="strong")
        assert turn.context_source == "prefilled" and "weights changed" in caplog.text
        assert torch.equal(turn.new_ids, _full_reprefill(model, torch.cat([before, message], 1), "strong"))
        again = session.turn(random_ids(1, 4, seed=3)[0], adapter="strong")
        # the strong -> base map was fitted for the old weights: the base catches up by its own pass, not through it
        assert again.model_tokens["keep_base"] > 0
    finally:
        with torch.no_grad():
            weight.copy_(kept)


INVOCATION = [7, 11, 13]


def _activated_lora():
    """A tiny model with one Activated LoRA (``act``) of real effect: it acts from its invocation tokens on."""
    torch.manual_seed(21)
    config = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=MODULES, init_lora_weights=False,
                        alora_invocation_tokens=INVOCATION)
    return get_peft_model(tiny_model("llama", seed=3), config, adapter_name="act").eval()


def test_an_activated_lora_shares_the_base_kv_up_to_each_requests_own_invocation():
    """Every turn of an Activated LoRA equals its full prefill, in sessions and the server: a turn after its own turn
    (its cache holds its KV from the last invocation on, where a prefill of the next request computes the base's),
    and a turn whose invocation lies inside the base's context (the base's KV is shared only up to it)."""
    from peft_kvcache.maps.adapter_maps import AdapterMaps
    from peft_kvcache.serving.engine import PrefixEngine
    from peft_kvcache.serving.store import PrefixStore

    shared = SharedPeftModel(_activated_lora(), AdapterMaps())
    invocation = torch.tensor([INVOCATION])
    messages = [ids[None] for ids in random_ids(5, 12, seed=8)]
    script = [(None, messages[0]), ("act", torch.cat([messages[1], invocation], 1)),
              ("act", torch.cat([messages[2], invocation], 1)),
              (None, torch.cat([messages[3], invocation], 1)), ("act", messages[4])]
    session, engine = AdapterSession(shared, **GEN), PrefixEngine(shared, PrefixStore(2**24), min_mapped_tokens=0)
    sources, conversation = [], torch.zeros(1, 0, dtype=torch.long)
    for adapter, message in script:
        prompt = torch.cat([conversation, message], 1)
        expected = _full_reprefill(shared.model, prompt, adapter)
        turn = session.turn(message, adapter=adapter)
        served = engine.run(adapter, prompt[0], GEN)
        assert torch.equal(turn.new_ids, expected) and torch.equal(served.new_ids, expected), (adapter, len(sources))
        sources.append([(turn.context_source, turn.cached_tokens), (served.context_source, served.cached_tokens)])
        if adapter == "act":  # the base's KV of the conversation so far, up to this request's last invocation
            last_invocation = max(i for i in range(prompt.shape[1]) if prompt[0, i: i + 3].tolist() == INVOCATION)
            shared_tokens = min(conversation.shape[1] - 1, last_invocation)
            assert sources[-1] == [("shared", shared_tokens)] * 2, len(sources)
            inside = last_invocation < conversation.shape[1] - 1
        conversation = torch.cat([prompt, expected], 1)
    assert inside  # the last turn's invocation lies inside the base's context
