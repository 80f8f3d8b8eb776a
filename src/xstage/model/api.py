"""Entry points that tie data, fitting and profiles together (re-exported by `xstage.model`).

Example:
    >>> from xstage.model import load_default_profile, load_reference_data, predict
    >>> out = predict(load_default_profile(), load_reference_data())
    >>> len(out["issue_ns"]) == len(out["observations"])
    True
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Callable

import numpy as np

from xstage.env import _git_commit
from xstage.errors import InputError
from xstage.model.data import Observations
from xstage.model.fit import MIN_CONFIGS, STRUCTURES, BootstrapStore, fit_path
from xstage.model.heldout import evaluate_loco
from xstage.model.predict import DEFAULT_CLASSES, predict_rows
from xstage.model.profile import Profile
from xstage.version import __version__


def predict(profile: Profile, data: Observations) -> dict:
    """The profile's predictions for the data rows of its path, beside the measurements."""
    obs = data.for_path(profile.path)
    issue, cpl = predict_rows(profile.params, obs, profile.classes)
    return {"observations": obs, "issue_ns": issue, "completion_ns": cpl,
            "rel_error": issue / obs.issue_med - 1.0}


def _loco_summary(loco: dict) -> dict:
    return {k: v for k, v in loco.items() if k != "rel_error"}


def loco_structures(structure: str, loco: bool, compare_structures: bool) -> list[str]:
    """The structures whose leave-one-configuration-out error `build_profile` computes."""
    return list(STRUCTURES) if compare_structures else ([structure] if loco else [])


def build_profile(obs: Observations, structure: str = "full", bootstrap: int = 20, loco: bool = True,
                  compare_structures: bool = False, workers: int = 1,
                  progress: Callable[[str], Callable] | None = None, classes: int = DEFAULT_CLASSES,
                  seed: int = 0, store: BootstrapStore | None = None,
                  on_point_fit: Callable[[float], None] | None = None) -> Profile:
    """Fit one path's data into a `Profile` with intervals, held-out error and provenance.

    Work: one point fit, `bootstrap` refits (those already in `store` are reused, see
    `xstage.model.fit.BootstrapStore`), and one fit per configuration for each structure of
    `loco_structures`. `progress(label)` returns a callback `(done, total)` used for the bootstrap and
    leave-one-out fits; `on_point_fit(seconds)` is called once the point fit is done.
    """
    path = str(obs.path[0])
    todo = loco_structures(structure, loco, compare_structures)
    if todo and len(obs.configs()) < MIN_CONFIGS + 1:
        raise InputError(f"data: need at least {MIN_CONFIGS + 1} configurations (path, n_sm, burst_bytes) for "
                         f"leave-one-out, got {len(obs.configs())}")
    res = fit_path(obs, structure=structure, bootstrap=bootstrap, classes=classes, seed=seed,
                   progress=progress("bootstrap") if progress else None, store=store, on_point_fit=on_point_fit,
                   workers=workers)
    quality = {"residuals": res.residuals, "cross_checks": res.cross_checks}
    struct = {"chosen": structure, "free": list(res.fitted)}
    for s in todo:
        cb = progress(f"leave-one-out ({s})") if progress else None
        summary = _loco_summary(evaluate_loco(obs, structure=s, classes=classes, progress=cb, workers=workers))
        if s == structure:
            quality["loco"] = summary
        struct.setdefault("loco_by_structure", {})[s] = {
            "median_rel_error": summary["median_rel_error"], "p90_rel_error": summary["p90_rel_error"]}
    try:

        commit = _git_commit()
    except Exception:  # provenance is best effort; a missing git must not fail a fit
        commit = "unknown"
    provenance = {
        **{k: obs.env.get(k, "") for k in ("gpu", "driver", "torch", "triton", "date")},
        "measured_git_commit": obs.env.get("git_commit", ""), "path": path,
        "sm_counts": sorted({int(n) for n in obs.n_sm}),
        "burst_bytes": sorted({int(b) for b in obs.burst_bytes}),
        "n_configs": res.n_configs, "n_rows": res.n_rows,
        "data_file": os.path.basename(obs.source) if obs.source else "",
        "fitted_with": {"xstage": __version__, "git_commit": commit, "numpy": np.__version__,
                        "date": _dt.date.today().isoformat(), "bootstrap_rounds": bootstrap, "seed": seed},
    }
    info = res.interval_info
    return Profile(path=path, params=res.params, intervals=res.intervals, fitted=list(res.fitted),
                   identified=res.identified, rel_se=res.rel_se, fit_quality=quality, structure=struct,
                   provenance=provenance, classes=classes, interval_method=info["interval_method"],
                   interval_level=info["interval_level"], bootstrap_rounds=info["bootstrap_rounds"],
                   intervals_widened=info["intervals_widened"])
