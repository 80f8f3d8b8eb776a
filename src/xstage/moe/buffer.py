"""The MoE context: capacities, device buffers, counters and signals of one EP group member.

Problem: the fused kernel needs receive/activation buffers, a combine buffer every peer can store
into, readiness counters, completion signals and an error word, all sized once from
`num_max_tokens_per_rank, num_experts, topk, hidden, intermediate` and the group, and reused (the
counters reset themselves, so calls can be captured in a CUDA graph).

Groups:
- `LoopbackGroup(num_ranks, path)`: one GPU plays rank 0 of an EP group of `num_ranks`. Peers are
  synthesised from the same routing (see `reference.loopback_inputs`): dispatch pulls from the local
  `x`, and combine rows meant for peers go to the `path` destination: `hbm` (a device buffer) or
  `host` (pinned host memory over PCIe, a store path with a finite drain rate).
- a `torch.distributed` process group: buffers are PyTorch symmetric memory; peers are reached
  through peer-relative offsets (`map(p, r) = p + base[r] - base[self]`).

Device and dtype: `device` defaults to the current CUDA device, else the CPU, as `create_context`
does; `dtype` (default bf16) must be fp16 or fp32 where kernels run in Triton's CPU interpreter, whose
bf16 `tl.dot` is wrong (`xstage.backend.refuse_interpreter_bf16`). Every size is an integer in a stated
range (`MAX_TOKENS_PER_RANK`, `MAX_EXPERTS`, `MAX_HIDDEN`, `xstage.bounds.MAX_RANKS`), checked before
anything is allocated.

Row pool (`pool_bytes=`): the received rows and their activations live in a pool of `pool_units`
slots of `block_m` rows, reused in unit order as units finish (unit u takes the slot of unit
u - pool_units once its Linear-2 tasks are done; the dispatch waits for it, under the watchdog). Any
legal routing therefore fits in bounded memory; only int32 row metadata is sized for the worst case.
The default (`DEFAULT_POOL_BYTES`) is 256 MiB; the pool holds at least `MIN_POOL_UNITS` units (or
every unit a routing can make, if fewer), and a `pool_bytes` below that is refused. An order that
needs more units in flight than the pool holds (`lag:k` needs k + 2) is refused when planned.
`capacity_factor` is deprecated: it sizes the pool the way it sized the buffers before.

Watchdog (`timeout_ns=`, default `xstage.comm.DEFAULT_TIMEOUT_NS`, 20 s): every device wait of this
buffer's calls, and the group barrier, gives up after that long without progress of what it waits
for; `check()` then raises `CommTimeoutError` naming this rank, the silent peer and the stage.

Errors the device records: the error word `err` (int32[4]: the first timeout's or a peer's refusal's
code, the timed-out waits, the refused argument, "a peer refused this call") and `bad_ids` (int64[3]:
how many expert ids of this rank's `topk_idx` were outside [0, E), the first one in (token, slot)
order, and a word the reduce kernel uses while it finds that one). Calls are
counted (`calls`); an asynchronously checked call (`fused_moe(check="async")`) has its words moved
into a row of a small pinned ring by its reduce kernel, with a CUDA event, and a later call raises
what a completed row holds without waiting. `check()` synchronises and raises the earliest error,
naming its call; each error is raised once.

FP8 (`dtype="fp8"` or `torch.float8_e4m3fn`): rows cross, and Linear-1/Linear-2 run, in e4m3 with
the DeepSeek-V3 scales of `xstage.moe.fp8` (1x128 per row for activations, 128x128 for weights);
the combine rows and the output stay BF16 (`out_dtype`). Hidden and intermediate sizes must be
multiples of 128, and the blocks match the scale blocks (`block_k` = `block_n1` = 128, `block_n2`
dividing 128; no TMA loads yet).

Store pacing (`pacing=`, `xstage.moe.pacing`): the pacing of the combine's remote stores.
`"auto"` (the default) is the planner's choice per token bucket and schedule; `"default"` the
fixed default of the store path (paced on `host`, where that was measured to pay); `"off"` or None
stores unpaced; `"RATE:BUDGET"` or a `StorePacing` sets rate and budget. Fixed pacings are resolved
once at construction. A call overrides it with `fused_moe(..., pacing=...)`.

Calibration (`calibration=`, `xstage.sched.calibration`): a folder of a user's own measurements (a
store path's profile, the kernel's tile costs) that `model_guided` and `pacing="auto"` decide with
instead of the embedded H200 calibration; by default the folder of the setting `XSTAGE_CALIBRATION`,
else the embedded one. Each decision names what it used (`MoEBuffer.decisions()`).

Example:
    >>> from xstage.moe.buffer import BlockConfig, MoEBuffer, LoopbackGroup
    >>> buf = MoEBuffer(num_max_tokens_per_rank=64, num_experts=8, topk=2, hidden=64, intermediate=64,
    ...                 group=LoopbackGroup(2), device="cpu", dtype="fp16",
    ...                 config=BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32))
    >>> buf.num_local_experts, buf.total_bytes() > 0
    (4, True)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from xstage.backend import refuse_interpreter_bf16, resolve_device
from xstage.bounds import INT32_MAX, INT64_MAX, MAX_RANKS, check_int, check_real
from xstage.comm import DEFAULT_TIMEOUT_NS, create_context
from xstage.comm.context import check_timeout_ns, refusal_error, timeout_error
from xstage.comm.stages import decode_error
from xstage.dtypes import DTYPES, FP8_DTYPES, parse_dtype
from xstage.errors import InputError, XstageError
from xstage.moe.decision import MoEDecision, cached, force, token_bucket
from xstage.moe.fp8 import BLOCK as FP8_BLOCK  # the DeepSeek-V3 scale block
from xstage.sched.calibration import calibration_of
from xstage.sched.pacing import resolve_pacing
from xstage.spec.moe import (  # the names of this module before xstage.spec, re-exported
    FP8_BLOCK_CONFIG,
    MAX_EXPERTS,
    MAX_HIDDEN,
    MAX_TOKENS_PER_RANK,
    BlockConfig,
    max_units,
    pool_units,
)
from xstage.spec.pacing import AUTO, StorePacing
from xstage.spec.stages import (  # noqa: F401  (the MoE waits' ids, named in xstage.spec.stages)
    STAGE_BUFFER_FREE,
    STAGE_COMBINE_DONE,
    STAGE_L1_WAIT,
    STAGE_L2_WAIT,
    STAGE_PLAN_BARRIER,
    STAGE_POOL_SLOT,
    STAGE_REFUSED,
    STAGE_STORE_PACING,
)
from xstage.spec.variant import Variant

MAX_BUFFER_BYTES = 96 << 30
SHARED_BYTES = 232448  # shared memory one CTA may use on Hopper (227 KiB)


@dataclass
class LoopbackGroup:
    """One GPU standing in for rank 0 of `num_ranks`; `silent_ranks` never signal (tests the timeouts)."""

    num_ranks: int
    path: str = "hbm"
    silent_ranks: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        self.num_ranks = check_int(self.num_ranks, "LoopbackGroup num_ranks", 1, MAX_RANKS, "ranks of the EP group")
        if self.path not in ("hbm", "host"):
            raise InputError(f"LoopbackGroup path={self.path!r}: must be 'hbm' or 'host'")
        if not isinstance(self.silent_ranks, (tuple, list)):
            raise InputError(f"LoopbackGroup silent_ranks={self.silent_ranks!r}: must be a tuple of ranks")
        self.silent_ranks = tuple(check_int(q, "LoopbackGroup silent_ranks", 0, self.num_ranks - 1, "a rank")
                                  for q in self.silent_ranks)


def stage_bytes(cfg: BlockConfig, elem: int) -> int:
    """Shared memory of one pipeline stage of the main kernel: the operand tiles of one K step."""
    return (cfg.block_m + max(2 * cfg.block_n1, cfg.block_n2)) * cfg.block_k * elem


def default_block_config(dtype: torch.dtype, fp8: bool = False) -> BlockConfig:
    """The tiles of a buffer that names none: FP8's for an FP8 buffer, else `BlockConfig()` with as many
    of its stages as fit shared memory at `dtype`'s element size. Its blocks are sized for 2-byte
    operands; float32 keeps them with 2 of the 4 stages (on Hopper) instead of refusing."""
    if fp8:
        return FP8_BLOCK_CONFIG
    c = BlockConfig()
    fit = SHARED_BYTES // stage_bytes(c, torch.tensor([], dtype=dtype).element_size())
    return c if fit >= c.num_stages else dataclasses.replace(c, num_stages=max(1, fit))


class MoEBuffer:
    """Buffers and signals of one rank of an expert-parallel MoE layer (see module docstring)."""

    def __init__(self, num_max_tokens_per_rank, num_experts, topk, hidden, intermediate, group=None, *,
                 device=None, dtype=torch.bfloat16, config: BlockConfig | None = None,
                 pool_bytes: int | None = None, capacity_factor: float | None = None,
                 max_bytes: int = MAX_BUFFER_BYTES, pacing="auto", timeout_ns: int = DEFAULT_TIMEOUT_NS,
                 calibration=None):
        self.T_max = check_int(num_max_tokens_per_rank, "num_max_tokens_per_rank", 1, MAX_TOKENS_PER_RANK,
                               "tokens per rank in one call")
        self.timeout_ns = check_timeout_ns(timeout_ns)
        # What `model_guided` and `pacing="auto"` decide with: a user's folder, loaded (and a bad one
        # refused) before anything is allocated; None: the setting XSTAGE_CALIBRATION, else the embedded.
        self.calibration = calibration_of(calibration) if calibration is not None else None
        self.E = check_int(num_experts, "num_experts", 1, MAX_EXPERTS, "experts of the layer")
        self.K = check_int(topk, "topk", 1, self.E, "experts per token, at most num_experts")
        self.H = check_int(hidden, "hidden", 1, MAX_HIDDEN, "elements per row")
        self.I = check_int(intermediate, "intermediate", 1, MAX_HIDDEN, "elements per expert row")
        max_bytes = check_int(max_bytes, "max_bytes", 1, INT64_MAX, "bytes the buffers may take")
        self.dtype = parse_dtype(dtype, allowed=(*DTYPES, *FP8_DTYPES))
        refuse_interpreter_bf16(self.dtype)
        self.fp8 = self.dtype in FP8_DTYPES.values()
        if config is not None and not isinstance(config, BlockConfig):
            raise InputError(f"config={config!r}: must be a BlockConfig or None")
        self.cfg = config or default_block_config(self.dtype, self.fp8)
        self.out_dtype = torch.bfloat16 if self.fp8 else self.dtype  # combine rows and the output
        # The same default as `create_context`: the current CUDA device, else the CPU (interpreter).
        self.device = resolve_device(device)
        self.group = group if group is not None else LoopbackGroup(1)
        self.loopback = isinstance(self.group, LoopbackGroup)
        if self.loopback:
            self.R, self.rank = self.group.num_ranks, 0
        elif isinstance(self.group, dist.ProcessGroup):

            self.R, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        else:
            raise InputError(f"group={group!r}: must be a LoopbackGroup, a torch.distributed ProcessGroup or None")
        if self.E % self.R:
            raise InputError(f"num_experts={self.E}: must be a multiple of the group size {self.R}")
        c = self.cfg
        for name, v, b in (("hidden", self.H, c.block_k), ("hidden", self.H, c.block_d),
                           ("intermediate", self.I, c.block_n1), ("intermediate", self.I, c.block_k)):
            if v % b:
                raise InputError(f"{name}={v}: must be a multiple of {b} (block config)")
        if self.H % 8:
            raise InputError(f"hidden={self.H}: must be a multiple of 8 (16-byte rows)")
        if self.fp8:
            self._check_fp8_blocks()
        elem = torch.tensor([], dtype=self.dtype).element_size()
        stage = stage_bytes(c, elem)
        if c.num_stages * stage > SHARED_BYTES:
            raise InputError(f"num_stages={c.num_stages}: {c.num_stages} x {stage} bytes of operand tiles exceed "
                             f"the {SHARED_BYTES} bytes of shared memory per CTA (fewer stages or smaller blocks)")
        self.E_local = self.E // self.R
        # Units any legal routing can make: every (token, slot) pair of the group on this rank's experts,
        # each expert padding its last unit. Only int32 metadata is sized for them; rows live in the pool.
        self.units_cap = max_units(self.R, self.T_max, self.K, self.E_local, c.block_m)
        self.rows_cap = self.units_cap * c.block_m
        if self.rows_cap > INT32_MAX:  # row indices and counters are int32 in the kernels
            raise InputError(f"num_max_tokens_per_rank={self.T_max}: {self.R} ranks x {self.T_max} tokens x "
                             f"top-{self.K} make {self.rows_cap} row slots, over the {INT32_MAX} int32 row indices "
                             "hold")
        self.pool_units = self._pool_units(pool_bytes, capacity_factor, elem)
        self._check_size(max_bytes)
        self._plans: dict = {}
        self._steady: dict = {}  # (schedule, pacing, tokens) -> a steady call's prologue (`device_plan`)
        # Decisions per (request, CTAs, token bucket) and forced variants per bucket (`xstage.moe.decision`).
        self._decisions: dict = {}
        self._forced: dict = {}
        self.calls = 0  # fused_moe calls on this buffer (errors name them)
        self._live_since = 1  # the first call whose errors may still be in the device words
        self._captured = (0, 0)  # the first and last call captured in a CUDA graph (replays report nothing)
        self._allocate()
        self._pacing = AUTO if isinstance(pacing, str) and pacing == AUTO else resolve_pacing(
            pacing, self.store_path, self.R)

    def _check_fp8_blocks(self) -> None:
        c = self.cfg
        for name, v in (("hidden", self.H), ("intermediate", self.I)):
            if v % FP8_BLOCK:
                raise InputError(f"{name}={v}: must be a multiple of {FP8_BLOCK} with dtype fp8 (the scale blocks)")
        for name, v in (("block_k", c.block_k), ("block_n1", c.block_n1)):
            if v != FP8_BLOCK:
                raise InputError(f"{name}={v}: must be {FP8_BLOCK} with dtype fp8 (one scale block per tile)")
        if FP8_BLOCK % c.block_n2:
            raise InputError(f"block_n2={c.block_n2}: must divide {FP8_BLOCK} with dtype fp8 (one weight-scale row "
                             "per tile)")

    def _pool_units(self, pool_bytes, capacity_factor, elem: int) -> int:
        """Units of `block_m` rows the receive and activation pool holds (see the module docstring)."""
        unit_bytes = self.cfg.block_m * (self.H + self.I) * elem
        if self.fp8:  # each row's 1x128 scales, float32
            unit_bytes += self.cfg.block_m * (self.H + self.I) // FP8_BLOCK * 4
        if capacity_factor is not None:
            warnings.warn("MoEBuffer(capacity_factor=...) is deprecated: the rows live in a pool reused as units "
                          "finish, so any routing fits; pass pool_bytes= to size the pool", DeprecationWarning,
                          stacklevel=3)
            if pool_bytes is None:
                capacity_factor = check_real(capacity_factor, "capacity_factor", 1e-6, self.R * self.E,
                                             "rows per token and slot")
                rows = int(capacity_factor * self.T_max * self.K) + self.E_local * (self.cfg.block_m - 1)
                pool_bytes = -(-rows // self.cfg.block_m) * unit_bytes
        return pool_units(pool_bytes, unit_bytes, self.units_cap)

    @property
    def pool_rows(self) -> int:
        """Rows of the receive and activation pool."""
        return self.pool_units * self.cfg.block_m

    @property
    def store_path(self) -> str:
        """Where rows for other ranks go: the loopback path, or `peer` in a real group."""
        return self.group.path if self.loopback else "peer"

    @property
    def pacing(self) -> StorePacing | str | None:
        """The pacing of the combine's remote stores (`xstage.comm.pacing`): a StorePacing, None when
        off, or `"auto"` when the planner chooses it per call (`xstage.moe.pacing.choose_pacing`)."""
        return self._pacing

    @property
    def num_local_experts(self) -> int:
        return self.E_local

    def decisions(self) -> list[MoEDecision]:
        """The decisions cached on this buffer: what `model_guided` (a schedule chosen per call) and
        `pacing="auto"` run, one per request, CTA count and token bucket (`xstage.moe.decision`)."""
        return cached(self)

    def force_decision(self, tokens, variant) -> list[tuple[int, int]]:
        """Force `variant` (`SCHEDULE[@PACING]`, e.g. `"lag:2@off"`) over the planner for calls of
        `tokens` tokens: a count (its bucket) or a range `(lo, hi)` of whole buckets; returns the buckets.
        An order replaces what a per-call name would choose, a pacing what `"auto"` would (see
        `xstage.moe.decision`)."""
        return force(self, tokens, variant)

    def forced_decisions(self) -> dict[tuple[int, int], Variant]:
        """The variants forced per token bucket `(lo, hi)`."""
        return {token_bucket(hi, self.T_max): v for hi, v in sorted(self._forced.items())}

    def clear_decisions(self) -> None:
        """Drop the cached and the forced decisions: the next calls ask the planner again."""
        self._decisions.clear()
        self._forced.clear()
        self._steady.clear()

    def nbytes(self) -> dict[str, int]:
        """Bytes of each buffer (device unless noted); `total_bytes()` sums them."""
        e = torch.tensor([], dtype=self.dtype).element_size()
        out_e = torch.tensor([], dtype=self.out_dtype).element_size()
        out = {
            "recv": self.pool_rows * self.H * e,
            "act": self.pool_rows * self.I * e,
            "combine": self.K * self.T_max * self.H * out_e,
            "x": 0 if self.loopback else self.T_max * self.H * e,
            "counters": 4 * (self.units_cap + 8 + 4 * self.R),
        }
        if self.fp8:
            out["scales"] = 4 * (self.pool_rows + (0 if self.loopback else self.T_max)) * self.H // FP8_BLOCK \
                + 4 * self.pool_rows * self.I // FP8_BLOCK
        if self.loopback and self.group.path == "host" and self.R > 1:
            out["combine_host"] = out["combine"]
        return out

    def total_bytes(self) -> int:
        return sum(self.nbytes().values())

    def _check_size(self, max_bytes: int) -> None:
        total = self.total_bytes()
        if total > max_bytes:
            parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in self.nbytes().items())
            raise InputError(
                f"MoE buffer needs {total / 2**30:.2f} GiB ({parts}), over the limit {max_bytes / 2**30:.1f} GiB: "
                f"reduce num_max_tokens_per_rank, topk, hidden or pool_bytes")

    def _allocate(self) -> None:
        dev, R = self.device, self.R
        i32 = dict(dtype=torch.int32, device=dev)
        # Zeroed once: TMA reads whole row blocks, and rows past a unit's valid rows must hold finite values.
        self.recv = torch.zeros(self.pool_rows, self.H, dtype=self.dtype, device=dev)
        self.act = torch.zeros(self.pool_rows, self.I, dtype=self.dtype, device=dev)
        # FP8: the 1x128 scales of the pool's rows; otherwise a word the kernel never reads
        n_h, n_i = (self.H // FP8_BLOCK, self.I // FP8_BLOCK) if self.fp8 else (1, 1)
        rows = self.pool_rows if self.fp8 else 1
        self.recv_scale = torch.zeros(rows, n_h, dtype=torch.float32, device=dev)
        self.act_scale = torch.zeros(rows, n_i, dtype=torch.float32, device=dev)
        self.xs_delta = torch.zeros(R, dtype=torch.int64, device=dev)  # peers' x_scale, in float32 words
        self.x_scale_buf = None
        self.ready = torch.zeros(self.units_cap, **i32)
        self.sync = torch.zeros(4, **i32)  # done CTAs, iteration, done reduce programs, next task (dynamic)
        self.pace_clock = torch.zeros(1, dtype=torch.int64, device=dev)  # ns; see xstage.comm.pacing
        self.err = torch.zeros(4, **i32)  # as `CommContext.error` (symmetric in a real group)
        self.bad_ids = torch.zeros(3, dtype=torch.int64, device=dev)  # count, first, the reduce's scratch
        self._reports = _Reports(dev)
        self.sig_slot = torch.full((R,), self.rank, **i32)
        elem = torch.tensor([], dtype=self.out_dtype).element_size()  # of the combine rows
        if self.loopback:
            self.combine = torch.empty(self.K, self.T_max, self.H, dtype=self.out_dtype, device=dev)
            self.sig = torch.zeros(3 * R + 1, **i32)
            self.x_buf = None
            self.sig_delta = torch.zeros(R, dtype=torch.int64, device=dev)
            self.sig_slot = torch.arange(R, **i32)
            for q in self.group.silent_ranks:
                self.sig_slot[q] = 2 * R  # words 2R and 3R: scratch nobody waits on
            comb_delta = [0] * R
            self.combine_host = None
            if self.group.path == "host" and R > 1:
                self.combine_host = torch.empty(self.K, self.T_max, self.H, dtype=self.out_dtype,
                                                pin_memory=dev.type == "cuda")
                d = (self.combine_host.data_ptr() - self.combine.data_ptr()) // elem
                comb_delta = [0] + [d] * (R - 1)
            self.x_delta = torch.zeros(R, dtype=torch.int64, device=dev)
            self.comb_delta = torch.tensor(comb_delta, dtype=torch.int64, device=dev)
            # Rows of experts on rank o came back from virtual peer (R - o) % R.
            self.read_delta = torch.tensor([comb_delta[(R - o) % R] for o in range(R)], dtype=torch.int64, device=dev)
        else:
            self._allocate_symmetric(elem)

    def _allocate_symmetric(self, elem: int) -> None:

        R, dev = self.R, self.device
        self.ctx = create_context(self.group, path="peer", device=dev, timeout_ns=self.timeout_ns)
        x = self.ctx.alloc("moe_x", (self.T_max, self.H), self.dtype)
        idx = self.ctx.alloc("moe_topk_idx", (self.T_max, self.K), torch.int64)
        comb = self.ctx.alloc("moe_combine", (self.K, self.T_max, self.H), self.out_dtype)
        if self.fp8:
            xs = self.ctx.alloc("moe_x_scale", (self.T_max, self.H // FP8_BLOCK), torch.float32)
            self.x_scale_buf = xs.local
            self.xs_delta = ((xs.ptrs - xs.ptrs[self.rank]) // 4).contiguous()
        sig = self.ctx.alloc("moe_signals", (3 * R + 1,), torch.int32)
        self.x_buf, self.combine, self.sig = x.local, comb.local, sig.local
        self.idx_buf, self.idx_peers = idx.local, idx.peers
        self.err = self.ctx.error
        self.x_delta = ((x.ptrs - x.ptrs[self.rank]) // x.local.element_size()).contiguous()
        self.comb_delta = ((comb.ptrs - comb.ptrs[self.rank]) // elem).contiguous()
        self.sig_delta = ((sig.ptrs - sig.ptrs[self.rank]) // 4).contiguous()
        self.read_delta = torch.zeros(R, dtype=torch.int64, device=dev)
        self.combine_host = None
        self.ctx.barrier()

    def barrier(self, host: bool = True) -> None:
        """The group's barrier (inputs written before peers pull them); `host=False` only enqueues the
        device barrier (`CommContext.barrier`), whose timeout or refusal a later check reads."""
        if not self.loopback:
            self.ctx.barrier(host=host)

    def begin_call(self) -> int:
        """Count a `fused_moe` call; its number."""
        self.calls += 1
        return self.calls

    def report_row(self) -> torch.Tensor:
        """The pinned row the next call's reduce kernel reports into (`fused_moe(check="async")`)."""
        return self._reports.row()

    def reported(self, call: int) -> None:
        """Record (after its kernels are enqueued) that `call` reports into the row `report_row` gave,
        covering the calls since the device words were last read."""
        self._reports.commit(self._live_since, call)
        self._live_since = call + 1

    def captured(self, call: int) -> None:
        """Record that `call` was captured in a CUDA graph: errors of its replays stay in the device
        words until `check()`, which names it."""
        lo, hi = self._captured
        self._captured = (lo or call, call)

    def raise_reported(self) -> None:
        """Raise the earliest error whose report has arrived, without waiting; the newest report (the
        call that asks) is left for a later call, as on a GPU it has not arrived yet."""
        self._reports.collect(wait=False, limit=len(self._reports.pending) - 1)
        self._raise_first()

    def check(self) -> None:
        """Synchronise, then raise the earliest error of this buffer's calls, naming the call: an
        `InputError` for an expert id out of range or a peer's refusal of its inputs
        (`CommContext.refuse`), `CommTimeoutError` for a device wait that timed out. Each error is
        raised once (its words are cleared); a later `check()` raises the next one, if any."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._reports.collect(wait=True)
        words = (*self.err[:3].tolist(), *self.bad_ids[:2].tolist())
        if words[0] or words[3]:
            self.err.zero_()
            self.bad_ids.zero_()
            # The calls whose errors the words can hold: those since they were last read, and captured ones.
            first, last = self._live_since, self.calls
            lo, hi = self._captured
            if lo and first > last:
                first, last = lo, hi
            elif lo:
                first, last = min(first, lo), max(last, hi)
            self._reports.errors.append((first, last, words))
        self._live_since = self.calls + 1
        self._raise_first()

    def _raise_first(self) -> None:
        if self._reports.errors:
            first, last, words = self._reports.errors.popleft()
            raise self._error(words, first, last)

    def _error(self, words, first: int, last: int) -> XstageError:
        """The error the words of calls `first`..`last` hold (a refusal, then ids, then a timeout)."""
        code, count, arg, n_bad, bad = (int(w) for w in words)
        if not last:
            call = []
        elif first > last:  # no call since the words were last read (a barrier of the buffer's own)
            call = [f"after fused_moe call {last}"]
        else:
            call = [f"fused_moe call {last}" if first == last else f"fused_moe calls {first}-{last}"]

        def note(*parts):
            return f" ({'; '.join(parts)})" if parts else ""

        stage, peer = decode_error(code)
        if code and stage == STAGE_REFUSED:
            return InputError(f"{refusal_error(peer, arg)}{note(*call)}")
        # The words of `last - first + 1` calls can count at most that many calls' ids, all outside
        # [0, E): anything else was written by something other than the reduce kernel, and is no count.
        most = (max(last, first) - min(last, first) + 1) * self.T_max * self.K
        if n_bad < 0 or n_bad > most or (n_bad and 0 <= bad < self.E):
            what = f"the bad-id words were overwritten (count {n_bad}, at most {most} possible)"
            if code:
                return timeout_error(self.rank, code, count, self.store_path,
                                     "".join(f"; {c}" for c in [*call, what]))
            return XstageError(f"rank {self.rank}: {what}{note(*call)}")
        if n_bad:
            rank = "" if self.loopback else f"rank {self.rank}: "
            more = [f"{n_bad} ids out of range"] if n_bad > 1 else []
            return InputError(f"{rank}topk_idx: value {bad} out of range [0, {self.E}){note(*more, *call)}")
        return timeout_error(self.rank, code, count, self.store_path, "".join(f"; {c}" for c in call))


# Rows of the report ring: a host that runs this many calls ahead of the device waits for the oldest
# (a synchronisation). 64 rows made 200 back-to-back calls of a 150 us kernel wait on every call after
# the 64th, so the host time measured inside a call was the kernel's (H200 run of 07bba47); with
# 1024 rows (64 KiB of pinned memory, three launches a call) CUDA's launch queue fills first.
REPORT_ROWS = 1024
REPORT_WORDS = 8  # err[0..2], bad_ids[0..1], unused


class _Reports:
    """The pinned ring the reduce kernel reports a call's error words into, and the events that say a
    row has arrived; `errors` holds `(first call, last call, words)` of arrived rows that hold an error."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.rows = torch.zeros(REPORT_ROWS, REPORT_WORDS, dtype=torch.int64, pin_memory=self.cuda)
        self.views = self.rows.unbind(0)  # made once: indexing makes a view each call (a microsecond)
        self.events = [None] * REPORT_ROWS
        self.pending: deque = deque()  # (row, first call, last call), oldest first
        self.errors: deque = deque()
        self.next = 0

    def row(self) -> torch.Tensor:
        if len(self.pending) == REPORT_ROWS:
            self.collect(wait=True, limit=1)
        return self.views[self.next]

    def commit(self, first: int, last: int) -> None:
        i = self.next
        if self.cuda:
            if self.events[i] is None:
                self.events[i] = torch.cuda.Event()
            # On the stream the call's kernels went to (`backend.Launch` launches on the current device's
            # current stream), named by device index: `record()` with no stream finds the device through
            # `torch.cuda.is_available()` and more, 18% of a call under cProfile on an H100 host
            # (benchmarks/results/h100-moe-call-host/profile-7b3b51f/).
            self.events[i].record(torch.cuda.current_stream(torch.cuda.current_device()))
        self.pending.append((i, first, last))
        self.next = (i + 1) % REPORT_ROWS

    def collect(self, wait: bool, limit: int | None = None) -> None:
        """Read the rows that have arrived, oldest first (`wait`: wait for each)."""
        n = 0
        while self.pending and (limit is None or n < limit):
            i, first, last = self.pending[0]
            ev = self.events[i]
            if ev is not None and not ev.query():
                if not wait:
                    return
                ev.synchronize()
            self.pending.popleft()
            n += 1
            words = self.views[i].tolist()[:5]  # the premade view of the row: indexing `rows` costs ~10x more
            if words[0] or words[3]:
                self.errors.append((first, last, words))
