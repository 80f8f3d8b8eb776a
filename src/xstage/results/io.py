"""Resumable long-format CSV results: one row per measurement, environment columns on every row.

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
import math
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

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


def read_rows(path: str | os.PathLike) -> list[dict[str, str]]:
    """All complete rows of a result CSV as dicts of strings (a torn last line is ignored)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"results file {path}: does not exist")
    with path.open(newline="") as f:
        lines = f.read().splitlines(keepends=True)
    if not lines:
        return []
    if not lines[-1].endswith("\n"):
        lines = lines[:-1]
    reader = csv.DictReader(lines)
    if reader.fieldnames is None:
        return []
    rows = []
    for i, row in enumerate(reader, start=2):
        if None in row or any(v is None for v in row.values()):
            raise InputError(f"results file {path}, line {i}: expected {len(reader.fieldnames)} fields")
        rows.append(row)
    return rows


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
        if self.path.exists() and self.path.stat().st_size > 0:
            self._resume()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w", newline="") as f:
                csv.writer(f).writerow(self.columns)

    def _resume(self) -> None:
        with self.path.open(newline="") as f:
            header = next(csv.reader(f), None)
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
        rows = read_rows(self.path)
        with self.path.open("rb") as f:
            raw = f.read()
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
        return read_rows(self.path)


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
