"""Several ranks in separate processes (gloo group, comm `peer` path) against `reference_moe_dist`.

On CPU the kernels run in the interpreter and the peers' buffers are shared-memory files; on one GPU
the ranks share cuda:0 through symmetric memory (timings there are meaningless, correctness is not).
"""

import pytest

from tests.moe.multirank import run_ranks


@pytest.mark.slow
def test_two_ranks_cpu_fp16(tmp_path):
    assert run_ranks(tmp_path, 2, (6, 4, 2, 64, 32), "fp16") == ["ok", "ok"]


@pytest.mark.slow
def test_two_ranks_cpu_fp16_device_plan(tmp_path):
    # The plan built on the device reads every peer's routing from its symmetric copy.
    assert run_ranks(tmp_path, 2, (6, 4, 2, 64, 32), "fp16", plan_on="device") == ["ok", "ok"]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("plan_on", ["host", "device"])
def test_ranks_share_one_gpu_bf16(tmp_path, world, plan_on):
    assert run_ranks(tmp_path, world, (40, 8, 2, 256, 128), "bf16", plan_on=plan_on) == ["ok"] * world


@pytest.mark.slow
def test_two_ranks_cpu_fp8(tmp_path):
    # e4m3 rows and their 1x128 scales cross to the experts' rank in the dispatch, BF16 rows come back
    assert run_ranks(tmp_path, 2, (6, 4, 2, 128, 128), "fp8") == ["ok", "ok"]


@pytest.mark.gpu
def test_ranks_share_one_gpu_fp8(tmp_path):
    assert run_ranks(tmp_path, 2, (40, 8, 2, 256, 128), "fp8") == ["ok", "ok"]
