"""From long-format probe CSVs to summary rows, experiment figures and plots.

`summarise_dir(out_dir)` turns every `raw/<sweep>.csv` into summary rows
(`xstage.model.data.SUMMARY_COLUMNS` plus `sweep`): per launch and burst index, the CTA median,
p10, p90 and max of the issue time and the median completion. `experiments(summary)` reduces
them (median over launches) to what each sweep is for:

- `first`: first-burst issue time per (n_sm, burst_bytes), and the aggregate issue rate;
- `periodic`: per (n_sm, burst, gap): burst-0 issue, the onset index (first burst whose issue time
  exceeds twice burst 0's plus 200 ns; None when no burst does: never backpressured, or already
  backpressured in burst 0) and the steady issue time (median over the second half);
- `twoburst`: per (n_sm, burst): the slope of the second burst's issue time against the measured
  gap where the second burst is backpressured (more than 20% above the smaller of burst 0's time
  and its own after the longest gap; the model says exactly -1), and the gap at which the second
  burst is back within 20% of the first (None when it never was 20% above it);
- `completion`: per n_sm a line through (aggregate bytes, completion): drain rate = 1/slope,
  latency = intercept;
- `knobs`, `peers`: issue times side by side.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from xstage.errors import InputError
from xstage.model.data import (
    ENV_COLUMNS,
    LONG_COLUMNS,
    PEER_MODES,
    SUMMARY_COLUMNS,
    as_float,
    observations_from_rows,
    summarise,
)
from xstage.results.io import cell_count, read_table, write_csv_atomic
from xstage.results.plots import plot_lines

SUMMARY_FILE_COLUMNS = ["sweep"] + SUMMARY_COLUMNS
ONSET_FACTOR = 2.0
ONSET_MARGIN_NS = 200.0
RECOVERED_FACTOR = 1.2


def summarise_raw(out_dir, progress=None) -> list[dict]:
    """Summary rows of every `raw/*.csv` under `out_dir` (with a `sweep` column), every file read and
    checked (`xstage.results.io.read_table`, `xstage.model.data.summarise`); writes nothing.
    `progress(done, total)` follows the files."""
    out_dir = Path(out_dir)
    files = sorted((out_dir / "raw").glob("*.csv"))
    if not files:
        raise InputError(f"probe output {out_dir}: no raw/*.csv to analyse")
    summary = []
    for i, f in enumerate(files):
        table = read_table(f, {"probe-long": LONG_COLUMNS}, what="probe data")
        summary += [{"sweep": f.stem, **r} for r in summarise(table.rows, f"probe data {f}", table.lines)]
        if progress:
            progress(i + 1, len(files))
    return summary


def summarise_dir(out_dir, progress=None) -> list[dict]:
    """`summarise_raw`, then summary.csv written with its rows (after every file was checked)."""
    summary = summarise_raw(out_dir, progress)
    write_csv_atomic(Path(out_dir) / "summary.csv", summary, SUMMARY_FILE_COLUMNS)
    return summary


def read_summary(path) -> list[dict]:
    """Summary rows from a summary.csv, numbers as floats/ints where the columns are numeric; every
    value checked as the fit reads it (`xstage.model.data.observations_from_rows`) and the kernel
    shape's columns as integers, errors naming the file, line and column."""
    table = read_table(path, {"probe-summary": SUMMARY_FILE_COLUMNS[: -len(ENV_COLUMNS)]}, what="probe summary")
    source = f"probe summary {table.path}"
    observations_from_rows(table.rows, source, table.lines)
    for r, line in zip(table.rows, table.lines):
        at = f"{source}, line {line}"
        for c, lo in (("warps", 1), ("vector_bytes", 1), ("gap_iters", 0)):
            cell_count(r, c, at, lo)
        if r["peer_mode"] not in PEER_MODES:
            raise InputError(f"{at}, column peer_mode: {r['peer_mode']!r} is not one of {', '.join(PEER_MODES)}")
    return [_typed(r) for r in table.rows]


