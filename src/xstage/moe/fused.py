"""`fused_moe`: one MoE layer as one persistent Triton kernel driven by a schedule table.

Problem: `y[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t])` over an expert-parallel group, with the
combine's remote stores placed by a schedule (expert_wave, interleaved, lag:k) instead of fixed in code.

Algorithm: (1) routing layout of the rows this rank receives, from every rank's `topk_idx`
(loopback: synthesised); (2) the schedule table for those units, cached; (3) `moe_main_kernel`:
dispatch, Linear-1 + SwiGLU, Linear-2 with the combine pushed from its epilogue, a completion signal
to every peer; (4) `moe_reduce_kernel`: wait for every peer, top-k weighted sum. At equal block sizes
every schedule computes each tile with the same code and K order, so outputs are bitwise identical.
An FP8 buffer (`MoEBuffer(dtype="fp8")`) runs the same steps on e4m3 rows and weights with their
DeepSeek-V3 scales (`x` quantized 1x128 first, `quantize_inputs`) and returns BF16.

Example (on a machine without a GPU, Triton's CPU interpreter; fp16 there, see `MoEBuffer`):
    >>> import torch
    >>> from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer, fused_moe, transform_weights
    >>> cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
    >>> buf = MoEBuffer(16, 4, 2, 64, 32, LoopbackGroup(2), device="cpu", dtype="fp16", config=cfg)
    >>> x = torch.randn(8, 64, dtype=torch.float16)
    >>> idx = torch.stack([torch.randperm(4)[:2] for _ in range(8)])
    >>> w = torch.rand(8, 2)
    >>> l1, l2 = torch.randn(2, 64, 64, dtype=torch.float16) / 8, torch.randn(2, 64, 32, dtype=torch.float16) / 8
    >>> w1t, w2 = transform_weights(l1, l2, cfg.block_n1)
    >>> fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1").shape
    torch.Size([8, 64])
"""

from __future__ import annotations

import functools
import re
import warnings
import weakref

import torch

from xstage import backend
from xstage.backend import refuse_interpreter_bf16
from xstage.bounds import check_instance
from xstage.comm.context import check_timeout_ns
from xstage.comm.device import wait_bounds
from xstage.env import interpreter_active
from xstage.errors import InputError
from xstage.moe import kernels
from xstage.moe.buffer import MoEBuffer
from xstage.moe.checks import _pair, check_epilogue, check_mode, check_w1_layout, validate_inputs
from xstage.moe.decision import decide
from xstage.moe.layout import routing_layout, unit_experts
from xstage.sched.pacing import resolve_pacing
from xstage.spec.activation import SILU
from xstage.spec.pacing import AUTO, StorePacing, pacing_args
from xstage.spec.schedule import TASK_COLS, Schedule, check_schedule, make_schedule, per_call
from xstage.spec.stages import (
    STAGE_BUFFER_FREE,
    STAGE_COMBINE_DONE,
    STAGE_L1_WAIT,
    STAGE_L2_WAIT,
    STAGE_POOL_SLOT,
    STAGE_STORE_PACING,
)

_REDUCE_BT = 8


def _epilogue_args(b1, b2, activation, buf: MoEBuffer) -> tuple[tuple, dict]:
    """The main kernel's bias pointers and activation parameters, and their constexpr flags. Off, each
    pointer is a word the kernel never reads and the flags compile today's epilogue."""
    alpha, limit = (0.0, 0.0) if activation == SILU else (activation.alpha, activation.limit)
    args = (buf.recv_scale if b1 is None else b1, buf.recv_scale if b2 is None else b2, alpha, limit)
    return args, dict(HAS_B1=b1 is not None, HAS_B2=b2 is not None, ACT=0 if activation == SILU else 1)


def _all_topk(topk_idx: torch.Tensor, buf: MoEBuffer) -> torch.Tensor:
    """Every rank's routing `[R, T, K]`: synthesised on loopback, all-gathered in a real group."""
    idx = topk_idx.long()
    if buf.loopback:
        # An id outside [0, E) stays outside in every synthesised source: no rank takes it, as in a real group.
        shifts = torch.arange(buf.R, device=idx.device)[:, None, None] * buf.E_local
        ok = (idx >= 0) & (idx < buf.E)
        return torch.where(ok[None], (idx[None] + shifts) % buf.E, idx[None].expand(buf.R, *idx.shape))
    # Every rank copied its routing into its symmetric buffer before the barrier in `fused_moe`.
    return torch.stack([p for p in buf.idx_peers]).to(idx.device)


