"""`xstage model` and `xstage fit` as users meet them: checked arguments and outputs, validated profiles,
labelled predictions, progress, resumable and honest bootstrap, help text, standard JSON."""

import json
import math
import re
from pathlib import Path

import pytest

import xstage.model as model_pkg
from xstage.cli import build_parser, main
from xstage.cli import model as commands
from xstage.model import fit as fit_mod
from xstage.model.data import SUMMARY_COLUMNS, read_observations
from xstage.model.design import calibration_design, synthetic_observations
from xstage.model.fit import fit_path
from xstage.model.intervals import MIN_BOOTSTRAP_ROUNDS, percentile_interval
from xstage.model.params import PathParams
from xstage.model.profile import Profile, load_default_profile
from xstage.results.io import write_csv_atomic
from xstage.results.output import MANIFEST

KIB = 1024
TRUTH = PathParams(r0=60e9, c_sm=64 * KIB, drain=100e9, capacity=2**20, t0=80.0)


def _strict_json(text: str):
    def refuse(c):
        raise AssertionError(f"non-standard JSON constant {c}")

    return json.loads(text, parse_constant=refuse)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def small_csv(tmp_path_factory):
    """Six configurations of noisy synthetic data: a base-structure fit takes about a second."""
    design = calibration_design(8, sm_counts=[1, 8], bursts=(16 * KIB, 256 * KIB, 4096 * KIB), gaps_ns=(0.0,))
    obs = synthetic_observations(TRUTH, design, noise=0.02, seed=3, completion=False)
    path = tmp_path_factory.mktemp("data") / "small.csv"
    write_csv_atomic(path, obs.summary_rows(), SUMMARY_COLUMNS)
    return path


def _fit_args(data, out, *extra):
    return ["fit", str(data), "-o", str(out), "--structure", "base", *extra]


# 1. Output paths are checked before any work.


@pytest.mark.parametrize("where", ["folder", "missing-parent", "file-parent", "existing"])
def test_fit_output_is_checked_before_the_fit(where, small_csv, tmp_path, capsys, monkeypatch):
    (tmp_path / "somefile.txt").write_text("x")
    (tmp_path / "existing.json").write_text("{}")
    out = {"folder": tmp_path, "missing-parent": tmp_path / "no" / "such" / "out.json",
           "file-parent": tmp_path / "somefile.txt" / "out.json", "existing": tmp_path / "existing.json"}[where]

    def no_work(*a, **k):
        raise AssertionError("the fit ran before its output was checked")

    monkeypatch.setattr(commands, "build_profile", no_work)
    monkeypatch.setattr(commands, "read_observations", no_work)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(_fit_args(small_csv, out)) == 2
    out_txt, err = capsys.readouterr()
    line = _one_error_line(err)
    assert "-o" in line and out_txt == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "existing.json").read_text() == "{}"  # never overwritten


