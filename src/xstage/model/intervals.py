"""Bootstrap intervals of fitted parameters, and what they may honestly be called.

Problem: an interval from a handful of bootstrap refits is not a 95% interval, and a percentile
interval of refits that all land on one side of the point estimate does not contain it. A profile
must say how its intervals were made.

Rule:
* the interval of a parameter is the 2.5th-97.5th percentile of its bootstrap refits (linear
  interpolation, `numpy.percentile`);
* if the point estimate falls outside it, the interval is widened to include the point estimate,
  and the parameter is listed as widened;
* it is labelled a 95% interval only with at least `MIN_BOOTSTRAP_ROUNDS` refits; with fewer it is
  the percentile range of that many refits, and says so (`interval_level` None).

Example:
    >>> from xstage.model.intervals import percentile_interval, describe
    >>> percentile_interval([2.0, 3.0, 4.0], 1.0)
    (1.0, 3.95, True)
    >>> describe(3, ["r0"])["interval_level"] is None
    True
"""

from __future__ import annotations

import math

import numpy as np

MIN_BOOTSTRAP_ROUNDS = 20
LEVEL = 0.95
PERCENTILES = (2.5, 97.5)


def percentile_interval(draws, point: float) -> tuple[float, float, bool]:
    """(lo, hi, widened): the 2.5/97.5 percentiles of `draws`, widened to contain `point`."""
    v = np.asarray(draws, float)
    lo, hi = (float(x) for x in np.percentile(v, PERCENTILES))
    widened = False
    if math.isfinite(point) and point < lo:
        lo, widened = float(point), True
    if math.isfinite(point) and point > hi:
        hi, widened = float(point), True
    return lo, hi, widened


def describe(rounds: int, widened=()) -> dict:
    """The profile fields that say how intervals from `rounds` bootstrap refits were made."""
    rounds = int(rounds)
    if rounds <= 0:
        return {"interval_method": "none (no bootstrap rounds)", "interval_level": None,
                "bootstrap_rounds": 0, "intervals_widened": []}
    method = (f"bootstrap percentile {PERCENTILES[0]}-{PERCENTILES[1]} of {rounds} refits to resampled "
              "configurations (local refits from the point estimate)")
    widened = sorted(widened)
    if widened:
        method += f"; widened to include the point estimate: {', '.join(widened)}"
    if rounds < MIN_BOOTSTRAP_ROUNDS:
        method += f"; fewer than {MIN_BOOTSTRAP_ROUNDS} rounds: not a {LEVEL:.0%} interval"
    return {"interval_method": method, "interval_level": LEVEL if rounds >= MIN_BOOTSTRAP_ROUNDS else None,
            "bootstrap_rounds": rounds, "intervals_widened": widened}


def label(level, rounds) -> str:
    """Short name of an interval for tables: '95%' or '3-round range'."""
    if level:
        return f"{level:.0%}"
    if rounds:
        return f"{rounds}-round range"
    return "range"


def few_rounds_warning(rounds: int) -> str | None:
    """The warning to print when `rounds` bootstrap rounds are too few for a 95% interval."""
    if 0 < rounds < MIN_BOOTSTRAP_ROUNDS:
        return (f"warning: {rounds} bootstrap rounds are fewer than {MIN_BOOTSTRAP_ROUNDS}: the intervals are the "
                f"percentile range of {rounds} refits, not {LEVEL:.0%} intervals (the profile says so)")
    return None
