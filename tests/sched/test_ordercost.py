import json
import math

import pytest

from xstage.calibrate.ordereffect import order_effect_from_means, restrict_order_effect
from xstage.errors import InputError
from xstage.sched.costs import TaskCosts
from xstage.sched.moe import MoeConfig, moe_work
from xstage.sched.ordercost import OrderEffect, weight_bytes

REF = "H4096-I2048-E256-K6"
SMALL = "H1152-I4608-E8-K2"


def effect() -> OrderEffect:
    return OrderEffect({
        "interleaved": {REF: {"linear1": [(96.0, 0.95), (384.0, 1.12), (1536.0, 1.18)], "linear2": [(96.0, 1.1)]},
                        SMALL: {"linear1": [(512.0, 1.02)]}},
        "lag:1": {REF: {"linear1": [(96.0, 0.8)]}},
        "lag:8": {REF: {"linear1": [(96.0, 1.05)]}},
    })


def test_a_traced_shape_interpolates_its_ratios_in_log_rows_and_holds_them_beyond():
    e = effect()
    mid = math.exp((math.log(384) + math.log(1536)) / 2)
    assert e.factor("interleaved", REF, "linear1", mid) == pytest.approx((1.12 + 1.18) / 2)
    assert e.factor("interleaved", REF, "linear1", 10.0) == pytest.approx(0.95)
    assert e.factor("interleaved", REF, "linear1", 1e5) == pytest.approx(1.18)
    assert e.factor("interleaved", SMALL, "linear1", 3.0) == pytest.approx(1.02)


def test_the_traced_order_and_untraced_orders_keep_their_times():
    e = effect()
    assert e.factor("expert_wave", REF, "linear1", 384.0) == 1.0
    assert e.factor(None, REF, "linear1", 384.0) == 1.0
    assert e.factor("my_order", REF, "linear1", 384.0) == 1.0
    assert e.factor("interleaved", REF, "dispatch", 384.0) == 1.0  # kind not traced on the reference


def test_an_untraced_lag_takes_the_nearest_traced_lag_in_log_k():
    e = effect()
    assert e.factor("lag:2", REF, "linear1", 96.0) == pytest.approx(0.8)  # |log 2/1| < |log 8/2|
    assert e.factor("lag:5", REF, "linear1", 96.0) == pytest.approx(1.05)  # |log 8/5| < |log 5/1|


def test_another_shape_scales_the_reference_by_its_weights_between_w1_and_w1_plus_w2_of_the_reference():
    e = effect()
    assert e.reference == REF  # the larger expert weights of the two traced shapes
    w1_ref = 2 * 4096 * 2048 * 2
    w2_ref = 4096 * 2048 * 2
    shape = "H4096-I1536-E128-K8"
    w = (3 * 4096 * 1536 * 2 - w1_ref) / w2_ref
    assert 0 < w < 1
    assert e.factor("interleaved", shape, "linear1", 384.0) == pytest.approx(1 + w * 0.12)
    assert e.factor("interleaved", "H7168-I3072-E384-K6", "linear1", 384.0) == pytest.approx(1.12)  # clamped at 1
    assert e.factor("interleaved", "H1024-I1024-E64-K4", "linear1", 384.0) == 1.0  # clamped at 0
    # 1-byte weights halve the bytes: H7168 at FP8 still exceeds the reference's W1 + W2
    assert sum(weight_bytes("H7168-I3072-E384-K6", 1)) > w1_ref + w2_ref


def test_ratios_come_from_the_mean_tile_times_of_the_same_run():
    rows = [{"shape": REF, "rows_per_expert": 96, "schedule": "expert_wave", "kind": "linear1", "mean_ns": 50e3},
            {"shape": REF, "rows_per_expert": 96, "schedule": "interleaved", "kind": "linear1", "mean_ns": 60e3},
            {"shape": REF, "rows_per_expert": 384, "schedule": "expert_wave", "kind": "linear1", "mean_ns": 40e3},
            {"shape": REF, "rows_per_expert": 384, "schedule": "interleaved", "kind": "linear1", "mean_ns": 42e3}]
    e = order_effect_from_means(rows)
    assert e.ratios["interleaved"][REF]["linear1"] == [(96.0, 1.2), (384.0, 1.05)]
    assert order_effect_from_means(rows[:1]) is None  # only the baseline: no effect
    with pytest.raises(InputError, match="interleaved.*no expert_wave row"):
        order_effect_from_means(rows[1:2])


def test_malformed_ratios_are_refused_with_the_place():
    with pytest.raises(InputError, match="kind 'linear3'"):
        OrderEffect({"interleaved": {REF: {"linear3": [(96.0, 1.0)]}}})
    with pytest.raises(InputError, match="ratio > 0"):
        OrderEffect({"interleaved": {REF: {"linear1": [(96.0, -1.0)]}}})
    with pytest.raises(InputError, match="H12"):
        OrderEffect({"interleaved": {"H12": {"linear1": [(96.0, 1.0)]}}})
    with pytest.raises(InputError, match="costs.json: order_effect"):
        OrderEffect.from_dict({"ratios": [1, 2]}, "costs.json: order_effect")


def _costs(order=None) -> TaskCosts:
    table = [{"shape": REF, "block": "128x128x256x64", "kind": k, "rows_per_expert": 96.0, "median_ns": t}
             for k, t in (("dispatch", 30e3), ("linear1", 60e3), ("linear2", 30e3))]
    table += [{**r, "shape": SMALL, "block": "128x128x128x64"} for r in table]
    return TaskCosts("moe", {}, {}, {}, table, fetch_ns=2000.0, order=order)


