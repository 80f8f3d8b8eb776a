"""`xstage bench experts`: the parser of the experts-backend grid and its handler (the grid:
`xstage.integrations.transformers.bench`)."""

from __future__ import annotations

from xstage.cli.args import add_force_option
from xstage.cli.bench import add_grid_options
from xstage.env import has_gpu
from xstage.errors import InputError
from xstage.integrations.transformers.bench import (
    RESULTS,
    SUMMARY_FILES,
    grid_configs,
    read_experts_csv,
    run_grid,
    summarize,
)
from xstage.results import emit, select
from xstage.results.output import Outputs


def register_bench(grids) -> None:
    p = grids.add_parser("experts", help="transformers experts modules on experts_implementation='xstage' against "
                         "'grouped_mm', call against call, at real widths (GPU, transformers 5.17)")
    add_grid_options(p)
    add_force_option(p)
    p.set_defaults(handler=_handler)


def _handler(args) -> int:
    from xstage.integrations.transformers.backend import require_transformers

    outs = Outputs("xstage bench experts", force=args.force)
    out = outs.folder(args.out, "-o", files=SUMMARY_FILES, append=() if args.summarize_only else [RESULTS])
    select(grid_configs(), args.only)  # an --only that selects nothing fails here, before any GPU work
    if args.summarize_only and not (out / RESULTS).is_file():
        raise InputError(f"-o {out}: holds no {RESULTS} to summarize; run the grid first")
    if not args.summarize_only:
        if not has_gpu():
            raise InputError("needs a CUDA GPU (--summarize-only runs anywhere)")
        require_transformers()
    rows = read_experts_csv(out / RESULTS) if args.summarize_only else None
    with outs:
        summary = summarize(out, rows) if args.summarize_only else run_grid(out, args.only, args.budget_s)
    emit(summary, args.json, (out / "summary.md").read_text())
    return 0
