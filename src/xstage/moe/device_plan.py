"""The plan of a fused MoE call built on the device: the routing layout and task table of every
built-in order from `topk_idx`, in one launch of `xstage.moe.plan_kernel.moe_plan_kernel` (its module
docstring gives the algorithm and its cost), with no host synchronisation; the outputs live in buffers
allocated once per MoE buffer, so a call can be captured in a CUDA graph.

A custom order (`register_schedule(name, fn)`) has no device form: `device_plan` builds it on the
host (`fused.plan`), which synchronises and cannot be captured. An order that cannot run in the row
pool is refused on the host before any launch, for the buffer's largest unit count (`units_cap`),
with the host planner's `PoolTooSmallError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from xstage.backend import Launch
from xstage.comm.device import wait_bounds
from xstage.env import interpreter_active
from xstage.moe.buffer import MoEBuffer
from xstage.moe.fused import _resolve_schedule, call_pacing, num_ctas, plan
from xstage.moe.layout import RoutingLayout
from xstage.moe.plan_kernel import _BC, _BE, _BT, _ORDER_CODE, _PE_ROWS, _UNIT_COLS, _WB, moe_plan_kernel
from xstage.spec.pacing import StorePacing
from xstage.spec.schedule import TASK_COLS, builtin_order, pool_too_small
from xstage.spec.stages import STAGE_PLAN_BARRIER

_CPU_PROGRAMS = 4  # scratch rows for the interpreter, where tests run up to this many programs


@dataclass(frozen=True)
class DeviceSchedule:
    """What the launchers read of a schedule built on the device. Its task count lives in device memory
    (`cta_start[num_ctas]`), so `num_tasks` is None: tracing (`launch_main(trace=...)`) needs the host
    plan."""

    name: str
    num_ctas: int
    n1: int
    n2: int
    num_tasks: None = None


@dataclass
class DevicePlan:
    """A plan built on the device; read by `fused.launch` like the host's `_Plan`. Its tensors are the
    MoE buffer's own (overwritten by the next device plan of that buffer)."""

    layout: RoutingLayout
    schedule: DeviceSchedule
    tasks: torch.Tensor
    cta_start: torch.Tensor
    pacing: StorePacing | None


def _on_gpu(buf: MoEBuffer) -> bool:
    return buf.device.type == "cuda" and not interpreter_active()


