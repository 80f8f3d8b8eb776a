"""`python3 -m xstage.bench.ulysses_dist` under torchrun: the parser and entry of the Ulysses grid on a
real group (the grid: `xstage.bench.ulysses_dist`)."""

from __future__ import annotations

import argparse
import time

from xstage.bench.runtime import Runtime, check_repeats
from xstage.bench.ulysses_dist import run_grid, write_report
from xstage.cli.bench import add_dist_options
from xstage.dtypes import dtype_name
from xstage.errors import InputError
from xstage.results import emit
from xstage.spec.exchange import parse_exchange


def _exchange(text: str) -> str:
    try:
        return str(parse_exchange(text))
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m xstage.bench.ulysses_dist",
                                description="Ulysses attention, fused vs serial, on a torchrun group")
    add_dist_options(p)
    p.add_argument("--exchange", type=_exchange, default="stores:paced", help="what the fused rows run, an "
                   "exchange spelling such as stores:burst or overlap:cudnn; write each to its own folder "
                   "(default %(default)s)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    t_start = time.monotonic()
    args = build_parser().parse_args(argv)
    check_repeats(args.warmup, args.rep)
    if args.summarize_only:
        path = write_report(args.out)
        emit({"summary": str(path)}, args.json, path.read_text())
        return 0
    rt = Runtime.start(args.backend, name="ulysses_dist")
    with rt:
        dtype = rt.dtype(args.dtype)
        rt.log(f"ulysses_dist: {rt.world} ranks, {rt.backend}, {rt.device}, {dtype_name(dtype)}")
        run_grid(args.out, rt, only=args.only, tiny=args.tiny, dtype=dtype, warmup=args.warmup, rep=args.rep,
                 budget_s=args.budget_s, t_start=t_start, exchange=args.exchange)
        if rt.rank == 0:
            path = write_report(args.out)
            emit({"summary": str(path)}, args.json, path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
