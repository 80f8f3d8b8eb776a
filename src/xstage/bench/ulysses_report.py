"""The report of `xstage bench ulysses`: its results read back and checked, the whole grid as a table,
fixed policies against the planner and the oracle, summary.md and its plots.

Ratios follow the grid's targets: `best serial` is the faster of `serial:triton` and `serial:cudnn` per
configuration, `attention` the faster core alone (`attention:triton`, `attention:cudnn`), all from one
run. A fixed policy runs one exchange everywhere; which fixed policy is best is known only after
measuring. The oracle is the fastest exchange measured per configuration (`auto` left out): chosen
after measuring, so it is not a policy, and it is shown beside the planner (`auto`) and every fixed one.
"""

from __future__ import annotations

import math
from pathlib import Path

from xstage.attention.flash import FlashConfig
from xstage.errors import InputError
from xstage.results.io import cell_count, cell_number, cell_text, cell_time, read_table
from xstage.results.output import write_text
from xstage.results.plots import plot_lines
from xstage.results.stats import geomean
from xstage.results.tables import markdown_table
from xstage.sched.measured import ULYSSES_COLUMNS, check_ulysses_rows
from xstage.spec.exchange import parse_exchange

CORES = ("attention:triton", "attention:cudnn")
SERIALS = (str(parse_exchange("serial:triton")), "serial:cudnn")
MAX_ERR = 2e-2  # bf16 outputs of two attention cores differ by a few ulps of their largest value
# The grid's targets (`benchmarks/results/h200-ulysses-exchange-grid/`): against serial everywhere, against
# attention alone on long sequences.
SERIAL_FLOOR = 0.99
ATTENTION_CEILING, LONG_TOKENS = 1.03, 32760


CORE_REQUIRED = ("tokens", "heads", "dim", "layout", "impl", "time_ns", "tflops")
TRITON_CONFIG = ("block_m", "block_n", "num_warps", "num_stages", "ctas_per_sm", "tma")  # of every Triton row


def read_core(path) -> list[dict]:
    """The rows of a `core.csv` (`run_core`), checked: the file (`xstage.results.io.read_table`), sizes,
    finite positive times and TFLOP/s, and each Triton row's configuration."""
    table = read_table(path, {"ulysses-core": CORE_REQUIRED})
    for i, r in enumerate(table.rows):
        at = table.where(i)
        for c in ("tokens", "heads", "dim"):
            cell_count(r, c, at)
        cell_time(r, "time_ns", at)
        cell_number(r, "tflops", at, positive=True)
        for c in ("ratio_vs_cudnn", "rel_err"):
            if c in r:
                cell_number(r, c, at, optional=True)
        if cell_text(r, "impl", at) == "triton":
            for c in TRITON_CONFIG:
                cell_count(r, c, at, minimum=0 if c in ("ctas_per_sm", "tma") else 1)
            if int(r["tma"]) > 1:
                raise InputError(f"{at}, column tma: {r['tma']}: must be 0 or 1")
            try:
                FlashConfig(*(int(r[c]) for c in TRITON_CONFIG[:5]))
            except InputError as exc:
                raise InputError(f"{at}: {exc}") from None
    return table.rows


def _num(row, col="time_ns") -> float:
    try:
        return float(row[col]) if row and row.get(col) not in (None, "") else float("nan")
    except ValueError:
        return float("nan")


def read_grid(path) -> list[dict]:
    """The rows of a `ulysses.csv` (`run_grid`), checked (`xstage.results.io.read_table` and
    `xstage.sched.measured.check_ulysses_rows`: sizes, variants, finite positive times)."""
    table = read_table(path, {"ulysses": (*ULYSSES_COLUMNS, "path")})
    check_ulysses_rows(table.rows, str(table.path), table.lines)
    return table.rows


