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


# ---- Relaunching a compiled kernel --------------------------------------------------------------------
# Triton binds and specialises every argument of every launch in Python (a few microseconds per
# argument on the H200 host: 70-100 us for the MoE prologue's 37 arguments and 25 constants), which
# made a MoE call's host time exceed its kernels at decode sizes. `launch` keys a compiled kernel by
# what Triton specialises on, refined (never coarser: a tensor's dtype and 16-byte alignment; an int's
# "is 1", "divisible by 16" and 32-bit range; a bool's value; a TMA descriptor's dtype and box; every
# constant's value), compiles through Triton on a new key and on a known one calls the compiled
# kernel's launcher with the arguments in the order Triton itself passes them.
_FAST = os.environ.get("XSTAGE_FAST_LAUNCH", "1") != "0"  # "0": every launch through Triton's own path
_compiled: dict = {}


def _spec(a):
    t = type(a)
    if t is torch.Tensor:
        return a.dtype, a.data_ptr() % 16 == 0
    if t is int:
        return a == 1, a % 16 == 0, -(2**31) <= a < 2**31
    if t is bool or a is None:
        return a
    if t is float:
        return float
    desc = getattr(a, "block_shape", None)  # a host TMA descriptor (triton.tools.tensor_descriptor)
    if desc is not None:
        return t, a.base.dtype, tuple(desc), a.base.data_ptr() % 16 == 0
    return t, a  # anything else: its value (a miss, never a wrong kernel)


def launch(kernel, grid: tuple, args: tuple, consts: dict):
    """`kernel[grid](*args, **consts)` (`consts`: the kernel's constants, then launch options such as
    `num_warps`), returning what that returns; after the first launch of a key, without Triton's
    per-launch binding. The interpreter, and any `kernel` that is not a Triton JIT function (a test's
    stand-in), take Triton's own path."""
    params = getattr(kernel, "params", None)
    if not _FAST or params is None or interpreter_active():
        return kernel[grid](*args, **consts)
    device = torch.cuda.current_device()
    key = (id(kernel), device, len(grid), tuple(consts.items()), tuple(_spec(a) for a in args))
    hit = _compiled.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **consts)
        tail = [p.name for p in params[len(args):]]
        # The launcher takes every parameter in order, constants included; all of them are at the end.
        if compiled is not None and all(n in consts for n in tail) and hasattr(compiled, "packed_metadata"):
            # The entry holds `kernel` itself, so its id cannot be reused by another kernel while cached.
            _compiled[key] = (kernel, compiled, tuple(consts[n] for n in tail))
        return compiled
    _, compiled, tail = hit
    from triton import knobs
    from triton.runtime import driver

    full = (*args, *tail)
    stream = driver.active.get_current_stream(device)
    g = (*grid, 1, 1)
    run = compiled.run  # loads the module on first use
    run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
        compiled.launch_metadata(grid, stream, *full), knobs.runtime.launch_enter_hook,
        knobs.runtime.launch_exit_hook, *full)
    return compiled
