"""FlashAttention forward in Triton for DiT: non-causal, `[B, S, H, D]` in and out, persistent over tiles.

Problem: `o[b, s, h] = softmax(scale * q[b, s, h] . k[b, :L_b, h]^T) v[b, :L_b, h]` for strided
`[B, S, H, D]` tensors (fp16 / bf16 / fp32, D in {16, 32, 64, 128, 256}), where `L_b` is batch `b`'s
valid key length (`kv_lens`; padded keys beyond it are ignored).

Algorithm: the online-softmax forward of FlashAttention-2. A persistent grid (one program per SM
and slot) walks query tiles `(b, h, m)` with the query-tile index fastest, so the programs running
at one time share the same head's K/V in L2. Each tile streams K/V in BLOCK_N blocks: full blocks
run unmasked (the pipelined hot loop), one masked tail block handles `L_b % BLOCK_N`. Scores use
`exp2` with `scale * log2(e)` folded into one multiply-add. On Hopper, Q/K/V come through TMA tensor
descriptors when their strides allow a 2-D view (see `_tma_view`); otherwise through pointers.

When the tile's output is final, the epilogue either stores it into `o` or, for the Ulysses
exchange (`xstage.attention.ulysses`), sends each row into the buffer of the rank that owns it:
paced (the default: in chunks during the next tile's key loop) or in one burst (`StoreRoute.paced`).
This module checks the inputs, picks the configuration and launches the kernel;
`xstage.attention.flash_kernel` holds the kernel and its Triton helpers, and says how and why the
exchange is paced.

Tracing (`trace=`, see `trace_buffer`): the kernel records per tile when it started, when its key
loop ended, when its epilogue ended, the time spent in and the number of paced sends inside its key
loop, and its SM, from `%globaltimer` (ns). Without `trace` the timer reads are compiled out.

Example:
    >>> import torch
    >>> from xstage.attention import flash_attention
    >>> q, k, v = (torch.randn(1, 300, 3, 64, dtype=torch.float16) for _ in range(3))
    >>> o = flash_attention(q, k, v)            # [1, 300, 3, 64]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from xstage import backend
from xstage.attention.flash_kernel import _attn_fwd_kernel
from xstage.bounds import check_instance
from xstage.comm.device import use_ptx
from xstage.env import interpreter_active
from xstage.errors import InputError
from xstage.spec.ulysses import SUPPORTED_HEAD_DIMS  # the head sizes the kernel compiles for

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Launch parameters Triton can compile: tiles are `tl.arange` extents (powers of two) that a GPU's shared
# memory holds at these sizes and not far beyond; warps per program as CUDA allows (1024 threads).
MAX_FLASH_BLOCK = 1024
MAX_FLASH_WARPS = 32
MAX_FLASH_STAGES = 16
MAX_FLASH_CTAS_PER_SM = 32  # resident programs per SM: an H100/H200 SM holds at most 32 blocks
# The fields of one trace row (`trace_buffer`): start, key loop end, epilogue end (ns), ns inside
# paced sends, chunks sent, SM id.
TRACE_FIELDS = 6
TRACE_START, TRACE_LOOP_END, TRACE_END, TRACE_SEND_NS, TRACE_CHUNKS, TRACE_SM = range(TRACE_FIELDS)


@dataclass(frozen=True)
class FlashConfig:
    """Launch parameters of the forward kernel.

    `ctas_per_sm` sizes the persistent grid (programs = SMs x ctas_per_sm, at most the tile count);
    0 launches one program per tile. `use_tma` None means: TMA descriptors when the GPU and the
    strides allow them. `chunk_rows`: rows per send of the paced exchange (a power of two; 0 means
    4 KiB chunks at 2-byte elements, i.e. `2048 // D` rows, at most `block_m`).
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    ctas_per_sm: int = 1
    use_tma: bool | None = None
    chunk_rows: int = 0

    def __post_init__(self):
        # A bad value is one line here, not a Triton compile error in the middle of an exchange.
        for name in ("block_m", "block_n", "num_warps", "num_stages", "ctas_per_sm", "chunk_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputError(f"config.{name}={value!r}: must be an integer")
        for name, low, high in (("block_m", 16, MAX_FLASH_BLOCK), ("block_n", 16, MAX_FLASH_BLOCK),
                                ("num_warps", 1, MAX_FLASH_WARPS)):
            value = getattr(self, name)
            if not low <= value <= high or value & (value - 1):
                raise InputError(f"config.{name}={value}: must be a power of two in {low}..{high}")
        if not 1 <= self.num_stages <= MAX_FLASH_STAGES:
            raise InputError(f"config.num_stages={self.num_stages}: must be in 1..{MAX_FLASH_STAGES}")
        if not 0 <= self.ctas_per_sm <= MAX_FLASH_CTAS_PER_SM:
            raise InputError(f"config.ctas_per_sm={self.ctas_per_sm}: must be in 0..{MAX_FLASH_CTAS_PER_SM} "
                             "(0: one program per tile)")
        if not 0 <= self.chunk_rows <= MAX_FLASH_BLOCK or self.chunk_rows & (self.chunk_rows - 1):
            raise InputError(f"config.chunk_rows={self.chunk_rows}: must be a power of two in 0..{MAX_FLASH_BLOCK} "
                             "(0: the default)")
        if not (self.use_tma is None or isinstance(self.use_tma, bool)):
            raise InputError(f"config.use_tma={self.use_tma!r}: must be None, True or False")


def default_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> FlashConfig:
    """The tuned configuration for Hopper, small blocks in the CPU interpreter."""
    if device.type != "cuda":
        return FlashConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, ctas_per_sm=0, use_tma=False)
    if dtype == torch.float32:
        return FlashConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if head_dim > 128:
        # Q plus three stages of 128-row K and V blocks would not fit in shared memory at D=256.
        return FlashConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    # Measured on one H200, bf16 (benchmarks/results/h200-ulysses/core.csv): 568 TFLOP/s at 16K tokens,
    # 24 x 128 (89% of cuDNN SDPA) and 399 at 17776 tokens, 30 x 64 (96%) with this configuration.
    return FlashConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


