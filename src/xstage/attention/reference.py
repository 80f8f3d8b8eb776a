"""Ground truth in plain torch: attention math in float64 and Ulysses as an explicit all-to-all.

`attention_reference` is softmax(scale q k^T) v over `[B, S, H, D]`. `ulysses_reference` takes every
rank's local shards and does what DeepSpeed-Ulysses does with plain tensor slicing: each rank gathers
its heads over the whole sequence (all-to-all 1), runs attention, and the results are scattered back
to the token owners (all-to-all 2). Nothing here shares code with the kernels or `layout.py`.

Example:
    >>> import torch
    >>> shards = [torch.randn(1, n, 5, 16) for n in (3, 2)]
    >>> outs = ulysses_reference(shards, shards, shards)
    >>> [tuple(o.shape) for o in outs]
    [(1, 3, 5, 16), (1, 2, 5, 16)]
"""

from __future__ import annotations

import math

import torch


def attention_reference(q, k, v, *, softmax_scale=None, kv_lens=None, dtype=torch.float64):
    """softmax(scale q k^T) v for `[B, S, H, D]` inputs, computed in `dtype`; keys past kv_lens[b] ignored."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    qt, kt, vt = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale  # [B, H, S_q, S_k]
    if kv_lens is not None:
        valid = torch.arange(k.shape[1], device=q.device)[None, :] < kv_lens.to(q.device)[:, None].long()
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, vt).transpose(1, 2)


def ulysses_reference(qs, ks, vs, *, softmax_scale=None, dtype=torch.float64):
    """Outputs `[B, S_r, H, D]` of every rank, given every rank's local `[B, S_r, H, D]` shards."""
    world = len(qs)
    heads = qs[0].shape[2]
    head_split = [heads // world + (1 if p < heads % world else 0) for p in range(world)]
    head_start = [sum(head_split[:p]) for p in range(world)]
    tok_start = [sum(q.shape[1] for q in qs[:p]) for p in range(world)]
    outs = [torch.empty(q.shape, dtype=dtype, device=q.device) for q in qs]
    for r in range(world):
        hs = slice(head_start[r], head_start[r] + head_split[r])
        # all-to-all 1: rank r receives its heads of every rank's tokens, in rank order
        qg = torch.cat([q[:, :, hs] for q in qs], dim=1)
        kg = torch.cat([k[:, :, hs] for k in ks], dim=1)
        vg = torch.cat([v[:, :, hs] for v in vs], dim=1)
        og = attention_reference(qg, kg, vg, softmax_scale=softmax_scale, dtype=dtype)
        # all-to-all 2: token owner p receives rows of its tokens for heads hs
        for p in range(world):
            outs[p][:, :, hs] = og[:, tok_start[p]:tok_start[p] + qs[p].shape[1]]
    return outs
