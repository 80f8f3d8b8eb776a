"""The planner's measured constants, read from data with their provenance: nothing fitted lives in code.

`xstage/data/h200-planner-constants.json` holds, each with the experiment that measured it, the results
folder that holds the measurement, and why the value is what it is:
- `hbm_path`: the local-memory store path as the planner takes it (issue rate per SM, drain, SMs);
- `default_pacing`: what `pacing="default"` means on a paced path (a factor of the path's drain and a
  budget in bytes);
- `exchange_candidates`: the Ulysses exchanges `exchange="auto"` ranks;
- `remote_path`: the per-SM window a persistent kernel's tasks can overlap (one vector store);
- `unpaced_drain_fit`: which rows the unpaced drain of the interference term is fitted on.

Example:
    >>> from xstage.sched.constants import planner_constants
    >>> planner_constants().default_rate_factor
    0.9
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources

from xstage.errors import InputError

CONSTANTS_JSON = "h200-planner-constants.json"


@dataclass(frozen=True)
class PlannerConstants:
    hbm_issue_rate: float  # B/s per SM
    hbm_drain: float  # B/s
    hbm_sms: int
    default_rate_factor: float  # x the path's drain
    default_budget: float  # B
    exchange_candidates: tuple[str, ...]
    held_store_window: float  # B
    unpaced_saturating_storers: int  # storing CTAs
    unpaced_max_footprint: int  # B
    source: str

    @property
    def hbm_bytes_per_ns_per_sm(self) -> float:
        """An SM's share of HBM bandwidth when all stream (bytes per ns)."""
        return self.hbm_drain / self.hbm_sms / 1e9


def _positive(d: dict, key: str, where: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InputError(f"{where}: {key} must be a finite number > 0, got {v!r}")
    return float(v)


def constants_from_dict(d: dict, source: str) -> PlannerConstants:
    """The constants of a `xstage-planner-constants/1` object; a missing or malformed value is one
    `InputError` naming `source` and the key."""
    try:
        hbm, pace, ex = d["hbm_path"], d["default_pacing"], d["exchange_candidates"]
        remote, unpaced = d["remote_path"], d["unpaced_drain_fit"]
        cands = ex["candidates"]
    except (KeyError, TypeError):
        raise InputError(f"{source}: expected hbm_path, default_pacing, exchange_candidates, remote_path and "
                         "unpaced_drain_fit") from None
    if not isinstance(cands, list) or not cands or not all(isinstance(c, str) for c in cands):
        raise InputError(f"{source}: exchange_candidates.candidates must be a non-empty list of exchange spellings")
    at_hbm, at_pace = f"{source} hbm_path", f"{source} default_pacing"
    at_remote, at_unpaced = f"{source} remote_path", f"{source} unpaced_drain_fit"
    return PlannerConstants(_positive(hbm, "issue_rate", at_hbm), _positive(hbm, "drain", at_hbm),
                            int(_positive(hbm, "sms", at_hbm)), _positive(pace, "rate_factor", at_pace),
                            _positive(pace, "budget_bytes", at_pace), tuple(cands),
                            _positive(remote, "held_store_window_bytes", at_remote),
                            int(_positive(unpaced, "saturating_storers", at_unpaced)),
                            int(_positive(unpaced, "max_footprint_bytes", at_unpaced)), source)


@functools.cache
def planner_constants() -> PlannerConstants:
    """The embedded constants (read once per process)."""
    ref = resources.files("xstage.data") / CONSTANTS_JSON
    return constants_from_dict(json.loads(ref.read_text()), f"xstage/data/{CONSTANTS_JSON}")


__all__ = ["CONSTANTS_JSON", "PlannerConstants", "constants_from_dict", "planner_constants"]
