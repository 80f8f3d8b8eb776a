"""`xstage model` (show a profile, predict a burst, plot) and `xstage fit` (data -> profile).

    xstage model [--profile P] [--burst 64KiB [--gap 20us] [--sms 132]] [--plot DIR [--data CSV]] [--json]
    xstage fit DATA.csv -o PROFILE.json [--path host] [--structure full] [--bootstrap 20] [--seed 0]
               [--loco] [--compare-structures] [--workers 1] [--json]

The embedded reference-fit host profile is regenerated from the packaged reference data with
`xstage fit src/xstage/data/h200-hostlink-probe.csv -o h200-host-profile.json --path host
--bootstrap 20 --compare-structures --workers 2` (then moved over `src/xstage/data/h200-host-profile.json`;
`xstage fit` replaces only a profile it wrote itself, unless `--force`).

Checked before any work: every number (`--burst` whole bytes in 1 B..64 GiB, `--gap` in 0..60 s,
`--sms` an integer in 1..4096, `--bootstrap` 0..10000, `--workers` 1..256), flags that need another
(`--gap`/`--sms` need `--burst`, `--data` needs `--plot`), the profile (`Profile.load`) and where
the output goes (`-o` a file in an existing folder, `--plot` a folder; an existing file is replaced only
if the same command wrote it, or with `--force`, and never an input: `xstage.results.output.Outputs`).
`xstage fit` states
how many fits it will run and, after timing the first, about how long the rest take; it keeps
finished bootstrap rounds in `PROFILE.json.bootstrap.jsonl` so that the same command, rerun after
an interrupt, runs only the missing rounds (the file is removed once the profile is written).
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import numpy as np

from xstage.bounds import MAX_BOOTSTRAP, MAX_SMS, MAX_WORKERS, check_int, number_from_text
from xstage.cli.args import add_force_option, path_arg
from xstage.errors import InputError
from xstage.model import closed_form as cf
from xstage.model import intervals as iv
from xstage.model.api import build_profile, loco_structures
from xstage.model.data import load_reference_data, read_observations
from xstage.model.fit import STRUCTURES, BootstrapStore, fit_key
from xstage.model.params import ADMISSIONS
from xstage.model.plots import plot_issue_vs_burst, plot_issue_vs_gap
from xstage.model.predict import simulate_launch, weighted_median
from xstage.model.profile import PATHS, Profile, load_default_profile
from xstage.model.simulate import ENGINES
from xstage.model.trace import BY, read_trace, score_trace
from xstage.results.io import write_csv_atomic
from xstage.results.output import Outputs, emit
from xstage.results.progress import Progress, say

KIB = 1024
MAX_BURST_BYTES = 64 * 1024**3  # 64 GiB per SM per burst: beyond any GPU's memory
MAX_GAP_NS = 60e9  # 60 s of compute between bursts
PREDICT_BURSTS = 24  # bursts per SM in the simulated launch, like the reference probe
STEADY_BURSTS = (12, 23)  # the bursts pooled for the steady state, like the reference probe
PLOT_SUFFIXES = ("-issue-vs-burst.png", "-issue-vs-gap.png")  # `--plot DIR` writes <path><suffix> in DIR

_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3,
               "kb": 1e3, "mb": 1e6, "gb": 1e9}
_TIME_UNITS = {"": 1.0, "ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*"


def parse_size(text: str, name: str = "size", max_bytes: float = MAX_BURST_BYTES) -> int:
    """Bytes from '65536', '64KiB', '4MiB', '1.5M' (binary K/M/G), '10MB' (decimal): a whole number of
    bytes in 1..`max_bytes`."""
    m = re.fullmatch(_NUMBER, str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise InputError(f"{name} must be a size such as 65536, 64KiB or 4MiB, got {text!r}")
    v = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if not v >= 1:
        raise InputError(f"{name} must be at least 1 byte, got {text!r}")
    if v > max_bytes:
        raise InputError(f"{name} must be at most {max_bytes / 1024**3:g} GiB, got {text!r}")
    if v != round(v):
        raise InputError(f"{name} must be a whole number of bytes, got {text!r} = {v:g} bytes")
    return int(round(v))


def parse_time(text: str, name: str = "time", max_ns: float = MAX_GAP_NS) -> float:
    """Nanoseconds from '2000', '2000ns', '20us', '1.5ms', '1s': a time in 0..`max_ns`."""
    m = re.fullmatch(_NUMBER, str(text))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise InputError(f"{name} must be a time >= 0 such as 2000 (ns), 20us or 1.5ms, got {text!r}")
    v = float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    if not v <= max_ns:
        raise InputError(f"{name} must be at most {max_ns / 1e9:g} s, got {text!r}")
    return v


def parse_count(text, name: str, lo: int, hi: int, what: str) -> int:
    """An integer in lo..hi from a command-line string (`xstage.bounds.check_int`)."""
    return check_int(number_from_text(text, name), name, lo, hi, what)


def _fmt(name: str, v: float) -> str:
    if isinstance(v, str) or v is None:
        return str(v)
    if math.isinf(v):
        return "inf"
    if name in ("r0", "drain", "r_fast"):
        return f"{v / 1e9:.2f} GB/s"
    if name in ("c_sm", "capacity", "b_fast"):
        return f"{v / 1024:.1f} KiB"
    if name in ("t0", "latency"):
        return f"{v:.1f} ns"
    return f"{v:.3g}"


def _fmt_ns(v: float) -> str:
    if v is None or not math.isfinite(v):
        return "inf" if v is not None and v > 0 else str(v)
    if abs(v) < 10_000:
        return f"{v:.0f} ns"
    if abs(v) < 10_000_000:
        return f"{v / 1e3:.1f} us"
    if abs(v) < 10e9:
        return f"{v / 1e6:.1f} ms"
    return f"{v / 1e9:.1f} s"


def _fmt_bytes(v: float) -> str:
    if not math.isfinite(v):
        return "inf"
    if v < 10 * KIB:
        return f"{v:.0f} B"
    if v < 10 * KIB**2:
        return f"{v / KIB:.1f} KiB"
    if v < 10 * KIB**3:
        return f"{v / KIB**2:.1f} MiB"
    return f"{v / KIB**3:.1f} GiB"


def _fmt_duration(s: float) -> str:
    if s < 1:
        return "under a second"
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _load_profile(arg):

    return Profile.load(arg) if arg else load_default_profile("host")


SIMULATED_METHOD = ("simulated: all {n} SMs issue {bursts} bursts each, the drain shared unequally among the SMs "
                    "holding bytes (spread {spread:.3g}); CTA median over the SMs. Use these: the profile was "
                    "fitted, and its held-out error measured, on this statistic.")
CLOSED_FORM_METHOD = ("closed form, equal sharing: the {n} SMs as one equivalent issuer with 1/{n} of the drain "
                      "and window min(c_sm, capacity/{n}); exact for one SM or spread = 1, otherwise a cross-check "
                      "that ignores unequal sharing.")


def predict_burst(profile, nbytes: float, gap_ns: float, n_sm: int) -> dict:
    """What the profile says about `n_sm` SMs issuing `nbytes` each, separated by `gap_ns` of compute.

    Two labelled predictions: `simulated` (use it: every SM, unequal sharing of the drain, the CTA
    median the profile was fitted on) and `closed_form` (the SMs as one equivalent issuer with an
    equal share of the drain: exact for one SM or `spread == 1`, else a cross-check); each has a first
    burst and a steady state. `use` names the one to use.
    """

    p = profile.params
    first = cf.burst(p, nbytes, n_sm=n_sm)
    issue, cpl, mult = simulate_launch(p, n_sm, nbytes, gap_ns, PREDICT_BURSTS, profile.classes)
    lo, hi = STEADY_BURSTS
    w = np.tile(mult[:, None], (1, hi + 1 - lo)).ravel()
    exact = n_sm == 1 or p.spread == 1.0
    return {
        "burst_bytes": nbytes, "gap_ns": gap_ns, "n_sm": n_sm, "use": "simulated",
        "simulated": {
            "method": SIMULATED_METHOD.format(n=n_sm, bursts=PREDICT_BURSTS, spread=p.spread),
            "first_issue_ns": weighted_median(issue[:, 0], mult),
            "first_completion_ns": weighted_median(cpl[:, 0], mult),
            "steady_issue_ns": weighted_median(issue[:, lo:hi + 1].ravel(), w),
            "steady_bursts": [lo, hi],
        },
        "closed_form": {
            "method": CLOSED_FORM_METHOD.format(n=n_sm), "exact": exact,
            "first_issue_ns": first["issue_ns"], "stall_ns": first["stall_ns"],
            "onset_bytes": cf.onset_bytes(p, n_sm=n_sm), "backlog_end_bytes": first["backlog_end"],
            "recovery_ns": first["recovery_ns"], "completion_ns": first["completion_ns"],
            "second_issue_ns": cf.two_burst_issue_time(p, nbytes, gap_ns, nbytes, n_sm=n_sm),
            "steady_issue_ns": cf.periodic_steady_issue_time(p, nbytes, gap_ns, n_sm=n_sm),
            "onset_index": cf.periodic_onset_index(p, nbytes, gap_ns, n_sm=n_sm),
        },
    }


def _prediction_text(pr: dict, n_sm: int) -> list[str]:
    sim, eq = pr["simulated"], pr["closed_form"]
    lo, hi = sim["steady_bursts"]
    onset = eq["onset_index"]
    lines = [
        f"prediction: {n_sm} SM{'s' if n_sm > 1 else ''} x {_fmt_bytes(pr['burst_bytes'])} per burst, "
        f"gap {_fmt_ns(pr['gap_ns'])}",
        f"  simulated, all {n_sm} SM{'s' if n_sm > 1 else ''} (use these; the profile was fitted on them):",
        f"    first burst issue, CTA median        {_fmt_ns(sim['first_issue_ns'])}",
        f"    first burst completion, CTA median   {_fmt_ns(sim['first_completion_ns'])}",
        f"    steady state issue, bursts {lo}..{hi}    {_fmt_ns(sim['steady_issue_ns'])}",
        "  closed form, equal sharing of the drain ("
        + ("exact here: same as simulated" if eq["exact"] else "cross-check only: ignores unequal sharing") + "):",
        f"    first burst issue {_fmt_ns(eq['first_issue_ns'])}, stall {_fmt_ns(eq['stall_ns'])}, "
        f"onset after {_fmt_bytes(eq['onset_bytes'])}, backlog at its end {_fmt_bytes(eq['backlog_end_bytes'])}, "
        f"recovery {_fmt_ns(eq['recovery_ns'])}, completion {_fmt_ns(eq['completion_ns'])}",
        f"    second burst issue {_fmt_ns(eq['second_issue_ns'])}; steady state issue "
        f"{_fmt_ns(eq['steady_issue_ns'])} ("
        + ("no backpressure in a periodic train" if onset is None else f"backpressure from burst {onset}") + ")",
    ]
    return lines


def _profile_text(prof) -> list[str]:
    lines = [f"profile: path {prof.path}, {prof.provenance.get('gpu', 'unknown GPU')}, "
             f"data {prof.provenance.get('data_file', '?')}"]
    label = prof.interval_label
    for name, v in prof.params.to_dict().items():
        v = float(v)
        ci = prof.intervals.get(name)
        ci_txt = f"  {label} [{_fmt(name, ci[0])}, {_fmt(name, ci[1])}]" if ci else ""
        tag = "" if name in prof.fitted else "  (fixed)"
        if name in prof.fitted and not prof.identified.get(name, True):
            tag = "  (not identified by the data)"
        lines.append(f"  {name:>9} = {_fmt(name, v)}{ci_txt}{tag}")
    if prof.intervals:
        lines.append(f"intervals: {prof.interval_method}")
    # Profiles from `xstage fit` carry leave-one-configuration-out errors; `xstage probe` holds a
    # fixed split of configurations out instead.
    for key, label in (("loco", "leave one configuration out"), ("heldout", "held-out configurations")):
        q = prof.fit_quality.get(key)
        if q and q.get("median_rel_error") is not None and q.get("p90_rel_error") is not None:
            lines.append(f"held-out error ({label}, {q.get('n_configs')} configurations): "
                         f"median {100 * q['median_rel_error']:.1f}%, p90 {100 * q['p90_rel_error']:.1f}%")
    return lines


def run_model(args) -> int:
    # Everything the user gave is checked before any work: numbers, flag combinations, the profile,
    # the data and the plot folder.
    if args.burst is None:
        for flag, value in (("--gap", args.gap), ("--sms", args.sms)):
            if value is not None:
                raise InputError(f"{flag} needs --burst (it describes the predicted burst); give --burst SIZE")
    if args.data is not None and not args.plot:
        raise InputError("--data needs --plot (the data is only drawn over the model's curves)")
    nbytes = parse_size(args.burst, "--burst") if args.burst is not None else None
    gap = parse_time(args.gap if args.gap is not None else "0", "--gap")
    n_sm = parse_count(args.sms if args.sms is not None else 1, "--sms", 1, MAX_SMS, "issuing SMs")
    outs = Outputs("xstage model", force=args.force, inputs=[("--profile", args.profile), ("--data", args.data)])
    plot_dir = outs.folder(args.plot, "--plot") if args.plot else None
    prof = _load_profile(args.profile)
    data = None
    if plot_dir is not None:
        # The plots are named after the profile's path (host, peer, hbm).
        outs.folder(plot_dir, "--plot", files=[f"{prof.path}{PLOT_SUFFIXES[0]}", f"{prof.path}{PLOT_SUFFIXES[1]}"])
        data = read_observations(args.data) if args.data else load_reference_data()
        data.for_path(prof.path)  # the data must hold the profile's path
    payload = {"profile": prof.to_dict()}
    lines = _profile_text(prof)
    if nbytes is not None:
        pr = predict_burst(prof, nbytes, gap, n_sm)
        notes = []
        try:
            measured = prof.sm_count
        except InputError:
            measured = None
        if measured is not None and n_sm > measured:
            notes.append(f"--sms {n_sm} is more SMs than the profile was measured with ({measured}): an extrapolation")
        pr["notes"] = notes
        payload["prediction"] = pr
        lines += _prediction_text(pr, n_sm) + [f"  note: {n}" for n in notes]
    if plot_dir is not None:
        with outs:
            files = [plot_issue_vs_burst(prof, data, plot_dir / f"{prof.path}{PLOT_SUFFIXES[0]}"),
                     plot_issue_vs_gap(prof, data, plot_dir / f"{prof.path}{PLOT_SUFFIXES[1]}")]
        payload["plots"] = [str(f) for f in files]
        lines += [f"wrote {f}" for f in files]
    emit(payload, args.json, "\n".join(lines))
    return 0


SCORE_COLUMNS = ["launch", "cta", "burst_index", "family", "burst_bytes", "start_ns", "measured_ns", "predicted_ns",
                 "error", "naive_ns", "naive_error"]


def _score_text(summary: dict, trace, prof, profile_arg, admission: str) -> list[str]:
    def row(label: str, st: dict) -> str:
        if not st["n"]:
            return f"  {label:<36} (none)"
        return (f"  {label:<36} median {100 * st['median']:6.1f}%  p90 {100 * st['p90']:6.1f}%  "
                f"max {100 * st['max']:7.1f}%  (n={st['n']})")

    def block(s: dict) -> list[str]:
        return [row("issue time per burst, model", s["bursts"]),
                row("issue time per burst, bytes / r0", s["bursts_bytes_over_r0"]),
                row("end of the launch (last CTA), model", s["end"])]

    lines = [f"{trace.source}: {len(trace.launches)} launch(es), {summary['bursts']['n']} bursts, scored with the "
             f"{prof.path} profile {profile_arg or '(embedded)'}, shared window admitted {admission}",
             "error = |predicted - measured| / max(measured, 500 ns)"] + block(summary)
    for name, s in summary["families"].items():
        lines += [f"family {name}:"] + block(s)
    return lines


def run_score(args) -> int:
    outs = Outputs("xstage model score", force=args.force, inputs=[("trace", args.trace), ("--profile", args.profile)])
    out = outs.file(args.output, "-o") if args.output else None
    prof = _load_profile(args.profile)
    trace = read_trace(args.trace)
    if trace.path is not None and trace.path != prof.path:
        raise InputError(f"trace {args.trace}: its path is {trace.path}, the profile's is {prof.path}; give the "
                         f"{trace.path} profile with --profile")
    params = prof.params if args.admission is None else prof.params.replace(admission=args.admission)
    score = score_trace(trace, params, engine=args.engine)
    summary = score.summary()
    if out is not None:
        b = score.bursts
        rows = [{c: (b[c][i].item() if hasattr(b[c][i], "item") else b[c][i]) for c in SCORE_COLUMNS}
                for i in range(len(b["error"]))]
        with outs:
            write_csv_atomic(out, rows, SCORE_COLUMNS)
    lines = _score_text(summary, trace, prof, args.profile, params.admission)
    grouped = score.by(args.by) if args.by else None
    if grouped is not None:
        lines.append(f"per-burst issue time by {args.by} (model; bytes / r0):")
        lines += [f"  {args.by} {k:<10} median {100 * g['bursts']['median']:6.1f}%; "
                  f"{100 * g['bursts_bytes_over_r0']['median']:6.1f}%  (n={g['bursts']['n']})"
                  for k, g in grouped.items()]
    lines += [f"wrote {out}"] if out is not None else []
    emit({"trace": str(args.trace), "profile": prof.path, "admission": params.admission, "engine": args.engine,
          **summary,
          **({"by": {"column": args.by, "groups": [{"value": k, **g} for k, g in grouped.items()]}}
             if grouped is not None else {}),
          **({"output": str(out)} if out is not None else {})}, args.json, "\n".join(lines))
    return 0


def add_profile_option(p) -> None:
    p.add_argument("--profile", type=path_arg, metavar="FILE",
                   help="profile JSON written by `xstage fit` or `xstage probe` (default: the embedded H200 "
                        "host-link profile)")


def register_score(sub) -> None:
    s = sub.add_parser(
        "score", help="score a profile on a per-burst trace of any kernel's stores",
        description="Play every launch of a per-burst trace (one row per burst per CTA: launch, cta, burst_index, "
                    "burst_bytes, start_ns, issue_ns; optional family, path, completion_ns, warps, vector_bytes; "
                    "the format is documented in xstage.model.trace) through the Burst-Gap simulator, and print "
                    "the error of each burst's issue time and of each launch's end, pooled and per family. "
                    "Error = |predicted - measured| / max(measured, 500 ns); the plain bytes / r0 guess is scored "
                    "beside the model.")
    s.add_argument("trace", type=path_arg, help="trace CSV")
    add_profile_option(s)
    s.add_argument("--engine", default="fast", choices=list(ENGINES),
                   help="simulator engine: fast (compiled) or reference (the plain one the tests hold it to) "
                        "(default fast)")
    s.add_argument("--admission", choices=list(ADMISSIONS),
                   help="score with the profile's parameters but this admission to the shared window: first_come "
                        "(the SMs fill it in the order they issue) or fair_share (each active SM owns its part; "
                        "xstage.model.params) (default: the profile's own)")
    s.add_argument("--by", choices=list(BY),
                   help="also group the per-burst errors by this column: where in its train a burst is "
                        "(burst_index), its size (burst_bytes), its CTA or its launch (default: by family only)")
    s.add_argument("-o", "--output", type=path_arg, metavar="CSV",
                   help="also write every burst's measured and predicted issue time and errors to this CSV, in an "
                        "existing folder; an existing file is replaced only if this command wrote it, or with "
                        "--force, and never the trace (default: none)")
    add_force_option(s)
    s.add_argument("--json", action="store_true",
                   help="print standard JSON on standard output instead of text (default: text)")
    s.set_defaults(handler=run_score)


def checkpoint_path(out: Path) -> Path:
    """Where `xstage fit -o OUT` keeps its finished bootstrap rounds: `OUT.bootstrap.jsonl`."""
    return out.with_name(out.name + ".bootstrap.jsonl")


def _stage_callbacks(bar: Progress):
    """`progress(label)` for `build_profile`: each stage's `(done, total)` moves the one bar of all fits."""

    def factory(label: str):
        state = {"done": 0}

        def cb(done: int, total: int) -> None:
            bar.advance(done - state["done"])
            state["done"] = done

        return cb

    return factory


