"""Where Triton kernels run: the GPU, or Triton's CPU interpreter on a machine without one.

`import xstage` calls `select()` before any kernel is defined (Triton reads `TRITON_INTERPRET` when a
kernel is decorated): on a machine without a CUDA GPU, with `TRITON_INTERPRET` unset, it sets
`TRITON_INTERPRET=1`, so every kernel runs in Triton's interpreter on CPU tensors: slow, meant for
tests and small examples. The first kernel call there prints a one-time notice (`require`). Where
`TRITON_INTERPRET=0` was set by hand on such a machine, `require` raises one line saying how to enable
the interpreter instead of Triton's "0 active drivers".

Triton's interpreter computes `tl.dot` on bf16 operands wrongly (errors of order 1e10; fp16 and fp32
are right), so entry points whose kernels multiply in their dtype refuse bf16 there by name
(`refuse_interpreter_bf16`) before any work, instead of returning garbage.
"""

from __future__ import annotations

import os
import sys

import torch

from xstage.dtypes import DTYPES
from xstage.env import interpreter_active
from xstage.errors import InputError

_NOTICE = ("xstage: no CUDA GPU here; Triton kernels run in Triton's CPU interpreter (slow, for tests and "
           "small shapes)")
_noticed: list[bool] = []


def select() -> None:
    """Turn the interpreter on where no CUDA GPU exists and nobody chose otherwise."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def require() -> None:
    """Before a kernel call: a GPU, or the interpreter (with a one-time notice); else one clear line."""
    if torch.cuda.is_available() and not interpreter_active():
        return
    if not interpreter_active():
        raise InputError("no CUDA GPU, and Triton's CPU interpreter is off (TRITON_INTERPRET=0): unset "
                         "TRITON_INTERPRET (or set TRITON_INTERPRET=1) before importing xstage to run kernels on "
                         "the CPU")
    if not _noticed and not torch.cuda.is_available():
        _noticed.append(True)
        print(_NOTICE, file=sys.stderr)


def refuse_interpreter_bf16(dtype, arg: str = "dtype") -> None:
    """Raise one `InputError` line when `dtype` (a `torch.dtype` or its short name) is bf16 and kernels run
    in Triton's CPU interpreter, whose bf16 `tl.dot` is wrong; `arg` names the argument."""
    if interpreter_active() and (dtype is DTYPES["bf16"] or (isinstance(dtype, str) and dtype == "bf16")):
        raise InputError(f"{arg}=bf16: dtype bf16 cannot run in Triton's CPU interpreter (its bf16 tl.dot is "
                         "wrong); use fp16 or fp32 there")


def resolve_device(device=None, arg: str = "device") -> torch.device:
    """The device a context or buffer lives on: `device` checked (`"cpu"`, `"cuda"`, `"cuda:1"`, a
    `torch.device`), or by default the current CUDA device, else the CPU (Triton's interpreter). A
    CUDA device on a machine without one, or past the last GPU, is refused by name."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"{arg}={device!r}: not a device; give 'cpu', 'cuda' or 'cuda:N' (default: the current "
                         "CUDA device, else the CPU)") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InputError(f"{arg}={device!r}: must be 'cpu' or a CUDA device ('cuda', 'cuda:N')")
    if not torch.cuda.is_available():
        raise InputError(f"{arg}={device!r}: no CUDA GPU here; give device='cpu' (Triton's CPU interpreter) or "
                         "leave it out")
    count = torch.cuda.device_count()
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.index >= count:
        raise InputError(f"{arg}={device!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return dev
