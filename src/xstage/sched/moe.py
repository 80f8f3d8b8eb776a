"""The fused MoE kernel's schedules as `KernelWork`: tasks, tile costs and combine stores.

A MoE configuration (shape, tokens per rank, EP size, block sizes) and a schedule name give the
kernel's schedule table (`xstage.moe.schedule.make_schedule`, the same table the kernel runs); each
row becomes a `Task` whose compute time comes from measured tile costs (`TaskCosts`) and whose
LINEAR2 epilogue stores the unit's output rows: the rows of other ranks' tokens go through the
`remote` store path, the own rank's rows are local.

Routing for planning is synthetic: every token of every rank picks `topk` experts uniformly, so a
local expert's row count is Binomial(tokens x EP, topk / experts) (seeded), of which Binomial(rows,
1 / EP) are rank 0's own; as in the kernel's routing layout those fill the expert's first units.

Example:
    cfg = MoeConfig.parse("H4096-I2048-E256-K6", tokens_per_rank=4096, ep=8)
    work = moe_work(cfg, "lag:2", load_default_costs("moe"), num_ctas=default_ctas())
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from xstage.bounds import INT64_MAX, MAX_RANKS, check_int
from xstage.errors import InputError
from xstage.model.interference import Interference
from xstage.model.params import PathParams
from xstage.sched.constants import planner_constants
from xstage.sched.costs import TaskCosts
from xstage.sched.simulate import SimResult, simulate_kernel
from xstage.sched.tilecost import tile_work
from xstage.sched.work import KernelWork, Task, require_positive_ints
from xstage.spec.moe import (
    MAX_EXPERTS,
    MAX_HIDDEN,
    MAX_TOKENS_PER_RANK,
    BlockConfig,
    MoeShape,
    check_block_size,
    parse_block,
)
from xstage.spec.pacing import StorePacing
from xstage.spec.schedule import DISPATCH, KIND_NAMES, LINEAR1, LINEAR2, make_schedule

REMOTE = 1  # destination id of "other ranks" in MoE work; the local rank (0) has no store path
REMOTE_PATH = "remote"  # the store path name of those destinations

_BLOCK = BlockConfig()  # the kernel's block defaults, the one place they live


@dataclass(frozen=True)
class MoeConfig:
    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    tokens_per_rank: int
    ep: int
    block_m: int = _BLOCK.block_m
    block_n1: int = _BLOCK.block_n1
    block_n2: int = _BLOCK.block_n2
    block_k: int = _BLOCK.block_k
    elem_bytes: int = 2  # operands: rows, activations, weights (1 on an FP8 buffer)
    dynamic: bool = _BLOCK.dynamic  # CTAs take tasks from the global order when free
    # Units of block_m rows the kernel's row pool holds (`MoEBuffer.pool_units`); None: every unit.
    pool_units: int | None = None
    # Combine rows (the remote stores); 0: as `elem_bytes`. An FP8 buffer's combine rows are BF16 (2).
    out_elem_bytes: int = 0

    @property
    def store_elem_bytes(self) -> int:
        return self.out_elem_bytes or self.elem_bytes

    def __post_init__(self):
        for name, hi, what in (("hidden", MAX_HIDDEN, "elements per row"),
                               ("intermediate", MAX_HIDDEN, "elements per expert row"),
                               ("num_experts", MAX_EXPERTS, "experts of the layer"),
                               ("tokens_per_rank", MAX_TOKENS_PER_RANK, "tokens per rank"),
                               ("ep", MAX_RANKS, "expert-parallel ranks")):
            object.__setattr__(self, name, check_int(getattr(self, name), f"MoE config {name}", 1, hi, what))
        require_positive_ints(self, ("topk", "block_m", "block_n1", "block_n2", "block_k", "elem_bytes"), "MoE config")
        # The kernel's tile extents (`BlockConfig`); block_n2 may also be the whole hidden size (a buffer
        # whose hidden size is below its block_n2 stores `hidden` columns per tile).
        for name in ("block_m", "block_n1", "block_n2", "block_k"):
            if name != "block_n2" or self.block_n2 != self.hidden:
                check_block_size(getattr(self, name), f"MoE config {name}")
        if self.num_experts % self.ep:
            raise InputError(f"num_experts={self.num_experts}: must be a multiple of ep={self.ep}")
        if self.topk > self.num_experts:
            raise InputError(f"topk={self.topk}: must be <= num_experts={self.num_experts}")
        if self.intermediate % self.block_n1:
            raise InputError(f"intermediate={self.intermediate}: must be a multiple of block_n1={self.block_n1}")

    @classmethod
    def parse(cls, shape: str, **kw) -> MoeConfig:
        """`"H4096-I2048-E256-K6"` (`xstage.moe.MoeShape`) plus keyword fields (tokens_per_rank, ep,
        block sizes)."""
        h, i, e, k = MoeShape.parse(shape)
        return cls(hidden=h, intermediate=i, num_experts=e, topk=k, **kw)

    @property
    def shape(self) -> str:
        return str(MoeShape(self.hidden, self.intermediate, self.num_experts, self.topk))

    @property
    def block(self) -> str:
        """Tile config key `BMxBN1xBN2xBK`, as in benchmark rows and task costs."""
        return f"{self.block_m}x{self.block_n1}x{self.block_n2}x{self.block_k}"

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep

    def with_blocks(self, **blocks) -> MoeConfig:
        return replace(self, **blocks)


# An FP8 buffer's byte sizes: 1-byte operands, BF16 combine rows (the stores).
FP8_ELEM_BYTES = dict(elem_bytes=1, out_elem_bytes=2)


def moe_dtype_fields(dtype: str, hidden: int) -> dict:
    """The `MoeConfig` fields a buffer of `dtype` ("bf16" or "fp8") changes from the BF16 defaults: for
    FP8, its byte sizes and its default tiles (`xstage.moe.problem.parse_block(None, hidden, fp8=True)`)."""
    if dtype != "fp8":
        return {}
    c = parse_block(None, hidden, fp8=True)
    return dict(FP8_ELEM_BYTES, block_m=c.block_m, block_n1=c.block_n1, block_n2=min(c.block_n2, hidden),
                block_k=c.block_k, dynamic=c.dynamic)


HELD_STORE_WINDOW = planner_constants().held_store_window  # bytes: one vector store (data: remote_path)


def remote_path(params: PathParams, pacing: StorePacing | None = None, unpaced_drain: float = 0.0) -> PathParams:
    """The store path as a persistent kernel's tasks meet it (the MoE kernel's, and the Ulysses
    kernel's in `xstage.sched.ulysses`): the link without a per-SM window. A paced kernel's pacer is
    not part of the path: `simulate_remote` plays it ahead of the link (`simulate_kernel(pacers=...)`).

    The probe's compute gaps are FMA chains, which run while the SM still holds up to `c_sm` of its
    burst. Every MoE task starts by loading its operands, and on the H200 host link those loads queue
    behind the stores the SM still holds (`benchmarks/store_then_load.py`: 1 MiB of reads take 58 us
    alone, 154 us after a 64 KiB burst from every SM). So the next task can overlap only with stores
    that already left the SM, and the per-SM window shrinks to one vector store. Measured on the host
    link only; on `peer` and `hbm` the same rule is an assumption (on `hbm` it changes nothing: stores
    leave the SM at its issue rate). A full shared level also slows the loads of other SMs
    (`benchmarks/results/h200-store-then-load/`): the simulator's interference term, not this path.
    Pacing keeps the shared level from filling.

    Unpaced, the path drains at most `unpaced_drain` (bytes per second; 0: its own drain), the rate
    the interference term measured for many CTAs' unpaced tile-sized bursts of scattered rows
    (`xstage.model.interference.Interference.unpaced_drain`). Even so, unpaced kernels whose link is
    not saturated come out short (`benchmarks/results/unpaced-diagnosis/`). Paced, the link keeps
    its own drain (paced rows kept 46-50 GB/s in `benchmarks/results/h200-tiles-beside-tile-stores/`)."""
    p = params.replace(c_sm=min(params.c_sm, HELD_STORE_WINDOW))
    if pacing is None and unpaced_drain > 0:
        return p.replace(drain=min(p.drain, unpaced_drain))
    return p


def simulate_remote(work: KernelWork, path: PathParams, pacing: StorePacing | None = None,
                    interference: Interference | None = None, **kw) -> SimResult:
    """`simulate_kernel` of a kernel whose stores go to its one remote path `path` (as `moe_work` and
    `xstage.sched.ulysses` name it), paced by `pacing` (None: unpaced), with the path's interference
    term (None: off). `kw` goes to `simulate_kernel` (`trace_backlog`, `engine`)."""
    drain = interference.unpaced_drain if interference is not None else 0.0
    return simulate_kernel(work, {REMOTE_PATH: remote_path(path, pacing, drain)},
                           interference={REMOTE_PATH: interference} if interference is not None else None,
                           pacers={REMOTE_PATH: pacing} if pacing is not None else None, **kw)


def check_seed(seed, arg: str = "seed") -> int:
    """A seed of the synthetic routing: an integer in 0..2^63 - 1 (numpy takes any; int64 is the bound)."""
    return check_int(seed, arg, 0, INT64_MAX, "seed of the synthetic routing")


def synthetic_routing(cfg: MoeConfig, seed: int = 0) -> tuple[list[int], list[int], list[int]]:
    """(local expert, valid rows, rows from other ranks) of each unit of rank 0 under uniform synthetic
    routing. The kernel's routing layout (`xstage.moe.layout.routing_layout`) orders an expert's rows
    by source rank, so rank 0's own rows (Binomial(rows, 1 / EP) of them) fill its first units and
    the rows its LINEAR2 tasks store to other ranks sit in the later ones: the remote stores come in a
    run per expert, not spread evenly."""
    rng = np.random.default_rng(check_seed(seed))
    counts = rng.binomial(cfg.tokens_per_rank * cfg.ep, cfg.topk / cfg.num_experts, size=cfg.local_experts)
    own = rng.binomial(counts, 1.0 / cfg.ep)  # drawn after the counts: the counts keep their values per seed
    experts, rows, remote = [], [], []
    for e, (c, c_own) in enumerate(zip(counts.tolist(), own.tolist())):
        for i in range(-(-c // cfg.block_m)):
            first, n = i * cfg.block_m, min(cfg.block_m, c - i * cfg.block_m)
            experts.append(e)
            rows.append(n)
            remote.append(n - min(n, max(0, c_own - first)))
    return experts, rows, remote


def routes_rows(cfg: MoeConfig, seed: int = 0) -> bool:
    """Whether the synthetic routing (`synthetic_routing`) routes any row to rank 0. At the smallest
    token counts of some shapes it routes none: the kernel then has no task to predict, and the
    buffer's planner (`xstage.sched.plan.pick_for_moe_buffer`) answers with a defined choice."""
    return bool(synthetic_routing(cfg, seed)[0])