def test_model_plot_refuses_an_existing_file(tmp_path, capsys):
    f = tmp_path / "existing.json"
    f.write_text("{}")
    assert main(["model", "--plot", str(f)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--plot" in line and "not a folder" in line
    assert f.read_text() == "{}"


def test_model_plot_json_lists_the_files(tmp_path, capsys):
    folder = tmp_path / "plots"
    assert main(["model", "--plot", str(folder), "--json"]) == 0
    payload = _strict_json(capsys.readouterr().out)
    assert sorted(payload["plots"]) == sorted(str(p) for p in folder.iterdir() if p.name != MANIFEST)
    assert all(Path(p).parent == folder for p in payload["plots"])


# 2. Malformed profiles: one line naming the file and the field.


def _profile_variants():
    prof = load_default_profile("host").to_dict()
    params = prof["params"]
    return {
        "intervals.r0": {**prof, "intervals": {**prof["intervals"], "r0": ["abc", 1]}},
        "fit_quality": {**prof, "fit_quality": "oops"},
        "provenance": {**prof, "provenance": [1, 2]},
        "path": {**prof, "path": "bogus"},
        "params": {k: v for k, v in prof.items() if k != "params"},
        "params.r0": {**prof, "params": {**params, "r0": "fast"}},
        "drain": {**prof, "params": {k: v for k, v in params.items() if k != "drain"}},
        "classes": {**prof, "classes": 0},
        "bootstrap_rounds": {**prof, "bootstrap_rounds": "many"},
        "fit_quality.heldout.median_rel_error": {**prof, "fit_quality": {"heldout": {"median_rel_error": "x"}}},
        "provenance.sm_counts": {**prof, "provenance": {**prof["provenance"], "sm_counts": ["all"]}},
        "identified.r0": {**prof, "identified": {**prof["identified"], "r0": "yes"}},
        "format": {**prof, "format": "something/2"},
    }


@pytest.mark.parametrize("field", list(_profile_variants()))
def test_malformed_profile_names_file_and_field(field, tmp_path, capsys):
    f = tmp_path / "bad-profile.json"
    f.write_text(json.dumps(_profile_variants()[field]))
    assert main(["model", "--profile", str(f)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "bad-profile.json" in line and field in line


@pytest.mark.parametrize("text, why", [("{not json", "not valid JSON"), (None, "does not exist"),
                                       ("[1, 2]", "JSON object")])
def test_unreadable_profile_is_one_line(text, why, tmp_path, capsys):
    f = tmp_path / "p.json"
    if text is not None:
        f.write_text(text)
    assert main(["model", "--profile", str(f)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "p.json" in line and why in line


def test_profile_load_is_the_validated_loader(tmp_path):
    f = tmp_path / "p.json"
    d = load_default_profile("host").to_dict()
    d["intervals"]["r0"] = ["abc", 1]
    f.write_text(json.dumps(d))
    with pytest.raises(Exception, match=r"intervals\.r0") as exc:
        Profile.load(f)
    assert type(exc.value).__name__ == "InputError"


# 3. Numbers are checked.


@pytest.mark.parametrize("argv, flag, constraint", [
    (["--burst", "0.5"], "--burst", "at least 1 byte"),
    (["--burst", "0.3KiB"], "--burst", "whole number of bytes"),
    (["--burst", "1e30"], "--burst", "at most 64 GiB"),
    (["--burst", "64KiB", "--sms", "100000"], "--sms", "1..4096"),
    (["--burst", "64KiB", "--sms", "2.5"], "--sms", "integer"),
    (["--burst", "64KiB", "--sms", "0"], "--sms", "1..4096"),
    (["--burst", "64KiB", "--gap", "abc"], "--gap", "time"),
    (["--burst", "64KiB", "--gap=-5us"], "--gap", "time >= 0"),
    (["--burst", "64KiB", "--gap", "1e9s"], "--gap", "at most 60 s"),
    (["--sms", "8"], "--sms", "needs --burst"),
    (["--gap", "20us"], "--gap", "needs --burst"),
    (["--data", "x.csv"], "--data", "needs --plot"),
])
def test_model_numbers_are_checked(argv, flag, constraint, capsys):
    assert main(["model", *argv]) == 2
    out, err = capsys.readouterr()
    line = _one_error_line(err)
    assert flag in line and constraint in line and out == ""


@pytest.mark.parametrize("argv, flag", [(["--bootstrap", "-1"], "--bootstrap"), (["--bootstrap", "x"], "--bootstrap"),
                                        (["--workers", "0"], "--workers"), (["--seed", "abc"], "--seed")])
def test_fit_numbers_are_checked(argv, flag, small_csv, tmp_path, capsys):
    assert main(_fit_args(small_csv, tmp_path / "o.json", *argv)) == 2
    assert flag in _one_error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_more_sms_than_measured_is_noted(capsys):
    assert main(["model", "--burst", "64KiB", "--sms", "256", "--json"]) == 0
    notes = _strict_json(capsys.readouterr().out)["prediction"]["notes"]
    assert any("extrapolation" in n and "132" in n for n in notes)


# 4. Predictions are labelled and one is named for use.


def test_model_labels_each_prediction(capsys):
    assert main(["model", "--burst", "256KiB", "--sms", "132", "--json"]) == 0
    pr = _strict_json(capsys.readouterr().out)["prediction"]
    assert pr["use"] == "simulated"
    sim, eq = pr["simulated"], pr["closed_form"]
    assert "Use these" in sim["method"] and "all 132 SMs" in sim["method"]
    assert "equal sharing" in eq["method"] and eq["exact"] is False
    # The two disagree here (unequal sharing); both are reported, each with its label.
    assert abs(sim["first_issue_ns"] / eq["first_issue_ns"] - 1) > 0.02
    assert sim["steady_bursts"] == [12, 23]
    assert main(["model", "--burst", "256KiB", "--sms", "132"]) == 0
    text = capsys.readouterr().out
    assert "simulated, all 132 SMs (use these" in text
    assert "closed form, equal sharing of the drain (cross-check only" in text
    assert "steady state issue, bursts 12..23" in text
    assert f"{sim['first_issue_ns'] / 1e3:.1f} us" in text and f"{eq['first_issue_ns'] / 1e3:.1f} us" in text


# 5. Progress, up-front estimate, resumable bootstrap.


def test_fit_states_its_work_and_shows_progress(small_csv, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(_fit_args(small_csv, out, "--bootstrap", "3", "--loco")) == 0
    _, err = capsys.readouterr()
    assert "xstage fit: 10 fits (1 point fit + 3 bootstrap rounds + 6 leave-one-out fits" in err
    assert re.search(r"the point fit took \d+\.\d s; the other 9 fits should take about .*extrapolated", err)
    assert "xstage fit: 10/10 after" in err  # plain progress lines when standard error is not a terminal
    assert not Path(str(out) + ".bootstrap.jsonl").exists()  # removed once the profile is written


def test_fit_help_says_what_the_bootstrap_costs(capsys):
    try:
        main(["fit", "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert "one refit" in text and "bootstrap" in text and "default 20" in text
    assert "resume" in text or "missing ones" in text


class _Rounds:
    """Counts bootstrap rounds; raises KeyboardInterrupt instead of running round `stop_at` (0-based count)."""

    def __init__(self, real, stop_at=None):
        self.real, self.stop_at, self.calls = real, stop_at, []

    def __call__(self, obs, params, names, classes, seed, r, max_nfev):
        if self.stop_at is not None and len(self.calls) == self.stop_at:
            raise KeyboardInterrupt
        self.calls.append(r)
        return self.real(obs, params, names, classes, seed, r, max_nfev)


def test_bootstrap_resumes_after_an_interrupt(small_csv, tmp_path, capsys, monkeypatch):
    real = fit_mod._bootstrap_round
    out = tmp_path / "p.json"
    ckpt = tmp_path / "p.json.bootstrap.jsonl"
    first = _Rounds(real, stop_at=2)
    monkeypatch.setattr(fit_mod, "_bootstrap_round", first)
    assert main(_fit_args(small_csv, out, "--bootstrap", "5")) == 130
    err = capsys.readouterr().err
    assert "2 of 5 bootstrap rounds are kept" in err
    assert not out.exists() and ckpt.is_file()
    assert len(ckpt.read_text().splitlines()) == 1 + 2  # header and two finished rounds

    second = _Rounds(real)
    monkeypatch.setattr(fit_mod, "_bootstrap_round", second)
    assert main(_fit_args(small_csv, out, "--bootstrap", "5")) == 0
    err = capsys.readouterr().err
    assert "resuming: 2 of 5 bootstrap rounds already done" in err
    assert second.calls == [2, 3, 4]  # only the remaining rounds ran
    assert not ckpt.exists()

    whole = _Rounds(real)
    monkeypatch.setattr(fit_mod, "_bootstrap_round", whole)
    out2 = tmp_path / "p2.json"
    assert main(_fit_args(small_csv, out2, "--bootstrap", "5")) == 0
    assert whole.calls == [0, 1, 2, 3, 4]
    a, b = Profile.load(out), Profile.load(out2)
    assert a.intervals == b.intervals and a.params == b.params  # same seed: same result as uninterrupted


def test_bootstrap_rounds_of_other_options_are_not_reused(small_csv, tmp_path, capsys, monkeypatch):
    real = fit_mod._bootstrap_round
    out = tmp_path / "p.json"
    monkeypatch.setattr(fit_mod, "_bootstrap_round", _Rounds(real, stop_at=2))
    assert main(_fit_args(small_csv, out, "--bootstrap", "3")) == 130
    again = _Rounds(real)
    monkeypatch.setattr(fit_mod, "_bootstrap_round", again)
    assert main(_fit_args(small_csv, out, "--bootstrap", "3", "--seed", "7")) == 0
    assert again.calls == [0, 1, 2]
    assert "not reused" in capsys.readouterr().err


# 6. Honest intervals.


def test_percentile_interval_contains_the_point_estimate():
    assert percentile_interval([2.0, 3.0, 4.0], 1.0)[0] == 1.0
    assert percentile_interval([2.0, 3.0, 4.0], 9.0)[1] == 9.0
    lo, hi, widened = percentile_interval(list(range(100)), 50.0)
    assert lo <= 50.0 <= hi and not widened


def test_fit_widens_intervals_to_the_point_and_says_so(small_csv, monkeypatch):
    obs = read_observations(small_csv).for_path("host")

    def above(obs, params, names, classes, seed, r, max_nfev):  # every refit lands above the point
        return {n: 2.0 * getattr(params, n) * (1 + 0.01 * r) for n in names}

    monkeypatch.setattr(fit_mod, "_bootstrap_round", above)
    res = fit_path(obs, structure="base", bootstrap=MIN_BOOTSTRAP_ROUNDS)
    for n, (lo, hi) in res.intervals.items():
        assert lo == getattr(res.params, n) < hi
    assert res.interval_info["intervals_widened"] == sorted(res.fitted)
    assert "widened to include the point estimate" in res.interval_info["interval_method"]
    assert res.interval_info["interval_level"] == 0.95


def test_few_bootstrap_rounds_are_not_called_95_percent(small_csv, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(_fit_args(small_csv, out, "--bootstrap", "3")) == 0
    text, err = capsys.readouterr()
    assert "warning: 3 bootstrap rounds are fewer than 20" in err
    assert "95%" not in text.replace("not a 95% interval", "")
    assert "3-round range [" in text
    prof = Profile.load(out)
    assert prof.bootstrap_rounds == 3 and prof.interval_level is None
    assert "not a 95% interval" in prof.interval_method
    for n, (lo, hi) in prof.intervals.items():
        assert lo <= getattr(prof.params, n) <= hi
    # A file that claims 95% for 3 rounds is not believed.
    d = json.loads(out.read_text())
    d["interval_level"] = 0.95
    assert Profile.from_dict(d).interval_level is None


def test_twenty_rounds_are_labelled_95_percent(small_csv, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(_fit_args(small_csv, out, "--json")) == 0  # default --bootstrap 20
    out_txt, err = capsys.readouterr()
    payload = _strict_json(out_txt)
    assert payload["bootstrap_rounds"] == 20 and payload["interval_level"] == 0.95
    assert "warning" not in err


def test_older_profiles_take_their_rounds_from_provenance():
    prof = load_default_profile("host")  # fitted with 10 rounds
    assert prof.bootstrap_rounds == 10 and prof.interval_level is None
    assert prof.interval_label == "10-round range"


# 7. Help text: every option has a default and a unit.


def _subparser(name):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices[name]


@pytest.mark.parametrize("command", ["model", "fit"])
def test_every_option_has_help_with_its_default(command):
    p = _subparser(command)
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and "default" in action.help, action.option_strings


@pytest.mark.parametrize("command, flag, unit", [
    ("model", "--burst", "bytes"), ("model", "--gap", "ns"), ("model", "--sms", "SMs"),
    ("fit", "--bootstrap", "rounds"), ("fit", "--workers", "processes"), ("fit", "--seed", "integer"),
])
def test_numeric_options_name_their_unit(command, flag, unit):
    action = next(a for a in _subparser(command)._actions if flag in a.option_strings)
    assert unit in action.help


def test_docstrings_name_only_flags_that_exist():
    flags = {c: {s for a in _subparser(c)._actions for s in a.option_strings} for c in ("model", "fit")}
    folder = Path(model_pkg.__file__).parent
    for f in folder.glob("*.py"):
        for m in re.finditer(r"xstage (model|fit)\b([^`\n]*)", f.read_text()):
            for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", m.group(2)):
                assert flag in flags[m.group(1)], (f.name, m.group(0))


# 8. Standard JSON, nothing else on standard output.


def test_fit_json_is_standard_and_alone(small_csv, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(_fit_args(small_csv, out, "--bootstrap", "2", "--json")) == 0
    out_txt, err = capsys.readouterr()
    payload = _strict_json(out_txt)
    assert payload["format"] == "xstage-profile/1"
    assert payload["params"]["c_sm"] == "inf" or isinstance(payload["params"]["c_sm"], float)
    assert "xstage fit:" not in err and "point fit took" not in err  # no progress under --json
    assert "warning: 2 bootstrap rounds" in err  # warnings still reach standard error


def test_model_json_is_standard(capsys):
    assert main(["model", "--burst", "64KiB", "--json"]) == 0
    payload = _strict_json(capsys.readouterr().out)
    assert payload["profile"]["path"] == "host"
    onset = payload["prediction"]["closed_form"]["onset_bytes"]
    assert onset == "inf" or (isinstance(onset, float) and math.isfinite(onset))
