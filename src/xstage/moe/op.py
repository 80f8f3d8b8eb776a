"""`torch.ops.xstage.moe_fused`: the fused MoE layer as a torch custom op for serving stacks.

Problem: serving stacks trace layers with `torch.compile` and replay them in CUDA graphs. The op
takes tensors plus the *name* of a registered `MoEBuffer` (like symmetric-memory ops take a group
name), has a fake implementation for tracing, and runs `fused_moe` with the plan built on the device
and no host synchronisation (counters and signals reset themselves), so a captured graph can be
replayed with new routing in the same tensors. A custom order (`register_schedule`) is planned on
the host and cannot be captured.

FP8 buffers (`MoEBuffer(dtype="fp8")`): `w1t`, `w2` are the e4m3 weights of `transform_weights` with
their scales in `w1t_scale`, `w2_scale`; `x` is BF16 (quantized inside) or e4m3 with `x_scale`; the
output is BF16.

Example (runs on a machine without a GPU too, in Triton's interpreter):
    >>> import torch
    >>> from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer, transform_weights
    >>> from xstage.moe.op import register_buffer
    >>> cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
    >>> register_buffer("moe0", MoEBuffer(8, 4, 2, 64, 32, LoopbackGroup(2), device="cpu",
    ...                                   dtype="fp16", config=cfg))
    >>> x = torch.randn(8, 64, dtype=torch.float16)
    >>> idx, w = torch.stack([torch.randperm(4)[:2] for _ in range(8)]), torch.rand(8, 2)
    >>> w1t, w2 = transform_weights(torch.randn(2, 64, 64).half() / 8, torch.randn(2, 64, 32).half() / 8, 16)
    >>> torch.ops.xstage.moe_fused(x, idx, w, w1t, w2, "moe0", "lag:1").shape
    torch.Size([8, 64])
"""

from __future__ import annotations

import torch

from xstage.errors import InputError
from xstage.moe.buffer import MoEBuffer
from xstage.moe.fused import fused_moe

_BUFFERS: dict[str, MoEBuffer] = {}


def register_buffer(name: str, buf: MoEBuffer) -> None:
    """Make `buf` reachable from the op under `name` (re-registering a name replaces it)."""
    if not isinstance(buf, MoEBuffer):
        raise InputError(f"buffer: expected a MoEBuffer, got {type(buf).__name__}")
    _BUFFERS[name] = buf


def get_buffer(name: str) -> MoEBuffer:
    if name not in _BUFFERS:
        raise InputError(f"buffer_name {name!r}: not registered (have {sorted(_BUFFERS)})")
    return _BUFFERS[name]


def _with_scale(t: torch.Tensor, scale: torch.Tensor | None):
    return t if scale is None else (t, scale)


@torch.library.custom_op("xstage::moe_fused", mutates_args=())
def moe_fused(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1t: torch.Tensor,
              w2: torch.Tensor, buffer_name: str, schedule: str, pacing: str = "buffer",
              x_scale: torch.Tensor | None = None, w1t_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    return fused_moe(_with_scale(x, x_scale), topk_idx, topk_weights, _with_scale(w1t, w1t_scale),
                     _with_scale(w2, w2_scale), get_buffer(buffer_name), schedule, check=False,
                     pacing=pacing)


@moe_fused.register_fake
def _(x, topk_idx, topk_weights, w1t, w2, buffer_name, schedule, pacing="buffer", x_scale=None, w1t_scale=None,
      w2_scale=None):
    return x.new_empty(x.shape, dtype=get_buffer(buffer_name).out_dtype)
