"""The store pacing of the fused MoE kernel's combine: one function parses and resolves it.

A pacing is given as `"auto"` (the default of the buffer's store path), `"off"`, `"RATE:BUDGET"` (GB/s
and KiB, e.g. `"50:128"`), a `StorePacing`, or None (off). `"auto"` paces where pacing was measured
to pay, today the `host` path, at `DEFAULT_RATE_FACTOR` x the drain of that path's embedded profile
(`xstage.comm.pacing.default_pacing`); none on `hbm` (no shared level to fill), on `peer` (not
measured there yet) and without remote ranks.

Example:
    >>> from xstage.moe.pacing import resolve_pacing
    >>> resolve_pacing("off", "host", 8) is None, resolve_pacing("50:128", "host", 8).rate
    (True, 50000000000.0)
"""

from __future__ import annotations

from xstage.comm.pacing import StorePacing, default_pacing, parse_pacing
from xstage.errors import InputError
from xstage.model import load_default_profile

PACED_PATHS = ("host",)


def auto_pacing(path: str, num_ranks: int) -> StorePacing | None:
    """What `"auto"` means for a kernel storing toward `num_ranks - 1` peers through `path`."""
    if num_ranks < 2 or path not in PACED_PATHS:
        return None
    return default_pacing(load_default_profile(path).params.drain)


def resolve_pacing(pacing, path: str, num_ranks: int) -> StorePacing | None:
    """`pacing` as the kernel runs it: a StorePacing, or None for unpaced stores."""
    if pacing is None or isinstance(pacing, StorePacing):
        return pacing
    if not isinstance(pacing, str):
        raise InputError(f"pacing={pacing!r}: must be 'auto', 'off', 'RATE_GBPS:BUDGET_KIB', a StorePacing or None")
    return parse_pacing(pacing, auto_pacing(path, num_ranks) if pacing == "auto" else None)
