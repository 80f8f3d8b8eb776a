"""Every command that writes files: it refuses a file the user made (exit 2, one line naming the argument
and the file, before any work, nothing written), takes it with --force, replaces its own earlier output
on a rerun, refuses its own output once edited, appends to its own results, and never writes onto an
input, not even with --force."""

import json
import os

import pytest

from tests.probe.synthetic import write_folder
from tests.sched.test_plan_inputs import TINY, _moe_csv, _moe_rows, _ulysses_rows
from xstage import demo
from xstage.bench import ulysses as bench_ulysses
from xstage.bench.moe_summary import summarize
from xstage.cli import main
from xstage.cli import probe as probe_commands
from xstage.cli.bench import moe as cli_bench_moe
from xstage.model.data import SUMMARY_COLUMNS
from xstage.model.design import calibration_design, synthetic_observations
from xstage.model.params import PathParams
from xstage.results import ResultWriter
from xstage.results.io import write_csv_atomic
from xstage.results.output import MANIFEST

USER = b"made by the user\n"
ENV = {"gpu": "test GPU", "driver": "1", "torch": "2", "triton": "3", "git_commit": "abc1234", "src_hash": "0" * 12,
       "date": "2026-01-01"}
MOE_ROWS = {"expert_wave": 200.0, "lag:4": 160.0, "unfused": 300.0}


