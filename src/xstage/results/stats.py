"""Statistics of repeated measurements: median with p10/p90, and the geometric mean of ratios."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    median_ns: float
    p10_ns: float
    p90_ns: float
    runs: int


def timing_summary(samples_ns: Sequence[float]) -> Timing:
    """Median and 10th/90th percentiles of samples (ns)."""
    s = sorted(samples_ns)
    if not s:
        raise ValueError("timing_summary: no samples")
    # "inclusive" keeps p10 and p90 within the samples (the default extrapolates past them for few runs).
    q = statistics.quantiles(s, n=10, method="inclusive") if len(s) >= 2 else [s[0]] * 9
    return Timing(statistics.median(s), q[0], q[-1], len(s))


def geomean(values: Sequence[float]) -> float:
    """Geometric mean of positive ratios; NaN for none."""
    return math.exp(sum(math.log(x) for x in values) / len(values)) if values else float("nan")
