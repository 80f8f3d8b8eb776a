import dataclasses

import pytest
import torch

from xstage.attention import UlyssesAttention, ulysses_attention, ulysses_reference
from xstage.attention.exchange import resolve_auto
from xstage.attention.flash import FlashConfig, default_config
from xstage.attention.layout import pack_qkv, unpack_out, unpack_qkv
from xstage.attention.ulysses import fused_state, loopback_index, run_fused
from xstage.comm import create_context
from xstage.comm.ulysses_signals import tiles_touching, wait_counters
from xstage.errors import CommTimeoutError, InputError
from xstage.spec.exchange import parse_exchange
from xstage.spec.ulysses import UlyssesPlan, split_sizes

TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


def _rand(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


def test_split_sizes_and_tiles():
    assert split_sizes(30, 4) == [8, 8, 7, 7]
    assert split_sizes(30, 8) == [4, 4, 4, 4, 4, 4, 3, 3]
    assert split_sizes(3, 5) == [1, 1, 1, 0, 0]
    for start, end, bm in [(0, 100, 64), (100, 200, 64), (5, 6, 4), (7, 7, 4), (64, 128, 64)]:
        brute = sum(1 for i in range(0, 300, bm) if any(i <= row < i + bm for row in range(start, end)))
        assert tiles_touching(start, end, bm) == brute


@pytest.mark.parametrize("world,H,seq", [(3, 5, [7, 6, 6]), (2, 4, [8, 8]), (4, 30, [5, 4, 4, 3]),
                                         (4, 3, [2, 0, 3, 0]), (3, 6, [0, 2, 0])],
                         ids=["P3-H5-uneven", "P2-H4-even", "P4-H30-uneven", "P4-H3-empty-ranks", "P3-H6-one-holder"])
def test_pack_unpack_is_the_reference_permutation(world, H, seq):
    # every rank packs, a plain all-to-all moves the chunks, every rank unpacks: the gathered q of
    # rank r must be its heads over the whole sequence, and the post-attention path must invert it
    B, D = 2, 8
    shards = [torch.randn(B, s, H, D) for s in seq]
    plans = [UlyssesPlan(world, r, B, seq, H, D) for r in range(world)]
    sends = [pack_qkv(plans[r], shards[r], 2 * shards[r], 3 * shards[r]) for r in range(world)]
    for r in range(world):
        chunks = [torch.split(sends[p], plans[p].qkv_send_splits())[r] for p in range(world)]
        qg, kg, vg = unpack_qkv(plans[r], torch.cat(chunks))
        h0, h1 = plans[r].head0[r], plans[r].head0[r + 1]
        want = torch.cat([s[:, :, h0:h1] for s in shards], dim=1)
        assert torch.equal(qg, want) and torch.equal(kg, 2 * want) and torch.equal(vg, 3 * want)
    # post-attention: rank p's gathered "output" is its heads over the sequence; each rank must get back
    # exactly its own tokens with all heads
    full = torch.cat(shards, dim=1)
    gathered = [full[:, :, plans[0].head0[p]:plans[0].head0[p + 1]].transpose(0, 1).contiguous() for p in range(world)]
    for r in range(world):
        chunks = [torch.split(gathered[p].reshape(-1), plans[p].out_send_splits())[r] for p in range(world)]
        out = unpack_out(plans[r], torch.cat(chunks), torch.full_like(shards[r], float("nan")))
        assert torch.equal(out, shards[r])


def _loopback_case(world, rank, H, seq, dtype, device, path):
    B, D = 2, 32
    s_r = seq[rank]
    q, k, v = (_rand((B, s_r, H, D), dtype, device, 10 + i) for i in range(3))
    plan = UlyssesPlan(world, rank, B, seq, H, D)
    idx = loopback_index(plan, device)
    starts = plan.tok0
    shards = [[t.index_select(1, idx[starts[p]:starts[p + 1]]) for p in range(world)] for t in (q, k, v)]
    refs = ulysses_reference(*shards)
    ctx = create_context(path=path, loopback_world=world, rank=rank, device=device)
    return plan, (q, k, v), refs, ctx


EXCHANGES = ["stores", "stores:burst", "serial", "serial:cudnn", "overlap", "overlap:cudnn:3"]
CASES = [
    pytest.param(2, 0, 4, [64, 64], torch.float16, id="P2-r0-H4-S128-fp16"),
    pytest.param(4, 2, 30, [37, 37, 36, 36], torch.float16, id="P4-r2-H30-S146-fp16"),
    pytest.param(3, 1, 5, [21, 20, 20], torch.float32, id="P3-r1-H5-S61-fp32"),
]


@pytest.mark.parametrize("exchange,case", [(e, c) for e in EXCHANGES for c in CASES[1:2]]
                         + [(e, c) for e in ("stores", "overlap") for c in (CASES[0], CASES[2])])
def test_loopback_layout_and_values(exchange, case, device):
    world, rank, H, seq, dtype = case.values
    plan, (q, k, v), refs, ctx = _loopback_case(world, rank, H, seq, dtype, device, "hbm")
    # the state (and output buffers) of the block size ulysses_attention will use: fp32 takes
    # smaller blocks than fp16 on a GPU
    cfg_bm = default_config(plan.head_dim, dtype, torch.device(device)).block_m
    out_buf = fused_state(ctx, plan, dtype, cfg_bm).out
    for t in out_buf.peers:
        t.fill_(float("nan"))
    out = ulysses_attention(q, k, v, comm=ctx, exchange=exchange, seq_lens=seq)
    assert out.shape == q.shape and not out.isnan().any()
    torch.testing.assert_close(out.double(), refs[rank], atol=TOL[dtype], rtol=TOL[dtype])
    # every destination received exactly its tokens of this rank's heads
    h0, h1 = plan.head0[rank], plan.head0[rank + 1]
    for p in range(world):
        if p == rank and not parse_exchange(exchange).in_kernel:
            continue  # the copy-engine exchanges write the own rows straight into the returned output
        got = out_buf.peers[p][:, :seq[p], h0:h1]
        assert not got.isnan().any(), f"destination {p} has unwritten rows"
        torch.testing.assert_close(got.double(), refs[p][:, :, h0:h1], atol=TOL[dtype], rtol=TOL[dtype])
    ctx.close()


def test_fused_counters_count_every_tile_once(device):
    # 3 ranks of 23, 22, 22 tokens: 32-row query tiles straddle the ranks' boundaries
    world, rank, H, seq = 3, 1, 5, [23, 22, 22]
    plan, (q, k, v), refs, ctx = _loopback_case(world, rank, H, seq, torch.float16, device, "hbm")
    bm = 32 if device == "cpu" else 128
    state = fused_state(ctx, plan, torch.float16, bm)
    h0, h1 = plan.head0[rank], plan.head0[rank + 1]
    qf, kf, vf = (t.index_select(1, loopback_index(plan, device))[:, :, h0:h1] for t in (q, k, v))
    run_fused(state, ctx, qf, kf, vf, wait=False)
    assert state.sig.tolist() == state.wait_expected.tolist()
    brute = [sum(1 for i in range(0, sum(seq), bm) for _ in range(2 * (h1 - h0))
                 if i < plan.tok0[p + 1] and i + bm > plan.tok0[p]) for p in range(world)]
    assert state.sig.tolist() == brute
    ctx.close()


def test_fused_counters_reset_and_timeout(device):
    world, rank, H, seq = 3, 0, 3, [20, 20, 20]
    plan, (q, k, v), refs, ctx = _loopback_case(world, rank, H, seq, torch.float16, device, "hbm")
    # two calls in a row: the counters must be handed back in between
    for _ in range(2):
        out = ulysses_attention(q, k, v, comm=ctx, seq_lens=seq, exchange="stores")
        torch.testing.assert_close(out.double(), refs[rank], atol=2e-3, rtol=2e-3)
    state = fused_state(ctx, plan, torch.float16, 32 if device == "cpu" else 128)
    assert state.sig.abs().sum().item() == 0
    # a destination that never gets its last tile: the wait gives up and names rank, peer and stage
    h0, h1 = plan.head0[rank], plan.head0[rank + 1]
    qf, kf, vf = (t.index_select(1, loopback_index(plan, device))[:, :, h0:h1] for t in (q, k, v))
    run_fused(state, ctx, qf, kf, vf, wait=False)
    short = state.wait_expected.clone()
    short[2] += 1
    ctx.timeout_ns = 50_000
    wait_counters(state.wait_table, state.sig, short, state.wait_peers, ctx.error, ctx.timeout_ns,
                  use_ptx=device != "cpu")
    with pytest.raises(CommTimeoutError, match=r"rank 0: wait for peer 2 timed out at stage attention\.ulysses_output"):
        ctx.check()
    ctx.close()


@pytest.mark.parametrize("paced,chunk_rows", [(True, 16), (True, 4), (False, 0)],
                         ids=["paced-in-loop", "paced-short-loop", "burst"])
def test_fused_exchange_over_several_tiles_per_program(paced, chunk_rows, device):
    # 14 query tiles over a persistent grid of 4 programs (the CPU stands for 4 SMs), tiles that
    # straddle ranks: with 16-row chunks every chunk of a previous tile is sent inside the next key
    # loop (6 key blocks, 2 chunks, pace 2: programs at phases 0 and 1); with 4-row chunks the loop
    # has room for 6 of 8 and the epilogue sends the rest; the last tile of each program goes
    # after the loop. Every destination must hold exactly its rows, every counter its tile count.
    world, rank, H, seq = 3, 1, 6, [70, 69, 69]
    plan, (q, k, v), refs, ctx = _loopback_case(world, rank, H, seq, torch.float16, device, "hbm")
    if device == "cpu":
        cfg = FlashConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, ctas_per_sm=1, use_tma=False,
                          chunk_rows=chunk_rows)
    else:
        cfg = FlashConfig(chunk_rows=chunk_rows)
    state = fused_state(ctx, plan, torch.float16, cfg.block_m)
    state.route = dataclasses.replace(state.route, paced=paced)
    h0, h1 = plan.head0[rank], plan.head0[rank + 1]
    for t in state.out.peers:
        t.fill_(float("nan"))
    qf, kf, vf = (t.index_select(1, loopback_index(plan, device))[:, :, h0:h1] for t in (q, k, v))
    run_fused(state, ctx, qf, kf, vf, config=cfg, wait=False)
    bm = cfg.block_m
    brute = [sum(1 for i in range(0, sum(seq), bm) for _ in range(2 * (h1 - h0))
                 if i < plan.tok0[p + 1] and i + bm > plan.tok0[p]) for p in range(world)]
    assert state.sig.tolist() == brute
    for p in range(world):
        got = state.out.peers[p][:, :seq[p], h0:h1]
        assert not got.isnan().any(), f"destination {p} has unwritten rows"
        torch.testing.assert_close(got.double(), refs[p][:, :, h0:h1], atol=2e-3, rtol=2e-3)
    ctx.close()


