"""`xstage model` (show a profile, predict a burst, plot) and `xstage fit` (data -> profile).

    xstage model [--profile P] [--burst 64KiB --gap 20us --sms 132] [--plot DIR] [--data CSV] [--json]
    xstage fit DATA.csv -o PROFILE.json [--path host] [--bootstrap N] [--loco] [--compare-structures]

The embedded host profile is regenerated from the packaged reference data with
`xstage fit src/xstage/data/h200-hostlink-probe.csv -o src/xstage/data/h200-host-profile.json
--path host --bootstrap 20 --compare-structures --workers 2`.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np

from xstage.errors import InputError
from xstage.model import closed_form as cf
from xstage.model.api import build_profile
from xstage.model.data import load_reference_data, read_observations
from xstage.model.plots import plot_issue_vs_burst, plot_issue_vs_gap
from xstage.model.predict import simulate_launch, weighted_median
from xstage.model.profile import Profile, load_default_profile
from xstage.results.output import emit

_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3,
               "kb": 1e3, "mb": 1e6, "gb": 1e9}
_TIME_UNITS = {"": 1.0, "ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


def parse_size(text: str, name: str = "size") -> float:
    """Bytes from '65536', '64KiB', '4MiB', '1.5M' (binary K/M/G), '10MB' (decimal)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise InputError(f"{name} must be a size such as 65536, 64KiB or 4MiB, got {text!r}")
    v = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if not v > 0:
        raise InputError(f"{name} must be > 0 bytes, got {text!r}")
    return v


