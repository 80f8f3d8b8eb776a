"""`xstage probe`: measure a store path with the named sweeps, then summarise, fit and plot.

    xstage probe --path host --sweep all -o results/h200-host       # measure + analyse (GPU)
    xstage probe --path host --sweep first,twoburst --only n_sm=8,132 -o DIR   # a slice
    xstage probe --path host --plan                                  # list configurations only
    xstage probe --analyse-only -o DIR                               # re-analyse recorded data
    torchrun --nproc-per-node 8 -m xstage probe --path peer --sweep all -o DIR

Measuring needs a CUDA GPU; planning and analysis run anywhere. The files of `-o DIR` (`OUTPUT_FILES`;
`raw/` is appended to) are checked before any work: each is new or one `xstage probe` wrote before,
unless `--force` (`xstage.results.output.Outputs`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from xstage.bounds import MAX_BOOTSTRAP, MAX_SMS
from xstage.cli.args import add_force_option, cli_int, only_spec, path_arg
from xstage.env import has_gpu
from xstage.errors import InputError
from xstage.model import load_default_profile
from xstage.model.trace import read_trace
from xstage.probe.report import analyse, load_probe_dir
from xstage.probe.session import measure
from xstage.probe.sweeps import IRREGULAR, PATH_SWEEPS, parse_sweeps, plan
from xstage.probe.trains import TRACE_FILE, plan_trains, score_trains
from xstage.results.output import Outputs, emit, write_text
from xstage.results.progress import say
from xstage.results.select import select

# What an analysis writes in -o DIR (summary.csv only when it is made from raw/*.csv), what a fit adds,
# and what measuring writes (raw/ per sweep, appended to by every run).
OUTPUT_FILES = ("summary.csv", "experiments.json", "summary.md", "plots/*.png")
FIT_FILES = ("fit.json", "profile.json")
RUN_FILE = "run.json"
SCORE_FILE = "traces/score.json"

MAX_REPEATS = 10_000  # recorded launches per configuration: the sweeps' defaults are a few


def _sm_count(args) -> int:
    if args.sm_count:
        return args.sm_count

    if has_gpu():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return load_default_profile().sm_count  # no GPU here: plan for the GPU the embedded profile came from


def _init_peer_group():
    if "RANK" not in os.environ:
        raise InputError("--path peer: start one process per rank with torchrun (RANK is not set)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.device_count() > 1:
        torch.cuda.set_device(local % torch.cuda.device_count())
    else:
        os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


def run_probe(args) -> int:

    sweeps = parse_sweeps(args.sweep, args.path)  # the numbers are checked by their `type=`
    if args.plan:
        planned = [{"sweep": s, **c.fields()} for s, c in plan(sweeps, args.path, _sm_count(args))]
        chosen = select(planned, args.only)
        counts = Counter(d["sweep"] for d in chosen)
        trains = plan_trains(args.path, _sm_count(args)) if IRREGULAR in sweeps else []
        counts[IRREGULAR] = len(trains)
        text = "\n".join([f"{len(chosen)} configurations on path {args.path}:"]
                         + [f"  {s:<11} {counts[s]}" + (" trains" if s == IRREGULAR else "") for s in sweeps])
        emit({"path": args.path, "configs": chosen, "trains": [t.label() for t in trains]}, args.json, text)
        return 0
    if not args.out:
        raise InputError("-o/--out: required to measure or analyse")
    measuring = not args.analyse_only
    outs, out = _outputs(args, sweeps, measuring)
    if measuring:  # the slice is checked before the GPU is looked for, like every other argument
        if args.only:
            select([{"sweep": s, **c.fields()} for s, c in plan(sweeps, args.path, _sm_count(args))], args.only)
        if not has_gpu():
            raise InputError("measuring needs a CUDA GPU (in the CPU interpreter every timer reads 0); --plan and "
                             "--analyse-only run anywhere")
    rank, group = 0, None
    if measuring and args.path == "peer":
        group = _init_peer_group()
        rank = group.get_rank()
    if rank != 0:  # every rank measures in step; rank 0 writes
        measure(out, args.path, sweeps, only=args.only, repeats=args.repeats, progress=False)
        group.barrier()
        return 0
    quiet = args.quiet or args.json
    # --analyse-only: a malformed folder is refused before any output is touched (not even the manifest)
    regular = _regular(sweeps, measuring, out)
    inputs = load_probe_dir(out, quiet=quiet) if not measuring and regular else None
    traces = read_trace(out / TRACE_FILE) if not measuring and (out / TRACE_FILE).is_file() else None
    with outs:
        if measuring:
            info = measure(out, args.path, sweeps, only=args.only, repeats=args.repeats, progress=not args.quiet)
            if group is not None:
                group.barrier()
            if info.get("configs_run", 0) == 0 and info.get("configs_skipped", 0):
                say(f"all {info['configs_skipped']} configurations already measured in {out}", quiet=args.json)
        result = (analyse(out, fit=not args.no_fit, bootstrap=args.bootstrap, quiet=quiet, inputs=inputs)
                  if regular else {"text": f"probe {args.path}: no regular sweeps in {out}"})
        if measuring and IRREGULAR in sweeps:
            traces = read_trace(out / TRACE_FILE)
        if traces is not None:
            result["irregular"] = _score_traces(out, traces, args.path)
            result["text"] += "\n" + result["irregular"].pop("text")
    emit(result, args.json, result["text"])
    return 0


def _has_regular(out: Path) -> bool:
    return any((out / "raw").glob("*.csv")) or (out / "summary.csv").is_file()


def _regular(sweeps: list[str], measuring: bool, out: Path) -> bool:
    """Whether this run has a regular analysis to make: regular sweeps measured now, or data of them in -o."""
    return measuring and any(s != IRREGULAR for s in sweeps) or _has_regular(out)


def _score_traces(out: Path, traces, path: str) -> dict:
    """The irregular trains (`traces`, read from `out`) scored on the path's embedded profile (the
    baseline any refit must beat), per split and family, written to `traces/score.json`."""
    scores = score_trains(traces, load_default_profile(path).params)
    lines = [f"irregular trains ({TRACE_FILE}), scored on the embedded {path} profile; error = |predicted - measured| "
             "/ max(measured, 500 ns), medians:"]
    for side, s in scores.items():
        lines.append(f"  {side}: per burst {100 * s['bursts']['median']:.1f}% (bytes / r0: "
                     f"{100 * s['bursts_bytes_over_r0']['median']:.1f}%), launch end {100 * s['end']['median']:.1f}%, "
                     f"{s['bursts']['n']} bursts")
        for f, fs in s["families"].items():
            lines.append(f"    {f:<11} per burst {100 * fs['bursts']['median']:.1f}%, "
                         f"end {100 * fs['end']['median']:.1f}%")
    write_text(out / SCORE_FILE, json.dumps(scores, indent=1))
    return {"scores": scores, "text": "\n".join(lines)}


def _outputs(args, sweeps: list[str], measuring: bool) -> tuple[Outputs, Path]:
    """The files this run may write in `-o`, declared (and so checked) before any work."""
    outs = Outputs("xstage probe", force=args.force)
    out = outs.folder(args.out, "-o")
    has_raw = any((out / "raw").glob("*.csv"))
    if not measuring and not _has_regular(out) and not (out / TRACE_FILE).is_file():
        raise InputError(f"-o {out}: holds neither raw/*.csv, summary.csv nor {TRACE_FILE}; measure into it first")
    # Without raw/*.csv (committed data) the analysis reads summary.csv instead of writing it.
    regular = _regular(sweeps, measuring, out)
    files = [f for f in OUTPUT_FILES if regular and (f != "summary.csv" or measuring or has_raw)]
    files += [] if args.no_fit or not regular else list(FIT_FILES)
    files += [RUN_FILE] if measuring else []
    appended = [f"raw/{s}.{ext}" for s in sweeps if s != IRREGULAR for ext in ("csv", "done")] if measuring else []
    if IRREGULAR in sweeps and measuring:
        appended += [TRACE_FILE, TRACE_FILE.replace(".csv", ".done")]
    if IRREGULAR in sweeps and measuring or (out / TRACE_FILE).is_file():
        files.append(SCORE_FILE)
    return outs, outs.folder(out, "-o", files=files, append=appended)


def register(sub) -> None:
    p = sub.add_parser("probe", help="measure a store path (X-Stage microbenchmarks), fit and plot")
    p.add_argument("--path", choices=sorted(PATH_SWEEPS), default="host",
                   help="where the stores go: hbm (device memory), host (pinned host memory over PCIe), peer "
                   "(other GPUs over NVLink, under torchrun) (default %(default)s)")
    p.add_argument("--sweep", default="all", help="'all' or a comma list of: first, periodic, twoburst, "
                   "completion, knobs, peers, irregular (a train per CTA, hbm and host only, not in 'all': recorded "
                   "in traces/irregular.csv and scored on the embedded profile) (default %(default)s)")
    p.add_argument("-o", "--out", type=path_arg,
                   help="output folder (raw CSVs, summary.csv, plots, summary.md); resumable: a "
                   "rerun appends to raw/ and writes the rest again, replacing only files xstage probe wrote")
    p.add_argument("--only", action="append", type=only_spec, metavar="KEY=V1,V2",
                   help="run only configurations whose field matches (sweep, n_sm, burst_bytes, ...); repeatable "
                   "(default: all)")
    p.add_argument("--repeats", type=cli_int(1, MAX_REPEATS, "recorded launches per configuration"),
                   help=f"recorded launches per configuration, 1..{MAX_REPEATS} (default per sweep)")
    p.add_argument("--plan", action="store_true", help="list the configurations and stop (nothing is measured)")
    p.add_argument("--sm-count", type=cli_int(1, MAX_SMS, "SMs of the GPU to plan for"),
                   help=f"SM count to plan for, 1..{MAX_SMS} (default: this GPU, else the SM count of the embedded "
                   "profile's GPU)")
    p.add_argument("--analyse-only", action="store_true", help="skip measuring; analyse what -o holds")
    p.add_argument("--no-fit", action="store_true", help="skip fitting the profile")
    p.add_argument("--bootstrap", type=cli_int(0, MAX_BOOTSTRAP, "bootstrap rounds"), default=20,
                   help=f"bootstrap rounds for parameter intervals, 0..{MAX_BOOTSTRAP}; fewer than 20 give a range, "
                   "not a 95%% interval (default %(default)s)")
    add_force_option(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar (default: progress on standard error)")
    p.add_argument("--json", action="store_true", help="print the result as standard JSON")
    p.set_defaults(handler=run_probe)