def test_chunk_rows_must_be_a_power_of_two():
    x = torch.zeros(1, 8, 1, 16)
    with pytest.raises(InputError, match="chunk_rows=3"):
        from xstage.attention import flash_attention

        flash_attention(x, x, x, config=FlashConfig(block_m=32, block_n=32, num_warps=4, num_stages=1,
                                                     ctas_per_sm=0, use_tma=False, chunk_rows=3))


def test_module_and_bad_inputs(device):
    ctx = create_context(path="hbm", loopback_world=2, rank=1, device=device)
    x = _rand((1, 16, 2, 16), torch.float16, device, 0)
    attn = UlyssesAttention(comm=ctx, exchange="serial")
    assert attn(x, x, x).shape == x.shape
    with pytest.raises(InputError, match="causal"):
        attn(x, x, x, causal=True)
    with pytest.raises(InputError, match="mode 'overlap': deprecated"):
        ulysses_attention(x, x, x, comm=ctx, mode="overlap")
    with pytest.raises(InputError, match="exchange, mode"):
        ulysses_attention(x, x, x, comm=ctx, mode="serial", exchange="serial")
    with pytest.raises(InputError, match=r"^comm: must be an xstage.comm context \(create_context\) or None, "
                                         r"got bool$"):
        ulysses_attention(x, x, x, comm=True)  # found by tests/test_fuzz_api.py: an AttributeError
    with pytest.raises(InputError, match=r"^mode \[\]: deprecated, and must be one of"):
        ulysses_attention(x, x, x, comm=ctx, mode=[])  # was TypeError: unhashable
    with pytest.raises(InputError, match=r"^check: must be True or False, got Tensor$"):
        ulysses_attention(x, x, x, comm=ctx, check=torch.tensor([1, 2]))  # was a RuntimeError
    for bad in ("fused", "stores:paced:3", "overlap:cudnn:1", "serial:flash", "tma:burst", 7, "overlap:cudnn:4:zig",
                "overlap:cudnn:x:waves", "serial:cudnn:4", "overlap:cudnn:4:waves:1"):
        with pytest.raises(InputError, match="exchange"):
            ulysses_attention(x, x, x, comm=ctx, exchange=bad)
    with pytest.raises(InputError, match="seq_lens: expected 2 non-negative"):
        ulysses_attention(x, x, x, comm=ctx, seq_lens=[16, 17, 3])
    for bad in ([16, 1.5], "ab", [0, 0], 3):
        with pytest.raises(InputError, match="seq_lens: expected 2 non-negative"):
            ulysses_attention(x, x, x, comm=ctx, seq_lens=bad)
    with pytest.raises(InputError, match=r"seq_lens: entry 1 \(this rank's\) is 10, but q holds 16 tokens"):
        ulysses_attention(x, x, x, comm=ctx, seq_lens=[10, 10])
    # softmax_scale: one line naming it, never a raw float() error
    for bad in ("a", float("nan"), float("inf"), 0.0, -1, True, [1.0]):
        with pytest.raises(InputError, match=r"^softmax_scale: must be a finite positive number or None, got "):
            ulysses_attention(x, x, x, comm=ctx, softmax_scale=bad)
    with pytest.raises(InputError, match="^config: expected a FlashConfig"):
        ulysses_attention(x, x, x, comm=ctx, config={"block_m": 32})
    with pytest.raises(InputError, match=r"^k, v: expected the local shape of q \[1, 16, 2, 16\]"):
        ulysses_attention(x, x[:, :8], x[:, :8], comm=ctx)
    with pytest.raises(InputError, match="^q: head dim D=24"):
        odd = _rand((1, 16, 2, 24), torch.float16, device, 0)
        ulysses_attention(odd, odd, odd, comm=ctx)
    ctx.close()


