"""Store pacing as data: one type (`StorePacing`), one spelling and one parser, no kernel.

A pacing keeps a kernel's remote-store backlog below the store path's shared X-Stage level: stores
claim `n / rate` of a virtual clock and wait while their claim ends more than `budget / rate` ahead
of now (a token bucket of `budget` bytes refilled at `rate`). The device side is
`xstage.comm.pacing.pace_stores`; the planner plays the same bucket in its simulator.

Spellings (API `pacing=`, the `@PACING` suffix of a variant, CLI flags, CSV `variant` column):
`"off"` (or None), `"default"` (the fixed default of the store path, a measured factor of its drain
and a budget: `xstage.sched.pacing.default_pacing`; which paths get it is `PACED_PATHS`), `"auto"`
(the planner's choice per call), or `"RATE_GBPS:BUDGET_KIB"` such as `"50:128"`. `parse_pacing` reads
every spelling but `"auto"`; resolving `"default"` needs the path's profile, which
`xstage.sched.pacing.resolve_pacing` reads.

Example:
    >>> from xstage.spec.pacing import StorePacing, parse_pacing, spec_of
    >>> p = StorePacing(rate=50e9, budget=1 << 20)
    >>> p.kernel_args()  # (femtoseconds per byte, budget in ns)
    (20000, 20972)
    >>> spec_of(parse_pacing("50:128"))
    '50:128'
"""

from __future__ import annotations

from dataclasses import dataclass

from xstage.bounds import check_real
from xstage.errors import InputError

FS_PER_S = 10**15
MIN_RATE = 1e9  # B/s: slower pacing would turn a 64 KiB tile into a wait of more than 64 us
# B/s: twice the device memory bandwidth of the fastest GPU (8 TB/s on a B200); a faster pace never
# waits, and the kernel's integer pace (fs per byte) keeps 1% resolution up to it.
MAX_RATE = 1e13
# Bytes ahead of the pace: 1 GiB, hundreds of times any store path's shared level (~3 MB on the H200
# host link); a larger budget never waits either.
MAX_BUDGET = 1 << 30
GB, KIB = 1e9, 1024


RATE_MEANING = "pace of the remote stores"
BUDGET_MEANING = "bytes the stores may run ahead of the pace"


@dataclass(frozen=True)
class StorePacing:
    """Pace remote stores at `rate` bytes/s with at most `budget` bytes ahead of that pace."""

    rate: float
    budget: float

    def __post_init__(self):
        object.__setattr__(self, "rate", check_real(self.rate, "StorePacing.rate", MIN_RATE, MAX_RATE,
                                                    RATE_MEANING, "B/s"))
        object.__setattr__(self, "budget", check_real(self.budget, "StorePacing.budget", 0, MAX_BUDGET,
                                                      BUDGET_MEANING, "B"))

    def kernel_args(self) -> tuple[int, int]:
        """(femtoseconds per byte, budget in ns): the integers `pace_stores` takes."""
        return round(FS_PER_S / self.rate), round(self.budget / self.rate * 1e9)


NO_PACING = (0, 0)
PACING_SPEC_HELP = "'off', 'default', 'auto' or RATE_GBPS:BUDGET_KIB such as '50:128'"


def parse_pacing(spec: str, default: StorePacing | None = None) -> StorePacing | None:
    """`"off"` -> None, `"default"` -> `default` (what the caller resolved for its path), `"RATE:BUDGET"`
    -> StorePacing of RATE GB/s and BUDGET KiB (e.g. `"50:128"`): the suffix of a variant such as
    `interleaved@off`. `"auto"` is the planner's choice per call, which only the kernel's caller can
    make (`xstage.sched.policy.choose_pacing`), so it is refused here."""
    if not isinstance(spec, str):
        raise InputError(f"pacing {spec!r}: expected {PACING_SPEC_HELP}")
    if spec == "off":
        return None
    if spec == "default":
        return default
    if spec == "auto":
        raise InputError("pacing 'auto': chosen per call by the planner (xstage.sched.policy.choose_pacing); "
                         "here give 'off', 'default' or RATE_GBPS:BUDGET_KIB")
    rate, sep, budget = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        rate, budget = float(rate), float(budget)
    except ValueError:
        raise InputError(f"pacing {spec!r}: expected {PACING_SPEC_HELP}") from None
    try:
        rate = check_real(rate, "RATE_GBPS", MIN_RATE / GB, MAX_RATE / GB, RATE_MEANING, "GB/s")
        budget = check_real(budget, "BUDGET_KIB", 0, MAX_BUDGET // KIB, BUDGET_MEANING, "KiB")
    except InputError as exc:
        raise InputError(f"pacing {spec!r}: {exc}") from None
    return StorePacing(rate=rate * GB, budget=budget * KIB)


def spec_of(pacing: StorePacing | None) -> str:
    """The `parse_pacing` spec of `pacing` (the rate to 6 digits; budgets, whole KiB as a rule, in full so
    that the largest still reads back)."""
    return "off" if pacing is None else f"{pacing.rate / GB:g}:{pacing.budget / KIB:.10g}"


def pacing_args(pacing: StorePacing | None) -> tuple[int, int]:
    """Kernel arguments for `pacing`; (0, 0) switches pacing off."""
    return NO_PACING if pacing is None else pacing.kernel_args()


# Where `"default"` paces: the paths where pacing was measured to pay (the host link). `hbm` has no
# shared level to fill, and `peer` (NVLink) was not measured yet.
PACED_PATHS = ("host",)
AUTO, DEFAULT = "auto", "default"
PACING_CANDIDATES = (DEFAULT, "off")  # what "auto" chooses from


def check_pacing(pacing) -> None:
    """Refuse a malformed pacing before anything runs: a StorePacing, None, or a string spelling
    (`"auto"` and `"default"` included, which the planner resolves later)."""
    if pacing is None or isinstance(pacing, StorePacing):
        return
    if not isinstance(pacing, str):
        raise InputError(f"pacing={pacing!r}: must be 'auto', 'default', 'off', 'RATE_GBPS:BUDGET_KIB', "
                         "a StorePacing or None")
    if pacing not in (AUTO, DEFAULT):
        parse_pacing(pacing)


__all__ = ["AUTO", "BUDGET_MEANING", "DEFAULT", "FS_PER_S", "GB", "KIB",
           "MAX_BUDGET", "MAX_RATE", "MIN_RATE", "NO_PACING", "PACED_PATHS", "PACING_CANDIDATES", "PACING_SPEC_HELP",
           "RATE_MEANING", "StorePacing", "check_pacing", "pacing_args", "parse_pacing", "spec_of"]
