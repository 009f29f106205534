"""Time to first token after a switch, measured one way for every map: the target's full prefill of L tokens and
the target continuing its own cache of the context (what a switch would cost if the target had kept one) vs the
switch (map the source cache the source already holds, the target computes the sink and the last token), side by
side in one run, each the median of ``--repeats`` runs with min and max.

- ``cold``: the target's sink pass is paid (its memo is cleared before every run);
- ``warm``: the sink memo already holds this conversation's first tokens (a chat template starts every
  conversation the same way);
- ``recipe``: cold, with the map's recommended refresh (its ``config.refresh``), as ``from_source`` does by default;
- ``recipe's passes``: where the recipe's time goes (medians over its runs): the refresh's probe pass, its recompute
  pass, the first token's pass, and the rest (mapping, the sink, the cache's bookkeeping);
- ``map only``: the mapping alone, its tokens/s, and its floors: cache bytes written over the measured memory
  bandwidth, and the map's multiply-adds over the measured matmul throughput.

    python -m benchmarks.ttft --pair up --label basis512 --lengths 512 2048 8192
    python -m benchmarks.ttft --pair up --label basis512 --lengths 2048 --sweep refresh@64/p32 refresh@96/p64
    python -m benchmarks.ttft --random-models qwen2.5-1.5b qwen2.5-7b --device cuda --dtype bfloat16

A sibling run names the maps it times (``--label``: the lever whose maps ``--map`` holds, by default the published
folder's) and writes ``ttft-<pair>-<label>``: the published table ``ttft-<pair>`` is `scripts.publish`'s, which
labels the folder's maps by the lever they came from.

Writes benchmarks/results/ttft-<name>.json/.md and a plot.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from peft_kvcache import KVMap, MappedCache
from peft_kvcache.calibration.statistics import ModelSide
from peft_kvcache.maps.config import KVMapConfig
from peft_kvcache.maps.recipe import Refresh
from peft_kvcache.modeling.capture import forward, run_with_cache
from peft_kvcache.runtime.cache import ContextCache
from peft_kvcache.runtime.refresh import refresh_policy
from peft_kvcache.runtime.target_sink import clear_target_sinks

from .common import (RESULTS, interval, ratio, read_results, rounds, save, spread, start_run, synchronize,
                     table, timed)
from .recipe_budget import runs_of_the_same_maps, with_earlier_runs

# Real configs of sizes timed with random weights (timing does not need trained weights).
RANDOM_CONFIGS = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4),
}


def prefill_multiply_adds_per_token(config, length: int) -> int:
    """Multiply-adds per token of a decoder's prefill of ``length`` tokens (a transformers config): its attention
    projections and MLP, and causal attention (scores and weighted values over ``length / 2`` positions on average);
    the embeddings and the LM head aside (a prefill computes one row of logits). What a map's own multiply-adds per
    token are measured against: a switch cannot be more than their ratio faster than the prefill it replaces."""
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    queries, keys = heads * head_dim, config.num_key_value_heads * head_dim
    projections = hidden * (2 * queries + 2 * keys)  # q and o, k and v
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    return config.num_hidden_layers * (projections + mlp + queries * length)


def random_model(name: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=151936, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **RANDOM_CONFIGS[name])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    model.config.name_or_path = f"random-{name}"
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
        pair_kind="cross_shape", key_layers=layers, value_layers=layers)
    return KVMap(config, tensors)


def floors(device: torch.device, dtype: torch.dtype) -> dict:
    """Memory bandwidth (a large copy, read + write) and matmul throughput of this machine."""
    data = torch.empty(512 * 2**20 // 4, dtype=torch.float32, device=device)
    out = torch.empty_like(data)
    copy = timed(lambda: out.copy_(data), 5)["median"]
    square = torch.randn(2048, 2048, device=device, dtype=dtype)
    matmul = timed(lambda: square @ square, 5)["median"]
    return {"bandwidth_bytes_per_s": 2 * data.numel() * 4 / copy, "matmul_flops_per_s": 2 * 2048**3 / matmul}


class RecipeTimer:
    """Times switches at one length: map ``source_kv`` (the source's cache of ``context``, untimed: the source holds
    it at a switch) into ``target`` with a refresh, and run the next token (``last``) on the result; each recipe's
    runs also record their passes (the refresh's probe and recompute passes, the first token's pass) in seconds."""

    def __init__(self, source_kv, target, kv_map, context: torch.Tensor, last: torch.Tensor) -> None:
        self.source_kv, self.target, self.kv_map, self.context, self.last = source_kv, target, kv_map, context, last
        self.step = torch.tensor([[context.shape[1]]])
        self.passes: dict[object, list[dict]] = {}  # per refresh as given (a name, a `Refresh`, None), run by run

    def switch(self, refresh) -> Callable[[], None]:
        def run():
            cache = MappedCache.from_source(self.source_kv, self.kv_map, self.target, input_ids=self.context,
                                            refresh_tokens=refresh)
            synchronize()  # the first token's clock starts when the switch's work is done, not queued
            started = time.perf_counter()
            forward(self.target, self.last, cache, position_ids=self.step, logits_to_keep=1)
            synchronize()
            if cache.refresh is not None:
                self.passes.setdefault(refresh, []).append({"probe": cache.refresh.probe_seconds,
                                                            "recompute": cache.refresh.recompute_seconds,
                                                            "first_token": time.perf_counter() - started})
        return run

    def median_passes(self, refresh, runs: int) -> dict:
        """The medians of the last ``runs`` runs' passes with ``refresh``."""
        last = self.passes[refresh][-runs:]
        return {name: statistics.median(run[name] for run in last) for name in last[0]}


