"""Weight layout for the fused kernel and the routing layout (which rows each unit of work covers).

Weight transform: Linear-1 `l1 [E, 2I, H]` (gate rows, then up rows) becomes `[E, 2I, H]` with gate
and up interleaved in blocks of `block_n1` rows (gate block 0, up block 0, gate block 1, ...), so one
Linear-1 task reads one contiguous `2*block_n1`-row slab and applies SwiGLU in its epilogue.
Linear-2 `l2 [E, H, I]` keeps its layout (rows are output columns, K-contiguous).

Routing layout: the rows this rank receives are sorted by local expert; each expert's rows are
padded to a multiple of `block_m`; a *unit* is one `block_m` row block of one expert. A unit's rows
have a logical position (for their source token and top-k slot) and a place in the row pool, the
receive and activation buffers: unit u uses pool slot `u % pool_units`, freed when unit
u - pool_units is done. All shapes are fixed by the capacities, so the layout runs without host
synchronisation (CUDA-graph friendly).

Example:
    >>> import torch
    >>> from xstage.moe.layout import routing_layout
    >>> idx = torch.tensor([[[0, 1], [1, 2]]])           # 1 rank, 2 tokens, top-2, 4 experts
    >>> lay = routing_layout(idx, rank=0, num_local_experts=4, block_m=2, rows_cap=8, units_cap=4,
    ...                      token_stride=2, pool_units=2)
    >>> lay.unit_info[:3].tolist()                       # (expert, first row, rows, first pool row)
    [[0, 0, 1, 0], [1, 2, 2, 2], [2, 4, 1, 0]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xstage.bounds import check_instance, check_int
from xstage.errors import InputError


def transform_weights(l1: torch.Tensor, l2: torch.Tensor, block_n1: int, l1_scale: torch.Tensor | None = None,
                      l2_scale: torch.Tensor | None = None):
    """`(l1 [E, 2I, H], l2 [E, H, I])` -> the fused kernel's layout (gate/up interleaved by block).

    FP8 weights (`float8_e4m3fn`, DeepSeek-V3 layout) come with their 128x128 scales `l1_scale [E,
    2I/128, H/128]` and `l2_scale [E, H/128, I/128]`, need `block_n1` = 128, and give the pairs
    `((w1t, w1t_scale), (w2, w2_scale))` that `fused_moe` takes on an FP8 buffer; the scale rows are
    interleaved like the weight rows."""
    if isinstance(l1, torch.Tensor) and l1.dtype == torch.float8_e4m3fn or l1_scale is not None:
        from xstage.moe.fp8 import BLOCK, check_fp8_moe_weights

        if l1_scale is None or l2_scale is None:
            raise InputError("l1_scale, l2_scale: FP8 weights need both 128x128 scale tensors")
        check_fp8_moe_weights(l1, l1_scale, l2, l2_scale)
        if block_n1 != BLOCK:
            raise InputError(f"block_n1={block_n1}: must be {BLOCK} with FP8 weights (one scale block per tile)")
        w1t, w2 = transform_weights(l1.view(torch.uint8), l2.view(torch.uint8), block_n1)
        s1t, s2 = transform_weights(l1_scale, l2_scale, 1)  # one scale row per 128 weight rows
        return (w1t.view(l1.dtype), s1t), (w2.view(l2.dtype), s2)
    if l2_scale is not None:
        raise InputError("l2_scale: only goes with FP8 weights and l1_scale")
    for name, t in (("l1", l1), ("l2", l2)):
        check_instance(t, name, torch.Tensor, "a 3-d weight tensor")
    block_n1 = check_int(block_n1, "block_n1", 1, 1 << 16, "weight rows per N tile of Linear-1")
    if l1.dim() != 3 or l2.dim() != 3:
        raise InputError(f"l1, l2: expected 3-d [E, 2I, H] and [E, H, I], got {tuple(l1.shape)}, {tuple(l2.shape)}")
    e, two_i, h = l1.shape
    if two_i % 2 or l2.shape != (e, h, two_i // 2):
        raise InputError(f"l2: expected shape {(e, h, two_i // 2)} to match l1 {tuple(l1.shape)}")
    inter = two_i // 2
    if inter % block_n1:
        raise InputError(f"intermediate size {inter}: must be a multiple of block_n1={block_n1}")
    nb = inter // block_n1
    gate = l1[:, :inter].reshape(e, nb, 1, block_n1, h)
    up = l1[:, inter:].reshape(e, nb, 1, block_n1, h)
    return torch.cat([gate, up], dim=2).reshape(e, two_i, h).contiguous(), l2.contiguous()


def untransform_l1(l1t: torch.Tensor, block_n1: int) -> torch.Tensor:
    """Inverse of the Linear-1 part of `transform_weights`."""
    e, two_i, h = l1t.shape
    inter = two_i // 2
    v = l1t.reshape(e, inter // block_n1, 2, block_n1, h)
    return torch.cat([v[:, :, 0].reshape(e, inter, h), v[:, :, 1].reshape(e, inter, h)], dim=1)


@dataclass
class RoutingLayout:
    """Device tensors describing the rows this rank computes.

    unit_info: [units_cap, 4] int32 (local expert, first padded row, valid rows, first row of its pool
               slot); unused units have 0 rows.
    row_src:   [rows_cap] int32, `source_rank * token_stride + token` of each padded row (-1: padding).
    row_slot:  [rows_cap] int32, top-k slot of each row.
    counts:    [num_local_experts] int64 rows per local expert.
    num_units: device scalar, units in use.
    """

    unit_info: torch.Tensor
    row_src: torch.Tensor
    row_slot: torch.Tensor
    counts: torch.Tensor
    num_units: torch.Tensor


def routing_layout(all_topk_idx, rank, num_local_experts, block_m, rows_cap, units_cap, token_stride,
                   pool_units: int | None = None):
    """Layout of the rows rank `rank` receives, from every rank's routing `all_topk_idx [R, T, K]`;
    `pool_units` slots of `block_m` rows hold them (default: one slot per unit)."""
    R, T, K = all_topk_idx.shape
    dev = all_topk_idx.device
    flat = all_topk_idx.reshape(-1).long()
    owner = flat // num_local_experts
    key = torch.where(owner == rank, flat % num_local_experts, torch.full_like(flat, num_local_experts))
    order = torch.argsort(key, stable=True)
    # scatter_add rather than bincount: bincount on CUDA reads the maximum back to the host.
    counts_all = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=dev)
    counts_all.scatter_add_(0, key, torch.ones_like(key))
    counts = counts_all[:num_local_experts]
    start = torch.cumsum(counts_all, 0) - counts_all
    n_units = (counts + block_m - 1) // block_m
    pstart = (torch.cumsum(n_units, 0) - n_units) * block_m
    sk = key[order]
    pos = torch.arange(order.numel(), device=dev)
    valid = sk < num_local_experts
    skc = sk.clamp(max=num_local_experts - 1)
    dest = torch.where(valid, pstart[skc] + pos - start[sk], torch.full_like(pos, rows_cap))
    dest = dest.clamp(max=rows_cap)
    src_token = order // K
    s, t = src_token // T, src_token % T
    row_src = torch.full((rows_cap + 1,), -1, dtype=torch.int32, device=dev)
    row_slot = torch.zeros(rows_cap + 1, dtype=torch.int32, device=dev)
    row_src.scatter_(0, dest, (s * token_stride + t).to(torch.int32))
    row_slot.scatter_(0, dest, (order % K).to(torch.int32))
    uend = torch.cumsum(n_units, 0)
    u = torch.arange(units_cap, device=dev)
    e = torch.searchsorted(uend, u, right=True)
    ec = e.clamp(max=num_local_experts - 1)
    mb = u - (uend[ec] - n_units[ec])
    rows = torch.where(e < num_local_experts, (counts[ec] - mb * block_m).clamp(0, block_m), torch.zeros_like(u))
    pool_row = (u % (pool_units or units_cap)) * block_m
    info = torch.stack([ec, pstart[ec] + mb * block_m, rows, pool_row], dim=1).to(torch.int32)
    return RoutingLayout(info.contiguous(), row_src[:rows_cap], row_slot[:rows_cap], counts, uend[-1])


def unit_experts(counts, block_m: int) -> list[int]:
    """Host list: the local expert of each unit, in unit order, from per-expert row counts."""
    out: list[int] = []
    for e, c in enumerate(counts):
        out.extend([e] * (-(-int(c) // block_m)))
    return out
