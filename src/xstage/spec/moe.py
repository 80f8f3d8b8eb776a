"""What a MoE layer is, as data: its shape, its tiles, its limits and its row pool's size.

- `MoeShape` (`H4096-I2048-E256-K6`: hidden, intermediate, experts, top-k) with one parser, the
  spelling of result rows, `--only shape=...` slices, `xstage plan moe --shape` and task costs;
  `SHAPES`, the four shapes of the benchmark grids and the tile-cost calibration.
- `BlockConfig`, the kernel's tiles and launch options, and its spec `BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS]`
  (`parse_block` / `format_block`); `BlockConfig()` is the one place block defaults live.
- The limits every floor checks against (`MAX_HIDDEN`, `MAX_EXPERTS`, `MAX_TOKENS_PER_RANK`), and the
  row pool's arithmetic (`max_units`, `pool_units`) that the kernel's buffer and the planner share.

Nothing here imports torch or Triton: the planner, the CLI and the kernels agree on these values.

Example:
    >>> from xstage.spec.moe import MoeShape, parse_block
    >>> s = MoeShape.parse("H4096-I2048-E256-K6")
    >>> s.hidden, str(s), parse_block("64:128:256:64:4:3", s.hidden).block_m
    (4096, 'H4096-I2048-E256-K6', 64)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from xstage.bounds import INT64_MAX, check_int, label
from xstage.errors import InputError

FP8_SCALE_BLOCK = 128  # the DeepSeek-V3 scale block of FP8 weights and activations (`xstage.moe.fp8`)

# The row pool (receive rows and activations): 256 MiB holds 102 units of 128 rows at H7168/I3072 in
# bf16; a pool never holds fewer than MIN_POOL_UNITS units (every built-in schedule up to lag:30 runs
# in it) nor more units than any routing can fill.
DEFAULT_POOL_BYTES = 256 << 20
MIN_POOL_UNITS = 32

MIN_GEMM_BLOCK = 16  # the smallest tile extent `tl.dot` takes
# The largest tile extent: a Triton block holds at most 2^20 elements, which a [1024, 1024] tile is.
MAX_BLOCK = 1024
MAX_STAGES = 16  # pipeline stages; the shared-memory check below bounds what fits far sooner
MAX_CTAS_PER_SM = 32  # resident CTAs an SM can hold (Hopper)
# Layer sizes, in elements: hidden and intermediate of the widest models are below 2^15 and their
# expert counts in the hundreds; top-k is at most the experts.
MAX_HIDDEN = 1 << 16
MAX_EXPERTS = 1 << 12
# Tokens per rank in one call: 1M, beyond any batch a layer is called with (x alone is 8 GiB at hidden
# 4096); the int32 row metadata bounds ranks x tokens x top-k separately.
MAX_TOKENS_PER_RANK = 1 << 20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_block_size(v, name: str, minimum: int = MIN_GEMM_BLOCK, maximum: int = MAX_BLOCK,
                     what: str = "block size") -> int:
    """`v` if it is a power-of-two integer in [`minimum`, `maximum`]; else `InputError` naming `name`."""
    if not _is_int(v) or v < minimum or v & (v - 1) or v > maximum:
        raise InputError(f"{name}={v!r}: {what} must be a power of two in {minimum}..{maximum}")
    return v


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch options of the fused kernel (one unit = `block_m` rows of one expert)."""

    block_m: int = 128
    block_n1: int = 128
    block_n2: int = 256
    block_k: int = 64
    block_d: int = 128
    num_warps: int = 8
    num_stages: int = 4
    ctas_per_sm: int = 0
    tma: bool = True  # GEMM operands through TMA descriptors (else pointer loads)
    dynamic: bool = True  # CTAs take the next task of the global order when free (else round-robin)

    def __post_init__(self):
        # Refused here, not inside Triton: GEMM tiles are `tl.arange` / `tl.dot` extents (powers of two,
        # at least 16), the dispatch chunk is a `tl.arange` extent, warps are a power of two.
        for name in ("block_m", "block_n1", "block_n2", "block_k"):
            check_block_size(getattr(self, name), f"BlockConfig {name}", minimum=MIN_GEMM_BLOCK)
        check_block_size(self.block_d, "BlockConfig block_d", minimum=1)
        check_block_size(self.num_warps, "BlockConfig num_warps", minimum=1, maximum=32, what="warps per CTA")
        for name, low, high, what in (("num_stages", 1, MAX_STAGES, "pipeline stages"),
                                      ("ctas_per_sm", 0, MAX_CTAS_PER_SM, "CTAs per SM, 0: one")):
            v = getattr(self, name)
            if not _is_int(v):  # the config is hashed and compiled on: no float stands in for an int here
                raise InputError(f"BlockConfig {name}={v!r}: must be an integer in {low}..{high} ({what})")
            check_int(v, f"BlockConfig {name}", low, high, what)
        for name in ("tma", "dynamic"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"BlockConfig {name}={getattr(self, name)!r}: must be True or False")


