"""Linear vs nonlinear (residual MLP heads) maps, and how well the quality gate predicts retention.

    python benchmarks/nonlinear.py                      # Qwen2.5-Coder 0.5B -> 1.5B fixtures (slow on CPU)
    python benchmarks/nonlinear.py --pair qwen-down --linear-from hub_cards/qwen2.5-coder-1.5b-to-0.5b-top2 \
        --variants linear nonlinear                     # 1.5B -> 0.5B: the published map and its MLP heads
    python benchmarks/nonlinear.py --pair shout         # SmolLM2-135M base -> its committed LoRA adapter "shout"
    python benchmarks/nonlinear.py --tiny               # tiny random models: checks the plumbing only

Variants, all scored on the same held-out text: the linear map; the same map plus MLP heads
(`fit_nonlinear_heads`); a hard variant calibrated on a deliberately small calibration set, linear and
nonlinear; and the linear map with noise added to its weights (a known-bad map, to spread the predictions).
For each: the gate's predicted retention (`measure_quality`) and measured normalized retention
(`evaluate_retention`, mapped@1), then the Pearson correlation between the two across variants (the
published anchor for attention-output cosine is r = +0.57). Writes benchmarks/results/nonlinear[-<pair>].{md,json}
(nonlinear_tiny.* with --tiny).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from peft_kvcache import KVMap
from peft_kvcache.evaluate import RetentionReport, evaluate_retention
from peft_kvcache.nonlinear import fit_nonlinear_heads
from peft_kvcache.quality import measure_quality

SMALL, LARGE = "gguf:qwen2.5-coder-0.5b-instruct", "gguf:qwen2.5-coder-1.5b-instruct"
RESULTS = Path(__file__).parent / "results"
VARIANTS = ("linear", "nonlinear", "weak", "weak-nonlinear", "noise-0.5", "noise-2")


def tiny_pair():
    from transformers import AutoModelForCausalLM, Qwen2Config

    def make(seed, **overrides):
        base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
        base.update(overrides)
        config = Qwen2Config(**base)
        config._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
        model.config._name_or_path = f"tiny-qwen2-{seed}"
        return model

    source = make(0)
    target = make(1, hidden_size=96, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                  intermediate_size=160)
    generator = torch.Generator().manual_seed(0)
    ids = lambda count, length: [torch.randint(0, 128, (length,), generator=generator) for _ in range(count)]  # noqa: E731
    return source, target, ids(16, 64), ids(6, 64), None


def adapter_pair(args):
    """SmolLM2 base -> base + LoRA adapter ``args.pair``: calibrated like the published adapter maps
    (scripts/calibrate_adapter_maps.py: same-layer statistics, stdlib files + chat prompts)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from calibrate_adapter_maps import MODEL, calibration_ids, load_peft_smollm2

    from peft_kvcache.corpus import evaluation_texts
    from peft_kvcache.evaluate import token_sequences
    from peft_kvcache.fixtures import load_model
    from peft_kvcache.peft_maps import calibrate_adapters

    target, tokenizer, _ = load_peft_smollm2(adapters=(args.pair,))
    source, _ = load_model(MODEL)
    calibration = calibration_ids(tokenizer, files=args.calibration_files)
    evaluation = token_sequences(evaluation_texts(83), tokenizer, args.context + args.continuation)[: args.eval_files]

    def calibrate(data):
        maps = calibrate_adapters(target, data, adapters=[args.pair], reverse=False, max_length=args.max_length)
        target.set_adapter(args.pair)
        return maps.to_adapter[args.pair]

    return source, target, calibration, evaluation, calibrate


def real_pair(args):
    from peft_kvcache.calibrate import calibration_sequences
    from peft_kvcache.corpus import calibration_texts, evaluation_texts
    from peft_kvcache.evaluate import token_sequences
    from peft_kvcache.fixtures import load_model

    source, tokenizer = load_model(LARGE if args.pair == "qwen-down" else SMALL)
    target, _ = load_model(SMALL if args.pair == "qwen-down" else LARGE)
    calibration = calibration_sequences(calibration_texts(args.calibration_files), tokenizer,
                                        args.max_length)[: args.calibration_files]
    evaluation = token_sequences(evaluation_texts(args.eval_files * 3), tokenizer,
                                 args.context + args.continuation)[: args.eval_files]
    return source, target, calibration, evaluation, None


