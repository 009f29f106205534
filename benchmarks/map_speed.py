"""How fast a published map runs, and what bfloat16 matmuls cost it in quality (issue 32: a switch at the decode-step
ceiling). Run it on a quiet machine: it times.

1. Speed: every published SmolLM2 adapter map and both Qwen2.5-Coder sibling maps, the mapping alone of a
   ``--tokens`` source cache (random states of the source's shape: the time does not depend on their values), float32
   and bfloat16 matmuls side by side in one run, median [min, max] of ``--repeats``; with the CPU's bfloat16 support,
   which sets the library's default (`peft_kvcache.maps.compute`).
2. Quality: the six adapter maps' continuation retention on the held-out examples of their published figures
   (`benchmarks.adapters.held_out_examples`: evaluation-split files, 512 tokens of context, 64 of continuation),
   float32 against bfloat16 matmuls: KL(full || mapped) per example, and the paired difference (bfloat16 - float32)
   with its 95% bootstrap interval.

    python -m benchmarks.map_speed                    # ~30 min on 2 cores
    python -m benchmarks.map_speed --examples 4 --repeats 2 --output /tmp/map-speed   # a smoke run

Writes benchmarks/results/map-speed.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from peft_kvcache import AdapterMaps, KVMap
from peft_kvcache.calibration.retention import evaluate_retention
from peft_kvcache.maps.apply import map_cache
from peft_kvcache.lab.provenance import write_results
from peft_kvcache.maps.compute import matmul_dtype, native_bf16_cpu
from peft_kvcache.modeling.fixtures import fixture_available, load_model

from . import adapters
from .common import ADAPTERS, RESULTS, ROOT, SMOLLM, bootstrap_mean, matmuls_in, start_run, table, timed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CONTEXT, CONTINUATION = 512, 64  # the adapter maps' published retention (scripts/publish.py)


def published_maps() -> list[Path]:
    return sorted(p for p in (ROOT / "hub_cards").iterdir() if (p / "config.json").is_file())


def random_inputs(kv_map: KVMap, tokens: int) -> tuple:
    """``map_cache``'s inputs for timing ``kv_map`` on ``tokens`` positions: random source keys and values of its
    shape (seed 0; the time does not depend on their values), the positions, float32 CPU placements."""
    source, target = kv_map.config.source_layout, kv_map.config.target_layout
    generator = torch.Generator().manual_seed(0)
    shape = (1, source.kv_heads, tokens, source.head_dim)
    keys = [torch.randn(shape, generator=generator) for _ in range(source.num_layers)]
    values = [torch.randn(shape, generator=generator) for _ in range(source.num_layers)]
    positions = torch.arange(tokens)[None]
    return keys, values, positions, positions, [(torch.device("cpu"), torch.float32)] * target.num_layers


def speed(folder: Path, tokens: int, repeats: int) -> dict:
    """The mapping alone of ``tokens`` positions, float32 and bfloat16 matmuls (the target in float32)."""
    kv_map = KVMap.from_pretrained(folder)
    inputs = random_inputs(kv_map, tokens)
    row = {"map": folder.name, "tokens": tokens}
    for name, dtype in DTYPES.items():
        row[name] = timed(lambda d=dtype: map_cache(kv_map, *inputs, d), repeats)
    row["speedup"] = row["float32"]["median"] / row["bfloat16"]["median"]
    return row


def quality(examples: int) -> dict:
    """Per adapter map (both ways), KL(full || mapped) per held-out example with float32 and bfloat16 matmuls."""
    model, tokenizer = adapters.load_smollm2(ADAPTERS)
    base, _ = load_model(SMOLLM)
    maps = AdapterMaps.from_pretrained(ROOT / "hub_cards", model, ADAPTERS)
    sequences, names = adapters.held_out_examples(tokenizer, CONTEXT, CONTINUATION, examples)
    kls: dict[str, dict[str, list[float]]] = {}
    for name in DTYPES:
        with matmuls_in(name):  # what MappedCache.from_source multiplies in, in this process
            for adapter in ADAPTERS:
                model.set_adapter(adapter)
                for reverse in (False, True):
                    source, target, kv_map = ((model, base, maps.to_base[adapter]) if reverse else
                                              (base, model, maps.to_adapter[adapter]))
                    report = evaluate_retention(source, target, kv_map, sequences, CONTEXT, CONTINUATION,
                                                window_control=False, naive_reuse=False, progress=False)
                    kls.setdefault(f"{adapter} -> base" if reverse else f"base -> {adapter}", {})[name] = [
                        float(kl.mean()) for kl in report.scores["mapped@1"].kl]
    rows = {key: {"float32": bootstrap_mean(v["float32"]), "bfloat16": bootstrap_mean(v["bfloat16"]),
                  "difference": bootstrap_mean([b - a for a, b in zip(v["float32"], v["bfloat16"])]), "kls": v}
            for key, v in kls.items()}
    return {"examples": len(sequences), "files": names, "rows": rows}


def markdown(payload: dict) -> str:
    def cell(t: dict) -> str:
        return f"{t['median'] * 1e3:.1f} [{t['min'] * 1e3:.1f}, {t['max'] * 1e3:.1f}]"

    lines = [f"# How fast a map runs ({payload['threads']} threads; this CPU "
             f"{'multiplies' if payload['native_bf16'] else 'does not multiply'} bfloat16 natively: the library's "
             f"default is {payload['default']})", "",
             table(["map", "tokens", "float32 matmuls (ms)", "bfloat16 matmuls (ms)", "speedup"],
                   [[r["map"], r["tokens"], cell(r["float32"]), cell(r["bfloat16"]), f"{r['speedup']:.2f}x"]
                    for r in payload["speed"]])]
    q = payload.get("quality")
    if q:
        lines += ["", f"## Quality: KL(full || mapped), {q['examples']} held-out examples ({CONTEXT} + {CONTINUATION} "
                      "tokens), mean [95% bootstrap]", "",
                  table(["map", "float32", "bfloat16", "bfloat16 - float32 (paired)"],
                        [[key, *(f"{r[k]['mean']:.5f} [{r[k]['low']:.5f}, {r[k]['high']:.5f}]"
                                 for k in ("float32", "bfloat16", "difference"))] for key, r in q["rows"].items()])]
    return "\n".join(lines)


def main(argv=None) -> int:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--examples", type=int, default=48, help="held-out examples of the quality part (0: none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS / "map-speed")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folders = [f for f in published_maps() if "qwen" not in f.name or fixture_available("gguf:qwen2.5-coder-1.5b-instruct")]
    payload = {"threads": args.threads, "native_bf16": native_bf16_cpu(), "default": str(matmul_dtype("cpu")),
               "speed": [speed(f, args.tokens, args.repeats) for f in folders]}
    if args.examples:
        payload["quality"] = quality(args.examples)
    text = markdown(payload)
    print(text)
    write_results(args.output, payload, text, data={"speed": "random source states (seed 0)",
                                                    "quality": payload.get("quality", {}).get("files")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
