"""The store pacing of the fused MoE kernel's combine: one function parses and resolves it.

A pacing is given as `"auto"` (the planner's choice per call), `"default"` (the fixed default of the
buffer's store path), `"off"`, `"RATE:BUDGET"` (GB/s and KiB, e.g. `"50:128"`), a `StorePacing`, or
None (off).

- `"default"` paces where pacing was measured to pay, today the `host` path, at
  `DEFAULT_RATE_FACTOR` x the drain of that path's embedded profile
  (`xstage.comm.pacing.default_pacing`); none on `hbm` (no shared level to fill), on `peer` (not
  measured there yet) and without remote ranks. Result rows of variants without an `@` suffix ran with it.
- `"auto"` is decided by the planner, which registers itself here when `xstage.sched` is imported
  (`import xstage` does): it predicts each candidate pacing (`PACING_CANDIDATES`) and keeps the
  fastest, jointly with the schedule when that is chosen per call too (`model_guided`). A fused call
  asks once per token bucket and caches the answer on its buffer (`xstage.moe.decision`).

Example:
    >>> from xstage.moe.pacing import resolve_pacing
    >>> resolve_pacing("off", "host", 8) is None, resolve_pacing("50:128", "host", 8).rate
    (True, 50000000000.0)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from xstage.bounds import MAX_RANKS, check_int
from xstage.comm.context import PATHS as STORE_PATHS
from xstage.comm.pacing import StorePacing, default_pacing, parse_pacing
from xstage.errors import InputError
from xstage.model import load_default_profile

PACED_PATHS = ("host",)
AUTO, DEFAULT = "auto", "default"
PACING_CANDIDATES = (DEFAULT, "off")  # what "auto" chooses from

_CHOOSER: Callable | None = None


def default_pacing_of(path: str, num_ranks: int) -> StorePacing | None:
    """What `"default"` means for a kernel storing toward `num_ranks - 1` peers through `path`."""
    if num_ranks < 2 or path not in PACED_PATHS:
        return None
    return _default_of_path(path)


@functools.cache
def _default_of_path(path: str) -> StorePacing:
    # The embedded profile is package data: read once per process, not on every call.
    return default_pacing(load_default_profile(path).params.drain)


def resolve_pacing(pacing, path: str, num_ranks: int) -> StorePacing | None:
    """`pacing` as the kernel runs it: a StorePacing, or None for unpaced stores. `"auto"` depends on
    the call: resolve it with `choose_pacing`."""
    if pacing is None or isinstance(pacing, StorePacing):
        return pacing
    if not isinstance(pacing, str):
        raise InputError(f"pacing={pacing!r}: must be 'auto', 'default', 'off', 'RATE_GBPS:BUDGET_KIB', "
                         "a StorePacing or None")
    if pacing == AUTO:
        raise InputError("pacing 'auto' is chosen per call (tokens, schedule): resolve it with "
                         "xstage.moe.pacing.choose_pacing, or name a pacing ('default', 'off', 'RATE:BUDGET')")
    if path not in STORE_PATHS:
        raise InputError(f"path={path!r}: must be one of {', '.join(STORE_PATHS)} (where the stores go)")
    num_ranks = check_int(num_ranks, "num_ranks", 1, MAX_RANKS, "ranks of the group")
    # Only "default" needs the path's profile: "off" and "RATE:BUDGET" read no file.
    return parse_pacing(pacing, default_pacing_of(path, num_ranks) if pacing == DEFAULT else None)


def check_pacing(pacing) -> None:
    """Refuse a malformed pacing before anything runs (`"auto"` included, which is resolved later)."""
    if not (isinstance(pacing, str) and pacing == AUTO):
        resolve_pacing(pacing, "hbm", 1)


def register_pacing_chooser(fn: Callable) -> None:
    """Set what resolves `"auto"`: `fn(buf, tokens, ctas, schedule) -> spec` with `spec` one of
    `PACING_CANDIDATES` and `schedule` a fixed order, or None when the schedule is chosen per call too."""
    global _CHOOSER
    _CHOOSER = fn


def choose_pacing(buf, tokens: int, ctas: int, schedule: str | None) -> StorePacing | None:
    """The planner's pacing for this buffer, `tokens` per rank, `ctas` CTAs and `schedule` (None: chosen
    jointly with it). Not cached here: `fused_moe` asks once per token bucket (`xstage.moe.decision`)."""
    if _CHOOSER is None:
        raise InputError("pacing 'auto': no planner is registered; import xstage (or xstage.sched) first, "
                         "or name a pacing ('default', 'off', 'RATE:BUDGET')")
    spec = _CHOOSER(buf, tokens, ctas, schedule)
    if spec not in PACING_CANDIDATES:
        raise InputError(f"pacing 'auto': the planner answered {spec!r}; expected one of {PACING_CANDIDATES}")
    return resolve_pacing(spec, buf.store_path, buf.R)
