"""The Ulysses exchange planner: predicted time of every mechanism, from tile and copy costs.

Problem: for one call shape (heads, head dim, tokens, group size, path, dtype), say what each
exchange (`xstage.attention.exchange`) will cost beyond attention alone, fast enough to decide at
the first call (`exchange="auto"`), and pick the fastest.

Model (rank 0 of P, `h` heads over the whole sequence of S tokens, a grid of `grid` programs):
- attention on `rows` query rows with core c: `a_c + b_c * rounds * 4 * 128 * S * D`, where
  `rounds = ceil(h * ceil(rows / 128) / grid)` (the kernels run 128-row query tiles, a wave of
  `grid` at a time); `a_c`, `b_c` per core and head dim;
- a copy-engine send of n bytes to the path: `x0 + n / rate` (after the Triton core; the cuDNN
  core adds a `[B, h, S, D]` -> sequence-major copy, fitted in its own pair);
- `serial`: attention, then one send of every remote row;
- `overlap`: the blocks of `overlap_blocks` on two alternating streams (`xstage.attention.overlap`):
  block i may start when block i - 2 is done. Their tiles (one head x 128 rows) run `grid` at a
  time, each as long as one round of attention alone times `1 + k`, a free slot taking a tile of
  the earliest block that may start (`wave_done`: the hardware serves the grid launched first, and
  the last, partial wave is what a block's copy may wait for). A block ends `z` after its last tile
  (its launch; the cuDNN core's copy into the sequence-major layout). Its sends (one per destination
  its rows reach) start when both block i and the sends before are done, each `y0 + n /
  overlap_rate`; the time is the later of the last compute and the last send. `y0`,
  `overlap_rate`, `z` and `k` are fitted on the calibration's `overlap` rows, per core (without
  them: the serial copy's costs, z = k = 0), since a copy beside running attention is not the
  serial copy. While a send is in flight the tiles run `1 + k` times as long (the copy engine's
  reads share the memory system with them): compute that overlaps a send of length d ends `k * d`
  later. Slowing every tile instead (the earlier model) fitted the calibration of commit d77f19c
  worse (in-sample median 1.80% / 1.73% for the ranked cuDNN cuts, against 1.57% / 1.40%) and put
  1.7% of attention on the long sequences, whose sends are a few percent of the kernel;
- `stores`: the Triton kernel with the exchange in its epilogue. Its key loop runs slower than
  attention alone even on a link-free path (register pressure of the send code; see
  `benchmarks/results/h200-ulysses-trace/`): a factor `1 + s`, plus `c` per round of tiles (each
  tile parks its rows and sends them in chunks, whatever its length), per head dim and pacing; the
  link must still carry every remote byte at the path's drain rate, and the last round's rows
  drain after the kernel. (`s` alone, fitted on the long kernels, left an in-sample median of 3.1%
  at D = 128 on that calibration; with `c`, 1.1%.) `s` and `c` are fitted apart for sequence lengths that are and are
  not multiples of 16: Triton compiles a separate kernel for each, and the fused one runs 2-7% slower
  without the divisibility (`benchmarks/results/h200-ulysses-length-specialization/`).
Every coefficient is fitted by least squares on a calibration grid (`xstage bench ulysses --grid
calibration`: other head counts and sequence lengths than the grid the planner is judged on) by
`xstage.calibrate.exchange`; the default fit, of the H200 host-path calibration embedded in
`xstage/data`, ships as data (`default_exchange_costs`). No term depends on the
head count, yet the fused kernel's overhead over attention does at one length and P: the
calibration holds two head counts at D = 128, so that its `stores` fit is not one count's.

Example:
    >>> from xstage.sched.exchange import default_exchange_costs, plan_exchange
    >>> ranked = plan_exchange(24, 128, 32760, 8, default_exchange_costs())
    >>> ranked[0].exchange in {r.exchange for r in ranked}
    True
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

from xstage.bounds import MAX_RANKS, check_instance, check_int, check_sequence, label
from xstage.errors import InputError, XstageError
from xstage.sched.constants import planner_constants
from xstage.spec.exchange import Exchange, parse_exchange
from xstage.spec.ulysses import SUPPORTED_HEAD_DIMS, UlyssesPlan, default_blocks, overlap_blocks, split_sizes

BLOCK_M = 128
# Ranked by default (`exchange="auto"`, `plan ulysses`): a measured choice, with its reasons, in
# `xstage/data/h200-planner-constants.json` (`xstage.sched.constants`).
CANDIDATES = planner_constants().exchange_candidates
CALIBRATION_CSV = "h200-ulysses-calibration.csv"
# Triton compiles integer arguments divisible by 16 apart; the fused kernel's sequence length is one
ALIGN = 16
# Attention heads over all ranks: the largest models have 128 query heads.
MAX_HEADS = 1024
# Sequence length over all ranks: 16M tokens, 16x the longest sequences attention runs on (video
# diffusion), where the blocks' wave arithmetic is still exact in float64.
MAX_SEQ_TOKENS = 1 << 24


@dataclass(frozen=True)
class Prediction:
    exchange: str
    time_ns: float
    attention_ns: float  # the same core's attention alone, predicted the same way

    @property
    def overhead_ns(self) -> float:
        return self.time_ns - self.attention_ns


@dataclass
class ExchangeCosts:
    """Fitted coefficients (ns; copy and overlap rates in bytes per ns, `drain` in bytes per second);
    see the module docstring."""

    attention: dict[tuple[str, int], tuple[float, float]]  # (core, D) -> (a_ns, ns per unit of rounds x work)
    copy: dict[str, tuple[float, float]]  # core -> (x0_ns, bytes per ns)
    # (burst, D, length a multiple of ALIGN) -> (slowdown s of the key loop, c ns per round)
    stores: dict[tuple[bool, int, bool], tuple[float, float]]
    drain: float  # bytes per second the in-kernel stores drain at
    grid: int = 132
    source: str = ""
    quality: dict = field(default_factory=dict)
    # core -> (y0 ns per send, bytes per ns, z ns per block, slowdown k of the tiles) of `overlap`
    overlap: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)

    def attention_ns(self, core: str, rows: int, heads: int, tokens: int, dim: int) -> float:
        a, b = self._att(core, dim)
        if rows <= 0:
            return 0.0
        rounds = math.ceil(heads * math.ceil(rows / BLOCK_M) / self.grid)
        return a + b * rounds * 4.0 * BLOCK_M * tokens * dim

    def _att(self, core: str, dim: int) -> tuple[float, float]:
        if (core, dim) in self.attention:
            return self.attention[(core, dim)]
        dims = sorted(d for c, d in self.attention if c == core)
        if not dims:
            raise InputError(f"exchange costs: no attention costs for core {core!r}")
        # per-FLOP cost of the nearest calibrated head dim (the work term carries D)
        near = min(dims, key=lambda d: abs(math.log2(d / dim)))
        return self.attention[(core, near)]

    def _copy(self, core: str) -> tuple[float, float]:
        if core not in self.copy:  # a calibration without `serial` rows of this core fits none
            raise InputError(f"exchange costs ({self.source or 'given'}): no copy costs for core {core!r} (its "
                             f"calibration has no serial:{core} rows beside attention:{core}); have "
                             f"{', '.join(sorted(self.copy)) or 'none'}")
        return self.copy[core]

    def copy_ns(self, core: str, nbytes: float) -> float:
        x0, rate = self._copy(core)
        return x0 + nbytes / rate if nbytes > 0 else 0.0

    def overlap_terms(self, core: str) -> tuple[float, float, float, float]:
        """(y0, rate, z, k) of `overlap` with `core`; without a fit, the serial copy's costs, z = k = 0."""
        if core in self.overlap:
            return self.overlap[core]
        return (*self._copy(core), 0.0, 0.0)


