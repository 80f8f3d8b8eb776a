"""The fused kernel under Triton's interpreter (fp16/fp32, small shapes) against the torch reference."""

import dataclasses

import pytest
import torch

from xstage.errors import CommTimeoutError, InputError
from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer, fused_moe, transform_weights
from xstage.moe.fused import launch, plan
from xstage.moe.reference import loopback_inputs, reference_moe_virtual
from xstage.spec.pacing import StorePacing

CFG = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
TOL = {torch.float16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-4, atol=1e-4)}
SCHEDULES = ["expert_wave", "interleaved", "lag:0", "lag:3", "model_guided"]


def _problem(T, E, K, H, I, R, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    l1 = (torch.randn(E // R, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    l2 = (torch.randn(E // R, H, I, generator=gen) / I**0.5).to(dtype)
    return x, idx, w, l1, l2


def _reference(x, idx, w, l1, l2, R):
    return reference_moe_virtual(*loopback_inputs(x.double(), idx, w.double(), l1.double(), l2.double(), R),
                                 dtype=torch.float64)[0]


@pytest.mark.parametrize(
    "T,E,K,H,I,R,path,dtype",
    [
        pytest.param(13, 8, 2, 64, 32, 2, "hbm", torch.float16, id="T13-E8-K2-H64-I32-R2-hbm-fp16"),
        pytest.param(24, 4, 3, 64, 64, 1, "hbm", torch.float32, id="T24-E4-K3-H64-I64-R1-fp32"),
        pytest.param(9, 16, 4, 96, 32, 4, "host", torch.float16, id="T9-E16-K4-H96-I32-R4-host-fp16"),
    ],
)
def test_fused_matches_reference_and_schedules_are_bitwise_equal(T, E, K, H, I, R, path, dtype):
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, dtype, seed=T * E)
    buf = MoEBuffer(32, E, K, H, I, LoopbackGroup(R, path=path), device="cpu", dtype=dtype, config=CFG)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    ref = _reference(x, idx, w, l1, l2, R)
    outs = {}
    for s in SCHEDULES:
        buf.combine.fill_(float("nan"))  # a combine row nobody wrote poisons y
        if buf.combine_host is not None:
            buf.combine_host.fill_(float("nan"))
        outs[s] = fused_moe(x, idx, w, w1t, w2, buf, schedule=s)
        torch.testing.assert_close(outs[s].double(), ref, **TOL[dtype])
    for s in SCHEDULES[1:]:
        assert torch.equal(outs[s], outs[SCHEDULES[0]]), s
    assert int(buf.sync[1]) == len(SCHEDULES)  # one completed iteration per call
    assert int(buf.ready.abs().sum()) == 0 and int(buf.sync[0]) == 0 and int(buf.sync[2]) == 0
    assert int(buf.sync[3]) == 0  # the dynamic task counter is back at zero for the next call


def test_kernel_variants_are_bitwise_equal():
    # TMA or pointer loads, dynamic or round-robin task assignment: the same tiles in the same K order.
    T, E, K, H, I, R = 11, 8, 2, 64, 32, 2
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, torch.float16, seed=11)
    ref = _reference(x, idx, w, l1, l2, R)
    outs = []
    for tma, dynamic in ((True, True), (False, False), (True, False), (False, True)):
        cfg = dataclasses.replace(CFG, tma=tma, dynamic=dynamic)
        buf = MoEBuffer(16, E, K, H, I, LoopbackGroup(R), device="cpu", dtype=torch.float16, config=cfg)
        w1t, w2 = transform_weights(l1, l2, cfg.block_n1)
        y = torch.empty_like(x)
        # Round-robin CTAs run one after another here, so only one may hold tasks; dynamic ones take turns.
        ctas = 3 if dynamic else 1
        for _ in range(2):  # the second call checks that the counters reset themselves
            launch(x, idx, w, w1t, w2, buf, plan(idx, buf, "lag:1", ctas=ctas), y)
            buf.check()
        torch.testing.assert_close(y.double(), ref, **TOL[torch.float16])
        outs.append(y)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_host_path_rows_for_peers_land_in_host_buffer():
    T, E, K, H, I, R = 8, 4, 2, 64, 32, 2
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, torch.float16, seed=5)
    buf = MoEBuffer(16, E, K, H, I, LoopbackGroup(R, path="host"), device="cpu", dtype=torch.float16, config=CFG)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    buf.combine.zero_()
    buf.combine_host.zero_()
    fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1")
    remote = (idx // (E // R)) != 0  # slots computed by a "peer": their rows went over the host path
    for t in range(T):
        for k in range(K):
            host_row, dev_row = buf.combine_host[k, t], buf.combine[k, t]
            assert bool(host_row.abs().sum() > 0) == bool(remote[t, k])
            assert bool(dev_row.abs().sum() > 0) == bool(~remote[t, k])


@pytest.mark.parametrize("R,block_n2", [pytest.param(2, 32, id="R2-BN2-32"),
                                        pytest.param(4, 64, id="R4-BN2-64-partial")])
def test_store_pacing_claims_every_remote_byte_once(R, block_n2):
    # Without a timer the pacing clock only adds up the claims: at 1 ns per byte it must end at the
    # bytes of all combine rows meant for other ranks, counted here from the routing alone.
    T, E, K, H, I = 11, 8, 2, 96, 32
    cfg = dataclasses.replace(CFG, block_n2=block_n2)
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, torch.float16, seed=R)
    buf = MoEBuffer(16, E, K, H, I, LoopbackGroup(R, path="host"), device="cpu", dtype=torch.float16, config=cfg,
                    pacing=StorePacing(rate=1e9, budget=0))
    w1t, w2 = transform_weights(l1, l2, cfg.block_n1)
    y = fused_moe(x, idx, w, w1t, w2, buf, schedule="interleaved")
    torch.testing.assert_close(y.double(), _reference(x, idx, w, l1, l2, R), **TOL[torch.float16])
    el = E // R
    remote_rows = sum(int((((idx + q * el) % E) // el == 0).sum()) for q in range(1, R))
    assert remote_rows > 0
    assert int(buf.pace_clock) == remote_rows * H * 2
    # A call's own pacing overrides the buffer's default, which stays as constructed.
    y_off = fused_moe(x, idx, w, w1t, w2, buf, schedule="interleaved", pacing="off")
    assert int(buf.pace_clock) == remote_rows * H * 2 and torch.equal(y_off, y)
    fused_moe(x, idx, w, w1t, w2, buf, schedule="interleaved", pacing="1:0")  # 1 GB/s: 1 ns per byte again
    assert int(buf.pace_clock) == 2 * remote_rows * H * 2
    assert buf.pacing == StorePacing(rate=1e9, budget=0)


def test_pacing_defaults_and_bad_values():
    assert MoEBuffer(16, 8, 2, 64, 32, LoopbackGroup(2, path="host"), device="cpu", dtype=torch.float16,
                     config=CFG).pacing == "auto"  # the planner's choice per call
    host = MoEBuffer(16, 8, 2, 64, 32, LoopbackGroup(2, path="host"), device="cpu", dtype=torch.float16, config=CFG,
                     pacing="default")
    assert host.pacing is not None and host.pacing.rate < 60e9  # paced below the host link's drain
    hbm = MoEBuffer(16, 8, 2, 64, 32, LoopbackGroup(2, path="hbm"), device="cpu", dtype=torch.float16, config=CFG,
                    pacing="default")
    assert hbm.pacing is None
    for bad in (5e10, "fast", "50"):
        with pytest.raises(InputError, match="pacing"):
            MoEBuffer(16, 8, 2, 64, 32, LoopbackGroup(2, path="host"), device="cpu", dtype=torch.float16,
                      config=CFG, pacing=bad)
    with pytest.raises(InputError, match="StorePacing.rate"):
        StorePacing(rate=1e6, budget=0)
    with pytest.raises(AttributeError):  # the buffer's default is fixed at construction; a call overrides it
        host.pacing = None
    off = MoEBuffer(16, 8, 2, 64, 32, LoopbackGroup(2, path="host"), device="cpu", dtype=torch.float16,
                    config=CFG, pacing="off")
    assert off.pacing is None
    assert MoEBuffer(16, 8, 2, 64, 32, LoopbackGroup(2, path="host"), device="cpu", dtype=torch.float16,
                     config=CFG, pacing="50:128").pacing == StorePacing(rate=50e9, budget=128 * 1024)


def test_auto_pacing_is_the_planners_pick_for_the_call():
    from xstage.sched.pacing import resolve_pacing
    from xstage.sched.policy import pick_pacing_for_buffer
    from xstage.spec.pacing import PACING_CANDIDATES

    T, E, K, H, I, R = 8, 4, 2, 64, 32, 2
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, torch.float16, seed=4)
    buf = MoEBuffer(T, E, K, H, I, LoopbackGroup(R, path="host"), device="cpu", dtype=torch.float16, config=CFG)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    y_auto = fused_moe(x, idx, w, w1t, w2, buf, schedule="interleaved")  # the buffer's "auto"
    y_off = fused_moe(x, idx, w, w1t, w2, buf, schedule="interleaved", pacing="off")
    assert torch.equal(y_auto, y_off)  # pacing changes timing, never the output
    (d,) = buf.decisions()  # the one made for the "auto" call; at T = 8 its bucket is 5..8
    pick = pick_pacing_for_buffer(buf, T, d.ctas, "interleaved")  # the planner, asked directly
    assert d.bucket == (5, T) and str(d.request) == "interleaved@auto"
    assert pick in PACING_CANDIDATES and d.pacing == resolve_pacing(pick, "host", R)


def test_silent_peer_raises_timeout_not_hang():
    T, E, K, H, I, R = 4, 4, 2, 64, 32, 2
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, torch.float16, seed=2)
    buf = MoEBuffer(8, E, K, H, I, LoopbackGroup(R, silent_ranks=(1,)), device="cpu", dtype=torch.float16,
                    config=CFG)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    with pytest.raises(CommTimeoutError, match=r"rank 0: .*peer 1 .*moe.reduce_waits_combine"):
        fused_moe(x, idx, w, w1t, w2, buf, schedule="interleaved", check=True)  # raised by the call itself


def test_unmet_dependency_times_out():
    # The interpreter runs CTA 0 to the end before CTA 1 starts: with round-robin assignment a
    # LINEAR2 task of CTA 0 whose LINEAR1 inputs belong to CTA 1 can never be satisfied, so its
    # bounded wait must fire.
    T, E, K, H, I, R = 8, 2, 1, 64, 64, 1
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, torch.float16, seed=3)
    cfg = dataclasses.replace(CFG, dynamic=False)
    buf = MoEBuffer(8, E, K, H, I, LoopbackGroup(R), device="cpu", dtype=torch.float16, config=cfg)
    w1t, w2 = transform_weights(l1, l2, cfg.block_n1)
    p = plan(idx, buf, "expert_wave", ctas=2)
    launch(x, idx, w, w1t, w2, buf, p, torch.empty_like(x))
    with pytest.raises(CommTimeoutError, match="moe.linear(1_waits_dispatch|2_waits_linear1)"):
        buf.check()


