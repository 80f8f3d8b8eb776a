"""Ulysses sequence-parallel attention with its post-attention all-to-all hidden behind attention.

Problem: every rank holds its tokens of q, k, v as `[B, S_local, H, D]` (yunchang's layout) and
needs attention over the whole sequence for its tokens and all heads, returned as `[B, S_local, H, D]`.

Algorithm (P ranks, rank r owns heads `head0[r]:head0[r+1]` after the first exchange):
1. pre-attention all-to-all of q, k, v (one `all_to_all_single`; see `layout.py`): rank r gets its
   heads over the whole sequence;
2. attention of those heads, with the output sent to the ranks that own its rows by the chosen
   `exchange` (`xstage.attention.exchange`):
   - `serial`: attention (Triton or cuDNN), then one all-to-all;
   - `overlap`: attention block of rows by block of rows; the copy engine sends each finished block
     while the SMs compute the next (`overlap.py`);
   - `stores`: the persistent FlashAttention kernel stores each finished tile's rows into the
     owners' buffers from its epilogue and raises each owner's per-source counter; the receiver
     waits for its counters (a one-program kernel, bounded by the context's timeout);
   - `auto` (the default): the planner's pick (`xstage.sched`).
   Or both exchanges pipelined by head chunks, `heads:CORE:C` (`xstage.attention.pipeline`), on a
   torch.distributed group.

Any head count and sequence length work: heads and tokens are split with the first `n % P` ranks
taking one more, so a rank may hold no token or own no head and still takes its part. Before any
exchange the ranks agree on their inputs and gather their token counts in one small collective
(`xstage.attention.inputs`): a rank that refuses its inputs makes every rank raise one agreed
`InputError`. `seq_lens` gives the counts instead: with `check=False` no host collective runs (the
refusals then stay local), and under CUDA graph capture, where none can run, it is needed whenever
the counts differ.

Groups: `group` (a ProcessGroup, default the world group) runs the pre-attention all-to-all through
torch.distributed (NCCL, or gloo for ranks sharing one GPU) and the `overlap` and `stores`
exchanges through a `peer` `xstage.comm` context built on first use. `comm=` passes a context instead; a loopback
context (`path="host"` or `"hbm"`) lets one device play rank r of P: rank p holds the local shard
shifted by p - r tokens (cyclically), so what peers would send is synthesized from local data, the
rows for other ranks land in buffers on the chosen path, and the other ranks' heads of the
returned output are computed by the Triton kernel outside the exchange. Since the stand-in ranks'
tokens come from the local shard, a loopback rank must hold at least one token (`seq_lens` may give
other ranks none); a rank without tokens runs in a real group.

Example (one device, loopback; runs in the CPU interpreter too):
    >>> import torch
    >>> from xstage.comm import create_context
    >>> from xstage.attention import ulysses_attention
    >>> ctx = create_context(path="hbm", loopback_world=2, rank=0)
    >>> q, k, v = (torch.randn(1, 64, 4, 32, dtype=torch.float16) for _ in range(3))
    >>> ulysses_attention(q, k, v, comm=ctx, exchange="overlap").shape
    torch.Size([1, 64, 4, 32])
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from xstage.attention.exchange import resolve_auto
from xstage.attention.flash import FlashConfig, StoreRoute, default_config, flash_attention
from xstage.attention.inputs import agree, check_call
from xstage.attention.layout import empty_gathered_out, pack_qkv, unpack_out, unpack_qkv
from xstage.attention.overlap import (
    attend,
    copy_region,
    run_overlap,
    run_serial_copies,
    stage_offset,
    unpack_stage,
)
from xstage.attention.pipeline import run_heads
from xstage.bounds import check_instance
from xstage.comm import CommContext, create_context
from xstage.comm.device import use_ptx
from xstage.comm.ulysses_signals import expected_tiles, wait_counters
from xstage.errors import InputError
from xstage.sched.calibration import calibration_of
from xstage.spec.exchange import Exchange, parse_exchange
from xstage.spec.ulysses import UlyssesPlan, split_sizes

# `mode=` before `exchange=` existed: what each old name runs now
MODES = {"fused": "stores:paced", "serial": "serial"}


@dataclass
class FusedState:
    """Buffers and tables of the fused exchange for one shape on one context."""

    plan: UlyssesPlan
    out: object  # SymmBuffer [B, S_max, H, D]: every rank's output
    sig: torch.Tensor  # int32 counters this rank waits on (loopback: one per destination)
    route: StoreRoute
    wait_table: torch.Tensor
    wait_expected: torch.Tensor
    wait_peers: torch.Tensor
    stage: object = None  # SymmBuffer: the serial exchange's receive buffers (allocated on first use)

    def own_output(self) -> torch.Tensor:
        s = self.plan.seq_lens[self.plan.rank]
        return self.out.local[:, :s]


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GROUP_CONTEXTS: dict[str, object] = {}


def fused_state(ctx, plan: UlyssesPlan, dtype: torch.dtype, block_m: int) -> FusedState:
    """The (cached) output buffers, counters and tables for `plan` on context `ctx`."""
    cache = _STATES.setdefault(ctx, {})
    key = (plan, dtype, block_m)
    if key in cache:
        return cache[key]
    dev = ctx.device
    B, H, D, P, r = plan.batch, plan.heads, plan.head_dim, plan.world, plan.rank
    s_max = max(plan.seq_lens)
    tag = f"ulysses.{B}x{'-'.join(map(str, plan.seq_lens))}x{H}x{D}.{str(dtype)[6:]}.bm{block_m}"
    out = ctx.alloc(tag + ".out", (B, s_max, H, D), dtype)
    heads = [plan.heads_of(p) for p in range(P)]
    tok0 = plan.tok0
    if ctx.loopback:
        # Counters stay in device memory even on the host path: the tiles cross the path, the
        # counters only mark them, and the sender's own GPU is the one that waits, for every
        # destination's counter of this source.
        sig = torch.zeros(P, dtype=torch.int32, device=dev)
        expected = [expected_tiles(tok0, heads, B, block_m, p)[r] for p in range(P)]
    else:
        sig_buf = ctx.alloc(tag + ".sig", (P,), torch.int32)
        sig = sig_buf.local
        expected = expected_tiles(tok0, heads, B, block_m, r)
    sig_addrs = torch.tensor([sig[p].data_ptr() for p in range(P)], dtype=torch.int64, device=dev)
    sig_table = sig_addrs if ctx.loopback else sig_buf.ptrs + 4 * r  # this source's slot on every rank
    route = StoreRoute(
        dst_table=out.ptrs, row0=torch.tensor(tok0, dtype=torch.int32, device=dev),
        batch_stride=s_max * H * D, head_offset=plan.head0[r], sig_table=sig_table, sig_like=sig,
        row_stride=H * D, head_stride=D,
    )
    state = FusedState(plan, out, sig, route, sig_addrs,
                       torch.tensor(expected, dtype=torch.int32, device=dev),
                       torch.arange(P, dtype=torch.int32, device=dev))
    cache[key] = state
    return state


def run_fused(state: FusedState, ctx, qg, kg, vg, *, softmax_scale=None, config: FlashConfig | None = None,
              wait: bool = True, exchange: Exchange | None = None) -> None:
    """Attention of this rank's heads with the output exchange in the epilogue (`exchange`: a
    `stores` spelling; None: the state's route as it is), then (if `wait`) the bounded wait for this
    rank's counters (loopback: for every destination's counter)."""
    route = state.route
    if exchange is not None:
        route = dataclasses.replace(route, paced=not exchange.burst)
        if exchange.chunk_rows:
            config = dataclasses.replace(config or default_config(qg.shape[-1], qg.dtype, qg.device),
                                         chunk_rows=exchange.chunk_rows)
    flash_attention(qg, kg, vg, softmax_scale=softmax_scale, config=config, route=route,
                    out=state.own_output())
    if wait:
        wait_fused(state, ctx)


def wait_fused(state: FusedState, ctx) -> None:
    wait_counters(state.wait_table, state.sig, state.wait_expected, state.wait_peers, ctx.error,
                  ctx.timeout_ns, use_ptx=use_ptx())


def loopback_gather(plan: UlyssesPlan, t: torch.Tensor) -> torch.Tensor:
    """The whole sequence `[B, S, H, D]` that a loopback group holds: rank p's shard is the local
    shard shifted by p - r tokens (cyclically), truncated or repeated to rank p's token count."""
    idx = loopback_index(plan, t.device)
    return t.index_select(1, idx)


