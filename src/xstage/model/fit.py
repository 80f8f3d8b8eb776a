"""Fit Burst-Gap parameters to measurements, with intervals, cross-checks and held-out error.

Problem: from CTA-median issue (and, when recorded, completion) times of many launches of one
path, estimate `PathParams`, say how sure each estimate is and whether the data can identify it at
all, and judge the model on configurations it was not fitted on.

Algorithm:
* Robust least squares (`scipy.optimize.least_squares`, soft-L1 loss) on relative residuals
  `log(pred / meas)` (symmetric: a 10x over- and under-prediction weigh alike), each configuration
  (path, n_sm, burst_bytes) weighing equally whatever its number of rows. Parameters are
  log-parametrised (`r_fast = r0 + e^x`, `spread = 1 + e^x`).
* Two stages: equal sharing first (closed forms, cheap, several starts), then, for structures that
  include unequal sharing, every parameter together through the simulator from the best start.
* Identifiability from the Jacobian at the optimum: a parameter whose relative standard error
  exceeds `IDENT_MAX_REL_SE` (or that leaves every prediction unchanged) is reported as not
  identified by the data; the two windows also need backpressure at more than one SM count, in
  the regime where each binds (`n c_sm < capacity` for the per-SM one, `>=` for the shared one).
* Bootstrap: resample configurations with replacement, refit starting from the full-data optimum
  (a local refit: it misses other optima), 2.5/97.5 percentiles widened to contain the point
  estimate, called 95% only with at least 20 rounds (`xstage.model.intervals`). Round `r` draws
  from its own generator `(seed, r)`, so finished rounds can be kept (`BootstrapStore`, keyed by
  `fit_key`: a hash of the data and the fit options) and a rerun computes only the missing ones,
  with the same result as an uninterrupted run.
* Cross-checks: the drain from the steep first-burst slope (and from completion times when
  present) against the fitted one; the second-burst issue time's slope in the gap under
  backpressure (the model says exactly -1); Little's law `C / D >= latency`.
* Leave-one-configuration-out (`xstage.model.heldout.evaluate_loco`): each configuration with all its
  gaps and repeats is held out in turn, the rest fitted, and the held-out CTA medians predicted; the
  median and p90 of the relative error pool the rows with every configuration weighing equally.

Example:
    >>> from xstage.model.data import load_reference_data
    >>> from xstage.model.fit import fit_path
    >>> obs = load_reference_data().for_path("host")
    >>> res = fit_path(obs, structure="fast", bootstrap=0)
    >>> 40e9 < res.params.r0 < 60e9
    True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from xstage.errors import InputError
from xstage.model import closed_form as cf
from xstage.model import intervals as iv
from xstage.model.data import Observations
from xstage.model.params import NS, PathParams, clamp
from xstage.model.predict import DEFAULT_CLASSES, predict_rows
from xstage.version import __version__

STRUCTURES = {
    "base": ("t0", "r0", "drain", "c_sm", "capacity"),
    "fast": ("t0", "r0", "drain", "c_sm", "capacity", "r_fast", "b_fast"),
    "full": ("t0", "r0", "drain", "c_sm", "capacity", "r_fast", "b_fast", "spread"),
    "full_fair": ("t0", "r0", "drain", "c_sm", "capacity", "r_fast", "b_fast", "spread"),
}
# A structure is its free parameters and how the SMs take the shared window (`PathParams.admission`).
ADMISSION = {"full_fair": "fair_share"}
DEFAULT_STRUCTURE = "full"
IDENT_MAX_REL_SE = 0.25
MIN_CONFIGS = 3
F_SCALE = 0.1


@dataclasses.dataclass
class FitResult:
    """Fitted parameters and everything said about them."""

    params: PathParams
    fitted: tuple[str, ...]
    identified: dict[str, bool]
    rel_se: dict[str, float]
    intervals: dict[str, tuple[float, float]]
    residuals: dict
    cross_checks: dict
    n_configs: int
    n_rows: int
    structure: str
    interval_info: dict = dataclasses.field(default_factory=dict)


def _encode(p: PathParams, names) -> np.ndarray:
    out = []
    for n in names:
        if n == "r_fast":
            out.append(math.log(max(p.r_fast - p.r0, 1e-3 * p.r0)))
        elif n == "spread":
            out.append(math.log(max(p.spread - 1.0, 1e-3)))
        elif n == "t0":
            out.append(math.log(max(p.t0, 1e-3)))
        elif n == "b_fast":
            out.append(math.log(max(p.b_fast, 1.0)))
        else:
            v = getattr(p, n)
            out.append(math.log(v if math.isfinite(v) else 1e15))
    return np.array(out)


def _decode(x: np.ndarray, names, base: PathParams) -> PathParams:
    vals = {}
    for n, v in zip(names, x):
        e = math.exp(min(float(v), 60.0))
        vals[n] = e
    if "r_fast" in vals:
        vals["r_fast"] = vals.get("r0", base.r0) + vals["r_fast"]
    if "spread" in vals:
        vals["spread"] = 1.0 + vals["spread"]
    return base.replace(**{n: clamp(n, v) for n, v in vals.items()})


def config_weights(obs: Observations) -> np.ndarray:
    """Row weights that give every configuration the same total weight 1."""
    keys = obs.config_keys()
    counts: dict = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    return np.array([1.0 / counts[k] for k in keys])


def _targets(obs: Observations):
    w = config_weights(obs)
    has_c = ~np.isnan(obs.completion_med)
    return w, has_c


def _residual_fn(obs: Observations, names, base: PathParams, classes: int) -> Callable:
    w, has_c = _targets(obs)
    sw = np.sqrt(w)

    def fn(x):
        p = _decode(x, names, base)
        pred, cpl = predict_rows(p, obs, classes)
        r = np.log(pred / obs.issue_med) * sw
        if has_c.any():
            rc = np.log(cpl[has_c] / obs.completion_med[has_c]) * sw[has_c]
            r = np.concatenate([r, rc])
        return r

    return fn


def _first_burst_curve(obs: Observations, n: int) -> tuple[np.ndarray, np.ndarray]:
    """First-burst CTA-median issue time against bytes per SM, for launches of `n` SMs."""
    nb = obs.burst_bytes * obs.ctas_per_sm
    rows = (obs.burst_lo == 0) & (obs.n_sm == n)
    sizes = np.unique(nb[rows])
    return sizes, np.array([np.median(obs.issue_med[rows & (nb == b)]) for b in sizes])


def initial_guess(obs: Observations) -> PathParams:
    """Starting values read off first-burst curves: slopes for rates, intercepts for t0."""
    n_lo, n_hi = int(obs.n_sm.min()), int(obs.n_sm.max())
    b, t = _first_burst_curve(obs, n_lo)
    if len(b) >= 3:
        r_fast = (b[1] - b[0]) / max(t[1] - t[0], 1e-3) / NS
        r0 = (b[-1] - b[-2]) / max(t[-1] - t[-2], 1e-3) / NS
        t0 = max(1.0, t[0] - b[0] / r_fast / NS)
    else:
        r0 = float(np.median(b / t)) / NS
        r_fast, t0 = 4 * r0, max(1.0, 0.3 * float(t.min()))
    r_fast = max(r_fast, 1.5 * r0)
    bh, th = _first_burst_curve(obs, n_hi)
    drain = n_hi * (bh[-1] - bh[-2]) / max(th[-1] - th[-2], 1e-3) / NS if len(bh) >= 2 else r0
    nb = obs.burst_bytes * obs.ctas_per_sm
    guess = dict(r0=r0, c_sm=float(np.median(nb)), drain=max(drain, 1e-3 * r0),
                 capacity=float(np.median(obs.n_sm * nb)), t0=t0, latency=0.0, r_fast=r_fast, b_fast=float(np.min(nb)))
    return PathParams(**{n: clamp(n, float(v)) for n, v in guess.items()})


def _window_grid(obs: Observations, p0: PathParams, names) -> list[PathParams]:
    """Starts over a log grid of the two windows: their cost surface has flat regions and kinks."""
    nb = obs.burst_bytes * obs.ctas_per_sm
    agg = obs.n_sm * nb
    c_vals = np.geomspace(nb.min(), nb.max(), 6)
    cap_vals = np.geomspace(agg.min(), agg.max(), 6)
    out = [p0.replace(c_sm=float(c), capacity=float(cap)) for c in c_vals for cap in cap_vals]
    if "b_fast" in names:
        out += [s.replace(b_fast=4 * p0.b_fast) for s in out]
    return out


def _cost(fn, x) -> float:
    z = (fn(x) / F_SCALE) ** 2
    return float(np.sum(np.sqrt(1.0 + z) - 1.0))


def _solve(fn, x0, max_nfev):
    from scipy.optimize import least_squares  # scipy costs 0.4 s of `import xstage` when imported at the top

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return least_squares(fn, x0, loss="soft_l1", f_scale=F_SCALE, x_scale=1.0, diff_step=1e-3,
                             max_nfev=max_nfev)


def _free_names(obs: Observations, structure: str) -> tuple[str, ...]:
    if structure not in STRUCTURES:
        raise InputError(f"structure must be one of {sorted(STRUCTURES)}, got {structure!r}")
    names = STRUCTURES[structure]
    if (~np.isnan(obs.completion_med)).any():
        names = names + ("latency",)
    return names


N_BEST_STARTS = 4
SPREAD_STARTS = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


def _fit_point(obs: Observations, names, classes: int, start: PathParams | None, max_nfev: int,
               admission: str = "first_come"):
    """The point fit; without `start`, from a grid of starts with the given `admission` (a start carries
    its own)."""
    base_names = tuple(n for n in names if n != "spread")
    if start is None:
        p0 = initial_guess(obs).replace(admission=admission)
        if "latency" in names:
            p0 = p0.replace(latency=max(1.0, float(np.nanmedian(obs.completion_med - obs.issue_med))))
        if "b_fast" not in names:
            p0 = p0.replace(b_fast=0.0, r_fast=math.inf)
        starts = _window_grid(obs, p0, base_names)
        fns = [_residual_fn(obs, base_names, s, classes) for s in starts]
        costs = [_cost(f, _encode(s, base_names)) for f, s in zip(fns, starts)]
        # Windows that never bind tie in cost; keep one start per distinct cost.
        picked: list[int] = []
        for j in np.argsort(costs):
            if all(abs(costs[j] - costs[i]) > 1e-9 * costs[i] for i in picked):
                picked.append(int(j))
            if len(picked) == N_BEST_STARTS:
                break
        best = None
        for j in picked:
            sol = _solve(fns[j], _encode(starts[j], base_names), max_nfev)
            if best is None or sol.cost < best[0].cost:
                best = (sol, _decode(sol.x, base_names, starts[j]))
        if "spread" not in names:
            return best[1], best[0]
        # Unequal sharing lowers the CTA median, which equal sharing can only mimic with a faster
        # drain: restart the drain from the steep-slope reading and scan the spread (bumpy cost).
        cands = [best[1].replace(spread=s, drain=d) for s in SPREAD_STARTS
                 for d in (best[1].drain, min(best[1].drain, p0.drain))]
        fn = _residual_fn(obs, names, cands[0], classes)
        start = min(cands, key=lambda c: _cost(fn, _encode(c, names)))
    fn = _residual_fn(obs, names, start, classes)
    sol = _solve(fn, _encode(start, names), max_nfev)
    return _decode(sol.x, names, start), sol


def _identifiability(sol, names) -> tuple[dict, dict]:
    jac = np.asarray(sol.jac)
    dof = max(1, jac.shape[0] - jac.shape[1])
    sigma2 = max(2.0 * sol.cost / dof, 1e-12)
    u, s, vt = np.linalg.svd(jac, full_matrices=False)
    tiny = s <= s.max() * 1e-8 if s.size else np.array([], bool)
    inv = np.where(tiny, 0.0, 1.0 / np.where(tiny, 1.0, s) ** 2)
    cov = (vt.T * inv) @ vt * sigma2
    rel_se, ident = {}, {}
    for j, n in enumerate(names):
        col = float(np.linalg.norm(jac[:, j]))
        null = tiny.any() and float(np.abs(vt[tiny][:, j]).max()) > 0.1
        se = math.inf if (col < 1e-9 or null) else math.sqrt(max(cov[j, j], 0.0))
        rel_se[n] = se
        ident[n] = se <= IDENT_MAX_REL_SE
    return rel_se, ident


def _window_identification(obs: Observations, params: PathParams, ident: dict) -> None:
    """Windows are told apart only by backpressure at several SM counts, in both regimes.

    n symmetric SMs see the window `min(c_sm, capacity / n)`: backpressure at a single SM count pins
    only that minimum; the per-SM window shows where `n c_sm < capacity`, the shared one elsewhere.
    """
    nb = obs.burst_bytes * obs.ctas_per_sm
    loaded = set()
    for n in sorted(set(obs.n_sm.tolist())):
        b = float(nb[obs.n_sm == n].max())
        if cf.stall(params.replace(spread=1.0), b, n_sm=int(n)) > 0:
            loaded.add(int(n))
    per_sm = any(n * params.c_sm < params.capacity for n in loaded)
    shared = any(n * params.c_sm >= params.capacity for n in loaded)
    for name, seen in (("c_sm", per_sm and len(loaded) > 1), ("capacity", shared and len(loaded) > 1)):
        if name in ident and not seen:
            ident[name] = False


def _check_fit_input(obs: Observations) -> None:
    if not isinstance(obs, Observations) or len(obs) == 0:
        raise InputError("data: no rows to fit")
    paths = set(obs.path.tolist())
    if len(paths) != 1:
        raise InputError(f"data: fit one path at a time (--path); the data has {sorted(paths)}")
    n_cfg = len(obs.configs())
    if n_cfg < MIN_CONFIGS:
        raise InputError(f"data: need at least {MIN_CONFIGS} configurations (path, n_sm, burst_bytes) to fit, "
                         f"got {n_cfg}")


def fit_point(obs: Observations, structure: str = DEFAULT_STRUCTURE, classes: int = DEFAULT_CLASSES,
              start: PathParams | None = None, max_nfev: int = 200) -> PathParams:
    """Point estimate only (what LOCO and bootstrap call)."""
    _check_fit_input(obs)
    admission = ADMISSION.get(structure, "first_come")
    return _fit_point(obs, _free_names(obs, structure), classes, start, max_nfev, admission)[0]


def fit_path(obs: Observations, structure: str = DEFAULT_STRUCTURE, bootstrap: int = 0,
             classes: int = DEFAULT_CLASSES, seed: int = 0, progress: Callable | None = None,
             max_nfev: int = 200, store: BootstrapStore | None = None,
             on_point_fit: Callable[[float], None] | None = None, workers: int = 1) -> FitResult:
    """Fit one path's parameters; `bootstrap` rounds of configuration resampling give the intervals.

    `progress(done, total)` follows the bootstrap rounds this call runs; `store` keeps finished rounds
    (its key must be `fit_key(obs, structure, classes, seed, max_nfev)`); `on_point_fit(seconds)` is
    called after the point fit, before the bootstrap; `workers > 1` refits the rounds in that many
    spawned processes (each round draws from its own generator, so the result does not change).
    """
    _check_fit_input(obs)
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
        raise InputError(f"bootstrap must be an integer number of rounds >= 0, got {bootstrap!r}")
    names = _free_names(obs, structure)
    if store is not None and store.key != fit_key(obs, structure, classes, seed, max_nfev):
        raise ValueError("fit_path: the bootstrap store belongs to other data or fit options")
    t0 = time.perf_counter()
    params, sol = _fit_point(obs, names, classes, None, max_nfev, ADMISSION.get(structure, "first_come"))
    if on_point_fit:
        on_point_fit(time.perf_counter() - t0)
    rel_se, ident = _identifiability(sol, names)
    _window_identification(obs, params, ident)
    pred, cpl = predict_rows(params, obs, classes)
    rel = pred / obs.issue_med - 1.0
    w = config_weights(obs)
    residuals = {
        "issue_median_rel": weighted_quantile(np.abs(rel), w, 0.5),
        "issue_p90_rel": weighted_quantile(np.abs(rel), w, 0.9),
        "issue_bias_rel": float(np.average(rel, weights=w)),
        "rows": int(len(obs)),
    }
    has_c = ~np.isnan(obs.completion_med)
    if has_c.any():
        rc = np.abs(cpl[has_c] / obs.completion_med[has_c] - 1.0)
        residuals["completion_median_rel"] = weighted_quantile(rc, w[has_c], 0.5)
    draws = bootstrap_draws(obs, params, names, bootstrap, classes, seed, progress, max_nfev, store, workers)
    intervals, widened = {}, []
    for n, v in draws.items():
        lo, hi, wide = iv.percentile_interval(v, getattr(params, n))
        intervals[n] = (lo, hi)
        if wide:
            widened.append(n)
    return FitResult(params=params, fitted=names, identified=ident, rel_se=rel_se, intervals=intervals,
                     residuals=residuals, cross_checks=cross_checks(obs, params), n_configs=len(obs.configs()),
                     n_rows=len(obs), structure=structure, interval_info=iv.describe(bootstrap, widened))


def fit_key(obs: Observations, structure: str = DEFAULT_STRUCTURE, classes: int = DEFAULT_CLASSES,
            seed: int = 0, max_nfev: int = 200) -> str:
    """Hash of the data and the fit options: bootstrap rounds with the same key are interchangeable."""
    h = hashlib.sha256()
    opts = {"xstage": __version__, "names": list(_free_names(obs, structure)), "structure": structure,
            "classes": classes, "seed": seed, "max_nfev": max_nfev}
    h.update(json.dumps(opts, sort_keys=True).encode())
    for f in dataclasses.fields(obs):
        v = getattr(obs, f.name)
        if isinstance(v, np.ndarray):
            h.update(f.name.encode())
            h.update("\x00".join(map(str, v.tolist())).encode() if v.dtype.kind in "OUS"
                     else np.ascontiguousarray(v, dtype=np.float64).tobytes())
    return h.hexdigest()[:24]


class BootstrapStore:
    """Finished bootstrap rounds of one fit, kept in a JSON-lines file so that a rerun resumes.

    Line 1 is `{"format", "key"}`; each further line `{"round": r, "params": {name: value}}`, appended
    and flushed as the round finishes (a line cut by an interrupt is ignored). A file with another key
    (other data or options) is replaced when the first new round is written; `discarded` counts its
    rounds.
    """

    FORMAT = "xstage-bootstrap/1"

    def __init__(self, path, key: str):
        self.path, self.key = Path(path), key
        self.rounds: dict[int, dict] = {}
        self.discarded = 0
        self._file = None
        lines = []
        if self.path.is_file():
            try:
                lines = self.path.read_text().splitlines()
            except (OSError, UnicodeDecodeError):
                lines = []
        head = _json_line(lines[0]) if lines else None
        if isinstance(head, dict) and head.get("format") == self.FORMAT and head.get("key") == key:
            for line in lines[1:]:
                rec = _json_line(line)
                if (isinstance(rec, dict) and isinstance(rec.get("round"), int)
                        and isinstance(rec.get("params"), dict)):
                    self.rounds[rec["round"]] = {k: float(v) for k, v in rec["params"].items()}
        elif lines:
            self.discarded = max(0, len(lines) - 1)

    def add(self, r: int, values: dict) -> None:
        if self._file is None:
            # Start the file afresh (header and the rounds kept so far), then append.
            text = json.dumps({"format": self.FORMAT, "key": self.key}) + "\n" + "".join(
                json.dumps({"round": k, "params": v}) + "\n" for k, v in sorted(self.rounds.items()))
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)
            self._file = open(self.path, "a")  # held open across rounds, closed in close()
        self.rounds[r] = {k: float(v) for k, v in values.items()}
        self._file.write(json.dumps({"round": r, "params": self.rounds[r]}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        """Delete the file (after the profile it served is written)."""
        self.close()
        self.path.unlink(missing_ok=True)


def _json_line(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _bootstrap_round(obs: Observations, params: PathParams, names, classes: int, seed: int, r: int,
                     max_nfev: int) -> dict:
    """One bootstrap refit: configurations resampled with generator `(seed, r)`, refit from `params`."""
    rng = np.random.default_rng([seed, r])
    keys = obs.config_keys()
    cfgs = obs.configs()
    rows_of = {c: np.array([i for i, k in enumerate(keys) if k == c]) for c in cfgs}
    pick = rng.integers(0, len(cfgs), len(cfgs))
    idx = np.concatenate([rows_of[cfgs[j]] for j in pick])
    sample = obs.select(idx)
    # Resampled configurations repeat; distinct launch ids keep their simulated runs apart.
    sample.launch = sample.launch + np.repeat(np.arange(len(pick)), [len(rows_of[cfgs[j]]) for j in pick]) * 10**6
    p, _ = _fit_point(sample, names, classes, params, max_nfev)
    return {n: float(getattr(p, n)) for n in names}


def _bootstrap_job(job) -> tuple[int, dict]:
    obs, params, names, classes, seed, r, max_nfev = job
    return r, _bootstrap_round(obs, params, names, classes, seed, r, max_nfev)


def bootstrap_draws(obs: Observations, params: PathParams, names, rounds: int, classes: int, seed: int = 0,
                    progress: Callable | None = None, max_nfev: int = 200,
                    store: BootstrapStore | None = None, workers: int = 1) -> dict:
    """Each fitted parameter's values over `rounds` bootstrap refits (rounds in `store` are reused);
    `workers > 1` refits them in spawned processes (a script calling it needs the usual
    `if __name__ == "__main__":` guard)."""
    if rounds <= 0:
        return {}
    kept = store.rounds if store is not None else {}
    todo = [r for r in range(rounds) if r not in kept or set(kept[r]) != set(names)]
    values = {r: kept[r] for r in range(rounds) if r not in todo}
    jobs = [(obs, params, names, classes, seed, r, max_nfev) for r in todo]

    def keep(j: int, r: int, v: dict) -> None:
        values[r] = v
        if store is not None:
            store.add(r, v)
        if progress:
            progress(j + 1, len(todo))

    if workers > 1 and len(jobs) > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
            for j, (r, v) in enumerate(pool.imap_unordered(_bootstrap_job, jobs)):
                keep(j, r, v)
    else:
        for j, job in enumerate(jobs):
            keep(j, *_bootstrap_job(job))
    return {n: [values[r][n] for r in range(rounds)] for n in names}


def bootstrap_intervals(obs: Observations, params: PathParams, names, rounds: int, classes: int,
                        seed: int = 0, progress: Callable | None = None, max_nfev: int = 200,
                        store: BootstrapStore | None = None) -> dict:
    """2.5/97.5 percentiles of each fitted parameter over bootstrap refits, widened to contain the
    point estimate (`xstage.model.intervals.percentile_interval`)."""
    draws = bootstrap_draws(obs, params, names, rounds, classes, seed, progress, max_nfev, store)
    return {n: iv.percentile_interval(v, getattr(params, n))[:2] for n, v in draws.items()}


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Quantile `q` of `values` where each value counts with its weight (step interpolation)."""
    values = np.asarray(values, float)
    weights = np.asarray(weights, float)
    ok = ~np.isnan(values)
    values, weights = values[ok], weights[ok]
    if not len(values):
        return math.nan
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][min(int(np.searchsorted(cum, q * cum[-1])), len(values) - 1)])


