"""The planners take only numbers the kernels can hold and the hardware can mean: what used to hang,
grow without bound or pass through is refused in one line, from Python and from the command line."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sched.test_plan import COSTS, SLOW_PATH
from xstage.errors import InputError
from xstage.sched.exchange import MAX_HEADS, MAX_SEQ_TOKENS, default_exchange_costs, plan_exchange, predict
from xstage.sched.moe import MoeConfig, synthetic_routing
from xstage.sched.plan import MAX_PLAN_CTAS, plan_moe
from xstage.spec.ulysses import SUPPORTED_HEAD_DIMS

ROOT = Path(__file__).resolve().parents[2]
CFG = MoeConfig.parse("H1024-I512-E8-K2", tokens_per_rank=64, ep=4, block_m=64, block_n1=64, block_n2=128)


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`xstage argv` in a fresh process, killed after `timeout` seconds (a hang fails the test)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "xstage", *argv], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


@pytest.mark.parametrize("argv, needle", [
    (["plan", "ulysses", "--heads", "24", "--dim", "128", "--tokens", "1e20", "--ranks", "4"],
     "argument --tokens: 1e20: must be an integer in 1..16777216 (sequence length over all ranks)"),
    (["plan", "ulysses", "--heads", "24", "--dim", "128", "--tokens", "100000000000000000000", "--ranks", "4"],
     "argument --tokens: 100000000000000000000: must be an integer in 1..16777216"),
    (["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "64", "--ep", "8", "--ctas", "99999999"],
     "argument --ctas: 99999999: must be an integer in 1..16384 (persistent CTAs the planner simulates)"),
])
def test_what_hung_or_grew_without_bound_is_refused_at_once(argv, needle):
    """`plan ulysses --tokens 1e20` spun without output and `plan moe --ctas 99999999` grew by a GB every
    few seconds; now each exits 2 with one line, well inside the timeout."""
    t0 = time.monotonic()
    out = _cli(*argv, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert time.monotonic() - t0 < 120


def test_the_largest_ulysses_call_is_planned_in_seconds():
    """The bounds themselves: the most heads at the longest sequence on one rank (the most tiles a rank
    plans) ranks every exchange without spinning."""
    t0 = time.monotonic()
    ranked = plan_exchange(MAX_HEADS, max(SUPPORTED_HEAD_DIMS), MAX_SEQ_TOKENS, 1, default_exchange_costs())
    assert ranked and all(p.time_ns > 0 for p in ranked)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("kw, match", [
    (dict(dim=7), r"^dim=7: must be one of 16, 32, 64, 128, 256 \(the head dims the attention kernel runs\)$"),
    (dict(dim=512), r"^dim=512: must be an integer in 1\.\.256"),
    (dict(dim=64.0 + 0.5), r"^dim=64\.5: must be an integer"),
    (dict(tokens=10**20), r"^tokens=100000000000000000000: must be an integer in 1\.\.16777216"),
    (dict(tokens=1e20), r"^tokens=1e\+20: must be an integer in 1\.\.16777216"),
    (dict(heads=10**6), r"^heads=1000000: must be an integer in 1\.\.1024"),
    (dict(ranks=4.5), r"^ranks=4\.5: must be an integer in 1\.\.1024"),
    (dict(ranks=32), r"^ranks=32: must be <= heads=24"),
])
def test_the_ulysses_planner_refuses_shapes_the_kernel_cannot_run(kw, match):
    args = dict(heads=24, dim=128, tokens=4096, ranks=4)
    args.update(kw)
    with pytest.raises(InputError, match=match):
        plan_exchange(args["heads"], args["dim"], args["tokens"], args["ranks"], default_exchange_costs())
    with pytest.raises(InputError, match=match):
        predict("serial:triton", args["heads"], args["dim"], args["tokens"], args["ranks"], default_exchange_costs())


def test_every_head_dim_the_kernel_runs_is_planned():
    for dim in SUPPORTED_HEAD_DIMS:
        assert plan_exchange(24, dim, 4096, 4, default_exchange_costs())


def test_the_moe_planner_refuses_numbers_before_simulating():
    for num_ctas, match in ((MAX_PLAN_CTAS + 1, r"num_ctas=16385: must be an integer in 1\.\.16384"),
                            (99999999, r"num_ctas=99999999: must be"), (8.0 + 0.5, r"num_ctas=8\.5")):
        with pytest.raises(InputError, match=match):
            plan_moe(CFG, SLOW_PATH, COSTS, num_ctas, candidates=["lag:1"])
    with pytest.raises(InputError, match=r"^seed=-1: must be an integer in 0\.\.9223372036854775807"):
        plan_moe(CFG, SLOW_PATH, COSTS, 8, candidates=["lag:1"], seed=-1)
    with pytest.raises(InputError, match=r"^seed=1e\+300: must be an integer"):
        synthetic_routing(CFG, seed=1e300)
    assert plan_moe(CFG, SLOW_PATH, COSTS, 8.0, candidates=["lag:1"])[0].schedule == "lag:1"


@pytest.mark.parametrize("kw, match", [
    (dict(tokens_per_rank=2**63), r"MoE config tokens_per_rank=9223372036854775808: must be an integer in "
                                  r"1\.\.1048576"),
    (dict(tokens_per_rank=64.5), r"MoE config tokens_per_rank=64\.5: must be an integer"),
    (dict(ep=10**6), r"MoE config ep=1000000: must be an integer in 1\.\.1024"),
])
def test_moe_config_states_its_bounds(kw, match):
    with pytest.raises(InputError, match=match):
        MoeConfig.parse("H1024-I512-E8-K2", **{**dict(tokens_per_rank=64, ep=4), **kw})


def test_the_planners_name_an_argument_of_the_wrong_type():
    """Found by tests/test_fuzz_api.py: None or True in these ended in AttributeError or TypeError."""
    costs = default_exchange_costs()
    for call, match in (
            (lambda: plan_exchange(24, 128, 4096, 4, None), r"^costs: must be ExchangeCosts .*, got NoneType$"),
            (lambda: plan_exchange(24, 128, 4096, 4, costs, True), r"^candidates: must be a list of exchange"),
            (lambda: predict("serial", 24, 128, 4096, 4, costs, elem_bytes="2"), r"^elem_bytes='2': must be an int"),
            (lambda: plan_moe(None, SLOW_PATH, COSTS, 8), r"^cfg: must be a MoeConfig, got NoneType$"),
            (lambda: plan_moe(CFG, None, COSTS, 8), r"^path: must be the store path's PathParams, got NoneType$"),
            (lambda: plan_moe(CFG, SLOW_PATH, None, 8), r"^costs: must be the kernel's TaskCosts, got NoneType$"),
            (lambda: plan_moe(CFG, SLOW_PATH, COSTS, 8, candidates=True), r"^candidates: must be a list of schedule"),
            (lambda: plan_moe(CFG, SLOW_PATH, COSTS, 8, block_ms=[64.5]), r"^block_ms\[0\]=64\.5: must be BLOCK_M"),
            (lambda: plan_moe(CFG, SLOW_PATH, COSTS, 8, pacing=True), r"^pacing: must be a StorePacing or None, got"),
            (lambda: plan_moe(CFG, SLOW_PATH, COSTS, 8, pacings="0"), r"^pacings: must be a mapping of pacing spec"),
            (lambda: plan_moe(CFG, SLOW_PATH, COSTS, 8, pacings={"x": 5}), r"^pacings\['x'\]: must be a StorePacing")):
        with pytest.raises(InputError, match=match):
            call()
