"""Store throughput of rows scattered over a large destination (one GPU, no torchrun).

The fused MoE kernel pushes each output row (`block_n2` elements, 256 or 512 bytes) to
`combine[slot, token]`: rows land at scattered addresses spread over the whole combine buffer (up to
K x T x H x 2 bytes, 1.4 GB in the benchmark grid). `xstage probe` bursts are contiguous. Here 132
CTAs store rows of `row_bytes` at a fixed pitch into pinned host memory (`host`) or device memory
(`hbm`), either in order (row i of the launch at position i) or at uniformly random rows of a
`footprint`-byte buffer, and the sustained bytes per second are reported.

    PYTHONPATH=src python3 benchmarks/experiments/scattered_rows.py -o OUT_DIR   # resumable
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from xstage.results import ResultWriter

COLUMNS = ["dest", "footprint_bytes", "pitch_bytes", "row_bytes", "order", "ctas", "gb_per_s"]


@triton.jit
def row_store(p_dst, p_rows, rows_per_cta, n_iter, PITCH: tl.constexpr, SEG: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    o_r = tl.arange(0, ROWS)
    o_c = tl.arange(0, SEG)
    v = tl.full([ROWS, SEG], 1, tl.int32)
    for it in range(n_iter):
        for r0 in range(0, rows_per_cta, ROWS):
            row = tl.load(p_rows + pid * rows_per_cta + r0 + o_r).to(tl.int64)
            tl.store(p_dst + row[:, None] * PITCH + o_c[None, :], v + it)


def run(out: Path, footprints_mib=(128, 256, 512, 1024, 2048), row_bytes=(256, 512), pitch: int = 8192,
        rows_per_cta: int = 512, n_iter: int = 4, reps: int = 5, dests=("host", "hbm")) -> list[dict]:
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    n = ctas * rows_per_cta
    writer = ResultWriter(out / "scattered_rows.csv", COLUMNS, COLUMNS[:5], require_commit=True)
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for dest in dests:
        for mib in footprints_mib:
            n_buf = (mib << 20) // pitch
            dst = torch.empty(n_buf * pitch // 4, dtype=torch.int32, pin_memory=dest == "host",
                              device="cpu" if dest == "host" else "cuda")
            for rb in row_bytes:
                for order in ("in_order", "scattered"):
                    key = {"dest": dest, "footprint_bytes": mib << 20, "pitch_bytes": pitch, "row_bytes": rb,
                           "order": order}
                    if writer.done(key):
                        continue  # measured by an earlier run into the same folder
                    rows = torch.arange(n) % n_buf if order == "in_order" else torch.randint(n_buf, (n,), generator=gen)
                    rows = rows.to(torch.int32).cuda()

                    def launch(rows=rows, rb=rb, dst=dst):
                        row_store[(ctas,)](dst, rows, rows_per_cta, n_iter, PITCH=pitch // 4, SEG=rb // 4, ROWS=8,
                                           num_warps=8)

                    launch()
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(reps):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        launch()
                        b.record()
                        torch.cuda.synchronize()
                        times.append(a.elapsed_time(b) / 1e3)
                    gbs = n * rb * n_iter / sorted(times)[reps // 2] / 1e9
                    rows_out.append({**key, "ctas": ctas, "gb_per_s": round(gbs, 2)})
                    writer.write(rows_out[-1])
                    print(f"{dest:4s} {mib:5d} MiB rows of {rb} B {order:9s}: {gbs:7.1f} GB/s", flush=True)
            del dst
    return rows_out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    run(Path(ap.parse_args().out))
