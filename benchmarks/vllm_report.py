"""The figures and tables of the vLLM load benchmark (`benchmarks.vllm_load`), from its raw measurements."""

from __future__ import annotations

import collections
import math
import statistics

from .common import bootstrap_mean, mean_interval, table
from .serve_load import percentile
from .vllm_servers import ADAPTERS

ROWS = {"a": "(a) vLLM + connector (map)", "b": "(b) vLLM + connector, naive sharing", "c": "(c) vLLM alone"}
LOAD_FIGURES = ("switch_ttft_p50", "cold_switch_ttft_median", "warm_switch_ttft_p50", "warm_switch_ttft_p95",
                "ttft_p95", "tokens_per_second", "prompt_tokens_computed")
RATIO_FIGURES = ("switch_ttft_p50", "cold_switch_ttft_median", "warm_switch_ttft_p95", "tokens_per_second",
                 "prompt_tokens_computed")


def first_token_kl(reference: dict[str, float], other: dict[str, float]) -> float:
    """A lower bound of KL(reference || other) from two top-k lists of log-probabilities: the KL of the two
    distributions coarse-grained to the tokens both list plus one bucket for all the rest. Coarse-graining never
    raises a KL (data processing), and every probability it uses is known (the sum over a top-k list alone is no
    bound: it goes negative when ``other`` is sharper on the same tokens)."""
    shared = [token for token in reference if token in other]
    p = [math.exp(reference[t]) for t in shared]
    q = [math.exp(other[t]) for t in shared]
    p.append(max(0.0, 1.0 - sum(p)))
    q.append(max(0.0, 1.0 - sum(q)))
    return sum(pi * (math.log(pi) - math.log(max(qi, 1e-30))) for pi, qi in zip(p, q) if pi > 0)


def top1(top: dict[str, float]) -> str:
    return max(top, key=top.get)


# ----- load -----


def load_figures(records: list[dict], wall: float) -> dict:
    """One load run: TTFT of switch turns (cold: the first to an adapter since the start; warm: the others), of
    every turn, throughput, prompt tokens computed."""
    switches = [r for r in records if r["turn"] > 0]
    cold = [r["ttft"] for r in switches if r["cold"]]
    warm = [r["ttft"] for r in switches if not r["cold"]]
    return {"requests": len(records), "switches": len(switches), "cold_switches": len(cold),
            "switch_ttft_p50": percentile([r["ttft"] for r in switches], 0.5),
            "cold_switch_ttft_median": statistics.median(cold) if cold else None,
            "warm_switch_ttft_p50": percentile(warm, 0.5), "warm_switch_ttft_p95": percentile(warm, 0.95),
            "ttft_p95": percentile([r["ttft"] for r in records], 0.95),
            "tokens_per_second": sum(r["completion_tokens"] for r in records) / wall,
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "prompt_tokens_computed": sum(r["prompt_tokens"] - r["cached"] for r in records),
            "min_switch_history_tokens": min(r["prompt_tokens"] for r in switches)}


def _over_runs(values: list) -> dict:
    """`mean_interval`, or no figure where a run had none (a loop without a cold switch)."""
    if any(v is None for v in values):
        return {"mean": None, "low": None, "high": None, "runs": values}
    return mean_interval(values)


def summed_counts(counts: list[dict[str, int]]) -> dict[str, int]:
    """Counts by reason (the connector's fallbacks) added up over runs or windows, reasons sorted."""
    return dict(sorted(sum((collections.Counter(c) for c in counts), collections.Counter()).items()))


def load_summary(phases: dict, loop: str) -> dict:
    """Per server: each figure's mean over runs with its 95% interval; per server against (c): the ratio run by run."""
    runs = sorted({int(name.split("/")[0].split("-")[1]) for name in phases if name.startswith(loop)})
    per_run = {key: [load_figures(phases[f"{loop}-{r}/{key}"]["records"], phases[f"{loop}-{r}/{key}"]["wall"])
                     for r in runs] for key in ROWS}
    servers = {key: {f: _over_runs([run[f] for run in figures]) for f in LOAD_FIGURES}
               for key, figures in per_run.items()}
    for key, figures in per_run.items():
        servers[key]["min_switch_history_tokens"] = min(run["min_switch_history_tokens"] for run in figures)
        servers[key]["cold_switches"] = sum(run["cold_switches"] for run in figures)
        counted = [phases[f"{loop}-{r}/{key}"].get("fallbacks") for r in runs]  # older raw files kept no count
        servers[key]["fallbacks"] = None if None in counted else summed_counts(counted)
    ratios = {f"{key}/c": {f: _over_runs([None if None in (mine[f], theirs[f]) else mine[f] / theirs[f]
                                          for mine, theirs in zip(per_run[key], per_run["c"])])
                           for f in RATIO_FIGURES} for key in "ab"}
    return {"runs": len(runs), "servers": servers, "ratios": ratios, "per_run": per_run}


