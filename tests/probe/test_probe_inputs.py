"""`xstage probe --analyse-only` reads raw data, summary, run record and progress record through the
common checks: a file it cannot read is one error naming it, before any output is written; the
analysis reports its progress."""

import os

import pytest

from xstage.errors import InputError
from xstage.probe.analysis import experiments, read_summary
from xstage.probe.report import analyse
from xstage.probe.session import read_done

from ..corrupt import (
    PROBE_SUMMARY_CSV,
    ULYSSES_CSV,
    committed,
    compressed,
    duplicate_column,
    header_only,
    with_bom,
    with_value,
    write,
)
from .synthetic import write_folder

SUMMARY_ROWS = 120


def _raw_folder(tmp_path, name="p"):
    out = tmp_path / name
    write_folder(out, ["first"], sm_count=4, repeats=1)
    return out


def _refused(out, *needles):
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(InputError) as exc:
        analyse(out, fit=False)
    text = str(exc.value)
    assert "\n" not in text and all(n in text for n in needles), text
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing written
    return text


def test_raw_files_it_cannot_read_are_named(tmp_path):
    out = _raw_folder(tmp_path)
    raw = out / "raw" / "first.csv"
    text = raw.read_text()
    cases = {
        "gzip": (compressed(text, "gzip"), ["raw/first.csv", "gzip-compressed"]),
        "header": (header_only(text), ["raw/first.csv: a header but no rows"]),
        "ulysses": (committed(ULYSSES_CSV, 3), ["looks like a Ulysses results CSV", "not a probe measurements CSV"]),
        "duplicate": (duplicate_column(text, "issue_ns"), ["column 'issue_ns' appears twice"]),
        "inf": (with_value(text, "issue_ns", "inf", row=5), ["first.csv, line 6: column 'issue_ns' must be finite"]),
        "negative": (with_value(text, "burst_bytes", "-4096", row=2), ["line 3: column 'burst_bytes'"]),
    }
    for data, needles in cases.values():
        write(raw, data)
        _refused(out, *needles)
    raw.unlink()
    os.mkfifo(raw)
    _refused(out, "raw/first.csv: is a FIFO (named pipe)")


def test_every_raw_file_is_checked_before_summary_csv_is_written(tmp_path):
    out = tmp_path / "p"
    write_folder(out, ["first", "twoburst"], sm_count=4, repeats=1)
    write(out / "raw" / "twoburst.csv", header_only((out / "raw" / "twoburst.csv").read_text()))
    _refused(out, "twoburst.csv: a header but no rows")
    assert not (out / "summary.csv").exists()


def _summary_folder(tmp_path, data, name="s"):
    out = tmp_path / name
    out.mkdir()
    write(out / "summary.csv", data)
    return out


def test_a_committed_summary_reads_the_same_with_a_byte_order_mark(tmp_path):
    text = committed(PROBE_SUMMARY_CSV, SUMMARY_ROWS)
    plain = read_summary(write(tmp_path / "plain.csv", text))
    bom = read_summary(write(tmp_path / "bom.csv", with_bom(text)))
    assert repr(bom) == repr(plain)  # repr: NaN completion times compare equal
    assert experiments(plain)  # the slice holds a sweep to reduce


