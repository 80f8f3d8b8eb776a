"""Per-tile arrival counters of the fused Ulysses exchange: how many to expect, and a bounded wait.

Each output tile a source rank stores into a destination's buffer raises one int32 counter (one per
destination and source) with a release add. The receiver knows how many tiles touch its rows
(`expected_tiles`), waits for each counter with an acquire poll bounded by the context's timeout,
and then subtracts what it expected: the counters are back to zero for the next launch without a
host-side reset, so the pair of kernels can be replayed from a CUDA graph. A counter that never
reaches its count writes the error word (stage `attention.ulysses_output`, peer = the source rank for
a receiver, the destination for a loopback sender), and `CommContext.check()` raises
`CommTimeoutError`.

Example (on the host: the counts a receiver waits for):
    >>> expected_tiles(tok0=[0, 100, 200], heads=[2, 1], batch=1, block_m=64, dst=1)
    [6, 3]
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.comm.device import peer_ptr, wait_acquire, wait_bounds
from xstage.spec.stages import STAGE_ULYSSES_OUTPUT


def tiles_touching(row_start: int, row_end: int, block_m: int) -> int:
    """Number of BLOCK_M query tiles (tile i covers rows [i*bm, (i+1)*bm)) that meet [row_start, row_end)."""
    if row_end <= row_start:
        return 0
    return (row_end - 1) // block_m - row_start // block_m + 1


def expected_tiles(tok0, heads, batch: int, block_m: int, dst: int) -> list[int]:
    """Tiles rank `dst` receives from each source s (which owns `heads[s]` heads): one per
    (batch, head, query tile meeting dst's rows)."""
    n = tiles_touching(tok0[dst], tok0[dst + 1], block_m)
    return [batch * h * n for h in heads]


@triton.jit
def _wait_counters_kernel(p_sig_tab, p_sig, p_expected, p_peer, n, p_err, timeout_ns,
                          STAGE: tl.constexpr, WAIT: tl.constexpr, USE_PTX: tl.constexpr):
    for i in range(n):
        p_flag = peer_ptr(p_sig_tab, i, p_sig, 4)
        want = tl.load(p_expected + i)
        code = (STAGE << 16) | tl.load(p_peer + i)
        ok = wait_acquire(p_flag, want, timeout_ns, p_err, code, WAIT, USE_PTX)
        if ok:
            # Hand the counts back: the next launch's tiles can only add to what is left.
            tl.atomic_add(p_flag, -want, sem="relaxed", scope="sys")


def wait_counters(sig_table, sig_like, expected, peers, error, timeout_ns: int, *, use_ptx: bool) -> None:
    """Launch the one-program wait over `len(expected)` counters (int64 address table `sig_table`,
    int32 `expected`, int32 `peers` (each < 2**16) naming the rank behind each counter for the error
    word). No host synchronisation: the launch can be captured in a CUDA graph."""
    timeout_arg = wait_bounds(timeout_ns, use_ptx)[1]  # without a timer, a poll count stands for the time
    _wait_counters_kernel[(1,)](sig_table, sig_like, expected, peers, expected.numel(), error, timeout_arg,
                                STAGE=STAGE_ULYSSES_OUTPUT, WAIT=True, USE_PTX=use_ptx, num_warps=1)