def loopback_index(plan: UlyssesPlan, device) -> torch.Tensor:
    s_r = plan.seq_lens[plan.rank]
    if s_r == 0:
        raise InputError(_LOOPBACK_EMPTY.format(rank=plan.rank))
    parts = [(torch.arange(s, device=device) + (p - plan.rank)) % s_r for p, s in enumerate(plan.seq_lens)]
    return torch.cat(parts)


# A loopback group has one process: the stand-in ranks' tokens are the local ones, shifted.
_LOOPBACK_EMPTY = ("seq_lens: a loopback context derives the stand-in ranks' tokens from the local shard, so "
                   "rank {rank} (this one) must hold at least one token; run a rank without tokens in a real group")


def _resolve(group, comm):
    if comm is not None:
        check_instance(comm, "comm", CommContext, "an xstage.comm context (create_context) or None")
        if group is not None:
            raise InputError("group, comm: pass one of them, not both")
        # a `peer` context's pre-attention all-to-all and agreement run on its own group
        return comm.world, comm.rank, comm, None if comm.loopback else comm.group

    if not dist.is_available() or not dist.is_initialized():
        raise InputError("group: torch.distributed is not initialised; pass comm= (e.g. a loopback context)")
    group = group or dist.group.WORLD
    return dist.get_world_size(group), dist.get_rank(group), None, group


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _group_context(group):

    name = getattr(group, "group_name", None) or str(id(group))
    if name not in _GROUP_CONTEXTS:
        _GROUP_CONTEXTS[name] = create_context(group, path="peer")
    return _GROUP_CONTEXTS[name]