@pytest.fixture(scope="module")
def small():
    T, E, K, H, I, R = 4, 4, 2, 64, 32, 2
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, torch.float16, seed=7)
    buf = MoEBuffer(4, E, K, H, I, LoopbackGroup(R), device="cpu", dtype=torch.float16, config=CFG)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    return buf, x, idx, w, w1t, w2


@pytest.mark.parametrize(
    "mutate,match",
    [
        pytest.param(lambda a: a.update(idx=a["idx"].clone().fill_(4)), r"topk_idx: value 4 out of range",
                     id="idx-high"),
        pytest.param(lambda a: a.update(idx=a["idx"] - 1), r"topk_idx: value -1 out of range", id="idx-negative"),
        pytest.param(lambda a: a.update(x=a["x"].float()), r"x: expected dtype", id="x-dtype"),
        pytest.param(lambda a: a.update(x=a["x"].to("meta")), r"x: expected a tensor on cpu", id="x-device"),
        pytest.param(lambda a: a.update(x=torch.cat([a["x"], a["x"]], 1)[:, ::2]), r"x: must be contiguous",
                     id="x-noncontiguous"),
        pytest.param(lambda a: a.update(x=torch.cat([a["x"]] * 2), idx=torch.cat([a["idx"]] * 2),
                                        w=torch.cat([a["w"]] * 2)), r"8 tokens exceed .*num_max_tokens_per_rank=4",
                     id="too-many-tokens"),
        pytest.param(lambda a: a.update(w=a["w"][:, :1].contiguous()), r"topk_weights: expected shape", id="w-shape"),
        pytest.param(lambda a: a.update(idx=a["idx"].float()), r"topk_idx: expected dtype", id="idx-dtype"),
        pytest.param(lambda a: a.update(w1t=a["w1t"][:1]), r"w1t: expected shape", id="w1-shape"),
    ],
)
def test_bad_inputs(small, mutate, match):
    buf, x, idx, w, w1t, w2 = small
    args = dict(x=x, idx=idx, w=w, w1t=w1t, w2=w2)
    mutate(args)
    with pytest.raises(InputError, match=match):  # check=True: ids out of range are refused before any launch
        fused_moe(args["x"], args["idx"], args["w"], args["w1t"], args["w2"], buf, check=True)


