"""Analysis and fitting on recorded (simulated) probe data: the figures each sweep exists for."""

import json

import numpy as np
import pytest

from xstage.model.closed_form import periodic_steady_issue_time
from xstage.model.profile import Profile
from xstage.probe.analysis import experiments, read_summary, summarise_dir
from xstage.probe.report import analyse, fit_and_check, holdout_split

from .synthetic import NS_PER_GAP_ITER, TRUE, write_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    write_folder(out, ["first", "periodic", "twoburst", "completion"], sm_count=8, repeats=2)
    summarise_dir(out)
    return out


@pytest.fixture(scope="module")
def exp(folder):
    return experiments(read_summary(folder / "summary.csv"))


def test_summary_has_one_row_per_launch_and_burst(folder):
    rows = read_summary(folder / "summary.csv")
    assert {r["sweep"] for r in rows} == {"first", "periodic", "twoburst", "completion"}
    per = {}
    for r in rows:
        per.setdefault((r["sweep"], r["launch"]), []).append(r["burst_index"])
    assert all(sorted(v) == list(range(len(v))) for v in per.values())
    assert all(r["n_cta"] == r["n_sm"] for r in rows)


def test_first_burst_issue_grows_with_bytes(exp):
    for n in {e["n_sm"] for e in exp["first"]}:
        t = [e["issue_ns"] for e in sorted(exp["first"], key=lambda e: e["burst_bytes"]) if e["n_sm"] == n]
        assert np.all(np.diff(t) > 0)


def test_two_burst_slope_is_minus_one(exp):
    checked = [e for e in exp["twoburst"] if e["points_backpressured"] >= 3]
    assert checked
    for e in checked:
        assert e["slope"] == pytest.approx(-1.0, abs=0.05)
        assert e["recovery_gap_ns"] is not None


def test_completion_gives_drain_and_latency(exp):
    widest = max(exp["completion"], key=lambda e: e["n_sm"])
    assert widest["drain_Bps"] == pytest.approx(TRUE.drain, rel=0.03)
    assert widest["latency_ns"] == pytest.approx(TRUE.latency + TRUE.t0, rel=0.25)


def test_periodic_steady_state_matches_closed_form(exp):
    for e in exp["periodic"]:
        if e["gap_iters"] == 0 and e["burst_bytes"] >= 64 * 1024:
            want = periodic_steady_issue_time(TRUE, e["burst_bytes"], e["gap_ns"], n_sm=e["n_sm"])
            assert e["steady_ns"] == pytest.approx(want, rel=0.05)
            # 256 KiB bursts overflow the per-SM window already in burst 0: no later onset to find.
            assert (e["onset_index"] is not None) == (e["burst_bytes"] == 64 * 1024)
    small_gap = [e for e in exp["periodic"] if e["burst_bytes"] == 4096]
    assert all(e["onset_index"] is None for e in small_gap)
    assert {e["gap_ns"] for e in exp["periodic"] if e["gap_iters"] == 1000} == {1000 * NS_PER_GAP_ITER}


def test_holdout_split_is_disjoint_deterministic_and_stratified():
    cfgs = [("host", n, b) for n in (1, 2, 4) for b in (4096, 8192, 16384)]
    calib, held = holdout_split(list(reversed(cfgs)))
    assert len(held) == 2 and not set(calib) & set(held) and set(calib) | set(held) == set(cfgs)
    assert holdout_split(cfgs) == (calib, held)
    multi = [c for c in cfgs if c[1] == 4]
    calib, held = holdout_split(cfgs, multi)
    assert held == sorted([multi[1], ("host", 1, 8192), ("host", 2, 16384)])


def test_fit_recovers_parameters_and_predicts_held_out(tmp_path):
    write_folder(tmp_path, ["first", "twoburst", "completion"], sm_count=8, repeats=1, seed=1)
    summarise_dir(tmp_path)
    res = fit_and_check(read_summary(tmp_path / "summary.csv"), "host", bootstrap=0, structure="base")
    assert res["heldout_configs"] >= 5 and res["heldout_median_rel_error"] < 0.03
    assert res["params"]["drain"] == pytest.approx(TRUE.drain, rel=0.05)
    assert res["params"]["r0"] == pytest.approx(TRUE.r0, rel=0.05)
    prof = Profile.from_dict(res["profile"])
    assert prof.path == "host" and prof.params.drain == res["params"]["drain"]
    assert prof.fit_quality["heldout"]["median_rel_error"] == res["heldout_median_rel_error"]
    assert prof.provenance["gpu"] == "simulated"


def test_analyse_writes_files_and_reanalyses_committed_summary(folder, tmp_path):
    result = analyse(folder, fit=False)
    for name in ("summary.csv", "experiments.json", "summary.md", "plots/first_burst.png", "plots/two_burst.png"):
        assert (folder / name).exists(), name
    assert "Not fitted" in (folder / "summary.md").read_text()
    committed = tmp_path / "committed"
    committed.mkdir()
    (committed / "summary.csv").write_text((folder / "summary.csv").read_text())
    again = analyse(committed, fit=False)
    assert json.loads(json.dumps(again["experiments"], default=str)) == \
        json.loads(json.dumps(result["experiments"], default=str))
