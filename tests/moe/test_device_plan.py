"""The plan built on the device (`xstage.moe.device_plan`) against the host planner, task by task.

The host `fused.plan` (routing_layout + make_schedule) is the reference: the device table must hold
the same rows in the same order (dynamic: the global order; round-robin: every CTA's list), the
same CTA starts, and the same routing layout, for every built-in order and routing. In Triton's
interpreter the prologue's phases run as separate launches of several programs, so the split of the
work over programs is checked here; the single launch with its grid barriers runs on the GPU (the
`gpu` tests at the end).
"""

import dataclasses

import numpy as np
import pytest
import torch

from tests.moe.hopper import assert_compiles_for_hopper
from xstage.errors import InputError
from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer, fused_moe, transform_weights
from xstage.moe.device_plan import DevicePlan, device_plan, plan_tables, pool_needed
from xstage.moe.fused import _Plan, plan
from xstage.moe.layout import routing_layout, unit_experts
from xstage.spec.moe import MIN_POOL_UNITS
from xstage.spec.schedule import CANDIDATES, PoolTooSmallError, make_schedule

CFG = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
# n1 = 3 and n2 = 2 with I = 48, H = 96 (a half-empty last output block), block_m 32.
ODD = BlockConfig(block_m=32, block_n1=16, block_n2=64, block_k=16, block_d=16)
ORDERS = {"ew": "expert_wave", "il": "interleaved", "lag0": "lag:0", "lag1": "lag:1", "lag4": "lag:4",
          "lag16": "lag:16"}


def _uniform(T, E, K, gen):
    rows = [torch.randperm(E, generator=gen)[:K] for _ in range(T)]
    return torch.stack(rows) if rows else torch.zeros(0, K, dtype=torch.int64)


def _skewed(T, E, K, gen):
    # Most tokens to the same few experts, a few spread over the rest.
    hot = torch.arange(K)
    rows = [hot if float(torch.rand(1, generator=gen)) < 0.85 else torch.randperm(E, generator=gen)[:K]
            for _ in range(T)]
    return torch.stack(rows) if rows else torch.zeros(0, K, dtype=torch.int64)


def _one_expert(T, E, K, gen):
    return torch.zeros(T, 1, dtype=torch.int64)


# name: (tokens, experts per rank, top-k, routing); "empty" has no token, "pool" has more units than the
# smallest pool the buffer allows (MIN_POOL_UNITS), "one" sends every token to one expert.
ROUTINGS = {
    "uniform": (13, 4, 2, _uniform),
    "skewed": (40, 5, 3, _skewed),
    "empty": (0, 4, 2, _uniform),
    "one": (37, 3, 1, _one_expert),
    "pool": (300, 2, 2, lambda T, E, K, gen: torch.tensor([[0, 1]] * T)),
}


def _buffer(tokens, el, K, R, cfg, H=64, I=32, pool=False):
    unit_bytes = cfg.block_m * (H + I) * 2
    return MoEBuffer(max(tokens, 1), el * R, K, H, I, LoopbackGroup(R), device="cpu", dtype=torch.float16,
                     config=cfg, pacing="off", pool_bytes=MIN_POOL_UNITS * unit_bytes if pool else None)


def _first_difference(a, b):
    rows = (a != b).any(1).nonzero()
    i = int(rows[0]) if len(rows) else -1
    return f"row {i}: device {a[i].tolist()} host {b[i].tolist()}" if i >= 0 else "shapes differ"


def _assert_same_plan(dev, host, buf, ctas):
    """Device plan == host plan: tasks (after the padding rows), CTA starts and routing layout."""
    assert isinstance(dev, DevicePlan)
    n = host.tasks.shape[0]
    assert torch.equal(dev.cta_start, host.cta_start), (dev.cta_start.tolist(), host.cta_start.tolist())
    starts = host.cta_start.tolist()
    lists = [(0, n)] if buf.cfg.dynamic else [(starts[c], starts[c + 1]) for c in range(ctas)]
    for c, (lo, hi) in enumerate(lists):  # round-robin: CTA by CTA
        d, h = dev.tasks[lo:hi], host.tasks[lo:hi]
        assert torch.equal(d, h), f"CTA {c}: {_first_difference(d, h)}"
    units, bm = host.layout.unit_info.shape[0], buf.cfg.block_m
    assert torch.equal(dev.layout.unit_info[:units], host.layout.unit_info)
    assert int(dev.layout.unit_info[units:, 2].abs().sum()) == 0  # no rows in the slots past the units in use
    assert torch.equal(dev.layout.row_src[: units * bm], host.layout.row_src[: units * bm])
    assert torch.equal(dev.layout.row_slot[: units * bm], host.layout.row_slot[: units * bm])
    assert torch.equal(dev.layout.counts, host.layout.counts)
    assert int(dev.layout.num_units) == int(host.layout.num_units)


