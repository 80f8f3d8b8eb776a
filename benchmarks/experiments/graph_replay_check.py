"""Does a CUDA graph of the Triton attention kernel still replay after another graph is captured?

Captures graph A (one `flash_attention` call), replays it, captures graph B (another call), then
replays A again; with TMA descriptors on and off, and for cuDNN SDPA. Prints one line per case.
"""

import sys

import torch

from xstage.attention.flash import FlashConfig, flash_attention


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main() -> int:
    q = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    o1, o2 = torch.empty_like(q), torch.empty_like(q)
    for tma in (True, False):
        cfg = FlashConfig(use_tma=tma)
        try:
            a = graph_of(lambda: flash_attention(q, q, q, out=o1, config=cfg))
            a.replay()
            torch.cuda.synchronize()
            b = graph_of(lambda: flash_attention(q, q, q, out=o2, config=cfg))
            b.replay()
            a.replay()
            torch.cuda.synchronize()
            print(f"tma={tma}: A replays after B is captured: ok", flush=True)
        except Exception as e:  # the answer is the error
            print(f"tma={tma}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
