"""Where a fused MoE call's time goes beyond its kernels: the device plan's prologue by phase, the host
time of each part of a call, and the call against its kernels (one GPU, loopback group of 1).

For each shape, token count and order:
- `tables`: whether the device plan's tables equal the host planner's (`moe.device_plan` against
  `fused.plan`, as the tests compare them).
- `prologue_phase{1..4}_us`: the prologue's device time with its launch stopped after phase 1, 2, 3
  or 4 (cumulative; the grid barrier's words zeroed between launches), each launch queued behind a
  sleep so that no host gap is timed.
- `prologue_us`, `main_us`, `reduce_us`: the three kernels of a call back to back, queued behind a
  sleep (`main_us` on the device-built table); `host_main_us`: the main kernel on the host-built table,
  queued the same way, each followed by its reduce (which resets the kernel's counters).
- `host_*_us`: host time of each part of a call (median of 40, the GPU kept busy so that no launch
  waits on the queue): input checks, pacing and schedule resolution, the prologue's launch, the main
  kernel's launch (`host_operands_us`: its TMA descriptors alone), the reduce's launch.
- `call_us`, `call_unchecked_us`, `call_sync_us`: wall clock over 200 back-to-back `fused_moe` calls
  cycling through 16 distinct routings, one sync at the end: with the default `check` ("async"), with
  `check=False` and with `check=True`.

    PYTHONPATH=src python3 benchmarks/experiments/moe_call_cost.py -o OUT_DIR
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

# Internal: it times a call's steps one by one (F._resolve_schedule, F._operands; D._scratch: the barrier).
from xstage.moe import device_plan as D
from xstage.moe import fused as F
from xstage.moe.problem import Problem, routing
from xstage.results import ResultWriter

SHAPES = [("H2048-I768-E128-K8", t) for t in (1, 64, 1024, 4096, 16384)] + [("H7168-I2048-E256-K8", 4096)]
ORDERS = ("interleaved", "lag:1", "expert_wave")
KEY = ["shape", "tokens", "schedule"]
COLUMNS = KEY + ["programs", "tables", *(f"prologue_phase{i}_us" for i in range(1, 5)), "prologue_us", "main_us",
                 "reduce_us", "host_main_us", "host_validate_us", "host_pacing_us", "host_prologue_us",
                 "host_main_launch_us", "host_operands_us", "host_reduce_us", "call_us", "call_unchecked_us",
                 "call_sync_us"]


def _median(v) -> float:
    return float(np.median(v))


def _queued(fns, rep: int = 20) -> list[float]:
    """Median device time (us) of each of `fns`, run in turn `rep` times behind a sleep."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    marks = []
    for _ in range(rep):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(fns) + 1)]
        ev[0].record()
        for i, fn in enumerate(fns):
            fn()
            ev[i + 1].record()
        marks.append(ev)
    torch.cuda.synchronize()
    return [_median([m[i].elapsed_time(m[i + 1]) * 1e3 for m in marks]) for i in range(len(fns))]


class _Capture:
    """Stands in for the prologue kernel to keep its last launch's grid and arguments."""

    def __init__(self, kernel):
        self.kernel, self.last = kernel, None

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.last = (grid, args, kw)
            return self.kernel[grid](*args, **kw)
        return launch

    def warmup(self, *args, **kw):
        return self.kernel.warmup(*args, **kw)


def _phases(cap: _Capture, buf) -> list[float]:
    """Cumulative device time (us) of the prologue stopped after each phase (its last launch's arguments)."""
    grid, args, kw = cap.last
    bar = D._scratch(buf).bar
    out = []
    for last in (1, 2, 3, 4):
        marks = []
        for _ in range(12):
            bar.zero_()
            torch.cuda._sleep(2_000_000)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            cap.kernel[grid](*args, **dict(kw, FIRST=1, LAST=last))
            b.record()
            marks.append((a, b))
        torch.cuda.synchronize()
        out.append(_median([a.elapsed_time(b) * 1e3 for a, b in marks[2:]]))
    bar.zero_()
    return out


