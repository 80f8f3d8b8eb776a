"""Parameters of one store path in the Burst-Gap model.

A path is the route a group of SMs stores through (device memory, host memory over PCIe, a peer GPU
over NVLink). Its X-Stage is modelled as two levels of outstanding bytes (issued, not yet remote
visible):

* per SM: the SM issues at most `r0` bytes/s and keeps at most `c_sm` bytes outstanding;
* shared: all SMs on the path together keep at most `capacity` bytes outstanding, and the path
  completes (drains) `drain` bytes/s, work-conserving, split among the SMs with bytes outstanding.

Each burst costs a fixed `t0` ns before its first store; completion of a byte is visible `latency` ns
after the drain releases it.

Two additions, each justified by the H200 host-link reference data (`xstage.data`, see
the README's Store paths results) and kept because they lower the held-out error: leave one
configuration (n_sm, burst_bytes) out, fit the rest, predict its CTA medians
(`xstage.model.heldout.evaluate_loco`; figures stored in the default profile's `structure` section).
On the 20 host configurations the median / p90 relative error is 29% / 90% for the base model,
7.5% / 41% with the first stage and 5.9% / 34% with unequal sharing as well.

* `r_fast`, `b_fast`: a small first stage in front of the per-SM window. A token bucket of `b_fast`
  bytes lets a burst start at `r_fast` (> `r0`) until `b_fast` bytes beyond the `r0` pace have gone;
  it refills at `r0` while the SM issues slower. One SM alone on the host link issues 4 KiB in 95 ns
  and 16 KiB in 152 ns (~215 GB/s incremental) but 64 KiB -> 1 MiB at ~50.6 GB/s, with an intercept
  that a single rate and `t0` cannot produce. `b_fast = 0` switches it off.
* `spread`: unequal sharing of the drain. SM `i` of `n` gets weight
  `spread ** ((i + 0.5) / n - 0.5)` (log-uniform over a factor `spread`), and the drain is split in
  proportion to weight among SMs holding bytes. Under backpressure the reference probe's per-CTA
  issue times spread up to ~12x around the median, and the CTA median sits at 0.4-0.8 of the
  equal-share time; with equal sharing the fit can only match the medians with a drain above the
  measured aggregate (69 GB/s against the 49-52.5 GB/s the steep slope and the kernel throughput
  show). `spread = 1` is equal sharing.

How the SMs take the shared window is `admission`, a choice of structure rather than a fitted number:

* `"first_come"` (the default): the SMs fill `capacity` in the order they issue; once it is full, every
  issuing SM gets its weighted slice of the drain, however little it holds.
* `"fair_share"`: each SM that holds bytes or issues owns `capacity x w_i / sum w` of the window (its
  drain weight `w_i` over the active SMs', at most `c_sm`). An SM whose holdings drained below its part
  during a gap issues at its own pace at once; an SM over its part (more SMs became active) waits for
  the drain. Measured on irregular trains (`benchmarks/results/h100-fair-share-window/`), a 4 KiB burst
  that starts beside 90 SMs stalled on 1 MiB bursts issues in ~90 ns, as here, where first come makes
  it wait microseconds. With the SMs starting together on the same program the two agree.

`c_sm` and `capacity` may be `math.inf` (no window: a path with no backpressure at that level is
valid). Units: bytes, bytes/s, ns. Every field lies in a physical range (`RANGES`), checked when the
parameters are built (from a profile or by hand): rates in 1 MB/s..1 PB/s, windows in 1 B..1 PiB,
times in 0..1 s, `spread` in 1..10^4, so that no prediction turns into inf or NaN.

Example:
    >>> from xstage.model.params import PathParams
    >>> p = PathParams(r0=50e9, c_sm=96 * 1024, drain=52.5e9, capacity=4.5 * 2**20, t0=75.0, latency=1000.0)
    >>> round(p.single().capacity)
    98304
"""

from __future__ import annotations

import copy
import dataclasses
import math

from xstage.bounds import MAX_SMS, check_int, check_real
from xstage.errors import InputError

NS = 1e-9

PARAM_NAMES = ("r0", "c_sm", "drain", "capacity", "t0", "latency", "r_fast", "b_fast", "spread")  # the numbers
ADMISSIONS = ("first_come", "fair_share")
PARAM_UNITS = {
    "r0": "B/s", "c_sm": "B", "drain": "B/s", "capacity": "B", "t0": "ns", "latency": "ns",
    "r_fast": "B/s", "b_fast": "B", "spread": "ratio",
}


