"""`xstage bench moe-calls`: the parser of the call-against-transformers grid and its handler
(the grid: `xstage.bench.moe_calls`)."""

from __future__ import annotations

from xstage.bench import moe_calls
from xstage.cli.args import add_force_option
from xstage.cli.bench import add_grid_options, handle_gpu_grid


def register_bench(grids) -> None:
    p = grids.add_parser("moe-calls", help="the fused MoE call against transformers' grouped_mm experts, call "
                         "against call (GPU, transformers 5)")
    add_grid_options(p)
    add_force_option(p)
    p.set_defaults(handler=_handler)


def _handler(args) -> int:
    return handle_gpu_grid(args, "xstage bench moe-calls", moe_calls, moe_calls.read_calls_csv,
                           lambda out: moe_calls.run_grid(out, args.only, args.warmup, args.rep, args.budget_s),
                           moe_calls.require_transformers)
