"""The model against `moe_link_tiles.py`'s traces: kernel time, compute and store time per CTA.

For every `host` row of `link-tiles.csv` (the fused kernel at EP > 1, default pacing), the planner's
simulation of the same configuration and schedule (`xstage.sched.moe.simulate_remote`, the embedded
profile, tile costs and interference term; `--calibration-only`: tile costs from the two calibration
shapes only, as the A/B protocol scores) against what the traces measured:
- `compute`: per CTA, the time inside tasks of the same kernel on the `hbm` path (nothing paced);
  simulated, the compute segments (each task's tile time plus the fetch before it);
- `store`: per CTA, how much longer the LINEAR2 tasks take on `host` than on `hbm` (the pacing wait
  and the issue of the combine rows); simulated, the issue and stall segments.

    PYTHONPATH=src python benchmarks/experiments/link_tiles_check.py \\
        benchmarks/results/h200-moe-link-tiles/link-tiles.csv --out FILE.csv [--calibration-only]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from xstage.calibrate.tilemodel import costs_calibrated_on
from xstage.calibrate.tiles import MODEL_SHAPES
from xstage.env import environment
from xstage.model.interference import load_default_interference
from xstage.results.io import read_rows, write_csv_atomic
from xstage.sched.costs import load_default_costs
from xstage.sched.moe import MoeConfig, moe_work, simulate_remote
from xstage.sched.pacing import resolve_pacing
from xstage.sched.plan import moe_path_params
from xstage.spec.moe import MoeShape, parse_block

KINDS = ("dispatch", "linear1", "linear2")


def check(rows, calibration_only: bool) -> list[dict]:
    costs = load_default_costs("moe")
    if calibration_only:
        costs = costs_calibrated_on(costs, MODEL_SHAPES)
    path, term = moe_path_params("host"), load_default_interference("host")
    by = {(r["shape"], r["tokens"], r["ep"], r["path"], r["schedule"]): r for r in rows}
    commit = environment().get("git_commit", "")
    out = []
    for r in rows:
        if r["path"] != "host":
            continue
        hbm = by[(r["shape"], r["tokens"], r["ep"], "hbm", r["schedule"])]
        block = parse_block(None, MoeShape.parse(r["shape"]).hidden)  # the traced kernel's default tiles
        cfg = MoeConfig.parse(r["shape"], tokens_per_rank=int(r["tokens"]), ep=int(r["ep"]),
                              block_n2=block.block_n2)
        work = moe_work(cfg, r["schedule"], costs, 132)
        res = simulate_remote(work, path, resolve_pacing("default", "host", cfg.ep), term)
        per_cta: dict[str, float] = defaultdict(float)
        for s in res.segments:
            per_cta[s.kind] += s.duration_ns / 132 / 1e3
        compute = sum(float(hbm[f"{k}_per_cta_us"]) for k in KINDS)
        store = float(r["linear2_per_cta_us"]) - float(hbm["linear2_per_cta_us"])
        out.append({"shape": r["shape"], "tokens": int(r["tokens"]), "ep": int(r["ep"]), "schedule": r["schedule"],
                    "measured_us": round(float(r["time_us"]), 1), "predicted_us": round(res.time_ns / 1e3, 1),
                    "error": round(res.time_ns / 1e3 / float(r["time_us"]) - 1, 4),
                    "compute_measured_us": round(compute, 1), "compute_predicted_us": round(per_cta["compute"], 1),
                    "store_measured_us": round(store, 1),
                    "store_predicted_us": round(per_cta["issue"] + per_cta["stall"], 1),
                    "tile_costs": "calibration shapes" if calibration_only else "all traced shapes",
                    "git_commit": commit})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("link_tiles")
    ap.add_argument("--out", required=True)
    ap.add_argument("--calibration-only", action="store_true")
    args = ap.parse_args()
    out = check(read_rows(args.link_tiles), args.calibration_only)
    write_csv_atomic(args.out, out, list(out[0]))
    for o in out:
        print(f"{o['shape']} {o['tokens']} EP{o['ep']} {o['schedule']}: {o['measured_us']:.0f} us, predicted "
              f"{o['error']:+.1%}; store per CTA {o['store_measured_us']:.0f} vs {o['store_predicted_us']:.0f} us")


if __name__ == "__main__":
    main()
