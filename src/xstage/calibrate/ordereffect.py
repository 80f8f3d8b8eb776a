"""Fit the order effect (`xstage.sched.ordercost.OrderEffect`) on traced tile times: the ratios of each
schedule's mean tile times to the traced `expert_wave` run's, and its occupancy term (kappa), fitted by
least squares over the interleaving orders' busy shares. `xstage plan calibrate` writes the result into
the task costs; the planner only reads it.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from xstage.errors import InputError
from xstage.sched.ordercost import BASELINE, OrderEffect
from xstage.spec.moe import MoeShape


def restrict_order_effect(effect: OrderEffect, shapes) -> OrderEffect | None:
    """`effect` as if only `shapes` had been traced (None where none of them was), its occupancy term
    refitted on their points."""
    keep = {str(MoeShape.parse(x)) for x in shapes}
    ratios = {sch: {x: k for x, k in per.items() if x in keep} for sch, per in effect.ratios.items()}
    ratios = {sch: per for sch, per in ratios.items() if per}
    if not ratios:
        return None
    return with_occupancy(OrderEffect(ratios, {"restricted_to": sorted(keep), "from": effect.provenance}))


def fit_idle_speedup(effect: OrderEffect) -> tuple[float, float]:
    """(idle_speedup, reference_busy) from the points that carry busy shares: within one shape, kind and
    rows per expert the interleaving orders share one L2 effect, so their ratios differ by their busy
    shares alone: log ratio = c + log(1 - kappa (1 - busy)), least squares over kappa with one c per
    group. reference_busy: the median busy share of the baseline runs. (0, 1): no busy shares."""
    groups: dict = defaultdict(list)
    base_busy = []
    for per in effect.ratios.values():
        for shape, kinds in per.items():
            for kind, pts in kinds.items():
                for p in pts:
                    if len(p) == 4:
                        groups[(shape, kind, p[0])].append((p[2], math.log(p[1])))
                        base_busy.append(p[3])
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return 0.0, 1.0

    def loss(kappa: float) -> float:
        total = 0.0
        for pts in groups.values():
            res = np.array([y - math.log(1.0 - kappa * (1.0 - b)) for b, y in pts])
            total += float(np.sum((res - res.mean()) ** 2))
        return total

    from scipy import optimize

    kappa = float(optimize.minimize_scalar(loss, bounds=(0.0, 0.95), method="bounded").x)
    return round(kappa, 4), round(float(np.median(base_busy)), 4)


def with_occupancy(effect: OrderEffect) -> OrderEffect:
    """`effect` with its occupancy term fitted on its own points (`fit_idle_speedup`)."""
    kappa, ref = fit_idle_speedup(effect)
    prov = dict(effect.provenance, idle_speedup_fitted_on=effect.shapes) if kappa > 0 else effect.provenance
    return OrderEffect(effect.ratios, prov, kappa, ref)


def order_effect_from_means(rows, provenance: dict | None = None) -> OrderEffect | None:
    """The effect from traced mean tile times: rows with shape, rows_per_expert, schedule, kind and
    mean_ns, where each (shape, rows per expert, kind) that has a non-baseline schedule also has its
    `expert_wave` row (the same run). Rows with `busy` (the share of CTA time inside tasks in that run)
    also fit the occupancy term (`fit_idle_speedup`). None when no row has another schedule."""
    base: dict = {}
    busy: dict = {}
    for r in rows:
        if r["schedule"] == BASELINE:
            key = (str(MoeShape.parse(r["shape"])), float(r["rows_per_expert"]), r["kind"])
            base[key] = float(r["mean_ns"])
            if r.get("busy") not in (None, ""):
                busy[key] = float(r["busy"])
    ratios: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        if r["schedule"] == BASELINE:
            continue
        key = (str(MoeShape.parse(r["shape"])), float(r["rows_per_expert"]), r["kind"])
        if key not in base:
            raise InputError(f"order effect: {r['schedule']} {key[0]} at {key[1]:g} rows per expert ({key[2]}) "
                             f"has no {BASELINE} row to compare with")
        point = (key[1], float(r["mean_ns"]) / base[key])
        if r.get("busy") not in (None, "") and key in busy:
            point += (float(r["busy"]), busy[key])
        ratios[r["schedule"]][key[0]][key[2]].append(point)
    if not ratios:
        return None
    return with_occupancy(OrderEffect({s: {sh: dict(k) for sh, k in per.items()} for s, per in ratios.items()},
                                      provenance or {}))
