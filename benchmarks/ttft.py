"""Time to first token after a switch: mapped path vs full target prefill, side by side in one run.

    python benchmarks/ttft.py --lengths 512 2048 8192                      # Qwen2.5-Coder 0.5B -> 1.5B fixtures
    python benchmarks/ttft.py --random-models qwen2.5-1.5b qwen2.5-7b --device cuda --dtype bfloat16

For each context length L (the source cache over the first L-1 tokens already exists after a switch, so
it is not timed):
- full: the target's prefill of all L tokens (logits for the last position only);
- mapped: MappedCache.from_source(source cache) + the target's step over the last token;
- map only: the mapping alone, its throughput (tokens/s) and its two floors: bytes of target cache written
  over the measured memory bandwidth, and the map's multiply-adds over the measured matmul throughput (on a
  CPU the map is compute-bound: every token costs 2 * d_in * d_out flops per target layer and kind);
- decode step: the target's one-token step over the mapped cache, the floor of the mapped path.
Prints a table, writes benchmarks/results/ttft-<name>.json and a plot of TTFT vs length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from peft_kvcache import KVMap, MappedCache
from peft_kvcache.calibrate import ModelSide
from peft_kvcache.capture import run_with_cache
from peft_kvcache.kvmap import KVMapConfig

RESULTS = Path(__file__).parent / "results"
# Real configs of sizes we time with random weights (timing does not need trained weights).
RANDOM_CONFIGS = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4),
}


def random_model(name: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6}, **RANDOM_CONFIGS[name])
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.config._name_or_path = f"random-{name}"
    return model


def random_map(source, target, top_k: int = 2) -> KVMap:
    """A map with the shapes calibration would give (top_k source layers per target layer), random weights."""
    src, tgt = ModelSide.of(source), ModelSide.of(target)
    layers = [sorted({min(src.layout.num_layers - 1, t * src.layout.num_layers // tgt.layout.num_layers + i)
                      for i in range(top_k)}) for t in range(tgt.layout.num_layers)]
    tensors = {"source.inv_freq": src.rotary.inv_freq, "target.inv_freq": tgt.rotary.inv_freq}
    for kind in ("keys", "values"):
        for t, group in enumerate(layers):
            d_in = len(group) * src.layout.layer_width
            tensors[f"{kind}.{t}.weight"] = torch.randn(d_in, tgt.layout.layer_width) / d_in**0.5
            tensors[f"{kind}.{t}.bias"] = torch.zeros(tgt.layout.layer_width)
    config = KVMapConfig(
        source_name=src.name, target_name=tgt.name, source_fingerprint=src.fingerprint,
        target_fingerprint=tgt.fingerprint, source_layout=src.layout, target_layout=tgt.layout,
        source_rotary=src.rotary.describe(), target_rotary=tgt.rotary.describe(), vocab_size=151936,
        pair_kind="cross_shape", key_layers=layers, value_layers=layers, sink_tokens=1)
    return KVMap(config, tensors)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return min(times)


def matmul_throughput(device: torch.device, dtype: torch.dtype, size: int = 2048) -> float:
    """Flops/s of a large square matmul: the compute floor's denominator."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    seconds = best_time(lambda: a @ a, device, 5)
    return 2 * size**3 / seconds


def memory_bandwidth(device: torch.device, megabytes: int = 512) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    data = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    out = torch.empty_like(data)
    seconds = best_time(lambda: out.copy_(data), device, 5)
    return 2 * data.numel() * 4 / seconds