def grid_table(rows: list[dict]) -> list[dict]:
    """One line per configuration: every variant's time (us) and the ratios the targets name."""
    table = []
    by_tokens = sorted(_configs(rows).items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1], kv[0][3]))
    for (H, D, T, P, path), v in by_tokens:
        line = {"heads x dim": f"{H}x{D}", "tokens": T, "P": P, "path": path}
        attn = min(_num(v.get(c)) for c in CORES)
        serial = min(_num(v.get(c)) for c in SERIALS)
        for name, row in v.items():
            line[f"{name} us"] = _num(row) / 1e3
        if "auto" in v:
            line["auto runs"] = v["auto"].get("exchange", "")
            line["best serial / auto"] = serial / _num(v["auto"])
            line["auto / attention"] = _num(v["auto"]) / attn
            line["auto p10-p90 %"] = 100 * (_num(v["auto"], "p90_ns") - _num(v["auto"], "p10_ns")) / _num(v["auto"])
        line["ok"] = all(str(r.get("exchange_ok", "")) in ("", "1") for r in v.values())
        table.append(line)
    return table


def read_report_rows(out_dir) -> tuple[list[dict], list[dict]]:
    """The checked rows of `ulysses.csv` and `core.csv` in `out_dir` (either may be absent, not both)."""
    out = Path(out_dir)
    if not (out / "ulysses.csv").exists() and not (out / "core.csv").exists():
        raise InputError(f"--out {out}: has neither ulysses.csv nor core.csv; run the grid first")
    rows = read_grid(out / "ulysses.csv") if (out / "ulysses.csv").exists() else []
    return rows, (read_core(out / "core.csv") if (out / "core.csv").exists() else [])


def write_report(out_dir, rows_and_core: tuple[list[dict], list[dict]] | None = None) -> Path:
    """summary.md and plots from `ulysses.csv` (and `core.csv` when present); `rows_and_core`: what
    `read_report_rows` gave, read before (so that a malformed file is refused before any output)."""
    out = Path(out_dir)
    rows, crows = read_report_rows(out) if rows_and_core is None else rows_and_core
    table = grid_table(rows)
    lines = ["# Ulysses attention: every exchange vs attention alone (one GPU, loopback)", ""]
    for label, src in (("Grid", rows), ("Attention core", crows)):
        if src:
            env = src[0]
            lines += [f"{label} machine: {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, "
                      f"triton {env.get('triton')}, commit {env.get('git_commit')}, {env.get('date')}.", ""]
    if not rows:
        lines += ["The loopback grid has not been run yet (no `ulysses.csv`).", ""]
    if table:
        cols = list(dict.fromkeys(c for t in table for c in t))
        lines += ["Rank 0 of a loopback group of P on one GPU; other ranks' buffers on the path shown; bf16, "
                  "batch 1. Medians of CUDA-graph replays (`timed` column: graph, or eager calls), the variants "
                  "taking turns in blocks of replays; every exchange is timed "
                  "until every destination holds its rows. `best serial` is the faster of `serial:triton` and "
                  "`serial:cudnn`, `attention` the faster core alone, both from the same run. `auto runs`: "
                  "the exchange the planner picked. `ok`: every destination received the attention output "
                  f"(max error <= {MAX_ERR} of its largest value).", "",
                  markdown_table(table, cols, floatfmt=".4g"), ""]
        policies = policy_table(rows)
        if policies:
            lines += ["## Fixed policies, the planner and the oracle", "",
                      f"Per policy, over the configurations where it and both serials and cores were measured: "
                      f"how often it is >= {SERIAL_FLOOR}x the best serial (and its lowest ratio), how often "
                      f"it is <= {ATTENTION_CEILING}x attention alone from {LONG_TOKENS} tokens (and its highest "
                      "ratio there), and its geomean speedup over the best serial. `auto` is the planner; "
                      "every other exchange is run everywhere; the oracle, the fastest exchange measured per "
                      "configuration, is chosen after measuring and is not a policy.", "",
                      markdown_table(policies, list(policies[0]), floatfmt=".3f"), ""]
        for key, ylabel, png in (("best serial / auto", "best serial / auto", "speedup.png"),
                                 ("auto / attention", "auto / attention alone", "overhead.png")):
            # a configuration without a serial or core variant has no ratio (NaN): nothing to draw
            pts = [{**t, "shape": t["heads x dim"]} for t in table if math.isfinite(t.get(key, float("nan")))]
            if pts:
                plot_lines(pts, "tokens", key, ["shape", "P"], out / png, logx=True, ylabel=ylabel, hline=1.0,
                           title=f"Ulysses exchange: {ylabel}")
                lines += [f"![{ylabel}]({png})", ""]
    if crows:
        crow = [{**r, **{c: float(r[c]) for c in ("tflops", "ratio_vs_cudnn", "rel_err") if r.get(c)}}
                for r in crows]
        lines += ["## Attention core vs cuDNN SDPA", "",
                  "bf16, batch 1, non-causal, median of CUDA-event timed calls. Layout `bshd`: contiguous "
                  "`[B, S, H, D]`; `gathered`: the Ulysses receive buffer `[S, 3, B, H, D]` read through "
                  "strides; cuDNN runs on contiguous `[B, H, S, D]`. `rel_err`: max |Triton - cuDNN| / "
                  "max |cuDNN|. `sass`: instruction counts of the compiled kernel (HGMMA = Hopper warpgroup "
                  "MMA, UTMALDG = TMA loads, STL = spill stores).", "",
                  markdown_table(crow, ["tokens", "heads", "dim", "layout", "impl", "block_m", "block_n",
                                        "num_warps", "num_stages", "ctas_per_sm", "tma", "tflops",
                                        "ratio_vs_cudnn", "rel_err", "sass"]), ""]
    return write_text(out / "summary.md", "\n".join(lines))


