"""The benchmark summaries (`--summarize-only`) refuse a results file they cannot read, in one line
naming it, before writing anything; no malformed file is summarised as numbers."""

import csv
import os

import pytest

import xstage.bench.ulysses as bu
from xstage.attention.flash import FlashConfig
from xstage.bench.moe_summary import summarize
from xstage.bench.ulysses_report import write_report
from xstage.errors import InputError

from ..corrupt import (
    CORE_CSV,
    MOE_CSV,
    NON_FINITE,
    ULYSSES_CSV,
    committed,
    compressed,
    duplicate_column,
    header_only,
    latin1,
    with_bom,
    with_value,
    write,
)

MOE_ROWS = 60  # the first configurations of the committed grid, expert_wave and its rivals among them
ULYSSES_ROWS = 22


def _moe_dir(tmp_path, data, name="moe"):
    folder = tmp_path / name
    folder.mkdir()
    write(folder / "moe.csv", data)
    return folder


def _refused(fn, folder, *needles):
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(InputError) as exc:
        fn(folder)
    text = str(exc.value)
    assert "\n" not in text and all(n in text for n in needles), text
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written
    return text


def test_moe_summary_of_a_committed_grid_is_unchanged_by_a_byte_order_mark(tmp_path):
    text = committed(MOE_CSV, MOE_ROWS)
    plain = summarize(_moe_dir(tmp_path, text, "plain"))
    assert plain["host"]["lag:4"]["configs"] >= 1  # the slice has speedups to compare
    assert summarize(_moe_dir(tmp_path, with_bom(text), "bom")) == plain


@pytest.mark.parametrize("case, needles", [
    ("gzip", ["moe.csv", "gzip-compressed"]),
    ("latin1", ["moe.csv, line 3", "not UTF-8"]),
    ("ulysses", ["looks like a Ulysses results CSV", "not a MoE results CSV"]),
    ("duplicate", ["column 'time_ns' appears twice"]),
    ("empty", ["moe.csv: is empty"]),
    ("header", ["moe.csv: a header but no rows"]),
    *[(f"time-{v}", ["moe.csv, line 4, column time_ns", "finite"]) for v in NON_FINITE],
    ("time-negative", ["moe.csv, line 4, column time_ns", "> 0 ns"]),
    ("tflops-text", ["moe.csv, line 4, column tflops", "'fast' is not a number"]),
    ("ep-zero", ["moe.csv, line 4, column ep"]),
])
def test_moe_summary_refuses_what_it_cannot_read(tmp_path, case, needles):
    text = committed(MOE_CSV, MOE_ROWS)
    data = {"gzip": lambda: compressed(text, "gzip"), "latin1": lambda: latin1(text),
            "ulysses": lambda: committed(ULYSSES_CSV, 5), "duplicate": lambda: duplicate_column(text, "time_ns"),
            "empty": lambda: "", "header": lambda: header_only(text),
            "time-negative": lambda: with_value(text, "time_ns", "-5", row=3),
            "tflops-text": lambda: with_value(text, "tflops", "fast", row=3),
            "ep-zero": lambda: with_value(text, "ep", "0", row=3),
            **{f"time-{v}": (lambda v=v: with_value(text, "time_ns", v, row=3)) for v in NON_FINITE}}[case]()
    _refused(summarize, _moe_dir(tmp_path, data), *needles)


def test_moe_summary_names_a_fifo_or_folder_and_does_not_wait(tmp_path):
    folder = tmp_path / "fifo"
    folder.mkdir()
    os.mkfifo(folder / "moe.csv")
    _refused(summarize, folder, "moe.csv: is a FIFO (named pipe)")
    folder = tmp_path / "dir"
    (folder / "moe.csv").mkdir(parents=True)
    _refused(summarize, folder, "moe.csv: is a folder")


def _ulysses_dir(tmp_path, data, core=None, name="u"):
    folder = tmp_path / name
    folder.mkdir()
    if data is not None:
        write(folder / "ulysses.csv", data)
    if core is not None:
        write(folder / "core.csv", core)
    return folder


def test_ulysses_report_of_a_committed_grid_is_unchanged_by_a_byte_order_mark(tmp_path):
    text = committed(ULYSSES_CSV, ULYSSES_ROWS)
    plain = write_report(_ulysses_dir(tmp_path, text, name="plain")).read_text()
    assert "| 16x128 | 3072 | 2 | host |" in plain
    assert write_report(_ulysses_dir(tmp_path, with_bom(text), name="bom")).read_text() == plain


@pytest.mark.parametrize("case, needles", [
    ("gzip", ["ulysses.csv", "gzip-compressed"]),
    ("moe", ["looks like a MoE results CSV", "not a Ulysses results CSV"]),
    ("duplicate", ["column 'time_ns' appears twice"]),
    ("header", ["ulysses.csv: a header but no rows"]),
    ("nan", ["ulysses.csv, line 3, column time_ns", "finite"]),
    ("p90-negative", ["ulysses.csv, line 3, column p90_ns", "> 0 ns"]),
    ("core-gzip", ["core.csv", "gzip-compressed"]),
    ("core-tflops", ["core.csv, line 3, column tflops", "finite"]),
    ("core-as-grid", ["looks like an attention-core results CSV", "not a Ulysses results CSV"]),
])
def test_ulysses_report_refuses_what_it_cannot_read(tmp_path, case, needles):
    text = committed(ULYSSES_CSV, ULYSSES_ROWS)
    core = committed(CORE_CSV, 4)
    grid, core_data = {
        "gzip": (compressed(text, "gzip"), None), "moe": (committed(MOE_CSV, 5), None),
        "duplicate": (duplicate_column(text, "time_ns"), None), "header": (header_only(text), None),
        "nan": (with_value(text, "time_ns", "nan", row=2), None),
        "p90-negative": (with_value(text, "p90_ns", "-1", row=2), None),
        "core-gzip": (None, compressed(core, "gzip")), "core-tflops": (None, with_value(core, "tflops", "inf", row=2)),
        "core-as-grid": (core, None),
    }[case]
    _refused(write_report, _ulysses_dir(tmp_path, grid, core_data), *needles)


def test_tuned_configs_read_core_files_through_the_same_checks(tmp_path):
    core = committed(CORE_CSV, 6)
    triton = [r for r in csv.DictReader(core.splitlines()) if r["impl"] == "triton"]
    best = max(triton, key=lambda r: float(r["tflops"]))
    want = FlashConfig(*(int(best[c]) for c in ("block_m", "block_n", "num_warps", "num_stages", "ctas_per_sm")),
                       best["tma"] == "1")
    assert {r["dim"] for r in triton} == {best["dim"]}
    assert bu.tuned_configs(write(tmp_path / "core.csv", core)) == {int(best["dim"]): want}
    assert bu.tuned_configs(write(tmp_path / "bom.csv", with_bom(core))) == {int(best["dim"]): want}
    with pytest.raises(InputError, match=r"bad.csv, line 3, column block_m: 'x' is not an integer"):
        bu.tuned_configs(write(tmp_path / "bad.csv", with_value(core, "block_m", "x", row=2)))
    with pytest.raises(InputError, match="looks like a Ulysses results CSV"):
        bu.tuned_configs(write(tmp_path / "u.csv", committed(ULYSSES_CSV, 3)))
