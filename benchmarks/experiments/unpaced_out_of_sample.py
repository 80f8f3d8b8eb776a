"""The unpaced drain on kernels it never saw: FP8 MoE kernels measured paced and unpaced (CPU only).

The interference term's `unpaced_drain` was calibrated on a microbenchmark and scored on the BF16 A/B
grid (`benchmarks/results/h200-moe-ab/with-unpaced-drain/`). This predicts FP8 kernels that were
measured afterwards, and never before unpaced (`xstage bench moe --dtype fp8 --schedules
lag:8,lag:8@off`), with the embedded term and with the same term without its unpaced drain, as
`xstage plan validate` does (FP8 tile costs, the host profile, the kernel's row pool), and prints the
median |pred/meas - 1| per pacing, both ways.

    PYTHONPATH=src python3 benchmarks/experiments/unpaced_out_of_sample.py RESULTS.csv --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from pathlib import Path

from xstage.env import environment
from xstage.model.interference import load_default_interference
from xstage.results.io import read_rows, write_csv_atomic
from xstage.results.tables import markdown_table
from xstage.sched.costs import load_default_costs
from xstage.sched.plan import moe_path_params
from xstage.sched.validate import validate_moe

POOL_BYTES = 256 << 20  # the kernel's default row pool (`MoEBuffer`)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    rows = read_rows(args.results)
    term = load_default_interference("host")
    costs = {"bf16": load_default_costs("moe"), "fp8": load_default_costs("moe", "fp8")}
    path = moe_path_params("host")
    preds = {}
    for label, t in (("with_drain", term), ("without_drain", dataclasses.replace(term, unpaced_drain=0.0))):
        out, _ = validate_moe(rows, path, costs, interference=t, pool_bytes=POOL_BYTES, workers=2)
        for o in out:
            preds[(o["shape"], int(o["tokens"]), int(o["ep"]), o["schedule"], label)] = o
    commit = environment()["git_commit"]
    table = []
    for (shape, tokens, ep, variant, label), o in sorted(preds.items()):
        if label != "with_drain":
            continue
        old = preds[(shape, tokens, ep, variant, "without_drain")]
        meas = float(o["measured_ns"])
        table.append(dict(shape=shape, tokens=tokens, ep=ep, variant=variant, measured_us=round(meas / 1e3, 1),
                          err_with_drain=round(float(o["predicted_ns"]) / meas - 1, 4),
                          err_without_drain=round(float(old["predicted_ns"]) / meas - 1, 4), git_commit=commit))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_csv_atomic(Path(args.out) / "unpaced_out_of_sample.csv", table, list(table[0]))
    print(markdown_table(table, ["shape", "tokens", "ep", "variant", "measured_us", "err_with_drain",
                                 "err_without_drain"]))
    for unpaced in (False, True):
        sel = [r for r in table if r["variant"].endswith("@off") == unpaced]
        print(f"{'unpaced' if unpaced else 'paced'}: {len(sel)} rows, median |err| with the drain "
              f"{statistics.median(abs(r['err_with_drain']) for r in sel):.1%}, without "
              f"{statistics.median(abs(r['err_without_drain']) for r in sel):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
