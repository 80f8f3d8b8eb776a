"""The FlashAttention forward kernel (`_attn_fwd_kernel`) and its Triton helpers; `xstage.attention.flash`
checks the inputs, picks the configuration and launches it (its docstring states the problem, the
algorithm and the trace).

When the tile's output is final, the epilogue either stores it into `o` or, for the Ulysses
exchange (`xstage.attention.ulysses`), sends each row into the buffer of the rank that owns it.
Paced exchange (the default): the epilogue parks the tile in a per-program staging slot in local
memory, and the next tile's key loop sends it on in chunks of `chunk_rows` rows, one chunk every
`n_blocks / (n_chunks + 1)` key blocks, each program at its own phase within that period, so that
the programs, which run in step, take turns on the path. Storing whole tiles in the epilogue
(`paced=False`, the burst exchange) makes every program store at the same moment: the burst of the
whole grid (132 x 28 KiB at D=128, P=8) is far more than the path drains at once (about 70 us over
PCIe), the stores stall the programs, and the kernel's compute stretches (on one H200, host path,
24 x 128: 1.17x attention alone at 118800 tokens, P=2; paced 1.06x; see
benchmarks/results/h200-ulysses/runs.md). Once a tile's last chunk is sent (at least one pacing
period before the tile's end), the program raises the owners' per-source counters with a release
add, which then finds the stores landed (release/acquire, `xstage.comm.device`). The last tile of
each program has no next tile to hide in: it is sent after the loop.
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.comm.device import globaltimer, peer_ptr, signal_add, smid


@triton.jit
def _tile_coords(tile, n_m, H):
    i_m = tile % n_m
    i_bh = tile // n_m
    return i_bh // H, i_bh % H, i_m


@triton.jit
def _attn_block(b_q, b_k, b_v, b_acc, b_m, b_l, qk_scale, o_n, kv_len, MASK: tl.constexpr, PREC: tl.constexpr):
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # [BM, BN] fp32
    if MASK:
        b_s = tl.where((o_n < kv_len)[None, :], b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * qk_scale)  # [BM]
    b_p = tl.math.exp2(b_s * qk_scale - b_m_new[:, None])  # [BM, BN]
    b_alpha = tl.math.exp2(b_m - b_m_new)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None]
    b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc, input_precision=PREC)  # [BM, D]
    return b_acc, b_m_new, b_l


@triton.jit
def _attn_fwd_kernel(
    q, k, v, p_o,
    s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ob, s_os, s_oh,
    q_rb, q_cb, k_rb, k_cb, v_rb, v_cb,
    p_kv_lens, qk_scale,
    H, S_q, S_k, n_m, n_tiles,
    p_dst_tab, p_dst_row0, d_sb, d_ss, d_sh, head_off, p_sig_tab, p_sig, p_stage, p_trace,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr, HAS_KV_LENS: tl.constexpr, EXCHANGE: tl.constexpr, PACED: tl.constexpr,
    CHUNK_ROWS: tl.constexpr, DOT_PREC: tl.constexpr, TRACE: tl.constexpr, USE_PTX: tl.constexpr,
):
    # q, k, v are TMA descriptors over 2-D views (row = b * rb + s, col = b * cb + h * s_h + d) when
    # USE_TMA, else pointers to [B, S, H, D] with unit stride in D. With TRACE, p_trace is int64
    # [n_progs, cdiv(n_tiles, n_progs) + 1, TRACE_FIELDS] (layout: `trace_buffer`).
    o_m = tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, HEAD_DIM)
    n_progs = tl.num_programs(0)
    pid = tl.program_id(0)
    N_CHUNKS: tl.constexpr = BLOCK_M // CHUNK_ROWS
    p_slot = p_stage + pid.to(tl.int64) * (BLOCK_M * HEAD_DIM)  # [BM, D] staging slot (paced exchange)
    pend_lo = 0
    pend_hi = -1  # owners of the previous tile's rows, not yet signalled (none)
    prev_m0 = -1  # first row of the staged previous tile (paced exchange; -1: none)
    prev_b = tl.full([], 0, tl.int64)
    prev_h = tl.full([], 0, tl.int64)
    for tile in range(pid, n_tiles, n_progs):
        if TRACE:
            # Each timestamp is stored as soon as it is read, the paced sends add to their row with
            # atomics (the host zeroed it), and the row's address is recomputed at each use: nothing
            # of the trace stays live across the key loop, so the traced kernel keeps the untraced
            # one's registers and schedule as far as it can.
            tl.store(_trace_row_ptr(p_trace, pid, tile, n_tiles, n_progs) + 0, globaltimer(USE_PTX))
        i_b, i_h, i_m = _tile_coords(tile, n_m, H)
        i_b = i_b.to(tl.int64)
        i_h = i_h.to(tl.int64)
        m0 = i_m * BLOCK_M
        o_s = m0 + o_m  # [BM] query rows
        kv_len = S_k
        if HAS_KV_LENS:
            kv_len = tl.minimum(tl.load(p_kv_lens + i_b), S_k)
        if USE_TMA:
            b_q = q.load([(i_b * q_rb + m0).to(tl.int32), (i_b * q_cb + i_h * s_qh).to(tl.int32)])
            k_row0 = (i_b * k_rb).to(tl.int32)
            k_col = (i_b * k_cb + i_h * s_kh).to(tl.int32)
            v_row0 = (i_b * v_rb).to(tl.int32)
            v_col = (i_b * v_cb + i_h * s_vh).to(tl.int32)
        else:
            p_q = q + i_b * s_qb + i_h * s_qh + o_s.to(tl.int64)[:, None] * s_qs + o_d[None, :]
            b_q = tl.load(p_q, mask=(o_s < S_q)[:, None], other=0.0)  # [BM, D]
            p_k = k + i_b * s_kb + i_h * s_kh + o_n.to(tl.int64)[:, None] * s_ks + o_d[None, :]
            p_v = v + i_b * s_vb + i_h * s_vh + o_n.to(tl.int64)[:, None] * s_vs + o_d[None, :]
        b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_M], tl.float32)
        b_acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        n_full = (kv_len // BLOCK_N) * BLOCK_N
        n_blocks = n_full // BLOCK_N
        # One chunk of the previous tile every `pace` key blocks, this program at phase `pid % pace`
        # of the period, so that the programs (which run in step) take turns on the path.
        pace = tl.maximum(n_blocks // (N_CHUNKS + 1), 1)
        phase = pid % pace
        for start_n in range(0, n_full, BLOCK_N):
            if EXCHANGE and PACED:
                i_blk = start_n // BLOCK_N
                if (prev_m0 >= 0) & (i_blk % pace == phase) & (i_blk // pace < N_CHUNKS):
                    if TRACE:
                        t_send = globaltimer(USE_PTX)
                    _send_chunk(p_slot, p_o, i_blk // pace, prev_m0, S_q, prev_b, prev_h, p_dst_tab, p_dst_row0,
                                d_sb, d_ss, d_sh, head_off, HEAD_DIM, CHUNK_ROWS)
                    if TRACE:
                        p_row = _trace_row_ptr(p_trace, pid, tile, n_tiles, n_progs)
                        tl.atomic_add(p_row + 3, globaltimer(USE_PTX) - t_send, sem="relaxed")
                        tl.atomic_add(p_row + 4, (prev_m0 + (i_blk // pace) * CHUNK_ROWS < S_q).to(tl.int64),
                                      sem="relaxed")
            if USE_TMA:
                b_k = k.load([k_row0 + start_n, k_col])  # [BN, D]
                b_v = v.load([v_row0 + start_n, v_col])
            else:
                b_k = tl.load(p_k + start_n * s_ks)
                b_v = tl.load(p_v + start_n * s_vs)
            b_acc, b_m, b_l = _attn_block(b_q, b_k, b_v, b_acc, b_m, b_l, qk_scale, o_n, kv_len, False, DOT_PREC)
        if n_full < kv_len:
            m_kv = (n_full + o_n) < kv_len  # [BN]
            if USE_TMA:
                b_k = k.load([k_row0 + n_full, k_col])
                b_v = v.load([v_row0 + n_full, v_col])
            else:
                b_k = tl.load(p_k + n_full * s_ks, mask=m_kv[:, None], other=0.0)
                b_v = tl.load(p_v + n_full * s_vs, mask=m_kv[:, None], other=0.0)
            # Rows past the key length may hold the next batch or padding garbage: zero them so
            # that 0-weight x garbage cannot turn into NaN.
            b_v = tl.where(m_kv[:, None], b_v, 0.0)
            b_acc, b_m, b_l = _attn_block(b_q, b_k, b_v, b_acc, b_m, b_l, qk_scale, n_full + o_n, kv_len, True,
                                           DOT_PREC)
        # A batch with no valid key gets zeros, not 0/0.
        b_o = (b_acc / tl.where(b_l == 0.0, 1.0, b_l)[:, None]).to(p_o.dtype.element_ty)  # [BM, D]
        if TRACE:
            tl.store(_trace_row_ptr(p_trace, pid, tile, n_tiles, n_progs) + 1, globaltimer(USE_PTX))
        if EXCHANGE and PACED:
            if prev_m0 >= 0:
                # chunks that found no slot in a key loop shorter than N_CHUNKS blocks
                for i_c in range(tl.minimum(n_blocks, N_CHUNKS), N_CHUNKS):
                    _send_chunk(p_slot, p_o, i_c, prev_m0, S_q, prev_b, prev_h, p_dst_tab, p_dst_row0,
                                d_sb, d_ss, d_sh, head_off, HEAD_DIM, CHUNK_ROWS)
                _signal_tile(p_sig_tab, p_sig, p_dst_row0, prev_m0, S_q, BLOCK_M)
            # every thread has read the previous tile from the slot before it is overwritten, and the
            # slot holds this tile for every thread before the next key loop reads it
            tl.debug_barrier()
            tl.store(p_slot + o_m[:, None] * HEAD_DIM + o_d[None, :], b_o)
            tl.debug_barrier()
            prev_m0 = m0
            prev_b = i_b
            prev_h = i_h
        elif EXCHANGE:
            # Publish the previous tile's rows only now: this tile's compute was the gap in which
            # they drained, so the release (which waits for them to land) costs little. Releasing
            # right after the stores would stall every program for the whole X-Stage.
            _signal_owners(p_sig_tab, p_sig, p_dst_row0, pend_lo, pend_hi)
            pend_lo, pend_hi = _store_rows(b_o, p_o, o_s, o_d, m0, S_q, i_b, i_h, p_dst_tab, p_dst_row0, d_sb,
                                           d_ss, d_sh, head_off, BLOCK_M)
        else:
            p_out = p_o + i_b * s_ob + i_h * s_oh + o_s.to(tl.int64)[:, None] * s_os + o_d[None, :]
            tl.store(p_out, b_o, mask=(o_s < S_q)[:, None])
        if TRACE:
            _trace_end(_trace_row_ptr(p_trace, pid, tile, n_tiles, n_progs), USE_PTX)
    if TRACE:
        # the last row: the sends and signals after the tile loop
        t_start = globaltimer(USE_PTX)
        t_sent = t_start
        send_ns = tl.zeros([], tl.int32)
        n_sent = tl.zeros([], tl.int32)
    if EXCHANGE and PACED:
        if prev_m0 >= 0:
            for i_c in range(N_CHUNKS):
                if TRACE:
                    t_send = globaltimer(USE_PTX)
                _send_chunk(p_slot, p_o, i_c, prev_m0, S_q, prev_b, prev_h, p_dst_tab, p_dst_row0, d_sb, d_ss,
                            d_sh, head_off, HEAD_DIM, CHUNK_ROWS)
                if TRACE:
                    t_sent = globaltimer(USE_PTX)
                    send_ns += (t_sent - t_send).to(tl.int32)
                    n_sent += (prev_m0 + i_c * CHUNK_ROWS < S_q).to(tl.int32)
            _signal_tile(p_sig_tab, p_sig, p_dst_row0, prev_m0, S_q, BLOCK_M)
    elif EXCHANGE:
        _signal_owners(p_sig_tab, p_sig, p_dst_row0, pend_lo, pend_hi)
    if TRACE:
        p_row = _trace_row_ptr(p_trace, pid, pid + tl.cdiv(n_tiles, n_progs) * n_progs, n_tiles, n_progs)
        tl.store(p_row + 0, t_start)
        tl.store(p_row + 1, t_sent)
        tl.store(p_row + 3, send_ns.to(tl.int64))
        tl.store(p_row + 4, n_sent.to(tl.int64))
        _trace_end(p_row, USE_PTX)


@triton.jit
def _trace_row_ptr(p_trace, pid, tile, n_tiles, n_progs):
    # row (tile - pid) / n_progs of program pid in [n_progs, cdiv(n_tiles, n_progs) + 1, 6]
    n_rows = tl.cdiv(n_tiles, n_progs) + 1
    return p_trace + (pid.to(tl.int64) * n_rows + (tile - pid) // n_progs) * 6


@triton.jit
def _trace_end(p_row, USE_PTX: tl.constexpr):
    # TRACE_END, TRACE_SM
    tl.store(p_row + 2, globaltimer(USE_PTX))
    tl.store(p_row + 5, smid(USE_PTX).to(tl.int64))


@triton.jit
def _send_chunk(p_slot, p_o, i_c, m0, S_q, i_b, i_h, p_dst_tab, p_dst_row0, d_sb, d_ss, d_sh, head_off,
                HEAD_DIM: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    # Rows [i_c * CR, (i_c + 1) * CR) of the staged tile (first row m0) to their owners. The slot was
    # written by other threads of this program: read it through L2 (.cg), not a stale L1 line.
    # Chunks past the sequence's end (in its last, partial tile) have no owner.
    c0 = m0 + i_c * CHUNK_ROWS
    if c0 < S_q:
        o_r = i_c * CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)  # [CR] rows within the tile
        o_d = tl.arange(0, HEAD_DIM)
        b_c = tl.load(p_slot + o_r[:, None] * HEAD_DIM + o_d[None, :], cache_modifier=".cg")  # [CR, D]
        _store_rows(b_c, p_o, c0 + tl.arange(0, CHUNK_ROWS), o_d, c0, S_q, i_b, i_h, p_dst_tab, p_dst_row0, d_sb,
                    d_ss, d_sh, head_off, CHUNK_ROWS)


@triton.jit
def _signal_tile(p_sig_tab, p_sig, p_dst_row0, m0, S_q, BLOCK_M: tl.constexpr):
    # The owners of rows [m0, min(m0 + BLOCK_M, S_q)): the first is the rank whose range holds m0.
    i_lo = 0
    while tl.load(p_dst_row0 + i_lo + 1) <= m0:
        i_lo += 1
    i_hi = i_lo
    row_last = tl.minimum(m0 + BLOCK_M, S_q) - 1
    while tl.load(p_dst_row0 + i_hi + 1) <= row_last:
        i_hi += 1
    _signal_owners(p_sig_tab, p_sig, p_dst_row0, i_lo, i_hi)


@triton.jit
def _store_rows(b_o, p_o, o_s, o_d, m0, S_q, i_b, i_h, p_dst_tab, p_dst_row0, d_sb, d_ss, d_sh, head_off,
                BLOCK_M: tl.constexpr):
    # Rows [row0[p], row0[p+1]) of the gathered sequence belong to rank p; a tile straddles a
    # boundary when a rank's row count is not a multiple of BLOCK_M, so store to every owner it
    # touches. Returns the first and last owner (inclusive).
    i_p = 0
    while tl.load(p_dst_row0 + i_p + 1) <= m0:
        i_p += 1
    p_first = i_p
    row_end = tl.minimum(m0 + BLOCK_M, S_q)
    r0 = tl.load(p_dst_row0 + i_p)
    while r0 < row_end:
        r1 = tl.load(p_dst_row0 + i_p + 1)
        if r1 > r0:
            p_dst = peer_ptr(p_dst_tab, i_p, p_o)
            o_row = (o_s - r0).to(tl.int64)
            p_out = p_dst + i_b * d_sb + (head_off + i_h) * d_sh + o_row[:, None] * d_ss + o_d[None, :]
            tl.store(p_out, b_o, mask=((o_s >= r0) & (o_s < r1))[:, None])
        i_p += 1
        r0 = r1
    return p_first, i_p - 1


@triton.jit
def _signal_owners(p_sig_tab, p_sig, p_dst_row0, p_lo, p_hi):
    # One release add per destination that received rows (ranks without rows get no signal).
    for i_p in range(p_lo, p_hi + 1):
        if tl.load(p_dst_row0 + i_p + 1) > tl.load(p_dst_row0 + i_p):
            signal_add(peer_ptr(p_sig_tab, i_p, p_sig), 1)
