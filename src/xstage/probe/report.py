"""Analyse a probe output folder: summary, experiments, plots, profile fit, held-out check, markdown.

`analyse(out_dir)` reads `raw/*.csv` (or, for committed data, only `summary.csv`), writes
`summary.csv`, `experiments.json`, `plots/*.png`, `fit.json`, `profile.json` (a
`xstage.model.profile.Profile`) and `summary.md`, and returns a dict
with the figures and a short text.

Fit and held-out check: the summary rows of the default kernel shape (8 warps, 16-byte stores, one
CTA per SM; the model has no term for the other knobs) are pooled over repeats and become
`xstage.model.data.Observations`. Configurations (path, n_sm, burst_bytes) are sorted and every
`HOLDOUT_EVERY`-th one (starting at the second; separately among those with multi-burst launches
and the others) is held out; `xstage.model.fit.fit_path` fits the rest (with bootstrap intervals)
and the held-out CTA-median issue times are predicted and compared (relative error, every
configuration weighing equally, as `xstage.model.heldout.evaluate_loco` does).

Example:
    result = analyse("benchmarks/results/h200-host-probe", bootstrap=20)
    print(result["text"])
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xstage.env import environment
from xstage.errors import InputError
from xstage.model.data import CONFIG_COLUMNS, load_reference_data, observations_from_rows
from xstage.model.fit import DEFAULT_STRUCTURE, fit_path, weighted_quantile
from xstage.model.predict import predict_rows
from xstage.model.profile import Profile
from xstage.probe.analysis import SUMMARY_FILE_COLUMNS, experiments, plot_experiments, read_summary, summarise_raw
from xstage.results.io import read_json, write_csv_atomic
from xstage.results.output import write_text
from xstage.results.plots import pyplot, save_figure
from xstage.results.progress import Progress, say
from xstage.results.tables import markdown_table
from xstage.version import __version__

HOLDOUT_EVERY = 4
BYTES_REGIME_NS = 10_000.0

POOLED = ("launch", "gap_ns", "burst_index", "burst_last", "issue_median_ns", "issue_p10_ns", "issue_p90_ns",
          "issue_max_ns", "completion_median_ns")
DEFAULT_KNOBS = {"warps": 8, "vector_bytes": 16, "ctas_per_sm": 1}
FIT_SWEEPS = ("first", "periodic", "twoburst", "completion")


def _fit_rows(summary: list[dict], path: str) -> list[dict]:
    return [r for r in summary if r["path"] == path and r["sweep"] in FIT_SWEEPS
            and all(int(r[k]) == v for k, v in DEFAULT_KNOBS.items())]


def pool_for_fit(rows: list[dict]) -> list[dict]:
    """One summary row per configuration, gap and burst span, pooled over repeated launches (medians):
    bursts 0 and 1 each, and the steady span (second half) of longer launches. The simulator then runs
    once per configuration and gap instead of once per launch."""
    groups: dict = {}
    for r in rows:
        key = (r["sweep"], *(r[c] for c in CONFIG_COLUMNS), r["n_bursts"])
        groups.setdefault(key, []).append(r)
    out = []
    for launch_id, (key, rs) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
        n_bursts = key[-1]
        spans = [(0, 0)] + ([(1, 1)] if n_bursts > 1 else []) + ([(n_bursts // 2, n_bursts - 1)] if n_bursts > 3
                                                                 else [])
        gaps = [r["gap_ns"] for r in rs if r["burst_index"] > 0 and not math.isnan(r["gap_ns"])]
        for lo, hi in spans:
            sel = [r for r in rs if lo <= r["burst_index"] <= hi]
            cpl = [r["completion_median_ns"] for r in sel if not math.isnan(r["completion_median_ns"])]
            out.append({**{c: rs[0][c] for c in rs[0] if c not in POOLED}, "launch": launch_id,
                        "gap_ns": float(np.median(gaps)) if gaps else 0.0, "burst_index": lo, "burst_last": hi,
                        "issue_median_ns": float(np.median([r["issue_median_ns"] for r in sel])),
                        "issue_p10_ns": float(np.median([r["issue_p10_ns"] for r in sel])),
                        "issue_p90_ns": float(np.median([r["issue_p90_ns"] for r in sel])),
                        "issue_max_ns": float(max(r["issue_max_ns"] for r in sel)),
                        "completion_median_ns": float(np.median(cpl)) if cpl else math.nan})
    return out


def holdout_split(configs: list[tuple], multi_burst=()) -> tuple[list[tuple], list[tuple]]:
    """(calibration, held-out) configurations: every HOLDOUT_EVERY-th of the sorted list, from the
    second, taken separately among the configurations with multi-burst launches (`multi_burst`) and
    the others, so that periodic and two-burst behaviour is held out as well as first bursts."""
    multi = set(multi_burst)
    held = []
    for group in (sorted(c for c in configs if c in multi), sorted(c for c in configs if c not in multi)):
        held += [c for i, c in enumerate(group) if i % HOLDOUT_EVERY == 1]
    return sorted(c for c in configs if c not in held), sorted(held)


def fit_and_check(summary: list[dict], path: str, *, bootstrap: int = 20, structure: str | None = None,
                  progress=None, on_point_fit=None) -> dict:
    """Fit the calibration configurations of `path` and predict the held-out ones (see module doc).
    `progress(done, total)` follows the bootstrap rounds, `on_point_fit(seconds)` the point fit before
    them (`xstage.model.fit.fit_path`)."""

    rows = pool_for_fit(_fit_rows(summary, path))
    if not rows:
        raise InputError(f"fit: no summary rows of path {path} with the default kernel shape {DEFAULT_KNOBS}")
    obs = observations_from_rows(rows, source=f"probe {path}")
    keys = obs.config_keys()
    multi = {k for k, nb in zip(keys, obs.n_bursts) if nb > 1}
    calib, held = holdout_split(obs.configs(), multi)
    m_held = np.array([k in set(held) for k in keys])
    res = fit_path(obs.select(~m_held), structure=structure or DEFAULT_STRUCTURE, bootstrap=bootstrap,
                   progress=progress, on_point_fit=on_point_fit)
    test = obs.select(m_held)
    pred, _ = predict_rows(res.params, test)
    rel = pred / test.issue_med - 1.0
    cnt: dict = {}
    for k in test.config_keys():
        cnt[k] = cnt.get(k, 0) + 1
    w = np.array([1.0 / cnt[k] for k in test.config_keys()])
    per_cfg = []
    for cfg in held:
        m = np.array([k == cfg for k in test.config_keys()])
        per_cfg.append({"n_sm": cfg[1], "burst_bytes": cfg[2], "rows": int(m.sum()),
                        "median_rel_error": float(np.median(np.abs(rel[m]))),
                        "measured_ns": float(np.median(test.issue_med[m])),
                        "predicted_ns": float(np.median(pred[m]))})
    heldout = {"median_rel_error": weighted_quantile(np.abs(rel), w, 0.5),
               "p90_rel_error": weighted_quantile(np.abs(rel), w, 0.9), "n_configs": len(held),
               "rule": f"every {HOLDOUT_EVERY}th configuration (path, n_sm, burst_bytes) of the sorted list, "
                       "from the second, among those with multi-burst launches and among the others"}
    return {
        "profile": _profile(res, obs.select(~m_held), heldout, bootstrap).to_dict(),
        "path": path, "structure": res.structure, "params": res.params.to_dict(),
        "fitted": list(res.fitted), "identified": res.identified, "rel_se": res.rel_se,
        "intervals": {k: list(v) for k, v in res.intervals.items()}, "bootstrap": bootstrap,
        "fit_residuals": res.residuals, "cross_checks": res.cross_checks,
        "calibration_configs": len(calib), "heldout_configs": len(held),
        "heldout_median_rel_error": heldout["median_rel_error"],
        "heldout_p90_rel_error": heldout["p90_rel_error"],
        "heldout": per_cfg,
        "points": [{"measured_ns": float(a), "predicted_ns": float(b), "burst_index": int(i), "n_sm": int(n)}
                   for a, b, i, n in zip(test.issue_med, pred, test.burst_lo, test.n_sm)],
    }


def _profile(res, calib, heldout: dict, bootstrap: int):
    """A `xstage.model.profile.Profile` of the calibration fit, with the held-out error as its quality."""

    provenance = {
        **{k: calib.env.get(k, "") for k in ("gpu", "driver", "torch", "triton", "date")},
        "measured_git_commit": calib.env.get("git_commit", ""), "path": str(calib.path[0]),
        "sm_counts": sorted({int(n) for n in calib.n_sm}), "burst_bytes": sorted({int(b) for b in calib.burst_bytes}),
        "n_configs": res.n_configs, "n_rows": res.n_rows, "data_file": "summary.csv (xstage probe)",
        "fitted_with": {"xstage": __version__, "git_commit": environment()["git_commit"],
                        "numpy": np.__version__, "bootstrap_rounds": bootstrap},
    }
    return Profile(path=str(calib.path[0]), params=res.params, intervals=res.intervals, fitted=list(res.fitted),
                   identified=res.identified, rel_se=res.rel_se,
                   fit_quality={"residuals": res.residuals, "cross_checks": res.cross_checks, "heldout": heldout},
                   structure={"chosen": res.structure, "free": list(res.fitted)}, provenance=provenance)


def _plot_heldout(fit: dict, out_dir: Path) -> Path:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5.5, 5))
    meas = np.array([p["measured_ns"] for p in fit["points"]])
    pred = np.array([p["predicted_ns"] for p in fit["points"]])
    ax.loglog(meas, pred, "o", ms=3, alpha=0.6)
    lo, hi = float(min(meas.min(), pred.min())), float(max(meas.max(), pred.max()))
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xlabel("measured CTA-median issue time (ns)")
    ax.set_ylabel("model (ns)")
    ax.set_title(f"held-out configurations, path {fit['path']}: median |err| "
                 f"{100 * fit['heldout_median_rel_error']:.1f}%")
    ax.grid(True, alpha=0.3)
    return save_figure(fig, out_dir / "plots" / "heldout_model_vs_measured.png")


def compare_reference(exp: dict, path: str) -> list[dict]:
    """Our first-burst and back-to-back steady issue times next to the independent CUDA reference
    probe (`xstage.model.data.load_reference_data`) wherever both measured the same (n_sm, burst)."""

    try:
        ref = load_reference_data().for_path(path)
    except InputError:
        return []
    first = {}
    steady = {}
    for i in range(len(ref)):
        key = (int(ref.n_sm[i]), int(ref.burst_bytes[i]))
        if ref.burst_lo[i] == 0:
            first.setdefault(key, []).append(float(ref.issue_med[i]))
        elif ref.burst_lo[i] > 1 and ref.gap_ns[i] < 100.0:
            steady.setdefault(key, []).append(float(ref.issue_med[i]))
    out = []
    for e in exp.get("first", []):
        key = (e["n_sm"], e["burst_bytes"])
        if key in first:
            r = float(np.median(first[key]))
            out.append({"measure": "first burst", "n_sm": key[0], "burst_bytes": key[1], "xstage_ns": e["issue_ns"],
                        "reference_ns": r, "ratio": e["issue_ns"] / r})
    for e in exp.get("periodic", []):
        key = (e["n_sm"], e["burst_bytes"])
        if e["gap_iters"] == 0 and key in steady:
            r = float(np.median(steady[key]))
            out.append({"measure": "steady, no gap", "n_sm": key[0], "burst_bytes": key[1],
                        "xstage_ns": e["steady_ns"], "reference_ns": r, "ratio": e["steady_ns"] / r})
    return out


def _fmt_params(fit: dict) -> list[dict]:
    rows = []
    for name in fit["fitted"]:
        v = fit["params"][name]
        lo, hi = fit["intervals"].get(name, (math.nan, math.nan))
        rows.append({"parameter": name, "value": v, "interval_low": lo, "interval_high": hi,
                     "identified": fit["identified"].get(name)})
    return rows


def _markdown(exp: dict, fit: dict | None, fit_error: str | None, env: dict, run: dict, ref: list[dict]) -> str:
    lines = ["# X-Stage probe summary", ""]
    lines.append(f"GPU {env.get('gpu', '?')}, driver {env.get('driver', '?')}, torch {env.get('torch', '?')}, "
                 f"triton {env.get('triton', '?')}, xstage {env.get('git_commit', '?')}, date {env.get('date', '?')}.")
    if run.get("timing"):
        lines.append(f"Path peer: {run['timing']}.")
    lines.append("")
    if "first" in exp:
        lines += ["## First-burst issue time (CTA median, median of launches)", "",
                  markdown_table(exp["first"], ["n_sm", "burst_bytes", "issue_ns", "issue_p90_ns", "agg_GBps"]), ""]
    if "periodic" in exp:
        lines += ["## Periodic bursts", "", markdown_table(
            exp["periodic"], ["n_sm", "burst_bytes", "gap_iters", "gap_ns", "issue0_ns", "onset_index",
                              "steady_ns"]), ""]
    if "twoburst" in exp:
        lines += ["## Two bursts vs gap (model: slope -1 while the second burst is backpressured)", "",
                  markdown_table(exp["twoburst"], ["n_sm", "burst_bytes", "issue0_ns", "points_backpressured",
                                                   "slope", "r2", "recovery_gap_ns"]), ""]
    if "completion" in exp:
        lines += ["## Completion (fence.sc.sys after one burst): line through (aggregate bytes, time)", "",
                  markdown_table(exp["completion"], ["n_sm", "drain_Bps", "latency_ns"]), ""]
    if "knobs" in exp:
        lines += ["## Kernel shape (warps, store width, CTAs per SM)", "", markdown_table(
            exp["knobs"], ["n_sm", "burst_bytes", "warps", "vector_bytes", "ctas_per_sm", "issue_ns",
                           "agg_GBps"]), ""]
    if "peers" in exp:
        lines += ["## One peer vs all peers", "", markdown_table(
            exp["peers"], ["peer_mode", "n_sm", "burst_bytes", "n_bursts", "issue0_ns", "steady_ns"]), ""]
    if ref:
        within = sum(1 for r in ref if abs(r["ratio"] - 1.0) <= 0.10)
        big = [r for r in ref if r["reference_ns"] >= BYTES_REGIME_NS]
        big_within = sum(1 for r in big if abs(r["ratio"] - 1.0) <= 0.10)
        lines += ["## Against the independent CUDA reference probe (xstage/data/h200-hostlink-probe.csv, "
                  "same GPU model)", "",
                  f"{within} of {len(ref)} shared configurations within 10%; where the reference issue time is "
                  f">= {BYTES_REGIME_NS / 1e3:.0f} us (bytes and the X-Stage dominate, not fixed per-burst costs): "
                  f"{big_within} of {len(big)}.", "",
                  markdown_table(ref, ["measure", "n_sm", "burst_bytes", "xstage_ns", "reference_ns", "ratio"]), ""]
    lines += ["## Model fit and held-out check", ""]
    if fit is None:
        lines.append(f"Not fitted: {fit_error}")
    else:
        lines += [f"Structure `{fit['structure']}`, {fit['calibration_configs']} calibration configurations, "
                  f"{fit['heldout_configs']} held out (every {HOLDOUT_EVERY}th), {fit['bootstrap']} bootstrap "
                  "rounds.", "",
                  markdown_table(_fmt_params(fit),
                                 ["parameter", "value", "interval_low", "interval_high", "identified"], floatfmt=".4g"),
                  "",
                  f"Held-out median relative error of the CTA-median issue time: "
                  f"**{100 * fit['heldout_median_rel_error']:.1f}%** "
                  f"(p90 {100 * fit['heldout_p90_rel_error']:.1f}%); on the calibration set "
                  f"{100 * fit['fit_residuals']['issue_median_rel']:.1f}%.", "",
                  markdown_table(fit["heldout"], ["n_sm", "burst_bytes", "rows", "measured_ns", "predicted_ns",
                                                  "median_rel_error"]), "",
                  "Cross-checks: " + ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}"
                                               for k, v in fit["cross_checks"].items()), ""]
    return "\n".join(lines)


def _read_run(out_dir: Path) -> dict:
    """run.json (what `xstage.probe.session.measure` records), or {} where there is none."""
    path = out_dir / "run.json"
    if not path.exists() and not path.is_symlink():
        return {}
    # its writer keeps NaN (a median of no launches), which only the ratio field can hold
    run = read_json(path, "probe run record", allow_nonfinite=True)
    if not isinstance(run, dict):
        raise InputError(f"probe run record {path}: expected a JSON object, got {type(run).__name__}")
    return run


def _fit_with_progress(summary: list[dict], path: str, bootstrap: int, quiet: bool) -> dict:
    """`fit_and_check` with its fits (the point fit, then the bootstrap rounds) on one progress bar."""
    say(f"probe: fitting path {path}: 1 point fit + {bootstrap} bootstrap rounds", quiet=quiet)
    with Progress(1 + bootstrap, "probe: fits", quiet=quiet) as bar:

        def point_done(seconds: float) -> None:
            if bootstrap:
                say(f"the point fit took {seconds:.1f} s; {bootstrap} bootstrap rounds follow", quiet=quiet)
            bar.advance(1)

        return fit_and_check(summary, path, bootstrap=bootstrap, on_point_fit=point_done,
                             progress=lambda done, total: bar.advance(1 + done - bar.done))


@dataclass
class ProbeInputs:
    """What an analysis reads from its folder, checked: the run record, and the summary rows made
    from `raw/*.csv` (`raw_summary`, summary.csv still to be written) or read from summary.csv."""

    run: dict
    raw_summary: list[dict] | None
    summary: list[dict] | None


def load_probe_dir(out_dir, *, quiet: bool = True) -> ProbeInputs:
    """Read and check every input of `analyse` in `out_dir`, writing nothing (so that a command can
    refuse a malformed folder before it touches any output)."""
    out_dir = Path(out_dir)
    run = _read_run(out_dir)
    if sorted((out_dir / "raw").glob("*.csv")):
        n = len(sorted((out_dir / "raw").glob("*.csv")))
        with Progress(n, "probe: raw files summarised", quiet=quiet) as bar:
            return ProbeInputs(run, summarise_raw(out_dir, progress=bar.callback), None)
    if (out_dir / "summary.csv").exists() or (out_dir / "summary.csv").is_symlink():
        return ProbeInputs(run, None, read_summary(out_dir / "summary.csv"))
    raise InputError(f"-o {out_dir}: holds neither raw/*.csv nor summary.csv")


def analyse(out_dir, *, fit: bool = True, bootstrap: int = 20, path: str | None = None, quiet: bool = True,
            inputs: ProbeInputs | None = None) -> dict:
    """Summarise, reduce, plot and fit what `out_dir` holds; writes the files listed in the module doc.
    Every input is read and checked before the first file is written (`inputs`: what
    `load_probe_dir` read before). `quiet=False` reports progress on standard error (the fit takes
    tens of seconds)."""
    out_dir = Path(out_dir)
    inputs = inputs or load_probe_dir(out_dir, quiet=quiet)
    run, summary = inputs.run, inputs.summary
    if inputs.raw_summary is not None:
        write_csv_atomic(out_dir / "summary.csv", inputs.raw_summary, SUMMARY_FILE_COLUMNS)
        summary = read_summary(out_dir / "summary.csv")
    path = path or summary[0]["path"]
    exp = experiments(summary)
    write_text(out_dir / "experiments.json", json.dumps(exp, indent=1, default=str))
    plots = [str(p) for p in plot_experiments(exp, out_dir)]
    fit_res, fit_error = None, (None if fit else "skipped (--no-fit)")
    if fit:
        try:
            fit_res = _fit_with_progress(summary, path, bootstrap, quiet)
        except (InputError, ImportError) as exc:
            fit_error = str(exc)
    if fit_res is not None:

        Profile.from_dict(fit_res["profile"]).save(out_dir / "profile.json")
        write_text(out_dir / "fit.json", json.dumps({k: v for k, v in fit_res.items() if k != "profile"},
                                                    indent=1, default=str))
        plots.append(str(_plot_heldout(fit_res, out_dir)))
    env = {k: summary[0].get(k, "") for k in ("gpu", "driver", "torch", "triton", "git_commit", "date")}
    ref = compare_reference(exp, path)
    md = _markdown(exp, fit_res, fit_error, env, run, ref)
    write_text(out_dir / "summary.md", md)
    text = [f"probe {path}: {len(summary)} summary rows in {out_dir}"]
    if fit_res is not None:
        p = fit_res["params"]
        text.append(f"fit ({fit_res['structure']}): r0 {_g(p['r0'])} B/s, drain {_g(p['drain'])} B/s, "
                    f"c_sm {_g(p['c_sm'])} B, capacity {_g(p['capacity'])} B; held-out median error "
                    f"{100 * fit_res['heldout_median_rel_error']:.1f}%")
    elif fit:
        text.append(f"not fitted: {fit_error}")
    text.append(f"wrote summary.csv, experiments.json, summary.md and {len(plots)} plots")
    return {"out": str(out_dir), "path": path, "summary_rows": len(summary), "experiments": exp, "reference": ref,
            "fit": fit_res, "fit_error": fit_error, "plots": plots, "text": "\n".join(text)}


def _g(v) -> str:
    return v if isinstance(v, str) else f"{v:.4g}"
