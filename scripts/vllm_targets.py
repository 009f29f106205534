"""Where the vLLM connector stands against its targets, said in sentences generated from its results files (the
README's vLLM section prints them under its tables, so that no claim outlives the figures it rests on)."""

from __future__ import annotations

SWITCH_TTFT_GOAL, SWITCH_TTFT_STRETCH = 1 / 10, 1 / 20  # (a)'s switch TTFT p50 over vLLM alone's
STREAMS_GOAL = 1.25  # non-switching streams' ITL p95 during switches over the same load without switches
OWN_CACHE_GOAL = 1.5  # a single mapped switch over a reuse of the adapter's own cache
LOOPS = {"closed_loop": "closed loop", "open_loop": "open loop"}


def _interval(stat: dict, digits: int = 2) -> str:
    return f"{stat['mean']:.{digits}f} [{stat['low']:.{digits}f}, {stat['high']:.{digits}f}]"


def _verdict(stat: dict, goal: float) -> str:
    """A ratio's interval against an upper goal: met (all of it at or under), missed (all of it past), or neither."""
    return "met" if stat["high"] <= goal else "missed" if stat["low"] > goal else "not resolved by the interval"


def _count(runs: list[float], below: float) -> str:
    kept = sum(1 for r in runs if r < below)
    return "every run" if kept == len(runs) else f"{kept} of {len(runs)} runs"


def load_targets(data: dict) -> str:
    """`benchmarks.vllm_load`'s results against the switch-TTFT goal (1/10 of vLLM alone, 1/20 the stretch) in each
    loop, and the non-switching streams' ITL p95 ratio against its 1.25x."""
    lines = []
    for key, loop in LOOPS.items():
        if key not in data:
            continue
        ratio = data[key]["ratios"]["a/c"]["switch_ttft_p50"]
        lines.append(f"{loop}: (a)'s switch TTFT p50 over (c)'s {_interval(ratio)} over the runs, under 1/10 in "
                     f"{_count(ratio['runs'], SWITCH_TTFT_GOAL)} (the interval's upper end "
                     f"{'under' if ratio['high'] < SWITCH_TTFT_GOAL else 'past'} it), under 1/20 in "
                     f"{_count(ratio['runs'], SWITCH_TTFT_STRETCH)}")
        naive = naive_wins(data[key]["servers"])
        if naive:
            lines.append(f"{loop}: (b) naive sharing did better than (a) on {naive} (means over the runs; (b) "
                         "serves another variant's KV unmapped: see its quality above)")
    streams = data.get("streams", {}).get("a", {}).get("p95_ratio")
    if streams:
        lines.append(f"non-switching streams' ITL p95 during switches over without, window by window "
                     f"{_interval(streams)}: the {STREAMS_GOAL}x target {_verdict(streams, STREAMS_GOAL)}")
    return ("\n\nAgainst the targets, and where (a) lost: " + "; ".join(lines) + ".") if lines else ""


NAIVE_COMPARED = {"switch_ttft_p50": "switch TTFT p50", "cold_switch_ttft_median": "cold switch TTFT",
                  "warm_switch_ttft_p50": "warm switch TTFT p50", "warm_switch_ttft_p95": "warm switch TTFT p95",
                  "tokens_per_second": "tokens/s"}


def naive_wins(servers: dict) -> str:
    """The figures on which the naive-sharing server (b) beat the mapping one (a): lower times, higher throughput."""
    if "a" not in servers or "b" not in servers:
        return ""
    wins = []
    for key, label in NAIVE_COMPARED.items():
        a, b = servers["a"][key]["mean"], servers["b"][key]["mean"]
        if (b > a) if key == "tokens_per_second" else (b < a):
            wins.append(f"{label} ({b:.2f} against {a:.2f})")
    return ", ".join(wins)


def switch_cost_targets(data: dict, small_step: dict | None = None) -> str:
    """`benchmarks.vllm_switch_cost`'s results: whether the mapped switches stall the streams more than switches on
    the adapter's own cache (their ratio against 1 and 1.25x), a single mapped switch against the own cache (1.5x),
    and, given the same run at a smaller engine step (``small_step``), how that step moves the ratio."""
    streams, own = data["streams"], data["own_cache"]
    mapped_over_own = streams["switch_to_own_p95_ratio"]
    holds_one = mapped_over_own["low"] <= 1 <= mapped_over_own["high"]
    lines = [f"switches over none, ITL p95 window by window {_interval(streams['p95_ratio'])}: the {STREAMS_GOAL}x "
             f"target {_verdict(streams['p95_ratio'], STREAMS_GOAL)}",
             f"mapped switches over own-cache switches, ITL p95 window by window {_interval(mapped_over_own)} (the "
             f"interval {'holds' if holds_one else 'excludes'} 1, its upper end "
             f"{'under' if mapped_over_own['high'] < STREAMS_GOAL else 'past'} {STREAMS_GOAL}x)"]
    worst = own["mapped_to_own"]["max"]
    lines.append(f"a single mapped switch over the own cache at most {worst:.2f}x over {data['setup']['repeats']} "
                 f"repeats ({'within' if worst <= OWN_CACHE_GOAL else 'past'} {OWN_CACHE_GOAL}x in "
                 f"{'every repeat' if worst <= OWN_CACHE_GOAL else 'at least one'}), "
                 f"first-token KL {_interval(own['mapped_kl'], 4)}")
    if small_step is not None:
        step = small_step["setup"].get("max_num_batched_tokens")
        small, default = small_step["streams"], streams
        lines.append(f"at --max-num-batched-tokens {step}, switches over none {_interval(small['p95_ratio'])} (here "
                     f"{_interval(default['p95_ratio'])}), the streams' ITL p95 without switches "
                     f"{1000 * small['none']['itl_p95']:.0f} ms (here {1000 * default['none']['itl_p95']:.0f} ms), "
                     f"with them {1000 * small['switch']['itl_p95']:.0f} ms (here "
                     f"{1000 * default['switch']['itl_p95']:.0f} ms)")
    return "\n\nAgainst the targets: " + "; ".join(lines) + "."
