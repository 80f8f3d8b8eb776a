"""Held-out evaluation of the Burst-Gap fit: leave one configuration out, fit the rest
(`xstage.model.fit.fit_point`), predict the left-out configuration's CTA-median issue time, and report
the error with every configuration weighing equally (`config_weights`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from xstage.errors import InputError
from xstage.model.data import Observations
from xstage.model.fit import (
    DEFAULT_STRUCTURE,
    MIN_CONFIGS,
    _check_fit_input,
    config_weights,
    fit_point,
    weighted_quantile,
)
from xstage.model.predict import DEFAULT_CLASSES, predict_rows


def evaluate_loco(data: Observations, structure: str = DEFAULT_STRUCTURE, classes: int = DEFAULT_CLASSES,
                  progress: Callable | None = None, max_nfev: int = 200, workers: int = 1) -> dict:
    """Leave-one-configuration-out error of the CTA-median issue time (see module docstring).

    `workers > 1` fits the folds in spawned processes: a script calling it needs the usual
    `if __name__ == "__main__":` guard.
    """
    _check_fit_input(data)
    cfgs = data.configs()
    keys = data.config_keys()
    if len(cfgs) < MIN_CONFIGS + 1:
        raise InputError(f"data: need at least {MIN_CONFIGS + 1} configurations for leave-one-out, got {len(cfgs)}")
    jobs = [(data, structure, classes, cfg, max_nfev) for cfg in cfgs]
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            results = []
            for j, r in enumerate(pool.imap(_loco_fold, jobs)):
                results.append(r)
                if progress:
                    progress(j + 1, len(jobs))
    else:
        results = []
        for j, job in enumerate(jobs):
            results.append(_loco_fold(job))
            if progress:
                progress(j + 1, len(jobs))
    rel = np.full(len(data), np.nan)
    per_config = {}
    for cfg, pred in zip(cfgs, results):
        m = np.array([k == cfg for k in keys])
        rel[m] = pred / data.issue_med[m] - 1.0
        per_config["/".join(map(str, cfg))] = float(np.median(np.abs(rel[m])))
    w = config_weights(data)
    return {
        "median_rel_error": weighted_quantile(np.abs(rel), w, 0.5),
        "p90_rel_error": weighted_quantile(np.abs(rel), w, 0.9),
        "n_configs": len(cfgs),
        "structure": structure,
        "per_config_median": per_config,
        "rel_error": rel,
    }


def _loco_fold(job) -> np.ndarray:
    data, structure, classes, cfg, max_nfev = job
    keys = data.config_keys()
    m = np.array([k == cfg for k in keys])
    p = fit_point(data.select(~m), structure, classes, max_nfev=max_nfev)
    return predict_rows(p, data.select(m), classes)[0]
