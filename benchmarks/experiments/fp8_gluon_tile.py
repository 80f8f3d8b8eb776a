"""The FP8 Linear-2 tile in Gluon: two math warpgroups that promote out of phase (an experiment).

`fp8_tile_variants.py` found that the Linear-2 tile's per-K-block promotion (`acc += dot(a, b) * scale`)
costs it a third of its time: the unscaled accumulator chain is 1.49x faster. Triton must wait for each
FP8 product before scaling it (`wgmma.wait_group 0` after every K block), and it puts CTA-wide
`bar.sync` instructions in each K iteration, so the two warpgroups of the 8-warp CTA promote in lockstep
and the tensor cores idle while both promote. Its `warp_specialize` moves the loads to a producer
partition but keeps one consumer group, and changes nothing.

SM90 FP8 GEMMs written in CUDA split the tile instead: a producer warp issues the TMA loads into a ring
of shared-memory stages guarded by mbarriers (`full`: the stage's bytes arrived, `empty`: both
consumers are done with it), and two consumer warpgroups each own 64 of the tile's 128 rows and their
own float32 accumulator. A consumer waits for its stage, runs the block's MMAs, waits for them, hands
the stage back and promotes. No barrier in the K loop spans both consumers, so they drift out of phase
and one promotes while the other's MMAs run. Gluon (Triton's explicit-layout language) can say this:
`gl.warp_specialize` with the first consumer as the default partition (4 warps), the second as a
4-warp worker and the producer as a 1-warp worker.

The tile computes what `_l2_desc` (SCALED=1) does: out[rows, n-block] (bf16) = sum over K blocks kb of
(act[rows, kb-block] @ w2[e * H + n-block, kb-block]^T) * act_s[row, kb] * w2_s[e, n-block // 128, kb],
expert e = row // RPE, 128 x 128 tiles, BK 128 (one scale block per step), one persistent CTA per SM.
Written against Triton 3.6's Gluon (it also compiles with 3.9, where one name differs); the kernel
module needs no torch, so it compiles offline for sm_90a, and the launcher imports the descriptor class
when it is called.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Triton 3.6 names the TMA load `async_copy_global_to_shared`; later releases rename it `async_load` (and
# make the old name raise), so take whichever this Triton has.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BM, BN, BK = 128, 128, 128  # the tile (two consumers of BM // 2 rows) and one scale block per K step


@gluon.jit
def _l2_producer(d_act, d_w2, a_bufs, b_bufs, full, empty, H, I, n_m, RPE: gl.constexpr,
                 NUM_STAGES: gl.constexpr):
    # One warp: the TMA loads of every tile this CTA owns, into the stage ring. The stage counter `it`
    # runs on across tiles (as in both consumers), so the producer fills the next tile's first stages
    # while the consumers still promote and store the last one.
    BMH: gl.constexpr = d_act.block_type.shape[0]
    BN_: gl.constexpr = d_w2.block_type.shape[0]
    BK_: gl.constexpr = d_w2.block_type.shape[1]
    STAGE_BYTES: gl.constexpr = 2 * d_act.block_type.nbytes + d_w2.block_type.nbytes
    n2 = H // BN_
    nkb = I // BK_
    it = 0
    for t in range(gl.program_id(0), n_m * n2, gl.num_programs(0)):
        mb = t // n2
        nb = t % n2
        row_a = mb * (2 * BMH)
        row_b = row_a // RPE * H + nb * BN_  # expert e's H rows of w2, then the tile's n-block
        for kb in range(nkb):
            s = it % NUM_STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0, so the first pass
            # over the ring waits for parity 1 and goes through; later passes wait for both consumers.
            mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)
            bar = full.index(s)
            mbarrier.expect(bar, STAGE_BYTES)
            _tma_load(d_act, [row_a, kb * BK_], bar, a_bufs.index(2 * s))
            _tma_load(d_act, [row_a + BMH, kb * BK_], bar, a_bufs.index(2 * s + 1))
            _tma_load(d_w2, [row_b, kb * BK_], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _l2_consumer(p_as, p_w2s, p_out, a_bufs, b_bufs, full, empty, H, I, n_m, RPE: gl.constexpr,
                 NUM_STAGES: gl.constexpr, HALF: gl.constexpr):
    # One warpgroup: rows HALF * 64 .. HALF * 64 + 63 of every tile, its own float32 accumulator.
    BMH: gl.constexpr = a_bufs.type.shape[1]
    BN_: gl.constexpr = b_bufs.type.shape[1]
    BK_: gl.constexpr = b_bufs.type.shape[2]
    # wgmma over 64 rows x BN columns with 4 warps: instruction m16 x n(BN) x k32 for 8-bit operands
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BN_, 256 // a_bufs.dtype.primitive_bitwidth])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    n2 = H // BN_
    nkb = I // BK_
    # The product registers are carried through the loop and handed back to each block's first MMA
    # (use_acc=False ignores them), so no zero tensor is rebuilt per K block.
    prod = gl.zeros([BMH, BN_], gl.float32, mma)
    it = 0
    for t in range(gl.program_id(0), n_m * n2, gl.num_programs(0)):
        mb = t // n2
        nb = t % n2
        e = (mb * (2 * BMH)) // RPE
        o_m = (mb * (2 * BMH) + HALF * BMH + gl.arange(0, BMH, layout=rows_l)).to(gl.int64)
        p_a_s = p_as + o_m * nkb
        p_bs = p_w2s + (e.to(gl.int64) * (H // 128) + (nb * BN_) // 128) * nkb
        acc = gl.zeros([BMH, BN_], gl.float32, mma)
        for kb in range(nkb):
            s = it % NUM_STAGES
            # the block's scales, issued before the waits so their latency hides behind the MMAs
            a_s = gl.load(p_a_s + kb)
            b_s = gl.load(p_bs + kb)
            mbarrier.wait(full.index(s), (it // NUM_STAGES) & 1)
            a_buf = a_bufs.index(2 * s + HALF)
            b_buf = b_bufs.index(s)
            # w2's block is [n, k] with k contiguous: its transposed view is the K-major B that FP8
            # wgmma needs, no data moves
            prod = warpgroup_mma(a_buf, b_buf.permute((1, 0)), prod, use_acc=False, is_async=True)
            prod, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(prod, a_buf, b_buf))
            # The stage is free once this warpgroup's MMAs have read it; the producer waits for both.
            mbarrier.arrive(empty.index(s), count=1)
            acc += prod * (a_s * b_s)[:, None]
            it += 1
        o_n = nb * BN_ + gl.arange(0, BN_, layout=cols_l)
        gl.store(p_out + o_m[:, None] * H + o_n[None, :], acc.to(gl.bfloat16))


@gluon.jit
def l2_gluon(d_act, p_as, d_w2, p_w2s, p_out, H, I, n_m, RPE: gl.constexpr, NUM_STAGES: gl.constexpr,
             CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Persistent FP8 Linear-2 tiles: d_act [P, I] in [64, BK] boxes, d_w2 [E * H, I] in [BN, BK] boxes;
    launch with num_warps=4 (the default partition is the first consumer)."""
    BMH: gl.constexpr = d_act.block_type.shape[0]
    gl.static_assert(d_act.block_type.shape[1] == d_w2.block_type.shape[1])
    gl.static_assert(BMH == 64)  # one warpgroup's wgmma rows
    a_bufs = gl.allocate_shared_memory(d_act.dtype, [2 * NUM_STAGES, BMH, d_act.block_type.shape[1]],
                                       d_act.layout)
    b_bufs = gl.allocate_shared_memory(d_w2.dtype, [NUM_STAGES] + d_w2.block_type.shape, d_w2.layout)
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(s), count=1)  # the producer's expect; the TMA bytes complete it
        mbarrier.init(empty.index(s), count=2)  # one arrival from each consumer
    # the initialized barriers must be visible to the TMA unit (async proxy) before its first load
    fence_async_shared()
    gl.warp_specialize([
        (_l2_consumer, (p_as, p_w2s, p_out, a_bufs, b_bufs, full, empty, H, I, n_m, RPE, NUM_STAGES, 0)),
        (_l2_consumer, (p_as, p_w2s, p_out, a_bufs, b_bufs, full, empty, H, I, n_m, RPE, NUM_STAGES, 1)),
        (_l2_producer, (d_act, d_w2, a_bufs, b_bufs, full, empty, H, I, n_m, RPE, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# Registers per thread: the kernel runs 12 warps (4 + 4 + 1, padded to whole warpgroups), so it launches
# with at most 65536 / 384 = 170 (168); setmaxnreg then moves them from the producer's warpgroup to the
# two consumers: (232 + 232 + 40) * 128 = 64512 of 65536.
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 232, 40, 168


def launch_l2_gluon(act, act_s, w2, w2_s, out, H, I, RPE, num_sms, num_stages=4):
    """A zero-argument callable that launches `l2_gluon` over every tile of `out` [P, H] (bf16) and
    returns what the launch returns (the compiled kernel)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    P = act.shape[0]
    assert P % BM == 0 and H % BN == 0 and I % BK == 0 and RPE % BM == 0
    a_layout = gl.NVMMASharedLayout.get_default_for([BM // 2, BK], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
    d_a = TensorDescriptor(act, shape=[P, I], strides=[I, 1], block_shape=[BM // 2, BK], layout=a_layout)
    d_b = TensorDescriptor(w2, shape=[w2.shape[0], I], strides=[I, 1], block_shape=[BN, BK], layout=b_layout)
    n_m = P // BM

    def launch():
        return l2_gluon[(num_sms,)](d_a, act_s, d_b, w2_s, out, H, I, n_m, RPE=RPE, NUM_STAGES=num_stages,
                                    CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
                                    maxnreg=MAXNREG)

    return launch
