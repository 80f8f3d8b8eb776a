"""The fused MoE kernel's tiles while the host link's X-Stage is full (one GPU, no torchrun).

1. Beside a store kernel: k CTAs keep storing 1 MiB passes into pinned host memory on one stream
   while the fused MoE kernel runs at EP=1 (no stores of its own) with 132 - k CTAs on another;
   its time is compared with the same kernel and grid while the link is idle.
2. Traced: the fused kernel on the `host` and the `hbm` loopback paths with `trace=` on; the median
   Linear-1 tile (which stores nothing) on each path.

    PYTHONPATH=src python3 benchmarks/experiments/moe_busy_link.py -o OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from xstage.moe.fused import launch_main, launch_reduce, plan
from xstage.moe.problem import Problem
from xstage.results import ResultWriter
from xstage.spec.moe import DEFAULT_BLOCK, MoeShape, parse_block
from xstage.spec.schedule import LINEAR1

BESIDE = ["shape", "tokens", "storing_ctas", "idle_ns", "busy_ns", "store_ns_nominal"]
TRACED = ["shape", "tokens", "ep", "schedule", "path", "linear1_median_ns", "kernel_span_ns"]


@triton.jit
def store_loop(p_dst, store_elems, n_iter, SB: tl.constexpr):
    pid = tl.program_id(0)
    v = tl.full([SB], 1, tl.int32)
    dst = p_dst + pid.to(tl.int64) * store_elems
    for k in range(n_iter):
        for i in range(0, store_elems, SB):
            tl.store(dst + i + tl.arange(0, SB), v + k)


def _problem(shape: str, tokens: int, ep: int, path: str) -> Problem:
    return Problem(shape, tokens, ep, path, parse_block(DEFAULT_BLOCK, MoeShape.parse(shape).hidden))


def beside(out: Path, cases=(("H4096-I2048-E256-K6", 4096), ("H4096-I1536-E128-K8", 4096),
                             ("H7168-I3072-E384-K6", 1024)), storers=(16, 33, 66), passes: int = 60) -> None:
    writer = ResultWriter(out / "beside_busy_link.csv", BESIDE, BESIDE[:3], require_commit=True)
    store_elems = 256 << 10  # 1 MiB per CTA and pass
    s_moe, s_st = torch.cuda.Stream(), torch.cuda.Stream()
    for shape, tokens in cases:
        pb = _problem(shape, tokens, 1, "hbm")
        y = torch.empty_like(pb.x)
        for k in storers:
            if writer.done({"shape": shape, "tokens": tokens, "storing_ctas": k}):
                continue
            p = plan(pb.idx, pb.buf, "interleaved", ctas=132 - k)
            dst = torch.empty(k * store_elems, dtype=torch.int32, pin_memory=True)
            res = {}
            for mode in ("idle", "busy", "idle"):
                times = []
                for _ in range(3):
                    torch.cuda.synchronize()
                    if mode == "busy":
                        with torch.cuda.stream(s_st):
                            store_loop[(k,)](dst, store_elems, passes, SB=4096, num_warps=32)
                    with torch.cuda.stream(s_moe):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        launch_main(pb.x, pb.w1t, pb.w2, pb.buf, p)
                        b.record()
                        launch_reduce(pb.idx, pb.w, y, pb.buf)
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b) * 1e6)
                res.setdefault(mode, []).append(sorted(times)[1])
            row = {"shape": shape, "tokens": tokens, "storing_ctas": k, "idle_ns": round(min(res["idle"])),
                   "busy_ns": round(res["busy"][0]), "store_ns_nominal": round(k * passes * 2**20 / 52e9 * 1e9)}
            writer.write(row)
            print(f"{shape} T={tokens} grid {132 - k} beside {k} storing CTAs: {row['idle_ns'] / 1e3:.0f} -> "
                  f"{row['busy_ns'] / 1e3:.0f} us (x{row['busy_ns'] / row['idle_ns']:.2f})", flush=True)
        del pb
        torch.cuda.empty_cache()


def traced(out: Path, cases=(("H4096-I2048-E256-K6", 16384, 2, "interleaved"),
                             ("H4096-I1536-E128-K8", 8192, 2, "lag:4"))) -> None:
    writer = ResultWriter(out / "traced_linear1.csv", TRACED, TRACED[:5], require_commit=True)
    for shape, tokens, ep, schedule in cases:
        for path in ("hbm", "host"):
            key = {"shape": shape, "tokens": tokens, "ep": ep, "schedule": schedule, "path": path}
            if writer.done(key):
                continue
            pb = _problem(shape, tokens, ep, path)
            p = plan(pb.idx, pb.buf, schedule)
            trace = torch.zeros(p.schedule.num_tasks, 3, dtype=torch.int64, device="cuda")
            y = torch.empty_like(pb.x)
            for _ in range(3):  # the last run is kept; the first compiles and warms up
                trace.zero_()
                launch_main(pb.x, pb.w1t, pb.w2, pb.buf, p, trace=trace)
                launch_reduce(pb.idx, pb.w, y, pb.buf)
                torch.cuda.synchronize()
            t = trace.cpu().numpy()
            ran = t[:, 0] > 0
            l1 = ran & (p.schedule.global_order()[:, 0] == LINEAR1)
            row = {**key, "linear1_median_ns": round(float(np.median(t[l1, 1] - t[l1, 0]))),
                   "kernel_span_ns": int(t[ran, 1].max() - t[ran, 0].min())}
            writer.write(row)
            print(f"{shape} T={tokens} EP={ep} {schedule} {path}: Linear-1 median "
                  f"{row['linear1_median_ns'] / 1e3:.1f} us, span {row['kernel_span_ns'] / 1e3:.0f} us", flush=True)
            del pb
            torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    out = Path(ap.parse_args().out)
    beside(out)
    traced(out)
