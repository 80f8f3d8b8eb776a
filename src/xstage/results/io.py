"""Reading every input file, and resumable long-format CSV results.

Reading (`read_table` / `read_rows` for CSV, `read_json`, both through `read_text` and `read_bytes`):
the checks every loader needs, in one place, each refusal one `InputError` line naming the file (and
the line and column): a missing file, a folder, a FIFO or a device, compressed data, text that is not
UTF-8 (a UTF-8 byte-order mark is accepted), unnamed or repeated CSV columns, column names holding line
ends or control characters, rows of the wrong width,
a CSV of another kind than the loader reads (`CSV_KINDS`: named for the kind it looks like), the
loader's required columns, and a file without rows. `cell_time`, `cell_count`, `cell_number` read
one value of a row: NaN, infinities, negative times and sizes are refused, naming line and column.

Writing: results are one row per measurement, with environment columns on every row.

A grid run opens a `ResultWriter` on its CSV with the columns that identify a configuration
(`key_columns`). Rows whose key is already in the file are skipped by the caller (`writer.done(key)`),
so a grid can span several short runs; each row is flushed as soon as it is measured, so a run that is
killed loses at most the row in progress (a torn last line is dropped on the next open).

Provenance (`ENV_COLUMNS`) follows the caller's columns. A file written before a provenance column
existed (e.g. without `src_hash`) keeps its header: a run resuming it writes the file's own columns and
leaves the new one out, so old and new rows of one file stay one table.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from xstage.bounds import INT64_MAX
from xstage.env import UNKNOWN_COMMITS, environment
from xstage.errors import InputError

ENV_COLUMNS = ("gpu", "driver", "torch", "triton", "git_commit", "src_hash", "date")


def _key(row: Mapping[str, object], columns: Sequence[str]) -> tuple[str, ...]:
    return tuple(_fmt(row.get(c, "")) for c in columns)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value) or abs(value) >= 1e16:
            return repr(value)  # 'nan' / 'inf' read back through float() like any other value
        return str(int(value))
    return str(value)


# ---- reading: one path for every file a command reads --------------------------------------------

# Leading bytes of compressed files: such a file named `.csv` or `.json` is refused by name.
_COMPRESSED = ((b"\x1f\x8b", "gzip-compressed", "gunzip"), (b"\xfd7zXZ\x00", "xz-compressed", "unxz"),
               (b"PK\x03\x04", "a zip archive", "unzip"), (b"PK\x05\x06", "a zip archive", "unzip"),
               (b"(\xb5/\xfd", "zstd-compressed", "unzstd"))
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def read_bytes(path: str | os.PathLike, what: str = "file") -> bytes:
    """The bytes of the regular file `path`. Refused with one `InputError` naming `what` and the path:
    what is not a path (a str or os.PathLike without NUL characters), a missing file, a folder, a FIFO,
    a socket or a device (said which; a FIFO is opened without blocking and never read), a file that
    cannot be read."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise InputError(f"{what} {path!r}: not a path (a str or os.PathLike), got {type(path).__name__}")
    p = Path(path)
    label = f"{what} {p}"
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise InputError(f"{label}: does not exist") from None
    except NotADirectoryError:
        raise InputError(f"{label}: does not exist (a folder on its path is a file)") from None
    except OSError as exc:
        raise InputError(f"{label}: cannot be read ({exc.strerror or exc})") from None
    except ValueError:  # os.stat: "embedded null byte"
        raise InputError(f"{what} {str(p)!r}: not a path (it holds a NUL character)") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{label}: is {_file_type(mode)}, not a regular file; give a file")
    try:
        # O_NONBLOCK: should the path turn into a FIFO after the check above, opening it does not wait
        # for a writer (fstat below then refuses it).
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise InputError(f"{label}: is {_file_type(mode)}, not a regular file; give a file")
            return f.read()
    except OSError as exc:
        raise InputError(f"{label}: cannot be read ({exc.strerror or exc})") from None


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """The text of `path` (`read_bytes`), decoded as UTF-8; a UTF-8 byte-order mark is accepted and
    dropped. Refused by name: compressed files (gzip, bzip2, xz, zip, zstd), UTF-16 text, binary data
    (NUL bytes) and bytes that are not UTF-8 (the line is named)."""
    data = read_bytes(path, what)
    label = f"{what} {Path(path)}"
    for magic, name, tool in _COMPRESSED:
        if data.startswith(magic):
            raise InputError(f"{label}: is {name}; decompress it first ({tool})")
    if data.startswith(b"BZh") and data[3:4].isdigit():
        raise InputError(f"{label}: is bzip2-compressed; decompress it first (bunzip2)")
    if data.startswith(_UTF16_BOMS):
        raise InputError(f"{label}: is UTF-16 text; save it as UTF-8")
    if b"\x00" in data:
        line = data.count(b"\n", 0, data.index(b"\x00")) + 1
        raise InputError(f"{label}, line {line}: holds NUL bytes (binary data), not UTF-8 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{label}, line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); "
                         "save it as UTF-8") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):  # 1e999: valid JSON syntax, but past the largest float it reads as inf
        raise ValueError(f"{text} is past the largest float (it would read as {v})")
    return v


