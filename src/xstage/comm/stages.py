"""Stage ids and the error word: how a device-side timeout becomes a host-side error.

A kernel that waits on a flag owns a stage id (a small positive integer). When a wait runs past its
bound, the kernel writes `code = stage * 65536 + peer` into the context's error word with a
compare-and-swap, so the first timeout wins and later ones only bump the count in word 1. The host
decodes the word in `CommContext.check()` and raises `CommTimeoutError` naming rank, peer and stage.

Stage id ranges (so that kernels written in different modules never collide):

| ids     | owner                                   |
|---------|-----------------------------------------|
| 1-15    | comm core and the probe microbenchmarks |
| 16-31   | attention (Ulysses)                     |
| 32-47   | MoE                                     |
| 48-127  | free; register before use               |

The ids of xstage's own kernels, and their names, are one table (`xstage.spec.stages`); a user's own
kernel names its id (48-127) with `register_stage(code, name)`, so that errors print a readable name.
"""

from __future__ import annotations

import torch

from xstage.bounds import PEER_BITS, check_int
from xstage.errors import InputError
from xstage.spec.stages import STAGE_GENERIC, STAGE_NAMES, STAGE_PROBE_FLAG, STAGE_PROBE_TEST  # noqa: F401

MAX_STAGE = 32767

_STAGES: dict[int, str] = dict(STAGE_NAMES)  # xstage's own ids, then those a user registers


def register_stage(code: int, name: str) -> int:
    """Give stage id `code` a name for error messages; returns `code` (re-registering the same name is fine)."""
    if not 1 <= int(code) <= MAX_STAGE:
        raise InputError(f"stage code {code}: must be in 1..{MAX_STAGE}")
    known = _STAGES.get(int(code))
    if known is not None and known != name:
        raise InputError(f"stage code {code}: already registered as {known!r}, cannot rename to {name!r}")
    _STAGES[int(code)] = name
    return int(code)


def stage_name(code: int) -> str:
    return _STAGES.get(int(code), f"stage-{int(code)}")


def error_code(stage: int, peer: int) -> int:
    """The value a kernel writes into the error word for a timeout at `stage` waiting on `peer`."""
    stage = check_int(stage, "stage", 1, MAX_STAGE, "stage id of the wait")
    peer = check_int(peer, "peer", 0, (1 << PEER_BITS) - 1, "rank waited on")
    return (stage << PEER_BITS) | peer


def decode_error(word: int) -> tuple[int, int]:
    """(stage, peer) from an error word; (0, 0) means no error."""
    if isinstance(word, torch.Tensor) and word.numel() == 1:
        word = word.item()
    word = check_int(word, "word", 0, (MAX_STAGE << PEER_BITS) | ((1 << PEER_BITS) - 1), "an error word")
    return word >> PEER_BITS, word & ((1 << PEER_BITS) - 1)
