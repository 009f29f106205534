"""What a switch costs the rest of a vLLM engine and how close it comes to the adapter's own cache (issue 32), the two
measurements of `benchmarks.vllm_load` that the connector's step slicing and its allocator setting change, on one
freshly started server (a) (vLLM's CPU build with the connector mapping; the same setup as `benchmarks.vllm_load`):

1. Streams: the inter-token latency of two long base-model streams while requests arrive, ``--repetitions`` windows
   per condition (`benchmarks.vllm_traffic.STREAM_CONDITIONS`): on histories the base model computed, switching to
   adapters (mapped) or (the same load without switches) to the base model again; and, the control that separates
   the mapping from the adapter's forward, to adapters on histories they computed themselves (their own prefix
   cache: the same new tokens through the adapter, nothing mapped; each of its histories is first a full prefill
   through the adapter, a few minutes of the run). The per-window p95 ratios with 95% t-intervals.
2. At ``--own-tokens`` of history, ``--repeats`` times: an adapter continuing its own cached prefix, a mapped switch
   and a prefill; mapped / own run by run, and the mapped switch's first-token KL against the prefill.

    python -m benchmarks.vllm_switch_cost          # ~20 min on 2 cores; a quiet machine: it times
    python -m benchmarks.vllm_switch_cost --maps OTHER --output OUT    # other maps (e.g. from git history)

Writes benchmarks/results/vllm-switch-cost.json and .md (the raw measurements inside).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from peft_kvcache.lab.provenance import write_results
from peft_kvcache.modeling.fixtures import converted_path

from . import vllm_traffic as traffic
from .common import RESULTS, ROOT, SMOLLM, start_run, table
from .vllm_load import MAPS
from .vllm_report import ci, own_summary, streams_summary
from .vllm_servers import vllm_server


def markdown(payload: dict, level: int = 1) -> str:
    """The results as markdown, sections at heading ``level`` + 1 (the README's block: level 3, no title)."""
    s, st, own = payload["setup"], payload["streams"], payload["own_cache"]
    h = "#" * (level + 1)
    title = ["# A switch inside vLLM: the streams around it and the adapter's own cache", ""] if level == 1 else []
    return "\n".join(title + [
        f"Server (a) of `benchmarks.vllm_load` (vLLM's CPU build, the connector mapping), started fresh, maps from "
        f"`{s['maps']}`; {s['threads']} threads" + (f"; at most {s['max_num_batched_tokens']} tokens per engine step"
                                                       if s.get("max_num_batched_tokens") else "") + ".", "",
        f"{h} Inter-token latency of streams that do not switch ({s['repetitions']} windows per condition)", "",
        table(["condition", "ITL p50 / p95 / largest (ms)", "foreground TTFT median (s)",
               "foreground prompt tokens cached", "connector fallbacks"],
              [[condition, " / ".join(f"{1e3 * st[condition][k]:.1f}" for k in ("itl_p50", "itl_p95", "itl_max")),
                f"{st[condition]['foreground_ttft_median']:.3f}",
                f"{st[condition]['cached_tokens']} of {st[condition]['prompt_tokens']}",
                ", ".join(f"{reason} {n}" for reason, n in sorted(st[condition]["fallbacks"].items())) or "none"]
               for condition in traffic.STREAM_CONDITIONS if condition in st]), "",
        "Conditions: " + "; ".join(f"{c}: {what}" for c, what in traffic.STREAM_CONDITIONS.items() if c in st) + ".",
        "",
        f"p95 ratio window by window, switches / none: {ci(st['p95_ratio'])}"
        + (f"; own-cache switches / none: {ci(st['own_p95_ratio'])}; mapped switches / own-cache switches: "
           f"{ci(st['switch_to_own_p95_ratio'])}" if "own_p95_ratio" in st else "") + ".", "",
        f"{h} An adapter's own cache against a mapped switch ({own['prompt_tokens']} prompt tokens, "
        f"{s['repeats']} repeats)", "",
        table(["reply", "TTFT median [min, max] (s)", "cached tokens"],
              [[kind, f"{own[kind]['median']:.3f} [{own[kind]['min']:.3f}, {own[kind]['max']:.3f}]",
                own["cached"][kind]] for kind in ("own", "mapped", "prefill")]), "",
        f"Mapped / own, run by run: median {own['mapped_to_own']['median']:.2f} [{own['mapped_to_own']['min']:.2f}, "
        f"{own['mapped_to_own']['max']:.2f}]; the mapped switch's first-token KL against the prefill "
        f"{ci(own['mapped_kl'], 4)}.",
    ])


def main(argv=None) -> int:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=4, help="inter-token latency windows per condition")
    parser.add_argument("--own-tokens", type=int, default=2048, help="history of the own-cache comparison")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the own / mapped / prefill timings")
    parser.add_argument("--history-chars", type=int, default=6000, help="characters of the module shared first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--maps", type=Path, default=Path(MAPS),
                        help="folder of the adapter maps the connector serves (default: the published hub_cards)")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                        help="python of the vLLM environment (scripts/vllm_env.sh)")
    parser.add_argument("--log", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "vllm-switch-cost.log")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens one engine step may compute (default: vLLM's): smaller steps chunk the switches' "
                             "forward through the adapter, for the streams' latency")
    parser.add_argument("--output", type=Path, default=RESULTS / "vllm-switch-cost")
    args = parser.parse_args(argv)
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"{args.vllm_python} does not exist: build the vLLM environment with bash scripts/vllm_env.sh")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_path(SMOLLM))
    texts = traffic.modules(args.history_chars)
    module = next(t for t in traffic.modules(0) if len(t) > 40000)
    maps = args.maps.resolve()
    with vllm_server(args.vllm_python, converted_path(SMOLLM), {"maps": str(maps)}, args.log,
                     max_num_batched_tokens=args.max_num_batched_tokens) as url:
        traffic.warm_up(url)
        windows = traffic.streams(url, texts, args.history_chars, args.repetitions,
                                  conditions=tuple(traffic.STREAM_CONDITIONS))
        rows = traffic.own_versus_mapped(url, tokenizer, module, args.own_tokens, args.repeats)
    shown = maps.relative_to(ROOT) if maps.is_relative_to(ROOT) else args.maps  # no machine path for the repo's own
    setup = {"model": SMOLLM, "server": "a", "maps": str(shown),
             **{k: getattr(args, k) for k in ("repetitions", "own_tokens", "repeats", "threads",
                                              "max_num_batched_tokens")}}
    payload = {"setup": setup, "streams": streams_summary(windows), "own_cache": own_summary(rows),
               "raw": {"windows": windows, "own": rows}}
    text = markdown(payload)
    print(text)
    write_results(args.output, payload, text, data={
        "texts": "evaluation-split stdlib modules (first history_chars characters) for the streams' histories; a "
                 "module over 40,000 characters for the own-cache timings"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
