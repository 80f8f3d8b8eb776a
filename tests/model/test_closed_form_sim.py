"""Closed forms against the event simulator, and the simulator's own invariants."""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from xstage.errors import InputError
from xstage.model import closed_form as cf
from xstage.model.params import PathParams
from xstage.model.simulate import PathSimulator, simulate_bursts

KIB = 1024.0
REL = 1e-6


@st.composite
def path_params(draw, fast=None, window=True):
    r0 = draw(st.floats(5e9, 200e9))
    drain = draw(st.floats(2e9, 150e9))
    c_sm = draw(st.floats(8 * KIB, 4096 * KIB)) if window else math.inf
    capacity = draw(st.one_of(st.just(math.inf), st.floats(8 * KIB, 16384 * KIB)))
    use_fast = draw(st.booleans()) if fast is None else fast
    b_fast = draw(st.floats(1 * KIB, 64 * KIB)) if use_fast else 0.0
    r_fast = r0 * draw(st.floats(1.0, 8.0)) if use_fast else math.inf
    return PathParams(r0=r0, c_sm=c_sm, drain=drain, capacity=capacity, t0=draw(st.floats(0.0, 500.0)),
                      latency=draw(st.floats(0.0, 3000.0)), r_fast=r_fast, b_fast=b_fast)


sizes = st.floats(1 * KIB, 8192 * KIB)
gaps = st.floats(0.0, 500_000.0)


def close(a, b, rel=REL):
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


@settings(max_examples=60, deadline=None)
@given(path_params(), sizes)
def test_one_burst_matches_simulation(p, b):
    res = simulate_bursts(p, [[(b, 0.0)]])
    assert close(float(res.issue_ns[0][0]), cf.issue_time(p, b))
    assert close(float(res.completion_ns[0][0]), cf.completion_time(p, b))


@settings(max_examples=60, deadline=None)
@given(path_params(), sizes, gaps, sizes)
def test_two_bursts_match_simulation(p, b1, g, b2):
    res = simulate_bursts(p, [[(b1, g), (b2, 0.0)]])
    assert close(float(res.issue_ns[0][1]), cf.two_burst_issue_time(p, b1, g, b2))


