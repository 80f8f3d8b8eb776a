"""Triton device helpers for remote stores: tile stores, release/acquire flags, bounded waits, timers.

Every helper that needs inline PTX takes a constexpr `USE_PTX`. With `USE_PTX=False` it falls back to
plain Triton so that kernels built from these helpers still run in the CPU interpreter
(`TRITON_INTERPRET=1`), where `tl.inline_asm_elementwise` is not implemented: timers then read 0 and
the system fence is a no-op (the interpreter runs programs one after another, so memory is coherent).
On a GPU always pass `USE_PTX=True`; `use_ptx()` gives the right value for the current process.

Waits have a constexpr `WAIT` as well: the interpreter runs programs in program-id order, so a wait
for a flag that a later program (or another rank) sets would never end there. With `WAIT=False` a
wait reads the flag once and reports whether it was already set, without spinning.

Flags are int32 counters that only grow (epochs): `signal_release(p, k)` publishes epoch `k`,
`wait_acquire(p, k, ...)` waits until the flag is `>= k`, so a buffer can be reused without resetting.

Example (a kernel that stores a tile to a peer, signals it, and waits for the peer's tile):

    @triton.jit
    def exchange(p_table, p_local, p_flags_table, p_my_flags, p_err, rank, peer, timeout_ns,
                 BLOCK: tl.constexpr, WAIT: tl.constexpr, USE_PTX: tl.constexpr):
        o_elem = tl.arange(0, BLOCK)                                   # [BLOCK]
        p_dst = peer_ptr(p_table, peer, p_local)
        store_tile(p_dst, o_elem, tl.load(p_local + o_elem), o_elem < BLOCK, 4)
        signal_release(peer_ptr(p_flags_table, peer, p_my_flags) + rank, 1)
        wait_acquire(p_my_flags + peer, 1, timeout_ns, p_err, (2 << 16) | peer, WAIT, USE_PTX)
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.env import interpreter_active

# Polls per nanosecond of timeout when no timer is available (USE_PTX=False on a GPU): one acquire
# poll of a flag costs far more than 64 ns, so the bound errs on the long side.
NS_PER_POLL_FALLBACK = tl.constexpr(64)
# One poll of a flag in Triton's CPU interpreter takes 0.1-1 ms (several ranks sharing two cores).
INTERPRETER_NS_PER_POLL = 200_000


def use_ptx() -> bool:
    """True when kernels run on a GPU (inline PTX available), False in the CPU interpreter."""
    return not interpreter_active()


@triton.jit
def globaltimer(USE_PTX: tl.constexpr):
    """%globaltimer in ns (int64): comparable across SMs of one GPU, ~32 ns ticks on Hopper."""
    if USE_PTX:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def clock64(USE_PTX: tl.constexpr):
    """%clock64 in SM cycles (int64): fine-grained, per SM, follows the SM clock."""
    if USE_PTX:
        t = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def smid(USE_PTX: tl.constexpr):
    """%smid (int32): the SM this program runs on (0 in the interpreter)."""
    if USE_PTX:
        s = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        s = tl.full([], 0, tl.int32)
    return s


@triton.jit
def fence_sys(USE_PTX: tl.constexpr):
    """System-scope fence (`fence.sc.sys`): returns once this thread's earlier stores are visible to the
    whole system (peer GPUs, host). Returns 0 (int32) so callers can fold it into a value they keep."""
    if USE_PTX:
        r = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
    else:
        r = tl.full([], 0, tl.int32)
    return r


@triton.jit
def fence_proxy_async(USE_PTX: tl.constexpr):
    """`fence.proxy.async`: orders this thread's generic-proxy memory accesses with async-proxy ones
    (TMA). A writer calls it after plain stores that another CTA will read through TMA, and the reader
    after its acquire and before its TMA loads. Returns 0 (int32)."""
    if USE_PTX:
        r = tl.inline_asm_elementwise("fence.proxy.async;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
    else:
        r = tl.full([], 0, tl.int32)
    return r


@triton.jit
def peer_ptr(p_table, peer, p_like, ALIGN: tl.constexpr = 16):
    """Pointer to rank `peer`'s buffer, read from a device pointer table (int64 addresses), typed like
    `p_like`. Addresses loaded at run time lose alignment facts; the `multiple_of` hint restores them
    so that stores through the pointer can be 16-byte vectors."""
    addr = tl.load(p_table + peer)
    return tl.multiple_of(addr.to(p_like.dtype), ALIGN)


@triton.jit
def store_tile(p_base, o_elem, b_vals, m_elem, VEC: tl.constexpr):
    """Store `b_vals` at `p_base + o_elem` ([BLOCK] each). `o_elem` must be made of runs of `VEC`
    contiguous, VEC-aligned element offsets (as `tl.arange` is) and `p_base` 16-byte aligned: then each
    thread writes VEC elements with one vector store (`st.global.v4.b32` for VEC=4 int32/fp32)."""
    o_vec = tl.max_contiguous(tl.multiple_of(o_elem, VEC), VEC)
    tl.store(p_base + o_vec, b_vals, mask=m_elem)


@triton.jit
def signal_release(p_flag, value):
    """Publish `value` on a flag with release semantics at system scope, after a CTA barrier so that
    every thread's earlier stores are ordered before it. Returns the previous flag value."""
    tl.debug_barrier()
    return tl.atomic_xchg(p_flag, value, sem="release", scope="sys")


