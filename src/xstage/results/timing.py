"""Device timing: warm-up, then the median (and spread) of many event-timed runs.

On CUDA each run is bracketed by CUDA events; on a machine without a GPU (Triton's interpreter) a
host-clock stand-in with the same `record` / `elapsed_time` interface keeps the same code running.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from xstage.results.stats import Timing, timing_summary


class HostEvent:
    """CPU stand-in for `torch.cuda.Event(enable_timing=True)`."""

    def record(self):
        self.t = time.perf_counter_ns()

    def elapsed_time(self, other) -> float:
        """Milliseconds from this event to `other`, as CUDA events report."""
        return (other.t - self.t) / 1e6


def events(n: int) -> list:
    """`n` timing events: CUDA events where a GPU is present, host-clock events elsewhere."""
    import torch  # here, not at import: the model and the planner read results without loading torch

    if torch.cuda.is_available():
        return [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    return [HostEvent() for _ in range(n)]


def synchronize() -> None:
    """Wait for the device (a no-op without a GPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_device(fn: Callable[[], object], *, warmup: int = 5, rep: int = 30, sync=None) -> Timing:
    """Median of `rep` timed calls of `fn` after `warmup` calls.

    On CUDA each call is bracketed by events (kernel time without host overhead between them);
    elsewhere by the host clock. `sync` (optional) runs before each timed call, e.g. a barrier across
    ranks.
    """
    for _ in range(warmup):
        fn()
    synchronize()
    starts, ends = events(rep), events(rep)
    for i in range(rep):
        if sync is not None:
            sync()
        starts[i].record()
        fn()
        ends[i].record()
    synchronize()
    return timing_summary([s.elapsed_time(e) * 1e6 for s, e in zip(starts, ends)])


def time_in_turns(makers: dict[str, Callable[[], Callable[[], object]]], *, warmup: int = 1, rep: int = 10,
                  turns: int = 2) -> dict[str, Timing]:
    """Median (p10, p90) of `rep` timed calls per name, the names taking turns in `turns` blocks of
    `rep / turns` calls: in each turn `makers[name]()` builds the callable afresh (e.g. captures a
    CUDA graph and returns its replay), which runs `warmup` times untimed and then the turn's timed
    calls. Only one built callable is alive at a time (this GPU's CUDA graphs of these kernels stopped
    replaying once several were held at once), and a drift over the run touches every name alike."""
    samples: dict[str, list[float]] = {name: [] for name in makers}
    per_turn = [rep // turns + (1 if t < rep % turns else 0) for t in range(turns)]
    for n in per_turn:
        for name, make in makers.items():
            fn = make()
            for _ in range(warmup):
                fn()
            synchronize()
            starts, ends = events(n), events(n)
            for i in range(n):
                starts[i].record()
                fn()
                ends[i].record()
            synchronize()
            samples[name] += [s.elapsed_time(e) * 1e6 for s, e in zip(starts, ends)]
            del fn
    return {name: timing_summary(s) for name, s in samples.items() if s}
