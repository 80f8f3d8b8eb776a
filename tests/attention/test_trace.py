"""The kernel trace (`flash_attention(..., trace=)`): same outputs, right row layout and chunk counts,
checked arguments; on a GPU, ordered timestamps and real SM ids. Also the trace experiment's
measurement function on a tiny configuration (interpreter)."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from xstage.attention.flash import (
    TRACE_CHUNKS,
    TRACE_END,
    TRACE_FIELDS,
    TRACE_LOOP_END,
    TRACE_SEND_NS,
    TRACE_SM,
    TRACE_START,
    FlashConfig,
    flash_attention,
    launch_grid,
    trace_buffer,
)
from xstage.attention.ulysses import fused_state, loopback_gather, wait_fused
from xstage.comm import create_context
from xstage.errors import InputError
from xstage.spec.ulysses import UlyssesPlan, split_sizes

ROOT = Path(__file__).resolve().parents[2]


def _rand(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


def _cfg(device, chunk_rows=0):
    # the CPU stands for 4 SMs: one program per "SM" takes several tiles
    if device == "cpu":
        return FlashConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, ctas_per_sm=1, use_tma=False,
                           chunk_rows=chunk_rows)
    return FlashConfig(chunk_rows=chunk_rows)


def _tiles_of(grid, per_prog, n_tiles):
    """[grid, per_prog] tile index of each trace row, -1 where the program has no such tile."""
    t = torch.arange(grid)[:, None] + grid * torch.arange(per_prog)[None, :]
    return torch.where(t < n_tiles, t, torch.full_like(t, -1))


def test_attention_trace_keeps_outputs_and_fills_every_tile_row(device):
    # 1 x 150 x 3 heads at 32-row tiles: 15 tiles over 4 programs (4, 4, 4, 3 tiles), a tail key block
    q, k, v = (_rand((1, 150, 3, 32), torch.float16, device, i) for i in range(3))
    cfg = _cfg(device)
    plain = flash_attention(q, k, v, config=cfg)
    trace = trace_buffer(q, cfg)
    grid, per_prog = launch_grid(q, cfg)
    assert trace.shape == (grid, per_prog + 1, TRACE_FIELDS) and trace.dtype == torch.int64
    trace.fill_(-1)  # flash_attention zeroes it
    traced = flash_attention(q, k, v, config=cfg, trace=trace)
    assert torch.equal(plain, traced)
    n_tiles = 3 * 5
    tiles = _tiles_of(grid, per_prog, n_tiles)
    rows = trace[:, :per_prog].cpu()
    has = tiles >= 0
    assert (rows >= 0).all()
    assert (rows[~has] == 0).all(), "a row without a tile was written"
    assert (rows[has][:, TRACE_CHUNKS] == 0).all() and (rows[has][:, TRACE_SEND_NS] == 0).all()
    assert (trace[:, per_prog].cpu() >= 0).all(), "the after-loop row was not written"
    assert (trace[:, per_prog, TRACE_CHUNKS] == 0).all()


def _fused_case(device, path="hbm"):
    # rank 0 of 2, 4 heads (2 local), 100 + 100 tokens: 7 query tiles per head, the last one 8 rows
    # long; 6 full key blocks and an 8-key tail
    world, rank, H, D = 2, 0, 4, 32
    plan = UlyssesPlan(world, rank, 1, split_sizes(200, world), H, D)
    local = [_rand((1, plan.seq_lens[rank], H, D), torch.float16, device, 20 + i) for i in range(3)]
    h0, h1 = plan.head0[rank], plan.head0[rank + 1]
    qg, kg, vg = (loopback_gather(plan, t)[:, :, h0:h1].contiguous() for t in local)
    ctx = create_context(path=path, loopback_world=world, rank=rank, device=device)
    return plan, ctx, (qg, kg, vg)


def _run_fused(state, ctx, qkv, cfg, trace=None):
    for t in state.out.peers:
        t.fill_(float("nan"))
    flash_attention(*qkv, config=cfg, route=state.route, out=state.own_output(), trace=trace)
    wait_fused(state, ctx)
    ctx.check()
    return [t.clone() for t in state.out.peers]


def _expected_in_loop_chunks(S, bm, n_blocks, chunk_rows, grid, n_tiles):
    """Chunks the paced exchange sends inside key loops, per program: every tile but a program's last
    goes out in its next tile's key loop, as many of its chunks as the loop has key blocks (the rest
    in that tile's epilogue); chunks starting past the sequence's end carry no rows. Also the chunks
    of each program's last tile (sent after its loop)."""
    n_m = -(-S // bm)
    n_chunks = bm // chunk_rows
    in_loop, after = [], []
    for pid in range(grid):
        tiles = list(range(pid, n_tiles, grid))
        rows = [(t % n_m) * bm for t in tiles]
        in_loop.append(sum(sum(1 for c in range(min(n_chunks, n_blocks)) if m0 + c * chunk_rows < S)
                           for m0 in rows[:-1]))
        after.append(sum(1 for c in range(n_chunks) if rows[-1] + c * chunk_rows < S))
    return in_loop, after


@pytest.mark.parametrize("paced,chunk_rows", [(True, 16), (True, 4), (False, 0)],
                         ids=["paced-in-loop", "paced-short-loop", "burst"])
def test_fused_trace_keeps_outputs_and_counts_chunks(paced, chunk_rows, device):
    if device != "cpu":
        pytest.skip("the chunk arithmetic below assumes the CPU's 32-row tiles and 4 programs")
    plan, ctx, qkv = _fused_case(device)
    cfg = _cfg(device, chunk_rows)
    state = fused_state(ctx, plan, torch.float16, cfg.block_m)
    state.route = dataclasses.replace(state.route, paced=paced)
    plain = _run_fused(state, ctx, qkv, cfg)
    h0, h1 = plan.head0[plan.rank], plan.head0[plan.rank + 1]
    assert not any(t[:, :s, h0:h1].isnan().any() for t, s in zip(plain, plan.seq_lens))
    trace = trace_buffer(qkv[0], cfg)
    traced = _run_fused(state, ctx, qkv, cfg, trace)
    for a, b in zip(plain, traced):  # rows and heads this rank does not send stay NaN in both
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    grid, per_prog = launch_grid(qkv[0], cfg)
    S, bm, h = plan.seq_total, cfg.block_m, plan.heads_of(plan.rank)
    n_tiles = h * -(-S // bm)
    assert (grid, per_prog) == (4, 4) and n_tiles == 14
    in_loop = trace[:, :per_prog, TRACE_CHUNKS].sum(1).tolist()
    after = trace[:, per_prog, TRACE_CHUNKS].tolist()
    if paced:
        want_in, want_after = _expected_in_loop_chunks(S, bm, S // cfg.block_n, chunk_rows, grid, n_tiles)
        assert in_loop == want_in and after == want_after
        assert sum(in_loop) > 0
    else:
        assert in_loop == [0] * grid and after == [0] * grid
    ctx.close()


def test_bad_trace_argument(device):
    q = _rand((1, 64, 2, 16), torch.float16, device, 0)
    cfg = _cfg(device)
    good = trace_buffer(q, cfg)
    for bad in (good.to(torch.int32), good[:, :-1], good[:-1], torch.zeros(2, 3), "trace",
                good.transpose(0, 1).contiguous().transpose(0, 1)):
        with pytest.raises(InputError, match=r"^trace: expected"):
            flash_attention(q, q, q, config=cfg, trace=bad)


@pytest.mark.gpu
def test_gpu_trace_timestamps_ordered_and_sm_ids():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    q, k, v = (_rand((1, 4096 + 77, 8, 128), torch.bfloat16, dev, i) for i in range(3))
    cfg = FlashConfig()
    launched: list = []
    plain = flash_attention(q, k, v, config=cfg, launched=launched)
    trace = trace_buffer(q, cfg)
    traced = flash_attention(q, k, v, config=cfg, trace=trace, launched=launched)
    torch.cuda.synchronize()
    assert torch.equal(plain, traced)
    # the untraced kernel reads no clock; the traced one does
    assert "%globaltimer" not in launched[0].asm["ptx"] and "%globaltimer" in launched[1].asm["ptx"]
    grid, per_prog = launch_grid(q, cfg)
    n_tiles = 8 * -(-q.shape[1] // cfg.block_m)
    has = _tiles_of(grid, per_prog, n_tiles) >= 0
    rows = trace[:, :per_prog].cpu()
    r = rows[has]
    assert (r[:, TRACE_START] > 0).all()
    assert (r[:, TRACE_START] <= r[:, TRACE_LOOP_END]).all() and (r[:, TRACE_LOOP_END] <= r[:, TRACE_END]).all()
    assert ((r[:, TRACE_SM] >= 0) & (r[:, TRACE_SM] < sms)).all()
    # a program's tiles follow one another, and the after-loop row comes last
    for pid in range(grid):
        n = int(has[pid].sum())
        starts, ends = rows[pid, :n, TRACE_START], rows[pid, :n, TRACE_END]
        assert (starts[1:] >= ends[:-1]).all()
        tail = trace[pid, per_prog].cpu()
        assert tail[TRACE_START] >= ends[-1] and tail[TRACE_START] <= tail[TRACE_LOOP_END] <= tail[TRACE_END]
        assert (rows[pid, :n, TRACE_SM] == tail[TRACE_SM]).all()


@pytest.mark.gpu
def test_gpu_fused_paced_trace_counts_sends():
    dev = torch.device("cuda")
    plan = UlyssesPlan(2, 0, 1, split_sizes(8192, 2), 8, 128)
    local = [_rand((1, plan.seq_lens[0], 8, 128), torch.bfloat16, dev, i) for i in range(3)]
    qkv = tuple(loopback_gather(plan, t)[:, :, :4].contiguous() for t in local)
    ctx = create_context(path="hbm", loopback_world=2, rank=0, device=dev)
    cfg = FlashConfig()
    state = fused_state(ctx, plan, torch.bfloat16, cfg.block_m)
    plain = _run_fused(state, ctx, qkv, cfg)
    trace = trace_buffer(qkv[0], cfg)
    traced = _run_fused(state, ctx, qkv, cfg, trace)
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(plain, traced))
    launched: list = []
    flash_attention(*qkv, config=cfg, route=state.route, out=state.own_output(), launched=launched)
    wait_fused(state, ctx)
    ptx = launched[0].asm["ptx"]
    assert "%globaltimer" not in ptx and "%clock" not in ptx, "the paced exchange must not read clocks"
    grid, per_prog = launch_grid(qkv[0], cfg)
    S = plan.seq_total
    n_tiles = 4 * -(-S // cfg.block_m)
    chunk_rows = 2048 // 128
    want_in, want_after = _expected_in_loop_chunks(S, cfg.block_m, S // cfg.block_n, chunk_rows, grid, n_tiles)
    t = trace.cpu()
    assert t[:, :per_prog, TRACE_CHUNKS].sum(1).tolist() == want_in
    assert t[:, per_prog, TRACE_CHUNKS].tolist() == want_after
    has = _tiles_of(grid, per_prog, n_tiles) >= 0
    r = t[:, :per_prog][has]
    assert (r[:, TRACE_SEND_NS] >= 0).all()
    assert (r[:, TRACE_SEND_NS] <= r[:, TRACE_LOOP_END] - r[:, TRACE_START]).all()
    ctx.close()


def _load_experiment():
    path = ROOT / "benchmarks" / "experiments" / "ulysses_trace.py"
    spec = importlib.util.spec_from_file_location("ulysses_trace_experiment", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_experiment_arguments_and_tiny_measurement(tmp_path, device):
    exp = _load_experiment()
    args = exp.parse_args(["--out", str(tmp_path), "--tokens", "32760", "--worlds", "2,8", "--shapes", "24x128"])
    assert args.tokens == [32760] and args.worlds == [2, 8] and args.shapes == [(24, 128)]
    with pytest.raises(SystemExit):
        exp.parse_args(["--out", str(tmp_path), "--shapes", "24-128"])
    # programs must take several tiles for chunks to go out inside key loops (132 SMs on an H200)
    cfg = {"tokens": 150, "P": 2, "heads": 4, "dim": 32} if device == "cpu" else \
        {"tokens": 8192, "P": 2, "heads": 8, "dim": 64}
    rows = exp.measure(cfg, device=torch.device(device), dtype=torch.float16, flash_cfg=_cfg(device, 16),
                       warmup=0, rep=1)
    assert [(r["variant"], r["path"]) for r in rows] == list(exp.VARIANTS)
    assert all(r["exchange_ok"] in (1, "") for r in rows)
    paced = [r for r in rows if r["variant"] == "stores:paced"]
    assert all(r["chunks_in_loop"] > 0 for r in paced)
    assert all(r["chunks_in_loop"] == 0 for r in rows if r["variant"] != "stores:paced")
    exp.write_outputs(rows, tmp_path, env={"gpu": "none", "torch": "x", "triton": "y", "git_commit": "c",
                                           "date": "d"})
    text = (tmp_path / "trace_summary.md").read_text()
    assert "stores:burst" in text and (tmp_path / "trace_summary.csv").read_text().count("\n") == len(rows) + 1
