"""The interference term in the kernel simulator, its calibration helpers and the MoE tasks' memory
shares. Expected values are worked out by hand from the term's definition: while the path's fabric
holds the onset, a task of memory share m computes at rate 1 / (1 + per_storer x k x m)."""

import dataclasses
import math

import pytest

from tests.sched.test_plan import COSTS, SLOW_PATH, SMALL
from xstage.calibrate.interference import (
    KEPT,
    SLOWED,
    STORE_PASS,
    busy_link_work,
    fit_interference,
    onset_from_bystanders,
    predict_slowdown,
)
from xstage.errors import InputError
from xstage.model import load_default_profile
from xstage.model.interference import Interference
from xstage.model.params import PathParams
from xstage.sched import KernelWork, Task, simulate_kernel
from xstage.sched.constants import planner_constants
from xstage.sched.costs import load_default_costs
from xstage.sched.moe import MoeConfig, mem_share, moe_work, remote_path
from xstage.spec.pacing import StorePacing
from xstage.spec.schedule import DISPATCH, KIND_NAMES, LINEAR1, LINEAR2

# An SM's share of HBM bandwidth when all stream, from the constants' data file (drain / SMs, per ns).
HBM_SHARE = planner_constants().hbm_drain / planner_constants().hbm_sms / 1e9

MIB = 1 << 20
WINDOW = 128 * 1024
# A slow shared drain: four CTAs storing 1 MiB bursts keep their bursts in flight for ~200 us each.
PATH = PathParams(r0=50e9, c_sm=WINDOW, drain=20e9, capacity=4 * MIB, t0=70.0, latency=1000.0)
PER_STORER = 0.25
# Three full windows: four storing CTAs reach it, two do not.
TERM = Interference(per_storer=PER_STORER, onset_bytes=3 * WINDOW, window_bytes=WINDOW)
REL = 1e-9


def storers_and_readers(storers: int, passes: int, readers, path: str = "host", dest: int = 1) -> KernelWork:
    """`storers` CTAs storing `passes` bursts of 1 MiB back to back, then one CTA per reader task list
    (name, compute_ns, mem_share)."""
    ctas = [[Task(f"s{c}.{j}", 0.0, stores={dest: MIB}) for j in range(passes)] for c in range(storers)]
    ctas += [[Task(name, c, mem_share=m) for name, c, m in tasks] for tasks in readers]
    return KernelWork(ctas=ctas, dest_path={dest: path})


def storer_ends(res, storers: int, passes: int) -> list[float]:
    return [res.task_end_ns[f"s{c}.{passes - 1}"] for c in range(storers)]


def assert_same(a, b, rel=REL):
    assert a.time_ns == pytest.approx(b.time_ns, rel=rel)
    assert a.task_end_ns.keys() == b.task_end_ns.keys()
    for name, t in a.task_end_ns.items():
        assert t == pytest.approx(b.task_end_ns[name], rel=rel, abs=1e-9), name


# ---- the term off: the simulator as before ----


def test_without_a_term_results_are_unchanged():
    work = moe_work(SMALL, "lag:1", COSTS, 4)
    assert any(t.mem_share > 0 for t in work.all_tasks())  # the shares would reach the clocks if the term were on
    assert any(t.store_bytes > 0 for t in work.all_tasks())
    paths = {"remote": SLOW_PATH}
    base = simulate_kernel(work, paths)
    assert_same(simulate_kernel(work, paths, interference=None), base, rel=0.0)
    assert_same(simulate_kernel(work, paths, interference={}), base, rel=0.0)
    # A term that is never reached plays the tasks on their clocks at rate 1: the same times.
    never = Interference(per_storer=10.0, onset_bytes=1e18, window_bytes=WINDOW)
    assert_same(simulate_kernel(work, paths, interference={"remote": never}), base)
    # A term on a path the work does not use changes nothing either.
    assert_same(simulate_kernel(work, paths, interference={"peer": TERM}), base, rel=0.0)
    # Nor does one that would slow no task: per_storer 0.
    free = Interference(per_storer=0.0, onset_bytes=0.0, window_bytes=WINDOW)
    assert_same(simulate_kernel(work, paths, interference={"remote": free}), base)