def num_ctas(buf: MoEBuffer) -> int:
    """Co-resident CTAs: SMs x CTAs per SM (1 under the interpreter, where programs run in turn).

    One CTA per SM unless `BlockConfig.ctas_per_sm` asks for more; then the first launch checks the
    compiled kernel's registers and shared memory against the SM and raises `InputError` if they do
    not fit (the bounded waits turn the unlucky first launch into a timeout, not a hang)."""
    if buf.device.type != "cuda" or interpreter_active():
        return 1
    sms = _SMS.get(buf.device)
    if sms is None:  # a device's SMs do not change in a process; asking torch costs ~2 us a call
        sms = _SMS[buf.device] = torch.cuda.get_device_properties(buf.device).multi_processor_count
    return sms * max(1, buf.cfg.ctas_per_sm or 1)


_SMS: dict = {}  # torch.device -> its SM count (`num_ctas`)


class _Plan:
    """The pieces of one call: routing layout, schedule and the schedule's device tensors (the
    table in global order when CTAs take tasks dynamically, else CTA by CTA)."""

    def __init__(self, layout, schedule: Schedule, device, dynamic: bool, tasks=None, cta_start=None,
                 pacing: StorePacing | None = None):
        self.layout = layout
        self.schedule = schedule
        self.pacing = pacing
        table = schedule.global_order() if dynamic else schedule.tasks
        self.tasks = torch.from_numpy(table).to(device) if tasks is None else tasks
        self.cta_start = torch.from_numpy(schedule.cta_start).to(device) if cta_start is None else cta_start


def call_pacing(pacing, buf: MoEBuffer, tokens: int, ctas: int, schedule: str) -> StorePacing | None:
    """The pacing of one call: `"buffer"` keeps the buffer's; `"auto"` is the planner's choice for this
    call's token bucket and schedule (jointly with the schedule when that is chosen per call too; cached
    on the buffer, `xstage.moe.decision`); anything else is resolved by `xstage.sched.pacing.resolve_pacing`
    for the buffer's store path."""
    if isinstance(pacing, str) and pacing == "buffer":
        pacing = buf.pacing
    if isinstance(pacing, str) and pacing == AUTO:
        return decide(buf, schedule, AUTO, tokens, ctas).pacing
    return resolve_pacing(pacing, buf.store_path, buf.R)


def _resolve_schedule(schedule: str, buf: MoEBuffer, tokens: int, ctas: int, pacing: StorePacing | None) -> str:
    """A name chosen per call (`model_guided`: the planner's pick; or a user's chooser) becomes its pick
    for this shape, token bucket and pacing (cached on the buffer, `xstage.moe.decision`); orders pass
    through."""
    if not per_call(check_schedule(schedule)):
        return schedule
    return decide(buf, schedule, pacing, tokens, ctas).schedule


