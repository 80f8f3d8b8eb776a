"""How Ulysses splits heads and tokens over P ranks, and the buffers its all-to-alls exchange.

Rank p holds tokens `[tok0[p], tok0[p+1])` of the sequence and, after the pre-attention all-to-all,
heads `[head0[p], head0[p+1])`; both splits give the first `n % P` ranks one more (any head count,
any sequence length). A rank may hold no token (fewer tokens than ranks, or the caller's `seq_lens`)
or own no head (H < P): its chunks are then empty, and it still computes and exchanges the rest.
Gathered tensors are kept sequence-major, `[S, ..., B, h, D]` in memory and viewed as `[B, S, h, D]`,
so that one rank's rows of the sequence are one contiguous chunk: the chunks of an all-to-all are
then plain slices and attention reads them through strides.

Pre-attention (`pack_qkv` / `unpack_qkv`): rank r sends rank p the chunk `[S_r, 3, B, h_p, D]`
(q, k, v of p's heads on r's tokens) and receives `[S_p, 3, B, h_r, D]` from every p, i.e. one
`[S, 3, B, h_r, D]` buffer. Post-attention (serial path, `unpack_out`): the attention output
`[S, B, h_r, D]` is already the send buffer; rank r receives `[S_r, B, h_p, D]` from every p.

Example:
    >>> plan = UlyssesPlan(world=4, rank=1, batch=1, seq_lens=split_sizes(10, 4), heads=30, head_dim=64)
    >>> plan.head0, plan.tok0
    ([0, 8, 16, 23, 30], [0, 3, 6, 8, 10])
"""

from __future__ import annotations

import torch

from xstage.spec.ulysses import UlyssesPlan, split_sizes  # noqa: F401  (re-exported: this module's names before xstage.spec)


def pack_qkv(plan: UlyssesPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The flat send buffer of the pre-attention all-to-all: chunk p is `[S_r, 3, B, h_p, D]`."""
    B, S_r, H, D = q.shape
    send = torch.empty(sum(plan.qkv_send_splits()), dtype=q.dtype, device=q.device)
    if plan.heads % plan.world == 0:
        h = H // plan.world
        view = send.view(plan.world, S_r, 3, B, h, D)
        for i, t in enumerate((q, k, v)):
            view[:, :, i].copy_(t.view(B, S_r, plan.world, h, D).permute(2, 1, 0, 3, 4))
        return send
    off = 0
    head0 = plan.head0
    for p, n in enumerate(plan.qkv_send_splits()):
        h = plan.heads_of(p)
        chunk = send[off:off + n].view(S_r, 3, B, h, D)
        for i, t in enumerate((q, k, v)):
            chunk[:, i].copy_(t[:, :, head0[p]:head0[p + 1]].transpose(0, 1))
        off += n
    return send


def unpack_qkv(plan: UlyssesPlan, recv: torch.Tensor):
    """Views `[B, S, h_r, D]` of q, k, v inside the receive buffer `[S, 3, B, h_r, D]` (no copy)."""
    h = plan.heads_of(plan.rank)
    g = recv.view(plan.seq_total, 3, plan.batch, h, plan.head_dim).permute(1, 2, 0, 3, 4)
    return g[0], g[1], g[2]


def empty_gathered_out(plan: UlyssesPlan, dtype, device) -> torch.Tensor:
    """Attention output of this rank's heads over the whole sequence: `[S, B, h_r, D]` viewed `[B, S, h_r, D]`."""
    h = plan.heads_of(plan.rank)
    return torch.empty(plan.seq_total, plan.batch, h, plan.head_dim, dtype=dtype, device=device).transpose(0, 1)


def unpack_out(plan: UlyssesPlan, recv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the post-attention receive buffer (chunk p = `[S_r, B, h_p, D]`) into `out` `[B, S_r, H, D]`."""
    S_r = plan.seq_lens[plan.rank]
    B, D = plan.batch, plan.head_dim
    if plan.heads % plan.world == 0:
        h = plan.heads // plan.world
        out.view(B, S_r, plan.world, h, D).copy_(recv.view(plan.world, S_r, B, h, D).permute(2, 1, 0, 3, 4))
        return out
    off = 0
    head0 = plan.head0
    for p, n in enumerate(plan.out_recv_splits()):
        h = plan.heads_of(p)
        out[:, :, head0[p]:head0[p + 1]].copy_(recv[off:off + n].view(S_r, B, h, D).transpose(0, 1))
        off += n
    return out
