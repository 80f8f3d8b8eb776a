"""`benchmarks/experiments/merge_calibration.py`: a new calibration run's rows replace the old rows of
the same configuration and variant, every other old row is kept, and mismatched files are refused."""

import csv
import importlib.util
from pathlib import Path

import pytest

from xstage.errors import InputError

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments" / "merge_calibration.py"
COLS = ["heads", "dim", "tokens", "P", "path", "variant", "time_ns"]


def _load():
    spec = importlib.util.spec_from_file_location("merge_calibration", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path, rows, cols=COLS):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def _row(heads, variant, t):
    return dict(heads=heads, dim=128, tokens=3072, P=2, path="host", variant=variant, time_ns=t)


def test_new_rows_replace_their_own_configuration_only(tmp_path):
    old = [_row(16, "attention:triton", 1.0), _row(16, "stores:paced", 2.0), _row(32, "attention:triton", 3.0)]
    new = [_row(32, "attention:triton", 30.0), _row(32, "stores:paced", 40.0)]
    _write(tmp_path / "old.csv", old)
    _write(tmp_path / "new.csv", new)
    _load().main([str(tmp_path / "old.csv"), str(tmp_path / "new.csv"), "-o", str(tmp_path / "m.csv")])
    with open(tmp_path / "m.csv") as f:
        got = {(r["heads"], r["variant"]): float(r["time_ns"]) for r in csv.DictReader(f)}
    assert got == {("16", "attention:triton"): 1.0, ("16", "stores:paced"): 2.0,
                   ("32", "attention:triton"): 30.0, ("32", "stores:paced"): 40.0}


def test_files_with_other_columns_are_refused_and_nothing_is_written(tmp_path):
    _write(tmp_path / "old.csv", [_row(16, "attention:triton", 1.0)])
    _write(tmp_path / "new.csv", [{**_row(32, "attention:triton", 3.0), "extra": 1}], COLS + ["extra"])
    with pytest.raises(InputError, match="different columns"):
        _load().main([str(tmp_path / "old.csv"), str(tmp_path / "new.csv"), "-o", str(tmp_path / "m.csv")])
    assert not (tmp_path / "m.csv").exists()