_INT_FIELDS = ("n_sm", "ctas_per_sm", "warps", "vector_bytes", "burst_bytes", "gap_iters", "launch", "n_bursts",
               "burst_index", "burst_last", "n_cta")
_FLOAT_FIELDS = ("gap_ns", "issue_median_ns", "issue_p10_ns", "issue_p90_ns", "issue_max_ns",
                 "completion_median_ns")


def _typed(r: dict) -> dict:
    out = dict(r)
    for c in _INT_FIELDS:
        if c in out and out[c] not in ("", None):
            out[c] = int(float(out[c]))
    for c in _FLOAT_FIELDS:
        if c in out:
            out[c] = as_float(out[c])
    return out


def _group(rows, keys):
    groups = defaultdict(list)
    for r in rows:
        groups[tuple(r[k] for k in keys)].append(r)
    return dict(sorted(groups.items()))


def _med(rows, col) -> float:
    vals = [r[col] for r in rows if not math.isnan(r[col])]
    return float(np.median(vals)) if vals else math.nan


def _burst_medians(rows) -> dict[int, dict]:
    """Per burst index: issue/completion/gap medians over launches."""
    return {k: {"issue_ns": _med(rs, "issue_median_ns"), "p90_ns": _med(rs, "issue_p90_ns"),
                "completion_ns": _med(rs, "completion_median_ns"), "gap_ns": _med(rs, "gap_ns")}
            for (k,), rs in _group(rows, ["burst_index"]).items()}


def _first(rows):
    out = []
    for (n, b, c, w, v), rs in _group(rows, ["n_sm", "burst_bytes", "ctas_per_sm", "warps", "vector_bytes"]).items():
        m = _burst_medians(rs)[0]
        out.append({"n_sm": n, "burst_bytes": b, "ctas_per_sm": c, "warps": w, "vector_bytes": v,
                    "issue_ns": m["issue_ns"], "issue_p90_ns": m["p90_ns"],
                    "agg_GBps": n * c * b / m["issue_ns"] if m["issue_ns"] > 0 else math.nan})
    return out


