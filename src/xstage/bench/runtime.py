"""The torchrun runtime of the distributed grids (`moe_dist`, `ulysses_dist`): one process per rank.

Problem: both grids start under torchrun, join one process group, start their timed runs together,
count the slowest rank, print from rank 0 and must leave without leaving a peer hanging in a
collective. `Runtime` does that once for both:

- `Runtime.start()` reads torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, switches
  NVLink multicast off (`MULTICAST_OFF`, before NCCL, symmetric memory or NVSHMEM initialise), picks
  the device and joins the group: NCCL when every local rank has its own GPU; gloo when ranks share a
  GPU (NCCL refuses that; `TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1` lets symmetric memory map them)
  or on the CPU (Triton's interpreter). Gloo runs check correctness; their timings mean nothing.
- A gloo control group carries barriers, rank 0's decisions and the maxima over ranks, so those never
  queue behind device work (on a gloo world it is the world group).
- `barrier` (device idle, then a host barrier), `sync_start` (the same, then on NCCL a one-element
  all-reduce that every stream leaves at once and a device sleep that covers the host's launches),
  `max_over_ranks`, `timings` (per run the slowest rank, then `xstage.results.timing_summary`), `log`
  (rank 0 prints), and teardown: `with rt:` destroys the group on success; on an exception it prints
  the traceback and leaves at once, so that the launcher stops the ranks waiting in a collective.

Example (under `torchrun --nproc-per-node 2`):
    rt = Runtime.start()
    with rt:
        rt.sync_start()
        rt.log(f"{rt.world} ranks, {rt.backend}, slowest: {rt.max_over_ranks([float(rt.rank)])}")
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import traceback
from collections.abc import Sequence

import torch
import torch.distributed as dist

from xstage import backend as xstage_backend
from xstage.dtypes import parse_dtype
from xstage.errors import InputError
from xstage.results import Timing, synchronize, timing_summary

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BACKENDS = ("nccl", "gloo")
# cycles of the device sleep after a synchronised start (~2 ms at the H200's 1.98 GHz): the host
# enqueues the run meanwhile, so its launch overhead stays out of the measurement
SLEEP_CYCLES = 4_000_000


def multicast_off() -> None:
    """NVLink multicast stays off in this process (and the processes it starts)."""
    os.environ.update(MULTICAST_OFF)


def check_repeats(warmup: int, rep: int) -> None:
    if warmup < 0 or rep < 1:
        raise InputError(f"--warmup {warmup}, --rep {rep}: need warmup >= 0 and rep >= 1")


class Runtime:
    """This process's rank in the torchrun group: `rank`, `world`, `device`, `backend`, `group` (the
    world group, for data) and `ctrl` (gloo, for control). Build it with `Runtime.start()`."""

    def __init__(self, rank: int, world: int, device: torch.device, backend: str, group, ctrl):
        self.rank, self.world, self.device, self.backend = rank, world, device, backend
        self.group, self.ctrl = group, ctrl
        # gloo moves CPU tensors only here: device tensors cross through host copies (correctness runs)
        self.stage_on_host = backend == "gloo" and device.type == "cuda"
        self._token = torch.zeros(1, device=device) if self.nccl else None

    @classmethod
    def start(cls, backend: str | None = None, timeout_s: float | None = None, name: str = "xstage") -> Runtime:
        """Join the group torchrun describes in the environment (module docstring for the rules)."""
        multicast_off()
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise InputError(f"{name}: start one process per rank with torchrun (RANK is not set)")
        if backend is not None and backend not in BACKENDS:
            raise InputError(f"--backend {backend!r}: must be one of {list(BACKENDS)}")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:
            device = torch.device("cuda", local % gpus)
            torch.cuda.set_device(device)
            own = gpus >= local_world
            if not own:
                os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
            backend = backend or ("nccl" if own else "gloo")
        else:
            xstage_backend.require()  # the interpreter, chosen at import where no GPU exists
            device = torch.device("cpu")
            backend = backend or "gloo"
        if backend == "nccl" and not gpus:
            raise InputError("--backend nccl: needs CUDA GPUs")
        kw = {"device_id": device} if backend == "nccl" else {}
        if timeout_s is not None:
            kw["timeout"] = _dt.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, **kw)
        ctrl = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        return cls(dist.get_rank(), dist.get_world_size(), device, backend, dist.group.WORLD, ctrl)

    @property
    def nccl(self) -> bool:
        return self.backend == "nccl"

    def dtype(self, name: str | None) -> torch.dtype:
        """`--dtype` (a name of `xstage.dtypes`); None: bf16 on GPUs, fp32 on the CPU."""
        return parse_dtype(name or ("bf16" if self.device.type == "cuda" else "fp32"), "--dtype")

    def log(self, msg: str) -> None:
        """Print on rank 0 (at once: the launcher interleaves the ranks' output)."""
        if self.rank == 0:
            print(msg, flush=True)

    def barrier(self) -> None:
        """Device idle on this rank, then every rank's host here."""
        synchronize()
        dist.barrier(group=self.ctrl)

    def sync_start(self) -> None:
        """Start the next run on every rank together: `barrier`, then (NCCL) a one-element all-reduce
        that all streams leave at once, then a device sleep of equal length on every rank."""
        self.barrier()
        if self.nccl:
            dist.all_reduce(self._token, group=self.group)
        if self.device.type == "cuda":
            torch.cuda._sleep(SLEEP_CYCLES)

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum of `values` over the ranks (every rank passes the same length)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return t.tolist()

    def timings(self, *runs_ns: Sequence[float]) -> list[Timing]:
        """One `Timing` per list of run times (ns): per run the slowest rank, then median, p10, p90."""
        slowest = self.max_over_ranks([v for runs in runs_ns for v in runs])
        out, i = [], 0
        for runs in runs_ns:
            out.append(timing_summary(slowest[i:i + len(runs)]))
            i += len(runs)
        return out

    def all_ok(self, ok: bool) -> bool:
        """True when `ok` holds on every rank."""
        return self.max_over_ranks([0.0 if ok else 1.0])[0] == 0.0

    def from_rank0(self, obj):
        """Rank 0's `obj` on every rank (a decision taken once)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        """`all_to_all_single` of rows on the world group; on gloo 16-bit rows travel as bytes (not every
        gloo build moves bf16), and device tensors through host copies."""
        if self.backend == "gloo" and out.dim() == 2 and out.element_size() == 2:
            o, i = out.view(torch.uint8), inp.contiguous().view(torch.uint8)
        else:
            o, i = out, inp.contiguous()
        if self.stage_on_host:
            o_h = o.cpu()
            dist.all_to_all_single(o_h, i.cpu(), out_splits, in_splits, group=self.group)
            o.copy_(o_h)
        else:
            dist.all_to_all_single(o, i, out_splits, in_splits, group=self.group)

    def close(self) -> None:
        if dist.is_initialized():
            # every rank is past its last collective before the group goes: a rank tearing it down while
            # a peer still sent to it ended that peer in "Connection closed by peer"
            dist.barrier(group=self.group)
            dist.destroy_process_group()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # The other ranks may sit in a collective: leave at once, without the group's shutdown
        # handshake, so that the launcher stops them (rows already written stay in the CSV).
        traceback.print_exception(exc_type, exc, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
