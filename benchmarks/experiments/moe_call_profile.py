"""Where a fused MoE call's host time goes at EP=1: the public call profiled function by function.

Per configuration (`SHAPE:TOKENS`, comma-separated): a buffer sized for the call, 20 warm-up calls,
then `N` calls back to back under `cProfile` (one sync at the end), cycling through 16 routings; and the
same number of calls unprofiled, timed on the host (`perf_counter_ns` around each call: its host time,
median and p90) with the reduce kernel's launch inside them as the issue's `L`. A third pass times every
`xstage.backend.Launch` inside the calls (per kernel, median over the calls), so the call's host time
splits into its launches and the rest; and Triton's own per-launch work on the host TMA descriptors
(`make_tensordesc_arg`, which encodes each descriptor with the driver on every launch) is timed alone on
the main kernel's four descriptors. Prints the split and the 25 functions of most own time per call;
writes both orderings to `profile.txt` under $OUT (or /tmp).

    PYTHONPATH=src python3 benchmarks/experiments/moe_call_profile.py H2048-I768-E128-K8:1,H2048-I768-E128-K8:1024
"""

from __future__ import annotations

import cProfile
import inspect
import io
import os
import pstats
import sys
import time

import numpy as np
import torch

from xstage.moe.buffer import LoopbackGroup, MoEBuffer
from xstage.moe.fused import fused_moe
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
        buf.check()
        per_kernel = _launch_split(x, routes, w1t, w2, buf)
        # The L: the reduce kernel's launch inside the calls. Timed alone, `launch_reduce` would
        # run reduces with no main kernel before them, which breaks the buffer's call protocol.
        L = next((v for k, v in per_kernel.items() if "reduce" in k), float("nan"))
        desc_us = _descriptor_encode_us(buf, w1t, w2)
        prof = cProfile.Profile()
        prof.enable()
        for i in range(N):
            fused_moe(x, *routes[i % 16], w1t, w2, buf)
        prof.disable()
        torch.cuda.synchronize()
        own, cum = io.StringIO(), io.StringIO()
        pstats.Stats(prof, stream=own).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof, stream=cum).sort_stats("cumulative").print_stats(40)
        launches = ", ".join(f"{k} {v:.1f}" for k, v in per_kernel.items())
        line = (f"{item}: call host {np.median(host) / 1e3:.1f} us (p90 {np.percentile(host, 90) / 1e3:.1f}), "
                f"launch_reduce host L {L:.1f} us; launches (us, median per call): "
                f"{launches}; rest {np.median(host) / 1e3 - sum(per_kernel.values()):.1f}; Triton's encoding of "
                f"the main kernel's 4 descriptors {desc_us:.1f} us; profile of {N} calls:")
        print(line)
        print(_trim(own.getvalue()))
        out += [line, own.getvalue(), cum.getvalue()]
    return "\n".join(out)


def _launch_split(x, routes, w1t, w2, buf) -> dict:
    """Median host us per call of each kernel's launch (`xstage.backend.Launch`, through which the
    prologue, main and reduce kernels launch), over N calls."""
    from xstage import backend

    if not hasattr(backend, "Launch"):  # a commit before it: no split
        return {}
    real, spent = backend.Launch.__call__, {}

    def timed(self, grid, *values):
        t0 = time.perf_counter_ns()
        r = real(self, grid, *values)
        spent.setdefault(getattr(self.kernel, "__name__", str(self.kernel)), []).append(time.perf_counter_ns() - t0)
        return r

    backend.Launch.__call__ = timed
    try:
        for i in range(N):
            fused_moe(x, *routes[i % 16], w1t, w2, buf)
        torch.cuda.synchronize()
    finally:
        backend.Launch.__call__ = real
    return {k: float(np.median(v)) * len(v) / N / 1e3 for k, v in spent.items()}


def _descriptor_encode_us(buf, w1t, w2) -> float:
    """Triton's per-launch handling of the main kernel's four host descriptors, timed alone (us)."""
    from triton.backends.nvidia import driver as nv

    from xstage.moe.fused import _operands

    descs = _operands(buf, w1t, w2)[1::2]
    if not buf.cfg.tma or not hasattr(nv, "make_tensordesc_arg"):
        return float("nan")
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 1, "block_size": list(descs[0].block_shape),
            "fp4_padded": False}
    # (arg, metadata) on Triton 3.6; a third, unused argument on later ones
    extra = (None,) * (len(inspect.signature(nv.make_tensordesc_arg).parameters) - 2)

    def encode(d, m):
        return nv.make_tensordesc_arg(d, m, *extra)

    ts = []
    for _ in range(N):
        t0 = time.perf_counter_ns()
        for d in descs:
            encode(d, dict(meta, block_size=list(d.block_shape)))
        ts.append(time.perf_counter_ns() - t0)
    return float(np.median(ts)) / 1e3


def _trim(text: str) -> str:
    """The stats table without pstats' preamble."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    return "\n".join(ln[:150] for ln in lines[start:start + 26])


if __name__ == "__main__":
    text = main(sys.argv[1] if len(sys.argv) > 1 else "H2048-I768-E128-K8:1,H2048-I768-E128-K8:1024")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "profile.txt"), "w") as f:
        f.write(text)