def test_bf16_is_refused_in_the_interpreter(device, monkeypatch):
    # Triton's CPU interpreter computes bf16 tl.dot wrongly: refused by name before any work
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(1, 16, 2, 16, dtype=torch.bfloat16, device=device)
    from xstage.attention import flash_attention

    with pytest.raises(InputError, match=r"^q\.dtype=bf16: dtype bf16 cannot run in Triton's CPU interpreter"):
        flash_attention(x, x, x)
    ctx = create_context(path="hbm", loopback_world=2, rank=0, device=device)
    with pytest.raises(InputError, match=r"^q\.dtype=bf16: dtype bf16 cannot run in Triton's CPU interpreter"):
        ulysses_attention(x, x, x, comm=ctx, exchange="serial")
    ctx.close()


@pytest.mark.parametrize("rank", [0, 3])
def test_loopback_ranks_without_heads_or_tokens(rank, device):
    # 4 ranks, 2 heads: ranks 2 and 3 own no head; rank 1 holds no token. Played as rank 0 (one head,
    # stores to a rank without tokens) and as rank 3 (no head: computes nothing of its own, but the
    # stand-in ranks' heads of its output still arrive), every exchange, against the reference.
    world, H, seq = 4, 2, [3, 0, 2, 1]
    plan, (q, k, v), refs, ctx = _loopback_case(world, rank, H, seq, torch.float16, device, "hbm")
    assert plan.heads_of(rank) == (1 if rank == 0 else 0)
    assert str(resolve_auto(plan, torch.float16, "hbm", torch.device(device))) == "serial"  # H < P
    out_buf = fused_state(ctx, plan, torch.float16, default_config(32, torch.float16, torch.device(device)).block_m).out
    for exchange in ("serial", "overlap", "stores", "auto"):
        for t in out_buf.peers:
            t.fill_(float("nan"))
        out = ulysses_attention(q, k, v, comm=ctx, exchange=exchange, seq_lens=seq)
        torch.testing.assert_close(out.double(), refs[rank], atol=2e-3, rtol=2e-3)
        h0, h1 = plan.head0[rank], plan.head0[rank + 1]
        for p in range(world):
            if p != rank and exchange != "auto":
                got = out_buf.peers[p][:, :seq[p], h0:h1]
                torch.testing.assert_close(got.double(), refs[p][:, :, h0:h1], atol=2e-3, rtol=2e-3)
    # a loopback group derives the stand-in ranks' tokens from the local shard: an empty one is refused
    plan, (q, k, v), refs, ctx = _loopback_case(world, 0, H, seq, torch.float16, device, "hbm")
    empty = q[:, :0]
    lone = create_context(path="hbm", loopback_world=world, rank=1, device=device)
    with pytest.raises(InputError, match="^seq_lens: a loopback context derives the stand-in ranks' tokens"):
        ulysses_attention(empty, empty, empty, comm=lone, seq_lens=seq)
    ctx.close()
    lone.close()


