"""Fit the store/compute interference term on the committed microbenchmarks and score it (CPU only).

Inputs (committed H200 measurements):
- `h200-store-then-load/bystander_reads.csv` and `h200-interference/bystander_intensity.csv`: readers
  beside k storing SMs (the onset);
- `h200-moe-busy-link/beside_busy_link.csv`: the fused MoE kernel beside a store kernel (`per_storer`,
  fitted on the calibration shapes' rows, the other rows only checked);
- `h200-tiles-beside-tile-stores/*.csv`: GEMM tiles with tile-sized unpaced bursts of scattered rows
  (`unpaced_drain`, `xstage.calibrate.interference.unpaced_drain_from`).

Writes `fit.csv` (one row per busy-link measurement, measured and predicted slowdown, role),
`onset.csv` (the bystander rows used) and, with `--update`, the embedded term JSON.

    PYTHONPATH=src python benchmarks/experiments/fit_interference.py --out benchmarks/results/h200-interference \
        --update src/xstage/data/h200-host-interference.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from xstage.calibrate.interference import fit_interference, unpaced_drain_from
from xstage.calibrate.tiles import MODEL_SHAPES
from xstage.env import environment
from xstage.model import load_default_profile
from xstage.results.io import read_rows, write_csv_atomic
from xstage.sched.costs import load_default_costs

RESULTS = Path(__file__).resolve().parents[1] / "results"


def bystander_rows() -> list[dict]:
    """(storing_ctas, slowdown) of the HBM-streaming readers on the host path, both benchmarks."""
    rows = []
    old = read_rows(RESULTS / "h200-store-then-load" / "bystander_reads.csv")
    alone = {r["dest"]: float(r["read_ns"]) for r in old if int(r["storing_ctas"]) == 0}
    rows += [{"source": "bystander_reads", "storing_ctas": int(r["storing_ctas"]),
              "slowdown": round(float(r["read_ns"]) / alone["host"], 3)}
             for r in old if r["dest"] == "host" and int(r["storing_ctas"]) > 0]
    new = read_rows(RESULTS / "h200-interference" / "bystander_intensity.csv")
    key = ("storing_ctas", "footprint_bytes", "fma")
    idle = {tuple(r[k] for k in key): float(r["read_ns"]) for r in new if r["storers"] == "idle"}
    rows += [{"source": f"bystander_intensity fma={r['fma']}", "storing_ctas": int(r["storing_ctas"]),
              "slowdown": round(float(r["read_ns"]) / idle[tuple(r[k] for k in key)], 3)}
             for r in new if r["storers"] == "busy" and int(r["footprint_bytes"]) == 1 << 20 and r["dest"] == "host"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--update", help="write the fitted term to this JSON (the embedded calibration)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    commit = env["git_commit"]
    onset = bystander_rows()
    busy = read_rows(RESULTS / "h200-moe-busy-link" / "beside_busy_link.csv")
    prov = {"fitted_with": f"benchmarks/experiments/fit_interference.py at {commit}",
            "onset_from": "h200-store-then-load/bystander_reads.csv, h200-interference/bystander_intensity.csv",
            "per_storer_from": f"h200-moe-busy-link/beside_busy_link.csv, shapes {list(MODEL_SHAPES)}",
            "gpu": "NVIDIA H200", "path": "host"}
    term, rows = fit_interference(onset, busy, load_default_profile("host").params, load_default_costs("moe"),
                                  provenance=prov)
    tile_dir = RESULTS / "h200-tiles-beside-tile-stores"
    tile_csvs = sorted(tile_dir.glob("*.csv"))
    drain, used = unpaced_drain_from([r for f in tile_csvs for r in read_rows(f)])
    term = dataclasses.replace(term, unpaced_drain=round(drain), provenance={
        **term.provenance, "unpaced_drain_from": f"{', '.join(f'{tile_dir.name}/{f.name}' for f in tile_csvs)}: "
                                                 f"median of {used} saturated unpaced rows"})
    fit_rows = [dict(r, git_commit=commit) for r in rows]
    onset_rows = [dict(r, git_commit=commit) for r in onset]
    write_csv_atomic(out / "fit.csv", fit_rows, list(fit_rows[0]))
    write_csv_atomic(out / "onset.csv", onset_rows, list(onset_rows[0]))
    print(json.dumps(term.to_dict(), indent=2))
    for r in rows:
        print(f"{r['shape']:>20s} k={r['storing_ctas']:3d} measured {r['measured']:6.2f}x predicted "
              f"{r['predicted']:6.2f}x ({r['rel_err']:+.1%}, {r['role']})")
    if args.update:
        dest = Path(args.update)
        tmp = dest.with_suffix(".tmp")
        tmp.write_text(json.dumps(term.to_dict(), indent=2) + "\n")
        os.replace(tmp, dest)


if __name__ == "__main__":
    main()
