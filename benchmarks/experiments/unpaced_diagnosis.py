"""Why are unpaced MoE kernels predicted too fast? Their link throughput and the interference term, per
configuration (CPU only: committed measurements and the simulator).

On the report shapes the model under-predicts unpaced kernels by 16% (median; -27% at 16384 tokens)
while paced ones are within 6% (`benchmarks/results/h200-moe-ab/`). For the same schedule measured
paced and unpaced in run B (`lag:8`, the default pacing against `@off`), this prints:
- the link throughput each achieved: rank 0's remote combine bytes over the kernel time;
- the simulator's prediction of both, with the interference term (and its unpaced drain, as
  `xstage plan validate` plays it; the first committed run predates the unpaced drain);
- for the unpaced kernel, from the simulated timeline: the mean number of CTAs with a store burst in
  progress (issuing or stalled), and the share of the kernel during which the term's occupancy (those
  bursts, each at most the term's window) reaches its onset, i.e. the share during which the term
  slows compute at all.

    PYTHONPATH=src python3 benchmarks/experiments/unpaced_diagnosis.py --out DIR
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from xstage.calibrate.tiles import REPORT_SHAPES
from xstage.env import environment
from xstage.model.interference import load_default_interference
from xstage.results.io import read_rows, write_csv_atomic
from xstage.results.tables import markdown_table
from xstage.sched.costs import load_default_costs
from xstage.sched.moe import moe_work, simulate_remote
from xstage.sched.pacing import resolve_pacing
from xstage.sched.plan import moe_path_params
from xstage.sched.validate import _config

RUN_B = Path(__file__).resolve().parents[1] / "results" / "h200-moe-ab" / "run-b" / "moe.csv"


# Storing CTAs from which every SM's tiles slowed beside unpaced combine-pattern bursts
# (`../results/h200-tiles-beside-tile-stores/`, run 3: none at 16, 12-15% at 33, 58-72% at 66)
CROWD = 33


def fabric_share(res, burst_bytes: dict[str, int], window: float, onset: float, crowd: int = CROWD
                 ) -> tuple[float, float, float]:
    """(mean CTAs with a burst in progress, share of the kernel with the term's occupancy >= onset,
    share of the kernel with at least `crowd` CTAs storing at once)."""
    events = []
    for s in res.segments:
        if s.kind in ("issue", "stall") and s.duration_ns > 0:
            b = min(burst_bytes.get(s.task, 0), window)
            events += [(s.start_ns, 1, b), (s.end_ns, -1, -b)]
    events.sort()
    busy_ns = active_ns = crowd_ns = 0.0
    n = occ = 0.0
    t_prev = 0.0
    for t, dn, db in events:
        busy_ns += n * (t - t_prev)
        if occ >= onset:
            active_ns += t - t_prev
        if n >= crowd:
            crowd_ns += t - t_prev
        n += dn
        occ += db
        t_prev = t
    return busy_ns / res.time_ns, active_ns / res.time_ns, crowd_ns / res.time_ns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--run-b", default=str(RUN_B))
    ap.add_argument("--schedule", default="lag:8")
    ap.add_argument("--tokens", default="2048,16384")
    args = ap.parse_args(argv)
    rows = read_rows(args.run_b)
    tokens = {int(t) for t in args.tokens.split(",")}
    costs = load_default_costs("moe")
    path = moe_path_params("host")
    term = load_default_interference("host")
    out = []
    for r in rows:
        if r["shape"] not in REPORT_SHAPES or int(r["tokens"]) not in tokens or int(r["ep"]) < 2 \
                or r["variant"] != f"{args.schedule}@off":
            continue
        paced_row = next(p for p in rows if p["variant"] == args.schedule and
                         all(p[k] == r[k] for k in ("shape", "tokens", "ep", "path")))
        cfg = _config(r)
        ep = cfg.ep
        remote = cfg.tokens_per_rank * cfg.topk * (ep - 1) / ep * cfg.hidden * 2  # expected bytes leaving rank 0
        work = moe_work(cfg, args.schedule, costs, int(r["ctas"]))
        bursts = {t.name: sum(t.stores.values()) for tasks in work.ctas for t in tasks}
        bursts.update({t.name: sum(t.stores.values()) for t in work.queue})
        pred = {}
        for pace in ("default", "off"):
            pred[pace] = simulate_remote(work, path, resolve_pacing(pace, "host", ep), term)
        storing, active, crowded = fabric_share(pred["off"], bursts, term.window_bytes, term.onset_bytes)
        t_paced, t_off = float(paced_row["time_ns"]), float(r["time_ns"])
        out.append(dict(shape=r["shape"], tokens=cfg.tokens_per_rank, ep=ep, schedule=args.schedule,
                        remote_mb=round(remote / 1e6, 1),
                        paced_ms=round(t_paced / 1e6, 3), unpaced_ms=round(t_off / 1e6, 3),
                        paced_gbps=round(remote / t_paced, 1), unpaced_gbps=round(remote / t_off, 1),
                        pred_paced_ms=round(pred["default"].time_ns / 1e6, 3),
                        pred_unpaced_ms=round(pred["off"].time_ns / 1e6, 3),
                        unpaced_err=round(pred["off"].time_ns / t_off - 1, 3),
                        sim_storing_ctas=round(storing, 1), sim_term_active=round(active, 3),
                        sim_crowded=round(crowded, 3),
                        measured_commit=r["git_commit"]))
        print(out[-1], flush=True)
    env = environment()
    for o in out:
        o["git_commit"] = env["git_commit"]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_csv_atomic(Path(args.out) / "unpaced_diagnosis.csv", out, list(out[0]))
    cols = ["shape", "tokens", "ep", "remote_mb", "paced_gbps", "unpaced_gbps", "unpaced_err", "sim_storing_ctas",
            "sim_crowded", "sim_term_active"]
    print(markdown_table(out, cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
