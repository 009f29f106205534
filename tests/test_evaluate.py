import torch

from conftest import random_ids, tiny_model
from peft_kvcache import KVMap
from peft_kvcache.evaluate import evaluate_retention, window_logits


@torch.no_grad()
def test_window_control_sees_its_sink():
    """The control keeps token 0 and the last W context tokens at their true positions: the sink must be
    attended to (transformers would read the position jump as a packed sequence and mask it out)."""
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (40,))
    with_sink = window_logits(model, ids, context=30, window=4, sink=1)
    without = window_logits(model, ids, context=30, window=4, sink=0)
    assert not torch.allclose(with_sink, without, atol=1e-4)
    # Reference: the sink's KV in a cache, then the window at its true positions.
    cache = model(ids[None, :1], use_cache=True).cache
    reference = model(ids[None, 26:39], position_ids=torch.arange(26, 39)[None], past_key_values=cache).logits[0, -10:]
    torch.testing.assert_close(with_sink, reference, rtol=1e-4, atol=1e-4)


def test_identity_map_retains_everything_and_naive_reuse_equals_full():
    model = tiny_model("qwen2")
    kv_map = KVMap.calibrate(model, model, random_ids(10, 40), progress=False)
    report = evaluate_retention(model, model, kv_map, random_ids(3, 48, seed=7), context_length=32,
                                continuation_length=16, windows=(1, 8), progress=False)
    rows = {row["variant"]: row for row in report.rows()}
    assert set(rows) == {"full", "no_context", "mapped@1", "mapped@8", "window@1", "window@8", "naive@1", "naive@8"}
    for name in ("mapped@1", "mapped@8", "naive@1"):
        assert rows[name]["kl"] < 1e-6 and rows[name]["greedy_agreement"] == 1.0
    assert rows["no_context"]["kl"] > 1e-3
    diff = report.paired_difference("mapped@8", "window@8", metric="kl")
    assert diff["difference"] < 0 and diff["low"] <= diff["difference"] <= diff["high"]
