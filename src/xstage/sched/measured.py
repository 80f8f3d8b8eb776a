"""Benchmark results as the planner reads them back: one checked loader for the CSVs of
`xstage bench moe` and `xstage bench ulysses` (what `xstage plan validate` and `xstage plan
attention-costs` interpret).

`load_results(path, kind=None, only=None)` reads a CSV, tells its kind from its header (a Ulysses CSV
has `heads`, a MoE CSV `shape`), keeps the rows matching `--only`, checks them and returns them with
their line numbers. Every refusal is one `InputError` naming the file, the line and the column:

- the kind's columns are there (`MOE_COLUMNS`, `ULYSSES_COLUMNS`) and the file has rows;
- sizes are positive integers (MoE `H I E K tokens ep`, and `block` `BMxBN1xBN2xBK` and `ctas` on
  the fused kernel's rows; Ulysses `heads dim tokens P grid`), `ep` divides `E`, `P` <= `heads`;
- times (MoE `time_ns` and, where given, `time_p10_ns` / `time_p90_ns`; Ulysses `time_ns`, or
  `sender_ns` and `receiver_ns` in results from before `exchange=`) are numbers, finite and > 0 (a
  Ulysses row whose `exchange_ok` records an error may have none);
- variants are known: MoE `SCHEDULE[@PACING]` (`xstage.moe.Variant`) or a baseline (`BASELINES`),
  Ulysses one of `ULYSSES_VARIANTS` or an exchange spelling; MoE `path` one of `PATHS` and the
  optional `dtype` one of `MOE_DTYPES` (rows without it are BF16).

`check_moe_rows` / `check_ulysses_rows` apply the same checks to rows given in Python
(`validate_moe`, `validate_ulysses` and `attention_costs` call them).

Example:
    res = load_results("benchmarks/results/h200-moe-paced/moe.csv", only=["path=host"])
    res.kind, len(res.rows), res.where(0)   # ('moe', 1008, '...moe.csv, line 2')
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from xstage.attention.exchange import parse_exchange
from xstage.dtypes import DTYPES, FP8_DTYPES
from xstage.errors import InputError
from xstage.moe.variant import Variant
from xstage.results.io import read_rows
from xstage.results.select import select

BASELINES = ("unfused", "chain", "chain_fp8")  # MoE rows of the benchmarks' baselines, not of the fused kernel
PATHS = ("hbm", "host", "peer")
MOE_DTYPES = (*DTYPES, *FP8_DTYPES)
MOE_COLUMNS = ("shape", "H", "I", "E", "K", "tokens", "ep", "path", "variant", "time_ns", "block", "ctas")
# The variants `xstage bench ulysses` and `xstage.bench.ulysses_dist` write.
# Before `exchange=`: the fused kernel was `fused`; since, every exchange spelling is a variant too.
ULYSSES_VARIANTS = ("pre_alltoall", "attention", "serial_triton", "serial_cudnn", "fused", "attention:triton",
                    "attention:cudnn")
ULYSSES_COLUMNS = ("heads", "dim", "tokens", "P", "variant", "grid")
KINDS = {"moe": ("`xstage bench moe`", MOE_COLUMNS), "ulysses": ("`xstage bench ulysses`", ULYSSES_COLUMNS)}


@dataclass(frozen=True)
class Results:
    """Checked rows of one results CSV (`kind` "moe" or "ulysses"); `lines[i]` is row i's line."""

    kind: str
    path: Path
    rows: list[dict]
    lines: list[int]

    def where(self, i: int) -> str:
        return f"{self.path}, line {self.lines[i]}"


def _header(path: Path) -> list[str]:
    with path.open(newline="") as f:
        first = next(csv.reader(f), None)
    return [c.strip() for c in first or [] if c.strip()]


def _missing(columns: Sequence[str], have) -> list[str]:
    return [c for c in columns if c not in have]


def load_results(path, kind: str | None = None, only=None) -> Results:
    """The rows of results CSV `path` matching `only` (`--only KEY=V1,V2` filters), checked (see module
    docstring). `kind` ("moe" or "ulysses") requires that kind; None tells it from the header."""
    path = Path(path)
    if kind is not None and kind not in KINDS:
        raise InputError(f"kind={kind!r}: must be one of {sorted(KINDS)}")
    if path.is_dir():
        raise InputError(f"results file {path}: is a folder; give the CSV written by `xstage bench`")
    rows = read_rows(path)  # refuses a missing file and rows with the wrong number of fields
    header = _header(path)
    if not header:
        raise InputError(f"results file {path}: empty; expected the CSV written by `xstage bench moe` or "
                         "`xstage bench ulysses`")
    if kind is None:
        kind = "ulysses" if "heads" in header else "moe"
    made_by, columns = KINDS[kind]
    missing = _missing(columns, header)
    if missing:
        raise InputError(f"results file {path}: no column(s) {', '.join(missing)}; a {made_by} CSV has "
                         f"{', '.join(columns)}")
    if not rows:
        raise InputError(f"results file {path}: a header but no rows")
    line_of = {id(r): i for i, r in enumerate(rows, start=2)}
    kept = select(rows, only) if only else rows
    if not kept:
        raise InputError(f"results file {path}: no rows match --only {' '.join(only)} ({len(rows)} rows in all)")
    lines = [line_of[id(r)] for r in kept]
    (check_moe_rows if kind == "moe" else check_ulysses_rows)(kept, str(path), lines)
    return Results(kind, path, kept, lines)


def _at(source: str, lines: Sequence[int] | None, i: int) -> str:
    return f"{source}, line {lines[i]}" if lines is not None else f"{source}, row {i + 1}"


def _value(row: Mapping, column: str, at: str) -> str:
    if column not in row:
        raise InputError(f"{at}: no column {column}")
    v = row[column]
    return "" if v is None else str(v).strip()


