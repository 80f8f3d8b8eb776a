"""A group barrier through the device signal words, bounded by the progress watchdog.

`torch.distributed.barrier` blocks without a bound and, when a rank is gone, fails with a transport
error that does not say which rank. Here every rank adds one to its own counter on every peer
(release, system scope) and waits until each peer's counter on itself reaches the barrier's epoch
(`wait_acquire`: it gives up only after `timeout_ns` without progress). A rank that never arrives is
named by the error word: `CommContext.check` raises `CommTimeoutError` naming that peer and the stage
`comm.barrier`.

A rank whose inputs are refused tells the group through the same words (`refuse_kernel`): before it
arrives at the barrier it writes its argument's id + 1 into its refusal word of that barrier on every
rank (two rows, by the epoch's parity: a rank is at most one barrier ahead of a peer that has not yet
read its words). Each rank's barrier, once every rank has arrived, moves a refusal into its own error
word (`STAGE_REFUSED << 16 | rank`, the argument's id in word 2, "this call is refused" in word 3),
in stream order with its own work: a host barrier raises the same `InputError` naming that rank and
argument on every rank (`CommContext.check`); after a device barrier the kernels of the call skip it
(`xstage.moe.kernels`) and a later check raises it. The barrier epochs stay in step, and the group
can go on with corrected inputs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.comm.device import peer_ptr, wait_acquire


@triton.jit
def barrier_kernel(p_table, p_local, p_err, rank, world, epoch, timeout_ns, STAGE: tl.constexpr,
                   STAGE_REFUSE: tl.constexpr, USE_PTX: tl.constexpr):
    """p_local: int32[3, world] on every rank: row 0 word q counts the barriers rank q has reached;
    row 1 + e % 2 word q holds rank q's refusal of barrier e (its argument's id + 1, else 0)."""
    for q in range(world):
        tl.atomic_add(peer_ptr(p_table, q, p_local, 4) + rank, 1, sem="release", scope="sys")
    for q in range(world):
        wait_acquire(p_local + q, epoch, timeout_ns, p_err, STAGE * 65536 + q, True, USE_PTX)
    p_refused = p_local + (1 + epoch % 2) * world
    for q in range(world):
        arg = tl.atomic_xchg(p_refused + q, 0, sem="acquire", scope="sys")
        if arg != 0:
            if tl.atomic_cas(p_err, 0, STAGE_REFUSE * 65536 + q, sem="relaxed", scope="sys") == 0:
                tl.atomic_xchg(p_err + 2, arg - 1, sem="relaxed", scope="sys")
            tl.atomic_xchg(p_err + 3, 1, sem="relaxed", scope="sys")


@triton.jit
def refuse_kernel(p_table, p_local, rank, world, epoch, arg_id):
    """Write `arg_id + 1` into this rank's refusal word of barrier `epoch` on every rank (the barrier
    words of `barrier_kernel`), before this rank arrives at that barrier (whose release orders it)."""
    row = 1 + epoch % 2
    for q in range(world):
        tl.atomic_xchg(peer_ptr(p_table, q, p_local, 4) + row * world + rank, arg_id + 1, sem="relaxed",
                       scope="sys")