@torch.no_grad()
def measure(source_run, target, kv_map, ids: torch.Tensor, repeats: int = 5, recipe: bool = True,
            full: dict | None = None, maps: str = "published") -> dict:
    """TTFT at ``ids``' length: ``source_run(ids) -> source cache`` (untimed: the source holds it at a switch), the
    target's full prefill (unless its timing ``full`` is given), the target continuing its own cache, and the switch
    cold, warm and with the map's recipe; medians with min and max. All are timed in rounds (`rounds`), so each
    speedup and the warm switch over the own cache are read round by round (a given ``full`` was timed apart: its
    speedups are ratios of medians). ``maps``: the label of ``kv_map`` (a calibration lever's, or ``published``),
    which names the recipe as the recipes benchmark does (``label:recipe``)."""
    length = ids.shape[1]
    context, last = ids[:, :-1], ids[:, -1:]
    timer = RecipeTimer(source_run(context), target, kv_map, context, last)
    own_kv = run_with_cache(target, context)  # untimed: what the target holds when it continues its own context
    fns = {} if full is not None else {"full": lambda: forward(target, ids, None, logits_to_keep=1)}
    fns |= {"own": lambda: forward(target, last, ContextCache(own_kv), position_ids=timer.step, logits_to_keep=1),
            "warm": timer.switch(0), "cold": timer.switch(0),
            "map_only": lambda: MappedCache.from_source(timer.source_kv, kv_map, target, input_ids=context,
                                                        refresh_tokens=0)}
    cold = {"cold": clear_target_sinks}
    with_recipe = recipe and kv_map.config.refresh is not None and kv_map.config.refresh.active
    if with_recipe:
        fns["recipe"], cold["recipe"] = timer.switch(None), clear_target_sinks
    runs = rounds(fns, repeats, before=cold)
    row = {"context": length, "full": full or spread(runs["full"]), **{name: spread(runs[name]) for name in runs}}
    if with_recipe:
        row["recipe_passes"] = timer.median_passes(None, repeats)
        name = kv_map.config.refresh.name  # what "recipe" timed, on which maps
        row["recipe_name"] = name if maps == "published" else f"{maps}:{name}"
    for name in ("cold", "warm", "recipe"):
        if name in row:
            row[f"speedup_{name}"] = (row["full"]["median"] / row[name]["median"] if full is not None
                                      else ratio(runs["full"], runs[name])["median"])
    row["warm_to_own"] = ratio(runs["warm"], runs["own"])
    layout = kv_map.config.target_layout
    element = torch.finfo(next(target.parameters()).dtype).bits // 8
    row["cache_bytes_written"] = 2 * layout.num_layers * layout.layer_width * (length - 1) * element
    row["map_flops"] = 2 * (length - 1) * kv_map.multiply_adds_per_token
    row["map_tokens_per_s"] = (length - 1) / row["map_only"]["median"]
    return row


@torch.no_grad()
def sweep(source_run, target, kv_map, ids: torch.Tensor, recipes: list[str], repeats: int = 3) -> dict:
    """TTFT at ``ids``' length of each recipe in ``recipes`` (names, `Refresh.named`), cold sink, beside the
    target's full prefill in the same run: what budget a TTFT goal leaves a recipe. Timed in rounds (the prefill,
    then each recipe once; a first round warms up), so that a drift in the machine's speed moves the prefill and the
    recipes together; a recipe's speedup is the median over rounds of the prefill's time over its own, with the
    rounds' min and max."""
    length = ids.shape[1]
    context, last = ids[:, :-1], ids[:, -1:]
    timer = RecipeTimer(source_run(context), target, kv_map, context, last)
    policies = {name: refresh_policy(kv_map, name) for name in recipes}  # read as `from_source` reads a name
    runs = rounds({"full": lambda: forward(target, ids, None, logits_to_keep=1),
                   **{name: timer.switch(policy) for name, policy in policies.items()}}, repeats,
                  before={name: clear_target_sinks for name in recipes})
    row = {"context": length, "full": spread(runs["full"]), "recipes": {}}
    for name in recipes:
        ratios = ratio(runs["full"], runs[name])
        row["recipes"][name] = {"timing": spread(runs[name]), "passes": timer.median_passes(policies[name], repeats),
                                "budget": policies[name].compute, "speedup": ratios["median"],
                                "speedup_min": ratios["min"], "speedup_max": ratios["max"]}
    return row