# ----- streams, conversation, quality, own cache, threshold -----


def streams_summary(windows: list[dict]) -> dict:
    """Inter-token latency of the background streams: per condition (`benchmarks.vllm_traffic.STREAM_CONDITIONS`)
    p50 / p95 / largest over every gap, the p95 per window, and the p95 ratios window by window: switches / none
    (``p95_ratio``) and, where the run had them, a switch to an adapter's own cache / none (``own_p95_ratio``) and
    mapped switches / own-cache switches (``switch_to_own_p95_ratio``); with the foreground requests' prompt tokens
    served from cache and the connector's fallbacks where the windows recorded them."""
    out = {}
    window_p95 = {(w["repetition"], w["condition"]): percentile(w["gaps"], 0.95) for w in windows}
    for condition in dict.fromkeys(w["condition"] for w in windows):
        chosen = [w for w in windows if w["condition"] == condition]
        gaps = [g for w in chosen for g in w["gaps"]]
        out[condition] = {"gaps": len(gaps), "itl_p50": percentile(gaps, 0.5), "itl_p95": percentile(gaps, 0.95),
                          "itl_max": max(gaps),
                          "window_p95": mean_interval([window_p95[w["repetition"], condition] for w in chosen]),
                          "foreground_ttft_median": statistics.median(t for w in chosen for t in w["foreground_ttft"])}
        if all("foreground_tokens" in w for w in chosen):  # recorded since the streams' loss was studied
            tokens = [pair for w in chosen for pair in w["foreground_tokens"]]
            out[condition].update(prompt_tokens=sum(p for p, _ in tokens), cached_tokens=sum(c for _, c in tokens),
                                  fallbacks=summed_counts([w["fallbacks"] for w in chosen]))
    for name, (over, under) in {"p95_ratio": ("switch", "none"), "own_p95_ratio": ("own", "none"),
                                "switch_to_own_p95_ratio": ("switch", "own")}.items():
        if over in out and under in out:  # window by window: the two conditions' windows of one repetition
            repetitions = sorted({r for r, c in window_p95 if c == over} & {r for r, c in window_p95 if c == under})
            out[name] = mean_interval([window_p95[r, over] / window_p95[r, under] for r in repetitions])
    return out


def conversation_summary(turns: list[dict], references: list[dict]) -> list[dict]:
    return [{"turn": t["turn"], "model": t["adapter"] or "base", "prompt_tokens": t["prompt_tokens"],
             "computed": t["prompt_tokens"] - t["cached"], "source": (t["label"] or {}).get("context_source"),
             "fallback": (t["label"] or {}).get("fallback"), "kl": first_token_kl(ref, t["top"]),
             "same_first_token": top1(ref) == top1(t["top"])} for t, ref in zip(turns, references)]


def quality_summary(samples: list[dict], answers: dict[str, list[dict]]) -> dict:
    """Per map (source -> target): the KL of (a) and (b) against (c), their paired difference, top-1 agreement and how
    many switches loaded KV; and the three switches to the base model pooled."""
    def row(index: list[int]) -> dict:
        exact = [answers["c"][k]["top"] for k in index]
        out = {}
        for key in "ab":
            kls = [first_token_kl(c, answers[key][k]["top"]) for c, k in zip(exact, index)]
            out[key] = {"kl": bootstrap_mean(kls), "kls": kls,
                        "top1_agreement": sum(top1(c) == top1(answers[key][k]["top"]) for c, k in zip(exact, index))
                        / len(index), "loaded": sum(answers[key][k]["cached"] > 0 for k in index)}
        out["a_minus_b"] = bootstrap_mean([x - y for x, y in zip(out["a"]["kls"], out["b"]["kls"])])
        return out

    rows = {}
    for adapter in ADAPTERS:
        for source, target in ((None, adapter), (adapter, None)):
            rows[f"{source or 'base'} -> {target or 'base'}"] = row(
                [k for k, s in enumerate(samples) if s["source"] == source and s["target"] == target])
    rows["every adapter -> base"] = row([k for k, s in enumerate(samples) if s["target"] is None])
    return rows


