"""Benchmark results as the planner reads them back: one checked loader for the CSVs of
`xstage bench moe` and `xstage bench ulysses` (what `xstage plan validate` and `xstage plan
attention-costs` interpret).

`load_results(path, kind=None, only=None)` reads a CSV (`xstage.results.io.read_table`: the file's
own checks, and its kind told from its header), keeps the rows matching `--only`, checks them and
returns them with their line numbers. Every refusal is one `InputError` naming the file, the line
and the column:

- the kind's columns are there (`MOE_COLUMNS`, `ULYSSES_COLUMNS`) and the file has rows; a CSV of
  another kind is named for the kind it looks like;
- sizes are positive integers (MoE `H I E K tokens ep`, and `block` `BMxBN1xBN2xBK` and `ctas` on
  the fused kernel's rows; Ulysses `heads dim tokens P grid`), `ep` divides `E`, `P` <= `heads`;
- times (MoE `time_ns` and, where given, `time_p10_ns`, `time_p90_ns`, `reduce_ns`,
  `combine_link_ns`; Ulysses `time_ns`, or
  `sender_ns` and `receiver_ns` in results from before `exchange=`) are numbers, finite and > 0 (a
  Ulysses row whose `exchange_ok` records an error may have none), and so are Ulysses `p10_ns`,
  `p90_ns` where given; `tflops` (and MoE `speedup`), where given, are finite and > 0, and the MoE
  measured errors (`MOE_ERRORS`) numbers;
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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from xstage.dtypes import DTYPES, FP8_DTYPES
from xstage.errors import InputError
from xstage.results.io import CSV_KINDS, cell_count, cell_number, cell_text, cell_time, read_table
from xstage.results.select import select
from xstage.spec.exchange import parse_exchange
from xstage.spec.variant import Variant

BASELINES = ("unfused", "chain", "chain_fp8")  # MoE rows of the benchmarks' baselines, not of the fused kernel
PATHS = ("hbm", "host", "peer")
MOE_DTYPES = (*DTYPES, *FP8_DTYPES)
MOE_COLUMNS = ("shape", "H", "I", "E", "K", "tokens", "ep", "path", "variant", "time_ns", "block", "ctas")
# The variants `xstage bench ulysses` and `xstage.bench.ulysses_dist` write.
# Before `exchange=`: the fused kernel was `fused`; since, every exchange spelling is a variant too.
ULYSSES_VARIANTS = ("pre_alltoall", "attention", "serial_triton", "serial_cudnn", "fused", "attention:triton",
                    "attention:cudnn")
ULYSSES_COLUMNS = ("heads", "dim", "tokens", "P", "variant", "grid")
KINDS = {"moe": MOE_COLUMNS, "ulysses": ULYSSES_COLUMNS}  # required columns, by kind (`xstage.results.io.CSV_KINDS`)
MOE_ERRORS = ("max_err", "err_fp8_ref", "fro_f32")  # optional measured errors: a number, NaN and inf included


@dataclass(frozen=True)
class Results:
    """Checked rows of one results CSV (`kind` "moe" or "ulysses"); `lines[i]` is row i's line."""

    kind: str
    path: Path
    rows: list[dict]
    lines: list[int]

    def where(self, i: int) -> str:
        return f"{self.path}, line {self.lines[i]}"


def load_results(path, kind: str | None = None, only=None) -> Results:
    """The rows of results CSV `path` matching `only` (`--only KEY=V1,V2` filters), checked (see module
    docstring). `kind` ("moe" or "ulysses") requires that kind; None tells it from the header."""
    if kind is not None and kind not in KINDS:
        raise InputError(f"kind={kind!r}: must be one of {sorted(KINDS)}")
    table = read_table(path, {k: KINDS[k] for k in ([kind] if kind else KINDS)})
    line_of = {id(r): line for r, line in zip(table.rows, table.lines)}
    kept = select(table.rows, only) if only else table.rows
    if not kept:
        raise InputError(f"results file {table.path}: no rows match --only {' '.join(only)} "
                         f"({len(table.rows)} rows in all)")
    lines = [line_of[id(r)] for r in kept]
    (check_moe_rows if table.kind == "moe" else check_ulysses_rows)(kept, str(table.path), lines)
    return Results(table.kind, table.path, kept, lines)


def _at(source: str, lines: Sequence[int] | None, i: int) -> str:
    return f"{source}, line {lines[i]}" if lines is not None else f"{source}, row {i + 1}"


def _check_columns(rows: Sequence[Mapping], kind: str, source: str) -> None:
    if not rows:
        raise InputError(f"{source}: no rows")
    missing = [c for c in KINDS[kind] if c not in rows[0]]
    if missing:
        raise InputError(f"{source}: no column(s) {', '.join(missing)}; {CSV_KINDS[kind].a()} has "
                         f"{', '.join(KINDS[kind])}")


