"""The communication context: one group's symmetric buffers, signal pad and error word.

Problem: a fused kernel on rank r stores tiles straight into buffers of the other ranks and signals
them with flags; it needs, for every buffer, the local tensor, a tensor (and a device address) for
each peer's copy, a place for flags, and a way to turn a device-side timeout into a host error.

Three paths say where "a peer's buffer" lives:

- `peer`: another GPU (or another process on the same GPU) through PyTorch symmetric memory, default
  CUDA backend: a plain store through a peer address is an NVLink write. One process per rank.
  Without a GPU the same API is backed by shared-memory files so that multi-process CPU tests (gloo,
  Triton interpreter) exercise the same code.
- `host` (loopback): one GPU plays rank r of a world of P ranks; the other ranks' buffers are mapped
  pinned host memory, so the stores cross PCIe (zero-copy) as they would cross NVLink.
- `hbm` (loopback): the same with the other ranks' buffers in local device memory (a control path).

Buffers are zero-filled at allocation. `close()` frees everything; the context is also a context
manager.

Example (loopback, runs on a CPU in the interpreter as well):

    ctx = create_context(path="hbm", loopback_world=4, rank=1)
    buf = ctx.alloc("tiles", (8, 64), torch.float32)
    buf.peers[2].fill_(1.0)              # the buffer "rank 2" would receive
    kernel[grid](buf.ptrs, buf.local, ctx.signal_pad.ptrs, ctx.error, ...)
    ctx.check()                          # raises CommTimeoutError(rank, peer, stage) after a timeout
    ctx.close()
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from xstage.backend import resolve_device
from xstage.bounds import INT64_MAX, MAX_RANKS, check_int
from xstage.comm.barrier import barrier_kernel, refuse_kernel
from xstage.comm.device import use_ptx, wait_bounds
from xstage.comm.stages import decode_error, stage_name
from xstage.errors import CommTimeoutError, InputError
from xstage.spec.stages import STAGE_BARRIER, STAGE_REFUSED

PATHS = ("hbm", "host", "peer")
DEFAULT_SIGNAL_SLOTS = 4096
# Arguments a rank can refuse on behalf of the group (`CommContext.refuse`): their position is the id
# every rank decodes, so the list only grows at its end.
REFUSABLE_ARGS = ["x", "topk_idx", "topk_weights", "w1t", "w2", "tokens",
                  "q", "k", "v", "softmax_scale", "seq_lens", "exchange", "mode", "config", "dropout_p", "causal",
                  "schedule", "pacing", "check", "static", "plan_on", "timeout_ns", "x_scale", "w1t_scale",
                  "w2_scale"]


def refusable_id(arg: str) -> int:
    """The id the group decodes for argument `arg` (past the list's end: an argument without a name)."""
    return REFUSABLE_ARGS.index(arg) if arg in REFUSABLE_ARGS else len(REFUSABLE_ARGS)


def refusal_error(rank: int, arg_id: int) -> InputError:
    """The error of every rank but `rank`, which refused the argument with id `arg_id` and raises its own."""
    name = REFUSABLE_ARGS[arg_id] if 0 <= arg_id < len(REFUSABLE_ARGS) else f"argument {arg_id}"
    return InputError(f"rank {rank} refused its {name} (its own error says why); every rank of the group "
                      "stops this call")
def timeout_error(rank: int, code: int, count: int, path: str, note: str = "") -> CommTimeoutError:
    """The error of a wait that timed out: error word `code` (`stage << 16 | peer`), `count` waits that
    gave up on `rank`, on `path`; `note` is added inside the parentheses."""
    stage, peer = decode_error(code)
    return CommTimeoutError(f"rank {rank}: wait for peer {peer} timed out at stage {stage_name(stage)} "
                            f"(stage id {stage}, path {path}, {count} wait(s) timed out{note})")


# The progress watchdog of every device wait: give up after this long without the awaited counter
# moving. Ranks sharing one GPU run in turns, so a peer can look idle for seconds; 20 s leaves room for
# that and still names a dead rank well within a minute.
DEFAULT_TIMEOUT_NS = 20_000_000_000
# A watchdog longer than an hour is a hang by another name; kernels compare it with int64 timer deltas.
MAX_TIMEOUT_NS = 3600 * 10**9
# Flags per rank: 4 MiB of int32 words, far above what any kernel here indexes (each loopback rank
# holds a copy).
MAX_SIGNAL_SLOTS = 1 << 20
# One buffer's bytes on one rank: 1 TiB, beyond the memory of any GPU or host.
MAX_ALLOC_BYTES = 1 << 40
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64)


