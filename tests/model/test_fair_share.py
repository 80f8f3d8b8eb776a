"""Fair-share admission to the shared window: what it changes, and what it must leave alone.

References are independent of the simulator's event loop: the unloaded issue time of one burst from the
closed forms, exact byte accounting, and the first-come engine where the two admissions must agree.
"""

import math

import numpy as np
import pytest

from xstage.errors import InputError
from xstage.model import closed_form as cf
from xstage.model.params import PathParams
from xstage.model.profile import load_default_profile
from xstage.model.simulate import path_simulator, simulate_bursts

# Test inputs, not measurements: a window that 8 SMs with 4 MiB bursts fill (8 x 256 KiB > 1 MiB).
P = PathParams(r0=50e9, c_sm=256 * 1024, drain=20e9, capacity=1 << 20, t0=50.0, latency=700.0)
FAIR = P.replace(admission="fair_share")
ENGINES = ("fast", "reference")


def _small_beside_stalled(params, engine):
    """Issue time of a 4 KiB burst that starts on a ninth SM while eight are stalled on 4 MiB bursts."""
    programs = [[(4 << 20, 0.0)]] * 8 + [[(4096, 0.0)]]
    res = simulate_bursts(params, programs, start_ns=[0.0] * 8 + [100_000.0], engine=engine)
    return float(res.issue_ns[8][0]), res


@pytest.mark.parametrize("engine", ENGINES)
def test_a_small_burst_beside_stalled_sms_issues_at_its_unloaded_pace(engine):
    fair, _ = _small_beside_stalled(FAIR, engine)
    first_come, _ = _small_beside_stalled(P, engine)
    alone = cf.issue_time(P.replace(c_sm=math.inf, capacity=math.inf), 4096)  # t0 + 4096 / r0
    assert fair == pytest.approx(alone, rel=1e-9)
    # first come: the ninth SM gets a ninth of the drain for its 4 KiB, ~1.8 us
    assert first_come == pytest.approx(P.t0 + 4096 / (P.drain / 9) * 1e9, rel=1e-6)
    assert first_come > 10 * fair


@pytest.mark.parametrize("engine", ENGINES)
def test_the_sms_over_their_part_wait_and_the_window_is_never_exceeded(engine):
    sim = path_simulator(FAIR, 9, engine=engine)
    for sm in range(8):
        sim.start_burst(sm, 0.0, 4 << 20)
    assert sim.backlog(99_000.0) == pytest.approx(P.capacity, rel=1e-9)
    assert sim.outstanding(0) == pytest.approx(P.capacity / 8, rel=1e-9)  # eight equal parts
    sim.start_burst(8, 100_000.0, 4 << 20)  # a ninth SM joins: the parts become ninths
    for t in np.linspace(100_000.0, 400_000.0, 31):
        assert sim.backlog(float(t)) <= P.capacity * (1 + 1e-9) + 1e-3
    assert sim.outstanding(8) == pytest.approx(P.capacity / 9, rel=1e-6)
    assert sim.outstanding(0) == pytest.approx(P.capacity / 9, rel=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_byte_drains_at_the_path_rate(engine):
    _, res = _small_beside_stalled(FAIR, engine)
    total = sum(float(b.sum()) for b in res.nbytes)
    last = max(float(c.max()) for c in res.completion_ns)
    # Backpressured from the first microseconds to the end: the drain never idles, so the last byte is
    # remote-visible total / drain after the start, plus the latency, within the unbackpressured ramp.
    assert last == pytest.approx(total / P.drain * 1e9 + P.latency, rel=2e-3)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("n_sm", [1, 4, 16, 132])
def test_sms_starting_together_on_one_program_see_no_difference(engine, n_sm):
    prof = load_default_profile("host").params.replace(spread=1.0)
    programs = [[(65536, 2000.0), (1 << 20, 0.0), (16384, 500.0), (262144, 0.0)]] * n_sm
    a = simulate_bursts(prof, programs, engine=engine)
    b = simulate_bursts(prof.replace(admission="fair_share"), programs, engine=engine)
    for x, y in zip(a.issue_end_ns, b.issue_end_ns):
        np.testing.assert_allclose(y, x, rtol=1e-9)


def test_admission_travels_with_the_parameters():
    d = FAIR.to_dict()
    assert d["admission"] == "fair_share" and PathParams.from_dict(d) == FAIR
    assert "admission" not in P.to_dict()  # the default writes profiles as before
    assert PathParams.from_dict(P.to_dict()) == P


@pytest.mark.parametrize("bad", ["fair", "", 1.0, None])
def test_an_unknown_admission_is_refused_by_name(bad):
    with pytest.raises(InputError, match=r"admission must be one of first_come, fair_share"):
        P.replace(admission=bad)
    with pytest.raises(InputError, match=r"parameters.admission must be one of first_come, fair_share"):
        PathParams.from_dict({**P.to_dict(), "admission": bad})