def _files(root) -> dict:
    """Every file under `root` with its size and modification time: what a refused command may not change."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _error_line(capsys) -> str:
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in cap.err and cap.out == "", cap.err
    return lines[0]


def _ok(capsys, argv):
    code = main(argv)
    cap = capsys.readouterr()
    assert code == 0, cap.err[-2000:]


def _fit_data(tmp_path):
    truth = PathParams(r0=60e9, c_sm=64 * 1024, drain=100e9, capacity=2**20, t0=80.0)
    design = calibration_design(8, sm_counts=[1, 8], bursts=(16 * 1024, 4096 * 1024), gaps_ns=(0.0,))
    data = tmp_path / "summary.csv"
    write_csv_atomic(data, synthetic_observations(truth, design, noise=0.0, completion=False).summary_rows(),
                     SUMMARY_COLUMNS)
    return data


def _moe_results(folder, rows=MOE_ROWS, tokens=256):
    # the columns `bench moe` writes that its summary needs (the fused rows' tiles and CTAs included)
    cols = ("shape", "H", "I", "E", "K", "tokens", "ep", "path", "variant", "time_ns", "block", "ctas", "reduce_ns",
            "tflops", "speedup")
    w = ResultWriter(folder / "moe.csv", cols, ("shape", "tokens", "ep", "path", "variant"), env=ENV)
    for variant, t in rows.items():
        fused = variant != "unfused"
        w.write(dict(shape="H1152-I4608-E8-K2", H=1152, I=4608, E=8, K=2, tokens=tokens, ep=2, path="host",
                     variant=variant, time_ns=t, block="128x128x128x64" if fused else "", ctas=132 if fused else "",
                     reduce_ns=10.0 if fused else "", tflops=1.0, speedup=""))


def _ulysses_results(folder):
    w = ResultWriter(folder / "ulysses.csv", bench_ulysses.COLUMNS, bench_ulysses.KEY_COLUMNS, env=ENV)
    common = {"heads": 24, "dim": 128, "tokens": 4608, "P": 2, "path": "host", "rank": 0, "rank_heads": 12,
              "block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "grid": 132, "tiles": 432,
              "tile_bytes": 32768, "remote_bytes": 7077888, "timed": "graph"}
    times = {"attention:triton": 100e3, "attention:cudnn": 90e3, "serial": 160e3, "serial:cudnn": 150e3,
             "auto": 120e3}
    for variant, t in times.items():
        w.write({**common, "variant": variant, "exchange": "overlap:cudnn" if variant == "auto" else variant,
                 "time_ns": t, "p10_ns": t, "p90_ns": t * 1.1, "tflops": 1.0,
                 "exchange_ok": "" if variant.startswith("attention") else 1})


# Each case: (argv, a file the command writes, the argument that names where) for a run in tmp_path.
def _demo(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "_PLAN_CONFIG", ("H512-I256-E16-K2", 64, 4))  # a small plan: a short test
    return ["demo", "-o", str(tmp_path / "d")], tmp_path / "d" / "plan_timeline.png", "-o"


def _plan_moe_file(tmp_path, monkeypatch):
    return [*TINY, "--plot", str(tmp_path / "t.png")], tmp_path / "t.png", "--plot"


def _plan_moe_folder(tmp_path, monkeypatch):
    return [*TINY, "--plot", str(tmp_path)], tmp_path / "plan_timeline.png", "--plot"


def _validate_moe(tmp_path, monkeypatch):
    csv = _moe_csv(tmp_path / "moe.csv", _moe_rows())
    return ["plan", "validate", str(csv), "-o", str(tmp_path / "v")], tmp_path / "v" / "validation.png", "-o"


def _validate_ulysses(tmp_path, monkeypatch):
    _ulysses_results(tmp_path)
    return (["plan", "validate", str(tmp_path / "ulysses.csv"), "-o", str(tmp_path / "v")],
            tmp_path / "v" / "validation-ulysses.csv", "-o")


def _attention_costs(tmp_path, monkeypatch):
    rows = _ulysses_rows() + [{**_ulysses_rows()[0], "tokens": 3000, "sender_ns": 1.4e5, "receiver_ns": 1.4e5}]
    csv = _moe_csv(tmp_path / "u.csv", rows)
    return (["plan", "attention-costs", str(csv), "-o", str(tmp_path / "c")],
            tmp_path / "c" / "attention-task-costs.json", "-o")


def _model_plot(tmp_path, monkeypatch):
    return ["model", "--plot", str(tmp_path / "p")], tmp_path / "p" / "host-issue-vs-gap.png", "--plot"


def _fit(tmp_path, monkeypatch):
    data = _fit_data(tmp_path)
    return (["fit", str(data), "-o", str(tmp_path / "prof.json"), "--structure", "base", "--bootstrap", "0"],
            tmp_path / "prof.json", "-o")


def _probe_analyse(tmp_path, monkeypatch):
    write_folder(tmp_path / "p", ["first", "twoburst"], sm_count=4, repeats=1)
    return (["probe", "--analyse-only", "-o", str(tmp_path / "p"), "--no-fit"], tmp_path / "p" / "summary.md", "-o")


def _probe_plots(tmp_path, monkeypatch):
    argv, _, arg = _probe_analyse(tmp_path, monkeypatch)
    return argv, tmp_path / "p" / "plots" / "first_burst.png", arg


def _bench_moe_summary(tmp_path, monkeypatch):
    (tmp_path / "b").mkdir()
    _moe_results(tmp_path / "b")
    return (["bench", "moe", "-o", str(tmp_path / "b"), "--summarize-only"],
            tmp_path / "b" / "speedup-H1152-I4608-E8-K2.png", "-o")


def _bench_ulysses_summary(tmp_path, monkeypatch):
    (tmp_path / "b").mkdir()
    _ulysses_results(tmp_path / "b")
    return ["bench", "ulysses", "-o", str(tmp_path / "b"), "--summarize-only"], tmp_path / "b" / "summary.md", "-o"


CASES = [_demo, _plan_moe_file, _plan_moe_folder, _validate_moe, _validate_ulysses, _attention_costs, _model_plot,
         _fit, _probe_analyse, _probe_plots, _bench_moe_summary, _bench_ulysses_summary]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.strip("_"))
def test_a_user_file_is_refused_forced_and_then_the_commands_own(case, tmp_path, capsys, monkeypatch):
    argv, target, arg = case(tmp_path, monkeypatch)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(USER)
    before = _files(tmp_path)

    assert main(argv) == 2  # refused before any work: nothing written, nothing replaced
    line = _error_line(capsys)
    assert f": error: {arg} " in line and f"{target} exists and was not written by `xstage " in line
    assert line.endswith("give --force to replace it")
    assert _files(tmp_path) == before

    _ok(capsys, [*argv, "--force"])
    assert target.read_bytes() != USER

    inode = target.stat().st_ino
    _ok(capsys, argv)  # its own output, unchanged since: replaced on a rerun
    assert target.stat().st_ino != inode

    target.write_bytes(target.read_bytes() + b"edited")
    before = _files(tmp_path)
    assert main(argv) == 2
    assert f"{target} exists and was changed since `xstage " in _error_line(capsys)
    assert _files(tmp_path) == before


def test_plan_calibrate_refuses_a_user_file_before_it_needs_a_gpu(tmp_path, capsys, monkeypatch):
    import xstage.cli.plan as cmd

    monkeypatch.setattr(cmd, "has_gpu", lambda: False)
    out = tmp_path / "c"
    out.mkdir()
    (out / "moe-task-costs.json").write_bytes(USER)
    before = _files(tmp_path)
    assert main(["plan", "calibrate", "-o", str(out)]) == 2
    assert "moe-task-costs.json exists and was not written by `xstage plan calibrate`" in _error_line(capsys)
    assert main(["plan", "calibrate", "-o", str(out), "--force"]) == 2
    assert _error_line(capsys) == ("xstage plan calibrate: error: needs a CUDA GPU: the tiles are timed inside the "
                                   "kernel")  # the command's name once, not twice
    assert _files(tmp_path) == before


# ---- results that runs append to (the measuring is replaced by a stand-in: no GPU here) ---------------

def test_bench_moe_appends_to_its_own_results_and_refuses_a_users(tmp_path, capsys, monkeypatch):
    runs = []

    def run_grid(out, *a, **k):  # one more configuration per run, as a resumed grid adds
        runs.append(out)
        _moe_results(out, tokens=256 * len(runs))
        return summarize(out)

    monkeypatch.setattr(cli_bench_moe, "has_gpu", lambda: True)  # the command's handler asks these
    monkeypatch.setattr(cli_bench_moe, "run_grid", run_grid)
    out = tmp_path / "b"
    out.mkdir()
    (out / "moe.csv").write_bytes(USER)
    assert main(["bench", "moe", "-o", str(out)]) == 2
    assert _error_line(capsys).endswith(f"{out / 'moe.csv'} exists and was not written by `xstage bench moe`; "
                                        "choose another folder or give --force to write to it")
    assert not runs and (out / "moe.csv").read_bytes() == USER
    (out / "moe.csv").unlink()
    _ok(capsys, ["bench", "moe", "-o", str(out)])
    inode = (out / "summary.md").stat().st_ino
    _ok(capsys, ["bench", "moe", "-o", str(out)])  # resumed: rows appended, summary written again
    lines = (out / "moe.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * len(MOE_ROWS) and len(runs) == 2
    assert (out / "summary.md").stat().st_ino != inode
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "moe.csv", "summary.md",
                                                           "speedup-H1152-I4608-E8-K2.png"])


def test_probe_appends_to_its_raw_results_and_writes_the_rest_again(tmp_path, capsys, monkeypatch):
    def measure(out, path, sweeps, **k):  # simulated measurements; a rerun finds them all done
        if (out / "raw" / "first.csv").exists():
            return {"configs_run": 0, "configs_skipped": 1}
        write_folder(out, sweeps, sm_count=4, repeats=1)
        (out / "run.json").write_text("{}")
        return {"configs_run": 1, "configs_skipped": 0}

    monkeypatch.setattr(probe_commands, "has_gpu", lambda: True)
    monkeypatch.setattr(probe_commands, "measure", measure)
    out = tmp_path / "p"
    argv = ["probe", "--path", "host", "--sweep", "first", "-o", str(out), "--no-fit"]
    _ok(capsys, argv)
    inode = (out / "summary.md").stat().st_ino
    _ok(capsys, argv)
    assert (out / "summary.md").stat().st_ino != inode
    assert {p.name for p in (out / "raw").iterdir()} == {MANIFEST, "first.csv"}
    (out / "run.json").write_bytes(USER)
    assert main(argv) == 2
    assert f"{out / 'run.json'} exists and was changed since `xstage probe`" in _error_line(capsys)


def test_a_killed_fit_resumes_its_kept_rounds(tmp_path, capsys, monkeypatch):
    data = _fit_data(tmp_path)
    out = tmp_path / "prof.json"
    ckpt = tmp_path / "prof.json.bootstrap.jsonl"
    ckpt.write_bytes(USER)  # a file of the user's where the rounds would be kept
    argv = ["fit", str(data), "-o", str(out), "--structure", "base", "--bootstrap", "2"]
    assert main(argv) == 2
    assert f"{ckpt} exists and was not written by `xstage fit`; choose another file or give --force to write to" \
        in _error_line(capsys)
    ckpt.unlink()
    from xstage.model import fit as fit_mod

    real = fit_mod.BootstrapStore.add
    calls = []

    def add_then_stop(self, r, values):
        real(self, r, values)
        calls.append(r)
        raise KeyboardInterrupt

    monkeypatch.setattr(fit_mod.BootstrapStore, "add", add_then_stop)
    assert main(argv) == 130
    capsys.readouterr()
    assert ckpt.exists() and not out.exists()
    monkeypatch.setattr(fit_mod.BootstrapStore, "add", real)
    _ok(capsys, argv)  # the kept rounds are the command's own: resumed, then removed
    assert out.exists() and not ckpt.exists()
    assert set(json.loads((tmp_path / MANIFEST).read_text())["files"]) == {"prof.json"}


# ---- an input is never an output ------------------------------------------------------------------------

def _inputs_as_outputs(tmp_path):
    d = tmp_path / "d"
    d.mkdir(exist_ok=True)
    _moe_csv(d / "validation.csv", _moe_rows())
    _moe_csv(d / "attention-task-costs.json", _ulysses_rows())
    data = _fit_data(tmp_path)
    _ulysses_results(d)
    return [
        (["plan", "validate", str(d / "validation.csv"), "-o", str(d)], d / "validation.csv", "results"),
        (["plan", "attention-costs", str(d / "attention-task-costs.json"), "-o", str(d)],
         d / "attention-task-costs.json", "results"),
        (["fit", str(data), "-o", str(data)], data, "data"),
        (["model", "--plot", str(d), "--data", str(d / "host-issue-vs-gap.png")], d / "host-issue-vs-gap.png",
         "--data"),
        ([*TINY, "--plot", str(d / "plan_timeline.png"), "--costs", str(d / "plan_timeline.png")],
         d / "plan_timeline.png", "--costs"),
        (["bench", "ulysses", "-o", str(d), "--calibration", str(d / "ulysses.csv")], d / "ulysses.csv",
         "--calibration"),
        (["bench", "ulysses", "-o", str(d), "--tuned-from", str(tmp_path / "d" / ".." / "d" / "ulysses.csv")],
         d / "ulysses.csv", "--tuned-from"),
    ]


def test_an_input_is_never_written_even_with_force(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "plan_timeline.png").write_bytes(USER)
    (tmp_path / "d" / "host-issue-vs-gap.png").write_bytes(USER)
    cases = _inputs_as_outputs(tmp_path)
    os.symlink(tmp_path / "d" / "validation.csv", tmp_path / "link.csv")
    cases.append((["plan", "validate", str(tmp_path / "link.csv"), "-o", str(tmp_path / "d")],
                  tmp_path / "d" / "validation.csv", "results"))
    before = _files(tmp_path)
    for argv, _, arg in cases:
        for force in ([], ["--force"]):
            assert main([*argv, *force]) == 2, argv
            line = _error_line(capsys)
            assert f"is the input {arg} " in line and "never written, even with --force" in line, line
    assert _files(tmp_path) == before


def test_validate_writes_beside_its_input_when_the_names_differ(tmp_path, capsys):
    _ulysses_results(tmp_path)
    _ok(capsys, ["plan", "validate", str(tmp_path / "ulysses.csv"), "-o", str(tmp_path)])
    assert (tmp_path / "validation-ulysses.csv").exists()



@pytest.mark.gpu
def test_gpu_runs_resume_their_results_and_replace_their_own_summaries(tmp_path, capsys, monkeypatch):
    from xstage.env import environment

    monkeypatch.setenv("XSTAGE_GIT_COMMIT", "abc1234")  # measured rows must name a commit
    environment.cache_clear()
    try:
        out = tmp_path / "b"
        grid = ["bench", "moe", "-o", str(out), "--only", "shape=H1152-I4608-E8-K2", "--only", "tokens=256",
                "--only", "ep=2", "--schedules", "expert_wave", "--warmup", "0", "--rep", "2"]
        _ok(capsys, grid)
        rows = (out / "moe.csv").read_text()
        inode = (out / "summary.md").stat().st_ino
        _ok(capsys, grid)  # everything measured: the CSV is kept as is, the summary written again
        assert (out / "moe.csv").read_text() == rows and (out / "summary.md").stat().st_ino != inode

        cal = tmp_path / "c"
        calibrate = ["plan", "calibrate", "-o", str(cal), "--shapes", "H1152-I4608-E8-K2", "--tokens", "256",
                     "--reps", "1"]
        _ok(capsys, calibrate)
        inode = (cal / "moe-task-costs.json").stat().st_ino
        _ok(capsys, calibrate)  # its own costs: replaced; its tile rows: resumed
        assert (cal / "moe-task-costs.json").stat().st_ino != inode
        (cal / "moe-task-costs.json").write_text("{}")
        assert main(calibrate) == 2
        assert "moe-task-costs.json exists and was changed since `xstage plan calibrate`" in _error_line(capsys)
    finally:
        environment.cache_clear()
