"""Measurement files of store-path probes: the long format, its summary and the reference format.

Problem: probes write one row per CTA per burst; fitting and plots want, per launch and burst index,
the CTA median (and spread) of the issue time; the independent H200 reference run comes per launch
in clock cycles. This module reads all three into one representation (`Observations`) and writes
the summary. Files are read by `xstage.results.io.read_table` (the checks every input CSV gets:
file type, compression, encoding, repeated columns, the format told from the header, no rows); every
malformed value is an `InputError` naming the file, line and column. Infinities are refused in every
column; NaN only where the schema says so.

Long format (`LONG_COLUMNS`, what `xstage.probe` writes), one row per CTA per burst:

    path          hbm | host | peer: where the stores go
    peer_mode     none | one | all: which peers a CTA stores to (none for hbm/host)
    n_sm          issuing SMs (>= 1)
    ctas_per_sm   CTAs per SM (>= 1); an SM's burst is ctas_per_sm * burst_bytes
    warps         warps per CTA (>= 1)
    vector_bytes  bytes per store instruction per thread (> 0)
    burst_bytes   bytes one CTA stores per burst (> 0)
    gap_iters     requested compute-gap iterations (>= 0)
    gap_ns        measured gap before this burst (ns); NaN for burst 0
    launch        integer id of the kernel launch (repeats and configurations differ)
    cta           CTA index within the launch
    burst_index   0-based burst index within the CTA
    issue_ns      timer after the burst's last store minus timer before its first (ns, > 0)
    completion_ns burst start to remote-visible completion (ns); NaN if not recorded
    gpu, driver, torch, triton, git_commit, date   provenance

Summary format (`SUMMARY_COLUMNS`), one row per launch and burst index (or span of indices):
the configuration columns, `gap_ns` (launch median), `n_bursts`, `burst_index`, `burst_last`
(equal to `burst_index` except for a pooled span such as the reference's steady state), `n_cta`,
`issue_median_ns`, `issue_p10_ns`, `issue_p90_ns`, `issue_max_ns`, `completion_median_ns`, and
the provenance columns.

Reference format (`xstage/data/h200-hostlink-probe.csv`, an independent CUDA probe): per
launch, `clock64` cycles at 1.98 GHz: `issue_first` (burst 0), `issue_2` (burst 1), `issue_steady`
(median over bursts 12..23), `gap_cycles`; 24 bursts per CTA.

Example:
    >>> from xstage.model.data import load_reference_data
    >>> obs = load_reference_data()
    >>> len(obs.configs("host"))
    20
"""

from __future__ import annotations

import dataclasses
import math
from importlib import resources
from pathlib import Path

import numpy as np

from xstage.bounds import INT64_MAX
from xstage.errors import InputError
from xstage.results.io import read_table

PATHS = ("hbm", "host", "peer")
PEER_MODES = ("none", "one", "all")
ENV_COLUMNS = ["gpu", "driver", "torch", "triton", "git_commit", "date"]
CONFIG_COLUMNS = ["path", "peer_mode", "n_sm", "ctas_per_sm", "warps", "vector_bytes", "burst_bytes",
                  "gap_iters"]
LONG_COLUMNS = CONFIG_COLUMNS + ["gap_ns", "launch", "cta", "burst_index", "issue_ns",
                                 "completion_ns"] + ENV_COLUMNS
SUMMARY_COLUMNS = CONFIG_COLUMNS + ["gap_ns", "launch", "n_bursts", "burst_index", "burst_last", "n_cta",
                                    "issue_median_ns", "issue_p10_ns", "issue_p90_ns", "issue_max_ns",
                                    "completion_median_ns"] + ENV_COLUMNS
REFERENCE_COLUMNS = ["dst", "nblocks", "burst_bytes", "gap_iters", "issue_first", "issue_2", "issue_steady",
                     "issue_max", "gap_cycles", "kernel_ms", "agg_GBps"]
REFERENCE_CLOCK_HZ = 1.98e9
REFERENCE_BURSTS = 24
REFERENCE_STEADY = (12, 23)

