"""Decisions of `model_guided` and `pacing="auto"`: made once per token bucket, visible, forceable, and
defined for calls of 0 and 1 tokens (kernels in Triton's interpreter, fp16, tiny shapes)."""

import pytest
import torch

import xstage.moe.decision as decision_mod
import xstage.sched.policy as policy
from xstage.errors import InputError
from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer, Variant, fused_moe, transform_weights
from xstage.moe.decision import MoEDecision, token_bucket, token_buckets
from xstage.moe.device_plan import device_plan
from xstage.moe.fused import plan
from xstage.moe.reference import loopback_inputs, reference_moe_virtual
from xstage.sched.moe import MoeConfig, routes_rows
from xstage.sched.pacing import resolve_pacing
from xstage.sched.policy import pick_for_moe_buffer, pick_pacing_for_buffer

CFG = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
H, I = 64, 32
TOL = dict(rtol=2e-2, atol=2e-2)  # fp16


def _buffer(t_max=16, E=4, K=2, R=2, path="host", **kw) -> MoEBuffer:
    return MoEBuffer(t_max, E, K, H, I, LoopbackGroup(R, path=path), device="cpu", dtype=torch.float16, config=CFG,
                     **kw)


def _problem(T, E, K, R, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).half()
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.int64)
    w = torch.rand(T, K, generator=gen)
    l1 = (torch.randn(E // R, 2 * I, H, generator=gen) / H**0.5).half()
    l2 = (torch.randn(E // R, H, I, generator=gen) / I**0.5).half()
    return x, idx, w, l1, l2


def _reference(x, idx, w, l1, l2, R):
    return reference_moe_virtual(*loopback_inputs(x.double(), idx, w.double(), l1.double(), l2.double(), R),
                                 dtype=torch.float64)[0]


@pytest.fixture
def calls(monkeypatch):
    """Every question put to the planner's policy, as (what, tokens, schedule or pacing asked with): the
    two policy functions the MoE decisions call are wrapped, their answers unchanged."""
    seen = []

    def schedule(cfg, path, ctas, pacing, **kw):
        seen.append(("schedule", cfg.tokens_per_rank, pacing))
        return policy.choose_schedule(cfg, path, ctas, pacing, **kw)

    def pacing(cfg, path, ctas, order, **kw):
        seen.append(("pacing", cfg.tokens_per_rank, order))
        return policy.choose_pacing(cfg, path, ctas, order, **kw)

    monkeypatch.setattr(decision_mod, "choose_schedule", schedule)
    monkeypatch.setattr(decision_mod, "choose_pacing", pacing)
    return seen


def _bucket_by_definition(tokens: int, t_max: int) -> tuple[int, int]:
    """The buckets written out: the smallest power of two holding the count, capped at t_max."""
    hi = 1
    while hi < tokens:
        hi *= 2
    hi = min(hi, t_max)
    lo = 0 if hi == 1 else next(p for p in (2**i for i in range(64)) if p >= hi) // 2 + 1
    return lo, hi


@pytest.mark.parametrize("t_max", [1, 2, 3, 12, 16, 1000])
def test_token_buckets_hold_every_count_once(t_max):
    buckets = token_buckets(t_max)
    assert buckets[0][0] == 0 and buckets[-1][1] == t_max
    assert all(b[0] == a[1] + 1 for a, b in zip(buckets, buckets[1:]))  # contiguous, no overlap
    for t in range(t_max + 1):
        assert token_bucket(t, t_max) == _bucket_by_definition(t, t_max), t
    assert token_buckets(12) == [(0, 1), (2, 2), (3, 4), (5, 8), (9, 12)]


@pytest.mark.parametrize("tokens", [-1, 17, 2.5, "3", True, None])
def test_a_count_outside_the_buffer_has_no_bucket(tokens):
    with pytest.raises(InputError, match=r"^tokens=") as err:
        token_bucket(tokens, 16)
    assert "\n" not in str(err.value)


def test_the_planner_runs_once_per_bucket_and_decides_as_asked_directly(calls):
    buf = _buffer()
    _, idx, *_ = _problem(16, 4, 2, 2, seed=1)
    plans = [plan(idx[:n], buf, "model_guided", pacing="auto") for n in (3, 4, 3, 4)]
    assert calls == [("pacing", 4, None), ("schedule", 4, plans[0].pacing)]  # once, at the bucket's largest count
    (d,) = buf.decisions()
    assert isinstance(d, MoEDecision) and d.bucket == (3, 4) and d.source == "planned"
    assert d.request == Variant("model_guided", "auto") and d.ctas == 1
    assert {p.schedule.name for p in plans} == {d.schedule} and all(p.pacing == d.pacing for p in plans)
    # The decision at the bucket's largest count is the planner's answer for that count, asked directly.
    want_pacing = resolve_pacing(pick_pacing_for_buffer(buf, 4, 1, None), "host", 2)
    assert d.pacing == want_pacing and d.schedule == pick_for_moe_buffer(buf, 4, 1, want_pacing)
    calls.clear()

    plan(idx[:5], buf, "model_guided", pacing="auto")  # another bucket: asked again, at its own count
    plan(idx[:8], buf, "model_guided", pacing="auto")
    assert calls == [("pacing", 8, None), ("schedule", 8, buf.decisions()[1].pacing)]
    first, second = buf.decisions()
    assert (first.bucket, second.bucket) == ((3, 4), (5, 8)) and first is not second
    calls.clear()

    # The order the joint decision ran with under its pacing is the one a call naming that pacing runs.
    plan(idx[:3], buf, "model_guided", pacing=d.pacing)
    assert calls == []
    plan(idx[:3], buf, "interleaved", pacing="auto")  # a fixed order: only the pacing is planned
    plan(idx[:4], buf, "interleaved", pacing="auto")
    assert calls == [("pacing", 4, "interleaved")]
    calls.clear()
    plan(idx[:4], buf, "model_guided", pacing="off")  # a named pacing: only the schedule is planned
    assert calls == [("schedule", 4, None)]


def test_device_plans_share_the_host_plans_decisions(calls):
    buf = _buffer(t_max=12)
    _, idx, *_ = _problem(12, 4, 2, 2, seed=2)
    device_plan(idx[:10], buf, "model_guided", pacing="auto")
    plan(idx[:9], buf, "model_guided", pacing="auto")  # the same bucket, 9..12
    assert [c[:2] for c in calls] == [("pacing", 12), ("schedule", 12)]
    assert [d.bucket for d in buf.decisions()] == [(9, 12)]


def test_fused_calls_in_one_bucket_share_a_decision_and_match_the_reference(calls):
    E, K, R = 4, 2, 2
    buf = _buffer(E=E, K=K, R=R)
    x, idx, w, l1, l2 = _problem(16, E, K, R, seed=3)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    for n in (5, 7):
        y = fused_moe(x[:n], idx[:n], w[:n], w1t, w2, buf, schedule="model_guided")  # the buffer's "auto"
        torch.testing.assert_close(y.double(), _reference(x[:n], idx[:n], w[:n], l1, l2, R), **TOL)
    assert [c[:2] for c in calls] == [("pacing", 8), ("schedule", 8)]
    assert [d.bucket for d in buf.decisions()] == [(5, 8)]


def test_a_forced_decision_wins_over_planning_and_is_visible(calls):
    E, K, R = 4, 2, 2
    buf = _buffer(E=E, K=K, R=R)
    x, idx, w, l1, l2 = _problem(16, E, K, R, seed=4)
    plan(idx[:12], buf, "model_guided", pacing="auto")  # planned before it is forced: made again
    assert buf.force_decision((3, 8), "lag:2@off") == [(3, 4), (5, 8)]
    assert buf.force_decision(12, Variant("expert_wave", "default")) == [(9, 16)]
    assert buf.forced_decisions() == {(3, 4): Variant("lag:2", "off"), (5, 8): Variant("lag:2", "off"),
                                      (9, 16): Variant("expert_wave", "default")}
    calls.clear()

    p = plan(idx[:3], buf, "model_guided", pacing="auto")
    assert (p.schedule.name, p.pacing) == ("lag:2", None) and calls == []
    p = plan(idx[:12], buf, "model_guided", pacing="auto")
    assert (p.schedule.name, p.pacing) == ("expert_wave", resolve_pacing("default", "host", R)) and calls == []
    # What a call names itself stays: a fixed order keeps its order, a named pacing its pacing.
    p = plan(idx[:6], buf, "interleaved", pacing="auto")
    assert (p.schedule.name, p.pacing) == ("interleaved", None)
    p = plan(idx[:6], buf, "model_guided", pacing="50:128")
    assert (p.schedule.name, p.pacing) == ("lag:2", resolve_pacing("50:128", "host", R)) and calls == []
    shown = [str(d) for d in buf.decisions()]
    assert "tokens 3..4, 1 CTA: model_guided@auto -> lag:2@off (forced)" in shown
    assert "tokens 5..8, 1 CTA: interleaved@auto -> interleaved@off (forced)" in shown
    assert all(d.source == "forced" for d in buf.decisions())

    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    y = fused_moe(x[:7], idx[:7], w[:7], w1t, w2, buf, schedule="model_guided")
    torch.testing.assert_close(y.double(), _reference(x[:7], idx[:7], w[:7], l1, l2, R), **TOL)
    assert calls == []

    plan(idx[:2], buf, "model_guided", pacing="auto")  # a bucket nobody forced is planned
    assert [c[:2] for c in calls] == [("pacing", 2), ("schedule", 2)]
    buf.clear_decisions()
    assert buf.decisions() == [] and buf.forced_decisions() == {}
    calls.clear()
    plan(idx[:3], buf, "model_guided", pacing="auto")
    assert [c[:2] for c in calls] == [("pacing", 4), ("schedule", 4)]


def test_forcing_one_part_leaves_the_other_to_the_planner(calls):
    buf = _buffer()
    _, idx, *_ = _problem(16, 4, 2, 2, seed=5)
    buf.force_decision(4, "model_guided@off")  # the pacing only
    buf.force_decision(8, "lag:1")  # the order only (no pacing: "auto" stays the planner's)
    p = plan(idx[:4], buf, "model_guided", pacing="auto")
    assert p.pacing is None and calls == [("schedule", 4, None)]
    assert p.schedule.name == pick_for_moe_buffer(buf, 4, 1, None)
    calls.clear()
    p = plan(idx[:8], buf, "model_guided", pacing="auto")
    assert p.schedule.name == "lag:1" and calls == [("pacing", 8, "lag:1")]
    assert p.pacing == resolve_pacing(pick_pacing_for_buffer(buf, 8, 1, "lag:1"), "host", 2)


def test_a_steady_device_plan_follows_forced_and_cleared_decisions(calls):
    # The device plan reuses what the first call at a token count resolved; forcing or clearing a
    # decision must reach the next call at that count, not the resolved order of before.
    buf = _buffer()
    _, idx, *_ = _problem(16, 4, 2, 2, seed=5)
    first = device_plan(idx[:8], buf, "model_guided", pacing="auto")
    assert device_plan(idx[:8], buf, "model_guided", pacing="auto").schedule == first.schedule
    asked = len(calls)
    assert device_plan(idx[:8], buf, "model_guided", pacing="auto") is not None and len(calls) == asked  # no re-ask
    forced = "lag:1" if first.schedule.name != "lag:1" else "expert_wave"
    buf.force_decision(8, f"{forced}@off")
    p = device_plan(idx[:8], buf, "model_guided", pacing="auto")
    assert p.schedule.name == forced and p.pacing is None
    buf.clear_decisions()
    p = device_plan(idx[:8], buf, "model_guided", pacing="auto")
    assert p.schedule.name == first.schedule.name and p.pacing == first.pacing


@pytest.mark.parametrize("tokens,variant,arg", [
    pytest.param(-1, "lag:2", "tokens", id="negative-count"),
    pytest.param(17, "lag:2", "tokens", id="count-over-capacity"),
    pytest.param(True, "lag:2", "tokens", id="bool-count"),
    pytest.param("4", "lag:2", "tokens", id="string-count"),
    pytest.param((3, 5), "lag:2", "tokens", id="range-ends-inside-a-bucket"),
    pytest.param((4, 8), "lag:2", "tokens", id="range-starts-inside-a-bucket"),
    pytest.param((8, 5), "lag:2", "tokens", id="range-reversed"),
    pytest.param((1, 2, 4), "lag:2", "tokens", id="three-items"),
    pytest.param((0, 17), "lag:2", "tokens", id="range-over-capacity"),
    pytest.param(4, "nope", "variant", id="unknown-order"),
    pytest.param(4, "lag:x", "variant", id="bad-lag"),
    pytest.param(4, "lag:2@", "variant", id="empty-pacing"),
    pytest.param(4, "lag:2@fast", "variant", id="bad-pacing"),
    pytest.param(4, "model_guided", "variant", id="forces-nothing"),
    pytest.param(4, "model_guided@auto", "variant", id="forces-nothing-auto"),
    pytest.param(4, 42, "variant", id="not-a-variant"),
    pytest.param(4, None, "variant", id="none"),
])
def test_bad_force_arguments_get_one_line(tokens, variant, arg):
    buf = _buffer()
    with pytest.raises(InputError) as err:
        buf.force_decision(tokens, variant)
    msg = str(err.value)
    assert msg.startswith(arg) and "\n" not in msg, msg
    assert buf.forced_decisions() == {}


def test_a_forced_order_must_fit_the_pool_in_its_buckets():
    unit = CFG.block_m * (H + I) * 2  # bytes of one pool unit at fp16
    buf = _buffer(t_max=256, pool_bytes=32 * unit)
    assert buf.pool_units == 32 and buf.units_cap > 32
    assert buf.force_decision((0, 4), "lag:40") == [(0, 1), (2, 2), (3, 4)]  # few units: the pool never binds
    with pytest.raises(InputError, match=r"^variant 'lag:40': needs 41 units of the row pool, which holds 32"):
        buf.force_decision(256, "lag:40")
    assert (129, 256) not in buf.forced_decisions()


@pytest.mark.parametrize("schedule", ["model_guided", "interleaved"])
def test_auto_decides_calls_of_zero_and_one_token(schedule):
    # E8-K1 at EP 2: the planner's synthetic routing routes no row to rank 0 at one token per rank,
    # where the planner refused before; the decision is defined: unpaced, the first candidate order.
    E, K, R = 8, 1, 2
    assert not routes_rows(MoeConfig(hidden=H, intermediate=I, num_experts=E, topk=K, tokens_per_rank=1, ep=R,
                                     block_m=16, block_n1=16, block_n2=32, block_k=32))
    buf = _buffer(t_max=8, E=E, K=K, R=R)
    x, idx, w, l1, l2 = _problem(1, E, K, R, seed=6)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    for T in (0, 1):
        buf.combine.fill_(float("nan"))
        buf.combine_host.fill_(float("nan"))
        y = fused_moe(x[:T], idx[:T], w[:T], w1t, w2, buf, schedule=schedule, pacing="auto")
        assert y.shape == (T, H)
        torch.testing.assert_close(y.double(), _reference(x[:T], idx[:T], w[:T], l1, l2, R), **TOL)
    (d,) = buf.decisions()
    assert d.bucket == (0, 1) and d.pacing is None and d.source == "planned"
    assert d.schedule == ("expert_wave" if schedule == "model_guided" else schedule)
