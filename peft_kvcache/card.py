"""Model cards for map artifacts, rendered with huggingface_hub's ModelCard from the template in
``peft_kvcache/templates/`` (also linked from ``hub_cards/``), plus the layer-selection chart."""

from __future__ import annotations

import logging
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

logger = logging.getLogger(__name__)

TEMPLATE_PATH = Path(__file__).parent / "templates" / "modelcard_template.md"
CHART_NAME = "layer_r2.png"


def _mean(rows: list[list[float]]) -> float:
    values = [v for row in rows for v in row]
    return sum(values) / len(values) if values else float("nan")


def plot_layer_selection(kv_map, path: str | Path) -> Path | None:
    """Per target layer: held-out R^2 of keys and values and the source layer chosen. Returns the PNG path,
    or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: the card has no layer chart")
        return None
    c = kv_map.config
    layers = list(range(c.target_layout.num_layers))
    fig, (ax_r2, ax_src) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, rows in (("keys", c.key_r2), ("values", c.value_r2)):
        ax_r2.plot(layers, [sum(r) / len(r) for r in rows], marker="o", ms=3, label=label)
    ax_r2.set(xlabel="target layer", ylabel="held-out R²", title="fit quality per target layer", ylim=(None, 1.0))
    ax_r2.legend()
    for label, groups, marker in (("keys", c.key_layers, "o"), ("values", c.value_layers, "x")):
        xs = [t for t, group in enumerate(groups) for _ in group]
        ys = [s for group in groups for s in group]
        ax_src.scatter(xs, ys, marker=marker, label=label)
    ax_src.set(xlabel="target layer", ylabel="source layer", title="source layer(s) chosen")
    ax_src.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _quality_text(quality: dict) -> str:
    if not quality:
        return "No retention or speed figures were recorded for this map yet (see `benchmarks/`)."
    lines = ["| metric | value |", "|---|---|"]
    for key, value in quality.items():
        lines.append(f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |")
    return "\n".join(lines)


def card_data(kv_map) -> ModelCardData:
    """The YAML metadata of a map's card."""
    c = kv_map.config
    figures = {"heldout_key_r2": round(_mean(c.key_r2), 4), "heldout_value_r2": round(_mean(c.value_r2), 4)}
    figures.update({k: v for k, v in c.quality.items() if isinstance(v, (int, float))})
    return ModelCardData(
        library_name="peft-kvcache",
        base_model=[c.source_name, c.target_name],
        tags=["peft-kvcache", "kv-cache", "kv-cache-mapping", c.pair_kind.replace("_", "-")],
        license=c.calibration.get("license"),
        metrics=sorted(figures),
        **figures,  # extra keys are kept in the YAML header
    )


def render_card(kv_map, folder: str | Path, repo_hint: str | None = None) -> str:
    """Render ``README.md`` for a map whose files are being written into ``folder`` (the chart goes there)."""
    c = kv_map.config
    chart_path = plot_layer_selection(kv_map, Path(folder) / CHART_NAME)
    calibration = c.calibration
    calibration_text = (
        f"{calibration.get('description') or 'Calibration data was not described.'}\n\n"
        f"{calibration.get('train_tokens', '?')} train tokens and {calibration.get('heldout_tokens', '?')} "
        f"held-out tokens ({calibration.get('sequences', '?')} sequences of at most "
        f"{calibration.get('max_length', '?')} tokens); top-{calibration.get('top_k', 1)} source layers per "
        f"target layer; ridge strength chosen per head on the held-out split."
    )
    card = ModelCard.from_template(
        card_data(kv_map),
        template_path=str(TEMPLATE_PATH),
        source_name=c.source_name,
        target_name=c.target_name,
        pair_description="same-shape pair, e.g. a base model and its adapter" if c.pair_kind == "same_shape"
        else "differently shaped siblings sharing a tokenizer",
        sink_tokens=c.sink_tokens,
        source_fingerprint=c.source_fingerprint[:16],
        target_fingerprint=c.target_fingerprint[:16],
        source_layout=f"{c.source_layout.num_layers} × {c.source_layout.kv_heads} × {c.source_layout.head_dim}",
        target_layout=f"{c.target_layout.num_layers} × {c.target_layout.kv_heads} × {c.target_layout.head_dim}",
        source_rotary=_rope_text(c.source_rotary),
        target_rotary=_rope_text(c.target_rotary),
        pair_kind=c.pair_kind,
        num_parameters=f"{kv_map.num_parameters:,}",
        size_mb=f"{kv_map.num_parameters * 4 / 2**20:.1f}",
        calibration_text=calibration_text,
        key_r2=f"{_mean(c.key_r2):.3f}",
        value_r2=f"{_mean(c.value_r2):.3f}",
        chart=f"![held-out R² and chosen source layer per target layer]({CHART_NAME})" if chart_path else "",
        quality_text=_quality_text(c.quality),
        repo_hint=repo_hint or "path/to/this/map",
    )
    return str(card)


def _rope_text(rotary: dict) -> str:
    return f"{rotary.get('rope_type', 'default')}, rotary dim {rotary.get('rotary_dim')}"
