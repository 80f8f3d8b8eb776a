"""EP=1: the fused MoE kernel against the grouped_mm chain, per block configuration (one GPU, no torchrun).

At EP=1 nothing crosses a link, so the fused kernel competes only with the compute chain
grouped_mm -> SwiGLU -> grouped_mm on pre-sorted rows. For each shape and token count the weights and
routing are built once, and every block spec of `--blocks` (`BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS]`, FLAGS
picking the TMA / dynamic-fetch kernel variants) runs the same problem: fused main kernel and reduce
times, their ratio to the chain, the kernel's registers, spills and shared memory, and the error
against the chain's combined output. `--trace` adds one traced run per block: the fraction of CTA
time spent inside tasks and the median tile time per task kind.

Rows go to `OUT_DIR/ep1.csv` (resumable: a rerun into the same folder skips measured rows) with
provenance columns; the table of fused/chain ratios is printed at the end.

    PYTHONPATH=src python3 benchmarks/experiments/moe_ep1.py -o OUT_DIR [--blocks SPEC,SPEC] \\
        [--shapes H4096-I2048-E256-K6,...] [--tokens 4096,16384] [--schedule lag:16] [--trace]
"""

from __future__ import annotations

import argparse
import math
import traceback
from pathlib import Path

import torch

from xstage.bench.moe import time_fused
from xstage.errors import InputError
from xstage.moe.baseline import Unfused
from xstage.moe.buffer import LoopbackGroup, MoEBuffer
from xstage.moe.fused import launch_main, launch_reduce, plan
from xstage.moe.layout import transform_weights
from xstage.moe.problem import Problem
from xstage.results import ResultWriter, geomean, read_rows, synchronize, time_device
from xstage.spec.moe import DEFAULT_BLOCK, SHAPES, MoeShape, parse_block
from xstage.spec.schedule import KIND_NAMES

KEYS = ["shape", "tokens", "schedule", "block"]
TILE_COLUMNS = [f"{name}_us" for name in KIND_NAMES]
TILE_MEAN_COLUMNS = [f"{name}_mean_us" for name in KIND_NAMES]
COLUMNS = KEYS + ["fused_us", "reduce_us", "chain_us", "fused_tflops", "chain_tflops", "ratio", "ratio_with_reduce",
                  "max_err", "regs", "spills", "shared", "busy", *TILE_COLUMNS, *TILE_MEAN_COLUMNS]


def _with_block(pb: Problem, cfg) -> None:
    """Give `pb` a buffer (and, for another block_n1, weight layout) for block config `cfg`."""
    if cfg.block_n1 != pb.cfg.block_n1:
        pb.w1t, pb.w2 = transform_weights(pb.l1, pb.l2, cfg.block_n1)
    pb.cfg = cfg
    pb.buf = MoEBuffer(pb.T, pb.E, pb.K, pb.H, pb.I, LoopbackGroup(pb.ep, path="hbm"), device=pb.x.device,
                       dtype=pb.x.dtype, config=cfg)


def _trace_summary(pb: Problem, schedule: str) -> tuple[float, dict]:
    """One traced run: the fraction of CTA time inside tasks (the rest is fetching, waiting and the
    tail) and the median and mean tile time per kind in us."""
    p = plan(pb.idx, pb.buf, schedule)
    trace = torch.zeros(p.schedule.num_tasks, 3, dtype=torch.int64, device=pb.x.device)
    launch_main(pb.x, pb.w1t, pb.w2, pb.buf, p, trace=trace)
    launch_reduce(pb.idx, pb.w, torch.empty_like(pb.x), pb.buf)
    synchronize()
    kinds = torch.from_numpy(p.schedule.global_order()[:, 0]).to(trace.device)
    ran = trace[:, 0] > 0  # unit slots without rows are skipped and leave zeros
    go, done = trace[ran, 0].double(), trace[ran, 1].double()
    busy = float((done - go).sum() / (p.schedule.num_ctas * (done.max() - go.min())))
    tiles = {}
    for i, name in enumerate(KIND_NAMES):
        d = (done - go)[kinds[ran] == i]
        if len(d):
            tiles.update({f"{name}_us": float(d.median()) / 1e3, f"{name}_mean_us": float(d.mean()) / 1e3})
    return busy, tiles


