"""Loopback contexts, the error word and the device helpers in the interpreter (or on a GPU)."""

import pytest
import torch

from xstage.comm import (
    STAGE_PROBE_TEST,
    create_context,
    decode_error,
    error_code,
    register_stage,
    stage_name,
)
from xstage.errors import CommTimeoutError, InputError

from .exchange import launch_exchange, source_data


def test_error_code_round_trip():
    for stage, peer in [(1, 0), (2, 7), (47, 65535), (32767, 3)]:
        assert decode_error(error_code(stage, peer)) == (stage, peer)
    assert decode_error(0) == (0, 0)
    with pytest.raises(InputError, match="stage"):
        error_code(0, 1)
    with pytest.raises(InputError, match="peer"):
        error_code(1, 1 << 16)
    # found by tests/test_fuzz_api.py: TypeError and OverflowError
    for call, match in ((lambda: error_code(1.5, 0), r"^stage=1\.5: must be an integer"),
                        (lambda: error_code(1, None), r"^peer=None: must be an integer"),
                        (lambda: decode_error(float("inf")), r"^word=inf: must be an integer"),
                        (lambda: decode_error(""), r"^word='': must be an integer")):
        with pytest.raises(InputError, match=match):
            call()
    assert decode_error(torch.tensor(error_code(3, 1))) == (3, 1)


def test_register_stage_names_and_refuses_renames():
    assert register_stage(120, "test.stage") == 120
    assert register_stage(120, "test.stage") == 120
    assert stage_name(120) == "test.stage"
    assert stage_name(121) == "stage-121"
    with pytest.raises(InputError, match="already registered"):
        register_stage(120, "other")


