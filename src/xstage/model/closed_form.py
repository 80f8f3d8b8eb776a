"""Closed forms of the Burst-Gap model for one issuer.

Problem: given a path's parameters, say how long a burst of B bytes takes to issue, whether and when
it stalls, how much it leaves in the X-Stage and how long that takes to drain, without simulating.

Algorithm: one SM alone sees a single window `C = min(c_sm, capacity)` drained at `D = drain`; `n`
SMs that run the same program from the same time with equal sharing each see `D / n` and
`min(c_sm, capacity / n)` (`PathParams.symmetric`). Within a burst that starts its stores with
backlog `q` and first-stage tokens `k`, the cumulative bytes issued after `t` ns follow the arrival
curve `min(r_fast t, k + r0 t, C - q + D t)` (the greedy output of a token bucket in series with a
window: for concave curves the min-plus convolution is the minimum), so

    issue time   T = t0 + max(B / r_fast, (B - k) / r0, (B - C + q) / D)
    backlog end  Q_end = max(0, q + B - D (T - t0))
    completion   T_cpl = T + Q_end / D + latency;   recovery Q_end / D

The overhead `t0` comes before the first store and the X-Stage keeps draining during it, so the
backlog met by the first store is `max(0, Q0 - D t0)` for a backlog `Q0` at the burst's start. With
`t0 = 0`, `b_fast = 0` these are exactly burst-gap.md's equations (`k = 0`, `r_fast` irrelevant).
Periodic bursts: `periodic_onset_index` is burst-gap.md's `k* = floor((C - a)/(a - b)) + 2` with
`b = D (G + t0)` (the gap plus the overhead drain); the steady issue time is
`max(t0 + T_free, B / D - G)`: under backpressure each period `T + G` must drain one burst.
All functions agree with `xstage.model.simulate` wherever both apply (tests/model).

Example:
    >>> from xstage.model.params import PathParams
    >>> from xstage.model import closed_form as cf
    >>> p = PathParams(r0=64e9, c_sm=2**20, drain=16e9, capacity=2**20, t0=100.0)
    >>> round(cf.issue_time(p, 4 * 2**20))
    196708
    >>> round(cf.onset_bytes(p))
    1398101
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from xstage.bounds import check_instance, check_int
from xstage.errors import InputError
from xstage.model.params import NS, PathParams

MAX_BURSTS = 1 << 20  # bursts of one periodic train: each is one step of a loop here


@dataclasses.dataclass(frozen=True)
class IssuerState:
    """What one issuer carries from one burst to the next: backlog (bytes) and first-stage tokens."""

    backlog: float = 0.0
    tokens: float | None = None


def _real(v, name: str, what: str, positive: bool = False) -> float:
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
    if not (ok and math.isfinite(v) and (v > 0 if positive else v >= 0)):
        raise InputError(f"{name} must be {what}, got {v!r}")
    return float(v)


def _check_bytes(nbytes: float, name: str = "nbytes") -> float:
    return _real(nbytes, name, "a finite number of bytes > 0", positive=True)


def _check_time(t: float, name: str) -> float:
    return _real(t, name, "a finite time >= 0 ns")


def _symmetric(params: PathParams, n_sm: int) -> PathParams:
    """The equivalent single issuer of `n_sm` SMs (`PathParams.symmetric`), `params` checked first."""
    return check_instance(params, "params", PathParams, "PathParams").symmetric(n_sm)


def _check_state(state: IssuerState) -> IssuerState:
    check_instance(state, "state", IssuerState, "an IssuerState")
    _real(state.backlog, "backlog", "a finite number of bytes >= 0")
    if state.tokens is not None:
        _real(state.tokens, "tokens", "a finite number of bytes >= 0")
    return state


def _duration_s(p: PathParams, nbytes: float, q: float, k: float) -> float:
    terms = [0.0 if math.isinf(p.r_fast) else nbytes / p.r_fast, (nbytes - k) / p.r0]
    if math.isfinite(p.capacity):
        terms.append((nbytes - p.capacity + q) / p.drain)
    return max(terms)


def burst_raw(p: PathParams, nbytes: float, backlog: float, tokens: float) -> tuple[float, float, float, float]:
    """Lean core of `burst` for an equivalent single issuer `p` (`PathParams.symmetric`).

    Returns issue time (ns), backlog and tokens at the end of issue, completion time (ns).
    """
    t0 = p.t0 * NS
    q = max(0.0, backlog - p.drain * t0)
    k = min(p.b_fast, tokens + p.r0 * t0)
    tau = _duration_s(p, nbytes, q, k)
    q_end = min(p.capacity, max(0.0, q + nbytes - p.drain * tau))
    k_end = max(0.0, min(p.b_fast - max(0.0, nbytes - p.r0 * tau), k + p.r0 * tau - nbytes))
    issue = p.t0 + tau / NS
    return issue, q_end, k_end, issue + q_end / p.drain / NS + p.latency


def gap_raw(p: PathParams, backlog: float, tokens: float, gap_ns: float) -> tuple[float, float]:
    """Backlog and tokens after `gap_ns` of compute (equivalent single issuer `p`)."""
    return max(0.0, backlog - p.drain * gap_ns * NS), min(p.b_fast, tokens + p.r0 * gap_ns * NS)


def burst(params: PathParams, nbytes: float, state: IssuerState = IssuerState(), n_sm: int = 1) -> dict:
    """Everything about one burst: issue, stall, backlog at the end, recovery, completion, next state.

    Times in ns from the burst's start (t0 included). `state` is the issuer's state at that start.
    """
    nbytes = _check_bytes(nbytes)
    _check_state(state)
    p = _symmetric(params, n_sm)
    tokens = p.b_fast if state.tokens is None else state.tokens
    issue, q_end, k_end, cpl = burst_raw(p, nbytes, state.backlog, tokens)
    free = burst_raw(p.replace(capacity=math.inf), nbytes, state.backlog, tokens)[0]
    return {
        "issue_ns": issue,
        "stall_ns": issue - free,
        "backlog_end": q_end,
        "recovery_ns": q_end / p.drain / NS,
        "completion_ns": cpl,
        "state": IssuerState(backlog=q_end, tokens=k_end),
    }


def issue_time(params: PathParams, nbytes: float, backlog: float = 0.0, n_sm: int = 1) -> float:
    """Issue time (ns, t0 included) of a burst that starts with `backlog` bytes outstanding."""
    return burst(params, nbytes, IssuerState(backlog), n_sm)["issue_ns"]


def stall(params: PathParams, nbytes: float, backlog: float = 0.0, n_sm: int = 1) -> float:
    """Extra issue time (ns) the window costs over the backpressure-free issue."""
    return burst(params, nbytes, IssuerState(backlog), n_sm)["stall_ns"]


def backlog_end(params: PathParams, nbytes: float, backlog: float = 0.0, n_sm: int = 1) -> float:
    """Bytes outstanding (per SM) when the burst's last store has issued."""
    return burst(params, nbytes, IssuerState(backlog), n_sm)["backlog_end"]


