"""Summarise `moe_task_timeline.py`'s per-task timelines, beside the simulator's rate for the same kernel.

Per file: the kernel span, the LINEAR2 tasks' time (p10/p50/p90: on the paced host path it holds the
pacing wait and the issue of the combine rows), and the steady rate at which LINEAR2 tasks finish
(those finishing between the 25th and 75th percentile of LINEAR2 end times, per ms). Orders of one
configuration run the same LINEAR2 tasks with the same rows, so the ratio of their steady rates is the
ratio of the rates at which their combine rows leave. On `host`, the CTAs waiting on the pacer over
the middle half of the kernel, in 5-us bins (a LINEAR2 task counts from its `hbm` twin's median task
time after its start to its end; simulated: its stall and issue segments): p10/p50/p90, the share of
bins with fewer than 2, and the period with the most power. `sim_*`: the same in the
simulated kernel (calibration-shape tile costs, embedded profile; on `host` paced by default with the
interference term, as `link_tiles_check.py`).

    PYTHONPATH=src python3 benchmarks/experiments/moe_task_timeline_check.py DIR/*.npz \\
        --measured-commit COMMIT --out timeline-summary.csv
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from xstage.calibrate.tilemodel import costs_calibrated_on
from xstage.calibrate.tiles import MODEL_SHAPES
from xstage.env import environment
from xstage.model.interference import load_default_interference
from xstage.results.io import write_csv_atomic
from xstage.sched.costs import load_default_costs
from xstage.sched.moe import MoeConfig, moe_work, simulate_remote
from xstage.sched.pacing import resolve_pacing
from xstage.sched.plan import moe_path_params
from xstage.spec.moe import MoeShape, parse_block
from xstage.spec.schedule import LINEAR2

NAME = re.compile(r"(?P<shape>H\d+-I\d+-E\d+-K\d+)-(?P<tokens>\d+)-ep(?P<ep>\d+)-(?P<path>\w+)"
                  r"-(?P<sched>[a-z_]+\d*)\.npz")


def steady_rate(ends_ns: np.ndarray) -> float:
    """Tasks per ms among those ending between the 25th and 75th percentile of end times."""
    lo, hi = np.percentile(ends_ns, [25, 75])
    return float(np.sum((ends_ns >= lo) & (ends_ns <= hi)) / (hi - lo) * 1e6)


BIN_NS = 5000.0


def occupancy_series(intervals, span_ns: float) -> np.ndarray:
    """How many of `intervals` (start, end ns) are open in each BIN_NS bin, on average over the bin."""
    acc = np.zeros(int(span_ns // BIN_NS) + 2)
    for a, b in intervals:
        if b <= a:
            continue
        ia, ib = int(a // BIN_NS), int(b // BIN_NS)
        if ia == ib:
            acc[ia] += (b - a) / BIN_NS
            continue
        acc[ia] += ((ia + 1) * BIN_NS - a) / BIN_NS
        acc[ia + 1:ib] += 1
        acc[ib] += (b - ib * BIN_NS) / BIN_NS
    return acc[:-1]


def queue_stats(intervals, span_ns: float, prefix: str) -> dict:
    w = occupancy_series(intervals, span_ns)
    w = w[len(w) // 4: 3 * len(w) // 4]
    power = np.abs(np.fft.rfft(w - w.mean()))[1:] ** 2
    period = 1.0 / np.fft.rfftfreq(len(w), BIN_NS / 1e3)[1:][int(np.argmax(power))]
    return {f"{prefix}pacer_waiting_p10": round(float(np.percentile(w, 10)), 1),
            f"{prefix}pacer_waiting_p50": round(float(np.median(w)), 1),
            f"{prefix}pacer_waiting_p90": round(float(np.percentile(w, 90)), 1),
            f"{prefix}bins_under_2": round(float(np.mean(w < 2)), 3), f"{prefix}period_us": round(float(period), 1)}


def simulated(shape: str, tokens: int, ep: int, path: str, schedule: str, costs) -> dict:
    """The steady LINEAR2 rate of the simulated kernel: on `host` paced by default with the interference
    term (and its pacer queue), on `hbm` (the other ranks' rows to device memory) unpaced."""
    block = parse_block(None, MoeShape.parse(shape).hidden)
    cfg = MoeConfig.parse(shape, tokens_per_rank=tokens, ep=ep, block_n2=block.block_n2)
    work = moe_work(cfg, schedule, costs, 132)
    if path == "host":
        res = simulate_remote(work, moe_path_params(path), resolve_pacing("default", path, ep),
                              load_default_interference(path))
    else:
        res = simulate_remote(work, moe_path_params(path))
    ends = np.array([end for name, end in res.task_end_ns.items() if name.startswith("linear2.")])
    out = {"sim_l2_rate_per_ms": round(steady_rate(ends), 1)}
    if path == "host":
        waits = [(g.start_ns, g.end_ns) for g in res.segments
                 if g.kind in ("stall", "issue") and g.task.startswith("linear2.")]
        out.update(queue_stats(waits, res.time_ns, "sim_"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--measured-commit", required=True, help="the commit that measured the files")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    costs = costs_calibrated_on(load_default_costs("moe"), MODEL_SHAPES)
    commit = environment()["git_commit"]
    rows = []
    for f in sorted(args.files):
        m = NAME.fullmatch(Path(f).name)
        if m is None:
            raise SystemExit(f"{f}: not a moe_task_timeline.py file name")
        d = np.load(f)
        l2 = d["kind"] == LINEAR2
        t = (d["done_ns"][l2] - d["go_ns"][l2]) / 1e3
        schedule = re.sub(r"^lag(\d+)$", r"lag:\1", m["sched"])
        row = {"shape": m["shape"], "tokens": int(m["tokens"]), "ep": int(m["ep"]), "path": m["path"],
               "schedule": schedule, "span_us": round(float(d["done_ns"].max()) / 1e3, 1),
               "l2_p10_us": round(float(np.percentile(t, 10)), 2), "l2_p50_us": round(float(np.median(t)), 2),
               "l2_p90_us": round(float(np.percentile(t, 90)), 2),
               "l2_rate_per_ms": round(steady_rate(d["done_ns"][l2]), 1)}
        if m["path"] == "host":
            twin = np.load(Path(f).with_name(Path(f).name.replace("-host-", "-hbm-")))
            c = float(np.median((twin["done_ns"] - twin["go_ns"])[twin["kind"] == LINEAR2]))
            row.update(queue_stats(list(zip(d["go_ns"][l2] + c, d["done_ns"][l2])), float(d["done_ns"].max()), ""))
        row.update(simulated(m["shape"], row["tokens"], row["ep"], m["path"], schedule, costs))
        rows.append({**row, "measured_commit": args.measured_commit, "git_commit": commit})
    cols = list(dict.fromkeys(k for r in rows for k in r))
    write_csv_atomic(args.out, [{c: r.get(c, "") for c in cols} for r in rows], cols)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
