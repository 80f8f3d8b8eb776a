"""The injection kernel: CTAs issue bursts of stores separated by compute gaps and time each burst.

Each CTA owns a region of `burst_bytes` in its destination buffer (region `cta_base + i_cta`) and,
`n_bursts` times: runs a compute gap (a chain of `gap_iters` dependent FMAs; none before burst 0),
passes a CTA barrier, stores the whole region with `VEC`-element vector stores (`BLOCK = warps * 32 * VEC` int32
per step), passes a barrier again, and then, depending on `COMPLETION`:

- `COMPLETION=0`: nothing (issue-only runs: the X-Stage keeps whatever backlog the burst left);
- `COMPLETION=1`: `fence.sc.sys` by every thread and a barrier: remote-visible completion;
- `COMPLETION=2`: a release flag at system scope in the destination's signal pad (epoch `k + 1`),
  which the receiving rank acquires.

Per burst it records `clock64` at the start of the gap, at the start of the burst (after the
barrier), after the last store (after the barrier: the sender-visible issue time) and after the
completion step, plus `%globaltimer` at the burst's start and end. Per CTA it records both timers
at the start and the end of the kernel (to convert cycles to ns) and its SM id.

All CTAs start their first burst together: the first CTA to arrive publishes `start + ALIGN_NS` of
`%globaltimer` and every CTA waits for that instant (a wait on time only, so it cannot hang).

Stored values: element `e` of region `c` after burst `k` holds `e + c * 2**21 + k` (int32, wrapping).
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.comm.device import (
    clock64,
    fence_sys,
    globaltimer,
    peer_ptr,
    signal_release,
    smid,
    store_tile,
    wait_acquire,
)

TIMES_PER_BURST = tl.constexpr(6)   # clk_gap, clk_start, clk_issued, clk_done, gt_start, gt_issued
TIMES_PER_CTA = tl.constexpr(6)     # gt_begin, clk_begin, gt_end, clk_end, smid, unused
CTA_VALUE_STRIDE = tl.constexpr(1 << 21)
ALIGN_NS = tl.constexpr(20_000)


# Runtime counts must not be specialised: Triton compiles a value of 1 as a constant, which turns
# the burst loop (n_bursts = 1) or the store loop (n_steps = 1) into different code than every other
# launch runs, and the issue times of those launches then differ (measured: 330 vs 178 ns for 16 KiB).
@triton.jit(do_not_specialize=["cta_base", "n_bursts", "n_steps", "gap_iters"])
def burst_kernel(
    p_table,            # int64 [n_dst]: destination base addresses
    p_like,             # int32 tensor: gives the pointer type of destinations
    p_dst_of_cta,       # int32 [n_ctas]: index into p_table for each CTA
    p_flag_table,       # int64 [n_dst]: signal-pad base of each destination (COMPLETION=2)
    p_flag_like,        # int32 tensor: pointer type of flags
    cta_base,           # region / flag slot of CTA i is cta_base + i (senders to one rank differ)
    p_times,            # int64 [n_ctas, n_bursts, TIMES_PER_BURST]
    p_cta,              # int64 [n_ctas, TIMES_PER_CTA]
    p_sync,             # int64 [1], zero before launch: the common start instant
    p_sink,             # float32 [n_ctas]: keeps the gap's FMA chain alive
    n_bursts,
    n_steps,            # stores per thread per burst: burst elements / BLOCK
    gap_iters,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    COMPLETION: tl.constexpr,
    USE_PTX: tl.constexpr,
):
    i_cta = tl.program_id(0)
    gt_begin = globaltimer(USE_PTX)
    clk_begin = clock64(USE_PTX)
    region = tl.cast(n_steps, tl.int64) * BLOCK
    i_region = cta_base + i_cta
    p_dst = peer_ptr(p_table, tl.load(p_dst_of_cta + i_cta), p_like) + i_region.to(tl.int64) * region
    o_elem = tl.arange(0, BLOCK)                                          # [BLOCK]
    b_base = o_elem + i_region * CTA_VALUE_STRIDE                         # [BLOCK] int32
    p_t = p_times + i_cta.to(tl.int64) * n_bursts * TIMES_PER_BURST
    acc = i_cta.to(tl.float32) * 1e-3 + 1.0
    if USE_PTX:
        target = tl.atomic_cas(p_sync, tl.full([], 0, tl.int64), gt_begin + ALIGN_NS, sem="relaxed", scope="gpu")
        target = tl.where(target == 0, gt_begin + ALIGN_NS, target)
        while globaltimer(USE_PTX) < target:
            acc = acc * 0.999999 + 1e-6
    for k in range(n_bursts):
        clk_gap = clock64(USE_PTX)
        n_gap = tl.where(k > 0, gap_iters, 0)
        for _ in range(n_gap):
            acc = acc * 0.999999 + 1e-6
        tl.debug_barrier()
        gt_start = globaltimer(USE_PTX)
        clk_start = clock64(USE_PTX)
        b_vals = b_base + k
        p_step = p_dst
        for _ in range(n_steps):
            store_tile(p_step, o_elem, b_vals, None, VEC)
            p_step += BLOCK
            b_vals += BLOCK
        tl.debug_barrier()
        clk_issued = clock64(USE_PTX)
        gt_issued = globaltimer(USE_PTX)
        if COMPLETION == 1:
            f = fence_sys(USE_PTX)
            tl.debug_barrier()
            clk_done = clock64(USE_PTX) + f
        elif COMPLETION == 2:
            p_flag = peer_ptr(p_flag_table, tl.load(p_dst_of_cta + i_cta), p_flag_like, 4)
            signal_release(p_flag + i_region, k + 1)
            clk_done = clock64(USE_PTX)
        else:
            clk_done = clk_issued
        p_k = p_t + k * TIMES_PER_BURST
        tl.store(p_k + 0, clk_gap)
        tl.store(p_k + 1, clk_start)
        tl.store(p_k + 2, clk_issued)
        tl.store(p_k + 3, clk_done)
        tl.store(p_k + 4, gt_start)
        tl.store(p_k + 5, gt_issued)
    tl.debug_barrier()
    clk_end = clock64(USE_PTX)
    gt_end = globaltimer(USE_PTX)
    p_c = p_cta + i_cta.to(tl.int64) * TIMES_PER_CTA
    tl.store(p_c + 0, gt_begin)
    tl.store(p_c + 1, clk_begin)
    tl.store(p_c + 2, gt_end)
    tl.store(p_c + 3, clk_end)
    tl.store(p_c + 4, smid(USE_PTX).to(tl.int64))
    tl.store(p_sink + i_cta, acc)




@triton.jit
def wait_flags_kernel(p_pad, p_slot, p_peer, p_ok, p_err, expected, timeout_ns, STAGE: tl.constexpr,
                      WAIT: tl.constexpr, USE_PTX: tl.constexpr):
    """Receiver side of `COMPLETION=2`: program i waits until flag `p_slot[i]` of this rank's signal
    pad reaches `expected` (the sender's last epoch); a timeout names sender `p_peer[i]`."""
    i = tl.program_id(0)
    slot = tl.load(p_slot + i)
    peer = tl.load(p_peer + i)
    ok = wait_acquire(p_pad + slot, expected, timeout_ns, p_err, STAGE * 65536 + peer, WAIT, USE_PTX)
    tl.store(p_ok + i, ok.to(tl.int32))

TIMES_PER_TRAIN_CTA = tl.constexpr(8)  # TIMES_PER_CTA's six, then gt and clk on leaving the common start


# A second kernel rather than per-CTA programs in `burst_kernel`: the regular sweeps keep the code
# they were measured with (see the note on specialisation above).
@triton.jit(do_not_specialize=["cta_base", "max_bursts", "region_steps"])
def train_kernel(
    p_table, p_like, p_dst_of_cta, cta_base,  # as in burst_kernel
    p_prog,             # int32 [n_ctas, max_bursts, 2]: per burst, stores per thread and gap iterations before it
    p_n_bursts,         # int32 [n_ctas]: bursts of each CTA's train (>= 1)
    p_times,            # int64 [n_ctas, max_bursts, TIMES_PER_BURST], as in burst_kernel
    p_cta,              # int64 [n_ctas, TIMES_PER_TRAIN_CTA]
    p_sync, p_sink,     # as in burst_kernel
    max_bursts,
    region_steps,       # steps of each CTA's region: its largest burst over the launch
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    USE_PTX: tl.constexpr,
):
    """`burst_kernel` with a program per CTA (issue-only): CTA i runs `p_n_bursts[i]` bursts, burst k
    after `p_prog[i, k, 1]` gap iterations (burst 0's: a start delay) of `p_prog[i, k, 0]` steps."""
    i_cta = tl.program_id(0)
    gt_begin = globaltimer(USE_PTX)
    clk_begin = clock64(USE_PTX)
    region = tl.cast(region_steps, tl.int64) * BLOCK
    i_region = cta_base + i_cta
    p_dst = peer_ptr(p_table, tl.load(p_dst_of_cta + i_cta), p_like) + i_region.to(tl.int64) * region
    o_elem = tl.arange(0, BLOCK)
    b_base = o_elem + i_region * CTA_VALUE_STRIDE
    p_t = p_times + i_cta.to(tl.int64) * max_bursts * TIMES_PER_BURST
    p_p = p_prog + i_cta.to(tl.int64) * max_bursts * 2
    acc = i_cta.to(tl.float32) * 1e-3 + 1.0
    if USE_PTX:
        target = tl.atomic_cas(p_sync, tl.full([], 0, tl.int64), gt_begin + ALIGN_NS, sem="relaxed", scope="gpu")
        target = tl.where(target == 0, gt_begin + ALIGN_NS, target)
        while globaltimer(USE_PTX) < target:
            acc = acc * 0.999999 + 1e-6
    gt_go = globaltimer(USE_PTX)
    clk_go = clock64(USE_PTX)
    n_bursts = tl.load(p_n_bursts + i_cta)
    for k in range(n_bursts):
        n_steps = tl.load(p_p + 2 * k)
        n_gap = tl.load(p_p + 2 * k + 1)
        clk_gap = clock64(USE_PTX)
        for _ in range(n_gap):
            acc = acc * 0.999999 + 1e-6
        tl.debug_barrier()
        gt_start = globaltimer(USE_PTX)
        clk_start = clock64(USE_PTX)
        b_vals = b_base + k
        p_step = p_dst
        for _ in range(n_steps):
            store_tile(p_step, o_elem, b_vals, None, VEC)
            p_step += BLOCK
            b_vals += BLOCK
        tl.debug_barrier()
        clk_issued = clock64(USE_PTX)
        gt_issued = globaltimer(USE_PTX)
        p_k = p_t + k * TIMES_PER_BURST
        tl.store(p_k + 0, clk_gap)
        tl.store(p_k + 1, clk_start)
        tl.store(p_k + 2, clk_issued)
        tl.store(p_k + 3, clk_issued)
        tl.store(p_k + 4, gt_start)
        tl.store(p_k + 5, gt_issued)
    tl.debug_barrier()
    clk_end = clock64(USE_PTX)
    gt_end = globaltimer(USE_PTX)
    p_c = p_cta + i_cta.to(tl.int64) * TIMES_PER_TRAIN_CTA
    tl.store(p_c + 0, gt_begin)
    tl.store(p_c + 1, clk_begin)
    tl.store(p_c + 2, gt_end)
    tl.store(p_c + 3, clk_end)
    tl.store(p_c + 4, smid(USE_PTX).to(tl.int64))
    tl.store(p_c + 6, gt_go)
    tl.store(p_c + 7, clk_go)
    tl.store(p_sink + i_cta, acc)


__all__ = ["burst_kernel", "train_kernel", "wait_flags_kernel", "TIMES_PER_BURST", "TIMES_PER_CTA",
           "TIMES_PER_TRAIN_CTA", "CTA_VALUE_STRIDE", "ALIGN_NS"]
