"""`xstage plan`: predicted time of every candidate schedule of the fused MoE or Ulysses kernel, the
pick and a timeline plot; tile-cost calibration; validation against benchmark results."""

from __future__ import annotations

import sys
from pathlib import Path

from xstage.comm.pacing import spec_of
from xstage.errors import InputError
from xstage.model import Profile, load_default_profile
from xstage.model.data import write_csv_atomic
from xstage.moe.pacing import resolve_pacing
from xstage.moe.schedule import CANDIDATES, check_schedule
from xstage.moe.variant import Variant
from xstage.results import emit, markdown_table, read_rows, select
from xstage.results.io import ResultWriter
from xstage.results.plots import plot_lines
from xstage.sched.calibrate import CALIBRATION_SHAPES, calibrate_moe
from xstage.sched.costs import TaskCosts, load_default_costs
from xstage.sched.moe import MoeConfig
from xstage.sched.plan import default_ctas, plan_moe
from xstage.sched.timeline import plot_timeline
from xstage.sched.ulysses import DEFAULT_EXCHANGES, UlyssesConfig, attention_costs, plan_ulysses, validate_ulysses
from xstage.sched.validate import validate_moe


def _load_path_params(profile_path: str | None):
    profile = Profile.load(profile_path) if profile_path else load_default_profile()
    return profile, profile.params


def run_plan_moe(args) -> int:

    profile, params = _load_path_params(args.profile)
    costs = TaskCosts.load(args.costs) if args.costs else load_default_costs("moe")
    cfg = MoeConfig.parse(args.shape, tokens_per_rank=args.tokens, ep=args.ep)
    candidates = [check_schedule(c) for c in args.candidates.split(",")] if args.candidates else list(CANDIDATES)
    block_ms = [int(b) for b in args.block_m.split(",")] if args.block_m else None
    args.ctas = args.ctas or default_ctas(profile)
    if args.ctas < 1:
        raise InputError(f"--ctas {args.ctas}: must be >= 1")
    # The kernel's pacing: "auto" is the default of the profile's path (the kernel's own rule).
    pacing = resolve_pacing(args.pacing, profile.path, cfg.ep)
    rows = plan_moe(cfg, params, costs, args.ctas, candidates=candidates, block_ms=block_ms, seed=args.seed,
                    pacing=pacing)
    table = [
        {"schedule": r.schedule, "block_m": r.block_m, "time_us": r.time_ns / 1e3,
         "vs_best": r.time_ns / rows[0].time_ns, "stall_us_per_cta": r.breakdown["stall"] / 1e3 / args.ctas,
         "wait_us_per_cta": r.breakdown["wait"] / 1e3 / args.ctas}
        for r in rows
    ]
    plot = None
    if args.plot:
        plot = plot_timeline(rows[0].result, Path(args.plot),
                             title=f"{cfg.shape} T={cfg.tokens_per_rank} EP={cfg.ep}: {rows[0].schedule} (predicted)")
    text = (f"{cfg.shape}, {cfg.tokens_per_rank} tokens/rank, EP={cfg.ep}, {args.ctas} CTAs, "
            f"store pacing {spec_of(pacing)} (GB/s:KiB), "
            f"profile {profile.describe() if hasattr(profile, 'describe') else args.profile or 'default'}\n"
            + markdown_table(table, list(table[0]), floatfmt=".4g")
            + f"\npick: {rows[0].schedule} (block_m {rows[0].block_m})" + (f"\ntimeline: {plot}" if plot else ""))
    emit({"config": cfg.shape, "tokens_per_rank": cfg.tokens_per_rank, "ep": cfg.ep, "pacing": spec_of(pacing),
          "rows": table,
          "pick": rows[0].schedule, "plot": str(plot) if plot else None}, args.json, text)
    return 0


def _progress(label: str):
    def cb(done: int, total: int) -> None:
        end = "\n" if done == total else ""
        print(f"\r{label}: {done}/{total}", end=end, file=sys.stderr, flush=True)

    return cb