def completion_time(params: PathParams, nbytes: float, backlog: float = 0.0, n_sm: int = 1) -> float:
    """Time (ns) from the burst's start until its last byte is remote-visible."""
    return burst(params, nbytes, IssuerState(backlog), n_sm)["completion_ns"]


def recovery_time(params: PathParams, nbytes: float, backlog: float = 0.0, n_sm: int = 1) -> float:
    """Compute gap (ns) after the burst that drains the X-Stage completely (`Q_end / D`)."""
    return burst(params, nbytes, IssuerState(backlog), n_sm)["recovery_ns"]


def onset_bytes(params: PathParams, backlog: float = 0.0, n_sm: int = 1) -> float:
    """Bytes a burst issues before backpressure starts (inf if the window never fills).

    Empty first stage and `b_fast = 0`: `C r0 / (r0 - D)` (burst-gap.md's `B_crit`).
    """
    backlog = _real(backlog, "backlog", "a finite number of bytes >= 0")
    p = _symmetric(params, n_sm)
    q, k = max(0.0, backlog - p.drain * p.t0 * NS), p.b_fast
    room = p.capacity - q
    if room <= 0:
        return 0.0
    if math.isinf(room):
        return math.inf
    d = p.drain
    if not math.isinf(p.r_fast) and p.r_fast > d:
        t1 = room / (p.r_fast - d)
        if p.r_fast * t1 <= k + p.r0 * t1:
            return p.r_fast * t1
    elif math.isinf(p.r_fast) and k >= room:
        return room
    if p.r0 <= d:
        return math.inf
    t2 = (room - k) / (p.r0 - d)
    return k + p.r0 * t2


