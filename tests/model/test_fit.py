"""Fitting: recovery of known parameters from synthetic data over the calibration design."""

import math

import numpy as np
import pytest

from xstage.errors import InputError
from xstage.model.design import calibration_design, synthetic_observations
from xstage.model.fit import cross_checks, fit_path, weighted_quantile
from xstage.model.heldout import evaluate_loco
from xstage.model.params import PathParams

KIB = 1024
TRUTH = PathParams(r0=60e9, c_sm=64 * KIB, drain=200e9, capacity=2 * 2**20, t0=80.0, latency=1500.0,
                   r_fast=240e9, b_fast=12 * KIB)


@pytest.fixture(scope="module")
def full_design_fit():
    obs = synthetic_observations(TRUTH, calibration_design(132), noise=0.03, seed=1)
    return obs, fit_path(obs, structure="fast")


def test_synthetic_recovery_within_two_percent(full_design_fit):
    _, res = full_design_fit
    assert set(res.fitted) == {"t0", "r0", "drain", "c_sm", "capacity", "r_fast", "b_fast", "latency"}
    for name in res.fitted:
        assert res.identified[name], name
        rel = getattr(res.params, name) / getattr(TRUTH, name) - 1.0
        assert abs(rel) <= 0.02, (name, rel)


def test_design_without_many_sms_cannot_identify_the_windows():
    """Only 4 SMs ever backpressure: min(c_sm, capacity / 4) is all the data says about the windows."""
    obs = synthetic_observations(TRUTH, calibration_design(4, sm_counts=[1, 4]), noise=0.03, seed=2)
    res = fit_path(obs, structure="fast")
    assert not res.identified["capacity"] and not res.identified["c_sm"]
    window = min(res.params.c_sm, res.params.capacity / 4)
    assert window == pytest.approx(min(TRUTH.c_sm, TRUTH.capacity / 4), rel=0.02)
    for name in res.fitted:
        if res.identified[name]:
            # A smaller design: each estimate within three of its reported standard errors.
            assert abs(math.log(getattr(res.params, name) / getattr(TRUTH, name))) <= 3 * res.rel_se[name], name


def test_cross_checks_read_the_drain_and_the_slope(full_design_fit):
    obs, res = full_design_fit
    cc = cross_checks(obs, res.params)
    assert cc["drain_steep_slope"] == pytest.approx(TRUTH.drain, rel=0.1)
    assert cc["drain_completion_slope"] == pytest.approx(TRUTH.drain, rel=0.1)
    assert cc["second_burst_gap_slope_median"] == pytest.approx(-1.0, abs=0.2)
    assert cc["littles_law_ok"] is True


def test_loco_on_noiseless_base_model_is_exact():
    truth = TRUTH.replace(r_fast=math.inf, b_fast=0.0, latency=0.0)
    design = calibration_design(16, sm_counts=[1, 16], bursts=(16 * KIB, 256 * KIB, 4096 * KIB),
                                gaps_ns=(0.0, 50_000.0))
    obs = synthetic_observations(truth, design, noise=0.0, completion=False)
    loco = evaluate_loco(obs, structure="base")
    assert loco["n_configs"] == 6
    assert loco["median_rel_error"] < 1e-3


def test_too_few_configurations_is_an_input_error():
    design = calibration_design(1, sm_counts=[1], bursts=(4 * KIB, 64 * KIB))
    obs = synthetic_observations(TRUTH, design, noise=0.0)
    with pytest.raises(InputError, match="at least 3 configurations"):
        fit_path(obs)
    with pytest.raises(InputError, match="structure"):
        fit_path(synthetic_observations(TRUTH, calibration_design(4, sm_counts=[1, 4]), 0.0), structure="x")


def test_weighted_quantile_counts_weights():
    v = np.array([1.0, 2.0, 3.0])
    assert weighted_quantile(v, np.array([1.0, 1.0, 1.0]), 0.5) == 2.0
    assert weighted_quantile(v, np.array([10.0, 1.0, 1.0]), 0.5) == 1.0


def test_bootstrap_rounds_in_worker_processes_equal_the_serial_ones():
    from xstage.model.fit import bootstrap_draws

    obs = synthetic_observations(TRUTH, calibration_design(4, sm_counts=[1, 4]), noise=0.03, seed=5)
    res = fit_path(obs, structure="base")
    names = list(res.fitted)
    serial = bootstrap_draws(obs, res.params, names, rounds=3, classes=4, seed=9, max_nfev=20)
    parallel = bootstrap_draws(obs, res.params, names, rounds=3, classes=4, seed=9, max_nfev=20, workers=2)
    assert serial == parallel and len(serial[names[0]]) == 3


def test_the_old_name_of_the_held_out_evaluation_warns_and_works():
    import xstage.model.fit as fit_module
    from xstage.model.heldout import evaluate_loco as moved

    with pytest.warns(DeprecationWarning, match=r"moved to xstage\.model\.heldout\.evaluate_loco"):
        old = fit_module.evaluate_loco
    assert old is moved


def test_a_fair_share_structure_fits_fair_share_data_and_keeps_its_admission():
    # Noiseless data of a path that admits its shared window fair-share, with unequal sharing; up to 32
    # SMs, so that the shared window does not bind and is not asserted.
    truth = TRUTH.replace(spread=3.0, admission="fair_share")
    obs = synthetic_observations(truth, calibration_design(32, sm_counts=[1, 8, 32]), noise=0.0, seed=1)
    res = fit_path(obs, structure="full_fair")
    assert res.params.admission == "fair_share" and res.structure == "full_fair"
    assert res.residuals["issue_median_rel"] <= 0.01
    for name in ("t0", "r0", "drain", "r_fast", "b_fast", "spread", "latency"):
        assert abs(getattr(res.params, name) / getattr(truth, name) - 1.0) <= 0.02, name
