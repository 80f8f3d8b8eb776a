"""Several ranks in separate processes (gloo): on a GPU they share it (symmetric memory with
overlapping devices), on a CPU the peer path is backed by shared-memory files and the interpreter."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

TOL = {torch.float16: 2e-3, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, use_gpu, dtype, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES="1", NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if not use_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from xstage.attention import ulysses_attention, ulysses_reference
    from xstage.attention.layout import empty_gathered_out
    from xstage.attention.overlap import run_overlap
    from xstage.attention.ulysses import (
        _group_context,
        _pre_alltoall,
        fused_state,
        run_fused,
        stage_buffer,
        wait_fused,
    )
    from xstage.errors import CommTimeoutError
    from xstage.spec.exchange import parse_exchange
    from xstage.spec.ulysses import UlyssesPlan

    device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    failures = []
    try:
        # 30 heads do not divide over 4 ranks; uneven token counts; bf16 on GPU
        for H, seq, B in ((5, [40, 33, 33, 33][:world], 2), (30, [32] * world, 1)):
            D = 64 if use_gpu else 32
            shards = []
            for p in range(world):
                g = torch.Generator().manual_seed(100 + p)
                shards.append([torch.randn(B, seq[p], H, D, generator=g).to(dtype) for _ in range(3)])
            refs = ulysses_reference(*[[s[i] for s in shards] for i in range(3)])
            q, k, v = (t.to(device) for t in shards[rank])
            for exchange in ("stores", "serial", "serial:cudnn", "overlap", "overlap:cudnn:3"):
                if exchange == "stores":
                    bm = 32 if not use_gpu else 128
                    plan = UlyssesPlan(world, rank, B, seq, H, D)
                    fused_state(_group_context(dist.group.WORLD), plan, dtype, bm).out.local.fill_(float("nan"))
                    dist.barrier()
                # the token counts are gathered from the group when not given
                out = ulysses_attention(q, k, v, exchange=exchange, seq_lens=seq if exchange != "serial" else None)
                err = ((out.double().cpu() - refs[rank]).abs().max() / refs[rank].abs().max()).item()
                if not err <= TOL[dtype]:
                    failures.append(f"rank {rank} H={H} seq={seq} {exchange}: relative error {err}")
        # a rank that never stores its tiles: the others must time out with a clear error
        H, seq, B, D = 4, [32] * world, 1, 64 if use_gpu else 32
        plan = UlyssesPlan(world, rank, B, seq, H, D)
        x = torch.randn(B, seq[rank], H, D).to(dtype=dtype, device=device)
        ctx = _group_context(dist.group.WORLD)
        qg, kg, vg = _pre_alltoall(plan, x, x, x, dist.group.WORLD)
        state = fused_state(ctx, plan, dtype, 32 if not use_gpu else 128)
        # the interpreter counts 64 ns per poll: keep its poll count small
        ctx.timeout_ns = 20_000_000 if use_gpu else 20_000
        if rank != world - 1:
            run_fused(state, ctx, qg, kg, vg, wait=False)
        # every other rank has stored its tiles before anyone waits: only the silent rank is missing
        if use_gpu:
            torch.cuda.synchronize()
        dist.barrier()
        if rank != world - 1:
            wait_fused(state, ctx)
            try:
                ctx.check()
                failures.append(f"rank {rank}: no timeout although rank {world - 1} never signalled")
            except CommTimeoutError as e:
                if f"peer {world - 1}" not in str(e) or "ulysses_output" not in str(e):
                    failures.append(f"rank {rank}: unexpected message {e}")
        dist.barrier()
        # overlap: a rank that never sends its rows nor reaches the barrier is named at comm.barrier;
        # the others meet first on the host, and wait long enough for each other's barrier kernels
        ctx.reset_error()
        # On a shared GPU the ranks' spinning barrier kernels take turns in time slices: give the
        # present ranks seconds to arrive (one GPU per rank needs microseconds).
        ctx.timeout_ns = 5_000_000_000 if use_gpu else 400_000_000
        og = empty_gathered_out(plan, dtype, device)
        stage = stage_buffer(state, ctx)
        if rank != world - 1:
            run_overlap(plan, parse_exchange("overlap"), qg, kg, vg, og, torch.empty_like(og[:, :seq[rank]]),
                        stage.peers)
            if use_gpu:
                torch.cuda.synchronize()
        dist.barrier()
        if rank != world - 1:
            ctx.barrier(host=False)
            try:
                ctx.check()
                failures.append(f"rank {rank}: overlap: no timeout although rank {world - 1} never arrived")
            except CommTimeoutError as e:
                if f"peer {world - 1}" not in str(e) or "comm.barrier" not in str(e):
                    failures.append(f"rank {rank}: overlap: unexpected message {e}")
        dist.barrier()
    except Exception as e:  # reported to the parent, which fails the test with the message
        failures.append(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        results.put((rank, failures))
        dist.destroy_process_group()


def _run(world, use_gpu, dtype):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, use_gpu, dtype, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, failures = results.get(timeout=600)
        got[rank] = failures
    for p in procs:
        p.join(timeout=60)
    problems = [f for r in sorted(got) for f in got[r]]
    assert not problems, "\n".join(problems)
    assert sorted(got) == list(range(world))


@pytest.mark.slow
def test_three_ranks_cpu():
    if torch.cuda.is_available():
        pytest.skip("the GPU variant runs instead")
    _run(3, False, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_one_gpu(world):
    _run(world, True, torch.bfloat16)