def run_calibrate(args) -> int:

    out = Path(args.out)
    shapes = args.shapes.split(",") if args.shapes else list(CALIBRATION_SHAPES)
    tokens = [int(t) for t in str(args.tokens).split(",")]
    costs, per_shape = calibrate_moe(shapes, tokens=tokens, block_specs=args.block or [None], reps=args.reps,
                                     progress=_progress("calibrate"))
    out.mkdir(parents=True, exist_ok=True)
    costs.save(out / "moe-task-costs.json")

    w = ResultWriter(out / "moe-tiles.csv", columns=list(per_shape[0]),
                     key_columns=["shape", "block", "kind", "tokens"])
    w.write_many(r for r in per_shape if not w.done(r))
    table = [{"kind": k, "overhead_ns": c.overhead_ns, "rate": c.rate,
              "max_err": costs.quality[k]["max_abs_rel_error"]} for k, c in costs.kinds.items()]
    emit({"costs": costs.to_dict(), "tiles": per_shape}, args.json,
         markdown_table(per_shape, list(per_shape[0])) + "\n\n" + markdown_table(table, list(table[0]))
         + f"\nwritten to {out}/moe-task-costs.json")
    return 0


def run_plan_ulysses(args) -> int:

    profile, params = _load_path_params(args.profile)
    costs = TaskCosts.load(args.costs) if args.costs else load_default_costs("attention")
    cfg = UlyssesConfig(heads=args.heads, head_dim=args.dim, tokens=args.tokens, ranks=args.ranks,
                        batch=args.batch, grid=args.ctas or default_ctas(profile))
    cands = args.candidates.split(",") if args.candidates else list(DEFAULT_EXCHANGES)
    rows = plan_ulysses(cfg, params, costs, cands)
    table = [{"exchange": n, "time_us": t / 1e3, "vs_best": t / rows[0][1],
              "stall_us_per_cta": b["stall"] / 1e3 / min(cfg.grid, cfg.tiles)} for n, t, b in rows]
    text = (f"{cfg.heads} heads x {cfg.head_dim}, {cfg.tokens} tokens, {cfg.ranks} ranks: rank 0 has "
            f"{cfg.local_heads} heads, {cfg.tiles} tiles on {min(cfg.grid, cfg.tiles)} programs; "
            f"profile {profile.path}\n"
            + markdown_table(table, list(table[0]), floatfmt=".4g") + f"\npick: {rows[0][0]}")
    emit({"rows": table, "pick": rows[0][0]}, args.json, text)
    return 0