@triton.jit
def signal_add(p_flag, inc):
    """Add `inc` to a counter flag with release semantics at system scope (after a CTA barrier)."""
    tl.debug_barrier()
    return tl.atomic_add(p_flag, inc, sem="release", scope="sys")


@triton.jit
def wait_acquire(p_flag, expected, timeout_ns, p_err, code, WAIT: tl.constexpr, USE_PTX: tl.constexpr):
    """Wait until `*p_flag >= expected` (acquire, system scope): a progress watchdog that gives up only
    after `timeout_ns` in which the flag did not move (a slow but advancing peer never times out).

    On giving up writes `code` (`stage << 16 | peer`, see `xstage.comm.stages`) into the error word
    `p_err[0]` unless an earlier error is already there, counts the timeout in `p_err[1]`, and returns
    False. A wait also gives up as soon as it sees any error in the word, so one timeout cannot chain
    into a hang of later waits. With `WAIT=False` the flag is read once (no spinning). Without a timer
    (`USE_PTX=False`) the bound counts polls since the flag last moved, `NS_PER_POLL_FALLBACK` ns
    each. Returns True when the flag reached `expected`."""
    v = tl.atomic_add(p_flag, 0, sem="acquire", scope="sys")
    if WAIT:
        t_moved = globaltimer(USE_PTX)
        last = v
        n_poll = 0
        err = tl.load(p_err, volatile=True)
        while (v < expected) & (err == 0):
            v = tl.atomic_add(p_flag, 0, sem="acquire", scope="sys")
            n_poll += 1
            if USE_PTX:
                now = globaltimer(USE_PTX)
                if v != last:
                    t_moved = now
                elapsed = now - t_moved
            else:
                if v != last:
                    n_poll = 0
                elapsed = tl.cast(n_poll, tl.int64) * NS_PER_POLL_FALLBACK
            last = v
            if (v < expected) & (elapsed > timeout_ns):
                tl.atomic_cas(p_err, tl.full([], 0, tl.int32), tl.cast(code, tl.int32), sem="relaxed", scope="sys")
                tl.atomic_add(p_err + 1, 1, sem="relaxed", scope="sys")
            err = tl.load(p_err, volatile=True)
    tl.debug_barrier()
    return v >= expected


def wait_bounds(timeout_ns: int, on_gpu: bool) -> tuple[bool, int, int]:
    """(USE_PTX, timeout argument, poll bound) for the waits of a kernel launch: on a GPU the timer
    bounds them; in Triton's interpreter (no timer) a poll count stands for `timeout_ns`, at about
    `INTERPRETER_NS_PER_POLL` per poll there."""
    if on_gpu:
        return True, int(timeout_ns), 2**31 - 1
    polls = max(100, int(timeout_ns) // INTERPRETER_NS_PER_POLL)
    return False, polls * int(NS_PER_POLL_FALLBACK), polls


__all__ = [
    "NS_PER_POLL_FALLBACK", "use_ptx", "globaltimer", "clock64", "smid", "fence_sys", "peer_ptr",
    "store_tile", "signal_release", "signal_add", "wait_acquire", "wait_bounds", "INTERPRETER_NS_PER_POLL",
]