def parse_time(text: str, name: str = "time") -> float:
    """Nanoseconds from '2000', '2000ns', '20us', '1.5ms'."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise InputError(f"{name} must be a time such as 2000 (ns), 20us or 1.5ms, got {text!r}")
    return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]


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


def _load_profile(arg):

    return Profile.load(arg) if arg else load_default_profile("host")


def predict_burst(profile, nbytes: float, gap_ns: float, n_sm: int) -> dict:
    """What the profile says about `n_sm` SMs issuing `nbytes` each, separated by `gap_ns` of compute."""

    p = profile.params
    first = cf.burst(p, nbytes, n_sm=n_sm)
    issue, cpl, mult = simulate_launch(p, n_sm, nbytes, gap_ns, 24, profile.classes)
    w = np.tile(mult[:, None], (1, 12)).ravel()
    return {
        "burst_bytes": nbytes, "gap_ns": gap_ns, "n_sm": n_sm,
        "first_issue_ns": weighted_median(issue[:, 0], mult),
        "first_completion_ns": weighted_median(cpl[:, 0], mult),
        "steady_issue_ns": weighted_median(issue[:, 12:24].ravel(), w),
        "equal_sharing": {
            "first_issue_ns": first["issue_ns"], "stall_ns": first["stall_ns"],
            "onset_bytes": cf.onset_bytes(p, n_sm=n_sm), "backlog_end_bytes": first["backlog_end"],
            "recovery_ns": first["recovery_ns"], "completion_ns": first["completion_ns"],
            "second_issue_ns": cf.two_burst_issue_time(p, nbytes, gap_ns, nbytes, n_sm=n_sm),
            "steady_issue_ns": cf.periodic_steady_issue_time(p, nbytes, gap_ns, n_sm=n_sm),
            "onset_index": cf.periodic_onset_index(p, nbytes, gap_ns, n_sm=n_sm),
        },
    }


def _profile_text(prof) -> list[str]:
    lines = [f"profile: path {prof.path}, {prof.provenance.get('gpu', 'unknown GPU')}, "
             f"data {prof.provenance.get('data_file', '?')}"]
    for name, v in prof.params.to_dict().items():
        v = float(v)
        ci = prof.intervals.get(name)
        ci_txt = f"  95% [{_fmt(name, ci[0])}, {_fmt(name, ci[1])}]" if ci else ""
        tag = "" if name in prof.fitted else "  (fixed)"
        if name in prof.fitted and not prof.identified.get(name, True):
            tag = "  (not identified by the data)"
        lines.append(f"  {name:>9} = {_fmt(name, v)}{ci_txt}{tag}")
    # Profiles from `xstage fit` carry leave-one-configuration-out errors; `xstage probe` holds a
    # fixed split of configurations out instead.
    for key, label in (("loco", "leave one configuration out"), ("heldout", "held-out configurations")):
        q = prof.fit_quality.get(key)
        if q:
            lines.append(f"held-out error ({label}, {q.get('n_configs')} configurations): "
                         f"median {100 * q['median_rel_error']:.1f}%, p90 {100 * q['p90_rel_error']:.1f}%")
    return lines


def run_model(args) -> int:

    prof = _load_profile(args.profile)
    payload = {"profile": prof.to_dict()}
    lines = _profile_text(prof)
    if args.burst is not None:
        nbytes = parse_size(args.burst, "--burst")
        gap = parse_time(args.gap, "--gap")
        if args.sms < 1:
            raise InputError(f"--sms must be >= 1, got {args.sms}")
        pr = predict_burst(prof, nbytes, gap, args.sms)
        payload["prediction"] = pr
        eq = pr["equal_sharing"]
        lines += [
            f"prediction: {args.sms} SM x {nbytes / 1024:.1f} KiB, gap {gap:.0f} ns",
            f"  first burst issue (CTA median)   {pr['first_issue_ns']:.0f} ns",
            f"  steady issue, bursts 12..23      {pr['steady_issue_ns']:.0f} ns",
            f"  equal sharing: issue {eq['first_issue_ns']:.0f} ns, stall {eq['stall_ns']:.0f} ns, "
            f"onset {eq['onset_bytes'] / 1024:.1f} KiB, backlog {eq['backlog_end_bytes'] / 1024:.1f} KiB, "
            f"recovery {eq['recovery_ns']:.0f} ns, second burst {eq['second_issue_ns']:.0f} ns, "
            f"steady {eq['steady_issue_ns']:.0f} ns",
        ]
    if args.plot:

        data = read_observations(args.data) if args.data else load_reference_data()
        out = Path(args.plot)
        out.mkdir(parents=True, exist_ok=True)
        files = [plot_issue_vs_burst(prof, data, out / f"{prof.path}-issue-vs-burst.png"),
                 plot_issue_vs_gap(prof, data, out / f"{prof.path}-issue-vs-gap.png")]
        payload["plots"] = files
        lines += [f"wrote {f}" for f in files]
    emit(payload, args.json, "\n".join(lines))
    return 0


def _progress(label: str):
    def cb(i: int, n: int) -> None:
        end = "\n" if i == n or not sys.stderr.isatty() else ""
        print(f"\r{label} {i}/{n}", end=end, file=sys.stderr, flush=True)

    return cb


def run_fit(args) -> int:

    if args.bootstrap < 0:
        raise InputError(f"--bootstrap must be >= 0, got {args.bootstrap}")
    out = Path(args.output)
    if not out.parent.exists():
        raise InputError(f"-o: directory {str(out.parent)!r} does not exist")
    obs = read_observations(args.data).for_path(args.path)
    prof = build_profile(obs, structure=args.structure, bootstrap=args.bootstrap, loco=args.loco,
                         compare_structures=args.compare_structures, workers=args.workers,
                         progress=_progress)
    prof.save(out)
    emit(prof.to_dict(), args.json, "\n".join(_profile_text(prof) + [f"wrote {out}"]))
    return 0


def register(sub) -> None:
    p = sub.add_parser("model", help="show a Burst-Gap profile, predict a burst, plot data over the model")
    p.add_argument("--profile", help="profile JSON (default: the embedded H200 host profile)")
    p.add_argument("--burst", help="bytes per SM per burst, e.g. 64KiB")
    p.add_argument("--gap", default="0", help="compute gap after each burst, e.g. 20us (default 0)")
    p.add_argument("--sms", type=int, default=1, help="issuing SMs (default 1)")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots of issue time vs burst size and vs gap")
    p.add_argument("--data", help="measurements to plot (default: the packaged reference data)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=run_model)

    f = sub.add_parser("fit", help="fit a Burst-Gap profile to probe data (long, summary or reference CSV)")
    f.add_argument("data", help="CSV in the long, summary or reference format")
    f.add_argument("-o", "--output", required=True, help="profile JSON to write")
    f.add_argument("--path", default="host", choices=["hbm", "host", "peer"], help="path to fit (default host)")
    f.add_argument("--structure", default="full", choices=["base", "fast", "full"],
                   help="model structure: base, + first stage (fast), + unequal sharing (full; default)")
    f.add_argument("--bootstrap", type=int, default=20, help="bootstrap rounds for intervals (default 20)")
    f.add_argument("--loco", action="store_true", help="also report leave-one-configuration-out error")
    f.add_argument("--compare-structures", action="store_true",
                   help="leave-one-configuration-out error of every structure (implies --loco)")
    f.add_argument("--workers", type=int, default=1, help="processes for leave-one-out fits (default 1)")
    f.add_argument("--json", action="store_true", help="print JSON")
    f.set_defaults(handler=run_fit)