def check_moe_row(row: Mapping, at: str) -> None:
    """One row of a `xstage bench moe` CSV (see module docstring); `at` says where it is."""
    variant = cell_text(row, "variant", at)
    fused = variant not in BASELINES
    if fused:
        try:
            Variant.parse(variant)
        except InputError as exc:
            raise InputError(f"{at}, column variant: {variant!r} is not a known variant ({exc}; or a baseline: "
                             f"{', '.join(BASELINES)})") from None
    if not cell_text(row, "shape", at):
        raise InputError(f"{at}, column shape: empty")
    sizes = {c: cell_count(row, c, at) for c in ("H", "I", "E", "K", "tokens", "ep")}
    if sizes["E"] % sizes["ep"]:
        raise InputError(f"{at}, column ep: {sizes['ep']} does not divide E={sizes['E']} experts")
    if sizes["K"] > sizes["E"]:
        raise InputError(f"{at}, column K: {sizes['K']} is more than E={sizes['E']} experts")
    dtype = str(row.get("dtype") or "").strip()  # optional: rows from before FP8 are BF16
    if dtype and dtype not in MOE_DTYPES:
        raise InputError(f"{at}, column dtype: {dtype!r} is not one of {', '.join(MOE_DTYPES)}")
    path = cell_text(row, "path", at)
    if path not in PATHS:
        raise InputError(f"{at}, column path: {path!r} is not a store path ({', '.join(PATHS)})")
    cell_time(row, "time_ns", at)
    for c in ("time_p10_ns", "time_p90_ns", "reduce_ns", "combine_link_ns"):  # optional: empty where not measured
        if c in row:
            cell_time(row, c, at, optional=True)
    for c in ("tflops", "speedup"):
        if c in row:
            cell_number(row, c, at, optional=True, positive=True)
    for c in MOE_ERRORS:
        text = cell_text(row, c, at) if c in row else ""
        try:
            float(text or 0)
        except ValueError:
            raise InputError(f"{at}, column {c}: {text!r} is not a number (a measured error)") from None
    if fused:
        block = cell_text(row, "block", at)
        parts = block.split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise InputError(f"{at}, column block: {block!r} is not a tile config BMxBN1xBN2xBK of positive "
                             "integers, e.g. 128x128x256x64")
        cell_count(row, "ctas", at)


def check_moe_rows(rows: Sequence[Mapping], source: str = "results", lines: Sequence[int] | None = None) -> None:
    """Every row of a `xstage bench moe` CSV (`check_moe_row`); errors name `source` and the line (or
    the row number when `lines` is None)."""
    _check_columns(rows, "moe", source)
    for i, row in enumerate(rows):
        check_moe_row(row, _at(source, lines, i))


def check_ulysses_row(row: Mapping, at: str) -> None:
    """One row of a `xstage bench ulysses` CSV (see module docstring); `at` says where it is."""
    variant = cell_text(row, "variant", at)
    if variant not in ULYSSES_VARIANTS:
        try:
            parse_exchange(variant)
        except InputError:
            raise InputError(f"{at}, column variant: {variant!r} is neither a Ulysses benchmark variant "
                             f"({', '.join(ULYSSES_VARIANTS)}) nor an exchange spelling") from None
    sizes = {c: cell_count(row, c, at) for c in ("heads", "dim", "tokens", "P", "grid")}
    for c in ("block_m", "block_n"):
        if c in row and cell_text(row, c, at):
            cell_count(row, c, at)
    if sizes["P"] > sizes["heads"]:
        raise InputError(f"{at}, column P: {sizes['P']} ranks is more than heads={sizes['heads']}")
    failed = str(row.get("exchange_ok") or "").startswith("error")
    if not any(c in row for c in ("time_ns", "sender_ns")):
        raise InputError(f"{at}: no time column (time_ns, or sender_ns in results from before exchange=)")
    for c in ("time_ns", "sender_ns", "receiver_ns"):
        if c not in row or (failed and not cell_text(row, c, at)):
            continue  # the benchmark recorded why this variant did not run
        cell_time(row, c, at)
    for c in ("p10_ns", "p90_ns"):  # optional spread columns
        if c in row:
            cell_time(row, c, at, optional=True)
    if "tflops" in row:
        cell_number(row, "tflops", at, optional=True, positive=True)


def check_ulysses_rows(rows: Sequence[Mapping], source: str = "Ulysses results",
                       lines: Sequence[int] | None = None) -> None:
    """Every row of a `xstage bench ulysses` CSV (`check_ulysses_row`)."""
    _check_columns(rows, "ulysses", source)
    for i, row in enumerate(rows):
        check_ulysses_row(row, _at(source, lines, i))


__all__ = ["BASELINES", "MOE_COLUMNS", "PATHS", "ULYSSES_COLUMNS", "ULYSSES_VARIANTS", "Results",
           "check_moe_row", "check_moe_rows", "check_ulysses_row", "check_ulysses_rows", "load_results"]