def plan(topk_idx, buf: MoEBuffer, schedule: str, ctas: int | None = None, pacing="buffer") -> _Plan:
    """Routing layout and schedule table for this call (one host synchronisation for the counts).

    `pacing` is the call's store pacing (`"buffer"`: the buffer's default; see `call_pacing`)."""
    tokens, ctas_used = int(topk_idx.shape[0]), ctas or num_ctas(buf)
    pacing = call_pacing(pacing, buf, tokens, ctas_used, schedule)
    schedule = _resolve_schedule(schedule, buf, tokens, ctas_used, pacing)
    all_idx = _all_topk(topk_idx, buf)
    local = all_idx[(all_idx // buf.E_local) == buf.rank] % buf.E_local
    counts = torch.bincount(local.reshape(-1), minlength=buf.E_local).tolist()
    bm = buf.cfg.block_m
    experts = unit_experts(counts, bm)
    n_units = max(len(experts), 1)
    lay = routing_layout(all_idx, buf.rank, buf.E_local, bm, buf.rows_cap, n_units, buf.T_max, buf.pool_units)
    rows = [min(bm, c - i * bm) for c in counts for i in range(-(-c // bm))]
    n2 = -(-buf.H // buf.cfg.block_n2)
    sched = make_schedule(schedule, experts or [0], ctas or num_ctas(buf), buf.I // buf.cfg.block_n1, n2,
                          unit_rows=rows or [0], unit_dest_rows=_unit_dest_rows(lay, n_units, bm, buf),
                          pool_units=buf.pool_units)
    return _Plan(lay, sched, buf.device, buf.cfg.dynamic, pacing=pacing)


def _unit_dest_rows(lay, n_units: int, bm: int, buf: MoEBuffer):
    """Rows of each unit per destination (source) rank, `[units, R]`, from the layout (host copy)."""
    src = lay.row_src[: n_units * bm].cpu().view(n_units, bm).long()
    valid = src >= 0
    dest = torch.where(valid, src // buf.T_max, torch.zeros_like(src))
    out = torch.zeros(n_units, buf.R, dtype=torch.int64).scatter_add_(1, dest, valid.long())
    return out.numpy()


def _bounds(buf: MoEBuffer, timeout_ns: int | None):
    """(USE_PTX, timeout argument, poll bound) of the kernels' waits; `timeout_ns` None: the buffer's
    watchdog (`MoEBuffer.timeout_ns`)."""
    timeout_ns = buf.timeout_ns if timeout_ns is None else check_timeout_ns(timeout_ns)
    on_gpu = buf.device.type == "cuda" and not interpreter_active()
    if not on_gpu and buf.loopback:
        # The interpreter runs a loopback call's programs one after another in this process: a wait
        # that is not met at once never will be, so a short poll bound reports it quickly.
        return False, 2000 * 64, 2000
    return wait_bounds(timeout_ns, on_gpu)


def _operands(buf: MoEBuffer, w1t, w2) -> tuple:
    """(recv, its descriptor, w1t, its descriptor, act, ..., w2, ...): the GEMM operands as pointers
    for the stores and, with `BlockConfig.tma`, as 2-d TMA descriptors of `[block, block_k]` boxes for
    the loads (small host objects, encoded at launch; `_descriptor` keeps them between calls)."""
    if not buf.cfg.tma:
        return buf.recv, buf.recv, w1t, w1t, buf.act, buf.act, w2, w2
    c = buf.cfg
    return (buf.recv, _descriptor(buf, buf.recv, c.block_m), w1t, _descriptor(buf, w1t, c.block_n1), buf.act,
            _descriptor(buf, buf.act, c.block_m), w2, _descriptor(buf, w2, c.block_n2))


def _descriptor(buf: MoEBuffer, t: torch.Tensor, box_rows: int):
    """The TMA descriptor of `t` viewed as 2-d, with `[box_rows, block_k]` boxes. Building one costs a
    call's host time several times over, so each is kept on the buffer while `t` lives; the key holds
    everything the descriptor encodes (address, shape, type, box), so a new tensor at a freed address
    gets its own entry or the identical one."""
    key = ("tma", t.data_ptr(), tuple(t.shape), t.dtype, box_rows)
    hit = buf._plans.get(key)
    if hit is not None:
        return hit
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = t.detach().view(-1, t.shape[-1])  # not a view of `t` itself, which would keep `t` alive
    d = TensorDescriptor(flat, shape=list(flat.shape), strides=[flat.shape[1], 1],
                         block_shape=[box_rows, buf.cfg.block_k])
    buf._plans[key] = d
    # The entry holds a view of `t`'s memory: it goes when the tensor the caller passed goes.
    weakref.finalize(t, buf._plans.pop, key, None)
    return d


def _scaled(x, w1t, w2, buf: MoEBuffer) -> tuple:
    """(x, x_scale, w1t, w1t_scale, w2, w2_scale) for the kernel. FP8 buffers take the pairs of
    `quantize_inputs` and `transform_weights`; other buffers their tensors, with a word the kernel
    never reads in place of each scale."""
    if not buf.fp8:
        return x, buf.recv_scale, w1t, buf.recv_scale, w2, buf.recv_scale
    parts = [_pair(v, name, buf) for v, name in ((x, "x"), (w1t, "w1t"), (w2, "w2"))]
    if parts[0][1] is None:
        raise InputError("x: the FP8 kernel takes (x_fp8, x_scale); fused_moe quantizes BF16 x (quantize_inputs)")
    return tuple(t for pair in parts for t in pair)


def quantize_inputs(x, buf: MoEBuffer):
    """`x` as the kernel takes it: on an FP8 buffer a BF16 `x` is quantized 1x128
    (`xstage.moe.fp8.quantize_activations`) and a pair `(x_fp8, x_scale)` passes; else `x` itself."""
    if not buf.fp8 or isinstance(x, (tuple, list)):
        return x
    from xstage.moe.fp8 import quantize_activations

    return quantize_activations(x)


_MAIN_HOLES = (0, 1, 2, 3, 4, 5, 35)  # the plan's tables, x and x_scale in `_main_args`


def _main_args(holes: tuple, w1t, w1_scale, w2, w2_scale, buf: MoEBuffer, pacing, timeout_ns, wait: bool, trace,
               w1_layout: str, b1, b2, activation) -> tuple[tuple, dict]:
    """The main kernel's arguments and constants; `holes` the values at `_MAIN_HOLES`."""
    c = buf.cfg
    tasks, cta_start, unit_info, row_src, row_slot, x, x_scale = holes
    epi_args, epi_consts = _epilogue_args(b1, b2, activation, buf)
    use_ptx, timeout_ns, max_spins = _bounds(buf, timeout_ns)
    opts = {} if interpreter_active() else dict(num_warps=c.num_warps, num_stages=c.num_stages)
    args = (
        tasks, cta_start, unit_info, row_src, row_slot,
        x, buf.x_delta, *_operands(buf, w1t, w2), buf.combine, buf.comb_delta,
        buf.ready, buf.sync, buf.sig, buf.sig_delta, buf.sig_slot, buf.err, buf.err if trace is None else trace,
        buf.pace_clock, buf.rank, buf.R, buf.T_max, buf.H, buf.I, buf.pool_units, timeout_ns, max_spins,
        *pacing_args(pacing), x_scale, buf.xs_delta, buf.recv_scale, w1_scale, buf.act_scale, w2_scale,
        *epi_args,
    )
    assert all(args[i] is h for i, h in zip(_MAIN_HOLES, holes))
    consts = dict(
        STAGE_L1=STAGE_L1_WAIT, STAGE_L2=STAGE_L2_WAIT, STAGE_FREE=STAGE_BUFFER_FREE, STAGE_PACE=STAGE_STORE_PACING,
        STAGE_SLOT=STAGE_POOL_SLOT,
        TASK_COLS=TASK_COLS, BM=c.block_m, BN1=c.block_n1, BN2=c.block_n2, BK=c.block_k, BD=c.block_d,
        TMA=c.tma, DYNAMIC=c.dynamic, PACED=pacing is not None, FP8=buf.fp8, WAIT=wait, USE_PTX=use_ptx,
        TRACE=trace is not None, W1_CONCAT=w1_layout == "concatenated", **epi_consts, **opts,
        # The FP8 Linear-2 loop takes two K blocks per step: one stage fewer keeps its shared memory
        # within the Linear-1 loop's (3 x 64 KiB against 4 x 48 KiB at the default tiles).
        PAIR_STAGES=max(1, c.num_stages - 1),
        # A float32 buffer computes in float32, as torch's own float32 matmul does by default: Triton's
        # default for float32 operands is TF32 (10-bit mantissa, ~1e-3 relative on the GPU). 16-bit
        # operands ignore it.
        DOT_PREC="ieee" if buf.dtype == torch.float32 else "tf32",
    )
    return args, consts


def launch_main(x, w1t, w2, buf: MoEBuffer, p: _Plan, timeout_ns: int | None = None, wait: bool = True,
                trace: torch.Tensor | None = None, compile_only: bool = False, w1_layout: str = "interleaved",
                b1=None, b2=None, activation=SILU):
    """Enqueue the persistent kernel (dispatch, Linear-1, Linear-2 + combine push, completion signal).
    On an FP8 buffer `x`, `w1t` and `w2` are (data, scale) pairs (`quantize_inputs`, `transform_weights`).
    `b1`, `b2` and `activation` as `fused_moe` takes them (checked there: `check_epilogue`).

    `trace` (int64 `[num_tasks, 3]`, optional) receives each task's `%globaltimer` after its
    dependency wait, after its last store, and the CTA that ran it; row g for the task at position g
    of the global order (`Schedule.global_order()`; tile-cost calibration). `compile_only` compiles
    (or loads from Triton's cache) without launching."""
    backend.require()
    return _main(x, w1t, w2, buf, p, timeout_ns, wait, trace, compile_only, w1_layout, b1, b2, activation)


def _main(x, w1t, w2, buf: MoEBuffer, p: _Plan, timeout_ns, wait: bool, trace, compile_only: bool, w1_layout: str,
          b1, b2, activation):
    """`launch_main` once `backend.require()` has passed."""
    if trace is not None and (trace.dtype != torch.int64 or tuple(trace.shape) != (p.schedule.num_tasks, 3)
                              or trace.device.type != buf.device.type):
        raise InputError(f"trace: must be int64 [{p.schedule.num_tasks}, 3] on {buf.device}, "
                         f"got {trace.dtype} {tuple(trace.shape)} on {trace.device}")
    x, x_scale, w1t, w1_scale, w2, w2_scale = _scaled(x, w1t, w2, buf)
    if not buf.loopback:  # peers pull the rows (and their scales) from the symmetric copies
        x, x_scale = buf.x_buf, (buf.x_scale_buf if buf.fp8 else x_scale)
    grid = (p.schedule.num_ctas,)
    holes = (p.tasks, p.cta_start, p.layout.unit_info, p.layout.row_src, p.layout.row_slot, x, x_scale)
    if compile_only or trace is not None:
        args, consts = _main_args(holes, w1t, w1_scale, w2, w2_scale, buf, p.pacing, timeout_ns, wait, trace,
                                  w1_layout, b1, b2, activation)
        if compile_only:
            return kernels.moe_main_kernel.warmup(*args, grid=grid, **consts)
        compiled = backend.launch(kernels.moe_main_kernel, grid, args, consts)
    else:
        # One launch object per weights, epilogue, pacing and watchdog: only the plan's tables and the
        # tokens change from call to call (`backend.Launch`). It holds aliases of the weights, not the
        # caller's tensors, and goes when any of them goes.
        owned = [t for t in (w1t, w1_scale, w2, w2_scale, b1, b2) if isinstance(t, torch.Tensor)]
        key = ("main launch", p.pacing, w1_layout, activation, timeout_ns, buf.timeout_ns, wait,
               *[(id(t), t.data_ptr()) for t in owned], b1 is None, b2 is None)
        site = buf._plans.get(key)
        if site is None:
            alias = {id(t): t.detach() for t in owned}
            a = [alias.get(id(t), t) if isinstance(t, torch.Tensor) else t
                 for t in (w1t, w1_scale, w2, w2_scale, b1, b2)]
            args, consts = _main_args(holes, *a[:4], buf, p.pacing, timeout_ns, wait, None, w1_layout, a[4], a[5],
                                      activation)
            site = buf._plans[key] = backend.Launch(kernels.moe_main_kernel, args, consts, holes=_MAIN_HOLES)
            for t in owned:
                weakref.finalize(t, buf._plans.pop, key, None)
        compiled = site(grid, *holes)
    if compiled is not None and buf.cfg.ctas_per_sm > 1:
        _check_residency(compiled, buf)
    return compiled


def _check_residency(compiled, buf: MoEBuffer) -> None:
    """Refuse a grid larger than the CTAs that fit on the SMs at once (its waits could never end)."""
    props = torch.cuda.get_device_properties(buf.device)
    regs = max(1, int(getattr(compiled, "n_regs", 0) or 0)) * 32 * buf.cfg.num_warps
    smem = max(1, int(compiled.metadata.shared))
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    fit = min(props.regs_per_multiprocessor // regs, smem_per_sm // smem)
    if buf.cfg.ctas_per_sm > fit:
        raise InputError(f"ctas_per_sm={buf.cfg.ctas_per_sm}: only {fit} CTA(s) of this kernel fit on an SM "
                         f"({compiled.n_regs} registers x {buf.cfg.num_warps} warps, {smem} bytes shared)")


def launch_reduce(topk_idx, topk_w, y, buf: MoEBuffer, timeout_ns: int | None = None, wait: bool = True,
                  compile_only: bool = False, report: torch.Tensor | None = None):
    """Enqueue the completion wait + top-k weighted reduce into `y [T, H]` (`compile_only`: compile it),
    after the same call's `launch_main`: a reduce alone breaks the buffer's call protocol
    (docs/failures.md). `report` (a row of `MoEBuffer.report_row()`): the kernel moves this rank's
    error words there and clears them; without it they stay for `MoEBuffer.check()`."""
    backend.require()
    return _reduce(topk_idx, topk_w, y, buf, timeout_ns, wait, compile_only, report)


def _reduce(topk_idx, topk_w, y, buf: MoEBuffer, timeout_ns, wait: bool, compile_only: bool, report):
    """`launch_reduce` once `backend.require()` has passed."""
    T = y.shape[0]
    grid = (max(1, -(-T // _REDUCE_BT)),)  # not triton.cdiv: a constexpr function, slow on the host
    row = buf._reports.rows[0] if report is None else report
    if compile_only:
        args, consts = _reduce_args(topk_idx, topk_w, y, row, report is not None, T, buf, timeout_ns, wait)
        kernels.moe_reduce_kernel.warmup(*args, grid=grid, **consts)
        return y
    # One launch object per watchdog and report mode: the routing, `y`, the report row and the token
    # count change from call to call (`backend.Launch`).
    key = ("reduce launch", timeout_ns, buf.timeout_ns, wait, report is not None)
    site = buf._plans.get(key)
    if site is None:
        args, consts = _reduce_args(topk_idx, topk_w, y, row, report is not None, T, buf, timeout_ns, wait)
        site = buf._plans[key] = backend.Launch(kernels.moe_reduce_kernel, args, consts, holes=_REDUCE_HOLES)
    site(grid, topk_idx, topk_w, y, row, T)
    return y


_REDUCE_HOLES = (2, 3, 4, 13, 18)  # topk_idx, topk_w, y, the report row and T in `_reduce_args`


def _reduce_args(topk_idx, topk_w, y, row, report: bool, T: int, buf: MoEBuffer, timeout_ns, wait: bool):
    """The reduce kernel's arguments and constants (`launch_reduce`)."""
    use_ptx, timeout_ns, max_spins = _bounds(buf, timeout_ns)
    bh = next(b for b in (256, 128, 64, 32, 16, 8) if buf.H % b == 0)
    args = (buf.combine, buf.read_delta, topk_idx, topk_w, y, buf.ready, buf.units_cap,
            buf.sync, buf.sig, buf.sig_delta, buf.sig_slot, buf.err, buf.bad_ids, row, int(report),
            buf.R, buf.E, buf.E_local, T, buf.T_max, buf.H, buf.K, timeout_ns, max_spins)
    assert all(args[i] is h for i, h in zip(_REDUCE_HOLES, (topk_idx, topk_w, y, row, T)))
    consts = dict(STAGE_DONE=STAGE_COMBINE_DONE, BT=_REDUCE_BT, BH=bh, KP=1 << max(0, buf.K - 1).bit_length(),
                  WAIT=wait, USE_PTX=use_ptx, **({} if interpreter_active() else {"num_warps": 4}))
    return args, consts


def _precompile(x, topk_idx, topk_w, w1t, w2, buf: MoEBuffer, pacing, timeout_ns: int | None,
                schedule: str | None = None, w1_layout: str = "interleaved", b1=None, b2=None,
                activation=SILU) -> None:
    """Compile both kernels, and the device plan's prologue for `schedule` (None: planned on the host),
    or load them from Triton's cache, before the group's barrier: a rank's first-call compile then never
    holds up its peers' waits. Once per buffer and pacing switch (the only launch-time choice that
    changes the main kernel) and per order (the prologue's); a GPU-only step (the interpreter compiles
    nothing)."""
    if buf.device.type != "cuda" or interpreter_active():
        return
    if schedule is not None:
        from xstage.moe.device_plan import precompile_prologue  # it builds on this module

        precompile_prologue(buf, _resolve_schedule(schedule, buf, int(topk_idx.shape[0]), num_ctas(buf), pacing))
    key = ("compiled", pacing is not None, w1_layout, *_epilogue_args(b1, b2, activation, buf)[1].values())
    if key in buf._plans:
        return
    # The layout's shapes and types are what compilation needs: this rank's own routing stands in for
    # the group's (which is not known before the barrier).
    idx = topk_idx.long()
    shifts = torch.arange(buf.R, device=idx.device)[:, None, None] * buf.E_local
    lay = routing_layout((idx[None] + shifts) % buf.E, buf.rank, buf.E_local, buf.cfg.block_m, buf.rows_cap,
                         buf.units_cap, buf.T_max, buf.pool_units)
    n2 = -(-buf.H // buf.cfg.block_n2)
    sched = make_schedule("expert_wave", [0], num_ctas(buf), buf.I // buf.cfg.block_n1, n2)
    p = _Plan(lay, sched, buf.device, buf.cfg.dynamic, pacing=pacing)
    launch_main(x, w1t, w2, buf, p, timeout_ns, compile_only=True, w1_layout=w1_layout, b1=b1, b2=b2,
                activation=activation)
    y = torch.empty(topk_idx.shape[0], buf.H, dtype=buf.out_dtype, device=buf.device)
    launch_reduce(topk_idx, topk_w, y, buf, timeout_ns, compile_only=True)
    buf._plans[key] = True


@functools.cache
def _device_plan():
    from xstage.moe.device_plan import device_plan  # it builds on this module (an import per call: 1 us)

    return device_plan


def launch(x, topk_idx, topk_w, w1t, w2, buf: MoEBuffer, p: _Plan, y: torch.Tensor,
           timeout_ns: int | None = None, wait: bool = True, report: torch.Tensor | None = None,
           w1_layout: str = "interleaved", b1=None, b2=None, activation=SILU) -> torch.Tensor:
    """Enqueue the main and reduce kernels for a planned call (no host synchronisation)."""
    backend.require()  # once for both (each is a microsecond or two of every call)
    _main(x, w1t, w2, buf, p, timeout_ns, wait, None, False, w1_layout, b1, b2, activation)
    return _reduce(topk_idx, topk_w, y, buf, timeout_ns, wait, False, report)


def _check_order_fits(schedule: str, buf: MoEBuffer, tokens: int, pacing) -> None:
    """On a real group, before any rank waits: the call's order (resolved as `plan` will) must run in
    the row pool whatever the group's routing, which no rank knows before the barrier; else the
    host planner's `PoolTooSmallError`, for the buffer's largest unit count."""
    from xstage.moe.device_plan import check_pool_fits  # it builds on this module

    ctas = num_ctas(buf)
    check_pool_fits(_resolve_schedule(schedule, buf, tokens, ctas, call_pacing(pacing, buf, tokens, ctas, schedule)),
                    buf)


def _refused(exc: InputError, buf: MoEBuffer) -> InputError:
    """Stop the group's call on every peer with this rank's refusal (no host collective; the peers'
    barrier reads it), and this rank's own error, naming it."""
    arg = re.match(r"[A-Za-z_][A-Za-z0-9_]*", str(exc))
    buf.ctx.refuse(arg.group(0) if arg else "")
    return type(exc)(f"rank {buf.rank}: {exc}")


def fused_moe(x, topk_idx, topk_weights, w1t, w2, buf: MoEBuffer, schedule: str = "interleaved",
              timeout_ns: int | None = None, check="async", static: bool = False,
              pacing="buffer", plan_on: str = "device", w1_layout: str = "interleaved", b1=None, b2=None,
              activation=SILU) -> torch.Tensor:
    """This rank's MoE output `y [T, H]` (see module docstring). `w1t` comes from `transform_weights`,
    or, with `w1_layout="concatenated"`, it is the untransformed `[E, 2I, H]` (each expert's I gate rows,
    then its I up rows: transformers' `gate_up_proj`), read in place with no copy. On an FP8 buffer the
    concatenated pair is a DeepSeek-V3 checkpoint's own `(w [E, 2I, H], scale [E, 2I/128, H/128])`,
    scale rows gate then up like the weight rows (transformers' fine-grained FP8 `gate_up_proj` and
    `gate_up_proj_scale_inv`). Both layouts give the same `y`, bit for bit.

    Expert biases and the activation (BF16, FP16 and FP32 buffers; None and `"silu"` compile the
    kernel without them): `b1 [E_local, 2I]` is added to Linear-1's output before the activation, each
    expert's I gate biases then its I up biases whatever `w1_layout`; `b2 [E_local, H]` is added to each
    expert's output before the router weight multiplies it (`y[t] = sum_k w[t,k] (L2(act) + b2)`), both in
    the buffer's dtype or float32. `activation` is `"silu"` (`silu(gate) * up`) or
    `xstage.spec.activation.ClampedSwiGLU(alpha, limit)` (GPT-OSS's: `g = min(gate, limit)`,
    `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`). The reference takes the same
    (`reference_moe_virtual(..., b1=, b2=, activation=)`).

    FP8 (a buffer with `dtype="fp8"`): `x` is BF16 `[T, H]`, quantized here 1x128, or a pre-quantized
    pair `(x_fp8, x_scale)` (`x_scale` float32 `[T, H/128]`); `w1t` and `w2` are the `(weights,
    scales)` pairs of `transform_weights` (or, concatenated, the checkpoint's own); `y` is
    BF16. An Inf or NaN in a token's `x` turns that token's whole output row non-finite (NaN or +-inf)
    and leaves every other token as it would be; the kernel completes (its waits never depend on values).

    `check` says when the errors the device records are raised. Expert ids outside [0, E) are memory-
    safe in any case: they add nothing to `y`, and the device counts them.
    - `"async"` (the default): no host synchronisation. The call's reduce kernel hands its error words
      (a timed-out wait, ids out of range, a peer's refusal) to a pinned host row with an event; a
      later call raises them once they have arrived, without waiting (after enqueueing its own
      kernels), and `buf.check()` synchronises and raises them. Either names the call they came from
      (`(fused_moe call 12)`, counted per buffer). Under CUDA-graph capture nothing is reported:
      errors of replays surface at `buf.check()`.
    - `True`: today's synchronous checks: `InputError` for an expert id out of range before any launch
      (one host sync), and `CommTimeoutError` after the kernels if a wait timed out (another sync).
    - `False`: no check at all; call `buf.check()` (errors of several calls then name them all; until
      then a recorded error makes the waits of later calls give up at once).
    `static=True` is deprecated (a `DeprecationWarning`): it means `plan_on="device"`, which every
    call with a built-in order now uses and which can be captured.
    `timeout_ns` is the progress watchdog of every wait (default: the buffer's, `MoEBuffer.timeout_ns`): a
    wait gives up after that long without its counter moving, and `CommTimeoutError` names the rank.
    `pacing` paces the combine's remote stores for this call: `"buffer"` (the buffer's default),
    `"auto"` (the planner's choice for this call), `"default"`, `"off"`, `"RATE_GBPS:BUDGET_KIB"`, a
    `StorePacing` or None (`xstage.moe.pacing`).
    `plan_on="device"` (the default) builds the routing layout and task table on the device in one
    prologue launch (`xstage.moe.device_plan`); a custom order (`register_schedule`) is planned on the
    host, which synchronises and cannot be captured. `plan_on="host"` keeps the host plan (`plan`, the
    reference the device plan is tested against). With the default `check` a call with a built-in
    order makes no host synchronisation, and on a loopback buffer it can be captured in a CUDA graph
    and replayed with new routing written into the same tensors.

    On a real group every rank's inputs are checked before the call's barrier, which is the device
    barrier unless `check=True` (then the host waits at it): a rank that refuses its inputs (or an
    order that could not run in the row pool for some routing) raises `InputError: rank R: ...`, and
    its peers skip the call (their `y` is NaN) and raise `InputError: rank R refused its <argument>`,
    at once with `check=True`, else as any recorded error.
    """
    if not isinstance(buf, MoEBuffer):
        raise InputError(f"buf: expected a MoEBuffer, got {type(buf).__name__}")
    if static is True:
        warnings.warn("fused_moe(static=True) is no longer needed: a call with a built-in order plans on the "
                      "device and can be captured in a CUDA graph", DeprecationWarning, stacklevel=2)
    refuse_interpreter_bf16(buf.dtype, "buf.dtype")  # as on every rank: the buffer's dtype is the group's
    call = buf.begin_call()
    try:
        check = check_mode(check)
        check_instance(static, "static", bool, "True or False")
        if plan_on not in ("host", "device") or (static and plan_on == "host"):
            raise InputError(f"plan_on={plan_on!r}: must be 'host' or 'device' (static=True plans on the device)")
        if timeout_ns is not None:
            check_timeout_ns(timeout_ns)
        check_w1_layout(w1_layout)
        b1, b2, activation = check_epilogue(b1, b2, activation, buf)
        validate_inputs(x, topk_idx, topk_weights, w1t, w2, buf, check_range=check is True)
        if not buf.loopback:
            _check_order_fits(schedule, buf, int(topk_idx.shape[0]), pacing)
    except InputError as exc:
        if not buf.loopback:
            # The peers are about to wait for this rank at the call's barrier: stop them with the same
            # error, naming this rank and the argument (no host collective).
            raise _refused(exc, buf) from None
        raise
    x = quantize_inputs(x, buf)
    rows = x[0] if buf.fp8 else x
    if not buf.loopback:
        _precompile(x, topk_idx.contiguous(), topk_weights, w1t, w2, buf,
                    call_pacing(pacing, buf, int(rows.shape[0]), num_ctas(buf), schedule), timeout_ns,
                    schedule if plan_on == "device" else None, w1_layout, b1, b2, activation)
        buf.x_buf[: rows.shape[0]].copy_(rows)
        if buf.fp8:
            buf.x_scale_buf[: rows.shape[0]].copy_(x[1])
        buf.idx_buf.fill_(-1)
        buf.idx_buf[: rows.shape[0]].copy_(topk_idx)
        buf.barrier(host=check is True)
    if plan_on == "device":
        p = _device_plan()(topk_idx, buf, schedule, pacing=pacing)
    else:
        p = plan(topk_idx, buf, schedule, pacing=pacing)
    y = torch.empty(rows.shape[0], buf.H, dtype=buf.out_dtype, device=buf.device)
    capturing = buf.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    report = buf.report_row() if check == "async" and not capturing else None
    launch(x, topk_idx.contiguous(), topk_weights, w1t, w2, buf, p, y, timeout_ns, report=report, w1_layout=w1_layout,
           b1=b1, b2=b2, activation=activation)
    if capturing:
        buf.captured(call)
    if check is True:
        buf.check()
    elif report is not None:
        buf.reported(call)
        buf.raise_reported()
    return y
