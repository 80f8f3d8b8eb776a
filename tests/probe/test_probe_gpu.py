"""On a GPU: the kernel at full shape writes exactly its bytes with vector stores, its two timers
agree, and a flag that never comes raises the timeout error instead of hanging."""

import re
import time

import numpy as np
import pytest
import torch

from xstage.comm import STAGE_PROBE_FLAG, create_context, error_code
from xstage.comm.device import use_ptx
from xstage.errors import CommTimeoutError
from xstage.probe.kernels import wait_flags_kernel
from xstage.probe.runner import BurstConfig, dest_elems, launch

from .test_runner import run_and_check_bytes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", ["hbm", "host"])
@pytest.mark.parametrize("vector_bytes, vec_store", [(16, ".v4."), (8, ".v2."), (4, None)])
def test_full_shape_bytes_and_vector_ptx(path, vector_bytes, vec_store):
    cfg = BurstConfig(path=path, n_sm=16, warps=8, vector_bytes=vector_bytes, burst_bytes=64 * 1024, n_bursts=3,
                      gap_iters=100, completion="fence")
    raw = run_and_check_bytes(path, cfg)
    asm = raw.kernel.asm["ptx"]
    stores = set(re.findall(r"st\.global[.\w]*", asm))
    vectors = {s for s in stores if ".v2." in s or ".v4." in s}
    assert vectors == ({f"st.global{vec_store}b32"} if vec_store else set()), stores
    assert "fence.sc.sys" in asm and "%globaltimer" in asm and "%clock64" in asm


def test_timers_are_consistent():
    cfg = BurstConfig(path="host", n_sm=8, burst_bytes=256 * 1024, n_bursts=4, gap_iters=20000,
                      completion="fence")
    short = BurstConfig(path="host", n_sm=8, burst_bytes=256 * 1024, n_bursts=4, gap_iters=2000)
    with create_context(path="host", loopback_world=2) as ctx:
        dest = ctx.alloc("dst", (dest_elems(cfg, 2),), torch.int32)
        launch(ctx, dest, cfg)
        raw = launch(ctx, dest, cfg)
        raw_short = launch(ctx, dest, short)
    ratio = raw.ns_per_cycle()
    assert np.all((ratio > 0.4) & (ratio < 1.3)), ratio          # 1 / (0.77 .. 2.5 GHz)
    t = raw.times.astype(np.float64)
    assert np.all(np.diff(t[:, :, :4], axis=2) >= 0)             # gap <= start <= issued <= done
    assert np.all(np.diff(t[:, :, 1], axis=1) > 0)
    issue_clk = (t[:, :, 2] - t[:, :, 1]) * ratio[:, None]
    issue_gt = t[:, :, 5] - t[:, :, 4]
    assert np.allclose(issue_gt, issue_clk, rtol=0.05, atol=100.0)
    gap = np.median((t[:, 1:, 1] - t[:, 1:, 0]) * ratio[:, None])
    ts = raw_short.times.astype(np.float64)
    gap_short = np.median((ts[:, 1:, 1] - ts[:, 1:, 0]) * raw_short.ns_per_cycle()[:, None])
    assert 7.0 < gap / gap_short < 12.0
    skew = t[:, 0, 4].max() - t[:, 0, 4].min()
    assert skew < 2000.0, f"burst 0 starts {skew} ns apart"


def test_flag_that_never_comes_times_out():
    with create_context(path="hbm", loopback_world=2, timeout_ns=2_000_000) as ctx:
        slots = torch.tensor([5, 6], dtype=torch.int32, device=ctx.device)
        peers = torch.tensor([1, 1], dtype=torch.int32, device=ctx.device)
        ok = torch.full((2,), -1, dtype=torch.int32, device=ctx.device)
        t0 = time.monotonic()
        wait_flags_kernel[(2,)](ctx.signal_pad.local, slots, peers, ok, ctx.error, 3, ctx.timeout_ns,
                                STAGE=STAGE_PROBE_FLAG, WAIT=True, USE_PTX=use_ptx())
        torch.cuda.synchronize()
        assert time.monotonic() - t0 < 30.0
        assert ok.tolist() == [0, 0] and ctx.error[0].item() == error_code(STAGE_PROBE_FLAG, 1)
        with pytest.raises(CommTimeoutError, match="rank 0: wait for peer 1 timed out at stage probe.peer_flag"):
            ctx.check()


def test_irregular_trains_record_one_time_line_and_score(tmp_path):
    # Two families of the committed plan on the host path, at 16 SMs: rows with positive issue times,
    # each CTA's bursts in order without overlap, and every family scored.
    from xstage.model.profile import load_default_profile
    from xstage.model.trace import read_trace, score_trace
    from xstage.probe.session import measure_trains
    from xstage.probe.trains import TRACE_FILE

    with create_context(path="host", loopback_world=2) as ctx:
        import xstage.probe.session as session

        plan = session.plan_trains
        session.plan_trains = lambda path, sm: [t for t in plan(path, 16) if t.family in ("staggered", "big_small")]
        try:
            info = measure_trains(ctx, tmp_path, "host", 16, {"git_commit": "test"}, repeats=1, progress=False)
        finally:
            session.plan_trains = plan
    assert info["trains_run"] == 8
    trace = read_trace(tmp_path / TRACE_FILE)  # refuses overlapping bursts, missing CTAs, times <= 0
    s = score_trace(trace, load_default_profile("host").params).summary()
    assert set(s["families"]) == {"staggered", "big_small"} and s["bursts"]["n"] > 0
    stag = [la for la in trace.launches if la.family == "staggered"]
    assert all(max(float(st[0]) for st in la.start_ns) > 5_000 for la in stag)  # the start delays show
