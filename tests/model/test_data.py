"""Data formats: long rows, summary, the reference adapter, and their errors."""

import csv
import math

import numpy as np
import pytest

from xstage.errors import InputError
from xstage.model.data import (
    LONG_COLUMNS,
    REFERENCE_CLOCK_HZ,
    SCHEMA,
    SUMMARY_COLUMNS,
    load_reference_data,
    read_observations,
    summarise,
    validate_long,
)
from xstage.results.io import write_csv_atomic

from ..corrupt import (
    MOE_CSV,
    PROBE_SUMMARY_CSV,
    REFERENCE_CSV,
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


def long_rows(n_cta=5, n_bursts=3, launch=7):
    rows = []
    rng = np.random.default_rng(0)
    for cta in range(n_cta):
        for b in range(n_bursts):
            rows.append({
                "path": "host", "peer_mode": "none", "n_sm": n_cta, "ctas_per_sm": 1, "warps": 8,
                "vector_bytes": 16, "burst_bytes": 65536, "gap_iters": 100,
                "gap_ns": "nan" if b == 0 else 450.0 + cta, "launch": launch, "cta": cta, "burst_index": b,
                "issue_ns": 1000.0 + 100 * cta + 10 * b + rng.uniform(), "completion_ns": 3000.0 + cta,
                "gpu": "G", "driver": "1", "torch": "2", "triton": "3", "git_commit": "abc", "date": "2026-01-01",
            })
    return rows


def test_schema_documents_every_long_column():
    assert set(SCHEMA) == set(LONG_COLUMNS)


def test_summarise_takes_cta_statistics():
    rows = long_rows()
    summary = summarise(rows)
    assert len(summary) == 3 and set(summary[0]) >= set(SUMMARY_COLUMNS)
    for s in summary:
        iss = np.array([r["issue_ns"] for r in rows if r["burst_index"] == s["burst_index"]])
        assert s["issue_median_ns"] == pytest.approx(np.median(iss))
        assert s["issue_p10_ns"] == pytest.approx(np.percentile(iss, 10))
        assert s["issue_max_ns"] == pytest.approx(iss.max())
        assert s["n_cta"] == 5 and s["n_bursts"] == 3 and s["gap_ns"] == pytest.approx(452.0)
        assert s["completion_median_ns"] == pytest.approx(3002.0)


def test_long_and_summary_files_read_alike(tmp_path):
    rows = long_rows()
    write_csv_atomic(tmp_path / "long.csv", rows, LONG_COLUMNS)
    write_csv_atomic(tmp_path / "summary.csv", summarise(rows), SUMMARY_COLUMNS)
    a = read_observations(tmp_path / "long.csv")
    b = read_observations(tmp_path / "summary.csv")
    assert np.allclose(a.issue_med, b.issue_med) and np.allclose(a.gap_ns, b.gap_ns)
    assert a.configs() == [("host", 5, 65536)]


def test_reference_adapter_converts_cycles():
    obs = load_reference_data()
    with open(obs.source) as f:
        ref = list(csv.DictReader(f))
    assert len(obs) == 3 * len(ref)
    r0 = ref[0]
    first = obs.select((obs.launch == 0) & (obs.burst_lo == 0))
    steady = obs.select((obs.launch == 0) & (obs.burst_lo == 12))
    assert first.issue_med[0] == pytest.approx(float(r0["issue_first"]) / REFERENCE_CLOCK_HZ * 1e9)
    assert steady.burst_hi[0] == 23 and steady.n_bursts[0] == 24
    assert first.gap_ns[0] == pytest.approx(float(r0["gap_cycles"]) / REFERENCE_CLOCK_HZ * 1e9)
    assert len(obs.configs("host")) == 20 and len(obs.configs("hbm")) == 20


@pytest.mark.parametrize("col, value, match", [
    ("issue_ns", "-3", "issue_ns"), ("burst_bytes", "0", "burst_bytes"), ("n_sm", "1.5", "n_sm"),
    ("path", "nvme", "path"), ("issue_ns", "abc", "issue_ns"), ("peer_mode", "x", "peer_mode"),
])
def test_bad_long_rows_name_the_column(col, value, match):
    rows = long_rows()
    rows[4][col] = value
    with pytest.raises(InputError, match=match):
        validate_long(rows)


def test_missing_column_and_malformed_files(tmp_path):
    rows = long_rows()
    for r in rows:
        del r["issue_ns"]
    with pytest.raises(InputError, match="issue_ns"):
        validate_long(rows)
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="match none of the kinds read here: reference probe"):
        read_observations(bad)
    with pytest.raises(InputError, match="does not exist"):
        read_observations(tmp_path / "none.csv")
    empty = tmp_path / "empty.csv"
    empty.write_text(",".join(SUMMARY_COLUMNS) + "\n")
    with pytest.raises(InputError, match="a header but no rows"):
        read_observations(empty)


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    out = tmp_path / "s.csv"
    out.write_text("old\n")

    class Boom:
        def __iter__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_csv_atomic(out, Boom(), ["a"])
    assert out.read_text() == "old\n"
    assert list(tmp_path.iterdir()) == [out]