@pytest.mark.parametrize("path", ["hbm", "host"])
def test_loopback_alloc(path, device):
    with create_context(path=path, loopback_world=3, rank=1) as ctx:
        assert (ctx.rank, ctx.world, ctx.loopback) == (1, 3, True)
        buf = ctx.alloc("x", (5, 7), torch.float16)
        assert buf.world == 3 and buf.peers[1] is buf.local
        assert all(t.shape == (5, 7) and t.dtype == torch.float16 for t in buf.peers)
        assert all(bool((t == 0).all()) for t in buf.peers)
        assert buf.ptrs.tolist() == buf.ptr_list and len(set(buf.ptr_list)) == 3
        assert buf.ptrs.device.type == torch.device(device).type
        if path == "host" and device == "cuda":
            assert buf.peers[0].is_pinned() and buf.peers[0].device.type == "cpu"
        assert ctx.buffer("x") is buf
        assert ctx.signal_pad.local.dtype == torch.int32
    assert ctx.closed
    with pytest.raises(InputError, match="closed"):
        ctx.alloc("y", (1,), torch.float32)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(path="nvlink"), "path"),
        (dict(path="hbm", loopback_world=0), "loopback_world"),
        (dict(path="hbm", loopback_world=2, rank=2), "rank"),
        (dict(path="hbm", signal_slots=0), "signal_slots"),
        (dict(path="peer"), "torch.distributed"),
    ],
)
def test_create_context_rejects_bad_input(kwargs, field):
    with pytest.raises(InputError, match=field):
        create_context(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(loopback_world=1.5), r"loopback_world=1\.5: must be an integer in 1\.\.1024 \(ranks of the group\)"),
    (dict(loopback_world="2"), r"loopback_world='2': must be an integer"),
    (dict(loopback_world=True), r"loopback_world=True: must be an integer"),
    (dict(loopback_world=10**6), r"loopback_world=1000000: must be an integer in 1\.\.1024"),
    (dict(loopback_world=2, rank=0.5), r"rank=0\.5: must be an integer in 0\.\.1 \(this rank, of loopback_world 2\)"),
    (dict(loopback_world=2, rank=-1), r"rank=-1: must be an integer in 0\.\.1"),
    (dict(timeout_ns=float("nan")), r"timeout_ns=nan: must be an integer in 1\.\.3600000000000 \(progress watchdog"),
    (dict(timeout_ns=1e30), r"timeout_ns=1e\+30: must be an integer in 1\.\.3600000000000"),
    (dict(timeout_ns=0), r"timeout_ns=0: must be an integer"),
    (dict(signal_slots="abc"), r"signal_slots='abc': must be an integer in 1\.\.1048576 \(flags per rank\)"),
    (dict(signal_slots=2**40), r"signal_slots=1099511627776: must be an integer in 1\.\.1048576"),
    (dict(group="abc"), r"group='abc': must be a torch\.distributed ProcessGroup or None"),
    (dict(device="abc"), r"device='abc': not a device; give 'cpu', 'cuda' or 'cuda:N'"),
    (dict(device="meta"), r"device='meta': must be 'cpu' or a CUDA device"),
])
def test_create_context_checks_every_number_before_allocating(kwargs, message):
    with pytest.raises(InputError, match="^" + message):
        create_context(path="hbm", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_a_cuda_device_without_a_gpu_is_refused_by_name():
    with pytest.raises(InputError, match=r"^device='cuda': no CUDA GPU here; give device='cpu'"):
        create_context(path="hbm", device="cuda")


def test_exact_integral_floats_are_the_integers_they_spell():
    with create_context(path="hbm", loopback_world=3.0, rank=2.0, timeout_ns=2e9, signal_slots=8.0) as ctx:
        assert (ctx.world, ctx.rank, ctx.timeout_ns, ctx.signal_pad.local.numel()) == (3, 2, 2_000_000_000, 8)
        assert all(type(v) is int for v in (ctx.world, ctx.rank, ctx.timeout_ns))


def test_alloc_rejects_bad_input():
    with create_context(path="hbm") as ctx:
        ctx.alloc("a", (2,), torch.float32)
        for args, field in [(("a", (2,), torch.float32), "name"), (("b", (0, 3), torch.float32), "shape"),
                            (("c", (2,), torch.complex64), "dtype"), (("d", (2.5,), torch.float32), "shape"),
                            (("e", (1 << 30, 1 << 30), torch.float32), "over the 1099511627776 bytes"),
                            (("f", ("3",), torch.float32), "shape"), (("g", (), torch.float32), "shape")]:
            with pytest.raises(InputError, match=field):
                ctx.alloc(*args)


@pytest.mark.parametrize("n_elem", [128, 300], ids=["N128", "N300-odd"])
def test_exchange_stores_signals_and_reads_flags(n_elem, device):
    """rank 1 of 3 stores to peer 2 and signals it; its own flag from peer 2 is not set, so the
    one-shot read reports False, and True once the flag is set."""
    with create_context(path="hbm", loopback_world=3, rank=1) as ctx:
        recv = ctx.alloc("recv", (3, n_elem), torch.float32)
        for t in recv.peers:
            t.fill_(float("nan"))
        src = source_data(1, n_elem, device)
        ok = launch_exchange(ctx, recv, src, 2, 5, wait=False)
        assert torch.equal(recv.peers[2][1], src)
        assert bool(torch.isnan(recv.peers[2][[0, 2]]).all()) and bool(torch.isnan(recv.peers[0]).all())
        n_blk = ok.numel()
        assert recv.peers[2].shape == (3, n_elem)
        pad2 = ctx.signal_pad.peers[2]
        assert pad2[64:64 + n_blk].tolist() == [5] * n_blk and int(pad2.sum()) == 5 * n_blk
        assert ok.tolist() == [0] * n_blk
        ctx.signal_pad.local[2 * 64:2 * 64 + n_blk] = 5
        ok = launch_exchange(ctx, recv, src, 2, 5, wait=True)
        assert ok.tolist() == [1] * n_blk
        ctx.check()


def test_wait_timeout_sets_error_word_and_check_raises():
    """A flag that never comes: the bounded wait gives up, the host error names rank, peer, stage."""
    with create_context(path="hbm", loopback_world=4, rank=3) as ctx:
        recv = ctx.alloc("recv", (4, 128), torch.float32)
        ok = launch_exchange(ctx, recv, source_data(3, 128, ctx.device), 1, 1, wait=True, timeout_ns=1_000_000)
        assert ok.tolist() == [0]
        code, count, arg, _ = ctx.error.tolist()
        assert decode_error(code) == (STAGE_PROBE_TEST, 1) and count == 1 and arg == 0
        with pytest.raises(CommTimeoutError, match=r"rank 3: wait for peer 1 timed out at stage comm.test_wait"):
            ctx.check()
        ctx.reset_error()
        ctx.check()
