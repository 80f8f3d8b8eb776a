"""Where does `overlap` lose time at P=2? Per-block timeline of the copy-engine exchange (one GPU, loopback).

In the Ulysses calibration the planner predicts `overlap:cudnn` within 1% at P = 4 and 8, but 3-7% of
attention alone too fast at P = 2 for 6144-24576 tokens, where its model hides every copy behind the
own half of the rows. This experiment records, for each block of `run_overlap` (`timeline=`), CUDA
events around its attention on its compute stream and around its copies on the copy stream, and
for comparison each block's attention alone, run block after block with no copies. Per block it
reports the median over `--reps` traced runs of: start and end of the compute and of the copies
(from the run's start), the compute time beside the copies over alone, and the gap before the block
starts (launch and stream hand-over). Per run: the exchange's time over attention alone (the same
cuDNN core on the whole sequence) and where the extra time sits: blocks slower, gaps, or the last
copy after the last block.

Configurations: 24 heads x 128, bf16, rank 0 of a loopback group of P on the `host` path (pinned
memory over PCIe), as `xstage bench ulysses`. Writes `overlap_trace.csv` under `--out` (default
`$OUT`) and prints a short table last.

    PYTHONPATH=src python3 benchmarks/experiments/ulysses_overlap_trace.py --out DIR [--tokens 6144,12288,24576]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path

import torch

from xstage.attention.exchange import parse_exchange
from xstage.attention.flash import default_config
from xstage.attention.layout import UlyssesPlan, empty_gathered_out, split_sizes, unpack_qkv
from xstage.attention.overlap import attend, concurrent_tiles, overlap_blocks, run_overlap
from xstage.attention.ulysses import fused_state, loopback_gather, stage_buffer
from xstage.comm import create_context
from xstage.results import time_device
from xstage.results.io import ResultWriter
from xstage.results.tables import markdown_table

COLUMNS = ["tokens", "P", "heads", "dim", "variant", "block", "rows", "remote_rows", "compute_start_us",
           "compute_end_us", "compute_us", "alone_us", "slowdown", "gap_us", "copy_start_us", "copy_end_us",
           "copy_us", "copy_bytes", "total_us", "attention_us", "overhead"]


def _setup(T: int, P: int, H: int, D: int, dev):
    plan = UlyssesPlan(P, 0, 1, split_sizes(T, P), H, D)
    h0, h1 = plan.head0[0], plan.head0[1]
    g = torch.Generator(device=dev).manual_seed(0)
    local = [torch.randn(1, plan.seq_lens[0], H, D, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    recv = torch.empty(T, 3, 1, h1 - h0, D, dtype=torch.bfloat16, device=dev)
    for i, t in enumerate(local):
        recv[:, i].copy_(loopback_gather(plan, t)[:, :, h0:h1].transpose(0, 1))
    qg, kg, vg = unpack_qkv(plan, recv.view(-1))
    fc = default_config(D, torch.bfloat16, dev)
    ctx = create_context(path="host", loopback_world=P, rank=0, device=dev)
    state = fused_state(ctx, plan, torch.bfloat16, fc.block_m)
    stage = stage_buffer(state, ctx)
    own_out = state.out.local[:, :plan.seq_lens[0], h0:h1]
    return plan, (qg, kg, vg), fc, stage, own_out


def trace_config(T: int, P: int, H: int, D: int, variant: str, reps: int, dev) -> list[dict]:
    plan, (qg, kg, vg), fc, stage, own_out = _setup(T, P, H, D, dev)
    ex = parse_exchange(variant)
    og = empty_gathered_out(plan, torch.bfloat16, dev)
    blocks = overlap_blocks(plan, ex.blocks, fc.block_m, cut=ex.cut, slots=concurrent_tiles(ex.core, dev, fc))
    a, b = plan.tok0[0], plan.tok0[1]
    h = plan.head0[1] - plan.head0[0]

    def whole():
        attend(ex.core, qg, kg, vg, og, config=fc)

    def exchange():
        run_overlap(plan, ex, qg, kg, vg, og, own_out, stage.peers, config=fc)

    for fn in (whole, exchange):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    attention_ms = time_device(whole, warmup=0, rep=reps).median_ns / 1e6
    total_ms = time_device(exchange, warmup=0, rep=reps).median_ns / 1e6
    # Each block's attention alone, block after block, no copies.
    alone = [[] for _ in blocks]
    for _ in range(reps):
        for i, ranges in enumerate(blocks):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for lo, hi in ranges:
                attend(ex.core, qg[:, lo:hi], kg, vg, og[:, lo:hi], config=fc)
            e.record()
            torch.cuda.synchronize()
            alone[i].append(s.elapsed_time(e))
    # Traced runs: per block compute and copy events, from the run's start.
    per = {}
    for _ in range(reps):
        timeline: list = []
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        run_overlap(plan, ex, qg, kg, vg, og, own_out, stage.peers, config=fc, timeline=timeline)
        torch.cuda.synchronize()
        for i, kind, s, e in timeline:
            per.setdefault((i, kind), []).append((start.elapsed_time(s), start.elapsed_time(e)))
    rows = []
    prev_end = 0.0
    for i, ranges in enumerate(blocks):
        n = sum(hi - lo for lo, hi in ranges)
        remote = sum(max(0, min(hi, a) - lo) + max(0, hi - max(lo, b)) for lo, hi in ranges)
        cs, ce = (statistics.median(v) for v in zip(*per[(i, "compute")]))
        ks, ke = (statistics.median(v) for v in zip(*per[(i, "copy")]))
        al = statistics.median(alone[i])
        rows.append(dict(tokens=T, P=P, heads=H, dim=D, variant=variant, block=i, rows=n, remote_rows=remote,
                         compute_start_us=cs * 1e3, compute_end_us=ce * 1e3, compute_us=(ce - cs) * 1e3,
                         alone_us=al * 1e3, slowdown=(ce - cs) / al if al else math.nan,
                         gap_us=(cs - prev_end) * 1e3, copy_start_us=ks * 1e3, copy_end_us=ke * 1e3,
                         copy_us=(ke - ks) * 1e3, copy_bytes=remote * h * D * 2, total_us=total_ms * 1e3,
                         attention_us=attention_ms * 1e3, overhead=total_ms / attention_ms - 1))
        prev_end = ce
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="6144,12288,24576")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--variants", default="overlap:cudnn:4:waves,overlap:cudnn:3:waves")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out)
    writer = ResultWriter(out / "overlap_trace.csv", COLUMNS, ["tokens", "P", "variant", "block"], require_commit=True)
    summary = []
    for P in (int(p) for p in args.worlds.split(",")):
        for T in (int(t) for t in args.tokens.split(",")):
            for v in args.variants.split(","):
                rows = trace_config(T, P, 24, 128, v, args.reps, dev)
                writer.write_many(rows)
                last = rows[-1]
                summary.append(dict(tokens=T, P=P, variant=v, overhead=f"{last['overhead']:.3f}",
                                    gaps_us=f"{sum(r['gap_us'] for r in rows[1:]):.0f}",
                                    extra_compute_us=f"{sum(r['compute_us'] - r['alone_us'] for r in rows):.0f}",
                                    tail_copy_us=f"{max(r['copy_end_us'] for r in rows) - last['compute_end_us']:.0f}",
                                    total_us=f"{last['total_us']:.0f}", attention_us=f"{last['attention_us']:.0f}"))
                torch.cuda.empty_cache()
    print(markdown_table(summary, list(summary[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
