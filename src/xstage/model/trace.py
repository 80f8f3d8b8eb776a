"""Per-burst traces of any kernel's stores, and how well a profile predicts them (`xstage model score`).

Problem: a profile is fitted on the probe's regular trains, but a kernel's own traffic is irregular:
every CTA runs its own train of mixed sizes and gaps, starting when it starts. A trace records that
traffic burst by burst; scoring plays each launch's trains through the Burst-Gap simulator and says
how far each burst's predicted issue time, and the launch's end, are from what was measured.

Trace format (`TRACE_COLUMNS`), one row per burst per CTA. The names mean what they mean in the
probe's long format (`xstage.model.data`) where the two share them:

    launch         integer id of one run; the CTAs of a launch share the path and are played together
    cta            CTA index within the launch; CTAs 0..n-1 each have at least one burst
    burst_index    the burst's index within its CTA; bursts 0..m-1, each once
    burst_bytes    bytes the CTA stores in this burst (an integer > 0)
    start_ns       when the burst's first store instruction issued (ns), on one clock for the whole
                   launch (any origin: the launch's earliest start is its zero)
    issue_ns       measured issue time: from that first store instruction to the CTA's last store
                   instruction of the burst (ns > 0)
  optional (`TRACE_OPTIONAL`):
    family         a label; errors are also reported per family. One family per launch
    path           hbm | host | peer; when given, the profile's path
    completion_ns, warps, vector_bytes, smid   read and checked; not scored or modelled yet (smid: the
                   SM the CTA ran on, an integer >= 0)

A probe's long-format file (`xstage.model.data`, what `xstage probe` writes in `raw/`) is read as a
trace too (`trace_from_long`): its CTAs start together, and each burst starts its measured `gap_ns`
after the one before ended; so the fit and the scorer read the same measurements.

What the model is given: per CTA its first burst's start and, per burst, its bytes and the compute
gap after it (the next burst's start minus this burst's measured end): what the kernel did, not
what the path made of it. What it predicts: each burst's issue time, and the launch's end (the last
CTA's last issue end, from the launch's first start). Each CTA is one issuer of the model (an SM
slot); CTAs sharing an SM are not told apart.

Error (`rel_error`): |predicted - measured| / max(measured, 500 ns), so that bursts near the timer's
resolution cannot dominate; medians are pooled over all bursts (and over launches for the end).
Beside the model, the plain `bytes / r0` guess is scored the same way, as the bar it has to clear.

Refused, in one line naming the file and line (`read_trace`): missing columns, a cell that is not a
finite number, negative or zero sizes and issue times, a repeated burst, a CTA or burst index left
out, two bursts of one CTA overlapping in time (by more than 1 ns of rounding), a launch with more
CTAs than the simulator plays, two families in one launch.

Example:
    >>> from xstage.model import load_default_profile
    >>> rows = [dict(launch=0, cta=c, burst_index=0, burst_bytes=65536, start_ns=0, issue_ns=1500)
    ...         for c in (0, 1)]
    >>> trace = trace_from_rows(rows)
    >>> s = score_trace(trace, load_default_profile("host").params)
    >>> len(s.bursts["predicted_ns"]), s.summary()["bursts"]["n"]
    (2, 2)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from xstage.errors import InputError
from xstage.model.data import LONG_COLUMNS, PATHS, validate_long
from xstage.model.fastsim import MAX_SLOTS
from xstage.model.params import NS, PathParams
from xstage.model.simulate import ENGINES, simulate_bursts
from xstage.results.io import cell_count, cell_text, cell_time, read_table

TRACE_COLUMNS = ["launch", "cta", "burst_index", "burst_bytes", "start_ns", "issue_ns"]
TRACE_OPTIONAL = ["family", "path", "completion_ns", "warps", "vector_bytes", "smid"]
FLOOR_NS = 500.0  # the error's denominator is at least this: the timer's resolution, not the burst
BY = ("burst_index", "burst_bytes", "cta", "launch")  # what `Score.by` groups the bursts by
OVERLAP_NS = 1.0  # a burst may start this much before its CTA's previous one ends (rounding; gap 0)


def rel_error(predicted, measured):
    """|predicted - measured| / max(measured, 500 ns), elementwise."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return np.abs(p - m) / np.maximum(m, FLOOR_NS)


