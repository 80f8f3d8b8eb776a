"""`xstage.comm`: symmetric buffers, signals and device helpers for kernels that store to other ranks.

Stable API (other modules build on it; new transports and ops go into new files of this package):

Host side (`xstage.comm.context`):
- `create_context(group=None, *, path="peer"|"host"|"hbm", loopback_world=None, rank=None,
  device=None, signal_slots=4096, timeout_ns=2e9) -> CommContext`
- `CommContext.alloc(name, shape, dtype) -> SymmBuffer` (zeroed; `.local`, `.peers[q]`, `.ptrs`:
  int64 device pointer table indexed by rank, `.ptr_list`, `.peer(q)`)
- `CommContext.signal_pad` (int32 `SymmBuffer`), `.error` (int32[2] error word), `.check()` (raises
  `CommTimeoutError` naming rank, peer and stage), `.reset_error()`, `.reset_signals()`,
  `.barrier()`, `.close()`; attributes `path, rank, world, device, group, group_name, loopback,
  timeout_ns`.

Device side (`xstage.comm.device`, Triton `@triton.jit` functions; `USE_PTX`/`WAIT` are constexpr):
- `globaltimer(USE_PTX)`, `clock64(USE_PTX)`, `smid(USE_PTX)`, `fence_sys(USE_PTX)`
- `peer_ptr(p_table, peer, p_like)`, `store_tile(p_base, o_elem, b_vals, m_elem, VEC)`
- `signal_release(p_flag, value)`, `signal_add(p_flag, inc)`
- `wait_acquire(p_flag, expected, timeout_ns, p_err, code, WAIT, USE_PTX) -> ok`
- `use_ptx()` (host): the `USE_PTX` value for this process.

Tracing (`xstage.comm.stamps`): `stamp(out, index)` stores the time a stream reaches it (%globaltimer;
works inside CUDA graphs; the host clock on CPU).

Error codes (`xstage.comm.stages`): `code = stage << 16 | peer`; `error_code(stage, peer)`,
`decode_error(word)`, `register_stage(code, name)`; stage id ranges: 1-15 comm/probe, 16-31
attention, 32-47 MoE.

Example (loopback on one device, the interpreter included):

    from xstage.comm import create_context
    with create_context(path="host", loopback_world=2) as ctx:
        out = ctx.alloc("out", (4, 256), torch.float32)
        # a kernel gets out.ptrs and stores into out.peers[1] (pinned host memory on a GPU)
        ctx.check()
"""

from xstage.backend import select

select()  # before this package's kernels are defined: Triton's interpreter where no GPU exists

from xstage.comm.context import DEFAULT_SIGNAL_SLOTS, DEFAULT_TIMEOUT_NS, CommContext, SymmBuffer, create_context  # noqa: E402
from xstage.comm.stages import decode_error, error_code, register_stage, stage_name  # noqa: E402
from xstage.spec.paths import PATHS  # noqa: E402
from xstage.spec.stages import STAGE_GENERIC, STAGE_PROBE_FLAG, STAGE_PROBE_TEST  # noqa: E402

__all__ = [
    "PATHS", "DEFAULT_SIGNAL_SLOTS", "DEFAULT_TIMEOUT_NS", "CommContext", "SymmBuffer", "create_context",
    "STAGE_GENERIC", "STAGE_PROBE_FLAG", "STAGE_PROBE_TEST", "decode_error", "error_code",
    "register_stage", "stage_name",
]