# ---- analytic cases ----

READERS = [
    [("r.half", 10_000.0, 0.5)],
    [("r.full", 20_000.0, 1.0)],
    [("r.third", 7_000.0, 0.3)],
    [("r.none", 5_000.0, 0.0)],
    [("r.seq.a", 4_000.0, 0.8), ("r.seq.b", 6_000.0, 0.8)],  # one CTA, two tasks on one clock
    [("r.pre", 5_000.0, 0.0), ("r.mid", 10_000.0, 0.6)],  # a new share's clock starts while the storers store
]


def test_readers_slow_down_by_storers_times_share_while_above_onset():
    k, passes = 4, 3
    res = simulate_kernel(storers_and_readers(k, passes, READERS), {"host": PATH}, interference={"host": TERM})
    # The storers keep the fabric above the onset for longer than any reader computes.
    assert min(storer_ends(res, k, passes)) > 100_000.0
    assert k * WINDOW >= TERM.onset_bytes
    end = res.task_end_ns
    assert end["r.half"] == pytest.approx(10_000.0 * (1 + 0.25 * 4 * 0.5), rel=1e-6)  # 15 us
    assert end["r.full"] == pytest.approx(20_000.0 * (1 + 0.25 * 4 * 1.0), rel=1e-6)  # 40 us
    assert end["r.third"] == pytest.approx(7_000.0 * (1 + 0.25 * 4 * 0.3), rel=1e-6)  # 9.1 us
    assert end["r.none"] == pytest.approx(5_000.0, rel=1e-12)  # no memory share: never slowed
    assert end["r.seq.a"] == pytest.approx(4_000.0 * 1.8, rel=1e-6)
    assert end["r.seq.b"] == pytest.approx(10_000.0 * 1.8, rel=1e-6)
    assert end["r.pre"] == pytest.approx(5_000.0, rel=1e-12)
    assert end["r.mid"] == pytest.approx(5_000.0 + 10_000.0 * (1 + 0.25 * 4 * 0.6), rel=1e-6)
    # The compute segments of slowed tasks span their stretched time.
    comp = {s.task: (s.start_ns, s.end_ns) for s in res.segments if s.kind == "compute"}
    assert comp["r.full"][0] == 0.0 and comp["r.full"][1] == pytest.approx(40_000.0, rel=1e-6)
    assert comp["r.seq.b"][0] == pytest.approx(7_200.0, rel=1e-6)


def test_storers_are_not_slowed_by_the_term():
    k, passes = 4, 2
    alone = simulate_kernel(storers_and_readers(k, passes, []), {"host": PATH})
    res = simulate_kernel(storers_and_readers(k, passes, READERS), {"host": PATH}, interference={"host": TERM})
    assert storer_ends(res, k, passes) == pytest.approx(storer_ends(alone, k, passes), rel=REL)


@pytest.mark.parametrize("k", [pytest.param(1, id="k1"), pytest.param(2, id="k2")])
def test_readers_keep_their_speed_below_the_onset(k):
    assert k * WINDOW < TERM.onset_bytes
    res = simulate_kernel(storers_and_readers(k, 3, READERS), {"host": PATH}, interference={"host": TERM})
    for tasks in READERS:
        total = 0.0
        for name, c, _ in tasks:
            total += c
            assert res.task_end_ns[name] == pytest.approx(total, rel=1e-12), name


