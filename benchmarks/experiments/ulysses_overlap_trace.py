"""Where does `overlap` lose time at P=2? Per-block timeline of the copy-engine exchange (one GPU, loopback).

In the Ulysses calibration the planner predicts `overlap:cudnn` within 1% at P = 4 and 8, but 3-7% of
attention alone too fast at P = 2 for 6144-24576 tokens, where its model hides every copy behind the
own half of the rows. Everything here runs as CUDA-graph replays, as the benchmark and the
calibration time it. One replay of `run_overlap(stamps=)` records, per block, `%globaltimer` stamps
(`xstage.comm.stamps`) when its stream starts and ends its attention and when the copy stream starts
and ends its copies, plus a stamp before and after the whole exchange; another graph runs each
block's attention alone, block after block, stamped the same way. Per block it reports the median
over `--reps` replays of: start and end of the compute and of the copies (from the exchange's first
stamp), the compute time beside the copies over alone, and the gap before the block starts. Per
configuration: the exchange's graph-replay time over attention alone (the same cuDNN core on the
whole sequence), both untraced. The stamps are one-thread kernels of a few us each.

Configurations: 24 heads x 128, bf16, rank 0 of a loopback group of P on the `host` path (pinned
memory over PCIe), as `xstage bench ulysses`. Writes `overlap_trace.csv` under `--out` (default
`$OUT`) and prints a short table last. (`benchmarks/results/h200-ulysses-overlap-trace/` was made by
the eager, CUDA-event version of this script, commit 99cd441.)

    PYTHONPATH=src python3 benchmarks/experiments/ulysses_overlap_trace.py --out DIR [--tokens 6144,12288,24576]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path

import torch

from xstage.attention.flash import default_config
from xstage.attention.layout import empty_gathered_out, unpack_qkv
from xstage.attention.overlap import attend, concurrent_tiles, run_overlap
from xstage.attention.ulysses import fused_state, loopback_gather, stage_buffer
from xstage.bench.ulysses import graphed
from xstage.comm import create_context
from xstage.comm.stamps import stamp
from xstage.results import time_device
from xstage.results.io import ResultWriter
from xstage.results.tables import markdown_table
from xstage.spec.exchange import parse_exchange
from xstage.spec.ulysses import UlyssesPlan, overlap_blocks, split_sizes

COLUMNS = ["tokens", "P", "heads", "dim", "variant", "block", "rows", "remote_rows", "compute_start_us",
           "compute_end_us", "compute_us", "alone_us", "slowdown", "gap_us", "copy_start_us", "copy_end_us",
           "copy_us", "copy_bytes", "stamped_us", "total_us", "attention_us", "overhead"]


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
    n = len(blocks)
    stamps = torch.zeros(n, 4, dtype=torch.int64, device=dev)
    ends = torch.zeros(2, dtype=torch.int64, device=dev)
    alone = torch.zeros(n, 2, dtype=torch.int64, device=dev)

    def whole():
        attend(ex.core, qg, kg, vg, og, config=fc)

    def exchange():
        run_overlap(plan, ex, qg, kg, vg, og, own_out, stage.peers, config=fc)

    def stamped():
        stamp(ends, 0)
        run_overlap(plan, ex, qg, kg, vg, og, own_out, stage.peers, config=fc, stamps=stamps)
        stamp(ends, 1)

    def blocks_alone():
        for i, ranges in enumerate(blocks):
            stamp(alone, 2 * i)
            for lo, hi in ranges:
                attend(ex.core, qg[:, lo:hi], kg, vg, og[:, lo:hi], config=fc)
            stamp(alone, 2 * i + 1)

    replay = {name: graphed(fn, warmup=2) for name, fn in
              (("whole", whole), ("exchange", exchange), ("stamped", stamped), ("alone", blocks_alone))}
    attention_ms = time_device(replay["whole"], warmup=2, rep=reps).median_ns / 1e6
    total_ms = time_device(replay["exchange"], warmup=2, rep=reps).median_ns / 1e6
    runs, alone_runs = [], []
    for _ in range(reps):
        replay["stamped"]()
        replay["alone"]()
        torch.cuda.synchronize()
        t0 = int(ends[0])
        runs.append(((stamps - t0).cpu().double() / 1e3, float(ends[1] - ends[0]) / 1e3))
        alone_runs.append((alone[:, 1] - alone[:, 0]).cpu().double() / 1e3)
    t = torch.stack([r[0] for r in runs]).median(0).values  # [n, 4] us from the exchange's first stamp
    al = torch.stack(alone_runs).median(0).values
    stamped_us = statistics.median(r[1] for r in runs)
    rows = []
    prev_end = 0.0
    for i, ranges in enumerate(blocks):
        rows_i = sum(hi - lo for lo, hi in ranges)
        remote = sum(max(0, min(hi, a) - lo) + max(0, hi - max(lo, b)) for lo, hi in ranges)
        cs, ce, ks, ke = (float(v) for v in t[i])
        rows.append(dict(tokens=T, P=P, heads=H, dim=D, variant=variant, block=i, rows=rows_i, remote_rows=remote,
                         compute_start_us=cs, compute_end_us=ce, compute_us=ce - cs, alone_us=float(al[i]),
                         slowdown=(ce - cs) / float(al[i]) if al[i] > 0 else math.nan, gap_us=cs - prev_end,
                         copy_start_us=ks, copy_end_us=ke, copy_us=ke - ks, copy_bytes=remote * h * D * 2,
                         stamped_us=stamped_us, total_us=total_ms * 1e3, attention_us=attention_ms * 1e3,
                         overhead=total_ms / attention_ms - 1))
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
                                    alone_sum_us=f"{sum(r['alone_us'] for r in rows):.0f}",
                                    gaps_us=f"{sum(r['gap_us'] for r in rows[1:]):.0f}",
                                    extra_compute_us=f"{sum(r['compute_us'] - r['alone_us'] for r in rows):.0f}",
                                    tail_copy_us=f"{max(r['copy_end_us'] for r in rows) - last['compute_end_us']:.0f}",
                                    total_us=f"{last['total_us']:.0f}", attention_us=f"{last['attention_us']:.0f}"))
                torch.cuda.empty_cache()
    print(markdown_table(summary, list(summary[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
