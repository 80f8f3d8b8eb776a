"""Calibration design: which probe launches identify which Burst-Gap parameters.

Problem: steady-state runs alone cannot identify the windows (burst-gap.md: `C` sets only *when*
backpressure starts), and one issuing SM cannot tell a per-SM window from a shared one. A
calibration must vary burst size and issuing SMs independently, start from an empty X-Stage, and
record completion.

Design (`calibration_design`):
* burst sizes 4 KiB .. 4 MiB, log-spaced (factor 2: the first stage ends near 16 KiB on the
  H200, and t0 trades off against `r_fast` unless several sizes sit below that knee);
* SM counts 1 .. all (1, 4, 16, 64, all by default): per-SM and shared windows separate because
  the shared one binds only once `n * c_sm > capacity`;
* experiments per (n_sm, burst): `first` (one burst from an empty X-Stage: t0, the first stage,
  r0, the windows), `periodic` (24 bursts with a compute gap from none to long enough to drain:
  steady state and onset), `two` (two bursts, gap swept across the recovery time: the drain, via
  the slope -1 of the second burst's issue time in the gap);
* completion recorded for every burst (the drain a second way, and the latency).

`synthetic_observations` draws data from known parameters over a design with multiplicative
log-normal noise: the fitter must recover what the design identifies (tests/model).

Example:
    >>> from xstage.model.design import calibration_design
    >>> d = calibration_design(n_sm_max=132)
    >>> sorted({x["experiment"] for x in d})
    ['first', 'periodic', 'two']
"""

from __future__ import annotations

import numpy as np

from xstage.errors import InputError
from xstage.model.data import Observations
from xstage.model.params import PathParams
from xstage.model.predict import predict_rows

KIB = 1024
BURSTS = tuple(4 * KIB * 2**i for i in range(11))
GAPS_NS = (0.0, 2_000.0, 20_000.0, 200_000.0)
PERIODIC_BURSTS = 24
STEADY = (12, 23)


def calibration_design(n_sm_max: int, sm_counts=None, bursts=BURSTS, gaps_ns=GAPS_NS,
                       repeats: int = 1, path: str = "host") -> list[dict]:
    """Launch specifications: experiment, path, n_sm, burst_bytes, gap_ns, n_bursts, spans to record."""
    if n_sm_max < 1:
        raise InputError(f"n_sm_max must be >= 1, got {n_sm_max}")
    if sm_counts is None:
        sm_counts = sorted({n for n in (1, 4, 16, 64) if n < n_sm_max} | {n_sm_max})
    if repeats < 1:
        raise InputError(f"repeats must be >= 1, got {repeats}")
    out = []
    for rep in range(repeats):
        for n in sm_counts:
            for b in bursts:
                out.append(dict(experiment="first", path=path, n_sm=n, burst_bytes=b, gap_ns=0.0, n_bursts=1,
                                spans=[(0, 0)], repeat=rep))
                for g in gaps_ns:
                    out.append(dict(experiment="periodic", path=path, n_sm=n, burst_bytes=b, gap_ns=g,
                                    n_bursts=PERIODIC_BURSTS, spans=[(0, 0), (1, 1), STEADY], repeat=rep))
                    out.append(dict(experiment="two", path=path, n_sm=n, burst_bytes=b, gap_ns=g, n_bursts=2,
                                    spans=[(1, 1)], repeat=rep))
    return out


def design_observations(design: list[dict]) -> Observations:
    """Empty observations (times NaN) laid out as the design's launches and spans."""
    cols: dict[str, list] = {k: [] for k in ("path", "n_sm", "burst_bytes", "gap_ns", "n_bursts", "launch",
                                              "burst_lo", "burst_hi")}
    for launch, d in enumerate(design):
        for lo, hi in d["spans"]:
            for k in ("path", "n_sm", "burst_bytes", "gap_ns", "n_bursts"):
                cols[k].append(d[k])
            cols["launch"].append(launch)
            cols["burst_lo"].append(lo)
            cols["burst_hi"].append(hi)
    n = len(cols["path"])
    nan = np.full(n, np.nan)
    return Observations(
        path=np.array(cols["path"]), n_sm=np.array(cols["n_sm"]), ctas_per_sm=np.ones(n, dtype=int),
        burst_bytes=np.array(cols["burst_bytes"]), gap_ns=np.array(cols["gap_ns"], dtype=float),
        n_bursts=np.array(cols["n_bursts"]), launch=np.array(cols["launch"]), burst_lo=np.array(cols["burst_lo"]),
        burst_hi=np.array(cols["burst_hi"]), n_cta=np.array(cols["n_sm"]), issue_med=nan.copy(),
        issue_p10=nan.copy(), issue_p90=nan.copy(), issue_max=nan.copy(), completion_med=nan.copy(),
        env={"gpu": "synthetic"}, source="synthetic",
    )


def synthetic_observations(params: PathParams, design: list[dict], noise: float = 0.03, seed: int = 0,
                           completion: bool = True) -> Observations:
    """Model predictions over `design`, each multiplied by exp(N(0, noise))."""
    if noise < 0:
        raise InputError(f"noise must be >= 0, got {noise}")
    obs = design_observations(design)
    issue, cpl = predict_rows(params, obs)
    rng = np.random.default_rng(seed)
    obs.issue_med = issue * np.exp(rng.normal(0.0, noise, len(obs)))
    if completion:
        obs.completion_med = cpl * np.exp(rng.normal(0.0, noise, len(obs)))
    return obs
