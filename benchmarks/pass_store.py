"""The models' full passes over the recipes benchmark's examples, kept on disk between runs.

Every run of `benchmarks.recipes` that has something to compute for an example first runs both siblings over its whole
text (the target's prefill is the reference, the source's cache is what the maps read): most of an example's time on
a CPU. A lever or a recipe added later needs the same passes again, so they are kept: one safetensors file per pass
holding the continuation's logits over the vocabulary and the cache, read back bit for bit, and read only for the same
checkpoint name and config, sampled weights, dtype, device, torch and transformers versions, text and continuation
(the file name is their digest, `PassStore.key`). A file that cannot be read is computed again and replaced. The
store stops keeping passes at its size limit, or where keeping one would leave its disk less than ``min_free_bytes``
(the lever fits after it write captures to the same disk; the first passes kept stay: a later run goes through the
examples in the same order, so it reads a prefix of them instead of evicting each before it is read again).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from peft_kvcache._files import atomic_write
from peft_kvcache.modeling._compat import output_cache
from peft_kvcache.modeling.capture import CapturedKV, cache_states, forward
from peft_kvcache.modeling.identity import cached_fingerprint
from peft_kvcache.modeling.layout import model_device

logger = logging.getLogger(__name__)


@torch.no_grad()  # a caller with autograd on would otherwise keep the whole pass's activations alive with its logits
def full_pass(model, ids: torch.Tensor, continuation: int) -> tuple[torch.Tensor, CapturedKV]:
    """One pass of ``model`` over ``ids[:-1]``: its continuation logits ``[M, vocab]`` and its own KV."""
    out = forward(model, ids[None, :-1], None, logits_to_keep=continuation)
    return out.logits[0].float().cpu(), cache_states(output_cache(out))


class PassStore:
    """`full_pass`, read from ``folder`` where an earlier run computed it (``folder=None``: always computed); a new
    pass is kept while the folder, with it, holds at most ``limit_bytes`` and its disk keeps ``min_free_bytes``."""

    def __init__(self, folder: Path | None, limit_bytes: int = 30 * 2**30, min_free_bytes: int = 2**30):
        self.folder, self.limit_bytes, self.min_free_bytes, self._full = folder, limit_bytes, min_free_bytes, False

    def key(self, model, ids: torch.Tensor, continuation: int) -> str:
        """The digest a pass is filed under: the model (its checkpoint's name, config, sampled weights
        `cached_fingerprint`, dtype and device), the torch and transformers versions that ran it, the token ids and
        the continuation's length."""
        digest = hashlib.sha256()
        for part in (model.config.name_or_path, model.config.to_json_string(), cached_fingerprint(model),
                     str(next(model.parameters()).dtype), model_device(model).type, torch.__version__,
                     transformers.__version__,
                     str(continuation), str(ids.numel())):
            digest.update(part.encode() + b"\0")
        digest.update(ids.to(torch.int64).cpu().numpy().tobytes())
        return digest.hexdigest()[:32]

    def full_pass(self, model, ids: torch.Tensor, continuation: int) -> tuple[torch.Tensor, CapturedKV]:
        if self.folder is None:
            return full_pass(model, ids, continuation)
        path = self.folder / f"{self.key(model, ids, continuation)}.safetensors"
        if path.is_file():
            try:
                logits, kv = _unpack(load_file(path, device=str(model_device(model))))
                if logits.shape[0] == continuation and kv.length == ids.numel() - 1:
                    return logits.cpu(), kv  # the logits where `full_pass` leaves them, the cache on the model's device
                logger.warning("recomputing the pass in %s, which holds another pass's shapes", path)
            except (SafetensorError, OSError, KeyError) as error:  # a torn or foreign file: computed again
                logger.warning("recomputing the pass in %s, which cannot be read (%s)", path, error)
        tensors = _pack(*full_pass(model, ids, continuation))
        logits, kv = _unpack(tensors)  # contiguous, as a kept pass reads back: every run multiplies the same layout
        self.folder.mkdir(parents=True, exist_ok=True)
        held = sum(f.stat().st_size for f in self.folder.glob("*.safetensors"))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        free = shutil.disk_usage(self.folder).free
        if held + size > self.limit_bytes or free - size < self.min_free_bytes:
            if not self._full:
                logger.warning("%s holds %.1f GiB (limit %.1f), its disk %.1f GiB free (kept free: %.1f): further "
                               "passes are computed, not kept", self.folder, held / 2**30, self.limit_bytes / 2**30,
                               free / 2**30, self.min_free_bytes / 2**30)
            self._full = True
            return logits, kv
        atomic_write(path, lambda tmp: save_file(tensors, tmp))
        return logits, kv


def _pack(logits: torch.Tensor, kv: CapturedKV) -> dict[str, torch.Tensor]:
    tensors = {"logits": logits}
    for i, (keys, values) in enumerate(kv.pairs()):
        tensors[f"keys.{i}"], tensors[f"values.{i}"] = keys.contiguous(), values.contiguous()
    return tensors


def _unpack(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, CapturedKV]:
    layers = sum(name.startswith("keys.") for name in tensors)
    if layers == 0:
        raise KeyError("no layers")
    return tensors["logits"], CapturedKV([tensors[f"keys.{i}"] for i in range(layers)],
                                         [tensors[f"values.{i}"] for i in range(layers)])
