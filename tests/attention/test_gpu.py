"""bf16 on the GPU at DiT-like shapes (the interpreter cannot check bf16 tl.dot)."""

import pytest
import torch

from xstage.attention import attention_reference, flash_attention, ulysses_attention, ulysses_reference
from xstage.attention.layout import UlyssesPlan
from xstage.attention.ulysses import fused_state, loopback_index
from xstage.comm import create_context


def _rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,H,D", [pytest.param(2, 1000, 3, 128, id="B2-S1000-H3-D128"),
                                     pytest.param(1, 2309, 5, 64, id="B1-S2309-H5-D64")])
def test_bf16_flash(B, S, H, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    kv_lens = torch.tensor([S, S // 3][:B], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    flash_attention(q, k, v, out=out, kv_lens=kv_lens)
    ref = attention_reference(q, k, v, kv_lens=kv_lens, dtype=torch.float32)
    assert _rel_err(out, ref) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["host", "hbm"])
@pytest.mark.parametrize("exchange", ["stores", "stores:burst", "serial", "serial:cudnn", "overlap", "overlap:cudnn:3",
                                      "auto"])
def test_bf16_loopback_30_heads_on_4_ranks(path, exchange):
    world, rank, H, D, B = 4, 1, 30, 64, 1
    seq = [757, 757, 756, 756]
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, seq[rank], H, D, device="cuda", generator=g, dtype=torch.bfloat16)
               for _ in range(3))
    plan = UlyssesPlan(world, rank, B, seq, H, D)
    idx = loopback_index(plan, "cuda")
    shards = [[t.index_select(1, idx[plan.tok0[p]:plan.tok0[p + 1]]) for p in range(world)] for t in (q, k, v)]
    refs = ulysses_reference(*shards, dtype=torch.float32)
    ctx = create_context(path=path, loopback_world=world, rank=rank)
    buf = fused_state(ctx, plan, torch.bfloat16, 128).out
    for t in buf.peers:
        t.fill_(float("nan"))
    for _ in range(2):  # twice: the counters must reset themselves
        out = ulysses_attention(q, k, v, comm=ctx, exchange=exchange, seq_lens=seq)
        assert _rel_err(out, refs[rank].to("cuda")) <= 1e-2
    h0, h1 = plan.head0[rank], plan.head0[rank + 1]
    for p in range(world):
        if p == rank and exchange.split(":")[0] in ("serial", "overlap", "auto"):
            continue  # the copy-engine exchanges write the own rows straight into the returned output
        got = buf.peers[p][:, :seq[p], h0:h1].to("cuda")
        assert not got.isnan().any()
        assert _rel_err(got, refs[p][:, :, h0:h1].to("cuda")) <= 1e-2
    ctx.close()