def _positive_int(row: Mapping, column: str, at: str) -> int:
    text = _value(row, column, at)
    try:
        v = int(text)
    except ValueError:
        raise InputError(f"{at}, column {column}: {text!r} is not an integer") from None
    if v < 1:
        raise InputError(f"{at}, column {column}: {text}: must be a positive integer")
    return v


def _time(row: Mapping, column: str, at: str) -> float:
    text = _value(row, column, at)
    if not text:
        raise InputError(f"{at}, column {column}: empty; a measured time in ns is needed")
    try:
        v = float(text)
    except ValueError:
        raise InputError(f"{at}, column {column}: {text!r} is not a number (a time in ns)") from None
    if not math.isfinite(v):
        raise InputError(f"{at}, column {column}: {text}: must be a finite time in ns")
    if v <= 0:
        raise InputError(f"{at}, column {column}: {text}: a time must be > 0 ns")
    return v


def _check_columns(rows: Sequence[Mapping], columns: Sequence[str], source: str, made_by: str) -> None:
    if not rows:
        raise InputError(f"{source}: no rows")
    missing = _missing(columns, rows[0])
    if missing:
        raise InputError(f"{source}: no column(s) {', '.join(missing)}; a {made_by} CSV has {', '.join(columns)}")


def check_moe_row(row: Mapping, at: str) -> None:
    """One row of a `xstage bench moe` CSV (see module docstring); `at` says where it is."""
    variant = _value(row, "variant", at)
    fused = variant not in BASELINES
    if fused:
        try:
            Variant.parse(variant)
        except InputError as exc:
            raise InputError(f"{at}, column variant: {variant!r} is not a known variant ({exc}; or a baseline: "
                             f"{', '.join(BASELINES)})") from None
    if not _value(row, "shape", at):
        raise InputError(f"{at}, column shape: empty")
    sizes = {c: _positive_int(row, c, at) for c in ("H", "I", "E", "K", "tokens", "ep")}
    if sizes["E"] % sizes["ep"]:
        raise InputError(f"{at}, column ep: {sizes['ep']} does not divide E={sizes['E']} experts")
    if sizes["K"] > sizes["E"]:
        raise InputError(f"{at}, column K: {sizes['K']} is more than E={sizes['E']} experts")
    dtype = str(row.get("dtype") or "").strip()  # optional: rows from before FP8 are BF16
    if dtype and dtype not in MOE_DTYPES:
        raise InputError(f"{at}, column dtype: {dtype!r} is not one of {', '.join(MOE_DTYPES)}")
    path = _value(row, "path", at)
    if path not in PATHS:
        raise InputError(f"{at}, column path: {path!r} is not a store path ({', '.join(PATHS)})")
    _time(row, "time_ns", at)
    for c in ("time_p10_ns", "time_p90_ns"):  # optional spread columns
        if c in row and _value(row, c, at):
            _time(row, c, at)
    if fused:
        block = _value(row, "block", at)
        parts = block.split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise InputError(f"{at}, column block: {block!r} is not a tile config BMxBN1xBN2xBK of positive "
                             "integers, e.g. 128x128x256x64")
        _positive_int(row, "ctas", at)


def check_moe_rows(rows: Sequence[Mapping], source: str = "results", lines: Sequence[int] | None = None) -> None:
    """Every row of a `xstage bench moe` CSV (`check_moe_row`); errors name `source` and the line (or
    the row number when `lines` is None)."""
    _check_columns(rows, MOE_COLUMNS, source, KINDS["moe"][0])
    for i, row in enumerate(rows):
        check_moe_row(row, _at(source, lines, i))


def check_ulysses_row(row: Mapping, at: str) -> None:
    """One row of a `xstage bench ulysses` CSV (see module docstring); `at` says where it is."""
    variant = _value(row, "variant", at)
    if variant not in ULYSSES_VARIANTS:
        try:
            parse_exchange(variant)
        except InputError:
            raise InputError(f"{at}, column variant: {variant!r} is neither a Ulysses benchmark variant "
                             f"({', '.join(ULYSSES_VARIANTS)}) nor an exchange spelling") from None
    sizes = {c: _positive_int(row, c, at) for c in ("heads", "dim", "tokens", "P", "grid")}
    for c in ("block_m", "block_n"):
        if c in row and _value(row, c, at):
            _positive_int(row, c, at)
    if sizes["P"] > sizes["heads"]:
        raise InputError(f"{at}, column P: {sizes['P']} ranks is more than heads={sizes['heads']}")
    failed = str(row.get("exchange_ok") or "").startswith("error")
    if not any(c in row for c in ("time_ns", "sender_ns")):
        raise InputError(f"{at}: no time column (time_ns, or sender_ns in results from before exchange=)")
    for c in ("time_ns", "sender_ns", "receiver_ns"):
        if c not in row or (failed and not _value(row, c, at)):
            continue  # the benchmark recorded why this variant did not run
        _time(row, c, at)


def check_ulysses_rows(rows: Sequence[Mapping], source: str = "Ulysses results",
                       lines: Sequence[int] | None = None) -> None:
    """Every row of a `xstage bench ulysses` CSV (`check_ulysses_row`)."""
    _check_columns(rows, ULYSSES_COLUMNS, source, KINDS["ulysses"][0])
    for i, row in enumerate(rows):
        check_ulysses_row(row, _at(source, lines, i))


__all__ = ["BASELINES", "MOE_COLUMNS", "PATHS", "ULYSSES_COLUMNS", "ULYSSES_VARIANTS", "Results",
           "check_moe_row", "check_moe_rows", "check_ulysses_row", "check_ulysses_rows", "load_results"]