def after_gap(params: PathParams, state: IssuerState, gap_ns: float, n_sm: int = 1) -> IssuerState:
    """Issuer state after a compute gap: the X-Stage drains, the first stage refills."""
    gap_ns = _check_time(gap_ns, "gap_ns")
    _check_state(state)
    p = _symmetric(params, n_sm)
    tokens = None if state.tokens is None else min(p.b_fast, state.tokens + p.r0 * gap_ns * NS)
    return IssuerState(max(0.0, state.backlog - p.drain * gap_ns * NS), tokens)


def two_burst_issue_time(params: PathParams, b1: float, gap_ns: float, b2: float, n_sm: int = 1) -> float:
    """Issue time (ns) of the second of two bursts `b1`, gap, `b2` from an empty X-Stage.

    While the second burst is backpressured it falls with slope exactly -1 in the gap.
    """
    first = burst(params, b1, IssuerState(), n_sm)
    return burst(params, b2, after_gap(params, first["state"], gap_ns, n_sm), n_sm)["issue_ns"]


def periodic_issue_times(params: PathParams, nbytes: float, gap_ns: float, n_bursts: int,
                         n_sm: int = 1) -> list[float]:
    """Issue times (ns) of `n_bursts` bursts of `nbytes`, each followed by `gap_ns` of compute."""
    n_bursts = check_int(n_bursts, "n_bursts", 1, MAX_BURSTS, "bursts in the train")
    state, out = IssuerState(), []
    for _ in range(n_bursts):
        b = burst(params, nbytes, state, n_sm)
        out.append(b["issue_ns"])
        state = after_gap(params, b["state"], gap_ns, n_sm)
    return out


def periodic_onset_index(params: PathParams, nbytes: float, gap_ns: float, n_sm: int = 1) -> int | None:
    """1-based index of the first backpressured burst of a periodic train (None: never).

    burst-gap.md's `k*` with `a = B (1 - D / r0)`, `b = D (G + t0)`; exact for `b_fast = 0`. With a
    first stage the train is followed burst by burst (up to 10^5 bursts).
    """
    nbytes = _check_bytes(nbytes)
    gap_ns = _check_time(gap_ns, "gap_ns")
    p = _symmetric(params, n_sm)
    if p.b_fast > 0:
        state = IssuerState()
        for i in range(1, 100_001):
            b = burst(p, nbytes, state)
            if b["stall_ns"] > 1e-9 * b["issue_ns"]:
                return i
            nxt = after_gap(p, b["state"], gap_ns)
            if nxt == state:
                return None
            state = nxt
        return None
    a = nbytes * (1.0 - p.drain / p.r0)
    b = p.drain * (gap_ns + p.t0) * NS
    if a > p.capacity:
        return 1
    if a <= b or math.isinf(p.capacity):
        return None
    return int(math.floor((p.capacity - a) / (a - b))) + 2


def periodic_steady_issue_time(params: PathParams, nbytes: float, gap_ns: float, n_sm: int = 1) -> float:
    """Issue time (ns) per burst once a periodic train has settled.

    Backpressured trains end every burst with a full window `C`, so each burst starts from
    `max(0, C - D (G + t0))`: the issue time is `B / D - G` while the gap cannot empty the window
    (burst-gap.md's steady state) and `t0 + (B - C) / D` once it can. Otherwise it is the free issue.
    """
    nbytes = _check_bytes(nbytes)
    gap_ns = _check_time(gap_ns, "gap_ns")
    p = _symmetric(params, n_sm)
    loaded = periodic_onset_index(params, nbytes, gap_ns, n_sm) is not None
    if not loaded:
        p = p.replace(capacity=math.inf, c_sm=math.inf)
    state = IssuerState(p.capacity if loaded else 0.0, p.b_fast)
    for _ in range(10_000):
        b = burst(p, nbytes, after_gap(p, state, gap_ns) if loaded else state)
        nxt = IssuerState(state.backlog, b["state"].tokens)
        if not loaded:
            nxt = after_gap(p, IssuerState(0.0, b["state"].tokens), gap_ns)
        if abs(nxt.tokens - state.tokens) <= 1e-9 * max(1.0, p.b_fast):
            break
        state = nxt
    return b["issue_ns"]
