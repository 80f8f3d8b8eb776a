"""A group barrier through the device signal words, bounded by the progress watchdog.

`torch.distributed.barrier` blocks without a bound and, when a rank is gone, fails with a transport
error that does not say which rank. Here every rank adds one to its own counter on every peer
(release, system scope) and waits until each peer's counter on itself reaches the barrier's epoch
(`wait_acquire`: it gives up only after `timeout_ns` without progress). A rank that never arrives is
named by the error word: `CommContext.check` raises `CommTimeoutError` naming that peer and the stage
`comm.barrier`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.comm.device import peer_ptr, wait_acquire
from xstage.comm.stages import register_stage

STAGE_BARRIER = register_stage(4, "comm.barrier")


@triton.jit
def barrier_kernel(p_table, p_local, p_err, rank, world, epoch, timeout_ns, STAGE: tl.constexpr,
                   USE_PTX: tl.constexpr):
    """p_local: int32[world] on every rank, word q counts the barriers rank q has reached."""
    for q in range(world):
        tl.atomic_add(peer_ptr(p_table, q, p_local, 4) + rank, 1, sem="release", scope="sys")
    for q in range(world):
        wait_acquire(p_local + q, epoch, timeout_ns, p_err, STAGE * 65536 + q, True, USE_PTX)
