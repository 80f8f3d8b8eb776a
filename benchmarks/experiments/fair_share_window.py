"""Does a small burst wait behind the other SMs' backlog? The shared window admitted first come or
partitioned among the SMs that hold bytes (`PathParams.admission`), scored burst by burst on
irregular-train traces and, held out, on the regular grid.

Four parameter sets, each under both engines' own admission (`xstage.model.simulate`):
- `embedded first_come`, `embedded fair_share`: the embedded host profile's parameters as they are;
- `refit full`, `refit full_fair`: the calibration split of the committed H200 grid refitted
  (`xstage.probe.report.fit_and_check`, no bootstrap) with first-come and with fair-share admission.
Per trace it prints the per-burst and launch-end errors (`xstage.model.trace`) over the held-out and the
train families, and per set the regular grid's held-out error (the profile's own split).

    PYTHONPATH=src python3 benchmarks/experiments/fair_share_window.py -o DIR TRACE.csv [TRACE.csv ...]

Writes `DIR/scores.json` and the two refitted profiles `DIR/refit-*.json` (never over existing files).
The two fits take minutes on two cores; each trace takes seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from xstage.model import load_default_profile
from xstage.model import trace as T
from xstage.model.fit import weighted_quantile
from xstage.model.predict import predict_rows
from xstage.model.profile import Profile
from xstage.probe.analysis import read_summary
from xstage.probe.report import _fit_rows, fit_and_check, holdout_split, observations_from_rows, pool_for_fit
from xstage.probe.trains import split

SUMMARY = Path(__file__).resolve().parents[2] / "src/xstage/data/h200-host-probe-summary.csv"


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


def _regular(rows, params) -> dict:
    """Held-out and calibration error of the CTA-median issue time on the committed H200 grid."""
    obs = observations_from_rows(pool_for_fit(_fit_rows(rows, "host")), source="h200 grid")
    keys = obs.config_keys()
    _, held = holdout_split(obs.configs(), {k for k, nb in zip(keys, obs.n_bursts) if nb > 1})
    m = np.array([k in set(held) for k in keys])
    out = {}
    for name, sel in (("heldout", obs.select(m)), ("calibration", obs.select(~m))):
        rel = np.abs(predict_rows(params, sel)[0] / sel.issue_med - 1.0)
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
    out = Path(args.out)
    written = {"scores": out / "scores.json", "full": out / "refit-full.json",
               "full_fair": out / "refit-full_fair.json"}
    if any(p.exists() for p in written.values()):
        sys.exit(f"{out}: holds an earlier run's files; choose another -o")
    rows = read_summary(SUMMARY)
    emb = load_default_profile("host").params
    sets = {"embedded first_come": emb, "embedded fair_share": emb.replace(admission="fair_share")}
    profiles = {}
    for structure in ("full", "full_fair"):
        t0 = time.time()
        profiles[structure] = fit_and_check(rows, "host", bootstrap=0, structure=structure)["profile"]
        sets[f"refit {structure}"] = Profile.from_dict(profiles[structure]).params
        print(f"refit {structure}: {time.time() - t0:.0f} s", flush=True)
    res: dict = {"sets": {k: p.to_dict() for k, p in sets.items()}, "traces": {}, "regular": {}}
    for path in args.traces:
        tr = T.read_trace(path)
        res["traces"][path] = {}
        for name, params in sets.items():
            s = T.score_trace(tr, params, engine="fast")
            sp = _splits(s)
            res["traces"][path][name] = {"summary": s.summary(), "by_burst_index": s.by("burst_index"),
                                         "splits": sp}
            print(f"{path}: {name:20s} " + "; ".join(
                f"{k} per burst {100 * v['bursts']:.1f}%, launch end {100 * v['end']:.1f}%" for k, v in sp.items()),
                flush=True)
    for name, params in sets.items():
        r = res["regular"][name] = _regular(rows, params)
        print(f"regular H200 grid, {name:20s}: held-out {100 * r['heldout']['median']:.1f}% (p90 "
              f"{100 * r['heldout']['p90']:.1f}%), calibration {100 * r['calibration']['median']:.1f}%")
    out.mkdir(parents=True, exist_ok=True)
    for structure, prof in profiles.items():
        written[structure].write_text(json.dumps(prof, indent=1) + "\n")
    written["scores"].write_text(json.dumps(res, indent=1, default=float))


if __name__ == "__main__":
    main()
