"""Do the compiled and the reference path simulators agree on a named corpus, and how fast is each?

Corpus:
- `design`: every launch of the calibration design (`xstage.model.calibration_design(132)`, the
  host profile), played as the fit plays it (`simulate_launch`'s SM classes): every burst's issue end
  and completion;
- `validation`: every fused-kernel row of a `xstage bench moe` CSV (default: the 924 kernels of
  `benchmarks/results/h200-moe-paced/moe.csv`), simulated as `xstage plan validate` simulates it:
  the kernel time and every task's end (a task ends when its last burst has issued).
`--every N` takes every N-th kernel of the validation corpus (the reference engine needs about an
hour on two cores for all of them). Writes `engine_agreement.csv` (one row per item: the largest
relative difference and each engine's seconds) and prints a summary.

    python benchmarks/experiments/engine_agreement.py --out OUT [--every 1] [--corpus design,validation]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from xstage.env import environment
from xstage.model import calibration_design, load_default_profile, simulate_bursts
from xstage.model.predict import DEFAULT_CLASSES, split_classes
from xstage.results.io import read_rows, write_csv_atomic
from xstage.sched.costs import load_default_costs
from xstage.sched.moe import moe_work, simulate_remote
from xstage.sched.pacing import resolve_pacing
from xstage.sched.validate import _config, fused_rows, split_variant

ENGINES = ("reference", "fast")


def _rel(a, b) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1.0))) if a.size else 0.0


def design_items(params):
    for i, launch in enumerate(calibration_design(132)):
        mult = split_classes(launch["n_sm"], DEFAULT_CLASSES)
        prog = [(float(launch["burst_bytes"]), float(launch["gap_ns"]))] * launch["n_bursts"]
        got, secs = {}, {}
        for engine in ENGINES:
            t = time.perf_counter()
            res = simulate_bursts(params, [prog] * len(mult), multiplicity=mult, engine=engine)
            secs[engine] = time.perf_counter() - t
            got[engine] = np.concatenate([np.concatenate(res.issue_end_ns), np.concatenate(res.completion_ns)])
        yield {"corpus": "design", "item": f"{i}:{launch['experiment']}:n{launch['n_sm']}:b{launch['burst_bytes']}"
               f":g{launch['gap_ns']}", "max_rel_diff": _rel(got["reference"], got["fast"]),
               "reference_s": secs["reference"], "fast_s": secs["fast"]}


def validation_items(params, csv_path, every: int):
    costs = load_default_costs("moe")
    rows = [r for r in fused_rows(read_rows(csv_path)) if str(r["path"]).strip() == "host"][::every]
    for r in rows:
        cfg = _config(r)
        schedule, pace = split_variant(str(r["variant"]).strip(), "default")  # rows without @ ran the default
        work = moe_work(cfg, schedule, costs, int(r["ctas"]))
        pacing = resolve_pacing(pace, "host", cfg.ep)
        got, secs = {}, {}
        for engine in ENGINES:
            t = time.perf_counter()
            got[engine] = simulate_remote(work, params, pacing, engine=engine)
            secs[engine] = time.perf_counter() - t
        ref, fast = got["reference"], got["fast"]
        names = sorted(ref.task_end_ns)
        diff = max(_rel([ref.time_ns], [fast.time_ns]),
                   _rel([ref.task_end_ns[n] for n in names], [fast.task_end_ns.get(n, np.nan) for n in names]))
        yield {"corpus": "validation", "item": f"{r['shape']}:{r['tokens']}:ep{r['ep']}:{r['variant']}",
               "max_rel_diff": diff, "reference_s": secs["reference"], "fast_s": secs["fast"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--corpus", default="design,validation")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--moe-csv", default="benchmarks/results/h200-moe-paced/moe.csv")
    args = ap.parse_args(argv)
    params = load_default_profile("host").params
    simulate_bursts(params, [[(4096.0, 0.0)]])  # compile the fast engine before timing it
    rows = []
    for corpus in args.corpus.split(","):
        items = design_items(params) if corpus == "design" else validation_items(params, args.moe_csv, args.every)
        for row in items:
            rows.append(row)
            if len(rows) % 50 == 0:
                print(f"{len(rows)} items, largest difference so far {max(r['max_rel_diff'] for r in rows):.2e}",
                      flush=True)
    env = environment()
    rows = [{**r, **{k: env.get(k, "") for k in ("git_commit", "src_hash", "python", "date")}} for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out / "engine_agreement.csv", rows, list(rows[0]))
    for corpus in sorted({r["corpus"] for r in rows}):
        sel = [r for r in rows if r["corpus"] == corpus]
        print(f"{corpus}: {len(sel)} items, largest relative difference {max(r['max_rel_diff'] for r in sel):.2e}, "
              f"reference {sum(r['reference_s'] for r in sel):.1f} s, fast {sum(r['fast_s'] for r in sel):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
