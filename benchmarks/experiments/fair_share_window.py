"""Does a small burst wait behind the other SMs' backlog? The shared window, admitted first come or
partitioned among the SMs that hold bytes, scored burst by burst on irregular-train traces.

The Burst-Gap simulator lets the SMs fill the path's shared window (`capacity`) first come: once it is
full, every issuing SM gets an equal (weighted) slice of the drain, so a 4 KiB burst that starts while
90 SMs are stalled on 1 MiB bursts waits about 90 x 4 KiB / drain. The probe's irregular trains say it
issues at the unloaded pace (~90 ns). This prototype (`FairShare`, the reference engine with one
change) gives each SM that holds bytes or issues its own part of the window, `capacity x w_i / sum w`
(its drain weight `w`; capped at `c_sm`): an SM whose holdings drained below its part during a gap
issues at once. With the embedded host profile's own parameters (no refit), it prints per trace the
per-burst and launch-end errors (`xstage.model.trace`) of both admissions (and of today's with the
drain 5% slower), and, on the regular H200
grid the profile was fitted to, the held-out error of both (the profile's own split).

    PYTHONPATH=src python3 benchmarks/experiments/fair_share_window.py -o DIR TRACE.csv [TRACE.csv ...]

Writes `DIR/scores.json` (never over an existing file). The prototype is Python (the reference engine,
minutes per trace); the fast engine is unchanged.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from xstage.model import load_default_profile
from xstage.model import simulate as S
from xstage.model import trace as T
from xstage.model.fit import weighted_quantile
from xstage.probe.analysis import read_summary
from xstage.probe.report import _fit_rows, holdout_split, observations_from_rows, pool_for_fit
from xstage.probe.trains import split

_predict = importlib.import_module("xstage.model.predict")  # the package exports a function of that name
SUMMARY = Path(__file__).resolve().parents[2] / "src/xstage/data/h200-host-probe-summary.csv"


class FairShare(S.PathSimulator):
    """The reference engine with the shared window partitioned by drain weight among active SMs."""

    def _parts(self) -> list[float]:
        p, n = self.params, self.n_sm
        act = [self.phase[i] == S._ISSUING or self.o[i] > S._TOL_B for i in range(n)]
        wsum = sum(self.mult[i] * self.weights[i] for i in range(n) if act[i])
        if not math.isfinite(p.capacity) or wsum == 0:
            return [p.c_sm] * n
        return [min(p.c_sm, p.capacity * self.weights[i] / wsum) for i in range(n)]

    def _rates(self):
        n, o, w, mult = self.n_sm, self.o, self.weights, self.mult
        part = self._part = self._parts()
        a = [(self._rf if self.k[i] > S._TOL_B else self._r0) if self.phase[i] == S._ISSUING else 0.0
             for i in range(n)]
        d = S._waterfill(self._d, [math.inf if o[i] > S._TOL_B else a[i] for i in range(n)], w, mult)
        for i in range(n):
            tol = 1e-9 * part[i] + 1e-3
            if o[i] > part[i] + tol:  # over its part (more SMs became active): wait for the drain
                a[i] = 0.0
            elif a[i] > d[i] and o[i] >= part[i] - tol:
                a[i] = d[i]
        d = S._waterfill(self._d, [math.inf if o[i] > S._TOL_B else a[i] for i in range(n)], w, mult)
        return a, d

    def _move(self, dt, a, d):
        # The parent's step knows the c_sm boundary only: stop where an SM reaches its part as well.
        for i, part in enumerate(self._part):
            net, tol = a[i] - d[i], 1e-9 * part + 1e-3
            if net > 0 and self.o[i] < part - tol:
                dt = min(dt, (part - self.o[i]) / net)
            elif a[i] == 0 and d[i] > 0 and self.o[i] > part + tol:
                dt = min(dt, (self.o[i] - part) / d[i])
        super()._move(dt, a, d)


_SIMULATE = S.simulate_bursts


def simulate_fair(params, programs, start_ns=None, multiplicity=None, weights=None, engine=None):
    """`simulate_bursts` on its reference loop, with `FairShare` in place of `PathSimulator`; `engine`
    is ignored."""
    make = S.path_simulator
    S.path_simulator = lambda p, n, mult, w, engine: FairShare(p, n, mult, w)
    try:
        return _SIMULATE(params, programs, start_ns=start_ns, multiplicity=multiplicity, weights=weights,
                         engine="reference")
    finally:
        S.path_simulator = make


def _splits(score) -> dict:
    """Pooled medians of the per-burst and launch-end errors over each split of the families."""
    b, la = score.bursts, score.launches
    out = {}
    for name in ("heldout", "train"):
        fams = [f for f, s in split()["families"].items() if s == name]
        mb, ml = np.isin(b["family"], fams), np.isin(la["family"], fams)
        out[name] = {"bursts": float(np.median(b["error"][mb])), "end": float(np.median(la["error"][ml])),
                     "n_bursts": int(mb.sum())}
    return out


def _regular(params) -> dict:
    """Held-out and calibration error of the CTA-median issue time on the committed H200 grid."""
    obs = observations_from_rows(pool_for_fit(_fit_rows(read_summary(SUMMARY), "host")), source="h200 grid")
    keys = obs.config_keys()
    _, held = holdout_split(obs.configs(), {k for k, nb in zip(keys, obs.n_bursts) if nb > 1})
    m = np.array([k in set(held) for k in keys])
    out = {}
    for name, sel in (("heldout", obs.select(m)), ("calibration", obs.select(~m))):
        rel = np.abs(_predict.predict_rows(params, sel)[0] / sel.issue_med - 1.0)
        cnt: dict = {}
        for k in sel.config_keys():
            cnt[k] = cnt.get(k, 0) + 1
        w = np.array([1.0 / cnt[k] for k in sel.config_keys()])
        out[name] = {"median": weighted_quantile(rel, w, 0.5), "p90": weighted_quantile(rel, w, 0.9)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    out = Path(args.out) / "scores.json"
    if out.exists():
        sys.exit(f"{out}: exists; choose another -o")
    params = load_default_profile("host").params
    res: dict = {"params": "embedded host profile (H200), no refit", "traces": {}}
    shared_sim = T.simulate_bursts
    for path in args.traces:
        tr = T.read_trace(path)
        res["traces"][path] = {}
        # The third: today's admission with the drain 5% slower (the H100's link against the H200's fit).
        for name, sim, engine, drain in (("shared", shared_sim, "fast", 1.0), ("fair", simulate_fair, "reference", 1.0),
                                         ("shared_drain_x0.95", shared_sim, "fast", 0.95)):
            T.simulate_bursts = sim
            t0 = time.time()
            s = T.score_trace(tr, params.replace(drain=params.drain * drain), engine=engine)
            res["traces"][path][name] = {"summary": s.summary(), "by_burst_index": s.by("burst_index"),
                                         "splits": _splits(s)}
            sp = res["traces"][path][name]["splits"]
            print(f"{path}: {name:6s} " + "; ".join(
                f"{k} per burst {100 * v['bursts']:.1f}%, launch end {100 * v['end']:.1f}%" for k, v in sp.items())
                + f" ({time.time() - t0:.0f} s)", flush=True)
    T.simulate_bursts = shared_sim
    res["regular"] = {"shared": _regular(params)}
    _predict.simulate_bursts = simulate_fair
    res["regular"]["fair"] = _regular(params)
    for name, r in res["regular"].items():
        print(f"regular H200 grid, {name:6s}: held-out {100 * r['heldout']['median']:.1f}% (p90 "
              f"{100 * r['heldout']['p90']:.1f}%), calibration {100 * r['calibration']['median']:.1f}%")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=float))


if __name__ == "__main__":
    main()
