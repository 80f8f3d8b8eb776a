"""`xstage bench <grid>`: the options every grid shares (`add_grid_options`, and for the grids on real
groups under torchrun `add_dist_options`) and the `bench` command.

Each grid's parser is a module of this package (`moe`, `ulysses`, `moe_calls`) exposing
`register_bench(bench_subparsers)`; `register` takes them as arguments so that this module imports none
of them (they import it for `add_grid_options`). The grids themselves are `xstage.bench`'s.
"""

from __future__ import annotations

import argparse

from xstage.bench.runtime import BACKENDS
from xstage.cli.args import cli_int, cli_real, only_spec, path_arg
from xstage.dtypes import DTYPES
from xstage.env import has_gpu
from xstage.errors import InputError
from xstage.results import emit, select
from xstage.results.output import Outputs

WARMUP, REP = 5, 30  # untimed and timed runs per configuration: the default of every grid
MAX_RUNS = 100_000  # runs per configuration: past it a grid takes days where 30 runs give the median
MAX_BUDGET_S = 30 * 86400.0


def add_grid_options(p, repeats: bool = True) -> None:
    """Options every grid shares: output folder, slice filter, repeat counts (not for a grid that sizes
    its own runs: `repeats=False`), time budget, JSON summary."""
    p.add_argument("-o", "--out", required=True, type=path_arg,
                   help="output folder (CSV, plots, summary.md); a rerun resumes "
                   "where the CSV stops")
    p.add_argument("--only", action="append", type=only_spec, metavar="KEY=V1,V2", help="run only matching "
                   "configurations; repeatable, all must match (default: the whole grid)")
    if repeats:
        p.add_argument("--warmup", type=cli_int(0, MAX_RUNS, "untimed runs per configuration"), default=WARMUP,
                       help=f"untimed runs per configuration, 0..{MAX_RUNS} (default %(default)s)")
        p.add_argument("--rep", type=cli_int(1, MAX_RUNS, "timed runs per configuration"), default=REP,
                       help=f"timed runs per configuration, 1..{MAX_RUNS}; median, p10 and p90 are "
                       "reported (default %(default)s)")
    p.add_argument("--budget-s", type=cli_real(1, MAX_BUDGET_S, "seconds of the grid's budget", "s"), default=None,
                   help="stop starting configurations after this many seconds, 1..30 days (default: no limit); "
                   "rerun to continue")
    p.add_argument("--summarize-only", action="store_true", help="only write the summary and plots again from "
                   "the CSV (no GPU needed)")
    p.add_argument("--json", action="store_true", help="print the summary as standard JSON")


def handle_gpu_grid(args, command: str, grid, read, run, require) -> int:
    """The handler of a GPU grid that appends to one CSV (`grid.RESULTS`) and writes its summary
    (`grid.SUMMARY_FILES`, `grid.summarize`): every refusal (an `--only` that selects nothing, nothing to
    summarize, no GPU, `require()` failing) comes before any output or GPU work. `read(path)` loads the
    CSV for `--summarize-only`; `run(out)` runs the grid into `out` and returns its summary."""
    outs = Outputs(command, force=args.force)
    out = outs.folder(args.out, "-o", files=grid.SUMMARY_FILES, append=() if args.summarize_only else [grid.RESULTS])
    select(grid.grid_configs(), args.only)
    if args.summarize_only and not (out / grid.RESULTS).is_file():
        raise InputError(f"-o {out}: holds no {grid.RESULTS} to summarize; run the grid first")
    if not args.summarize_only:
        if not has_gpu():
            raise InputError("needs a CUDA GPU (--summarize-only runs anywhere)")
        require()
    rows = read(out / grid.RESULTS) if args.summarize_only else None
    with outs:
        summary = grid.summarize(out, rows) if args.summarize_only else run(out)
    emit(summary, args.json, (out / "summary.md").read_text())
    return 0


def register(sub, grid_modules) -> None:
    """The `bench` command with one subcommand per module of `grid_modules`."""
    p = sub.add_parser("bench", help="benchmark grids (fused kernels vs baselines)")
    grids = p.add_subparsers(dest="grid", metavar="GRID")
    for module in grid_modules:
        module.register_bench(grids)


def add_dist_options(p: argparse.ArgumentParser) -> None:
    """The options of a distributed grid: those of `xstage bench <grid>` plus dtype and backend."""
    add_grid_options(p)
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on GPUs, fp32 on the CPU")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="process group; default: nccl when every rank has its own GPU, else gloo")
