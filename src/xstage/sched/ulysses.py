"""The `stores` exchange of Ulysses attention as `KernelWork`: attention tiles and their stores.

The event simulator's detailed model of the in-kernel exchange (`xstage.sched.exchange` ranks
every exchange with closed forms instead, fast enough for `exchange="auto"`).

After the first all-to-all a rank holds its share of the heads (rank 0: `ceil(heads / ranks)`) over
the whole sequence. The fused
kernel (`xstage.attention.flash`) walks its query tiles `(b, h, m)` round-robin over a persistent
grid and sends each finished tile's rows to the rank that owns them (rows `[p*S/P, (p+1)*S/P)`
belong to rank p); rank 0 is simulated. Two exchanges:

- `stores:burst`: a tile's rows go out in its epilogue, all at once;
- `stores:paced:R`: the tile is parked and sent in chunks of R rows during the next tile's key loop, one
  chunk every `n_blocks / (n_chunks + 1)` key blocks, each program at its own phase of that period;
  the last tile's chunks go after the loop. The task list follows the kernel: each tile is split at
  the key blocks where a chunk of the previous tile leaves.

A tile's compute time is `overhead + 4 * block_m * keys * head_dim / rate` (QK^T and PV FLOPs),
fitted per head dim to the attention-alone kernel of the Ulysses benchmark (`attention_costs`), the
same kernel with the exchange off: a tile costs that kernel's time over its rounds of tiles.

Example:
    cfg = UlyssesConfig(heads=24, head_dim=128, tokens=32760, ranks=8)
    work = ulysses_work(cfg, "stores:paced:16", load_default_costs("attention"))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from xstage.errors import InputError
from xstage.model import load_default_profile
from xstage.sched.costs import TaskCosts, fit_kind
from xstage.sched.measured import check_ulysses_rows
from xstage.sched.work import KernelWork, Task, require_positive_ints
from xstage.spec.exchange import parse_exchange

REMOTE = 1  # destination id of the other ranks (rank 0's own rows are local)


@dataclass(frozen=True)
class UlyssesConfig:
    heads: int
    head_dim: int
    tokens: int
    ranks: int
    batch: int = 1
    block_m: int = 128
    block_n: int = 128
    # Persistent programs: by default the SM count of the GPU the embedded profile was measured on.
    grid: int = field(default_factory=lambda: load_default_profile().sm_count)
    elem_bytes: int = 2

    def __post_init__(self):
        require_positive_ints(self, ("heads", "head_dim", "tokens", "ranks", "batch", "block_m", "block_n", "grid",
                                     "elem_bytes"), "Ulysses config")
        if self.ranks > self.heads:
            raise InputError(f"ranks={self.ranks}: must be <= heads={self.heads}")

    @property
    def local_heads(self) -> int:
        """Heads of rank 0 (the layout gives the first ranks one head more when `ranks` does not divide)."""
        return -(-self.heads // self.ranks)

    @property
    def m_tiles(self) -> int:
        return -(-self.tokens // self.block_m)

    @property
    def tiles(self) -> int:
        return self.batch * self.local_heads * self.m_tiles

    def tile_work(self) -> float:
        """FLOPs of one query tile against every key."""
        return 4.0 * self.block_m * self.tokens * self.head_dim

    def remote_rows(self, m: int) -> int:
        """Rows of query tile `m` that other ranks own (rank 0 owns the first ceil(S / P) rows)."""
        own = -(-self.tokens // self.ranks)
        lo, hi = m * self.block_m, min((m + 1) * self.block_m, self.tokens)
        return max(0, hi - max(lo, own))


def cost_kind(head_dim: int, block_m: int, block_n: int) -> str:
    return f"attention@{block_m}x{block_n}x{head_dim}"


def ulysses_work(cfg: UlyssesConfig, exchange: str, costs: TaskCosts | None, tile_ns: float | None = None
                 ) -> KernelWork:
    """Rank 0's fused kernel as per-program task lists (see module docstring). `tile_ns` (optional)
    replaces the fitted tile cost, e.g. by the measured attention-alone time of this configuration."""
    ex = parse_exchange(exchange)
    if ex.mechanism != "stores":
        raise InputError(f"exchange {exchange!r}: the task model covers the in-kernel stores only")
    kind = "burst" if ex.burst else "paced"
    chunk_rows = ex.chunk_rows or max(1, 2048 // cfg.head_dim)
    if tile_ns is None:
        if costs is None:
            raise InputError("ulysses_work: give task costs or tile_ns")
        tile_ns = costs.cost(cost_kind(cfg.head_dim, cfg.block_m, cfg.block_n)).time_ns(cfg.tile_work())
    row_bytes = cfg.head_dim * cfg.elem_bytes
    n_blocks = max(1, cfg.tokens // cfg.block_n)
    progs = min(cfg.grid, cfg.tiles)
    ctas: list[list[Task]] = [[] for _ in range(progs)]
    for pid in range(progs):
        tiles = range(pid, cfg.tiles, progs)
        if kind == "burst":
            ctas[pid] = [Task(f"t{t}", tile_ns, stores=_remote(cfg.remote_rows(t % cfg.m_tiles) * row_bytes),
                              kind="attention") for t in tiles]
            continue
        n_chunks = cfg.block_m // min(chunk_rows, cfg.block_m)
        rows = min(chunk_rows, cfg.block_m)
        pace = max(n_blocks // (n_chunks + 1), 1)
        phase = pid % pace
        block_ns = tile_ns / n_blocks
        prev = None
        tasks: list[Task] = []
        for t in tiles:
            # Chunk j of the previous tile leaves at key block j * pace + phase of this tile.
            cut = 0
            for j in range(n_chunks if prev is not None else 0):
                at = min(j * pace + phase, n_blocks)
                tasks.append(Task(f"t{t}.{j}", (at - cut) * block_ns, stores=_remote(_chunk(cfg, prev, j, rows)
                                                                                     * row_bytes), kind="attention"))
                cut = at
            tasks.append(Task(f"t{t}.end", tile_ns - cut * block_ns, kind="attention"))
            prev = t
        if prev is not None:
            tasks += [Task(f"t{prev}.tail{j}", 0.0, stores=_remote(_chunk(cfg, prev, j, rows) * row_bytes))
                      for j in range(n_chunks)]
        ctas[pid] = tasks
    return KernelWork(ctas=ctas, dest_path={REMOTE: "remote"})


def _remote(nbytes: int) -> dict[int, int]:
    return {REMOTE: int(nbytes)} if nbytes > 0 else {}


def _chunk(cfg: UlyssesConfig, tile: int, j: int, rows: int) -> int:
    """Remote rows in chunk j of `tile`."""
    m = tile % cfg.m_tiles
    own = -(-cfg.tokens // cfg.ranks)
    lo = m * cfg.block_m + j * rows
    hi = min(lo + rows, cfg.tokens)
    return max(0, hi - max(lo, own))


def attention_costs(rows: list[dict], block_m: int = 128, block_n: int = 128, *, source: str = "Ulysses results",
                    lines: Sequence[int] | None = None) -> TaskCosts:
    """Per-head-dim tile costs fitted to the attention-alone rows of a `xstage bench ulysses` CSV.

    A row's kernel runs `ceil(tiles / grid)` rounds of tiles on every program, so one tile costs
    its time over that; `overhead_ns + work / rate` is fitted per head dim over every row. The rows
    are checked first (`check_ulysses_rows`; `source` and `lines` name where a refused row is)."""
    check_ulysses_rows(rows, source, lines)
    by_dim: dict[int, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("variant") not in ("attention", "attention:triton"):
            continue
        try:
            cfg = UlyssesConfig(heads=int(r["heads"]), head_dim=int(r["dim"]), tokens=int(r["tokens"]),
                                ranks=int(r["P"]), block_m=int(r.get("block_m") or block_m),
                                block_n=int(r.get("block_n") or block_n), grid=int(r["grid"]))
            rounds = math.ceil(cfg.tiles / cfg.grid)
            by_dim.setdefault(cfg.head_dim, []).append((cfg.tile_work(), float(r.get("time_ns") or r["sender_ns"])
                                                        / rounds))
        except (KeyError, ValueError) as exc:
            raise InputError(f"Ulysses results row {r.get('heads')}x{r.get('dim')}/{r.get('tokens')}: "
                             f"malformed ({exc})") from None
    if not by_dim:
        raise InputError(f"{source}: no 'attention' rows (the attention-alone kernel) to fit tile costs to; "
                         f"its variants are {', '.join(sorted({str(r['variant']) for r in rows}))}")
    kinds, quality = {}, {}
    for d, pts in sorted(by_dim.items()):
        w, t = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        k = fit_kind(w, t)
        kinds[cost_kind(d, block_m, block_n)] = k
        err = np.abs((k.overhead_ns + w / k.rate) / t - 1)
        quality[cost_kind(d, block_m, block_n)] = {"points": len(pts), "median_abs_rel_error": float(np.median(err)),
                                                   "max_abs_rel_error": float(err.max())}
    return TaskCosts("attention", kinds, {"source": "attention-alone rows of a Ulysses benchmark CSV"}, quality)