def check_head_dim(value, arg: str = "dim") -> int:
    """A head dim the attention kernel runs (`xstage.spec.ulysses.SUPPORTED_HEAD_DIMS`)."""
    dim = check_int(value, arg, 1, max(SUPPORTED_HEAD_DIMS), "head dim in elements")
    if dim not in SUPPORTED_HEAD_DIMS:
        raise InputError(f"{label(arg, value)}: must be one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))} (the head "
                         "dims the attention kernel runs)")
    return dim


def check_call_shape(heads, dim, tokens, ranks, args=("heads", "dim", "tokens", "ranks")) -> tuple[int, int, int, int]:
    """(heads, dim, tokens, ranks) of one Ulysses call, each checked (`args` names them), ranks <= heads."""
    h = check_int(heads, args[0], 1, MAX_HEADS, "attention heads over all ranks")
    d = check_head_dim(dim, args[1])
    t = check_int(tokens, args[2], 1, MAX_SEQ_TOKENS, "sequence length over all ranks")
    r = check_int(ranks, args[3], 1, MAX_RANKS, "sequence-parallel ranks")
    if r > h:
        raise InputError(f"{label(args[3], ranks)}: must be <= {label(args[0], heads)} (each rank gets heads)")
    return h, d, t, r


def _rank0(heads: int, dim: int, tokens: int, ranks: int) -> UlyssesPlan:
    heads, dim, tokens, ranks = check_call_shape(heads, dim, tokens, ranks)
    return UlyssesPlan(ranks, 0, 1, split_sizes(tokens, ranks), heads, dim)