def ep1_sweep(shapes=None, tokens=(4096, 16384), blocks=(DEFAULT_BLOCK,), schedules=("interleaved",), warmup=3,
              rep=10, trace=False, writer: ResultWriter | None = None, log=print) -> list[dict]:
    """Fused kernel (main + reduce) vs the grouped_mm chain for each block spec and schedule, side by side
    on one problem per shape and token count; rows already in `writer` are skipped, new ones written to it."""
    rows = []
    for shape in shapes or SHAPES:
        H = MoeShape.parse(shape).hidden
        for T in tokens:
            todo = [(b, s) for b in blocks for s in schedules
                    if writer is None or not writer.done(dict(shape=shape, tokens=T, schedule=s, block=b))]
            if not todo:
                continue
            pb = Problem(shape, T, 1, "hbm", parse_block(todo[0][0], H))
            un = Unfused(pb, "hbm")
            chain = time_device(lambda un=un: un.chain(un.x_sorted), warmup=warmup, rep=rep).median_ns
            ref = un.combine(un.chain(un.x_sorted)).float()
            scale = float(ref.abs().max()) or 1.0
            for spec, schedule in todo:
                try:
                    # a fresh buffer per row: a launch that failed leaves no armed counters to the next
                    _with_block(pb, parse_block(spec, H))
                    k = launch_main(pb.x, pb.w1t, pb.w2, pb.buf, plan(pb.idx, pb.buf, schedule))  # compiles
                    launch_reduce(pb.idx, pb.w, torch.empty_like(pb.x), pb.buf)  # re-arms the counters
                    main, red, y, _ = time_fused(pb, schedule, warmup, rep)
                    main = main.median_ns
                except Exception:  # a config that does not compile or fit: report and go on
                    log(f"ep1 {shape} T={T} block={spec} schedule={schedule}: " + traceback.format_exc()[-2500:])
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    continue
                f = pb.flops()
                busy, tiles = _trace_summary(pb, schedule) if trace else (float("nan"), {})
                row = dict(shape=shape, tokens=T, schedule=schedule, block=spec, fused_us=main / 1e3,
                           reduce_us=red / 1e3, chain_us=chain / 1e3, fused_tflops=f / main / 1e3,
                           chain_tflops=f / chain / 1e3, ratio=main / chain, ratio_with_reduce=(main + red) / chain,
                           max_err=float((y.float() - ref).abs().max()) / scale,
                           regs=getattr(k, "n_regs", -1), spills=getattr(k, "n_spills", -1),
                           shared=int(k.metadata.shared) if k is not None else -1, busy=busy, **tiles)
                rows.append(row)
                if writer is not None:
                    writer.write(row)
                log("ep1 " + " ".join(f"{c}={v:.4g}" if isinstance(v, float) else f"{c}={v}" for c, v in row.items()))
            del pb, un
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def _number(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def ep1_table(rows: list[dict]) -> str:
    """fused/chain per configuration (rows) and block spec (columns), geomean last; with traces, the
    busy fraction and median tile times."""
    rows = [{c: _number(v) if c not in KEYS else v for c, v in r.items()} for r in rows]
    for r in rows:
        r["tokens"] = int(r["tokens"])
    blocks = list(dict.fromkeys(r["block"] for r in rows))
    confs = list(dict.fromkeys((r["shape"], r["tokens"]) for r in rows))
    by = {(r["shape"], r["tokens"], r["block"]): r for r in rows}
    lines = ["| shape | tokens | chain us | " + " | ".join(blocks) + " |", "|---" * (3 + len(blocks)) + "|"]
    for shape, t in confs:
        chain = next(r["chain_us"] for r in rows if (r["shape"], r["tokens"]) == (shape, t))
        cells = [f"{by[(shape, t, b)]['ratio']:.3f}" if (shape, t, b) in by else "-" for b in blocks]
        lines.append(f"| {shape} | {t} | {chain:.0f} | " + " | ".join(cells) + " |")
    gm = [geomean([r["ratio"] for r in rows if r["block"] == b]) for b in blocks]
    lines.append("| geomean | | | " + " | ".join(f"{g:.3f}" for g in gm) + " |")
    traced = [r for r in rows if isinstance(r.get("busy"), float) and not math.isnan(r["busy"])]
    if traced:
        lines += ["", "busy fraction / median " + ", ".join(KIND_NAMES) + " tile us:"]
        for r in traced:
            lines.append(f"{r['shape']} {r['tokens']} {r['block']}: {r['busy']:.2f} / " + ", ".join(
                f"{r.get(c) if isinstance(r.get(c), float) else float('nan'):.1f}" for c in TILE_COLUMNS))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True, help="output folder (ep1.csv, resumable)")
    ap.add_argument("--blocks", default=DEFAULT_BLOCK,
                    help="comma-separated block specs BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS]")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes H<h>-I<i>-E<e>-K<k>")
    ap.add_argument("--tokens", default="4096,16384", help="comma-separated token counts")
    ap.add_argument("--schedule", default="lag:16", help="comma-separated schedules of the fused kernel")
    ap.add_argument("--trace", action="store_true", help="also one traced run per block: busy fraction, tile times")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rep", type=int, default=10)
    a = ap.parse_args(argv)
    blocks = a.blocks.split(",")
    path = Path(a.out) / "ep1.csv"
    try:  # malformed arguments and an unknown commit stop here, before anything is built
        shapes = [str(MoeShape.parse(s)) for s in a.shapes.split(",")]
        tokens = [int(t) for t in a.tokens.split(",")]
        for shape in shapes:
            for spec in blocks:
                parse_block(spec, MoeShape.parse(shape).hidden)
        if not torch.cuda.is_available():
            raise InputError("needs a CUDA GPU")
        writer = ResultWriter(path, COLUMNS, KEYS, require_commit=True)
    except (InputError, ValueError) as exc:
        ap.error(str(exc))
    schedules = a.schedule.split(",")
    ep1_sweep(shapes, tokens, blocks, schedules, a.warmup, a.rep, a.trace, writer)
    for schedule in schedules:
        chosen = [r for r in read_rows(path) if r["shape"] in shapes and int(r["tokens"]) in tokens
                  and r["block"] in blocks and r["schedule"] == schedule]
        print(f"schedule {schedule}:\n" + (ep1_table(chosen) if chosen else "no rows"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
