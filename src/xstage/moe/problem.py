"""MoE problem instances: synthetic routing, and one configuration's inputs, weights and buffer.

- `routing`: uniform random top-k routing; `Problem`: inputs, weights and a loopback buffer of one
  configuration, what benchmarks, calibration and GPU checks run.
- The shapes (`MoeShape`, `SHAPES`) and the block spec (`parse_block`, `format_block`) are data of
  `xstage.spec.moe`, re-exported here.

Example:
    >>> from xstage.moe.problem import MoeShape, parse_block
    >>> s = MoeShape.parse("H4096-I2048-E256-K6")
    >>> s.hidden, str(s), parse_block("64:128:256:64:4:3", s.hidden).block_m
    (4096, 'H4096-I2048-E256-K6', 64)
"""

from __future__ import annotations

import torch

from xstage.backend import refuse_interpreter_bf16, resolve_device
from xstage.bounds import INT64_MAX, MAX_RANKS, check_instance, check_int
from xstage.dtypes import DTYPES, FP8_DTYPES, parse_dtype
from xstage.errors import InputError
from xstage.moe.buffer import LoopbackGroup, MoEBuffer
from xstage.moe.layout import transform_weights
from xstage.spec.moe import MAX_TOKENS_PER_RANK, SHAPES, BlockConfig, MoeShape, format_block, parse_block  # noqa: F401  (this module's names before xstage.spec)


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