def check_predictable(ex: str | Exchange) -> Exchange:
    """`ex` parsed, or an `InputError` when the planner cannot predict it (`auto`, `tma`)."""
    ex = parse_exchange(ex)
    if ex.mechanism in ("auto", "tma", "heads"):
        raise InputError(f"exchange {str(ex)!r}: the planner predicts serial, overlap and stores only (the whole "
                         "layer, heads:CORE:C included: xstage.sched.layer, `xstage plan layer`)")
    return ex


def predict(ex: str | Exchange, heads: int, dim: int, tokens: int, ranks: int, costs: ExchangeCosts,
            elem_bytes: int = 2) -> Prediction:
    """Predicted receiver-visible time of exchange `ex` for rank 0 of `ranks`."""
    ex = check_predictable(ex)
    plan = _rank0(heads, dim, tokens, ranks)
    check_instance(costs, "costs", ExchangeCosts,
                   "ExchangeCosts (xstage.calibrate.exchange.fit_exchange_costs, default_exchange_costs)")
    if check_int(elem_bytes, "elem_bytes", 1, 4, "bytes per element of the output") == 3:
        raise InputError("elem_bytes=3: must be 1, 2 or 4 (bytes per element of the output)")
    h = plan.heads_of(0)
    row_bytes = h * dim * elem_bytes
    remote = (tokens - plan.seq_lens[0]) * row_bytes
    core = "triton" if ex.in_kernel else ex.core
    alone = costs.attention_ns(core, tokens, h, tokens, dim)
    if ex.mechanism == "serial":
        return Prediction(str(ex), alone + costs.copy_ns(core, remote), alone)
    if ex.mechanism == "overlap":
        return Prediction(str(ex), _overlap_ns(plan, ex, core, tokens, dim, row_bytes, costs), alone)
    aligned = tokens % ALIGN == 0
    keys = [k for k in costs.stores if k[0] == ex.burst]
    if not keys:
        raise InputError(f"exchange costs: no `stores` costs for {str(ex)!r}")
    # the same compiled variant first (alignment), then the nearest head dim
    fit = costs.stores[min(keys, key=lambda k: (k[2] != aligned, abs(math.log2(k[1] / dim))))]
    return Prediction(str(ex), float(_stores_ns(alone, h, tokens, remote, fit, costs)), alone)


