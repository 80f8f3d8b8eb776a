"""A fused MoE call's own Python, timed on a CPU: the call with its kernel launches made no-ops.

What is left of `fused_moe` when every `xstage.backend.Launch` (prologue, main, reduce) returns at
once: the argument checks, the decision lookups, the device plan's key lookup, the report ring. It
needs no GPU, so a change to the call path can be timed side by side on any machine: run it with
`PYTHONPATH` pointing at each commit's `src/` in turn. One warm-up call launches the kernels for real
(through Triton's interpreter), 50 more warm the no-op path, then 500 calls cycling through 16 routings
are timed one by one (`perf_counter_ns`); prints the median and p10 in microseconds. With an argument
(a `pstats` sort key such as `tottime`), also profiles 500 more calls and prints the top 45 functions.

Shape: fp16, H256-I128-E8-K2, 16 tokens, a loopback group of one (interpreter-sized; the call's Python
does not depend on the width).

    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/experiments/moe_call_host_cpu.py [tottime]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import numpy as np
import torch

from xstage import backend
from xstage.moe.buffer import LoopbackGroup, MoEBuffer
from xstage.moe.fused import fused_moe
from xstage.moe.layout import transform_weights
from xstage.moe.problem import routing

H, I, E, K, T = 256, 128, 8, 2, 16
CALLS = 500


def main(sort_key: str | None) -> None:
    g = torch.Generator().manual_seed(0)
    l1 = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float16) * H**-0.5
    l2 = torch.randn(E, H, I, generator=g, dtype=torch.float16) * I**-0.5
    buf = MoEBuffer(T, E, K, H, I, LoopbackGroup(1), device="cpu", dtype="fp16")
    w1t, w2 = transform_weights(l1, l2, buf.cfg.block_n1)
    x = torch.randn(T, H, generator=g, dtype=torch.float16)
    routes = [routing(T, E, K, "cpu", seed=s) for s in range(16)]
    fused_moe(x, *routes[0], w1t, w2, buf)  # one real call: compiles and fills every cache
    backend.Launch.__call__ = lambda self, grid, *values: None
    for i in range(50):
        fused_moe(x, *routes[i % 16], w1t, w2, buf)
    ts = []
    for i in range(CALLS):
        t0 = time.perf_counter_ns()
        fused_moe(x, *routes[i % 16], w1t, w2, buf)
        ts.append(time.perf_counter_ns() - t0)
    print(f"call without launches: median {np.median(ts) / 1e3:.1f} us, p10 {np.percentile(ts, 10) / 1e3:.1f} us "
          f"({CALLS} calls)")
    if sort_key:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(CALLS):
            fused_moe(x, *routes[i % 16], w1t, w2, buf)
        prof.disable()
        pstats.Stats(prof).sort_stats(sort_key).print_stats(45)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
