"""Ulysses geometry as data: how heads and tokens split over P ranks, and how `overlap` cuts rows.

Rank p holds tokens `[tok0[p], tok0[p+1])` of the sequence and, after the pre-attention all-to-all,
heads `[head0[p], head0[p+1])`; both splits give the first `n % P` ranks one more (any head count,
any sequence length). A rank may hold no token (fewer tokens than ranks, or the caller's `seq_lens`)
or own no head (H < P). `UlyssesPlan` holds one layer's split as seen from one rank, with the element
counts its all-to-alls exchange; the buffers themselves are `xstage.attention.layout`'s.

`overlap_blocks` cuts the gathered sequence into the blocks the `overlap` exchange computes and sends
one by one; `SUPPORTED_HEAD_DIMS` are the head sizes the attention kernel compiles for.

Example:
    >>> plan = UlyssesPlan(world=4, rank=1, batch=1, seq_lens=split_sizes(10, 4), heads=30, head_dim=64)
    >>> plan.head0, plan.tok0
    ([0, 8, 16, 23, 30], [0, 3, 6, 8, 10])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xstage.bounds import PEER_BITS
from xstage.errors import InputError
from xstage.spec.exchange import CUTS

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def split_sizes(n: int, parts: int) -> list[int]:
    """`n` items over `parts` ranks, the first `n % parts` ranks taking one more."""
    if parts < 1:
        raise InputError(f"parts: must be >= 1, got {parts}")
    if n < 0:
        raise InputError(f"n: must be >= 0, got {n}")
    return [n // parts + (1 if p < n % parts else 0) for p in range(parts)]


def _offsets(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + int(s))
    return out


@dataclass(frozen=True)
class UlyssesPlan:
    """Token and head split of one Ulysses layer as seen from `rank`."""

    world: int
    rank: int
    batch: int
    seq_lens: tuple[int, ...]
    heads: int
    head_dim: int

    def __init__(self, world, rank, batch, seq_lens, heads, head_dim):
        seq_lens = tuple(int(s) for s in seq_lens)
        if not 1 <= world < (1 << PEER_BITS):
            raise InputError(f"world size: must be in 1..{(1 << PEER_BITS) - 1}, got {world}")
        if not 0 <= rank < world:
            raise InputError(f"rank: must be in 0..{world - 1}, got {rank}")
        if len(seq_lens) != world or any(s < 0 for s in seq_lens) or sum(seq_lens) == 0:
            raise InputError(f"seq_lens: expected {world} non-negative token counts with a positive sum, "
                             f"got {list(seq_lens)}")
        if heads < 1:
            raise InputError(f"heads H={heads}: must be >= 1")
        object.__setattr__(self, "world", int(world))
        object.__setattr__(self, "rank", int(rank))
        object.__setattr__(self, "batch", int(batch))
        object.__setattr__(self, "seq_lens", seq_lens)
        object.__setattr__(self, "heads", int(heads))
        object.__setattr__(self, "head_dim", int(head_dim))

    @property
    def head0(self) -> list[int]:
        return _offsets(split_sizes(self.heads, self.world))

    @property
    def tok0(self) -> list[int]:
        return _offsets(self.seq_lens)

    @property
    def seq_total(self) -> int:
        return sum(self.seq_lens)

    def heads_of(self, p: int) -> int:
        h = self.head0
        return h[p + 1] - h[p]

    @property
    def uniform(self) -> bool:
        return self.heads % self.world == 0 and len(set(self.seq_lens)) == 1

    def qkv_send_splits(self) -> list[int]:
        """Elements sent to each rank by the pre-attention all-to-all."""
        n = self.seq_lens[self.rank] * 3 * self.batch * self.head_dim
        return [n * self.heads_of(p) for p in range(self.world)]

    def qkv_recv_splits(self) -> list[int]:
        n = 3 * self.batch * self.heads_of(self.rank) * self.head_dim
        return [n * s for s in self.seq_lens]

    def out_send_splits(self) -> list[int]:
        n = self.batch * self.heads_of(self.rank) * self.head_dim
        return [n * s for s in self.seq_lens]

    def out_recv_splits(self) -> list[int]:
        n = self.seq_lens[self.rank] * self.batch * self.head_dim
        return [n * self.heads_of(p) for p in range(self.world)]


def overlap_blocks(plan: UlyssesPlan, blocks: int, block_m: int, *, cut: str = "even",
                   slots: int = 0) -> list[list[tuple[int, int]]]:
    """Row ranges of the gathered sequence, block by block, in the order `overlap` computes them.

    The remote rows (those after this rank's, then those before, i.e. the sequence rotated to start
    after this rank's rows) are cut into `blocks - 1` blocks, each a multiple of `block_m` rows where
    it can be, so that no query tile is split; the last block holds this rank's own rows. A block may
    wrap around the end of the sequence, and then has two ranges. `cut`:
    - `even`: remote blocks of nearly equal size;
    - `waves`: the kernel runs `slots` tiles (one head x `block_m` rows) at a time, so its last wave
      is partial. When the own rows' tiles cannot fill that wave, some remote tiles run in it, and
      the copy of their whole block waits for the kernel's end. `waves` puts just those tiles (the
      "spill") in a small last remote block, whose copy is short, and cuts the rest evenly; with
      no spill, a single wave or fewer than three blocks it is `even`."""
    if blocks < 2:
        raise InputError(f"blocks={blocks}: overlap needs at least 2 (the remote rows, then the own rows)")
    if cut not in CUTS:
        raise InputError(f"cut={cut!r}: must be one of {', '.join(CUTS)}")
    if cut == "waves" and slots < 1:
        raise InputError(f"slots={slots}: the `waves` cut needs the tiles that run at once (>= 1)")
    S, r = plan.seq_total, plan.rank
    a, b = plan.tok0[r], plan.tok0[r + 1]
    remote = S - (b - a)
    n_remote = blocks - 1
    tiles = -(-remote // block_m)
    n_remote = max(1, min(n_remote, tiles))
    cuts = [min(remote, (tiles * i // n_remote) * block_m) for i in range(n_remote + 1)] if tiles else [0]
    spill = _spill_row_tiles(plan.heads_of(r), tiles, -(-(b - a) // block_m), slots) if cut == "waves" else 0
    if n_remote >= 2 and 0 < spill < tiles:
        big = tiles - spill
        cuts = [(big * i // (n_remote - 1)) * block_m for i in range(n_remote)] + [remote]
    out: list[list[tuple[int, int]]] = []
    for x0, x1 in zip(cuts, cuts[1:]):
        lo, hi = b + x0, b + x1  # rotated: row b + x, past the end wrapping to the start
        if hi <= lo:
            continue
        if hi <= S:
            out.append([(lo, hi)])
        elif lo >= S:
            out.append([(lo - S, hi - S)])
        else:
            out.append([(lo, S), (0, hi - S)])
    if b > a:
        out.append([(a, b)])
    return out


def _spill_row_tiles(heads: int, remote_row_tiles: int, own_row_tiles: int, slots: int) -> int:
    """Row tiles of remote rows that run in the kernel's last wave beside every own tile (0: none)."""
    total = heads * (remote_row_tiles + own_row_tiles)
    if total <= slots:
        return 0  # one wave: every block runs in it
    spill = (total % slots or slots) - heads * own_row_tiles
    return -(-spill // heads) if spill > 0 else 0


def default_blocks(plan: UlyssesPlan) -> int:
    """Blocks of `overlap` when the spelling names none: the remote rows in one block, then the own
    rows (the least compute split; the planner picks more where the last copy would show)."""
    return 2


__all__ = ["SUPPORTED_HEAD_DIMS", "UlyssesPlan", "default_blocks", "overlap_blocks", "split_sizes"]
