"""Burst-Gap model of the X-Stage: parameters, closed forms, simulator, fitting and profiles.

Public API (stable):

* `PathParams`: one path's parameters (per-SM `r0`, `c_sm`; shared `drain`, `capacity`; `t0`,
  `latency`; first stage `r_fast`, `b_fast`; unequal sharing `spread`).
* `closed_form`: one-issuer formulas: `issue_time`, `stall`, `onset_bytes`, `backlog_end`,
  `completion_time`, `recovery_time`, `two_burst_issue_time`, `periodic_onset_index`,
  `periodic_steady_issue_time`, `periodic_issue_times`, `burst`, `after_gap`.
* `PathSimulator` (incremental: `start_burst`, `next_event_time`, `advance`, `backlog`,
  `completion_ns`; the reference engine), `FastPathSimulator` (the same on the compiled engine,
  `fastsim.py`), `path_simulator(..., engine="fast"|"reference")` and
  `simulate_bursts(params, programs, engine=...)` -> `BurstResult`.
* Data: `LONG_COLUMNS`, `SUMMARY_COLUMNS`, `SCHEMA`, `validate_long`, `summarise`,
  `read_observations`, `load_reference_data`, `Observations`.
* Fitting: `fit_path`, `evaluate_loco`, `calibration_design`, `synthetic_observations`.
* Profiles: `Profile`, `load_default_profile` (host: xstage's H200 probe; peer: 2 x H200 NVLink),
  `load_reference_profile` (host, fitted to the reference probe), `build_profile`, `predict`.
* Plots: `plot_issue_vs_burst`, `plot_issue_vs_gap`.

Example:
    >>> from xstage.model import load_default_profile, closed_form
    >>> prof = load_default_profile("host")
    >>> closed_form.issue_time(prof.params, 64 * 1024) > 0
    True
"""

from xstage.model import closed_form
from xstage.model.api import build_profile, predict
from xstage.model.data import (
    LONG_COLUMNS,
    SCHEMA,
    SUMMARY_COLUMNS,
    Observations,
    load_reference_data,
    read_observations,
    summarise,
    validate_long,
)
from xstage.model.design import calibration_design, synthetic_observations
from xstage.model.fastsim import FastPathSimulator
from xstage.model.fit import FitResult, fit_path
from xstage.model.heldout import evaluate_loco
from xstage.model.params import PathParams
from xstage.model.plots import plot_issue_vs_burst, plot_issue_vs_gap
from xstage.model.profile import Profile, load_default_profile, load_reference_profile
from xstage.model.simulate import BurstResult, PathSimulator, path_simulator, simulate_bursts

__all__ = [
    "LONG_COLUMNS", "SCHEMA", "SUMMARY_COLUMNS", "BurstResult", "FastPathSimulator", "FitResult", "Observations",
    "PathParams", "PathSimulator", "Profile", "build_profile", "calibration_design", "closed_form", "evaluate_loco",
    "fit_path", "load_default_profile", "load_reference_data", "load_reference_profile", "path_simulator",
    "plot_issue_vs_burst", "plot_issue_vs_gap", "predict", "read_observations", "simulate_bursts", "summarise",
    "synthetic_observations", "validate_long",
]
