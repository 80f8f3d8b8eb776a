"""Store pacing resolved for a store path: the one place a pacing spelling becomes what a kernel runs.

`resolve_pacing(pacing, path, num_ranks)` turns any spelling of `xstage.spec.pacing` but `"auto"`
into a `StorePacing` or None (unpaced). Only `"default"` needs the path's embedded profile (its
drain, `default_pacing`, with the measured factor and budget of `xstage.sched.constants`), read once
per process; `"off"` and `"RATE:BUDGET"` read no file. `"auto"`
depends on the call (tokens, schedule) and is the planner's decision:
`xstage.sched.policy.choose_pacing`.

Example:
    >>> from xstage.sched.pacing import resolve_pacing
    >>> resolve_pacing("off", "host", 8) is None, resolve_pacing("50:128", "host", 8).rate
    (True, 50000000000.0)
"""

from __future__ import annotations

import functools

from xstage.bounds import MAX_RANKS, check_int
from xstage.errors import InputError
from xstage.model import load_default_profile
from xstage.sched.constants import planner_constants
from xstage.spec.pacing import AUTO, DEFAULT, PACED_PATHS, StorePacing, parse_pacing
from xstage.spec.paths import PATHS


def default_pacing(drain: float) -> StorePacing:
    """The default pacing of a path that drains at `drain` bytes/s: the measured factor of the drain and
    budget of `xstage/data/h200-planner-constants.json` (`xstage.sched.constants`)."""
    c = planner_constants()
    return StorePacing(rate=c.default_rate_factor * drain, budget=c.default_budget)


def default_pacing_of(path: str, num_ranks: int) -> StorePacing | None:
    """What `"default"` means for a kernel storing toward `num_ranks - 1` peers through `path`."""
    if num_ranks < 2 or path not in PACED_PATHS:
        return None
    return _default_of_path(path)


@functools.cache
def _default_of_path(path: str) -> StorePacing:
    # The embedded profile is package data: read once per process, not on every call.
    return default_pacing(load_default_profile(path).params.drain)


def resolve_pacing(pacing, path: str, num_ranks: int) -> StorePacing | None:
    """`pacing` as the kernel runs it: a StorePacing, or None for unpaced stores. `"auto"` depends on
    the call: the planner decides it (`xstage.sched.policy.choose_pacing`)."""
    if pacing is None or isinstance(pacing, StorePacing):
        return pacing
    if not isinstance(pacing, str):
        raise InputError(f"pacing={pacing!r}: must be 'auto', 'default', 'off', 'RATE_GBPS:BUDGET_KIB', "
                         "a StorePacing or None")
    if pacing == AUTO:
        raise InputError("pacing 'auto' is chosen per call (tokens, schedule): resolve it with "
                         "xstage.sched.policy.choose_pacing, or name a pacing ('default', 'off', 'RATE:BUDGET')")
    if path not in PATHS:
        raise InputError(f"path={path!r}: must be one of {', '.join(PATHS)} (where the stores go)")
    num_ranks = check_int(num_ranks, "num_ranks", 1, MAX_RANKS, "ranks of the group")
    # Only "default" needs the path's profile: "off" and "RATE:BUDGET" read no file.
    return parse_pacing(pacing, default_pacing_of(path, num_ranks) if pacing == DEFAULT else None)


__all__ = ["default_pacing", "default_pacing_of", "resolve_pacing"]