def test_bad_schedule_name(small):
    buf, x, idx, w, w1t, w2 = small
    with pytest.raises(InputError, match="schedule 'zigzag'"):
        fused_moe(x, idx, w, w1t, w2, buf, schedule="zigzag")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param(dict(num_experts=6, group=LoopbackGroup(4)), "multiple of the group size 4", id="E-vs-R"),
        pytest.param(dict(topk=9), "topk=9", id="topk"),
        pytest.param(dict(hidden=40), "hidden=40", id="hidden-block"),
        pytest.param(dict(num_max_tokens_per_rank=0), "num_max_tokens_per_rank=0", id="zero-tokens"),
        pytest.param(dict(num_max_tokens_per_rank=1 << 20, hidden=65536), r"GiB .*over the limit", id="absurd"),
        pytest.param(dict(hidden=256, intermediate=256, dtype=torch.float32,
                          config=BlockConfig(block_m=128, block_n1=128, block_n2=256, block_k=64, num_stages=4)),
                     r"num_stages=4: .*shared memory", id="stages-vs-shared-memory"),
    ],
)
def test_buffer_refuses_bad_sizes(kwargs, match):
    args = dict(num_max_tokens_per_rank=8, num_experts=8, topk=2, hidden=64, intermediate=32,
                group=LoopbackGroup(2), device="cpu", dtype=torch.float16, config=CFG)
    args.update(kwargs)
    with pytest.raises(InputError, match=match):
        MoEBuffer(**args)


