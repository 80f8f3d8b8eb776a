"""A group barrier through the device signal words, bounded by the progress watchdog.

`torch.distributed.barrier` blocks without a bound and, when a rank is gone, fails with a transport
error that does not say which rank. Here every rank adds one to its own counter on every peer
(release, system scope) and waits until each peer's counter on itself reaches the barrier's epoch
(`wait_acquire`: it gives up only after `timeout_ns` without progress). A rank that never arrives is
named by the error word: `CommContext.check` raises `CommTimeoutError` naming that peer and the stage
`comm.barrier`.

A rank whose inputs are refused tells the group through the same words (`refuse_kernel`): it writes
`STAGE_REFUSED << 16 | rank` into every rank's error word (the argument's id in word 2), then arrives
at the barrier, so that every rank leaves it at once and raises the same `InputError` naming that
rank and argument; the barrier epochs stay in step, and the group can go on with corrected inputs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.comm.device import peer_ptr, wait_acquire
from xstage.comm.stages import register_stage

STAGE_BARRIER = register_stage(4, "comm.barrier")
STAGE_REFUSED = register_stage(5, "comm.peer_refused_its_inputs")


@triton.jit
def barrier_kernel(p_table, p_local, p_err, rank, world, epoch, timeout_ns, STAGE: tl.constexpr,
                   USE_PTX: tl.constexpr):
    """p_local: int32[world] on every rank, word q counts the barriers rank q has reached."""
    for q in range(world):
        tl.atomic_add(peer_ptr(p_table, q, p_local, 4) + rank, 1, sem="release", scope="sys")
    for q in range(world):
        wait_acquire(p_local + q, epoch, timeout_ns, p_err, STAGE * 65536 + q, True, USE_PTX)


@triton.jit
def refuse_kernel(p_err_table, p_err, rank, world, arg_id, STAGE: tl.constexpr):
    """Write `STAGE << 16 | rank` into word 0 of every rank's error word (first error wins) and the
    argument's id into word 2, before this rank arrives at the barrier (whose release orders them)."""
    for q in range(world):
        p_q = peer_ptr(p_err_table, q, p_err, 4)
        tl.atomic_xchg(p_q + 2, arg_id, sem="relaxed", scope="sys")
        tl.atomic_cas(p_q, 0, STAGE * 65536 + rank, sem="relaxed", scope="sys")
