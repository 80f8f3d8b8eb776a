"""What a loopback Ulysses call's wall time holds, on one GPU playing rank 0 of P (host path, bf16).

Times, with CUDA events (median of 5 after 2 warm-up runs): the public call (`exchange="auto"`), the own
heads' cuDNN attention over the whole sequence, the stand-in ranks' heads that the loopback call
computes locally (`_loopback_peer_heads`: rank 0's tokens against the whole sequence for the heads it
does not own, work no real rank does) and the loopback gathers of Q, K and V (the stand-in for the
pre-attention exchange, device-local). Prints one line per shape.

    PYTHONPATH=src python3 benchmarks/experiments/ulysses_loopback_standin.py
"""

from __future__ import annotations

import statistics

import torch

from xstage.attention import ulysses_attention
from xstage.attention.flash import default_config
from xstage.attention.overlap import attend
from xstage.attention.ulysses import _loopback_peer_heads, loopback_gather
from xstage.comm import create_context
from xstage.spec.ulysses import UlyssesPlan

SHAPES = ((24, 32760, 4), (40, 75600, 8))  # (heads, tokens, P) at head dim 128: Wan 480p / 720p widths


def timed(fn, n: int = 5) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def measure(H: int, S: int, P: int) -> str:
    s = S // P
    q, k, v = (torch.randn(1, s, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ctx = create_context(path="host", loopback_world=P, rank=0)
    plan = UlyssesPlan(P, 0, 1, [s] * P, H, 128)
    cfg = default_config(128, q.dtype, q.device)
    h0, h1 = plan.head0[0], plan.head0[1]
    qf, kf, vf = (loopback_gather(plan, x) for x in (q, k, v))
    og = torch.empty(1, S, h1 - h0, 128, device="cuda", dtype=q.dtype)
    out = torch.empty_like(q)
    call = timed(lambda: ulysses_attention(q, k, v, comm=ctx, exchange="auto"))
    own = timed(lambda: attend("cudnn", qf[:, :, h0:h1], kf[:, :, h0:h1], vf[:, :, h0:h1], og, config=cfg))
    stand = timed(lambda: _loopback_peer_heads(plan, q, kf, vf, out, None, cfg))
    gather = timed(lambda: [loopback_gather(plan, x) for x in (q, k, v)])
    return (f"standin {H}x128 S={S} P={P}: call {call:.2f} ms, own heads cuDNN {own:.2f} ms, stand-in heads "
            f"{stand:.2f} ms ({stand / own:.3f}x own), loopback gathers {gather:.2f} ms, call - stand-in "
            f"{call - stand:.2f} ms ({(call - stand) / own:.3f}x own)")


def main() -> None:
    for shape in SHAPES:
        print(measure(*shape), flush=True)


if __name__ == "__main__":
    main()
