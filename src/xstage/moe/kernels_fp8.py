"""FP8 tile functions of the fused MoE kernel: block-scaled Linear-1 (+ SwiGLU + 1x128 requantization)
and Linear-2, the FP8 counterparts of `kernels._linear1` / `_linear2`: operand tiles through pointers, or
with `TMA` through 2-d descriptors (`[BM, 128]` row blocks and `[BN, 128]` weight blocks, K-major as
the FP8 MMA takes them); the scales always through pointers.

Problem: run one LINEAR1 or LINEAR2 task of the persistent MoE kernel on `float8_e4m3fn` operands in
the DeepSeek-V3 formats of `xstage.moe.fp8`, so that wiring them into `_run_task` is a matter of
passing the scale pointers along.

Formats (all scales float32; sizes H and I are multiples of 128):
- receive pool `p_recv` e4m3 `[P, H]` (row stride H) with 1x128 scales `p_recv_scale [P, H/128]`;
- Linear-1 weights `p_w1` e4m3 `[E * 2I, H]` in the kernel's interleaved layout (for output block
  `nb`: BN1 gate rows, then BN1 up rows) with 128x128 scales `p_w1_scale [E, 2I/128, H/128]` in the same
  row order, so with BN1 == 128 the gate block of `nb` has scale row `2 nb` and the up block `2 nb + 1`;
  or, with `W1_CONCAT`, in a checkpoint's own `[gate; up]` order (gate block `nb` at row `nb BN1`,
  scale row `nb`; up block at `I + nb BN1`, scale row `I/128 + nb`);
- activation `p_act` e4m3 `[P, I]` with 1x128 scales `p_act_scale [P, I/128]`;
- Linear-2 weights `p_w2` e4m3 `[E * H, I]` with 128x128 scales `p_w2_scale [E, H/128, I/128]`.

Algorithm (the order `fp8.scaled_linear` emulates): for each 128-wide K block, the raw e4m3 product
`tl.dot` in float32 (each product exact), times `a_scale[:, None] * w_scale`, added to a float32
accumulator. `_linear1_fp8` then forms SwiGLU `g * sigmoid(g) * u` in float32 and quantizes each row of
its `[BM, 128]` tile 1x128 (`s = amax / 448`, 1 for an all-zero row; `q = e4m3(clamp(h / s, +-448))`),
stores q and s and releases the unit's readiness counter. `_linear2_fp8_acc` returns the float32
accumulator; the caller (the combine epilogue, with pacing) rounds it to BF16 and stores it.

Precision: on Hopper the FP8 MMA does not keep a float32 sum inside one `tl.dot` (9.6-12 bits of the
sum of |terms| at K = 128, `benchmarks/results/h200-fp8-dot/`); promoting to float32 once per 128 of K
is DeepSeek-V3's recipe, and finer promotion (K = 32 dots: 13.5-14.9 bits) costs MMA throughput. The
tests use operands whose partial sums the MMA keeps exactly, so they hold the functions to float32
exactness on the GPU as in the interpreter.

Rounding: `h / s` uses `tl.div_rn` (Triton's plain fp32 `/` is an approximate division on NVIDIA
GPUs). Compiled (`USE_PTX`), the cast to e4m3 is the hardware's `cvt.rn.satfinite` (to nearest, ties
to even). Triton 3.9's interpreter casts float32 to fp8 by rounding half up and drops the carry of a
mantissa that rounds up to the next binade (-0.1219 became -0.0625), so without `USE_PTX` the value is
first rounded to the e4m3 grid in float32 by `_round_to_e4m3`, after which the cast is exact; the CPU
tests check those codes against torch's cast, the GPU tests the hardware's. (The explicit rounding
costs about 7 instructions per element, 450 per thread of a `[128, 128]` tile, in the compiled code.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.comm.device import fence_proxy_async

FP8_MAX = tl.constexpr(448.0)  # the largest finite e4m3 value
SCALE_BLOCK = tl.constexpr(128)  # DeepSeek-V3 block: 128x128 weights, 1x128 activations


@triton.jit
def _round_to_e4m3(v):
    """float32 `v` in [-448, 448] -> the nearest e4m3 value (ties to even), still as float32.

    e4m3 keeps 3 mantissa bits down to 2^-6 and the fixed subnormal step 2^-9 below, so the grid
    step of `v` is `2^(max(e, -6) - 3)` with `e` its binary exponent. Adding
    1.5 * 2^23 steps to `|v|` and subtracting them again rounds it to that step with float32's own
    round-to-nearest-even (the sum lies in [2^23, 2^24) steps, where float32's spacing is one step).
    The sign goes back on afterwards, so a negative value that rounds to zero stays -0 as in torch."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # zero and float32 subnormals: the subnormal step
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    big = step * 12582912.0  # 1.5 * 2^23 steps (exact: a power of two times 1.5 * 2^23)
    r = (tl.abs(v) + big) - big
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _linear1_fp8(u, e, prow, n_rows, nb, p_recv, d_recv, p_recv_scale, p_w1, d_w1, p_w1_scale, p_act, p_act_scale,
                 p_ready, H, I, BM: tl.constexpr, BN1: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr,
                 USE_PTX: tl.constexpr, W1_CONCAT: tl.constexpr):
    # One 128-column block per tile: the 1x128 requantization of the SwiGLU output needs the whole
    # block's amax in one CTA, and the gate and up slabs each map to one weight-scale row.
    tl.static_assert(BN1 == SCALE_BLOCK, "BN1 must be 128 on the FP8 path (one 1x128 activation block per tile)")
    # Each K step must be exactly one scale block, so one pair of scales applies to the whole dot.
    tl.static_assert(BK == SCALE_BLOCK, "BK must be 128 on the FP8 path (one scale block per K step)")
    o_m = tl.arange(0, BM)
    m_m = o_m < n_rows
    o_n = tl.arange(0, BN1)
    o_k = tl.arange(0, BK)
    nkb = H // BK
    b_g = tl.zeros([BM, BN1], dtype=tl.float32)
    b_u = tl.zeros([BM, BN1], dtype=tl.float32)
    o_row = (prow + o_m).to(tl.int64)  # the unit's pool slot
    p_a = p_recv + o_row[:, None] * H + o_k[None, :]  # [BM, BK]
    p_as = p_recv_scale + o_row * nkb  # [BM]: one scale per row per K block
    # Where the tile's gate and up rows, and their scale rows (one per 128 weight rows), are among the
    # expert's 2I. Interleaved (`transform_weights`): gate block nb at rows 2 nb BN1 (scale row 2 nb), its
    # up block right after. Concatenated (the checkpoint's own `[gate; up]`, transformers' fine-grained
    # FP8 `gate_up_proj` and `gate_up_proj_scale_inv`, read in place): gate block nb at nb BN1 (scale
    # row nb), up block I rows on (scale row I / 128 + nb).
    if W1_CONCAT:
        g_row = nb * BN1
        up_off = I
        g_srow = nb
    else:
        g_row = nb * 2 * BN1
        up_off = BN1
        g_srow = 2 * nb
    o_w = e.to(tl.int64) * 2 * I * H + (g_row + o_n).to(tl.int64)[None, :] * H + o_k[:, None]
    p_g = p_w1 + o_w  # [BK, BN1] gate slab
    p_gs = p_w1_scale + (e.to(tl.int64) * (2 * I // SCALE_BLOCK) + g_srow) * nkb
    if W1_CONCAT:
        p_u = p_g + I.to(tl.int64) * H  # [BK, BN1] up slab
        p_us = p_gs + (I // SCALE_BLOCK) * nkb
    else:
        p_u = p_g + BN1 * H
        p_us = p_gs + nkb
    w_row = e * 2 * I + g_row  # TMA: the gate slab's first weight row
    for kb in range(0, nkb):
        b_as = tl.load(p_as + kb, mask=m_m, other=0.0)[:, None]  # masked rows stay 0 (their a is 0 too)
        if TMA:
            # Whole [BM, BK] row blocks: rows past n_rows hold stale codes that only reach output rows the
            # epilogue masks (a row's amax and products are its own). Weights arrive K-major, as the FP8
            # MMA takes both operands.
            b_a = d_recv.load([prow, kb * BK])
            b_wg = d_w1.load([w_row, kb * BK]).T
            b_wu = d_w1.load([w_row + up_off, kb * BK]).T
        else:
            b_a = tl.load(p_a, mask=m_m[:, None], other=0.0)
            b_wg = tl.load(p_g)
            b_wu = tl.load(p_u)
        # Raw e4m3 products in float32, scaled once per K block: the order fp8.scaled_linear emulates.
        b_g += tl.dot(b_a, b_wg, out_dtype=tl.float32) * (b_as * tl.load(p_gs + kb))
        b_u += tl.dot(b_a, b_wu, out_dtype=tl.float32) * (b_as * tl.load(p_us + kb))
        p_a += BK
        p_g += BK
        p_u += BK
    b_h = b_g * tl.sigmoid(b_g) * b_u  # [BM, BN1] SwiGLU in float32
    # 1x128 quantization straight from float32 (no BF16 detour), as fp8.expert_mlp_fp8 does.
    amax = tl.max(tl.abs(b_h), axis=1)  # [BM]
    b_s = tl.where(amax == 0, 1.0, tl.div_rn(amax, FP8_MAX))  # an all-zero row must not divide by zero
    b_v = tl.div_rn(b_h, b_s[:, None])
    # Clamp first: h / s can round a hair past 448, and an out-of-range cast is not saturating everywhere.
    b_v = tl.minimum(tl.maximum(b_v, -FP8_MAX), FP8_MAX)
    if USE_PTX:
        b_q = b_v.to(p_act.dtype.element_ty)  # compiled: cvt.rn.satfinite, round to nearest even
    else:
        # The interpreter's cast rounds wrongly (module docstring): round first, then the cast is exact.
        b_q = _round_to_e4m3(b_v).to(p_act.dtype.element_ty)
    p_o = p_act + o_row[:, None] * I + (nb * BN1 + o_n)[None, :]
    tl.store(p_o, b_q, mask=m_m[:, None])
    tl.store(p_act_scale + o_row * (I // SCALE_BLOCK) + nb, b_s, mask=m_m)
    if TMA:
        fence_proxy_async(USE_PTX)  # LINEAR2 reads the activation through TMA
    tl.debug_barrier()
    tl.atomic_add(p_ready + u, 1, sem="release", scope="gpu")


@triton.jit
def _scaled_block(p_a, p_b, d_act, d_w2, prow, w_row, kb, m_m, m_n, p_as, p_bs, BK: tl.constexpr, TMA: tl.constexpr):
    """K block `kb` of a Linear-2 tile: the raw e4m3 product in float32 times its scales."""
    b_s = tl.load(p_as + kb, mask=m_m, other=0.0)[:, None] * tl.load(p_bs + kb)
    if TMA:
        b_a = d_act.load([prow, kb * BK])
        b_b = d_w2.load([w_row, kb * BK]).T
    else:
        b_a = tl.load(p_a + kb * BK, mask=m_m[:, None], other=0.0)
        b_b = tl.load(p_b + kb * BK, mask=m_n[None, :], other=0.0)
    return tl.dot(b_a, b_b, out_dtype=tl.float32) * b_s


@triton.jit
def _linear2_fp8_acc(e, prow, n_rows, nb, p_act, d_act, p_act_scale, p_w2, d_w2, p_w2_scale, H, I,
                     BM: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr,
                     PAIR_STAGES: tl.constexpr):
    """float32 `[BM, BN2]` Linear-2 accumulator of output columns `nb * BN2 ..` (rows past `n_rows` and
    columns past H are 0); the caller rounds it to BF16 and stores it.

    Two K blocks per loop step (and `PAIR_STAGES` of these steps in flight): each step ends in a barrier
    before the next operands land, and the FP8 product's wait leaves nothing to overlap it; halving the
    steps made H1152-I4608-E8-K2's Linear-2 tiles 1.04x faster on their own
    (`benchmarks/results/h200-fp8-tile-variants/`). A pair step holds twice a single step's operands."""
    tl.static_assert(BK == SCALE_BLOCK, "BK must be 128 on the FP8 path (one scale block per K step)")
    # BN2 | 128: all of a tile's output columns lie in one 128-row weight block, so one scale per K step.
    tl.static_assert(SCALE_BLOCK % BN2 == 0, "BN2 must divide 128 on the FP8 path (one weight-scale row per tile)")
    o_m = tl.arange(0, BM)
    m_m = o_m < n_rows
    o_n = nb * BN2 + tl.arange(0, BN2)
    m_n = o_n < H
    o_k = tl.arange(0, BK)
    nkb = I // BK
    b_acc = tl.zeros([BM, BN2], dtype=tl.float32)
    o_row = (prow + o_m).to(tl.int64)
    p_a = p_act + o_row[:, None] * I + o_k[None, :]  # [BM, BK]
    p_as = p_act_scale + o_row * nkb  # [BM]
    p_b = p_w2 + e.to(tl.int64) * H * I + o_n.to(tl.int64)[None, :] * I + o_k[:, None]  # [BK, BN2]
    p_bs = p_w2_scale + (e.to(tl.int64) * (H // SCALE_BLOCK) + (nb * BN2) // SCALE_BLOCK) * nkb
    w_row = e * H + nb * BN2  # TMA: BN2 | 128 | H, so a tile never reads past its expert's rows
    for kb in tl.range(0, nkb - 1, 2, num_stages=PAIR_STAGES):
        b_acc += _scaled_block(p_a, p_b, d_act, d_w2, prow, w_row, kb, m_m, m_n, p_as, p_bs, BK, TMA)
        b_acc += _scaled_block(p_a, p_b, d_act, d_w2, prow, w_row, kb + 1, m_m, m_n, p_as, p_bs, BK, TMA)
    if nkb % 2 == 1:  # an odd number of K blocks: the last one alone
        b_acc += _scaled_block(p_a, p_b, d_act, d_w2, prow, w_row, nkb - 1, m_m, m_n, p_as, p_bs, BK, TMA)
    return b_acc
