"""What a caller waits for: a public call timed back to back, its host time, launches, syncs and graph replay.

The kernel columns of the MoE tables (`time_ns`, `reduce_ns`) time the kernels with the plan built
once, outside the timed region. A caller gets more: the plan (on the host, or a device prologue),
validation, allocations, launches, synchronisations. The measures here take the public call as it is
called, on inputs that change from call to call:

- `time_calls` -> `CallTiming`: `call_ns`, the host wall clock over `calls` back-to-back calls divided
  by their number, with one device synchronisation after the last; the calls cycle through distinct
  inputs (at least `ROUTINGS` routings, each its own tensors, so no cache keyed on data pointers can
  serve a call from an earlier one). `host`: the host time inside each call (median, p10, p90); once
  the device falls behind, a call also waits for room in the launch queue, which p10 leaves out.
- `count_launches` -> `Launches`: kernels per call, counted outside the code under test: on a GPU, the
  CUDA kernel events of torch's profiler (with their summed device time, and the memcpy/memset
  operations beside them); in Triton's CPU interpreter, the launches its grid executor runs (the torch
  operations there are CPU work, not launches).
- `count_syncs`: the synchronisations torch's sync debug mode reports in one call (GPU only; an
  explicit `torch.cuda.synchronize()` is not among them).
- `time_graph`: the call captured once in a CUDA graph (after eager warm-up on a side stream), then
  replayed with each routing copied into the captured input tensors; the median per replay. A capture
  that fails, or a replay whose output differs from an eager call on the same inputs, is no number:
  the reason is returned instead.

Example (any machine; on a GPU the kernels are counted by the profiler):
    >>> import torch
    >>> from xstage.bench.calls import time_calls
    >>> inputs = [(torch.full((4,), float(i)),) for i in range(16)]
    >>> t = time_calls(lambda a: a.sum(), inputs, calls=32)
    >>> t.calls, t.routings, t.call_ns > 0
    (32, 16, True)
"""

from __future__ import annotations

import json
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from xstage.env import interpreter_active
from xstage.errors import InputError
from xstage.results import Timing, synchronize, timing_summary

CALLS = 200  # back-to-back calls behind one call_ns
ROUTINGS = 16  # distinct inputs the calls cycle through


@dataclass(frozen=True)
class CallTiming:
    """`call_ns`: wall clock per call over `calls` back-to-back calls (one sync after the last);
    `host`: host time inside each call; `routings`: distinct inputs cycled."""

    call_ns: float
    host: Timing
    calls: int
    routings: int


def _check_distinct(inputs: Sequence[tuple]) -> None:
    """Refuse inputs that share a tensor: a cache keyed on data pointers could then skip work."""
    seen: dict[int, int] = {}
    for i, args in enumerate(inputs):
        for t in args:
            if isinstance(t, torch.Tensor) and t.numel():
                j = seen.setdefault(t.data_ptr(), i)
                if j != i:
                    raise InputError(f"inputs {j} and {i}: share a tensor (data pointer {t.data_ptr():#x}); "
                                     "each call's inputs must be their own tensors")


def time_calls(call: Callable, inputs: Sequence[tuple], calls: int = CALLS, *, warmup: int = 2,
               sync: Callable[[], None] = synchronize, clock: Callable[[], int] = time.perf_counter_ns
               ) -> CallTiming:
    """`call(*inputs[i % len(inputs)])` for i < `calls`, back to back; see `CallTiming`.

    `warmup` untimed calls come first (compilation, per-size decisions; the last inputs, so that the
    timed calls start on `inputs[0]`), then a synchronisation. `calls` must be at least the number of
    inputs, so that every input is used; `sync` runs once after the last call (and after the
    warm-up), `clock` gives nanoseconds (both replaceable for tests)."""
    if not inputs:
        raise InputError("inputs: give at least one tuple of call arguments")
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < len(inputs):
        raise InputError(f"calls={calls!r}: must be an integer >= the {len(inputs)} inputs (each is used)")
    _check_distinct(inputs)
    if warmup:
        for i in range(warmup):
            call(*inputs[-1 - i % len(inputs)])
        sync()
    n = len(inputs)
    host = [0] * calls
    start = clock()
    for i in range(calls):
        args = inputs[i % n]
        a = clock()
        call(*args)
        host[i] = clock() - a
    sync()
    total = clock() - start
    return CallTiming(total / calls, timing_summary(host), calls, n)


