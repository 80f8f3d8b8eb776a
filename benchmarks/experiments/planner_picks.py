"""The planner's pick per configuration from a `xstage plan validate` output, scored against a baseline.

For every configuration (shape, tokens, EP, dtype) of `validation.csv`, the pick is the schedule
with the lowest predicted time; its measured time is compared with the measured time of the baseline
schedule (default `expert_wave`) and of the best measured schedule (the oracle). Writes `picks.csv`
beside the input and prints the geomean, min and max of baseline / pick, the configurations where
the pick is slower than the baseline, and the geomean loss to the oracle.

    PYTHONPATH=src python benchmarks/experiments/planner_picks.py \
        benchmarks/results/h200-moe-fp8/validation-fp8-costs/validation.csv
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from xstage.results import geomean, read_rows
from xstage.results.io import write_csv_atomic


def picks(rows: list[dict], baseline: str = "expert_wave") -> list[dict]:
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        groups[(r["shape"], int(r["tokens"]), int(r["ep"]), r.get("dtype", "bf16"))][r["schedule"]] = r
    out = []
    for (shape, tokens, ep, dtype), g in sorted(groups.items()):
        if baseline not in g:
            continue
        pick = min(g.values(), key=lambda r: float(r["predicted_ns"]))
        best = min(g.values(), key=lambda r: float(r["measured_ns"]))
        base = float(g[baseline]["measured_ns"])
        out.append(dict(shape=shape, tokens=tokens, ep=ep, dtype=dtype, pick=pick["schedule"],
                        pick_ns=float(pick["measured_ns"]), best=best["schedule"], best_ns=float(best["measured_ns"]),
                        baseline=baseline, baseline_ns=base, speedup=base / float(pick["measured_ns"]),
                        loss_to_best=float(pick["measured_ns"]) / float(best["measured_ns"]) - 1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("validation", help="validation.csv written by `xstage plan validate`")
    ap.add_argument("--baseline", default="expert_wave")
    args = ap.parse_args(argv)
    out = picks(read_rows(args.validation), args.baseline)
    write_csv_atomic(Path(args.validation).with_name("picks.csv"), out, list(out[0]))
    sp = [r["speedup"] for r in out]
    print(f"{len(out)} configurations: pick over {args.baseline} geomean {geomean(sp):.3f}, min {min(sp):.3f}, "
          f"max {max(sp):.3f}, slower in {sum(s < 1 for s in sp)}; loss to the best measured "
          f"{geomean([1 + r['loss_to_best'] for r in out]) - 1:.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
