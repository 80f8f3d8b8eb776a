"""Malformed copies of the committed data files, for tests of what every loader refuses.

Each function takes the bytes or text of a real file (`committed(...)`) and returns a damaged copy;
`write(path, data)` puts it in a test's tmp_path.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOE_CSV = ROOT / "benchmarks/results/h200-moe-paced/moe.csv"
ULYSSES_CSV = ROOT / "benchmarks/results/h200-ulysses-calibration/ulysses.csv"
CORE_CSV = ROOT / "benchmarks/results/h200-ulysses/core.csv"
REFERENCE_CSV = ROOT / "src/xstage/data/h200-hostlink-probe.csv"
PROBE_SUMMARY_CSV = ROOT / "src/xstage/data/h200-host-probe-summary.csv"
CALIBRATION_CSV = ROOT / "src/xstage/data/h200-ulysses-calibration.csv"
PROFILE_JSON = ROOT / "src/xstage/data/h200-host-profile.json"
COSTS_JSON = ROOT / "src/xstage/data/h200-moe-task-costs.json"


def committed(path: Path, rows: int | None = None) -> str:
    """The text of a committed file; with `rows`, its header and first `rows` rows only."""
    text = path.read_text()
    if rows is None:
        return text
    return "".join(text.splitlines(keepends=True)[: rows + 1])


def write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def compressed(text: str, how: str) -> bytes:
    """`text` compressed as `gzip`, `bz2`, `xz` or `zip` (an archive holding it)."""
    data = text.encode()
    if how == "gzip":
        return gzip.compress(data)
    if how == "bz2":
        return bz2.compress(data)
    if how == "xz":
        return lzma.compress(data)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("data.csv", data)
    return buf.getvalue()


COMPRESSIONS = ("gzip", "bz2", "xz", "zip")


def with_bom(text: str) -> bytes:
    return b"\xef\xbb\xbf" + text.encode()


def latin1(text: str, line: int = 3) -> bytes:
    """`text` with a Latin-1 byte (not UTF-8) at the start of line `line` (1-based)."""
    lines = text.splitlines(keepends=True)
    lines[line - 1] = "\xe9" + lines[line - 1]
    return "".join(lines).encode("latin-1")


def duplicate_column(text: str, column: str, value: str = "1") -> str:
    """`text` with a second `column` appended to the header, `value` in every row: a CSV reader that
    keeps the last copy reads `value` instead of the measurement."""
    lines = text.splitlines()
    return "\n".join([lines[0] + f",{column}"] + [line + f",{value}" for line in lines[1:]]) + "\n"


def header_only(text: str) -> str:
    return text.splitlines(keepends=True)[0]


def with_value(text: str, column: str, value: str, row: int = 1) -> str:
    """`text` with `column` of data row `row` (1-based) set to `value` (no quoted commas in these files)."""
    lines = text.splitlines(keepends=True)
    header = lines[0].rstrip("\r\n").split(",")
    cells = lines[row].rstrip("\r\n").split(",")
    cells[header.index(column)] = value
    lines[row] = ",".join(cells) + "\n"
    return "".join(lines)


NON_FINITE = ("nan", "inf", "-inf")
