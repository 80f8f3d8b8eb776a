"""The fused MoE kernel's tiles at EP > 1, on the paced host link and on HBM (one GPU, no torchrun).

Question: do a schedule's tiles run at their EP=1 speed when its combine stores go through the paced
host link? The model takes every tile's time from EP=1 traces (times the order effect) and charges
the link only through the stores' issue and stall. For each configuration, schedule and path (`hbm`:
the loopback rows go to device memory, nothing paced; `host`: pinned host memory at the default
pacing) the kernel is timed untraced (median of `--rep`), then traced once (the last of three runs).
Per task kind: median and mean task time, and the time per CTA inside tasks of that kind (sum over
tasks / CTAs); `outside_us` is the rest of the traced span per CTA (fetching, dependency waits, tail).
A LINEAR2 task's time includes its pacing wait and store issue (the trace stops after the last store).

Rows go to `OUT_DIR/link-tiles.csv` (resumable) with provenance; a short table is printed last.

    PYTHONPATH=src python3 benchmarks/experiments/moe_link_tiles.py -o OUT_DIR \\
        [--configs H7168-I3072-E384-K6:16384:2,...] [--schedules expert_wave,interleaved] [--rep 5]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

from xstage.bench.moe import time_fused
from xstage.moe.fused import launch_main, launch_reduce, plan
from xstage.moe.problem import Problem
from xstage.results import ResultWriter, synchronize
from xstage.spec.moe import DEFAULT_BLOCK, MoeShape, parse_block
from xstage.spec.schedule import KIND_NAMES

KEYS = ["shape", "tokens", "ep", "path", "schedule"]
PER_KIND = [f"{k}_{s}" for k in KIND_NAMES for s in ("median_us", "mean_us", "per_cta_us")]
COLUMNS = KEYS + ["time_us", "time_p10_us", "time_p90_us", "span_us", "outside_us", *PER_KIND]
DEFAULT_CONFIGS = ("H7168-I3072-E384-K6:16384:2,H7168-I3072-E384-K6:4096:2,H7168-I3072-E384-K6:16384:8,"
                   "H4096-I2048-E256-K6:16384:2,H4096-I2048-E256-K6:16384:8,H4096-I1536-E128-K8:16384:2,"
                   "H4096-I1536-E128-K8:16384:8,H1152-I4608-E8-K2:16384:4")


def traced_row(pb: Problem, schedule: str) -> dict:
    """One traced run (the last of three): span, time outside tasks and per-kind task times per CTA."""
    p = plan(pb.idx, pb.buf, schedule)
    trace = torch.zeros(p.schedule.num_tasks, 3, dtype=torch.int64, device=pb.x.device)
    y = torch.empty_like(pb.x)
    for _ in range(3):
        trace.zero_()
        launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p, trace=trace)
        launch_reduce(pb.idx, pb.w, y, pb.buf)
    synchronize()
    kinds = torch.from_numpy(p.schedule.global_order()[:, 0]).to(trace.device)
    ran = trace[:, 0] > 0  # unit slots without rows are skipped and leave zeros
    go, done = trace[ran, 0].double(), trace[ran, 1].double()
    ctas = p.schedule.num_ctas
    span = float(done.max() - go.min())
    row = {"span_us": span / 1e3, "outside_us": (span - float((done - go).sum()) / ctas) / 1e3}
    for i, name in enumerate(KIND_NAMES):
        d = (done - go)[kinds[ran] == i]
        if len(d):
            row.update({f"{name}_median_us": float(d.median()) / 1e3, f"{name}_mean_us": float(d.mean()) / 1e3,
                        f"{name}_per_cta_us": float(d.sum()) / ctas / 1e3})
    return row


def sweep(configs, schedules, paths, rep: int, writer: ResultWriter, log=print) -> None:
    for shape, tokens, ep in configs:
        for path in paths:
            todo = [s for s in schedules if not writer.done(dict(shape=shape, tokens=tokens, ep=ep, path=path,
                                                                 schedule=s))]
            if not todo:
                continue
            pb = Problem(shape, tokens, ep, path, parse_block(DEFAULT_BLOCK, MoeShape.parse(shape).hidden))
            for schedule in todo:
                main, _red, _y, _ = time_fused(pb, schedule, warmup=2, rep=rep)
                row = dict(shape=shape, tokens=tokens, ep=ep, path=path, schedule=schedule,
                           time_us=main.median_ns / 1e3, time_p10_us=main.p10_ns / 1e3,
                           time_p90_us=main.p90_ns / 1e3, **traced_row(pb, schedule))
                writer.write(row)
                log(" ".join(f"{c}={v:.4g}" if isinstance(v, float) else f"{c}={v}" for c, v in row.items()),
                    flush=True)
            del pb
            torch.cuda.empty_cache()


def parse_list(spec: str) -> list[str]:
    return [t.strip() for t in spec.split(",") if t.strip()]


def parse_configs(spec: str) -> list[tuple[str, int, int]]:
    out = []
    for item in parse_list(spec):
        shape, tokens, ep = item.split(":")
        out.append((str(MoeShape.parse(shape)), int(tokens), int(ep)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="SHAPE:TOKENS:EP,...")
    ap.add_argument("--schedules", default="expert_wave,interleaved,lag:2,lag:8")
    ap.add_argument("--paths", default="hbm,host")
    ap.add_argument("--rep", type=int, default=5)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    writer = ResultWriter(out / "link-tiles.csv", COLUMNS, KEYS, require_commit=True)
    sweep(parse_configs(args.configs), parse_list(args.schedules), parse_list(args.paths),
          args.rep, writer)
    print("| shape | tokens | ep | path | schedule | time us | linear1 mean | linear2 mean | dispatch mean | outside |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in csv.DictReader(open(out / "link-tiles.csv")):
        f = {k: float(r[k]) if r.get(k) else float("nan") for k in
             ("time_us", "linear1_mean_us", "linear2_mean_us", "dispatch_mean_us", "outside_us")}
        print(f"| {r['shape']} | {r['tokens']} | {r['ep']} | {r['path']} | {r['schedule']} | {f['time_us']:.0f} | "
              f"{f['linear1_mean_us']:.1f} | {f['linear2_mean_us']:.1f} | {f['dispatch_mean_us']:.1f} | "
              f"{f['outside_us']:.0f} |")


if __name__ == "__main__":
    main()
