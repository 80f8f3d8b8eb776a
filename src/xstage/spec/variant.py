"""A variant of the fused MoE kernel: a schedule plus a store pacing, spelled `SCHEDULE[@PACING]`.

One type, one parser, one formatter for the API, the CLI (`--schedules`, `--candidates`) and the
`variant` column of result rows. `lag:4@off` is `lag:4` unpaced; `lag:4@50:128` paces at 50 GB/s
with 128 KiB ahead; `lag:4@auto` lets the planner choose per call; `lag:4` alone runs with the
buffer's pacing, and result rows without a suffix are read as `default` (the fixed default of the
path; `--default-pacing` when results are read back).

Example:
    >>> from xstage.moe.variant import Variant
    >>> v = Variant.parse("lag:4@50:128")
    >>> v.schedule, v.pacing, str(v)
    ('lag:4', '50:128', 'lag:4@50:128')
"""

from __future__ import annotations

from dataclasses import dataclass

from xstage.errors import InputError
from xstage.spec.pacing import check_pacing
from xstage.spec.schedule import check_schedule


@dataclass(frozen=True)
class Variant:
    """`schedule` (a registered name, `lag:k` included) and `pacing` (a pacing spec; None: the default)."""

    schedule: str
    pacing: str | None = None

    def __post_init__(self):
        check_schedule(self.schedule)
        if self.pacing is not None:
            check_pacing(self.pacing)  # refuses a malformed spec here, before anything runs

    @classmethod
    def parse(cls, text: str) -> Variant:
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"variant {text!r}: expected SCHEDULE[@PACING], e.g. 'lag:4@off'")
        schedule, sep, pacing = text.strip().partition("@")
        if sep and not pacing:
            raise InputError(f"variant {text!r}: a pacing must follow '@' (off, default, auto or RATE_GBPS:BUDGET_KIB)")
        return cls(schedule, pacing or None)

    def __str__(self) -> str:
        return self.schedule if self.pacing is None else f"{self.schedule}@{self.pacing}"

    def pacing_or(self, default: str) -> str:
        """This variant's pacing spec, or `default` when it has none."""
        return self.pacing if self.pacing is not None else default


def parse_variants(text: str, arg: str = "--schedules") -> list[Variant]:
    """Comma-separated variants (`"expert_wave,lag:4@off"`); refuses an empty list or a bad entry."""
    if not isinstance(text, str):
        raise InputError(f"{arg} {text!r}: expected a string of comma-separated SCHEDULE[@PACING]")
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise InputError(f"{arg}: give at least one SCHEDULE[@PACING]")
    try:
        return [Variant.parse(t) for t in items]
    except InputError as exc:
        raise InputError(f"{arg}: {exc}") from None
