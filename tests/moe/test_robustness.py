"""Any legal routing completes with the reference result, errors that every rank agrees on, no spurious
timeouts, dead ranks reported by name. The GPU cases are the H5120/I1408/E63/top-6 EP=3 runs with ranks
sharing one GPU:

    PYTHONPATH=src python3 -m pytest -q -m gpu tests/moe/test_robustness.py

The CPU cases run the same logic at interpreter sizes.
"""

import pytest

from tests.moe.robustness import run

GPU_SHAPE = (5120, 1408, 63, 6)
GPU_TOKENS = 3000
# fp8: against the FP8-emulating reference; in the interpreter its BF16 cast is not round-to-nearest
TOL = {"bf16": 2e-2, "fp16": 2e-2, "fp8": 2e-2}
FP8_CPU_BLOCK = dict(block_m=16, block_n1=128, block_n2=64, block_k=128, block_d=32, num_warps=4, num_stages=2,
                     tma=False)


def _case(shape, tokens, routings, dtype, **kw):
    return dict(shape=shape, tokens=tokens, routings=routings, schedules=kw.pop("schedules", ["expert_wave", "lag:2"]),
                dtype=dtype, **kw)


def _assert_correct(recs, world, dtype):
    for r in range(world):
        assert recs[r], f"rank {r} recorded nothing"
        for rec in recs[r]:
            assert "error" not in rec, f"rank {r}: {rec}"
            if "rel_err" in rec:
                assert rec["rel_err"] <= TOL[dtype] and not rec["nan"], f"rank {r}: {rec}"
            if "equal" in rec:
                assert rec["equal"], f"rank {r}: schedules differ bitwise ({rec})"


GPU_ROUTINGS = [
    pytest.param((5120, 1408, 63, 6), ["uniform", "skewed", "one_rank", "empty_rank"], id="E63-top6"),
    pytest.param((5120, 1408, 63, 1), ["top1", "one_expert"], id="E63-top1"),
]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("shape,routings", GPU_ROUTINGS)
def test_every_legal_routing_completes_on_one_gpu(tmp_path, shape, routings):
    recs, hung = run(tmp_path, 3, _case(shape, GPU_TOKENS, routings, "bf16"), timeout_s=900)
    assert not hung, f"ranks {hung} hung"
    _assert_correct(recs, 3, "bf16")


@pytest.mark.gpu
def test_experts_not_divisible_by_ranks_is_an_input_error_on_every_rank(tmp_path):
    recs, hung = run(tmp_path, 3, _case((5120, 1408, 64, 6), 64, ["uniform"], "bf16"), timeout_s=300)
    assert not hung
    for r in range(3):
        assert recs[r] and recs[r][0]["case"] == "buffer" and "InputError" in recs[r][0]["error"], recs[r]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("when", [
    "before",
    # Failed on the H200 with one survivor faulting (docs/failures.md). Suspected cause: the first survivor to
    # report exited while the other's kernels still used its memory; every rank now lingers until the
    # others are done (`robustness._linger`), which did not fix it: it still failed on an H100 at 7784d19
    # (benchmarks/results/h100-gpu-tests/). Strict: it fails the suite once it passes.
    pytest.param("during", marks=pytest.mark.xfail(strict=True, reason="a survivor faulted after timing out on a "
                                                                        "rank that stopped mid-call (open defect)")),
])
def test_a_dead_rank_is_named_within_60_s_on_one_gpu(tmp_path, when):
    # buf.check() after the call: the asynchronous check's error, read synchronously (the call that
    # raises it by itself is in tests/moe/test_async_check.py)
    recs, hung = run(tmp_path, 3, _case(GPU_SHAPE, 512, ["uniform"], "bf16", schedules=["lag:2"], die=when,
                                        sync_check=True), timeout_s=300)
    assert not hung, f"ranks {hung} were left running"
    for r in (0, 1):
        rec = recs[r][0]
        assert "error" in rec and "CommTimeoutError" in rec["error"] and "peer 2" in rec["error"], rec
        assert rec["seconds"] < 60, rec


CPU_BLOCK = dict(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)
CPU_ROUTINGS = [
    pytest.param((64, 32, 6, 2), ["uniform", "skewed", "one_rank", "empty_rank"], id="E6-top2"),
    pytest.param((64, 32, 6, 1), ["top1", "one_expert"], id="E6-top1"),
    pytest.param((64, 32, 6, 6), ["topk_all"], id="E6-top6-all"),
]


@pytest.mark.slow
@pytest.mark.parametrize("shape,routings", CPU_ROUTINGS)
def test_every_legal_routing_completes_cpu(tmp_path, shape, routings):
    case = _case(shape, 40, routings, "fp16", block=CPU_BLOCK)
    recs, hung = run(tmp_path, 3, case, timeout_s=600)
    assert not hung, f"ranks {hung} hung"
    _assert_correct(recs, 3, "fp16")


