"""A/B on one GPU: fused_moe with w1 interleaved (transform_weights) against w1 concatenated (read in place,
`w1_layout="concatenated"`). Same weights, routing and buffer; the variants take turns (6 turns of 10 timed
calls after 3 untimed); CUDA-event time per call, medians with p10/p90. Writes $OUT/ab_concat.json.

    PYTHONPATH=src python3 benchmarks/experiments/moe_w1_layout.py
"""

import json
import os
import statistics as st

import torch

from xstage.moe import LoopbackGroup, MoEBuffer, fused_moe, transform_weights

CONFIGS = [("H2048-I768-E128-K8", 64), ("H2048-I768-E128-K8", 4096), ("H2048-I768-E128-K8", 16384),
           ("H7168-I2048-E256-K8", 4096)]


def measure(shape: str, T: int) -> dict:
    H, I, E, K = (int(v[1:]) for v in shape.split("-"))
    g = torch.Generator(device="cuda").manual_seed(0)
    l1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()
    l2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
    buf = MoEBuffer(T, E, K, H, I, LoopbackGroup(1), device="cuda", dtype=torch.bfloat16)
    w1t, w2 = transform_weights(l1, l2, buf.cfg.block_n1)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    if T <= 4096:
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)])
    else:
        idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda", generator=g)
    runs = {"interleaved": lambda: fused_moe(x, idx, w, w1t, w2, buf),
            "concatenated": lambda: fused_moe(x, idx, w, l1, w2, buf, w1_layout="concatenated")}
    ys = {k: f() for k, f in runs.items()}
    torch.cuda.synchronize()
    times = {k: [] for k in runs}
    for _turn in range(6):
        for k, f in runs.items():
            for _ in range(3):
                f()
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                f()
                b.record()
                b.synchronize()
                times[k].append(a.elapsed_time(b) * 1e3)
    buf.check()
    row = dict(shape=shape, tokens=T, bitwise_equal=torch.equal(ys["interleaved"], ys["concatenated"]))
    for k, v in times.items():
        q = st.quantiles(v, n=10)
        row[k] = dict(median_us=st.median(v), p10_us=q[0], p90_us=q[-1])
    row["ratio"] = row["concatenated"]["median_us"] / row["interleaved"]["median_us"]
    return row


if __name__ == "__main__":
    out = []
    for shape, T in CONFIGS:
        row = measure(shape, T)
        out.append(row)
        print(f"{shape} T={T}: interleaved {row['interleaved']['median_us']:.1f} us, concatenated "
              f"{row['concatenated']['median_us']:.1f} us, ratio {row['ratio']:.3f}, "
              f"bitwise equal {row['bitwise_equal']}", flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "ab_concat.json"), "x") as f:  # never overwrites
        f.write(json.dumps(out, indent=1))
