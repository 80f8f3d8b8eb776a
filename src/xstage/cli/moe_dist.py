"""`python3 -m xstage.bench.moe_dist` under torchrun: the parser and entry of the MoE grid on a real EP
group (the grid: `xstage.bench.moe_dist`)."""

from __future__ import annotations

import argparse

from xstage.bench.moe_dist import SCHEDULES, SUMMARY_INTRO, SUMMARY_TITLE, run_peer_grid, table
from xstage.bench.moe_summary import summarize
from xstage.bench.runtime import Runtime, check_repeats
from xstage.cli.bench import add_dist_options
from xstage.dtypes import dtype_name
from xstage.results import emit
from xstage.spec.moe import parse_block
from xstage.spec.variant import parse_variants


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m xstage.bench.moe_dist",
                                 description="MoE grid on a real EP group (run under torchrun, one process per rank)")
    add_dist_options(ap)
    ap.add_argument("--schedules", default=",".join(SCHEDULES),
                    help="comma-separated variants SCHEDULE[@PACING], PACING one of off, auto or "
                         "RATE_GBPS:BUDGET_KIB (default: %(default)s, pacing auto)")
    ap.add_argument("--block", default=None, help="block BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS] for every shape "
                    "(default: the kernel's BlockConfig)")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dump-outputs", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    check_repeats(args.warmup, args.rep)
    variants = parse_variants(args.schedules)
    parse_block(args.block, 4096)  # a malformed --block fails here, before any rank starts
    if args.summarize_only:
        emit(summarize(args.out, SUMMARY_TITLE, SUMMARY_INTRO), args.json, table(args.out))
        return 0
    rt = Runtime.start(args.backend, timeout_s=300, name="moe_dist")
    with rt:
        dtype = rt.dtype(args.dtype)
        rt.log(f"world {rt.world}, backend {rt.backend}, device {rt.device}, dtype {dtype_name(dtype)}")
        summary = run_peer_grid(args.out, rt, args.only, variants, args.warmup, args.rep, args.budget_s,
                                args.block, dtype, args.tiny, args.dump_outputs)
        if summary is not None:
            emit(summary, args.json, table(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