SCHEMA = {
    "path": "hbm | host | peer", "peer_mode": "none | one | all", "n_sm": "issuing SMs, int >= 1",
    "ctas_per_sm": "CTAs per SM, int >= 1", "warps": "warps per CTA, int >= 1",
    "vector_bytes": "bytes per store per thread, int > 0", "burst_bytes": "bytes per CTA per burst, int > 0",
    "gap_iters": "requested gap iterations, int >= 0", "gap_ns": "measured gap before the burst, ns (NaN: burst 0)",
    "launch": "launch id, int", "cta": "CTA index, int >= 0", "burst_index": "burst index, int >= 0",
    "issue_ns": "issue time, ns > 0", "completion_ns": "start to remote-visible completion, ns (NaN: none)",
    "gpu": "GPU name", "driver": "driver version", "torch": "torch version", "triton": "triton version",
    "git_commit": "xstage commit", "date": "ISO date of the run",
}

# Cell texts that mean "not recorded" (NaN where the schema allows it), whatever their case and spaces.
NOT_RECORDED = ("", "nan", "none")


def as_float(raw) -> float:
    """A checked cell (`_num`) as a float: NaN for the texts of `NOT_RECORDED`."""
    return math.nan if raw is None or str(raw).strip().lower() in NOT_RECORDED else float(raw)


_INT_COLS = {"n_sm": 1, "ctas_per_sm": 1, "warps": 1, "vector_bytes": 1, "burst_bytes": 1, "gap_iters": 0,
             "cta": 0, "burst_index": 0}


@dataclasses.dataclass
class Observations:
    """CTA-median issue times per launch and burst span, with their configuration (numpy columns).

    A configuration is (path, n_sm, burst_bytes); its launches differ in gap and repeat.
    """

    path: np.ndarray
    n_sm: np.ndarray
    ctas_per_sm: np.ndarray
    burst_bytes: np.ndarray
    gap_ns: np.ndarray
    n_bursts: np.ndarray
    launch: np.ndarray
    burst_lo: np.ndarray
    burst_hi: np.ndarray
    n_cta: np.ndarray
    issue_med: np.ndarray
    issue_p10: np.ndarray
    issue_p90: np.ndarray
    issue_max: np.ndarray
    completion_med: np.ndarray
    env: dict
    source: str = ""

    def __len__(self) -> int:
        return len(self.issue_med)

    def config_keys(self) -> list[tuple[str, int, int]]:
        return [(str(p), int(n), int(b)) for p, n, b in zip(self.path, self.n_sm, self.burst_bytes)]

    def configs(self, path: str | None = None) -> list[tuple[str, int, int]]:
        """Distinct (path, n_sm, burst_bytes), sorted; only those of `path` if given."""
        return sorted({k for k in self.config_keys() if path is None or k[0] == path})

    def select(self, mask) -> Observations:
        mask = np.asarray(mask)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Observations(**{k: (v[mask] if isinstance(v, np.ndarray) else v) for k, v in fields.items()})

    def for_path(self, path: str) -> Observations:
        if path not in set(self.path.tolist()):
            raise InputError(f"path: no rows for path {path!r}; the data has {sorted(set(self.path.tolist()))}")
        return self.select(self.path == path)

    def launches(self) -> list[np.ndarray]:
        """Row indices of each launch (rows that share one simulated run)."""
        keys = {}
        for i, k in enumerate(zip(self.path, self.n_sm, self.ctas_per_sm, self.burst_bytes, self.gap_ns,
                                  self.n_bursts, self.launch)):
            keys.setdefault(k, []).append(i)
        return [np.array(v) for v in keys.values()]

    def summary_rows(self) -> list[dict]:
        rows = []
        for i in range(len(self)):
            rows.append({
                "path": self.path[i], "peer_mode": "none", "n_sm": int(self.n_sm[i]),
                "ctas_per_sm": int(self.ctas_per_sm[i]), "warps": "", "vector_bytes": "",
                "burst_bytes": int(self.burst_bytes[i]), "gap_iters": "", "gap_ns": self.gap_ns[i],
                "launch": int(self.launch[i]), "n_bursts": int(self.n_bursts[i]),
                "burst_index": int(self.burst_lo[i]), "burst_last": int(self.burst_hi[i]),
                "n_cta": int(self.n_cta[i]), "issue_median_ns": self.issue_med[i],
                "issue_p10_ns": self.issue_p10[i], "issue_p90_ns": self.issue_p90[i],
                "issue_max_ns": self.issue_max[i], "completion_median_ns": self.completion_med[i],
                **{k: self.env.get(k, "") for k in ENV_COLUMNS},
            })
        return rows