@dataclasses.dataclass
class Launch:
    """One launch's trains: per CTA, arrays of its bursts' bytes, starts and measured issue times."""

    launch: int
    family: str
    nbytes: list[np.ndarray]
    start_ns: list[np.ndarray]
    issue_ns: list[np.ndarray]

    def programs(self) -> tuple[list[list[tuple[float, float]]], list[float]]:
        """The simulator's input: per CTA its (bytes, compute gap after) bursts, and its start from
        the launch's first start."""
        t0 = min(float(s[0]) for s in self.start_ns)
        progs, starts = [], []
        for b, s, i in zip(self.nbytes, self.start_ns, self.issue_ns):
            gaps = np.append(np.maximum(s[1:] - (s[:-1] + i[:-1]), 0.0), 0.0)
            progs.append([(float(x), float(g)) for x, g in zip(b, gaps)])
            starts.append(float(s[0]) - t0)
        return progs, starts

    def measured_end_ns(self) -> float:
        t0 = min(float(s[0]) for s in self.start_ns)
        return max(float(s[-1] + i[-1]) for s, i in zip(self.start_ns, self.issue_ns)) - t0


@dataclasses.dataclass
class Trace:
    """A trace file's launches, in file order of their first row; `path` from the file (None: not given)."""

    launches: list[Launch]
    path: str | None = None
    source: str = ""


def _at(source: str, lines, n: int) -> str:
    return f"{source}, line {lines[n]}" if lines is not None else f"{source}, row {n + 1}"


def trace_from_rows(rows: list[dict], source: str = "trace", lines=None) -> Trace:
    """Check trace rows (dicts of cells) and group them by launch and CTA; every refusal is one
    `InputError` naming `source` and the row's line (`lines`, from `read_table`) or number."""
    if not rows:
        raise InputError(f"{source}: no rows")
    missing = [c for c in TRACE_COLUMNS if c not in rows[0]]
    if missing:
        raise InputError(f"{source}: no column(s) {', '.join(missing)}; a trace has {', '.join(TRACE_COLUMNS)}")
    where = {}  # (launch, cta, burst) -> row position, for the errors found after grouping
    groups: dict[int, dict[int, dict[int, tuple[int, float, float]]]] = {}
    families: dict[int, tuple[str, int]] = {}
    paths = set()
    for n, row in enumerate(rows):
        at = _at(source, lines, n)
        launch, cta, burst = (cell_count(row, c, at, minimum=0) for c in ("launch", "cta", "burst_index"))
        nbytes = cell_count(row, "burst_bytes", at)
        start = cell_time(row, "start_ns", at, zero=True)
        issue = cell_time(row, "issue_ns", at)
        if "completion_ns" in row:
            cell_time(row, "completion_ns", at, optional=True)
        for c in ("warps", "vector_bytes"):
            if c in row and cell_text(row, c, at):
                cell_count(row, c, at)
        if "smid" in row and cell_text(row, "smid", at):
            cell_count(row, "smid", at, minimum=0)
        if "path" in row and cell_text(row, "path", at):
            p = cell_text(row, "path", at)
            if p not in PATHS:
                raise InputError(f"{at}, column path: {p!r}: must be one of {', '.join(PATHS)}")
            paths.add(p)
        family = cell_text(row, "family", at) if "family" in row else ""
        first = families.setdefault(launch, (family, n))
        if first[0] != family:
            raise InputError(f"{at}, column family: {family!r}, but launch {launch} began as {first[0]!r} "
                             f"({_at(source, lines, first[1])}); one family per launch")
        bursts = groups.setdefault(launch, {}).setdefault(cta, {})
        if burst in bursts:
            raise InputError(f"{at}: launch {launch}, CTA {cta}, burst {burst} again (first at "
                             f"{_at(source, lines, where[launch, cta, burst])})")
        bursts[burst] = (nbytes, start, issue)
        where[launch, cta, burst] = n
    if len(paths) > 1:
        raise InputError(f"{source}: column path holds {', '.join(sorted(paths))}; a trace is of one path")
    launches = [_launch(launch, families[launch][0], ctas, source, lines, where) for launch, ctas in groups.items()]
    return Trace(launches, next(iter(paths), None), source)