def test_buffer_reports_bytes():
    buf = MoEBuffer(16, 8, 2, 64, 32, LoopbackGroup(2, path="host"), device="cpu", dtype=torch.float16, config=CFG)
    nb = buf.nbytes()
    assert nb["combine"] == 2 * 16 * 64 * 2 and nb["combine_host"] == nb["combine"]
    assert nb["recv"] == buf.pool_rows * 64 * 2 and nb["act"] == buf.pool_rows * 32 * 2
    assert buf.total_bytes() == sum(nb.values())


def test_plan_reports_rows_per_destination():
    T, E, K, H, I, R = 11, 8, 3, 64, 32, 4
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, torch.float16, seed=9)
    buf = MoEBuffer(16, E, K, H, I, LoopbackGroup(R), device="cpu", dtype=torch.float16, config=CFG)
    s = plan(idx, buf, "lag:1").schedule
    per_dest = s.dest_rows.sum(0) // s.n2  # every LINEAR2 n-block of a unit stores the same rows
    el = E // R
    expect = [int((((idx + r * el) % E) // el == 0).sum()) for r in range(R)]
    assert per_dest.tolist() == expect and sum(expect) == T * K


def test_partial_last_output_block_and_repeated_calls():
    # H=96 with block_n2=64: the last Linear-2 block is half masked.
    cfg = BlockConfig(block_m=16, block_n1=16, block_n2=64, block_k=32, block_d=32)
    T, E, K, H, I, R = 7, 4, 2, 96, 32, 2
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, torch.float32, seed=11)
    buf = MoEBuffer(8, E, K, H, I, LoopbackGroup(R), device="cpu", dtype=torch.float32, config=cfg)
    w1t, w2 = transform_weights(l1, l2, cfg.block_n1)
    ref = _reference(x, idx, w, l1, l2, R)
    for s in ("interleaved", "lag:0"):
        torch.testing.assert_close(fused_moe(x, idx, w, w1t, w2, buf, schedule=s).double(), ref,
                                   **TOL[torch.float32])


def test_any_routing_completes_in_a_reused_row_pool():
    # Every token to the same two experts: 38 units of 16 rows in a pool of 32 units, so 6 units reuse
    # the slots of units that finished; every schedule gives the reference result, bitwise equal.
    from xstage.spec.moe import MIN_POOL_UNITS

    T, E, K, H, I, R = 300, 4, 2, 64, 32, 1
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, torch.float16, seed=4)
    idx = torch.tensor([[0, 1]] * T)
    unit_bytes = CFG.block_m * (H + I) * 2
    buf = MoEBuffer(T, E, K, H, I, LoopbackGroup(R), device="cpu", dtype=torch.float16, config=CFG,
                    pool_bytes=MIN_POOL_UNITS * unit_bytes)
    assert buf.pool_units == MIN_POOL_UNITS and buf.nbytes()["recv"] == MIN_POOL_UNITS * CFG.block_m * H * 2
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    ref = _reference(x, idx, w, l1, l2, R)
    outs = {}
    for s in ("expert_wave", "interleaved", "lag:2", "lag:16"):
        buf.combine.fill_(float("nan"))
        outs[s] = fused_moe(x, idx, w, w1t, w2, buf, schedule=s)
        torch.testing.assert_close(outs[s].double(), ref, **TOL[torch.float16])
    assert all(torch.equal(y, outs["expert_wave"]) for y in outs.values())
    with pytest.raises(InputError, match="row pool holds"):  # lag:40 needs 42 units in flight
        fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:40")


def test_pool_below_the_minimum_and_deprecated_capacity_factor():
    from xstage.spec.moe import MIN_POOL_UNITS

    unit_bytes = CFG.block_m * (64 + 32) * 2
    with pytest.raises(InputError, match=f"minimum is {MIN_POOL_UNITS} units"):
        MoEBuffer(300, 4, 2, 64, 32, LoopbackGroup(1), device="cpu", dtype=torch.float16, config=CFG,
                  pool_bytes=(MIN_POOL_UNITS - 1) * unit_bytes)
    # A small problem's pool never exceeds the units any routing can make (and may be below the minimum).
    small = MoEBuffer(4, 4, 2, 64, 32, LoopbackGroup(1), device="cpu", dtype=torch.float16, config=CFG)
    assert small.pool_units == small.units_cap == -(-4 * 2 // CFG.block_m) + 4
    with pytest.warns(DeprecationWarning, match="capacity_factor"):
        old = MoEBuffer(300, 4, 2, 64, 32, LoopbackGroup(1), device="cpu", dtype=torch.float16, config=CFG,
                        capacity_factor=1.0)
    assert old.pool_units == max(MIN_POOL_UNITS, -(-(300 * 2 + 4 * (CFG.block_m - 1)) // CFG.block_m))


def test_residency_check_refuses_too_many_ctas(monkeypatch):
    from types import SimpleNamespace

    from xstage.moe.fused import _check_residency

    props = SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    kernel = SimpleNamespace(n_regs=255, metadata=SimpleNamespace(shared=147456))
    cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=8, ctas_per_sm=2)
    buf = MoEBuffer(4, 4, 2, 64, 32, LoopbackGroup(1), device="cpu", dtype=torch.float16, config=cfg)
    with pytest.raises(InputError, match="ctas_per_sm=2: only 1 CTA"):
        _check_residency(kernel, buf)
    small = SimpleNamespace(n_regs=64, metadata=SimpleNamespace(shared=32768))
    _check_residency(small, buf)  # 4 warps' worth of registers and 32 KiB: two fit


def test_tma_descriptors_are_kept_while_their_tensor_lives():
    import gc

    from xstage.moe.fused import _descriptor

    cfg = dataclasses.replace(CFG, tma=True)
    buf = MoEBuffer(4, 4, 2, 64, 32, LoopbackGroup(2), device="cpu", dtype=torch.float16, config=cfg)
    w = torch.randn(2, 64, 64).half()
    d = _descriptor(buf, w, 16)
    assert _descriptor(buf, w, 16) is d  # kept
    v = w.view(4, 32, 64)
    assert _descriptor(buf, w, 32) is not d and _descriptor(buf, v, 16) is not d  # another box, another shape
    assert (d.shape, d.strides, d.block_shape) == ([128, 64], [64, 1], [16, 32])
    assert d.base.data_ptr() == w.data_ptr()
    assert len([k for k in buf._plans if k[0] == "tma"]) == 3
    del v
    gc.collect()
    assert len([k for k in buf._plans if k[0] == "tma"]) == 2
    del w, d
    gc.collect()
    assert not [k for k in buf._plans if k[0] == "tma"]  # gone with the tensor: no weight kept alive


@pytest.mark.parametrize("T,E,K,H,I,R,path,dtype", [
    pytest.param(24, 4, 3, 64, 64, 1, "hbm", torch.float32, id="R1-fp32"),
    pytest.param(9, 8, 2, 64, 96, 2, "host", torch.float16, id="R2-host-fp16"),
])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_concatenated_w1_read_in_place_gives_the_interleaved_result_bit_for_bit(T, E, K, H, I, R, path, dtype, tma):
    # I / block_n1 >= 3 tiles: a kernel reading the wrong rows for either layout would mix gate and up rows.
    x, idx, w, l1, l2 = _problem(T, E, K, H, I, R, dtype, seed=T + E)
    cfg = dataclasses.replace(CFG, tma=tma)
    buf = MoEBuffer(32, E, K, H, I, LoopbackGroup(R, path=path), device="cpu", dtype=dtype, config=cfg)
    w1t, w2 = transform_weights(l1, l2, cfg.block_n1)
    assert not torch.equal(w1t, l1)  # the two layouts differ at this shape
    y_int = fused_moe(x, idx, w, w1t, w2, buf)
    y_cat = fused_moe(x, idx, w, l1.contiguous(), w2, buf, w1_layout="concatenated")
    assert torch.equal(y_cat, y_int)
    torch.testing.assert_close(y_cat.double(), _reference(x, idx, w, l1, l2, R), **TOL[dtype])


def test_bad_w1_layout_is_one_input_error():
    E, K, H, I = 4, 2, 64, 32
    x, idx, w, l1, l2 = _problem(4, E, K, H, I, 1, torch.float16, seed=3)
    buf = MoEBuffer(8, E, K, H, I, LoopbackGroup(1), device="cpu", dtype=torch.float16, config=CFG)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    with pytest.raises(InputError, match=r"w1_layout='transposed': must be one of interleaved, concatenated"):
        fused_moe(x, idx, w, w1t, w2, buf, w1_layout="transposed")
