"""Resumable long-format CSV results: one row per measurement, environment columns on every row.

A grid run opens a `ResultWriter` on its CSV with the columns that identify a configuration
(`key_columns`). Rows whose key is already in the file are skipped by the caller (`writer.done(key)`),
so a grid can span several short runs; each row is flushed as soon as it is measured, so a run that is
killed loses at most the row in progress (a torn last line is dropped on the next open).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from xstage.env import environment
from xstage.errors import InputError

ENV_COLUMNS = ("gpu", "driver", "torch", "triton", "git_commit", "date")


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

    Example:
        w = ResultWriter("out/moe.csv", columns=["shape", "tokens", "schedule", "time_ns"],
                         key_columns=["shape", "tokens", "schedule"])
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
    ):
        missing = [c for c in key_columns if c not in columns]
        if missing:
            raise InputError(f"key_columns {missing} are not among columns")
        self.path = Path(path)
        self.env = dict(environment() if env is None else env)
        self.columns = list(columns) + [c for c in ENV_COLUMNS if c not in columns]
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
            raise InputError(
                f"results file {self.path}: its columns {header} differ from this run's {self.columns}; "
                "write to a new file"
            )
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
