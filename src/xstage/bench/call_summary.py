"""Call columns of the MoE results: their checks, and the summary's section of calls against kernels.

Rows of `xstage bench moe` (and `moe_dist`) measured since call timing exists carry, for each fused
variant, the public call's columns (`xstage.bench.calls.CALL_COLUMNS`: `call_ns`, `host_ns` with p10
and p90, `launches`, `syncs`, `graph_ns`, `call_note`) and `reduce_host_ns`, one `launch_reduce`'s
host time, and `loop_ns`, the same number of back-to-back runs of the kernels alone (`xstage bench moe`
only). Older files have none of them; rows of baselines leave them empty.

`check_call_cells(row, at)` refuses a malformed value of any of them (one line naming the row and the
column). `call_sections(rows)` returns, per dtype and path, the calls against the kernels
(`time_ns + reduce_ns`, planned before the timed runs) by token count, and how many rows meet each
target of a call:

- from `CALL_FROM_TOKENS` tokens, `call_ns` <= `CALL_OVER_KERNELS` x the kernels;
- the graph replay <= `CALL_OVER_KERNELS` x the kernels + `GRAPH_SLACK_NS`, at every size;
- `launches` <= `MAX_LAUNCHES` (BF16 on one GPU) or `MAX_LAUNCHES_WIDE` (FP8 or a real group);
- `host_ns` <= `launches` x `reduce_host_ns` + `HOST_SLACK_NS`;
- no synchronisation torch reports (`syncs` = 0).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from xstage.errors import InputError
from xstage.results import geomean
from xstage.results.io import cell_count, cell_time

CALL_TIMES = ("call_ns", "host_ns", "host_p10_ns", "host_p90_ns", "graph_ns", "reduce_host_ns", "loop_ns")
CALL_OVER_KERNELS = 1.03
CALL_FROM_TOKENS = 1024
GRAPH_SLACK_NS = 10e3
HOST_SLACK_NS = 30e3
MAX_LAUNCHES, MAX_LAUNCHES_WIDE = 3, 5


def check_call_cells(row, at: str) -> None:
    """The call columns of one row, where present and not empty: times finite and > 0, `launches` and
    `syncs` integers >= 0, `max_err` a number."""
    for c in CALL_TIMES:
        if c in row:
            cell_time(row, c, at, optional=True)
    for c in ("launches", "syncs"):
        if str(row.get(c) or "").strip():
            cell_count(row, c, at, minimum=0)
    text = str(row.get("max_err") or "").strip()
    try:
        float(text or 0)
    except ValueError:
        raise InputError(f"{at}, column max_err: {text!r} is not a number (a measured error)") from None


def _num(row, column: str) -> float | None:
    text = str(row.get(column) or "").strip()
    return float(text) if text else None


def launch_bound(row) -> int:
    """The launches a call may make: more for FP8 (its quantization) and a real group (its barrier)."""
    return MAX_LAUNCHES_WIDE if row.get("dtype") == "fp8" or row.get("path") == "peer" else MAX_LAUNCHES


def _met(flags: list[bool]) -> str:
    return f"{sum(flags)} of {len(flags)}"


def _group_lines(rows: list[dict]) -> list[str]:
    by_tokens: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_tokens[int(r["tokens"])].append(r)
    looped = any(_num(r, "loop_ns") for r in rows)  # files before `loop_ns` have no such column
    extra = " call / kernels back to back (geomean, max) |" if looped else ""
    lines = ["| tokens | rows | call / kernels (geomean, max) | graph / kernels (max; captured) | launches (max) | "
             "host us (median, max) | syncs (max) |" + extra,
             "|---|---|---|---|---|---|---|" + ("---|" if looped else "")]
    for tokens, sel in sorted(by_tokens.items()):
        ratio = [_num(r, "call_ns") / _kernels(r) for r in sel]
        loop = [_num(r, "call_ns") / _num(r, "loop_ns") for r in sel if _num(r, "loop_ns")]
        graph = [_num(r, "graph_ns") / _kernels(r) for r in sel if _num(r, "graph_ns")]
        launches = [_num(r, "launches") for r in sel if _num(r, "launches") is not None]
        host = sorted(_num(r, "host_ns") for r in sel if _num(r, "host_ns"))
        syncs = [_num(r, "syncs") for r in sel if _num(r, "syncs") is not None]
        cells = [str(tokens), str(len(sel)), f"{geomean(ratio):.3f}, {max(ratio):.3f}",
                 f"{max(graph):.3f}; {len(graph)} of {len(sel)}" if graph else f"none of {len(sel)}",
                 f"{max(launches):g}" if launches else "",
                 f"{statistics.median(host) / 1e3:.1f}, {host[-1] / 1e3:.1f}" if host else "",
                 f"{max(syncs):g}" if syncs else ""]
        if looped:
            cells.append(f"{geomean(loop):.3f}, {max(loop):.3f}" if loop else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _kernels(row) -> float:
    return _num(row, "time_ns") + (_num(row, "reduce_ns") or 0.0)


def _target_lines(rows: list[dict]) -> list[str]:
    late = [r for r in rows if int(r["tokens"]) >= CALL_FROM_TOKENS]
    call = [_num(r, "call_ns") <= CALL_OVER_KERNELS * _kernels(r) for r in late]
    captured = [r for r in rows if _num(r, "graph_ns")]
    graph = [_num(r, "graph_ns") <= CALL_OVER_KERNELS * _kernels(r) + GRAPH_SLACK_NS for r in captured]
    reasons = sorted({n.strip() for r in rows if not _num(r, "graph_ns")
                      for n in str(r.get("call_note") or "").split(";") if n.strip().startswith("graph:")})
    counted = [r for r in rows if _num(r, "launches") is not None]
    launches = [_num(r, "launches") <= launch_bound(r) for r in counted]
    hosted = [r for r in counted if _num(r, "reduce_host_ns") and _num(r, "host_ns")]
    host = [_num(r, "host_ns") <= _num(r, "launches") * _num(r, "reduce_host_ns") + HOST_SLACK_NS for r in hosted]
    synced = [_num(r, "syncs") == 0 for r in rows if _num(r, "syncs") is not None]
    bounds = "/".join(str(b) for b in sorted({launch_bound(r) for r in counted})) or str(MAX_LAUNCHES)
    graph_line = (f"- graph replay <= {CALL_OVER_KERNELS} x kernels + {GRAPH_SLACK_NS / 1e3:g} us: "
                  + (f"met in {_met(graph)} captured rows" if graph else "no row captured"))
    if len(captured) < len(rows):
        why = f": {reasons[0]}" + (f" (and {len(reasons) - 1} other reasons)" if len(reasons) > 1 else "") \
            if reasons else ""
        graph_line += f"; {len(rows) - len(captured)} rows not captured{why}"
    return [f"- call <= {CALL_OVER_KERNELS} x kernels from {CALL_FROM_TOKENS} tokens: "
            + (f"met in {_met(call)} rows" if call else f"no row of {CALL_FROM_TOKENS} tokens or more"),
            graph_line,
            f"- launches <= {bounds} per call: " + (f"met in {_met(launches)} rows" if launches else "not counted"),
            f"- host_ns <= launches x reduce_host_ns + {HOST_SLACK_NS / 1e3:g} us: "
            + (f"met in {_met(host)} rows" if host else "not measured"),
            "- no synchronisation torch reports (`syncs` = 0): "
            + (f"met in {_met(synced)} rows" if synced else "not counted")]


def call_sections(rows: list[dict]) -> list[str]:
    """Markdown of the calls against the kernels (module docstring), per dtype and path; [] when no row
    has a call time."""
    called = [r for r in rows if _num(r, "call_ns") and _num(r, "time_ns")]
    if not called:
        return []
    lines = ["", "## Calls against kernels", "",
             "`call`: the public `fused_moe` call with its defaults (the buffer's pacing unless the variant names "
             "one; the buffer sized for the run's largest token count), back to back on distinct routings, wall "
             "clock per call (`call_ns`). `kernels`: `time_ns + reduce_ns`, the same kernels on a plan built "
             "before the timed runs. `graph`: the call replayed from a CUDA graph, median per replay. "
             "`host`: host time inside one call; `launches`: kernels per call (torch's profiler on a GPU). "
             "A plan built by a prologue kernel counts as call time, not kernel time. `kernels back to back` "
             "(`loop_ns`, where measured): as many runs of the kernels on one plan, back to back with one "
             "synchronisation, as the calls; the call over it is what the call itself adds under the same load."]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in called:
        groups[(r.get("dtype") or "bf16", r["path"])].append(r)
    for (dtype, path), sel in sorted(groups.items(), key=lambda kv: (kv[0][0] != "bf16", kv[0])):
        eps = ", ".join(str(e) for e in sorted({int(r["ep"]) for r in sel}))
        lines += ["", f"### {dtype}, path `{path}`, EP {eps} ({len(sel)} rows)", ""] + _group_lines(sel) + [""]
        lines += _target_lines(sel)
    return lines
