import dataclasses
import math

import pytest

from xstage.errors import InputError
from xstage.model import closed_form
from xstage.model.params import PathParams
from xstage.sched import KernelWork, Task, simulate_kernel

HOST = PathParams(r0=50e9, c_sm=96 * 1024, drain=52.5e9, capacity=4.5 * 2**20, t0=70.0, latency=1000.0)


def test_one_cta_compute_then_store_matches_closed_form():
    b = 256 * 1024
    work = KernelWork(ctas=[[Task("t", 5000.0, stores={1: b})]], dest_path={1: "host"})
    res = simulate_kernel(work, {"host": HOST})
    assert res.time_ns == pytest.approx(5000.0 + closed_form.issue_time(HOST, b), rel=1e-6)
    br = res.breakdown()
    assert br["compute"] == pytest.approx(5000.0)
    assert br["issue"] + br["stall"] == pytest.approx(closed_form.issue_time(HOST, b), rel=1e-6)
    assert br["stall"] == pytest.approx(closed_form.stall(HOST, b), rel=1e-6, abs=1e-3)


def test_gap_between_bursts_drains_the_window():
    """Two bursts separated by compute: a long enough gap brings the second burst back to the free cost."""
    b = 512 * 1024
    slow = HOST.replace(r0=64e9, drain=16e9)  # one SM can outrun the drain

    def two(gap):
        tasks = [Task("a", 0.0, stores={1: b}), Task("b", gap, stores={1: b})]
        return simulate_kernel(KernelWork(ctas=[tasks], dest_path={1: "host"}), {"host": slow}).time_ns

    first = closed_form.issue_time(slow, b)
    assert two(0.0) > 2 * first * 1.1  # back to back: the second burst starts with a full window
    assert two(0.0) == pytest.approx(closed_form.two_burst_issue_time(slow, b, 0.0, b) + first, rel=1e-6)
    long_gap = 1e6
    assert two(long_gap) == pytest.approx(2 * first + long_gap, rel=1e-6)


def test_local_destination_costs_nothing_and_dependencies_are_honoured():
    work = KernelWork(
        ctas=[[Task("l1", 3000.0, stores={0: 1 << 20})], [Task("l2", 1000.0, deps=("l1",), stores={1: 4096})]],
        dest_path={1: "host"},
    )
    res = simulate_kernel(work, {"host": HOST})
    assert res.task_end_ns["l1"] == pytest.approx(3000.0)
    assert res.task_end_ns["l2"] == pytest.approx(4000.0 + closed_form.issue_time(HOST, 4096), rel=1e-6)
    waits = [s for s in res.segments if s.kind == "wait"]
    assert len(waits) == 1 and waits[0].cta == 1 and waits[0].duration_ns == pytest.approx(3000.0)


def test_concurrent_ctas_share_the_drain():
    """n CTAs each storing B at once: the shared window makes the aggregate slower than one CTA alone."""
    b = 1 << 20
    n = 16
    work = KernelWork(ctas=[[Task(f"t{i}", 0.0, stores={1: b})] for i in range(n)], dest_path={1: "host"})
    res = simulate_kernel(work, {"host": HOST}, trace_backlog=True)
    alone = closed_form.issue_time(HOST, b)
    assert res.time_ns > alone
    # Conservation: the last issue cannot end before the excess over both windows has drained.
    excess = n * b - HOST.capacity
    assert res.time_ns >= excess / HOST.drain * 1e9 * 0.999
    trace = res.backlog["host"]
    assert max(q for _, q in trace) <= HOST.capacity * (1 + 1e-9)


