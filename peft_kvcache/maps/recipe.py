"""`Refresh`: what the target computes itself beside a mapped context, and the named recipes (``hybrid@B``,
``refresh@B/pP``, ``index@B/pP``) a map's ``config.json`` records and ``MappedCache.from_source`` applies."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RecordError
from .records import check_fields, to_json


@dataclass(frozen=True)
class Refresh:
    """What the target computes itself beside the mapped context (`peft_kvcache.runtime.refresh`): the last
    ``probe_tokens`` context tokens run on the mapped cache, the ``tokens`` context positions the last of them attends
    to most (in spans of ``span``) are recomputed, with the ``recent_tokens`` context tokens before the probe and the
    probe itself, in one pass. ``mapped_middle=False`` drops the rest of the mapped context: the target keeps only
    the sink and what it computed (the map chose the positions). With ``tokens=0`` nothing is picked and no probe
    pass runs: the last ``probe_tokens + recent_tokens`` tokens are computed over the mapped prefix. Target compute:
    ``2 * probe_tokens + tokens + recent_tokens`` tokens (``probe_tokens + recent_tokens`` with ``tokens=0``).

    The named recipes at a budget of ``B`` context tokens (`named`): ``hybrid@B`` (the mapped prefix, the last B
    computed), ``refresh@B/pP`` (P picked positions, the mapped middle kept, the last ``B - 16 - P`` tokens computed,
    the probe included), ``index@B/pP`` (the same without the mapped middle).

    Example:
        >>> Refresh(tokens=64).probe_tokens
        16
        >>> Refresh.named("index@160/p20") == Refresh(20, recent_tokens=108, mapped_middle=False)
        True
    """

    tokens: int = 32
    probe_tokens: int = 16
    span: int = 8
    recent_tokens: int = 0
    mapped_middle: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self, where: str = "Refresh") -> None:
        """Refuse (`RecordError`) fields of the wrong type, a negative budget or window, a probe or span under 1, or a
        dropped middle with nothing picked; run when it is built, so a `Refresh` in hand is always valid."""
        check_fields(self, where)
        if self.tokens < 0 or self.recent_tokens < 0 or self.probe_tokens < 1 or self.span < 1:
            raise RecordError(f"{where}: tokens and recent_tokens must be >= 0, probe_tokens and span >= 1, got "
                              f"{to_json(self)}")
        if not self.mapped_middle and self.tokens == 0:
            raise RecordError(f"{where}: mapped_middle=False needs tokens > 0 (the positions the map picks); a window "
                              "alone needs no map")

    @property
    def active(self) -> bool:
        """Whether the target computes anything beside the mapped context (``Refresh(0)`` is no refresh)."""
        return self.tokens > 0 or self.recent_tokens > 0

    @property
    def compute(self) -> int:
        """Context tokens the target runs (the probe's pass counted once)."""
        return self.probe_tokens + self.recent_tokens + (self.probe_tokens + self.tokens if self.tokens else 0)

    @property
    def name(self) -> str:
        """The recipe's name at its budget (``hybrid@B``, ``refresh@B/pP``, ``index@B/pP``); see `named`."""
        if not self.tokens:
            return f"hybrid@{self.compute}"
        return f"{'refresh' if self.mapped_middle else 'index'}@{self.compute}/p{self.tokens}"

    @classmethod
    def named(cls, name: str, probe_tokens: int = 16, span: int = 8) -> "Refresh":
        """The recipe ``name`` (``hybrid@B``, ``refresh@B/pP`` or ``index@B/pP``, B context tokens of target compute,
        P picked positions), with a ``probe_tokens`` probe; a bad name raises `RecordError` naming the forms."""
        kind, _, rest = name.partition("@")
        budget, _, picked = rest.partition("/p")
        forms = "hybrid@B, refresh@B/pP or index@B/pP (B and P whole numbers)"
        if kind not in ("hybrid", "refresh", "index") or not budget.isdigit() or (kind == "hybrid") != (picked == "") \
                or (picked and not picked.isdigit()):
            raise RecordError(f"recipe {name!r} is not one of {forms}")
        budget_tokens, picked_tokens = int(budget), int(picked or 0)
        if kind == "hybrid":
            if budget_tokens <= probe_tokens:
                raise RecordError(f"recipe {name!r}: B must exceed the {probe_tokens}-token probe")
            return cls(0, probe_tokens, span, budget_tokens - probe_tokens)
        recent = budget_tokens - 2 * probe_tokens - picked_tokens
        if picked_tokens < 1 or recent < 0:
            raise RecordError(f"recipe {name!r}: P must be in 1..B - {2 * probe_tokens} (the probe runs twice)")
        return cls(picked_tokens, probe_tokens, span, recent, kind == "refresh")
