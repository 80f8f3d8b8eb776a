"""A small exchange kernel built only from `xstage.comm.device` helpers, shared by the comm tests."""

import os
import warnings

import torch
import triton
import triton.language as tl

from xstage.comm import STAGE_PROBE_TEST, create_context, error_code
from xstage.comm.device import peer_ptr, signal_release, store_tile, use_ptx, wait_acquire


@triton.jit
def exchange_kernel(p_table, p_recv, p_src, p_pad_table, p_pad, p_err, p_ok, rank, peer, epoch, timeout_ns,
                    code, n_elem, BLOCK: tl.constexpr, VEC: tl.constexpr, WAIT: tl.constexpr,
                    USE_PTX: tl.constexpr):
    # p_recv: [world, n_elem] on every rank; row q receives rank q's p_src.
    i_blk = tl.program_id(0)
    o_elem = i_blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)          # [BLOCK]
    m_elem = o_elem < n_elem
    b_src = tl.load(p_src + o_elem, mask=m_elem)
    p_dst = peer_ptr(p_table, peer, p_recv) + tl.cast(rank, tl.int64) * n_elem
    store_tile(p_dst, o_elem, b_src, m_elem, VEC)
    signal_release(peer_ptr(p_pad_table, peer, p_pad) + rank * 64 + i_blk, epoch)
    ok = wait_acquire(p_pad + peer * 64 + i_blk, epoch, timeout_ns, p_err, code, WAIT, USE_PTX)
    tl.store(p_ok + i_blk, ok.to(tl.int32))


def launch_exchange(ctx, recv, src, peer, epoch, *, wait, timeout_ns=None, block=128):
    n_elem = src.numel()
    grid = (triton.cdiv(n_elem, block),)
    ok = torch.full(grid, -1, dtype=torch.int32, device=ctx.device)
    exchange_kernel[grid](
        recv.ptrs, recv.local, src, ctx.signal_pad.ptrs, ctx.signal_pad.local, ctx.error, ok, ctx.rank, peer,
        epoch, ctx.timeout_ns if timeout_ns is None else timeout_ns, error_code(STAGE_PROBE_TEST, peer),
        n_elem, BLOCK=block, VEC=4, WAIT=wait, USE_PTX=use_ptx(),
    )
    return ok


def source_data(rank, n_elem, device):
    return torch.arange(n_elem, dtype=torch.float32, device=device) + 1000.0 * (rank + 1)


def peer_worker(rank, world, init_file, result_file, n_elem):
    """One rank of a ring exchange on path `peer`: send to rank+1, wait for rank-1, check the data."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # no deprecated torch call in the context's set-up
            ctx = create_context(path="peer", device=device, timeout_ns=5_000_000_000)
        recv = ctx.alloc("recv", (world, n_elem), torch.float32)
        recv.local.fill_(float("nan"))
        ctx.barrier()
        src = source_data(rank, n_elem, device)
        ok = launch_exchange(ctx, recv, src, (rank + 1) % world, 1, wait=True)
        ctx.barrier()
        ctx.check()
        prev = (rank - 1) % world
        got = recv.local[prev].cpu()
        good = bool(torch.equal(got, source_data(prev, n_elem, "cpu"))) and bool((ok == 1).all())
        untouched = [q for q in range(world) if q != prev]
        good = good and bool(torch.isnan(recv.local[untouched]).all())
        ctx.barrier()
        ctx.close()
        with open(f"{result_file}.{rank}", "w") as f:
            f.write("ok" if good else f"bad: ok={ok.tolist()} got={got[:8].tolist()}")
    finally:
        dist.destroy_process_group()
