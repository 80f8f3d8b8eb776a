"""`fused_moe(check=...)`: expert ids out of range are memory-safe in every path and add nothing to the
output; the errors the device records (ids out of range, timed-out waits, a peer's refusal) are raised
by a later call or by `buf.check()` under `check="async"` (the default), before the launch or right
after the kernels under `check=True`, and only at `buf.check()` under `check=False`; each names its call
and is raised once.

The reference is the plain-torch layer (`xstage.moe.reference`) on the same inputs with the ids out of
range dropped (their weight set to zero). Multi-rank cases spawn gloo ranks (`tests/moe/robustness.py`);
the `gpu` cases need the H200 (loopback, and ranks sharing one GPU).
"""


import pytest
import torch

from tests.moe.hopper import assert_compiles_for_hopper
from tests.moe.robustness import run
from xstage.errors import CommTimeoutError, InputError, XstageError
from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer, fused_moe, transform_weights
from xstage.moe import buffer as moe_buffer
from xstage.moe.checks import check_mode
from xstage.moe.fp8 import quantize_weights, reference_moe_fp8
from xstage.moe.reference import loopback_inputs, reference_moe_virtual

CFG = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
FP8_CFG = BlockConfig(block_m=16, block_n1=128, block_n2=64, block_k=128, block_d=128, tma=False)
TOL = dict(rtol=2e-2, atol=2e-2)  # fp16 inputs against float64 math
E, K, R = 8, 2, 2


