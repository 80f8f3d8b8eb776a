"""Calibrate the store/compute interference term (`xstage.model.interference`) on microbenchmarks.

Two measurements, never the grids the planner is judged on:

- The onset, from the bystander benchmark (`benchmarks/experiments/store_then_load.py --bystanders`,
  `bystander_intensity.py`): readers keep their speed beside k_lo storing SMs and slow down beside
  k_hi. The onset lies between k_lo and k_hi full per-SM windows; the term takes their geometric mean.
- `per_storer`, from the fused MoE kernel's tiles beside a store kernel that saturates the link
  (`benchmarks/experiments/moe_busy_link.py`): the kernel (EP=1, no stores of its own, 132 - k CTAs)
  and k storing CTAs are simulated together (`busy_link_work`), and the one parameter is fitted so that
  the predicted slowdown (time beside the stores over time alone) matches the measured one, in log
  space, over the calibration shapes' rows.

Example:
    term, rows = fit_interference(bystander_rows, busy_rows, load_default_profile("host").params,
                                  load_default_costs("moe"))
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from xstage.errors import InputError
from xstage.model.interference import Interference
from xstage.model.params import PathParams
from xstage.sched.constants import planner_constants
from xstage.sched.costs import TaskCosts
from xstage.sched.moe import MoeConfig, moe_work
from xstage.sched.simulate import simulate_kernel
from xstage.sched.work import KernelWork, Task
from xstage.spec.moe import MODEL_SHAPES, MoeShape, parse_block

SLOWED, KEPT = 1.5, 1.1  # reader slowdowns that count as slowed / as unchanged
STORE_PASS = 1 << 20  # bytes per storing CTA and pass in both benchmarks


def onset_from_bystanders(rows: Sequence[dict], window_bytes: float) -> tuple[float, int, int]:
    """(onset bytes, k_lo, k_hi) from rows with `storing_ctas` and `slowdown` (reader time beside the
    storers over reader time alone): k_lo the most storers with slowdown <= KEPT, k_hi the fewest
    with slowdown >= SLOWED."""
    kept = [int(r["storing_ctas"]) for r in rows if float(r["slowdown"]) <= KEPT and int(r["storing_ctas"]) > 0]
    slowed = [int(r["storing_ctas"]) for r in rows if float(r["slowdown"]) >= SLOWED]
    if not kept or not slowed:
        raise InputError("bystander rows: need a storer count that leaves readers at speed and one that slows them")
    k_lo, k_hi = max(kept), min(slowed)
    if k_lo >= k_hi:
        raise InputError(f"bystander rows: readers keep their speed with {k_lo} storers but slow with {k_hi}")
    return math.sqrt(k_lo * k_hi) * window_bytes, k_lo, k_hi


def busy_link_work(shape: str, tokens: int, storing_ctas: int, costs: TaskCosts, num_sms: int,
                   passes: int = 60, busy: bool = True, scale: float = 1.0) -> KernelWork:
    """The MoE kernel at EP=1 on `num_sms - storing_ctas` CTAs, its tasks' times x `scale`, beside (when
    `busy`) `storing_ctas` CTAs that each store `passes` x 1 MiB to destination 1 (a plain store
    kernel: no loads)."""
    if not 0 < storing_ctas < num_sms:
        raise InputError(f"storing_ctas={storing_ctas}: must be between 1 and {num_sms - 1}")
    block = parse_block(None, MoeShape.parse(shape).hidden)  # the measured kernel's default tiles
    cfg = MoeConfig.parse(shape, tokens_per_rank=tokens, ep=1, block_n2=block.block_n2)
    moe = moe_work(cfg, "expert_wave", costs, num_ctas=num_sms - storing_ctas)
    # The MoE CTAs take tasks from the shared queue; a storer's last task waits for the queue's last
    # task, so storers never take MoE tasks (they are another kernel).
    queue = [dataclasses.replace(t, compute_ns=t.compute_ns * scale) for t in moe.queue]
    last = (queue[-1].name,)
    storers = [[Task(f"store.{c}.{j}", 0.0, stores={1: STORE_PASS}) for j in range(passes if busy else 0)]
               + [Task(f"store.{c}.end", 0.0, deps=last)] for c in range(storing_ctas)]
    return KernelWork(ctas=[[] for _ in range(num_sms - storing_ctas)] + storers, dest_path={1: "store"},
                      queue=queue)


def scaled_busy_link_work(row: dict, store_path: PathParams, costs: TaskCosts, num_sms: int) -> KernelWork:
    """`busy_link_work` of one busy-link row, its MoE tasks scaled to reproduce the kernel's measured
    time alone on its CTAs: the tiles were traced with every SM computing, and on fewer CTAs each tile
    gets more of HBM. What remains to predict is the term's slowdown alone."""
    shape, tokens, k = str(row["shape"]), int(row["tokens"]), int(row["storing_ctas"])
    alone = simulate_kernel(busy_link_work(shape, tokens, k, costs, num_sms, busy=False), {"store": store_path})
    return busy_link_work(shape, tokens, k, costs, num_sms, scale=float(row["idle_ns"]) / alone.time_ns)