@torch.no_grad()
def measure(source, target, kv_map, length: int, repeats: int) -> dict:
    device = next(target.parameters()).device
    ids = torch.randint(100, 20000, (1, length), device=device)
    source_cache = run_with_cache(source, ids[:, :-1])  # exists at a switch: not timed
    source_kv = list(zip(source_cache.keys, source_cache.values))
    context = ids[:, :-1]
    step_positions = torch.tensor([[length - 1]], device=device)

    full = best_time(lambda: target(ids, logits_to_keep=1), device, repeats)
    map_only = best_time(lambda: MappedCache.from_source(source_kv, kv_map, target, input_ids=context,
                                                         verify_models=False), device, repeats)

    def mapped_path():
        cache = MappedCache.from_source(source_kv, kv_map, target, input_ids=context, verify_models=False)
        target(ids[:, -1:], past_key_values=cache, position_ids=step_positions, logits_to_keep=1)

    mapped = best_time(mapped_path, device, repeats)
    cache = MappedCache.from_source(source_kv, kv_map, target, input_ids=context, verify_models=False)
    decode = best_time(lambda: target(ids[:, -1:], past_key_values=cache, position_ids=step_positions,
                                      logits_to_keep=1), device, 1)
    layout, dtype_bytes = kv_map.config.target_layout, torch.finfo(next(target.parameters()).dtype).bits // 8
    written = 2 * layout.num_layers * layout.layer_width * (length - 1) * dtype_bytes
    flops = 2 * (length - 1) * sum(t.numel() for n, t in kv_map.tensors.items() if n.endswith(".weight"))
    return {"map_flops": flops, "context": length, "full_prefill_s": full, "mapped_s": mapped, "speedup": full / mapped,
            "map_only_s": map_only, "map_tokens_per_s": (length - 1) / map_only, "decode_step_s": decode,
            "ceiling_speedup": full / decode, "cache_bytes_written": written}


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    lengths = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("full_prefill_s", "full target prefill"), ("mapped_s", "mapped cache + 1 step"),
                       ("decode_step_s", "one decode step (floor)")):
        ax.plot(lengths, [r[key] for r in rows], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="time to first token (s)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--map", default="hub_cards/qwen2.5-coder-0.5b-to-1.5b-top2",
                        help="map folder for the fixture pair (a random map of the same shapes if missing)")
    parser.add_argument("--random-models", nargs=2, metavar=("SOURCE", "TARGET"), choices=sorted(RANDOM_CONFIGS),
                        help="time randomly initialised models of real shapes instead of the fixtures")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    torch.manual_seed(0)

    if args.random_models:
        source, target = (random_model(name, args.device, dtype) for name in args.random_models)
        kv_map, name = random_map(source, target), f"{args.random_models[0]}-to-{args.random_models[1]}"
    else:
        from peft_kvcache.fixtures import load_model

        source, _ = load_model("gguf:qwen2.5-coder-0.5b-instruct", dtype=dtype)
        target, _ = load_model("gguf:qwen2.5-coder-1.5b-instruct", dtype=dtype)
        source, target = source.to(device), target.to(device)
        kv_map = KVMap.from_pretrained(args.map) if Path(args.map).is_dir() else random_map(source, target)
        name = "qwen2.5-coder-0.5b-to-1.5b"
    measure(source, target, kv_map, 64, 1)  # warm-up
    bandwidth, peak = memory_bandwidth(device), matmul_throughput(device, dtype)
    rows = []
    print(f"{name} on {args.device} ({args.dtype}, {torch.get_num_threads()} threads); memory bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s, matmul {peak / 1e9:.0f} GFLOP/s")
    print("| context | full prefill s | mapped + 1 step s | speedup | ceiling (prefill / decode step) | "
          "map only s | map tok/s | map vs bandwidth floor | map vs matmul floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        row = measure(source, target, kv_map, length, args.repeats)
        row["bandwidth_floor_s"] = row["cache_bytes_written"] / bandwidth
        row["floor_fraction"] = row["bandwidth_floor_s"] / row["map_only_s"]
        row["compute_floor_s"] = row["map_flops"] / peak
        row["compute_floor_fraction"] = row["compute_floor_s"] / row["map_only_s"]
        rows.append(row)
        print(f"| {length} | {row['full_prefill_s']:.3f} | {row['mapped_s']:.3f} | {row['speedup']:.1f}x | "
              f"{row['ceiling_speedup']:.1f}x | {row['map_only_s']:.4f} | {row['map_tokens_per_s']:,.0f} | "
              f"{row['floor_fraction']:.1%} | {row['compute_floor_fraction']:.0%} |", flush=True)
    RESULTS.mkdir(exist_ok=True)
    tag = f"{name}-{args.device}-{args.dtype}"
    (RESULTS / f"ttft-{tag}.json").write_text(json.dumps({"bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": peak, "rows": rows,
                                                           "threads": torch.get_num_threads()}, indent=2))
    plot(rows, RESULTS / f"ttft-{tag}.png", f"TTFT after a switch: {name}")


if __name__ == "__main__":
    main()