def _tables_equal(dev, host, buf) -> bool:
    n = host.tasks.shape[0]
    units, bm = host.layout.unit_info.shape[0], buf.cfg.block_m
    return (torch.equal(dev.cta_start.cpu(), host.cta_start.cpu())
            and torch.equal(dev.tasks[:n].cpu(), host.tasks.cpu())
            and torch.equal(dev.layout.unit_info[:units].cpu(), host.layout.unit_info.cpu())
            and torch.equal(dev.layout.row_src[: units * bm].cpu(), host.layout.row_src.cpu()[: units * bm]))


def _host_parts(pb, routs, order: str, y) -> dict:
    parts = {k: [] for k in ("validate", "pacing", "prologue", "main_launch", "operands", "reduce")}
    ctas = F.num_ctas(pb.buf)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    for i in range(40):
        idx, w = routs[i % len(routs)]
        t = [time.perf_counter()]
        F.validate_inputs(pb.x, idx, w, pb.w1t, pb.w2, pb.buf, check_range=False)
        t.append(time.perf_counter())
        F._resolve_schedule(order, pb.buf, pb.T, ctas, F.call_pacing("buffer", pb.buf, pb.T, ctas, order))
        t.append(time.perf_counter())
        p = D.device_plan(idx, pb.buf, order)
        t.append(time.perf_counter())
        F.launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p)
        t.append(time.perf_counter())
        F._operands(pb.buf, pb.w1t, pb.w2)
        t.append(time.perf_counter())
        F.launch_reduce(idx, w, y, pb.buf)
        t.append(time.perf_counter())
        for k, a, b in zip(parts, t, t[1:]):
            parts[k].append((b - a) * 1e6)
    torch.cuda.synchronize()
    return {f"host_{k}_us": _median(v) for k, v in parts.items()}


def _calls(pb, routs, order: str, check) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(200):
        idx, w = routs[i % len(routs)]
        F.fused_moe(pb.x, idx, w, pb.w1t, pb.w2, pb.buf, schedule=order, check=check)
    torch.cuda.synchronize()
    pb.buf.check()
    return (time.perf_counter() - t0) / 200 * 1e6


def _measure(pb, routs, order: str, cap: _Capture) -> dict:
    """One row: the tables, the prologue by phase, the kernels, the host parts and the calls."""
    y = torch.empty_like(pb.x)
    for i in range(3):  # compile, and settle the per-bucket decisions
        F.fused_moe(pb.x, routs[i][0], routs[i][1], pb.w1t, pb.w2, pb.buf, schedule=order)
    host_plan = F.plan(pb.idx, pb.buf, order)
    dev = [D.device_plan(pb.idx, pb.buf, order)]
    torch.cuda.synchronize()
    row = dict(programs=cap.last[0][0], tables=int(_tables_equal(dev[0], host_plan, pb.buf)))
    row.update({f"prologue_phase{i + 1}_us": v for i, v in enumerate(_phases(cap, pb.buf))})

    def prologue():
        dev[0] = D.device_plan(pb.idx, pb.buf, order)

    row["prologue_us"], row["main_us"], row["reduce_us"] = _queued(
        [prologue, lambda: F.launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, dev[0]),
         lambda: F.launch_reduce(pb.idx, pb.w, y, pb.buf)])
    row["host_main_us"] = _queued([lambda: F.launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, host_plan),
                                   lambda: F.launch_reduce(pb.idx, pb.w, y, pb.buf)])[0]
    row.update(_host_parts(pb, routs, order, y))
    row["call_us"], row["call_unchecked_us"], row["call_sync_us"] = (
        _calls(pb, routs, order, c) for c in ("async", False, True))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True, type=Path)
    out = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    writer = ResultWriter(out / "moe_call_cost.csv", COLUMNS, KEY, require_commit=True)
    cap = D.moe_plan_kernel = _Capture(D.moe_plan_kernel)
    for shape, T in SHAPES:
        pb = Problem(shape, T, 1, "hbm")
        routs = [routing(T, pb.E, pb.K, "cuda", s) for s in range(16)]
        for order in ORDERS:
            key = dict(shape=shape, tokens=T, schedule=order)
            if writer.done(key):
                continue
            row = {**key, **_measure(pb, routs, order, cap)}
            writer.write(row)
            print(" ".join(f"{k}={row[k]:.1f}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in COLUMNS),
                  flush=True)
        del pb, routs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