def test_exchange_spellings_round_trip():
    for text, canon in (("serial", "serial"), ("serial:triton", "serial"), ("serial:cudnn", "serial:cudnn"),
                        ("overlap:cudnn:4", "overlap:cudnn:4"), ("overlap:triton:3", "overlap:triton:3"),
                        ("overlap:cudnn:4:even", "overlap:cudnn:4"),
                        ("overlap:triton:3:waves", "overlap:triton:3:waves"),
                        ("stores", "stores:paced"), ("stores:paced:16", "stores:paced:16"),
                        ("stores:burst", "stores:burst"), ("tma", "tma"), ("auto", "auto"),
                        ("heads:cudnn:4", "heads:cudnn:4"), ("heads:triton:1", "heads:triton:1")):
        ex = parse_exchange(text)
        assert str(ex) == canon and parse_exchange(str(ex)) == ex
    assert parse_exchange("stores:burst").in_kernel and not parse_exchange("overlap").in_kernel
    assert parse_exchange("heads:cudnn:3").chunks == 3 and not parse_exchange("heads:cudnn:3").in_kernel
    for bad, message in (("heads", "expected one of"), ("heads:cudnn", "expected one of"),
                         ("heads:cudnn:0", r"C \(head chunks\) must be an integer in \[1, 1024\], got '0'"),
                         ("heads:cudnn:x", "C \\(head chunks\\)"), ("heads:flash:2", "attention core 'flash'"),
                         ("heads:triton:2:waves", "expected one of")):
        with pytest.raises(InputError, match=message):
            parse_exchange(bad)