def read_json(path: str | os.PathLike, what: str = "JSON file", *, allow_nonfinite: bool = False):
    """The JSON document in `path`, read through `read_text` (the same refusals). `NaN` and
    `Infinity` are not standard JSON and are refused unless `allow_nonfinite` (files whose writer
    allowed them), and so are numbers past the largest float (`1e999`, which would read as inf),
    and nesting too deep to decode. Errors name the file, line and column."""
    text = read_text(path, what)
    label = f"{what} {Path(path)}"
    if not text.strip():
        raise InputError(f"{label}: is empty; expected a JSON document")
    try:
        if allow_nonfinite:
            return json.loads(text)
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise InputError(f"{label}, line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg})") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise InputError(f"{label}: arrays or objects nested too deep to read (past Python's recursion limit); "
                         "no xstage file nests more than a few levels") from None
    except ValueError as exc:
        raise InputError(f"{label}: {exc}; write null or a finite number") from None


@dataclass(frozen=True)
class CsvKind:
    """A kind of CSV xstage reads: what people call it, what writes it, and the columns that tell it
    from the other kinds (a file whose header has all of `signature` looks like this kind)."""

    name: str
    made_by: str
    signature: tuple[str, ...]

    def a(self) -> str:
        return f"{_article(self.name)} {self.name} CSV (from {self.made_by})"


def _article(name: str) -> str:
    return "an" if name[0] in "aeio" else "a"  # a MoE, a Ulysses (said "you"), an attention-core


# Every kind, so that a file of one kind given where another is read is named for what it is.
CSV_KINDS = {
    "moe": CsvKind("MoE results", "`xstage bench moe`", ("shape", "H", "I", "E", "K", "ep", "variant")),
    "moe-calls": CsvKind("MoE call comparison", "`xstage bench moe-calls`", ("model", "side", "call_ns")),
    "experts": CsvKind("experts backend comparison", "`xstage bench experts`", ("arch", "routing", "side", "call_ns")),
    "ulysses": CsvKind("Ulysses results", "`xstage bench ulysses`", ("heads", "dim", "tokens", "P", "variant")),
    "ulysses-core": CsvKind("attention-core results", "`xstage bench ulysses --core`",
                            ("impl", "layout", "ratio_vs_cudnn")),
    "trace": CsvKind("burst trace", "a kernel's per-burst timers (`xstage model score`'s input)",
                     ("cta", "start_ns", "issue_ns")),
    "probe-long": CsvKind("probe measurements", "`xstage probe`, raw/*.csv", ("cta", "issue_ns", "peer_mode")),
    "probe-summary": CsvKind("probe summary", "`xstage probe`, summary.csv", ("issue_median_ns",)),
    "probe-reference": CsvKind("reference probe", "the CUDA reference probe, h200-hostlink-probe.csv",
                               ("dst", "nblocks", "issue_first")),
    "moe-tiles": CsvKind("MoE tile timings", "`xstage plan calibrate`, moe-tiles.csv",
                         ("kind", "block", "work", "median_ns")),
    "moe-validation": CsvKind("MoE validation", "`xstage plan validate`, validation.csv",
                              ("measured_ns", "predicted_ns", "rel_error")),
    "ulysses-validation": CsvKind("Ulysses validation", "`xstage plan validate`, validation-ulysses.csv",
                                  ("exchange", "overhead_error")),
}


