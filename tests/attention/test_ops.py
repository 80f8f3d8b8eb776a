import pytest
import torch

from xstage.attention import register_comm, ulysses_attention
from xstage.comm import create_context
from xstage.errors import InputError


def _inputs(device):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(1, 24, 4, 16, generator=g).to(device=device, dtype=torch.float16) for _ in range(3)]


def test_custom_op_matches_the_function_and_compiles(device):
    ctx = create_context(path="hbm", loopback_world=2, rank=1, device=device)
    name = register_comm("test-ops-loopback", ctx)
    q, k, v = _inputs(device)
    want = ulysses_attention(q, k, v, comm=ctx)
    got = torch.ops.xstage.ulysses_attention(q, k, v, name)
    assert torch.equal(got, want)

    def layer(q, k, v):
        return torch.ops.xstage.ulysses_attention(q, k, v, name, None, "serial") * 2.0

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), 2.0 * want, atol=2e-3, rtol=2e-3)
    torch.library.opcheck(torch.ops.xstage.ulysses_attention.default, (q, k, v, name),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(InputError, match="group_name"):
        torch.ops.xstage.ulysses_attention(q, k, v, "no-such-group")
    with pytest.raises(InputError, match="^exchange 'bogus'"):
        torch.ops.xstage.ulysses_attention(q, k, v, name, None, "bogus")
    ctx.close()


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["auto", "stores:paced", "overlap:cudnn:3:waves", "overlap:triton:4:waves",
                                      "serial:cudnn"])
def test_cuda_graph_replays_each_exchange_on_a_loopback_group(exchange):
    # the host path's stand-in ranks unpack in stream order, so every mechanism can be captured
    from xstage.attention import ulysses_reference
    from xstage.attention.ulysses import loopback_index
    from xstage.spec.ulysses import UlyssesPlan

    world, rank, H, D, seq = 4, 3, 30, 128, [300, 300, 300, 300]
    ctx = create_context(path="host", loopback_world=world, rank=rank)
    plan = UlyssesPlan(world, rank, 1, seq, H, D)
    static = [torch.randn(1, 300, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = ulysses_attention(*static, comm=ctx, exchange=exchange)  # first call allocates, outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ulysses_attention(*static, comm=ctx, exchange=exchange)
    idx = loopback_index(plan, "cuda")
    for seed in range(3):
        torch.manual_seed(seed)
        for t in static:
            t.copy_(torch.randn_like(t))
        graph.replay()
        shards = [[t.index_select(1, idx[plan.tok0[p]:plan.tok0[p + 1]]) for p in range(world)] for t in static]
        ref = ulysses_reference(*shards, dtype=torch.float32)[rank]
        assert ((out.float() - ref).abs().max() / ref.abs().max()).item() <= 1e-2
    ctx.check()
    ctx.close()