def task_work(cfg: MoeConfig, kind: int) -> float:
    """Work of one task: FLOPs of a full BLOCK_M tile (tensor cores compute the padded tile), or bytes."""
    if kind == DISPATCH:
        return float(cfg.block_m * cfg.hidden * cfg.elem_bytes)
    if kind == LINEAR1:
        return 2.0 * cfg.block_m * (2 * cfg.block_n1) * cfg.hidden
    return 2.0 * cfg.block_m * min(cfg.block_n2, cfg.hidden) * cfg.intermediate


def tile_load_bytes(cfg: MoeConfig, kind: int, rows_per_expert: float) -> float:
    """Bytes a task loads (`xstage.sched.tilecost.tile_work`): a GEMM tile's whole weight slab and its
    unit's activation rows, from L2 or HBM; a dispatch copy its unit's rows."""
    w = tile_work(KIND_NAMES[kind], cfg.shape, cfg.block, rows_per_expert, cfg.elem_bytes)
    return w.copy_bytes if kind == DISPATCH else w.load_bytes


def mem_share(load_bytes: float, task_ns: float) -> float:
    """The share of a task's time that its loads would take at an SM's share of HBM bandwidth, at most 1
    (`Task.mem_share`). Every operand byte counts, L2 hits included: beside a saturated host link the
    kernel's tiles slow alike whether their expert's weights are shared through L2 or not (fitted both
    ways on `benchmarks/results/h200-moe-busy-link/`, this one predicts the shape with L2 sharing within
    16% instead of 48%; `benchmarks/results/h200-interference/`)."""
    share = planner_constants().hbm_bytes_per_ns_per_sm  # an SM's share of HBM bandwidth when all stream
    return min(1.0, load_bytes / (share * task_ns)) if task_ns > 0 else 0.0