def _configs(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (int(r["heads"]), int(r["dim"]), int(r["tokens"]), int(r["P"]), r["path"])
        by_key.setdefault(key, {})[r["variant"]] = r
    return by_key


def policy_table(rows: list[dict]) -> list[dict]:
    """Per policy (`auto`, each exchange run everywhere, and the oracle): in how many configurations it
    is >= 0.99x the best serial (and the lowest ratio), in how many of those from 32760 tokens it is
    <= 1.03x attention alone (and the highest ratio), and its geomean over the best serial up to 16384
    tokens and over all. A configuration counts only where the policy, both serials and both cores
    were measured."""
    configs = []
    for (_H, _D, T, _P, _path), v in sorted(_configs(rows).items()):
        if not all(math.isfinite(_num(v.get(c))) for c in (*SERIALS, *CORES)):
            continue
        serial = min(_num(v[c]) for c in SERIALS)
        attn = min(_num(v[c]) for c in CORES)
        times = {name: _num(r) for name, r in v.items() if name not in CORES and math.isfinite(_num(r))}
        exchanges = {n: t for n, t in times.items() if n != "auto"}
        if exchanges:
            times["oracle (best per configuration)"] = min(exchanges.values())
        configs.append((T, serial, attn, times))
    names = list(dict.fromkeys(n for *_, times in configs for n in times))
    names.sort(key=lambda n: (n != "auto", n.startswith("oracle"), n))
    table = []
    for name in names:
        got = [(T, serial / times[name], times[name] / attn) for T, serial, attn, times in configs if name in times]
        if not got:
            continue
        long = [a for T, _s, a in got if T >= LONG_TOKENS]
        short = [s for T, s, _a in got if T < LONG_TOKENS]
        table.append({
            "policy": name, "configurations": len(got),
            f">= {SERIAL_FLOOR}x best serial": sum(s >= SERIAL_FLOOR for _T, s, _a in got),
            "min over best serial": min(s for _T, s, _a in got),
            f"<= {ATTENTION_CEILING}x attention from {LONG_TOKENS} tokens": sum(a <= ATTENTION_CEILING for a in long),
            f"of (from {LONG_TOKENS})": len(long),
            "max over attention from 32760": max(long) if long else float("nan"),
            f"geomean over best serial below {LONG_TOKENS}": geomean(short) if short else float("nan"),
            "geomean over best serial, all": geomean([s for _T, s, _a in got]),
        })
    return table