def _launch(launch: int, family: str, ctas: dict, source: str, lines, where: dict) -> Launch:
    if len(ctas) > MAX_SLOTS:
        raise InputError(f"{source}: launch {launch} has {len(ctas)} CTAs; the simulator plays at most {MAX_SLOTS}")
    absent = next((c for c in range(len(ctas)) if c not in ctas), None)
    if absent is not None:
        raise InputError(f"{source}: launch {launch}: CTA {absent} has no bursts, though CTA {max(ctas)} has; "
                         f"CTAs are numbered 0..n-1 and each has bursts")
    nbytes, starts, issues = [], [], []
    for cta in range(len(ctas)):
        bursts = ctas[cta]
        gap = next((b for b in range(len(bursts)) if b not in bursts), None)
        if gap is not None:
            raise InputError(f"{source}: launch {launch}, CTA {cta}: burst {gap} is missing, though burst "
                             f"{max(bursts)} is there; bursts are numbered 0..m-1")
        b, s, i = (np.array([bursts[k][f] for k in range(len(bursts))], dtype=float) for f in range(3))
        over = np.nonzero(s[1:] < s[:-1] + i[:-1] - OVERLAP_NS)[0]
        if len(over):
            k = int(over[0]) + 1
            raise InputError(f"{_at(source, lines, where[launch, cta, k])}: launch {launch}, CTA {cta}: burst {k} "
                             f"starts at {s[k]:g} ns, before burst {k - 1} ends ({s[k - 1]:g} + {i[k - 1]:g} ns); "
                             "one CTA's bursts cannot overlap")
        nbytes.append(b)
        starts.append(s)
        issues.append(i)
    return Launch(launch, family, nbytes, starts, issues)


def trace_from_long(rows: list[dict], source: str = "long data", lines=None) -> Trace:
    """The trace of probe long-format rows (`xstage.model.data`, checked by `validate_long`): the
    probe's CTAs start burst 0 together, and burst k starts `gap_ns` (measured) after burst k - 1's
    issue ended. The family of a launch is its configuration (`<n_sm>sm-<burst_bytes>B-g<gap_iters>`)."""
    typed = validate_long(rows, source, lines)
    ends: dict[tuple[int, int], float] = {}
    out = []
    for n, r in sorted(enumerate(typed), key=lambda nr: (nr[1]["launch"], nr[1]["cta"], nr[1]["burst_index"])):
        key = (r["launch"], r["cta"])
        if r["burst_index"] == 0:
            start = 0.0
        elif key in ends and math.isfinite(r["gap_ns"]):
            start = ends[key] + r["gap_ns"]
        else:
            raise InputError(f"{_at(source, lines, n)}: burst {r['burst_index']} of launch {r['launch']}, CTA "
                             f"{r['cta']} needs the burst before it and its measured gap_ns to be placed in time")
        ends[key] = start + r["issue_ns"]
        out.append({"launch": r["launch"], "cta": r["cta"], "burst_index": r["burst_index"],
                    "burst_bytes": r["burst_bytes"], "start_ns": start, "issue_ns": r["issue_ns"],
                    "path": r["path"], "family": f"{r['n_sm']}sm-{r['burst_bytes']}B-g{r['gap_iters']}"})
    return trace_from_rows(out, source)


def read_trace(path) -> Trace:
    """Read and check a trace CSV, or a probe's long-format CSV (`trace_from_long`); the file's checks:
    `xstage.results.io.read_table`."""
    table = read_table(path, {"trace": TRACE_COLUMNS, "probe-long": LONG_COLUMNS}, what="trace")
    if table.kind == "probe-long":
        return trace_from_long(table.rows, f"trace {table.path}", table.lines)
    return trace_from_rows(table.rows, f"trace {table.path}", table.lines)


