"""Discrete-event simulation of a persistent kernel: CTAs run their task lists (or take tasks from a
shared queue when free), stores go through the Burst-Gap path simulator, waits honour dependencies.

Each CTA is one issuer on its SM (persistent kernels here run one CTA per SM). A task waits for its
dependencies, computes for `compute_ns`, then issues its stores destination by destination; every
path-bound burst goes through that path's simulator (`xstage.model.simulate.path_simulator`), shared by all CTAs, so
concurrent bursts fill the per-SM and shared windows together and later bursts stall. A task is
finished when its last store has issued (sender-visible); consumers of its output may start then.

With `work.occupancy`, every task computes at 1 / occupancy(share of CTAs computing) of its rate at
full occupancy: tiles run faster while fewer SMs compute beside them (the others waiting on
dependencies or on their stores). Tasks then run on the clocks below, which both effects set.

With `interference` (`xstage.model.interference`, per path), a task that loads memory
(`Task.mem_share` > 0) computes slower while that path's fabric holds at least the onset: its
progress runs on a clock of rate 1 / (1 + stretch), the stretch set by the CTAs whose bursts are in
the fabric. The fabric's bursts change only when a burst starts or ends, so these clocks are
piecewise linear between the simulation's own events, and tasks of one memory share keep one clock.

With `pacers` (per path, a store pacing with `rate` in bytes per second and `budget` in bytes), a
task's burst first waits for the kernel's pacer (`xstage.comm.pacing.pace_stores`): one virtual clock
per path, raised to now, claims the burst's `bytes / rate`, and the CTA waits until its claim ends at
most `budget / rate` ahead of now. Claims are served in the order they are made, so of many CTAs that
finish their tiles together the first leaves after one claim and the last after all of them; a
fluid path drained at the pace would share its drain among them and release all of them at the end.
The wait counts as stall; the burst then goes through the path's simulator (the link itself).

The result gives the predicted kernel time (last CTA done), per-CTA timelines (compute, issue,
stall, wait segments) and the breakdown summed over CTAs. `issue` is what the stores would cost on
an empty path (backpressure-free); `stall` is the rest of the measured-by-model issue time.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from xstage.errors import InputError
from xstage.model import closed_form
from xstage.model.interference import Interference
from xstage.model.params import PathParams
from xstage.model.simulate import path_simulator
from xstage.sched.work import KernelWork, Task

KINDS = ("compute", "issue", "stall", "wait")


@dataclass(frozen=True)
class Segment:
    cta: int
    kind: str  # one of KINDS
    start_ns: float
    end_ns: float
    task: str

    @property
    def duration_ns(self) -> float:
        return self.end_ns - self.start_ns


@dataclass
class SimResult:
    time_ns: float
    segments: list[Segment]
    task_end_ns: dict[str, float]
    backlog: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def breakdown(self) -> dict[str, float]:
        """Total ns per segment kind, summed over CTAs."""
        out = dict.fromkeys(KINDS, 0.0)
        for s in self.segments:
            out[s.kind] += s.duration_ns
        return out

    def cta_end_ns(self) -> dict[int, float]:
        end: dict[int, float] = defaultdict(float)
        for s in self.segments:
            end[s.cta] = max(end[s.cta], s.end_ns)
        return dict(end)


@functools.lru_cache(maxsize=4096)
def _free_issue_ns(params: PathParams, nbytes: int) -> float:
    # kernels store the same few burst sizes thousands of times: remember each one's free issue time
    return closed_form.issue_time(params.replace(c_sm=math.inf, capacity=math.inf), nbytes)


class _LoadClock:
    """The progress of the tasks of one memory share: runs at 1 / sigma of real time, sigma >= 1 set by
    the interference term; entries of `heap` are (progress at which the task ends, cta)."""

    __slots__ = ("mem_share", "progress", "t", "sigma", "slowdown", "heap")

    def __init__(self, mem_share: float, now: float):
        self.mem_share = mem_share
        self.progress = 0.0
        self.t = now
        self.sigma = 1.0
        self.slowdown = 1.0  # the interference term's part of sigma (changes only with the fabric)
        self.heap: list[tuple[float, int]] = []

    def advance(self, now: float) -> None:
        self.progress += (now - self.t) / self.sigma
        self.t = now


class _Cta:
    __slots__ = ("index", "tasks", "pos", "pending_stores", "issue_started", "task_ready", "compute_started")

    def __init__(self, index: int, tasks):
        self.index = index
        self.tasks: list[Task] = list(tasks)
        self.pos = 0
        self.pending_stores: list[tuple[str, int]] = []
        self.issue_started = 0.0
        self.task_ready = 0.0
        self.compute_started = 0.0

    @property
    def task(self) -> Task | None:
        return self.tasks[self.pos] if self.pos < len(self.tasks) else None


class _Pacer:
    """The kernel's store pacer on one path: a virtual clock (ns) at which every claimed byte will have
    left at `rate`; a claim may end at most `budget` bytes' worth of time ahead of now."""

    __slots__ = ("ns_per_byte", "budget_ns", "clock")

    def __init__(self, rate: float, budget: float):
        self.ns_per_byte = 1e9 / rate
        self.budget_ns = budget * self.ns_per_byte
        self.clock = 0.0

    def release(self, now: float, nbytes: float) -> float:
        """Claim `nbytes` at `now`; the time the burst may start."""
        self.clock = max(self.clock, now) + nbytes * self.ns_per_byte
        return max(now, self.clock - self.budget_ns)


