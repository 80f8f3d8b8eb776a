"""The committed H200 host-path measurements (benchmarks/results/h200-host-probe): what they show,
against the independent CUDA reference probe, and how well the committed profile predicts the
configurations it was not fitted on."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from xstage.model.data import observations_from_rows
from xstage.model.fit import weighted_quantile
from xstage.model.predict import predict_rows
from xstage.model.profile import Profile
from xstage.probe.analysis import experiments, read_summary
from xstage.probe.report import _fit_rows, analyse, compare_reference, holdout_split, pool_for_fit

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200-host-probe"
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def summary():
    return read_summary(RESULTS / "summary.csv")


@pytest.fixture(scope="module")
def exp(summary):
    return experiments(summary)


def _first(exp, n, b):
    (e,) = [e for e in exp["first"] if e["n_sm"] == n and e["burst_bytes"] == b]
    return e


def test_provenance(summary):
    r = summary[0]
    assert r["gpu"] == "NVIDIA H200" and r["triton"] and r["torch"] and r["driver"] and r["date"]
    assert {x["path"] for x in summary} == {"host"}


def test_host_link_drain_and_per_sm_rate(exp):
    agg = _first(exp, 132, 2 * MIB)["agg_GBps"]
    assert 45 < agg < 60, agg                        # PCIe Gen5 x16 posted writes
    one = _first(exp, 1, 2 * MIB)["agg_GBps"]
    assert 45 < one < 60, one                         # one SM issues at about the link rate
    # The same 2 MiB in total: 8 SMs x 256 KiB stall, 32 SMs x 64 KiB do not (two window levels).
    assert _first(exp, 8, 256 * 1024)["issue_ns"] > 10 * _first(exp, 32, 64 * 1024)["issue_ns"]


def test_hbm_control_has_no_host_knee():
    hbm = experiments(read_summary(RESULTS / "hbm" / "summary.csv"))
    (e,) = [e for e in hbm["first"] if e["n_sm"] == 132 and e["burst_bytes"] == 2 * MIB]
    assert e["agg_GBps"] > 1000


def test_agrees_with_reference_probe_where_bytes_dominate(exp):
    ref = [r for r in compare_reference(exp, "host") if r["reference_ns"] >= 10_000]
    assert len(ref) >= 10
    within = [abs(r["ratio"] - 1) <= 0.10 for r in ref]
    assert np.mean(within) >= 0.75


def test_committed_profile_predicts_held_out_configurations(summary):
    prof = Profile.load(RESULTS / "profile.json")
    obs = observations_from_rows(pool_for_fit(_fit_rows(summary, "host")))
    keys = obs.config_keys()
    multi = {k for k, nb in zip(keys, obs.n_bursts) if nb > 1}
    _, held = holdout_split(obs.configs(), multi)
    m = np.array([k in set(held) for k in keys])
    test = obs.select(m)
    pred, _ = predict_rows(prof.params, test, prof.classes)
    rel = np.abs(pred / test.issue_med - 1)
    w = np.array([1.0 / sum(k2 == k for k2 in test.config_keys()) for k in test.config_keys()])
    err = weighted_quantile(rel, w, 0.5)
    assert err <= 0.10
    assert err == pytest.approx(prof.fit_quality["heldout"]["median_rel_error"], rel=1e-6)


def test_reanalysis_reproduces_committed_figures(tmp_path):
    shutil.copy(RESULTS / "summary.csv", tmp_path / "summary.csv")
    got = analyse(tmp_path, fit=False)["experiments"]
    want = json.loads((RESULTS / "experiments.json").read_text())
    got = json.loads(json.dumps(got, default=str))
    for sweep in want:
        for a, b in zip(got[sweep], want[sweep]):
            for k, v in b.items():
                if isinstance(v, float) and not math.isnan(v):
                    assert a[k] == pytest.approx(v, rel=1e-9), (sweep, k)


def test_packaged_profile_is_the_committed_measurement():
    from importlib import resources

    packaged = Profile.load(Path(str(resources.files("xstage.data") / "h200-host-probe-profile.json")))
    committed = Profile.load(RESULTS / "profile.json")
    packaged_dict = packaged.to_dict()
    # The packaged copy also names the packaged copy of its data; everything else is the measurement.
    assert packaged_dict["provenance"].pop("packaged_data") == "h200-host-probe-summary.csv"
    assert packaged_dict == committed.to_dict()
    assert packaged.provenance["gpu"] == "NVIDIA H200" and packaged.fit_quality["heldout"]["median_rel_error"] <= 0.10


def test_packaged_summary_is_the_committed_data():
    from importlib import resources

    packaged = Path(str(resources.files("xstage.data") / "h200-host-probe-summary.csv"))
    assert packaged.read_bytes() == (RESULTS / "summary.csv").read_bytes()
