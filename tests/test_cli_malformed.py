"""Every subcommand answers bad input with one line naming the problem and exit status 2: no traceback,
the command's name once, nothing written and nothing replaced, whatever the malformed input; and so it
answers an output that would replace a file the user made, or one of the command's inputs."""

import json
import shutil

import pytest

from tests.sched.test_plan_inputs import _moe_csv, _moe_rows
from xstage.cli import main
from xstage.env import has_gpu

from .loader_cases import make_unreadable_inputs, unreadable_input_cases

GOOD_PROFILE = None


@pytest.fixture
def files(tmp_path):
    from xstage.model import load_default_profile

    d = tmp_path
    (d / "existing.json").write_text("{}")
    (d / "afile").write_text("x")
    (d / "empty.csv").write_text("")
    (d / "notcsv.csv").write_text("\x00\x01garbage\n")
    prof = load_default_profile("host").to_dict()
    bad = {"r0-not-number": {**prof, "intervals": {**prof["intervals"], "r0": ["abc", 1]}},
           "fit-quality-str": {**prof, "fit_quality": "oops"},
           "provenance-list": {**prof, "provenance": [1, 2]},
           "path-bogus": {**prof, "path": "bogus"},
           "params-missing": {k: v for k, v in prof.items() if k != "params"}}
    for name, p in bad.items():
        (d / f"{name}.json").write_text(json.dumps(p))
    (d / "notjson.json").write_text("{not json")
    moe_cols = "shape,H,I,E,K,tokens,ep,path,variant,time_ns,time_p10_ns,time_p90_ns,block,ctas\n"
    row = "H512-I256-E16-K2,512,256,16,2,256,4,host,{v},{t},{t},{t},64x64x128x32,8\n"
    for name, v, t in (("abc", "expert_wave", "abc"), ("nan", "expert_wave", "nan"), ("neg", "expert_wave", "-5"),
                       ("unknown-variant", "wave_of_doom", "1000")):
        (d / f"moe-{name}.csv").write_text(moe_cols + row.format(v=v, t=t))
    (d / "moe-no-time.csv").write_text("shape,H,I,E,K,tokens,ep,path,variant\nH512-I256-E16-K2,512,256,16,2,256,4,"
                                       "host,expert_wave\n")
    # Files the user made where commands write (demo, model --plot, plan, bench summaries), and inputs.
    for name in ("report.md", "host-issue-vs-burst.png", "plan_timeline.png", "summary.md", "moe-task-costs.json",
                 "attention-task-costs.json"):
        (d / name).write_text("made by the user\n")
    _moe_csv(d / "validation.csv", _moe_rows())
    shutil.copy("src/xstage/data/h200-hostlink-probe.csv", d / "probe.csv")
    make_unreadable_inputs(d)
    return d


