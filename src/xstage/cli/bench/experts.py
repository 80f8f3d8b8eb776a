"""`xstage bench experts`: the parser of the experts-backend grid and its handler (the grid:
`xstage.integrations.transformers.bench`)."""

from __future__ import annotations

from xstage.cli.args import add_force_option
from xstage.cli.bench import add_grid_options, handle_gpu_grid


def register_bench(grids) -> None:
    p = grids.add_parser("experts", help="transformers experts modules on experts_implementation='xstage' against "
                         "'grouped_mm', call against call, at real widths (GPU, transformers 5.17)")
    # The grid sizes its own runs (as many calls as fit 0.6 s, 10-200): no --warmup or --rep.
    add_grid_options(p, repeats=False)
    add_force_option(p)
    p.set_defaults(handler=_handler)


def _handler(args) -> int:
    from xstage.integrations.transformers import bench
    from xstage.integrations.transformers.backend import require_transformers

    return handle_gpu_grid(args, "xstage bench experts", bench, bench.read_experts_csv,
                           lambda out: bench.run_grid(out, args.only, args.budget_s), require_transformers)