# The FP8 default: one scale block per K step and per Linear-1 tile, pointer loads (no FP8 TMA path yet).
FP8_BLOCK_CONFIG = BlockConfig(block_n1=FP8_SCALE_BLOCK, block_n2=FP8_SCALE_BLOCK, block_k=FP8_SCALE_BLOCK, tma=False)


def max_units(num_ranks: int, tokens_per_rank: int, topk: int, num_local_experts: int, block_m: int) -> int:
    """Units any legal routing can make on one rank: every (token, slot) pair of the group on its
    experts, each expert padding its last unit."""
    return -(-(num_ranks * tokens_per_rank * topk) // block_m) + num_local_experts


def pool_units(pool_bytes: int | None, unit_bytes: int, units_cap: int) -> int:
    """Units of `unit_bytes` (`block_m` rows of hidden + intermediate) a pool of `pool_bytes` holds
    (default `DEFAULT_POOL_BYTES`), never more than `units_cap`; refuses a pool below the minimum."""
    if pool_bytes is None:
        pool_bytes = DEFAULT_POOL_BYTES
    pool_bytes = check_int(pool_bytes, "pool_bytes", 1, INT64_MAX, "bytes of the row pool")
    minimum = min(MIN_POOL_UNITS, units_cap)
    units = min(pool_bytes // unit_bytes, units_cap)
    if units < minimum:
        raise InputError(f"pool_bytes={pool_bytes}: holds {pool_bytes // unit_bytes} units of {unit_bytes} bytes "
                         f"(block_m rows of hidden + intermediate); the minimum is {minimum} units "
                         f"= {minimum * unit_bytes} bytes")
    return int(units)



_SHAPE = re.compile(r"^H(\d+)-I(\d+)-E(\d+)-K(\d+)$")


class MoeShape(NamedTuple):
    """An MoE layer's sizes: hidden, intermediate (per expert), number of experts, top-k."""

    hidden: int
    intermediate: int
    num_experts: int
    topk: int

    @classmethod
    def parse(cls, text, arg: str = "shape") -> MoeShape:
        """`"H4096-I2048-E256-K6"` -> MoeShape; a MoeShape or a 4-tuple passes through."""
        if isinstance(text, tuple) and len(text) == 4:
            sizes = text
        else:
            m = _SHAPE.match(str(text).strip())
            if not m:
                raise InputError(f"{label(arg, text)}: expected H<hidden>-I<intermediate>-E<experts>-K<topk> with "
                                 "positive sizes, e.g. H4096-I2048-E256-K6")
            sizes = [int(g) for g in m.groups()]
        try:
            h, i, e = (check_int(v, name, 1, hi, what) for v, name, hi, what in zip(sizes, "HIE", (
                MAX_HIDDEN, MAX_HIDDEN, MAX_EXPERTS), ("hidden size", "intermediate size", "experts")))
            k = check_int(sizes[3], "K", 1, e, "top-k, at most the experts")
        except InputError as exc:
            raise InputError(f"{label(arg, text)}: {exc}") from None
        return cls(h, i, e, k)

    def __str__(self) -> str:
        return f"H{self.hidden}-I{self.intermediate}-E{self.num_experts}-K{self.topk}"


# The four shapes of the benchmark grids and of the tile-cost calibration, in report order.
SHAPES: dict[str, MoeShape] = {s: MoeShape.parse(s) for s in (
    "H4096-I2048-E256-K6", "H7168-I3072-E384-K6", "H4096-I1536-E128-K8", "H1152-I4608-E8-K2")}

_FLAG = re.compile(r"^(?:-|[td]*)([1-9])?$")


def format_block(cfg: BlockConfig) -> str:
    """The block spec of `cfg` (without flags): `BM:BN1:BN2:BK:WARPS:STAGES`."""
    return ":".join(str(v) for v in (cfg.block_m, cfg.block_n1, cfg.block_n2, cfg.block_k, cfg.num_warps,
                                     cfg.num_stages))


DEFAULT_BLOCK = format_block(BlockConfig())
# The FP8 buffer's default tiles: pointer loads (no FP8 TMA path), dynamic task fetch.
DEFAULT_BLOCK_FP8 = format_block(FP8_BLOCK_CONFIG) + ":d"


def parse_block(spec: str | None, hidden: int, fp8: bool = False) -> BlockConfig:
    """`"BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS]"` -> BlockConfig; None -> the defaults (of an FP8 buffer with
    `fp8`). BN2 halves until it divides `hidden`.

    FLAGS (optional) picks the kernel variant: letters `t` (TMA loads) and `d` (dynamic task fetch), or
    `-` for neither, then optionally a digit: CTAs per SM (`d2`: dynamic, two CTAs per SM; the first
    launch refuses a grid whose CTAs do not fit); without FLAGS the BlockConfig defaults apply."""
    if spec is not None and not isinstance(spec, str):
        raise InputError(f"block {spec!r}: expected a string BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS] or None")
    hidden = check_int(hidden, "hidden", 1, MAX_HIDDEN, "hidden size the tiles split")
    parts = (spec if spec is not None else (DEFAULT_BLOCK_FP8 if fp8 else DEFAULT_BLOCK)).split(":")
    flags = parts.pop() if len(parts) == 7 else None
    try:
        if len(parts) != 6:
            raise ValueError
        bm, bn1, bn2, bk, warps, stages = (int(v) for v in parts)
    except ValueError:
        raise InputError(f"block {spec!r}: expected BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS]") from None
    m = _FLAG.match(flags) if flags is not None else None
    if flags is not None and (not flags or m is None):
        raise InputError(f"block {spec!r}: FLAGS must be made of 't' (TMA), 'd' (dynamic) or be '-', then "
                         "optionally a digit 1-9 (CTAs per SM)")
    while bn2 > 1 and hidden % bn2:
        bn2 //= 2
    # Dispatch copies [BM, BD] chunks one after another, each waiting for its loads: wide chunks
    # keep more bytes in flight (the copy was latency-bound at BD=128).
    bd = next((b for b in (512, 256, 128, 64, 32, 16, 8) if hidden % b == 0), None)
    if bd is None:
        raise InputError(f"hidden={hidden}: must be a multiple of 8")
    variant = {} if flags is None else dict(tma="t" in flags, dynamic="d" in flags,
                                            ctas_per_sm=int(m.group(1) or 0))
    return BlockConfig(block_m=bm, block_n1=bn1, block_n2=bn2, block_k=bk, block_d=bd, num_warps=warps,
                       num_stages=stages, **variant)


CALIBRATION_SHAPES = tuple(SHAPES)
# The planner's models (tile model, interference term) are calibrated on these two shapes only; the two
# other benchmark shapes (`REPORT_SHAPES`) score them.
MODEL_SHAPES = ("H4096-I2048-E256-K6", "H1152-I4608-E8-K2")
REPORT_SHAPES = tuple(s for s in CALIBRATION_SHAPES if s not in MODEL_SHAPES)


__all__ = ["CALIBRATION_SHAPES", "MODEL_SHAPES", "REPORT_SHAPES", "DEFAULT_BLOCK", "DEFAULT_BLOCK_FP8",
           "DEFAULT_POOL_BYTES", "FP8_BLOCK_CONFIG", "FP8_SCALE_BLOCK", "MAX_BLOCK", "MAX_CTAS_PER_SM",
           "MAX_EXPERTS", "MAX_HIDDEN", "MAX_STAGES", "MAX_TOKENS_PER_RANK", "MIN_GEMM_BLOCK", "MIN_POOL_UNITS",
           "SHAPES", "BlockConfig", "MoeShape", "check_block_size", "format_block", "max_units", "parse_block",
           "pool_units"]
