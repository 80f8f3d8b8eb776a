"""Where a fused MoE call's time goes beyond its kernels at EP=1: the same kernels timed seven ways, in turns.

Per configuration (`SHAPE:TOKENS:SCHEDULE`, comma-separated), three turns of seven variants, each with
the SM clock and board power sampled beside it (NVML, every 20 ms):
- `event_1r`: main + reduce on one host-built plan, event-timed over 10 runs (the tables' `time_ns +
  reduce_ns`);
- `loop_host_1r`, `loop_host_16r`: 200 back-to-back runs of the kernels on host-built plans
  (`xstage.moe.fused.plan`), of one routing or cycling through 16;
- `loop_dev_prebuilt_16r`: the same on device-built plans made before the loop
  (`xstage.moe.device_plan.device_plan`);
- `loop_dev_prologue_16r`: the device plan's prologue launched in the loop, before each run;
- `call_16r`, `call_bigbuf_16r`: the public `fused_moe` call, on the problem's buffer and on a buffer
  sized for 16384 tokens (what `xstage bench moe` calls with).
Writes `gap.jsonl` under $OUT (or /tmp) and prints one line per variant.

    PYTHONPATH=src python3 benchmarks/experiments/moe_call_gap.py \
        H4096-I2048-E256-K6:4096:interleaved,H4096-I2048-E256-K6:16384:expert_wave,H2048-I768-E128-K8:4096:interleaved
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
import torch

from xstage.moe.buffer import LoopbackGroup, MoEBuffer
from xstage.moe.device_plan import device_plan
from xstage.moe.fused import fused_moe, launch_main, launch_reduce, plan
from xstage.moe.problem import Problem, routing

N = 200  # back-to-back iterations per timed loop
try:
    import pynvml

    pynvml.nvmlInit()
    NVML = pynvml.nvmlDeviceGetHandleByIndex(0)
except Exception as exc:  # the clocks are context, not a result: measure without them
    print("no NVML:", exc)
    NVML = None


class Sampler:
    """The SM clock (MHz) and board power (W) every 20 ms while the block runs; medians."""

    def __enter__(self):
        self.samples, self.stop = [], False

        def run():
            while not self.stop:
                if NVML is not None:
                    self.samples.append((pynvml.nvmlDeviceGetClockInfo(NVML, pynvml.NVML_CLOCK_SM),
                                         pynvml.nvmlDeviceGetPowerUsage(NVML) / 1000.0))
                time.sleep(0.02)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()

    def medians(self) -> tuple[float, float]:
        a = np.array(self.samples) if self.samples else np.zeros((1, 2))
        return float(np.median(a[:, 0])), float(np.median(a[:, 1]))


def back_to_back(step) -> tuple[float, tuple]:
    """ns per iteration of N iterations of `step(i)`, one synchronisation after the last."""
    torch.cuda.synchronize()
    with Sampler() as s:
        t0 = time.perf_counter_ns()
        for i in range(N):
            step(i)
        torch.cuda.synchronize()
        ns = (time.perf_counter_ns() - t0) / N
    return ns, s.medians()


def event_timed(pb, p, y, rep=10, warm=3) -> tuple[float, tuple]:
    """The tables' kernel time: median main + median reduce over `rep` event-timed runs."""
    for _ in range(warm):
        launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p)
        launch_reduce(pb.idx, pb.w, y, pb.buf)
    torch.cuda.synchronize()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(rep)]
    with Sampler() as s:
        for a, b, c in ev:
            a.record()
            launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p)
            b.record()
            launch_reduce(pb.idx, pb.w, y, pb.buf)
            c.record()
        torch.cuda.synchronize()
    main = np.median([a.elapsed_time(b) for a, b, _ in ev])
    red = np.median([b.elapsed_time(c) for _, b, c in ev])
    return (main + red) * 1e6, s.medians()


def measure(shape: str, tokens: int, sched: str, out) -> None:
    pb = Problem(shape, tokens, 1, "hbm")
    routs = [(pb.idx, pb.w)] + [routing(tokens, pb.E, pb.K, "cuda", seed=1 + s) for s in range(15)]
    y = torch.empty_like(pb.x)
    big = MoEBuffer(16384, pb.E, pb.K, pb.H, pb.I, LoopbackGroup(1, path="hbm"), device=pb.x.device,
                    dtype=torch.bfloat16, config=pb.cfg)
    host = [plan(i, pb.buf, sched) for i, _ in routs]
    dev = [device_plan(i, pb.buf, sched) for i, _ in routs]

    def kernels(p, i):
        launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p)
        launch_reduce(routs[i][0], routs[i][1], y, pb.buf)

    variants = {
        "event_1r": None,
        "loop_host_1r": lambda i: kernels(host[0], 0),
        "loop_host_16r": lambda i: kernels(host[i % 16], i % 16),
        "loop_dev_prebuilt_16r": lambda i: kernels(dev[i % 16], i % 16),
        "loop_dev_prologue_16r": lambda i: kernels(device_plan(routs[i % 16][0], pb.buf, sched), i % 16),
        "call_16r": lambda i: fused_moe(pb.x, *routs[i % 16], pb.w1t, pb.w2, pb.buf, schedule=sched),
        "call_bigbuf_16r": lambda i: fused_moe(pb.x, *routs[i % 16], pb.w1t, pb.w2, big, schedule=sched),
    }
    for fn in variants.values():  # compile and decide every path before timing
        for i in range(3):
            if fn is not None:
                fn(i)
    torch.cuda.synchronize()
    results = {name: [] for name in variants}
    for _turn in range(3):
        for name, fn in variants.items():
            results[name].append(event_timed(pb, host[0], y) if fn is None else back_to_back(fn))
    pb.buf.check()
    big.check()
    base = np.median([ns for ns, _ in results["event_1r"]])
    for name, rs in results.items():
        ns = float(np.median([r[0] for r in rs]))
        rec = dict(shape=shape, T=tokens, sched=sched, variant=name, us=ns / 1e3, over_event=ns / base,
                   sm_mhz=float(np.median([r[1][0] for r in rs])), watts=float(np.median([r[1][1] for r in rs])),
                   turns=[round(float(r[0]) / 1e3, 1) for r in rs])
        out.write(json.dumps(rec) + "\n")
        out.flush()
        print(f"{shape} {tokens} {sched:12s} {name:22s} {ns / 1e3:9.1f} us  x{ns / base:.3f}  "
              f"{rec['sm_mhz']:.0f} MHz {rec['watts']:.0f} W  turns={rec['turns']}", flush=True)


def main() -> None:
    configs = [c.split(":") for c in sys.argv[1].split(",")]
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gap.jsonl"), "a") as out:
        for shape, tokens, sched in configs:
            measure(shape, int(tokens), sched, out)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
