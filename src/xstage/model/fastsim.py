"""The fluid path simulator compiled with numba: the same events, the same arithmetic, ~100x faster.

Problem: `xstage.model.simulate.PathSimulator` is the reference engine, pure Python. Fitting a
profile with bootstrap rounds and validating hundreds of kernels call it millions of times; at
interpreter speed that takes hours on two cores.

Algorithm: the reference engine's loop (`_rates`, `_run`, `_move`, `_settle`, `_waterfill`) ported
line by line to numba over flat float64 arrays, in the same order of operations, so that every
burst's issue end and completion agree with the reference (the tests hold them to 1e-9 relative; in
practice they are bitwise equal). A per-SM FIFO of bursts waiting to drain becomes a linked list over
burst ids. `FastPathSimulator` keeps the reference's API (`start_burst`, `advance`,
`advance_until`, `next_event_time`, `backlog`, `outstanding`, `completion_ns`, `issue_end_ns`,
`finish`), so `simulate_bursts` and `xstage.sched.simulate_kernel` take either engine.

Example:
    >>> from xstage.model.params import PathParams
    >>> sim = FastPathSimulator(PathParams(r0=64e9, c_sm=65536, drain=32e9, capacity=2**20), n_sm=2)
    >>> b = sim.start_burst(0, 0.0, 262144)
    >>> t = sim.next_event_time()
    >>> sim.advance(t) == [(0, t)]
    True
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from numba import njit

from xstage.bounds import MAX_SMS, check_int, check_sequence
from xstage.errors import InputError
from xstage.model.params import NS, PathParams

MAX_SLOTS = MAX_SMS * 32  # SM slots (or CTAs) one simulation plays: every resident CTA of the largest GPU

_TOL_B = 1e-6
_IDLE, _OVERHEAD, _ISSUING = 0, 1, 2


@njit(cache=True)
def _waterfill(total, demand, weight, mult, out):
    # out_i = min(demand_i, lam * weight_i) with sum_i mult_i out_i = total (the reference's order)
    n = demand.shape[0]
    for i in range(n):
        out[i] = 0.0
    n_act = 0
    for i in range(n):
        if demand[i] > 0:
            n_act += 1
    if n_act == 0:
        return
    act = np.empty(n_act, np.int64)
    j = 0
    s = 0.0
    for i in range(n):
        if demand[i] > 0:
            act[j] = i
            j += 1
            s += mult[i] * demand[i]
    if s <= total:
        for i in act:
            out[i] = demand[i]
        return
    keys = np.empty(n_act)
    for j in range(n_act):
        keys[j] = demand[act[j]] / weight[act[j]]
    act = act[np.argsort(keys, kind="mergesort")]  # stable, as Python's sort
    wsum = 0.0
    for i in act:
        wsum += mult[i] * weight[i]
    left = total
    for pos in range(n_act):
        i = act[pos]
        lam = left / wsum
        if demand[i] <= lam * weight[i]:
            out[i] = demand[i]
            left -= mult[i] * demand[i]
            wsum -= mult[i] * weight[i]
        else:
            for q in range(pos, n_act):
                out[act[q]] = lam * weight[act[q]]
            break


@njit(cache=True)
def _part_tol(part):
    return 1e-9 * part + 1e-3  # the reference's `_part_tol`


@njit(cache=True)
def _parts(st, o, phase, mult, w, part):
    # the reference's `_parts`: each active SM's part of the shared window under fair-share admission
    c_sm, capacity = st[4], st[5]
    n = o.shape[0]
    wsum = 0.0
    for i in range(n):
        if phase[i] == _ISSUING or o[i] > _TOL_B:
            wsum += mult[i] * w[i]
    for i in range(n):
        if not math.isfinite(capacity) or wsum == 0:
            part[i] = c_sm
        else:
            part[i] = min(c_sm, capacity * w[i] / wsum)


@njit(cache=True)
def _rates(st, o, k, phase, mult, w, a, d, tmp, part):
    r0, rf, drain, c_sm, capacity = st[1], st[2], st[3], st[4], st[5]
    n = o.shape[0]
    for i in range(n):
        a[i] = 0.0
        if phase[i] == _ISSUING:
            a[i] = rf if k[i] > _TOL_B else r0
    if st[8] > 0:  # fair-share admission: the reference's `_rates_fair`
        _parts(st, o, phase, mult, w, part)
        for i in range(n):
            tmp[i] = math.inf if o[i] > _TOL_B else a[i]
        _waterfill(drain, tmp, w, mult, d)
        for i in range(n):
            tol = _part_tol(part[i])
            if o[i] > part[i] + tol:
                a[i] = 0.0
            elif a[i] > d[i] and o[i] >= part[i] - tol:
                a[i] = d[i]
        for i in range(n):
            tmp[i] = math.inf if o[i] > _TOL_B else a[i]
        _waterfill(drain, tmp, w, mult, d)
        return
    for i in range(n):
        tmp[i] = math.inf if o[i] > _TOL_B else a[i]
    _waterfill(drain, tmp, w, mult, d)
    for i in range(n):
        if a[i] > d[i] and o[i] >= c_sm - _TOL_B:
            a[i] = d[i]
    q = 0.0
    for i in range(n):
        q += mult[i] * o[i]
    if q >= capacity - _TOL_B:
        total = 0.0
        for i in range(n):
            total += mult[i] * d[i]
        a_in = a.copy()
        _waterfill(total, a_in, w, mult, a)
        for i in range(n):
            tmp[i] = math.inf if o[i] > _TOL_B else a[i]
        _waterfill(drain, tmp, w, mult, d)


@njit(cache=True)
def _run(st, t_limit, stop_on_issue_end, o, k, phase, t_go, rem, cur, issued, drained, mult, w,
         pend_head, pend_tail, pend_next, b_mark, b_issue_end, b_completion, done_sm, done_t):
    """The reference `_run`; `st` = [t, r0, r_fast, drain, c_sm, capacity, b_fast, latency, fair] (per ns;
    `fair` is 1 for fair-share admission, else 0).
    Returns how many issue ends it recorded in `done_sm` / `done_t`."""
    r0, c_sm, capacity, b_fast, latency = st[1], st[4], st[5], st[6], st[7]
    n = o.shape[0]
    n_done = 0
    a = np.empty(n)
    d = np.empty(n)
    tmp = np.empty(n)
    part = np.empty(n)
    fair = st[8] > 0
    while True:
        busy = False
        for i in range(n):
            if phase[i] != _IDLE or pend_head[i] >= 0:
                busy = True
                break
        if not busy:
            if math.isfinite(t_limit) and t_limit > st[0]:
                idle = t_limit - st[0]
                for i in range(n):
                    k[i] = min(b_fast, k[i] + r0 * idle)
                st[0] = t_limit
            return n_done
        _rates(st, o, k, phase, mult, w, a, d, tmp, part)
        dt = t_limit - st[0]
        q_tot = 0.0
        for i in range(n):
            q_tot += mult[i] * o[i]
        dq = 0.0
        for i in range(n):
            dq += mult[i] * (a[i] - d[i])
        if dq > 0 and q_tot < capacity - _TOL_B:
            dt = min(dt, (capacity - q_tot) / dq)
        for i in range(n):
            ph = phase[i]
            if ph == _OVERHEAD:
                dt = min(dt, t_go[i] - st[0])
            elif ph == _ISSUING and a[i] > 0:
                dt = min(dt, rem[i] / a[i])
            net = a[i] - d[i]
            if net > 0 and o[i] < c_sm - _TOL_B:
                dt = min(dt, (c_sm - o[i]) / net)
            elif net < 0 and o[i] > _TOL_B:
                dt = min(dt, o[i] / -net)
            if a[i] > r0 and k[i] > _TOL_B:
                dt = min(dt, k[i] / (a[i] - r0))
            if pend_head[i] >= 0 and d[i] > 0:
                dt = min(dt, (b_mark[pend_head[i]] - drained[i]) / d[i])
            if fair:
                tol = _part_tol(part[i])
                if net > 0 and o[i] < part[i] - tol:
                    dt = min(dt, (part[i] - o[i]) / net)
                elif a[i] == 0 and d[i] > 0 and o[i] > part[i] + tol:
                    dt = min(dt, (o[i] - part[i]) / d[i])
        if math.isinf(dt):
            return -1
        dt = max(dt, 0.0)
        # _move
        st[0] += dt
        for i in range(n):
            if a[i] == 0 and d[i] == 0 and k[i] >= b_fast:
                continue
            o[i] = min(c_sm, max(0.0, o[i] + (a[i] - d[i]) * dt))
            k[i] = min(b_fast, max(0.0, k[i] + (r0 - a[i]) * dt))
            rem[i] -= a[i] * dt
            issued[i] += a[i] * dt
            drained[i] += d[i] * dt
        # _settle
        t = st[0]
        for i in range(n):
            if o[i] <= _TOL_B:
                o[i] = 0.0
                drained[i] = issued[i]
            elif o[i] >= c_sm - _TOL_B:
                o[i] = c_sm
            if k[i] <= _TOL_B:
                k[i] = 0.0
            if phase[i] == _OVERHEAD and t_go[i] <= t + 1e-9:
                phase[i] = _ISSUING
            if phase[i] == _ISSUING and rem[i] <= _TOL_B:
                bid = cur[i]
                issued[i] += rem[i]
                rem[i] = 0.0
                phase[i] = _IDLE
                b_issue_end[bid] = t
                b_mark[bid] = issued[i]
                pend_next[bid] = -1
                if pend_tail[i] >= 0:
                    pend_next[pend_tail[i]] = bid
                else:
                    pend_head[i] = bid
                pend_tail[i] = bid
                done_sm[n_done] = i
                done_t[n_done] = t
                n_done += 1
            while pend_head[i] >= 0 and drained[i] >= b_mark[pend_head[i]] - _TOL_B:
                bid = pend_head[i]
                b_completion[bid] = t + latency
                pend_head[i] = pend_next[bid]
                if pend_head[i] < 0:
                    pend_tail[i] = -1
        if (stop_on_issue_end and n_done > 0) or st[0] >= t_limit:
            return n_done


@njit(cache=True)
def _play(st, t0, o, k, phase, t_go, rem, cur, issued, drained, mult, w, prog_b, prog_g, prog_len, starts):
    """`simulate_bursts`'s loop, compiled: per SM a program of (bytes, gap after) from `starts[sm]`.
    Returns the bursts `[sm, start, issue_end, completion, bytes]` in start order (-1 rows: stuck)."""
    n = o.shape[0]
    total = 0
    for i in range(n):
        total += prog_len[i]
    pend_head = np.full(n, -1, np.int64)
    pend_tail = np.full(n, -1, np.int64)
    pend_next = np.full(total, -1, np.int64)
    b_mark = np.zeros(total)
    b_issue_end = np.full(total, np.nan)
    b_completion = np.full(total, np.nan)
    b_sm = np.full(total, -1, np.int64)
    b_start = np.full(total, np.nan)
    b_bytes = np.full(total, np.nan)
    done_sm = np.empty(n, np.int64)
    done_t = np.empty(n)
    next_t = np.full(n, np.inf)  # the heap of the reference: at most one pending start per SM
    next_j = np.zeros(n, np.int64)
    started = np.zeros(n, np.int64)
    for i in range(n):
        if prog_len[i] > 0:
            next_t[i] = starts[i]
    n_b = 0
    while True:
        heap_any = False
        t_next = np.inf
        for i in range(n):
            if next_t[i] < np.inf:
                heap_any = True
                if next_t[i] < t_next:
                    t_next = next_t[i]
        issuing = False
        for i in range(n):
            if phase[i] != _IDLE:
                issuing = True
                break
        if not heap_any and not issuing:
            break
        n_done = _run(st, t_next, True, o, k, phase, t_go, rem, cur, issued, drained, mult, w, pend_head,
                      pend_tail, pend_next, b_mark, b_issue_end, b_completion, done_sm, done_t)
        if n_done < 0:
            return b_sm[:0], b_start[:0], b_issue_end[:0], b_completion[:0], b_bytes[:0], False
        if n_done > 0:
            for q in range(n_done):
                sm = done_sm[q]
                j = started[sm]
                if j < prog_len[sm]:
                    next_t[sm] = done_t[q] + prog_g[sm, j - 1]
                    next_j[sm] = j
            continue
        while True:
            # pop (t, sm) in the reference heap's order: earliest time, then lowest SM
            best = -1
            for i in range(n):
                if next_t[i] < np.inf and next_t[i] <= st[0]:
                    if best < 0 or next_t[i] < next_t[best]:
                        best = i
            if best < 0:
                break
            sm = best
            t_s = max(next_t[sm], st[0])
            next_t[sm] = np.inf
            j = next_j[sm]
            nd = _run(st, t_s, False, o, k, phase, t_go, rem, cur, issued, drained, mult, w, pend_head, pend_tail,
                      pend_next, b_mark, b_issue_end, b_completion, done_sm, done_t)
            if nd < 0:
                return b_sm[:0], b_start[:0], b_issue_end[:0], b_completion[:0], b_bytes[:0], False
            bid = n_b
            n_b += 1
            b_sm[bid] = sm
            b_start[bid] = t_s
            b_bytes[bid] = prog_b[sm, j]
            cur[sm] = bid
            rem[sm] = prog_b[sm, j]
            if t0 > 0:
                phase[sm] = _OVERHEAD
                t_go[sm] = t_s + t0
            else:
                phase[sm] = _ISSUING
            started[sm] += 1
    nd = _run(st, np.inf, False, o, k, phase, t_go, rem, cur, issued, drained, mult, w, pend_head, pend_tail,
              pend_next, b_mark, b_issue_end, b_completion, done_sm, done_t)
    return b_sm[:n_b], b_start[:n_b], b_issue_end[:n_b], b_completion[:n_b], b_bytes[:n_b], nd >= 0


def play_programs(params: PathParams, programs, starts, multiplicity=None, weights=None):
    """The bursts of `simulate_bursts` on the compiled engine: per SM slot, arrays of start, issue end,
    completion and bytes (ns, bytes), in program order; `programs` checked as `simulate_bursts` does."""
    sim = FastPathSimulator(params, len(programs), multiplicity, weights)
    n = sim.n_sm
    longest = max(1, max(len(p) for p in programs))
    prog_b = np.zeros((n, longest))
    prog_g = np.zeros((n, longest))
    prog_len = np.zeros(n, dtype=np.int64)
    for i, prog in enumerate(programs):
        prog_len[i] = len(prog)
        for j, (b, g) in enumerate(prog):
            prog_b[i, j], prog_g[i, j] = b, g
    b_sm, b_start, b_end, b_cpl, b_bytes, ok = _play(
        sim._st, float(params.t0), sim.o, sim.k, sim.phase, sim.t_go, sim.rem, sim.cur, sim.issued, sim.drained,
        sim.mult, sim.weights, prog_b, prog_g, prog_len, np.asarray(starts, dtype=np.float64))
    if not ok:
        raise InputError("simulation cannot progress: no rate is positive (check the parameters)")
    per_sm = [np.flatnonzero(b_sm == i) for i in range(n)]
    return ([b_start[ix] for ix in per_sm], [b_end[ix] for ix in per_sm], [b_cpl[ix] for ix in per_sm],
            [b_bytes[ix] for ix in per_sm], sim.mult.tolist())


def real_list(values, name: str) -> list[float]:
    """`values` as floats: a list (or other sequence) of finite real numbers, else `InputError`."""
    out = [float(v) for v in check_sequence(values, name, numbers.Real, "finite numbers")]
    if not all(math.isfinite(v) for v in out):
        raise InputError(f"{name}: must be a list of finite numbers, got {values!r:.80}")
    return out


def check_simulator_args(params, n_sm, multiplicity, weights) -> tuple[int, list[float], list[float]]:
    """Both engines' arguments checked the same way: (SM slots, multiplicities, drain weights)."""
    if not isinstance(params, PathParams):
        raise InputError("params must be a PathParams")
    n = check_int(n_sm, "n_sm", 1, MAX_SLOTS, "SM slots of the simulation")
    mult = [1.0] * n if multiplicity is None else real_list(multiplicity, "multiplicity")
    if len(mult) != n or any(not 1 <= m <= MAX_SLOTS or m != int(m) for m in mult):
        raise InputError(f"multiplicity must list {n} integers in 1..{MAX_SLOTS}")
    if weights is None:
        weights = class_weights(params, mult)
    wts = real_list(weights, "weights")
    if len(wts) != n or any(not w > 0 for w in wts):
        raise InputError(f"weights must list {n} finite numbers > 0")
    return n, mult, wts