def _where(source: str, lines, n: int) -> str:
    return f"{source}, line {lines[n]}" if lines is not None else f"{source}, row {n + 1}"


def _num(row: dict, col: str, where: str, allow_nan: bool = False) -> float:
    """A finite number (NaN, or an empty cell, where `allow_nan`); infinities are never data here."""
    raw = row.get(col)
    if raw is None:
        raise InputError(f"{where}: missing column {col!r}")
    if isinstance(raw, str) and raw.strip().lower() in NOT_RECORDED:
        if allow_nan:
            return math.nan
        if raw.strip():
            raise InputError(f"{where}: column {col!r} must be a number, got NaN")
        raise InputError(f"{where}: column {col!r} is empty; it must be a number")
    try:
        v = float(raw)
    except (TypeError, ValueError):
        raise InputError(f"{where}: column {col!r} must be a number, got {raw!r}") from None
    if math.isnan(v) and not allow_nan:
        raise InputError(f"{where}: column {col!r} must be a number, got NaN")
    if math.isinf(v):
        raise InputError(f"{where}: column {col!r} must be finite, got {raw!r}")
    return v


def _check_int(row: dict, col: str, where: str, lo: int | None = None) -> int:
    v = _num(row, col, where)
    lo = _INT_COLS[col] if lo is None else lo
    if v != int(v) or v < lo:
        raise InputError(f"{where}: column {col!r} must be an integer >= {lo}, got {row[col]!r}")
    if v > INT64_MAX:  # counts and sizes are held in int64
        raise InputError(f"{where}: column {col!r} must be at most {INT64_MAX}, got {str(row[col])[:24]!r}...")
    return int(v)


def _rows_from(df_or_rows) -> list[dict]:
    if hasattr(df_or_rows, "to_dict") and hasattr(df_or_rows, "columns"):
        return df_or_rows.to_dict("records")
    rows = list(df_or_rows)
    if rows and not isinstance(rows[0], dict):
        raise InputError("rows must be dicts keyed by column name")
    return rows


def validate_long(df_or_rows, source: str = "long data", lines=None) -> list[dict]:
    """Check long-format rows (dicts or a DataFrame) against `SCHEMA`; returns typed rows. Errors name
    `source` and the row's line in it (`lines`, from `xstage.results.io.read_table`) or its number."""
    rows = _rows_from(df_or_rows)
    if not rows:
        raise InputError(f"{source}: no rows")
    missing = [c for c in LONG_COLUMNS if c not in rows[0]]
    if missing:
        raise InputError(f"{source}: missing column(s) {missing}; required: {LONG_COLUMNS}")
    out = []
    for n, row in enumerate(rows):
        where = _where(source, lines, n)
        if row["path"] not in PATHS:
            raise InputError(f"{where}: column 'path' must be one of {PATHS}, got {row['path']!r}")
        if row["peer_mode"] not in PEER_MODES:
            raise InputError(f"{where}: column 'peer_mode' must be one of {PEER_MODES}, got {row['peer_mode']!r}")
        typed = {c: row[c] for c in ENV_COLUMNS}
        typed.update(path=row["path"], peer_mode=row["peer_mode"])
        for c in _INT_COLS:
            typed[c] = _check_int(row, c, where)
        launch = _num(row, "launch", where)
        if launch != int(launch):
            raise InputError(f"{where}: column 'launch' must be an integer, got {row['launch']!r}")
        typed["launch"] = int(launch)
        typed["issue_ns"] = _num(row, "issue_ns", where)
        if not (typed["issue_ns"] > 0 and math.isfinite(typed["issue_ns"])):
            raise InputError(f"{where}: column 'issue_ns' must be a finite time > 0 ns, got {row['issue_ns']!r}")
        for c in ("gap_ns", "completion_ns"):
            typed[c] = _num(row, c, where, allow_nan=True)
            if typed[c] < 0:
                raise InputError(f"{where}: column {c!r} must be >= 0 ns or NaN, got {row[c]!r}")
        out.append(typed)
    return out