@dataclass(frozen=True)
class Table:
    """The rows of one CSV (dicts of strings), its `kind` (a key of `CSV_KINDS`, None when not asked),
    its column names and each row's line in the file."""

    path: Path
    kind: str | None
    columns: list[str]
    rows: list[dict[str, str]]
    lines: list[int]

    def where(self, i: int) -> str:
        return f"{self.path}, line {self.lines[i]}"


def _kind_of(header: list[str], kinds: Mapping[str, Sequence[str]], label: str) -> str:
    """The kind among `kinds` (kind -> required columns) that `header` is: the first whose signature
    it has (the only one, when one is asked and no other kind fits better). Otherwise one line
    saying which kind the file looks like, or which required columns it lacks."""
    have = set(header)

    def looks(k: str) -> bool:
        return set(CSV_KINDS[k].signature) <= have

    kind = next((k for k in kinds if looks(k)), None)
    if kind is None:
        names = [CSV_KINDS[k].name for k in kinds]
        wanted = (CSV_KINDS[next(iter(kinds))].a() if len(kinds) == 1
                  else f"{_article(names[0])} {', '.join(names[:-1])} or {names[-1]} CSV")
        others = [k for k in CSV_KINDS if k not in kinds and looks(k)]
        if others:
            raise InputError(f"{label}: looks like {CSV_KINDS[others[0]].a()}, not {wanted}")
        if len(kinds) > 1:
            shown = ", ".join(header[:8]) + (", ..." if len(header) > 8 else "")
            known = ", ".join(f"{CSV_KINDS[k].name} ({', '.join(CSV_KINDS[k].signature)}, ...)" for k in kinds)
            raise InputError(f"{label}: its columns ({shown}) match none of the kinds read here: {known}")
        kind = next(iter(kinds))
    missing = [c for c in kinds[kind] if c not in have]
    if missing:
        raise InputError(f"{label}: no column(s) {', '.join(missing)}; {CSV_KINDS[kind].a()} has "
                         f"{', '.join(kinds[kind])}")
    return kind


def read_table(path: str | os.PathLike, kinds: Mapping[str, Sequence[str]] | None = None, *,
               what: str = "results file", allow_empty: bool = False) -> Table:
    """Every complete row of the CSV `path` (a torn last line, from a run killed mid-row, is ignored).

    The checks every CSV reader needs, in one place; each refusal is one `InputError` naming `what`,
    the file and, where it applies, the line and column: the file itself (`read_text`: missing, not a
    regular file, compressed, not UTF-8; a byte-order mark is dropped), unnamed or repeated column
    names, rows with another number of fields than the header, the kind (`kinds` maps each kind the
    caller reads, a key of `CSV_KINDS`, to the columns it requires; a file of another kind is named
    for what it looks like), and a file without rows (unless `allow_empty`)."""
    text = read_text(path, what)
    p = Path(path)
    label = f"{what} {p}"
    if not text.strip():
        raise InputError(f"{label}: is empty (no header, no rows)")
    complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1] or text
    reader = csv.reader(io.StringIO(complete, newline=""))
    try:
        header = next(reader, None) or []
        body = [(reader.line_num, r) for r in reader if r]
    except csv.Error as exc:
        raise InputError(f"{label}, line {reader.line_num}: not CSV ({exc})") from None
    columns = [c.strip() for c in header]
    for i, c in enumerate(columns):
        if not c:
            raise InputError(f"{label}, line 1: column {i + 1} of the header has no name")
        if not c.isprintable():  # a line end in a name: a quote left open swallowed the lines after it
            raise InputError(f"{label}, line 1: column {i + 1} of the header, {c[:40]!r}"
                             f"{'...' if len(c) > 40 else ''}, holds a line end or control character"
                             + (" (a quote left open?)" if "\n" in c or "\r" in c else ""))
        if c in columns[:i]:
            raise InputError(f"{label}, line 1: column {c!r} appears twice (columns {columns.index(c) + 1} and "
                             f"{i + 1}); each column must appear once")
    kind = _kind_of(columns, kinds, label) if kinds else None
    rows, lines = [], []
    for line, r in body:
        if len(r) != len(columns):
            raise InputError(f"{label}, line {line}: {len(r)} fields, the header has {len(columns)}")
        rows.append(dict(zip(columns, r)))
        lines.append(line)
    if not rows and not allow_empty:
        torn = "" if text.endswith("\n") or complete is text else " (its last line has no line end: a torn row)"
        raise InputError(f"{label}: a header but no rows{torn}")
    return Table(p, kind, columns, rows, lines)