@dataclass(frozen=True)
class Launches:
    """Kernels of one call (`kernels`), how they were counted (`how`), their names, and on a GPU the
    memcpy/memset operations beside them (`copies`) and the kernels' summed device time (`kernel_ns`)."""

    kernels: float
    how: str
    names: tuple[str, ...] = ()
    copies: float = 0.0
    kernel_ns: float | None = None


@contextmanager
def interpreter_launches():
    """Inside the block, every launch Triton's CPU interpreter runs appends its kernel's name to the
    yielded list (its grid executor is the one path every launch takes there)."""
    from triton.runtime import interpreter

    executor = getattr(interpreter, "GridExecutor", None)
    if executor is None:
        raise InputError("this Triton's interpreter has no GridExecutor: its launches cannot be counted")
    names: list[str] = []
    run = executor.__call__

    def counted(self, *args, **kwargs):
        names.append(getattr(self.fn, "__name__", "?"))
        return run(self, *args, **kwargs)

    executor.__call__ = counted
    try:
        yield names
    finally:
        executor.__call__ = run


def _profiled(fn: Callable[[], object], calls: int) -> list[dict]:
    """The device events of torch's profiler over `calls` calls of `fn` (chrome-trace dicts)."""
    from torch.profiler import ProfilerActivity, profile

    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def count_launches(fn: Callable[[], object], calls: int = 1) -> Launches | None:
    """Kernels per call of `fn` over `calls` calls (see `Launches`); None where no counter applies
    (a CPU run outside Triton's interpreter)."""
    if interpreter_active():
        with interpreter_launches() as names:
            for _ in range(calls):
                fn()
        return Launches(len(names) / calls, "Triton interpreter launches", tuple(dict.fromkeys(names)))
    if not torch.cuda.is_available():
        return None
    events = _profiled(fn, calls)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    busy_ns = sum(float(e.get("dur", 0.0)) for e in kernels) * 1e3  # the trace's durations are in us
    names = tuple(dict.fromkeys(str(e.get("name")) for e in kernels))
    return Launches(len(kernels) / calls, "torch profiler CUDA kernels", names, len(copies) / calls, busy_ns / calls)


