"""`xstage plan ...`: user errors are one line and exit 2 before any work, results CSVs are checked
by one loader, progress goes to standard error (plain lines when redirected, none under --json), and
every option says its default."""

import csv
import json
import math

import pytest

from tests.sched.test_calibrate_validate import _row
from tests.sched.test_plan import COSTS, SLOW_PATH
from xstage.cli import build_parser, main
from xstage.errors import InputError
from xstage.sched.exchange import default_exchange_costs, validate_exchange
from xstage.sched.measured import check_moe_rows, load_results
from xstage.sched.moe import MoeConfig
from xstage.sched.plan import plan_moe
from xstage.sched.ulysses import attention_costs
from xstage.sched.validate import validate_moe

MOE = ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "2048", "--ep", "8"]
TINY = ["plan", "moe", "--shape", "H512-I256-E16-K2", "--tokens", "64", "--ep", "4", "--ctas", "8",
        "--candidates", "expert_wave,lag:1"]
CFG = MoeConfig.parse("H1024-I512-E8-K2", tokens_per_rank=512, ep=4, block_m=64, block_n1=64, block_n2=128)


def _strict_json(text: str):
    """Standard JSON only: NaN / Infinity are refused."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _fails(capsys, argv, *needles):
    """`argv` exits 2 with one line on stderr that contains every needle, and nothing on stdout."""
    assert main(argv) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1, cap.err
    assert "Traceback" not in cap.err and cap.out == ""
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ---- output locations, checked before any work ------------------------------------------------------

@pytest.fixture
def existing(tmp_path):
    p = tmp_path / "existing.json"
    p.write_text("{}")
    return p


def _moe_csv(path, rows):
    cols = list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        w.writerows(rows)
    return path


def _moe_rows():
    return [{**_row(CFG, v, t), "dtype": "bf16"} for v, t in (("expert_wave", 2.0e5), ("lag:1", 1.9e5),
                                                              ("lag:1@off", 1.8e5), ("unfused", 3.0e5))]


def _ulysses_rows():
    base = {"heads": 6, "dim": 64, "tokens": 1000, "P": 3, "path": "host", "block_m": 128, "block_n": 128,
            "grid": 5, "exchange_ok": ""}
    return [{**base, "variant": "attention", "sender_ns": 5e4, "receiver_ns": 5e4},
            {**base, "variant": "fused", "sender_ns": 6e4, "receiver_ns": 7e4}]


def test_output_locations_are_checked_before_any_work(tmp_path, capsys, existing, monkeypatch):
    import xstage.cli.plan as cmd

    def no_work(*a, **k):
        raise AssertionError("work started before the output location was checked")

    for name in ("validate_moe", "validate_exchange", "attention_costs", "calibrate_moe", "load_results"):
        monkeypatch.setattr(cmd, name, no_work)
    moe_csv = _moe_csv(tmp_path / "moe.csv", _moe_rows())
    _fails(capsys, ["plan", "validate", str(moe_csv), "-o", str(existing)], "-o", str(existing), "not a folder")
    _fails(capsys, ["plan", "attention-costs", str(moe_csv), "-o", str(existing)], "-o", "not a folder")
    _fails(capsys, ["plan", "calibrate", "-o", str(existing)], "-o", "not a folder")
    _fails(capsys, ["plan", "validate", str(moe_csv), "-o", str(tmp_path / "missing" / "x"), "--workers", "0"],
           "--workers: 0: must be an integer in 1..256")


def test_plot_writes_exactly_the_path_it_reports(tmp_path, capsys):
    folder = tmp_path / "plots"
    folder.mkdir()
    assert main([*TINY, "--plot", str(folder), "--json"]) == 0
    written = _strict_json(capsys.readouterr().out)["plot"]
    assert written == str(folder / "plan_timeline.png") and (folder / "plan_timeline.png").stat().st_size > 5000
    assert not (tmp_path / "plots.png").exists()
    png = tmp_path / "t.png"
    assert main([*TINY, "--plot", str(png)]) == 0
    assert f"timeline: {png}" in capsys.readouterr().out and png.stat().st_size > 5000
    # Not a .png and not a folder; a folder that does not exist: refused before planning.
    _fails(capsys, [*MOE, "--plot", str(tmp_path / "t")], "--plot", ".png")
    _fails(capsys, [*MOE, "--plot", str(tmp_path / "nowhere" / "t.png")], "--plot", "does not exist")


# ---- numbers ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,needles", [
    (["--block-m", "abc"], ("--block-m", "abc", "not an integer")),
    (["--block-m", "100"], ("--block-m", "100", "power of two in 16..1024")),
    (["--block-m", "8"], ("--block-m", "power of two in 16..1024")),
    (["--ctas", "0"], ("--ctas: 0: must be an integer in 1..16384 (persistent CTAs the planner simulates)",)),
    (["--ctas", "99999999"], ("--ctas: 99999999: must be an integer in 1..16384",)),
    (["--seed", "-1"], ("--seed: -1: must be an integer in 0..9223372036854775807",)),
    (["--pacing", "50:1e300"], ("--pacing 50:1e300: BUDGET_KIB=1e+300: must be a finite number in 0..1048576 KiB",)),
    (["--pacing", "1e290:128"], ("--pacing 1e290:128: RATE_GBPS=1e+290: must be a finite number in 1..10000 GB/s",)),
    (["--pacing", "fast"], ("--pacing fast",)),
    (["--candidates", "lag:x"], ("--candidates", "lag:x")),
    (["--candidates", "model_guided"], ("--candidates", "model_guided", "per call")),
    (["--dtype", "fp16"], ("--dtype", "'fp16'", "bf16", "fp8")),
])
def test_plan_moe_numbers_are_one_line_errors(capsys, extra, needles):
    _fails(capsys, [*MOE, *extra], *needles)


@pytest.mark.parametrize("tokens,ep,needles", [
    ("0", "8", ("--tokens: 0: must be an integer in 1..65536 (tokens per rank the planner simulates)",)),
    ("-5", "8", ("--tokens: -5:",)), ("99999999999999999999", "8", ("--tokens: 99999999999999999999: must be",)),
    ("1e20", "8", ("--tokens: 1e20: must be an integer in 1..65536",)),
    ("2048", "7", ("--ep 7", "divide", "256 experts")), ("2048", "0", ("--ep: 0: must be an integer in 1..1024",))
])
def test_plan_moe_tokens_and_ep(capsys, tokens, ep, needles):
    argv = ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", tokens, "--ep", ep]
    _fails(capsys, argv, *needles)


def test_plan_ulysses_and_validate_numbers(capsys, tmp_path):
    u = ["plan", "ulysses", "--heads", "4", "--dim", "64", "--tokens", "100"]
    _fails(capsys, [*u, "--ranks", "8"], "--ranks 8", "--heads 4")
    _fails(capsys, [*u, "--ranks", "0"], "--ranks: 0: must be an integer in 1..1024")
    _fails(capsys, [*u, "--ranks", "2", "--candidates", "stores:paced:3"], "--candidates", "stores:paced:3")
    _fails(capsys, [*u, "--ranks", "2", "--candidates", "tma"], "--candidates", "tma")
    _fails(capsys, [*u, "--ranks", "2", "--calibration", str(tmp_path / "none.csv")], "none.csv")
    moe_csv = _moe_csv(tmp_path / "moe.csv", _moe_rows())
    v = ["plan", "validate", str(moe_csv), "-o", str(tmp_path / "out")]
    _fails(capsys, [*v, "--workers", "0"], "--workers: 0: must be an integer in 1..256")
    _fails(capsys, [*v, "--default-pacing", "fast"], "--default-pacing fast")
    _fails(capsys, [*v, "--exchange", "stores:paced:3"], "--exchange", "stores:paced:3")
    _fails(capsys, ["plan", "calibrate", "-o", str(tmp_path / "c"), "--tokens", "0"], "--tokens: 0: must be")
    _fails(capsys, ["plan", "calibrate", "-o", str(tmp_path / "c"), "--tokens", "64,1e30"],
           "--tokens: 1e30: must be an integer in 1..1048576")
    _fails(capsys, ["plan", "calibrate", "-o", str(tmp_path / "c"), "--reps", "0"], "--reps: 0: must be")
    _fails(capsys, ["plan", "calibrate", "-o", str(tmp_path / "c"), "--shapes", "H1-I2"], "--shapes")
    _fails(capsys, ["plan", "calibrate", "-o", str(tmp_path / "c"), "--block", "100:128:256:64:8:4"],
           "--block", "block_m=100", "power of two")
    _fails(capsys, ["plan", "calibrate", "-o", str(tmp_path / "c"), "--schedules", "interleaved"],
           "--schedules", "include expert_wave")
    _fails(capsys, ["plan", "calibrate", "-o", str(tmp_path / "c"), "--schedules", "expert_wave,lag:x"],
           "--schedules", "lag:x")
    assert not (tmp_path / "out").exists() and not (tmp_path / "c").exists()


def test_plan_moe_api_refuses_unrunnable_blocks_and_ctas():
    with pytest.raises(InputError, match="block_m=100.*power of two"):
        plan_moe(CFG, SLOW_PATH, COSTS, 8, candidates=["lag:1"], block_ms=[100])
    with pytest.raises(InputError, match="block_m=24"):
        MoeConfig.parse("H1024-I512-E8-K2", tokens_per_rank=64, ep=4, block_m=24)
    with pytest.raises(InputError, match="num_ctas=2.5"):
        plan_moe(CFG, SLOW_PATH, COSTS, 2.5, candidates=["lag:1"])
    with pytest.raises(InputError, match="num_ctas=0"):
        plan_moe(CFG, SLOW_PATH, COSTS, 0, candidates=["lag:1"])


# ---- results CSVs: one checked loader -----------------------------------------------------------------

@pytest.mark.parametrize("column,value,needles", [
    ("time_ns", "abc", ("line 3", "column time_ns", "'abc'", "not a number")),
    ("time_ns", "nan", ("line 3", "column time_ns", "finite")),
    ("time_ns", "inf", ("line 3", "column time_ns", "finite")),
    ("time_ns", "-5", ("line 3", "column time_ns", "> 0")),
    ("time_ns", "0", ("line 3", "column time_ns", "> 0")),
    ("time_ns", "", ("line 3", "column time_ns", "empty")),
    ("variant", "wave", ("line 3", "column variant", "'wave'", "not a known variant")),
    ("variant", "lag:4@fast", ("line 3", "column variant", "'lag:4@fast'")),
    ("ep", "3", ("line 3", "column ep", "does not divide")),
    ("tokens", "x", ("line 3", "column tokens", "not an integer")),
    ("ctas", "", ("line 3", "column ctas")),
    ("block", "64x64", ("line 3", "column block", "BMxBN1xBN2xBK")),
    ("path", "pcie", ("line 3", "column path", "'pcie'")),
    ("dtype", "fp4", ("line 3", "column dtype", "'fp4'", "bf16")),
    ("time_p90_ns", "nan", ("line 3", "column time_p90_ns", "finite")),
])
def test_validate_refuses_bad_moe_rows_naming_file_line_and_column(tmp_path, capsys, column, value, needles):
    rows = _moe_rows()
    rows[1][column] = value
    path = _moe_csv(tmp_path / "moe.csv", rows)
    line = _fails(capsys, ["plan", "validate", str(path), "-o", str(tmp_path / "out")], str(path), *needles)
    assert "EP >= 2" not in line
    assert not (tmp_path / "out").exists()


def test_validate_says_what_is_missing(tmp_path, capsys):
    rows = [{k: v for k, v in r.items() if k != "time_ns"} for r in _moe_rows()]
    no_time = _moe_csv(tmp_path / "no_time.csv", rows)
    _fails(capsys, ["plan", "validate", str(no_time), "-o", str(tmp_path / "o")], str(no_time), "no column(s) time_ns")
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    _fails(capsys, ["plan", "validate", str(empty), "-o", str(tmp_path / "o")], str(empty), "empty")
    header = tmp_path / "header.csv"
    header.write_text(",".join(_moe_rows()[0]) + "\n")
    _fails(capsys, ["plan", "validate", str(header), "-o", str(tmp_path / "o")], str(header), "no rows")
    _fails(capsys, ["plan", "validate", str(tmp_path / "absent.csv"), "-o", str(tmp_path / "o")], "does not exist")
    ep1 = _moe_csv(tmp_path / "ep1.csv", [{**r, "ep": 1} for r in _moe_rows()])
    _fails(capsys, ["plan", "validate", str(ep1), "-o", str(tmp_path / "o")], "EP >= 2", "EP 1")
    ok = _moe_csv(tmp_path / "ok.csv", _moe_rows())
    _fails(capsys, ["plan", "validate", str(ok), "-o", str(tmp_path / "o"), "--only", "shape=H1-I1-E1-K1"],
           "selects none of the")


def test_loader_keeps_line_numbers_through_only_filters(tmp_path):
    rows = _moe_rows()
    rows[3]["path"] = "hbm"
    rows[3]["time_ns"] = "-1"  # line 5, selected by --only path=hbm
    path = _moe_csv(tmp_path / "moe.csv", rows)
    assert [r["variant"] for r in load_results(path, only=["path=host"]).rows] == ["expert_wave", "lag:1", "lag:1@off"]
    with pytest.raises(InputError, match=r"line 5, column time_ns"):
        load_results(path, only=["path=hbm"])


def test_api_rows_are_checked_with_row_numbers():
    rows = _moe_rows()
    rows[2]["time_ns"] = math.nan
    with pytest.raises(InputError, match=r"results, row 3, column time_ns: nan"):
        validate_moe(rows, SLOW_PATH, COSTS)
    rows[2]["time_ns"] = 1.0
    rows[0]["variant"] = "nope"
    with pytest.raises(InputError, match=r"row 1, column variant: 'nope'"):
        check_moe_rows(rows)
    with pytest.raises(InputError, match="workers=0"):
        validate_moe(_moe_rows(), SLOW_PATH, COSTS, workers=0)


def test_ulysses_results_are_checked(tmp_path, capsys):
    def write(rows, name="u.csv"):
        return _moe_csv(tmp_path / name, rows)

    rows = _ulysses_rows()
    rows[1]["sender_ns"] = "nan"
    p = write(rows)
    _fails(capsys, ["plan", "validate", str(p), "-o", str(tmp_path / "o")], str(p), "line 3", "sender_ns", "finite")
    rows = _ulysses_rows()
    rows[0]["variant"] = "flash"
    p = write(rows)
    _fails(capsys, ["plan", "attention-costs", str(p), "-o", str(tmp_path / "o")], "line 2", "column variant",
           "'flash'")
    rows = _ulysses_rows()
    rows[0]["receiver_ns"] = "-3"
    p = write(rows)
    _fails(capsys, ["plan", "attention-costs", str(p), "-o", str(tmp_path / "o")], "line 2", "receiver_ns", "> 0")
    # A variant the benchmark could not run records why and has no times: accepted, and left out.
    rows = _ulysses_rows() + [{**_ulysses_rows()[0], "variant": "serial_cudnn", "sender_ns": "", "receiver_ns": "",
                               "exchange_ok": "error: cuDNN refused"}]
    assert len(load_results(write(rows)).rows) == 3
    with pytest.raises(InputError, match="no exchange row"):
        validate_exchange(rows, default_exchange_costs())
    with pytest.raises(InputError, match="no 'attention' rows"):
        attention_costs([rows[1]])
    assert not (tmp_path / "o").exists()


def test_attention_costs_writes_into_the_checked_folder(tmp_path, capsys):
    rows = _ulysses_rows() + [{**_ulysses_rows()[0], "tokens": 3000, "sender_ns": 1.4e5, "receiver_ns": 1.4e5}]
    p = _moe_csv(tmp_path / "u.csv", rows)
    assert main(["plan", "attention-costs", str(p), "-o", str(tmp_path / "costs"), "--json"]) == 0
    payload = _strict_json(capsys.readouterr().out)
    assert payload["kernel"] == "attention" and (tmp_path / "costs" / "attention-task-costs.json").exists()


# ---- progress and JSON --------------------------------------------------------------------------------

def test_validate_progress_is_plain_lines_and_quiet_under_json(tmp_path, capsys):
    path = _moe_csv(tmp_path / "moe.csv", _moe_rows())
    assert main(["plan", "validate", str(path), "-o", str(tmp_path / "a")]) == 0
    cap = capsys.readouterr()
    assert "\r" not in cap.err and "validate: rows predicted: 3/3" in cap.err
    assert "written to" in cap.out
    assert main(["plan", "validate", str(path), "-o", str(tmp_path / "b"), "--json"]) == 0
    cap = capsys.readouterr()
    assert cap.err == ""
    summary = _strict_json(cap.out)
    assert summary["rows"] == 3 and summary["pick_within_tolerance"] is None  # no config with every candidate
    assert (tmp_path / "b" / "validation.csv").exists() and (tmp_path / "b" / "validation.png").exists()
    import csv

    with open(tmp_path / "b" / "validation.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and all(r["git_commit"] and r["date"] for r in rows)  # rows say which model made them


def test_plan_progress_goes_to_stderr_and_json_is_standard(capsys):
    assert main(TINY) == 0
    cap = capsys.readouterr()
    # 2 candidates x the 2 pacings "auto" (the default) chooses from
    assert "\r" not in cap.err and "plan moe: candidates simulated: 4/4" in cap.err
    assert "pick:" in cap.out
    assert main([*TINY, "--json"]) == 0
    cap = capsys.readouterr()
    assert cap.err == "" and len(_strict_json(cap.out)["rows"]) == 4
    u = ["plan", "ulysses", "--heads", "6", "--dim", "64", "--tokens", "1000", "--ranks", "3",
         "--candidates", "stores:burst,stores:paced:16"]
    assert main(u) == 0
    assert "pick:" in capsys.readouterr().out
    assert main([*u, "--json"]) == 0
    cap = capsys.readouterr()
    assert cap.err == "" and _strict_json(cap.out)["pick"] in ("stores:burst", "stores:paced:16")


# ---- help ---------------------------------------------------------------------------------------------

def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def test_every_plan_and_demo_option_says_its_default():
    top = _subparsers(build_parser())
    parsers = {f"plan {k}": p for k, p in _subparsers(top["plan"]).items()}
    parsers["demo"] = top["demo"]
    assert set(parsers) == {"plan moe", "plan ulysses", "plan exchange-costs", "plan attention-costs", "plan calibrate",
                            "plan validate", "plan layer", "plan layer-grid", "demo"}
    for name, p in parsers.items():
        for action in p._actions:
            if action.dest == "help":
                continue
            text = action.help or ""
            assert "default" in text or "required" in text, (name, action.dest, text)


def test_model_files_are_checked(tmp_path, capsys):
    _fails(capsys, [*MOE, "--costs", str(tmp_path)], "task costs file", "is a folder")
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe not json")
    _fails(capsys, [*MOE, "--costs", str(bad)], str(bad), "UTF-16")
    attention = tmp_path / "attention.json"
    attention.write_text(json.dumps({"kernel": "attention", "kinds": {"attention@128x128x64": {
        "overhead_ns": 1.0, "rate": 1.0}}}))
    _fails(capsys, [*MOE, "--costs", str(attention)], "--costs", "'attention' kernel", "'moe'")
