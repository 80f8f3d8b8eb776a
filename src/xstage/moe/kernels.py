"""Triton kernels of the fused MoE layer: one persistent task-table kernel and the combine reduce.

`moe_main_kernel` (grid = co-resident CTAs) runs the rows of the schedule table: with `DYNAMIC` each
CTA takes the next row of the global order from an atomic counter when it is free (balanced, and
deadlock-free because a task waits only on earlier rows, all taken by running CTAs); otherwise each
CTA walks its own round-robin rows. With `TMA` the GEMM operands (receive buffer, activation,
weights) load through 2-d TMA descriptors, and a `fence.proxy.async` on both sides of each
readiness counter orders the plain stores that produced them with those loads. The tasks:
- DISPATCH(u): wait until the unit's pool slot is free (unit u - pool_units has finished all its
  tasks), pull the unit's `block_m` token rows from their source ranks into the slot's rows of the
  receive buffer, then release the unit's readiness counter.
- LINEAR1(u, n): wait until the unit is dispatched, `[BM, H] x [H, 2*BN1]` gate/up GEMM, SwiGLU in
  the epilogue (with `HAS_B1` the expert's gate/up bias first; `ACT` 1: GPT-OSS's clamped SwiGLU with
  runtime `alpha`, `limit` instead), store `[BM, BN1]` of the activation, release the counter.
- LINEAR2(u, n): wait until all LINEAR1 slabs of the unit are done, `[BM, I] x [I, BN2]`, and push
  every output row (with `HAS_B2` plus the expert's output bias: the reduce's router weight then
  scales bias and product alike) into `combine[slot, token]` of the token's source rank (vector stores through
  peer-relative offsets): the remote-store burst. With store pacing on (`MoEBuffer.pacing`) the
  tile first waits until its remote bytes fit the pacing budget (`xstage.comm.pacing`). Then it
  releases the readiness counter once more: after all `n2` slabs the slot is free.
With `FP8` (an FP8 buffer) the rows and activations are e4m3: DISPATCH also moves each row's 1x128
scales, LINEAR1 and LINEAR2 run the block-scaled tile functions of `xstage.moe.kernels_fp8` (LINEAR1
requantizes its SwiGLU output 1x128), and the combine rows stay BF16.
The readiness counter of a unit thus counts 1 dispatch, `n1` LINEAR1 and `n2` LINEAR2 tasks.
The last CTA to finish raises this rank's completion count on every peer (release, system scope).
`moe_reduce_kernel` waits for every peer's completion, forms `y[t] = sum_k w[t,k] combine[k,t]`,
resets the readiness counters and tells the peers that its combine buffer may be reused.

Every wait is a progress watchdog: it gives up after `timeout_ns` of `%globaltimer` (with `USE_PTX`,
else a poll count) in which the awaited counter did not move (cross-rank
waits use `xstage.comm.device.wait_acquire`; the local readiness waits use `wait_geq`, GPU scope). A
timeout writes `stage << 16 | peer` into the error word (first one wins) and the kernel carries on,
so the host raises `CommTimeoutError` instead of hanging.

Expert ids outside [0, E) never form an address: the layout leaves them to no rank, and the reduce
masks them (they add nothing to `y`), counts them and keeps the first one in (token, slot) order in the
buffer's `bad_ids` words. A peer's refusal of the call (word 3 of the error word, set by the group barrier,
`xstage.comm.barrier`) makes both kernels skip the call: no task, no signal, `y` all NaN. With
`report` set, the reduce's last program moves this rank's error words into a row of pinned host
memory and clears them (`MoEBuffer.check`, the asynchronous check of `fused_moe`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.comm.device import fence_proxy_async, globaltimer, wait_acquire
from xstage.comm.pacing import pace_stores
from xstage.moe.kernels_fp8 import SCALE_BLOCK, _linear1_fp8, _linear2_fp8_acc
from xstage.spec.stages import STAGE_REFUSED

_REFUSED = tl.constexpr(STAGE_REFUSED)


@triton.jit
def _reachable(p_err, q):
    """False once the error word names a wait on peer `q` that timed out: that peer is taken as gone, and
    this call signals it no more. Why: a rank whose process exited may have its memory unmapped (ranks
    sharing one GPU showed it), and a store there is an illegal address, sticky, that no later check
    could turn into the timeout naming the dead rank."""
    err0 = tl.load(p_err, volatile=True)
    return (err0 == 0) | ((err0 % 65536) != q) | ((err0 // 65536) == _REFUSED)


@triton.jit
def wait_geq(p_flag, target, p_err, code, timeout_ns, max_spins, SCOPE: tl.constexpr, USE_PTX: tl.constexpr):
    """Poll `*p_flag` (acquire, `SCOPE`) until it reaches `target`; 1 if reached. A progress watchdog:
    it gives up only after `timeout_ns` (or `max_spins` polls) in which the flag did not move.

    Unlike `wait_acquire` (system scope, for flags other ranks write) this polls at GPU scope: it
    guards the local readiness counters between tasks."""
    v = tl.atomic_add(p_flag, 0, sem="acquire", scope=SCOPE)
    if v < target:
        t_moved = globaltimer(USE_PTX)
        last = v
        elapsed = t_moved - t_moved
        spins = 0
        # Give up at once when another wait already timed out, so timeouts cannot queue up.
        err = tl.load(p_err, volatile=True)
        while (v < target) & (elapsed < timeout_ns) & (spins < max_spins) & (err == 0):
            v = tl.atomic_add(p_flag, 0, sem="acquire", scope=SCOPE)
            spins += 1
            err = tl.load(p_err, volatile=True)
            if v != last:
                spins = 0
                if USE_PTX:
                    t_moved = globaltimer(USE_PTX)
            last = v
            if USE_PTX:
                elapsed = globaltimer(USE_PTX) - t_moved
        if (v < target) & (err == 0):
            tl.atomic_cas(p_err, 0, code)
            tl.atomic_add(p_err + 1, 1)
    return v >= target


@triton.jit
def _dispatch(u, row0, prow, n_rows, p_row_src, p_x, p_x_delta, p_recv, p_ready, T_STRIDE, H,
              p_x_scale, p_xs_delta, p_recv_scale,
              BM: tl.constexpr, BD: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr, USE_PTX: tl.constexpr):
    o_m = tl.arange(0, BM)
    m_m = o_m < n_rows
    b_src = tl.load(p_row_src + row0 + o_m, mask=m_m, other=0)  # [BM]
    b_delta = tl.load(p_x_delta + b_src // T_STRIDE, mask=m_m, other=0)  # [BM] int64
    o_src = b_delta + (b_src % T_STRIDE).to(tl.int64) * H
    o_src = tl.multiple_of(o_src, 8)
    o_dst = (prow + o_m).to(tl.int64) * H  # the unit's pool slot
    for h in range(0, H, BD):
        o_d = h + tl.arange(0, BD)
        b_x = tl.load(p_x + o_src[:, None] + o_d[None, :], mask=m_m[:, None])  # [BM, BD]
        tl.store(p_recv + o_dst[:, None] + o_d[None, :], b_x, mask=m_m[:, None])
    if FP8:
        # The rows' 1x128 scales cross with them (float32 [rows, H/128] beside the e4m3 rows).
        n_s = H // SCALE_BLOCK
        o_ss = tl.load(p_xs_delta + b_src // T_STRIDE, mask=m_m, other=0) + (b_src % T_STRIDE).to(tl.int64) * n_s
        o_sd = (prow + o_m).to(tl.int64) * n_s
        for j in range(0, n_s):
            tl.store(p_recv_scale + o_sd + j, tl.load(p_x_scale + o_ss + j, mask=m_m), mask=m_m)
    if TMA:
        fence_proxy_async(USE_PTX)  # LINEAR1 reads these rows through TMA (the async proxy)
    tl.debug_barrier()
    tl.atomic_add(p_ready + u, 1, sem="release", scope="gpu")


@triton.jit
def _linear1(u, e, prow, n_rows, nb, p_recv, d_recv, p_w1, d_w1, p_act, p_ready, H, I, p_b1, act_alpha, act_limit,
             BM: tl.constexpr, BN1: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, USE_PTX: tl.constexpr,
             W1_CONCAT: tl.constexpr, HAS_B1: tl.constexpr, ACT: tl.constexpr, DOT_PREC: tl.constexpr):
    # Where a tile's gate and up rows are in an expert's 2I rows. Interleaved (`transform_weights`): gate
    # block nb at nb * 2 BN1, its up block right after. Concatenated (the untransformed `[gate; up]`, as
    # transformers' `gate_up_proj` holds it, read in place): gate block nb at nb BN1, up block I rows on.
    if W1_CONCAT:
        g_row = nb * BN1
        up_off = I
    else:
        g_row = nb * 2 * BN1
        up_off = BN1
    o_m = tl.arange(0, BM)
    m_m = o_m < n_rows
    o_n = tl.arange(0, BN1)
    b_g = tl.zeros([BM, BN1], dtype=tl.float32)
    b_u = tl.zeros([BM, BN1], dtype=tl.float32)
    if TMA:
        # Whole [BM, BK] row blocks: rows past n_rows hold stale data that only reaches output rows
        # the epilogue masks (a GEMM row depends on its own input row only).
        w_row = e * 2 * I + g_row
        for k in range(0, H, BK):
            b_a = d_recv.load([prow, k])
            b_g = tl.dot(b_a, d_w1.load([w_row, k]).T, b_g, input_precision=DOT_PREC)
            b_u = tl.dot(b_a, d_w1.load([w_row + up_off, k]).T, b_u, input_precision=DOT_PREC)
    else:
        o_k = tl.arange(0, BK)
        p_a = p_recv + (prow + o_m).to(tl.int64)[:, None] * H + o_k[None, :]  # [BM, BK]
        o_w = e.to(tl.int64) * 2 * I * H + (g_row + o_n).to(tl.int64)[None, :] * H + o_k[:, None]
        p_g = p_w1 + o_w  # [BK, BN1] gate slab
        if W1_CONCAT:
            p_u = p_g + I.to(tl.int64) * H  # [BK, BN1] up slab
        else:
            p_u = p_g + BN1 * H
        for _k in range(0, H, BK):
            b_a = tl.load(p_a, mask=m_m[:, None], other=0.0)
            b_g = tl.dot(b_a, tl.load(p_g), b_g, input_precision=DOT_PREC)
            b_u = tl.dot(b_a, tl.load(p_u), b_u, input_precision=DOT_PREC)
            p_a += BK
            p_g += BK
            p_u += BK
    if HAS_B1:
        # `b1 [E, 2I]` is gate biases then up biases whatever the weights' layout: column nb * BN1 + n.
        p_bg = p_b1 + e.to(tl.int64) * 2 * I + nb * BN1 + o_n  # [BN1]
        b_g += tl.load(p_bg).to(tl.float32)[None, :]
        b_u += tl.load(p_bg + I).to(tl.float32)[None, :]
    if ACT == 1:
        # GPT-OSS: the gate clamped from above only, the up both ways, and up + 1. NaN stays NaN, as in
        # torch's clamp (the hardware min/max would return the limit).
        b_g = tl.minimum(b_g, act_limit, propagate_nan=tl.PropagateNan.ALL)
        b_u = tl.minimum(tl.maximum(b_u, -act_limit, propagate_nan=tl.PropagateNan.ALL), act_limit,
                         propagate_nan=tl.PropagateNan.ALL)
        b_h = b_g * tl.sigmoid(act_alpha * b_g) * (b_u + 1.0)  # [BM, BN1]
    else:
        b_h = b_g * tl.sigmoid(b_g) * b_u  # [BM, BN1] SwiGLU
    p_o = p_act + (prow + o_m).to(tl.int64)[:, None] * I + (nb * BN1 + o_n)[None, :]
    tl.store(p_o, b_h.to(p_act.dtype.element_ty), mask=m_m[:, None])
    if TMA:
        fence_proxy_async(USE_PTX)  # LINEAR2 reads the activation through TMA
    tl.debug_barrier()
    tl.atomic_add(p_ready + u, 1, sem="release", scope="gpu")


@triton.jit
def _linear2(u, e, row0, prow, n_rows, nb, p_act, d_act, p_w2, d_w2, p_row_src, p_row_slot, p_comb, p_comb_delta,
             p_ready, p_pace, pace_fs, pace_budget_ns, p_err, rank, T_STRIDE, H, I, timeout_ns, max_spins,
             p_act_scale, p_w2_scale, p_b2,
             STAGE_PACE: tl.constexpr, BM: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr,
             PACED: tl.constexpr, FP8: tl.constexpr, PAIR_STAGES: tl.constexpr, USE_PTX: tl.constexpr,
             HAS_B2: tl.constexpr, DOT_PREC: tl.constexpr):
    o_m = tl.arange(0, BM)
    m_m = o_m < n_rows
    o_n = nb * BN2 + tl.arange(0, BN2)
    m_n = o_n < H
    b_acc = tl.zeros([BM, BN2], dtype=tl.float32)
    if FP8:
        b_acc = _linear2_fp8_acc(e, prow, n_rows, nb, p_act, d_act, p_act_scale, p_w2, d_w2, p_w2_scale, H, I, BM,
                                 BN2, BK, TMA, PAIR_STAGES)
    elif TMA:
        w_row = e * H + nb * BN2  # columns past H read the next expert's rows; the store masks them
        for k in range(0, I, BK):
            b_acc = tl.dot(d_act.load([prow, k]), d_w2.load([w_row, k]).T, b_acc, input_precision=DOT_PREC)
    else:
        o_k = tl.arange(0, BK)
        p_a = p_act + (prow + o_m).to(tl.int64)[:, None] * I + o_k[None, :]  # [BM, BK]
        p_b = p_w2 + e.to(tl.int64) * H * I + o_n.to(tl.int64)[None, :] * I + o_k[:, None]  # [BK, BN2]
        for _k in range(0, I, BK):
            b_a = tl.load(p_a, mask=m_m[:, None], other=0.0)
            b_acc = tl.dot(b_a, tl.load(p_b, mask=m_n[None, :], other=0.0), b_acc,
                           input_precision=DOT_PREC)
            p_a += BK
            p_b += BK
    if HAS_B2:
        # Into the combine row, before the reduce multiplies that row by the token's router weight.
        b_acc += tl.load(p_b2 + e.to(tl.int64) * H + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    b_src = tl.load(p_row_src + row0 + o_m, mask=m_m, other=0)  # [BM]
    b_slot = tl.load(p_row_slot + row0 + o_m, mask=m_m, other=0)
    b_delta = tl.load(p_comb_delta + b_src // T_STRIDE, mask=m_m, other=0)  # [BM] int64
    o_row = b_delta + (b_slot.to(tl.int64) * T_STRIDE + b_src % T_STRIDE) * H
    o_row = tl.multiple_of(o_row, 8)
    p_c = p_comb + o_row[:, None] + o_n[None, :]  # [BM, BN2] rows of the source ranks' buffers
    if PACED:
        # Rows for other ranks cross the store path: wait for room in the pacing budget first.
        n_remote = tl.sum((m_m & (b_src // T_STRIDE != rank)).to(tl.int32))
        n_cols = tl.minimum(H - nb * BN2, BN2)
        pace_stores(p_pace, n_remote * n_cols * (p_comb.dtype.element_ty.primitive_bitwidth // 8), pace_fs,
                    pace_budget_ns, timeout_ns, max_spins, p_err, STAGE_PACE * 65536 + rank, USE_PTX)
    tl.store(p_c, b_acc.to(p_comb.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])
    # This slab has read its activation rows: after all n2 slabs the unit's pool slot is free.
    tl.debug_barrier()
    tl.atomic_add(p_ready + u, 1, sem="release", scope="gpu")


@triton.jit
def _run_task(ti, i_c, p_tasks, p_units, p_row_src, p_row_slot, p_x, p_x_delta, p_recv, d_recv, p_w1, d_w1,
              p_act, d_act, p_w2, d_w2, p_comb, p_comb_delta, p_ready, p_err, p_trace, p_pace, pace_fs,
              pace_budget_ns, rank, T_STRIDE, H, I, n1, n2, pool_units, timeout_ns, max_spins,
              p_x_scale, p_xs_delta, p_recv_scale, p_w1_scale, p_act_scale, p_w2_scale, p_b1, p_b2, act_alpha,
              act_limit,
              STAGE_L1: tl.constexpr, STAGE_L2: tl.constexpr, STAGE_PACE: tl.constexpr, STAGE_SLOT: tl.constexpr,
              TASK_COLS: tl.constexpr,
              BM: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
              TMA: tl.constexpr, PACED: tl.constexpr, FP8: tl.constexpr, PAIR_STAGES: tl.constexpr, WAIT: tl.constexpr,
              USE_PTX: tl.constexpr, TRACE: tl.constexpr, W1_CONCAT: tl.constexpr, HAS_B1: tl.constexpr,
              HAS_B2: tl.constexpr, ACT: tl.constexpr, DOT_PREC: tl.constexpr):
    """Row `ti` of the task table: wait for its inputs, then run it (see module docstring)."""
    p_t = p_tasks + ti * TASK_COLS  # tables stay far below 2**31 entries
    kind = tl.load(p_t)
    u = tl.load(p_t + 1)
    nb = tl.load(p_t + 2)
    e = tl.load(p_units + u * 4)
    row0 = tl.load(p_units + u * 4 + 1)
    n_rows = tl.load(p_units + u * 4 + 2)
    prow = tl.load(p_units + u * 4 + 3)
    if n_rows > 0:
        if WAIT:
            if kind == 0:
                if u >= pool_units:
                    wait_geq(p_ready + u - pool_units, 1 + n1 + n2, p_err, STAGE_SLOT * 65536 + rank, timeout_ns,
                             max_spins, "gpu", USE_PTX)
            elif kind == 1:
                wait_geq(p_ready + u, 1, p_err, STAGE_L1 * 65536 + rank, timeout_ns, max_spins, "gpu", USE_PTX)
            elif kind == 2:
                wait_geq(p_ready + u, 1 + n1, p_err, STAGE_L2 * 65536 + rank, timeout_ns, max_spins,
                         "gpu", USE_PTX)
            if TMA:
                fence_proxy_async(USE_PTX)  # the acquire above orders generic loads only
        if TRACE:
            t_go = globaltimer(USE_PTX)
        if kind == 0:
            _dispatch(u, row0, prow, n_rows, p_row_src, p_x, p_x_delta, p_recv, p_ready, T_STRIDE, H,
                      p_x_scale, p_xs_delta, p_recv_scale, BM, BD, TMA, FP8, USE_PTX)
        elif kind == 1:
            if FP8:
                _linear1_fp8(u, e, prow, n_rows, nb, p_recv, d_recv, p_recv_scale, p_w1, d_w1, p_w1_scale, p_act,
                             p_act_scale, p_ready, H, I, BM, BN1, BK, TMA, USE_PTX, W1_CONCAT)
            else:
                _linear1(u, e, prow, n_rows, nb, p_recv, d_recv, p_w1, d_w1, p_act, p_ready, H, I, p_b1, act_alpha,
                         act_limit, BM, BN1, BK, TMA, USE_PTX, W1_CONCAT, HAS_B1, ACT, DOT_PREC)
        else:
            _linear2(u, e, row0, prow, n_rows, nb, p_act, d_act, p_w2, d_w2, p_row_src, p_row_slot, p_comb,
                     p_comb_delta, p_ready, p_pace, pace_fs, pace_budget_ns, p_err, rank, T_STRIDE, H, I, timeout_ns,
                     max_spins, p_act_scale, p_w2_scale, p_b2, STAGE_PACE, BM, BN2, BK, TMA, PACED, FP8, PAIR_STAGES,
                     USE_PTX, HAS_B2, DOT_PREC)
        if TRACE:
            # Tile cost without its dependency wait: the timer after the CTA's last store issued,
            # recorded with the CTA at the task's position in the global order.
            tl.debug_barrier()
            t_done = globaltimer(USE_PTX)
            g = tl.load(p_t + 6).to(tl.int64)
            tl.store(p_trace + g * 3, t_go)
            tl.store(p_trace + g * 3 + 1, t_done)
            tl.store(p_trace + g * 3 + 2, i_c.to(tl.int64))


@triton.jit(do_not_specialize=["rank", "num_ranks", "T_STRIDE", "pace_fs", "pace_budget_ns", "pool_units"])
def moe_main_kernel(
    p_tasks, p_cta_start, p_units, p_row_src, p_row_slot,
    p_x, p_x_delta, p_recv, d_recv, p_w1, d_w1, p_act, d_act, p_w2, d_w2, p_comb, p_comb_delta,
    p_ready, p_sync, p_sig, p_sig_delta, p_sig_slot, p_err, p_trace, p_pace,
    rank, num_ranks, T_STRIDE, H, I, pool_units, timeout_ns, max_spins, pace_fs, pace_budget_ns,
    p_x_scale, p_xs_delta, p_recv_scale, p_w1_scale, p_act_scale, p_w2_scale, p_b1, p_b2, act_alpha, act_limit,
    STAGE_L1: tl.constexpr, STAGE_L2: tl.constexpr, STAGE_FREE: tl.constexpr, STAGE_PACE: tl.constexpr,
    STAGE_SLOT: tl.constexpr,
    TASK_COLS: tl.constexpr, BM: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr,
    BK: tl.constexpr, BD: tl.constexpr, TMA: tl.constexpr, DYNAMIC: tl.constexpr, PACED: tl.constexpr,
    FP8: tl.constexpr, PAIR_STAGES: tl.constexpr, WAIT: tl.constexpr, USE_PTX: tl.constexpr, TRACE: tl.constexpr,
    W1_CONCAT: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, ACT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    n_c = tl.num_programs(0)
    it = tl.load(p_sync + 1)
    # A peer refused this call (the barrier set word 3): run no task and signal nobody, as the peers do.
    go = tl.load(p_err + 3, volatile=True) == 0
    if WAIT:
        if go:
            # Peers must have reduced the previous layer before their combine buffers are refilled.
            for q in range(num_ranks):
                wait_acquire(p_sig + num_ranks + q, it, timeout_ns, p_err, STAGE_FREE * 65536 + q, True, USE_PTX)
    n1 = I // BN1
    n2 = tl.cdiv(H, BN2)
    if DYNAMIC:
        # The table is in global order; each CTA takes the next task when it is free. A task waits
        # only on tasks before it, all already taken by running CTAs, so this cannot deadlock.
        n_tasks = tl.where(go, tl.load(p_cta_start + n_c), 0)
        ti = tl.atomic_add(p_sync + 3, 1, sem="relaxed", scope="gpu")
        while ti < n_tasks:
            _run_task(ti, i_c, p_tasks, p_units, p_row_src, p_row_slot, p_x, p_x_delta, p_recv, d_recv, p_w1, d_w1,
                      p_act, d_act, p_w2, d_w2, p_comb, p_comb_delta, p_ready, p_err, p_trace, p_pace, pace_fs,
                      pace_budget_ns, rank, T_STRIDE, H, I, n1, n2, pool_units, timeout_ns, max_spins,
                      p_x_scale, p_xs_delta, p_recv_scale, p_w1_scale, p_act_scale, p_w2_scale, p_b1, p_b2, act_alpha,
                      act_limit, STAGE_L1, STAGE_L2, STAGE_PACE, STAGE_SLOT, TASK_COLS,
                      BM, BN1, BN2, BK, BD, TMA, PACED, FP8, PAIR_STAGES, WAIT, USE_PTX, TRACE, W1_CONCAT, HAS_B1,
                      HAS_B2, ACT, DOT_PREC)
            ti = tl.atomic_add(p_sync + 3, 1, sem="relaxed", scope="gpu")
    else:
        t_lo = tl.load(p_cta_start + i_c)
        for ti in range(t_lo, tl.where(go, tl.load(p_cta_start + i_c + 1), t_lo)):
            _run_task(ti, i_c, p_tasks, p_units, p_row_src, p_row_slot, p_x, p_x_delta, p_recv, d_recv, p_w1, d_w1,
                      p_act, d_act, p_w2, d_w2, p_comb, p_comb_delta, p_ready, p_err, p_trace, p_pace, pace_fs,
                      pace_budget_ns, rank, T_STRIDE, H, I, n1, n2, pool_units, timeout_ns, max_spins,
                      p_x_scale, p_xs_delta, p_recv_scale, p_w1_scale, p_act_scale, p_w2_scale, p_b1, p_b2, act_alpha,
                      act_limit, STAGE_L1, STAGE_L2, STAGE_PACE, STAGE_SLOT, TASK_COLS,
                      BM, BN1, BN2, BK, BD, TMA, PACED, FP8, PAIR_STAGES, WAIT, USE_PTX, TRACE, W1_CONCAT, HAS_B1,
                      HAS_B2, ACT, DOT_PREC)
    tl.debug_barrier()
    done = tl.atomic_add(p_sync, 1, sem="acq_rel", scope="sys")
    if done == n_c - 1:
        tl.atomic_xchg(p_sync, 0)
        tl.atomic_xchg(p_sync + 3, 0)  # every CTA has made its last fetch before counting itself done
        if go:
            for q in range(num_ranks):
                if _reachable(p_err, q):
                    d = tl.load(p_sig_delta + q)
                    slot = tl.load(p_sig_slot + q)
                    tl.atomic_add(p_sig + d + slot, 1, sem="release", scope="sys")


@triton.jit(do_not_specialize=["units_cap", "num_ranks", "E_LOCAL", "T", "T_STRIDE", "report"])
def moe_reduce_kernel(
    p_comb, p_read_delta, p_idx, p_w, p_y, p_ready, units_cap,
    p_sync, p_sig, p_sig_delta, p_sig_slot, p_err, p_bad, p_report, report,
    num_ranks, E, E_LOCAL, T, T_STRIDE, H, K, timeout_ns, max_spins,
    STAGE_DONE: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, KP: tl.constexpr,
    WAIT: tl.constexpr, USE_PTX: tl.constexpr,
):
    i_t = tl.program_id(0)
    n_p = tl.num_programs(0)
    it = tl.load(p_sync + 1)
    go = tl.load(p_err + 3, volatile=True) == 0  # see moe_main_kernel
    if WAIT:
        if go:
            for q in range(num_ranks):
                wait_acquire(p_sig + q, it + 1, timeout_ns, p_err, STAGE_DONE * 65536 + q, True, USE_PTX)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, KP)
    m_tk = m_t[:, None] & (o_k < K)[None, :]  # [BT, KP]
    o_tk = o_t[:, None].to(tl.int64) * K + o_k[None, :]  # [BT, KP] flat position in topk_idx
    b_idx = tl.load(p_idx + o_tk, mask=m_tk, other=0).to(tl.int64)
    # An id outside [0, E) has no combine row: masked before it forms an address, counted below.
    m_bad = m_tk & ((b_idx < 0) | (b_idx >= E))
    m_ok = m_tk & (b_idx >= 0) & (b_idx < E)
    b_w = tl.load(p_w + o_tk, mask=m_ok, other=0.0).to(tl.float32)
    b_rd = tl.load(p_read_delta + tl.where(m_ok, b_idx, 0) // E_LOCAL, mask=m_ok, other=0)  # [BT, KP] int64
    o_row = b_rd + (o_k[None, :].to(tl.int64) * T_STRIDE + o_t[:, None]) * H
    for h in range(0, H, BH):
        o_h = h + tl.arange(0, BH)
        # One slot at a time: a [BT, BH] block of pointers and values stays in registers, where a
        # [BT, KP, BH] block spilled to local memory.
        b_y = tl.zeros([BT, BH], tl.float32)
        for k in tl.static_range(KP):
            is_k = o_k[None, :] == k
            row_k = tl.sum(tl.where(is_k, o_row, 0), axis=1)  # [BT]
            w_k = tl.sum(tl.where(is_k, b_w, 0.0), axis=1)
            ok_k = tl.sum((is_k & m_ok).to(tl.int32), axis=1) > 0
            b_c = tl.load(p_comb + row_k[:, None] + o_h[None, :], mask=ok_k[:, None], other=0.0)
            b_y += b_c.to(tl.float32) * w_k[:, None]
        b_y = tl.where(go, b_y, float("nan"))  # a refused call has no output
        tl.store(p_y + o_t[:, None].to(tl.int64) * H + o_h[None, :], b_y.to(p_y.dtype.element_ty),
                 mask=m_t[:, None])
    n_bad = tl.sum(tl.sum(m_bad.to(tl.int32), axis=1), axis=0)
    if n_bad > 0:
        # The call's first bad entry in (token, slot) order, whichever program gets here first: its
        # position goes into word 2 as 2**62 - position, the largest one winning (the word starts at 0).
        first = tl.min(tl.min(tl.where(m_bad, o_tk, 1 << 62), axis=1), axis=0)
        tl.atomic_add(p_bad, n_bad.to(tl.int64))
        tl.atomic_max(p_bad + 2, (1 << 62) - first)
    tl.debug_barrier()
    done = tl.atomic_add(p_sync + 2, 1, sem="acq_rel", scope="gpu")
    if done == n_p - 1:
        # The main kernel has finished (stream order), so its counters can be cleared for the next call.
        tl.atomic_xchg(p_sync + 2, 0)
        if go:
            for u0 in range(0, units_cap, 1024):
                o_u = u0 + tl.arange(0, 1024)
                tl.store(p_ready + o_u, tl.zeros([1024], tl.int32), mask=o_u < units_cap)
            tl.atomic_xchg(p_sync + 1, it + 1)
            for q in range(num_ranks):
                if _reachable(p_err, q):
                    d = tl.load(p_sig_delta + q)
                    slot = tl.load(p_sig_slot + q)
                    tl.atomic_add(p_sig + d + num_ranks + slot, 1, sem="release", scope="sys")
        pos = tl.atomic_xchg(p_bad + 2, 0)
        if pos != 0:
            # Every program has counted (the counter above orders them): word 1 keeps the first bad
            # id of the earliest call whose words are still unread (an id out of range is never 0).
            if tl.load(p_bad + 1) == 0:
                tl.store(p_bad + 1, tl.load(p_idx + ((1 << 62) - pos)).to(tl.int64))
        if report != 0:
            # Every error of this call is in (all its kernels ran before this program): hand the words
            # to the host (a pinned row it reads once the call's event completes) and clear them.
            for j in tl.static_range(3):
                tl.store(p_report + j, tl.atomic_xchg(p_err + j, 0).to(tl.int64))
            tl.store(p_report + 3, tl.atomic_xchg(p_bad, 0))
            tl.store(p_report + 4, tl.atomic_xchg(p_bad + 1, 0))
        tl.atomic_xchg(p_err + 3, 0)  # a refusal stops one call only