class _Scratch:
    """The device plan's outputs and working memory, allocated once per MoE buffer: a call allocates
    nothing (CUDA-graph capture)."""

    def __init__(self, buf: MoEBuffer):
        dev, c = buf.device, buf.cfg
        i32 = dict(dtype=torch.int32, device=dev)
        self.n1, self.n2 = buf.I // c.block_n1, triton.cdiv(buf.H, c.block_n2)
        self.elp = triton.next_power_of_2(buf.E_local)
        self.programs_max = (torch.cuda.get_device_properties(dev).multi_processor_count if _on_gpu(buf)
                             else _CPU_PROGRAMS)
        # Task rows past the call's tasks are never read (the kernel stops at cta_start[num_ctas]).
        self.tasks = torch.zeros(buf.units_cap * (1 + self.n1 + self.n2), TASK_COLS, **i32)
        self.layout = RoutingLayout(torch.zeros(buf.units_cap, 4, **i32), torch.full((buf.rows_cap,), -1, **i32),
                                    torch.zeros(buf.rows_cap, **i32),
                                    torch.zeros(buf.E_local, dtype=torch.int64, device=dev),
                                    torch.zeros(1, dtype=torch.int64, device=dev)[0])
        self.hist = torch.zeros(self.programs_max, self.elp, **i32)
        self.pe = torch.zeros(self.programs_max, _PE_ROWS, self.elp, **i32)
        self.rank = torch.zeros(max(1, buf.R * buf.T_max * buf.K), **i32)
        self.unit = torch.zeros(buf.units_cap, _UNIT_COLS, **i32)
        self.ws = torch.zeros(buf.units_cap + 2, **i32)
        self.pos = torch.zeros(buf.units_cap, **i32)
        self.bar = torch.zeros(4, **i32)  # arrivals, exits, this launch timed out
        if buf.loopback:
            self.idx_delta = torch.zeros(buf.R, dtype=torch.int64, device=dev)
        else:  # each peer's routing (symmetric memory, mapped here) relative to this rank's own copy
            base = buf.idx_buf.data_ptr()
            self.idx_delta = torch.tensor([(p.data_ptr() - base) // buf.idx_buf.element_size() for p in buf.idx_peers],
                                          dtype=torch.int64, device=dev)
        self.cta_starts = {num_ctas(buf): torch.zeros(num_ctas(buf) + 1, **i32)}

    def cta_start(self, ctas: int) -> torch.Tensor:
        if ctas not in self.cta_starts:  # other CTA counts than the buffer's: tests, or a forced grid
            self.cta_starts[ctas] = torch.zeros(ctas + 1, dtype=torch.int32, device=self.tasks.device)
        return self.cta_starts[ctas]


def _scratch(buf: MoEBuffer) -> _Scratch:
    key = ("device_plan",)
    if key not in buf._plans:
        buf._plans[key] = _Scratch(buf)
    return buf._plans[key]


def pool_needed(name: str) -> int:
    """The smallest row pool (in units) in which the built-in order `name` runs every routing that has
    more units than the pool (`make_schedule` refuses it in a smaller one, whatever the routing).

    With a pool of P units, unit u takes unit u - P's slot. `lag:k` runs LINEAR1 of units 0..k before
    any LINEAR2, so it needs P >= k + 1; `interleaved` (waves of max(1, P // 3) units, LINEAR1 of wave
    w + 1 beside LINEAR2 of wave w) needs P >= 2; `expert_wave` (waves of max(1, P // 2) units) runs in
    any pool."""
    base, k = builtin_order(name)
    return k + 1 if base == "lag" else 2 if base == "interleaved" else 1


def check_pool_fits(name: str, buf: MoEBuffer) -> None:
    """Refuse a built-in order that some routing could not run in the buffer's row pool, before any
    launch: the device plan reads no count back, so the largest unit count (`units_cap`) decides. The
    first unit that would wait is unit P, for unit 0: the error is the host planner's, word for word."""
    pool = buf.pool_units
    if builtin_order(name) is not None and pool < buf.units_cap and pool < pool_needed(name):
        raise pool_too_small(name, pool, pool)


def plan_tables(idx, idx_delta, rows_per_source: int, rank: int, buf: MoEBuffer, schedule: str, ctas: int,
                pacing: StorePacing | None = None, loopback: bool = True, programs: int | None = None,
                compile_only: bool = False) -> DevicePlan | None:
    """Launch the prologue for a built-in order `schedule` (checked against the pool by the caller).

    Routing of source s, token t, slot k: `loopback`: `idx[t, k]` shifted by s E_local (the loopback
    group's synthesised peers); else `idx.view(-1)[idx_delta[s] + t K + k]` (a real group: `idx` is
    this rank's symmetric routing buffer, the deltas reach the peers' copies). `rows_per_source`
    tokens per source; `programs` overrides the grid (at most the SMs; tests use it in the
    interpreter, where the phases then run as separate launches). `compile_only`: compile the GPU
    launch (or load it from Triton's cache) without running it."""
    if programs is None and not compile_only:
        launch, made, programs = _steady_site(idx, idx_delta, rows_per_source, rank, buf, schedule, ctas, pacing,
                                              loopback)
        launch((programs,), idx, rows_per_source)
        return made
    base, k = builtin_order(schedule)
    st, on_gpu = _scratch(buf), _on_gpu(buf)
    programs = max(1, min(int(programs or 1), st.programs_max))
    args, consts = _prologue_args(idx, idx_delta, rows_per_source, rank, buf, base, k, ctas, loopback, on_gpu)
    if compile_only:
        moe_plan_kernel.warmup(*args, grid=(programs,), FIRST=1, LAST=4, WAIT=on_gpu, **consts)
        return None
    if on_gpu or programs == 1:  # (one program runs every phase)
        moe_plan_kernel[(programs,)](*args, FIRST=1, LAST=4, WAIT=on_gpu, **consts)
    else:
        # The interpreter runs programs in turn, so a grid barrier could never open: phase by phase.
        for phase in range(1, 5):
            moe_plan_kernel[(programs,)](*args, FIRST=phase, LAST=phase, WAIT=False, **consts)
    return DevicePlan(st.layout, DeviceSchedule(schedule, ctas, st.n1, st.n2), st.tasks, st.cta_start(ctas), pacing)


def _steady_site(idx, idx_delta, rows_per_source: int, rank: int, buf: MoEBuffer, schedule: str, ctas: int,
                 pacing: StorePacing | None, loopback: bool) -> tuple:
    """(launch object, plan, grid size) of a steady call's prologue: one launch object and one plan per
    order, grid size and routing source; only the routing and its token count change from call to call
    (`backend.Launch`)."""
    base, k = builtin_order(schedule)
    st, c = _scratch(buf), buf.cfg
    on_gpu = _on_gpu(buf)
    key = ("prologue launch", base, k, ctas, loopback, rank, buf.timeout_ns, idx_delta.data_ptr(), pacing)
    site = buf._plans.get(key)
    if site is None:
        args, consts = _prologue_args(idx, idx_delta, rows_per_source, rank, buf, base, k, ctas, loopback, on_gpu)
        launch = Launch(moe_plan_kernel, args, dict(consts, FIRST=1, LAST=4, WAIT=on_gpu), holes=(0, _ROWS_ARG))
        made = DevicePlan(st.layout, DeviceSchedule(schedule, ctas, st.n1, st.n2), st.tasks, st.cta_start(ctas), pacing)
        site = buf._plans[key] = (launch, made)
    programs = 1  # the interpreter's one program runs the phases in turn
    if on_gpu:
        # Enough programs for the entries and for the tasks the largest routing of this call makes.
        # Plain integer arithmetic: triton.cdiv is a constexpr function, microseconds a call on the host.
        n_ent = buf.R * rows_per_source * buf.K
        units = min(buf.units_cap, -(-n_ent // c.block_m) + buf.E_local)
        programs = min(max(1, -(-n_ent // _BE), -(-units * (st.n1 + st.n2) // _BT)), st.programs_max)
    return (*site, programs)


_ROWS_ARG = 19  # the position of `rows_per_source` in `_prologue_args`


def _prologue_args(idx, idx_delta, rows_per_source: int, rank: int, buf: MoEBuffer, base: str, k: int, ctas: int,
                   loopback: bool, on_gpu: bool) -> tuple[tuple, dict]:
    """The prologue's arguments and constants (`plan_tables`), but for the phases and `WAIT`."""
    st, c, lay = _scratch(buf), buf.cfg, _scratch(buf).layout
    utop = 1 << max(0, buf.units_cap - 1).bit_length()  # next power of two
    use_ptx, timeout_ns, max_spins = wait_bounds(buf.timeout_ns, on_gpu)
    args = (idx, idx_delta, st.tasks, st.cta_start(ctas), lay.unit_info, lay.row_src, lay.row_slot, lay.counts,
            lay.num_units, st.hist, st.pe, st.rank, st.unit, st.ws, st.pos, st.bar, buf.err,
            rank, buf.R, rows_per_source, buf.T_max, buf.K, buf.E, buf.E_local, buf.units_cap, buf.pool_units,
            st.n1, st.n2, ctas, 2 * ctas, min(k, buf.units_cap), timeout_ns, max_spins,
            STAGE_PLAN_BARRIER * 65536 + rank)
    assert args[_ROWS_ARG] is rows_per_source
    consts = dict(BM=c.block_m, ORDER=_ORDER_CODE[base], RR=not c.dynamic, LOOPBACK=loopback, USE_PTX=use_ptx,
                  ELP=st.elp, LOG_E=st.elp.bit_length() - 1, UTOP=utop, LOG_U=utop.bit_length() - 1,
                  BE=_BE, BU=min(64, 4096 // c.block_m), BT=_BT,
                  GB=max(1, min(1 << max(0, st.programs_max - 1).bit_length(), 8192 // st.elp)), BC=_BC, TC=TASK_COLS,
                  PE=_PE_ROWS, UC=_UNIT_COLS, WB=_WB, **({"num_warps": 4} if on_gpu else {}))
    return args, consts


def device_plan(topk_idx, buf: MoEBuffer, schedule: str, ctas: int | None = None, pacing="buffer",
                programs: int | None = None):
    """The plan of `fused.plan`, built on the device (one launch, no host synchronisation) for the
    built-in orders; a custom order is planned on the host (`fused.plan`, not capturable). An order
    that some routing could not run in the row pool raises `PoolTooSmallError` first
    (`check_pool_fits`). On a real group the peers' routing is read from their symmetric copies,
    written before the call's barrier (`fused_moe`)."""
    tokens = int(topk_idx.shape[0])
    # A steady call (the same request at a token count seen before) reuses what the first one resolved:
    # the pacing, the order, the pool check and the prologue's launch (`MoEBuffer._steady`, cleared when
    # a decision is forced or cleared).
    key = (schedule, pacing, tokens) if (ctas is None and programs is None and isinstance(schedule, str)
                                         and (pacing is None or isinstance(pacing, (str, StorePacing)))) else None
    hit = buf._steady.get(key) if key is not None else None
    if hit is None:
        ctas = ctas or num_ctas(buf)
        pacing = call_pacing(pacing, buf, tokens, ctas, schedule)
        schedule = _resolve_schedule(schedule, buf, tokens, ctas, pacing)
        if builtin_order(schedule) is None:
            return plan(topk_idx, buf, schedule, ctas, pacing=pacing)
        check_pool_fits(schedule, buf)
        st = _scratch(buf)
        idx, rows, rank = (topk_idx.contiguous(), tokens, 0) if buf.loopback else (buf.idx_buf, buf.T_max, buf.rank)
        if programs is not None:
            return plan_tables(idx, st.idx_delta, rows, rank, buf, schedule, ctas, pacing, loopback=buf.loopback,
                               programs=programs)
        hit = _steady_site(idx, st.idx_delta, rows, rank, buf, schedule, ctas, pacing, buf.loopback)
        if key is not None:
            buf._steady[key] = hit
    launch, made, n_programs = hit
    if buf.loopback:
        launch((n_programs,), topk_idx.contiguous(), tokens)
    else:
        launch((n_programs,), buf.idx_buf, buf.T_max)
    return made


def precompile_prologue(buf: MoEBuffer, schedule: str) -> None:
    """Compile the prologue of a real group's call for the order `schedule` (nothing for a custom
    order, planned on the host), once per buffer and order: `fused_moe` does it before the group's
    barrier, so a rank's first compile never holds up its peers' waits."""
    base = builtin_order(schedule)
    key = ("prologue compiled", None if base is None else base[0])
    if base is None or key in buf._plans:
        return
    plan_tables(buf.idx_buf, _scratch(buf).idx_delta, buf.T_max, buf.rank, buf, schedule, num_ctas(buf),
                loopback=buf.loopback, compile_only=True)
    buf._plans[key] = True