# A store path slower than 1 MB/s or faster than 1 PB/s (200x an H200's device memory) is a broken
# measurement or a typo; a window of 1 PiB is beyond any memory, yet whole bytes in a float (wider is
# `inf`); one second of fixed cost per burst, or a drain split more unequally than 10^4 : 1 between
# SMs, is no GPU's. (lo, hi, inf allowed) per field:
MIN_RATE, MAX_RATE = 1e6, 1e15
MAX_WINDOW = float(2**50)
MAX_TIME_NS = 1e9
MAX_SPREAD = 1e4
RANGES = {
    "r0": (MIN_RATE, MAX_RATE, False), "c_sm": (1.0, MAX_WINDOW, True), "drain": (MIN_RATE, MAX_RATE, False),
    "capacity": (1.0, MAX_WINDOW, True), "t0": (0.0, MAX_TIME_NS, False), "latency": (0.0, MAX_TIME_NS, False),
    "r_fast": (MIN_RATE, MAX_RATE, True), "b_fast": (0.0, MAX_WINDOW, False), "spread": (1.0, MAX_SPREAD, False),
}
MEANINGS = {
    "r0": "issue rate of one SM", "drain": "drain rate of the path", "c_sm": "outstanding bytes per SM",
    "capacity": "outstanding bytes of the path", "t0": "fixed cost per burst", "latency": "completion latency",
    "r_fast": "issue rate of the first stage", "b_fast": "bytes of the first stage",
    "spread": "drain sharing between SMs",
}


def clamp(name: str, value: float) -> float:
    """`value` moved into the range of field `name`: for fitters, whose search may step outside."""
    lo, hi, allow_inf = RANGES[name]
    return value if allow_inf and value == math.inf else min(max(value, lo), hi)


@dataclasses.dataclass(frozen=True)
class PathParams:
    """Burst-Gap parameters of one path; see the module docstring for the meaning of each field."""

    r0: float
    c_sm: float
    drain: float
    capacity: float
    t0: float = 0.0
    latency: float = 0.0
    r_fast: float = math.inf
    b_fast: float = 0.0
    spread: float = 1.0
    admission: str = "first_come"

    def __post_init__(self) -> None:
        if self.admission not in ADMISSIONS:
            raise InputError(f"PathParams.admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        for name, (lo, hi, allow_inf) in RANGES.items():
            v = check_real(getattr(self, name), f"PathParams.{name}", lo, hi, MEANINGS[name], PARAM_UNITS[name],
                           allow_inf)
            object.__setattr__(self, name, v)
        if self.r_fast < self.r0:
            raise InputError(f"PathParams.r_fast must be >= r0 ({self.r0:g} B/s), got {self.r_fast!r}")
        if self.b_fast > 0 and math.isinf(self.r_fast):
            raise InputError("PathParams.r_fast must be finite when b_fast > 0 (a first stage has a rate)")

    def replace(self, **changes) -> PathParams:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """JSON-ready dict; infinite windows and rates become the string "inf". `admission` is written only
        when it is not the default, so that a profile of the default structure reads as it always did."""
        out = {k: ("inf" if math.isinf(v) else float(v)) for k in PARAM_NAMES for v in (getattr(self, k),)}
        if self.admission != "first_come":
            out["admission"] = self.admission
        return out

    @classmethod
    def from_dict(cls, d: dict) -> PathParams:
        """Inverse of `to_dict`; unknown keys are an error so that a typo is not silently ignored."""
        if not isinstance(d, dict):
            raise InputError(f"parameters must be a mapping, got {type(d).__name__}")
        unknown = set(d) - set(PARAM_NAMES) - {"admission"}
        if unknown:
            raise InputError(f"parameters: unknown field(s) {sorted(unknown)}; known: {[*PARAM_NAMES, 'admission']}")
        missing = {"r0", "c_sm", "drain", "capacity"} - set(d)
        if missing:
            raise InputError(f"parameters: missing required field(s) {sorted(missing)}")
        vals = {}
        for k, v in d.items():
            if k == "admission":
                if v not in ADMISSIONS:
                    raise InputError(f"parameters.admission must be one of {', '.join(ADMISSIONS)}, got {v!r:.40}")
                vals[k] = v
                continue
            try:
                vals[k] = float(v)
            except (TypeError, ValueError):
                raise InputError(f"parameters.{k} must be a number or 'inf', got {v!r}") from None
        return cls(**vals)

    def weights(self, n_sm: int) -> list[float]:
        """Drain-sharing weight of each of `n_sm` SMs (all 1 when `spread == 1`)."""
        if self.spread == 1.0:
            return [1.0] * n_sm
        return [self.spread ** ((i + 0.5) / n_sm - 0.5) for i in range(n_sm)]

    def single(self) -> PathParams:
        """One SM issuing alone: the two windows act as one of size min(c_sm, capacity)."""
        return self.symmetric(1)

    def symmetric(self, n_sm: int) -> PathParams:
        """The equivalent single issuer of `n_sm` SMs running the same program from the same time.

        With equal sharing each SM sees drain `drain / n` and window `min(c_sm, capacity / n)`;
        r0, the first stage and t0 stay per SM. Exact only for `spread == 1` (unequal sharing breaks
        the symmetry).
        """
        n_sm = check_int(n_sm, "n_sm", 1, MAX_SMS, "SMs issuing together")
        # One SM's share, derived from checked parameters: below the ranges a path is given in, so built
        # without their check.
        share = copy.copy(self)
        window = min(self.c_sm, self.capacity / n_sm)
        for name, v in (("drain", self.drain / n_sm), ("c_sm", window), ("capacity", window), ("spread", 1.0)):
            object.__setattr__(share, name, v)
        return share
