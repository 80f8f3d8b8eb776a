"""Per-task timelines of the fused MoE kernel (one traced run), to set beside the simulator's.

For each configuration, path and schedule: the kernel is warmed up and run three times with the
trace on (readiness counters re-armed by the reduce between runs); the last run's per-task start (after
its dependency wait), end (after its last store issued) and CTA go to `DIR/<shape>-<tokens>-ep<EP>-
<path>-<schedule>.npz` with the task table (kind, unit, n block), times in ns from the first start.
`summary.csv` has per kind the task count and the p10/p50/p90/mean task time. These files are raw
data for `moe_task_timeline_check.py`; the npz files are not committed (a few MB each).

    PYTHONPATH=src python3 benchmarks/experiments/moe_task_timeline.py -o DIR \\
        --configs H4096-I1536-E128-K8:16384:2 --schedules lag:1,lag:8 --paths hbm,host
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from moe_link_tiles import parse_configs, parse_list  # the sibling trace script's --configs format

from xstage.moe.fused import launch_main, launch_reduce, plan
from xstage.moe.problem import Problem
from xstage.results import ResultWriter, synchronize
from xstage.spec.moe import DEFAULT_BLOCK, MoeShape, parse_block
from xstage.spec.schedule import KIND_NAMES

COLUMNS = ["shape", "tokens", "ep", "path", "schedule", "kind", "tasks", "p10_us", "p50_us", "p90_us", "mean_us",
           "span_us"]


def timeline(pb: Problem, schedule: str) -> dict[str, np.ndarray]:
    p = plan(pb.idx, pb.buf, schedule)
    trace = torch.zeros(p.schedule.num_tasks, 3, dtype=torch.int64, device=pb.x.device)
    y = torch.empty_like(pb.x)
    for _ in range(2):  # warm-up, untraced
        launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p)
        launch_reduce(pb.idx, pb.w, y, pb.buf)
    for _ in range(3):
        trace.zero_()
        launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p, trace=trace)
        launch_reduce(pb.idx, pb.w, y, pb.buf)
    synchronize()
    t = trace.cpu().numpy()
    order = p.schedule.global_order()
    ran = t[:, 0] > 0  # unit slots without rows are skipped and leave zeros
    t0 = t[ran, 0].min()
    return {"kind": order[ran, 0], "unit": order[ran, 1], "n_block": order[ran, 2], "cta": t[ran, 2],
            "go_ns": t[ran, 0] - t0, "done_ns": t[ran, 1] - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--configs", required=True, help="SHAPE:TOKENS:EP,...")
    ap.add_argument("--schedules", default="lag:1,lag:8")
    ap.add_argument("--paths", default="hbm,host")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    writer = ResultWriter(out / "summary.csv", COLUMNS, COLUMNS[:6], require_commit=True)
    for shape, tokens, ep in parse_configs(args.configs):
        for path in parse_list(args.paths):
            pb = Problem(shape, tokens, ep, path, parse_block(DEFAULT_BLOCK, MoeShape.parse(shape).hidden))
            for schedule in parse_list(args.schedules):
                tl = timeline(pb, schedule)
                np.savez_compressed(out / f"{shape}-{tokens}-ep{ep}-{path}-{schedule.replace(':', '')}.npz", **tl)
                d = (tl["done_ns"] - tl["go_ns"]) / 1e3
                span = float(tl["done_ns"].max()) / 1e3
                for k, name in enumerate(KIND_NAMES):
                    dk = d[tl["kind"] == k]
                    if len(dk):
                        row = dict(shape=shape, tokens=tokens, ep=ep, path=path, schedule=schedule, kind=name,
                                   tasks=len(dk), p10_us=float(np.percentile(dk, 10)), p50_us=float(np.median(dk)),
                                   p90_us=float(np.percentile(dk, 90)), mean_us=float(dk.mean()), span_us=span)
                        writer.write(row)
                        print(" ".join(f"{c}={v:.4g}" if isinstance(v, float) else f"{c}={v}" for c, v in row.items()),
                              flush=True)
            del pb
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
