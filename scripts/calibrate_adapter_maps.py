"""Fit and publish the base <-> adapter maps of the committed SmolLM2-135M-Instruct adapters.

One calibration pass (`peft_kvcache.peft_maps.calibrate_adapters`) over the first ``--tokens`` tokens of
``--files`` calibration-split stdlib files plus a few chat-formatted calibration-split prompts (the
sessions hold chats); each map's blend toward its source cache chosen on ``--blend-files`` further
calibration-split files (`peft_kvcache.peft_maps.choose_adapter_blends`); then
``hub_cards/smollm2-135m-instruct-base-to-<adapter>/`` and ``...-<adapter>-to-base/`` with their model cards.

    PYTHONPATH=. python scripts/calibrate_adapter_maps.py            # ~20 min on 2 threads

`load_peft_smollm2` and `ensure_maps` are also what examples/adapter_chat.py and benchmarks/adapters.py use.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = "gguf:smollm2-135m-instruct"
PREFIX = "smollm2-135m-instruct"
ADAPTERS = ("docstring", "shout")
CALIBRATION_FILES = 128  # stdlib files the published maps are fitted on (4x the first maps' 32; shout KL 0.0176 -> 0.0161)
HUB_CARDS = ROOT / "hub_cards"

logger = logging.getLogger("calibrate_adapter_maps")


def load_peft_smollm2(adapters=ADAPTERS, extra: tuple[str, ...] = ()):
    """SmolLM2-135M-Instruct with the committed adapters under ``adapters/`` loaded by name:
    ``(peft_model, tokenizer, names)``."""
    from peft import PeftModel

    from peft_kvcache.fixtures import load_model

    base, tokenizer = load_model(MODEL)
    names = [a for a in (*adapters, *extra) if (ROOT / "adapters" / a / "adapter_config.json").is_file()]
    if not names:
        raise SystemExit(f"no adapters under {ROOT / 'adapters'}: run scripts/train_adapters.py")
    model = PeftModel.from_pretrained(base, str(ROOT / "adapters" / names[0]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(ROOT / "adapters" / name), adapter_name=name)
    return model.eval(), tokenizer, names


def calibration_ids(tokenizer, files: int = CALIBRATION_FILES, tokens: int = 512, chats: int = 8) -> list[torch.Tensor]:
    """The first ``tokens`` tokens of ``files`` calibration-split stdlib files, and ``chats`` chat-formatted
    calibration-split docstring prompts with their answers."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_adapters import encode, functions_with_docstrings

    from peft_kvcache.corpus import calibration_texts

    sequences = [tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0, :tokens]
                 for text in calibration_texts(files)]
    pairs = functions_with_docstrings("calibration", 400)[-chats:] if chats else []
    sequences += [encode(tokenizer, code, doc)[0] for code, doc in pairs]
    return sequences


def blend_ids(tokenizer, skip: int = CALIBRATION_FILES, files: int = 12, tokens: int = 512 + 64) -> list[torch.Tensor]:
    """Held-out text for choosing the blends: ``files`` calibration-split files after the first ``skip`` (the
    ones the maps were fitted on), their first ``tokens`` tokens."""
    from peft_kvcache.corpus import calibration_texts

    texts = calibration_texts(skip + files)[skip:]
    return [tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0, :tokens] for text in texts]


def fit_maps(model, tokenizer, adapters, files: int = CALIBRATION_FILES, tokens: int = 512, chats: int = 8,
             blend_files: int = 12, **options):
    """Calibrate the maps (``files`` stdlib files + ``chats`` chat prompts), then choose each map's blend
    toward its source cache on ``blend_files`` further calibration-split files (0: no blend)."""
    from peft_kvcache.peft_maps import calibrate_adapters, choose_adapter_blends

    maps = calibrate_adapters(model, calibration_ids(tokenizer, files, tokens, chats), adapters=list(adapters),
                              max_length=max(tokens, 512), **options)
    if blend_files:
        maps = choose_adapter_blends(maps, model, blend_ids(tokenizer, files, blend_files))
    return maps


def ensure_maps(model, tokenizer, adapters, root: Path = HUB_CARDS, save: bool = True, **options):
    """The published maps for ``adapters`` when they match the models, else freshly calibrated ones
    (saved under ``root`` when ``save``)."""
    from peft_kvcache.errors import PeftKVCacheError
    from peft_kvcache.peft_maps import AdapterMaps, adapter_active

    try:
        maps = AdapterMaps.from_pretrained(root, PREFIX, adapters)
        for adapter in adapters:
            with adapter_active(model, adapter):
                maps.to_adapter[adapter].check_models(None, model)
        return maps
    except (PeftKVCacheError, OSError) as err:
        logger.warning("calibrating the adapter maps (%s)", str(err).splitlines()[0][:160])
    options.setdefault("description", "SmolLM2 adapter maps: stdlib calibration split + chat-formatted prompts")
    maps = fit_maps(model, tokenizer, adapters, **options)
    if save:
        maps.save_pretrained(root, PREFIX)
    return maps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=CALIBRATION_FILES)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--blend-files", type=int, default=12, help="held-out files choosing the blends (0: none)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(HUB_CARDS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO)
    from peft_kvcache.corpus import corpus_description

    model, tokenizer, names = load_peft_smollm2()
    maps = fit_maps(
        model, tokenizer, names, args.files, args.tokens, args.chats, args.blend_files,
        description=f"{corpus_description('calibration', args.files)}; first {args.tokens} tokens of each; plus "
                    f"{args.chats} chat-formatted docstring prompts from calibration-split functions")
    for folder in maps.save_pretrained(args.out, PREFIX):
        print("wrote", folder)
    for name, kv_map in [*maps.to_adapter.items(), *maps.to_base.items()]:
        r2k = sum(sum(r) for r in kv_map.config.key_r2) / sum(len(r) for r in kv_map.config.key_r2)
        r2v = sum(sum(r) for r in kv_map.config.value_r2) / sum(len(r) for r in kv_map.config.value_r2)
        blend = kv_map.config.blend
        print(f"{kv_map.config.source_name} -> {kv_map.config.target_name}: held-out R^2 keys {r2k:.4f} values "
              f"{r2v:.4f}; blend keys {blend.get('keys')} values {blend.get('values')}")


if __name__ == "__main__":
    main()