def read_rows(path: str | os.PathLike, kinds: Mapping[str, Sequence[str]] | None = None, *,
              what: str = "results file", allow_empty: bool = False) -> list[dict[str, str]]:
    """The rows of `read_table` (same checks): dicts of strings keyed by column name."""
    return read_table(path, kinds, what=what, allow_empty=allow_empty).rows


# ---- cells: numbers read from rows ------------------------------------------------------------------

def cell_text(row: Mapping, column: str, at: str) -> str:
    """The stripped text of `row[column]` ('' when empty); `at` says where the row is."""
    if column not in row:
        raise InputError(f"{at}: no column {column}")
    v = row[column]
    return "" if v is None else str(v).strip()


def _cell_number(row: Mapping, column: str, at: str, noun: str, optional: bool) -> float | None:
    text = cell_text(row, column, at)
    if not text:
        if optional:
            return None
        raise InputError(f"{at}, column {column}: empty; a {noun} is needed")
    try:
        v = float(text)
    except ValueError:
        raise InputError(f"{at}, column {column}: {text!r} is not a number"
                         + ("" if noun == "number" else f" (a {noun})")) from None
    if not math.isfinite(v):
        raise InputError(f"{at}, column {column}: {text}: must be a finite {noun}")
    return v


def cell_time(row: Mapping, column: str, at: str, *, optional: bool = False, zero: bool = False) -> float | None:
    """`row[column]` as a time in ns: a finite number > 0 (>= 0 with `zero`). Empty: None if `optional`."""
    v = _cell_number(row, column, at, "time in ns", optional)
    if v is not None and (v < 0 or (v == 0 and not zero)):
        raise InputError(f"{at}, column {column}: {cell_text(row, column, at)}: a time must be "
                         f"{'>= 0' if zero else '> 0'} ns")
    return v


def cell_number(row: Mapping, column: str, at: str, *, optional: bool = False, positive: bool = False
                ) -> float | None:
    """`row[column]` as a finite number (> 0 with `positive`). Empty: None if `optional`."""
    v = _cell_number(row, column, at, "number", optional)
    if positive and v is not None and v <= 0:
        raise InputError(f"{at}, column {column}: {cell_text(row, column, at)}: must be > 0")
    return v


def cell_count(row: Mapping, column: str, at: str, minimum: int = 1) -> int:
    """`row[column]` as an integer in `minimum..INT64_MAX` (a size or a count, as the code holds it)."""
    text = cell_text(row, column, at)
    try:
        v = int(text)
    except ValueError:
        raise InputError(f"{at}, column {column}: {text[:40]!r}{'...' if len(text) > 40 else ''} is not an "
                         "integer") from None
    if v < minimum:
        need = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InputError(f"{at}, column {column}: {text}: must be {need}")
    if v > INT64_MAX:
        raise InputError(f"{at}, column {column}: {text[:20]}... ({len(text)} digits): must be at most {INT64_MAX}")
    return v


