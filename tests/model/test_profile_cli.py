"""Profiles, the `xstage model` / `xstage fit` commands and the plots."""

import json
import math

import numpy as np
import pytest

from xstage.cli import main
from xstage.cli.model import parse_size, parse_time, predict_burst
from xstage.errors import InputError
from xstage.model import closed_form as cf
from xstage.model.data import SUMMARY_COLUMNS, load_reference_data
from xstage.model.design import calibration_design, synthetic_observations
from xstage.model.params import PathParams
from xstage.model.profile import Profile, load_default_profile, load_reference_profile
from xstage.results.io import write_csv_atomic
from xstage.results.output import MANIFEST

KIB = 1024


def test_default_profiles_are_the_measured_paths():
    host, peer = load_default_profile(), load_default_profile("peer")
    assert host.path == "host" and host.provenance["gpu"] == "NVIDIA H200"
    assert host.fit_quality["heldout"]["median_rel_error"] <= 0.10
    assert peer.path == "peer" and peer.fit_quality["heldout"]["median_rel_error"] <= 0.10
    assert peer.params.drain > 5 * host.params.drain  # NVLink drains far faster than PCIe


def test_reference_profile_is_the_fitted_host_path():
    prof = load_reference_profile()
    assert prof.path == "host" and prof.provenance["data_file"] == "h200-hostlink-probe.csv"
    p = prof.params
    assert 40e9 < p.drain < 70e9 and 40e9 < p.r0 < 60e9
    assert prof.fit_quality["loco"]["median_rel_error"] <= 0.10
    for name, (lo, hi) in prof.intervals.items():
        assert lo <= hi, name


def test_default_profile_predicts_the_reference_points():
    """Independent of the fit's own bookkeeping: re-predict the host rows and measure the error."""
    from xstage.model.api import predict

    out = predict(load_reference_profile(), load_reference_data())
    err = np.abs(out["rel_error"])
    assert np.median(err) < 0.10
    assert len(err) == 240


def test_profile_round_trip_and_errors(tmp_path):
    p = PathParams(r0=50e9, c_sm=math.inf, drain=40e9, capacity=2e6, t0=10.0)
    prof = Profile(path="peer", params=p, intervals={"r0": (49e9, 51e9)}, fitted=["r0"])
    f = tmp_path / "p.json"
    prof.save(f)
    back = Profile.load(f)
    assert back.params == p and back.intervals == {"r0": (49e9, 51e9)}
    d = json.loads(f.read_text())
    assert d["params"]["c_sm"] == "inf"
    d["params"]["drain"] = -1
    f.write_text(json.dumps(d))
    with pytest.raises(InputError, match="drain"):
        Profile.load(f)
    f.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        Profile.load(f)
    with pytest.raises(InputError, match="no embedded default profile"):
        load_default_profile("hbm")


@pytest.mark.parametrize("text, value", [("65536", 65536), ("64KiB", 65536), ("4MiB", 4 * 2**20),
                                         ("1.5M", 1.5 * 2**20), ("10MB", 1e7), ("64k", 65536)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_errors():
    with pytest.raises(InputError, match="--burst"):
        parse_size("12 parsecs", "--burst")
    with pytest.raises(InputError, match="size"):
        parse_size("0KiB")
    assert parse_time("20us") == 20_000.0 and parse_time("1.5ms") == 1.5e6


def test_model_command_predicts_a_burst(capsys):
    assert main(["model", "--burst", "64KiB", "--gap", "20us", "--sms", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    pr = out["prediction"]
    prof = load_default_profile()
    assert pr["closed_form"]["first_issue_ns"] == pytest.approx(cf.issue_time(prof.params, 65536, n_sm=8))
    assert pr["simulated"]["first_issue_ns"] > 0 and pr["simulated"]["steady_issue_ns"] > 0
    assert main(["model", "--burst", "lots"]) == 2


def test_predict_burst_one_sm_matches_closed_form():
    prof = load_default_profile()
    pr = predict_burst(prof, 256 * KIB, 1000.0, 1)
    assert pr["simulated"]["first_issue_ns"] == pytest.approx(cf.issue_time(prof.params, 256 * KIB))
    assert pr["closed_form"]["exact"] is True
    assert pr["closed_form"]["first_issue_ns"] == pytest.approx(pr["simulated"]["first_issue_ns"])


def test_model_command_writes_plots_exactly_into_the_folder(tmp_path, capsys):
    folder = tmp_path / "new" / "plots"  # created, parents too
    assert main(["model", "--plot", str(folder)]) == 0
    out = capsys.readouterr().out
    pngs = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)  # the manifest records them
    assert pngs == ["host-issue-vs-burst.png", "host-issue-vs-gap.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]
    for p in folder.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote {p}" in out  # the command names every file it wrote


def test_fit_command_writes_a_profile_and_keeps_old_output_on_failure(tmp_path, capsys):
    truth = PathParams(r0=60e9, c_sm=64 * KIB, drain=100e9, capacity=2**20, t0=80.0)
    design = calibration_design(8, sm_counts=[1, 8], bursts=(16 * KIB, 256 * KIB, 4096 * KIB), gaps_ns=(0.0,))
    obs = synthetic_observations(truth, design, noise=0.0, completion=False)
    data = tmp_path / "summary.csv"
    write_csv_atomic(data, obs.summary_rows(), SUMMARY_COLUMNS)
    out = tmp_path / "prof.json"
    assert main(["fit", str(data), "-o", str(out), "--structure", "base", "--bootstrap", "2"]) == 0
    prof = Profile.load(out)
    assert prof.params.drain == pytest.approx(truth.drain, rel=1e-3)
    assert set(prof.intervals) == set(prof.fitted)
    before = out.read_text()
    bad = tmp_path / "bad.csv"
    bad.write_text("issue_median_ns,path\n5,host\n")
    assert main(["fit", str(bad), "-o", str(out)]) == 2  # its own profile: a rerun may replace it, not a failed one
    assert "no column(s) n_sm" in capsys.readouterr().err
    assert out.read_text() == before
    mine = tmp_path / "mine.json"
    mine.write_text("{}")
    assert main(["fit", str(bad), "-o", str(mine)]) == 2
    assert "was not written by `xstage fit`" in capsys.readouterr().err  # checked before the data is even read
    assert mine.read_text() == "{}"
    out2 = tmp_path / "prof2.json"
    assert main(["fit", str(bad), "-o", str(out2)]) == 2
    assert "no column(s) n_sm, burst_bytes" in capsys.readouterr().err
    assert not out2.exists()
