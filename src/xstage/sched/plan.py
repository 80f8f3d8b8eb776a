"""The planner: predict every candidate schedule of a fused kernel with the Burst-Gap model and pick.

For a MoE configuration, a store-path profile and measured tile costs, each candidate order
(`expert_wave`, `interleaved`, `lag:k`) is turned into its task graph (`moe_work`) and simulated
(`simulate_kernel`, with the path's store/compute interference term where one was calibrated); the
table is sorted by predicted kernel time. Given several store pacings (`pacings`), every schedule is
ranked under each of them. The choices a kernel leaves open are made from these tables by the policy
(`xstage.sched.policy`: `choose_schedule`, `choose_pacing`).

Example:
    from xstage.model import load_default_profile
    cfg = MoeConfig.parse("H4096-I2048-E256-K6", tokens_per_rank=1024, ep=8)
    rows = plan_moe(cfg, load_default_profile().params, load_default_costs("moe"), num_ctas=default_ctas())
    print(rows[0].schedule, rows[0].time_ns)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from xstage.bounds import MAX_SMS, check_instance, check_int, check_sequence
from xstage.errors import InputError
from xstage.model import Profile, load_default_profile
from xstage.model.interference import Interference
from xstage.model.params import PathParams
from xstage.sched.constants import planner_constants
from xstage.sched.costs import TaskCosts
from xstage.sched.moe import MoeConfig, check_seed, moe_work, simulate_remote
from xstage.sched.simulate import SimResult
from xstage.spec.pacing import StorePacing, spec_of
from xstage.spec.schedule import CANDIDATES, PoolTooSmallError, check_schedule, per_call

# Persistent CTAs the planner simulates: a GPU's SMs x the CTAs per SM the kernel keeps (132 x 9 at most
# on an H200); the simulation's time grows with them, and past the tasks more CTAs only idle.
MAX_PLAN_CTAS = 4 * MAX_SMS
CTAS_MEANING = "persistent CTAs the planner simulates"
# Tokens per rank `xstage plan moe` simulates: every tile is a task, so time and memory grow with tokens
# x top-k; 65536 is 4x the largest benchmarked count and still takes minutes, not hours.
MAX_PLAN_TOKENS = 1 << 16


@dataclass(frozen=True)
class PlanRow:
    schedule: str
    block_m: int
    time_ns: float
    breakdown: dict[str, float]
    result: SimResult
    pacing: str = "off"  # the pacing spec it was predicted with (`xstage.moe.pacing`)
    rank_ns: float = 0.0  # what the ranking compares (`rank_ns`)

    @property
    def variant(self) -> str:
        """`SCHEDULE@PACING` (`xstage.moe.Variant`)."""
        return f"{self.schedule}@{self.pacing}"

    def as_dict(self) -> dict:
        return {"schedule": self.schedule, "pacing": self.pacing, "block_m": self.block_m, "time_ns": self.time_ns,
                **self.breakdown}


def rank_ns(time_ns: float, pacing: StorePacing | None, interference: Interference | None) -> float:
    """What the planner compares across candidates: the predicted time, an unpaced one multiplied by
    the term's measured `unpaced_bias` (what the interference term still misses on unpaced kernels)."""
    return time_ns * (interference.unpaced_bias if pacing is None and interference is not None else 1.0)