def passes_cell(passes: dict, total: float) -> str:
    """A recipe's median passes (probe / recompute / first token) and the rest of its median ``total``, in seconds."""
    return " / ".join(f"{seconds:.2f}" for seconds in [*passes.values(), total - sum(passes.values())]) + " s"


def markdown(name: str, rows: list[dict], machine: dict) -> str:
    def cell(timing: dict) -> str:
        return interval(timing["median"], timing["min"], timing["max"], 2) + " s"

    def warm_to_own(r: dict) -> str:  # rows written before the rounds hold the ratio of two medians
        ratios = r.get("warm_to_own")
        if isinstance(ratios, dict):
            return f"{ratios['median']:.2f}x [{ratios['min']:.2f}, {ratios['max']:.2f}]"
        return f"{ratios:.2f}x" if ratios is not None else "-"

    header = ["context", "full prefill", "own cache", "switch, cold", "switch, warm", "with the recipe",
              "speedup cold / warm / recipe", "recipe's passes: probe / recompute / first token / rest",
              "warm switch / own cache (by round)", "map only (tok/s)", "map vs bandwidth / matmul floor"]
    body = []
    for r in rows:
        speedups = " / ".join(f"{r[f'speedup_{k}']:.1f}x" if f"speedup_{k}" in r else "-" for k in ("cold", "warm", "recipe"))
        bandwidth = r["cache_bytes_written"] / machine["bandwidth_bytes_per_s"] / r["map_only"]["median"]
        compute = r["map_flops"] / machine["matmul_flops_per_s"] / r["map_only"]["median"]
        body.append([r["context"], cell(r["full"]), cell(r["own"]) if "own" in r else "-", cell(r["cold"]),
                     cell(r["warm"]), cell(r["recipe"]) if "recipe" in r else "-", speedups,
                     passes_cell(r["recipe_passes"], r["recipe"]["median"]) if "recipe_passes" in r else "-",
                     warm_to_own(r),
                     f"{r['map_only']['median']:.3f} s ({r['map_tokens_per_s']:,.0f})", f"{bandwidth:.0%} / {compute:.0%}"])
    return (f"## TTFT after a switch: {name}\n\nMedian [min, max] of the runs, timed in rounds (each times every "
            f"column once); {torch.get_num_threads()} threads. A speedup and the warm switch over the own cache: the "
            "median over rounds of the ratio of two times in one round.\n\n"
            + table(header, body) + "\n")