CASES = []
for _o, _name in ORDERS.items():
    for _r in ROUTINGS:
        for _ep in (1, 2, 4):
            for _form in ("dyn", "rr"):
                CASES.append(pytest.param(_name, _r, _ep, _form, id=f"{_o}-{_r}-EP{_ep}-{_form}"))


@pytest.mark.parametrize("schedule,routing,ep,form", CASES)
def test_device_plan_equals_host_plan(schedule, routing, ep, form):
    tokens, el, K, make = ROUTINGS[routing]
    cfg = dataclasses.replace(CFG, dynamic=form == "dyn")
    buf = _buffer(tokens, el, K, ep, cfg, pool=routing == "pool")
    idx = make(tokens, el * ep, K, torch.Generator().manual_seed(tokens + ep))
    ctas = (3, 1, 7)[(tokens + ep) % 3]
    host = plan(idx, buf, schedule, ctas=ctas)
    if routing == "pool":
        assert host.layout.unit_info.shape[0] > buf.pool_units  # the pool is reused
    programs = 1 + (tokens + ep) % 3  # the work split over 1, 2 or 3 programs
    _assert_same_plan(device_plan(idx, buf, schedule, ctas=ctas, programs=programs), host, buf, ctas)


@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved", "lag:0", "lag:2"])
@pytest.mark.parametrize("ep,form", [pytest.param(1, "dyn", id="EP1-dyn"), pytest.param(2, "rr", id="EP2-rr")])
def test_device_plan_odd_blocks(schedule, ep, form):
    # n1 = 3 Linear-1 and n2 = 2 Linear-2 tasks per unit, units of 32 rows, a last output block half full.
    cfg = dataclasses.replace(ODD, dynamic=form == "dyn")
    buf = _buffer(29, 3, 2, ep, cfg, H=96, I=48)
    idx = _skewed(29, 3 * ep, 2, torch.Generator().manual_seed(5))
    host = plan(idx, buf, schedule, ctas=2)
    assert host.schedule.n1 == 3 and host.schedule.n2 == 2
    _assert_same_plan(device_plan(idx, buf, schedule, ctas=2, programs=2), host, buf, 2)


@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved", "lag:1", "lag:3"])
@pytest.mark.parametrize("pool", [1, 2, 3, 5])
def test_device_plan_small_pools(schedule, pool):
    # Pools below MIN_POOL_UNITS cannot be built, but the wave caps (pool // 2, pool // 3) and the
    # hoisting bound must hold for any pool: set one on the buffer directly.
    buf = _buffer(40, 4, 2, 2, CFG)
    buf.pool_units = pool
    idx = _skewed(40, 8, 2, torch.Generator().manual_seed(pool))
    try:
        host = plan(idx, buf, schedule, ctas=2)
    except PoolTooSmallError as exc:
        with pytest.raises(PoolTooSmallError) as dev_exc:
            device_plan(idx, buf, schedule, ctas=2)
        assert str(dev_exc.value) == str(exc)
        return
    assert host.layout.unit_info.shape[0] > pool
    _assert_same_plan(device_plan(idx, buf, schedule, ctas=2, programs=3), host, buf, 2)