def _check_pacer(name: str, p) -> _Pacer:
    rate, budget = getattr(p, "rate", None), getattr(p, "budget", None)
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (rate, budget))
    if not ok or rate <= 0 or budget < 0:
        raise InputError(f"pacers[{name!r}]: expected a pacing with a finite rate > 0 (B/s) and budget >= 0 (B), "
                         f"got {p!r}")
    return _Pacer(float(rate), float(budget))


def simulate_kernel(work: KernelWork, paths: Mapping[str, PathParams], *, trace_backlog: bool = False,
                    engine: str = "fast", interference: Mapping[str, Interference] | None = None,
                    pacers: Mapping[str, object] | None = None) -> SimResult:
    """Predict the kernel time of `work` with the store paths `paths` (path name -> parameters).

    `trace_backlog` records each path's backlog (bytes outstanding) at every path event. `engine`:
    the path simulator, "fast" (compiled) or "reference" (`xstage.model.simulate.path_simulator`).
    `interference` (path name -> `Interference`) slows tasks that load memory while that path is full;
    None or a path without an entry: compute never slows. `pacers` (path name -> a pacing with `rate`,
    B/s, and `budget`, B, such as `xstage.comm.pacing.StorePacing`) paces that path's bursts as the
    kernel does (module docstring); None or a path without an entry: unpaced.
    """
    missing = [p for p in work.paths() if p not in paths]
    if missing:
        raise InputError(f"paths: no parameters for store path(s) {missing}")
    for name, term in (interference or {}).items():
        if not isinstance(term, Interference):
            raise InputError(f"interference[{name!r}]: expected an Interference, got {type(term).__name__}")
    pacer = {name: _check_pacer(name, p) for name, p in (pacers or {}).items() if p is not None}
    sim = _KernelSim(work, paths, engine, trace_backlog, interference or {}, pacer)
    sim.run()
    stuck = [c.task.name for c in sim.ctas if c.task is not None]
    if stuck:
        raise InputError(
            f"work cannot finish: tasks {stuck[:5]} wait on dependencies that never complete "
            "(a cycle, or a dependency ordered later on the same CTA)"
        )
    time_ns = max(sim.task_end.values(), default=0.0)
    return SimResult(time_ns, sim.segments, sim.task_end, sim.backlog)


