"""The injection kernel writes exactly its bytes; timers become rows of the long format."""

import math

import numpy as np
import pytest
import torch

from xstage.comm import create_context
from xstage.errors import InputError
from xstage.model.data import LONG_COLUMNS, validate_long
from xstage.probe.runner import (
    BurstConfig,
    LaunchResult,
    dest_elems,
    destinations,
    expected_region,
    launch,
    rows_from_launch,
)

POISON = -123456789


def run_and_check_bytes(path, cfg, world=2, rank=0):
    """Launch `cfg` into a poisoned destination; every region must hold the last burst's values and
    every other element must keep the poison."""
    with create_context(path=path, loopback_world=world, rank=rank) as ctx:
        n = dest_elems(cfg, world) + 4096
        dest = ctx.alloc("dst", (n,), torch.int32)
        for t in dest.peers:
            t.fill_(POISON)
        raw = launch(ctx, dest, cfg)
        elems = cfg.burst_bytes // 4
        got = dest.peers[(rank + 1) % world].cpu()
        written = torch.zeros(n, dtype=torch.bool)
        for i in range(cfg.n_ctas):
            region = rank * cfg.n_ctas + i
            lo = region * elems
            assert torch.equal(got[lo:lo + elems], expected_region(region, cfg.burst_bytes, cfg.n_bursts)), i
            written[lo:lo + elems] = True
        assert bool((got[~written] == POISON).all())
        assert bool((dest.local.cpu() == POISON).all())
        return raw


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(BurstConfig(path="hbm", n_sm=3, warps=1, vector_bytes=16, burst_bytes=1536, n_bursts=2,
                                 gap_iters=3), id="hbm-sm3-w1-v16-B1536-n2"),
        pytest.param(BurstConfig(path="host", n_sm=2, warps=2, vector_bytes=8, burst_bytes=1024, n_bursts=3),
                     id="host-sm2-w2-v8-B1024-n3"),
        pytest.param(BurstConfig(path="hbm", n_sm=1, ctas_per_sm=2, warps=1, vector_bytes=4, burst_bytes=384,
                                 completion="fence"), id="hbm-sm1x2-w1-v4-B384-fence"),
    ],
)
def test_kernel_writes_exactly_its_bytes(cfg, device):
    raw = run_and_check_bytes(cfg.path, cfg)
    assert raw.times.shape == (cfg.n_ctas, cfg.n_bursts, 6) and raw.cta.shape == (cfg.n_ctas, 6)


def test_rank_offsets_regions_in_loopback():
    cfg = BurstConfig(path="hbm", n_sm=2, warps=1, burst_bytes=512, n_bursts=1)
    run_and_check_bytes("hbm", cfg, world=3, rank=2)


def test_destinations_one_and_all():
    one = BurstConfig(path="peer", peer_mode="one", n_sm=5)
    all_ = BurstConfig(path="peer", peer_mode="all", n_sm=5)
    assert destinations(one, 2, 4) == [3] * 5
    assert destinations(all_, 2, 4) == [3, 0, 1, 3, 0]
    assert destinations(BurstConfig(path="host", n_sm=2), 0, 2) == [1, 1]
    with pytest.raises(InputError, match="world"):
        destinations(one, 0, 1)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(path="nvlink"), "path"), (dict(peer_mode="one"), "peer_mode"),
        (dict(path="peer", peer_mode="none"), "peer_mode"), (dict(warps=3), "warps"),
        (dict(vector_bytes=32), "vector_bytes"), (dict(n_sm=0), "n_sm"), (dict(n_sm=200), "n_sm"),
        (dict(burst_bytes=4096 + 16), "burst_bytes"), (dict(gap_iters=-1), "gap_iters"),
        (dict(n_bursts=0), "n_bursts"), (dict(completion="flag"), "completion"),
        (dict(ctas_per_sm=9), "ctas_per_sm"),
    ],
)
def test_config_validation_names_the_field(changes, field):
    with pytest.raises(InputError, match=field):
        BurstConfig(**changes).validate(sm_count=132)


def test_rows_from_timers_convert_cycles_to_ns():
    """Two CTAs, two bursts; CTA 1 runs at half the clock (2 ns per cycle)."""
    cfg = BurstConfig(path="host", n_sm=2, burst_bytes=4096, n_bursts=2, gap_iters=100, completion="fence")
    times = np.zeros((2, 2, 6), dtype=np.int64)
    #                 clk_gap clk_start clk_issued clk_done gt_start gt_issued
    times[0] = [[1000, 1000, 1300, 2300, 0, 0], [2300, 2500, 3000, 5000, 0, 0]]
    times[1] = [[1000, 1000, 1100, 1200, 0, 0], [1200, 1400, 1500, 1900, 0, 0]]
    cta = np.array([[10_000, 0, 20_000, 10_000, 3, 0], [10_000, 0, 30_000, 10_000, 7, 0]], dtype=np.int64)
    raw = LaunchResult(times=times, cta=cta)
    assert raw.ns_per_cycle().tolist() == [1.0, 2.0] and raw.sm_ids() == [3, 7]
    rows = rows_from_launch(cfg, raw, launch_index=7)
    got = {(r["cta"], r["burst_index"]): (r["issue_ns"], r["completion_ns"], r["gap_ns"]) for r in rows}
    assert got == {(0, 0): (300.0, 1300.0, ""), (0, 1): (500.0, 2500.0, 200.0),
                   (1, 0): (200.0, 400.0, ""), (1, 1): (200.0, 1000.0, 400.0)}
    env = {"gpu": "g", "driver": "d", "torch": "t", "triton": "tr", "git_commit": "c", "date": "2026-01-01"}
    typed = validate_long([{**r, **env} for r in rows])
    assert set(rows[0]) | set(env) == set(LONG_COLUMNS)
    assert all(r["launch"] == 7 and r["peer_mode"] == "none" for r in typed)
    assert math.isnan(typed[0]["gap_ns"])


def test_rows_leave_completion_empty_without_observation():
    cfg = BurstConfig(path="hbm", n_sm=1, burst_bytes=4096)
    raw = LaunchResult(times=np.array([[[0, 0, 50, 50, 0, 0]]], dtype=np.int64),
                       cta=np.array([[0, 0, 100, 100, 0, 0]], dtype=np.int64))
    (row,) = rows_from_launch(cfg, raw, 0)
    assert row["completion_ns"] == "" and row["issue_ns"] == 50.0


def test_launch_rejects_small_destination():
    cfg = BurstConfig(path="hbm", n_sm=2, warps=1, burst_bytes=512)
    with create_context(path="hbm") as ctx:
        dest = ctx.alloc("dst", (100,), torch.int32)
        with pytest.raises(InputError, match="dest"):
            launch(ctx, dest, cfg)
