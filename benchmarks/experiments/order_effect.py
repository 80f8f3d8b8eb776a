"""The order effect (`xstage.sched.ordercost`) from EP=1 traces per schedule, and how it predicts.

Input: `moe_ep1.py --trace` rows of several schedules (`ep1.csv`: per shape, tokens and schedule the
fused kernel's time and the mean tile time per kind). Output, under `--out`:
- `ratios.csv`: per shape, tokens, schedule and kind the measured ratio (mean tile time over
  `expert_wave`'s in the same run) and the ratio the effect predicts from the calibration shapes only
  (`xstage.calibrate.tiles.MODEL_SHAPES`); the report shapes never enter it.
- `ep1-kernels.csv`: the EP=1 kernel time per configuration and schedule, measured and simulated with
  the calibration shapes' costs, with and without the effect; the summary scores the times and each
  schedule's time over `expert_wave`'s.
- a summary table on stdout and in `summary.md`.
`--update COSTS_JSON` writes the effect of every traced shape into that task-costs file (the embedded
`xstage/data/h200-moe-task-costs.json`), as the embedded tile table holds every traced shape.

    PYTHONPATH=src python benchmarks/experiments/order_effect.py --ep1 benchmarks/results/h200-moe-order/ep1.csv \
        --out benchmarks/results/h200-moe-order [--update src/xstage/data/h200-moe-task-costs.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from xstage.calibrate.ordereffect import order_effect_from_means, restrict_order_effect
from xstage.calibrate.tilemodel import costs_calibrated_on
from xstage.calibrate.tiles import MODEL_SHAPES, REPORT_SHAPES
from xstage.env import environment
from xstage.model import load_default_profile
from xstage.results.io import read_rows, write_csv_atomic
from xstage.results.tables import markdown_table
from xstage.sched.costs import TaskCosts, load_default_costs
from xstage.sched.moe import MoeConfig, moe_work, remote_path
from xstage.sched.simulate import simulate_kernel
from xstage.spec.moe import MoeShape
from xstage.spec.schedule import KIND_NAMES


def mean_rows(ep1: list[dict]) -> list[dict]:
    """`ep1.csv` rows -> one row per shape, rows per expert, schedule and kind (EP=1)."""
    out = []
    for r in ep1:
        _, _, experts, topk = MoeShape.parse(r["shape"])
        for kind in KIND_NAMES:
            out.append({"shape": r["shape"], "tokens": int(r["tokens"]), "schedule": r["schedule"], "kind": kind,
                        "rows_per_expert": int(r["tokens"]) * topk / experts,
                        "mean_ns": float(r[f"{kind}_mean_us"]) * 1e3, "busy": float(r["busy"])})
    return out


def ep1_time_ns(costs: TaskCosts, shape: str, tokens: int, block: str, schedule: str, path) -> float:
    """The simulated EP=1 kernel as `xstage plan validate` builds it; it stores nothing remotely, so
    `path` (the store path's parameters the simulator asks for) does not change the time."""
    bm, bn1, bn2, bk = (int(v) for v in block.split(":")[:4])
    cfg = MoeConfig.parse(shape, tokens_per_rank=tokens, ep=1, block_m=bm, block_n1=bn1,
                          block_n2=min(bn2, MoeShape.parse(shape).hidden), block_k=bk)
    return simulate_kernel(moe_work(cfg, schedule, costs, 132), {"remote": path}).time_ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep1", required=True, help="moe_ep1.py rows of several schedules, with --trace")
    ap.add_argument("--out", required=True)
    ap.add_argument("--update", help="write the effect of every traced shape into this task-costs JSON")
    ap.add_argument("--no-kernels", action="store_true", help="skip the EP=1 kernel simulations")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ep1 = read_rows(a.ep1)
    rows = mean_rows(ep1)
    source = {"from": str(a.ep1), "git_commit": sorted({r["git_commit"] for r in ep1}),
              "method": "mean traced tile time per kind under each schedule over expert_wave's, EP=1, same run"}
    full = order_effect_from_means(rows, source)
    calib = restrict_order_effect(full, MODEL_SHAPES)
    commit = environment()["git_commit"]

    by_key = {(r["shape"], r["tokens"], r["schedule"], r["kind"]): r for r in rows}
    ratio_rows = []
    for r in rows:
        if r["schedule"] == "expert_wave":
            continue
        ew = by_key[(r["shape"], r["tokens"], "expert_wave", r["kind"])]
        base = ew["mean_ns"]
        # The measured ratio holds both runs' busy shares; the simulator plays them (occupancy term).
        busy = calib.occupancy_factor(r["busy"]) / calib.occupancy_factor(ew["busy"])
        ratio_rows.append({"shape": r["shape"], "tokens": r["tokens"], "schedule": r["schedule"], "kind": r["kind"],
                           "role": "calibration" if r["shape"] in MODEL_SHAPES else "report",
                           "measured_ratio": round(r["mean_ns"] / base, 4),
                           "predicted_ratio": round(calib.factor(r["schedule"], r["shape"], r["kind"],
                                                                 r["rows_per_expert"]) * busy, 4),
                           "git_commit": commit})
    write_csv_atomic(out / "ratios.csv", ratio_rows, list(ratio_rows[0]))
    lines = ["Tile-time ratios over `expert_wave`, report shapes (effect from the calibration shapes only): "
             "median |predicted / measured - 1|"]
    table = []
    for shape in REPORT_SHAPES:
        for kind in KIND_NAMES:
            sel = [r for r in ratio_rows if r["shape"] == shape and r["kind"] == kind]
            err = [abs(r["predicted_ratio"] / r["measured_ratio"] - 1) for r in sel]
            none = [abs(1 / r["measured_ratio"] - 1) for r in sel]
            table.append({"shape": shape, "kind": kind, "rows": len(sel),
                          "with the effect": f"{statistics.median(err):.1%}",
                          "without (ratio 1)": f"{statistics.median(none):.1%}"})
    lines.append(markdown_table(table, list(table[0])))

    if not a.no_kernels:
        base_costs = costs_calibrated_on(load_default_costs("moe"), MODEL_SHAPES)
        with_costs = dataclasses.replace(base_costs, order=calib)
        without_costs = dataclasses.replace(base_costs, order=None)
        path = remote_path(load_default_profile("host").params)
        kern = []
        for r in ep1:
            t = int(r["tokens"])
            kern.append({"shape": r["shape"], "tokens": t, "schedule": r["schedule"],
                         "role": "calibration" if r["shape"] in MODEL_SHAPES else "report",
                         "measured_ns": round(float(r["fused_us"]) * 1e3),
                         "predicted_ns": round(ep1_time_ns(with_costs, r["shape"], t, r["block"], r["schedule"],
                                                           path)),
                         "predicted_without_ns": round(ep1_time_ns(without_costs, r["shape"], t, r["block"],
                                                                   r["schedule"], path)),
                         "git_commit": commit})
        write_csv_atomic(out / "ep1-kernels.csv", kern, list(kern[0]))
        table = []
        for role in ("calibration", "report"):
            sel = [k for k in kern if k["role"] == role]
            for col, label in (("predicted_ns", "with the effect"), ("predicted_without_ns", "without")):
                e = [k[col] / k["measured_ns"] - 1 for k in sel]
                table.append({"shapes": role, "model": label, "rows": len(sel),
                              "median |pred/meas - 1|": f"{statistics.median(map(abs, e)):.1%}",
                              "signed median": f"{statistics.median(e):+.1%}"})
        lines += ["", "EP=1 kernel time per configuration and schedule, simulated with the calibration shapes' costs",
                  markdown_table(table, list(table[0]))]
        ew = {(k["shape"], k["tokens"]): k for k in kern if k["schedule"] == "expert_wave"}
        table = []
        for role in ("calibration", "report"):
            sel = [k for k in kern if k["role"] == role and k["schedule"] != "expert_wave"]
            for col, label in (("predicted_ns", "with the effect"), ("predicted_without_ns", "without")):
                e = [k[col] / ew[(k["shape"], k["tokens"])][col]
                     / (k["measured_ns"] / ew[(k["shape"], k["tokens"])]["measured_ns"]) - 1 for k in sel]
                table.append({"shapes": role, "model": label, "rows": len(sel),
                              "median |pred/meas - 1|": f"{statistics.median(map(abs, e)):.1%}",
                              "signed median": f"{statistics.median(e):+.1%}"})
        lines += ["", "EP=1 kernel time of each schedule over expert_wave's (what the planner compares)",
                  markdown_table(table, list(table[0]))]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    if a.update:
        costs = TaskCosts.load(a.update)
        dataclasses.replace(costs, order=full).save(a.update)
        print(f"order effect of {', '.join(full.shapes)} written into {a.update}")


if __name__ == "__main__":
    main()