def predict_slowdown(row: dict, store_path: PathParams, term: Interference, costs: TaskCosts,
                     num_sms: int, work: KernelWork | None = None) -> float:
    """Predicted time of the MoE kernel beside the storers over its measured time alone, for one busy-link
    row (`work`: its `scaled_busy_link_work`, built here when not given)."""
    busy = work if work is not None else scaled_busy_link_work(row, store_path, costs, num_sms)
    res = simulate_kernel(busy, {"store": store_path}, interference={"store": term})
    return max(res.task_end_ns[t.name] for t in busy.queue) / float(row["idle_ns"])


def fit_interference(bystander_rows: Sequence[dict], busy_rows: Sequence[dict], store_path: PathParams,
                     costs: TaskCosts, num_sms: int = 132, shapes: Sequence[str] = MODEL_SHAPES,
                     provenance: dict | None = None) -> tuple[Interference, list[dict]]:
    """The fitted term and one row per busy-link measurement (measured and predicted slowdown, and
    whether the row calibrated the fit or only checks it)."""
    onset, k_lo, k_hi = onset_from_bystanders(bystander_rows, store_path.c_sm)
    fit_rows = [r for r in busy_rows if r["shape"] in shapes]
    if not fit_rows:
        raise InputError(f"busy-link rows: none of the calibration shapes {list(shapes)}")

    def term(per_storer: float) -> Interference:
        return Interference(per_storer, onset, store_path.c_sm,
                            provenance=dict(provenance or {}, onset_storers=[k_lo, k_hi]))

    works = [scaled_busy_link_work(r, store_path, costs, num_sms) for r in busy_rows]  # per_storer-free

    def loss(per_storer: float) -> float:
        return sum(math.log(predict_slowdown(r, store_path, term(per_storer), costs, num_sms, w) / _measured(r)) ** 2
                   for r, w in zip(busy_rows, works) if r["shape"] in shapes)

    lo, hi = 0.0, 2.0  # golden-section search: the slowdown grows monotonically with per_storer
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(30):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = loss(b)
    best = term(round((lo + hi) / 2, 4))
    out = []
    for r, w in zip(busy_rows, works):
        pred = predict_slowdown(r, store_path, best, costs, num_sms, w)
        out.append({"shape": r["shape"], "tokens": int(r["tokens"]), "storing_ctas": int(r["storing_ctas"]),
                    "measured": round(_measured(r), 3), "predicted": round(pred, 3),
                    "rel_err": round(pred / _measured(r) - 1, 4),
                    "role": "calibration" if r["shape"] in shapes else "check"})
    return best, out


# Which rows the unpaced drain is fitted on, with why (data: unpaced_drain_fit): storing CTAs whose unpaced
# tile bursts keep the host link busy, and the footprint beyond which scattered rows cap the link anyway.
UNPACED_SATURATING_STORERS = planner_constants().unpaced_saturating_storers
UNPACED_MAX_FOOTPRINT = planner_constants().unpaced_max_footprint


def unpaced_drain_from(rows: Sequence[dict]) -> tuple[float, int]:
    """(bytes per second, rows used): the median host rate of unpaced rows of
    `benchmarks/experiments/tiles_beside_tile_stores.py` with at least `UNPACED_SATURATING_STORERS`
    storing CTAs (the link saturated) over a footprint of at most `UNPACED_MAX_FOOTPRINT` (where the
    scatter itself does not cap the link; over 1 GiB it caps paced and unpaced bursts alike)."""
    rates = [float(r["host_gbps"]) * 1e9 for r in rows
             if str(r.get("pacing", "off")) == "off" and int(r["storing_ctas"]) >= UNPACED_SATURATING_STORERS
             and int(r["footprint_mib"]) << 20 <= UNPACED_MAX_FOOTPRINT]
    if not rates:
        raise InputError("unpaced drain: no unpaced row with a saturated link over a small footprint")
    return statistics.median(rates), len(rates)


def fit_unpaced_bias(pairs: Sequence[tuple[float, float, float, float]]) -> float:
    """Geometric mean over (predicted unpaced, predicted paced, measured unpaced, measured paced) of the
    measured unpaced/paced ratio over the predicted one: how much slower unpaced kernels run, next to
    their paced twins, than the model says (`Interference.unpaced_bias`)."""
    if not pairs:
        raise InputError("unpaced bias: no (predicted, measured) pairs of unpaced and paced kernels")
    logs = []
    for pred_off, pred_paced, meas_off, meas_paced in pairs:
        if min(pred_off, pred_paced, meas_off, meas_paced) <= 0:
            raise InputError(f"unpaced bias: times must be > 0, got {(pred_off, pred_paced, meas_off, meas_paced)}")
        logs.append(math.log((meas_off / meas_paced) / (pred_off / pred_paced)))
    return math.exp(sum(logs) / len(logs))


def _measured(row: dict) -> float:
    return float(row["busy_ns"]) / float(row["idle_ns"])
