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
    if not interpreter_active():
        if torch.cuda.is_available():
            return
        raise InputError("no CUDA GPU, and Triton's CPU interpreter is off (TRITON_INTERPRET=0): unset "
                         "TRITON_INTERPRET (or set TRITON_INTERPRET=1) before importing xstage to run kernels on "
                         "the CPU")
    if not _noticed and not torch.cuda.is_available():
        _noticed.append(True)
        print(_NOTICE, file=sys.stderr)


def refuse_interpreter_bf16(dtype, arg: str = "dtype") -> None:
    """Raise one `InputError` line when `dtype` (a `torch.dtype` or its short name) is bf16 and kernels run
    in Triton's CPU interpreter, whose bf16 `tl.dot` is wrong; `arg` names the argument."""
    if (dtype is DTYPES["bf16"] or (isinstance(dtype, str) and dtype == "bf16")) and interpreter_active():
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
# kernel's launcher with the arguments in the order Triton itself passes them. `Launch` goes further for
# a call site whose arguments are mostly fixed (a MoE buffer's own tensors, a layer's weights): it keys
# and expands them once, and on Triton versions whose launcher it knows it calls the compiled C launcher
# itself with host TMA descriptors encoded once (Triton encodes each with the driver on every launch).
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


# Triton versions whose CUDA launcher `Launch` calls directly (its argument layout and its wrapper's
# expansion of host TMA descriptors are read off that version's `triton/backends/nvidia/driver.py`);
# elsewhere `Launch` calls the compiled kernel's `run`, which does the same with per-launch expansion.
_RAW_TRITON = ("3.6.",)
_HOLE = object()


def _raw_launcher(compiled):
    """(C launcher, expansion of one argument by its position, `compiled.run`) of a compiled kernel, or
    None where this Triton's launcher is not the known one or a launch needs scratch memory."""
    import triton

    run = compiled.run  # loads the module on first use
    if not triton.__version__.startswith(_RAW_TRITON) or type(run).__name__ != "CudaLauncher":
        return None
    if run.global_scratch_size or run.profile_scratch_size:
        return None
    from triton.backends.nvidia import driver as nv

    raw = run.launch
    if type(raw).__name__ != "builtin_function_or_method":  # wrapped for host tensor descriptors
        cells = dict(zip(raw.__code__.co_freevars, raw.__closure__ or ()))
        raw = cells["launcher"].cell_contents if "launcher" in cells else None
        if type(raw).__name__ != "builtin_function_or_method":
            return None
    sig = list(compiled.src.signature.values())
    metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
    descs = [i for i, t in enumerate(sig) if isinstance(t, str) and t.startswith("tensordesc")]
    meta_of = dict(zip(descs, metas or [None] * len(descs)))

    def expand(i, a):
        return nv.make_tensordesc_arg(a, meta_of[i]) if i in meta_of else [a]

    return raw, expand, run


def hooked(hook) -> bool:
    """Whether a Triton launch hook is set. On Triton 3.6 (and later) each hook is a `HookChain`, never
    None and is empty when nothing is hooked; before, None meant none. (Testing `is not None` alone sent
    every relaunch on Triton 3.6 through `compiled.run`, with its per-launch descriptor encoding.)"""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launch:
    """Launches of one kernel at one call site whose arguments are fixed but for a few: `args` with
    `holes` (their positions) given per launch, `consts` the kernel's constants and launch options.

    The fixed arguments are expanded once (on a known Triton); a launch specialises only its hole
    values, and after the first launch of a key calls the compiled launcher directly (or `compiled.run`,
    as `launch` does). In Triton's interpreter, or with `XSTAGE_FAST_LAUNCH=0`, every launch is
    `kernel[grid](*args, **consts)`. The object holds its fixed arguments: whoever caches it decides
    how long they live."""

    def __init__(self, kernel, args: tuple, consts: dict, holes: tuple = ()):
        self.kernel, self.consts, self.holes = kernel, consts, tuple(holes)
        self.args = [_HOLE if i in self.holes else a for i, a in enumerate(args)]
        self._slow = not _FAST or getattr(kernel, "params", None) is None or interpreter_active()
        self._hits: dict = {}  # the fixed arguments never change, so their specialisation is not in the key

    def _full(self, values) -> tuple:
        args = list(self.args)
        for i, v in zip(self.holes, values):
            args[i] = v
        return tuple(args)

    def __call__(self, grid: tuple, *values):
        """Launch on `grid` with the holes' `values` (in `holes` order); returns what `launch` returns
        on a first launch, else None."""
        if self._slow:
            return self.kernel[grid](*self._full(values), **self.consts)
        device = torch.cuda.current_device()
        key = (device, len(grid), *[_spec(v) for v in values])
        hit = self._hits.get(key)
        if hit is None:
            full = self._full(values)
            compiled = launch(self.kernel, grid, full, self.consts)
            self._hits[key] = self._relauncher(compiled, full)
            return compiled
        return hit(grid, values, device)

    def _relauncher(self, compiled, full: tuple):
        """The relaunch of `compiled` for this key: through its C launcher with the fixed arguments
        expanded once where this Triton allows (and no hole is a host descriptor), else through
        `compiled.run` as `launch` does."""
        from triton import knobs
        from triton.runtime import driver

        tail = tuple(self.consts[p.name] for p in self.kernel.params[len(full):])
        raw = _raw_launcher(compiled) if compiled is not None and hasattr(compiled, "packed_metadata") else None
        if raw is not None and any(getattr(full[i], "block_shape", None) is not None for i in self.holes):
            raw = None

        def through_run(grid, values, device):
            args = (*self._full(values), *tail)
            stream = driver.active.get_current_stream(device)
            g = (*grid, 1, 1)
            compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(grid, stream, *args), knobs.runtime.launch_enter_hook,
                         knobs.runtime.launch_exit_hook, *args)

        if raw is None:
            return through_run
        c_launch, expand, run = raw
        # Each fixed argument expanded now; each hole a slot of the flat list, filled per launch.
        flat, slots = [], []
        for i, a in enumerate((*full, *tail)):
            if i in self.holes:
                slots.append(len(flat))
                flat.append(None)
            else:
                # A CUDA tensor's address is its device pointer (the launcher would look it up per launch);
                # `self.args` keeps the tensor alive. Host memory (pinned rows) stays a tensor.
                flat.extend(x.data_ptr() if type(x) is torch.Tensor and x.is_cuda else x for x in expand(i, a))
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                compiled.packed_metadata, None)

        def relaunch(grid, values, device):
            if hooked(knobs.runtime.launch_enter_hook) or hooked(knobs.runtime.launch_exit_hook):
                return through_run(grid, values, device)  # a profiler's hooks see Triton's own launch
            args = list(flat)
            for pos, v in zip(slots, values):
                args[pos] = v
            g = (*grid, 1, 1)
            c_launch(g[0], g[1], g[2], driver.active.get_current_stream(device), *head, None, None, *args)

        return relaunch
