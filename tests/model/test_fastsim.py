"""The compiled path simulator against the reference engine: same bursts, same times (1e-9)."""

import math
import random

import numpy as np
import pytest

from xstage.errors import InputError
from xstage.model.fastsim import FastPathSimulator
from xstage.model.params import PathParams
from xstage.model.simulate import PathSimulator, path_simulator, simulate_bursts

# Test inputs, not measurements: paths with and without each stage of the model.
PATHS = {
    "full": PathParams(r0=50e9, c_sm=96 * 1024, drain=40e9, capacity=2 << 20, t0=75.0, latency=900.0,
                       r_fast=200e9, b_fast=8192, spread=6.0),
    "no-first-stage": PathParams(r0=64e9, c_sm=64 * 1024, drain=16e9, capacity=1 << 20, t0=100.0, latency=500.0),
    "no-windows": PathParams(r0=50e9, c_sm=math.inf, drain=30e9, capacity=math.inf),
    "shared-only": PathParams(r0=50e9, c_sm=math.inf, drain=20e9, capacity=256 * 1024, t0=40.0, spread=3.0),
}
# The same paths with the shared window partitioned among the active SMs (fair-share admission).
PATHS |= {f"{k}-fair": v.replace(admission="fair_share") for k, v in list(PATHS.items()) if k != "no-windows"}
REL = 1e-9


def _close(ref, fast):
    for a, b in zip(ref, fast):
        assert a.shape == b.shape
        assert np.all(np.abs(a - b) <= REL * np.maximum(np.abs(a), 1.0)), (a, b)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bursts_agree_with_the_reference(path, seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    programs = [[(rng.choice([4096, 16384, 65536, 300000]), rng.choice([0.0, 500.0, 4000.0, 30000.0]))
                 for _ in range(rng.randint(1, 12))] for _ in range(n)]
    starts = [rng.choice([0.0, 0.0, 1000.0, 2500.0]) for _ in range(n)]
    mult = [rng.randint(1, 20) for _ in range(n)]
    ref = simulate_bursts(PATHS[path], programs, starts, mult, engine="reference")
    fast = simulate_bursts(PATHS[path], programs, starts, mult, engine="fast")
    _close(ref.start_ns, fast.start_ns)
    _close(ref.issue_end_ns, fast.issue_end_ns)
    _close(ref.completion_ns, fast.completion_ns)


@pytest.mark.parametrize("path", ["full", "full-fair"])
def test_the_incremental_api_agrees_call_by_call(path):
    rng = random.Random(7)
    p = PATHS[path]
    ref, fast = PathSimulator(p, 5), FastPathSimulator(p, 5)
    t = 0.0
    for _ in range(60):
        sm = rng.randrange(5)
        if ref.phase[sm] == 0:
            nbytes = rng.choice([8192, 65536, 200000])
            assert ref.start_burst(sm, t, nbytes) == fast.start_burst(sm, t, nbytes)
        t_next = ref.next_event_time()
        assert fast.next_event_time() == pytest.approx(t_next, rel=REL)
        step = min(t_next, t + rng.choice([100.0, 1000.0, 5000.0]))
        ended_ref, ended_fast = ref.advance_until(step), fast.advance_until(step)
        # (burst id, issue end) pairs: the same bursts end, at the same times
        assert [b for b, _ in ended_fast] == [b for b, _ in ended_ref]
        assert [t for _, t in ended_fast] == pytest.approx([t for _, t in ended_ref], rel=REL)
        t = ref.now
        assert fast.now == pytest.approx(t, rel=REL)
        assert fast.backlog() == pytest.approx(ref.backlog(), rel=REL, abs=1e-6)
    ref.finish()
    fast.finish()
    for b in range(len(ref.bursts)):
        assert fast.issue_end_ns(b) == pytest.approx(ref.issue_end_ns(b), rel=REL)
        assert fast.completion_ns(b) == pytest.approx(ref.completion_ns(b), rel=REL)


def test_a_kernel_simulation_is_the_same_on_both_engines():
    from tests.sched.test_plan import COSTS, SLOW_PATH
    from xstage.sched.moe import MoeConfig, moe_work
    from xstage.sched.simulate import simulate_kernel

    cfg = MoeConfig.parse("H1024-I512-E8-K2", tokens_per_rank=512, ep=4, block_m=64, block_n1=64, block_n2=128)
    work = moe_work(cfg, "lag:1", COSTS, num_ctas=8)
    ref = simulate_kernel(work, {"remote": SLOW_PATH}, engine="reference")
    fast = simulate_kernel(work, {"remote": SLOW_PATH}, engine="fast")
    assert fast.time_ns == pytest.approx(ref.time_ns, rel=REL)
    assert fast.task_end_ns.keys() == ref.task_end_ns.keys()
    assert all(fast.task_end_ns[k] == pytest.approx(v, rel=REL) for k, v in ref.task_end_ns.items())


def test_bad_arguments_are_refused_alike():
    with pytest.raises(InputError, match="engine 'turbo'"):
        path_simulator(PATHS["full"], 2, engine="turbo")
    for engine in ("fast", "reference"):
        with pytest.raises(InputError, match="multiplicity"):
            path_simulator(PATHS["full"], 2, multiplicity=[1, 0.5], engine=engine)
        sim = path_simulator(PATHS["full"], 2, engine=engine)
        sim.start_burst(0, 10.0, 4096)
        with pytest.raises(InputError, match="still issuing"):
            sim.start_burst(0, 10.0, 4096)
        with pytest.raises(InputError, match="backwards"):
            sim.advance(1.0)