@pytest.mark.slow
@pytest.mark.parametrize("when,dtype", [("before", "fp16"), ("during", "fp16"), ("during", "fp8")])
def test_a_dead_rank_is_named_cpu(tmp_path, when, dtype):
    # A short watchdog: the survivors give up on the dead rank after 3 s without progress.
    shape, block = ((128, 128, 6, 2), FP8_CPU_BLOCK) if dtype == "fp8" else ((64, 32, 6, 2), CPU_BLOCK)
    case = _case(shape, 12, ["uniform"], dtype, schedules=["lag:2"], die=when, block=block,
                 buffer=dict(timeout_ns=3_000_000_000), sync_check=True)
    recs, hung = run(tmp_path, 3, case, timeout_s=240)
    assert not hung, f"ranks {hung} were left running"
    for r in (0, 1):
        rec = recs[r][0]
        assert "error" in rec and "peer 2" in rec["error"], rec
        assert "CommTimeoutError" in rec["error"], rec
        assert rec["seconds"] < 60, rec


@pytest.mark.slow
@pytest.mark.parametrize("shape,routings", [
    pytest.param((128, 128, 6, 2), ["one_rank", "empty_rank"], id="E6-top2-one-rank-empty-rank"),
    pytest.param((128, 128, 6, 6), ["topk_all"], id="E6-top6-all"),
])
def test_every_legal_routing_completes_cpu_fp8(tmp_path, shape, routings):
    # e4m3 rows and scales cross to the experts' ranks through the same row pool as BF16
    case = _case(shape, 24, routings, "fp8", block=FP8_CPU_BLOCK)
    recs, hung = run(tmp_path, 3, case, timeout_s=600)
    assert not hung, f"ranks {hung} hung"
    _assert_correct(recs, 3, "fp8")


def test_experts_not_divisible_by_ranks_is_an_input_error_on_every_rank_cpu(tmp_path):
    recs, hung = run(tmp_path, 3, _case((64, 32, 8, 2), 12, ["uniform"], "fp16", block=CPU_BLOCK), timeout_s=120)
    assert not hung
    for r in range(3):
        assert recs[r] and recs[r][0]["case"] == "buffer", recs[r]
        assert "InputError: num_experts=8: must be a multiple of the group size 3" in recs[r][0]["error"]


@pytest.mark.slow
def test_a_refused_input_stops_every_rank_with_the_same_error_cpu(tmp_path):
    # check=True: the range check runs on the host before the barrier, and the peers wait at a host
    # barrier (the asynchronous refusal is in tests/moe/test_async_check.py)
    case = _case((64, 32, 6, 2), 12, ["uniform"], "fp16", schedules=["lag:2", "expert_wave"], block=CPU_BLOCK,
                 bad_input_rank=1, buffer=dict(timeout_ns=30_000_000_000), check=True)
    recs, hung = run(tmp_path, 3, case, timeout_s=240)
    assert not hung
    first = [recs[r][0] for r in range(3)]
    assert "InputError: rank 1: topk_idx: value 11 out of range [0, 6)" in first[1]["error"], first[1]
    for r in (0, 2):
        assert "InputError: rank 1 refused its topk_idx" in first[r]["error"], first[r]
        assert first[r]["seconds"] < 20, first[r]  # at once, not after the 30 s watchdog
    for r in range(3):  # the group goes on with correct inputs
        second = recs[r][1]
        assert second["case"] == "uniform/expert_wave" and "error" not in second and second["rel_err"] < 2e-2


TORCHRUN_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from xstage.moe import BlockConfig, MoEBuffer, fused_moe, transform_weights
dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)
buf = MoEBuffer(8, 6, 2, 64, 32, dist.group.WORLD, device="cpu", dtype="fp16", config=cfg, timeout_ns=3_000_000_000)
g = torch.Generator().manual_seed(rank)
x = torch.randn(8, 64, generator=g).half()
idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(8)])
w1t, w2 = transform_weights((torch.randn(2, 64, 64) / 8).half(), (torch.randn(2, 64, 32) / 8).half(), 16)
if rank == 2:
    sys.exit(0)  # a clean exit: torchrun itself sees no failure of this rank
fused_moe(x, idx, torch.rand(8, 2), w1t, w2, buf, schedule="lag:1")
buf.check()  # the call's errors are checked asynchronously: read them before the rank ends
"""


@pytest.mark.slow
def test_under_torchrun_the_log_names_the_dead_rank_cpu(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--standalone",
                          str(script)], capture_output=True, text=True, timeout=300, env=env)
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    assert "CommTimeoutError" in log and "for peer 2 timed out" in log, log[-3000:]
