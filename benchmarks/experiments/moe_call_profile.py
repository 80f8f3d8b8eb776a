"""Where a fused MoE call's host time goes at EP=1: the public call profiled function by function.

Per configuration (`SHAPE:TOKENS`, comma-separated): a buffer sized for the call, 20 warm-up calls,
then `N` calls back to back under `cProfile` (one sync at the end), cycling through 16 routings; and the
same number of calls unprofiled, timed on the host (`perf_counter_ns` around each call: its host time,
median and p90) with one `launch_reduce` timed alike (the issue's `L`). Prints the call's host time,
`L`, and the 25 functions of most cumulative time per call; writes `profile.txt` under $OUT (or /tmp).

    PYTHONPATH=src python3 benchmarks/experiments/moe_call_profile.py H2048-I768-E128-K8:1,H2048-I768-E128-K8:1024
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np
import torch

from xstage.moe.buffer import LoopbackGroup, MoEBuffer
from xstage.moe.fused import fused_moe, launch_reduce
from xstage.moe.layout import transform_weights
from xstage.moe.problem import routing
from xstage.spec.moe import MoeShape

N = 200


def main(spec: str) -> str:
    out = []
    for item in spec.split(","):
        shape, tokens = item.split(":")
        H, I, E, K = MoeShape.parse(shape)
        T = int(tokens)
        g = torch.Generator(device="cuda").manual_seed(0)
        l1 = torch.randn(E, 2 * I, H, generator=g, device="cuda", dtype=torch.bfloat16) * H**-0.5
        l2 = torch.randn(E, H, I, generator=g, device="cuda", dtype=torch.bfloat16) * I**-0.5
        buf = MoEBuffer(max(T, 16), E, K, H, I, LoopbackGroup(1), device="cuda", dtype="bf16")
        w1t, w2 = transform_weights(l1, l2, buf.cfg.block_n1)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        routes = [routing(T, E, K, "cuda", seed=s) for s in range(16)]
        for i in range(20):
            fused_moe(x, *routes[i % 16], w1t, w2, buf)
        torch.cuda.synchronize()
        host = []
        for i in range(N):
            t0 = time.perf_counter_ns()
            fused_moe(x, *routes[i % 16], w1t, w2, buf)
            host.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        y = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
        reduce_host = []
        for i in range(N):
            t0 = time.perf_counter_ns()
            launch_reduce(routes[i % 16][0], routes[i % 16][1], y, buf)
            reduce_host.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        buf.check()
        prof = cProfile.Profile()
        prof.enable()
        for i in range(N):
            fused_moe(x, *routes[i % 16], w1t, w2, buf)
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
        line = (f"{item}: call host {np.median(host) / 1e3:.1f} us (p90 {np.percentile(host, 90) / 1e3:.1f}), "
                f"launch_reduce host L {np.median(reduce_host) / 1e3:.1f} us; profile of {N} calls:")
        print(line)
        print(s.getvalue())
        out += [line, s.getvalue()]
    return "\n".join(out)


if __name__ == "__main__":
    text = main(sys.argv[1] if len(sys.argv) > 1 else "H2048-I768-E128-K8:1,H2048-I768-E128-K8:1024")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "profile.txt"), "w") as f:
        f.write(text)
