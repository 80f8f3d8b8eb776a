import json

import pytest

from xstage.errors import InputError
from xstage.model.interference import load_default_interference
from xstage.model.params import PathParams
from xstage.sched.costs import KindCost, TaskCosts
from xstage.sched.moe import MoeConfig, moe_work, synthetic_routing, task_work
from xstage.sched.plan import plan_moe
from xstage.sched.simulate import simulate_kernel
from xstage.sched.timeline import plot_timeline
from xstage.spec.schedule import LINEAR2

# Test inputs, not measurements: round numbers of the order an H200 shows.
COSTS = TaskCosts("moe", {"dispatch": KindCost(400.0, 20.0), "linear1": KindCost(300.0, 4000.0),
                          "linear2": KindCost(300.0, 4000.0)})
SLOW_PATH = PathParams(r0=50e9, c_sm=64 * 1024, drain=8e9, capacity=1 << 20, t0=70.0, latency=1000.0)
FAST_PATH = PathParams(r0=50e9, c_sm=float("inf"), drain=1e15, capacity=float("inf"), t0=70.0)
SMALL = MoeConfig.parse("H512-I256-E16-K2", tokens_per_rank=256, ep=4, block_m=64, block_n1=64, block_n2=128)


def test_config_parsing_and_validation():
    cfg = MoeConfig.parse("H4096-I2048-E256-K6", tokens_per_rank=1024, ep=8)
    assert (cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.topk, cfg.local_experts) == (4096, 2048, 256, 6, 32)
    assert cfg.shape == "H4096-I2048-E256-K6"
    with pytest.raises(InputError, match="expected H"):
        MoeConfig.parse("4096x2048", tokens_per_rank=1, ep=1)
    with pytest.raises(InputError, match="multiple of ep"):
        MoeConfig.parse("H512-I256-E10-K2", tokens_per_rank=1, ep=4)


def test_synthetic_routing_covers_the_routed_rows():
    experts, rows, _ = synthetic_routing(SMALL, seed=3)
    assert all(0 < r <= SMALL.block_m for r in rows)
    # Expected rows on rank 0: tokens x EP x topk / experts x local experts.
    expected = SMALL.tokens_per_rank * SMALL.ep * SMALL.topk / SMALL.num_experts * SMALL.local_experts
    assert abs(sum(rows) - expected) < 5 * expected**0.5
    assert experts == sorted(experts)


def test_work_stores_only_in_linear2_and_only_the_rows_of_other_ranks():
    work = moe_work(SMALL, "expert_wave", COSTS, num_ctas=4)
    experts, rows, remote = synthetic_routing(SMALL)
    n2 = SMALL.hidden // SMALL.block_n2
    by_unit = {t.name: t.store_bytes for t in work.all_tasks() if t.kind == "linear2"}
    for u, r in enumerate(remote):  # every LINEAR2 slab of a unit stores its remote rows, BF16
        assert all(by_unit[f"linear2.{u}.{j}"] == r * SMALL.block_n2 * 2 for j in range(n2))
    assert all(t.kind == "linear2" for t in work.all_tasks() if t.store_bytes)
    # About (EP - 1) / EP of the rows are other ranks' (binomial, 5 sigma).
    n, p = sum(rows), (SMALL.ep - 1) / SMALL.ep
    assert abs(sum(remote) - n * p) < 5 * (n * p * (1 - p)) ** 0.5
    assert task_work(SMALL, LINEAR2) == 2.0 * 64 * 128 * 256


