"""The EP=1 MoE chain in FP8 against the same chain in bf16, on the EP=1 set (one GPU, no torchrun).

For each shape of the benchmark set at 4096 and 16384 tokens (the 8 configurations of
`moe_ep1.py`), one problem and its routing: the bf16 chain (`Unfused.chain`: `torch._grouped_mm`,
SwiGLU, `_grouped_mm`) and the FP8 chain (`xstage.moe.baseline.ChainFP8`: rowwise e4m3
`_scaled_grouped_mm`, SwiGLU, quantize, `_scaled_grouped_mm`) take turns
(`xstage.results.timing.time_in_turns`), medians of `rep` calls with p10/p90, and beside them the
FP8 chain's two GEMMs alone on activations quantized beforehand (`fp8_gemms_only`). `rel_fro` is the FP8
chain's combined output against the bf16 chain's (relative Frobenius). These are the baselines of the
fused FP8 layer.

    PYTHONPATH=src python3 benchmarks/experiments/fp8_chain.py -o OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from xstage.moe.baseline import ChainFP8, Unfused
from xstage.moe.fp8 import quantize_rowwise
from xstage.moe.problem import Problem
from xstage.results import ResultWriter
from xstage.results.timing import time_in_turns
from xstage.spec.moe import SHAPES

COLUMNS = ["shape", "tokens", "chain", "time_ns", "p10_ns", "p90_ns", "tflops", "rel_fro"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--rep", type=int, default=20)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    writer = ResultWriter(out / "fp8_chain.csv", COLUMNS, ["shape", "tokens", "chain"], require_commit=True)
    for shape in SHAPES:
        for tokens in (4096, 16384):
            pb = Problem(shape, tokens, 1, "hbm")
            un = Unfused(pb, "hbm")
            f8 = ChainFP8(un)
            ref = un.combine(un.chain(un.x_sorted)).float()
            y8 = f8.combine(f8.chain(f8.x_sorted)).float()
            rel = float((y8 - ref).norm() / ref.norm())
            bf16_fn, fp8_fn = (lambda u=un: u.chain(u.x_sorted)), (lambda f=f8: f.chain(f.x_sorted))
            # The two FP8 GEMMs alone, on activations quantized beforehand: what the quantizations cost.
            a8, sa = quantize_rowwise(f8.x_sorted)
            h = f8._gemm(f8.x_sorted, f8.w1, f8.s1)
            act8, sact = quantize_rowwise(torch.nn.functional.silu(h[:, : pb.I]) * h[:, pb.I:])
            del h

            def gemms_fn(f=f8, a8=a8, sa=sa, act8=act8, sact=sact):
                f._mm(a8, f.w1.transpose(-2, -1), sa, f.s1, offs=f.offs, out_dtype=torch.bfloat16)
                return f._mm(act8, f.w2.transpose(-2, -1), sact, f.s2, offs=f.offs, out_dtype=torch.bfloat16)

            timings = time_in_turns({"bf16": lambda g=bf16_fn: g, "fp8": lambda g=fp8_fn: g,
                                     "fp8_gemms_only": lambda g=gemms_fn: g}, warmup=3, rep=args.rep)
            for name, tm in timings.items():
                writer.write({"shape": shape, "tokens": tokens, "chain": name, "time_ns": round(tm.median_ns),
                              "p10_ns": round(tm.p10_ns), "p90_ns": round(tm.p90_ns),
                              "tflops": round(pb.flops() / tm.median_ns / 1e3, 1),
                              "rel_fro": round(rel, 5) if name != "bf16" else 0.0})
            t16, t8, tg = (timings[k].median_ns for k in ("bf16", "fp8", "fp8_gemms_only"))
            print(f"{shape} T={tokens}: bf16 {t16 / 1e3:8.1f} us, fp8 {t8 / 1e3:8.1f} us ({t16 / t8:.2f}x), "
                  f"fp8 GEMMs alone {tg / 1e3:8.1f} us ({t16 / tg:.2f}x), fp8 vs bf16 {rel:.2%}", flush=True)
            del pb, un, f8, bf16_fn, fp8_fn, gemms_fn, a8, act8
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
