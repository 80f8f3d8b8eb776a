"""`exchange="heads:CORE:C"`: both Ulysses exchanges pipelined by head chunks, on real torch.distributed
groups (gloo, one process per rank, the CPU interpreter), against the plain-torch Ulysses reference in
float64 and, bit for bit, against the serial layer of the same attention core."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from xstage.attention.pipeline import chunk_plans
from xstage.spec.ulysses import UlyssesPlan, split_sizes

TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("heads", [1, 2, 5, 24, 30, 40])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 7])
def test_chunks_cover_every_rank_s_heads_once_in_order(heads, world, chunks):
    for rank in range(world):
        plan = UlyssesPlan(world, rank, 1, split_sizes(64, world), heads, 16)
        parts = chunk_plans(plan, chunks)  # also checks each chunk's split over the ranks (an assert)
        assert 1 <= len(parts) <= chunks
        for p in range(world):
            got = [h for _, ranges in parts for h in range(*ranges[p])]
            assert got == list(range(plan.head0[p], plan.head0[p + 1]))
        for sub, ranges in parts:
            assert sub.heads == sum(b - a for a, b in ranges) > 0 and sub.seq_lens == plan.seq_lens


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      TRITON_INTERPRET="1")
    import torch.distributed as dist

    from xstage.attention import ulysses_attention, ulysses_reference

    dist.init_process_group("gloo", rank=rank, world_size=world)
    failures = []
    try:
        # heads that do not divide over the ranks, one fewer head than ranks (a rank owns none), uneven
        # token counts and batch 2, more chunks than a rank has heads
        cases = ((5, [13, 9, 11][:world], 2, torch.float32, (1, 2, 3, 7)),
                 (world - 1, [8] * world, 1, torch.float32, (2,)),
                 (6, [16, 15, 17][:world], 1, torch.float16, (2, 3)))
        for H, seq, B, dtype, chunk_counts in cases:
            D = 32
            shards = []
            for p in range(world):
                g = torch.Generator().manual_seed(200 + p)
                shards.append([torch.randn(B, seq[p], H, D, generator=g).to(dtype) for _ in range(3)])
            ref = ulysses_reference(*[[s[i] for s in shards] for i in range(3)])[rank]
            q, k, v = shards[rank]
            for core in ("triton", "cudnn"):
                serial = ulysses_attention(q, k, v, exchange=f"serial:{core}")
                for c in chunk_counts:
                    name = f"heads:{core}:{c}"
                    out = ulysses_attention(q, k, v, exchange=name)
                    err = float((out.double() - ref).abs().max() / ref.abs().max())
                    if not err <= TOL[dtype]:
                        failures.append(f"rank {rank} H={H} seq={seq} B={B} {name}: relative error {err}")
                    if not torch.equal(out, serial):
                        failures.append(f"rank {rank} H={H} seq={seq} B={B} {name}: differs from serial:{core}")
    except Exception as exc:  # reported to the test
        failures.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        results.put((rank, failures))
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_head_chunks_on_a_gloo_group_match_the_reference_and_the_serial_layer(world):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, failures = results.get(timeout=600)
            got[rank] = failures
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert sorted(got) == list(range(world))
    problems = [f for r in sorted(got) for f in got[r]]
    assert not problems, "\n".join(problems)