def _cases(d):
    profile_bad = [str(d / f"{n}.json") for n in ("r0-not-number", "fit-quality-str", "provenance-list",
                                                    "path-bogus", "params-missing", "notjson", "missing")]
    cases = [
        ["env", "--bogus"],
        ["probe", "--path", "nowhere"],
        ["probe", "--sweep", "nonsense", "--plan"],
        ["probe", "--repeats", "0", "--plan"],
        ["probe", "--sm-count", "-3", "--plan"],
        ["probe", "-o", str(d / "afile"), "--analyse-only"],
        ["probe", "-o", str(d / "missing-run"), "--analyse-only"],
        ["bench", "moe", "-o", str(d / "afile")],
        ["bench", "moe", "-o", str(d / "x"), "--schedules", "lag:x"],
        ["bench", "moe", "-o", str(d / "x"), "--schedules", "lag:4@fast"],
        ["bench", "moe", "-o", str(d / "x"), "--block", "1:2"],
        ["bench", "ulysses", "-o", str(d / "afile")],
        ["bench", "ulysses", "-o", str(d / "x"), "--core", "--core-shapes", "axb"],
        ["model", "--burst", "abc"],
        ["model", "--burst", "0.5"],
        ["model", "--burst", "1e30"],
        ["model", "--burst", "64KiB", "--sms", "100000"],
        ["model", "--burst", "64KiB", "--gap", "abc"],
        ["model", "--sms", "8"],
        ["model", "--plot", str(d / "existing.json")],
        *[["model", "--profile", p] for p in profile_bad],
        ["fit", str(d / "empty.csv"), "-o", str(d / "out.json")],
        ["fit", str(d / "notcsv.csv"), "-o", str(d / "out.json")],
        ["fit", str(d / "missing.csv"), "-o", str(d / "out.json")],
        ["fit", "src/xstage/data/h200-hostlink-probe.csv", "-o", str(d)],
        ["fit", "src/xstage/data/h200-hostlink-probe.csv", "-o", str(d / "existing.json")],
        ["fit", "src/xstage/data/h200-hostlink-probe.csv", "-o", str(d / "afile" / "out.json")],
        ["fit", "src/xstage/data/h200-hostlink-probe.csv", "-o", str(d / "no" / "such" / "out.json")],
        ["plan", "moe", "--shape", "H4096/I2048/E256/top6", "--tokens", "2048", "--ep", "8"],
        ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "abc", "--ep", "8"],
        ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "2048", "--ep", "7"],
        ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "0", "--ep", "8"],
        ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "2048", "--ep", "8", "--block-m", "abc"],
        ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "2048", "--ep", "8", "--block-m", "100"],
        ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "2048", "--ep", "8", "--ctas", "0"],
        ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "2048", "--ep", "8", "--candidates", "zz"],
        ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "2048", "--ep", "8", "--pacing", "fast"],
        *[["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "2048", "--ep", "8", "--profile", p]
          for p in profile_bad],
        ["plan", "ulysses", "--heads", "2", "--dim", "64", "--tokens", "100", "--ranks", "4"],
        ["plan", "ulysses", "--heads", "24", "--dim", "128", "--tokens", "-1", "--ranks", "4"],
        ["plan", "validate", str(d / "empty.csv"), "-o", str(d / "v")],
        ["plan", "validate", str(d / "missing.csv"), "-o", str(d / "v")],
        ["plan", "validate", str(d / "moe-no-time.csv"), "-o", str(d / "v")],
        *[["plan", "validate", str(d / f"moe-{n}.csv"), "-o", str(d / "v")]
          for n in ("abc", "nan", "neg", "unknown-variant")],
        ["plan", "validate", str(d / "moe-abc.csv"), "-o", str(d / "existing.json")],
        ["plan", "validate", str(d / "moe-abc.csv"), "-o", str(d / "v"), "--workers", "0"],
        ["plan", "attention-costs", str(d / "empty.csv"), "-o", str(d / "a")],
        ["plan", "attention-costs", str(d / "moe-abc.csv"), "-o", str(d / "existing.json")],
        ["demo", "-o", str(d / "existing.json")],
        ["demo", "-o", str(d / "afile" / "deeper")],
        # no subcommand: a usage error, like any other
        [],
        ["plan"],
        ["bench"],
        # one --only parser: malformed spellings, and slices that select nothing
        ["probe", "--plan", "--only", "n_sm==1"],
        ["probe", "--plan", "--only", "n_sm=1,,2"],
        ["probe", "--plan", "--only", "n_sm=7"],
        ["plan", "validate", str(d / "validation.csv"), "-o", str(d / "v"), "--only", "ep==4"],
        ["plan", "validate", str(d / "validation.csv"), "-o", str(d / "v"), "--only", "ep=3"],
        ["bench", "moe", "-o", str(d / "x"), "--only", "tokens"],
        ["bench", "moe", "-o", str(d / "x"), "--only", "tokens=3"],
        ["bench", "ulysses", "-o", str(d / "x"), "--only", "P=3"],
        # files the user made are not replaced without --force
        ["demo", "-o", str(d)],
        ["model", "--plot", str(d)],
        ["plan", "moe", "--shape", "H512-I256-E16-K2", "--tokens", "64", "--ep", "4", "--plot", str(d)],
        ["plan", "moe", "--shape", "H512-I256-E16-K2", "--tokens", "64", "--ep", "4", "--plot",
         str(d / "plan_timeline.png")],
        ["plan", "calibrate", "-o", str(d)],
        ["plan", "attention-costs", str(d / "moe-abc.csv"), "-o", str(d)],
        ["bench", "moe", "-o", str(d), "--summarize-only"],
        ["bench", "ulysses", "-o", str(d), "--summarize-only"],
        ["probe", "--analyse-only", "-o", str(d)],
        # an input is never an output, not even with --force
        ["plan", "validate", str(d / "validation.csv"), "-o", str(d), "--force"],
        ["fit", str(d / "probe.csv"), "-o", str(d / "probe.csv"), "--force"],
        ["model", "--plot", str(d), "--data", str(d / "host-issue-vs-burst.png"), "--force"],
        # numbers past what the code holds or the hardware means
        *[["plan", "ulysses", "--heads", "24", "--dim", dim, "--tokens", tok, "--ranks", "4"]
          for dim, tok in (("7", "4096"), ("128", "1e20"), ("128", "99999999999999999999"))],
        *[["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "64", "--ep", "8", *extra]
          for extra in (["--ctas", "99999999"], ["--pacing", "50:1e300"], ["--pacing", "1e290:128"])],
        ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "99999999999999999999", "--ep", "8"],
        ["plan", "calibrate", "-o", str(d / "c"), "--tokens", "99999999999999999999"],
        ["probe", "--sm-count", "99999999999999", "--plan"],
        ["bench", "moe", "-o", str(d / "x"), "--schedules", "lag:4@1e290:128"],
        ["bench", "moe", "-o", str(d / "x"), "--budget-s", "nan"],
        ["bench", "ulysses", "-o", str(d / "x"), "--core", "--core-shapes", "99999999999999999999999x24x128"],
        # values holding line ends or control characters: still one line (found by tests/test_fuzz_args.py)
        ["plan", "moe", "--shape", "\x1e", "--tokens", "64", "--ep", "4"],
        ["plan", "validate", str(d / "validation.csv"), "-o", str(d / "v"), "--default-pacing", "\r"],
        ["plan", "validate", str(d / "validation.csv"), "-o", str(d / "v"), "--candidates", "0\r"],
        ["plan", "ulysses", "--heads", "24", "--dim", "128", "--tokens", "4096\n7", "--ranks", "4"],
        # an empty path is no path: it meant the current folder, or the default, without a word
        *[[*words, ""] for words in (["plan", "moe", "--shape", "H512-I256-E16-K2", "--tokens", "64", "--ep", "4",
                                      "--profile"], ["model", "--burst", "64KiB", "--plot"], ["demo", "-o"],
                                     ["bench", "moe", "--summarize-only", "-o"], ["fit"])],
        ["plan", "validate", str(d / "validation.csv"), "-o", str(d / "v"), "--costs", ""],
        # an input of the other kind of results would be ignored: refused
        ["plan", "validate", str(d / "validation.csv"), "-o", str(d / "v"), "--calibration", str(d / "uly.csv")],
        ["plan", "validate", str(d / "uly.csv"), "-o", str(d / "v"), "--costs",
         "src/xstage/data/h200-moe-task-costs.json"],
        # an empty list is refused, not taken for the option's absence
        ["plan", "validate", str(d / "validation.csv"), "-o", str(d / "v"), "--exchange", ""],
        *unreadable_input_cases(d),
    ]
    if not has_gpu():  # where measuring would start, the missing GPU is the user error
        cases += [["probe", "-o", str(d / "x")], ["bench", "moe", "-o", str(d / "x")],
                  ["bench", "ulysses", "-o", str(d / "x")], ["bench", "ulysses", "-o", str(d / "x"), "--core"],
                  ["plan", "calibrate", "-o", str(d / "x")]]
    return cases


