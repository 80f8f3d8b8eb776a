"""Both Ulysses exchanges pipelined by head chunks: `exchange="heads:CORE:C"` on a torch.distributed group.

Problem: the pre-attention all-to-all (Q, K and V: three times the output's bytes) runs before any
attention can start, and the output all-to-all after it ends; the post-only exchanges
(`xstage.attention.overlap`, the in-kernel stores) hide only the second. Attention of one head needs
only that head's Q, K, V, so the layer can be cut by heads: while one chunk of heads computes, the
next chunk's Q, K, V and the previous chunk's output cross the link.

Algorithm (P ranks, rank r; rank p owns heads `[head0[p], head0[p+1])` as in `UlyssesPlan`):
1. Cut every rank's heads into C chunks (`split_sizes(h_p, C)`: the first chunks take one more).
   Chunk j is itself a Ulysses layer over the chunk-j heads of every rank: its heads split over the
   ranks exactly as `UlyssesPlan` splits them (the ranks' counts differ by at most one, larger first),
   so each chunk runs the plain layer's packing on its own plan (`chunk_plans` checks this).
2. Issue every chunk's Q, K, V all-to-all, first to last, without waiting (`async_op`): the group's
   communication stream carries them in that order.
3. Per chunk, in order: the compute stream waits for its Q, K, V (the host does not, on NCCL), runs
   its attention, and issues its output all-to-all, which queues behind the remaining Q, K, V; so
   attention on chunk j runs while chunk j + 1's Q, K, V and chunk j - 1's output cross.
4. Wait for every output all-to-all and write its rows into the output `[B, S_r, H, D]`.

C = 1 is the serial layer. A chunk where every rank holds no head (H < C) is skipped on every rank
alike; a rank holding no head of a chunk (H < P C) still sends and receives its empty parts. On NCCL
the all-to-alls run on NCCL's stream, which is what overlaps them with attention; on gloo (the CPU
tests) they run on gloo's threads, for correctness. Every wait is bounded by the group's own timeout,
as the serial exchange's is. The planner predicts this scheme (`xstage.sched.layer`, `xstage plan
layer`); `exchange="auto"` does not pick it until it has been measured.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xstage.attention.layout import empty_gathered_out, unpack_qkv
from xstage.attention.overlap import attend
from xstage.spec.exchange import Exchange
from xstage.spec.ulysses import UlyssesPlan, split_sizes


def chunk_plans(plan: UlyssesPlan, chunks: int) -> list[tuple[UlyssesPlan, list[tuple[int, int]]]]:
    """Per non-empty chunk: its plan (heads of the chunk over the same ranks and tokens) and every
    rank's global head range `(a, b)` in it, rank p's chunk heads being `[a_p, b_p)`."""
    per_rank = [split_sizes(plan.heads_of(p), chunks) for p in range(plan.world)]
    out = []
    for j in range(chunks):
        ranges = []
        for p in range(plan.world):
            a = plan.head0[p] + sum(per_rank[p][:j])
            ranges.append((a, a + per_rank[p][j]))
        heads = sum(b - a for a, b in ranges)
        if heads == 0:
            continue
        sub = UlyssesPlan(plan.world, plan.rank, plan.batch, plan.seq_lens, heads, plan.head_dim)
        # The chunk's heads split over the ranks as UlyssesPlan splits any head count (module docstring).
        assert [sub.heads_of(p) for p in range(plan.world)] == [b - a for a, b in ranges], (plan, j)
        out.append((sub, ranges))
    return out


def _pack(sub: UlyssesPlan, ranges, q, k, v) -> torch.Tensor:
    """The chunk's Q, K, V send buffer: part p is `[S_r, 3, B, n_p, D]` of rank p's chunk heads."""
    B, S_r, _, D = q.shape
    send = torch.empty(sum(sub.qkv_send_splits()), dtype=q.dtype, device=q.device)
    off = 0
    for (a, b), n in zip(ranges, sub.qkv_send_splits()):
        part = send[off:off + n].view(S_r, 3, B, b - a, D)
        for i, t in enumerate((q, k, v)):
            part[:, i].copy_(t[:, :, a:b].transpose(0, 1))
        off += n
    return send


def _unpack(sub: UlyssesPlan, ranges, recv: torch.Tensor, out: torch.Tensor) -> None:
    """The chunk's output receive buffer (part p: `[S_r, B, n_p, D]`) into `out`'s heads `[a_p, b_p)`."""
    S_r, B, D = sub.seq_lens[sub.rank], sub.batch, sub.head_dim
    off = 0
    for (a, b), n in zip(ranges, sub.out_recv_splits()):
        if n:
            out[:, :, a:b].copy_(recv[off:off + n].view(S_r, B, b - a, D).transpose(0, 1))
        off += n


def run_heads(plan: UlyssesPlan, ex: Exchange, q, k, v, group, *, softmax_scale=None, config=None) -> torch.Tensor:
    """This rank's output `[B, S_r, H, D]` of the layer, both exchanges pipelined by `ex.chunks` head
    chunks with `ex.core` attention (see the module docstring). Every rank of `group` calls it alike."""
    parts = chunk_plans(plan, ex.chunks)
    pre = []
    for sub, ranges in parts:  # every chunk's Q, K, V, first to last
        recv = torch.empty(sum(sub.qkv_recv_splits()), dtype=q.dtype, device=q.device)
        work = dist.all_to_all_single(recv, _pack(sub, ranges, q, k, v), sub.qkv_recv_splits(),
                                      sub.qkv_send_splits(), group=group, async_op=True)
        pre.append((recv, work))
    post = []
    for (sub, _), (recv, work) in zip(parts, pre):
        work.wait()  # NCCL: the compute stream waits, the host goes on
        qg, kg, vg = unpack_qkv(sub, recv)
        og = empty_gathered_out(sub, q.dtype, q.device)
        attend(ex.core, qg, kg, vg, og, softmax_scale=softmax_scale, config=config)
        back = torch.empty(sum(sub.out_recv_splits()), dtype=q.dtype, device=q.device)
        send = og.transpose(0, 1).reshape(-1)  # [S, B, h, D] is contiguous: no copy
        post.append((back, dist.all_to_all_single(back, send, sub.out_recv_splits(), sub.out_send_splits(),
                                                  group=group, async_op=True)))
    out = torch.empty_like(q)
    for (sub, ranges), (back, work) in zip(parts, post):
        work.wait()
        _unpack(sub, ranges, back, out)
    return out


__all__ = ["chunk_plans", "run_heads"]
