"""`xstage bench <grid>`: each benchmark grid registers itself through BENCH_MODULES.

A module named here exposes `register_bench(bench_subparsers)` and adds one subcommand
(e.g. `xstage bench moe`). Common options for grids: `add_grid_options(parser)`.
"""

from __future__ import annotations

import importlib

BENCH_MODULES: list[str] = [
    "xstage.bench.ulysses",
    "xstage.bench.moe",
]


def add_grid_options(p) -> None:
    """Options every grid shares: output folder, slice filter, repeat counts, JSON summary."""
    p.add_argument("-o", "--out", required=True, help="output folder (CSV, plots, summary.md); resumable")
    p.add_argument("--only", action="append", metavar="KEY=V1,V2", help="run only matching configurations")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs per configuration")
    p.add_argument("--rep", type=int, default=30, help="timed runs per configuration (median reported)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark grids (fused kernels vs baselines)")
    grids = p.add_subparsers(dest="grid", metavar="GRID")
    for name in BENCH_MODULES:
        importlib.import_module(name).register_bench(grids)
    p.set_defaults(handler=lambda args: (p.print_help(), 1)[1])