def test_nan_completion_is_allowed():
    rows = long_rows()
    for r in rows:
        r["completion_ns"] = "nan"
    assert all(math.isnan(s["completion_median_ns"]) for s in summarise(rows))


def test_fit_data_files_are_read_through_the_common_checks(tmp_path):
    """The three formats refuse what every input CSV refuses (`xstage.results.io.read_table`), naming
    the file: a repeated column would otherwise feed its last copy to the fit."""
    ref = committed(REFERENCE_CSV)
    summary = committed(PROBE_SUMMARY_CSV, 40)
    bad = {
        "dup.csv": duplicate_column(ref, "issue_steady", "1"),
        "dup-summary.csv": duplicate_column(summary, "issue_median_ns", "5"),
        "gz.csv": compressed(summary, "gzip"),
        "latin1.csv": latin1(ref),
        "header.csv": header_only(summary),
        "ulysses.csv": committed(ULYSSES_CSV, 3),
        "moe.csv": committed(MOE_CSV, 3),
    }
    expect = {"dup.csv": "column 'issue_steady' appears twice", "dup-summary.csv": "column 'issue_median_ns' appears",
              "gz.csv": "gzip-compressed", "latin1.csv": "line 3: not UTF-8", "header.csv": "a header but no rows",
              "ulysses.csv": "looks like a Ulysses results CSV", "moe.csv": "looks like a MoE results CSV"}
    for name, data in bad.items():
        path = write(tmp_path / name, data)
        with pytest.raises(InputError) as exc:
            read_observations(path)
        assert str(exc.value).startswith(f"data file {path}") and expect[name] in str(exc.value), str(exc.value)
    bom = read_observations(write(tmp_path / "bom.csv", with_bom(ref)))
    assert np.array_equal(bom.issue_med, load_reference_data().issue_med)


@pytest.mark.parametrize("source, column, value, match", [
    ("reference", "issue_first", "nan", "line 4: column 'issue_first' must be a number, got NaN"),
    ("reference", "issue_2", "inf", "line 4: column 'issue_2' must be finite, got 'inf'"),
    ("reference", "gap_cycles", "-5", "line 4: column 'gap_cycles' must be >= 0 cycles"),
    ("reference", "nblocks", "0", "line 4: column 'nblocks' must be an integer >= 1"),
    ("reference", "burst_bytes", "1e400", "line 4: column 'burst_bytes' must be finite"),
    ("summary", "gap_ns", "inf", "line 4: column 'gap_ns' must be finite"),
    ("summary", "issue_p90_ns", "-3", "line 4: column 'issue_p90_ns' must be a time > 0 ns or empty"),
    ("summary", "issue_median_ns", "0", "line 4: column 'issue_median_ns' must be a finite time > 0 ns"),
    ("summary", "n_bursts", "0", "line 4: column 'n_bursts' must be an integer >= 1"),
    ("summary", "launch", "2.5", "line 4: column 'launch' must be an integer"),
    ("summary", "n_cta", "-1", "line 4: column 'n_cta' must be an integer >= 1"),
])
def test_bad_values_name_file_line_and_column(tmp_path, source, column, value, match):
    text = committed(REFERENCE_CSV if source == "reference" else PROBE_SUMMARY_CSV, 5)
    path = write(tmp_path / "data.csv", with_value(text, column, value, row=3))
    with pytest.raises(InputError, match=f"^data file {path}, {match}"):
        read_observations(path)


def test_long_rows_name_their_line(tmp_path):
    rows = long_rows()
    rows[6]["issue_ns"] = "inf"
    write_csv_atomic(tmp_path / "long.csv", rows, LONG_COLUMNS)
    with pytest.raises(InputError, match=r"long.csv, line 8: column 'issue_ns' must be finite"):
        read_observations(tmp_path / "long.csv")