@dataclass
class SymmBuffer:
    """One named buffer as seen by `rank`: `local`, the copy of every rank (`peers[q]`, with
    `peers[rank] is local`), and `ptrs`, an int64 tensor of their addresses on the context device
    (the device pointer table kernels index by rank)."""

    name: str
    local: torch.Tensor
    peers: list[torch.Tensor]
    ptrs: torch.Tensor
    rank: int
    handle: object = field(default=None, repr=False)

    @property
    def world(self) -> int:
        return len(self.peers)

    @property
    def ptr_list(self) -> list[int]:
        return [t.data_ptr() for t in self.peers]

    def peer(self, q: int) -> torch.Tensor:
        if not 0 <= q < self.world:
            raise InputError(f"peer {q}: must be in 0..{self.world - 1}")
        return self.peers[q]


class CommContext:
    """Owns the buffers of one group on one path; build with `create_context`, free with `close()`.

    Attributes: `path`, `rank`, `world`, `device`, `group` (None on loopback), `group_name`,
    `loopback` (True for `host`/`hbm`), `error` (int32[4] on the device, symmetric on `peer`: word 0
    the first error's code, word 1 the number of waits that gave up, word 2 a refused argument's id,
    word 3 set when the last barrier read a peer's refusal),
    `signal_pad` (a zeroed int32 `SymmBuffer` of `signal_slots` flags per rank), `timeout_ns` (the
    progress watchdog kernels should pass to waits).
    """

    def __init__(self, *, path, rank, world, device, group, signal_slots, timeout_ns):
        self.path = path
        self.rank = rank
        self.world = world
        self.device = device
        self.group = group
        self.loopback = path != "peer"
        self.group_name = None if group is None else getattr(group, "group_name", None)
        self.timeout_ns = int(timeout_ns)
        self._buffers: dict[str, SymmBuffer] = {}
        self._shm_files: list[str] = []
        self._shm_tag = None
        self.closed = False
        if path == "peer":
            self._init_peer_backend()
        # Word 0: the first error's code; 1: how many waits gave up; 2: a refused argument's id (`refuse`);
        # 3: "a peer refused the call" (the barrier sets it, the MoE reduce clears it). Symmetric on `peer`.
        self._errors = self.alloc("error", (4,), torch.int32)
        self.error = self._errors.local
        self.signal_pad = self.alloc("signal_pad", (signal_slots,), torch.int32)
        # Row 0: barriers each rank reached; rows 1-2: refusals, by the barrier's parity (`xstage.comm.barrier`).
        self._barrier_words = self.alloc("barrier", (3, world), torch.int32) if path == "peer" else None
        self._barrier_epoch = 0

    def _init_peer_backend(self) -> None:

        if self.device.type == "cuda":
            import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

            # Older torch needs the group enabled before a rendezvous; torch 2.11 and 2.13 keep the call
            # as a deprecated no-op (marked `__deprecated__`) that only prints a FutureWarning.
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None and getattr(enable, "__deprecated__", None) is None and self.group_name is not None:
                enable(self.group_name)
            return
        tag = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(tag, src=dist.get_global_rank(self.group, 0), group=self.group)
        self._shm_tag = tag[0]

    def _alloc_peer(self, name, shape, dtype) -> tuple[torch.Tensor, list[torch.Tensor], object]:
        if self.device.type == "cuda":
            import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

            local = symm_mem.empty(*shape, dtype=dtype, device=self.device)
            local.zero_()
            torch.cuda.synchronize(self.device)
            hdl = symm_mem.rendezvous(local, self.group_name or self.group)
            peers = [local if q == self.rank else hdl.get_buffer(q, tuple(shape), dtype)
                     for q in range(self.world)]
            return local, peers, hdl

        numel = math.prod(shape)
        nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
        files = [os.path.join(_shm_dir(), f"xstage-{self._shm_tag}-{name}-{q}") for q in range(self.world)]
        with open(files[self.rank], "wb") as f:
            f.truncate(nbytes)
        self._shm_files.append(files[self.rank])
        dist.barrier(group=self.group)
        peers = [torch.from_file(fn, shared=True, size=numel, dtype=dtype).view(shape) for fn in files]
        return peers[self.rank], peers, None

    def alloc(self, name: str, shape, dtype: torch.dtype = torch.float32) -> SymmBuffer:
        """A zeroed buffer of `shape` and `dtype` on every rank, with peer views and a pointer table.

        On `peer` every rank must call `alloc` with the same arguments in the same order."""
        if self.closed:
            raise InputError("context: closed; create a new one")
        if not isinstance(name, str) or not name or name in self._buffers:
            raise InputError(f"name {name!r}: must be a new non-empty string")
        dims = shape if isinstance(shape, (tuple, list)) else (shape,)
        if not dims:
            raise InputError(f"shape {shape!r}: give at least one dimension")
        shape = tuple(check_int(s, f"shape[{i}]", 1, INT64_MAX, "elements") for i, s in enumerate(dims))
        if dtype not in _DTYPES:
            raise InputError(f"dtype {dtype}: must be one of {[str(d) for d in _DTYPES]}")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > MAX_ALLOC_BYTES:
            raise InputError(f"shape {shape}: {nbytes} bytes of {dtype}, over the {MAX_ALLOC_BYTES} bytes one "
                             "buffer may take")
        handle = None
        if self.path == "peer":
            local, peers, handle = self._alloc_peer(name, shape, dtype)
        else:
            local = torch.zeros(shape, dtype=dtype, device=self.device)
            pin = self.path == "host" and self.device.type == "cuda"
            peers = [local if q == self.rank else
                     (torch.zeros(shape, dtype=dtype, pin_memory=True) if pin else
                      torch.zeros(shape, dtype=dtype, device=self.device))
                     for q in range(self.world)]
        ptrs = torch.tensor([t.data_ptr() for t in peers], dtype=torch.int64, device=self.device)
        buf = SymmBuffer(name=name, local=local, peers=peers, ptrs=ptrs, rank=self.rank, handle=handle)
        self._buffers[name] = buf
        return buf

    def buffer(self, name: str) -> SymmBuffer:
        if name not in self._buffers:
            raise InputError(f"buffer {name!r}: not allocated (have {sorted(self._buffers)})")
        return self._buffers[name]

    def check(self) -> None:
        """Raise `CommTimeoutError` naming rank, peer and stage if a device wait timed out, or the
        `InputError` of a peer that refused its inputs (`refuse`). Synchronises with the device (it
        reads the error word)."""
        code, count, arg, _ = (int(v) for v in self.error.cpu().tolist())
        if code == 0:
            return
        stage, peer = decode_error(code)
        if stage == STAGE_REFUSED:
            self.error.zero_()  # the call is abandoned on every rank; the group may go on
            raise refusal_error(peer, arg)
        raise timeout_error(self.rank, code, count, self.path)

    def refuse(self, arg: str) -> None:
        """This rank's `arg` failed its checks: stop the group's current call on every rank, which then
        raises an `InputError` naming this rank and `arg` (`check`: at once after a host barrier, later
        after a device barrier, whose call is skipped). Call it where the rank would otherwise arrive at
        the call's barrier; the caller raises its own, more detailed error. Synchronises this rank."""
        if self.path != "peer":
            return
        words = self._barrier_words
        refuse_kernel[(1,)](words.ptrs, words.local, self.rank, self.world, self._barrier_epoch + 1, refusable_id(arg),
                            num_warps=1)
        try:
            self.barrier()
        except InputError:
            pass  # this rank's own refusal, read back by the barrier's check

    def reset_error(self) -> None:
        self.error.zero_()

    def reset_signals(self) -> None:
        """Zero this rank's signal pad (call `barrier()` after it before peers signal again)."""
        self.signal_pad.local.zero_()

    def barrier(self, host: bool = True) -> None:
        """Wait for this rank's device work, then for every rank of the group. Bounded: a rank that does
        not arrive within the progress watchdog (`timeout_ns`) is named in a `CommTimeoutError`
        (`xstage.comm.barrier`). `host=False`: only enqueue the device barrier on the current stream
        (no host synchronisation, so CUDA graphs can capture it); a later `check()` reports a timeout."""
        if host and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.path != "peer":
            return
        self._barrier_epoch += 1
        on_gpu = use_ptx()
        words = self._barrier_words
        barrier_kernel[(1,)](words.ptrs, words.local, self.error, self.rank, self.world, self._barrier_epoch,
                             wait_bounds(self.timeout_ns, on_gpu)[1], STAGE=STAGE_BARRIER, STAGE_REFUSE=STAGE_REFUSED,
                             USE_PTX=on_gpu, num_warps=1)
        if host:
            self.check()

    def close(self) -> None:
        """Free every buffer of this context (idempotent)."""
        if self.closed:
            return
        self._buffers.clear()
        self.signal_pad = None
        for fn in self._shm_files:
            try:
                os.unlink(fn)
            except FileNotFoundError:
                pass
        self._shm_files.clear()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def check_timeout_ns(value, arg: str = "timeout_ns") -> int:
    """The progress watchdog of device waits: an integer number of ns in 1..`MAX_TIMEOUT_NS` (1 hour)."""
    return check_int(value, arg, 1, MAX_TIMEOUT_NS, "progress watchdog of device waits, in ns")


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


