"""`xstage plan`: predicted time of every candidate schedule of the fused MoE or Ulysses kernel, the
pick and a timeline plot; tile-cost calibration; validation against benchmark results.

Every handler checks its arguments, input files and output files before any simulation or
measurement: a user error is one `InputError` line naming the argument (or file, line and column). An
output file is new or one the same command wrote before, unless `--force`, and never one of the inputs
(`xstage.results.output.Outputs`).
Long work reports progress on standard error (`xstage.results.progress.Progress`), nothing under
`--json`, whose standard output is one standard JSON document.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from xstage.bounds import INT64_MAX, MAX_RANKS, MAX_WORKERS
from xstage.calibrate.exchange import fit_default_exchange_costs, fit_exchange_costs
from xstage.calibrate.tiles import CALIBRATION_SHAPES, calibrate_moe
from xstage.cli.args import add_force_option, add_json_option, cli_int, cli_type, only_spec, path_arg
from xstage.cli.plan_layer import ULYSSES_FLAGS, add_call_shape, register_layer
from xstage.dtypes import FP8_DTYPES, dtype_name, parse_dtype
from xstage.env import environment, has_gpu
from xstage.errors import InputError
from xstage.model import Profile, load_default_profile
from xstage.model.interference import load_default_interference
from xstage.results import emit, markdown_table
from xstage.results.io import ResultWriter, write_csv_atomic
from xstage.results.output import Outputs, with_provenance
from xstage.results.plots import plot_lines
from xstage.results.progress import Progress
from xstage.sched.costs import TaskCosts, load_default_costs
from xstage.sched.exchange import CANDIDATES as EXCHANGE_CANDIDATES
from xstage.sched.exchange import (
    COSTS_JSON,
    check_call_shape,
    check_predictable,
    costs_to_dict,
    default_exchange_costs,
    plan_exchange,
    validate_exchange,
)
from xstage.sched.measured import load_results
from xstage.sched.moe import MoeConfig, check_seed, moe_dtype_fields
from xstage.sched.pacing import resolve_pacing
from xstage.sched.plan import CTAS_MEANING, MAX_PLAN_CTAS, MAX_PLAN_TOKENS, check_plannable, default_ctas, plan_moe
from xstage.sched.timeline import plot_timeline
from xstage.sched.ulysses import attention_costs
from xstage.sched.validate import fused_rows, validate_moe
from xstage.spec.exchange import parse_exchange
from xstage.spec.moe import MAX_TOKENS_PER_RANK, MoeShape, check_block_size, parse_block
from xstage.spec.pacing import AUTO, PACING_CANDIDATES, spec_of
from xstage.spec.schedule import CANDIDATES, check_schedule
from xstage.spec.variant import Variant

PLOT_NAME = "plan_timeline.png"  # what `--plot FOLDER` writes in the folder
MOE_COSTS, MOE_TILES = "moe-task-costs.json", "moe-tiles.csv"  # what `plan calibrate -o DIR` writes
ATTENTION_COSTS = "attention-task-costs.json"  # what `plan attention-costs -o DIR` writes
VALIDATION = {"moe": ("validation.csv", "validation.png"), "ulysses": ("validation-ulysses.csv",)}
MAX_REPS = 1000  # traced runs per calibrated shape; the median of a few is what is kept


# ---- argument checks (before any work) -------------------------------------------------------------

def int_list(lo: int, hi: int, what: str):
    """An argparse `type=` for comma-separated integers in `lo..hi` (`--tokens 1024,4096`)."""
    def parse(text: str) -> list[int]:
        items = [t.strip() for t in str(text).split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least one {what}")
        return [cli_int(lo, hi, what)(t) for t in items]

    return parse


def block_m_list(text: str | None) -> list[int] | None:
    """`--block-m 64,128`: powers of two >= 16 (the kernel's tile rows)."""
    if text is None:
        return None
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise InputError(f"--block-m {text!r}: give comma-separated block sizes such as 64,128")
    out = []
    for t in items:
        try:
            v = int(t)
        except ValueError:
            raise InputError(f"--block-m {text}: {t!r} is not an integer (BLOCK_M, rows per tile)") from None
        try:
            out.append(check_block_size(v, "BLOCK_M"))
        except InputError as exc:
            raise InputError(f"--block-m {text}: {exc}") from None
    return out


def _checked_list(text: str | None, default, check, example: str, flag: str = "--candidates") -> list[str]:
    """A comma list for `flag`: `default` when absent; every item passes `check`."""
    if text is None:
        return list(default)
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise InputError(f"{flag} {text!r}: give at least one, e.g. {example}")
    for name in items:
        try:
            check(name)
        except InputError as exc:
            raise InputError(f"{flag} {text}: {exc}") from None
    return items


def schedule_list(text: str | None) -> list[str]:
    """`--candidates` of `plan moe` and `plan validate`: schedules the planner can rank."""
    return _checked_list(text, CANDIDATES, check_plannable, "expert_wave,lag:4")


def exchange_list(text: str | None, default=EXCHANGE_CANDIDATES, flag: str = "--candidates") -> list[str]:
    """`--candidates` of `plan ulysses`, `--exchange` of `plan validate`: exchanges the planner predicts."""
    return [str(parse_exchange(e)) for e in _checked_list(text, default, check_predictable,
                                                           "serial:cudnn,stores:paced:16", flag)]


def plot_path(outs: Outputs, value: str | None) -> Path | None:
    """Where `--plot` writes, declared in `outs`: PATH itself (a `.png` file), or
    `PATH/plan_timeline.png` when PATH is an existing folder."""
    if value is None:
        return None
    p = Path(value)
    if p.is_dir():
        p = p / PLOT_NAME
    elif p.suffix.lower() != ".png":
        raise InputError(f"--plot {value}: give a .png file path or an existing folder")
    return outs.file(p, "--plot")


def _load_profile(profile_path: str | None) -> Profile:
    return Profile.load(profile_path) if profile_path else load_default_profile()


def _load_costs(costs_path: str | None, kernel: str, dtype: str = "bf16") -> TaskCosts:
    costs = TaskCosts.load(costs_path) if costs_path else load_default_costs(kernel, dtype)
    if costs.kernel != kernel:
        raise InputError(f"--costs {costs_path}: task costs of the {costs.kernel!r} kernel; this command needs "
                         f"the {kernel!r} kernel's (`xstage plan "
                         f"{'calibrate' if kernel == 'moe' else 'attention-costs'}` writes them)")
    return costs


def _pacing(arg: str, spec: str, path: str, ranks: int):
    try:
        return resolve_pacing(spec, path, ranks)
    except InputError as exc:  # the spec once, named by its flag
        raise InputError(f"{arg} {spec}: {str(exc).removeprefix(f'pacing {spec!r}: ')}") from None


# ---- handlers --------------------------------------------------------------------------------------

def run_plan_moe(args) -> int:
    shape = MoeShape.parse(args.shape, "--shape")
    tokens, ep, ctas, seed = args.tokens, args.ep, args.ctas, args.seed  # checked by their `type=`
    if shape.num_experts % ep:
        raise InputError(f"--ep {ep}: must divide the {shape.num_experts} experts of --shape {shape}")
    if shape.topk > shape.num_experts:
        raise InputError(f"--shape {shape}: top-k {shape.topk} is more than its {shape.num_experts} experts")
    block_ms = block_m_list(args.block_m)
    candidates = schedule_list(args.candidates)
    outs = Outputs("xstage plan moe", force=args.force, inputs=[("--profile", args.profile), ("--costs", args.costs)])
    plot = plot_path(outs, args.plot)
    dtype = dtype_name(parse_dtype(args.dtype, "--dtype", allowed=("bf16", *FP8_DTYPES)))
    try:
        cfg = MoeConfig.parse(str(shape), tokens_per_rank=tokens, ep=ep, **moe_dtype_fields(dtype, shape.hidden))
        for bm in block_ms or ():
            cfg.with_blocks(block_m=bm)
    except InputError as exc:
        raise InputError(f"--shape {shape} --tokens {tokens} --ep {ep}: {exc}") from None
    profile = _load_profile(args.profile)
    costs = _load_costs(args.costs, "moe", dtype)
    ctas = ctas or default_ctas(profile)
    # "auto": every schedule under each pacing "auto" chooses from (the kernel's own rule).
    if args.pacing == AUTO:
        pacings = {spec: _pacing("--pacing", spec, profile.path, cfg.ep) for spec in PACING_CANDIDATES}
    else:
        pacings = {args.pacing: _pacing("--pacing", args.pacing, profile.path, cfg.ep)}
    interference = None if args.no_interference else load_default_interference(profile.path)
    total = len(candidates) * len(block_ms or [cfg.block_m]) * len(pacings)
    with outs, Progress(total, "plan moe: candidates simulated", quiet=args.json) as bar:
        rows = plan_moe(cfg, profile.params, costs, ctas, candidates=candidates, block_ms=block_ms, seed=seed,
                        pacings=pacings, progress=bar.callback, interference=interference)
        if plot is not None:
            plot = plot_timeline(rows[0].result, plot, title=f"{cfg.shape} T={cfg.tokens_per_rank} EP={cfg.ep}: "
                                 f"{rows[0].schedule} (predicted)")
    table = [
        {"schedule": r.schedule, "pacing": r.pacing, "block_m": r.block_m, "time_us": r.time_ns / 1e3,
         "vs_best": r.rank_ns / rows[0].rank_ns, "stall_us_per_cta": r.breakdown["stall"] / 1e3 / ctas,
         "wait_us_per_cta": r.breakdown["wait"] / 1e3 / ctas}
        for r in rows
    ]
    pacing_text = ", ".join(f"{spec} = {spec_of(p)}" for spec, p in pacings.items())
    text = (f"{cfg.shape} {dtype}, {cfg.tokens_per_rank} tokens/rank, EP={cfg.ep}, {ctas} CTAs, "
            f"store pacing {pacing_text} (GB/s:KiB), interference {'on' if interference else 'off'}, "
            f"profile {profile.describe() if hasattr(profile, 'describe') else args.profile or 'default'}\n"
            + markdown_table(table, list(table[0]), floatfmt=".4g")
            + f"\npick: {rows[0].variant} (block_m {rows[0].block_m})" + (f"\ntimeline: {plot}" if plot else ""))
    emit({"config": cfg.shape, "dtype": dtype, "tokens_per_rank": cfg.tokens_per_rank, "ep": cfg.ep, "ctas": ctas,
          "pacing": {spec: spec_of(p) for spec, p in pacings.items()}, "interference": interference is not None,
          "rows": table, "pick": rows[0].schedule, "pick_pacing": rows[0].pacing,
          "plot": str(plot) if plot else None}, args.json, text)
    return 0


def run_calibrate(args) -> int:
    outs = Outputs("xstage plan calibrate", force=args.force)
    out = outs.folder(args.out, "-o", files=[MOE_COSTS], append=[MOE_TILES])
    shapes = ([t.strip() for t in args.shapes.split(",") if t.strip()] if args.shapes is not None
              else list(CALIBRATION_SHAPES))
    if not shapes:
        raise InputError(f"--shapes {args.shapes!r}: give at least one shape, e.g. H4096-I2048-E256-K6")
    parsed = [MoeShape.parse(s, "--shapes") for s in shapes]
    tokens, reps = args.tokens, args.reps  # checked by their `type=`
    dtype = dtype_name(parse_dtype(args.dtype, "--dtype", allowed=("bf16", *FP8_DTYPES)))
    for spec in args.block or ():
        for s in parsed:
            try:
                parse_block(spec, s.hidden, fp8=dtype == "fp8")
            except InputError as exc:
                raise InputError(f"--block {spec} (shape {s}): {exc}") from None
    blocks = args.block or [None]
    model_shapes = None
    if args.model_shapes is not None:
        model_shapes = [str(MoeShape.parse(s.strip(), "--model-shapes")) for s in args.model_shapes.split(",")
                        if s.strip()]
        untraced = sorted(set(model_shapes) - {str(s) for s in parsed})
        if not model_shapes or untraced:
            raise InputError(f"--model-shapes {args.model_shapes!r}: give shapes among --shapes "
                             f"({','.join(str(s) for s in parsed)})"
                             + (f"; not traced: {','.join(untraced)}" if untraced else ""))
    schedules = _checked_list(args.schedules, ["expert_wave"], check_schedule, "expert_wave,interleaved", "--schedules")
    if "expert_wave" not in schedules:
        raise InputError(f"--schedules {args.schedules!r}: include expert_wave, the order the tile costs are traced in")
    if not has_gpu():
        raise InputError("needs a CUDA GPU: the tiles are timed inside the kernel")
    with outs, Progress(len(shapes) * len(tokens) * len(blocks), "calibrate: runs traced", quiet=args.json) as bar:
        costs, per_shape = calibrate_moe(shapes, tokens=tokens, block_specs=blocks, reps=reps,
                                         progress=bar.callback, model_shapes=model_shapes, dtype=dtype,
                                         schedules=schedules)
        costs.save(out / MOE_COSTS)
        w = ResultWriter(out / MOE_TILES, columns=list(per_shape[0]), key_columns=["shape", "block", "kind", "tokens"])
        w.write_many(r for r in per_shape if not w.done(r))
    table = [{"kind": k, "overhead_ns": c.overhead_ns, "rate": c.rate,
              "max_err": costs.quality[k]["max_abs_rel_error"]} for k, c in costs.kinds.items()]
    model_text = f"\ntile model {costs.provenance['tile_model']}"
    if costs.tile_model is not None:
        model_text += ": " + ", ".join(f"{k} {getattr(costs.tile_model, k):.4g}" for k in costs.tile_model.CONSTANTS)
    emit({"costs": costs.to_dict(), "tiles": per_shape}, args.json,
         markdown_table(per_shape, list(per_shape[0])) + "\n\n" + markdown_table(table, list(table[0]))
         + model_text + f"\nwritten to {out / MOE_COSTS}")
    return 0


def _add_calibration(p) -> None:
    p.add_argument("--calibration", type=path_arg, metavar="CSV",
                   help="ulysses.csv of `xstage bench ulysses --grid calibration` "
                   "to fit the exchange costs on (default: the embedded H200 host-path calibration)")


def run_plan_ulysses(args) -> int:
    sizes = dict(zip(ULYSSES_FLAGS, check_call_shape(args.heads, args.dim, args.tokens, args.ranks, ULYSSES_FLAGS)))
    cands = exchange_list(args.candidates)
    costs = _exchange_costs(args.calibration)
    ranked = plan_exchange(sizes["--heads"], sizes["--dim"], sizes["--tokens"], sizes["--ranks"], costs, cands)
    table = [{"exchange": p.exchange, "time_us": p.time_ns / 1e3, "vs_best": p.time_ns / ranked[0].time_ns,
              "attention_us": p.attention_ns / 1e3, "exposed_overhead_us": p.overhead_ns / 1e3} for p in ranked]
    text = (f"{sizes['--heads']} heads x {sizes['--dim']}, {sizes['--tokens']} tokens, {sizes['--ranks']} ranks "
            f"(rank 0's share); costs fitted on {costs.source}\n"
            + markdown_table(table, list(table[0]), floatfmt=".4g") + f"\npick: {ranked[0].exchange}")
    emit({"rows": table, "pick": ranked[0].exchange}, args.json, text)
    return 0


def _exchange_costs(calibration: str | None):
    if calibration is None:
        return default_exchange_costs()
    res = load_results(calibration, kind="ulysses")
    return fit_exchange_costs(res.rows, drain=load_default_profile("host").params.drain, source=str(res.path),
                              lines=res.lines)


def run_exchange_costs(args) -> int:
    """Fit the exchange costs (the embedded calibration, or `--calibration`) and write them as JSON:
    the file `xstage/data` ships, so that no process fits at run time."""
    outs = Outputs("xstage plan exchange-costs", force=args.force, inputs=[("--calibration", args.calibration)])
    out = outs.folder(args.out, "-o", files=[COSTS_JSON])
    costs = fit_default_exchange_costs() if args.calibration is None else _exchange_costs(args.calibration)
    data = costs_to_dict(costs)
    with outs:
        (out / COSTS_JSON).write_text(json.dumps(data, indent=1) + "\n")
    emit(data, args.json, f"exchange costs fitted on {costs.source}, written to {out / COSTS_JSON}")
    return 0


def run_attention_costs(args) -> int:
    outs = Outputs("xstage plan attention-costs", force=args.force, inputs=[("results", args.results)])
    out = outs.folder(args.out, "-o", files=[ATTENTION_COSTS])
    res = load_results(args.results, kind="ulysses")
    with outs:
        costs = attention_costs(res.rows, source=str(res.path), lines=res.lines)
        costs.save(out / ATTENTION_COSTS)
    table = [{"kind": k, "overhead_ns": c.overhead_ns, "rate": c.rate, **costs.quality[k]}
             for k, c in costs.kinds.items()]
    emit(costs.to_dict(), args.json, markdown_table(table, list(table[0])) + f"\nwritten to {out / ATTENTION_COSTS}")
    return 0


def run_validate(args) -> int:
    outs = Outputs("xstage plan validate", force=args.force, inputs=[
        ("results", args.results), ("--profile", args.profile), ("--costs", args.costs),
        ("--calibration", args.calibration)])
    outs.folder(args.out, "-o")  # a usable folder; its files are declared once the results' kind is known
    env = environment()
    workers = args.workers  # checked by its `type=`
    candidates = schedule_list(args.candidates)
    try:
        Variant("expert_wave", args.default_pacing)  # a malformed pacing fails here, before any simulation
    except InputError as exc:
        raise InputError(f"--default-pacing {args.default_pacing}: {exc}") from None
    exchanges = exchange_list(args.exchange, default=(), flag="--exchange") if args.exchange is not None else None
    res = load_results(args.results, only=args.only)
    # Options of the other kind of results would be ignored: refused, like any input that is not used.
    other = {"moe": ("--calibration", "--exchange"), "ulysses": ("--costs",)}[res.kind]
    for flag in other:
        if getattr(args, flag[2:]) is not None:
            raise InputError(f"{flag}: applies to {'Ulysses' if res.kind == 'moe' else 'MoE'} results; "
                             f"{args.results} holds {'MoE' if res.kind == 'moe' else 'Ulysses'} results")
    # The kind of results (read from the file's header) says which files are written.
    out = outs.folder(args.out, "-o", files=VALIDATION[res.kind])
    params = _load_profile(args.profile).params
    if res.kind == "ulysses":
        csv_path = out / VALIDATION["ulysses"][0]
        with outs:
            out_rows, summary = validate_exchange(res.rows, _exchange_costs(args.calibration), exchanges)
            out_rows = with_provenance(out_rows, env)
            write_csv_atomic(csv_path, out_rows, list(out_rows[0]))
        emit({"exchanges": summary}, args.json, markdown_table(summary, list(summary[0]), floatfmt=".4g")
             + f"\nwritten to {csv_path}")
        return 0
    # Without --costs, each row's dtype takes its own embedded tile costs.
    costs = _load_costs(args.costs, "moe") if args.costs else {d: _load_costs(None, "moe", d) for d in ("bf16", "fp8")}
    csv_path, png_path = (out / name for name in VALIDATION["moe"])
    with outs, Progress(len(fused_rows(res.rows)), "validate: rows predicted", quiet=args.json) as bar:
        out_rows, summary = validate_moe(res.rows, params, costs, candidates=candidates,
                                         default_pacing=args.default_pacing, progress=bar.callback, workers=workers,
                                         source=str(res.path), lines=res.lines, pool_bytes=args.pool_bytes,
                                         interference=None if args.no_interference
                                         else load_default_interference(_load_profile(args.profile).path))
        out_rows = with_provenance(out_rows, env)
        write_csv_atomic(csv_path, out_rows, list(out_rows[0]))
        plot_lines([{**r, "ratio": r["predicted_ns"] / r["measured_ns"]} for r in out_rows], "tokens", "ratio",
                   ["shape", "schedule"], png_path, logx=True, hline=1.0,
                   ylabel="predicted / measured kernel time", title="MoE kernel: model vs measurement")
    emit(summary, args.json, markdown_table([summary], list(summary)) + f"\nwritten to {csv_path}")
    return 0


# ---- the parser ------------------------------------------------------------------------------------

def _add_model_files(p, kernel: str) -> None:
    p.add_argument("--profile", type=path_arg, metavar="JSON",
                   help="store-path profile JSON written by `xstage fit` or `xstage "
                   "probe` (default: the embedded H200 host-link profile)")
    p.add_argument("--costs", type=path_arg, metavar="JSON",
                   help=f"task costs JSON of {kernel} (default: the embedded H200 "
                   "tile costs of that kernel)")


def _add_interference(p) -> None:
    p.add_argument("--no-interference", action="store_true", help="predict without the store/compute "
                   "interference term (default: the term of the profile's path where one is calibrated)")


def _register_ulysses(kinds) -> None:
    """`plan ulysses`, `plan exchange-costs`, `plan layer` and `plan layer-grid` (`plan_layer`), and
    `plan attention-costs`."""
    u = kinds.add_parser("ulysses", help="rank every Ulysses exchange (serial, overlap, stores) for one call shape")
    add_call_shape(u)
    _add_calibration(u)
    u.add_argument("--candidates", metavar="X1,X2", help="comma-separated exchanges: serial[:CORE], "
                   "overlap[:CORE[:BLOCKS]], stores[:burst|:paced[:R]] "
                   f"(default: {','.join(EXCHANGE_CANDIDATES)})")
    add_json_option(u)
    u.set_defaults(handler=run_plan_ulysses)

    x = kinds.add_parser("exchange-costs", help="fit the Ulysses exchange costs and write them as JSON (the "
                         "file xstage/data ships; no GPU)")
    x.add_argument("-o", "--out", required=True, type=path_arg, metavar="DIR",
                   help=f"output folder, created if missing; {COSTS_JSON} is written in it, replacing only a file "
                   "this command wrote (required)")
    _add_calibration(x)
    add_force_option(x)
    add_json_option(x)
    x.set_defaults(handler=run_exchange_costs)

    register_layer(kinds)

    a = kinds.add_parser("attention-costs", help="attention tile costs from the attention-alone rows of a "
                         "`xstage bench ulysses` CSV (no GPU)")
    a.add_argument("results", type=path_arg, help="ulysses.csv written by `xstage bench ulysses` (required)")
    a.add_argument("-o", "--out", required=True, type=path_arg, metavar="DIR",
                   help="output folder, created if missing; "
                   f"{ATTENTION_COSTS} is written in it, replacing only a file this command wrote (required)")
    add_force_option(a)
    add_json_option(a)
    a.set_defaults(handler=run_attention_costs)


def register(sub) -> None:
    p = sub.add_parser("plan", help="predict schedules of a fused kernel with the Burst-Gap model and pick one")
    kinds = p.add_subparsers(dest="kernel", metavar="KERNEL")
    m = kinds.add_parser("moe", help="plan the fused MoE kernel's schedule")
    m.add_argument("--shape", required=True, help="MoE shape H<hidden>-I<intermediate>-E<experts>-K<topk> "
                   "(sizes in elements; required), e.g. H4096-I2048-E256-K6")
    m.add_argument("--tokens", type=cli_int(1, MAX_PLAN_TOKENS, "tokens per rank the planner simulates"),
                   required=True, help=f"tokens per rank, 1..{MAX_PLAN_TOKENS} (required)")
    m.add_argument("--ep", type=cli_int(1, MAX_RANKS, "expert-parallel ranks"), required=True,
                   help=f"expert-parallel group size in ranks, 1..{MAX_RANKS}; must divide the shape's experts "
                   "(required)")
    _add_model_files(m, "the MoE kernel, from `xstage plan calibrate`")
    m.add_argument("--ctas", type=cli_int(1, MAX_PLAN_CTAS, CTAS_MEANING), default=None,
                   help=f"persistent CTAs, 1..{MAX_PLAN_CTAS} (default: this GPU's SM count, else the SM count of "
                   "the profile's GPU)")
    m.add_argument("--candidates", metavar="S1,S2", help="comma-separated schedules to rank (default: "
                   f"{','.join(CANDIDATES)})")
    m.add_argument("--block-m", metavar="BM1,BM2", help="comma-separated BLOCK_M values to try, in rows per tile: "
                   "powers of two >= 16 (default: the kernel's 128)")
    m.add_argument("--dtype", default="bf16", help="the buffer's dtype: bf16, or fp8 (1-byte operands in the FP8 "
                   "default tiles, BF16 combine rows; default: %(default)s)")
    m.add_argument("--seed", type=cli_type(check_seed), default=0, help="seed of the synthetic routing, "
                   "0..2^63-1 (default: 0)")
    m.add_argument("--pacing", default=AUTO, help="the kernel's store pacing: auto (rank every schedule under "
                   f"each of {', '.join(PACING_CANDIDATES)}), default (the fixed default of the profile's path), off, "
                   "or RATE:BUDGET in GB/s:KiB such as 50:128 (default: auto)")
    _add_interference(m)
    m.add_argument("--plot", type=path_arg, metavar="PATH",
                   help="write the best candidate's timeline here: a .png file, or an "
                   f"existing folder (writes {PLOT_NAME} in it); an existing file is replaced only if this command "
                   "wrote it, or with --force (default: no plot)")
    add_force_option(m)
    add_json_option(m)
    m.set_defaults(handler=run_plan_moe)

    _register_ulysses(kinds)

    c = kinds.add_parser("calibrate", help="time the fused MoE kernel's own tiles on the GPU (task costs JSON)")
    c.add_argument("-o", "--out", required=True, type=path_arg, metavar="DIR",
                   help="output folder, created if missing; "
                   f"{MOE_COSTS} and {MOE_TILES} (resumed) are written in it, replacing only files this command "
                   "wrote (required)")
    add_force_option(c)
    c.add_argument("--shapes", metavar="S1,S2", help="comma-separated MoE shapes H<hidden>-I<inter>-E<experts>-K<topk> "
                   f"(default: the benchmark shapes {','.join(CALIBRATION_SHAPES)})")
    c.add_argument("--tokens", type=int_list(1, MAX_TOKENS_PER_RANK, "tokens per rank of a traced run"),
                   default=[4096], metavar="T1,T2", help="comma-separated token counts of the traced runs, tokens "
                   f"per rank at EP=1, each 1..{MAX_TOKENS_PER_RANK} (default: 4096)")
    c.add_argument("--block", action="append", metavar="SPEC", help="tile config BM:BN1:BN2:BK:WARPS:STAGES "
                   "(block sizes in elements), repeatable (default: the benchmark's choice per shape)")
    c.add_argument("--dtype", default="bf16", help="the traced buffer's dtype: bf16, or fp8 (its default tiles "
                   "unless --block; rows carry elem_bytes 1; default: %(default)s)")
    c.add_argument("--reps", type=cli_int(1, MAX_REPS, "traced runs per shape"), default=3,
                   help=f"traced runs per shape whose median is taken, 1..{MAX_REPS} (default: 3)")
    c.add_argument("--model-shapes", metavar="S1,S2", help="comma-separated traced shapes to fit the tile model "
                   "(xstage.sched.tilecost) on, to score it on the others (default: every traced shape)")
    c.add_argument("--schedules", default="expert_wave", metavar="S1,S2", help="comma-separated schedules to trace; "
                   "the tile costs come from expert_wave (required among them), the others give the order effect "
                   "(xstage.sched.ordercost), e.g. expert_wave,interleaved,lag:1,lag:2,lag:4,lag:8,lag:16 "
                   "(default: %(default)s)")
    add_json_option(c)
    c.set_defaults(handler=run_calibrate)

    v = kinds.add_parser("validate", help="predicted vs measured kernel times from `xstage bench moe` or "
                         "`xstage bench ulysses` results")
    v.add_argument("results", type=path_arg, help="moe.csv or ulysses.csv written by `xstage bench` (required)")
    v.add_argument("-o", "--out", required=True, type=path_arg, metavar="DIR",
                   help="output folder, created if missing; "
                   "validation.csv and validation.png (MoE) or validation-ulysses.csv are written in it, replacing "
                   "only files this command wrote; never the RESULTS file (required)")
    add_force_option(v)
    _add_model_files(v, "the measured kernel (MoE or attention)")
    v.add_argument("--only", action="append", type=only_spec, metavar="KEY=V1,V2", help="validate only rows whose "
                   "column KEY has one of the values; repeatable, all must match (default: every row)")
    v.add_argument("--workers", type=cli_int(1, MAX_WORKERS, "processes"), default=1,
                   help=f"processes for the MoE simulations, 1..{MAX_WORKERS} (default: 1)")
    v.add_argument("--candidates", metavar="S1,S2", help="schedules a configuration needs measured to count for "
                   f"the pick accuracy (default: the planner's, {','.join(CANDIDATES)})")
    v.add_argument("--pool-bytes", type=cli_int(1, INT64_MAX, "bytes of the row pool"), default=None,
                   help="MoE results: the row pool of the kernel that "
                   "measured them, in bytes (268435456 is the default pool); default: none, for results of the "
                   "kernel before the row pool")
    v.add_argument("--default-pacing", default="default", help="pacing of variants without an @ suffix: default "
                   "(today's fixed default of the row's path), off (results measured before the kernel paced) or "
                   "RATE:BUDGET in GB/s:KiB (default: default)")
    _add_interference(v)
    v.add_argument("--exchange", default=None, metavar="X1,X2", help="Ulysses results: the exchanges to validate "
                   "(default: every exchange in the rows)")
    _add_calibration(v)
    add_json_option(v)
    v.set_defaults(handler=run_validate)