def _pre_alltoall(plan, q, k, v, group):

    send = pack_qkv(plan, q, k, v)
    recv = torch.empty(sum(plan.qkv_recv_splits()), dtype=q.dtype, device=q.device)
    dist.all_to_all_single(recv, send, plan.qkv_recv_splits(), plan.qkv_send_splits(), group=group)
    return unpack_qkv(plan, recv)


def _loopback_peer_heads(plan, q, kf, vf, out, scale, config):
    """Fill the heads of `out` that other ranks would send (loopback): same kernel, same math."""
    h0, h1 = plan.head0[plan.rank], plan.head0[plan.rank + 1]
    for a, b in ((0, h0), (h1, plan.heads)):
        if b > a:
            flash_attention(q[:, :, a:b], kf[:, :, a:b], vf[:, :, a:b], softmax_scale=scale,
                            out=out[:, :, a:b], config=config)


def exchange_from_mode(exchange, mode) -> Exchange:
    """The exchange of a call that may still use the deprecated `mode=` ("fused" or "serial")."""
    if mode is None:
        return parse_exchange(exchange)
    if not isinstance(mode, str) or mode not in MODES:
        raise InputError(f"mode {mode!r}: deprecated, and must be one of {', '.join(MODES)}; pass exchange= "
                         "instead (serial, overlap, stores, tma, auto)")
    if exchange is not None:
        raise InputError(f"exchange, mode: pass exchange= only (mode={mode!r} is deprecated)")
    warnings.warn(f"ulysses_attention(mode={mode!r}) is deprecated: use exchange={MODES[mode]!r}",
                  DeprecationWarning, stacklevel=3)
    return parse_exchange(MODES[mode])


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    *,
    softmax_scale: float | None = None,
    exchange: str | Exchange | None = None,
    comm=None,
    seq_lens=None,
    config: FlashConfig | None = None,
    check: bool = True,
    mode: str | None = None,
    calibration=None,
) -> torch.Tensor:
    """Ulysses attention: `[B, S_local, H, D]` q, k, v in, `[B, S_local, H, D]` out (non-causal).

    `group`: ProcessGroup (None: the world group). `comm`: an `xstage.comm` context instead (a
    loopback context makes one device play one rank). `exchange`: how the output reaches the ranks
    that own its rows, one of the spellings of `xstage.attention.exchange` (`serial`, `overlap`,
    `stores`, `tma`, `auto`, or `heads:CORE:C`, which pipelines both exchanges by head chunks on a
    torch.distributed group; None means `auto`, the planner's pick for this shape, group size, path
    and dtype: `xstage.sched.policy.choose_exchange`). `calibration`: a user's calibration folder (or
    `xstage.sched.calibration.Calibration`) that `auto` decides with instead of the embedded one (default:
    the setting `XSTAGE_CALIBRATION`, else the embedded calibration). `mode` ("fused" or "serial") is
    deprecated: it maps to `stores:paced` and `serial`.
    `softmax_scale`: a finite positive number (None: `1/sqrt(D)`). `seq_lens`: every rank's token
    count (default: gathered from the group; on a loopback context or during CUDA graph capture all
    equal to this rank's). A rank may hold no token, or own no head (H < P), and still takes its part.
    `check`: after the call, synchronise and raise `CommTimeoutError` if a wait on a peer timed out
    (skipped while a CUDA graph is being captured; `serial` is bounded by the group's own timeout
    instead); on a group, when `seq_lens` is given, also agree on the inputs first.

    Inputs on a group: a rank that refuses its inputs raises `InputError: rank R: <argument>: ...`
    and every other rank `InputError: rank R refused its <argument> ...`, before any rank waits on a
    peer, through one small all-gather that also collects the token counts (`xstage.attention.inputs`
    says when it runs: not under CUDA graph capture, nor with `seq_lens` and `check=False`).

    Example: see the module docstring.
    """
    try:
        check_instance(check, "check", bool, "True or False")
        ex, refusal = exchange_from_mode("auto" if exchange is None and mode is None else exchange, mode), None
    except InputError as e:
        ex, refusal, check = None, e, True  # the ranks still agree on the refusal
    return _ulysses(q, k, v, group, ex, refusal, softmax_scale=softmax_scale, comm=comm, seq_lens=seq_lens,
                    config=config, check=check, calibration=calibration)