@settings(max_examples=30, deadline=None)
@given(path_params(), sizes, gaps, st.integers(2, 5), st.integers(1, 6))
def test_symmetric_sms_reduce_to_one_issuer(p, b, g, n, n_bursts):
    prog = [(b, g)] * n_bursts
    res = simulate_bursts(p, [prog] * n)
    expect = cf.periodic_issue_times(p, b, g, n_bursts, n_sm=n)
    for sm in range(n):
        assert np.allclose(res.issue_ns[sm], expect, rtol=REL, atol=1e-6)
    grouped = simulate_bursts(p, [prog], multiplicity=[n])
    assert np.allclose(grouped.issue_ns[0], expect, rtol=REL, atol=1e-6)
    assert np.allclose(grouped.completion_ns[0], res.completion_ns[0], rtol=REL, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(path_params(), sizes, sizes)
def test_issue_time_monotone_in_bytes_and_gap(p, b1, b2):
    lo, hi = sorted((b1, b2))
    assert cf.issue_time(p, lo) <= cf.issue_time(p, hi) * (1 + REL)
    assert cf.two_burst_issue_time(p, hi, 1000.0, lo) >= cf.two_burst_issue_time(p, hi, 5000.0, lo) * (1 - REL)
    assert cf.issue_time(p, hi, backlog=0.0) <= cf.issue_time(p, hi, backlog=lo) * (1 + REL)


@settings(max_examples=30, deadline=None)
@given(path_params(), st.lists(st.tuples(sizes, gaps), min_size=1, max_size=4), st.integers(1, 4))
def test_bytes_are_conserved(p, prog, n):
    sim = PathSimulator(p.replace(spread=3.0), n)
    ids = []
    for sm in range(n):
        ids.append(sim.start_burst(sm, 0.0, prog[0][0]))
    sim.finish()
    total = n * prog[0][0]
    assert math.isclose(sum(sim.issued), total, rel_tol=1e-9)
    assert math.isclose(sum(sim.drained), total, rel_tol=1e-9)
    assert sim.backlog() == 0.0
    for bid in ids:
        assert sim.completion_ns(bid) >= sim.issue_end_ns(bid) + p.latency - 1e-6


def test_second_burst_slope_is_minus_one_under_backpressure():
    p = PathParams(r0=64e9, c_sm=256 * KIB, drain=16e9, capacity=math.inf, t0=100.0)
    b = 2048 * KIB
    gaps_ns = np.array([0.0, 2000.0, 4000.0, 8000.0])
    t_cf = np.array([cf.two_burst_issue_time(p, b, g, b) for g in gaps_ns])
    t_sim = np.array([float(simulate_bursts(p, [[(b, g), (b, 0.0)]]).issue_ns[0][1]) for g in gaps_ns])
    assert cf.stall(p, b, backlog=cf.backlog_end(p, b)) > 0
    assert np.allclose(np.diff(t_cf) / np.diff(gaps_ns), -1.0, atol=1e-9)
    assert np.allclose(np.diff(t_sim) / np.diff(gaps_ns), -1.0, atol=1e-6)


def test_design_equations_without_overhead():
    """With t0 = 0 and no first stage the closed forms are burst-gap.md's equations verbatim."""
    r0, d, c = 64e9, 16e9, 1024 * KIB
    p = PathParams(r0=r0, c_sm=c, drain=d, capacity=math.inf)
    b, q0 = 3072 * KIB, 100 * KIB
    assert math.isclose(cf.issue_time(p, b, q0), max(b / r0, (b - c + q0) / d) * 1e9)
    assert math.isclose(cf.onset_bytes(p), c * r0 / (r0 - d))
    assert math.isclose(cf.backlog_end(p, b, q0), min(c, q0 + b * (1 - d / r0)))
    assert math.isclose(cf.completion_time(p, b, q0), (q0 + b) / d * 1e9)


@settings(max_examples=40, deadline=None)
@given(path_params(fast=False), st.floats(64 * KIB, 2048 * KIB), st.floats(0.0, 50_000.0))
def test_periodic_onset_and_steady_state(p, b, g):
    eq = p.single()
    a = b * (1 - eq.drain / eq.r0)
    drained = eq.drain * (g + eq.t0) * 1e-9
    if a > drained and math.isfinite(eq.capacity):
        x = (eq.capacity - a) / (a - drained)
        assume(abs(x - round(x)) > 1e-3 and abs(a / eq.capacity - 1) > 1e-3)
    n_bursts = 40
    issue = simulate_bursts(p, [[(b, g)] * n_bursts]).issue_ns[0]
    free = cf.issue_time(p.replace(c_sm=math.inf, capacity=math.inf), b)
    stalled = np.nonzero(issue > free * (1 + 1e-6) + 1e-6)[0]
    first = int(stalled[0]) + 1 if len(stalled) else None
    k = cf.periodic_onset_index(p, b, g)
    assert first == (k if k is not None and k <= n_bursts else None)
    if k is not None and k + 3 < n_bursts:
        assert math.isclose(issue[-1], cf.periodic_steady_issue_time(p, b, g), rel_tol=1e-6)


def test_incremental_interface_overlapping_bursts():
    p = PathParams(r0=50e9, c_sm=128 * KIB, drain=40e9, capacity=256 * KIB, t0=50.0, latency=700.0)
    sim = PathSimulator(p, 3)
    b0 = sim.start_burst(0, 0.0, 512 * KIB)
    b1 = sim.start_burst(1, 1000.0, 256 * KIB)
    t_next = sim.next_event_time()
    assert sim.now == 1000.0
    assert sim.advance(t_next - 1.0) == []
    done = sim.advance(t_next)
    assert len(done) == 1 and math.isclose(done[0][1], t_next)
    b2 = sim.start_burst(done[0][0], t_next + 10.0, 64 * KIB)
    assert sim.backlog() > 0
    sim.finish()
    for bid in (b0, b1, b2):
        assert sim.completion_ns(bid) is not None
    batch = simulate_bursts(p, [[(512 * KIB, 0.0)], [(256 * KIB, 0.0)]], start_ns=[0.0, 1000.0])
    assert math.isclose(float(batch.issue_end_ns[0][0]), sim.issue_end_ns(b0)) or \
        math.isclose(float(batch.issue_end_ns[1][0]), sim.issue_end_ns(b1))


def test_unequal_sharing_orders_the_sms():
    p = PathParams(r0=50e9, c_sm=64 * KIB, drain=20e9, capacity=math.inf, spread=8.0)
    res = simulate_bursts(p, [[(1024 * KIB, 0.0)]] * 4)
    first = [float(x[0]) for x in res.issue_ns]
    assert first == sorted(first, reverse=True) and first[0] > 1.5 * first[-1]


@pytest.mark.parametrize("bad, field", [
    (dict(r0=0.0), "r0"), (dict(drain=-1.0), "drain"), (dict(c_sm=0.0), "c_sm"),
    (dict(capacity=float("nan")), "capacity"), (dict(t0=-1.0), "t0"), (dict(spread=0.5), "spread"),
    (dict(b_fast=100.0), "r_fast"), (dict(r_fast=1e9), "r_fast"),
])
def test_bad_parameters_name_the_field(bad, field):
    args = dict(r0=50e9, c_sm=65536.0, drain=40e9, capacity=1e6)
    args.update(bad)
    with pytest.raises(InputError, match=field):
        PathParams(**args)


def test_bad_simulator_input():
    p = PathParams(r0=50e9, c_sm=65536.0, drain=40e9, capacity=1e6)
    with pytest.raises(InputError, match="burst_bytes"):
        simulate_bursts(p, [[(0.0, 1.0)]])
    with pytest.raises(InputError, match="gap_ns"):
        simulate_bursts(p, [[(10.0, -1.0)]])
    sim = PathSimulator(p, 1)
    sim.start_burst(0, 100.0, 1e6)
    with pytest.raises(InputError, match="backwards"):
        sim.advance(50.0)
    with pytest.raises(InputError, match="still issuing"):
        sim.start_burst(0, 100.0, 10.0)
    with pytest.raises(InputError, match="nbytes"):
        cf.issue_time(p, -5.0)


@pytest.mark.parametrize("spread", [1.0, 4.0, 12.0])
def test_backpressured_sms_share_exactly_the_drain(spread):
    """Whatever the sharing, the path drains at D while bytes wait: the last issue end is bounded."""
    n, b, c = 6, 4096 * KIB, 64 * KIB
    p = PathParams(r0=50e9, c_sm=c, drain=20e9, capacity=math.inf, spread=spread)
    res = simulate_bursts(p, [[(b, 0.0)]] * n)
    t_last = max(float(e[0]) for e in res.issue_end_ns) * 1e-9
    assert n * b - n * c <= p.drain * t_last * (1 + 1e-9) <= n * b
    t_done = max(float(x[0]) for x in res.completion_ns) * 1e-9
    assert t_done == pytest.approx(n * b / p.drain, rel=1e-6)