def cross_checks(obs: Observations, params: PathParams) -> dict:
    """Independent readings of the drain and the model's parameter-free predictions."""
    out: dict = {"drain_fit": params.drain}
    first = obs.burst_lo == 0
    nb = obs.burst_bytes * obs.ctas_per_sm
    n_max = obs.n_sm.max()
    rows = first & (obs.n_sm == n_max)
    sizes = np.unique(nb[rows])
    if len(sizes) >= 2:
        t = [np.median(obs.issue_med[rows & (nb == s)]) for s in sizes[-2:]]
        out["drain_steep_slope"] = float(n_max * (sizes[-1] - sizes[-2]) / max(t[1] - t[0], 1e-9) / NS)
    has_c = ~np.isnan(obs.completion_med) & first & (obs.n_sm == n_max)
    if has_c.any():
        s = nb[has_c]
        if len(np.unique(s)) >= 2:
            slope = np.polyfit(s * n_max, obs.completion_med[has_c], 1)[0]
            out["drain_completion_slope"] = float(1.0 / slope / NS) if slope > 0 else math.nan
    slopes = []
    second = obs.burst_lo == 1
    for cfg in obs.configs():
        m = second & np.array([k == cfg for k in obs.config_keys()])
        if m.sum() < 2:
            continue
        g, t = obs.gap_ns[m], obs.issue_med[m]
        order = np.argsort(g)
        g, t = g[order], t[order]
        b, n = float(nb[m][0]), int(cfg[1])
        free = cf.issue_time(params.replace(c_sm=math.inf, capacity=math.inf), b)
        recovery = cf.recovery_time(params, b, n_sm=n)
        for j in range(len(g)):
            for k in range(j + 1, len(g)):
                # Both second bursts backpressured, both gaps shorter than the first burst's recovery
                # (beyond it the slope is 0), and far enough apart that noise does not swamp the difference.
                if min(t[j], t[k]) > 10 * free and g[k] <= recovery and g[k] - g[j] >= 0.1 * t[j]:
                    slopes.append((t[k] - t[j]) / (g[k] - g[j]))
    if slopes:
        out["second_burst_gap_slope_median"] = float(np.median(slopes))
        out["second_burst_gap_slope_n"] = len(slopes)
    # Little's law on the shared level: the bytes in flight at full drain for one round trip must fit.
    out["capacity_over_drain_ns"] = params.capacity / params.drain / NS
    if params.latency > 0:
        out["littles_law_ok"] = bool(params.capacity / params.drain / NS >= params.latency)
    else:
        out["littles_law_ok"] = None
        out["littles_law_note"] = "no round trip measured (no completion times): not checked"
    return out


def __getattr__(name: str):
    # `xstage.model.fit.evaluate_loco` moved to `xstage.model.heldout` (it imports this module, so
    # the old name resolves on first use); `xstage.model.evaluate_loco` is unchanged.
    if name == "evaluate_loco":
        warnings.warn("xstage.model.fit.evaluate_loco moved to xstage.model.heldout.evaluate_loco",
                      DeprecationWarning, stacklevel=2)
        from xstage.model.heldout import evaluate_loco

        return evaluate_loco
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