def test_small_bursts_count_their_own_bytes_not_the_window():
    # Four storers of 64 KiB bursts hold 256 KiB < onset (384 KiB) although 4 windows would reach it.
    ctas = [[Task(f"s{c}.{j}", 0.0, stores={1: 64 * 1024}) for j in range(40)] for c in range(4)]
    ctas.append([Task("r", 10_000.0, mem_share=1.0)])
    res = simulate_kernel(KernelWork(ctas=ctas, dest_path={1: "host"}), {"host": PATH}, interference={"host": TERM})
    assert min(res.task_end_ns[f"s{c}.39"] for c in range(4)) > 10_000.0
    assert res.task_end_ns["r"] == pytest.approx(10_000.0, rel=1e-12)
    # Six such storers hold 384 KiB: the onset, reached.
    ctas = [[Task(f"s{c}.{j}", 0.0, stores={1: 64 * 1024}) for j in range(40)] for c in range(6)]
    ctas.append([Task("r", 10_000.0, mem_share=1.0)])
    res = simulate_kernel(KernelWork(ctas=ctas, dest_path={1: "host"}), {"host": PATH}, interference={"host": TERM})
    assert min(res.task_end_ns[f"s{c}.39"] for c in range(6)) > 10_000.0 * (1 + 0.25 * 6)
    assert res.task_end_ns["r"] == pytest.approx(10_000.0 * (1 + 0.25 * 6 * 1.0), rel=1e-6)


def test_a_pacer_keeps_the_fabric_below_onset_and_the_readers_at_speed():
    pacing = StorePacing(rate=20e9, budget=256 * 1024)  # bursts leave one at a time at the link's drain
    assert 2 * WINDOW < TERM.onset_bytes <= 4 * WINDOW
    work = storers_and_readers(4, 3, READERS)
    res = simulate_kernel(work, {"host": PATH}, interference={"host": TERM}, pacers={"host": pacing})
    assert min(storer_ends(res, 4, 3)) > 100_000.0
    for tasks in READERS:
        total = 0.0
        for name, c, _ in tasks:
            total += c
            assert res.task_end_ns[name] == pytest.approx(total, rel=1e-12), name
    # The same work unpaced is slowed: the pacer, not the work, keeps the readers at speed.
    unpaced = simulate_kernel(work, {"host": PATH}, interference={"host": TERM})
    assert unpaced.task_end_ns["r.full"] == pytest.approx(40_000.0, rel=1e-6)


@pytest.mark.parametrize("passes", [pytest.param(1, id="one-burst"), pytest.param(2, id="two-bursts")])
def test_slowdown_stops_when_the_storers_stop(passes):
    k, m = 4, 1.0
    sigma = 1 + PER_STORER * k * m  # 2.0
    alone = simulate_kernel(storers_and_readers(k, passes, []), {"host": PATH})
    ends = storer_ends(alone, k, passes)
    # Symmetric storers: all stop storing at the same time, so k stays 4 until the fabric empties.
    assert max(ends) == pytest.approx(min(ends), rel=1e-12)
    t_s = max(ends)
    long_c = t_s / sigma + 30_000.0  # still computing when the storers stop
    short_c = 0.5 * t_s / sigma  # done while they store
    readers = [[("r.long", long_c, m)], [("r.short", short_c, m)], [("r.after", 0.9 * t_s, m), ("r.next", 5_000.0, m)]]
    res = simulate_kernel(storers_and_readers(k, passes, readers), {"host": PATH}, interference={"host": TERM})
    assert storer_ends(res, k, passes) == pytest.approx(ends, rel=REL)
    assert res.task_end_ns["r.long"] == pytest.approx(t_s + (long_c - t_s / sigma), rel=1e-6)
    assert res.task_end_ns["r.short"] == pytest.approx(short_c * sigma, rel=1e-6)
    # A task that straddles T_s on the same clock, then one that runs entirely after it at full speed.
    after_end = t_s + (0.9 * t_s - t_s / sigma)
    assert res.task_end_ns["r.after"] == pytest.approx(after_end, rel=1e-6)
    assert res.task_end_ns["r.next"] == pytest.approx(after_end + 5_000.0, rel=1e-6)


