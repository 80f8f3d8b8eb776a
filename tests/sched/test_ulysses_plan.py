"""The in-kernel Ulysses exchange as task work (tiles, stores, tile-cost fit) and the exchange planner."""

import math

import pytest

from tests.sched.test_plan import SLOW_PATH
from xstage.errors import InputError
from xstage.model.params import PathParams
from xstage.sched.costs import KindCost, TaskCosts
from xstage.sched.moe import remote_path
from xstage.sched.simulate import simulate_kernel
from xstage.sched.ulysses import REMOTE, UlyssesConfig, attention_costs, cost_kind, ulysses_work

# Test inputs, not measurements.
COSTS = TaskCosts("attention", {cost_kind(64, 128, 128): KindCost(500.0, 3000.0)})
CFG = UlyssesConfig(heads=6, head_dim=64, tokens=1000, ranks=3, grid=5)
FREE_PATH = PathParams(r0=1e15, c_sm=float("inf"), drain=1e15, capacity=float("inf"))  # stores cost ~nothing


def test_tiles_and_remote_rows_follow_the_sequence_split():
    assert (CFG.local_heads, CFG.m_tiles, CFG.tiles) == (2, 8, 16)
    # Rank 0 owns rows [0, 334): tiles 0-1 are local, tile 2 straddles, the rest go to other ranks.
    assert [CFG.remote_rows(m) for m in range(8)] == [0, 0, 384 - 334, 128, 128, 128, 128, 1000 - 896]
    assert UlyssesConfig(heads=30, head_dim=64, tokens=100, ranks=4).local_heads == 8  # ceil: layout of any H
    with pytest.raises(InputError, match="ranks"):
        UlyssesConfig(heads=2, head_dim=64, tokens=100, ranks=4)


@pytest.mark.parametrize("exchange", ["stores:burst", "stores:paced:16", "stores:paced:128"])
def test_every_exchange_sends_every_remote_byte_once_and_computes_every_tile(exchange):
    work = ulysses_work(CFG, exchange, COSTS)
    sent = sum(t.stores.get(REMOTE, 0) for cta in work.ctas for t in cta)
    want = CFG.local_heads * sum(CFG.remote_rows(m) for m in range(CFG.m_tiles)) * CFG.head_dim * 2
    assert sent == want
    tile = COSTS.cost(cost_kind(64, 128, 128)).time_ns(CFG.tile_work())
    compute = sum(t.compute_ns for cta in work.ctas for t in cta)
    assert compute == pytest.approx(CFG.tiles * tile)
    # With free stores the kernel is its compute: rounds of tiles on the busiest program.
    t = simulate_kernel(work, {"remote": FREE_PATH}).time_ns
    assert t == pytest.approx(math.ceil(CFG.tiles / CFG.grid) * tile, rel=1e-3)


def test_paced_exchange_hides_the_drain_that_burst_stalls_on():
    cfg = UlyssesConfig(heads=8, head_dim=64, tokens=4096, ranks=8, grid=16)
    # The planner's path: a task's loads wait for the stores its SM holds (`remote_path`).
    burst, paced = (simulate_kernel(ulysses_work(cfg, e, COSTS), {"remote": remote_path(SLOW_PATH)}).time_ns
                    for e in ("stores:burst", "stores:paced:16"))
    assert paced < 0.9 * burst
    with pytest.raises(InputError, match="stores only"):
        ulysses_work(cfg, "serial", COSTS)


def test_attention_costs_fit_the_tile_time_per_round():
    # Two configurations whose attention-alone times follow 500 ns + work / 3000 per tile exactly.
    cfgs = [CFG, UlyssesConfig(heads=6, head_dim=64, tokens=3000, ranks=3, grid=5)]
    rows = []
    for c in cfgs:
        tile = 500.0 + c.tile_work() / 3000.0
        base = {"heads": c.heads, "dim": c.head_dim, "tokens": c.tokens, "P": c.ranks, "block_m": 128,
                "block_n": 128, "grid": c.grid}
        rows += [{**base, "variant": "attention:triton", "time_ns": math.ceil(c.tiles / c.grid) * tile},
                 {**base, "variant": "stores:paced", "time_ns": 1.0}]
    fitted = attention_costs(rows).cost(cost_kind(64, 128, 128))
    assert fitted.overhead_ns == pytest.approx(500.0, rel=0.05) and fitted.rate == pytest.approx(3000.0, rel=0.01)
    with pytest.raises(InputError, match="attention"):
        attention_costs([r for r in rows if r["variant"] != "attention:triton"])


def test_cli_plans_ulysses_from_the_embedded_costs(capsys):
    import json

    from xstage.cli import main

    assert main(["plan", "ulysses", "--heads", "24", "--dim", "128", "--tokens", "8192", "--ranks", "8",
                 "--candidates", "serial:cudnn,stores:burst,stores:paced:16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["exchange"] for r in out["rows"]} == {"serial:cudnn", "stores:burst", "stores:paced:16"}
    assert out["pick"] == out["rows"][0]["exchange"]
    assert all(r["time_us"] > r["attention_us"] > 0 for r in out["rows"])
