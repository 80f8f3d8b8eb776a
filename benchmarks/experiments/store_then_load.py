"""Do a CTA's stores into a slow path hold up that CTA's next loads? (one GPU, no torchrun)

Every CTA of a full grid repeats: store S bytes (a burst), then stream-read 1 MiB of its own HBM
buffer (the operand loads of a GEMM tile). Per CTA the kernel sums `%globaltimer` over the store
phase (until the last store issued) and the read phase; the medians over CTAs are reported per
destination (`host`: mapped pinned memory over PCIe; `hbm`: device memory) and burst size.

If the reads after a burst take longer than reads alone, the stores the SM still holds delay its
loads: then a persistent kernel's next tile cannot overlap with the drain of its last burst the way
a compute-only gap does (the Burst-Gap probe's gaps are FMA chains).

`--bystanders` adds a second experiment: k CTAs store without pause (1 MiB passes) while the other
CTAs only read; it reports the readers' time per 1 MiB, i.e. whether a busy path slows the loads of
SMs that store nothing.

`--paced SPEC,...` repeats the bystander experiment on `host` with the storers' 8 KiB stores paced
by `xstage.comm.pacing` (SPEC as in `parse_pacing`: `off`, or GB/s:KiB such as `50:128`), and also
reports the throughput the storers reach: does pacing keep the readers' speed, and at what cost to
the link?

    PYTHONPATH=src python3 benchmarks/experiments/store_then_load.py -o OUT_DIR [--bystanders] [--paced off,50:128]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from xstage.comm.device import globaltimer
from xstage.comm.pacing import pace_stores
from xstage.results import ResultWriter
from xstage.spec.pacing import pacing_args, parse_pacing

COLUMNS = ["dest", "ctas", "store_bytes", "read_bytes", "store_ns", "read_ns"]
BYSTANDER_COLUMNS = ["dest", "storing_ctas", "reading_ctas", "read_bytes", "read_ns"]
PACED_COLUMNS = ["dest", "pacing", "storing_ctas", "reading_ctas", "read_bytes", "read_ns", "store_gbps"]


@triton.jit
def store_then_load(p_dst, p_src, p_sink, p_t, store_elems, read_elems, n_rounds,
                    SB: tl.constexpr, RB: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([RB], tl.float32)
    v = tl.full([SB], 1, tl.int32)
    dst = p_dst + pid.to(tl.int64) * store_elems
    src = p_src + pid.to(tl.int64) * read_elems
    s_store = tl.zeros([], tl.int64)
    s_read = tl.zeros([], tl.int64)
    for k in range(n_rounds):
        t0 = globaltimer(True)
        for i in range(0, store_elems, SB):
            tl.store(dst + i + tl.arange(0, SB), v + k)
        tl.debug_barrier()
        t1 = globaltimer(True)
        for i in range(0, read_elems, RB):
            acc += tl.load(src + i + tl.arange(0, RB)).to(tl.float32)
        tl.debug_barrier()
        t2 = globaltimer(True)
        if k > 0:  # round 0 warms up
            s_store += t1 - t0
            s_read += t2 - t1
    tl.store(p_sink + pid * RB + tl.arange(0, RB), acc)
    tl.store(p_t + pid * 2, s_store)
    tl.store(p_t + pid * 2 + 1, s_read)


@triton.jit
def _timed_reads(p_src, p_sink, p_t, pid, read_elems, n_rounds, RB: tl.constexpr):
    """A reader CTA: `n_rounds` reads of its `read_elems` bf16, the mean ns per round into `p_t[pid]`."""
    acc = tl.zeros([RB], tl.float32)
    src = p_src + pid.to(tl.int64) * read_elems
    s = tl.zeros([], tl.int64)
    for _k in range(n_rounds):
        t0 = globaltimer(True)
        for i in range(0, read_elems, RB):
            acc += tl.load(src + i + tl.arange(0, RB)).to(tl.float32)
        tl.debug_barrier()
        s += globaltimer(True) - t0
    tl.store(p_sink + pid * RB + tl.arange(0, RB), acc)
    tl.store(p_t + pid, s // n_rounds)


@triton.jit
def bystander_reads(p_dst, p_src, p_sink, p_t, n_store_ctas, store_elems, n_store_iter, read_elems, n_rounds,
                    SB: tl.constexpr, RB: tl.constexpr):
    """CTAs below `n_store_ctas` only store; the others only read, timing each 1 MiB read."""
    pid = tl.program_id(0)
    if pid < n_store_ctas:
        v = tl.full([SB], 1, tl.int32)
        dst = p_dst + pid.to(tl.int64) * store_elems
        for k in range(n_store_iter):
            for i in range(0, store_elems, SB):
                tl.store(dst + i + tl.arange(0, SB), v + k)
    else:
        _timed_reads(p_src, p_sink, p_t, pid, read_elems, n_rounds, RB)


@triton.jit
def paced_bystander_reads(p_dst, p_src, p_sink, p_t, p_clock, p_err, n_store_ctas, store_elems, n_store_iter,
                          read_elems, n_rounds, pace_fs, pace_budget_ns, SB: tl.constexpr, RB: tl.constexpr):
    """`bystander_reads` with every store of SB int32 paced; storers record their elapsed time."""
    pid = tl.program_id(0)
    if pid < n_store_ctas:
        v = tl.full([SB], 1, tl.int32)
        dst = p_dst + pid.to(tl.int64) * store_elems
        t0 = globaltimer(True)
        nbytes = tl.full([], SB * 4, tl.int32)
        for k in range(n_store_iter):
            for i in range(0, store_elems, SB):
                pace_stores(p_clock, nbytes, pace_fs, pace_budget_ns, 2_000_000_000, 2**31 - 1, p_err, 1, True)
                tl.store(dst + i + tl.arange(0, SB), v + k)
        tl.debug_barrier()
        tl.store(p_t + pid, globaltimer(True) - t0)
    else:
        _timed_reads(p_src, p_sink, p_t, pid, read_elems, n_rounds, RB)


def run_paced_bystanders(out: Path, specs, storers=(33, 66, 99), rounds: int = 20, passes: int = 12,
                         reps: int = 3) -> list[dict]:
    """Bystander reads on `host` with the storers paced by each spec (`off`: unpaced)."""
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    read_elems, store_elems = 512 << 10, 256 << 10
    src = torch.ones(n_sm * read_elems, dtype=torch.bfloat16, device="cuda")
    sink = torch.empty(n_sm * 2048, device="cuda")
    t = torch.zeros(n_sm, dtype=torch.int64, device="cuda")
    clock = torch.zeros(1, dtype=torch.int64, device="cuda")
    err = torch.zeros(2, dtype=torch.int32, device="cuda")
    writer = ResultWriter(out / "bystander_reads_paced.csv", PACED_COLUMNS, PACED_COLUMNS[:3], require_commit=True)
    rows = []
    for spec in specs:
        fs, budget_ns = pacing_args(parse_pacing(spec, "host"))
        for k in storers:
            if writer.done({"dest": "host", "pacing": spec, "storing_ctas": k}):
                continue
            dst = torch.empty(k * store_elems, dtype=torch.int32, pin_memory=True)
            runs = []
            for _ in range(reps):
                paced_bystander_reads[(n_sm,)](dst, src, sink, t, clock, err, k, store_elems, passes, read_elems,
                                               rounds, fs, budget_ns, SB=2048, RB=2048, num_warps=8)
                torch.cuda.synchronize()
                gbps = k * passes * store_elems * 4 / float(t[:k].max())
                runs.append((float(t[k:].double().median()), gbps))
            if int(err[0]):
                raise RuntimeError(f"pacing {spec}: a paced store waited past its bound")
            read_ns, gbps = sorted(runs)[reps // 2]
            rows.append({"dest": "host", "pacing": spec, "storing_ctas": k, "reading_ctas": n_sm - k,
                         "read_bytes": read_elems * 2, "read_ns": round(read_ns, 1), "store_gbps": round(gbps, 2)})
            writer.write(rows[-1])
            print(f"host {spec:>8s}: {k:3d} CTAs storing at {gbps:5.1f} GB/s, the other {n_sm - k} read 1 MiB in "
                  f"{read_ns / 1e3:7.1f} us", flush=True)
    return rows


def run_bystanders(out: Path, storers=(0, 8, 33, 66, 99), rounds: int = 20, reps: int = 3) -> list[dict]:
    """Reads of SMs that store nothing while `storers` other SMs keep the path busy."""
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    read_elems, store_elems = 512 << 10, 256 << 10  # 1 MiB of reads per round, 1 MiB of stores per pass
    src = torch.ones(n_sm * read_elems, dtype=torch.bfloat16, device="cuda")
    sink = torch.empty(n_sm * 2048, device="cuda")
    t = torch.zeros(n_sm, dtype=torch.int64, device="cuda")
    writer = ResultWriter(out / "bystander_reads.csv", BYSTANDER_COLUMNS, BYSTANDER_COLUMNS[:2], require_commit=True)
    rows = []
    for dest, passes in (("host", 12), ("hbm", 400)):  # both outlast the readers' 20 rounds
        for k in storers:
            if writer.done({"dest": dest, "storing_ctas": k}):
                continue
            dst = torch.empty(max(k, 1) * store_elems, dtype=torch.int32, pin_memory=dest == "host",
                              device="cpu" if dest == "host" else "cuda")
            runs = []
            for _ in range(reps):
                bystander_reads[(n_sm,)](dst, src, sink, t, k, store_elems, passes if k else 0, read_elems, rounds,
                                         SB=2048, RB=2048, num_warps=8)
                torch.cuda.synchronize()
                runs.append(float(t[k:].double().median()))
            read_ns = sorted(runs)[reps // 2]
            rows.append({"dest": dest, "storing_ctas": k, "reading_ctas": n_sm - k, "read_bytes": read_elems * 2,
                         "read_ns": round(read_ns, 1)})
            writer.write(rows[-1])
            print(f"{dest:4s}: {k:3d} CTAs storing, the other {n_sm - k} read 1 MiB in {read_ns / 1e3:7.1f} us",
                  flush=True)
    return rows


def run(out: Path, store_kib=(0, 4, 16, 32, 64, 128, 256), rounds: int = 20, reps: int = 3) -> list[dict]:
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    read_elems = 512 << 10  # 1 MiB of bf16 per CTA and round
    src = torch.ones(n_sm * read_elems, dtype=torch.bfloat16, device="cuda")
    sink = torch.empty(n_sm * 2048, device="cuda")
    t = torch.zeros(n_sm * 2, dtype=torch.int64, device="cuda")
    writer = ResultWriter(out / "store_then_load.csv", COLUMNS, COLUMNS[:3], require_commit=True)
    rows = []
    for dest in ("host", "hbm"):
        for kib in store_kib:
            if writer.done({"dest": dest, "ctas": n_sm, "store_bytes": kib * 1024}):
                continue  # measured by an earlier run into the same folder
            se = max(kib * 256, 2048)
            dst = torch.empty(n_sm * se, dtype=torch.int32, pin_memory=dest == "host",
                              device="cpu" if dest == "host" else "cuda")
            runs = []
            for _ in range(reps):
                store_then_load[(n_sm,)](dst, src, sink, t, kib * 256, read_elems, rounds, SB=2048, RB=2048,
                                         num_warps=8)
                torch.cuda.synchronize()
                per_cta = t.view(-1, 2).double().cpu() / (rounds - 1)
                runs.append((float(per_cta[:, 1].median()), float(per_cta[:, 0].median())))
            read_ns, store_ns = sorted(runs)[reps // 2]
            rows.append({"dest": dest, "ctas": n_sm, "store_bytes": kib * 1024, "read_bytes": read_elems * 2,
                         "store_ns": round(store_ns, 1), "read_ns": round(read_ns, 1)})
            writer.write(rows[-1])
            print(f"{dest:4s} {kib:4d} KiB per CTA: store {store_ns / 1e3:7.1f} us, "
                  f"then read 1 MiB {read_ns / 1e3:7.1f} us", flush=True)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--bystanders", action="store_true", help="also: reads of SMs that store nothing")
    ap.add_argument("--paced", help="only: bystander reads with paced storers, comma-separated pacing specs")
    args = ap.parse_args()
    if args.paced:
        run_paced_bystanders(Path(args.out), args.paced.split(","))
        raise SystemExit(0)
    run(Path(args.out))
    if args.bystanders:
        run_bystanders(Path(args.out))