def noisy(kv_map: KVMap, relative: float, seed: int = 0) -> KVMap:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in kv_map.tensors.items():
        if name.endswith(".weight"):
            tensor = tensor + relative * tensor.std() * torch.randn(tensor.shape, generator=generator)
        tensors[name] = tensor
    return KVMap(copy.deepcopy(kv_map.config), tensors)


def pearson(a: list[float], b: list[float]) -> float:
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x.norm() * y.norm()).clamp_min(1e-30))


def pooled_correlation() -> str:
    """Predicted vs measured retention over every real pair and variant in benchmarks/results/nonlinear*.json."""
    rows, pairs = [], []
    for path in sorted(RESULTS.glob("nonlinear*.json")):
        if "tiny" not in path.stem:
            summary = json.loads(path.read_text())
            rows += summary["rows"]
            pairs.append(summary["pair"])
    if len(rows) < 3:
        return ""

    def correlations(subset):
        predicted = [r["predicted_retention"] for r in subset]
        return (pearson(predicted, [r["normalized_retention"] for r in subset]),
                pearson(predicted, [-r["kl"] for r in subset]))

    usable = [r for r in rows if "noise" not in r["variant"]]
    (r_all, k_all), (r_usable, k_usable) = correlations(rows), correlations(usable)
    return (f"Pooled over {len(pairs)} pairs ({'; '.join(pairs)}), {len(rows)} variants: Pearson r(predicted, "
            f"measured normalized retention) = {r_all:+.2f}, r(predicted, -KL) = {k_all:+.2f}; without the "
            f"noise-corrupted maps ({len(usable)} variants): {r_usable:+.2f} and {k_usable:+.2f} (anchor: +0.57)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random models (plumbing check)")
    parser.add_argument("--pair", default="qwen-up", help="qwen-up (0.5B -> 1.5B fixtures), qwen-down (1.5B -> 0.5B) "
                        "or the name of a committed SmolLM2 adapter (base -> adapter)")
    parser.add_argument("--calibration-files", type=int, default=32)
    parser.add_argument("--weak-files", type=int, default=4, help="calibration files of the hard variant")
    parser.add_argument("--eval-files", type=int, default=10)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--query-tokens", type=int, default=16, help="query tokens of the quality gate")
    parser.add_argument("--r2-threshold", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--max-rows", type=int, default=4096)
    parser.add_argument("--linear-from", default=None, help="a published map folder (e.g. hub_cards/qwen2.5-"
                        "coder-0.5b-to-1.5b-top2) used as the linear variant instead of calibrating it again")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="which variants to score (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1 if args.tiny else torch.get_num_threads())
    if args.tiny:
        args.context, args.continuation, args.weak_files = 48, 16, 4
        args.hidden, args.steps, args.max_rows, args.r2_threshold = 32, 100, 1024, 1.1
        source, target, calibration, evaluation, calibrate = tiny_pair()
    elif args.pair in ("qwen-up", "qwen-down"):
        source, target, calibration, evaluation, calibrate = real_pair(args)
    else:
        source, target, calibration, evaluation, calibrate = adapter_pair(args)
    if calibrate is None:
        def calibrate(data):
            return KVMap.calibrate(source, target, data, max_length=args.max_length, progress=not args.tiny)

    mlp = dict(r2_threshold=args.r2_threshold, hidden=args.hidden, steps=args.steps, max_rows=args.max_rows,
               progress=not args.tiny)
    started = time.perf_counter()
    linear = KVMap.from_pretrained(args.linear_from) if args.linear_from else calibrate(calibration)
    weak_data = calibration[: max(args.weak_files, 3)]
    weak = calibrate(weak_data) if {"weak", "weak-nonlinear"} & set(args.variants) else None
    builders = {
        "linear": ("linear", lambda: linear),
        "nonlinear": ("nonlinear", lambda: fit_nonlinear_heads(linear, source, target, calibration, **mlp)),
        "weak": (f"linear, {len(weak_data)} calibration files", lambda: weak),
        "weak-nonlinear": (f"nonlinear, {len(weak_data)} calibration files",
                           lambda: fit_nonlinear_heads(weak, source, target, weak_data, **mlp)),
        "noise-0.5": ("linear + noise 0.5", lambda: noisy(linear, 0.5)),
        "noise-2": ("linear + noise 2", lambda: noisy(linear, 2.0)),
    }
    variants = {builders[v][0]: builders[v][1]() for v in args.variants}
    rows, mapped_scores = [], {}
    for name, kv_map in variants.items():
        quality = measure_quality(kv_map, source, target, evaluation, query_tokens=args.query_tokens,
                                  progress=not args.tiny)
        report = evaluate_retention(source, target, kv_map, evaluation, args.context, args.continuation,
                                    windows=(1,), window_control=False, naive_reuse=False, progress=not args.tiny)
        mapped = next(r for r in report.rows() if r["variant"] == "mapped@1")
        mapped_scores[name] = report.scores["mapped@1"]
        anchors = {k: report.scores[k] for k in ("full", "no_context")}
        info = kv_map.config.nonlinear or {}
        rows.append({
            "variant": name, "mlp_layers_keys": len(info.get("keys", [])), "mlp_layers_values": len(info.get("values", [])),
            "predicted_retention": quality["predicted_retention"], "attention_cosine_mean": quality["attention_cosine_mean"],
            "normalized_retention": mapped["normalized_retention"], "normalized_low": mapped["normalized_low"],
            "normalized_high": mapped["normalized_high"], "kl": mapped["kl"], "accuracy": mapped["accuracy"],
        })
        print(f"{name}: predicted {quality['predicted_retention']:.3f}, measured {mapped['normalized_retention']:.3f}, "
              f"KL {mapped['kl']:.4f}", flush=True)
    predicted = [r["predicted_retention"] for r in rows]
    r_retention = pearson(predicted, [r["normalized_retention"] for r in rows]) if len(rows) > 2 else None
    r_kl = pearson(predicted, [-r["kl"] for r in rows]) if len(rows) > 2 else None
    paired = {}
    if {"linear", "nonlinear"} <= set(mapped_scores):  # same examples: nonlinear - linear, paired
        both = RetentionReport({**anchors, **mapped_scores}, args.context, args.continuation)
        paired = {metric: both.paired_difference("nonlinear", "linear", metric=metric)
                  for metric in ("normalized", "kl")}
    pair = ("tiny random" if args.tiny else f"{SMALL} -> {LARGE}" if args.pair == "qwen-up" else
            f"{LARGE} -> {SMALL}" if args.pair == "qwen-down" else f"SmolLM2-135M-Instruct base -> adapter {args.pair}")
    summary = {"pair": pair, "rows": rows,
               "pearson_predicted_vs_normalized_retention": r_retention, "pearson_predicted_vs_minus_kl": r_kl,
               "nonlinear_minus_linear": paired,
               "seconds": round(time.perf_counter() - started, 1), "options": vars(args)}
    lines = [f"# Linear vs nonlinear maps, {summary['pair']}", "",
             f"context {args.context}, continuation {args.continuation}, {len(evaluation)} held-out examples", "",
             "| variant | MLP layers (K/V) | predicted retention | measured normalized [95% CI] | KL |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['mlp_layers_keys']}/{r['mlp_layers_values']} | {r['predicted_retention']:.3f} | "
              f"{r['normalized_retention']:.3f} [{r['normalized_low']:.2f}, {r['normalized_high']:.2f}] | {r['kl']:.4f} |"
              for r in rows]
    if r_retention is not None:
        lines += ["", f"Pearson r(predicted, measured normalized retention) = {r_retention:+.2f}; "
                      f"r(predicted, -KL) = {r_kl:+.2f} (anchor: +0.57)"]
    if paired:
        n, k = paired["normalized"], paired["kl"]
        lines += ["", f"nonlinear - linear (paired, same examples): normalized {n['difference']:+.3f} "
                      f"[{n['low']:+.3f}, {n['high']:+.3f}], KL {k['difference']:+.4f} [{k['low']:+.4f}, {k['high']:+.4f}]"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "nonlinear_tiny" if args.tiny else "nonlinear" if args.pair == "qwen-up" else f"nonlinear-{args.pair}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not args.tiny:
        lines += ["", pooled_correlation()]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
