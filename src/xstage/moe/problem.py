"""MoE problem definitions: named shapes, the block spec, synthetic routing, and one problem instance.

- `MoeShape` (`H4096-I2048-E256-K6`: hidden, intermediate, experts, top-k) with one parser, the
  spelling of result rows, `--only shape=...` slices, `xstage plan moe --shape` and task costs.
- `parse_block` / `format_block`: the block spec `BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS]`; the default is
  `BlockConfig()`, the one place block defaults live.
- `routing`: uniform random top-k routing; `Problem`: inputs, weights and a loopback buffer of one
  configuration, what benchmarks, calibration and GPU checks run.

Example:
    >>> from xstage.moe.problem import MoeShape, parse_block
    >>> s = MoeShape.parse("H4096-I2048-E256-K6")
    >>> s.hidden, str(s), parse_block("64:128:256:64:4:3", s.hidden).block_m
    (4096, 'H4096-I2048-E256-K6', 64)
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from xstage.backend import refuse_interpreter_bf16, resolve_device
from xstage.bounds import INT64_MAX, MAX_RANKS, check_instance, check_int, label
from xstage.dtypes import DTYPES, FP8_DTYPES, parse_dtype
from xstage.errors import InputError
from xstage.moe.buffer import (
    FP8_BLOCK_CONFIG,
    MAX_EXPERTS,
    MAX_HIDDEN,
    MAX_TOKENS_PER_RANK,
    BlockConfig,
    LoopbackGroup,
    MoEBuffer,
)
from xstage.moe.layout import transform_weights

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


def routing(T: int, E: int, K: int, device, seed: int = 0):
    """Uniform random top-k routing (distinct experts per token) and normalised weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(T, E, generator=g, device=device)
    w, idx = torch.topk(scores, K, dim=1)
    return idx.contiguous(), (w / w.sum(1, keepdim=True)).float().contiguous()


class Problem:
    """Inputs, weights and a loopback buffer of one configuration on one device (rank 0 of `ep`).

    `dtype="fp8"`: the buffer is FP8 and the kernel's operands are (data, scale) pairs: `x_in` is `x`
    quantized 1x128 and `w1t`, `w2` are the weights quantized in 128x128 blocks (`xstage.moe.fp8`),
    while `x`, `l1`, `l2` stay the BF16 tensors they were quantized from (the baselines' inputs).
    Otherwise `x_in` is `x`."""

    def __init__(self, shape, tokens: int, ep: int, path: str, cfg: BlockConfig | None = None, device=None,
                 dtype="bf16", seed: int = 0, pacing="default"):
        H, I, E, K = self.shape = MoeShape.parse(shape)
        check_instance(cfg, "cfg", (BlockConfig, type(None)), "a BlockConfig or None")
        dtype = parse_dtype(dtype, allowed=(*DTYPES, *FP8_DTYPES))
        refuse_interpreter_bf16(dtype)  # before any tensor is drawn
        tokens = check_int(tokens, "tokens", 1, MAX_TOKENS_PER_RANK, "tokens per rank")
        ep = check_int(ep, "ep", 1, MAX_RANKS, "ranks of the EP group")
        seed = check_int(seed, "seed", 0, INT64_MAX - 1, "seed of the random problem")  # seed + 1 is drawn too
        if E % ep:
            raise InputError(f"ep={ep}: must divide the {E} experts of {self.shape}")
        device = resolve_device(device)
        self.fp8 = dtype in FP8_DTYPES.values()
        data_dtype = torch.bfloat16 if self.fp8 else dtype
        self.H, self.I, self.E, self.K, self.T, self.ep = H, I, E, K, tokens, ep
        el = E // ep
        g = torch.Generator(device=device).manual_seed(seed + 1)
        self.x = torch.randn(tokens, H, generator=g, device=device, dtype=data_dtype)
        self.idx, self.w = routing(tokens, E, K, device, seed)
        self.l1 = torch.randn(el, 2 * I, H, generator=g, device=device, dtype=data_dtype).mul_(H**-0.5)
        self.l2 = torch.randn(el, H, I, generator=g, device=device, dtype=data_dtype).mul_(I**-0.5)
        self.cfg = cfg or parse_block(None, H, fp8=self.fp8)
        self.buf = MoEBuffer(tokens, E, K, H, I, LoopbackGroup(ep, path=path), device=device, dtype=dtype,
                             config=self.cfg, pacing=pacing)
        if self.fp8:
            from xstage.moe.fp8 import quantize_activations, quantize_weights

            self.x_in = quantize_activations(self.x)
            self.l1_fp8, self.l2_fp8 = quantize_weights(self.l1), quantize_weights(self.l2)
            self.w1t, self.w2 = transform_weights(*self.l1_fp8[:1], *self.l2_fp8[:1], self.cfg.block_n1,
                                                  self.l1_fp8[1], self.l2_fp8[1])
        else:
            self.x_in = self.x
            self.w1t, self.w2 = transform_weights(self.l1, self.l2, self.cfg.block_n1)
        self.rows = tokens * K  # rows rank 0 computes (each of its (token, slot) pairs exactly once)

    def flops(self) -> float:
        return 6.0 * self.rows * self.H * self.I