def run_attention_costs(args) -> int:

    costs = attention_costs(read_rows(args.results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    costs.save(out / "attention-task-costs.json")
    table = [{"kind": k, "overhead_ns": c.overhead_ns, "rate": c.rate, **costs.quality[k]}
             for k, c in costs.kinds.items()]
    emit(costs.to_dict(), args.json, markdown_table(table, list(table[0]))
         + f"\nwritten to {out}/attention-task-costs.json")
    return 0


def _validate_ulysses(args, rows, params, out: Path) -> int:

    costs = TaskCosts.load(args.costs) if args.costs else load_default_costs("attention")
    out_rows, summary = validate_ulysses(rows, params, costs, exchange=args.exchange)
    out.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out / "validation-ulysses.csv", out_rows, list(out_rows[0]))
    emit(summary, args.json, markdown_table([summary], list(summary)) + f"\nwritten to {out}/validation-ulysses.csv")
    return 0


def run_validate(args) -> int:

    _, params = _load_path_params(args.profile)
    costs = TaskCosts.load(args.costs) if args.costs else load_default_costs("moe")
    rows = read_rows(args.results)
    if args.only:
        rows = select(rows, args.only)
    if rows and "heads" in rows[0]:  # a `xstage bench ulysses` CSV
        return _validate_ulysses(args, rows, params, Path(args.out))
    candidates = [check_schedule(c) for c in args.candidates.split(",")] if args.candidates else list(CANDIDATES)
    Variant("expert_wave", args.default_pacing)  # a malformed --default-pacing fails here, before any simulation
    out_rows, summary = validate_moe(rows, params, costs, candidates=candidates, default_pacing=args.default_pacing,
                                     progress=_progress("validate"), workers=args.workers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out / "validation.csv", out_rows, list(out_rows[0]))
    plot_lines([{**r, "ratio": r["predicted_ns"] / r["measured_ns"]} for r in out_rows], "tokens", "ratio",
               ["shape", "schedule"], out / "validation.png", logx=True, hline=1.0,
               ylabel="predicted / measured kernel time", title="MoE kernel: model vs measurement")
    emit(summary, args.json, markdown_table([summary], list(summary)) + f"\nwritten to {out}/validation.csv")
    return 0


def _add_model_files(p) -> None:
    p.add_argument("--profile", help="store-path profile JSON (default: the embedded H200 profile)")
    p.add_argument("--costs", help="task costs JSON (default: the embedded H200 tile costs of the kernel)")


def register(sub) -> None:
    p = sub.add_parser("plan", help="predict schedules of a fused kernel with the Burst-Gap model and pick one")
    kinds = p.add_subparsers(dest="kernel", metavar="KERNEL")
    m = kinds.add_parser("moe", help="plan the fused MoE kernel's schedule")
    m.add_argument("--shape", required=True, help="MoE shape H<hidden>-I<intermediate>-E<experts>-K<topk>, "
                   "e.g. H4096-I2048-E256-K6")
    m.add_argument("--tokens", type=int, required=True, help="tokens per rank")
    m.add_argument("--ep", type=int, required=True, help="expert-parallel group size")
    _add_model_files(m)
    m.add_argument("--ctas", type=int, default=None, help="persistent CTAs (default: this GPU's SM count, else "
                   "the SM count of the profile's GPU)")
    m.add_argument("--candidates", help="comma-separated schedules (default: expert_wave,interleaved,lag:1..16)")
    m.add_argument("--block-m", help="comma-separated BLOCK_M values to try (default 128)")
    m.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing")
    m.add_argument("--pacing", default="auto", help="the kernel's store pacing: auto (the default of the "
                   "profile's path), off, or GBPS:KIB such as 50:128")
    m.add_argument("--plot", help="write the best candidate's timeline PNG here")
    m.add_argument("--json", action="store_true", help="print JSON")
    m.set_defaults(handler=run_plan_moe)
    u = kinds.add_parser("ulysses", help="plan the fused Ulysses attention kernel's exchange (burst or paced)")
    u.add_argument("--heads", type=int, required=True, help="attention heads (all ranks)")
    u.add_argument("--dim", type=int, required=True, help="head dim")
    u.add_argument("--tokens", type=int, required=True, help="sequence length (all ranks)")
    u.add_argument("--ranks", type=int, required=True, help="sequence-parallel group size")
    u.add_argument("--batch", type=int, default=1)
    u.add_argument("--ctas", type=int, default=None, help="persistent programs (default: this GPU's SM count, "
                   "else the SM count of the profile's GPU)")
    _add_model_files(u)
    u.add_argument("--candidates", help="comma-separated exchanges (default: burst,paced:8..64)")
    u.add_argument("--json", action="store_true", help="print JSON")
    u.set_defaults(handler=run_plan_ulysses)
    a = kinds.add_parser("attention-costs", help="attention tile costs from the attention-alone rows of a "
                         "`xstage bench ulysses` CSV (no GPU)")
    a.add_argument("results", help="ulysses.csv written by `xstage bench ulysses`")
    a.add_argument("-o", "--out", required=True, help="output folder (attention-task-costs.json)")
    a.add_argument("--json", action="store_true", help="print JSON")
    a.set_defaults(handler=run_attention_costs)
    c = kinds.add_parser("calibrate", help="time the fused MoE kernel's own tiles on the GPU (task costs JSON)")
    c.add_argument("-o", "--out", required=True, help="output folder (moe-task-costs.json, moe-tiles.csv)")
    c.add_argument("--shapes", help="comma-separated shapes (default: the four benchmark shapes)")
    c.add_argument("--tokens", default="4096", help="comma-separated token counts of the traced runs (EP=1)")
    c.add_argument("--block", action="append", help="tile config BM:BN1:BN2:BK:WARPS:STAGES, repeatable "
                   "(default: the benchmark's choice per shape)")
    c.add_argument("--reps", type=int, default=3, help="traced runs per shape (median)")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(handler=run_calibrate)
    v = kinds.add_parser("validate", help="predicted vs measured kernel times from `xstage bench moe` or "
                         "`xstage bench ulysses` results")
    v.add_argument("results", help="moe.csv or ulysses.csv written by `xstage bench`")
    v.add_argument("-o", "--out", required=True, help="output folder (validation.csv, validation.png)")
    _add_model_files(v)
    v.add_argument("--only", action="append", metavar="KEY=V1,V2", help="validate only matching rows")
    v.add_argument("--workers", type=int, default=1, help="processes for the simulations")
    v.add_argument("--candidates", help="schedules a configuration needs to count for the pick "
                   "(default: the planner's, expert_wave,interleaved,lag:1..16)")
    v.add_argument("--default-pacing", default="auto", help="pacing of variants without an @ suffix: auto "
                   "(today's default of the row's path) or off (results measured before the kernel paced)")
    v.add_argument("--exchange", default="burst", help="Ulysses results: the exchange the fused rows ran "
                   "(burst or paced:R)")
    v.add_argument("--json", action="store_true", help="print JSON")
    v.set_defaults(handler=run_validate)
    p.set_defaults(handler=lambda args: (p.print_help(), 1)[1])
