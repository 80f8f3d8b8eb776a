"""How much does a saturated store path slow the loads of SMs that store nothing, by their memory intensity?
(one GPU, no torchrun; the calibration data of the planner's interference term)

k CTAs store 1 MiB passes into the destination without pause; the other CTAs (readers) repeat a round:
read 1 MiB (from a per-CTA buffer of `footprint` bytes, re-read until 1 MiB is loaded: 1 MiB streams
from HBM, 128 KiB stays in L2) and run `fma` dependent FMAs per loaded element. The readers time every
round with `%globaltimer`. Each configuration runs twice: with the storers busy and with the same
grid whose storers store nothing (`storers=idle`), so the readers' own speed at that reader count is
the baseline. The storers' passes are sized to outlast the readers' rounds.

Rows (`bystander_intensity.csv`): per (dest, storing CTAs, footprint, fma, storers) the median over
reader CTAs of the mean time per round (median of `reps` launches), and the reader's intensity
(bytes loaded per ns of its idle-storers round).

    PYTHONPATH=src python3 benchmarks/experiments/bystander_intensity.py -o OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from xstage.comm.device import globaltimer
from xstage.results import ResultWriter

COLUMNS = ["dest", "storing_ctas", "reading_ctas", "footprint_bytes", "fma", "storers", "read_bytes", "read_ns",
           "read_ns_p10", "read_ns_p90", "store_gbps"]
KEY = COLUMNS[:6]
ROUND_BYTES = 1 << 20


@triton.jit
def bystander_rounds(p_dst, p_src, p_sink, p_t, n_store_ctas, store_elems, n_store_iter, foot_elems, round_elems,
                     n_rounds, fma, SB: tl.constexpr, RB: tl.constexpr):
    """CTAs below `n_store_ctas` store `n_store_iter` passes of `store_elems` int32 and record their time;
    the others read `round_elems` bf16 per round from `foot_elems` of their own, `fma` FMAs per element."""
    pid = tl.program_id(0)
    if pid < n_store_ctas:
        v = tl.full([SB], 1, tl.int32)
        dst = p_dst + pid.to(tl.int64) * store_elems
        t0 = globaltimer(True)
        for k in range(n_store_iter):
            for i in range(0, store_elems, SB):
                tl.store(dst + i + tl.arange(0, SB), v + k)
        tl.debug_barrier()
        tl.store(p_t + pid, globaltimer(True) - t0)
    else:
        acc = tl.zeros([RB], tl.float32)
        src = p_src + pid.to(tl.int64) * foot_elems
        s = tl.zeros([], tl.int64)
        for _r in range(n_rounds):
            t0 = globaltimer(True)
            for i in range(0, round_elems, RB):
                b_x = tl.load(src + (i % foot_elems) + tl.arange(0, RB)).to(tl.float32)
                for _f in range(fma):  # dependent FMAs on the loaded tile: compute per byte loaded
                    b_x = b_x * 0.999 + 0.001
                acc += b_x
            tl.debug_barrier()
            s += globaltimer(True) - t0
        tl.store(p_sink + pid * RB + tl.arange(0, RB), acc)
        tl.store(p_t + pid, s // n_rounds)


def run(out: Path, storers=(16, 33, 66, 99), footprints=(1 << 20, 128 << 10), fmas=(0, 4, 16, 64),
        rounds: int = 10, reps: int = 3, dests=("host",)) -> list[dict]:
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    store_elems = 256 << 10  # 1 MiB of int32 per pass
    src = torch.ones(n_sm * (ROUND_BYTES // 2), dtype=torch.bfloat16, device="cuda")
    sink = torch.empty(n_sm * 2048, device="cuda")
    t = torch.zeros(n_sm, dtype=torch.int64, device="cuda")
    writer = ResultWriter(out / "bystander_intensity.csv", COLUMNS, KEY, require_commit=True)
    rows = []
    for dest in dests:
        for k in storers:
            dst = torch.empty(k * store_elems, dtype=torch.int32, pin_memory=dest == "host",
                              device="cpu" if dest == "host" else "cuda")
            # about 150 ms of stores at the host link's ~52 GB/s, longer than any reader's rounds here
            passes = max(4, -(-7500 // k)) if dest == "host" else max(40, -(-250000 // k))
            for foot in footprints:
                for fma in fmas:
                    idle_ns = None
                    for mode in ("idle", "busy"):
                        key = {"dest": dest, "storing_ctas": k, "reading_ctas": n_sm - k, "footprint_bytes": foot,
                               "fma": fma, "storers": mode}
                        runs = []
                        for _ in range(reps):
                            bystander_rounds[(n_sm,)](dst, src, sink, t, k, store_elems,
                                                      passes if mode == "busy" else 0, foot // 2, ROUND_BYTES // 2,
                                                      rounds, fma, SB=2048, RB=2048, num_warps=8)
                            torch.cuda.synchronize()
                            readers = t[k:].double().cpu()
                            gbps = k * passes * store_elems * 4 / float(t[:k].max()) if mode == "busy" else 0.0
                            runs.append((float(readers.median()), float(readers.quantile(0.1)),
                                         float(readers.quantile(0.9)), gbps))
                        med, p10, p90, gbps = sorted(runs)[reps // 2]
                        if mode == "idle":
                            idle_ns = med
                        if writer.done(key):
                            continue
                        rows.append({**key, "read_bytes": ROUND_BYTES, "read_ns": round(med, 1),
                                     "read_ns_p10": round(p10, 1), "read_ns_p90": round(p90, 1),
                                     "store_gbps": round(gbps, 2)})
                        writer.write(rows[-1])
                        if mode == "busy":
                            print(f"{dest} k={k:3d} foot={foot >> 10:5d} KiB fma={fma:3d}: "
                                  f"{idle_ns / 1e3:8.1f} -> {med / 1e3:8.1f} us per round ({med / idle_ns:5.2f}x), "
                                  f"stores {gbps:5.1f} GB/s", flush=True)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    run(Path(args.out), reps=args.reps)
