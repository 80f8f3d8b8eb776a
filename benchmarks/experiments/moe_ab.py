"""Score the MoE planner honestly: choices made on run A (or from the model alone), judged on run B.

Inputs: two `xstage bench moe` grids of the same variants, measured in separate device calls (runs A
and B; see `benchmarks/results/h200-moe-ab/README.md`). Every variant is `SCHEDULE[@PACING]`; rows
without `@` ran with the fixed default pacing (`default`).

Policies, each scored on run B's measured times:
- `planner`: per configuration, the variant the planner ranks first (`xstage.sched.plan.rank_ns`):
  predicted times with tile costs calibrated on `MODEL_SHAPES` only and the path's interference term,
  unpaced ones multiplied by the term's `unpaced_bias`, which is fitted here on run A's `MODEL_SHAPES`
  rows only (`fit_unpaced_bias`; `--update` writes it into the embedded term);
- `planner, no bias`: the same without `unpaced_bias`; `planner without the term`: no term, its own bias;
- `constant (A)`: the one variant with the best geomean over run A's configurations;
- `per-configuration best (A)`: each configuration's fastest variant on run A;
- `oracle (B)`: each configuration's fastest variant on run B itself (an upper bound, not a policy).
Baseline: `expert_wave` at the default pacing on run B.

Model error: median |pred/meas - 1| of run B's rows, paced (`default`) and unpaced (`off`) apart, on
`REPORT_SHAPES` (and `MODEL_SHAPES` for reference), with and without the interference term.

    PYTHONPATH=src python benchmarks/experiments/moe_ab.py --out benchmarks/results/h200-moe-ab \
        --run-a benchmarks/results/h200-moe-ab/run-a/moe.csv --run-b benchmarks/results/h200-moe-ab/run-b/moe.csv
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict
from pathlib import Path

import numpy as np

from xstage.calibrate.interference import fit_unpaced_bias
from xstage.calibrate.tilemodel import costs_calibrated_on
from xstage.calibrate.tiles import MODEL_SHAPES, REPORT_SHAPES
from xstage.env import environment
from xstage.model import load_default_profile
from xstage.model.interference import Interference, load_default_interference
from xstage.results.io import read_rows, write_csv_atomic
from xstage.results.tables import markdown_table
from xstage.sched.costs import load_default_costs
from xstage.sched.pacing import resolve_pacing
from xstage.sched.plan import rank_ns
from xstage.sched.validate import fused_rows, validate_moe
from xstage.spec.variant import Variant

POOL_BYTES = 256 << 20  # the kernel's default row pool (`MoEBuffer`), which measured both runs
BASELINE = "expert_wave@default"
TOLERANCE = 0.03


def canonical(variant: str) -> str:
    v = Variant.parse(variant)
    return f"{v.schedule}@{v.pacing_or('default')}"


def by_config(rows) -> dict[tuple, dict[str, dict]]:
    out: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in fused_rows(rows):
        out[(r["shape"], int(r["tokens"]), int(r["ep"]))][canonical(r["variant"])] = r
    return out


def geomean(xs) -> float:
    return float(np.exp(np.mean(np.log(xs))))


def spread(r: dict) -> float:
    return (float(r["time_p90_ns"]) - float(r["time_p10_ns"])) / float(r["time_ns"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-a", required=True)
    ap.add_argument("--run-b", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--update", help="write the fitted unpaced_bias into this interference JSON")
    ap.add_argument("--predictions", help="reuse the predictions.csv of an earlier run at the same commit "
                    "instead of simulating (its times are rounded to 0.1 ns, so near-ties may rank differently)")
    ap.add_argument("--tile-costs", choices=("calibration", "traced"), default="calibration",
                    help="calibration: tile costs from MODEL_SHAPES only (the protocol); traced: every shape's "
                    "own traces (a diagnostic: the planner for shapes calibrated with `xstage plan calibrate`)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = environment()["git_commit"]
    rows_a, rows_b = read_rows(args.run_a), read_rows(args.run_b)
    a, b = by_config(rows_a), by_config(rows_b)
    configs = sorted(set(a) & set(b))
    variants = sorted(set.intersection(*(set(a[c]) & set(b[c]) for c in configs)))
    params = load_default_profile("host").params
    costs = load_default_costs("moe")
    if args.tile_costs == "calibration":
        costs = costs_calibrated_on(costs, MODEL_SHAPES)
    term = load_default_interference("host")

    preds = {}
    if args.predictions:
        for r in read_rows(args.predictions):
            key = (r["shape"], int(r["tokens"]), int(r["ep"]), r["variant"])
            preds[(*key, "with_term")] = float(r["predicted_ns"])
            preds[(*key, "without_term")] = float(r["predicted_without_term_ns"])
    for label, interference in (("with_term", term), ("without_term", None)) if not preds else ():
        pred_rows, _ = validate_moe(rows_b, params, costs, pool_bytes=POOL_BYTES, interference=interference,
                                    workers=args.workers, progress=None)
        for o in pred_rows:
            preds[(o["shape"], o["tokens"], o["ep"], canonical(o["schedule"]), label)] = o["predicted_ns"]

    def t(run, cfg, v) -> float:
        return float(run[cfg][v]["time_ns"])

    def bias_of(label: str) -> float:  # run A, calibration shapes only
        return fit_unpaced_bias([(preds[(*c, v, label)], preds[(*c, v.replace("@off", "@default"), label)],
                                  t(a, c, v), t(a, c, v.replace("@off", "@default")))
                                 for c in configs if c[0] in MODEL_SHAPES for v in variants if v.endswith("@off")])

    bias = {label: bias_of(label) for label in ("with_term", "without_term")}
    terms = {label: Interference(0.0, 0.0, 0.0, unpaced_bias=bias[label]) for label in bias}

    paced = resolve_pacing("default", "host", 2)  # what rows without `@` ran with

    def planner(c, label: str, use_bias: bool = True):
        def key(v: str) -> float:
            pacing = None if v.endswith("@off") else paced
            return rank_ns(preds[(*c, v, label)], pacing, terms[label] if use_bias else None)
        return min(variants, key=key)

    constant = min(variants, key=lambda v: geomean([t(a, c, v) / min(t(a, c, w) for w in variants) for c in configs]))
    per_config = []
    for c in configs:
        best_b = min(variants, key=lambda v: t(b, c, v))
        picks = {"planner": planner(c, "with_term"), "planner, no bias": planner(c, "with_term", False),
                 "planner without the term": planner(c, "without_term"), "constant (A)": constant,
                 "per-configuration best (A)": min(variants, key=lambda v: t(a, c, v)), "oracle (B)": best_b}
        tol = max(TOLERANCE, spread(b[c][best_b]))
        row = {"shape": c[0], "tokens": c[1], "ep": c[2], "baseline_ns": t(b, c, BASELINE),
               "best_b_ns": t(b, c, best_b), "tolerance": round(tol, 4)}
        for name, v in picks.items():
            row[f"{name}: variant"] = v
            row[f"{name}: time_ns"] = t(b, c, v)
        per_config.append(row)

    policies = ["planner", "planner, no bias", "planner without the term", "constant (A)",
                "per-configuration best (A)", "oracle (B)"]
    summary = []
    for name, shapes in [(p, None) for p in policies] + [(p, REPORT_SHAPES) for p in policies]:
        judged = [r for r in per_config if shapes is None or r["shape"] in shapes]
        speed = [r["baseline_ns"] / r[f"{name}: time_ns"] for r in judged]
        loss = [r[f"{name}: time_ns"] / r["best_b_ns"] for r in judged]
        within = sum(r[f"{name}: time_ns"] <= r["best_b_ns"] * (1 + r["tolerance"]) for r in judged)
        picked_off = sum(r[f"{name}: variant"].endswith("@off") for r in judged)
        summary.append({"configurations": "report shapes" if shapes else "all",
                        "policy": name + (f" = {constant}" if name == "constant (A)" else ""),
                        "geomean speedup over expert_wave@default (B)": round(geomean(speed), 4),
                        "min": round(min(speed), 3), "max": round(max(speed), 3),
                        "geomean loss to oracle (B)": round(geomean(loss) - 1, 4),
                        "within max(3%, spread) of oracle": f"{within}/{len(judged)}",
                        "unpaced picks": picked_off})

    errors = []
    for shapes, role in ((REPORT_SHAPES, "report"), (MODEL_SHAPES, "calibration")):
        for pacing in ("off", "default"):
            for label in ("with_term", "without_term"):
                rel = [preds[(*c, v, label)] / t(b, c, v) - 1 for c in configs if c[0] in shapes
                       for v in variants if v.endswith("@" + pacing)]
                errors.append({"shapes": role, "pacing": pacing, "model": label.replace("_", " "), "rows": len(rel),
                               "median |pred/meas - 1|": round(float(np.median(np.abs(rel))), 4),
                               "p90": round(float(np.quantile(np.abs(rel), 0.9)), 4),
                               "signed median": round(float(np.median(rel)), 4)})

    pred_out = [{"shape": c[0], "tokens": c[1], "ep": c[2], "variant": v, "measured_b_ns": t(b, c, v),
                 "measured_a_ns": t(a, c, v), "predicted_ns": round(preds[(*c, v, "with_term")], 1),
                 "predicted_without_term_ns": round(preds[(*c, v, "without_term")], 1), "git_commit": commit}
                for c in configs for v in variants]
    for r in per_config:
        r["git_commit"] = commit
    write_csv_atomic(out / "predictions.csv", pred_out, list(pred_out[0]))
    write_csv_atomic(out / "policies.csv", per_config, list(per_config[0]))
    write_csv_atomic(out / "summary.csv", [dict(s, git_commit=commit) for s in summary],
                     list(summary[0]) + ["git_commit"])
    write_csv_atomic(out / "model-error.csv", [dict(e, git_commit=commit) for e in errors],
                     list(errors[0]) + ["git_commit"])
    text = (f"{len(configs)} configurations x {len(variants)} variants; commit {commit}; unpaced_bias fitted on "
            f"run A, {', '.join(MODEL_SHAPES)}: {bias['with_term']:.4f} with the term, "
            f"{bias['without_term']:.4f} without; tile costs: {args.tile_costs}\n\n"
            + markdown_table(summary, list(summary[0]), floatfmt=".4g") + "\n\n"
            + markdown_table(errors, list(errors[0]), floatfmt=".4g"))
    (out / "scores.md").write_text(text + "\n")
    print(text)
    if not math.isfinite(summary[0]["geomean speedup over expert_wave@default (B)"]):
        raise SystemExit("non-finite score")
    if args.update:
        path = Path(args.update)
        d = json.loads(path.read_text())
        d["unpaced_bias"] = round(bias["with_term"], 4)
        d.setdefault("provenance", {})["unpaced_bias_from"] = (
            f"benchmarks/experiments/moe_ab.py at {commit}: run A of h200-moe-ab, shapes {list(MODEL_SHAPES)}")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(d, indent=2) + "\n")
        os.replace(tmp, path)


if __name__ == "__main__":
    main()
