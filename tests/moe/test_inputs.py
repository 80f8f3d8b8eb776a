"""The MoE API refuses inputs the kernel cannot run, naming the field, before anything is launched."""

import numpy as np
import pytest
import torch

from xstage.errors import InputError
from xstage.moe.buffer import BlockConfig
from xstage.moe.problem import parse_block
from xstage.moe.reference import loopback_inputs, reference_moe_virtual
from xstage.moe.schedule import make_schedule


@pytest.mark.parametrize("field,value,match", [
    ("block_m", 24, "block_m=24.*power of two >= 16"),
    ("block_m", 8, "block_m=8.*>= 16"),
    ("block_n1", 0, "block_n1=0"),
    ("block_n2", 96, "block_n2=96"),
    ("block_k", -64, "block_k=-64"),
    ("block_k", 64.0, "block_k=64.0"),
    ("block_d", 48, "block_d=48"),
    ("num_warps", 3, "num_warps=3.*power of two"),
    ("num_warps", 64, "num_warps=64.*<= 32"),
    ("num_stages", 0, "num_stages=0.*>= 1"),
    ("ctas_per_sm", -1, "ctas_per_sm=-1.*>= 0"),
    ("ctas_per_sm", 1.5, "ctas_per_sm=1.5"),
    ("tma", "yes", "tma='yes'"),
    ("block_m", True, "block_m=True"),
])
def test_block_config_refuses_what_the_kernel_cannot_run(field, value, match):
    with pytest.raises(InputError, match=f"BlockConfig {match}"):
        BlockConfig(**{field: value})


def test_block_config_accepts_the_configs_in_use():
    BlockConfig()
    BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)
    BlockConfig(block_m=64, block_n1=128, block_n2=256, block_k=64, block_d=8, ctas_per_sm=2, tma=False)
    assert parse_block("64:128:256:64:4:3", 4096).block_m == 64
    with pytest.raises(InputError, match="block_m=100"):
        parse_block("100:128:256:64:4:3", 4096)


@pytest.mark.parametrize("kw,match", [
    (dict(unit_expert=[-1, 0]), r"unit_expert\[0\]=-1: must be an integer >= 0"),
    (dict(unit_expert=[0, 0.5]), r"unit_expert\[1\]=0.5"),
    (dict(unit_expert="01"), "unit_expert='01'"),
    (dict(num_ctas=2.5), "num_ctas=2.5: must be an integer"),
    (dict(num_ctas=0), "num_ctas=0"),
    (dict(num_ctas=True), "num_ctas=True"),
    (dict(n1=1.5), "n1=1.5"),
    (dict(n2=0), "n2=0"),
    (dict(unit_rows=[4, -1, 2]), r"unit_rows\[1\]=-1"),
    (dict(unit_rows=[4, 2]), "unit_rows: 2 entries for 3 units"),
    (dict(dispatch_lead=-1), "dispatch_lead=-1"),
])
def test_make_schedule_refuses_non_integer_or_negative_inputs(kw, match):
    args = dict(name="lag:1", unit_expert=[0, 0, 1], num_ctas=2, n1=2, n2=1)
    args.update(kw)
    with pytest.raises(InputError, match=match):
        make_schedule(**args)


def test_make_schedule_takes_numpy_and_tensor_integers():
    a = make_schedule("lag:1", [0, 0, 1], 2, 2, 1)
    b = make_schedule("lag:1", np.array([0, 0, 1]), np.int64(2), np.int32(2), 1)
    c = make_schedule("lag:1", torch.tensor([0, 0, 1]), 2, 2, 1)
    assert np.array_equal(a.tasks, b.tasks) and np.array_equal(a.tasks, c.tasks)


def _virtual(R=2, T=4, H=8, I=6, E=4, K=2):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=g) for _ in range(R)]
    idx = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) for _ in range(R)]
    ws = [torch.rand(T, K, generator=g) for _ in range(R)]
    l1 = [torch.randn(E // R, 2 * I, H, generator=g) for _ in range(R)]
    l2 = [torch.randn(E // R, H, I, generator=g) for _ in range(R)]
    return xs, idx, ws, l1, l2


@pytest.mark.parametrize("bad", [99, 4, -1])
def test_reference_refuses_expert_ids_outside_the_experts(bad):
    xs, idx, ws, l1, l2 = _virtual()
    assert len(reference_moe_virtual(xs, idx, ws, l1, l2)) == 2
    idx[1] = idx[1].clone()
    idx[1][2, 0] = bad
    with pytest.raises(InputError, match=rf"topk_idx\[1\]: expert id {bad} is outside \[0, 4\)"):
        reference_moe_virtual(xs, idx, ws, l1, l2)


def test_reference_refuses_malformed_topk_idx():
    xs, idx, ws, l1, l2 = _virtual()
    with pytest.raises(InputError, match=r"topk_idx\[0\]: must hold integer expert ids"):
        reference_moe_virtual(xs, [i.float() for i in idx], ws, l1, l2)
    with pytest.raises(InputError, match="topk_idx: 1 tensors for 2 ranks"):
        reference_moe_virtual(xs, idx[:1], ws, l1, l2)
    with pytest.raises(InputError, match=r"topk_idx: expert id 99 is outside \[0, 8\)"):
        loopback_inputs(xs[0], torch.tensor([[0, 99]]), ws[0][:1], l1[0], l2[0], num_ranks=4)