def test_a_task_that_starts_after_the_storers_is_not_slowed():
    alone = simulate_kernel(storers_and_readers(4, 1, []), {"host": PATH})
    t_s = max(storer_ends(alone, 4, 1))
    ctas = [[Task(f"s{c}.0", 0.0, stores={1: MIB})] for c in range(4)]
    ctas.append([Task("late", 10_000.0, deps=("s0.0", "s1.0", "s2.0", "s3.0"), mem_share=1.0)])
    res = simulate_kernel(KernelWork(ctas=ctas, dest_path={1: "host"}), {"host": PATH}, interference={"host": TERM})
    assert res.task_end_ns["late"] == pytest.approx(t_s + 10_000.0, rel=1e-9)


def test_terms_of_two_paths_add_up():
    other = Interference(per_storer=0.1, onset_bytes=2 * WINDOW, window_bytes=WINDOW)
    ctas = [[Task(f"a{c}.{j}", 0.0, stores={1: MIB}) for j in range(2)] for c in range(4)]
    ctas += [[Task(f"b{c}.{j}", 0.0, stores={2: MIB}) for j in range(2)] for c in range(3)]
    ctas.append([Task("r", 10_000.0, mem_share=0.5)])
    work = KernelWork(ctas=ctas, dest_path={1: "host", 2: "peer"})
    paths = {"host": PATH, "peer": PATH}
    both = simulate_kernel(work, paths, interference={"host": TERM, "peer": other})
    assert both.task_end_ns["r"] == pytest.approx(10_000.0 * (1 + 0.25 * 4 * 0.5 + 0.1 * 3 * 0.5), rel=1e-6)
    host_only = simulate_kernel(work, paths, interference={"host": TERM})
    assert host_only.task_end_ns["r"] == pytest.approx(10_000.0 * (1 + 0.25 * 4 * 0.5), rel=1e-6)


# ---- engines and inputs ----


def test_fast_and_reference_engines_agree_with_the_term_on():
    cfg = MoeConfig.parse("H1024-I512-E8-K2", tokens_per_rank=512, ep=2, block_m=64, block_n1=64, block_n2=128)
    work = moe_work(cfg, "lag:1", load_default_costs("moe"), 8)
    host = load_default_profile("host").params
    paths = {"remote": remote_path(host)}
    # The LINEAR2 tiles store 8 KiB each: an onset of one tile's bytes is reached whenever a tile stores.
    term = Interference(per_storer=0.5, onset_bytes=8000.0, window_bytes=host.c_sm)
    fast = simulate_kernel(work, paths, interference={"remote": term}, engine="fast")
    ref = simulate_kernel(work, paths, interference={"remote": term}, engine="reference")
    assert_same(fast, ref)
    off = simulate_kernel(work, paths)
    # The term is active: it moves task ends.
    assert max(abs(fast.task_end_ns[n] / off.task_end_ns[n] - 1) for n in off.task_end_ns) > 1e-3


@pytest.mark.parametrize("bad", [
    pytest.param(1.0, id="float"),
    pytest.param({"per_storer": 0.1, "onset_bytes": 1.0, "window_bytes": 1.0}, id="dict"),
    pytest.param(None, id="none"),
])
def test_a_term_that_is_not_an_interference_is_an_input_error(bad):
    work = storers_and_readers(1, 1, [[("r", 1.0, 0.5)]])
    with pytest.raises(InputError, match="interference"):
        simulate_kernel(work, {"host": PATH}, interference={"host": bad})


@pytest.mark.parametrize("bad", [
    pytest.param(-0.1, id="negative"),
    pytest.param(1.5, id="above-1"),
    pytest.param(math.nan, id="nan"),
    pytest.param(math.inf, id="inf"),
])
def test_task_mem_share_outside_0_1_is_an_input_error(bad):
    with pytest.raises(InputError, match="mem_share"):
        Task("t", 1.0, mem_share=bad)


def test_task_mem_share_bounds_are_valid():
    assert Task("t", 1.0).mem_share == 0.0
    assert Task("t", 1.0, mem_share=0.0).mem_share == 0.0
    assert Task("t", 1.0, mem_share=1.0).mem_share == 1.0


