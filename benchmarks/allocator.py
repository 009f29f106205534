"""An adapter switch under glibc's default malloc and with freed memory kept (`peft_kvcache.keep_freed_memory`),
side by side (issue 32: a switch within 1.5x of the adapter's own cache). SmolLM2-135M-Instruct, per base -> adapter
map at ``--tokens``: the mapping alone (`MappedCache.from_source`, warm sink), the adapter's step on its own cache of
the context, and the warm switch (the mapping and that step). The setting is process-wide and cannot be undone, so
each allocator runs in its own process, the two interleaved over ``--rounds`` rounds of ``--repeats`` runs each;
median [min, max] of all runs, and the switch / own-cache ratio of the medians. Run it on a quiet machine: it times.

    python -m benchmarks.allocator                                # ~4 min on 2 cores
    python -m benchmarks.allocator --extra docstring=runs/prof/rank16 --output /tmp/allocator   # other maps too

Writes benchmarks/results/allocator.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from peft_kvcache.lab.provenance import write_results

from .common import ADAPTERS, RESULTS, ROOT, start_run, table, timed

ALLOCATORS = ("glibc", "kept")


def child(allocator: str, tokens: int, repeats: int, extra: list[tuple[str, str]]) -> dict:
    """One process's timings, in seconds: map label -> {map, own, switch: [runs]}."""
    from peft_kvcache import AdapterMaps, KVMap, MappedCache, adapter_active, keep_freed_memory, run_with_cache
    from peft_kvcache.modeling.capture import forward
    from peft_kvcache.runtime.cache import ContextCache

    from . import adapters

    if allocator == "kept" and not keep_freed_memory():
        raise SystemExit("keep_freed_memory() did not apply here (not glibc, or another allocator preloaded)")
    model, _ = adapters.load_smollm2(ADAPTERS)
    maps = AdapterMaps.from_pretrained(ROOT / "hub_cards", model, list(ADAPTERS))
    chosen = {f"base -> {a}": (a, maps.to_adapter[a]) for a in ADAPTERS}
    chosen.update({f"base -> {a} ({Path(folder).name})": (a, KVMap.from_pretrained(folder)) for a, folder in extra})
    ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
    context, last, step = ids[:, :-1], ids[:, -1:], torch.tensor([[tokens - 1]])
    with adapter_active(model, None):
        source = run_with_cache(model, context)
    out = {}
    for label, (adapter, kv_map) in chosen.items():
        with adapter_active(model, adapter):
            own = run_with_cache(model, context)

            def mapped():
                return MappedCache.from_source(source, kv_map, model, input_ids=context, refresh_tokens=0)

            out[label] = {
                "map": timed(mapped, repeats)["runs"],
                "own": timed(lambda: forward(model, last, ContextCache(own), position_ids=step, logits_to_keep=1),
                             repeats)["runs"],
                "switch": timed(lambda: forward(model, last, mapped(), position_ids=step, logits_to_keep=1),
                                repeats)["runs"],
            }
    return out


def summary(runs: list[float]) -> dict:
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def markdown(payload: dict) -> str:
    def cell(t: dict) -> str:
        return f"{t['median'] * 1e3:.1f} [{t['min'] * 1e3:.1f}, {t['max'] * 1e3:.1f}] ms"

    rows = []
    for label, by_allocator in payload["maps"].items():
        for allocator in ALLOCATORS:
            r = by_allocator[allocator]
            rows.append([label, allocator, cell(r["map"]), cell(r["own"]), cell(r["switch"]),
                         f"{r['switch_to_own']:.2f}x"])
    return "\n".join([
        f"# An adapter switch by allocator: SmolLM2-135M-Instruct, {payload['tokens']} tokens "
        f"({payload['threads']} threads)",
        "",
        f"Median [min, max] of {payload['rounds']} rounds x {payload['repeats']} runs, the allocators interleaved, "
        "each in its own process. `glibc`: the default malloc; `kept`: `peft_kvcache.keep_freed_memory()`.",
        "",
        table(["map", "allocator", "mapping (warm sink)", "own cache step", "switch (mapping + step)",
               "switch / own"], rows),
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--extra", nargs="*", default=[], metavar="ADAPTER=FOLDER",
                        help="more base -> adapter maps to time (e.g. residual-rank fits)")
    parser.add_argument("--child", choices=ALLOCATORS, help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=RESULTS / "allocator")
    args = parser.parse_args(argv)
    extra = [tuple(item.split("=", 1)) for item in args.extra]
    if any(len(pair) != 2 or pair[0] not in ADAPTERS for pair in extra):
        parser.error(f"--extra takes ADAPTER=FOLDER with ADAPTER one of {list(ADAPTERS)}, got {args.extra}")
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.repeats, extra)))
        return 0
    start_run()
    runs: dict = {}
    for round_ in range(args.rounds):
        for allocator in ALLOCATORS:
            command = [sys.executable, "-m", "benchmarks.allocator", "--child", allocator, "--tokens", str(args.tokens),
                       "--repeats", str(args.repeats), "--threads", str(args.threads), "--extra", *args.extra]
            done = subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True)
            for label, timings in json.loads(done.stdout.splitlines()[-1]).items():
                for part, values in timings.items():
                    runs.setdefault(label, {}).setdefault(allocator, {}).setdefault(part, []).extend(values)
            print(f"round {round_ + 1}/{args.rounds}: {allocator} done", flush=True)
    maps = {label: {allocator: {part: summary(values) for part, values in parts.items()}
                    for allocator, parts in by_allocator.items()} for label, by_allocator in runs.items()}
    for by_allocator in maps.values():
        for r in by_allocator.values():
            r["switch_to_own"] = r["switch"]["median"] / r["own"]["median"]
    payload = {"tokens": args.tokens, "rounds": args.rounds, "repeats": args.repeats, "threads": args.threads,
               "extra": extra, "maps": maps}
    write_results(args.output, payload, markdown(payload), seeds={"ids": 0})
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
