"""`xstage bench ulysses`: the parser of the Ulysses grid and its handler (the grid itself: `xstage.bench.ulysses`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from xstage.attention.flash import MAX_FLASH_BLOCK, FlashConfig
from xstage.bench.ulysses import (
    BLOCK_FLAGS,
    CORE_RESULTS,
    CORE_SHAPES,
    RESULTS,
    SUMMARY_FILES,
    VARIANTS,
    check_variants,
    grid_configs,
    run_core,
    run_grid,
    tuned_configs,
)
from xstage.bench.ulysses_report import read_report_rows, write_report
from xstage.calibrate.exchange import fit_exchange_costs
from xstage.cli.args import add_force_option, cli_int, path_arg
from xstage.cli.bench import add_grid_options
from xstage.env import has_gpu
from xstage.errors import InputError
from xstage.model import load_default_profile
from xstage.results.output import Outputs, emit
from xstage.results.select import select
from xstage.sched.exchange import check_call_shape
from xstage.sched.measured import load_results


def _outputs(args) -> tuple[Outputs, Path]:
    """The files this run writes in `-o`, checked before any work; never one of its inputs."""
    inputs = [("--calibration", args.calibration)] + [("--tuned-from", t) for t in args.tuned_from or ()]
    outs = Outputs("xstage bench ulysses", force=args.force, inputs=inputs)
    appended = [] if args.summarize_only else [CORE_RESULTS if args.core else RESULTS]
    return outs, outs.folder(args.out, "-o", files=SUMMARY_FILES, append=appended)


def _flash_config(args):
    """The kernel's configuration from `--block-m` and the flags that go with it, or the fastest of
    `--tuned-from`'s core.csv files; None: the kernel's own choice. Checked (`FlashConfig`) before any
    work, measuring or not."""
    given = [f for f in BLOCK_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
    if not args.block_m:
        if given:
            raise InputError(f"{given[0]} needs --block-m (it overrides the kernel's configuration with it)")
        return tuned_configs(*args.tuned_from) if args.tuned_from else None
    if args.tuned_from:
        raise InputError("--block-m and --tuned-from both choose the kernel's configuration: give one of them")
    try:
        return FlashConfig(args.block_m, args.block_n or 128, args.num_warps or 8, args.num_stages or 3, 1, None)
    except InputError as exc:
        raise InputError(f"--block-m {args.block_m}{''.join(f' with {f}' for f in given)}: {exc}") from None


def _core_shapes(text: str | None) -> list[tuple[int, int, int]]:
    """`--core-shapes TOKENSxHEADSxDIM[,...]`, each a call the attention kernel runs; the defaults without it."""
    if text is None:
        return list(CORE_SHAPES)
    try:
        shapes = [tuple(int(x) for x in spec.split("x")) for spec in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(t) != 3 for t in shapes):
        raise InputError(f"--core-shapes {text!r}: expected TOKENSxHEADSxDIM[,...]")
    try:
        checked = [check_call_shape(h, d, t, 1, ("heads", "dim", "tokens", "ranks")) for t, h, d in shapes]
    except InputError as exc:
        raise InputError(f"--core-shapes {text!r}: {exc}") from None
    return [(t, h, d) for h, d, t, _ in checked]


def _variant_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list, e.g. "
                                         "attention:triton,serial:cudnn")
    try:
        return check_variants(names)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _turns(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return n


def _handler(args) -> int:
    # Every option and input is checked first, whether this run measures or summarizes: a malformed one
    # is refused before the GPU is even looked for.
    outs, out = _outputs(args)
    if args.turns > args.rep:
        raise InputError(f"--turns {args.turns}: at most --rep ({args.rep}) blocks of replays")
    fc = _flash_config(args)
    if args.core_shapes is not None and not args.core:
        raise InputError("--core-shapes needs --core (the shapes of the attention-core measurement)")
    shapes = _core_shapes(args.core_shapes)
    if not args.core:
        select(grid_configs(args.grid_set), args.only)  # an --only that selects nothing fails here
    costs = None
    if args.calibration is not None:  # the planner behind `auto`, fitted on this calibration grid
        res = load_results(args.calibration, kind="ulysses")
        costs = fit_exchange_costs(res.rows, drain=load_default_profile("host").params.drain, source=str(res.path),
                                   lines=res.lines)
    measuring = not args.summarize_only
    if not measuring and not any((out / f).is_file() for f in (RESULTS, CORE_RESULTS)):
        raise InputError(f"-o {out}: holds neither {RESULTS} nor {CORE_RESULTS}; run the grid first")
    if measuring and not has_gpu():
        raise InputError(f"{'--core ' if args.core else ''}needs a CUDA GPU (--summarize-only runs anywhere)")
    # A malformed results file is refused before the outputs are touched (not even the manifest).
    read = None if measuring else read_report_rows(out)
    with outs:
        if args.core and measuring:
            run_core(out, shapes=shapes, warmup=args.warmup, rep=args.rep)
        elif measuring:
            run_grid(out, only=args.only, path=args.path, warmup=args.warmup, rep=args.rep,
                     max_seconds=args.budget_s, flash_cfg=fc, variants=args.exchange, grid=args.grid_set,
                     graphs=not args.eager, turns=args.turns, costs=costs)  # `auto` rows follow the costs given
        summary = write_report(out, read)
    emit({"summary": str(summary)}, args.json, summary.read_text())
    return 0


def register_bench(grids) -> None:
    p = grids.add_parser("ulysses", help="fused Ulysses attention vs serial baselines (one GPU, loopback)")
    add_grid_options(p)
    p.add_argument("--path", choices=("host", "hbm"), default="host", help="where the other ranks' buffers "
                   "live: host (pinned host memory over PCIe) or hbm (device memory) (default %(default)s)")
    p.add_argument("--core", action="store_true",
                   help="measure the attention core vs cuDNN SDPA instead of the grid (16K tokens 24x128, 17776 "
                   "tokens 30x64; default: the grid)")
    p.add_argument("--core-shapes", default=None, help="with --core: TOKENSxHEADSxDIM[,...] (default both)")
    p.add_argument("--exchange", type=_variant_list, default=VARIANTS, metavar="X1,X2",
                   help="comma-separated variants: attention:triton, attention:cudnn and exchange spellings "
                   "(serial[:CORE], overlap[:CORE[:BLOCKS]], stores[:burst|:paced[:R]], auto) "
                   f"(default {','.join(VARIANTS)})")
    p.add_argument("--calibration", type=path_arg, metavar="CSV",
                   help="ulysses.csv of a `--grid calibration` run: the planner "
                   "behind `auto` is fitted on it (default: the embedded calibration)")
    p.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--turns", type=_turns, default=2, help="the variants take turns in this many blocks of the "
                   "--rep replays, so that a drift of the GPU's clocks over a configuration touches every "
                   "variant alike (1 to --rep; default %(default)s)")
    p.add_argument("--grid", dest="grid_set", choices=("main", "calibration"), default="main",
                   help="main: the 54 configurations; calibration: the planner's calibration shapes "
                   "(default %(default)s)")
    p.add_argument("--tuned-from", action="append", default=None, type=path_arg,
                   help="core.csv (repeatable): use the fastest configuration per head dim (default: the kernel's)")
    p.add_argument("--block-m", type=cli_int(0, MAX_FLASH_BLOCK, "BLOCK_M, rows per query tile; 0: the kernel's"),
                   default=None, help=f"override the kernel's BLOCK_M, rows per query tile, a power of two in "
                   f"16..{MAX_FLASH_BLOCK}, with the next three (default: the kernel's own choice)")
    p.add_argument("--block-n", type=cli_int(16, MAX_FLASH_BLOCK, "BLOCK_N, keys per step"), default=None,
                   help=f"with --block-m: keys per step, a power of two in 16..{MAX_FLASH_BLOCK} (default 128)")
    p.add_argument("--num-warps", type=cli_int(1, 32, "warps per program"), default=None,
                   help="with --block-m: warps per program, a power of two in 1..32 (default 8)")
    p.add_argument("--num-stages", type=cli_int(1, 16, "pipeline stages"), default=None,
                   help="with --block-m: pipeline stages, 1..16 (default 3)")
    add_force_option(p)
    # Long sequences take up to 160 ms a run: this grid keeps fewer runs per configuration than the others.
    p.set_defaults(handler=_handler, warmup=2, rep=10)