# ---- calibration helpers ----

W = 150e3


def bystander_rows(pairs):
    return [{"storing_ctas": str(k), "slowdown": str(s)} for k, s in pairs]


@pytest.mark.parametrize("pairs, k_lo, k_hi", [
    pytest.param([(0, 1.0), (4, 1.01), (8, 1.05), (16, 2.1), (32, 3.0)], 8, 16, id="8-16"),
    pytest.param([(0, 1.0), (2, 1.0), (4, 1.3), (6, 1.4), (12, 1.6), (24, 1.5)], 2, 12, id="gap-2-12"),
    pytest.param([(1, KEPT), (3, SLOWED)], 1, 3, id="thresholds-inclusive"),
    pytest.param([(32, 4.0), (16, 1.6), (8, 1.0), (4, 1.0)], 8, 16, id="unsorted"),
])
def test_onset_from_bystanders(pairs, k_lo, k_hi):
    onset, lo, hi = onset_from_bystanders(bystander_rows(pairs), W)
    assert (lo, hi) == (k_lo, k_hi)
    assert onset == pytest.approx(math.sqrt(k_lo * k_hi) * W, rel=1e-12)


@pytest.mark.parametrize("pairs", [
    pytest.param([(0, 1.0), (4, 1.6), (8, 2.0)], id="none-kept"),
    pytest.param([(0, 1.0), (4, 1.0), (8, 1.2)], id="none-slowed"),
    pytest.param([(0, 1.0)], id="only-zero-storers"),
    pytest.param([(4, 1.6), (8, 1.0)], id="kept-above-slowed"),
    pytest.param([(8, 1.0), (8, 2.0)], id="kept-equals-slowed"),
    pytest.param([], id="empty"),
])
def test_onset_from_bystanders_rejects_rows_without_an_onset(pairs):
    with pytest.raises(InputError, match="bystander"):
        onset_from_bystanders(bystander_rows(pairs), W)


BUSY_SHAPE = "H1152-I4608-E8-K2"


def test_busy_link_work_keeps_storers_and_moe_apart():
    costs = load_default_costs("moe")
    num_sms, k, passes = 12, 3, 4
    work = busy_link_work(BUSY_SHAPE, 128, k, costs, num_sms, passes=passes)
    cfg = MoeConfig.parse(BUSY_SHAPE, tokens_per_rank=128, ep=1, block_n2=128)
    moe = moe_work(cfg, "expert_wave", costs, num_ctas=num_sms - k)
    assert len(work.ctas) == num_sms
    assert [t.name for t in work.queue] == [t.name for t in moe.queue]
    assert [t.compute_ns for t in work.queue] == [t.compute_ns for t in moe.queue]
    assert [t.mem_share for t in work.queue] == [t.mem_share for t in moe.queue]
    assert all(t.store_bytes == 0 for t in work.queue)  # EP=1: the kernel stores nothing remote
    assert all(not cta for cta in work.ctas[: num_sms - k])
    for cta in work.ctas[num_sms - k:]:
        assert len(cta) == passes + 1
        assert all(t.name.startswith("store.") for t in cta)
        assert all(t.mem_share == 0.0 and t.compute_ns == 0.0 for t in cta)
        assert [t.stores for t in cta[:-1]] == [{1: STORE_PASS}] * passes
    res = simulate_kernel(work, {"store": PATH})
    # Storer CTAs only ever run store tasks; every MoE task runs on a MoE CTA.
    storer_idx = set(range(num_sms - k, num_sms))
    for s in res.segments:
        assert (s.cta in storer_idx) == s.task.startswith("store."), s
    assert set(res.task_end_ns) == {t.name for t in work.all_tasks()}
    idle = busy_link_work(BUSY_SHAPE, 128, k, costs, num_sms, passes=passes, busy=False)
    assert all(len(cta) == 1 and cta[0].name.endswith(".end") for cta in idle.ctas[num_sms - k:])


