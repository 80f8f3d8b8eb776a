"""Unreadable input files for every CLI entry point that reads one (`tests/test_cli_malformed.py` runs
them: exit 2, one line, nothing written). Made from the committed data: compressed, not UTF-8, a
repeated column, the other kind of results, no rows, NaN times, a FIFO and a folder."""

from __future__ import annotations

import os

from .corrupt import (
    CORE_CSV,
    COSTS_JSON,
    MOE_CSV,
    PROBE_SUMMARY_CSV,
    PROFILE_JSON,
    REFERENCE_CSV,
    ULYSSES_CSV,
    committed,
    compressed,
    duplicate_column,
    header_only,
    latin1,
    with_value,
    write,
)

MOE_TEXT_ROWS = 40
ULYSSES_TEXT_ROWS = 22


def make_unreadable_inputs(d) -> None:
    """The files `unreadable_input_cases` names, under folder `d`."""
    moe, uly = committed(MOE_CSV, MOE_TEXT_ROWS), committed(ULYSSES_CSV, ULYSSES_TEXT_ROWS)
    ref, summary = committed(REFERENCE_CSV), committed(PROBE_SUMMARY_CSV, 120)
    files = {
        "moe.gz.csv": compressed(moe, "gzip"), "moe.bz2.csv": compressed(moe, "bz2"),
        "moe.latin1.csv": latin1(moe), "moe-dup.csv": duplicate_column(moe, "time_ns"),
        "moe-header.csv": header_only(moe), "moe-inf.csv": with_value(moe, "time_ns", "inf", row=2),
        "uly.csv": uly, "uly.xz.csv": compressed(uly, "xz"), "uly-dup.csv": duplicate_column(uly, "time_ns"),
        "uly-header.csv": header_only(uly), "uly-nan.csv": with_value(uly, "time_ns", "nan", row=2),
        "uly-no-remote-bytes.csv": uly.replace(",remote_bytes,", ",remote_bytes_2,", 1),
        "core.zip.csv": compressed(committed(CORE_CSV, 4), "zip"),
        "ref-dup.csv": duplicate_column(ref, "issue_steady"), "ref.gz.csv": compressed(ref, "gzip"),
        "profile.gz.json": compressed(PROFILE_JSON.read_text(), "gzip"),
        "profile-nan.json": PROFILE_JSON.read_text().replace('"r0": ', '"r0": NaN, "r0_was": ', 1),
        "costs.latin1.json": latin1(COSTS_JSON.read_text()),
    }
    for name, data in files.items():
        write(d / name, data)
    os.mkfifo(d / "fifo.csv")
    os.mkfifo(d / "fifo.json")
    (d / "folder.csv").mkdir()
    # output folders of `--summarize-only` and `--analyse-only`, each holding one unreadable input
    grids = {"sum-moe-gz": ("moe.csv", compressed(moe, "gzip")), "sum-moe-uly": ("moe.csv", uly),
             "sum-moe-empty": ("moe.csv", ""), "sum-moe-header": ("moe.csv", header_only(moe)),
             "sum-moe-nan": ("moe.csv", with_value(moe, "time_ns", "nan", row=3)),
             "sum-moe-dup": ("moe.csv", duplicate_column(moe, "time_ns")),
             "sum-uly-gz": ("ulysses.csv", compressed(uly, "gzip")), "sum-uly-moe": ("ulysses.csv", moe),
             "sum-uly-header": ("ulysses.csv", header_only(uly)),
             "sum-core-nan": ("core.csv", with_value(committed(CORE_CSV, 4), "tflops", "nan", row=2)),
             "probe-gz": ("summary.csv", compressed(summary, "gzip")),
             "probe-dup": ("summary.csv", duplicate_column(summary, "issue_median_ns")),
             "probe-moe": ("summary.csv", moe)}
    for folder, (name, data) in grids.items():
        (d / folder).mkdir()
        write(d / folder / name, data)
    (d / "sum-moe-fifo").mkdir()
    os.mkfifo(d / "sum-moe-fifo" / "moe.csv")
    (d / "probe-raw-gz" / "raw").mkdir(parents=True)
    write(d / "probe-raw-gz" / "raw" / "first.csv", compressed("path,cta,issue_ns\nhost,0,1\n", "gzip"))


def unreadable_input_cases(d) -> list[list[str]]:
    unreadable_csv = ["moe.gz.csv", "moe.bz2.csv", "moe.latin1.csv", "moe-dup.csv", "moe-header.csv",
                      "moe-inf.csv", "uly.xz.csv", "uly-dup.csv", "uly-header.csv", "uly-nan.csv", "fifo.csv",
                      "folder.csv"]
    plan_u = ["plan", "ulysses", "--heads", "24", "--dim", "128", "--tokens", "4096", "--ranks", "4"]
    plan_m = ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "2048", "--ep", "8"]
    return [
        *[["plan", "validate", str(d / f), "-o", str(d / "v")] for f in unreadable_csv],
        *[["plan", "attention-costs", str(d / f), "-o", str(d / "a")]
          for f in ("uly.xz.csv", "uly-dup.csv", "uly-nan.csv", "moe.gz.csv", "moe-dup.csv", "fifo.csv")],
        *[[*plan_u, "--calibration", str(d / f)] for f in ("uly.xz.csv", "moe-dup.csv", "uly-header.csv", "fifo.csv",
                                                           "uly-no-remote-bytes.csv")],
        *[["plan", "validate", str(d / "uly.csv"), "-o", str(d / "v"), "--calibration", str(d / f)]
          for f in ("moe.gz.csv", "fifo.csv")],
        *[["bench", "moe", "-o", str(d / f), "--summarize-only"]
          for f in ("sum-moe-gz", "sum-moe-uly", "sum-moe-empty", "sum-moe-header", "sum-moe-nan", "sum-moe-dup",
                    "sum-moe-fifo")],
        *[["bench", "ulysses", "-o", str(d / f), "--summarize-only"]
          for f in ("sum-uly-gz", "sum-uly-moe", "sum-uly-header", "sum-core-nan")],
        *[["bench", "ulysses", "-o", str(d / "x"), "--calibration", str(d / f)] for f in ("uly.xz.csv", "moe.gz.csv")],
        *[["bench", "ulysses", "-o", str(d / "x"), "--tuned-from", str(d / f)]
          for f in ("core.zip.csv", "uly.csv", "fifo.csv")],
        *[["probe", "--analyse-only", "-o", str(d / f)]
          for f in ("probe-gz", "probe-dup", "probe-moe", "probe-raw-gz")],
        *[["fit", str(d / f), "-o", str(d / "out.json")]
          for f in ("ref-dup.csv", "ref.gz.csv", "moe.latin1.csv", "uly.csv", "fifo.csv", "folder.csv")],
        *[["model", "--plot", str(d / "plots"), "--data", str(d / f)] for f in ("ref-dup.csv", "fifo.csv")],
        *[["model", "--profile", str(d / f)] for f in ("profile.gz.json", "profile-nan.json", "fifo.json")],
        *[[*plan_m, "--costs", str(d / f)] for f in ("costs.latin1.json", "fifo.json", "profile.gz.json")],
        *[[*plan_m, "--profile", str(d / f)] for f in ("profile-nan.json", "fifo.json")],
    ]