def create_context(
    group=None,
    *,
    path: str = "peer",
    loopback_world: int | None = None,
    rank: int | None = None,
    device=None,
    signal_slots: int = DEFAULT_SIGNAL_SLOTS,
    timeout_ns: int = DEFAULT_TIMEOUT_NS,
) -> CommContext:
    """Build the context for `group` (default: the world group) on `path`.

    `peer` needs `torch.distributed` initialised (one process per rank; a gloo group works, also
    for several ranks on one GPU with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1). `host` and `hbm`
    are loopback: this process plays rank `rank` (default: the group rank, else 0) of
    `loopback_world` ranks (default: the group size, else 2; at most `MAX_RANKS`). `device` defaults to
    the current CUDA device, or the CPU when there is none (Triton interpreter). `signal_slots` (flags
    per rank, 1..`MAX_SIGNAL_SLOTS`) and `timeout_ns` (1 ns..1 h) are integers; every argument is checked
    before anything is allocated.
    """
    if not isinstance(path, str) or path not in PATHS:
        raise InputError(f"path {path!r}: must be one of {PATHS}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise InputError(f"group={group!r}: must be a torch.distributed ProcessGroup or None")
    signal_slots = check_int(signal_slots, "signal_slots", 1, MAX_SIGNAL_SLOTS, "flags per rank")
    timeout_ns = check_timeout_ns(timeout_ns)
    if loopback_world is not None:
        loopback_world = check_int(loopback_world, "loopback_world", 1, MAX_RANKS, "ranks of the group")
    device = resolve_device(device)
    if path == "peer":

        if not dist.is_available() or not dist.is_initialized():
            raise InputError("path 'peer': torch.distributed must be initialised (one process per rank)")
        group = group or dist.group.WORLD
        g_rank, g_world = dist.get_rank(group), dist.get_world_size(group)
        if rank is not None and rank != g_rank:
            raise InputError(f"rank {rank}: on path 'peer' must equal the group rank {g_rank}")
        if loopback_world is not None and loopback_world != g_world:
            raise InputError(f"loopback_world {loopback_world}: only for host/hbm (group has {g_world})")
        return CommContext(path=path, rank=g_rank, world=g_world, device=device, group=group,
                           signal_slots=signal_slots, timeout_ns=timeout_ns)
    world = loopback_world
    if world is None:
        world = check_int(_group_size(group), "the group's size", 1, MAX_RANKS, "ranks of the group") \
            if group is not None else 2
    if rank is None:
        rank = _group_rank(group) if group is not None else 0
    rank = check_int(rank, "rank", 0, world - 1, f"this rank, of loopback_world {world}")
    return CommContext(path=path, rank=rank, world=world, device=device, group=None,
                       signal_slots=signal_slots, timeout_ns=timeout_ns)


def _group_size(group) -> int:

    return dist.get_world_size(group)


def _group_rank(group) -> int:

    return dist.get_rank(group)