def test_busy_link_work_scale_and_input_errors():
    costs = load_default_costs("moe")
    plain = busy_link_work(BUSY_SHAPE, 128, 2, costs, 8, passes=1)
    scaled = busy_link_work(BUSY_SHAPE, 128, 2, costs, 8, passes=1, scale=2.5)
    assert [t.compute_ns for t in scaled.queue] == pytest.approx([2.5 * t.compute_ns for t in plain.queue], rel=1e-12)
    assert [t.mem_share for t in scaled.queue] == [t.mem_share for t in plain.queue]
    # The storers' own tasks are not scaled.
    assert all(t.compute_ns == 0.0 for cta in scaled.ctas for t in cta)
    for k in (0, 8, 9):
        with pytest.raises(InputError, match="storing_ctas"):
            busy_link_work(BUSY_SHAPE, 128, k, costs, 8)


def _stretched_reference(row, store_path, per_storer, costs, num_sms):
    """The predicted slowdown worked out without the term: the storers keep the fabric above the onset
    throughout, so every MoE task's compute is its scaled time x (1 + per_storer x k x its share)."""
    shape, tokens, k, idle = row["shape"], row["tokens"], row["storing_ctas"], row["idle_ns"]
    alone = busy_link_work(shape, tokens, k, costs, num_sms, busy=False)
    scale = idle / simulate_kernel(alone, {"store": store_path}).time_ns
    base = busy_link_work(shape, tokens, k, costs, num_sms, busy=False, scale=scale)
    queue = [dataclasses.replace(t, compute_ns=t.compute_ns * (1 + per_storer * k * t.mem_share)) for t in base.queue]
    stretched = KernelWork(ctas=base.ctas, dest_path=base.dest_path, queue=queue)
    return simulate_kernel(stretched, {"store": store_path}).time_ns / idle


@pytest.mark.parametrize("per_storer", [pytest.param(0.0, id="ps0"), pytest.param(0.1, id="ps0.1"),
                                        pytest.param(0.3, id="ps0.3")])
def test_predict_slowdown_matches_a_pre_stretched_kernel(per_storer):
    costs = load_default_costs("moe")
    host = load_default_profile("host").params
    row = {"shape": BUSY_SHAPE, "tokens": 128, "storing_ctas": 3, "idle_ns": 50_000.0}
    term = Interference(per_storer, 2 * host.c_sm, host.c_sm)  # 3 storers' windows hold the onset
    got = predict_slowdown(row, host, term, costs, 12)
    assert got == pytest.approx(_stretched_reference(row, host, per_storer, costs, 12), rel=1e-9)
    if per_storer == 0.0:
        assert got == pytest.approx(1.0, rel=1e-9)  # the scaled kernel alone reproduces idle_ns
    else:
        assert got > 1.0


def test_fit_interference_recovers_a_synthetic_per_storer():
    costs = load_default_costs("moe")
    host = load_default_profile("host").params
    num_sms, k = 8, 2
    bystanders = bystander_rows([(0, 1.0), (1, 1.02), (2, 1.7)])  # onset sqrt(2) windows: 2 storers hold it
    onset = math.sqrt(2) * host.c_sm
    row = {"shape": BUSY_SHAPE, "tokens": 64, "storing_ctas": k, "idle_ns": 40_000.0}
    truth = 0.37
    measured = predict_slowdown(row, host, Interference(truth, onset, host.c_sm), costs, num_sms)
    check = dict(row, shape="H512-I256-E8-K2", busy_ns=55_000.0)  # not a calibration shape: only checked
    term, out = fit_interference(bystanders, [dict(row, busy_ns=measured * 40_000.0), check], host, costs,
                                 num_sms=num_sms, shapes=(BUSY_SHAPE,), provenance={"gpu": "test"})
    assert term.per_storer == pytest.approx(truth, abs=2e-4)
    assert term.onset_bytes == pytest.approx(onset, rel=1e-12)
    assert term.window_bytes == host.c_sm
    assert term.provenance == {"gpu": "test", "onset_storers": [1, 2]}
    assert [r["role"] for r in out] == ["calibration", "check"]
    assert out[0]["measured"] == pytest.approx(measured, abs=1e-3)
    assert abs(out[0]["rel_err"]) < 1e-3
    assert out[1]["measured"] == pytest.approx(55_000.0 / 40_000.0, abs=1e-3)
    with pytest.raises(InputError, match="calibration shapes"):
        fit_interference(bystanders, [check], host, costs, num_sms=num_sms, shapes=(BUSY_SHAPE,))