def summarise(rows, source: str = "long data", lines=None) -> list[dict]:
    """Summary rows (`SUMMARY_COLUMNS`) from long rows: per launch and burst index, CTA statistics
    (`source` and `lines` name where a refused row is, as in `validate_long`)."""
    typed = validate_long(rows, source, lines)
    launches: dict[int, list[dict]] = {}
    for r in typed:
        launches.setdefault(r["launch"], []).append(r)
    out = []
    for launch, rs in sorted(launches.items()):
        first = rs[0]
        for c in CONFIG_COLUMNS:
            if any(r[c] != first[c] for r in rs):
                raise InputError(f"{source}, launch {launch}: column {c!r} differs between rows of one launch")
        gaps = [r["gap_ns"] for r in rs if not math.isnan(r["gap_ns"])]
        gap = float(np.median(gaps)) if gaps else 0.0
        n_bursts = 1 + max(r["burst_index"] for r in rs)
        by_burst: dict[int, list[dict]] = {}
        for r in rs:
            by_burst.setdefault(r["burst_index"], []).append(r)
        for b, br in sorted(by_burst.items()):
            iss = np.array([r["issue_ns"] for r in br])
            cpl = np.array([r["completion_ns"] for r in br])
            cpl = cpl[~np.isnan(cpl)]
            out.append({
                **{c: first[c] for c in CONFIG_COLUMNS}, "gap_ns": gap, "launch": launch, "n_bursts": n_bursts,
                "burst_index": b, "burst_last": b, "n_cta": len(br),
                "issue_median_ns": float(np.median(iss)), "issue_p10_ns": float(np.percentile(iss, 10)),
                "issue_p90_ns": float(np.percentile(iss, 90)), "issue_max_ns": float(iss.max()),
                "completion_median_ns": float(np.median(cpl)) if len(cpl) else math.nan,
                **{c: first[c] for c in ENV_COLUMNS},
            })
    return out


SUMMARY_REQUIRED = ["path", "n_sm", "burst_bytes", "gap_ns", "launch", "n_bursts", "burst_index", "issue_median_ns"]
_SPREAD = {"issue_p10": "issue_p10_ns", "issue_p90": "issue_p90_ns", "issue_max": "issue_max_ns",
           "completion_med": "completion_median_ns"}


def _from_summary(rows: list[dict], source: str, lines=None) -> Observations:
    missing = [c for c in SUMMARY_REQUIRED if c not in rows[0]]
    if missing:
        raise InputError(f"{source}: missing column(s) {missing}; expected: {SUMMARY_COLUMNS}")
    cols: dict[str, list] = {k: [] for k in ("path", "n_sm", "ctas_per_sm", "burst_bytes", "gap_ns", "n_bursts",
                                              "launch", "burst_lo", "burst_hi", "n_cta", "issue_med",
                                              "issue_p10", "issue_p90", "issue_max", "completion_med")}
    for n, row in enumerate(rows):
        where = _where(source, lines, n)
        if row["path"] not in PATHS:
            raise InputError(f"{where}: column 'path' must be one of {PATHS}, got {row['path']!r}")
        opt = {c: (row.get(c) if row.get(c) not in (None, "") else "nan") for c in _SPREAD.values()}
        lo = _check_int(row, "burst_index", where)
        hi = _check_int({"burst_last": row.get("burst_last") or lo}, "burst_last", where, 0)
        nb = _check_int(row, "n_bursts", where, 1)
        if not lo <= hi < nb:
            raise InputError(f"{where}: need burst_index <= burst_last < n_bursts, got {lo}, {hi}, {nb}")
        vals = {
            "path": row["path"], "n_sm": _check_int(row, "n_sm", where),
            "ctas_per_sm": _check_int({"ctas_per_sm": row.get("ctas_per_sm") or 1}, "ctas_per_sm", where),
            "burst_bytes": _check_int(row, "burst_bytes", where), "gap_ns": _num(row, "gap_ns", where),
            "n_bursts": nb, "launch": _check_int(row, "launch", where, -(2**62)), "burst_lo": lo, "burst_hi": hi,
            "n_cta": _check_int({"n_cta": row.get("n_cta") or 1}, "n_cta", where, 1),
            "issue_med": _num(row, "issue_median_ns", where),
            **{k: _num(opt, c, where, True) for k, c in _SPREAD.items()},
        }
        if not vals["issue_med"] > 0:
            raise InputError(f"{where}: column 'issue_median_ns' must be a finite time > 0 ns, "
                             f"got {row['issue_median_ns']!r}")
        if vals["gap_ns"] < 0:
            raise InputError(f"{where}: column 'gap_ns' must be a time >= 0 ns, got {row['gap_ns']!r}")
        for k, c in _SPREAD.items():  # NaN: not recorded
            if vals[k] < 0 or (vals[k] == 0 and k != "completion_med"):
                raise InputError(f"{where}: column {c!r} must be a time {'>= 0' if k == 'completion_med' else '> 0'} "
                                 f"ns or empty, got {row[c]!r}")
        for k, v in vals.items():
            cols[k].append(v)
    env = {c: rows[0].get(c, "") for c in ENV_COLUMNS}
    return Observations(**{k: np.array(v) for k, v in cols.items()}, env=env, source=source)


