"""Time stamps from the GPU's own clock, enqueued on a stream: they work inside CUDA graphs, where CUDA
events cannot be timed.

`stamp(out, index)` enqueues on the current stream a one-thread kernel that stores `%globaltimer`
(ns, one clock for every SM of the GPU) into `out[index]` when the stream reaches it. `out` is an
int64 tensor on the stream's device. On a CPU tensor (or under Triton's interpreter, which has no
`%globaltimer`) the host's monotonic clock in ns is stored at the call, which is when CPU work runs.

Example (GPU): stamps around a kernel, captured once and replayed:

    t = torch.zeros(2, dtype=torch.int64, device="cuda")
    stamp(t, 0); kernel(...); stamp(t, 1)
    elapsed_ns = int(t[1] - t[0])
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from xstage.comm.device import globaltimer, use_ptx
from xstage.env import interpreter_active
from xstage.errors import InputError


@triton.jit
def _stamp_kernel(p_out, index, USE_PTX: tl.constexpr):
    tl.store(p_out + index, globaltimer(USE_PTX))


def stamp(out: torch.Tensor, index: int) -> None:
    """Store the time at which the current stream reaches this call into `out[index]` (ns)."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int64 or not out.is_contiguous():
        raise InputError("out: expected a contiguous int64 tensor of time stamps")
    if not 0 <= index < out.numel():
        raise InputError(f"index={index}: out of range for {out.numel()} stamps")
    if out.device.type != "cuda" or interpreter_active():
        out.view(-1)[index] = time.monotonic_ns()
        return
    _stamp_kernel[(1,)](out, index, USE_PTX=use_ptx(), num_warps=1)
