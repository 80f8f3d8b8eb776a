import re

import pytest
import torch

from xstage.attention import FlashConfig, attention_reference, flash_attention
from xstage.errors import InputError

TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


def _rand(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize(
    "B,S,S_k,H,D",
    [
        pytest.param(1, 100, 77, 3, 64, id="B1-S100-Sk77-H3-D64"),
        pytest.param(2, 70, 70, 2, 32, id="B2-S70-H2-D32"),
        pytest.param(1, 33, 130, 1, 128, id="B1-S33-Sk130-H1-D128"),
    ],
)
def test_matches_reference(B, S, S_k, H, D, dtype, device):
    q = _rand((B, S, H, D), dtype, device, 1)
    k = _rand((B, S_k, H, D), dtype, device, 2)
    v = _rand((B, S_k, H, D), dtype, device, 3)
    out = _poisoned((B, S, H, D), dtype, device)
    flash_attention(q, k, v, out=out)
    ref = attention_reference(q, k, v)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("ctas_per_sm", [0, 1], ids=["per-tile", "persistent"])
def test_kv_lens_scale_and_paths(use_tma, ctas_per_sm, device):
    B, S, H, D = 3, 50, 2, 32
    q, k, v = (_rand((B, S, H, D), torch.float16, device, i) for i in range(3))
    # padding beyond a batch's key length must not matter, even when it is NaN
    kv_lens = torch.tensor([50, 17, 1], dtype=torch.int32, device=device)
    for b in range(B):
        k[b, kv_lens[b]:] = float("nan")
        v[b, kv_lens[b]:] = float("nan")
    cfg = FlashConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, ctas_per_sm=ctas_per_sm, use_tma=use_tma)
    out = flash_attention(q, k, v, kv_lens=kv_lens, softmax_scale=0.3, config=cfg)
    ref = attention_reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), kv_lens=kv_lens, softmax_scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def test_strided_inputs(device):
    # sequence-major storage [S, B, H, D] viewed as [B, S, H, D], and a head slice of a wider tensor
    S, B, H, D = 40, 2, 6, 32
    base = _rand((S, 3, B, H, D), torch.float16, device, 7)
    q, k, v = (base[:, i].transpose(0, 1)[:, :, 1:4] for i in range(3))
    assert not q.is_contiguous()
    for use_tma in (False, True):
        cfg = FlashConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, ctas_per_sm=0, use_tma=use_tma)
        out = torch.empty(S, B, 3, D, dtype=torch.float16, device=device).transpose(0, 1)
        flash_attention(q, k, v, out=out, config=cfg)
        torch.testing.assert_close(out.double(), attention_reference(q, k, v), atol=2e-3, rtol=2e-3)


def test_bad_inputs(device):
    q = torch.zeros(1, 8, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(InputError, match="head dim"):
        flash_attention(q[..., :24], q[..., :24], q[..., :24])
    with pytest.raises(InputError, match="dtypes must match"):
        flash_attention(q, q.float(), q)
    with pytest.raises(InputError, match="k, v"):
        flash_attention(q, q[:, :, :1], q[:, :, :1])
    with pytest.raises(InputError, match="kv_lens"):
        flash_attention(q, q, q, kv_lens=torch.tensor([1, 2], dtype=torch.int32))
    for bad in (-1.0, "a", float("nan"), float("inf"), 0, False, [1.0]):
        with pytest.raises(InputError, match=r"^softmax_scale: must be a finite positive number or None, got "):
            flash_attention(q, q, q, softmax_scale=bad)
    with pytest.raises(InputError, match="^k: key length must be at least 1"):
        flash_attention(q, q[:, :0], q[:, :0])
    with pytest.raises(InputError, match="unit stride"):
        flash_attention(q.transpose(2, 3), q.transpose(2, 3), q.transpose(2, 3))


@pytest.mark.parametrize("field,value,match", [
    ("block_m", 24, "config.block_m=24: must be a power of two in 16..1024"),
    ("block_n", 8, "config.block_n=8: must be a power of two in 16..1024"),
    ("num_warps", 3, "config.num_warps=3: must be a power of two in 1..32"),
    ("num_stages", 0, "config.num_stages=0: must be in 1..16"),
    ("ctas_per_sm", -1, "config.ctas_per_sm=-1: must be in 0..32"),
    ("chunk_rows", 12, "config.chunk_rows=12: must be a power of two"),
    # past what Triton compiles or a GPU runs: refused here, not in a compile that takes the machine's memory
    ("block_m", 2**40, "config.block_m=1099511627776: must be a power of two in 16..1024"),
    ("block_n", 2048, "config.block_n=2048: must be a power of two in 16..1024"),
    ("num_warps", 64, "config.num_warps=64: must be a power of two in 1..32"),
    ("num_stages", 10**6, "config.num_stages=1000000: must be in 1..16"),
    ("ctas_per_sm", 2**63, "config.ctas_per_sm=9223372036854775808: must be in 0..32"),
    ("chunk_rows", 2**20, "config.chunk_rows=1048576: must be a power of two in 0..1024"),
    ("block_m", 32.0, "config.block_m=32.0: must be an integer"),
    ("use_tma", "yes", "config.use_tma='yes': must be None, True or False"),
    ("use_tma", torch.tensor([1, 2]), "config.use_tma=tensor([1, 2]): must be None, True or False"),  # a RuntimeError
])
def test_config_is_checked_when_made(field, value, match):
    with pytest.raises(InputError, match="^" + re.escape(match)):
        FlashConfig(**{field: value})


def test_a_core_csv_config_past_the_bounds_names_its_line(tmp_path):
    from xstage.bench.ulysses import read_core

    from ..corrupt import CORE_CSV, committed, with_value, write

    path = write(tmp_path / "core.csv", with_value(committed(CORE_CSV, 3), "block_m", "4096", row=2))
    with pytest.raises(InputError, match=r"core.csv, line 3: config.block_m=4096: must be a power of two in 16..1024"):
        read_core(path)


def test_out_and_kv_lens_that_are_not_tensors_are_named():
    """Found by tests/test_fuzz_api.py: True raised an AttributeError, a meta tensor a NotImplementedError."""
    q = torch.randn(1, 16, 1, 16).half()
    for kw, match in ((dict(out=True), r"^out: must be a tensor like q or None, got bool$"),
                      (dict(kv_lens=True), r"^kv_lens: must be an int32 tensor of shape \[1\] or None, got bool$"),
                      (dict(kv_lens=torch.tensor([16], dtype=torch.int32, device="meta")),
                       r"^kv_lens: expected an int32 tensor of shape \[1\] holding data, got torch.int32 \(1,\) "
                       r"on meta")):
        with pytest.raises(InputError, match=match):
            flash_attention(q, q, q, **kw)