def check_tensors(q, k, v) -> None:
    """What the kernel needs of q, k, v each and together, the sequence lengths aside: 4-D
    `[B, S, H, D]` tensors of one supported dtype on one device, unit stride in D, a supported D."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InputError(f"{name}: expected a 4-D tensor [B, S, H, D], got {getattr(t, 'shape', type(t))}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise InputError(f"{name}.dtype: must be one of float16, bfloat16, float32, got {t.dtype}")
        if t.stride(-1) != 1 and t.numel() > 0:
            raise InputError(f"{name}: the head dimension D must have unit stride, got stride {t.stride(-1)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise InputError(f"q, k, v: dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise InputError("q, k, v: must be on one device")
    backend.refuse_interpreter_bf16(q.dtype, "q.dtype")
    D = q.shape[3]
    if D not in SUPPORTED_HEAD_DIMS:
        raise InputError(f"q: head dim D={D}: must be one of {SUPPORTED_HEAD_DIMS}")


def _check_qkv(q, k, v):
    check_tensors(q, k, v)
    B, _, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != H or k.shape[3] != D:
        raise InputError(f"k, v: expected shape [{B}, S_k, {H}, {D}] matching q, got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape[1] == 0:
        raise InputError("k: key length must be at least 1")


def softmax_scale_value(softmax_scale, head_dim: int) -> float:
    """The scale of the scores: `softmax_scale` as a float (None: `1/sqrt(head_dim)`); anything but a
    finite positive real number is refused."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        scale = None if isinstance(softmax_scale, (bool, str, bytes)) else float(softmax_scale)
    except (TypeError, ValueError, RuntimeError):
        scale = None
    if scale is None or not math.isfinite(scale) or scale <= 0:
        raise InputError(f"softmax_scale: must be a finite positive number or None, got {softmax_scale!r}")
    return scale


def _tma_view(t: torch.Tensor):
    """(rows, cols, row_stride, rb, cb) of a 2-D view of `[B, S, H, D]` with element (b, s, h, d) at
    row `b * rb + s`, column `b * cb + h * s_h + d`, or None when no such view exists."""
    B, S, H, D = t.shape
    sb, ss, sh, _ = t.stride()
    if ss <= 0 or sh < D or (H - 1) * sh + D > ss:
        return None
    if B == 1:
        return S, (H - 1) * sh + D, ss, 0, 0
    if sb % ss == 0 and sb // ss >= S:
        rb = sb // ss
        return (B - 1) * rb + S, (H - 1) * sh + D, ss, rb, 0
    if (B - 1) * sb + (H - 1) * sh + D <= ss and sb >= (H - 1) * sh + D:
        return S, (B - 1) * sb + (H - 1) * sh + D, ss, 0, sb
    return None


def _tma_ok(t: torch.Tensor) -> bool:
    esize = t.element_size()
    view = _tma_view(t)
    return (view is not None and t.data_ptr() % 16 == 0 and (view[2] * esize) % 16 == 0
            and (t.stride(2) * esize) % 16 == 0 and (view[4] * esize) % 16 == 0
            and t.shape[3] * esize >= 16)