class _KernelSim:
    """One run of `simulate_kernel`: the CTAs, the path simulators and the clocks of the computing
    tasks, stepped event by event (`run`) until no CTA has a task left it can start."""

    def __init__(self, work: KernelWork, paths: Mapping[str, PathParams], engine: str, trace_backlog: bool,
                 interference: Mapping[str, Interference], pacer: dict[str, _Pacer]):
        self.work = work
        self.paths = paths
        self.pacer = pacer
        self.n = len(work.ctas)
        self.sims = {name: path_simulator(paths[name], self.n, engine=engine) for name in work.paths()}
        self.ctas = [_Cta(i, tasks) for i, tasks in enumerate(work.ctas)]
        self.segments: list[Segment] = []
        self.task_end: dict[str, float] = {}
        self.waiting: dict[str, list[_Cta]] = defaultdict(list)
        self.compute_done: list[tuple[float, int]] = []  # heap of (time, cta)
        self.issuing: dict[tuple[str, int], _Cta] = {}
        self.trace_backlog = trace_backlog
        self.backlog: dict[str, list[tuple[float, float]]] = {name: [] for name in self.sims} if trace_backlog else {}
        self.terms = {name: t for name, t in interference.items() if name in self.sims}
        self.in_fabric: dict[str, dict[int, float]] = {name: {} for name in self.terms}  # path -> cta -> burst bytes
        self.clocks: dict[float, _LoadClock] = {}  # memory share -> its tasks' clock
        self.clock_list: list[_LoadClock] = []  # the same clocks, iterated at every event
        self.occupancy = work.occupancy
        self.computing = 0  # tasks on the clocks
        self.queue = list(work.queue)
        self.taken = 0  # tasks of the shared queue taken so far
        self.released: list[tuple[float, int]] = []  # heap of (time, cta): paced bursts waiting for their claim

    def sync(self, now: float) -> None:
        for clock in self.clock_list:
            clock.advance(now)

    def retune(self, fabric: bool = True) -> None:
        """Each clock's rate after the computing CTAs changed, and with `fabric` also the bursts in the
        fabric (call after `sync`)."""
        if fabric and self.terms:
            active = [(t, len(self.in_fabric[name])) for name, t in self.terms.items()
                      if t.active(t.occupancy(self.in_fabric[name].values(), self.paths[name].capacity))]
            for clock in self.clock_list:
                clock.slowdown = 1.0 + sum(t.stretch(k, clock.mem_share) for t, k in active)
        busy = self.occupancy(max(1, self.computing) / self.n) if self.occupancy else 1.0
        if not 0 < busy < math.inf:
            raise InputError(f"work.occupancy({max(1, self.computing) / self.n:g}) = {busy!r}: "
                             "must be a finite factor > 0")
        for clock in self.clock_list:
            clock.sigma = clock.slowdown * busy

    def trace(self, path: str, now: float) -> None:
        if self.trace_backlog:
            self.backlog[path].append((now, float(self.sims[path].backlog())))

    def try_start(self, cta: _Cta, now: float) -> None:
        task = cta.task
        if task is None and self.taken < len(self.queue):
            # A free CTA takes the next task of the shared queue (the kernel's atomic fetch).
            cta.tasks.append(self.queue[self.taken])
            self.taken += 1
            task = cta.task
        if task is None:
            return
        for dep in task.deps:
            if dep not in self.task_end:
                self.waiting[dep].append(cta)
                return
        start = max([now] + [self.task_end[d] for d in task.deps])
        if start > cta.task_ready:
            self.segments.append(Segment(cta.index, "wait", cta.task_ready, start, task.name))
        if (self.terms and task.mem_share > 0) or (self.occupancy and task.compute_ns > 0):
            self.sync(start)
            share = task.mem_share if self.terms else 0.0  # without the term one clock serves every task
            clock = self.clocks.get(share)
            new = clock is None
            if new:
                clock = self.clocks[share] = _LoadClock(share, start)
                self.clock_list.append(clock)
            cta.compute_started = start
            heapq.heappush(clock.heap, (clock.progress + task.compute_ns, cta.index))
            self.computing += 1
            self.retune(fabric=new)
            return
        end = start + task.compute_ns
        if task.compute_ns > 0:
            self.segments.append(Segment(cta.index, "compute", start, end, task.name))
        heapq.heappush(self.compute_done, (end, cta.index))

    def finish_task(self, cta: _Cta, now: float) -> None:
        task = cta.task
        self.task_end[task.name] = now
        cta.pos += 1
        cta.task_ready = now
        self.try_start(cta, now)
        for other in self.waiting.pop(task.name, []):
            self.try_start(other, now)

    def next_store(self, cta: _Cta, now: float) -> None:
        """Claim the CTA's next store burst (the head of `pending_stores`) from its path's pacer, or
        start it, or finish the task when none is left."""
        if not cta.pending_stores:
            self.finish_task(cta, now)
            return
        path, nbytes = cta.pending_stores[0]
        if path in self.pacer:
            start = self.pacer[path].release(now, nbytes)
            if start > now:
                self.segments.append(Segment(cta.index, "stall", now, start, cta.task.name))
                heapq.heappush(self.released, (start, cta.index))
                return
        self.start_store(cta, now)

    def start_store(self, cta: _Cta, now: float) -> None:
        path, nbytes = cta.pending_stores[0]
        cta.issue_started = now
        self.sims[path].start_burst(cta.index, now, nbytes)
        if path in self.in_fabric:
            self.in_fabric[path][cta.index] = nbytes
        self.trace(path, now)
        self.issuing[(path, cta.index)] = cta

    def store_issued(self, path: str, cta: _Cta, now: float) -> None:
        if self.clocks:
            self.sync(now)
        _, nbytes = cta.pending_stores.pop(0)
        if path in self.in_fabric:
            del self.in_fabric[path][cta.index]
        free = _free_issue_ns(self.paths[path], nbytes)
        start = cta.issue_started
        split = min(now, start + free)
        self.segments.append(Segment(cta.index, "issue", start, split, cta.task.name))
        if now > split:
            self.segments.append(Segment(cta.index, "stall", split, now, cta.task.name))
        self.next_store(cta, now)

    def run(self) -> None:
        """Start every CTA, then play the events in time order (the stores' issue ends on the paths, the
        paced bursts' releases, the tasks' compute ends) until none is left."""
        for cta in self.ctas:
            self.try_start(cta, 0.0)
        single = next(iter(self.sims)) if len(self.sims) == 1 else None
        while True:
            t_compute, slowest = self.next_compute_end()
            paced_first = bool(self.released) and self.released[0][0] < t_compute
            if paced_first:
                t_compute = self.released[0][0]
            if single is not None:
                if self.advance_single_path(single, t_compute):
                    continue
            elif self.advance_next_path(t_compute):
                continue
            if math.isinf(t_compute):
                break
            if paced_first:
                self.release_paced()
            else:
                self.end_compute(t_compute, slowest)

    def next_compute_end(self) -> tuple[float, _LoadClock | None]:
        """The next compute end and the clock it runs on (None: a task of fixed duration)."""
        t_compute = self.compute_done[0][0] if self.compute_done else math.inf
        slowest = None
        for clock in self.clock_list:
            if clock.heap:  # its next end: its first task's remaining progress at its rate
                t = clock.t + (clock.heap[0][0] - clock.progress) * clock.sigma
                if t < t_compute:
                    t_compute, slowest = t, clock
        return t_compute, slowest

    def advance_single_path(self, single: str, t_compute: float) -> bool:
        """One path: move it towards the next compute event, stopping at the first issue end. Whether
        an issue ended."""
        sim = self.sims[single]
        if any(key[0] == single for key in self.issuing):
            ended = sim.advance_until(t_compute)
            if ended:
                for sm, t_end in ended:
                    self.store_issued(single, self.issuing.pop((single, sm)), t_end)
                self.trace(single, ended[-1][1])
                if self.terms:
                    self.retune()
                return True
        return False

    def advance_next_path(self, t_compute: float) -> bool:
        """Several paths: play the earliest path event if it comes no later than `t_compute`. Whether
        one was played."""
        t_path, path_next = math.inf, None
        for name, sim in self.sims.items():
            t = sim.next_event_time()
            if t < t_path:
                t_path, path_next = t, name
        if t_path <= t_compute and path_next is not None:
            for sm, t_end in self.sims[path_next].advance(t_path):
                self.store_issued(path_next, self.issuing.pop((path_next, sm)), t_end)
            self.trace(path_next, t_path)
            if self.terms:
                self.retune()
            return True
        return False

    def release_paced(self) -> None:
        """Start the paced burst whose claim ends first."""
        now, i = heapq.heappop(self.released)
        if self.clocks:
            self.sync(now)
        self.start_store(self.ctas[i], now)
        if self.terms:
            self.retune()

    def end_compute(self, t_compute: float, slowest: _LoadClock | None) -> None:
        """End the compute of the task that ends first (at `t_compute` on clock `slowest`, or the
        earliest fixed-duration task) and start its stores."""
        if slowest is None:
            now, i = heapq.heappop(self.compute_done)
            if self.clocks:
                self.sync(now)
        else:
            now = t_compute
            self.sync(now)
            _, i = heapq.heappop(slowest.heap)
            self.computing -= 1
        cta = self.ctas[i]
        if slowest is not None and now > cta.compute_started:
            self.segments.append(Segment(cta.index, "compute", cta.compute_started, now, cta.task.name))
        dest_path = self.work.dest_path
        cta.pending_stores = [(dest_path[d], b) for d, b in sorted(cta.task.stores.items()) if d in dest_path and b > 0]
        self.next_store(cta, now)
        if self.terms or self.occupancy:
            self.retune(fabric=bool(self.terms))