def _ulysses(q, k, v, group, ex: Exchange | None, refusal: InputError | None, *, softmax_scale, comm, seq_lens,
             config, check, calibration=None):
    """`ulysses_attention` with the exchange parsed, or the caller's refusal of its own arguments."""
    world, rank, ctx, group = _resolve(group, comm)
    on_group = ctx is None or not ctx.loopback
    scale = lens = None
    if refusal is None:
        try:
            scale, lens = check_call(q, k, v, softmax_scale=softmax_scale, seq_lens=seq_lens, config=config,
                                     world=world, rank=rank)
            check_runnable(ex, q.device)
            if ex.mechanism == "heads" and ctx is not None and ctx.loopback:
                raise InputError(f"exchange {str(ex)!r}: runs on a torch.distributed group (its Q, K, V go by "
                                 "the group's all-to-all); a loopback context does not stage that exchange yet")
            calibration = calibration_of(calibration)  # a bad folder is a refusal the group hears of
        except InputError as e:
            refusal = e
    if not on_group:
        if refusal is not None:
            raise refusal
        lens = lens or [q.shape[1]] * world
        if lens[rank] == 0:
            raise InputError(_LOOPBACK_EMPTY.format(rank=rank))
    elif not _capturing() and (seq_lens is None or check):
        lens = agree(refusal, q, ex, lens, world, rank, group)
    elif refusal is not None:
        raise InputError(f"rank {rank}: {refusal}") from None
    B, s_r, H, D = q.shape
    plan = UlyssesPlan(world, rank, B, lens or [s_r] * world, H, D)
    cfg = config or default_config(D, q.dtype, q.device)
    if world == 1:
        out = torch.empty_like(q)
        attend("cudnn" if ex.mechanism in ("serial", "overlap", "heads") and ex.core == "cudnn" else "triton", q, k, v,
               out, softmax_scale=scale, config=cfg)
        return out
    path = ctx.path if ctx is not None else "peer"
    if ex.mechanism == "auto":
        ex = resolve_auto(plan, q.dtype, path, q.device, calibration=calibration)
    check_runnable(ex, q.device)
    if ex.mechanism == "heads":
        return run_heads(plan, ex, q, k, v, group, softmax_scale=scale, config=cfg)
    h0, h1 = plan.head0[rank], plan.head0[rank + 1]
    kf = vf = None
    if not on_group:
        qf, kf, vf = (loopback_gather(plan, t) for t in (q, k, v))
        qg, kg, vg = qf[:, :, h0:h1], kf[:, :, h0:h1], vf[:, :, h0:h1]
    else:
        qg, kg, vg = _pre_alltoall(plan, q, k, v, group)
    out = torch.empty_like(q)
    if ex.mechanism == "serial" and on_group:
        og = empty_gathered_out(plan, q.dtype, q.device)
        attend(ex.core, qg, kg, vg, og, softmax_scale=scale, config=cfg)
        recv = torch.empty(sum(plan.out_recv_splits()), dtype=q.dtype, device=q.device)
        send = og.transpose(0, 1).reshape(-1)  # [S, B, h_r, D] is contiguous: no copy
        dist.all_to_all_single(recv, send, plan.out_recv_splits(), plan.out_send_splits(), group=group)
        return unpack_out(plan, recv, out)
    if ctx is None:
        ctx = _group_context(group)
    state = fused_state(ctx, plan, q.dtype, cfg.block_m)
    if ex.in_kernel:
        run_fused(state, ctx, qg, kg, vg, softmax_scale=scale, config=cfg, exchange=ex)
        # A copy, so that the next call's stores cannot overwrite what the caller holds.
        out.copy_(state.own_output())
    else:
        og = empty_gathered_out(plan, q.dtype, q.device)
        stage = stage_buffer(state, ctx)
        if ex.mechanism == "overlap":
            run_overlap(plan, ex, qg, kg, vg, og, out[:, :, h0:h1], stage.peers, softmax_scale=scale, config=cfg)
        else:
            attend(ex.core, qg, kg, vg, og, softmax_scale=scale, config=cfg)
            run_serial_copies(plan, og, out[:, :, h0:h1], stage.peers)
        if ctx.loopback:
            unpack_loopback(plan, state)
        else:
            # every rank's copies have landed: a device barrier on the stream, bounded by the watchdog
            ctx.barrier(host=False)
            unpack_stage(plan, stage.local, out, [s for s in range(world) if s != rank])
    if check and not _capturing() and ex.mechanism != "serial":
        ctx.check()
    if kf is not None:
        _loopback_peer_heads(plan, q, kf, vf, out, scale, cfg)
    return out