def count_syncs(fn: Callable[[], object]) -> int | None:
    """Synchronisations torch's sync debug mode reports during one call of `fn`; None without a GPU."""
    if not torch.cuda.is_available() or interpreter_active():
        return None
    synchronize()
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def _first_line(exc: BaseException) -> str:
    # A call failing inside `torch.cuda.graph` makes the capture's end fail too, while handling it: the
    # call's error is the one to name.
    exc = exc.__cause__ or exc.__context__ or exc
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def time_graph(call: Callable, inputs: Sequence[tuple], replays: int = CALLS, *, warmup: int = 2,
               same: Callable[[torch.Tensor, torch.Tensor], str | None] | None = None,
               after: Callable[[], None] | None = None,
               agree: Callable[[bool], bool] = bool) -> tuple[Timing | None, str]:
    """(median per replay, "") of `call` captured in a CUDA graph, or (None, why not).

    The captured call reads its inputs from copies of `inputs[0]`; before each replay the next input is
    copied into them (outside the timed region). The first replays, one per input, are checked against
    eager calls on the same inputs: `same(replayed, eager)` returns None when they agree, else the
    difference in words (default: bitwise equality). `after` (e.g. a buffer's error check) runs after
    the checked replays and after the timed ones; an exception there becomes the reason. `agree(ok)`
    is asked after the capture and after the check (ranks of a group answer together: True only when
    every rank is ok), so that every rank takes the same branch."""
    if not torch.cuda.is_available() or interpreter_active():
        return None, "CUDA graphs need a GPU"
    same = same or (lambda a, b: None if torch.equal(a, b) else "not bitwise equal")
    _check_distinct(inputs)
    eager = [call(*args).clone() for args in inputs]
    static = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call(*static)
    torch.cuda.current_stream().wait_stream(side)
    synchronize()
    graph, why = torch.cuda.CUDAGraph(), ""
    try:
        with torch.cuda.graph(graph):
            out = call(*static)
    except Exception as exc:  # what the call does that a graph cannot hold (a host sync, a host read)
        why = f"capture failed: {_first_line(exc)}"
        synchronize()  # an error here is the device's, not the capture's: it stops the run
    if not agree(not why):
        return None, why or "capture failed on another rank"

    def load(args):
        for dst, src in zip(static, args):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)

    def replay_all(inputs_in_turn, check: bool, timed: bool):
        n = len(inputs_in_turn)
        start = [torch.cuda.Event(enable_timing=True) for _ in range(n)] if timed else []
        end = [torch.cuda.Event(enable_timing=True) for _ in range(n)] if timed else []
        diffs = []
        for i, args in enumerate(inputs_in_turn):
            load(args)
            if timed:
                start[i].record()
            graph.replay()
            if timed:
                end[i].record()
            if check:  # every input is replayed, so that each rank replays as often as its peers
                d = same(out, eager[i])
                if d is not None:
                    diffs.append(f"input {i}: {d}")
        synchronize()
        if after is not None:
            after()
        return diffs, [s.elapsed_time(e) * 1e6 for s, e in zip(start, end)]

    try:
        diffs, _ = replay_all(inputs, check=True, timed=False)
        if diffs:
            why = f"replay differs from the eager call on the same inputs ({diffs[0]}; {len(diffs)} of {len(inputs)})"
    except Exception as exc:
        synchronize()
        why = f"replay failed: {_first_line(exc)}"
    if not agree(not why):
        return None, why or "replay failed on another rank"
    try:
        _, times = replay_all([inputs[i % len(inputs)] for i in range(replays)], check=False, timed=True)
    except Exception as exc:
        synchronize()
        why = f"replay failed: {_first_line(exc)}"
    if not agree(not why):
        return None, why or "replay failed on another rank"
    return timing_summary(times), ""


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| (in float32; NaN where the shapes differ or y is not finite)."""
    if y.shape != ref.shape:
        return float("nan")
    ref32 = ref.float()
    return float((y.float() - ref32).abs().max()) / (float(ref32.abs().max()) or 1.0) if ref.numel() else 0.0


CALL_COLUMNS = ("call_ns", "host_ns", "host_p10_ns", "host_p90_ns", "launches", "syncs", "graph_ns", "call_note")


@dataclass(frozen=True)
class CallMeasure:
    """Everything `measure_call` found; `columns()` spells it as the result columns `CALL_COLUMNS`."""

    timing: CallTiming | None = None
    launches: Launches | None = None
    syncs: int | None = None
    graph: Timing | None = None
    notes: tuple[str, ...] = ()

    def columns(self) -> dict:
        t, n = self.timing, self.launches
        kernels = "" if n is None else (int(n.kernels) if float(n.kernels).is_integer() else n.kernels)
        return dict(call_ns=t.call_ns if t else "", host_ns=t.host.median_ns if t else "",
                    host_p10_ns=t.host.p10_ns if t else "", host_p90_ns=t.host.p90_ns if t else "",
                    launches=kernels, syncs="" if self.syncs is None else self.syncs,
                    graph_ns=self.graph.median_ns if self.graph else "", call_note="; ".join(self.notes))


def measure_call(call: Callable, inputs: Sequence[tuple], reference: torch.Tensor, tolerance: float, *,
                 calls: int = CALLS, after: Callable[[], None] | None = None, agree: Callable[[bool], bool] = bool,
                 graph: bool = True) -> CallMeasure:
    """`call` on `inputs` as a caller sees it: first its output on `inputs[0]` against `reference`
    (relative error within `tolerance`; otherwise nothing is timed and the note says by how much), then
    `time_calls`, `count_launches`, `count_syncs` and (with `graph`) `time_graph`, whose replays must
    agree with eager calls within the same tolerance. `after` (e.g. a buffer's error check) runs after
    each measurement; `agree` as in `time_graph` (a group decides together)."""
    err = relative_error(call(*inputs[0]), reference)
    if not agree(err <= tolerance):
        what = f"{err:.3g}" if err == err else "a shape or a non-finite value"
        return CallMeasure(notes=(f"not timed: the call's output differs from the kernels' by {what} "
                                  f"(tolerance {tolerance:g})" if not err <= tolerance else
                                  "not timed: the call's output differed on another rank",))
    timing = time_calls(call, inputs, calls)
    if after is not None:
        after()
    notes = []
    launches = count_launches(lambda: call(*inputs[0]))
    if launches is None:
        notes.append("launches not counted (no GPU and no Triton interpreter)")
    elif launches.copies:
        notes.append(f"{launches.copies:g} memcpy/memset per call beside the kernels")
    syncs = count_syncs(lambda: call(*inputs[0]))
    if after is not None:
        after()
    replay = None
    if graph:
        def close(a, b):
            e = relative_error(a, b)
            return None if e <= tolerance else f"relative error {e:.3g}"

        replay, why = time_graph(call, inputs, calls, same=close, after=after, agree=agree)
        if why:
            notes.append(f"graph: {why}")
    return CallMeasure(timing, launches, syncs, replay, tuple(notes))
