"""The device plan's prologue kernel (`moe_plan_kernel`) and its Triton helpers; `xstage.moe.device_plan`
launches it. The plan of a fused MoE call built on the device: one launch, no host synchronisation.

Problem: `xstage.moe.fused.plan` reads the routing counts back to the host and builds the task table
in Python loops over units and tasks, so a call waits for the host. Here one Triton kernel turns
`topk_idx` into the same routing layout (`unit_info`, `row_src`, `row_slot`, rows sorted stably by
(local expert, source rank, token, slot)) and the same task table, row for row, as the host planner
(`routing_layout` + `make_schedule`, the reference the tests hold it to), for every built-in order
(`expert_wave`, `interleaved`, `lag:k`) in both table forms (dynamic: global order; round-robin:
task g on CTA g % num_ctas, per-CTA lists concatenated), with dispatch hoisting and the row pool.

Algorithm. The named orders are regular, so each task's position has a closed form; only the greedy
split of experts into waves is sequential, and it runs over experts, not units.
- Rest order (the order without its dispatches), per unit u of wave w starting at unit s (size z,
  previous wave from sp, next wave of size zn; positions of LINEAR1(u, nb) and LINEAR2(u, nb)):
  - expert_wave: wave w's LINEAR1 tasks then its LINEAR2 tasks: s(n1+n2) + (u-s)n1 + nb and
    s(n1+n2) + z n1 + (u-s)n2 + nb.
  - interleaved: segment w-1 alternates LINEAR1 item j of wave w with LINEAR2 item j of wave w-1;
    an item j of a list sits at 2j (+1 for LINEAR2) while the other list has an item j, else at
    j + the other list's length.
  - lag:k: A = min(k+1, U) n1 LINEAR1 tasks first, then LINEAR2(i) and LINEAR1(i+k+1): LINEAR2(i, nb)
    at A + i n2 + min(i, U-k-1) n1 + nb.
- Hoisting (`hoist_dispatch`): DISPATCH(u) goes to pos(u) = max(0, first_LINEAR1(u) - lead), and with
  a bounded pool after last_LINEAR2(u - pool) + 1. pos is nondecreasing in u, so DISPATCH(u) lands at
  pos(u) + u and a task at rest index i at i + #{u : pos(u) <= i} (a binary search over pos).
- Waves (`_waves`): a new wave at an expert boundary once the wave holds >= 2 num_ctas LINEAR1
  tasks, and whenever it holds the pool's cap (pool//2 units for expert_wave, pool//3 interleaved).
  One loop over experts carries (wave, fill); each unit's wave follows from its expert's entry.
- Layout: a stable counting sort. Each program takes a contiguous range of the flattened routing
  `[R, T, K]`, ranks its entries per expert block by block (a [BE, BE] comparison within the block,
  plus the program's running count per expert), and publishes its per-expert counts; a row then
  lands at expert start + the counts of earlier programs + its rank.

Phases of `moe_plan_kernel` (G programs, G <= SMs, all co-resident): (1) rank the routing; (2) every
program reduces the G count rows itself (no extra barrier), units per expert, the wave loop, unit_info,
rows; (3) per unit: pos(u), its DISPATCH row; (4) per LINEAR task: its row. Between phases a grid
barrier (an arrival counter, bounded by the buffer's watchdog): 3 for expert_wave and interleaved,
2 for lag:k (its phase 3 needs nothing another program wrote in phase 2). In Triton's interpreter
(programs run one after another) the phases are separate launches instead.

Cost model (device time of the prologue):
  launch + phase 1: R T K / (G BE) blocks of a [BE, BE] comparison and two barriers each
  + one barrier per phase boundary (an atomic round trip through L2 and polling)
  + phase 2: G x E_local count words read by every program, and for expert_wave / interleaved a
    dependent scalar loop of E_local iterations (the one sequential step), + units_cap / G unit slots
  + phase 3: U / G units, a few gathers each
  + phase 4: U (n1 + n2) / G tasks, each log2(units_cap) dependent gathers of the binary search.
No term grows with the kernel's GEMM work; the per-token terms are spread over G programs, and the
wave loop is bounded by E_local. Outputs live in buffers allocated once per MoE buffer (units_cap
units, units_cap (1 + n1 + n2) task rows), so a call launches no allocation and can be captured in
a CUDA graph; the real tasks come first, the rows after them are left as they were.
Measured on the H200: `benchmarks/results/h200-moe-prologue/` (17.9 us at 1 token, 26.6 at 1024,
76.0 at 16384 with Qwen3 widths).
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.comm.device import globaltimer

EXPERT_WAVE, INTERLEAVED, LAG = 0, 1, 2
_ORDER_CODE = {"expert_wave": EXPERT_WAVE, "interleaved": INTERLEAVED, "lag": LAG}
# "No cap" for the wave split: above any unit count (rows_cap, hence units, is below 2**31 / 16).
_NO_CAP = tl.constexpr(1 << 30)
_PE_ROWS = 8  # per-program rows: ustart, uend, offset, counts, schedule units, wave, fill, [U]
_UNIT_COLS = 10  # expert, m block, rows, wave, then the rest-order parameters (b1, j1, c1, b2, j2, a2)
# Entries per ranking block ([BE, BE] comparisons). On the H200 (Qwen3 widths, 132 programs) the whole
# prologue took 26.6 us at BE=32 against 30.0 at 64 with 1024 tokens, 76 against 135 us with 16384.
_BE, _BT, _BC = 32, 128, 256
_WB = 8  # experts per step of the uncapped wave split


@triton.jit
def _grid_barrier(p_bar, target, p_err, p_failed, code, timeout_ns, max_spins, USE_PTX: tl.constexpr):
    """Arrive, then wait until `target` arrivals: a progress watchdog like `kernels.wait_geq`, but it
    does not give up on an error word set by an earlier call (the plan must be whole); a timeout
    records `code` and marks this launch failed (its plan is then emptied)."""
    tl.debug_barrier()
    tl.atomic_add(p_bar, 1, sem="release", scope="gpu")
    v = tl.atomic_add(p_bar, 0, sem="acquire", scope="gpu")
    t_moved = globaltimer(USE_PTX)
    elapsed = t_moved - t_moved
    last = v
    spins = 0
    while (v < target) & (elapsed < timeout_ns) & (spins < max_spins):
        v = tl.atomic_add(p_bar, 0, sem="acquire", scope="gpu")
        spins += 1
        if v != last:
            spins = 0
            if USE_PTX:
                t_moved = globaltimer(USE_PTX)
        last = v
        if USE_PTX:
            elapsed = globaltimer(USE_PTX) - t_moved
    if v < target:
        tl.atomic_cas(p_err, 0, code)
        tl.atomic_add(p_err + 1, 1)
        tl.atomic_xchg(p_failed, 1)
    tl.debug_barrier()


@triton.jit
def _route(p_idx, p_idx_delta, o, m, rank, T, K, E, EL, LOOPBACK: tl.constexpr):
    """(local expert, whether it is this rank's) of flat routing entries `o = (source T + token) K +
    slot`. Loopback synthesises source s as the own routing shifted by s E_local modulo E
    (`fused._all_topk`); otherwise source s's rows are at `p_idx + delta[s]`. Ids outside [0, E) are
    never this rank's, in any source (memory-safe without the host's range check)."""
    s = o // (T * K)
    tk = o - s * (T * K)
    if LOOPBACK:
        raw = tl.load(p_idx + tk, mask=m, other=-1).to(tl.int64)
    else:
        d = tl.load(p_idx_delta + s, mask=m, other=0)
        raw = tl.load(p_idx + d + tk, mask=m, other=-1).to(tl.int64)
    ok = (raw >= 0) & (raw < E)
    v = tl.where(ok, raw, 0).to(tl.int32)
    if LOOPBACK:
        # s E_local < E, so one subtraction is the modulo (an int64 modulo per entry cost more than
        # the rest of the ranking).
        v += s * EL
        v = tl.where(v >= E, v - E, v)
    mine = m & ok & (v >= rank * EL) & (v < (rank + 1) * EL)
    return tl.where(mine, v - rank * EL, 0), mine


@triton.jit
def _count_le(p_arr, n, x, m, TOP: tl.constexpr, STEPS: tl.constexpr, CACHE: tl.constexpr):
    """#{i < n : arr[i] <= x} per lane, for a nondecreasing `arr` and n <= 2 TOP - 1."""
    cnt = x * 0
    for b in tl.static_range(STEPS):
        nxt = cnt + (TOP >> b)
        ok = m & (nxt <= n)
        v = tl.load(p_arr + nxt - 1, mask=ok, other=0, cache_modifier=CACHE)
        cnt = tl.where(ok & (v <= x), nxt, cnt)
    return cnt


@triton.jit
def _unit_params(u, m, p_unit, p_ws, U, n1, n2, lag_k, ORDER: tl.constexpr, UC: tl.constexpr):
    """The rest-order parameters of units `u` (see `_l1_pos`, `_l2_pos`): LINEAR1(u, nb) sits at
    b1 + f(j1 + nb, c1) and LINEAR2(u, nb) at b2 + f'(j2 + nb, a2), where f(j, c) = 2j if j < c else
    c + j and f'(j, a) = 2j + 1 if j < a else a + j (the one-for-one merge of `interleaved`; c = a = 0
    for the orders that do not merge)."""
    zero = u * 0
    if ORDER == 2:
        a = tl.minimum(lag_k + 1, U) * n1
        b1 = tl.where(u <= lag_k, u * n1, a + (u - lag_k) * n2 + (u - lag_k - 1) * n1)
        b2 = a + u * n2 + tl.minimum(u, tl.maximum(U - lag_k - 1, 0)) * n1
        return b1, zero, zero, b2, zero, zero
    # Written by other programs in this launch: read past the SM's L1 (".cg"), which is not coherent.
    w = tl.load(p_unit + u.to(tl.int64) * UC + 3, mask=m, other=0, cache_modifier=".cg")
    s = tl.load(p_ws + w, mask=m, other=0, cache_modifier=".cg")
    en = tl.load(p_ws + w + 1, mask=m, other=0, cache_modifier=".cg")
    if ORDER == 0:
        b1 = s * (n1 + n2) + (u - s) * n1
        b2 = s * (n1 + n2) + (en - s) * n1 + (u - s) * n2
        return b1, zero, zero, b2, zero, zero
    sp = tl.load(p_ws + w - 1, mask=m & (w >= 1), other=0, cache_modifier=".cg")
    zn = tl.load(p_ws + w + 2, mask=m, other=0, cache_modifier=".cg") - en
    w0 = w == 0
    b1 = tl.where(w0, u * n1, s * n1 + sp * n2)
    j1 = tl.where(w0, 0, (u - s) * n1)
    c1 = tl.where(w0, 0, (s - sp) * n2)
    return b1, j1, c1, en * n1 + s * n2, (u - s) * n2, zn * n1


@triton.jit
def _l1_pos(b1, j1, c1, nb):
    j = j1 + nb
    return b1 + tl.where(j < c1, 2 * j, c1 + j)


@triton.jit
def _l2_pos(b2, j2, a2, nb):
    j = j2 + nb
    return b2 + tl.where(j < a2, 2 * j + 1, a2 + j)


@triton.jit
def _write_rows(p_tasks, g, m, kind, u, nb, e, mb, wait, rows, N, C, RR: tl.constexpr, TC: tl.constexpr):
    """Task rows (columns of `schedule.COLUMNS`) at global positions `g`: row g of the global order,
    or with RR its place in CTA g % C's list (`cta_start[c] = c (N // C) + min(c, N % C)`)."""
    if RR:
        c = g % C
        row = c * (N // C) + tl.minimum(c, N % C) + g // C
    else:
        row = g
    p = p_tasks + row.to(tl.int64) * TC
    tl.store(p, kind, mask=m)
    tl.store(p + 1, u, mask=m)
    tl.store(p + 2, nb, mask=m)
    tl.store(p + 3, e, mask=m)
    tl.store(p + 4, mb, mask=m)
    tl.store(p + 5, wait, mask=m)
    tl.store(p + 6, g, mask=m)
    tl.store(p + 7, rows, mask=m)


@triton.jit(do_not_specialize=["rank", "R", "T", "T_STRIDE", "K", "E", "EL", "units_cap", "pool_units", "n1", "n2",
                               "C", "lead", "lag_k", "code"])
def moe_plan_kernel(
    p_idx, p_idx_delta, p_tasks, p_cta_start, p_units, p_row_src, p_row_slot, p_counts, p_num_units,
    p_hist, p_pe, p_rank, p_unit, p_ws, p_pos, p_bar, p_err,
    rank, R, T, T_STRIDE, K, E, EL, units_cap, pool_units, n1, n2, C, lead, lag_k, timeout_ns, max_spins, code,
    BM: tl.constexpr, ORDER: tl.constexpr, RR: tl.constexpr, LOOPBACK: tl.constexpr, FIRST: tl.constexpr,
    LAST: tl.constexpr, WAIT: tl.constexpr, USE_PTX: tl.constexpr, ELP: tl.constexpr, LOG_E: tl.constexpr,
    UTOP: tl.constexpr, LOG_U: tl.constexpr, BE: tl.constexpr, BU: tl.constexpr, BT: tl.constexpr,
    GB: tl.constexpr, BC: tl.constexpr, TC: tl.constexpr, PE: tl.constexpr, UC: tl.constexpr,
    WB: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    o_e = tl.arange(0, ELP)
    m_e = o_e < EL
    p_me = p_pe + pid * (PE * ELP)  # this program's rows (see _PE_ROWS)
    p_h = p_hist + pid * ELP
    o_be = tl.arange(0, BE)
    o_bu = tl.arange(0, BU)
    n_ent = R * T * K
    # Contiguous entry ranges keep the sort stable: earlier programs hold earlier (source, token, slot).
    span = tl.cdiv(tl.cdiv(n_ent, G), BE) * BE
    e_lo = pid * span
    e_hi = tl.minimum(e_lo + span, n_ent)
    if FIRST <= 1:
        # (1) Rank each entry among this program's entries of its expert; count them per expert. Per
        # block of BE entries: an entry's rank among the block's earlier entries of its expert (a
        # [BE, BE] comparison), plus the program's running count of that expert, kept in its `hist`
        # row; the block's last entry of each expert then advances that count (one writer per expert).
        # Cost per block: BE^2 comparisons, independent of E_local (a one-hot [BE, E_local] prefix sum
        # took about 17 us per block on the H200).
        tl.store(p_h + o_e, tl.zeros([ELP], tl.int32))
        tl.debug_barrier()
        for c0 in range(e_lo, e_hi, BE):
            o = c0 + o_be
            key, mine = _route(p_idx, p_idx_delta, o, o < e_hi, rank, T, K, E, EL, LOOPBACK)
            same = (key[:, None] == key[None, :]) & mine[:, None] & mine[None, :]  # [BE, BE]
            before = tl.sum((same & (o_be[None, :] < o_be[:, None])).to(tl.int32), axis=1)
            after = tl.sum((same & (o_be[None, :] > o_be[:, None])).to(tl.int32), axis=1)
            r = tl.load(p_h + key, mask=mine, other=0) + before
            tl.store(p_rank + o, r, mask=mine)
            tl.debug_barrier()  # every count is read before any is advanced
            tl.store(p_h + key, r + 1, mask=mine & (after == 0))
            tl.debug_barrier()
        if WAIT and LAST >= 2:
            _grid_barrier(p_bar, G, p_err, p_bar + 2, code, timeout_ns, max_spins, USE_PTX)
    if FIRST <= 2 and LAST >= 2:
        # (2) Every program reduces the count rows itself: a barrier costs more than G x E_local loads.
        counts = tl.zeros([ELP], tl.int32)
        off = tl.zeros([ELP], tl.int32)
        for p0 in range(0, G, GB):
            o_p = p0 + tl.arange(0, GB)
            h = tl.load(p_hist + o_p[:, None] * ELP + o_e[None, :], mask=(o_p < G)[:, None] & m_e[None, :],
                        other=0, cache_modifier=".cg")  # [GB, ELP], other programs' rows
            counts += tl.sum(h, axis=0)
            off += tl.sum(tl.where((o_p < pid)[:, None], h, 0), axis=0)
        n_u = (counts + BM - 1) // BM
        U = tl.sum(n_u, axis=0)
        uend = tl.cumsum(n_u, axis=0)
        # The host schedules one empty unit of expert 0 when no row arrives (`experts or [0]`).
        U_s = tl.maximum(U, 1)
        n_s = tl.where((o_e == 0) & (U == 0), 1, n_u)
        tl.store(p_me + o_e, uend - n_u)
        tl.store(p_me + ELP + o_e, uend)
        tl.store(p_me + 2 * ELP + o_e, off)
        tl.store(p_me + 3 * ELP + o_e, counts)
        tl.store(p_me + 4 * ELP + o_e, n_s)
        tl.store(p_me + 7 * ELP, U)
        N = U_s * (1 + n1 + n2)
        if pid == 0:
            tl.store(p_counts + o_e, counts.to(tl.int64), mask=m_e)
            tl.store(p_num_units, U.to(tl.int64))
            for c0 in range(0, C + 1, BC):
                o_c = c0 + tl.arange(0, BC)
                tl.store(p_cta_start + o_c, o_c * (N // C) + tl.minimum(o_c, N % C), mask=o_c <= C)
        pooled = pool_units < U_s
        if ORDER == 0:
            cap = tl.maximum(pool_units // 2, 1)
        else:
            cap = tl.maximum(pool_units // 3, 1)
        mu = tl.where(pooled, cap, _NO_CAP)
        tl.debug_barrier()
        if ORDER != 2:
            # The one sequential step, over experts: (wave, fill) as `schedule._waves` carries them.
            cur = U * 0
            w = U * 0
            if pooled:
                for i_e in range(0, EL):
                    n_e = tl.load(p_me + 4 * ELP + i_e)
                    has = n_e > 0
                    reset = has & ((cur >= mu) | (cur.to(tl.int64) * n1 >= 2 * C))
                    w += reset.to(tl.int32)
                    cur = tl.where(reset, 0, cur)
                    tl.store(p_me + 5 * ELP + i_e, w)
                    tl.store(p_me + 6 * ELP + i_e, cur)
                    last_u = cur + n_e - 1
                    w = tl.where(has, w + last_u // mu, w)
                    cur = tl.where(has, last_u % mu + 1, cur)
            else:
                # No cap: the chain is a compare, a select and an add per expert (no division), with
                # WB experts' loads ahead of it and the outputs kept in registers until the end.
                thr = (2 * C + n1 - 1) // n1  # cur n1 >= 2 C, for n1 >= 1
                w_v = tl.zeros([ELP], tl.int32)
                c_v = tl.zeros([ELP], tl.int32)
                for i0 in range(0, EL, WB):
                    for j in tl.static_range(WB):
                        n_e = tl.load(p_me + 4 * ELP + i0 + j, mask=i0 + j < EL, other=0)
                        reset = (n_e > 0) & (cur >= thr)
                        w += reset.to(tl.int32)
                        cur = tl.where(reset, 0, cur) + n_e
                        w_v = tl.where(o_e == i0 + j, w, w_v)
                        c_v = tl.where(o_e == i0 + j, cur - n_e, c_v)
                tl.store(p_me + 5 * ELP + o_e, w_v)
                tl.store(p_me + 6 * ELP + o_e, c_v)
            tl.debug_barrier()
        o_bm = tl.arange(0, BM)
        for u0 in range(pid * BU, units_cap, G * BU):
            u = u0 + o_bu
            m_u = u < units_cap
            e_u = _count_le(p_me + ELP, EL, u, m_u, ELP, LOG_E + 1, "")  # searchsorted(uend, u, right=True)
            ec = tl.minimum(e_u, EL - 1)
            mb = u - tl.load(p_me + ec, mask=m_u, other=0)
            cnt = tl.load(p_me + 3 * ELP + ec, mask=m_u, other=0)
            rows = tl.where(e_u < EL, tl.minimum(tl.maximum(cnt - mb * BM, 0), BM), 0)
            p_ui = p_units + u.to(tl.int64) * 4
            tl.store(p_ui, ec, mask=m_u)
            tl.store(p_ui + 1, u * BM, mask=m_u)
            tl.store(p_ui + 2, rows, mask=m_u)
            tl.store(p_ui + 3, (u % pool_units) * BM, mask=m_u)
            # Rows of a scheduled unit past its valid rows are padding (rows of later slots are never read).
            o_r = u.to(tl.int64)[:, None] * BM + o_bm[None, :]  # [BU, BM]
            m_pad = (m_u & (u < U_s))[:, None] & (o_bm[None, :] >= rows[:, None])
            tl.store(p_row_src + o_r, tl.full([BU, BM], -1, tl.int32), mask=m_pad)
            tl.store(p_row_slot + o_r, tl.zeros([BU, BM], tl.int32), mask=m_pad)
            m_s = u < U_s
            e_s = tl.where(U > 0, ec, 0)
            mb_s = tl.where(U > 0, mb, 0)
            p_un = p_unit + u.to(tl.int64) * UC
            tl.store(p_un, e_s, mask=m_s)
            tl.store(p_un + 1, mb_s, mask=m_s)
            tl.store(p_un + 2, rows, mask=m_s)
            if ORDER != 2:
                fill = tl.load(p_me + 6 * ELP + e_s, mask=m_s, other=0) + mb_s
                wave = tl.load(p_me + 5 * ELP + e_s, mask=m_s, other=0) + fill // mu
                tl.store(p_un + 3, wave, mask=m_s)
                tl.store(p_ws + wave, u, mask=m_s & (fill % mu == 0))
                m_last = m_s & (u == U_s - 1)  # the wave after the last ends there too
                tl.store(p_ws + wave + 1, u * 0 + U_s, mask=m_last)
                tl.store(p_ws + wave + 2, u * 0 + U_s, mask=m_last)
        for c0 in range(e_lo, e_hi, BE):
            o = c0 + o_be
            key, mine = _route(p_idx, p_idx_delta, o, o < e_hi, rank, T, K, E, EL, LOOPBACK)
            r = tl.load(p_rank + o, mask=mine, other=0)
            dest = (tl.load(p_me + key, mask=mine, other=0) * BM + tl.load(p_me + 2 * ELP + key, mask=mine, other=0)
                    + r)
            mine = mine & (dest < units_cap * BM)
            s = o // (T * K)
            tk = o - s * (T * K)
            tl.store(p_row_src + dest, s * T_STRIDE + tk // K, mask=mine)
            tl.store(p_row_slot + dest, tk % K, mask=mine)
        if WAIT and LAST >= 3 and ORDER != 2:
            _grid_barrier(p_bar, 2 * G, p_err, p_bar + 2, code, timeout_ns, max_spins, USE_PTX)
    if FIRST <= 3 and LAST >= 3:
        # (3) pos(u) of every unit (hoisted dispatch) and the DISPATCH rows. lag:k has no grid barrier
        # before this phase: this CTA's own phase-2 stores must still be visible to all its threads.
        tl.debug_barrier()
        U_s = tl.maximum(tl.load(p_me + 7 * ELP), 1)
        N = U_s * (1 + n1 + n2)
        for u0 in range(pid * BU, U_s, G * BU):
            u = u0 + o_bu
            m = u < U_s
            b1, j1, c1, b2, j2, a2 = _unit_params(u, m, p_unit, p_ws, U_s, n1, n2, lag_k, ORDER, UC)
            pos = tl.maximum(_l1_pos(b1, j1, c1, 0) - lead, 0)
            if pool_units < U_s:
                # Unit u reuses the slot of unit u - pool: its dispatch follows that unit's last LINEAR2.
                v = u - pool_units
                m_v = m & (v >= 0)
                q1, qj1, qc1, q2, qj2, qa2 = _unit_params(tl.maximum(v, 0), m_v, p_unit, p_ws, U_s, n1, n2, lag_k,
                                                          ORDER, UC)
                pos = tl.where(m_v, tl.maximum(pos, _l2_pos(q2, qj2, qa2, n2 - 1) + 1), pos)
            p_un = p_unit + u.to(tl.int64) * UC
            tl.store(p_pos + u, pos, mask=m)
            tl.store(p_un + 4, b1, mask=m)
            tl.store(p_un + 5, j1, mask=m)
            tl.store(p_un + 6, c1, mask=m)
            tl.store(p_un + 7, b2, mask=m)
            tl.store(p_un + 8, j2, mask=m)
            tl.store(p_un + 9, a2, mask=m)
            e = tl.load(p_un, mask=m, other=0)
            mb = tl.load(p_un + 1, mask=m, other=0)
            zero = u * 0
            _write_rows(p_tasks, pos + u, m, zero, u, zero, e, mb, zero, zero, N, C, RR, TC)
        if WAIT and LAST >= 4:
            if ORDER == 2:
                _grid_barrier(p_bar, 2 * G, p_err, p_bar + 2, code, timeout_ns, max_spins, USE_PTX)
            else:
                _grid_barrier(p_bar, 3 * G, p_err, p_bar + 2, code, timeout_ns, max_spins, USE_PTX)
    if FIRST <= 4 and LAST >= 4:
        # (4) LINEAR tasks: rest index i from the closed form, + the dispatches at or before i.
        U_s = tl.maximum(tl.load(p_me + 7 * ELP), 1)
        N = U_s * (1 + n1 + n2)
        nr = n1 + n2
        o_bt = tl.arange(0, BT)
        # (Names differ from phase 3's: a loop may not change a variable's shape, and BT != BU.)
        for q0 in range(pid * BT, U_s * nr, G * BT):
            q = q0 + o_bt
            m_q = q < U_s * nr
            u_q = q // nr
            j_q = q - u_q * nr
            is1 = j_q < n1
            nb_q = tl.where(is1, j_q, j_q - n1)
            p_uq = p_unit + u_q.to(tl.int64) * UC
            i1 = _l1_pos(tl.load(p_uq + 4, mask=m_q, other=0, cache_modifier=".cg"),
                         tl.load(p_uq + 5, mask=m_q, other=0, cache_modifier=".cg"),
                         tl.load(p_uq + 6, mask=m_q, other=0, cache_modifier=".cg"), nb_q)
            i2 = _l2_pos(tl.load(p_uq + 7, mask=m_q, other=0, cache_modifier=".cg"),
                         tl.load(p_uq + 8, mask=m_q, other=0, cache_modifier=".cg"),
                         tl.load(p_uq + 9, mask=m_q, other=0, cache_modifier=".cg"), nb_q)
            i_q = tl.where(is1, i1, i2)
            g_q = i_q + _count_le(p_pos, U_s, i_q, m_q, UTOP, LOG_U + 1, ".cg")
            rows_q = tl.load(p_uq + 2, mask=m_q & ~is1, other=0, cache_modifier=".cg")
            _write_rows(p_tasks, g_q, m_q, tl.where(is1, 1, 2), u_q, nb_q,
                        tl.load(p_uq, mask=m_q, other=0, cache_modifier=".cg"),
                        tl.load(p_uq + 1, mask=m_q, other=0, cache_modifier=".cg"), tl.where(is1, 1, 1 + n1), rows_q,
                        N, C, RR, TC)
        tl.debug_barrier()
        done = tl.atomic_add(p_bar + 1, 1, sem="acq_rel", scope="gpu")
        if done == G - 1:
            # Every program is done: a launch whose barrier timed out leaves no task to run.
            if tl.atomic_add(p_bar + 2, 0) != 0:
                for c0 in range(0, C + 1, BC):
                    o_c = c0 + tl.arange(0, BC)
                    tl.store(p_cta_start + o_c, tl.zeros([BC], tl.int32), mask=o_c <= C)
            tl.atomic_xchg(p_bar, 0)
            tl.atomic_xchg(p_bar + 1, 0)
            tl.atomic_xchg(p_bar + 2, 0)
