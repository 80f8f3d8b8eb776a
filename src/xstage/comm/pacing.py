"""Store pacing: keep a kernel's remote-store backlog below the path's shared X-Stage level.

Why: on the H200 host link, once the shared level is full the loads of *every* SM slow down, also of
SMs that store nothing (`benchmarks/results/h200-store-then-load/`, bystanders: 4-18x slower with
33-99 storing SMs), and the fused MoE kernel's own tiles run 2-18x slower beside a saturated link
(`benchmarks/results/h200-moe-busy-link/`). With 8 storing SMs, whose per-SM windows hold ~1.2 MB
together (below the ~3 MB shared level), readers kept their speed although the link was busy. So
stores that wait in software instead of in the fabric leave the other SMs their memory bandwidth.

How: one int64 virtual clock per kernel buffer (`%globaltimer` ns) is the time at which every byte
claimed so far will have drained at `rate`. A CTA about to store `n` bytes raises the clock to at
least now (an idle link earns no credit), claims `n / rate` of it with one atomic add, and waits
until its claim ends at most `budget / rate` ahead of now, i.e. until at most `budget` bytes would
be outstanding with its own. This is a token bucket of `budget` bytes refilled at `rate` that serves
claims in the order they are made, which the planner's kernel simulator plays as such
(`xstage.sched.simulate.simulate_kernel(pacers=...)`) ahead of the link.

Without a timer (the CPU interpreter) the clock only accumulates the claims and nobody waits: the
outputs do not depend on pacing, and tests can read the clock to check the claimed bytes.

The type, its spellings and kernel arguments are data (`xstage.spec.pacing`: `StorePacing`,
`pacing_args`); this module is the device side.
"""

from __future__ import annotations

import triton
import triton.language as tl

from xstage.comm.device import globaltimer
from xstage.spec.pacing import (  # noqa: F401  (this module's names before xstage.spec)
    NO_PACING,
    StorePacing,
    pacing_args,
    parse_pacing,
    spec_of,
)


@triton.jit
def pace_stores(p_clock, nbytes, fs_per_byte, budget_ns, timeout_ns, max_spins, p_err, code,
                USE_PTX: tl.constexpr):
    """Wait until `nbytes` more remote bytes fit the pacing budget (see module docstring).

    `fs_per_byte == 0` switches pacing off (kernels that never pace compile the call out instead).
    The wait ends by itself (every claim ahead drains at the pace); it is still bounded by `timeout_ns`
    and `max_spins`, and running past them writes `code` into the error word, so a mis-set pace becomes
    a host-side error instead of a stalled kernel."""
    if (fs_per_byte > 0) & (nbytes > 0):
        now = globaltimer(USE_PTX)
        cost = (nbytes.to(tl.int64) * fs_per_byte) // 1000000  # ns
        tl.atomic_max(p_clock, now, sem="relaxed", scope="gpu")
        start = tl.atomic_add(p_clock, cost, sem="relaxed", scope="gpu")
        if USE_PTX:
            target = start + cost - budget_ns
            t_enter = now
            spins = 0
            while (now < target) & (now - t_enter < timeout_ns) & (spins < max_spins):
                now = globaltimer(USE_PTX)
                spins += 1
            if now < target:
                tl.atomic_cas(p_err, 0, code)
                tl.atomic_add(p_err + 1, 1)


__all__ = ["pace_stores"]
