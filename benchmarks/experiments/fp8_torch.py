"""What FP8 buys on this GPU through torch alone: `_scaled_mm` vs `mm`, `_scaled_grouped_mm` vs `_grouped_mm`.
(one GPU, no torchrun; the baselines of the FP8 MegaMoE work)

Dense: [M, K] x [K, N] in bf16 (`torch.mm`) and in float8_e4m3fn with rowwise float32 scales
(`torch._scaled_mm`, bf16 output). Grouped: G groups of M/G rows against [G, K, N] weights
(`torch._grouped_mm` in bf16, `torch._scaled_grouped_mm` in e4m3 with rowwise scales). Each pair is
timed side by side (`xstage.results.timing.time_in_turns`: the two take turns), median of `rep` calls
with p10/p90; TFLOP/s = 2 M N K / time. The FP8 result is also compared with the bf16 one (relative
Frobenius difference) so a wrong layout cannot pass as fast.

    PYTHONPATH=src python3 benchmarks/experiments/fp8_torch.py -o OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from xstage.results import ResultWriter
from xstage.results.timing import time_in_turns

COLUMNS = ["op", "M", "N", "K", "groups", "dtype", "time_ns", "p10_ns", "p90_ns", "tflops", "rel_diff_to_bf16"]
DENSE = [(4096, 2048, 4096), (4096, 4096, 7168), (16384, 2048, 4096), (16384, 4096, 7168), (8192, 3072, 7168)]
GROUPED = [(8192, 4096, 7168, 32), (8192, 2048, 4096, 32), (16384, 3072, 7168, 64)]
F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) float32 scales so each row's max maps to the e4m3 max."""
    scale = t.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / F8_MAX
    return (t.float() / scale).to(F8), scale


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def dense_pair(M: int, N: int, K: int):
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)  # [N, K]: _scaled_mm wants b column-major
    a8, sa = quantize_rows(a)
    b8, sb = quantize_rows(b)
    ref = torch.mm(a, b.t())
    out = torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
    return {"bf16": lambda: torch.mm(a, b.t()),
            "fp8": lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)}, \
        rel_diff(out, ref)


def grouped_pair(M: int, N: int, K: int, G: int):
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)  # [G, N, K], used transposed
    offs = torch.arange(M // G, M + 1, M // G, device="cuda", dtype=torch.int32)
    a8, sa = quantize_rows(a)
    w8, sw = quantize_rows(w)  # [G, N, 1] scales per output column
    sa1, sw1 = sa.squeeze(-1), sw.squeeze(-1)
    ref = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    out = torch._scaled_grouped_mm(a8, w8.transpose(-2, -1), sa1, sw1, offs=offs, out_dtype=torch.bfloat16)
    return {"bf16": lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs),
            "fp8": lambda: torch._scaled_grouped_mm(a8, w8.transpose(-2, -1), sa1, sw1, offs=offs,
                                                    out_dtype=torch.bfloat16)}, rel_diff(out, ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--rep", type=int, default=30)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    writer = ResultWriter(out / "fp8_torch.csv", COLUMNS, ["op", "M", "N", "K", "groups", "dtype"], require_commit=True)
    cases = [("mm", (M, N, K, 1), dense_pair) for M, N, K in DENSE] + \
            [("grouped_mm", (M, N, K, G), grouped_pair) for M, N, K, G in GROUPED]
    for op, (M, N, K, G), make in cases:
        try:
            fns, diff = make(M, N, K) if G == 1 else make(M, N, K, G)
        except (RuntimeError, TypeError) as exc:  # an op this torch build lacks: say so, go on
            print(f"{op} {M}x{N}x{K} G={G}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            continue
        timings = time_in_turns({k: (lambda f=f: f) for k, f in fns.items()}, warmup=5, rep=args.rep)
        for dtype, tm in timings.items():
            tflops = 2.0 * M * N * K / tm.median_ns / 1e3
            writer.write({"op": op, "M": M, "N": N, "K": K, "groups": G, "dtype": dtype, "time_ns": round(tm.median_ns),
                          "p10_ns": round(tm.p10_ns), "p90_ns": round(tm.p90_ns), "tflops": round(tflops, 1),
                          "rel_diff_to_bf16": round(diff, 5) if dtype == "fp8" else 0.0})
        ratio = timings["bf16"].median_ns / timings["fp8"].median_ns
        print(f"{op:10s} {M}x{N}x{K} G={G}: bf16 {2.0 * M * N * K / timings['bf16'].median_ns / 1e3:7.1f} "
              f"fp8 {2.0 * M * N * K / timings['fp8'].median_ns / 1e3:7.1f} TFLOP/s ({ratio:.2f}x), "
              f"fp8 vs bf16 {diff:.3%}", flush=True)


if __name__ == "__main__":
    main()
