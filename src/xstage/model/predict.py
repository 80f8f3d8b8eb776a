"""Model predictions for measured launches: the CTA-median issue time per burst span.

Problem: a measurement reports, per launch, the median over CTAs of a burst's issue time; the model
must produce the same statistic for the same launch (n SMs, bursts, gaps) to be compared with it.

Algorithm: each launch is simulated once (`xstage.model.simulate`) with its SMs grouped into at most
`classes` slots of consecutive drain weight (a slot stands for its SMs, which then behave alike);
the prediction for a row is the multiplicity-weighted median of the slots' issue times over the
row's burst span. With `spread == 1` all SMs are alike and one slot is exact.

Example:
    >>> from xstage.model.data import load_reference_data
    >>> from xstage.model.params import PathParams
    >>> obs = load_reference_data().for_path("host")
    >>> p = PathParams(r0=50e9, c_sm=96e3, drain=52.5e9, capacity=4.5e6, t0=75.0)
    >>> predict_issue(p, obs).shape == (len(obs),)
    True
"""

from __future__ import annotations

import numpy as np

from xstage.model import closed_form as cf
from xstage.model.data import Observations
from xstage.model.params import PathParams
from xstage.model.simulate import simulate_bursts

DEFAULT_CLASSES = 4


def split_classes(n_sm: int, classes: int) -> list[int]:
    """`n_sm` SMs in at most `classes` slots of near-equal size."""
    k = max(1, min(n_sm, classes))
    base, extra = divmod(n_sm, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """Median of `values` each repeated `weights` times (mean of the two middle ones when even)."""
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    half = cum[-1] / 2.0
    lo = int(np.searchsorted(cum, half, side="left"))
    hi = int(np.searchsorted(cum, half, side="right"))
    hi = min(hi, len(v) - 1)
    # np.isclose(cum[lo], half) written out on scalars: the fit calls this thousands of times per step
    c = float(cum[lo])
    return float(0.5 * (v[lo] + v[hi])) if abs(c - half) <= 1e-8 + 1e-5 * abs(half) else float(v[lo])


def simulate_launch(params: PathParams, n_sm: int, burst_bytes: float, gap_ns: float, n_bursts: int,
                    classes: int = DEFAULT_CLASSES):
    """Issue and completion times `[slot, burst]` (ns from each burst's start) and slot multiplicities.

    SMs that share the drain equally (one SM, or `spread == 1`) run the same program in lockstep, so
    the closed forms for the equivalent single issuer give them exactly and at once.
    """
    if n_sm == 1 or params.spread == 1.0:
        p = params.symmetric(n_sm)
        q, k, issue, cpl = 0.0, p.b_fast, [], []
        for _ in range(n_bursts):
            t, q, k, c = cf.burst_raw(p, burst_bytes, q, k)
            issue.append(t)
            cpl.append(c)
            q, k = cf.gap_raw(p, q, k, gap_ns)
        return np.array([issue]), np.array([cpl]), np.array([float(n_sm)])
    mult = split_classes(n_sm, classes)
    prog = [(burst_bytes, gap_ns)] * n_bursts
    res = simulate_bursts(params, [prog] * len(mult), multiplicity=mult)
    return (np.vstack(res.issue_ns), np.vstack(res.completion_ns) - np.vstack(res.start_ns),
            np.array(mult, dtype=float))


def predict_issue(params: PathParams, obs: Observations, classes: int = DEFAULT_CLASSES) -> np.ndarray:
    """Predicted CTA-median issue time (ns) of every row of `obs`."""
    return predict_rows(params, obs, classes)[0]


def predict_rows(params: PathParams, obs: Observations,
                 classes: int = DEFAULT_CLASSES) -> tuple[np.ndarray, np.ndarray]:
    """Predicted CTA-median issue and completion times (ns) of every row of `obs`."""
    out = np.full(len(obs), np.nan)
    out_c = np.full(len(obs), np.nan)
    cache: dict = {}
    for rows in obs.launches():
        i0 = rows[0]
        key = (int(obs.n_sm[i0]), float(obs.burst_bytes[i0] * obs.ctas_per_sm[i0]), float(obs.gap_ns[i0]),
               int(obs.n_bursts[i0]))
        if key not in cache:
            cache[key] = simulate_launch(params, *key, classes=classes)
        issue, cpl, mult = cache[key]
        for i in rows:
            lo, hi = int(obs.burst_lo[i]), int(obs.burst_hi[i])
            w = np.tile(mult[:, None], (1, hi + 1 - lo)).ravel()
            out[i] = weighted_median(issue[:, lo:hi + 1].ravel(), w)
            out_c[i] = weighted_median(cpl[:, lo:hi + 1].ravel(), w)
    return out, out_c
