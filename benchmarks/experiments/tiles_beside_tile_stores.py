"""GEMM tiles beside the combine stores of k tile-sized bursts: the fused MoE kernel's unpaced pattern.

The interference term (`xstage.model.interference`) was calibrated on storers that push 1 MiB passes
without pause and on readers that only load; in the fused MoE kernel every CTA computes a tile, then
sends 32 KiB of scattered combine rows, then computes the next. `benchmarks/results/unpaced-diagnosis/`
found the term inactive in most unpaced kernels the model under-predicts. Here every CTA of a full
grid repeats rounds of one BF16 GEMM tile (`[128, 1536] x [1536, 256]`, the shape of an
H4096-I1536 Linear-2 tile: its own activation rows, weights shared by all CTAs) and then stores the
tile: the first `store_rows` rows (32 KiB at 64 rows) to random rows of a pinned host buffer of
`footprint` bytes (`host`, over PCIe) when the CTA is one of the first k, every other row to a
device buffer. Per CTA the kernel sums `%globaltimer` over the rounds (the first warms up); per
condition it reports the median over storing and over non-storing CTAs of the mean round, the
storers' store phase (until their last store issued; per-CTA means of the last launch), the median
kernel time and the host bytes per second (`xstage.results.time_device`).
`--pacing` paces each storer's burst as the fused kernel does (`xstage.comm.pacing`), the wait
counted in the store phase; the first run (commit 2a6bec3) had no pacing (`off`).
`--pattern` places the stored rows: `uniform` (the first runs) draws each 512-byte row anywhere in
the footprint; `combine:H` lays the footprint out as the fused kernel's combine buffer of H-wide
BF16 rows and stores as a Linear-2 tile does: a unit's 64 rows (sorted, as routing orders a unit's
tokens) receive the 512-byte segment of one column block per round, the next column block the next
round, a new unit once every block was sent.

    PYTHONPATH=src python3 benchmarks/experiments/tiles_beside_tile_stores.py --out DIR \
        [--storers 0,8,33] [--pacing off,50:128] [--pattern uniform,combine:7168]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from xstage.comm.device import globaltimer
from xstage.comm.pacing import pace_stores
from xstage.env import environment
from xstage.results import time_device
from xstage.results.io import write_csv_atomic
from xstage.results.tables import markdown_table
from xstage.spec.pacing import pacing_args, parse_pacing

BM, BN, BK, K = 128, 256, 64, 1536
ROW_BYTES = BN * 2


@triton.jit
def tile_rounds(p_a, p_b, p_host, p_dev, p_rows, p_t, p_clock, p_err, n_store, n_rounds, store_rows, pace_fs,
                pace_budget_ns, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    o_m = tl.arange(0, BM)
    o_n = tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    storer = pid < n_store
    a_base = p_a + pid.to(tl.int64) * BM * K
    host_rows = (o_m < store_rows) & storer  # these rows cross the link
    s_round = tl.zeros([], tl.int64)
    s_store = tl.zeros([], tl.int64)
    for r in range(n_rounds):
        t0 = globaltimer(True)
        acc = tl.zeros([BM, BN], tl.float32)
        for k in range(0, K, BK):
            a = tl.load(a_base + o_m[:, None] * K + (k + o_k)[None, :])
            b = tl.load(p_b + (k + o_k)[:, None] * BN + o_n[None, :])
            acc = tl.dot(a, b, acc)
        out = acc.to(tl.bfloat16)
        t1 = globaltimer(True)
        row = tl.load(p_rows + (pid * n_rounds + r).to(tl.int64) * BM + o_m).to(tl.int64)
        if storer:  # paced as the fused kernel paces a tile's remote rows (no-op when pace_fs is 0)
            pace_stores(p_clock, store_rows * BN * 2, pace_fs, pace_budget_ns, 2_000_000_000, 2**31 - 1, p_err, 1, True)
        tl.store(p_host + row[:, None] * BN + o_n[None, :], out, mask=host_rows[:, None])
        tl.store(p_dev + (pid.to(tl.int64) * BM + o_m)[:, None] * BN + o_n[None, :], out, mask=~host_rows[:, None])
        tl.debug_barrier()
        t2 = globaltimer(True)
        if r > 0:  # round 0 warms up
            s_round += t2 - t0
            s_store += t2 - t1
    tl.store(p_t + pid * 2, s_round // (n_rounds - 1))
    tl.store(p_t + pid * 2 + 1, s_store // (n_rounds - 1))


def destinations(pattern: str, n_dst: int, ctas: int, rounds: int, store_rows: int = BM, seed: int = 1
                 ) -> torch.Tensor:
    """int32 `[ctas, rounds, BM]`: the 512-byte row of the footprint (`n_dst` of them) each stored row
    goes to, for `pattern` `uniform` or `combine:H` (see the module docstring); under `combine` the
    first `store_rows` of a unit (the ones the kernel stores) are in ascending order."""
    gen = torch.Generator().manual_seed(seed)
    if pattern == "uniform":
        return torch.randint(n_dst, (ctas, rounds, BM), generator=gen, dtype=torch.int32)
    kind, _, hidden = pattern.partition(":")
    if kind != "combine" or not hidden.isdigit() or int(hidden) % BN or int(hidden) < BN:
        raise SystemExit(f"--pattern {pattern!r}: expected uniform or combine:H with H a multiple of {BN}")
    blocks = int(hidden) // BN  # 512-byte column blocks of one combine row
    n_rows = n_dst // blocks
    if n_rows < BM:
        raise SystemExit(f"--pattern {pattern!r}: the footprint holds {n_rows} rows, fewer than a unit's {BM}")
    units = -(-rounds // blocks)
    unit_rows = torch.randint(n_rows, (ctas, units, BM), generator=gen)
    unit_rows[..., :store_rows] = unit_rows[..., :store_rows].sort(dim=-1).values  # routing order
    r = torch.arange(rounds)
    rows = unit_rows[:, r // blocks] * blocks + (r % blocks)[None, :, None]
    return rows.to(torch.int32)


def run(out: Path, storers, footprints_mib, store_rows: int, rounds: int, reps: int, pacings=("off",),
        patterns=("uniform",)) -> list[dict]:
    dev = torch.device("cuda")
    ctas = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(ctas * BM, K, generator=g, device=dev, dtype=torch.bfloat16)
    b = torch.randn(K, BN, generator=g, device=dev, dtype=torch.bfloat16) * K**-0.5
    dev_out = torch.empty(ctas * BM, BN, device=dev, dtype=torch.bfloat16)
    t = torch.zeros(ctas, 2, dtype=torch.int64, device=dev)
    clock = torch.zeros(1, dtype=torch.int64, device=dev)
    err = torch.zeros(2, dtype=torch.int32, device=dev)
    env = environment()
    rows_out = []
    for mib, pattern in [(m, p) for m in footprints_mib for p in patterns]:
        n_dst = (mib << 20) // ROW_BYTES
        host = torch.empty(n_dst, BN, dtype=torch.bfloat16, pin_memory=True)
        rows = destinations(pattern, n_dst, ctas, rounds, store_rows).to(dev)
        for spec in pacings:
            pace_fs, budget_ns = pacing_args(parse_pacing(spec))
            for k in storers:
                def launch(k=k, host=host, rows=rows, pace_fs=pace_fs, budget_ns=budget_ns):
                    tile_rounds[(ctas,)](a, b, host, dev_out, rows, t, clock, err, k, rounds, store_rows, pace_fs,
                                         budget_ns, K=K, BM=BM, BN=BN, BK=BK, num_warps=8, num_stages=3)

                kernel_ns = time_device(launch, warmup=1, rep=reps).median_ns
                per = t.cpu()  # the per-CTA means of the last launch
                if int(err[0]):
                    raise RuntimeError(f"pacing wait timed out (storers {k}, pacing {spec})")
                st = [float(per[i, 0]) for i in range(k)]
                ns = [float(per[i, 0]) for i in range(k, ctas)]
                host_bytes = k * rounds * store_rows * ROW_BYTES
                rows_out.append(dict(
                    footprint_mib=mib, pattern=pattern, pacing=spec, storing_ctas=k, store_rows=store_rows,
                    burst_bytes=store_rows * ROW_BYTES, rounds=rounds, kernel_us=round(kernel_ns / 1e3, 1),
                    storer_round_us=round(statistics.median(st) / 1e3, 2) if st else "",
                    storer_store_us=round(statistics.median(float(per[i, 1]) for i in range(k)) / 1e3, 2) if k else "",
                    other_round_us=round(statistics.median(ns) / 1e3, 2) if ns else "",
                    host_gbps=round(host_bytes / kernel_ns, 1),
                    **{c: env[c] for c in ("gpu", "driver", "torch", "triton", "git_commit", "date")}))
                print(rows_out[-1], flush=True)
        del host, rows
    out.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out / "tiles_beside_tile_stores.csv", rows_out, list(rows_out[0]))
    return rows_out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--storers", default="0,4,8,16,24,33,66,132")
    ap.add_argument("--footprints-mib", default="256,1024")
    ap.add_argument("--store-rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pacing", default="off", help="comma-separated pacing specs (`off`, GB/s:KiB), each in turn")
    ap.add_argument("--pattern", default="uniform", help="comma-separated row placements: uniform, combine:H")
    args = ap.parse_args(argv)
    rows = run(Path(args.out), [int(k) for k in args.storers.split(",")],
               [int(m) for m in args.footprints_mib.split(",")], args.store_rows, args.rounds, args.reps,
               args.pacing.split(","), args.pattern.split(","))
    print(markdown_table(rows, ["footprint_mib", "pattern", "pacing", "storing_ctas", "kernel_us", "storer_round_us",
                                "storer_store_us", "other_round_us", "host_gbps"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