class ResultWriter:
    """Append-only CSV of result rows with fixed columns; `done(key)` tells what is already measured.

    The provenance columns `ENV_COLUMNS` are appended to `columns`, except where `columns` already
    names one of them: then the caller's layout is the file's (a fixed schema such as the probe's long
    format) and none is added. `env` replaces `xstage.env.environment()` (tests, or ranks that share
    rank 0's). `require_commit=True` (measurement runs) refuses, before any file is touched, to write
    rows whose `git_commit` is unknown: such rows could not be traced to the code that made them.

    Example:
        w = ResultWriter("out/moe.csv", columns=["shape", "tokens", "schedule", "time_ns"],
                         key_columns=["shape", "tokens", "schedule"], require_commit=True)
        for cfg in grid:
            if not w.done(cfg):
                w.write({**cfg, "time_ns": measure(cfg)})
    """

    def __init__(
        self,
        path: str | os.PathLike,
        columns: Sequence[str],
        key_columns: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        require_commit: bool = False,
    ):
        missing = [c for c in key_columns if c not in columns]
        if missing:
            raise InputError(f"key_columns {missing} are not among columns")
        self.path = Path(path)
        self.env = dict(environment() if env is None else env)
        if require_commit and str(self.env.get("git_commit", "")).strip() in UNKNOWN_COMMITS:
            raise InputError(f"results file {self.path}: the source commit is unknown; run inside a git checkout "
                             "or set XSTAGE_GIT_COMMIT (e.g. XSTAGE_GIT_COMMIT=$(git rev-parse --short=12 HEAD))")
        own_env = any(c in ENV_COLUMNS for c in columns)
        self.columns = list(columns) + ([] if own_env else list(ENV_COLUMNS))
        self.key_columns = list(key_columns)
        self._keys: set[tuple[str, ...]] = set()
        if self.path.exists() and not self.path.is_file():
            read_bytes(self.path)  # refuses a folder, FIFO or device by name, before opening it to write
        if self.path.exists() and self.path.stat().st_size > 0:
            self._resume()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w", newline="") as f:
                csv.writer(f).writerow(self.columns)

    def _resume(self) -> None:
        table = read_table(self.path, allow_empty=True)
        header = table.columns
        if header != self.columns:
            absent = [c for c in self.columns if c not in (header or [])]
            if not header or any(c not in ENV_COLUMNS for c in absent) or header != [
                    c for c in self.columns if c not in absent]:
                raise InputError(
                    f"results file {self.path}: its columns {header} differ from this run's {self.columns}; "
                    "write to a new file"
                )
            # An older file without some provenance columns: keep its header, leave those out.
            self.columns = list(header)
        rows = table.rows
        raw = read_bytes(self.path)
        if raw and not raw.endswith(b"\n"):
            # A killed run left a torn last row: drop it so appends start on a fresh line.
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_bytes(raw[: raw.rfind(b"\n") + 1])
            os.replace(tmp, self.path)
        self._keys = {_key(r, self.key_columns) for r in rows}

    def done(self, key: Mapping[str, object]) -> bool:
        return _key(key, self.key_columns) in self._keys

    def write(self, row: Mapping[str, object]) -> None:
        full = {**self.env, **row}
        unknown = [c for c in row if c not in self.columns]
        if unknown:
            raise InputError(f"row has columns {unknown} that the results file {self.path} does not have")
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerow([_fmt(full.get(c, "")) for c in self.columns])
            f.flush()
        self._keys.add(_key(full, self.key_columns))

    def write_many(self, rows: Iterable[Mapping[str, object]]) -> None:
        for row in rows:
            self.write(row)

    def rows(self) -> list[dict[str, str]]:
        return read_rows(self.path, allow_empty=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(path, newline: str | None = None, binary: bool = False):
    """A text file (a binary one with `binary=True`) that replaces `path` only when the block completes:
    a failure leaves `path` untouched.

    The file gets the permissions a plain `open` would give it (0666 less the umask), not the private
    0600 of the temporary file it is written through."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", newline=newline) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_csv_atomic(path, rows: list[dict], columns: list[str]) -> None:
    """Write rows to `path` through a temporary file and a rename (`atomic_open`)."""
    with atomic_open(path, newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