def run_fit(args) -> int:
    # Arguments and the output location first: a long fit never ends in an error about them.
    bootstrap = parse_count(args.bootstrap, "--bootstrap", 0, MAX_BOOTSTRAP, "bootstrap rounds")
    workers = parse_count(args.workers, "--workers", 1, MAX_WORKERS, "processes")
    seed = parse_count(args.seed, "--seed", 0, 2**32 - 1, "seed of the bootstrap")
    outs = Outputs("xstage fit", force=args.force, inputs=[("data", args.data)])
    out = outs.file(args.output, "-o")
    ckpt = checkpoint_path(out)
    if ckpt.exists() and not ckpt.is_file():
        raise InputError(f"-o {out}: {ckpt} (where finished bootstrap rounds are kept) is not a file")
    outs.file(ckpt, "-o", append=True)  # this command's own, kept across an interrupt
    obs = read_observations(args.data).for_path(args.path)
    structures = loco_structures(args.structure, args.loco, args.compare_structures)
    n_cfg = len(obs.configs())
    store = BootstrapStore(ckpt, fit_key(obs, args.structure, seed=seed)) if bootstrap else None
    kept = len([r for r in (store.rounds if store else {}) if r < bootstrap])
    n_boot = bootstrap - kept
    n_loco = n_cfg * len(structures)
    total = 1 + n_boot + n_loco
    quiet = args.json
    parts = ["1 point fit", f"{n_boot} bootstrap rounds"]
    if n_loco:
        parts.append(f"{n_loco} leave-one-out fits ({n_cfg} configurations x {len(structures)} "
                     f"structure{'s' if len(structures) > 1 else ''})")
    say(f"xstage fit: {total} fits ({' + '.join(parts)}); the point fit comes first and times the rest",
        quiet=quiet)
    if store is not None and store.discarded:
        say(f"{ckpt} holds {store.discarded} bootstrap rounds of other data or options: not reused", quiet=quiet)
    if kept:
        say(f"resuming: {kept} of {bootstrap} bootstrap rounds already done (kept in {ckpt})", quiet=quiet)
    warning = iv.few_rounds_warning(bootstrap)
    if warning:
        say(warning)  # a warning about the result, shown even with --json (on standard error)

    with outs:  # records the profile, and the kept rounds of an interrupted fit
        with Progress(total, "xstage fit", quiet=quiet) as bar:

            def on_point_fit(seconds: float) -> None:
                rest = n_boot * seconds / min(workers, max(n_boot, 1)) + n_loco * seconds / min(workers, max(n_cfg, 1))
                if total > 1:
                    say(f"the point fit took {seconds:.1f} s; the other {total - 1} fits should take about "
                        f"{_fmt_duration(rest)} (extrapolated from the point fit; bootstrap refits start from its "
                        "optimum and are usually faster)", quiet=quiet)
                bar.advance(1)

            t0 = time.monotonic()
            try:
                prof = build_profile(obs, structure=args.structure, bootstrap=bootstrap, loco=args.loco,
                                     compare_structures=args.compare_structures, workers=workers,
                                     progress=_stage_callbacks(bar), seed=seed, store=store, on_point_fit=on_point_fit)
            except KeyboardInterrupt:
                if store is not None:
                    store.close()
                    done = len([r for r in store.rounds if r < bootstrap])
                    say(f"interrupted: {done} of {bootstrap} bootstrap rounds are kept in {ckpt}; rerun the same "
                        "command to resume")
                raise
            finally:
                if store is not None:
                    store.close()
        outs.recheck(out)  # nothing else wrote it while the fits ran
        prof.save(out)
        if store is not None:
            store.remove()
    say(f"fitted in {_fmt_duration(time.monotonic() - t0)}", quiet=quiet)
    emit(prof.to_dict(), args.json, "\n".join(_profile_text(prof) + [f"wrote {out}"]))
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "model", help="show a Burst-Gap profile, predict a burst, plot data over the model",
        description="Show a Burst-Gap profile (parameters, intervals, held-out error); with --burst, predict "
                    "issue time, stall, onset, recovery and steady state (simulated, and the equal-sharing "
                    "closed form as a labelled cross-check); with --plot, draw the data over the model.")
    add_profile_option(p)
    p.add_argument("--burst", metavar="SIZE",
                   help="bytes each SM stores per burst: a whole number of bytes in 1 B..64 GiB, e.g. 65536, "
                        "64KiB, 4MiB, 10MB (default: none, no prediction)")
    p.add_argument("--gap", metavar="TIME",
                   help="compute time after each burst, 0..60 s, e.g. 2000 (ns), 20us, 1.5ms; needs --burst "
                        "(default 0 ns)")
    p.add_argument("--sms", metavar="N",
                   help=f"SMs issuing bursts at once, an integer in 1..{MAX_SMS}; needs --burst (default 1)")
    p.add_argument("--plot", type=path_arg, metavar="DIR",
                   help="folder (created if missing) to write two PNG plots into, issue time vs burst size and "
                        "vs gap, named <path>-issue-vs-burst.png and <path>-issue-vs-gap.png after the profile's store "
                        "path (host, peer, hbm); an existing plot is replaced only if this command wrote it, or "
                        "with --force (default: no plots)")
    p.add_argument("--data", type=path_arg, metavar="CSV",
                   help="measurements (long, summary or reference CSV) to draw with --plot (default: the packaged "
                        "H200 reference data)")
    add_force_option(p)
    p.add_argument("--json", action="store_true",
                   help="print standard JSON on standard output instead of text (default: text)")
    p.set_defaults(handler=run_model)
    register_score(p.add_subparsers(dest="model_command", metavar="score", required=False))

    f = sub.add_parser(
        "fit", help="fit a Burst-Gap profile to probe data (long, summary or reference CSV)",
        description="Fit one path's Burst-Gap parameters to probe data and write a profile with intervals. "
                    "Cost: one point fit, plus one refit per bootstrap round (each about as long as the point "
                    "fit or less), plus one fit per configuration per structure with --loco or "
                    "--compare-structures. It says up front how many fits it runs and, after the first, "
                    "about how long the rest take; finished bootstrap rounds are kept in "
                    "PROFILE.json.bootstrap.jsonl, and rerunning the same command after an interrupt runs only "
                    "the missing ones.")
    f.add_argument("data", type=path_arg, help="CSV in the long, summary or reference format")
    f.add_argument("-o", "--output", required=True, type=path_arg, metavar="PROFILE.json",
                   help="profile JSON to write, in an existing folder; an existing file is replaced only if "
                        "this command wrote it (and nobody changed it since), or with --force, and never the data "
                        "file (required, no default)")
    f.add_argument("--path", default="host", choices=list(PATHS),
                   help="store path whose rows are fitted (default host)")
    f.add_argument("--structure", default="full", choices=list(STRUCTURES),
                   help="model structure: base (two windows), fast (+ small-burst first stage), full (+ unequal "
                        "sharing of the drain), full_fair (full, with the shared window partitioned among the "
                        "active SMs) (default full)")
    f.add_argument("--bootstrap", default="20", metavar="N",
                   help=f"bootstrap rounds for the parameter intervals, 0..{MAX_BOOTSTRAP}; each round is one "
                        f"refit from the point estimate, so N rounds cost up to N point fits (on one CPU core: about "
                        f"a second each on a few configurations; 20-60 s each on the 20-configuration reference "
                        f"data, whose point fit takes 1-4 min); fewer than {iv.MIN_BOOTSTRAP_ROUNDS} give a labelled "
                        f"range, not a 95%% interval (default 20)")
    f.add_argument("--seed", default="0", metavar="N",
                   help="seed of the bootstrap resampling, an integer >= 0 (default 0)")
    f.add_argument("--loco", action="store_true",
                   help="also report leave-one-configuration-out error: one more fit per configuration "
                        "(default: off)")
    f.add_argument("--compare-structures", action="store_true",
                   help="leave-one-configuration-out error of every structure (implies --loco; one fit per "
                        "configuration per structure) (default: off)")
    f.add_argument("--workers", default="1", metavar="N",
                   help=f"processes for the bootstrap refits and the leave-one-out fits, 1..{MAX_WORKERS} (default 1)")
    f.add_argument("--json", action="store_true",
                   help="print the profile as standard JSON on standard output, no progress (default: text and "
                        "progress on standard error)")
    add_force_option(f)
    f.set_defaults(handler=run_fit)