def test_unfinishable_work_is_a_clear_error():
    work = KernelWork(ctas=[[Task("a", 1.0, deps=("b",)), Task("b", 1.0)]])
    with pytest.raises(InputError, match="cannot finish"):
        simulate_kernel(work, {})
    with pytest.raises(InputError, match="unknown dependencies"):
        KernelWork(ctas=[[Task("a", 1.0, deps=("zz",))]])
    with pytest.raises(InputError, match="no parameters"):
        simulate_kernel(KernelWork(ctas=[[Task("a", 1.0, stores={1: 8})]], dest_path={1: "peer"}), {})
    with pytest.raises(InputError, match="compute_ns"):
        Task("a", -1.0)
    assert math.isfinite(simulate_kernel(KernelWork(ctas=[[Task("a", 2.0)]]), {}).time_ns)


def test_shared_queue_balances_tasks_over_free_ctas():
    """Queued tasks go to whichever CTA is free first; round-robin lists cannot rebalance."""
    costs = [10.0, 1.0, 1.0, 1.0]
    queue = [Task(f"q{i}", c) for i, c in enumerate(costs)]
    dynamic = simulate_kernel(KernelWork(ctas=[[], []], queue=queue), {})
    assert dynamic.time_ns == pytest.approx(10.0)  # CTA 1 runs the three short tasks meanwhile
    assert [s.cta for s in sorted(dynamic.segments, key=lambda s: s.start_ns) if s.kind == "compute"] == [0, 1, 1, 1]
    static = KernelWork(ctas=[[queue[0], queue[2]], [queue[1], queue[3]]])
    assert simulate_kernel(static, {}).time_ns == pytest.approx(11.0)


def test_shared_queue_waits_for_dependencies_taken_earlier():
    queue = [Task("a", 5.0), Task("b", 1.0, deps=("a",)), Task("c", 1.0)]
    res = simulate_kernel(KernelWork(ctas=[[], []], queue=queue), {})
    # CTA 1 takes b and waits for a; CTA 0, free after a at 5 ns, takes c.
    assert res.task_end_ns["b"] == pytest.approx(6.0) and res.task_end_ns["c"] == pytest.approx(6.0)
    waits = [s for s in res.segments if s.kind == "wait"]
    assert len(waits) == 1 and waits[0].cta == 1 and waits[0].duration_ns == pytest.approx(5.0)
    with pytest.raises(InputError, match="unique"):
        KernelWork(ctas=[[Task("a", 1.0)]], queue=[Task("a", 1.0)])


def _claims(now_and_bytes, rate, budget):
    """The kernel's pacer (`xstage.comm.pacing.pace_stores`) by hand: one virtual clock raised to now,
    each claim adds bytes / rate and waits until the clock is at most budget / rate ahead of now."""
    clock, out = 0.0, []
    for now, b in now_and_bytes:
        clock = max(clock, now) + b / rate * 1e9
        out.append(max(now, clock - budget / rate * 1e9))
    return out


def test_paced_bursts_leave_in_the_order_they_were_claimed():
    """Four CTAs finish their tiles together and store B each at a pace far below the link's drain:
    they leave one claim apart (first come, first served), as the kernel's virtual clock releases them,
    and their next tasks start then; a fluid bucket would release them all at the end."""
    b, rate, budget = 64 * 1024, 2e9, 32 * 1024
    fast_link = HOST.replace(drain=1e12, r0=1e12, capacity=math.inf, c_sm=math.inf, t0=0.0, latency=0.0)
    pacing = type("Pacing", (), {"rate": rate, "budget": budget})()
    ctas = [[Task(f"t{i}", 1000.0, stores={1: b}), Task(f"n{i}", 500.0)] for i in range(4)]
    res = simulate_kernel(KernelWork(ctas=ctas, dest_path={1: "host"}), {"host": fast_link},
                          pacers={"host": pacing})
    starts = _claims([(1000.0, b)] * 4, rate, budget)
    issue = b / 1e12 * 1e9
    # Equal finish times: the CTAs claim in index order (the simulator's tie order).
    for i, start in enumerate(starts):
        assert res.task_end_ns[f"t{i}"] == pytest.approx(start + issue, rel=1e-9)
        assert res.task_end_ns[f"n{i}"] == pytest.approx(start + issue + 500.0, rel=1e-9)
    assert starts[1] - starts[0] == pytest.approx(b / rate * 1e9)  # one claim apart
    stall = sum(s.duration_ns for s in res.segments if s.kind == "stall")
    assert stall == pytest.approx(sum(s - 1000.0 for s in starts), rel=1e-6)
    # Without the pacer the same link takes the bursts at once.
    free = simulate_kernel(KernelWork(ctas=[[Task(f"t{i}", 1000.0, stores={1: b})] for i in range(4)],
                                      dest_path={1: "host"}), {"host": fast_link})
    assert free.time_ns == pytest.approx(1000.0 + issue, rel=1e-9)