def _stats(err: np.ndarray) -> dict:
    if not len(err):
        return {"n": 0, "median": float("nan"), "p90": float("nan"), "max": float("nan")}
    return {"n": int(len(err)), "median": float(np.median(err)), "p90": float(np.percentile(err, 90)),
            "max": float(err.max())}


@dataclasses.dataclass
class Score:
    """Per burst and per launch: measured and predicted times and their errors (numpy columns)."""

    bursts: dict
    launches: dict

    def summary(self) -> dict:
        """Error statistics (n, median, p90, max) of the bursts' issue times (model and `bytes / r0`)
        and of the launches' ends, pooled and (where a family is named) per family."""
        b, la = self.bursts, self.launches

        def block(bmask, lmask) -> dict:
            return {"bursts": _stats(b["error"][bmask]), "bursts_bytes_over_r0": _stats(b["naive_error"][bmask]),
                    "end": _stats(la["error"][lmask])}

        out = block(slice(None), slice(None))
        names = sorted({f for f in la["family"] if f})
        out["families"] = {f: block(b["family"] == f, la["family"] == f) for f in names}
        return out

    def by(self, column: str) -> dict:
        """The bursts' error statistics (model and `bytes / r0`) grouped by a burst column (`BY`: where
        in its train a burst is, its size, its CTA, its launch), keyed by the column's values in order."""
        if column not in BY:
            raise InputError(f"by {column!r}: must be one of {', '.join(BY)}")
        b = self.bursts
        return {v.item(): {"bursts": _stats(b["error"][b[column] == v]),
                           "bursts_bytes_over_r0": _stats(b["naive_error"][b[column] == v])}
                for v in np.unique(b[column])}


def score_trace(trace: Trace, params: PathParams, engine: str = "fast") -> Score:
    """Play every launch of `trace` through the Burst-Gap simulator on `params` (`engine`: see
    `xstage.model.simulate.path_simulator`) and compare with what was measured."""
    if not isinstance(engine, str) or engine not in ENGINES:
        raise InputError(f"engine {engine!r}: must be one of {', '.join(ENGINES)}")
    cols = {k: [] for k in ("launch", "cta", "burst_index", "family", "burst_bytes", "start_ns", "measured_ns",
                            "predicted_ns")}
    ends = {k: [] for k in ("launch", "family", "n_cta", "measured_ns", "predicted_ns")}
    for la in trace.launches:
        progs, starts = la.programs()
        res = simulate_bursts(params, progs, start_ns=starts, engine=engine)
        for cta, (b, s, i) in enumerate(zip(la.nbytes, la.start_ns, la.issue_ns)):
            n = len(b)
            cols["launch"] += [la.launch] * n
            cols["cta"] += [cta] * n
            cols["burst_index"] += list(range(n))
            cols["family"] += [la.family] * n
            cols["burst_bytes"] += [int(x) for x in b]
            cols["start_ns"] += s.tolist()
            cols["measured_ns"] += i.tolist()
            cols["predicted_ns"] += res.issue_ns[cta].tolist()
        ends["launch"].append(la.launch)
        ends["family"].append(la.family)
        ends["n_cta"].append(len(la.nbytes))
        ends["measured_ns"].append(la.measured_end_ns())
        ends["predicted_ns"].append(max(float(e[-1]) for e in res.issue_end_ns))
    bursts = {k: np.array(v) for k, v in cols.items()}
    bursts["error"] = rel_error(bursts["predicted_ns"], bursts["measured_ns"])
    bursts["naive_ns"] = bursts["burst_bytes"] / params.r0 / NS
    bursts["naive_error"] = rel_error(bursts["naive_ns"], bursts["measured_ns"])
    launches = {k: np.array(v) for k, v in ends.items()}
    launches["error"] = rel_error(launches["predicted_ns"], launches["measured_ns"])
    return Score(bursts, launches)