def check_runnable(ex: Exchange, device: torch.device) -> None:
    """An `InputError` naming the mechanisms that can run when `ex` cannot run on `device`."""
    if ex.mechanism == "tma":
        raise InputError(f"exchange {str(ex)!r}: cannot run here: with Triton 3.6 a bulk (TMA) store of a tile "
                         "that straddles two ranks' rows faults (benchmarks/results/h200-tma-store/); these can: "
                         "serial, overlap, stores, auto")


def unpack_loopback(plan: UlyssesPlan, state: FusedState, *, stream_ordered: bool = True) -> None:
    """What the stand-in ranks of a loopback group do with this rank's staged rows: move them into
    their outputs, in stream order (so also inside a CUDA graph, and on any stream): the copies into
    the staging buffers are ordered before these reads on every path, `host` included
    (`copy_region`).

    `stream_ordered=False` is for tests only: the host path's regions are then copied by the CPU at
    once, as torch does for tensors in host memory, racing the stream's copies into them (so that a
    test can show the delivery check catches that race)."""
    r = plan.rank
    h0, h1 = plan.head0[r], plan.head0[r + 1]
    n = plan.batch * (h1 - h0) * plan.head_dim
    stage = state.stage
    for p in range(plan.world):
        s_p = plan.seq_lens[p]
        if p == r or s_p == 0 or h1 == h0:
            continue
        off = stage_offset(plan, p, r)
        region = stage.peers[p].view(-1)[off:off + s_p * n].view(s_p, plan.batch, h1 - h0, plan.head_dim)
        dest = state.out.peers[p][:, :s_p, h0:h1]
        if stream_ordered and state.out.local.is_cuda:
            copy_region(region, dest)
        else:
            dest.copy_(region.transpose(0, 1))


