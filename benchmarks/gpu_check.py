"""The connector's GPU path on a CUDA machine with torch and transformers (no vLLM needed), at the shapes of an
8B-class model (32 layers, 8 KV heads of 128, bfloat16):

1. every GPU paged layout (NHD ``LBNHC``, HND ``LBHNC``, block-outer ``BLNHC`` / ``BLHNC``, and a manager block split
   into kernel blocks) round-trips through `peft_kvcache.vllm.layout.LogicalLayout` on the device (blocks out of
   order, NaN in every other slot), the cache laid out as vLLM 0.32 lays it out (a flat allocation viewed as
   ``[blocks, heads, block, 2 * head_dim]`` per layer, strides in the layout's order);
2. `map_cache` at 8k tokens on the device: median time and peak memory, against the target's own prefill of the same
   8k tokens (a randomly initialised Llama of that shape: timing needs no trained weights).

    python -m benchmarks.gpu_check --tokens 8192 --repeats 5

Writes benchmarks/results/gpu-check.json/.md. Needs CUDA; on a machine without it, it says so and writes nothing.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from .common import save, start_run, table, timed

LAYERS, KV_HEADS, HEADS, HEAD_DIM, HIDDEN, BLOCK = 32, 8, 32, 128, 4096, 16
# stride orders of vLLM 0.32's KVCacheLayout over the logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py)
LAYOUTS = {"LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4)}


class Layout:
    """What the codec needs of a `KVCacheLayout`: its name and a layer's physical axis order."""

    def __init__(self, name: str):
        self.name = name
        self.layer_view_order = tuple(i - 1 for i in LAYOUTS[name] if i != 0)


def paged_layers(name: str, blocks: int, kernel_block: int, dtype, device) -> list[torch.Tensor]:
    """One logical ``[blocks * ratio, heads, kernel_block, 2 * head_dim]`` view per layer of one NaN allocation laid
    out in ``name``'s order (as vLLM's create_kv_cache_views builds them)."""
    ratio = BLOCK // kernel_block
    shape = (LAYERS, blocks * ratio, KV_HEADS, kernel_block, 2 * HEAD_DIM)
    order = LAYOUTS[name]
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.full((step,), float("nan"), dtype=dtype, device=device)
    view = torch.as_strided(raw, shape, strides)
    return list(view.unbind(0))


def check_layouts(device, dtype=torch.bfloat16) -> list[dict]:
    from peft_kvcache.vllm.layout import LogicalLayout

    rows = []
    cases = [(name, BLOCK) for name in LAYOUTS] + [("LBNHC", BLOCK // 2)]
    for name, kernel_block in cases:
        layers = paged_layers(name, 64, kernel_block, dtype, device)
        codec = LogicalLayout.of(layers[0], Layout(name), HEAD_DIM, BLOCK, 64)
        ids = (41, 3, 17, 8)
        written = [(torch.randn(KV_HEADS, len(ids) * BLOCK, HEAD_DIM, device=device).to(dtype),
                    torch.randn(KV_HEADS, len(ids) * BLOCK, HEAD_DIM, device=device).to(dtype)) for _ in layers[:4]]
        for layer, (k, v) in zip(layers, written):
            codec.write(layer, ids, k, v)
        exact = all(torch.equal(codec.read(layer, ids)[0], k) and torch.equal(codec.read(layer, ids)[1], v)
                    for layer, (k, v) in zip(layers, written))
        others = [b for b in range(64) if b not in ids]
        untouched = bool(torch.isnan(layers[0][[b * codec.ratio for b in others]].float()).all())
        rows.append({"layout": name, "kernel_block": kernel_block, "round_trip": exact, "others_untouched": untouched})
    return rows


def random_map(device):
    """A same-shape map of 8B shape (identity plus noise, each layer from itself): what an adapter map costs."""
    from peft_kvcache import KVMap, KVMapConfig
    from peft_kvcache.maps.config import CalibrationRecord, DataRecord
    from peft_kvcache.modeling.layout import KVLayout
    from peft_kvcache.modeling.positions import RotaryRecord

    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM)
    rotary = RotaryRecord(rope_type="default", head_dim=HEAD_DIM, rotary_dim=HEAD_DIM, attention_scaling=1.0)
    config = KVMapConfig(source_name="random-8b", target_name="random-8b+adapter", source_fingerprint="a" * 64,
                         target_fingerprint="b" * 64, source_layout=layout, target_layout=layout, source_rotary=rotary,
                         target_rotary=rotary, vocab_size=128256, pair_kind="same_shape",
                         key_layers=[[t] for t in range(LAYERS)], value_layers=[[t] for t in range(LAYERS)],
                         calibration=CalibrationRecord(data=DataRecord("random")))
    width = layout.layer_width
    inv_freq = 1.0 / 500000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    tensors = {"source.inv_freq": inv_freq, "target.inv_freq": inv_freq.clone()}
    for kind in ("keys", "values"):
        for t in range(LAYERS):
            tensors[f"{kind}.{t}.weight"] = torch.eye(width) + 0.01 * torch.randn(width, width)
            tensors[f"{kind}.{t}.bias"] = torch.zeros(width)
    return KVMap(config, tensors)


def time_mapping(device, tokens: int, repeats: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft_kvcache.maps.apply import map_cache

    kv_map = random_map(device)
    keys = [torch.randn(1, KV_HEADS, tokens, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(LAYERS)]
    values = [torch.randn_like(k) for k in keys]
    positions = torch.arange(tokens, device=device)[None]
    placements = [(device, torch.bfloat16)] * LAYERS
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    mapping = timed(lambda: map_cache(kv_map, keys, values, positions, positions, placements), repeats, warmup=1)
    peak = torch.cuda.max_memory_allocated(device) - base
    keys = values = None  # freed before the model is built
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=14336, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, vocab_size=128256, max_position_embeddings=max(8192, tokens))
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128256, (1, tokens), device=device)
    with torch.no_grad():
        prefill = timed(lambda: model(ids, logits_to_keep=1), repeats, warmup=1)
    return {"tokens": tokens, "map_seconds": mapping, "map_peak_bytes": peak, "prefill_seconds": prefill,
            "ratio": prefill["median"] / mapping["median"]}


def main() -> int:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: the GPU check was not run", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    layouts = check_layouts(device)
    timing = time_mapping(device, args.tokens, args.repeats)
    lines = [f"# The connector's GPU path ({torch.cuda.get_device_name(device)})", "",
             table(["layout", "kernel block", "round trip", "other blocks untouched"],
                   [[r["layout"], r["kernel_block"], r["round_trip"], r["others_untouched"]] for r in layouts]), "",
             f"map_cache at {timing['tokens']} tokens (32 layers x 8 KV heads x 128, bfloat16): median "
             f"{timing['map_seconds']['median'] * 1e3:.1f} ms, peak {timing['map_peak_bytes'] / 2**30:.2f} GiB; the "
             f"target's prefill of the same tokens: {timing['prefill_seconds']['median'] * 1e3:.1f} ms "
             f"({timing['ratio']:.0f}x the mapping)."]
    save("gpu-check", {"layouts": layouts, "timing": timing, "device": torch.cuda.get_device_name(device)},
         "\n".join(lines))
    return 0 if all(r["round_trip"] and r["others_untouched"] for r in layouts) and math.isfinite(timing["ratio"]) else 1


if __name__ == "__main__":
    sys.exit(main())
