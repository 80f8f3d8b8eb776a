"""A per-tile cost model of the fused MoE kernel: a task's time from its FLOPs, its bytes and the
operand element size, with five machine constants fitted to traced tiles.

Problem: the measured tile table (`TaskCosts.table`) covers the traced shapes only. A planner for
another shape, token count, EP size or operand type needs a tile's time from what the tile does.

Model (one task on one SM while every SM is busy, as in the traces; `xstage.moe.kernels`):
- A GEMM tile (LINEAR1 `[BM, H] x [H, 2*BN1]`, LINEAR2 `[BM, I] x [I, BN2]`) is a roofline:

      t = overhead_ns + max(flops / mma_rate(e), hbm_bytes / hbm_bytes_per_ns)

  `flops` counts the padded tile (tensor cores compute all BM rows). `hbm_bytes` is what the tile
  brings from HBM: its weight slab (N x K x e) divided by the units that read it, plus its unit's
  activation rows (BM x K x e) divided by the unit's slabs. The units of one expert read the same slab
  a few tasks apart in every schedule's order, so only the first one misses in L2; a unit's
  activation rows are read from HBM once, by its first slab. TMA loads run several stages ahead of the
  MMAs, so memory time and MMA time overlap (a max, not a sum). `overhead_ns` is what does not overlap:
  filling the pipeline, the epilogue's stores, the release. Output stores (a few percent of a tile's
  bytes, drained by L2 write-back) are left out.
- Units reading one slab: E[ceil(c / BM) | c > 0] for an expert's row count c ~ Binomial(n, topk /
  experts) with mean `rows_per_expert` (uniform routing, as `xstage.sched.moe.synthetic_routing`).
- A DISPATCH task copies its unit's valid rows (min(BM, rows per expert) rows of H elements) in H / BD
  chunks, each waiting for its loads before it stores (`_dispatch`; BD as `parse_block` picks it):

      t = chunks * loaded_latency_ns * rho**2 + copy_bytes / copy_bytes_per_ns

  `rho` is the HBM utilisation of the GEMM tiles running beside it (their HBM time over their tile
  time, over one unit's tiles). A chunk's loads queue behind those tiles' weight streams: with few
  rows per expert the tiles stream weights and rho nears 1, with many rows they are MMA-bound and the
  queue is short. The square was chosen over rho and rho / (1 - rho) on the calibration traces.
- mma_rate(e) = mma_flops_per_ns * mma_elem_bytes / e: tensor cores take a fixed number of operand
  bytes per cycle, so 1-byte (FP8) operands double the 2-byte rate (Hopper's datasheet ratio). Only
  2-byte tiles have been traced: the FP8 rate is that assumption until FP8 tiles are.

Constants are per SM with all SMs busy (times the SM count for a GPU-wide figure).
`xstage.calibrate.tilemodel.fit_tile_model` fits them in two least-squares stages on relative (log)
errors: the GEMM constants on the GEMM tiles, then the dispatch constants on the dispatch tasks, with
rho from the fitted GEMM constants.

Example:
    >>> m = TileModel(overhead_ns=3000.0, mma_flops_per_ns=5500.0, hbm_bytes_per_ns=37.0,
    ...               copy_bytes_per_ns=23.0, loaded_latency_ns=2900.0)
    >>> round(m.tile_ns("linear1", "H4096-I2048-E256-K6", "128x128x256x64", rows_per_expert=24.0))
    61451
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from xstage.errors import InputError
from xstage.spec.moe import MoeShape, parse_block

KINDS = ("dispatch", "linear1", "linear2")
GEMM_KINDS = ("linear1", "linear2")


def parse_block_key(block) -> tuple[int, int, int, int]:
    """Tile config key `BMxBN1xBN2xBK` (as in task costs and benchmark rows) -> (BM, BN1, BN2, BK)."""
    parts = block if isinstance(block, tuple) else str(block).split("x")
    try:
        sizes = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        sizes = ()
    if len(sizes) != 4 or min(sizes) < 1:
        raise InputError(f"block={block!r}: expected BMxBN1xBN2xBK with positive sizes, e.g. 128x128x256x64")
    return sizes


def _positive(name: str, v, integer: bool = False) -> float:
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    if not ok or (integer and v != int(v)):
        raise InputError(f"{name}={v!r}: must be a finite {'integer' if integer else 'number'} > 0")
    return int(v) if integer else float(v)


@lru_cache(maxsize=4096)  # planners ask for the same configuration once per schedule and kind
def units_per_expert(rows_per_expert: float, block_m: int, route_share: float) -> float:
    """Mean units of `block_m` rows of an expert that has rows: E[ceil(c / BM) | c > 0] with
    c ~ Binomial(n, route_share) of mean `rows_per_expert`."""
    rpe = _positive("rows_per_expert", rows_per_expert)
    if not 0 < route_share <= 1:
        raise InputError(f"route_share={route_share!r}: must be in (0, 1] (topk / experts)")
    from scipy import stats  # imported where used: scipy costs 0.4 s of `import xstage`

    n = max(1, round(rpe / route_share))
    dist = stats.binom(n, route_share)
    c = np.arange(int(dist.ppf(1e-12)), int(dist.isf(1e-12)) + 1)
    pmf = dist.pmf(c)
    return float(np.sum(pmf * np.ceil(c / block_m)) / max(1.0 - dist.pmf(0), 1e-300))


@dataclass(frozen=True)
class TileWork:
    """What one task does: GEMM tiles carry `flops`, `hbm_bytes` and `load_bytes` (every operand byte
    it loads, from L2 or HBM), dispatch `copy_bytes` and `chunks`."""

    kind: str
    elem_bytes: int
    flops: float = 0.0
    hbm_bytes: float = 0.0
    load_bytes: float = 0.0
    copy_bytes: float = 0.0
    chunks: int = 0


def tile_work(kind: str, shape, block, rows_per_expert: float, elem_bytes: int = 2) -> TileWork:
    """The FLOPs and bytes of one task of `kind` (see the module docstring)."""
    if kind not in KINDS:
        raise InputError(f"kind={kind!r}: expected one of {', '.join(KINDS)}")
    h, i, experts, topk = MoeShape.parse(shape)
    bm, bn1, bn2, _bk = parse_block_key(block)
    rpe = _positive("rows_per_expert", rows_per_expert)
    e = _positive("elem_bytes", elem_bytes, integer=True)
    if kind == "dispatch":
        chunk = parse_block(None, h).block_d  # the kernel's copy width for this hidden size
        return TileWork(kind, e, copy_bytes=min(bm, rpe) * h * e, chunks=-(-h // chunk))
    if kind == "linear1":
        n_cols, k_dim, slabs = 2 * bn1, h, -(-i // bn1)
    else:
        n_cols, k_dim, slabs = min(bn2, h), i, -(-h // bn2)
    sharing = units_per_expert(rpe, bm, min(1.0, topk / experts))
    hbm = n_cols * k_dim * e / sharing + bm * k_dim * e / slabs
    return TileWork(kind, e, flops=2.0 * bm * n_cols * k_dim, hbm_bytes=hbm, load_bytes=(bm + n_cols) * k_dim * e)


def unit_gemm_tiles(shape, block, rows_per_expert: float, elem_bytes: int = 2) -> list[tuple[int, TileWork]]:
    """(count, work) of the GEMM tiles of one unit: I / BN1 LINEAR1 slabs and H / BN2 LINEAR2 slabs."""
    h, i, _, _ = MoeShape.parse(shape)
    _, bn1, bn2, _ = parse_block_key(block)
    return [(-(-i // bn1), tile_work("linear1", shape, block, rows_per_expert, elem_bytes)),
            (-(-h // bn2), tile_work("linear2", shape, block, rows_per_expert, elem_bytes))]


@dataclass(frozen=True)
class TileModel:
    """Machine constants of the tile roofline (module docstring), per SM with every SM busy."""

    overhead_ns: float  # GEMM tile time that overlaps nothing: pipeline fill, epilogue, release
    mma_flops_per_ns: float  # tensor-core FLOP rate at `mma_elem_bytes` operands
    hbm_bytes_per_ns: float  # the SM's share of HBM bandwidth
    copy_bytes_per_ns: float  # dispatch copy rate
    loaded_latency_ns: float  # a dispatch chunk's wait for its loads with HBM saturated
    mma_elem_bytes: int = 2  # operand size the MMA rate was fitted at
    fitted_on: tuple[str, ...] = ()  # shapes whose traces fitted the constants
    quality: dict = field(default_factory=dict, compare=False)  # per kind: median / max |pred/meas - 1|

    def __post_init__(self):
        for name in ("mma_flops_per_ns", "hbm_bytes_per_ns", "copy_bytes_per_ns"):
            _positive(name, getattr(self, name))
        for name in ("overhead_ns", "loaded_latency_ns"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                raise InputError(f"{name}={v!r}: must be a finite number >= 0")
        _positive("mma_elem_bytes", self.mma_elem_bytes, integer=True)

    def mma_rate(self, elem_bytes: int) -> float:
        return self.mma_flops_per_ns * self.mma_elem_bytes / elem_bytes

    def gemm_ns(self, w: TileWork) -> float:
        return self.overhead_ns + max(w.flops / self.mma_rate(w.elem_bytes), w.hbm_bytes / self.hbm_bytes_per_ns)

    def hbm_utilisation(self, shape, block, rows_per_expert: float, elem_bytes: int = 2) -> float:
        """HBM busy share of one unit's GEMM tiles: their HBM time over their tile time."""
        tiles = unit_gemm_tiles(shape, block, rows_per_expert, elem_bytes)
        busy = sum(n * w.hbm_bytes / self.hbm_bytes_per_ns for n, w in tiles)
        return busy / sum(n * self.gemm_ns(w) for n, w in tiles)

    def dispatch_ns(self, w: TileWork, rho: float) -> float:
        return w.chunks * self.loaded_latency_ns * rho**2 + w.copy_bytes / self.copy_bytes_per_ns

    def tile_ns(self, kind: str, shape, block, rows_per_expert: float, elem_bytes: int = 2) -> float:
        """A task's compute time (ns) from its shape, tile config, rows per expert and operand size."""
        w = tile_work(kind, shape, block, rows_per_expert, elem_bytes)
        if kind in GEMM_KINDS:
            return self.gemm_ns(w)
        return self.dispatch_ns(w, self.hbm_utilisation(shape, block, rows_per_expert, elem_bytes))

    CONSTANTS = ("overhead_ns", "mma_flops_per_ns", "hbm_bytes_per_ns", "copy_bytes_per_ns", "loaded_latency_ns")

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.CONSTANTS}, "mma_elem_bytes": self.mma_elem_bytes,
                "fitted_on": list(self.fitted_on), "quality": self.quality}

    @classmethod
    def from_dict(cls, d: dict, source: str = "tile model") -> TileModel:
        try:
            return cls(*(d[k] for k in cls.CONSTANTS), mma_elem_bytes=d.get("mma_elem_bytes", 2),
                       fitted_on=tuple(str(s) for s in d.get("fitted_on", ())), quality=dict(d.get("quality", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{source}: malformed tile model ({type(exc).__name__}: {exc})") from None