def moe_work(cfg: MoeConfig, schedule: str, costs: TaskCosts, num_ctas: int, seed: int = 0) -> KernelWork:
    experts, rows, remote_rows = synthetic_routing(cfg, seed)
    if not experts:
        raise InputError(f"{cfg.shape} at {cfg.tokens_per_rank} tokens: no rows routed to rank 0")
    n1 = cfg.intermediate // cfg.block_n1
    n2 = -(-cfg.hidden // cfg.block_n2)
    table = make_schedule(schedule, experts, num_ctas, n1, n2, unit_rows=rows, pool_units=cfg.pool_units)
    reuse = cfg.pool_units if cfg.pool_units and cfg.pool_units < len(experts) else None
    shape_key = f"H{cfg.hidden}-I{cfg.intermediate}-E{cfg.num_experts}-K{cfg.topk}"
    rows_per_expert = cfg.tokens_per_rank * cfg.topk * cfg.ep / cfg.num_experts
    # A task occupies its CTA for the tile plus the fetch before it (next task, its inputs' check).
    kind_time = {k: costs.fetch_ns + costs.tile_ns(KIND_NAMES[k], cfg.block, shape_key, rows_per_expert,
                                                   task_work(cfg, k), elem_bytes=cfg.elem_bytes, schedule=schedule)
                 for k in (DISPATCH, LINEAR1, LINEAR2)}
    # Rounded so tasks of one kind share one clock in the simulator's interference term.
    kind_share = {k: round(mem_share(tile_load_bytes(cfg, k, rows_per_expert), kind_time[k]), 3)
                  for k in (DISPATCH, LINEAR1, LINEAR2)}
    n_cols = min(cfg.block_n2, cfg.hidden)

    def name(kind: int, u: int, nb: int) -> str:
        return f"{KIND_NAMES[kind]}.{u}.{nb}"

    def tasks(rows) -> list[Task]:
        out = []
        for kind, u, nb, *_ in rows.tolist():
            if kind == DISPATCH:
                # The row pool: unit u takes the slot of unit u - pool_units once all its LINEAR2 are done.
                deps: tuple[str, ...] = ()
                if reuse and u >= reuse:
                    deps = tuple(name(LINEAR2, u - reuse, j) for j in range(n2))
            elif kind == LINEAR1:
                deps = (name(DISPATCH, u, 0),)
            else:
                deps = tuple(name(LINEAR1, u, j) for j in range(n1))
            stores = {}
            if kind == LINEAR2 and remote_rows[u] > 0:
                stores = {REMOTE: remote_rows[u] * n_cols * cfg.store_elem_bytes}
            out.append(Task(name(kind, u, nb), kind_time[kind], stores=stores, deps=deps, kind=KIND_NAMES[kind],
                            mem_share=kind_share[kind]))
        return out

    # Tiles run faster while fewer CTAs compute beside them (fitted with the order effect).
    occupancy = costs.order.occupancy_factor if costs.order is not None and costs.order.has_occupancy else None
    if cfg.dynamic:
        return KernelWork(ctas=[[] for _ in range(num_ctas)], dest_path={REMOTE: REMOTE_PATH},
                          queue=tasks(table.global_order()), occupancy=occupancy)
    return KernelWork(ctas=[tasks(table.cta_tasks(c)) for c in range(num_ctas)], dest_path={REMOTE: REMOTE_PATH},
                      occupancy=occupancy)
