"""`xstage demo`: the main job on any machine, GPU or not.

Loads the embedded default profile (the H200 host link), prints its parameters with confidence
intervals and held-out error, predicts its own measurements, plans the fused MoE kernel's schedule
for one configuration with that profile and the embedded tile costs, and writes plots and a short
markdown report into the output folder.

The plan is what `xstage plan moe` plans for that configuration (`PLAN_COMMAND`): the same candidates
(`xstage.moe.schedule.CANDIDATES`), the kernel's default pacing (`auto`), the profile's SM count as CTAs.
The output folder and its files (`DEMO_FILES`) are checked before any work: each is new or one `xstage
demo` wrote before, unless `--force` (`xstage.results.output.Outputs`). Progress goes to standard
error, none under `--json`.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import numpy as np

from xstage.errors import InputError
from xstage.model import (
    load_default_profile,
    load_reference_data,
    plot_issue_vs_burst,
    plot_issue_vs_gap,
    predict,
    read_observations,
)
from xstage.model.interference import load_default_interference
from xstage.model.params import MEANINGS, PARAM_UNITS
from xstage.results import emit, markdown_table
from xstage.results.output import Outputs, write_text
from xstage.results.progress import Progress, say
from xstage.sched.costs import load_default_costs
from xstage.sched.moe import MoeConfig
from xstage.sched.pacing import resolve_pacing
from xstage.sched.plan import plan_moe
from xstage.sched.timeline import plot_timeline
from xstage.spec.pacing import spec_of
from xstage.spec.schedule import CANDIDATES

_PLAN_CONFIG = ("H4096-I2048-E256-K6", 2048, 8)
_PLAN_PACING = "default"  # the path's fixed default pacing: one row per schedule
PLAN_COMMAND = "xstage plan moe --shape {} --tokens {} --ep {} --pacing default".format(*_PLAN_CONFIG)
REPORT, PLOTS = "report.md", ("issue_vs_burst.png", "issue_vs_gap.png", "plan_timeline.png")
DEMO_FILES = (REPORT, *PLOTS)  # everything the demo writes in its folder


def _fmt_value(v: float, unit: str) -> str:
    if math.isinf(v):
        return "inf"
    if unit == "B/s":
        return f"{v / 1e9:.4g} GB/s"
    if unit == "B":
        return f"{v / 1024:.4g} KiB"
    if unit == "ns":
        return f"{v:.4g} ns"
    return f"{v:.4g}"


def _param_rows(profile) -> list[dict]:

    rows = []
    for name, value in profile.params.to_dict().items():
        v = float(value)
        unit = PARAM_UNITS.get(name, "")
        lo, hi = profile.intervals.get(name, (math.nan, math.nan))
        interval = "-" if math.isnan(lo) else f"[{_fmt_value(lo, unit)}, {_fmt_value(hi, unit)}]"
        status = "fitted" if name in profile.fitted else "fixed"
        if profile.identified and name in profile.identified and not profile.identified[name]:
            status = "not identified"
        rows.append({"parameter": name, "meaning": MEANINGS.get(name, ""), "value": _fmt_value(v, unit),
                     f"{profile.interval_label} interval": interval, "status": status})
    return rows


def _data_for(profile):
    """The measurements the profile was fitted to, when they ship with the package."""


    name = str(profile.provenance.get("packaged_data") or Path(str(profile.provenance.get("data_file", ""))).name)
    ref = resources.files("xstage.data").joinpath(name) if name else None
    if ref is not None and ref.is_file():
        return read_observations(Path(str(ref))), name
    return load_reference_data(), "h200-hostlink-probe.csv"


def _plan_section(profile, out: Path, quiet: bool = False) -> tuple[list[dict], str | None, str]:

    shape, tokens, ep = _PLAN_CONFIG
    try:
        costs = load_default_costs("moe")
    except InputError as exc:
        return [], None, f"planning skipped: {exc}"
    cfg = MoeConfig.parse(shape, tokens_per_rank=tokens, ep=ep)
    ctas = profile.sm_count
    # What `PLAN_COMMAND` plans: every candidate at the path's default pacing, interference term on.
    pacing = resolve_pacing(_PLAN_PACING, profile.path, ep)
    with Progress(len(CANDIDATES), "demo: MoE schedules simulated", quiet=quiet) as bar:
        rows = plan_moe(cfg, profile.params, costs, num_ctas=ctas, candidates=CANDIDATES, pacing=pacing,
                        progress=bar.callback, interference=load_default_interference(profile.path))
    wave = next(r for r in rows if r.schedule == "expert_wave")
    table = [{"schedule": r.schedule, "time_us": r.time_ns / 1e3,
              "speedup_vs_expert_wave": wave.time_ns / r.time_ns,
              "stall_us_per_cta": r.breakdown["stall"] / 1e3 / ctas} for r in rows]
    png = plot_timeline(rows[0].result, out / PLOTS[2], capacity=profile.params.capacity,
                        title=f"{shape} T={tokens} EP={ep} over {profile.path}: {rows[0].schedule} (predicted)")
    return table, str(png), (f"{shape}, {tokens} tokens/rank, EP={ep}, {ctas} CTAs, remote stores over "
                             f"`{profile.path}`, store pacing {spec_of(pacing)} (GB/s:KiB). "
                             f"This table is what `{PLAN_COMMAND}` plans (on a GPU, add `--ctas {ctas}`): the "
                             f"same candidates ({', '.join(f'`{c}`' for c in CANDIDATES)}), the same default "
                             f"pacing (`{_PLAN_PACING}`), the same predicted times in us.")


def run_demo(args) -> int:
    outs = Outputs("xstage demo", force=args.force)
    out = outs.folder(args.out, "-o", files=DEMO_FILES)
    with outs:
        payload, report = _demo(out, args.json)
    emit(payload, args.json, report + f"\nwritten to {out}/")
    return 0


def _demo(out: Path, quiet: bool) -> tuple[dict, str]:
    profile = load_default_profile("host")
    params = _param_rows(profile)
    loco = profile.fit_quality.get("loco") or profile.fit_quality.get("heldout") or {}
    data, data_name = _data_for(profile)
    say(f"demo: predicting the {profile.path} profile's own measurements ({data_name}) and plotting them",
        quiet=quiet)
    pred = predict(profile, data)
    err = np.abs(np.asarray(pred["rel_error"], dtype=float))
    plots = [plot_issue_vs_burst(profile, data, out / PLOTS[0]), plot_issue_vs_gap(profile, data, out / PLOTS[1])]
    say(f"demo: planning the fused MoE kernel ({PLAN_COMMAND}: {len(CANDIDATES)} schedules)", quiet=quiet)
    plan_rows, plan_png, plan_title = _plan_section(profile, out, quiet)
    if plan_png:
        plots.append(plan_png)
    prov = profile.provenance
    lines = [
        f"# xstage demo: the embedded `{profile.path}` profile",
        "",
        f"Measured on {prov.get('gpu', '?')} (driver {prov.get('driver', '?')}, torch {prov.get('torch', '?')}, "
        f"triton {prov.get('triton', '?')}, {prov.get('date', '?')}); data `{data_name}`.",
        "",
        "The Burst-Gap model of a store path: an SM issues remote stores at `r0` until `c_sm` bytes of its own",
        "are outstanding; the path drains them at `drain` and holds at most `capacity` bytes from all SMs; past",
        "either level, later stores stall. `fitted`: estimated from the measurements, with the interval",
        "below; `fixed`: held at its value; `not identified`: the data cannot tell it apart.",
        "",
        markdown_table(params, ["parameter", "meaning", "value", f"{profile.interval_label} interval", "status"]),
        "",
        "Errors: |predicted - measured| / measured issue time of a burst. The held-out error predicts",
        "configurations the fit did not see; the in-sample error, those it did.",
        "",
        f"Held-out error ({loco.get('rule', 'leave one configuration out')}; {loco.get('n_configs', '?')} "
        "configurations): "
        f"median {100 * loco.get('median_rel_error', math.nan):.1f}%, "
        f"p90 {100 * loco.get('p90_rel_error', math.nan):.1f}%.",
        f"In-sample error over {len(err)} burst observations: median {100 * np.median(err):.1f}%, "
        f"p90 {100 * np.quantile(err, 0.9):.1f}%.",
        "",
        "## Planning the fused MoE kernel with this profile",
        "",
        plan_title,
        "",
        "Columns: `time_us`, the predicted kernel time; `speedup_vs_expert_wave`, the expert-wave order's time",
        "over this one's (above 1: faster); `stall_us_per_cta`, the time a CTA's stores wait for room on the",
        "path. The planner (`schedule=\"model_guided\"`) runs the first row.",
        "",
        markdown_table(plan_rows, list(plan_rows[0])) if plan_rows else "",
        "",
        "## Plots",
        "",
        *(f"![{Path(p).stem}]({Path(p).name})\n" for p in plots),
        "- `issue_vs_burst`: the issue time of one burst against its size, measured points over the model's",
        "  curve, per number of storing SMs; the knee is where the SM's window fills.",
        "- `issue_vs_gap`: the same against the compute gap between bursts: long gaps let the path drain.",
        "- `plan_timeline`: the planner's pick, per CTA over time (see the axis), and the path's backlog",
        "  against its capacity.",
        "",
        "## What to run next",
        "",
        "- `xstage model --burst 64KiB --gap 20us --sms 8`: predict a burst pattern of your own.",
        f"- `{PLAN_COMMAND}`: the planner's table for this configuration, with its timeline (`--plot t.png`).",
        "- On a GPU node: `xstage probe --path host --sweep all -o DIR` measures your own path, and",
        "  `xstage fit` turns it into a profile the planner can decide with (`XSTAGE_CALIBRATION`).",
    ]
    report = "\n".join(lines) + "\n"
    write_text(out / REPORT, report)
    payload = {"profile": profile.to_dict(), "in_sample_median_rel_error": float(np.median(err)),
               "plan": plan_rows, "plots": [str(p) for p in plots], "report": str(out / REPORT)}
    return payload, report