def test_task_costs_scale_traced_tiles_and_keep_the_effect_through_json_and_restriction(tmp_path):
    c = _costs(effect())
    assert c.tile_ns("linear1", "128x128x256x64", REF, 96.0, 1.0, schedule="interleaved") == pytest.approx(60e3 * 0.95)
    assert c.tile_ns("linear1", "128x128x256x64", REF, 96.0, 1.0) == pytest.approx(60e3)
    c.save(tmp_path / "c.json")
    back = TaskCosts.load(tmp_path / "c.json")
    assert back.order == c.order
    assert restrict_order_effect(c.order, [SMALL]).shapes == [SMALL]
    assert restrict_order_effect(c.order, ["H7168-I3072-E384-K6"]) is None
    d = json.loads((tmp_path / "c.json").read_text())
    d["order_effect"] = {"ratios": {"interleaved": {REF: {"linear1": "x"}}}}
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(InputError, match="bad.json: order_effect"):
        TaskCosts.load(tmp_path / "bad.json")


def test_the_task_graph_of_a_schedule_uses_its_tile_times():
    cfg = MoeConfig(hidden=4096, intermediate=2048, num_experts=256, topk=6, tokens_per_rank=4096, ep=1,
                    block_m=128, block_n1=128, block_n2=256, block_k=64)
    rpe = 4096 * 6 / 256
    plain, scaled = _costs(), _costs(OrderEffect({"interleaved": {REF: {
        "linear1": [(rpe, 1.25)], "linear2": [(rpe, 1.5)], "dispatch": [(rpe, 2.0)]}}}))
    for kind, f in (("linear1", 1.25), ("linear2", 1.5), ("dispatch", 2.0)):
        t0 = {t.kind: t.compute_ns for t in moe_work(cfg, "interleaved", plain, 8).queue}[kind]
        t1 = {t.kind: t.compute_ns for t in moe_work(cfg, "interleaved", scaled, 8).queue}[kind]
        assert t1 - 2000.0 == pytest.approx(f * (t0 - 2000.0))
        ew = {t.kind: t.compute_ns for t in moe_work(cfg, "expert_wave", scaled, 8).queue}[kind]
        assert ew == pytest.approx(t0)


def test_calibration_traces_each_schedule_and_keeps_their_mean_tile_ratios(monkeypatch):
    import numpy as np

    from xstage.calibrate import tiles as calibrate
    from xstage.spec.schedule import DISPATCH, LINEAR1, LINEAR2

    kinds = np.array([DISPATCH, LINEAR1, LINEAR1, LINEAR2, LINEAR2, LINEAR2])
    base = np.array([10.0, 20.0, 40.0, 30.0, 30.0, 0.0])  # a task that did not run (0) is left out
    # interleaved and lag:2 share one L2 effect (1.5); lag:2 keeps fewer CTAs busy, so with kappa = 0.5
    # its tiles run 1 - 0.5 x (1 - busy) as long as at full occupancy.
    busy = {"expert_wave": 0.94, "interleaved": 0.94, "lag:2": 0.7}
    scale = {"expert_wave": 1.0, "interleaved": 1.5, "lag:2": 1.5 * (1 - 0.5 * 0.3) / (1 - 0.5 * 0.06)}
    traced = []

    def fake_trace(shape, tokens, spec, reps, seed=0, dtype="bf16", schedule="expert_wave"):
        traced.append(schedule)
        cfg = MoeConfig(hidden=1152, intermediate=4608, num_experts=8, topk=2, tokens_per_rank=tokens, ep=1,
                        block_m=128, block_n1=128, block_n2=128, block_k=64)
        return cfg, None, kinds, base * scale[schedule] * (1 + tokens / 1e4), 2000.0, busy[schedule]

    monkeypatch.setattr(calibrate, "trace_tasks", fake_trace)
    costs, _ = calibrate.calibrate_moe([SMALL], tokens=[1024, 4096], schedules=("expert_wave", "interleaved", "lag:2"))
    assert traced.count("interleaved") == 2 and traced.count("lag:2") == 2
    assert costs.order.ratios["interleaved"][SMALL]["linear1"] == [(256.0, pytest.approx(1.5), 0.94, 0.94),
                                                                   (1024.0, pytest.approx(1.5), 0.94, 0.94)]
    # The occupancy term recovers kappa, and lag:2's factor is its L2 effect alone: the simulator plays
    # its occupancy (occupancy_factor, 1 at the traced expert_wave kernels' busy share).
    assert costs.order.idle_speedup == pytest.approx(0.5, abs=1e-3)
    assert costs.order.reference_busy == pytest.approx(0.94)
    assert costs.order.factor("lag:2", SMALL, "linear2", 512.0) == pytest.approx(1.5, rel=1e-3)
    assert costs.order.occupancy_factor(0.94) == pytest.approx(1.0)
    assert costs.order.occupancy_factor(0.7) == pytest.approx(0.85 / 0.97, rel=1e-3)
    # Below the lowest traced busy share (lag:2's 0.7) the factor is held: no trace says how far it goes.
    assert costs.order.lowest_traced_busy == pytest.approx(0.7)
    assert costs.order.occupancy_factor(0.1) == pytest.approx(0.85 / 0.97, rel=1e-3)
    only, _ = calibrate.calibrate_moe([SMALL], tokens=[1024])
    assert only.order is None
    with pytest.raises(InputError, match="include expert_wave"):
        calibrate.calibrate_moe([SMALL], tokens=[1024], schedules=("interleaved",))
