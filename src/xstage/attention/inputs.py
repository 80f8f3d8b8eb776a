"""A Ulysses call's inputs: what each rank checks alone, and how the group agrees on them before any
rank waits on a peer.

Problem: on a real group every rank enters the pre-attention all-to-all. A rank that refuses its
inputs and raises would leave the others waiting there until the transport gives up with an error
that names nobody ("Connection closed by peer"). As in the MoE layer (`CommContext.refuse`), a
refusal must reach every rank as one agreed error, before any rank waits.

How: each rank first checks what it can alone (`check_call`: q, k, v, softmax_scale, config,
seq_lens; the caller adds the exchange). Then one small all-gather (`agree`) carries a row per rank:
its verdict (the refused argument's id in `xstage.comm.context.REFUSABLE_ARGS`), its token count, and
what every rank must share: B, H, D, dtype, the exchange, and the `seq_lens` it was given. It is the
gather of the token counts that a call without `seq_lens` needs anyway. From the same rows every
rank reaches the same verdict:
- a rank that refused raises `InputError: rank R: <argument>: ...` (its own line); every other rank
  raises `InputError: rank R refused its <argument> ...`, R the lowest rank that refused;
- else the first rank whose B, H, D, dtype or exchange differ from rank 0's, or whose `seq_lens`
  differ from the token counts the ranks hold, is refused in the same way;
- a sequence without any token is the same line on every rank.

What is guaranteed, and when (`ulysses_attention`):
- eager, `seq_lens` not given: always (the gather is the one that collects the token counts);
- eager, `seq_lens` given, `check=True` (the default): always; the gather is then one small
  collective that the call would not otherwise make;
- `seq_lens` given with `check=False` (no host collective and no host synchronisation: the form to
  time), or under CUDA graph capture (no host collective can run there): no gather. Every rank still
  checks its own inputs before it enqueues anything, and a rank that refuses raises
  `rank R: <argument>: ...`, but the others are not told: in eager mode they wait in the all-to-all
  until the group's own timeout; under capture nothing waits (capture runs nothing), and the other
  ranks' graphs must not be replayed. `seq_lens` that differ between ranks go undetected there.
A loopback context (one process) raises the plain line: there is no group to tell.
"""

from __future__ import annotations

import operator
import zlib

import torch
import torch.distributed as dist

from xstage.attention.flash import SUPPORTED_DTYPES, FlashConfig, check_tensors, softmax_scale_value
from xstage.comm.context import refusable_id, refusal_error
from xstage.errors import InputError

# A row of the agreement gather: verdict (0: accepted, else the refused argument's id + 1), tokens,
# B, H, D, dtype index, exchange checksum, whether seq_lens was given, then seq_lens (world entries).
_VERDICT, _TOKENS, _B, _H, _D, _DTYPE, _EXCHANGE, _HAS_LENS = range(8)
_FIXED = 8


def check_call(q, k, v, *, softmax_scale, seq_lens, config, world: int, rank: int):
    """This rank's own checks of a Ulysses call: `(scale, seq_lens)` (the scale as a float, `seq_lens`
    as a tuple of ints, or None when not given), or an `InputError` naming the argument first."""
    check_tensors(q, k, v)
    if k.shape != q.shape or v.shape != q.shape:
        raise InputError(f"k, v: expected the local shape of q {list(q.shape)}, got {list(k.shape)}, "
                         f"{list(v.shape)}")
    B, S, H, D = q.shape
    if B < 1 or H < 1:
        raise InputError(f"q: batch B={B} and heads H={H} must be >= 1")
    scale = softmax_scale_value(softmax_scale, D)
    if config is not None and not isinstance(config, FlashConfig):
        raise InputError(f"config: expected a FlashConfig or None, got {type(config).__name__}")
    if seq_lens is None:
        return scale, None
    lens = parse_seq_lens(seq_lens, world)
    if lens[rank] != S:
        raise InputError(f"seq_lens: entry {rank} (this rank's) is {lens[rank]}, but q holds {S} tokens "
                         f"(local shape {list(q.shape)})")
    return scale, lens