def _from_reference(rows: list[dict], source: str, lines=None) -> Observations:
    cyc = 1e9 / REFERENCE_CLOCK_HZ
    out = []
    for n, row in enumerate(rows):
        where = _where(source, lines, n)
        if row["dst"] not in ("hbm", "host"):
            raise InputError(f"{where}: column 'dst' must be hbm or host, got {row['dst']!r}")
        nblocks = _check_int(row, "nblocks", where, 1)
        b = _check_int(row, "burst_bytes", where)
        gap = _num(row, "gap_cycles", where)
        if gap < 0:
            raise InputError(f"{where}: column 'gap_cycles' must be >= 0 cycles, got {row['gap_cycles']!r}")
        spans = [("issue_first", 0, 0), ("issue_2", 1, 1), ("issue_steady", *REFERENCE_STEADY)]
        for col, lo, hi in spans:
            v = _num(row, col, where)
            if not v > 0:
                raise InputError(f"{where}: column {col!r} must be > 0 cycles, got {row[col]!r}")
            out.append({"path": row["dst"], "n_sm": nblocks, "burst_bytes": b, "gap_ns": gap * cyc, "launch": n,
                        "n_bursts": REFERENCE_BURSTS, "burst_index": lo, "burst_last": hi, "n_cta": nblocks,
                        "issue_median_ns": v * cyc})
    obs = _from_summary(out, source)
    obs.env = {"gpu": "NVIDIA H200 (132 SMs, 1.98 GHz)", "driver": "unknown", "torch": "none (CUDA probe)",
               "triton": "none", "git_commit": "none", "date": "unknown"}
    return obs


# What `read_observations` reads, by kind (`xstage.results.io.CSV_KINDS`): the columns each requires.
DATA_KINDS = {"probe-reference": REFERENCE_COLUMNS[:9], "probe-long": LONG_COLUMNS, "probe-summary": SUMMARY_REQUIRED}


def detect_format(columns) -> str:
    cols = set(columns)
    if set(REFERENCE_COLUMNS[:9]) <= cols:
        return "reference"
    if "cta" in cols and "issue_ns" in cols:
        return "long"
    if "issue_median_ns" in cols:
        return "summary"
    raise InputError("data: unrecognised columns; need the long format (cta, issue_ns, ...), the summary "
                     "(issue_median_ns, ...) or the reference format (dst, nblocks, issue_first, ...)")


def observations_from_rows(rows: list[dict], source: str = "", lines=None) -> Observations:
    """`Observations` from rows of any of the three formats (told from their columns, `detect_format`);
    errors name `source` and each row's line (`lines`) or number."""
    if not rows:
        raise InputError(f"{source or 'data'}: no rows")
    fmt = detect_format(rows[0].keys())
    source = source or f"{fmt} data"
    if fmt == "reference":
        return _from_reference(rows, source, lines)
    if fmt == "long":
        rows, lines = summarise(rows, source, lines), None
    obs = _from_summary(rows, source, lines)
    obs.env = {c: rows[0].get(c, "") for c in ENV_COLUMNS}
    return obs


def read_observations(path) -> Observations:
    """Read a long, summary or reference CSV into `Observations` (the file's checks:
    `xstage.results.io.read_table`; a CSV of another kind is named for what it looks like)."""
    table = read_table(path, DATA_KINDS, what="data file")
    obs = observations_from_rows(table.rows, f"data file {table.path}", table.lines)
    obs.source = str(table.path)
    return obs


def reference_csv_path() -> Path:
    return Path(str(resources.files("xstage.data") / "h200-hostlink-probe.csv"))


def load_reference_data(path=None) -> Observations:
    """The H200 host-link / HBM reference run (packaged copy unless `path` is given)."""
    return read_observations(path or reference_csv_path())