def own_summary(rows: list[dict]) -> dict:
    def spread(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {"own": spread([r["own_ttft"] for r in rows]), "mapped": spread([r["mapped_ttft"] for r in rows]),
            "prefill": spread([r["prefill_ttft"] for r in rows]),
            "mapped_to_own": spread([r["mapped_ttft"] / r["own_ttft"] for r in rows]),
            "prompt_tokens": min(r["prompt_tokens"] for r in rows),
            "cached": {k: min(r[f"{k}_cached"] for r in rows) for k in ("own", "mapped", "prefill")},
            "mapped_kl": bootstrap_mean([first_token_kl(r["exact_top"], r["mapped_top"]) for r in rows])}


def threshold_summary(rows: list[dict]) -> dict:
    out = [{"tokens": r["tokens"], "mapped_ttft": statistics.median(r["mapped_runs"]),
            "prefill_ttft": statistics.median(r["prefill_runs"]),
            "ratio": statistics.median(r["mapped_runs"]) / statistics.median(r["prefill_runs"]), **r} for r in rows]
    paying = [r["tokens"] for r in out if r["ratio"] <= 0.5]
    return {"rows": out, "rule": "the smallest mapped length whose switch TTFT is at most half the prefill's",
            "recommended_min_mapped_tokens": min(paying) if paying else None}


def summarise(raw: dict) -> dict:
    phases = raw["phases"]
    extras = {key: phases[f"extras/{key}"] for key in ROWS}
    return {"closed_loop": load_summary(phases, "closed"), "open_loop": load_summary(phases, "open"),
            "streams": {key: streams_summary(extras[key]["streams"]) for key in "ac"},
            "conversation": conversation_summary(extras["a"]["conversation"], extras["c"]["conversation_references"]),
            "switch_quality": quality_summary(extras["a"]["samples"], {k: extras[k]["answers"] for k in ROWS}),
            "own_cache": own_summary(extras["a"]["own"]), "threshold": threshold_summary(phases["threshold/a"]["rows"])}


# ----- markdown -----


def ci(figure: dict, digits: int = 2) -> str:
    if figure["mean"] is None:
        return "-"
    return f"{figure['mean']:.{digits}f} [{figure['low']:.{digits}f}, {figure['high']:.{digits}f}]"


def fallback_cell(key: str, fallbacks: dict | None) -> str:
    """The connector's fallbacks of a server's runs by reason; "-" for vLLM alone or runs that did not count them."""
    if key == "c" or fallbacks is None:
        return "-"
    return ", ".join(f"{reason} {count}" for reason, count in fallbacks.items()) or "none"


def load_tables(summary: dict) -> str:
    rows = [[ROWS[key], ci(s["switch_ttft_p50"]), ci(s["cold_switch_ttft_median"]), ci(s["warm_switch_ttft_p50"]),
             ci(s["warm_switch_ttft_p95"]), ci(s["tokens_per_second"], 1), ci(s["prompt_tokens_computed"], 0),
             fallback_cell(key, s.get("fallbacks"))]
            for key, s in summary["servers"].items()]
    ratios = [[name, *(ci(r[f]) for f in RATIO_FIGURES)] for name, r in summary["ratios"].items()]
    return (table(["server", "switch TTFT p50 (s)", "cold switch TTFT (s)", "warm switch TTFT p50 (s)",
                   "warm switch TTFT p95 (s)", "tokens/s", "prompt tokens computed", "fallbacks (all runs)"], rows)
            + "\n\n"
            + table(["ratio (run by run)", "switch TTFT p50", "cold switch TTFT", "warm switch TTFT p95", "throughput",
                     "prompt tokens computed"], ratios))


def markdown(payload: dict, level: int = 1) -> str:
    """The results as markdown, sections at heading ``level`` + 1 (the README's block: level 3, no title)."""
    s, closed = payload["setup"], payload["closed_loop"]
    history = min(v["min_switch_history_tokens"] for v in closed["servers"].values())
    h = "#" * (level + 1)
    lines = ([f"{'#' * level} The vLLM connector under load", ""] if level == 1 else []) + [
             f"SmolLM2-135M-Instruct and its {len(s['adapters'])} adapters, float32, vLLM's CPU build, "
             f"{s['threads']} threads, 127.0.0.1; every server started fresh for every measurement (warm-up: one "
             f"base-model request). Switch turns on histories of {history}+ tokens, {s['max_tokens']} new tokens at "
             f"most, greedy, streamed. Figures: mean over {closed['runs']} runs [95% t-interval]; cold switch: the "
             "first to an adapter since the start.", "",
             f"{h} Closed loop: {s['conversations']} conversations at once, {s['turns']} turns each", "",
             load_tables(closed), "",
             f"{h} Open loop: {s['open_conversations']} conversations arriving as a Poisson process of {s['rate']} "
             f"per second, {s['turns']} turns each", "", load_tables(payload["open_loop"]), ""]
    st = payload["streams"]
    lines += [f"{h} Inter-token latency of streams that do not switch", "",
              "Two base-model streams decoding while requests arrive one after another on 1,500+-token histories the "
              f"base model computed (a switch to an adapter, or the base model again); {s['repetitions']} windows "
              "per condition.", "",
              table(["server", "ITL p50 / p95, no switches (ms)", "ITL p50 / p95, switches (ms)",
                     "p95 ratio switches / none (per window)", "their TTFT, none / switches (s)"],
                    [[ROWS[k], f"{1e3 * v['none']['itl_p50']:.1f} / {1e3 * v['none']['itl_p95']:.1f}",
                      f"{1e3 * v['switch']['itl_p50']:.1f} / {1e3 * v['switch']['itl_p95']:.1f}", ci(v["p95_ratio"]),
                      f"{v['none']['foreground_ttft_median']:.3f} / {v['switch']['foreground_ttft_median']:.3f}"]
                     for k, v in st.items()]), ""]
    lines += [f"{h} A conversation switching at every turn ({len(payload['conversation'])} turns, (a))", "",
              table(["turn", "model", "prompt tokens", "computed", "context", "first-token KL vs (c)",
                     "same first token"],
                    [[t["turn"], t["model"], t["prompt_tokens"], t["computed"],
                      t["source"] + (f" ({t['fallback']})" if t["fallback"] else ""), f"{t['kl']:.4f}",
                      "yes" if t["same_first_token"] else "no"] for t in payload["conversation"]]), ""]
    rows = []
    for name, row in payload["switch_quality"].items():
        a, b = row["a"], row["b"]
        rows.append([name, f"{ci(a['kl'], 4)} / {a['top1_agreement']:.2f} ({a['loaded']} of {a['kl']['samples']})",
                     f"{ci(b['kl'], 4)} / {b['top1_agreement']:.2f} ({b['loaded']} of {b['kl']['samples']})",
                     ci(row["a_minus_b"], 4)])
    lines += [f"{h} Switch quality on held-out text", "",
              f"One switch per evaluation-split module ({s['samples']}) and map: the history computed by the map's "
              "source, then a docstring request to its target; the first reply token against (c)'s exact prefill "
              "(KL: a lower bound from the two top-20 lists; mean [95% bootstrap]).", "",
              table(["map", "(a) mapped: KL / same first token (loaded)", "(b) naive: KL / same first token (loaded)",
                     "(a) - (b) KL, paired"], rows), ""]
    own = payload["own_cache"]
    lines += [f"{h} An adapter's own cache against a mapped switch ({own['prompt_tokens']} prompt tokens, (a))", "",
              table(["continues", "TTFT median [min, max] (s)", "prompt tokens cached (least)"],
                    [[kind, f"{own[kind]['median']:.3f} [{own[kind]['min']:.3f}, {own[kind]['max']:.3f}]",
                      own["cached"][kind]] for kind in ("own", "mapped", "prefill")]), "",
              f"Mapped / own, run by run: median {own['mapped_to_own']['median']:.2f} [{own['mapped_to_own']['min']:.2f}"
              f", {own['mapped_to_own']['max']:.2f}]; the mapped switch's first-token KL against the prefill "
              f"{ci(own['mapped_kl'], 4)}.", ""]
    gate = payload["threshold"]
    lines += [f"{h} Where mapping stops paying (single switches, one at a time, TTFT medians)", "",
              table(["mapped tokens", "mapped (s)", "prefilled (s)", "ratio"],
                    [[r["tokens"], f"{r['mapped_ttft']:.3f}", f"{r['prefill_ttft']:.3f}", f"{r['ratio']:.2f}"]
                     for r in gate["rows"]]), "",
              f"Rule: {gate['rule']}: {gate['recommended_min_mapped_tokens']} tokens (the connector's default "
              f"min_mapped_tokens: {s['connector_min_mapped_tokens']})."]
    return "\n".join(lines)