def class_weights(params: PathParams, mult: list[float]) -> list[float]:
    """Weight of each slot: the spread's log-uniform weight at the middle of the slot's SMs."""
    total = sum(mult)
    out, first = [], 0.0
    for m in mult:
        mid = (first + m / 2.0) / total
        out.append(params.spread ** (mid - 0.5))
        first += m
    return out


class FastPathSimulator:
    """`xstage.model.simulate.PathSimulator` on the compiled engine (same API, same results)."""

    def __init__(self, params: PathParams, n_sm: int, multiplicity=None, weights=None):
        n, mult, wts = check_simulator_args(params, n_sm, multiplicity, weights)
        self.params, self.n_sm = params, n
        self.mult = np.array(mult, dtype=np.float64)
        self.weights = np.array(wts, dtype=np.float64)
        r0 = params.r0 * NS
        rf = params.r_fast * NS if params.b_fast > 0 else r0
        self._st = np.array([0.0, r0, rf, params.drain * NS, params.c_sm, params.capacity, float(params.b_fast),
                             params.latency, 1.0 if params.admission == "fair_share" else 0.0], dtype=np.float64)
        self.o = np.zeros(n)
        self.k = np.full(n, float(params.b_fast))
        self.phase = np.zeros(n, dtype=np.int64)
        self.t_go = np.zeros(n)
        self.rem = np.zeros(n)
        self.cur = np.full(n, -1, dtype=np.int64)
        self.issued = np.zeros(n)
        self.drained = np.zeros(n)
        self.pend_head = np.full(n, -1, dtype=np.int64)
        self.pend_tail = np.full(n, -1, dtype=np.int64)
        self._n_b = 0
        self._grow(64)
        self._done_sm = np.empty(n, dtype=np.int64)
        self._done_t = np.empty(n)

    def _grow(self, cap: int) -> None:
        old = self._n_b
        def keep(a, fill, dtype=np.float64):
            out = np.full(cap, fill, dtype=dtype)
            if old:
                out[:old] = a[:old]
            return out
        self.b_sm = keep(getattr(self, "b_sm", None), -1, np.int64)
        self.b_start = keep(getattr(self, "b_start", None), math.nan)
        self.b_issue_end = keep(getattr(self, "b_issue_end", None), math.nan)
        self.b_completion = keep(getattr(self, "b_completion", None), math.nan)
        self.b_bytes = keep(getattr(self, "b_bytes", None), math.nan)
        self.b_mark = keep(getattr(self, "b_mark", None), 0.0)
        self.pend_next = keep(getattr(self, "pend_next", None), -1, np.int64)

    @property
    def now(self) -> float:
        return float(self._st[0])

    @property
    def t(self) -> float:
        return float(self._st[0])

    @property
    def bursts(self) -> list[list]:
        """`[sm, start, issue_end, completion, nbytes]` per burst, as the reference keeps them."""
        n = self._n_b
        return [[int(self.b_sm[i]), float(self.b_start[i]), float(self.b_issue_end[i]), float(self.b_completion[i]),
                 float(self.b_bytes[i])] for i in range(n)]

    def _call(self, t_limit: float, stop: bool) -> list[tuple[int, float]]:
        if t_limit < self._st[0] - 1e-9 * max(1.0, abs(self._st[0])):
            raise InputError(f"time must not go backwards: now {self._st[0]} ns, asked {t_limit} ns")
        n_done = _run(self._st, float(t_limit), stop, self.o, self.k, self.phase, self.t_go, self.rem, self.cur,
                      self.issued, self.drained, self.mult, self.weights, self.pend_head, self.pend_tail,
                      self.pend_next, self.b_mark, self.b_issue_end, self.b_completion, self._done_sm, self._done_t)
        if n_done < 0:
            raise InputError("simulation cannot progress: no rate is positive (check the parameters)")
        return [(int(self._done_sm[j]), float(self._done_t[j])) for j in range(n_done)]

    def start_burst(self, sm: int, t_ns: float, nbytes: float) -> int:
        if not (0 <= sm < self.n_sm):
            raise InputError(f"sm must be in [0, {self.n_sm}), got {sm}")
        if not (nbytes > 0 and math.isfinite(nbytes)):
            raise InputError(f"nbytes must be a finite number of bytes > 0, got {nbytes!r}")
        self._call(t_ns, False)
        if self.phase[sm] != _IDLE:
            raise InputError(f"SM {sm} is still issuing burst {self.cur[sm]} at t={t_ns} ns")
        if self._n_b == len(self.b_sm):
            self._grow(2 * len(self.b_sm))
        bid = self._n_b
        self._n_b += 1
        self.b_sm[bid], self.b_start[bid], self.b_bytes[bid] = sm, float(t_ns), float(nbytes)
        self.cur[sm] = bid
        self.rem[sm] = float(nbytes)
        if self.params.t0 > 0:
            self.phase[sm] = _OVERHEAD
            self.t_go[sm] = t_ns + self.params.t0
        else:
            self.phase[sm] = _ISSUING
        return bid

    def advance(self, t_ns: float) -> list[tuple[int, float]]:
        return self._call(t_ns, False)

    def advance_until(self, t_ns: float) -> list[tuple[int, float]]:
        return self._call(t_ns, True)

    def _state(self):
        return [a.copy() for a in (self._st, self.o, self.k, self.phase, self.t_go, self.rem, self.cur, self.issued,
                                    self.drained, self.pend_head, self.pend_tail, self.pend_next, self.b_mark,
                                    self.b_issue_end, self.b_completion)]

    def _restore(self, s) -> None:
        (self._st, self.o, self.k, self.phase, self.t_go, self.rem, self.cur, self.issued, self.drained,
         self.pend_head, self.pend_tail, self.pend_next, self.b_mark, self.b_issue_end, self.b_completion) = s

    def next_event_time(self) -> float:
        if not (self.phase != _IDLE).any():
            return math.inf
        saved = self._state()
        try:
            done = self._call(math.inf, True)
        finally:
            self._restore(saved)
        return done[0][1] if done else math.inf

    def backlog(self, t_ns: float | None = None) -> float:
        if t_ns is not None:
            self._call(t_ns, False)
        return float(sum(m * o for m, o in zip(self.mult.tolist(), self.o.tolist())))

    def outstanding(self, sm: int) -> float:
        return float(self.o[sm])

    def completion_ns(self, burst_id: int) -> float | None:
        c = self.b_completion[burst_id]
        return None if math.isnan(c) else float(c)

    def issue_end_ns(self, burst_id: int) -> float | None:
        e = self.b_issue_end[burst_id]
        return None if math.isnan(e) else float(e)

    def finish(self) -> None:
        self._call(math.inf, False)


__all__ = ["FastPathSimulator", "check_simulator_args", "class_weights", "play_programs"]