def plan_moe(
    cfg: MoeConfig,
    path: PathParams,
    costs: TaskCosts,
    num_ctas: int,
    candidates: Sequence[str] = CANDIDATES,
    block_ms: Sequence[int] | None = None,
    seed: int = 0,
    pacing: StorePacing | None = None,
    progress=None,
    interference: Interference | None = None,
    pacings: Mapping[str, StorePacing | None] | None = None,
) -> list[PlanRow]:
    """Every candidate (schedule x block_m) with its predicted kernel time, fastest first; `pacing` is
    the kernel's store pacing (`xstage.comm.pacing`), None for unpaced stores; `pacings` (spec ->
    pacing), when given, ranks every candidate under each of them instead (by `rank_ns`). `interference` is the store
    path's interference term (`xstage.model.interference`; None: off). `progress(done, total)` is
    called after each candidate's simulation. Every argument is checked before the first one."""
    check_instance(cfg, "cfg", MoeConfig, "a MoeConfig")
    check_instance(path, "path", PathParams, "the store path's PathParams")
    check_instance(costs, "costs", TaskCosts, "the kernel's TaskCosts")
    num_ctas = check_int(num_ctas, "num_ctas", 1, MAX_PLAN_CTAS, CTAS_MEANING)
    seed = check_seed(seed)
    candidates = check_candidates(candidates)
    if interference is not None and not isinstance(interference, Interference):
        raise InputError(f"interference: expected an Interference or None, got {type(interference).__name__}")
    block_ms = check_sequence(block_ms, "block_ms", int, "BLOCK_M values") if block_ms is not None else None
    configs = [cfg.with_blocks(block_m=bm) for bm in block_ms or (cfg.block_m,)]  # MoeConfig checks block_m
    check_instance(pacing, "pacing", (StorePacing, type(None)), "a StorePacing or None")
    if pacings is not None:
        check_instance(pacings, "pacings", Mapping, "a mapping of pacing spec to StorePacing or None")
        for spec, p in pacings.items():
            check_instance(p, f"pacings[{spec!r}]", (StorePacing, type(None)), "a StorePacing or None")
    paced = dict(pacings) if pacings else {spec_of(pacing): pacing}
    rows = []
    total = len(configs) * len(candidates) * len(paced)
    done = 0
    for c in configs:
        for name in candidates:
            try:
                work = moe_work(c, name, costs, num_ctas, seed=seed)
            except PoolTooSmallError:
                done += len(paced)
                continue  # the kernel's row pool cannot run this order: not a candidate
            for spec, p in paced.items():
                done += 1
                res = simulate_remote(work, path, p, interference, trace_backlog=True)
                rows.append(PlanRow(name, c.block_m, res.time_ns, res.breakdown(), res, pacing=spec,
                                    rank_ns=rank_ns(res.time_ns, p, interference)))
                if progress:
                    progress(done, total)
    if not rows:
        raise InputError(f"candidates {list(candidates)}: none fits a row pool of {cfg.pool_units} units")
    rows.sort(key=lambda r: r.rank_ns)
    return rows


def check_candidates(candidates) -> list[str]:
    """`candidates` as a non-empty list of orders the planner can simulate (`check_plannable`)."""
    candidates = check_sequence(candidates, "candidates", str, "schedule names")
    if not candidates:
        raise InputError("candidates: at least one schedule is needed")
    for name in candidates:
        check_plannable(name)
    return list(candidates)


def check_plannable(name) -> None:
    """An order the planner can simulate: a registered order (`lag:k` included), not a per-call chooser."""
    check_schedule(name)
    if per_call(name):
        raise InputError(f"schedule {name!r}: chosen per call, not an order the planner can rank")
    return name


def pick_moe_schedule(cfg: MoeConfig, path: PathParams, costs: TaskCosts, num_ctas: int, **kw) -> str:
    """The name of the schedule with the lowest predicted kernel time."""
    return plan_moe(cfg, path, costs, num_ctas, **kw)[0].schedule


def moe_path_params(path: str) -> PathParams:
    """The store path the planner assumes for a MoE buffer's remote rows.

    `host` and `peer` use the embedded profile of that path. `hbm` has no knee in the H200 probe's
    control run, so it is a path without windows at the issue rate and drain measured there, where only
    issue cost remains (`xstage.sched.constants`, with their provenance)."""
    if path == "hbm":
        c = planner_constants()
        return PathParams(r0=c.hbm_issue_rate, c_sm=math.inf, drain=c.hbm_drain, capacity=math.inf)
    return load_default_profile(path).params


def default_ctas(profile: Profile | None = None) -> int:
    """Persistent CTAs to plan for: this GPU's SM count, else the SM count the profile was measured on."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).multi_processor_count
    return (profile or load_default_profile()).sm_count
