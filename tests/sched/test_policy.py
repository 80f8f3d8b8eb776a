"""The planner's policy: each open choice is a `Decision` that names its alternatives, its calibration and
whether that calibration was validated on the path; the choices are the planner's own rankings."""

import dataclasses
import logging

import pytest

from xstage.errors import InputError
from xstage.model import load_default_profile
from xstage.model.interference import load_default_interference
from xstage.sched.costs import load_default_costs
from xstage.sched.exchange import default_exchange_costs, plan_exchange
from xstage.sched.moe import MoeConfig
from xstage.sched.pacing import resolve_pacing
from xstage.sched.plan import moe_path_params, plan_moe
from xstage.sched.policy import Decision, choose_exchange, choose_pacing, choose_schedule
from xstage.spec.pacing import PACING_CANDIDATES

CFG = MoeConfig.parse("H1152-I4608-E8-K2", tokens_per_rank=256, ep=2)
CTAS = 132


@pytest.mark.parametrize("path", ["host", "hbm"])
def test_the_exchange_is_the_ranking_of_the_embedded_costs_off_nvlink(path):
    d = choose_exchange(24, 128, 8192, 4, path=path, dtype="bf16")
    ranked = plan_exchange(24, 128, 8192, 4, default_exchange_costs())
    assert d.choice == ranked[0].exchange
    assert d.predicted_ns == tuple((p.exchange, p.time_ns) for p in ranked)
    assert d.validated is (path == "host") and d.kind == "exchange" and d.path == path and d.dtype == "bf16"


def test_on_nvlink_the_exchange_uses_the_peer_profiles_drain_and_says_it_is_not_validated():
    d = choose_exchange(16, 128, 4096, 2, path="peer", dtype="bf16")
    peer = dataclasses.replace(default_exchange_costs(), drain=load_default_profile("peer").params.drain)
    assert peer.drain > 5 * default_exchange_costs().drain  # NVLink drains several times faster
    ranked = plan_exchange(16, 128, 4096, 2, peer)
    assert d.choice == ranked[0].exchange and d.predicted_ns == tuple((p.exchange, p.time_ns) for p in ranked)
    assert not d.validated and "embedded peer profile" in d.calibration
    assert "not validated on this path" in str(d)
    # the store-path term moved: the in-kernel stores' prediction is not the host one
    host = dict(choose_exchange(16, 128, 4096, 2, path="host", dtype="bf16").predicted_ns)
    assert dict(d.predicted_ns)["stores:paced"] < host["stores:paced"]


def test_given_exchange_costs_drive_the_choice_and_are_not_called_validated():
    costs = dataclasses.replace(default_exchange_costs(), source="my calibration")
    d = choose_exchange(24, 128, 8192, 4, path="host", dtype="bf16", costs=costs)
    assert d.choice == plan_exchange(24, 128, 8192, 4, costs)[0].exchange
    assert not d.validated and "my calibration" in d.calibration


def test_fewer_heads_than_ranks_is_serial_with_the_reason():
    d = choose_exchange(2, 64, 1024, 4, path="host", dtype="fp16")
    assert d.choice == "serial" and d.predicted_ns == () and "owns no head" in d.note


def test_the_schedule_is_the_planners_fastest_under_the_given_pacing():
    paced = resolve_pacing("default", "host", 2)
    d = choose_schedule(CFG, "host", CTAS, paced)
    rows = plan_moe(CFG, load_default_profile("host").params, load_default_costs("moe"), CTAS, pacing=paced,
                    interference=load_default_interference("host"))
    assert d.choice == rows[0].schedule
    assert d.predicted_ns == tuple((r.schedule, r.rank_ns) for r in rows)
    assert [ns for _, ns in d.predicted_ns] == sorted(ns for _, ns in d.predicted_ns)
    assert d.validated and d.kind == "schedule"


def test_the_joint_pacing_ranks_every_schedule_under_every_candidate_pacing():
    d = choose_pacing(CFG, "host", CTAS, None)
    pacings = {s: resolve_pacing(s, "host", 2) for s in PACING_CANDIDATES}
    rows = plan_moe(CFG, moe_path_params("host"), load_default_costs("moe"), CTAS, pacings=pacings,
                    interference=load_default_interference("host"))
    assert d.choice == rows[0].pacing in PACING_CANDIDATES
    assert d.predicted_ns == tuple((r.variant, r.rank_ns) for r in rows)
    fixed = choose_pacing(CFG, "host", CTAS, "lag:2")
    assert {name for name, _ in fixed.predicted_ns} == set(PACING_CANDIDATES)


def test_one_rank_has_nothing_to_pace():
    d = choose_pacing(MoeConfig.parse("H1152-I4608-E8-K2", tokens_per_rank=256, ep=1), "hbm", CTAS, None)
    assert d.choice == "off" and d.predicted_ns == () and "one rank" in d.note


def test_a_users_profile_drives_the_choice_and_is_named():
    mine = load_default_profile("host")
    slow = dataclasses.replace(mine, params=dataclasses.replace(mine.params, drain=mine.params.drain / 50))
    d = choose_schedule(CFG, "host", CTAS, None, profile=slow)
    rows = plan_moe(CFG, slow.params, load_default_costs("moe"), CTAS, interference=load_default_interference("host"))
    assert d.choice == rows[0].schedule and not d.validated and d.calibration.startswith("given profile")
    assert dict(d.predicted_ns) != dict(choose_schedule(CFG, "host", CTAS, None).predicted_ns)


def test_every_decision_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="xstage.decisions"):
        d = choose_exchange(24, 128, 8192, 4, path="host", dtype="bf16")
    assert [r.getMessage() for r in caplog.records if r.name == "xstage.decisions"] == [str(d)]


@pytest.mark.parametrize("call", [
    lambda: choose_exchange(24, 128, 8192, 4, path="nvlink", dtype="bf16"),
    lambda: choose_schedule(CFG, "pcie", CTAS, None),
    lambda: choose_pacing(CFG, "host", CTAS, None, costs="costs.json"),
    lambda: choose_schedule(CFG, "host", CTAS, None, profile={"drain": 1e9}),
])
def test_bad_arguments_get_one_line(call):
    with pytest.raises(InputError) as err:
        call()
    assert "\n" not in str(err.value)


def test_a_decision_prints_its_choice_its_grounds_and_its_best_alternatives():
    d = Decision("schedule", "lag:2", (("lag:2", 1e6), ("lag:4", 1.1e6), ("interleaved", 1.2e6), ("x", 2e6)),
                 "peer", "fp8", "embedded H200 peer path, embedded H200 tile costs", False)
    assert str(d) == ("schedule lag:2 [peer, fp8; embedded H200 peer path, embedded H200 tile costs, not validated "
                      "on this path]: lag:2 1000.0 us, lag:4 1100.0 us, interleaved 1200.0 us (+1 more)")
