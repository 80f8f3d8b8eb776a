"""Event-level (fluid) simulator of bursts from many SMs sharing one store path.

Problem: closed forms cover one issuer; real kernels have n SMs whose bursts and compute gaps
overlap arbitrarily, share the path's drain unevenly and fill one shared window. This module plays
any such schedule through the Burst-Gap model and reports, per burst, when its issue ended and when
its last byte became remote-visible.

Algorithm: bytes are fluid and every rate is constant between events, so the state moves linearly
from one event to the next. Per SM: outstanding bytes `o_i <= c_sm`, first-stage tokens
`k_i <= b_fast`, bytes left in the current burst. Shared: `sum_i o_i <= capacity`. Between events:

1. each issuing SM wants `r_fast` while it holds tokens, `r0` otherwise;
2. the drain `D` is water-filled over the SMs in proportion to their weights: an SM with bytes
   outstanding takes any share, an SM with none takes at most what it issues (work conservation);
3. an SM at its window `c_sm` issues no faster than its drain share;
4. with the shared window full, the SMs' issue is water-filled (by weight) to the total drain.

With `admission="fair_share"` (`xstage.model.params`) steps 3 and 4 become one: each active SM (issuing
or holding bytes) owns `capacity x w_i / sum w` of the window, at most `c_sm`; at its part it issues no
faster than its drain share, and over it (another SM became active) it waits for the drain.

Events: a burst's overhead `t0` ends or its last byte issues, a window fills or empties, the tokens
run out, the shared window fills, a burst's last byte drains (FIFO per SM; completion = that time +
`latency`). One engine: `PathSimulator` is driven call by call (by `xstage.sched`), and
`simulate_bursts` drives it from per-SM programs. An SM slot may stand for `m` identical SMs
(`multiplicity`), which keeps symmetric many-SM runs cheap.

Example:
    >>> from xstage.model.params import PathParams
    >>> from xstage.model.simulate import simulate_bursts
    >>> p = PathParams(r0=64e9, c_sm=2**20, drain=16e9, capacity=2**20, t0=100.0)
    >>> res = simulate_bursts(p, [[(4 * 2**20, 0.0)]])
    >>> round(float(res.issue_ns[0][0]))
    196708
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque

import numpy as np

from xstage.errors import InputError
from xstage.model.fastsim import MAX_SLOTS, FastPathSimulator, check_simulator_args, play_programs, real_list
from xstage.model.params import NS, PathParams

_TOL_B = 1e-6
_IDLE, _OVERHEAD, _ISSUING = 0, 1, 2


def _part_tol(part: float) -> float:
    """Bytes within which an SM counts as at its part of the window (relative, with a floor: parts are
    quotients, so exact equality cannot be asked of them)."""
    return 1e-9 * part + 1e-3


def _waterfill(total: float, demand: list[float], weight: list[float], mult: list[float]) -> list[float]:
    """Per-unit shares s_i = min(demand_i, lam * weight_i) with sum_i mult_i s_i = total."""
    out = [0.0] * len(demand)
    active = [i for i, d in enumerate(demand) if d > 0]
    if not active:
        return out
    if sum(mult[i] * demand[i] for i in active) <= total:
        for i in active:
            out[i] = demand[i]
        return out
    active.sort(key=lambda i: demand[i] / weight[i])
    wsum = sum(mult[i] * weight[i] for i in active)
    left = total
    for pos, i in enumerate(active):
        lam = left / wsum
        if demand[i] <= lam * weight[i]:
            out[i] = demand[i]
            left -= mult[i] * demand[i]
            wsum -= mult[i] * weight[i]
        else:
            for j in active[pos:]:
                out[j] = lam * weight[j]
            break
    return out


class PathSimulator:
    """Incremental fluid simulation of `n_sm` SM slots storing through one path.

    Calls come in nondecreasing time. `start_burst` begins a burst on an idle SM; `advance` moves
    time forward and returns the bursts whose issue ended; `next_event_time` looks ahead (without
    moving) to the earliest issue end if nothing else starts. Times in ns, sizes in bytes.

    Example:
        >>> from xstage.model.params import PathParams
        >>> sim = PathSimulator(PathParams(r0=64e9, c_sm=65536, drain=32e9, capacity=2**20), n_sm=2)
        >>> b = sim.start_burst(0, 0.0, 262144)
        >>> t = sim.next_event_time()
        >>> sim.advance(t) == [(0, t)]
        True
    """

    def __init__(self, params: PathParams, n_sm: int, multiplicity=None, weights=None):
        n, mult, wts = check_simulator_args(params, n_sm, multiplicity, weights)
        self.params = params
        self.n_sm = n
        self.mult = mult
        self.weights = wts
        self._r0 = params.r0 * NS
        self._rf = params.r_fast * NS if params.b_fast > 0 else self._r0
        self._d = params.drain * NS
        self._fair = params.admission == "fair_share"
        self.t = 0.0
        self.o = [0.0] * n
        self.k = [float(params.b_fast)] * n
        self.phase = [_IDLE] * n
        self.t_go = [0.0] * n
        self.rem = [0.0] * n
        self.cur = [-1] * n
        self.issued = [0.0] * n
        self.drained = [0.0] * n
        self.pending = [deque() for _ in range(n)]
        self.bursts: list[list] = []

    @property
    def now(self) -> float:
        return self.t

    def start_burst(self, sm: int, t_ns: float, nbytes: float) -> int:
        """Begin a burst of `nbytes` on SM `sm` at `t_ns` (SM idle, time not before `now`); returns its id."""
        if not (0 <= sm < self.n_sm):
            raise InputError(f"sm must be in [0, {self.n_sm}), got {sm}")
        if not (nbytes > 0 and math.isfinite(nbytes)):
            raise InputError(f"nbytes must be a finite number of bytes > 0, got {nbytes!r}")
        self._run(t_ns, stop_on_issue_end=False)
        if self.phase[sm] != _IDLE:
            raise InputError(f"SM {sm} is still issuing burst {self.cur[sm]} at t={t_ns} ns")
        bid = len(self.bursts)
        self.bursts.append([sm, float(t_ns), math.nan, math.nan, float(nbytes)])
        self.cur[sm] = bid
        self.rem[sm] = float(nbytes)
        if self.params.t0 > 0:
            self.phase[sm] = _OVERHEAD
            self.t_go[sm] = t_ns + self.params.t0
        else:
            self.phase[sm] = _ISSUING
        return bid

    def advance(self, t_ns: float) -> list[tuple[int, float]]:
        """Move to `t_ns`; returns `(sm, issue_end_ns)` of the bursts whose issue ended on the way."""
        return self._run(t_ns, stop_on_issue_end=False)

    def next_event_time(self) -> float:
        """Earliest time a current burst's issue ends if no burst starts meanwhile (inf if none)."""
        if not any(ph != _IDLE for ph in self.phase):
            return math.inf
        saved = self._save()
        try:
            done = self._run(math.inf, stop_on_issue_end=True)
        finally:
            self._load(saved)
        return done[0][1] if done else math.inf

    def backlog(self, t_ns: float | None = None) -> float:
        """Bytes outstanding on the path (all SMs) at `t_ns` (default: now)."""
        if t_ns is not None:
            self._run(t_ns, stop_on_issue_end=False)
        return sum(m * o for m, o in zip(self.mult, self.o))

    def outstanding(self, sm: int) -> float:
        """Bytes outstanding of one SM (of one SM of the slot) now."""
        return self.o[sm]

    def completion_ns(self, burst_id: int) -> float | None:
        """Time the burst's last byte is remote-visible, or None while it is not yet known."""
        c = self.bursts[burst_id][3]
        return None if math.isnan(c) else c

    def issue_end_ns(self, burst_id: int) -> float | None:
        e = self.bursts[burst_id][2]
        return None if math.isnan(e) else e

    def finish(self) -> None:
        """Run until every started burst has issued and completed."""
        self._run(math.inf, stop_on_issue_end=False)

    def advance_until(self, t_ns: float) -> list[tuple[int, float]]:
        """Move towards `t_ns` but stop at the first issue end on the way; returns the bursts that ended.

        The event loop of a kernel simulator with one path calls this instead of `next_event_time`
        + `advance`: it moves once instead of looking ahead and moving again."""
        return self._run(t_ns, stop_on_issue_end=True)

    def _open_bursts(self) -> set[int]:
        """Bursts a run can still change: those issuing and those waiting to complete."""
        ids = {b for b in self.cur if b >= 0 and math.isnan(self.bursts[b][2])}
        for q in self.pending:
            ids.update(bid for bid, _ in q)
        return ids

    def _save(self):
        # Only open bursts can change, so the look-ahead saves those rather than the whole history.
        return (self.t, self.o[:], self.k[:], self.phase[:], self.t_go[:], self.rem[:], self.issued[:],
                self.drained[:], [deque(q) for q in self.pending],
                {b: self.bursts[b][:] for b in self._open_bursts()})

    def _load(self, s) -> None:
        (self.t, self.o, self.k, self.phase, self.t_go, self.rem, self.issued, self.drained,
         self.pending, open_bursts) = s
        for b, row in open_bursts.items():
            self.bursts[b] = row

    def _parts(self) -> list[float]:
        """Each SM's part of the shared window under fair-share admission (see the module docstring)."""
        p, n, o, mult, w = self.params, self.n_sm, self.o, self.mult, self.weights
        wsum = 0.0
        for i in range(n):
            if self.phase[i] == _ISSUING or o[i] > _TOL_B:
                wsum += mult[i] * w[i]
        if not math.isfinite(p.capacity) or wsum == 0:
            return [p.c_sm] * n
        return [min(p.c_sm, p.capacity * w[i] / wsum) for i in range(n)]

    def _rates_fair(self) -> tuple[list[float], list[float]]:
        n, o, w, mult = self.n_sm, self.o, self.weights, self.mult
        part = self._part = self._parts()
        a = [(self._rf if self.k[i] > _TOL_B else self._r0) if self.phase[i] == _ISSUING else 0.0
             for i in range(n)]
        d = _waterfill(self._d, [math.inf if o[i] > _TOL_B else a[i] for i in range(n)], w, mult)
        for i in range(n):
            tol = _part_tol(part[i])
            if o[i] > part[i] + tol:
                a[i] = 0.0
            elif a[i] > d[i] and o[i] >= part[i] - tol:
                a[i] = d[i]
        d = _waterfill(self._d, [math.inf if o[i] > _TOL_B else a[i] for i in range(n)], w, mult)
        return a, d

    def _rates(self) -> tuple[list[float], list[float]]:
        if self._fair:
            return self._rates_fair()
        p, n = self.params, self.n_sm
        o, k, mult, w = self.o, self.k, self.mult, self.weights
        a = [0.0] * n
        for i in range(n):
            if self.phase[i] == _ISSUING:
                a[i] = self._rf if k[i] > _TOL_B else self._r0
        demand = [math.inf if o[i] > _TOL_B else a[i] for i in range(n)]
        d = _waterfill(self._d, demand, w, mult)
        for i in range(n):
            if a[i] > d[i] and o[i] >= p.c_sm - _TOL_B:
                a[i] = d[i]
        if sum(m * x for m, x in zip(mult, o)) >= p.capacity - _TOL_B:
            total = sum(m * x for m, x in zip(mult, d))
            a = _waterfill(total, a, w, mult)
            d = _waterfill(self._d, [math.inf if o[i] > _TOL_B else a[i] for i in range(n)], w, mult)
        return a, d

    def _run(self, t_limit: float, stop_on_issue_end: bool) -> list[tuple[int, float]]:
        if t_limit < self.t - 1e-9 * max(1.0, abs(self.t)):
            raise InputError(f"time must not go backwards: now {self.t} ns, asked {t_limit} ns")
        p, n = self.params, self.n_sm
        done: list[tuple[int, float]] = []
        while True:
            busy = any(ph != _IDLE for ph in self.phase) or any(self.pending)
            if not busy:
                if math.isfinite(t_limit) and t_limit > self.t:
                    idle = t_limit - self.t
                    self.k = [min(p.b_fast, k + self._r0 * idle) for k in self.k]
                    self.t = t_limit
                return done
            a, d = self._rates()
            dt = t_limit - self.t
            q_tot = sum(m * x for m, x in zip(self.mult, self.o))
            dq = sum(m * (x - y) for m, x, y in zip(self.mult, a, d))
            if dq > 0 and q_tot < p.capacity - _TOL_B:
                dt = min(dt, (p.capacity - q_tot) / dq)
            for i in range(n):
                ph = self.phase[i]
                if ph == _OVERHEAD:
                    dt = min(dt, self.t_go[i] - self.t)
                elif ph == _ISSUING and a[i] > 0:
                    dt = min(dt, self.rem[i] / a[i])
                net = a[i] - d[i]
                if net > 0 and self.o[i] < p.c_sm - _TOL_B:
                    dt = min(dt, (p.c_sm - self.o[i]) / net)
                elif net < 0 and self.o[i] > _TOL_B:
                    dt = min(dt, self.o[i] / -net)
                if a[i] > self._r0 and self.k[i] > _TOL_B:
                    dt = min(dt, self.k[i] / (a[i] - self._r0))
                if self.pending[i] and d[i] > 0:
                    dt = min(dt, (self.pending[i][0][1] - self.drained[i]) / d[i])
                if self._fair:  # an SM reaching its part of the window (from below, or down by the drain)
                    part = self._part[i]
                    tol = _part_tol(part)
                    if net > 0 and self.o[i] < part - tol:
                        dt = min(dt, (part - self.o[i]) / net)
                    elif a[i] == 0 and d[i] > 0 and self.o[i] > part + tol:
                        dt = min(dt, (self.o[i] - part) / d[i])
            if math.isinf(dt):
                raise InputError("simulation cannot progress: no rate is positive (check the parameters)")
            dt = max(dt, 0.0)
            self._move(dt, a, d)
            done.extend(self._settle())
            if (stop_on_issue_end and done) or self.t >= t_limit:
                return done

    def _move(self, dt: float, a: list[float], d: list[float]) -> None:
        p = self.params
        self.t += dt
        for i in range(self.n_sm):
            if a[i] == 0 and d[i] == 0 and self.k[i] >= p.b_fast:
                continue
            self.o[i] = min(p.c_sm, max(0.0, self.o[i] + (a[i] - d[i]) * dt))
            self.k[i] = min(p.b_fast, max(0.0, self.k[i] + (self._r0 - a[i]) * dt))
            self.rem[i] -= a[i] * dt
            self.issued[i] += a[i] * dt
            self.drained[i] += d[i] * dt

    def _settle(self) -> list[tuple[int, float]]:
        """Snap values onto the boundaries they reached and record the events that happened."""
        p, t = self.params, self.t
        done = []
        for i in range(self.n_sm):
            if self.o[i] <= _TOL_B:
                self.o[i] = 0.0
                self.drained[i] = self.issued[i]
            elif self.o[i] >= p.c_sm - _TOL_B:
                self.o[i] = p.c_sm
            if self.k[i] <= _TOL_B:
                self.k[i] = 0.0
            if self.phase[i] == _OVERHEAD and self.t_go[i] <= t + 1e-9:
                self.phase[i] = _ISSUING
            if self.phase[i] == _ISSUING and self.rem[i] <= _TOL_B:
                bid = self.cur[i]
                self.issued[i] += self.rem[i]
                self.rem[i] = 0.0
                self.phase[i] = _IDLE
                self.bursts[bid][2] = t
                self.pending[i].append((bid, self.issued[i]))
                done.append((i, t))
            q = self.pending[i]
            while q and self.drained[i] >= q[0][1] - _TOL_B:
                bid, _ = q.popleft()
                self.bursts[bid][3] = t + p.latency
        return done


