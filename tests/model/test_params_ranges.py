"""Burst-Gap parameters lie in physical ranges: a profile cannot make a prediction inf or NaN."""

import json
import math

import numpy as np
import pytest

from xstage.errors import InputError
from xstage.model import closed_form, load_default_profile
from xstage.model.fit import _decode
from xstage.model.params import PARAM_NAMES, RANGES, PathParams, clamp

GOOD = dict(r0=50e9, c_sm=96 * 1024.0, drain=52.5e9, capacity=4.5 * 2**20, t0=75.0, latency=1000.0)


@pytest.mark.parametrize("field, value, bound", [
    ("r0", 1e-300, r"1e\+06\.\.1e\+15 B/s"), ("r0", 1e300, r"1e\+06\.\.1e\+15 B/s"),
    ("drain", 1e-300, r"1e\+06\.\.1e\+15 B/s"), ("drain", math.inf, "B/s"),
    ("c_sm", 1e-300, r"1\.\.1\.1259e\+15 B or inf"), ("capacity", 1e300, "B or inf"),
    ("t0", 1e30, r"0\.\.1e\+09 ns"), ("latency", -1.0, "ns"), ("latency", math.nan, "ns"),
    ("b_fast", 1e300, "B"), ("spread", 1e300, r"1\.\.10000 ratio"), ("r0", "50e9", "B/s"),
])
def test_out_of_range_fields_are_refused_naming_field_and_range(field, value, bound):
    with pytest.raises(InputError, match=rf"^PathParams\.{field}=.*: must be a finite number in .*{bound}"):
        PathParams(**{**GOOD, field: value})


def test_a_profile_with_a_tiny_rate_is_refused_where_the_prediction_was_inf():
    params = load_default_profile("host").params.to_dict()
    with pytest.raises(InputError, match=r"PathParams\.r0=1e-300"):
        PathParams.from_dict({**params, "r0": 1e-300})
    p = PathParams.from_dict(params)
    assert math.isfinite(closed_form.issue_time(p, 256 * 1024))


def test_the_bounds_themselves_are_valid_and_predict_finite_times():
    lo = PathParams(**{n: RANGES[n][0] for n in ("r0", "c_sm", "drain", "capacity", "t0", "latency")})
    hi = PathParams(**{n: RANGES[n][1] for n in ("r0", "c_sm", "drain", "capacity", "t0", "latency")})
    for p in (lo, hi):
        t = closed_form.issue_time(p, 2.0**36)  # 64 GiB: the largest burst `xstage model` takes
        assert math.isfinite(t) and t > 0


def test_one_sms_share_of_many_is_derived_below_the_given_ranges():
    p = PathParams(**GOOD)
    share = p.symmetric(4096)
    assert share.drain == GOOD["drain"] / 4096 and share.capacity == min(GOOD["c_sm"], GOOD["capacity"] / 4096)
    assert share.r0 == p.r0 and share.spread == 1.0
    with pytest.raises(InputError, match=r"n_sm=0: must be an integer in 1\.\.4096"):
        p.symmetric(0)


def test_the_fitter_steps_stay_inside_the_ranges():
    names = list(PARAM_NAMES)
    base = PathParams(**GOOD)
    for x in (np.full(len(names), -700.0), np.full(len(names), 700.0)):
        p = _decode(x, names, base)  # exp(-700) and exp(60): far outside every range
        assert all(RANGES[n][0] <= getattr(p, n) <= RANGES[n][1] for n in names)
    assert clamp("c_sm", math.inf) == math.inf and clamp("t0", -5.0) == 0.0


def test_the_command_line_refuses_such_a_profile_in_one_line(tmp_path, capsys):
    from xstage.cli import main

    prof = load_default_profile("host").to_dict()
    path = tmp_path / "r0-tiny.json"
    path.write_text(json.dumps({**prof, "params": {**prof["params"], "r0": 1e-300}}))
    for argv in (["model", "--profile", str(path), "--burst", "64KiB"],
                 ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "64", "--ep", "8",
                  "--profile", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "PathParams.r0=1e-300: must be a finite number in 1e+06..1e+15 B/s" in err[0]


def test_closed_forms_and_simulators_name_arguments_of_the_wrong_type_or_size():
    """Found by tests/test_fuzz_api.py: None, text or True raised TypeError or AttributeError, and
    n_sm=2**40 allocated a slot list until the memory ran out."""
    from xstage.model import path_simulator, simulate_bursts

    p = load_default_profile("host").params
    for call, match in (
            (lambda: closed_form.burst(None, 65536.0), r"^params: must be PathParams, got NoneType$"),
            (lambda: closed_form.burst(p, None), r"^nbytes must be a finite number of bytes > 0, got None$"),
            (lambda: closed_form.burst(p, 65536.0, state=None), r"^state: must be an IssuerState"),
            (lambda: closed_form.onset_bytes(p, backlog="0"), r"^backlog must be a finite number of bytes"),
            (lambda: closed_form.periodic_issue_times(p, 4096.0, 0.0, 2**40), r"^n_bursts=1099511627776: must"),
            (lambda: path_simulator(p, 2**40), r"^n_sm=1099511627776: must be an integer in 1\.\.131072"),
            (lambda: path_simulator(p, 2, multiplicity=" "), r"^multiplicity: must be a list of finite numbers"),
            (lambda: path_simulator(p, 2, weights=True), r"^weights: must be a list of finite numbers, got bool"),
            (lambda: path_simulator(p, 2, engine=[]), r"^engine \[\]: must be one of fast, reference$"),
            (lambda: simulate_bursts(p, [[("64", 0.0)]]), r"^programs\[0\]\[0\] must be \(burst_bytes, gap_ns\)$"),
            (lambda: simulate_bursts(p, [[(64, 0.0)]], start_ns=["x"]), r"^start_ns\[0\]='x': must be")):
        with pytest.raises(InputError, match=match):
            call()
