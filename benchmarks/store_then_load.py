"""Do a CTA's stores into a slow path hold up that CTA's next loads? (one GPU, no torchrun)

Every CTA of a full grid repeats: store S bytes (a burst), then stream-read 1 MiB of its own HBM
buffer (the operand loads of a GEMM tile). Per CTA the kernel sums `%globaltimer` over the store
phase (until the last store issued) and the read phase; the medians over CTAs are reported per
destination (`host`: mapped pinned memory over PCIe; `hbm`: device memory) and burst size.

If the reads after a burst take longer than reads alone, the stores the SM still holds delay its
loads: then a persistent kernel's next tile cannot overlap with the drain of its last burst the way
a compute-only gap does (the Burst-Gap probe's gaps are FMA chains).

    PYTHONPATH=src python3 benchmarks/store_then_load.py -o OUT_DIR
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
import triton
import triton.language as tl

from xstage.comm.device import globaltimer
from xstage.env import environment


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


def run(out: Path, store_kib=(0, 4, 16, 32, 64, 128, 256), rounds: int = 20, reps: int = 3) -> list[dict]:
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    read_elems = 512 << 10  # 1 MiB of bf16 per CTA and round
    src = torch.ones(n_sm * read_elems, dtype=torch.bfloat16, device="cuda")
    sink = torch.empty(n_sm * 2048, device="cuda")
    t = torch.zeros(n_sm * 2, dtype=torch.int64, device="cuda")
    env = environment()
    rows = []
    for dest in ("host", "hbm"):
        for kib in store_kib:
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
                         "store_ns": round(store_ns, 1), "read_ns": round(read_ns, 1),
                         **{k: env[k] for k in ("gpu", "driver", "torch", "triton", "git_commit", "date")}})
            print(f"{dest:4s} {kib:4d} KiB per CTA: store {store_ns / 1e3:7.1f} us, "
                  f"then read 1 MiB {read_ns / 1e3:7.1f} us", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "store_then_load.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    run(Path(ap.parse_args().out))