def test_an_experts_remote_rows_follow_its_own_rows_as_in_the_kernels_layout():
    import torch

    from xstage.moe.layout import routing_layout, unit_experts

    cfg = MoeConfig.parse("H512-I256-E8-K2", tokens_per_rank=512, ep=4, block_m=16, block_n1=64, block_n2=128)
    experts, rows, remote = synthetic_routing(cfg, seed=1)
    for e in set(experts):  # the model: within an expert, the own rows fill the first units
        units = [u for u, x in enumerate(experts) if x == e]
        own = [rows[u] - remote[u] for u in units]
        first_remote = next((i for i, u in enumerate(units) if remote[u]), len(units))
        assert all(o == rows[u] for o, u in zip(own[:first_remote], units))
        assert all(o == 0 for o in own[first_remote + 1:])
    # The kernel's layout orders an expert's rows by source rank (rank 0: its own first).
    gen = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.rand(cfg.tokens_per_rank, cfg.num_experts, generator=gen).topk(cfg.topk).indices
                       for _ in range(cfg.ep)])
    el = cfg.local_experts
    counts = torch.bincount((idx[idx // el == 0] % el).reshape(-1), minlength=el)
    units = unit_experts(counts.tolist(), cfg.block_m)
    lay = routing_layout(idx, 0, el, cfg.block_m, rows_cap=4096, units_cap=len(units), token_stride=1 << 16)
    for e in range(el):
        first = int(lay.unit_info[units.index(e), 1])
        src_rank = (lay.row_src[first:first + int(counts[e])] >> 16).tolist()
        assert src_rank == sorted(src_rank) and src_rank[0] == 0 and src_rank[-1] == cfg.ep - 1


def test_schedules_equal_without_backpressure_and_differ_with_it():
    """On a path that never backpressures, store placement cannot matter beyond issue cost;
    on a slow path the wave order, which concentrates the Linear-2 stores, must not win, and stalls
    more than `interleaved`, which spreads a wave's stores over the next wave's LINEAR1 tasks. (`lag:1`
    spreads them over three units only: an expert's remote rows come in a run of units, after its own.)"""
    cfg = MoeConfig.parse("H1024-I512-E8-K2", tokens_per_rank=512, ep=4, block_m=64, block_n1=64, block_n2=128)
    fast = {r.schedule: r.time_ns for r in plan_moe(cfg, FAST_PATH, COSTS, 8, candidates=["expert_wave", "lag:1"])}
    slow = plan_moe(cfg, SLOW_PATH, COSTS, 8, candidates=["expert_wave", "interleaved", "lag:1"])
    assert all(r.time_ns >= min(fast.values()) for r in slow)
    by_name = {r.schedule: r for r in slow}
    assert by_name["expert_wave"].breakdown["stall"] > by_name["interleaved"].breakdown["stall"]
    assert slow[0].schedule != "expert_wave"


def test_costs_round_trip_and_malformed(tmp_path):
    path = tmp_path / "c.json"
    COSTS.save(path)
    assert TaskCosts.load(path).to_dict() == COSTS.to_dict()
    path.write_text(json.dumps({"kernel": "moe", "kinds": {"linear1": {"overhead_ns": 1}}}))
    with pytest.raises(InputError, match="malformed"):
        TaskCosts.load(path)
    with pytest.raises(InputError, match="rate"):
        KindCost(1.0, 0.0)


def test_timeline_plot(tmp_path):
    from xstage.sched.timeline import COLORS, timeline_figure

    res = simulate_kernel(moe_work(SMALL, "lag:1", COSTS, 4), {"remote": SLOW_PATH}, trace_backlog=True)
    fig = timeline_figure(res)
    ax, axq = fig.axes
    # Every drawn bar is a segment of the simulation: as many bars as segments with a duration.
    assert len(ax.patches) == sum(1 for s in res.segments if s.duration_ns > 0)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(COLORS)
    assert ax.get_title() == f"predicted kernel time {res.time_ns / 1e3:.1f} us"
    (line,) = axq.get_lines()
    peak = max(q for _, q in res.backlog["remote"])
    assert line.get_label() == f"remote: bytes issued, not yet drained (peak {peak / 2**10:.3g} KiB)"
    assert max(line.get_ydata()) == peak / 2**20
    assert (axq.get_xlabel(), axq.get_ylabel()) == ("time (us)", "backlog (MiB)")
    # With the path's capacity, the panel shows it as a level and reaches it: a small backlog reads small.
    axq = timeline_figure(res, capacity=SLOW_PATH.capacity).axes[1]
    level = [ln for ln in axq.get_lines() if ln.get_linestyle() == "--"]
    assert len(level) == 1 and level[0].get_ydata()[0] == SLOW_PATH.capacity / 2**20
    assert axq.get_ylim()[1] >= SLOW_PATH.capacity / 2**20
    out = plot_timeline(res, tmp_path / "t.png")
    assert out == tmp_path / "t.png" and out.read_bytes()[:4] == b"\x89PNG"


def test_model_guided_pick_is_the_planner_best():
    from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer
    from xstage.sched.costs import load_default_costs
    from xstage.sched.plan import moe_path_params
    from xstage.sched.policy import pick_for_moe_buffer

    cfg = BlockConfig(block_m=64, block_n1=64, block_n2=128, block_k=32, block_d=32)
    buf = MoEBuffer(512, 8, 2, 1024, 512, LoopbackGroup(4, path="host"), device="cpu", dtype="fp16", config=cfg,
                    pacing="default")  # 2-byte rows as in bf16 (refused in the CPU interpreter)
    pick = pick_for_moe_buffer(buf, 512, num_ctas=8, pacing=buf.pacing)
    mcfg = MoeConfig.parse("H1024-I512-E8-K2", tokens_per_rank=512, ep=4, block_m=64, block_n1=64,
                           block_n2=128, block_k=32)
    assert buf.pacing is not None  # the host path is paced by default, and the planner knows it
    rows = plan_moe(mcfg, moe_path_params("host"), load_default_costs("moe"), 8, pacing=buf.pacing,
                    interference=load_default_interference("host"))
    assert pick == rows[0].schedule


def test_the_buffer_planner_answers_where_its_routing_routes_no_row():
    from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer
    from xstage.sched.costs import load_default_costs
    from xstage.sched.moe import routes_rows
    from xstage.sched.policy import buffer_config, pick_for_moe_buffer, pick_pacing_for_buffer

    cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
    buf = MoEBuffer(8, 8, 1, 64, 32, LoopbackGroup(2, path="host"), device="cpu", dtype="fp16", config=cfg)
    assert not routes_rows(buffer_config(buf, 1)) and routes_rows(buffer_config(buf, 8))
    with pytest.raises(InputError, match="no rows routed to rank 0"):  # nothing to rank: `plan moe` says so
        plan_moe(buffer_config(buf, 1), SLOW_PATH, load_default_costs("moe"), 8)
    # A call must still run: no remote store to pace, and every order runs no task (the first is kept).
    assert pick_pacing_for_buffer(buf, 1, 8, None) == "off"
    assert pick_for_moe_buffer(buf, 1, 8, None) == "expert_wave"
    assert pick_for_moe_buffer(buf, 1, 8, None, candidates=["lag:2", "expert_wave"]) == "lag:2"


def test_auto_pacing_pick_is_the_fastest_schedule_and_pacing():
    from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer
    from xstage.sched.costs import load_default_costs
    from xstage.sched.pacing import resolve_pacing
    from xstage.sched.plan import moe_path_params
    from xstage.sched.policy import pick_pacing_for_buffer
    from xstage.spec.pacing import PACING_CANDIDATES

    cfg = BlockConfig(block_m=64, block_n1=64, block_n2=128, block_k=32, block_d=32)
    buf = MoEBuffer(512, 8, 2, 1024, 512, LoopbackGroup(4, path="host"), device="cpu", dtype="fp16", config=cfg)
    mcfg = MoeConfig.parse("H1024-I512-E8-K2", tokens_per_rank=512, ep=4, block_m=64, block_n1=64,
                           block_n2=128, block_k=32)
    times = {}
    term = load_default_interference("host")
    for spec in PACING_CANDIDATES:  # an independent ranking: one fixed pacing at a time
        for r in plan_moe(mcfg, moe_path_params("host"), load_default_costs("moe"), 8,
                          pacing=resolve_pacing(spec, "host", 4), interference=term):
            # unpaced predictions carry the term's measured bias when compared with paced ones
            times[(r.schedule, spec)] = r.time_ns * (term.unpaced_bias if spec == "off" else 1.0)
    best_schedule, best_pacing = min(times, key=times.get)
    assert pick_pacing_for_buffer(buf, 512, 8, None) == best_pacing
    for schedule in ("expert_wave", "lag:4"):
        want = min(PACING_CANDIDATES, key=lambda spec: times[(schedule, spec)])
        assert pick_pacing_for_buffer(buf, 512, 8, schedule) == want


def test_a_paced_kernel_waits_for_its_pacer_ahead_of_the_link():
    from xstage.sched.moe import remote_path, simulate_remote
    from xstage.spec.pacing import StorePacing

    pacing = StorePacing(rate=1e9, budget=64 * 1024)  # far below SLOW_PATH's 8 GB/s drain: it bounds the kernel
    assert remote_path(SLOW_PATH, pacing) == remote_path(SLOW_PATH)  # the pacer is not part of the link
    work = moe_work(SMALL, "lag:1", COSTS, 4)
    unpaced = simulate_remote(work, SLOW_PATH).time_ns
    paced = simulate_remote(work, SLOW_PATH, pacing).time_ns
    remote = sum(sum(t.stores.values()) for t in work.queue)
    assert paced > unpaced and paced >= (remote - pacing.budget) / pacing.rate * 1e9  # the pace bounds it
    fast = StorePacing(rate=1e12, budget=64 << 20)  # a pace the path cannot reach changes nothing
    assert simulate_remote(work, SLOW_PATH, fast).time_ns == pytest.approx(unpaced, rel=1e-9)


def test_cli_plan_moe_takes_the_pacing(capsys):
    from xstage.cli import main

    args = ["plan", "moe", "--shape", "H512-I256-E16-K2", "--tokens", "256", "--ep", "4", "--ctas", "8",
            "--candidates", "lag:1", "--json"]
    times = {}
    for spec in ("off", "2:64"):
        assert main([*args, "--pacing", spec]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["pacing"] == {spec: spec}
        times[spec] = out["rows"][0]["time_us"]
    assert times["2:64"] > times["off"]  # 2 GB/s is far below the host link's drain
    assert main([*args, "--pacing", "auto"]) == 0  # every schedule under each candidate pacing
    out = json.loads(capsys.readouterr().out)
    assert sorted(r["pacing"] for r in out["rows"]) == ["default", "off"]
    bias = load_default_interference("host").unpaced_bias
    ranked = min(out["rows"], key=lambda r: r["time_us"] * (bias if r["pacing"] == "off" else 1.0))
    assert out["pick_pacing"] == ranked["pacing"] and out["pick"] == ranked["schedule"]
    assert main([*args, "--pacing", "fast"]) != 0
    assert "--pacing fast: expected 'off'" in capsys.readouterr().err


def test_remote_path_has_no_per_sm_window_and_costs_more_when_the_link_is_busy():
    from xstage.sched.moe import HELD_STORE_WINDOW, remote_path

    p = remote_path(SLOW_PATH)
    assert p.c_sm == HELD_STORE_WINDOW and p.drain == SLOW_PATH.drain and p.capacity == SLOW_PATH.capacity
    work = moe_work(SMALL, "expert_wave", COSTS, 4)
    window = simulate_kernel(work, {"remote": SLOW_PATH}).time_ns
    held = simulate_kernel(work, {"remote": p}).time_ns
    assert held >= window  # a task can no longer compute while its SM holds its last burst


def test_unpaced_drain_slows_only_unpaced_paths_and_never_speeds_one_up():
    from xstage.model.interference import Interference
    from xstage.sched.moe import remote_path
    from xstage.spec.pacing import StorePacing

    assert remote_path(SLOW_PATH, None, 0.0) == remote_path(SLOW_PATH)  # 0: the path's own drain
    slower = remote_path(SLOW_PATH, None, SLOW_PATH.drain / 2)
    assert slower.drain == SLOW_PATH.drain / 2 and slower.capacity == SLOW_PATH.capacity
    assert remote_path(SLOW_PATH, None, SLOW_PATH.drain * 2).drain == SLOW_PATH.drain  # never above the path's
    paced = StorePacing(rate=4e9, budget=256 * 1024)
    assert remote_path(SLOW_PATH, paced, 1e6) == remote_path(SLOW_PATH, paced)  # a paced kernel keeps its pace
    # The planner plays it: the unpaced candidate of a link-bound kernel slows, the paced one does not.
    work_args = (SMALL, SLOW_PATH, COSTS, 4)
    kw = dict(candidates=["lag:1"], pacings={"off": None, "4:256": paced})
    base = {r.pacing: r.time_ns for r in plan_moe(*work_args, **kw, interference=Interference(0.0, 1e18, 1.0))}
    term = Interference(0.0, 1e18, 1.0, unpaced_drain=SLOW_PATH.drain / 4)
    got = {r.pacing: r.time_ns for r in plan_moe(*work_args, **kw, interference=term)}
    assert got["off"] > base["off"] * 1.05
    assert got["4:256"] == pytest.approx(base["4:256"], rel=1e-12)


def test_unpaced_drain_from_takes_the_saturated_unpaced_rows_over_a_small_footprint():
    from xstage.calibrate.interference import unpaced_drain_from

    rows = [dict(pacing="off", storing_ctas=66, footprint_mib=256, host_gbps=40.0),
            dict(pacing="off", storing_ctas=132, footprint_mib=256, host_gbps=44.0),
            dict(storing_ctas=132, footprint_mib=128, host_gbps=46.0),  # a run without the column: unpaced
            dict(pacing="50:128", storing_ctas=132, footprint_mib=256, host_gbps=48.0),  # paced
            dict(pacing="off", storing_ctas=33, footprint_mib=256, host_gbps=30.0),  # link not saturated
            dict(pacing="off", storing_ctas=132, footprint_mib=1024, host_gbps=36.0)]  # the scatter caps it
    assert unpaced_drain_from(rows) == (44e9, 3)
    with pytest.raises(InputError, match="no unpaced row"):
        unpaced_drain_from(rows[3:])


def test_row_pool_slot_waits_are_dependencies_and_cost_time():
    import dataclasses

    cfg = MoeConfig.parse("H1024-I512-E8-K2", tokens_per_rank=2048, ep=2, block_m=64, block_n1=64,
                          block_n2=128, block_k=32)
    experts, _, _ = synthetic_routing(cfg, 0)
    pool = 8
    assert len(experts) > 2 * pool
    pooled = dataclasses.replace(cfg, pool_units=pool)
    work = moe_work(pooled, "expert_wave", COSTS, 8)
    deps = {t.name: t.deps for t in work.queue}
    n2 = -(-cfg.hidden // cfg.block_n2)
    # Unit `pool` dispatches into unit 0's slot: it waits for every Linear-2 slab of unit 0.
    assert deps[f"dispatch.{pool}.0"] == tuple(f"linear2.0.{j}" for j in range(n2))
    assert deps["dispatch.0.0"] == ()
    # The same order with extra waits (lag:2 keeps its order in a pool of 8): never faster.
    t_pool = simulate_kernel(moe_work(pooled, "lag:2", COSTS, 8), {"remote": SLOW_PATH}).time_ns
    t_free = simulate_kernel(moe_work(cfg, "lag:2", COSTS, 8), {"remote": SLOW_PATH}).time_ns
    assert t_pool >= t_free
    rows = plan_moe(dataclasses.replace(cfg, pool_units=4), SLOW_PATH, COSTS, 8,
                    candidates=("expert_wave", "lag:2", "lag:8"))
    assert [r.schedule for r in rows if r.schedule == "lag:8"] == []  # lag:8 needs 10 units: not a candidate
    assert {r.schedule for r in rows} == {"expert_wave", "lag:2"}


def test_unpaced_bias_ranks_unpaced_candidates_slower_but_keeps_their_predicted_time():
    from xstage.model.interference import Interference
    from xstage.sched.plan import rank_ns
    from xstage.spec.pacing import StorePacing

    paced = StorePacing(rate=4e9, budget=256 * 1024)
    term = Interference(0.0, 1e9, 1.0, unpaced_bias=1.5)
    assert rank_ns(100.0, None, term) == 150.0 and rank_ns(100.0, paced, term) == 100.0
    assert rank_ns(100.0, None, None) == 100.0
    rows = plan_moe(SMALL, SLOW_PATH, COSTS, 4, candidates=["lag:1"], pacings={"off": None, "4:256": paced})
    unbiased = {r.pacing: r.time_ns for r in rows}
    big = Interference(0.0, 1e18, 1.0, unpaced_bias=1e3)  # never active; only the bias matters
    rows = plan_moe(SMALL, SLOW_PATH, COSTS, 4, candidates=["lag:1"], pacings={"off": None, "4:256": paced},
                    interference=big)
    assert rows[0].pacing == "4:256"  # the unpaced candidate now ranks last
    assert {r.pacing: r.time_ns for r in rows} == pytest.approx(unbiased, rel=1e-12)  # times unchanged
    assert rows[1].rank_ns == rows[1].time_ns * 1e3


def test_fit_unpaced_bias_is_the_geomean_of_measured_over_predicted_ratios():
    from xstage.calibrate.interference import fit_unpaced_bias

    # measured off/paced ratios 1.2 and 1.0 against predicted 1.0 and 0.8: biases 1.2 and 1.25
    got = fit_unpaced_bias([(100.0, 100.0, 120.0, 100.0), (80.0, 100.0, 100.0, 100.0)])
    assert got == pytest.approx((1.2 * 1.25) ** 0.5, rel=1e-12)
    with pytest.raises(InputError, match="no"):
        fit_unpaced_bias([])
    with pytest.raises(InputError, match="> 0"):
        fit_unpaced_bias([(0.0, 1.0, 1.0, 1.0)])