def sweep_markdown(name: str, payload: dict) -> str:
    """The sweep's table, then one per earlier run of the same maps it keeps (the budget must hold in each)."""
    def speedup(r: dict) -> str:
        spread = f" [{r['speedup_min']:.1f}, {r['speedup_max']:.1f}]" if "speedup_min" in r else ""
        return f"{r['speedup']:.1f}x{spread}"

    def runs_table(rows: list[dict]) -> str:
        header = ["context", "full prefill", "recipe", "target compute", "TTFT", "speedup",
                  "passes: probe / recompute / first token / rest"]
        body = []
        for row in rows:
            full = interval(row["full"]["median"], row["full"]["min"], row["full"]["max"], 2) + " s"
            for recipe, r in row["recipes"].items():
                body.append([row["context"], full, recipe, r["budget"],
                             interval(r["timing"]["median"], r["timing"]["min"], r["timing"]["max"], 2) + " s",
                             speedup(r), passes_cell(r["passes"], r["timing"]["median"])])
        return table(header, body) + "\n"

    text = (f"## TTFT by recipe: {name}\n\nCold sink; median [min, max] of the runs; {torch.get_num_threads()} threads. "
            "Speedup: the median over rounds (each times the prefill, then every recipe) of the prefill's time over the "
            "recipe's. Target compute: context tokens the target computes (the probe counted once).\n\n"
            + runs_table(payload["rows"]))
    for earlier in runs_of_the_same_maps(payload)[1:]:
        commit = (earlier["provenance"].get("commit") or "unknown")[:7]
        text += (f"\n### An earlier run of the same maps ({earlier['provenance']['date']}, commit {commit}; a budget "
                 "must meet the goals in every run)\n\n" + runs_table(earlier["rows"]))
    return text


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("full", "full target prefill"), ("cold", "switch (cold sink)"), ("warm", "switch (warm sink)"),
                       ("recipe", "switch with the recipe")):
        points = [(r["context"], r[key]["median"]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="time to first token (s)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(name: str, source_run, target, kv_map, lengths, repeats: int, device: torch.device, dtype: torch.dtype,
        vocab_low: int = 100, vocab_high: int = 20000, maps: str = "published",
        goals: dict[int, int] | None = None) -> dict:
    """Measure every length and write ``benchmarks/results/ttft-<name>`` (``maps``: ``kv_map``'s label, see
    `measure`; ``goals``: the speedup each length must reach, recorded beside the rows for whoever reports them);
    returns the payload."""
    generator = torch.Generator().manual_seed(0)
    machine = floors(device, dtype)
    rows = [measure(source_run, target, kv_map, torch.randint(vocab_low, vocab_high, (1, n), generator=generator),
                    repeats, maps=maps) for n in lengths]
    payload = {"name": name, "maps": maps, "repeats": repeats, "machine_floors": machine, "rows": rows,
               **({"goals": {str(n): goal for n, goal in goals.items() if n in lengths}} if goals else {})}
    save(f"ttft-{name}", payload, markdown(name, rows, machine), seeds={"ids": 0})
    plot(rows, RESULTS / f"ttft-{name}.png", f"TTFT after a switch: {name}")
    return payload


def main() -> None:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=["up", "down"], default="up", help="the Qwen2.5-Coder sibling direction")
    parser.add_argument("--map", default=None, help="map folder (default: hub_cards/<the pair's map>)")
    parser.add_argument("--label", help="a sibling pair: the maps timed (the lever --map's maps come from, e.g. "
                        "basis512 for the published up map): results ttft-<pair>-<label>, a sweep records it")
    parser.add_argument("--recipe", help="the recipe timed, by name (`Refresh.named`; default the map's own)")
    parser.add_argument("--sweep", nargs="+", metavar="RECIPE",
                        help="time these recipes instead (results ttft-<pair>-sweep, whichever --map): the budget a TTFT goal leaves")
    parser.add_argument("--random-models", nargs=2, metavar=("SOURCE", "TARGET"), choices=sorted(RANDOM_CONFIGS),
                        help="time randomly initialised models of real shapes instead of the fixtures")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.sweep and (args.recipe or len(set(args.sweep)) < len(args.sweep)):
        parser.error("--sweep takes distinct recipes and no --recipe (it times each recipe it names)")
    if not args.random_models and not args.label:  # the published table is scripts.publish's: it knows which
        # lever's maps the folder holds
        parser.error("--label names the maps timed (the lever they come from: basis512 for the published up map, "
                     "top4 down); results go to ttft-<pair>-<label>, never the published table")
    torch.set_num_threads(args.threads)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    if args.random_models:
        source, target = (random_model(name, args.device, dtype) for name in args.random_models)
        kv_map, name = random_map(source, target), "-to-".join(args.random_models) + f"-{args.device}"
    else:
        from . import siblings

        models, _ = siblings.load_pair()
        small_to_large = args.pair == "up"
        source, target = (models["small"], models["large"]) if small_to_large else (models["large"], models["small"])
        name = siblings.pair_name(args.pair)
        kv_map = KVMap.from_pretrained(args.map or Path(RESULTS.parents[1] / "hub_cards" / name))
    if args.recipe:
        kv_map.config.refresh = Refresh.named(args.recipe)
    if args.sweep:  # one sweep per pair, whichever maps it ran (recorded): it sets the pair's budget
        generator, source_run = torch.Generator().manual_seed(0), lambda ids: run_with_cache(source, ids)
        rows = [sweep(source_run, target, kv_map, torch.randint(100, 20000, (1, n), generator=generator), args.sweep,
                      args.repeats) for n in args.lengths]
        payload = {"name": name, "maps": args.label, "map_parameters": kv_map.num_parameters,
                   "map_multiply_adds_per_token": kv_map.multiply_adds_per_token, "repeats": args.repeats, "rows": rows}
        stem = f"ttft-{name}-sweep"
        payload = with_earlier_runs(payload, read_results(stem) if (RESULTS / f"{stem}.json").is_file() else None)
        save(stem, payload, sweep_markdown(f"{name} ({payload['maps']} maps)", payload), seeds={"ids": 0})
        return
    name += f"-{args.label}" if args.label else ""
    run(name, lambda ids: run_with_cache(source, ids), target, kv_map, args.lengths, args.repeats, device, dtype,
        maps=args.label or "published")


if __name__ == "__main__":
    main()