def parse_seq_lens(seq_lens, world: int) -> tuple[int, ...]:
    """`seq_lens` as `world` non-negative token counts with a positive sum."""
    try:
        lens = tuple(operator.index(s) for s in seq_lens)
    except TypeError:
        lens = None
    if lens is None or len(lens) != world or any(s < 0 for s in lens) or sum(lens) == 0:
        raise InputError(f"seq_lens: expected {world} non-negative integer token counts (one per rank) with a "
                         f"positive sum, got {seq_lens!r}")
    return lens


def _gather_device(group) -> torch.device:
    """Where a collective of `group` takes its tensors: the CPU for gloo (also gloo beside NCCL),
    this process's GPU for NCCL."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange_sum(exchange) -> int:
    return zlib.crc32(str(exchange).encode()) & 0x7FFFFFFF


def _row(refusal, q, exchange, seq_lens, world: int) -> list[int]:
    row = [0] * (_FIXED + world)
    if refusal is not None:
        row[_VERDICT] = refusable_id(_argument(refusal)) + 1
        return row
    B, S, H, D = q.shape
    row[_TOKENS:_EXCHANGE + 1] = [S, B, H, D, SUPPORTED_DTYPES.index(q.dtype), _exchange_sum(exchange)]
    if seq_lens is not None:
        row[_HAS_LENS] = 1
        row[_FIXED:] = seq_lens
    return row


def _argument(err: InputError) -> str:
    """The argument an error names: its first word (`q.dtype: ...` and `q, k, v: ...` name `q`)."""
    text = str(err)
    end = next((i for i, c in enumerate(text) if not (c.isalnum() or c == "_")), len(text))
    return text[:end]


def _mismatch(rows: list[list[int]], p: int, exchange) -> tuple[str, str] | None:
    """(argument, line) when rank p's row disagrees with the group (evaluated alike on every rank;
    the line only on rank p, which knows its own exchange's spelling)."""
    r, r0 = rows[p], rows[0]
    counts = [row[_TOKENS] for row in rows]
    if r[_B:_DTYPE + 1] != r0[_B:_DTYPE + 1]:
        def desc(row):
            return f"[{row[_B]}, {row[_H]}, {row[_D]}] in {str(SUPPORTED_DTYPES[row[_DTYPE]])[6:]}"
        return "q", (f"q: [B, H, D] = {desc(r)} differs from rank 0's {desc(r0)} (the ranks' shards may "
                     "differ in their token counts only)")
    if r[_EXCHANGE] != r0[_EXCHANGE]:
        return "exchange", (f"exchange {str(exchange)!r}: rank 0 runs another exchange; every rank must pass the "
                            "same")
    if r[_HAS_LENS] and r[_FIXED:] != counts:
        return "seq_lens", f"seq_lens: {r[_FIXED:]} differ from the token counts the ranks hold, {counts}"
    return None


def agree(refusal: InputError | None, q, exchange, seq_lens, world: int, rank: int, group) -> list[int]:
    """The ranks' token counts, after one all-gather of every rank's verdict on its inputs; raises the
    agreed `InputError` on every rank if any rank refused, or the ranks disagree (module docstring)."""
    row = torch.tensor(_row(refusal, q, exchange, seq_lens, world), dtype=torch.int64, device=_gather_device(group))
    parts = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(parts, row, group=group)
    rows = [t.tolist() for t in parts]
    refused = [p for p in range(world) if rows[p][_VERDICT]]
    if refused:
        if refusal is not None:
            raise InputError(f"rank {rank}: {refusal}") from None
        raise refusal_error(refused[0], rows[refused[0]][_VERDICT] - 1)
    for p in range(world):
        bad = _mismatch(rows, p, exchange)
        if bad is not None:
            if p == rank:
                raise InputError(f"rank {rank}: {bad[1]}")
            raise refusal_error(p, refusable_id(bad[0]))
    counts = [row[_TOKENS] for row in rows]
    if sum(counts) == 0:
        raise InputError(f"q: no rank holds a token (token counts {counts}); the sequence needs at least one")
    return counts


__all__ = ["agree", "check_call", "parse_seq_lens"]