@dataclasses.dataclass
class BurstResult:
    """Per SM slot, per burst: start, issue end and completion (ns), issue time and bytes."""

    start_ns: list[np.ndarray]
    issue_end_ns: list[np.ndarray]
    completion_ns: list[np.ndarray]
    nbytes: list[np.ndarray]
    multiplicity: list[float]

    @property
    def issue_ns(self) -> list[np.ndarray]:
        return [e - s for s, e in zip(self.start_ns, self.issue_end_ns)]

    def burst_issue_ns(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Issue times of burst `index` over the slots that have it, with the slots' multiplicities."""
        vals, mult = [], []
        for s, e, m in zip(self.start_ns, self.issue_end_ns, self.multiplicity):
            if index < len(s):
                vals.append(e[index] - s[index])
                mult.append(m)
        return np.array(vals), np.array(mult)


def _check_programs(programs) -> list[list[tuple[float, float]]]:
    if not isinstance(programs, (list, tuple)) or not programs or len(programs) > MAX_SLOTS:
        raise InputError(f"programs must be a non-empty list of at most {MAX_SLOTS} (one list of (burst_bytes, "
                         "gap_ns) per SM)")
    out = []
    for sm, prog in enumerate(programs):
        if not isinstance(prog, (list, tuple)):
            raise InputError(f"programs[{sm}] must be a list of (burst_bytes, gap_ns)")
        items = []
        for j, item in enumerate(prog):
            try:
                b, g = real_list(item, f"programs[{sm}][{j}]")
            except (InputError, ValueError):
                raise InputError(f"programs[{sm}][{j}] must be (burst_bytes, gap_ns)") from None
            if not (b > 0 and math.isfinite(b)):
                raise InputError(f"programs[{sm}][{j}]: burst_bytes must be > 0, got {b!r}")
            if not (g >= 0 and math.isfinite(g)):
                raise InputError(f"programs[{sm}][{j}]: gap_ns must be >= 0, got {g!r}")
            items.append((b, g))
        out.append(items)
    return out


ENGINES = ("fast", "reference")


def path_simulator(params: PathParams, n_sm: int, multiplicity=None, weights=None, engine: str = "fast"):
    """A path simulator on `engine`: "fast" (`xstage.model.fastsim`, compiled) or "reference" (this
    module's `PathSimulator`, kept for the tests that hold the fast one to it)."""
    if not isinstance(engine, str):
        raise InputError(f"engine {engine!r}: must be one of {', '.join(ENGINES)}")
    if engine == "fast":
        return FastPathSimulator(params, n_sm, multiplicity, weights)
    if engine == "reference":
        return PathSimulator(params, n_sm, multiplicity, weights)
    raise InputError(f"engine {engine!r}: must be one of {', '.join(ENGINES)}")


def simulate_bursts(params: PathParams, programs, start_ns=None, multiplicity=None,
                    weights=None, engine: str = "fast") -> BurstResult:
    """Play per-SM programs of `(burst_bytes, gap_ns)` (gap after each burst) through one path.

    SMs start together at t=0 unless `start_ns[sm]` says otherwise; `multiplicity[sm]` makes a slot
    stand for that many identical SMs (same program, same weight). `engine`: see `path_simulator`.
    """
    progs = _check_programs(programs)
    n = len(progs)
    starts = [0.0] * n if start_ns is None else real_list(start_ns, "start_ns")
    if not isinstance(engine, str) or engine not in ENGINES:
        raise InputError(f"engine {engine!r}: must be one of {', '.join(ENGINES)}")
    if len(starts) != n or any(not (s >= 0 and math.isfinite(s)) for s in starts):
        raise InputError(f"start_ns must list {n} finite times >= 0 ns")
    if engine == "fast":
        return BurstResult(*play_programs(params, progs, starts, multiplicity, weights))
    sim = path_simulator(params, n, multiplicity, weights, engine)
    ids: list[list[int]] = [[] for _ in range(n)]
    heap = [(starts[sm], sm, 0) for sm in range(n) if progs[sm]]
    heapq.heapify(heap)
    while heap or any(ph != _IDLE for ph in sim.phase):
        t_next = heap[0][0] if heap else math.inf
        done = sim.advance_until(t_next)
        if done:
            for sm, t_end in done:
                j = len(ids[sm])
                if j < len(progs[sm]):
                    heapq.heappush(heap, (t_end + progs[sm][j - 1][1], sm, j))
            continue
        while heap and heap[0][0] <= sim.t:
            t_s, sm, j = heapq.heappop(heap)
            ids[sm].append(sim.start_burst(sm, max(t_s, sim.t), progs[sm][j][0]))
    sim.finish()
    rec = np.array(sim.bursts, dtype=float).reshape(-1, 5)

    def col(c: int) -> list[np.ndarray]:
        return [rec[ids[sm], c] if ids[sm] else np.zeros(0) for sm in range(n)]

    return BurstResult(col(1), col(2), col(3), col(4), list(sim.mult))
