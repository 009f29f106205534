import math

import pytest
import torch
from conftest import random_ids, tiny_model

from peft_kvcache import KVMap
from peft_kvcache.calibration.retention import (
    RetentionReport,
    VariantScores,
    evaluate_retention,
    full_logits,
    token_kl,
    window_logits,
)
from peft_kvcache.modeling._compat import output_cache, with_cache


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
    cache = output_cache(model(ids[None, :1], use_cache=True))
    reference = model(ids[None, 26:39], position_ids=torch.arange(26, 39)[None], **with_cache(model, cache)).logits[0, -10:]
    torch.testing.assert_close(with_sink, reference, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_the_reports_window_control_is_the_one_with_the_sink():
    """`evaluate_retention`'s window@W row scores the control that keeps the map's sink, not a bare window."""
    model = tiny_model("llama")
    kv_map = KVMap.calibrate(model, model, random_ids(6, 40), progress=False)
    sequences = random_ids(2, 40, seed=3)
    report = evaluate_retention(model, model, kv_map, sequences, context_length=30, continuation_length=10,
                                windows=(4,), progress=False)
    sink = kv_map.config.sink_tokens
    assert sink >= 1
    expected = [token_kl(full_logits(model, ids, 30), window_logits(model, ids, 30, 4, sink)) for ids in sequences]
    torch.testing.assert_close(torch.cat(report.scores["window@4"].kl), torch.cat(expected), rtol=1e-4, atol=1e-6)


def test_identity_map_retains_everything_and_naive_reuse_equals_full(exact_matmuls):
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


def _report(per_example: dict[str, list[float]], tokens: int = 10) -> RetentionReport:
    """A report whose variants score the given top-1 accuracies per example (``tokens`` tokens each)."""
    scores = {}
    for name, accuracies in per_example.items():
        variant = VariantScores()
        for accuracy in accuracies:
            hits = round(accuracy * tokens)
            variant.correct.append(torch.tensor([1.0] * hits + [0.0] * (tokens - hits)))
            variant.kl.append(torch.full((tokens,), 1.0 - accuracy))
            variant.agree.append(torch.ones(tokens))
        scores[name] = variant
    return RetentionReport(scores, context_length=32, continuation_length=tokens)


def test_normalized_retention_is_the_share_of_the_context_gain():
    report = _report({"full": [0.8, 0.8], "no_context": [0.4, 0.4], "mapped@1": [0.6, 0.6]})
    rows = {row["variant"]: row for row in report.rows()}
    assert rows["mapped@1"]["normalized_retention"] == pytest.approx(0.5)  # (0.6 - 0.4) / (0.8 - 0.4)
    assert rows["mapped@1"]["raw_retention"] == pytest.approx(0.75)       # 0.6 / 0.8: not the headline figure
    assert rows["no_context"]["normalized_retention"] == 0 and rows["full"]["normalized_retention"] == 1
    # where the context barely helps the full prefill, a share of its gain means nothing: no figure, not a huge one
    flat = _report({"full": [0.8, 0.8], "no_context": [0.8, 0.8], "mapped@1": [0.6, 0.6]})
    assert math.isnan(flat.normalized("mapped@1"))


def test_resamples_where_normalized_retention_is_undefined_widen_its_interval_or_leave_none():
    # the context helps the full prefill on a few examples only: resamples without them have no normalized figure
    def report(helped: int) -> RetentionReport:
        return _report({"full": [0.8] * helped + [0.4] * (20 - helped), "no_context": [0.4] * 20,
                        "mapped@1": [0.6] * helped + [0.4] * (20 - helped)})

    def finite_only(r: RetentionReport) -> torch.Tensor:  # what dropping the undefined resamples would report
        values = r.normalized("mapped@1", r._resamples())
        return values[torch.isfinite(values)]

    few = report(5)  # (15/20)^20: 0.3% of resamples undefined
    assert 0 < (~torch.isfinite(few.normalized("mapped@1", few._resamples()))).sum() <= 25
    low, high = few.interval(lambda idx: few.normalized("mapped@1", idx))
    kept = finite_only(few)
    assert low <= float(kept.quantile(0.025)) and high >= float(kept.quantile(0.975))
    many = report(3)  # (17/20)^20: 3.9% undefined, more than a tail holds
    assert all(math.isnan(v) for v in many.interval(lambda idx: many.normalized("mapped@1", idx)))


def test_intervals_are_paired_over_examples():
    """Examples differ a lot in difficulty but a is always 0.1 above b: a paired interval is tight around 0.1,
    an unpaired one would span the spread between examples."""
    easy_hard = [0.9, 0.2, 0.8, 0.3, 0.7, 0.1, 0.9, 0.2, 0.6, 0.3, 0.8, 0.2]
    report = _report({"full": [min(1.0, x + 0.1) for x in easy_hard], "no_context": [0.0] * 12,
                      "a": easy_hard, "b": [x - 0.1 if x >= 0.1 else 0.0 for x in easy_hard]})
    diff = report.paired_difference("a", "b", metric="kl")
    assert diff["difference"] == pytest.approx(-0.1, abs=1e-6)
    assert diff["high"] - diff["low"] < 0.05  # the spread between examples (0.8) cancels out when paired
    normalized = report.paired_difference("a", "b")
    assert normalized["low"] > 0 and normalized["high"] - normalized["low"] < 0.1


def test_sparse_control_with_every_position_is_the_targets_own_prefill(sibling_pair, sibling_map):
    source, target = sibling_pair
    report = evaluate_retention(source, target, sibling_map, random_ids(2, 40, seed=12), context_length=32,
                                continuation_length=8, windows=(2,), refresh=(4, 60), sparse_control=True,
                                progress=False)
    rows = {row["variant"]: row for row in report.rows()}
    assert rows["sparse@2+r60"]["kl"] < 1e-6  # every position recomputed by the target: its own prefill
    assert rows["sparse@2+r4"]["kl"] > 1e-4   # a few positions and no mapped context: far from it


def test_a_context_too_short_for_a_refresh_scores_its_sparse_control_without_picked_positions(sibling_pair,
                                                                                                 sibling_map):
    source, target = sibling_pair
    report = evaluate_retention(source, target, sibling_map, random_ids(2, 8, seed=12), context_length=2,
                                continuation_length=4, windows=(1,), refresh=(4,), sparse_control=True, progress=False)
    assert "sparse@1+r4" in {row["variant"] for row in report.rows()}


@pytest.mark.parametrize("options, match", [({"windows": ()}, "windows"), ({"windows": (40,)}, "windows"),
                                             ({"refresh": (0,), "sparse_control": True}, "refresh budgets"),
                                             ({"continuation_length": 0}, "continuation of 1 or more")])
def test_bad_evaluation_options_are_refused_before_any_model_runs(sibling_pair, sibling_map, options, match):
    from peft_kvcache.errors import EvaluationError

    source, target = sibling_pair
    with pytest.raises(EvaluationError, match=match):
        evaluate_retention(source, target, sibling_map, random_ids(2, 48), context_length=40,
                           **{"continuation_length": 8, "progress": False, **options})