def _periodic(rows):
    out = []
    for (n, b, g), rs in _group(rows, ["n_sm", "burst_bytes", "gap_iters"]).items():
        per = _burst_medians(rs)
        ks = sorted(per)
        i0 = per[0]["issue_ns"]
        onset = next((k for k in ks[1:] if per[k]["issue_ns"] > ONSET_FACTOR * i0 + ONSET_MARGIN_NS), None)
        steady = float(np.median([per[k]["issue_ns"] for k in ks[len(ks) // 2:]]))
        gaps = [per[k]["gap_ns"] for k in ks[1:]]
        out.append({"n_sm": n, "burst_bytes": b, "gap_iters": g,
                    "gap_ns": float(np.median(gaps)) if gaps else math.nan, "n_bursts": len(ks),
                    "issue0_ns": i0, "onset_index": onset, "steady_ns": steady})
    return out


def _twoburst(rows):
    out = []
    for (n, b), rs in _group(rows, ["n_sm", "burst_bytes"]).items():
        pts = []
        for (_g,), grs in _group(rs, ["gap_iters"]).items():
            per = _burst_medians(grs)
            if 1 in per:
                pts.append((per[1]["gap_ns"], per[1]["issue_ns"], per[0]["issue_ns"]))
        pts.sort()
        i0 = float(np.median([p[2] for p in pts]))
        # Backpressured: above the free issue time, the smaller of burst 0's (stalled itself when
        # the burst overflows the windows) and the second burst's after the longest gap.
        free = min(i0, pts[-1][1])
        bp = [(g, t) for g, t, _ in pts if t > RECOVERED_FACTOR * free and g > 0]
        slope = r2 = math.nan
        if len(bp) >= 3:
            x, y = np.array(bp).T
            slope, icpt = np.polyfit(x, y, 1)
            resid = y - (slope * x + icpt)
            r2 = 1.0 - float(resid @ resid) / max(float(((y - y.mean()) ** 2).sum()), 1e-30)
        recovered = None
        if pts[0][1] > RECOVERED_FACTOR * i0:
            recovered = next((g for g, t, _ in pts if t <= RECOVERED_FACTOR * i0), None)
        out.append({"n_sm": n, "burst_bytes": b, "issue0_ns": i0, "points_backpressured": len(bp),
                    "slope": float(slope), "r2": float(r2), "recovery_gap_ns": recovered,
                    "points": [{"gap_ns": g, "issue2_ns": t} for g, t, _ in pts]})
    return out


def _completion(rows):
    out = []
    for (n,), rs in _group(rows, ["n_sm"]).items():
        pts = []
        for (b,), grs in _group(rs, ["burst_bytes"]).items():
            c = _burst_medians(grs)[0]["completion_ns"]
            if not math.isnan(c):
                pts.append((n * b, c))
        d = lat = math.nan
        if len(pts) >= 2:
            x, y = np.array(pts, dtype=float).T
            slope, lat = np.polyfit(x, y, 1)
            d = 1e9 / slope if slope > 0 else math.nan
        out.append({"n_sm": n, "drain_Bps": float(d), "latency_ns": float(lat),
                    "points": [{"agg_bytes": int(a), "completion_ns": c} for a, c in pts]})
    return out


def _peers(rows):
    out = []
    for (m, n, b, nb), rs in _group(rows, ["peer_mode", "n_sm", "burst_bytes", "n_bursts"]).items():
        per = _burst_medians(rs)
        ks = sorted(per)
        out.append({"peer_mode": m, "n_sm": n, "burst_bytes": b, "n_bursts": nb, "issue0_ns": per[0]["issue_ns"],
                    "steady_ns": float(np.median([per[k]["issue_ns"] for k in ks[len(ks) // 2:]]))})
    return out


_REDUCERS = {"first": _first, "knobs": _first, "periodic": _periodic, "twoburst": _twoburst,
             "completion": _completion, "peers": _peers}


def experiments(summary: list[dict]) -> dict:
    """Per sweep present in `summary`, its reduced figures (see the module docstring)."""
    rows = [_typed(r) if isinstance(r.get("n_sm"), str) else r for r in summary]
    return {s: _REDUCERS[s](rs) for (s,), rs in _group(rows, ["sweep"]).items() if s in _REDUCERS}


def plot_experiments(exp: dict, out_dir) -> list[Path]:
    """One PNG per experiment under `out_dir/plots`."""
    plots = Path(out_dir) / "plots"
    made = []
    if exp.get("first"):
        made.append(plot_lines(exp["first"], "burst_bytes", "issue_ns", ["n_sm"], plots / "first_burst.png",
                               title="first-burst issue time", xlabel="burst bytes per CTA",
                               ylabel="issue time (ns)", logx=True, logy=True))
    if exp.get("periodic"):
        made.append(plot_lines(exp["periodic"], "gap_ns", "steady_ns", ["n_sm", "burst_bytes"],
                               plots / "periodic_steady.png", title="periodic bursts: steady issue time vs gap",
                               xlabel="measured gap (ns)", ylabel="steady issue time (ns)", logy=True))
    if exp.get("twoburst"):
        pts = [{"n_sm": e["n_sm"], "burst_bytes": e["burst_bytes"], **p} for e in exp["twoburst"]
               for p in e["points"]]
        made.append(plot_lines(pts, "gap_ns", "issue2_ns", ["n_sm", "burst_bytes"], plots / "two_burst.png",
                               title="second-burst issue time vs gap (model: slope -1 while backpressured)",
                               xlabel="measured gap (ns)", ylabel="issue time of burst 2 (ns)"))
    if exp.get("completion"):
        pts = [{"n_sm": e["n_sm"], **p} for e in exp["completion"] for p in e["points"]]
        made.append(plot_lines(pts, "agg_bytes", "completion_ns", ["n_sm"], plots / "completion.png",
                               title="remote-visible completion vs aggregate burst", xlabel="bytes (all SMs)",
                               ylabel="completion (ns)", logx=True, logy=True))
    return made
