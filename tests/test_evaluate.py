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
    reference = model(ids[None, 26:39], position_ids=torch.arange(26, 39)[None], cache=cache).logits[0, -10:]
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


def test_context_checks_are_recorded_per_example_and_sorted_into_bad_and_good(sibling_pair, sibling_map):
    source, target = sibling_pair
    examples = random_ids(4, 40, seed=11)
    for margin, expect_flagged in ((float("inf"), 0), (-float("inf"), 4)):  # the margin decides, per context
        report = evaluate_retention(source, target, sibling_map, examples, context_length=32, continuation_length=8,
                                    windows=(4,), check_tokens=4, check_margin=margin, progress=False)
        assert len(report.context_checks) == 4
        assert sum(c["flagged"] for c in report.context_checks) == expect_flagged
        counts = report.check_catch_rate(4)
        mapped = torch.stack([c.mean() for c in report.scores["mapped@4"].correct])
        control = torch.stack([c.mean() for c in report.scores["window@4"].correct])
        bad = int((mapped < control).sum())
        assert (counts["bad"], counts["good"]) == (bad, 4 - bad)
        assert (counts["bad_flagged"], counts["good_flagged"]) == ((bad, 4 - bad) if expect_flagged else (0, 0))
