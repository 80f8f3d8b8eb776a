"""The device plan's prologue by its ranking block (BE), warps and wave-loop step (WB): device time of
phase 1 alone and of the whole launch, each queued behind a sleep, with the compiled kernel's
registers and spills (the tables are checked against the host planner first); then the whole
prologue at 16-132 programs. One GPU, loopback group of 1.

    PYTHONPATH=src python3 benchmarks/experiments/moe_prologue_blocks.py | tee OUT/probe.log
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

# Internal: it tests the prologue kernel D.moe_plan_kernel; D._scratch gives the grid barrier it zeroes.
from xstage.moe import device_plan as D
from xstage.moe import fused as F
from xstage.moe.problem import Problem

sys.path.insert(0, str(Path(__file__).parent))
from moe_call_cost import _Capture, _tables_equal  # noqa: E402  (a sibling experiment)

SHAPES = [("H2048-I768-E128-K8", 1), ("H2048-I768-E128-K8", 1024), ("H2048-I768-E128-K8", 16384),
          ("H7168-I2048-E256-K8", 4096)]
VARIANTS = [(32, 4, 8), (64, 4, 8), (64, 8, 8), (64, 4, 1)]  # BE, num_warps, WB


def _timed(fn, before, rep: int = 12) -> float:
    """Median device time (us) of `fn`, each run queued behind a sleep, `before` run ahead of it."""
    marks = []
    for _ in range(rep):
        before()
        torch.cuda._sleep(2_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        marks.append((a, b))
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) * 1e3 for a, b in marks[3:]]))


def main() -> None:
    cap = D.moe_plan_kernel = _Capture(D.moe_plan_kernel)
    kernel = cap.kernel
    for shape, T in SHAPES:
        pb = Problem(shape, T, 1, "hbm")
        for order in ("lag:1", "expert_wave", "interleaved"):
            dev = D.device_plan(pb.idx, pb.buf, order)
            torch.cuda.synchronize()
            print(f"{shape} T={T} {order}: tables equal {_tables_equal(dev, F.plan(pb.idx, pb.buf, order), pb.buf)}",
                  flush=True)
        grid, args, kw = cap.last
        bar = D._scratch(pb.buf).bar
        for be, warps, wb in VARIANTS:
            res = []
            for last in (1, 4):
                k2 = dict(kw, BE=be, num_warps=warps, LAST=last, WB=wb)
                compiled = kernel[grid](*args, **k2)
                torch.cuda.synchronize()
                bar.zero_()
                res.append(_timed(lambda g=grid, a=args, k=k2: kernel[g](*a, **k), bar.zero_))
            # "by phase": phase 1 alone, then the whole launch
            print(f"{shape} T={T} G={grid[0]} BE={be} warps={warps} WB={wb}: by phase {res[0]:.1f} {res[1]:.1f} us, "
                  f"regs {compiled.n_regs} spills {compiled.n_spills}", flush=True)
        del pb
        torch.cuda.empty_cache()
    for shape, T in (("H2048-I768-E128-K8", 1024), ("H2048-I768-E128-K8", 4096)):
        pb = Problem(shape, T, 1, "hbm")
        bar = D._scratch(pb.buf).bar
        for order in ("interleaved", "lag:1"):
            out = []
            for programs in (None, 16, 32, 64):
                D.device_plan(pb.idx, pb.buf, order, programs=programs)
                torch.cuda.synchronize()
                grid, args, kw = cap.last
                out.append(f"G={grid[0]}:{_timed(lambda g=grid, a=args, k=kw: kernel[g](*a, **k), bar.zero_):.1f}")
            print(f"{shape} T={T} {order} programs sweep: " + " ".join(out), flush=True)
        del pb
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
