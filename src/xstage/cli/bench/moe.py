"""`xstage bench moe`: the parser of the fused MoE grid and its handler (the grid itself: `xstage.bench.moe`)."""

from __future__ import annotations

from xstage.bench.moe import (
    DECODE_TOKENS,
    GRIDS,
    RESULTS,
    SCHEDULES,
    SUMMARY_FILES,
    block_per_dtype,
    grid_configs,
    run_grid,
)
from xstage.bench.moe_summary import read_moe_csv, summarize
from xstage.cli.args import add_force_option
from xstage.cli.bench import add_grid_options
from xstage.dtypes import FP8_DTYPES, parse_dtype
from xstage.env import has_gpu
from xstage.errors import InputError
from xstage.results import emit, select
from xstage.results.output import Outputs
from xstage.spec.variant import parse_variants


def register_bench(grids) -> None:
    p = grids.add_parser("moe", help="fused MoE schedules vs expert_wave and the unfused pipeline")
    add_grid_options(p)
    p.add_argument("--grid", choices=GRIDS, default="main", help="main: the 84+8 configurations; decode: "
                   f"{', '.join(map(str, DECODE_TOKENS))} tokens per rank at EP 1, 2, 4, 8 (default %(default)s)")
    p.add_argument("--path", choices=("host", "hbm"), default="host", help="loopback store path for EP>1 "
                   "(default host: pinned host memory over PCIe)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated variants SCHEDULE[@PACING], "
                   "PACING one of off, auto or RATE_GBPS:BUDGET_KIB (default: %(default)s, the buffer's pacing)")
    p.add_argument("--block", default=None, help="block BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS] for every shape and "
                   "dtype, or DTYPE=SPEC entries separated by commas (default: the kernel's BlockConfig, or its FP8 "
                   "default for fp8)")
    p.add_argument("--dtype", default="bf16", metavar="D1,D2", help="comma-separated dtypes, each configuration "
                   "measured in each in turn: bf16, fp8 (FP8 buffer, block-scaled e4m3 weights; default: %(default)s)")
    add_force_option(p)
    p.set_defaults(handler=_handler)


def _handler(args) -> int:
    outs = Outputs("xstage bench moe", force=args.force)
    # --summarize-only reads moe.csv; a run appends to it.
    out = outs.folder(args.out, "-o", files=SUMMARY_FILES, append=() if args.summarize_only else [RESULTS])
    variants = parse_variants(args.schedules)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for d in dtypes or [""]:  # an unknown dtype fails here, before any GPU work
        parse_dtype(d, "--dtype", allowed=("bf16", *FP8_DTYPES))
    block_per_dtype(args.block, dtypes)  # a malformed --block fails here, before any GPU work
    select(grid_configs(args.grid), args.only)  # so does an --only that selects nothing
    if args.summarize_only and not (out / RESULTS).is_file():
        raise InputError(f"-o {out}: holds no {RESULTS} to summarize; run the grid first")
    if not args.summarize_only and not has_gpu():
        raise InputError("needs a CUDA GPU (--summarize-only runs anywhere)")
    # A malformed results file is refused before the outputs are touched (not even the manifest).
    rows = read_moe_csv(out / RESULTS) if args.summarize_only else None
    with outs:
        if args.summarize_only:
            summary = summarize(out, rows=rows)
        else:
            summary = run_grid(out, args.only, args.path, variants, args.warmup, args.rep, args.budget_s,
                               args.block, dtypes=dtypes, grid=args.grid)
    emit(summary, args.json, (out / "summary.md").read_text())
    return 0