def _host_plan_for(all_idx, rank, buf, schedule, ctas):
    """`fused.plan`'s steps for rank `rank` of a group whose routing is `all_idx [R, T_max, K]`."""
    el, bm, c = buf.E_local, buf.cfg.block_m, buf.cfg
    local = all_idx[(all_idx // el) == rank] % el
    counts = torch.bincount(local.reshape(-1), minlength=el).tolist()
    experts = unit_experts(counts, bm)
    units = max(len(experts), 1)
    lay = routing_layout(all_idx, rank, el, bm, buf.rows_cap, units, buf.T_max, buf.pool_units)
    rows = [min(bm, n - i * bm) for n in counts for i in range(-(-n // bm))]
    s = make_schedule(schedule, experts or [0], ctas, buf.I // c.block_n1, -(-buf.H // c.block_n2),
                      unit_rows=rows or [0], pool_units=buf.pool_units)
    return _Plan(lay, s, "cpu", c.dynamic)


@pytest.mark.parametrize("routing", ["uniform", "nothing-for-rank1"])
@pytest.mark.parametrize("schedule", ["interleaved", "lag:1"])
def test_gathered_routing_form(routing, schedule):
    # A real group's form: every rank's routing in its own buffer ([T_max, K], -1 past its tokens),
    # read through per-source deltas, here the rows of one stacked tensor.
    R, el, K, T_max = 3, 2, 2, 12
    buf = _buffer(T_max, el, K, R, dataclasses.replace(CFG, dynamic=schedule == "lag:1"))
    gen = torch.Generator().manual_seed(3)
    all_idx = torch.full((R, T_max, K), -1, dtype=torch.int64)
    for s, T in enumerate((12, 7, 0)):
        if routing == "uniform":
            all_idx[s, :T] = _uniform(T, R * el, K, gen)
        else:  # every token to rank 0's and rank 2's experts: rank 1 receives nothing
            all_idx[s, :T] = torch.stack([torch.tensor([0, 5])] * T) if T else all_idx[s, :0]
    delta = torch.arange(R, dtype=torch.int64) * T_max * K
    for rank in range(R):
        host = _host_plan_for(all_idx, rank, buf, schedule, 2)
        dev = plan_tables(all_idx[0], delta, T_max, rank, buf, schedule, 2, loopback=False, programs=2)
        _assert_same_plan(dev, host, buf, 2)
        if routing != "uniform" and rank == 1:
            assert int(dev.layout.num_units) == 0 and int(dev.cta_start[-1]) == 1 + host.schedule.n1 + host.schedule.n2


def test_gathered_form_of_loopback_routing_equals_plan():
    # The loopback group's synthesised routing, stacked as a real group would hold it, gives plan()'s plan.
    buf = _buffer(11, 4, 3, 2, CFG)
    idx = _uniform(11, 8, 3, torch.Generator().manual_seed(1))
    stacked = torch.stack([(idx + s * 4) % 8 for s in range(2)]).contiguous()
    delta = torch.arange(2, dtype=torch.int64) * 11 * 3
    dev = plan_tables(stacked[0], delta, 11, 0, buf, "expert_wave", 3, loopback=False, programs=3)
    _assert_same_plan(dev, plan(idx, buf, "expert_wave", ctas=3), buf, 3)


def test_out_of_range_expert_ids_as_the_host_treats_them():
    # With check=False nothing refuses them: loopback wraps them modulo E as `_all_topk` does, and in
    # the gathered form they belong to no rank, as in `routing_layout`; no address is formed from them.
    buf = _buffer(9, 2, 2, 2, CFG)
    idx = _uniform(9, 4, 2, torch.Generator().manual_seed(6))
    idx[0, 0], idx[3, 1], idx[5, 0] = -3, 4 + 5, -(1 << 40)
    _assert_same_plan(device_plan(idx, buf, "lag:1", ctas=2, programs=2), plan(idx, buf, "lag:1", ctas=2), buf, 2)
    stacked = torch.stack([idx, idx.flip(0)]).contiguous()
    delta = torch.arange(2, dtype=torch.int64) * 9 * 2
    for rank in range(2):
        dev = plan_tables(stacked[0], delta, 9, rank, buf, "interleaved", 2, loopback=False, programs=2)
        _assert_same_plan(dev, _host_plan_for(stacked, rank, buf, "interleaved", 2), buf, 2)


@pytest.mark.parametrize("name", sorted(set(CANDIDATES) | {"lag:0", "lag:3", "lag:5"}))
def test_pool_needed_is_where_the_host_starts_refusing(name):
    # For every pool and unit count above it, the host refuses the order exactly when the pool is
    # below pool_needed: the device plan's up-front check is the host's, for the largest routing.
    need = pool_needed(name)
    for units in range(2, 12):
        for n_experts in (1, 3, units):
            experts = sorted(e % n_experts for e in range(units))
            for pool in range(1, units):
                for ctas in (1, 4):
                    try:
                        make_schedule(name, experts, ctas, 2, 3, pool_units=pool)
                        refused = False
                    except PoolTooSmallError:
                        refused = True
                    assert refused == (pool < need), (name, units, n_experts, pool, ctas)


def test_order_that_cannot_fit_is_refused_up_front_in_the_hosts_words():
    tokens, el, K, make = ROUTINGS["pool"]
    buf = _buffer(tokens, el, K, 1, CFG, pool=True)
    idx = make(tokens, el, K, None)
    with pytest.raises(PoolTooSmallError) as host_exc:
        plan(idx, buf, "lag:40", ctas=2)
    with pytest.raises(PoolTooSmallError) as dev_exc:
        device_plan(idx, buf, "lag:40", ctas=2)
    assert str(dev_exc.value) == str(host_exc.value)
    # A routing with fewer units than the pool runs on the host, but another routing of the same call
    # shape might not: the device plan decides for the buffer's largest, before any launch.
    small = idx[:8]
    assert plan(small, buf, "lag:40", ctas=2).schedule.num_units <= buf.pool_units
    with pytest.raises(PoolTooSmallError, match=r"needs more than the 32 units the row pool holds"):
        device_plan(small, buf, "lag:40", ctas=2)
    device_plan(small, buf, f"lag:{MIN_POOL_UNITS - 1}", ctas=2)  # k + 1 = pool fits


def test_custom_order_is_planned_on_the_host(monkeypatch):
    from xstage.spec import schedule as sched_mod

    def backwards(unit_expert, n1, n2, num_ctas, arg, pool_units=None):
        order = []
        for u in reversed(range(len(unit_expert))):
            order += [(0, u, 0)] + [(1, u, nb) for nb in range(n1)] + [(2, u, nb) for nb in range(n2)]
        return order

    monkeypatch.setitem(sched_mod._REGISTRY, "backwards", backwards)
    monkeypatch.setitem(sched_mod._REGISTRY, "lag", backwards)  # a shipped name replaced: no device form
    buf = _buffer(13, 4, 2, 2, CFG)
    idx = _uniform(13, 8, 2, torch.Generator().manual_seed(2))
    for name in ("backwards", "lag:2"):
        p = device_plan(idx, buf, name, ctas=2)
        assert isinstance(p, _Plan) and torch.equal(p.tasks, plan(idx, buf, name, ctas=2).tasks)


def test_plan_on_is_checked():
    buf = _buffer(4, 2, 2, 1, CFG)
    x = torch.zeros(4, 64, dtype=torch.float16)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    for bad, kw in (("gpu", {}), ("host", {"static": True})):
        with pytest.raises(InputError, match="plan_on="):
            fused_moe(x, idx, torch.ones(4, 2), None, None, buf, plan_on=bad, **kw)


def test_static_is_deprecated_and_plans_on_the_device():
    buf = _buffer(8, 4, 2, 2, CFG)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=gen).half()
    idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(8)])
    w = torch.rand(8, 2, generator=gen)
    w1t, w2 = _weights(4, 64, 32, torch.float16, gen, CFG.block_n1)
    with pytest.warns(DeprecationWarning, match="static=True"):
        y = fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", static=True)
    assert torch.equal(y, fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", plan_on="host"))


def _weights(E_local, H, I, dtype, gen, bn1):
    l1 = (torch.randn(E_local, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    l2 = (torch.randn(E_local, H, I, generator=gen) / I**0.5).to(dtype)
    return transform_weights(l1, l2, bn1)


@pytest.mark.parametrize("dtype,R,path,form", [
    pytest.param(torch.float16, 2, "hbm", "dyn", id="fp16-EP2-hbm-dyn"),
    pytest.param(torch.float32, 4, "host", "rr", id="fp32-EP4-host-rr"),
    pytest.param(torch.float16, 1, "hbm", "rr", id="fp16-EP1-hbm-rr"),
])
def test_fused_moe_with_the_device_plan_is_bitwise_the_host_plans(dtype, R, path, form):
    E, K, H, I = 4 * R, 2, 64, 32
    cfg = dataclasses.replace(CFG, dynamic=form == "dyn")
    buf = MoEBuffer(24, E, K, H, I, LoopbackGroup(R, path=path), device="cpu", dtype=dtype, config=cfg)
    gen = torch.Generator().manual_seed(R)
    w1t, w2 = _weights(E // R, H, I, dtype, gen, cfg.block_n1)
    # Token counts that grow and shrink: the device plan's buffers keep rows of earlier calls.
    for T, schedule in ((24, "interleaved"), (5, "lag:1"), (17, "expert_wave"), (0, "lag:0")):
        x = torch.randn(T, H, generator=gen).to(dtype)
        idx = _skewed(T, E, K, gen) if T != 17 else _uniform(T, E, K, gen)
        w = torch.rand(T, K, generator=gen)
        outs = []
        for plan_on in ("host", "device"):
            buf.combine.fill_(float("nan"))  # a combine row nobody wrote poisons y
            if buf.combine_host is not None:
                buf.combine_host.fill_(float("nan"))
            outs.append(fused_moe(x, idx, w, w1t, w2, buf, schedule=schedule, pacing="off", plan_on=plan_on))
        assert outs[0].shape == (T, H) and bool(torch.isfinite(outs[0]).all())
        assert torch.equal(outs[1], outs[0]), (T, schedule)
    assert int(buf.ready.abs().sum()) == 0 and int(buf.sync[3]) == 0  # the counters re-armed


def test_fused_moe_device_plan_in_a_reused_pool():
    tokens, el, K, make = ROUTINGS["pool"]
    buf = _buffer(tokens, el, K, 1, CFG, pool=True)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, 64, generator=gen).half()
    w = torch.rand(tokens, K, generator=gen)
    w1t, w2 = _weights(el, 64, 32, torch.float16, gen, CFG.block_n1)
    idx = make(tokens, el, K, gen)
    for schedule in ("expert_wave", "lag:16"):
        y_host = fused_moe(x, idx, w, w1t, w2, buf, schedule=schedule, plan_on="host")
        buf.combine.fill_(float("nan"))
        y_dev = fused_moe(x, idx, w, w1t, w2, buf, schedule=schedule, plan_on="device")
        assert torch.equal(y_dev, y_host), schedule


_HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from xstage.moe.device_plan import moe_plan_kernel

consts = dict(BM=128, FIRST=1, LAST=4, WAIT=True, USE_PTX=True, ELP=128, LOG_E=7, UTOP=512, LOG_U=9, BE=64,
              BU=32, BT=128, GB=64, BC=256, TC=8, PE=8, UC=10, WB=8)
for order, rr, loopback in ((0, False, True), (1, True, False), (2, True, True)):
    c = dict(consts, ORDER=order, RR=rr, LOOPBACK=loopback)
    sig = {}
    for n in moe_plan_kernel.arg_names:
        if n in c:
            sig[n] = "constexpr"
        elif n in ("p_idx_delta", "p_counts", "p_num_units") or (n == "p_idx" and not loopback):
            sig[n] = "*i64"
        elif n.startswith("p_"):
            sig[n] = "*i32"
        else:
            sig[n] = "i64" if n in ("timeout_ns", "max_spins") else "i32"
    triton.compile(ASTSource(fn=moe_plan_kernel, signature=sig, constexprs=c), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4))
print("compiled")
"""


@pytest.mark.slow
def test_prologue_compiles_for_hopper():
    # The single launch of each order (`tests.moe.hopper`).
    assert_compiles_for_hopper(_HOPPER_COMPILE)


# ---- GPU: the single launch with its grid barriers, no host sync, CUDA-graph capture -------------

GPU_CFG = BlockConfig(block_m=64, block_n1=64, block_n2=128, block_k=64, block_d=64, num_warps=4, num_stages=3)


def _gpu_problem(T, E, K, H, I, R, seed, T_max=None):
    gen = torch.Generator().manual_seed(seed)
    buf = MoEBuffer(T_max or T, E, K, H, I, LoopbackGroup(R), device="cuda", dtype=torch.bfloat16, config=GPU_CFG)
    w1t, w2 = _weights(E // R, H, I, torch.bfloat16, gen, GPU_CFG.block_n1)
    return buf, w1t.cuda(), w2.cuda(), gen


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved", "lag:0", "lag:1", "lag:16"])
@pytest.mark.parametrize("R", [1, 4])
def test_gpu_device_plan_equals_host_plan(schedule, R):
    # Every program of the single launch, behind the grid barriers, for several routings and CTA counts.
    for dynamic in (True, False):
        cfg = dataclasses.replace(GPU_CFG, dynamic=dynamic)
        buf = MoEBuffer(2048, 32 * R, 4, 256, 128, LoopbackGroup(R), device="cuda", dtype=torch.bfloat16,
                        config=cfg)
        gen = torch.Generator().manual_seed(R)
        for T, make in ((2048, _uniform), (1500, _skewed), (0, _uniform), (700, _one_expert), (1, _uniform)):
            idx = make(T, 32 * R, 4 if make is not _one_expert else 1, gen)
            if make is _one_expert:
                idx = torch.cat([idx, idx + 1, idx + 2, idx + 3], 1)
            idx = idx.cuda()
            for ctas in (132, 7):
                host = plan(idx, buf, schedule, ctas=ctas, pacing="off")
                dev = device_plan(idx, buf, schedule, ctas=ctas, pacing="off")
                _assert_same_plan(_cpu(dev), _cpu(host), buf, ctas)


def _cpu(p):
    out = dataclasses.replace(p) if isinstance(p, DevicePlan) else p
    out.tasks, out.cta_start = p.tasks.cpu(), p.cta_start.cpu()
    lay = p.layout
    out.layout = dataclasses.replace(lay, unit_info=lay.unit_info.cpu(), row_src=lay.row_src.cpu(),
                                     row_slot=lay.row_slot.cpu(), counts=lay.counts.cpu(),
                                     num_units=lay.num_units.cpu())
    return out


@pytest.mark.gpu
def test_gpu_device_plan_call_makes_no_host_sync():
    T, E, K, H, I, R = 512, 32, 4, 512, 256, 2
    buf, w1t, w2, gen = _gpu_problem(T, E, K, H, I, R, seed=1)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    idx, w = _uniform(T, E, K, gen).cuda(), torch.rand(T, K, generator=gen).cuda()
    ref = fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1")  # compiles, and fixes the pacing decision
    fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", check=False, plan_on="device")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", check=False, plan_on="device")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    buf.check()
    assert torch.equal(y, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["interleaved", "lag:4"])
def test_gpu_graph_replay_with_new_routing(schedule):
    T, E, K, H, I, R = 384, 32, 4, 512, 256, 4
    buf, w1t, w2, gen = _gpu_problem(T, E, K, H, I, R, seed=2)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    idx, w = _uniform(T, E, K, gen).cuda(), torch.rand(T, K, generator=gen).cuda()
    for _ in range(2):  # compile and settle the per-call decisions outside the capture
        fused_moe(x, idx, w, w1t, w2, buf, schedule=schedule, check=False, plan_on="device")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_moe(x, idx, w, w1t, w2, buf, schedule=schedule, check=False, plan_on="device")
    for seed, make in ((10, _uniform), (11, _skewed), (12, _uniform)):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(T, H, generator=g).to(torch.bfloat16))
        idx.copy_(make(T, E, K, g))
        w.copy_(torch.rand(T, K, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        buf.check()
        eager = fused_moe(x, idx, w, w1t, w2, buf, schedule=schedule)  # host plan, synchronous checks
        assert torch.equal(y, eager), (seed, float((y.float() - eager.float()).abs().max()))


@pytest.mark.gpu
def test_gpu_prologue_time_against_the_main_kernel():
    # Information for the cost model (printed, not held to a bound here): prologue and main kernel times.
    from xstage.moe.fused import launch_main

    T, E, K, H, I, R = 1024, 128, 8, 2048, 768, 1
    buf = MoEBuffer(T, E, K, H, I, LoopbackGroup(R), device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    w1t, w2 = _weights(E, H, I, torch.bfloat16, gen, buf.cfg.block_n1)
    w1t, w2 = w1t.cuda(), w2.cuda()
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    idx, w = _uniform(T, E, K, gen).cuda(), torch.rand(T, K, generator=gen).cuda()
    for schedule in ("interleaved", "lag:1"):
        fused_moe(x, idx, w, w1t, w2, buf, schedule=schedule, plan_on="device")
        times = []
        for _ in range(20):
            a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            a.record()
            p = device_plan(idx, buf, schedule)
            b.record()
            launch_main(x, w1t, w2, buf, p)
            c.record()
            y = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
            from xstage.moe.fused import launch_reduce

            launch_reduce(idx, w, y, buf)
            torch.cuda.synchronize()
            times.append((a.elapsed_time(b), b.elapsed_time(c)))
        pro, main = np.median([t[0] for t in times]), np.median([t[1] for t in times])
        print(f"{schedule}: prologue {pro * 1e3:.1f} us, main {main * 1e3:.1f} us ({100 * pro / main:.1f}%)")
        assert pro > 0 and main > 0
