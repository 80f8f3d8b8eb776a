"""How exact is an FP8 `tl.dot` on this GPU? The error of one e4m3 x e4m3 -> float32 dot of K = 128
(one DeepSeek-V3 scale block) against float64, and of the same dot cut into K = 32 pieces added in
float32, plus the FP8 tile functions' errors in the shapes of their tests.

Why: the FP8 tile functions (`xstage.moe.kernels_fp8`) pass their interpreter tests and failed on
the H200 by ~1e-4 relative. One explanation is Hopper's FP8 MMA, which keeps fewer accumulator bits
than float32 inside one MMA chain; this measures it instead of assuming it.

    python benchmarks/experiments/fp8_dot_precision.py --out DIR      # writes DIR/dot.csv, prints a table
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn


@triton.jit
def _dot(p_a, p_b, p_out, K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # KP: the K of each tl.dot; the pieces are added in float32
    o_m, o_n, o_k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, KP)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, KP):
        a = tl.load(p_a + o_m[:, None] * K + (k0 + o_k)[None, :])
        b = tl.load(p_b + (k0 + o_k)[:, None] * BN + o_n[None, :])
        acc += tl.dot(a, b, out_dtype=tl.float32)
    tl.store(p_out + o_m[:, None] * BN + o_n[None, :], acc)


def dot_errors(kind: str, kp: int, seed: int = 0, bm: int = 64, bn: int = 128, k: int = 128) -> dict:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        a, b = torch.randn(bm, k, generator=g) * 100, torch.randn(k, bn, generator=g) * 100
    elif kind == "positive":  # no cancellation: the sum is as large as its terms allow
        a, b = torch.rand(bm, k, generator=g) * 448, torch.rand(k, bn, generator=g) * 448
    else:  # small integers: every partial sum is exact in float32
        a, b = torch.randint(-8, 9, (bm, k), generator=g).float(), torch.randint(-8, 9, (k, bn), generator=g).float()
    a8, b8 = a.to(FP8), b.to(FP8)
    ref = a8.double() @ b8.double()
    mag = a8.double().abs() @ b8.double().abs()  # sum of |terms|: the scale a rounding error is relative to
    out = torch.empty(bm, bn, device="cuda")
    _dot[(1,)](a8.cuda(), b8.cuda().contiguous(), out, K=k, KP=kp, BM=bm, BN=bn)
    err = (out.cpu().double() - ref).abs()
    return {"values": kind, "k_per_dot": kp, "max_err_over_max_ref": float(err.max() / ref.abs().max()),
            "max_err_over_sum_abs_terms": float((err / mag.clamp_min(1e-300)).max()),
            "bits": float(-torch.log2((err / mag.clamp_min(1e-300)).max().clamp_min(2.0**-60))),
            "exact_fraction": float((err == 0).double().mean())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_dot_precision: needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [dot_errors(kind, kp, seed) for kind in ("integers", "normal", "positive") for kp in (128, 64, 32)
            for seed in range(3)]
    dev = torch.cuda.get_device_name()
    for r in rows:
        r.update(gpu=dev, torch=torch.__version__, triton=triton.__version__,
                 git_commit=os.environ.get("XSTAGE_GIT_COMMIT", "unknown"))
    with open(args.out / "dot.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("| values | K per dot | max err / max ref | max err / sum abs terms | bits kept | exact |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['values']} | {r['k_per_dot']} | {r['max_err_over_max_ref']:.2e} | "
              f"{r['max_err_over_sum_abs_terms']:.2e} | {r['bits']:.1f} | {r['exact_fraction']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
