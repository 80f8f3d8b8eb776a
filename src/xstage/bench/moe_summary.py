"""Summary of a fused-MoE results CSV: speedups over expert_wave at the same store pacing, per path.

`summarize(out_dir)` reads `out_dir/moe.csv` (written by `xstage bench moe` or the multi-GPU bench;
checked first, `read_moe_csv`: a malformed, empty or other kind of file is one error naming it) and
writes `summary.md` and the speedup plots; it returns, per path and variant, the number of
configurations, the geomean / max / min speedup and how many configurations the variant loses. Each
dtype of the file gets its own sections, keyed by path for the first dtype (bf16 where present) and
`path:dtype` for the others; with FP8 rows, the FP8 sections of `xstage.bench.moe_fp8_summary` follow.

Every speedup is taken over `expert_wave` with the same pacing suffix (`lag:8` over `expert_wave`,
`lag:4@off` over `expert_wave@off`), from the public calls' times (`call_ns`) where both rows have
one, else from the kernel times (`time_ns`; files from before call timing, and the baselines, which
are not calls), and says which. The best schedule per configuration is chosen after measuring,
so it is reported as the oracle, beside the best constant variant (one schedule for every
configuration, chosen by geomean). Rows with call times get the section of calls against kernels
(`xstage.bench.call_summary`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from xstage.bench.call_summary import call_sections, check_call_cells
from xstage.bench.moe_fp8_summary import fp8_sections
from xstage.results import geomean
from xstage.results.io import cell_number, read_table
from xstage.results.output import write_text
from xstage.results.plots import plot_lines
from xstage.sched.measured import MOE_COLUMNS, check_moe_rows
from xstage.spec.moe import SHAPES

__all__ = ["SUMMARY_INTRO", "SUMMARY_TITLE", "geomean", "summarize"]

_NOT_FUSED = ("unfused", "chain", "chain_fp8")
# How the speedups are taken, said in every section that shows them.
BASIS_TEXT = ("Each ratio is of call times (`call_ns`: the public call, plan and launches included) where both "
              "rows have one, else of kernel times (`time_ns`: the kernels on a plan built before the timed runs); "
              "`timed` says which.")


def _pacing(variant: str) -> str:
    """The pacing suffix of a variant: `lag:4@off` -> `off`; no suffix -> `` (the run's default)."""
    return variant.partition("@")[2]


def _baseline(variant: str) -> str:
    """The variant a speedup is taken over: `expert_wave` with the same pacing suffix."""
    pace = _pacing(variant)
    return f"expert_wave@{pace}" if pace else "expert_wave"


def _pace_label(pace: str) -> str:
    return f"`@{pace}`" if pace else "default (no suffix)"


def _shape_order(shapes) -> list[str]:
    known = [s for s in SHAPES if s in shapes]
    return known + sorted(s for s in shapes if s not in SHAPES)


def _times(rows: list[dict], column: str = "time_ns") -> dict[tuple, float]:
    """(shape, tokens, ep, variant) -> `column` of the rows that have one (`call_ns`: fused rows
    measured since call timing exists)."""
    return {(r["shape"], int(r["tokens"]), int(r["ep"]), r["variant"]): float(r[column])
            for r in rows if r.get(column) not in ("", None)}


@dataclass(frozen=True)
class Times:
    """Kernel times (`time_ns`) and call times (`call_ns`) of a set of rows, keyed like `_times`.
    `of(keys)`: the times of `keys` from the calls where every key has one, else from the kernels
    (one basis per comparison, never a call against a kernel), and which."""

    kernels: dict[tuple, float]
    calls: dict[tuple, float]

    @classmethod
    def of_rows(cls, rows: list[dict]) -> Times:
        return cls(_times(rows), _times(rows, "call_ns"))

    def of(self, keys) -> tuple[list[float], str] | None:
        keys = list(keys)
        for basis, t in (("call", self.calls), ("kernels", self.kernels)):
            if all(k in t for k in keys):
                return [t[k] for k in keys], basis
        return None


def _speedups(t: Times) -> tuple[dict[str, dict[tuple, float]], dict[str, dict[tuple, str]]]:
    """variant -> configuration -> time of its same-pacing expert_wave over its time (`Times.of`), and
    the basis of each ratio ("call" or "kernels")."""
    out: dict[str, dict[tuple, float]] = defaultdict(dict)
    basis: dict[str, dict[tuple, str]] = defaultdict(dict)
    for (*cfg, variant) in t.kernels:
        got = t.of([(*cfg, _baseline(variant)), (*cfg, variant)])
        if got is not None and got[0][1] > 0:
            (base, time_ns), how = got
            out[variant][tuple(cfg)] = base / time_ns
            basis[variant][tuple(cfg)] = how
    return out, basis


def _basis_label(bases) -> str:
    """`call`, `kernels`, or `call in N of M` for a mix."""
    bases = list(bases)
    n = sum(b == "call" for b in bases)
    return "call" if n == len(bases) else "kernels" if n == 0 else f"call in {n} of {len(bases)}"


def _stats(values) -> dict:
    v = list(values)
    return dict(configs=len(v), geomean=geomean(v), max=max(v), min=min(v), losses=sum(x < 1.0 for x in v))


def _cell(s: dict) -> str:
    return f"{s['geomean']:.3f} / {s['min']:.3f}"


def _speedup_section(multi: list[dict], path: str, label: str = "") -> tuple[list[str], dict]:
    """Markdown lines and per-variant statistics of the speedup over same-pacing expert_wave."""
    t = Times.of_rows(multi)
    sp, basis = _speedups(t)
    summary = {v: dict(_stats(s.values()), baseline=_baseline(v), basis=_basis_label(basis[v].values()))
               for v, s in sp.items() if s}
    lines = [f"## Path `{path}`{label}", "",
             "Speedup = time of `expert_wave` at the same pacing over time of the variant, per configuration "
             f"(shape, tokens, EP). {BASIS_TEXT} `slower in`: configurations where the variant is slower than its "
             "baseline.", "",
             "| variant | baseline | timed | configs | geomean | max | min | slower in |",
             "|---|---|---|---|---|---|---|---|"]
    for v, s in sorted(summary.items(), key=lambda kv: (_pacing(kv[0]), kv[0])):
        lines.append(f"| {v} | {s['baseline']} | {s['basis']} | {s['configs']} | {s['geomean']:.3f} | {s['max']:.3f} | "
                     f"{s['min']:.3f} | {s['losses']} of {s['configs']} |")
    fused = [v for v in summary if v not in _NOT_FUSED]
    by_pace: dict[str, list[str]] = defaultdict(list)
    for v in fused:
        by_pace[_pacing(v)].append(v)
    for pace, variants in sorted(by_pace.items()):
        base = _baseline(variants[0])
        cfgs = sorted({c for v in variants for c in sp[v]})
        # The oracle takes every configuration's fastest schedule, known only after measuring it (on the
        # calls where every schedule of the configuration has one).
        oracle = []
        for c in cfgs:
            (b, *others), _ = t.of([(*c, base)] + [(*c, v) for v in variants if (*c, v) in t.kernels])
            oracle.append(b / min([b, *others]))
        others = [v for v in variants if v != base]
        lines += ["", f"Pacing {_pace_label(pace)}, over `{base}`, {len(cfgs)} configurations:"]
        if others:
            const = max(others, key=lambda v: (summary[v]["geomean"], v))
            s = summary[const]
            lines.append(f"- best constant variant (one schedule everywhere, chosen by geomean): `{const}` geomean "
                         f"{s['geomean']:.3f}, max {s['max']:.3f}, min {s['min']:.3f}, slower in {s['losses']} "
                         f"of {s['configs']};")
        o = _stats(oracle)
        lines.append(f"- oracle (best of {len(variants)} schedules per configuration, chosen after measuring): "
                     f"geomean {o['geomean']:.3f}, max {o['max']:.3f}.")
    cols = sorted(fused, key=lambda v: (_pacing(v), v))
    cols = [v for v in cols if v != _baseline(v)]
    if cols:
        lines += ["", "Per shape and EP, each cell is geomean / min over the token counts.", "",
                  "| shape | EP | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
        shapes = _shape_order({c[0] for v in cols for c in sp[v]})
        eps = sorted({c[2] for v in cols for c in sp[v]})
        for shape in shapes:
            for ep in eps:
                cells = []
                for v in cols:
                    vals = [x for c, x in sp[v].items() if c[0] == shape and c[2] == ep]
                    cells.append(_cell(_stats(vals)) if vals else "")
                if any(cells):
                    lines.append(f"| {shape} | {ep} | " + " | ".join(cells) + " |")
    return lines + [""], summary


def _pacing_section(multi: list[dict]) -> list[str]:
    """Time without pacing over time with each pacing, per schedule measured both ways."""
    times = Times.of_rows(multi)
    t = times.kernels
    gains = defaultdict(list)
    for shape, tokens, ep, variant in t:
        schedule, _, pace = variant.partition("@")
        got = times.of([(shape, tokens, ep, f"{schedule}@off"), (shape, tokens, ep, variant)])
        if got is not None and pace != "off" and variant not in _NOT_FUSED:
            (off, time_ns), _ = got
            gains[(schedule, pace or "default")].append(off / time_ns)
    if not gains:
        return []
    lines = ["", "Store pacing: time unpaced (`@off`) over time paced, same schedule, per pacing "
                 "(`slower paced`: configurations where pacing loses).", "",
             "| schedule | pacing | configs | geomean | min | max | slower paced |", "|---|---|---|---|---|---|---|"]
    for (schedule, pace), g in sorted(gains.items()):
        s = _stats(g)
        lines.append(f"| {schedule} | {pace} | {s['configs']} | {s['geomean']:.3f} | {s['min']:.3f} | {s['max']:.3f} "
                     f"| {s['losses']} of {s['configs']} |")
    # Pacing and order together, over the unpaced baseline: a different question from the same-pacing
    # speedups above, so both the oracle and the best constant paced variant are given.
    paced = sorted({k[3] for k in t if k[3] not in _NOT_FUSED and _pacing(k[3]) == ""})
    per_cfg = {}  # configuration -> (unpaced expert_wave, {paced variant: time}), on one basis
    for c in {k[:3] for k in t if (*k[:3], "expert_wave@off") in t}:
        there = [v for v in paced if (*c, v) in t]
        if there:
            (off, *tv), _ = times.of([(*c, "expert_wave@off")] + [(*c, v) for v in there])
            per_cfg[c] = (off, dict(zip(there, tv)))
    if per_cfg:
        cfgs = list(per_cfg)
        const = {v: geomean([off / tv[v] for off, tv in per_cfg.values() if v in tv]) for v in paced
                 if any(v in tv for _, tv in per_cfg.values())}
        best = max(const, key=lambda v: (const[v], v))
        oracle = [off / min(tv.values()) for off, tv in per_cfg.values()]
        lines += ["", f"Pacing and order together, over unpaced `expert_wave` ({len(cfgs)} configurations; not a "
                      "same-pacing comparison): best constant paced variant "
                      f"`{best}` geomean {const[best]:.3f}; oracle: Best paced schedule per configuration over "
                      f"unpaced `expert_wave` geomean {geomean(oracle):.3f}, max {max(oracle):.3f}."]
    return lines


SUMMARY_TITLE = "# MoE fused kernel: schedules vs expert_wave (EP>1, loopback on one GPU)"
SUMMARY_INTRO = ("Time of the fused persistent kernel (dispatch, Linear-1 + SwiGLU, Linear-2 + combine push); "
                 "`unfused` is the serial pipeline with the same exchange bytes. `host`: rows for other ranks "
                 "cross PCIe into pinned memory (the X-Stage path); `hbm`: they stay in device memory (a control "
                 "that isolates the effect of task order from the effect of the store path). A variant without "
                 "`@` runs with the run's default store pacing; `@off` is unpaced.")


def _ep1_section(ep1: list[dict], chain_name: str = "chain", label: str = "") -> list[str]:
    """EP=1: each schedule's fused time over the grouped_mm chain (`chain_name`); best constant schedule
    and oracle."""
    t = _times(ep1)
    chain = {k[:3]: x for k, x in t.items() if k[3] == chain_name}
    schedules = sorted({k[3] for k in t if k[3] not in _NOT_FUSED})
    ratio = {s: {c: t[(*c, s)] / chain[c] for c in chain if (*c, s) in t} for s in schedules}
    ratio = {s: r for s, r in ratio.items() if r}
    if not ratio:
        return []
    const = min(ratio, key=lambda s: (geomean(list(ratio[s].values())), s))
    what = {"chain": "grouped_mm", "chain_fp8": "FP8 `_scaled_grouped_mm` (`chain_fp8`)"}.get(chain_name, chain_name)
    lines = ["", f"## EP=1{label}: fused kernel vs the {what} compute chain (same routing)", "",
             "fused / chain per schedule (lower is better; over 1: the fused kernel is slower):", "",
             "| schedule | configs | geomean | min | max | slower in |", "|---|---|---|---|---|---|"]
    for s, r in sorted(ratio.items()):
        v = list(r.values())
        lines.append(f"| {s} | {len(v)} | {geomean(v):.2f} | {min(v):.2f} | {max(v):.2f} | "
                     f"{sum(x > 1 for x in v)} of {len(v)} |")
    calls = _times(ep1, "call_ns")
    lines += ["", f"Best constant schedule (by geomean): `{const}`. Oracle: the fastest schedule per configuration, "
                  "chosen after measuring. Ratios with the top-k reduce add `reduce_ns` to the fused time. These "
                  "ratios are of kernel times (the chain has no call time); `call`: the public call of "
                  f"`{const}` (`call_ns`, plan and launches included) where measured, over the chain.", "",
              f"| shape | tokens | chain (us) | chain TFLOP/s | {const} (us) | {const}/chain | {const} call (us) | "
              "call/chain | oracle (us) | oracle TFLOP/s | reduce (us) | oracle/chain | (oracle+reduce)/chain |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r["shape"], int(r["tokens"]), int(r["ep"]), r["variant"]): r for r in ep1}
    for shape in _shape_order({c[0] for c in chain}):
        for c in sorted(c for c in chain if c[0] == shape):
            fz = [by_key[(*c, s)] for s in ratio if (*c, s) in by_key]
            if not fz:
                continue
            ch, f = by_key[(*c, chain_name)], min(fz, key=lambda r: float(r["time_ns"]))
            ct, ft, rt = float(ch["time_ns"]), float(f["time_ns"]), float(f["reduce_ns"] or 0)
            k, call = t.get((*c, const)), calls.get((*c, const))
            kc = f"{k / 1e3:.0f} | {k / ct:.2f}" if k else " | "
            kc += f" | {call / 1e3:.0f} | {call / ct:.2f}" if call else " |  | "
            lines.append(f"| {shape} | {c[1]} | {ct / 1e3:.0f} | {float(ch['tflops']):.0f} | {kc} | {ft / 1e3:.0f} "
                         f"({f['variant']}) | {float(f['tflops']):.0f} | {rt / 1e3:.0f} | {ft / ct:.2f} | "
                         f"{(ft + rt) / ct:.2f} |")
    return lines


SUMMARY_COLUMNS = (*MOE_COLUMNS, "reduce_ns", "tflops")  # what the summary reads, beyond the planner's


def read_moe_csv(path) -> list[dict]:
    """The rows of a `moe.csv`, checked before anything is summarised: the file
    (`xstage.results.io.read_table`), sizes, variants, finite positive times
    (`xstage.sched.measured.check_moe_rows`), the TFLOP/s of every row and the call columns where a
    row has them (`xstage.bench.call_summary.check_call_cells`; files from before have none)."""
    table = read_table(path, {"moe": SUMMARY_COLUMNS})
    check_moe_rows(table.rows, str(table.path), table.lines)
    for i, r in enumerate(table.rows):
        cell_number(r, "tflops", table.where(i), positive=True)
        check_call_cells(r, table.where(i))
    return table.rows


def summarize(out_dir, title: str = SUMMARY_TITLE, intro: str = SUMMARY_INTRO, rows: list[dict] | None = None) -> dict:
    """Same-pacing speedups of each variant over expert_wave, plots, and summary.md from the CSV.

    Returns {path: {variant: {configs, geomean, max, min, losses, baseline, basis}}}. `title` and `intro`
    head summary.md (other grids writing the same columns pass their own). `rows`: the CSV's rows as
    `read_moe_csv` gives them, read before (so that a malformed file is refused before any output)."""
    out = Path(out_dir)
    rows = read_moe_csv(out / "moe.csv") if rows is None else rows
    for r in rows:  # rows from before FP8 have no dtype column: BF16
        r["dtype"] = r.get("dtype") or "bf16"
    lines = [title, "", intro, ""]
    summary: dict = {}
    dtypes = sorted({r["dtype"] for r in rows}, key=lambda d: (d != "bf16", d))
    for dtype in dtypes:
        timed = [r for r in rows if r["dtype"] == dtype and r.get("time_ns") not in ("", None)]
        multi_all = [r for r in timed if int(r["ep"]) > 1]
        label = "" if dtype == "bf16" else f", {dtype}"
        paths = sorted({r["path"] for r in multi_all}, key=lambda p: (p != "host", p))
        for path in paths:
            sel = [r for r in multi_all if r["path"] == path]
            section, by_path = _speedup_section(sel, path, label)
            lines += section + _pacing_section(sel)
            summary[path if dtype == dtypes[0] else f"{path}:{dtype}"] = by_path
        ep1 = [r for r in timed if int(r["ep"]) == 1]
        lines += _ep1_section(ep1, "chain_fp8" if dtype == "fp8" else "chain", label)
    lines += fp8_sections(rows) + call_sections(rows)
    if rows:
        env = rows[-1]
        commits = sorted({r.get("git_commit", "") or "unknown" for r in rows})
        lines += ["", f"Machine: {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, "
                      f"triton {env.get('triton')}, {env.get('date')}; commit {', '.join(commits)}; "
                      "block (BMxBN1xBN2xBK) per row in moe.csv."]
    write_text(out / "summary.md", "\n".join(lines) + "\n")
    host = [r for r in rows if r["dtype"] == "bf16" and int(r["ep"]) > 1 and r["path"] == "host"
            and r.get("time_ns") not in ("", None)]
    sp, _ = _speedups(Times.of_rows(host))
    for shape in _shape_order({r["shape"] for r in host}):
        sel = [dict(variant=v, ep=c[2], tokens=c[1], speedup=x) for v, s in sp.items() if v not in _NOT_FUSED
               for c, x in s.items() if c[0] == shape]
        if sel:
            plot_lines(sel, "tokens", "speedup", ["variant", "ep"], out / f"speedup-{shape}.png", logx=True,
                       title=f"{shape}: speedup over expert_wave at the same pacing (host loopback)", hline=1.0)
    return summary