def test_paced_claims_earn_no_credit_while_the_link_is_idle():
    """A burst above the budget waits for its excess; a claim after a long idle time starts at once (the
    clock is raised to now, so idling earns no credit); each then issues as the link lets it."""
    rate, budget, big, small = 1e9, 64 * 1024, 256 * 1024, 64 * 1024
    pacing = type("Pacing", (), {"rate": rate, "budget": budget})()
    tasks = [Task("a", 0.0, stores={1: big}), Task("b", 1e6, stores={1: small})]
    res = simulate_kernel(KernelWork(ctas=[tasks], dest_path={1: "host"}), {"host": HOST}, pacers={"host": pacing})
    start_a = (big - budget) / rate * 1e9
    end_a = start_a + closed_form.issue_time(HOST, big)
    assert res.task_end_ns["a"] == pytest.approx(end_a, rel=1e-6)
    assert res.task_end_ns["b"] == pytest.approx(end_a + 1e6 + closed_form.issue_time(HOST, small), rel=1e-6)


@pytest.mark.parametrize("pacing", [object(), type("P", (), {"rate": 0.0, "budget": 1.0})(),
                                    type("P", (), {"rate": 1e9, "budget": -1.0})()])
def test_a_malformed_pacer_is_a_clear_error(pacing):
    work = KernelWork(ctas=[[Task("t", 1.0, stores={1: 4096})]], dest_path={1: "host"})
    with pytest.raises(InputError, match=r"pacers\['host'\]"):
        simulate_kernel(work, {"host": HOST}, pacers={"host": pacing})


def test_tasks_speed_up_while_fewer_ctas_compute():
    """Two CTAs, occupancy factor 1 with both computing and 0.8 with one: the longer task runs its
    first 1000 ns beside the other, then its remaining 2000 ns of full-occupancy work in 1600 ns."""
    factors = {1.0: 1.0, 0.5: 0.8}
    work = KernelWork(ctas=[[Task("a", 1000.0)], [Task("b", 3000.0), Task("c", 500.0, deps=("a",))]],
                      occupancy=lambda share: factors[share])
    res = simulate_kernel(work, {})
    assert res.task_end_ns["a"] == pytest.approx(1000.0, rel=1e-12)
    assert res.task_end_ns["b"] == pytest.approx(1000.0 + 2000.0 * 0.8, rel=1e-12)
    assert res.task_end_ns["c"] == pytest.approx(2600.0 + 500.0 * 0.8, rel=1e-12)  # alone again
    compute = {s.task: s.duration_ns for s in res.segments if s.kind == "compute"}
    assert compute == pytest.approx({"a": 1000.0, "b": 2600.0, "c": 400.0})
    fixed = simulate_kernel(dataclasses.replace(work, occupancy=None), {})
    assert fixed.task_end_ns["b"] == pytest.approx(3000.0) and fixed.time_ns == pytest.approx(3500.0)


@pytest.mark.parametrize("occupancy, match", [("fast", "work.occupancy: expected a function"),
                                              (lambda share: 0.0, r"work.occupancy\(1\) = 0.0")])
def test_a_malformed_occupancy_is_a_clear_error(occupancy, match):
    with pytest.raises(InputError, match=match):
        simulate_kernel(KernelWork(ctas=[[Task("t", 1.0)]], occupancy=occupancy), {})
