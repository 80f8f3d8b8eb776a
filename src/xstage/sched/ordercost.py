"""How a schedule's task order changes the fused MoE kernel's tile times: the order effect.

Problem: the tile costs (`TaskCosts.table`, the tile model) are traced under one order, `expert_wave`,
whose concurrent tasks stream one weight matrix of one expert at a time (W1 while a wave's LINEAR1
tasks run, then W2). The interleaving orders (`interleaved`, `lag:k`) run LINEAR1 and LINEAR2 tasks
side by side, so the SMs stream both matrices at once. Measured at EP=1 on one H200
(`benchmarks/results/h200-moe-order/`): where W1 + W2 of an expert reaches the L2's size (about 50 MB),
every GEMM tile and dispatch of an interleaving order runs 10-47% longer than under `expert_wave`
(the units of an expert no longer find its weights in L2); where both fit (H1152-I4608, 32 MB) the
orders run their tiles alike. `lag:1` and `lag:2` keep fewer tasks in flight (their LINEAR2 tasks
wait for the LINEAR1 tasks just before them), and their tiles run up to 24% faster.

Model: a factor on a task's traced time, per schedule, shape, kind and rows per expert:
- a traced shape: its own ratio, mean tile time under the schedule over mean tile time under
  `expert_wave` in the same run, interpolated in log(rows per expert) and held beyond the traced range;
- another shape: the ratio of the reference shape (the traced shape with the largest W1 + W2) scaled by
  how far the shape's W1 + W2 goes from the reference's W1 (the set `expert_wave` streams there, with no
  effect: the traces' baseline) towards the reference's W1 + W2, clamped to [0, 1]:

      factor = 1 + w * (ratio_ref - 1),   w = clamp((W1 + W2 - W1_ref) / W2_ref, 0, 1)

`expert_wave` keeps factor 1 (it is the baseline of every trace). A schedule without traces (a custom
order) has factor 1; `lag:k` without traces takes the traced lag nearest in log(k).

Occupancy: a tile also runs faster while fewer CTAs compute beside it (more of L2 and HBM for each),
by `idle_speedup` (kappa) x the share of CTAs not computing. Points traced with their runs' busy
shares (CTA time inside tasks over CTAs x span; `[rows, ratio, busy, baseline busy]`) fit kappa
(`xstage.calibrate.ordereffect.fit_idle_speedup`: within one shape, kind and rows per expert the
interleaving orders share one L2 effect, so their ratios differ by their busy shares alone), and the
factor above is taken without that difference. The simulator plays each kernel's own occupancy
instead (`occupancy_factor`, 1 at `reference_busy`, the traced `expert_wave` kernels' busy share;
`KernelWork.occupancy`), held at the lowest traced busy share below it: EP > 1 kernels bound by the
store link keep most CTAs waiting (busy shares far below any trace), and the linear term taken there
made their tiles up to twice as fast.

Example:
    >>> eff = OrderEffect({"interleaved": {"H4096-I2048-E256-K6": {"linear1": [(96.0, 1.0), (384.0, 1.2)]}}})
    >>> round(eff.factor("interleaved", "H4096-I2048-E256-K6", "linear1", 192.0), 3)
    1.1
    >>> round(eff.factor("interleaved", "H4096-I1536-E128-K8", "linear1", 384.0), 3)  # W1 + W2 = 37.7 MB
    1.05
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from xstage.errors import InputError
from xstage.spec.moe import MoeShape
from xstage.spec.schedule import KIND_NAMES

BASELINE = "expert_wave"  # the order every tile trace runs in


def weight_bytes(shape: str, elem_bytes: int = 2) -> tuple[float, float]:
    """(W1, W2) bytes of one expert: gate/up `[H, 2I]` and down `[I, H]`."""
    h, i, _, _ = MoeShape.parse(shape)
    return 2.0 * h * i * elem_bytes, 1.0 * h * i * elem_bytes


def _lag(schedule: str) -> int | None:
    if schedule.startswith("lag:"):
        try:
            return int(schedule[4:])
        except ValueError:
            return None
    return None


@dataclass(frozen=True)
class OrderEffect:
    """Measured tile-time ratios per schedule, shape and kind: `{schedule: {shape: {kind: [(rows per
    expert, ratio), ...]}}}`, ratios over `expert_wave` (module docstring), and the occupancy term
    (`idle_speedup`, `reference_busy`; 0 and 1: off)."""

    ratios: dict
    provenance: dict = field(default_factory=dict, compare=False)
    idle_speedup: float = 0.0  # kappa: a tile's time falls by kappa x the share of CTAs not computing
    reference_busy: float = 1.0  # the busy share of the traced `expert_wave` kernels (the tile costs')

    def _relative_time(self, busy: float) -> float:
        """A tile's time with a share `busy` of the CTAs computing, over its time with all of them."""
        return 1.0 - self.idle_speedup * (1.0 - busy)

    @functools.cached_property
    def _reference_time(self) -> float:
        return self._relative_time(self.reference_busy)

    @functools.cached_property
    def lowest_traced_busy(self) -> float:
        """The lowest busy share among the traced points (1 where none carries one)."""
        return min((p[2] for per in self.ratios.values() for kinds in per.values() for pts in kinds.values()
                    for p in pts if len(p) == 4), default=1.0)

    def occupancy_factor(self, busy: float) -> float:
        """A task's time with a share `busy` of the CTAs computing, over its traced time (module docstring);
        the simulator asks at every task start and end. Below the lowest traced busy share the factor is
        held there: a tile cannot keep speeding up as its neighbours go idle (its MMAs bound it), and no
        trace says where it stops."""
        return self._relative_time(max(busy, self.lowest_traced_busy)) / self._reference_time

    @property
    def has_occupancy(self) -> bool:
        return self.idle_speedup > 0

    def __post_init__(self):
        clean: dict = {}
        try:
            for schedule, shapes in self.ratios.items():
                for shape, kinds in shapes.items():
                    key = str(MoeShape.parse(shape))
                    for kind, pts in kinds.items():
                        if kind not in KIND_NAMES:
                            raise InputError(f"kind {kind!r}: expected one of {', '.join(KIND_NAMES)}")
                        if any(isinstance(v, (bool, str)) for p in pts for v in p):
                            raise TypeError(f"{schedule} {shape} {kind}: ratios must be numbers, got {pts!r}")
                        pts = sorted(tuple(float(v) for v in p) for p in pts)
                        if not pts or any(len(p) not in (2, 4) or not all(v > 0 and math.isfinite(v) for v in p)
                                          or any(b > 1 for b in p[2:]) for p in pts):
                            raise InputError(f"{schedule} {shape} {kind}: ratios need [rows per expert > 0, "
                                             f"ratio > 0] or with [busy, baseline busy] in (0, 1], got {pts!r}")
                        clean.setdefault(str(schedule), {}).setdefault(key, {})[kind] = pts
        except (AttributeError, TypeError, ValueError) as exc:
            raise InputError(f"order effect: malformed ratios ({type(exc).__name__}: {exc})") from None
        object.__setattr__(self, "ratios", clean)
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                 for v in (self.idle_speedup, self.reference_busy))
        if not ok or not 0 <= self.idle_speedup < 1 or not 0 < self.reference_busy <= 1:
            raise InputError(f"order effect: idle_speedup={self.idle_speedup!r} must be in [0, 1) and "
                             f"reference_busy={self.reference_busy!r} in (0, 1]")

    @property
    def shapes(self) -> list[str]:
        return sorted({s for shapes in self.ratios.values() for s in shapes})

    @property
    def reference(self) -> str | None:
        """The traced shape with the largest expert weights: it carries the effect to other shapes."""
        return max(self.shapes, key=lambda s: sum(weight_bytes(s)), default=None)

    def _schedule(self, schedule: str) -> str | None:
        if schedule in self.ratios:
            return schedule
        k = _lag(schedule)
        lags = [(abs(math.log(_lag(s) / k)), _lag(s), s) for s in self.ratios if _lag(s)] if k else []
        return min(lags)[2] if lags else None

    def _busy_free(self, p) -> float:
        """A point's ratio without the occupancy difference between its run and the baseline's."""
        if len(p) < 4 or not self.has_occupancy:
            return p[1]
        return p[1] * self._relative_time(p[3]) / self._relative_time(p[2])

    def _interp(self, pts, rows_per_expert: float) -> float:
        xs = np.log([p[0] for p in pts])
        return float(np.interp(math.log(max(rows_per_expert, 1e-9)), xs, [self._busy_free(p) for p in pts]))

    def factor(self, schedule: str | None, shape: str, kind: str, rows_per_expert: float, elem_bytes: int = 2) -> float:
        """The factor on a task's traced time under `schedule` (1 for `expert_wave` and untraced orders)."""
        if schedule is None or schedule == BASELINE:
            return 1.0
        name = self._schedule(schedule)
        if name is None:
            return 1.0
        per_shape = self.ratios[name]
        if shape in per_shape and kind in per_shape[shape]:
            return self._interp(per_shape[shape][kind], rows_per_expert)
        ref = self.reference
        if ref not in per_shape or kind not in per_shape[ref]:
            return 1.0
        w1_ref, w2_ref = weight_bytes(ref)
        w = min(1.0, max(0.0, (sum(weight_bytes(shape, elem_bytes)) - w1_ref) / w2_ref))
        return 1.0 + w * (self._interp(per_shape[ref][kind], rows_per_expert) - 1.0)

    def to_dict(self) -> dict:
        return {"ratios": {sch: {s: {k: [list(p) for p in pts] for k, pts in kinds.items()}
                                 for s, kinds in per.items()} for sch, per in self.ratios.items()},
                "idle_speedup": self.idle_speedup, "reference_busy": self.reference_busy,
                "provenance": self.provenance}

    @classmethod
    def from_dict(cls, d: dict, source: str = "order effect") -> OrderEffect:
        if not isinstance(d, dict) or not isinstance(d.get("ratios"), dict):
            raise InputError(f"{source}: expected an object with 'ratios' "
                             "{schedule: {shape: {kind: [[rows per expert, ratio], ...]}}}")
        try:
            return cls(d["ratios"], dict(d.get("provenance", {})), d.get("idle_speedup", 0.0),
                       d.get("reference_busy", 1.0))
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None