def _files(root) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_every_malformed_input_gets_one_line_and_status_2(files, capsys):
    failures = []
    before = _files(files)
    for args in _cases(files):
        try:
            code = main(args)
        except Exception as exc:  # noqa: BLE001 - any escaping exception is the failure this test looks for
            failures.append(f"{args}: raised {type(exc).__name__}: {exc}")
            continue
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.strip()]
        if code != 2 or len(lines) != 1 or "Traceback" in err or "error" not in lines[0]:
            failures.append(f"{args}: exit {code}, stderr {err[-400:]!r}")
            continue
        prog, _, message = lines[0].partition(": error: ")
        words = prog.split()
        if words[:1] != ["xstage"] or any(message.startswith(f"{' '.join(words[i:])}:") for i in range(len(words))):
            failures.append(f"{args}: the command's name is not said exactly once: {lines[0]!r}")
    assert not failures, "\n".join(failures)
    assert _files(files) == before  # nothing written, nothing replaced


@pytest.mark.parametrize("argv, needle", [
    (["probe", "-o", "{d}/afile"], "-o {d}/afile: exists and is not a folder"),
    (["probe", "-o", "{d}/new", "--only", "P=3"], "--only: unknown field(s) ['P']"),
    (["probe", "-o", "{d}/new", "--only", "n_sm=7"], "--only n_sm=7: selects none"),
    (["plan", "calibrate", "-o", "{d}/c", "--model-shapes", ""], "--model-shapes '': give shapes among --shapes"),
    (["plan", "calibrate", "-o", "{d}/c", "--shapes", ""], "--shapes '': give at least one shape"),
    (["plan", "calibrate", "-o", "{d}/c", "--block", ""], "--block  (shape H4096-I2048-E256-K6): block ''"),
    (["bench", "moe", "-o", "{d}/b", "--block", "bf16="], "--block 'bf16=': block '': expected BM:BN1:BN2:BK"),
    (["bench", "moe", "-o", "{d}/b", "--block", "128:128:256:64:0:4"],
     "--block '128:128:256:64:0:4': BlockConfig num_warps=0: warps per CTA must be a power of two"),
])
def test_arguments_are_refused_before_the_gpu_is_looked_for(tmp_path, capsys, argv, needle):
    """Found by tests/test_fuzz_args.py: a measuring run looked for the GPU first, so on a machine without
    one the malformed argument went unnamed (and an empty --model-shapes was taken for none given)."""
    (tmp_path / "afile").write_text("x")
    assert main([a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert needle.format(d=tmp_path) in err and "needs a CUDA GPU" not in err, err