# ---- the MoE tasks' memory shares ----


def test_mem_share_formula():
    per_ns = HBM_SHARE
    assert mem_share(0.0, 1000.0) == 0.0
    assert mem_share(per_ns * 250.0, 1000.0) == pytest.approx(0.25, rel=1e-12)
    assert mem_share(per_ns * 1000.0, 1000.0) == pytest.approx(1.0, rel=1e-12)
    assert mem_share(per_ns * 5000.0, 1000.0) == 1.0  # capped
    assert mem_share(1e6, 0.0) == 0.0
    assert per_ns == pytest.approx(4.56e12 / 132 / 1e9, rel=1e-12)


@pytest.mark.parametrize("shape, tokens, ep", [
    pytest.param("H4096-I2048-E256-K6", 1024, 1, id="H4096-I2048-E256-K6-T1024-EP1"),
    pytest.param("H1152-I4608-E8-K2", 96, 1, id="H1152-I4608-E8-K2-T96-EP1"),
    pytest.param("H1024-I512-E8-K2", 512, 2, id="H1024-I512-E8-K2-T512-EP2"),
    pytest.param("H512-I256-E16-K2", 33, 4, id="H512-I256-E16-K2-T33-EP4"),
])
def test_moe_work_mem_shares_are_in_0_1_and_follow_tile_bytes(shape, tokens, ep):
    costs = load_default_costs("moe")
    blocks = {"block_m": 64, "block_n1": 64, "block_n2": 128} if shape.startswith("H512") else {}
    cfg = MoeConfig.parse(shape, tokens_per_rank=tokens, ep=ep, **blocks)
    work = moe_work(cfg, "expert_wave", costs, 16)
    rows_per_expert = cfg.tokens_per_rank * cfg.topk * cfg.ep / cfg.num_experts
    by_kind = {KIND_NAMES[k]: k for k in (DISPATCH, LINEAR1, LINEAR2)}
    for t in work.all_tasks():
        assert 0.0 <= t.mem_share <= 1.0, t
        # every operand byte the task loads, written out here independently of the code under test
        e, h, i = cfg.elem_bytes, cfg.hidden, cfg.intermediate
        loaded = {DISPATCH: min(cfg.block_m, rows_per_expert) * h * e,
                  LINEAR1: (cfg.block_m + 2 * cfg.block_n1) * h * e,
                  LINEAR2: (cfg.block_m + min(cfg.block_n2, h)) * i * e}[by_kind[t.kind]]
        want = min(1.0, loaded / (HBM_SHARE * t.compute_ns))
        assert t.mem_share == pytest.approx(want, abs=5e-4 + 1e-12), t.name


def test_gemm_tiles_count_their_loads_from_l2_too():
    costs = load_default_costs("moe")

    def gemm_shares(tokens, ep):
        cfg = MoeConfig.parse("H4096-I2048-E256-K6", tokens_per_rank=tokens, ep=ep)
        work = moe_work(cfg, "expert_wave", costs, 132)
        shares = {t.mem_share for t in work.all_tasks() if t.kind in ("linear1", "linear2")}
        assert shares
        return shares

    # 24 rows per expert (weights streamed from HBM) and 1536 (weights shared through L2): a tile loads
    # 1.5-3 MiB of operands in 30-70 us either way, more than its time at an SM's HBM share
    assert min(gemm_shares(1024, 1)) == 1.0 and min(gemm_shares(8192, 8)) == 1.0
