"""Device timing: warm-up, then the median (and spread) of many event-timed runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    median_ns: float
    p10_ns: float
    p90_ns: float
    runs: int


def timing_summary(samples_ns: list[float]) -> Timing:
    """Median and 10th/90th percentiles of samples (ns)."""
    s = sorted(samples_ns)
    q = statistics.quantiles(s, n=10) if len(s) >= 2 else [s[0]] * 9
    return Timing(statistics.median(s), q[0], q[-1], len(s))


def time_device(fn: Callable[[], object], *, warmup: int = 5, rep: int = 30, sync=None) -> Timing:
    """Median of `rep` timed calls of `fn` after `warmup` calls.

    On CUDA each call is bracketed by events (kernel time without host overhead between them);
    elsewhere by the host clock. `sync` (optional) runs after each call, e.g. a barrier across ranks.
    """
    import torch

    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
        for i in range(rep):
            if sync is not None:
                sync()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return timing_summary([s.elapsed_time(e) * 1e6 for s, e in zip(starts, ends)])
    samples = []
    for _ in range(rep):
        if sync is not None:
            sync()
        t = time.perf_counter_ns()
        fn()
        samples.append(float(time.perf_counter_ns() - t))
    return timing_summary(samples)