@pytest.mark.parametrize("column, value, needle", [
    ("issue_median_ns", "nan", "line 5: column 'issue_median_ns' must be a number, got NaN"),
    ("issue_median_ns", "-2", "line 5: column 'issue_median_ns' must be a finite time > 0 ns"),
    ("gap_ns", "inf", "line 5: column 'gap_ns' must be finite"),
    ("n_sm", "0", "line 5: column 'n_sm' must be an integer >= 1"),
    ("warps", "abc", "line 5, column warps: 'abc' is not an integer"),
    ("gap_iters", "-1", "line 5, column gap_iters: -1: must be an integer >= 0"),
    ("peer_mode", "some", "line 5, column peer_mode: 'some' is not one of none, one, all"),
    # found by tests/test_fuzz_files.py: a 400-digit count passed the check and overflowed the reader
    ("warps", "9" * 400, "line 5, column warps: 99999999999999999999... (400 digits): must be at most"),
    ("n_sm", "9" * 30, "line 5: column 'n_sm' must be at most 9223372036854775807"),
])
def test_summary_values_are_checked(tmp_path, column, value, needle):
    text = committed(PROBE_SUMMARY_CSV, SUMMARY_ROWS)
    out = _summary_folder(tmp_path, with_value(text, column, value, row=4))
    assert needle in _refused(out, f"probe summary {out / 'summary.csv'}")


@pytest.mark.parametrize("value", [" ", "None", " NaN "])
def test_a_spread_cell_not_recorded_reads_as_nan_however_spelled(tmp_path, value):
    """Found by tests/test_fuzz_files.py: the check took ' ' and 'None' for "not recorded" and the reader
    then failed on them with a ValueError."""
    text = committed(PROBE_SUMMARY_CSV, SUMMARY_ROWS)
    rows = read_summary(write(tmp_path / "s.csv", with_value(text, "issue_p90_ns", value, row=4)))
    assert rows[3]["issue_p90_ns"] != rows[3]["issue_p90_ns"]  # NaN
    assert rows[2]["issue_p90_ns"] > 0


def test_summary_files_it_cannot_read_are_named(tmp_path):
    text = committed(PROBE_SUMMARY_CSV, SUMMARY_ROWS)
    _refused(_summary_folder(tmp_path, duplicate_column(text, "issue_median_ns"), "dup"), "appears twice")
    _refused(_summary_folder(tmp_path, compressed(text, "xz"), "xz"), "xz-compressed")
    _refused(_summary_folder(tmp_path, header_only(text), "head"), "a header but no rows")
    folder = tmp_path / "folder"
    (folder / "summary.csv").mkdir(parents=True)
    _refused(folder, "summary.csv: is a folder")


def test_run_record_it_cannot_read_is_named(tmp_path):
    text = committed(PROBE_SUMMARY_CSV, SUMMARY_ROWS)
    for name, data, needle in (("bad", "{not json", "line 1, column 2: not valid JSON"),
                               ("list", "[1, 2]", "expected a JSON object, got list"),
                               ("gz", compressed('{"timing": "x"}', "gzip"), "gzip-compressed")):
        out = _summary_folder(tmp_path, text, name)
        write(out / "run.json", data)
        _refused(out, f"probe run record {out / 'run.json'}", needle)


def test_progress_record_it_cannot_read_is_named(tmp_path):
    good = write(tmp_path / "first.done", "n_sm=1 0,1\nn_sm=2 2\n")
    assert read_done(good) == {"n_sm=1": [0, 1], "n_sm=2": [2]}
    bad = write(tmp_path / "bad.done", "n_sm=1 0,1\nn_sm=2 2,x\n")
    with pytest.raises(InputError, match=r"probe progress record .*bad.done, line 2: expected a configuration label"):
        read_done(bad)
    with pytest.raises(InputError, match="gzip-compressed"):
        read_done(write(tmp_path / "gz.done", compressed("n_sm=1 0\n", "gzip")))


def test_analysis_reports_progress_unless_quiet(tmp_path, capsys):
    out = tmp_path / "p"
    write_folder(out, ["first", "twoburst", "completion"], sm_count=8, repeats=1, seed=1)
    analyse(out, bootstrap=2, quiet=False)
    err = capsys.readouterr().err
    assert "probe: raw files summarised: 3/3" in err
    assert "probe: fitting path host: 1 point fit + 2 bootstrap rounds" in err
    assert "probe: fits: 3/3" in err
    analyse(out, fit=False)  # quiet by default (the API, and --json / --quiet)
    assert capsys.readouterr().err == ""