def _stores_ns(alone: float, heads: int, tokens: int, remote: float, fit: tuple[float, float],
               costs: ExchangeCosts) -> float:
    """The `stores` kernel's time (see the module docstring); `fit` = (s, c), each may be an array."""
    s, c = fit
    rounds = max(1, math.ceil(heads * math.ceil(tokens / BLOCK_M) / costs.grid))
    kernel = alone * (1.0 + s) + rounds * c
    link_ns = remote / costs.drain * 1e9  # every remote byte crosses the link at the drain rate
    tail = link_ns / rounds  # the last round's rows drain after the kernel
    return np.maximum(kernel, link_ns) + tail


def _overlap_geometry(plan: UlyssesPlan, ex: Exchange, row_bytes: int, grid: int
                      ) -> tuple[list[int], list[list[int]]]:
    """(tiles, bytes of each send) per `overlap` block, in order: what the blocks are, whatever they cost."""
    h = plan.heads_of(plan.rank)
    blocks = overlap_blocks(plan, ex.blocks or default_blocks(plan), BLOCK_M, cut=ex.cut, slots=grid)
    tok0 = plan.tok0
    tiles = [h * sum(-(-(hi - lo) // BLOCK_M) for lo, hi in ranges) for ranges in blocks]
    sends = [[n * row_bytes for lo, hi in ranges for p in range(plan.world)
              if p != plan.rank and (n := min(hi, tok0[p + 1]) - max(lo, tok0[p])) > 0] for ranges in blocks]
    return tiles, sends


def _overlap_steps(geometry, core: str, tokens: int, dim: int, costs: ExchangeCosts, block_ns: float = 0.0
                   ) -> list[tuple[float, list[int]]]:
    """(compute done, bytes of each send) per `overlap` block of `geometry` (`_overlap_geometry`), in
    order (see the module docstring), no send in flight: the blocks' tiles run as `wave_done` says,
    as long as alone, and each block ends `block_ns` after its last tile."""
    tiles, sends = geometry
    a, b = costs._att(core, dim)
    done = wave_done(tiles, costs.grid, b * 4.0 * BLOCK_M * tokens * dim, block_ns)
    return [(a + t, s) for t, s in zip(done, sends)]


def wave_done(tiles: Sequence[int], slots: int, tile_ns: float, block_ns: float = 0.0) -> list[float]:
    """When each block of attention tiles ends, on a machine that runs `slots` tiles at once, each
    `tile_ns` long. Block i (on stream i % 2) may start when block i - 2 has ended; a free slot
    takes a tile of the earliest block that may start (the hardware serves the grid launched
    first); a block ends `block_ns` after its last tile (its launch, the cuDNN core's layout copy).

    Example:
        >>> wave_done([6, 6, 2], slots=4, tile_ns=1.0)   # the third block waits for the first
        [2.0, 3.0, 4.0]
    """
    n = len(tiles)
    if any(t < 1 for t in tiles) or slots < 1:
        raise InputError(f"wave_done: every block needs a tile and the machine a slot, got {list(tiles)}, {slots}")
    left = [int(t) for t in tiles]
    start: list[float | None] = [0.0 if i < 2 else None for i in range(n)]
    done = [0.0] * n
    free = {0.0: slots}  # time -> slots that free up then
    pending = list(range(n))
    while pending:
        t = min(free)
        count = free.pop(t)
        for i in [i for i in pending if start[i] is not None and start[i] <= t]:
            k = min(count, left[i])
            left[i] -= k
            count -= k
            free[t + tile_ns] = free.get(t + tile_ns, 0) + k
            if left[i] == 0:  # tiles end in dispatch order: this one is the block's last
                done[i] = t + tile_ns + block_ns
                pending.remove(i)
                if i + 2 < n:
                    start[i + 2] = done[i]
            if count == 0:
                break
        if count:  # idle until the next slot frees or the next block may start
            nxt = min([*free, *(start[i] for i in pending if start[i] is not None and start[i] > t)])
            free[nxt] = free.get(nxt, 0) + count
    return done


def _overlap_time(steps, y0, rate, slowdown=0.0):
    """The later of the last block's compute and the last send, each send `y0 + n / rate` (ns, B/ns)
    in order, once its block and the send before are done. Compute that overlaps a send runs
    `1 + slowdown` times as long: a send of length d that starts while compute runs pushes every
    later compute end back by `slowdown * min(d, compute left)`. `y0`, `rate` (and `slowdown`) may be
    numpy arrays of candidates (the fit evaluates a grid at once).

    Example:
        >>> float(_overlap_time([(10.0, [20]), (30.0, [])], 0.0, 2.0, 0.5))  # the send: 10..20 ns
        35.0
    """
    if not steps:
        return 0.0
    t_copy, late = 0.0, 0.0  # end of the last send; how much later the compute ends than alone
    last = steps[-1][0]
    for t_comp, sends in steps:
        for n in sends:
            start = np.maximum(t_comp + late, t_copy)
            d = y0 + n / rate
            late = late + slowdown * np.clip(last + late - start, 0.0, d)
            t_copy = start + d
    return np.maximum(last + late, t_copy)


def _overlap_ns(plan: UlyssesPlan, ex: Exchange, core: str, tokens: int, dim: int, row_bytes: int,
                costs: ExchangeCosts) -> float:
    y0, rate, z, k = costs.overlap_terms(core)
    steps = _overlap_steps(_overlap_geometry(plan, ex, row_bytes, costs.grid), core, tokens, dim, costs, z)
    return float(_overlap_time(steps, y0, rate, k))


def plan_exchange(heads: int, dim: int, tokens: int, ranks: int, costs: ExchangeCosts,
                  candidates: Sequence[str] = CANDIDATES) -> list[Prediction]:
    """Every candidate's prediction, fastest first."""
    candidates = check_sequence(candidates, "candidates", (str, Exchange), "exchange spellings")
    if not candidates:
        raise InputError("candidates: at least one exchange is needed")
    preds = [predict(c, heads, dim, tokens, ranks, costs) for c in candidates]
    return sorted(preds, key=lambda p: p.time_ns)


def _line(xs, ys, scale=None) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b x; with `scale`, of the residuals divided by it."""
    w = 1.0 / np.asarray(scale, float) if scale is not None else np.ones(len(xs))
    A = np.vstack([np.ones(len(xs)), np.asarray(xs, float)]).T * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, np.asarray(ys, float) * w, rcond=None)
    return float(a), float(b)


def _rel_err(pred, meas) -> float:
    return float(np.median(np.abs(np.asarray(pred) / np.asarray(meas) - 1)))


COSTS_JSON = "h200-ulysses-exchange-costs.json"  # the fit of CALIBRATION_CSV, shipped (`xstage plan exchange-costs`)


def calibration_sha256() -> str:
    return hashlib.sha256((resources.files("xstage.data") / CALIBRATION_CSV).read_bytes()).hexdigest()


def costs_to_dict(costs: ExchangeCosts) -> dict:
    """`costs` as JSON-ready data: every coefficient, and where it came from (the calibration file and
    its SHA-256 when `costs` is the embedded fit)."""
    out = {"source": costs.source, "fit": "xstage.calibrate.exchange.fit_exchange_costs", "drain": costs.drain,
           "grid": costs.grid,
           "attention": [[core, dim, *v] for (core, dim), v in sorted(costs.attention.items())],
           "copy": [[core, *v] for core, v in sorted(costs.copy.items())],
           "stores": [[burst, dim, aligned, *v] for (burst, dim, aligned), v in sorted(costs.stores.items())],
           "overlap": [[core, *v] for core, v in sorted(costs.overlap.items())],
           "quality": dict(sorted(costs.quality.items()))}
    if costs.source == f"xstage/data/{CALIBRATION_CSV}":
        out["calibration_sha256"] = calibration_sha256()
    return out


def costs_from_dict(d: dict) -> ExchangeCosts:
    return ExchangeCosts({(c, int(D)): (a, b) for c, D, a, b in d["attention"]},
                         {c: (x0, rate) for c, x0, rate in d["copy"]},
                         {(bool(b), int(D), bool(al)): (sl, c) for b, D, al, sl, c in d["stores"]},
                         float(d["drain"]), int(d["grid"]), d["source"], dict(d["quality"]),
                         {c: tuple(v) for c, *v in d["overlap"]})


@functools.cache
def default_exchange_costs() -> ExchangeCosts:
    """The fit on the embedded H200 host-path calibration grid, as shipped fitted (`COSTS_JSON`): the
    library fits nothing at run time. A test holds the file equal to a fresh fit."""
    d = json.loads((resources.files("xstage.data") / COSTS_JSON).read_text())
    if d.get("calibration_sha256") != calibration_sha256():
        raise XstageError(f"xstage/data/{COSTS_JSON}: fitted on another {CALIBRATION_CSV} than the embedded one; "
                          "write it again with `xstage plan exchange-costs -o DIR` and copy it into xstage/data")
    return costs_from_dict(d)


def validate_exchange(rows: list[dict], costs: ExchangeCosts, exchanges: Sequence[str] | None = None
                      ) -> tuple[list[dict], list[dict]]:
    """Predicted vs measured exposed overhead of every exchange row of a `xstage bench ulysses` CSV.

    Overhead = time - attention alone with the same core (Triton for `stores`), predicted from the
    costs for the prediction and from the same run's attention row for the measurement. Returns the
    rows and, per exchange, the median and p90 over configurations of |predicted - measured| /
    measured attention alone (the planner issue's measure)."""
    by_cfg: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r.get("time_ns") not in ("", None):
            by_cfg.setdefault((int(r["heads"]), int(r["dim"]), int(r["tokens"]), int(r["P"])), {})[r["variant"]] = r
    names = [str(parse_exchange(e)) for e in exchanges] if exchanges else sorted(
        {n for v in by_cfg.values() for n in v if not n.startswith("attention:") and n not in ("auto", "tma")})
    out = []
    for (H, D, T, P), v in sorted(by_cfg.items()):
        for name in names:
            if name not in v:
                continue
            ex = parse_exchange(name)
            core = "triton" if ex.in_kernel else ex.core
            alone = v.get(f"attention:{core}")
            if alone is None:
                continue
            pred = predict(ex, H, D, T, P, costs)
            meas, att = float(v[name]["time_ns"]), float(alone["time_ns"])
            out.append({"heads": H, "dim": D, "tokens": T, "P": P, "exchange": name, "measured_ns": meas,
                        "attention_ns": att, "predicted_ns": pred.time_ns,
                        "predicted_attention_ns": pred.attention_ns,
                        "overhead_measured_ns": meas - att, "overhead_predicted_ns": pred.overhead_ns,
                        "overhead_error": (pred.overhead_ns - (meas - att)) / att})
    if not out:
        raise InputError("results: no exchange row with its attention-alone row to validate against")
    summary = []
    for name in names:
        e = np.abs([o["overhead_error"] for o in out if o["exchange"] == name])
        if len(e):
            summary.append({"exchange": name, "configurations": len(e),
                            "median_abs_overhead_error": float(np.median(e)),
                            "p90_abs_overhead_error": float(np.quantile(e, 0.9))})
    return out, summary


__all__ = ["CANDIDATES", "ExchangeCosts", "Prediction", "check_predictable",
           "default_exchange_costs", "plan_exchange", "predict", "validate_exchange",
           "wave_done"]