def _problem(T, H=64, I=32, seed=0, dtype=torch.float16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    l1 = (torch.randn(E // R, 2 * I, H, generator=g) / H**0.5).to(dtype)
    l2 = (torch.randn(E // R, H, I, generator=g) / I**0.5).to(dtype)
    return tuple(t.to(device) for t in (x, idx, w, l1, l2))


def _with_bad_ids(idx):
    """`idx` with ids out of range at (1, 0), (3, 1) and (4, 0), in that flat order: 77 is the first."""
    bad = idx.clone()
    bad[1, 0], bad[3, 1], bad[4, 0] = 77, -5, E
    return bad


def _dropped(idx, w):
    """The inputs the reference takes for `idx` with ids out of range: those dropped (weight 0)."""
    ok = (idx >= 0) & (idx < E)
    return torch.where(ok, idx, 0), torch.where(ok, w, 0.0)


def _reference(x, idx, w, l1, l2):
    idx, w = _dropped(idx.cpu(), w.cpu())
    return reference_moe_virtual(*loopback_inputs(x.cpu().double(), idx, w.double(), l1.cpu().double(),
                                                  l2.cpu().double(), R), dtype=torch.float64)[0]


def _buffer(T=8, group=None, **kw):
    return MoEBuffer(T, E, K, 64, 32, group or LoopbackGroup(R), device="cpu", dtype=torch.float16, config=CFG, **kw)


@pytest.fixture
def problem():
    x, idx, w, l1, l2 = _problem(6, seed=1)
    return x, idx, w, *transform_weights(l1, l2, CFG.block_n1), l1, l2


@pytest.mark.parametrize("plan_on", ["host", "device"], ids=["host-plan", "device-plan"])
def test_async_bad_ids_leave_the_rest_right_and_raise_at_the_next_call_once(problem, plan_on):
    x, idx, w, w1t, w2, l1, l2 = problem
    buf = _buffer()
    kw = dict(schedule="lag:1", plan_on=plan_on)
    buf.combine.fill_(float("nan"))  # a bad id that read a combine row would poison its token
    y = fused_moe(x, _with_bad_ids(idx), w, w1t, w2, buf, **kw)  # call 1: no error yet
    torch.testing.assert_close(y.double(), _reference(x, _with_bad_ids(idx), w, l1, l2), **TOL)
    with pytest.raises(InputError, match=r"^topk_idx: value 77 out of range \[0, 8\) \(3 ids out of range; "
                                         r"fused_moe call 1\)$"):
        fused_moe(x, idx, w, w1t, w2, buf, **kw)  # call 2 raises call 1's error after its own kernels
    y3 = fused_moe(x, idx, w, w1t, w2, buf, **kw)  # raised once: call 3 and the check find nothing
    buf.check()
    torch.testing.assert_close(y3.double(), _reference(x, idx, w, l1, l2), **TOL)
    assert buf.calls == 3 and int(buf.bad_ids.abs().sum()) == 0 and int(buf.err.abs().sum()) == 0


def test_async_error_surfaces_at_buf_check_naming_its_call(problem):
    x, idx, w, w1t, w2, _, _ = problem
    buf = _buffer()
    fused_moe(x, idx, w, w1t, w2, buf)
    fused_moe(x, _with_bad_ids(idx), w, w1t, w2, buf)
    with pytest.raises(InputError, match=r"value 77 out of range \[0, 8\) \(3 ids out of range; fused_moe call 2\)"):
        buf.check()
    buf.check()  # once
    fused_moe(x, idx, w, w1t, w2, buf)
    buf.check()


def test_check_true_refuses_before_any_launch_in_todays_words(problem):
    x, idx, w, w1t, w2, _, _ = problem
    buf = _buffer()
    with pytest.raises(InputError) as exc:
        fused_moe(x, _with_bad_ids(idx), w, w1t, w2, buf, check=True)
    assert str(exc.value) == "topk_idx: value 77 out of range [0, 8)"
    assert int(buf.sync[1]) == 0 and int(buf.bad_ids[0]) == 0  # no kernel ran
    fused_moe(x, idx, w, w1t, w2, buf, check=True)
    assert int(buf.sync[1]) == 1


def test_check_false_records_and_raises_only_at_buf_check(problem):
    x, idx, w, w1t, w2, l1, l2 = problem
    buf = _buffer()
    y = fused_moe(x, _with_bad_ids(idx), w, w1t, w2, buf, check=False)
    torch.testing.assert_close(y.double(), _reference(x, _with_bad_ids(idx), w, l1, l2), **TOL)
    assert buf.bad_ids[:2].tolist() == [3, 77]  # the device's words: how many, and the first in (token, slot) order
    fused_moe(x, idx, w, w1t, w2, buf, check=False)
    fused_moe(x, _with_bad_ids(idx), w, w1t, w2, buf, check=False)
    assert buf.bad_ids[:2].tolist() == [6, 77]
    with pytest.raises(InputError, match=r"value 77 out of range \[0, 8\) \(6 ids out of range; fused_moe calls 1-3\)"):
        buf.check()
    buf.check()
    assert buf.bad_ids.tolist() == [0, 0, 0]


@pytest.mark.parametrize("code", [0, (34 << 16) | 2], ids=["no-timeout", "timeout"])
@pytest.mark.parametrize("words", [[1_992_095_959, -471_337_706_274_260_819], [1, 5], [-3, 99]],
                         ids=["huge-count", "bad-id-in-range", "negative-count"])
def test_bad_id_words_no_reduce_could_write_are_not_reported_as_ids(problem, code, words):
    # Words a reduce kernel cannot produce (a count above every id of the calls, a "bad" id inside
    # [0, E), a negative count) were written by something else: not passed on as an id and a count.
    # (Seen on the H200 when a peer process exited during a call; the peer's timeout is still named.)
    x, idx, w, w1t, w2, _, _ = problem
    buf = _buffer()
    fused_moe(x, idx, w, w1t, w2, buf, check=False)
    buf.err[:2] = torch.tensor([code, 3 if code else 0], dtype=torch.int32)
    buf.bad_ids[:2] = torch.tensor(words)
    kind, head = (CommTimeoutError, r"rank 0: wait for peer 2 timed out at stage \S+ \(.*") if code else (
        XstageError, r"rank 0: ")
    with pytest.raises(kind, match=head + rf"the bad-id words were overwritten \(count {words[0]}, at most "
                                         rf"{8 * K} possible\)") as exc:
        buf.check()
    assert "out of range" not in str(exc.value)
    buf.check()  # raised once


def test_a_synchronous_call_raises_an_earlier_asynchronous_calls_error(problem):
    x, idx, w, w1t, w2, _, _ = problem
    buf = _buffer()
    fused_moe(x, _with_bad_ids(idx), w, w1t, w2, buf)
    with pytest.raises(InputError, match=r"\(3 ids out of range; fused_moe call 1\)"):
        fused_moe(x, idx, w, w1t, w2, buf, check=True)
    fused_moe(x, idx, w, w1t, w2, buf, check=True)


def test_reports_outrun_by_the_host_are_read_in_order(problem, monkeypatch):
    # A ring of 2 rows, and calls that leave their reports unread (as a host running ahead of the GPU
    # does): the third call reads the first row before reusing it. The checks then raise the errors in
    # call order, each once.
    monkeypatch.setattr(moe_buffer, "REPORT_ROWS", 2)
    x, idx, w, w1t, w2, _, _ = problem
    buf = _buffer()
    monkeypatch.setattr(buf, "raise_reported", lambda: None)
    bad = _with_bad_ids(idx)
    fused_moe(x, bad, w, w1t, w2, buf)  # call 1: row 0
    fused_moe(x, bad.flip(0).contiguous(), w, w1t, w2, buf)  # call 2: row 1; its first id out of range is 8
    fused_moe(x, idx, w, w1t, w2, buf)  # call 3: row 0 again
    monkeypatch.undo()
    with pytest.raises(InputError, match=r"value 77 out of range .*fused_moe call 1\)$"):
        buf.check()
    with pytest.raises(InputError, match=r"value 8 out of range .*fused_moe call 2\)$"):
        buf.check()
    buf.check()
    fused_moe(x, idx, w, w1t, w2, buf)
    buf.check()


def test_fp8_bad_ids_are_memory_safe_and_reported():
    T, H, I = 7, 128, 128
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    l1, s1 = quantize_weights(torch.randn(E // R, 2 * I, H, generator=g) * H**-0.5)
    l2, s2 = quantize_weights(torch.randn(E // R, H, I, generator=g) * I**-0.5)
    w1t, w2 = transform_weights(l1, l2, FP8_CFG.block_n1, s1, s2)
    buf = MoEBuffer(8, E, K, H, I, LoopbackGroup(R, path="host"), device="cpu", dtype="fp8", config=FP8_CFG)
    bad = _with_bad_ids(idx)
    ref = reference_moe_fp8(x, *_dropped(bad, w), *(t.repeat(R, 1, 1) for t in (l1, s1, l2, s2))).double()
    for plan_on in ("host", "device"):
        buf.combine.fill_(float("nan"))
        y = fused_moe(x, bad, w, w1t, w2, buf, schedule="expert_wave", check=False, plan_on=plan_on)
        assert float((y.double() - ref).abs().max() / ref.abs().max()) <= 2e-2, plan_on
        with pytest.raises(InputError, match=rf"value 77 out of range \[0, 8\) \(3 ids out of range; fused_moe call "
                                             rf"{buf.calls}\)$"):
            buf.check()
        # the same bits as the call with those entries routed to expert 0 at weight 0
        assert torch.equal(y, fused_moe(x, *_dropped(bad, w), w1t, w2, buf, schedule="expert_wave", check=True,
                                        plan_on=plan_on)), plan_on


def test_async_timeout_of_a_silent_peer_is_raised_by_the_next_call():
    x, idx, w, l1, l2 = _problem(4, seed=2)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    buf = _buffer(group=LoopbackGroup(R, silent_ranks=(1,)))
    fused_moe(x, idx, w, w1t, w2, buf, schedule="interleaved")  # call 1 returns: its reduce waited in vain
    with pytest.raises(CommTimeoutError, match=r"^rank 0: wait for peer 1 timed out at stage moe\.reduce_waits_combine "
                                               r"\(stage id 34, path hbm, \d+ wait\(s\) timed out; "
                                               r"fused_moe call 1\)$"):
        fused_moe(x, idx, w, w1t, w2, buf, schedule="interleaved")
    with pytest.raises(CommTimeoutError, match=r"fused_moe call 2\)$"):  # call 2 timed out as well
        buf.check()
    buf.check()


@pytest.mark.parametrize("value,got", [("sync", "'sync'"), (1, "int"), (None, "NoneType"),
                                       ("async\n", repr("async\n")), (torch.tensor(True), "Tensor")])
def test_a_bad_check_value_is_one_input_error_line(problem, value, got):
    x, idx, w, w1t, w2, _, _ = problem
    buf = _buffer()
    with pytest.raises(InputError) as exc:
        fused_moe(x, idx, w, w1t, w2, buf, check=value)
    assert str(exc.value) == f"check: must be True, False or 'async', got {got}"
    assert check_mode("async") == "async" and check_mode(False) is False


# ---- real groups (gloo ranks on CPU) -------------------------------------------------------------------

GROUP_BLOCK = dict(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)


def _group_case(**kw):
    return dict(shape=(64, 32, 6, 2), tokens=12, routings=["uniform"], dtype="fp16", block=GROUP_BLOCK, **kw)


@pytest.mark.slow
def test_async_timeout_of_a_dead_rank_names_the_call_cpu(tmp_path):
    # The survivors' first call returns (its barrier and waits gave up after the 3 s watchdog); the
    # second raises the first one's CommTimeoutError, naming the dead rank and the call.
    case = _group_case(schedules=["lag:2", "lag:2"], die="before", buffer=dict(timeout_ns=3_000_000_000))
    recs, hung = run(tmp_path, 3, case, timeout_s=240)
    assert not hung, f"ranks {hung} were left running"
    for r in (0, 1):
        first, second = recs[r][0], recs[r][1]
        assert "error" not in first and first["seconds"] < 60, first
        assert second["error"].startswith(f"CommTimeoutError: rank {r}: wait for peer 2 timed out at stage "
                                          "comm.barrier"), second
        assert second["error"].endswith("; fused_moe call 1)") and second["seconds"] < 60, second


@pytest.mark.slow
def test_async_refusal_reaches_every_peer_and_the_group_goes_on_cpu(tmp_path):
    # Rank 1 refuses its first call (weights of the wrong dtype): it raises at once; its peers skip the
    # call (NaN output, no wait), raise the agreed refusal with their second call (which ran in full,
    # so rank 1's second call is right), and the third call is right everywhere.
    case = _group_case(schedules=["lag:2", "expert_wave", "lag:2"], bad_input_rank=1, bad_input="weights_dtype",
                       buffer=dict(timeout_ns=30_000_000_000))
    recs, hung = run(tmp_path, 3, case, timeout_s=240)
    assert not hung
    assert recs[1][0]["error"].startswith("InputError: rank 1: topk_weights: expected dtype"), recs[1][0]
    for r in (0, 2):
        assert "error" not in recs[r][0] and recs[r][0]["nan"] and recs[r][0]["seconds"] < 20, recs[r][0]
        assert recs[r][1]["error"] == ("InputError: rank 1 refused its topk_weights (its own error says why); every "
                                       "rank of the group stops this call (fused_moe call 1)"), recs[r][1]
    assert "error" not in recs[1][1] and recs[1][1]["rel_err"] < 2e-2, recs[1][1]
    for r in range(3):
        assert "error" not in recs[r][2] and recs[r][2]["rel_err"] < 2e-2, recs[r][2]


@pytest.mark.slow
def test_async_bad_id_on_a_real_group_is_raised_by_its_rank_only_cpu(tmp_path):
    case = _group_case(schedules=["lag:2", "expert_wave", "lag:2"], bad_input_rank=1,
                       buffer=dict(timeout_ns=30_000_000_000))
    recs, hung = run(tmp_path, 3, case, timeout_s=240)
    assert not hung
    assert "error" not in recs[1][0], recs[1][0]  # memory-safe: the call completes
    assert recs[1][1]["error"] == "InputError: rank 1: topk_idx: value 11 out of range [0, 6) (fused_moe call 1)"
    for r in (0, 2):  # the peers' outputs do not depend on rank 1's id out of range
        assert all("error" not in rec and rec["rel_err"] < 2e-2 for rec in recs[r][:3]), recs[r]
    assert "error" not in recs[1][2] and recs[1][2]["rel_err"] < 2e-2


@pytest.mark.slow
def test_an_order_that_cannot_fit_the_pool_is_refused_before_any_rank_waits_cpu(tmp_path):
    # 103 tokens per rank make 41 unit slots; a pool of 32 units cannot run lag:40 for every routing:
    # every rank refuses it before the barrier (no watchdog), and the group goes on.
    unit_bytes = GROUP_BLOCK["block_m"] * (64 + 32) * 2
    case = _group_case(schedules=["lag:40", "lag:2"], buffer_tokens=103,
                       buffer=dict(timeout_ns=30_000_000_000, pool_bytes=32 * unit_bytes))
    recs, hung = run(tmp_path, 3, case, timeout_s=240)
    assert not hung
    for r in range(3):
        first = recs[r][0]
        assert first["error"].startswith(f"PoolTooSmallError: rank {r}: schedule 'lag:40': needs more than the 32 "
                                         "units"), first
        assert first["seconds"] < 20, first
        assert "error" not in recs[r][1] and recs[r][1]["rel_err"] < 2e-2, recs[r][1]


# ---- the compiler the GPU runs -------------------------------------------------------------------------

_HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from xstage.comm.barrier import barrier_kernel, refuse_kernel
from xstage.moe.kernels import moe_main_kernel, moe_reduce_kernel

I64 = {"p_read_delta", "p_x_delta", "p_comb_delta", "p_sig_delta", "p_xs_delta", "p_pace", "p_bad", "p_report",
       "p_table", "timeout_ns", "max_spins", "pace_fs", "pace_budget_ns", "p_trace"}
F32 = {"p_w", "p_x_scale", "p_recv_scale", "p_w1_scale", "p_act_scale", "p_w2_scale"}
BF16 = {"p_comb", "p_y", "p_x", "p_recv", "d_recv", "p_w1", "d_w1", "p_act", "d_act", "p_w2", "d_w2"}


def sig(fn, consts):
    out = {}
    for n in fn.arg_names:
        if n in consts:
            out[n] = "constexpr"
        elif n.startswith(("p_", "d_")):
            out[n] = "*" + ("i64" if n in I64 else "fp32" if n in F32 else "bf16" if n in BF16 else "i32")
        else:
            out[n] = "i64" if n in I64 else "i32"
    return out


def build(fn, consts, warps):
    triton.compile(ASTSource(fn=fn, signature=sig(fn, consts), constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps))


build(moe_reduce_kernel, dict(STAGE_DONE=34, BT=8, BH=64, KP=8, WAIT=True, USE_PTX=True), 4)
for dynamic in (True, False):
    build(moe_main_kernel, dict(STAGE_L1=32, STAGE_L2=33, STAGE_FREE=35, STAGE_PACE=36, STAGE_SLOT=37, TASK_COLS=8,
                                BM=64, BN1=64, BN2=128, BK=64, BD=64, TMA=False, DYNAMIC=dynamic, PACED=False,
                                FP8=False, PAIR_STAGES=2, WAIT=True, USE_PTX=True, TRACE=False, DOT_PREC="tf32"), 4)
build(barrier_kernel, dict(STAGE=4, STAGE_REFUSE=5, USE_PTX=True), 1)
build(refuse_kernel, {}, 1)
print("compiled")
"""


@pytest.mark.slow
def test_the_changed_kernels_compile_for_hopper():
    assert_compiles_for_hopper(_HOPPER_COMPILE)


# ---- GPU ---------------------------------------------------------------------------------------------

GPU_CFG = BlockConfig(block_m=64, block_n1=64, block_n2=128, block_k=64, block_d=64, num_warps=4, num_stages=3)


def _gpu(T=256, H=512, I=256, seed=5):
    x, idx, w, l1, l2 = _problem(T, H, I, seed=seed, dtype=torch.bfloat16)
    buf = MoEBuffer(T, E, K, H, I, LoopbackGroup(R), device="cuda", dtype=torch.bfloat16, config=GPU_CFG)
    w1t, w2 = transform_weights(l1, l2, GPU_CFG.block_n1)
    return buf, x.cuda(), idx.cuda(), w.cuda(), w1t.cuda(), w2.cuda(), l1, l2


@pytest.mark.gpu
@pytest.mark.parametrize("plan_on", ["host", "device"])
def test_gpu_bad_ids_leave_the_context_usable_and_surface(plan_on):
    buf, x, idx, w, w1t, w2, l1, l2 = _gpu()
    bad = _with_bad_ids(idx)
    bad[100, 1], bad[200, 0] = 1 << 30, -(1 << 30)  # far outside any buffer
    y = fused_moe(x, bad, w, w1t, w2, buf, schedule="lag:1", plan_on=plan_on)
    torch.cuda.synchronize()  # an illegal address would be raised here, and stick to the context
    ref = _reference(x.float(), bad, w, l1.float(), l2.float()).float()
    scale = float(ref.abs().max())
    assert float((y.float().cpu() - ref).abs().max()) <= 2e-2 * scale
    assert float(torch.ones(4, device="cuda").sum()) == 4.0  # a later eager op
    raised = None
    try:
        y2 = fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", plan_on=plan_on)
    except InputError as exc:  # the report of call 1 had arrived
        raised = exc
    if raised is None:
        with pytest.raises(InputError) as exc:
            buf.check()
        raised = exc.value
    assert str(raised) == "topk_idx: value 77 out of range [0, 8) (5 ids out of range; fused_moe call 1)"
    y2 = fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", plan_on=plan_on)  # a later correct call
    buf.check()
    ref2 = _reference(x.float(), idx, w, l1.float(), l2.float()).float()
    assert float((y2.float().cpu() - ref2).abs().max()) <= 2e-2 * float(ref2.abs().max())


@pytest.mark.gpu
def test_gpu_async_call_with_the_device_plan_makes_no_host_sync():
    buf, x, idx, w, w1t, w2, _, _ = _gpu(seed=6)
    ref = fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", check=True)  # compiles, fixes the decisions
    fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", plan_on="device")
    buf.check()
    bad_idx = _with_bad_ids(idx)  # writing ids from Python synchronises: before the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        ys = [fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", plan_on="device") for _ in range(3)]
        bad = fused_moe(x, bad_idx, w, w1t, w2, buf, schedule="lag:1", plan_on="device")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(y, ref) for y in ys) and bad.shape == ref.shape
    with pytest.raises(InputError, match=r"fused_moe call 6\)$"):
        buf.check()


@pytest.mark.gpu
def test_gpu_captured_call_reports_nothing_and_its_replays_surface_at_check():
    buf, x, idx, w, w1t, w2, l1, l2 = _gpu(seed=7)
    for _ in range(2):  # compile and settle the per-call decisions outside the capture
        fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", plan_on="device")
    buf.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", plan_on="device")  # check="async"
    good = idx.clone()
    graph.replay()
    torch.cuda.synchronize()
    buf.check()  # the capture itself ran nothing
    idx.copy_(_with_bad_ids(good))
    graph.replay()
    torch.cuda.synchronize()
    ref = _reference(x.float(), idx, w, l1.float(), l2.float()).float()
    assert float((y.float().cpu() - ref).abs().max()) <= 2e-2 * float(ref.abs().max())
    with pytest.raises(InputError, match=r"value 77 out of range \[0, 8\) \(3 ids out of range; fused_moe call 3\)"):
        buf.check()
    idx.copy_(good)
    graph.replay()
    buf.check()


@pytest.mark.gpu
def test_gpu_dead_peer_sharing_the_gpu_surfaces_asynchronously(tmp_path):
    case = dict(shape=(256, 128, 6, 2), tokens=64, routings=["uniform"], dtype="bf16", schedules=["lag:2", "lag:2"],
                die="before", buffer=dict(timeout_ns=5_000_000_000), final_check=True)
    recs, hung = run(tmp_path, 3, case, timeout_s=300)
    assert not hung, f"ranks {hung} were left running"
    for r in (0, 1):
        assert "error" not in recs[r][0], recs[r][0]  # call 1 returns without waiting for its report
        errors = [rec["error"] for rec in recs[r][1:] if "error" in rec]
        assert errors and errors[0].startswith(f"CommTimeoutError: rank {r}: wait for peer 2 timed out"), recs[r]
        assert errors[0].endswith("; fused_moe call 1)"), recs[r]
        assert all(rec["seconds"] < 60 for rec in recs[r]), recs[r]


def test_the_reference_drops_exactly_the_ids_out_of_range():
    kept, w = _dropped(torch.tensor([[0, 77], [-5, 7], [8, 3]]), torch.ones(3, 2))
    assert kept.tolist() == [[0, 0], [0, 7], [0, 3]] and w.tolist() == [[1, 0], [0, 1], [0, 1]]
