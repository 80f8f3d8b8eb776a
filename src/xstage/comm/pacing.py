"""Store pacing: keep a kernel's remote-store backlog below the path's shared X-Stage level.

Why: on the H200 host link, once the shared level is full the loads of *every* SM slow down, also of
SMs that store nothing (`benchmarks/results/h200-store-then-load/`, bystanders: 4-18x slower with
33-99 storing SMs), and the fused MoE kernel's own tiles run 2-18x slower beside a saturated link
(`benchmarks/results/h200-moe-busy-link/`). With 8 storing SMs, whose per-SM windows hold ~1.2 MB
together (below the ~3 MB shared level), readers kept their speed although the link was busy. So
stores that wait in software instead of in the fabric leave the other SMs their memory bandwidth.

How: one int64 virtual clock per kernel buffer (`%globaltimer` ns) is the time at which every byte
claimed so far will have drained at `rate`. A CTA about to store `n` bytes raises the clock to at
least now (an idle link earns no credit), claims `n / rate` of it with one atomic add, and waits
until its claim ends at most `budget / rate` ahead of now, i.e. until at most `budget` bytes would
be outstanding with its own. This is a token bucket of `budget` bytes refilled at `rate` that serves
claims in the order they are made, which the planner's kernel simulator plays as such
(`xstage.sched.simulate.simulate_kernel(pacers=...)`) ahead of the link.

Without a timer (the CPU interpreter) the clock only accumulates the claims and nobody waits: the
outputs do not depend on pacing, and tests can read the clock to check the claimed bytes.

Example:
    >>> from xstage.comm.pacing import StorePacing
    >>> p = StorePacing(rate=50e9, budget=1 << 20)
    >>> p.kernel_args()  # (femtoseconds per byte, budget in ns)
    (20000, 20972)
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from xstage.bounds import check_real
from xstage.comm.device import globaltimer
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


# The pacing measured to pay on the H200 host link (`benchmarks/results/h200-moe-pacing/`: 0.9 x drain
# beat 0.8 and 1.0, and budgets of 64-128 KiB beat 256 KiB-2 MiB). Which paths get it, and from which
# profile's drain, is decided by the kernel that stores (`xstage.moe.pacing`): comm knows no profiles.
DEFAULT_RATE_FACTOR = 0.9
DEFAULT_BUDGET = 128 << 10

NO_PACING = (0, 0)
PACING_SPEC_HELP = "'off', 'default', 'auto' or RATE_GBPS:BUDGET_KIB such as '50:128'"


def default_pacing(drain: float) -> StorePacing:
    """The default pacing of a path that drains at `drain` bytes/s: `DEFAULT_RATE_FACTOR` x drain,
    `DEFAULT_BUDGET` bytes ahead."""
    return StorePacing(rate=DEFAULT_RATE_FACTOR * drain, budget=DEFAULT_BUDGET)


def parse_pacing(spec: str, default: StorePacing | None = None) -> StorePacing | None:
    """`"off"` -> None, `"default"` -> `default` (what the caller resolved for its path), `"RATE:BUDGET"`
    -> StorePacing of RATE GB/s and BUDGET KiB (e.g. `"50:128"`): the suffix of a variant such as
    `interleaved@off`. `"auto"` is the planner's choice per call, which only the kernel's caller can
    make (`xstage.moe.pacing.choose_pacing`), so it is refused here."""
    if not isinstance(spec, str):
        raise InputError(f"pacing {spec!r}: expected {PACING_SPEC_HELP}")
    if spec == "off":
        return None
    if spec == "default":
        return default
    if spec == "auto":
        raise InputError("pacing 'auto': chosen per call by the planner (xstage.moe.pacing.choose_pacing); "
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


@triton.jit
def pace_stores(p_clock, nbytes, fs_per_byte, budget_ns, timeout_ns, max_spins, p_err, code,
                USE_PTX: tl.constexpr):
    """Wait until `nbytes` more remote bytes fit the pacing budget (see module docstring).

    `fs_per_byte == 0` switches pacing off (kernels that never pace compile the call out instead).
    The wait ends by itself (every claim ahead drains at the pace); it is still bounded by `timeout_ns`
    and `max_spins`, and running past them writes `code` into the error word, so a mis-set pace becomes
    a host-side error instead of a stalled kernel."""
    if (fs_per_byte > 0) & (nbytes > 0):
        now = globaltimer(USE_PTX)
        cost = (nbytes.to(tl.int64) * fs_per_byte) // 1000000  # ns
        tl.atomic_max(p_clock, now, sem="relaxed", scope="gpu")
        start = tl.atomic_add(p_clock, cost, sem="relaxed", scope="gpu")
        if USE_PTX:
            target = start + cost - budget_ns
            t_enter = now
            spins = 0
            while (now < target) & (now - t_enter < timeout_ns) & (spins < max_spins):
                now = globaltimer(USE_PTX)
                spins += 1
            if now < target:
                tl.atomic_cas(p_err, 0, code)
                tl.atomic_add(p_err + 1, 1)


__all__ = ["DEFAULT_BUDGET", "DEFAULT_RATE_FACTOR", "NO_PACING", "StorePacing", "default_pacing", "pace_stores",
           "pacing_args", "parse_pacing", "spec_of"]