def serial_loopback_exchange(plan: UlyssesPlan, og: torch.Tensor, state: FusedState, ctx, *,
                             unpack: bool = True) -> None:
    """The serial exchange on a loopback group, as an all-to-all would do it.

    Sender side: this rank's own rows go into its output; every other rank's rows (one contiguous
    `[S_p, B, h_r, D]` chunk of the sequence-major `og`) are copied into that rank's receive buffer
    on the path. With `unpack`, also what each receiver does next: move the chunk into its output."""
    r = plan.rank
    stage = stage_buffer(state, ctx)
    run_serial_copies(plan, og, state.out.local[:, :plan.seq_lens[r], plan.head0[r]:plan.head0[r + 1]], stage.peers)
    if unpack:
        unpack_loopback(plan, state)


def stage_buffer(state: FusedState, ctx):
    """The staging buffer of the copy-engine exchanges for `state`'s shape (allocated on first use;
    on `peer` every rank must reach this call in the same order, as for any `ctx.alloc`)."""
    if state.stage is None:
        plan = state.plan
        numel = plan.batch * max(plan.seq_lens) * plan.heads * plan.head_dim
        state.stage = ctx.alloc(state.out.name.removesuffix(".out") + ".stage", (numel,), state.out.local.dtype)
    return state.stage


class UlyssesAttention(torch.nn.Module):
    """`nn.Module` form of `ulysses_attention` with yunchang's call signature.

    Example:
        >>> from xstage.comm import create_context
        >>> attn = UlyssesAttention(comm=create_context(path="hbm", loopback_world=2))
        >>> x = torch.randn(1, 32, 2, 16, dtype=torch.float16)
        >>> attn(x, x, x).shape
        torch.Size([1, 32, 2, 16])
    """

    def __init__(self, sequence_process_group=None, *, exchange: str | Exchange | None = None, comm=None,
                 config: FlashConfig | None = None, mode: str | None = None, calibration=None):
        super().__init__()
        # a bad folder is refused here, before any call; None: the setting XSTAGE_CALIBRATION at each call
        self.calibration = calibration_of(calibration) if calibration is not None else None
        self.exchange = exchange_from_mode("auto" if exchange is None and mode is None else exchange, mode)
        self.group = sequence_process_group
        self.comm = comm
        self.config = config

    def forward(self, query, key, value, dropout_p: float = 0.0, softmax_scale: float | None = None,
                causal: bool = False, seq_lens=None, **unused):
        refusal = None
        if dropout_p != 0.0:
            refusal = InputError(f"dropout_p={dropout_p}: only 0.0 is supported (inference)")
        elif causal:
            refusal = InputError("causal=True: only non-causal attention is supported (DiT)")
        # a refusal here reaches the group like one of ulysses_attention's own
        return _ulysses(query, key, value, self.group, self.exchange, refusal, softmax_scale=softmax_scale,
                        comm=self.comm, seq_lens=seq_lens, config=self.config, check=True,
                        calibration=self.calibration)


__all__ = ["MODES", "FusedState", "UlyssesAttention", "check_runnable", "exchange_from_mode", "fused_state",
           "loopback_gather", "run_fused", "serial_loopback_exchange", "split_sizes", "stage_buffer",
           "ulysses_attention", "unpack_loopback", "wait_fused"]