def test_head_chunks_refuse_a_loopback_context_before_any_work():
    q = torch.randn(1, 8, 4, 32)
    with create_context(path="host", loopback_world=2) as ctx:
        with pytest.raises(InputError, match=r"^exchange 'heads:triton:2': runs on a torch\.distributed group"):
            ulysses_attention(q, q, q, comm=ctx, exchange="heads:triton:2")


def _tiles(ranges, heads, block_m):
    return heads * sum(-(-(hi - lo) // block_m) for lo, hi in ranges)


@pytest.mark.parametrize("heads,tokens,world,blocks", [(24, 32760, 8, 3), (24, 32760, 8, 4), (16, 12288, 8, 5),
                                                       (24, 4608, 4, 4)])
def test_waves_cut_leaves_only_the_spill_beside_the_own_rows(heads, tokens, world, blocks):
    """The `waves` cut: every remote row once, the own rows last, and the last remote block holds just
    the tiles that the own tiles cannot fill the last wave with (an independent wave count)."""
    from xstage.spec.ulysses import UlyssesPlan, overlap_blocks, split_sizes

    slots, bm = 132, 128
    plan = UlyssesPlan(world, 0, 1, split_sizes(tokens, world), heads, 128)
    h = plan.heads_of(0)
    even = overlap_blocks(plan, blocks, bm)
    waves = overlap_blocks(plan, blocks, bm, cut="waves", slots=slots)
    for cut in (even, waves):
        rows = sorted(r for ranges in cut[:-1] for lo, hi in ranges for r in range(lo, hi))
        assert rows == list(range(plan.tok0[1], tokens)) and cut[-1] == [(0, plan.tok0[1])]
    assert len(waves) == len(even) == blocks
    total = sum(_tiles(r, h, bm) for r in waves)
    last_wave = total - (total - 1) // slots * slots
    spill = last_wave - _tiles(waves[-1], h, bm)
    tail = _tiles(waves[-2], h, bm)
    assert spill > 0 and spill <= tail < spill + h  # just the spill, rounded up to whole row tiles
    # the blocks before it fill whole waves (but for that rounding)
    assert total - tail - _tiles(waves[-1], h, bm) > (total - 1) // slots * slots - h


def test_waves_cut_is_even_without_a_spill():
    from xstage.spec.ulysses import UlyssesPlan, overlap_blocks, split_sizes

    for heads, tokens, world in ((24, 32760, 4), (24, 2048, 8), (40, 75600, 8)):  # own tiles fill it; one wave
        plan = UlyssesPlan(world, 0, 1, split_sizes(tokens, world), heads, 128)
        assert overlap_blocks(plan, 4, 128, cut="waves", slots=132) == overlap_blocks(plan, 4, 128)
    with pytest.raises(InputError, match="slots"):
        overlap_blocks(plan, 4, 128, cut="waves")


@pytest.mark.parametrize("world,rank,seq,blocks", [(3, 1, [70, 69, 69], 3), (4, 0, [40, 40, 40, 40], 2),
                                                   (2, 1, [33, 31], 4), (3, 0, [70, 69, 69], "4:waves")],
                         ids=["P3-r1-uneven-3blocks", "P4-r0-2blocks", "P2-r1-4blocks", "P3-r0-4blocks-waves"])
def test_overlap_sends_every_remote_row_once_in_flag_order(world, rank, seq, blocks, device):
    from xstage.attention.overlap import run_overlap
    from xstage.attention.ulysses import stage_buffer, unpack_loopback
    from xstage.spec.ulysses import overlap_blocks

    H = 4
    plan, (q, k, v), refs, ctx = _loopback_case(world, rank, H, seq, torch.float16, device, "hbm")
    cfg = default_config(plan.head_dim, torch.float16, torch.device(device))
    h0, h1 = plan.head0[rank], plan.head0[rank + 1]
    qf, kf, vf = (t.index_select(1, loopback_index(plan, device))[:, :, h0:h1] for t in (q, k, v))
    state = fused_state(ctx, plan, torch.float16, cfg.block_m)
    stage = stage_buffer(state, ctx)
    for t in (*state.out.peers, *stage.peers):
        t.fill_(float("nan"))
    from xstage.attention.layout import empty_gathered_out

    og = empty_gathered_out(plan, torch.float16, torch.device(device))
    sends = []
    ex = parse_exchange(f"overlap:triton:{blocks}")
    n_blocks = len(overlap_blocks(plan, ex.blocks, cfg.block_m, cut=ex.cut, slots=132))
    stamps = torch.zeros(n_blocks, 4, dtype=torch.int64, device=device)
    run_overlap(plan, ex, qf, kf, vf, og, state.out.local[:, :seq[rank], h0:h1], stage.peers, config=cfg,
                on_send=lambda *s: sends.append(s), stamps=stamps)
    # per block: its attention starts, ends, then its copies start and end; blocks start in order
    t = stamps.cpu()
    assert bool((t > 0).all()) and bool((t[:, 1:] >= t[:, :-1]).all()) and bool((t[1:, 0] >= t[:-1, 0]).all())
    with pytest.raises(InputError, match="stamps: expected int64"):
        run_overlap(plan, ex, qf, kf, vf, og, state.out.local[:, :seq[rank], h0:h1], stage.peers, config=cfg,
                    stamps=stamps[:-1])
    # flags are raised block by block: the sends come in block order
    assert [s[0] for s in sends] == sorted(s[0] for s in sends)
    rows = sorted(r for (_, dest, lo, hi) in sends for r in range(lo, hi))
    own = set(range(plan.tok0[rank], plan.tok0[rank + 1]))
    assert rows == sorted(set(range(plan.seq_total)) - own)  # every remote row exactly once, no own row
    for (_, dest, lo, hi) in sends:
        assert plan.tok0[dest] <= lo < hi <= plan.tok0[dest + 1]  # each row to the rank that owns it
    assert {s[0] for s in sends} <= set(range(n_blocks - 1)) | {n_blocks - 1}
    unpack_loopback(plan, state)
    for p in range(world):
        got = state.out.peers[p][:, :seq[p], h0:h1]
        torch.testing.assert_close(got.double(), refs[p][:, :, h0:h1], atol=2e-3, rtol=2e-3)
    ctx.close()


@pytest.mark.parametrize("S,B,H,h0,h,D", [(5, 1, 4, 1, 2, 16), (3, 2, 3, 0, 3, 8), (7, 3, 5, 4, 1, 32)],
                         ids=["S5-B1-h2of4", "S3-B2-all-heads", "S7-B3-last-head"])
def test_copy_region_moves_rows_like_the_transposed_copy(S, B, H, h0, h, D, device):
    """The stand-in receivers' stream-ordered unpack kernel against torch's transposed copy."""
    from xstage.attention.overlap import copy_region

    region = torch.randn(S, B, h, D, device=device)
    dest = torch.full((B, S + 2, H, D), float("nan"), device=device)
    copy_region(region, dest[:, :S, h0:h0 + h])
    want = torch.full_like(dest, float("nan"))
    want[:, :S, h0:h0 + h] = region.transpose(0, 1)
    torch.testing.assert_close(dest, want, equal_nan=True, rtol=0, atol=0)
    with pytest.raises(InputError, match="copy_region"):
        copy_region(torch.randn(S, B, h, 2 * D, device=device)[..., ::2], dest[:, :S, h0:h0 + h])