def _descriptor(t: torch.Tensor, block_rows: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, cols, ss, _, _ = _tma_view(t)
    flat = t.as_strided((rows, cols), (ss, 1))
    return TensorDescriptor(flat, shape=[rows, cols], strides=[ss, 1], block_shape=[block_rows, t.shape[3]])


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@dataclass(frozen=True)
class StoreRoute:
    """Where the epilogue sends each output row (see `xstage.attention.ulysses`).

    dst_table: int64 [P] addresses of each rank's output buffer (16-byte aligned);
    row0: int32 [P+1] first gathered-sequence row of each rank (row0[P] = S);
    batch_stride, row_stride, head_stride: element strides of every rank's output `[B, S_p, H_total, D]`;
    head_offset: index of this rank's first head among H_total heads;
    sig_table: int64 [P] addresses of the int32 counter that rank p keeps for this source;
    sig_like: an int32 tensor on the kernel's device (types the counter pointers);
    paced: send each tile in chunks during the next tile's key loop (True), or store it whole in the
    epilogue (False, the burst exchange; kept for comparison).
    """

    dst_table: torch.Tensor
    row0: torch.Tensor
    batch_stride: int
    head_offset: int
    sig_table: torch.Tensor
    sig_like: torch.Tensor
    row_stride: int
    head_stride: int
    paced: bool = True


def launch_grid(q: torch.Tensor, config: FlashConfig | None = None) -> tuple[int, int]:
    """(programs, tiles per program) that `flash_attention(q, ..., config=config)` launches: query
    tiles `B x H x cdiv(S_q, block_m)` over `SMs x ctas_per_sm` programs (one per tile when
    `ctas_per_sm` is 0); program i takes tiles i, i + programs, ..."""
    B, S_q, H, D = q.shape
    cfg = config or default_config(D, q.dtype, q.device)
    n_tiles = B * H * triton.cdiv(S_q, cfg.block_m)
    grid = n_tiles if cfg.ctas_per_sm <= 0 else min(n_tiles, _num_sms(q.device) * cfg.ctas_per_sm)
    return grid, triton.cdiv(n_tiles, grid) if grid else 0


def trace_buffer(q: torch.Tensor, config: FlashConfig | None = None) -> torch.Tensor:
    """A zeroed trace for `flash_attention(q, ..., config=config, trace=...)`: int64
    `[programs, tiles_per_program + 1, TRACE_FIELDS]` on q's device (`launch_grid` gives both sizes).

    Row j < tiles_per_program of program i describes its j-th tile (tile `i + j * programs`; rows of
    tiles a program does not have stay 0: `flash_attention` zeroes the trace before it launches).
    Fields, all times from `%globaltimer` (ns, comparable across SMs):
    `TRACE_START` the tile's start; `TRACE_LOOP_END` its key loop's end (after the masked tail block and
    the normalisation); `TRACE_END` its epilogue's end (the store, or the staging write and the
    previous tile's remaining chunks and signals, or the burst's stores and signals: store issue, not
    landing); `TRACE_SEND_NS` the summed time that the paced sends (of the previous tile's chunks)
    inside its key loop took to issue (a store returns before it lands); `TRACE_CHUNKS` how many
    chunks those sends carried (chunks past the sequence's end, which send nothing, are not
    counted); `TRACE_SM` the SM it ran on.
    The last row (index tiles_per_program) holds what the program does after its tile loop (the paced
    exchange's last tile: all its chunks, then its signals; the burst exchange: its last signals):
    `TRACE_START` when it began, `TRACE_LOOP_END` when the last chunk was sent (= start without
    sends), `TRACE_END` after the signals, `TRACE_SEND_NS` / `TRACE_CHUNKS` those sends, `TRACE_SM`.
    In the interpreter the timers read 0 (the counts and SM 0 are still written).

    Example:
        >>> q = torch.zeros(1, 100, 2, 32)
        >>> trace_buffer(q, FlashConfig(block_m=32, ctas_per_sm=1)).shape   # 8 tiles on 4 CPU "SMs"
        torch.Size([4, 3, 6])
    """
    grid, per_prog = launch_grid(q, config)
    return torch.zeros(grid, per_prog + 1, TRACE_FIELDS, dtype=torch.int64, device=q.device)


def _chunk_rows(cfg: FlashConfig, head_dim: int) -> int:
    return min(cfg.chunk_rows or max(1, 2048 // head_dim), cfg.block_m)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    kv_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: FlashConfig | None = None,
    route: StoreRoute | None = None,
    launched: list | None = None,
    trace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Non-causal attention over `[B, S, H, D]` tensors; returns `out` (`[B, S_q, H, D]`, q's dtype).

    `kv_lens` (int32 [B], optional) limits batch b's keys to its first `kv_lens[b]` (padded
    sequences). `softmax_scale` defaults to `1/sqrt(D)`. `route` sends the output rows to other
    ranks' buffers instead of `out` (then `out` is this rank's own output buffer and is returned).
    `launched` (a list, optional) receives the compiled kernel of this call (None in the interpreter
    or when nothing is launched): its `.asm` holds the PTX and cubin Triton chose. `trace` (int64,
    optional, from `trace_buffer`; zeroed here first) receives per-tile timestamps; the kernel traced
    is a separate compilation (without `trace` no timer is read).

    Example:
        >>> q = k = v = torch.randn(2, 100, 4, 32, dtype=torch.float16)
        >>> flash_attention(q, k, v, kv_lens=torch.tensor([100, 37], dtype=torch.int32)).shape
        torch.Size([2, 100, 4, 32])
    """
    backend.require()
    _check_qkv(q, k, v)
    B, S_q, H, D = q.shape
    S_k = k.shape[1]
    scale = softmax_scale_value(softmax_scale, D)
    if config is not None and not isinstance(config, FlashConfig):
        raise InputError(f"config: expected a FlashConfig, got {type(config).__name__}")
    if kv_lens is not None:
        check_instance(kv_lens, "kv_lens", torch.Tensor, f"an int32 tensor of shape [{B}] or None")
        if kv_lens.shape != (B,) or kv_lens.dtype not in (torch.int32, torch.int64) or kv_lens.is_meta:
            raise InputError(f"kv_lens: expected an int32 tensor of shape [{B}] holding data, got {kv_lens.dtype} "
                             f"{tuple(kv_lens.shape)} on {kv_lens.device}")
        kv_lens = kv_lens.to(device=q.device, dtype=torch.int32)
    if out is not None:
        check_instance(out, "out", torch.Tensor, "a tensor like q or None")
    if route is None:
        if out is None:
            out = torch.empty(B, S_q, H, D, dtype=q.dtype, device=q.device)
        elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
            raise InputError(f"out: expected {tuple(q.shape)} {q.dtype} on {q.device} with unit stride in D")
    elif out is None:
        raise InputError("out: required with route (this rank's own output buffer)")
    cfg = config or default_config(D, q.dtype, q.device)
    grid, per_prog = launch_grid(q, cfg)
    if trace is not None:
        want = (grid, per_prog + 1, TRACE_FIELDS)
        if (not isinstance(trace, torch.Tensor) or trace.dtype != torch.int64 or tuple(trace.shape) != want
                or trace.device != q.device or not trace.is_contiguous()):
            raise InputError(f"trace: expected a contiguous int64 tensor of shape {list(want)} on {q.device} "
                             f"(see trace_buffer), got {getattr(trace, 'dtype', type(trace))} "
                             f"{list(getattr(trace, 'shape', []))} on {getattr(trace, 'device', '-')}")
        trace.zero_()  # the paced sends add to their rows
    if S_q == 0 or B == 0 or H == 0:
        if launched is not None:
            launched.append(None)
        return out
    n_m = triton.cdiv(S_q, cfg.block_m)
    n_tiles = B * H * n_m
    use_tma = cfg.use_tma
    tma_possible = (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9
                    and all(_tma_ok(t) for t in (q, k, v)))
    if use_tma is None:
        use_tma = tma_possible and not interpreter_active()
    elif use_tma and not (tma_possible or (interpreter_active() and all(_tma_ok(t) for t in (q, k, v)))):
        raise InputError("config.use_tma: the strides of q, k, v do not allow a TMA view")
    if use_tma:
        args_qkv = (_descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n))
        views = [_tma_view(t)[3:] for t in (q, k, v)]
    else:
        args_qkv = (q, k, v)
        views = [(0, 0)] * 3
    chunk_rows = _chunk_rows(cfg, D)
    paced = route is not None and route.paced
    if route is None:
        ex_args = (out, out, out, 0, 0, 0, out, out, out)
        o_strides = (out.stride(0), out.stride(1), out.stride(2))
    else:
        e = route
        # one [BLOCK_M, D] staging slot per program (paced exchange)
        stage = torch.empty(grid * cfg.block_m * D if paced else 1, dtype=out.dtype, device=out.device)
        ex_args = (e.dst_table, e.row0, e.batch_stride, e.row_stride, e.head_stride, e.head_offset,
                   e.sig_table, e.sig_like, stage)
        o_strides = (0, 0, 0)
    kernel = _attn_fwd_kernel[(grid,)](
        *args_qkv, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *o_strides,
        *views[0], *views[1], *views[2],
        kv_lens if kv_lens is not None else out, scale * LOG2E,
        H, S_q, S_k, n_m, n_tiles,
        *ex_args, trace if trace is not None else out,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, USE_TMA=use_tma,
        HAS_KV_LENS=kv_lens is not None, EXCHANGE=route is not None, PACED=paced, CHUNK_ROWS=chunk_rows,
        # fp32 inputs get fp32 products (tl.dot would round them to tf32 on a GPU by default)
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        TRACE=trace is not None, USE_PTX=use_ptx(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if launched is not None:
        launched.append(kernel)
    return out
