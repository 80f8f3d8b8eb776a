"""The whole Ulysses layer, predicted before it is measured: pre exchange, attention, post exchange.

Problem: `xstage.sched.exchange` predicts attention and the post-attention exchange (the output O to
its rows' owners). A layer also runs the pre-attention exchange (Q, K and V: three times O's bytes),
which today runs alone before attention. This module predicts the three together under each
candidate scheme, ranks them (`plan_layer`) and states a lower bound that no scheme of the model can
beat (`layer_bound`). It decides nothing for a call: `heads:CORE:C` runs on torch.distributed groups
(`xstage.attention.pipeline`) but has not been measured, so `exchange="auto"` does not use this model.

Model (rank 0 of P, the rank with the most heads and tokens; batch B, e bytes per element; rank 0
holds h of H heads after the pre exchange and S_0 of S tokens):
- bytes. Pre exchange: rank 0 sends `3 B S_0 (H - h) D e` and receives `3 B h (S - S_0) D e`; post
  exchange: sends `B h (S - S_0) D e`, receives `B S_0 (H - h) D e`. PCIe and NVLink are full duplex
  (each direction at the same nominal rate), so a transfer lasts as long as its larger direction:
  `max(sent, received)` bytes at the path's rate.
- the pre exchange alone: a copy-engine send of sequence-major rows, `x0 + n / rate`, the copy fit of
  the Triton core (its post exchange is the same kind of copy; the cuDNN core's fit also carries the
  layout copy of its output, which Q, K and V do not need).
- `serial:CORE` and today's post-only schemes (`overlap:...`, `stores:...`, the exchanges that
  `choose_exchange` ranks): the pre exchange alone, then today's exchange as `xstage.sched.exchange`
  predicts it (attention and the post exchange; that model times rank 0's sends), plus the post
  exchange's received bytes beyond its sent ones at the copy rate (rank 0 receives more than it sends
  only when it holds more tokens than the others).
- `heads:CORE:C` (head-chunk pipelining of both exchanges): rank 0's heads in C chunks
  (`split_sizes`, each rank's heads likewise). The link carries every chunk's Q, K, V, first to last,
  then each chunk's O once that chunk's attention is done, one transfer at a time (the copy engine's
  queue); chunk j's attention starts when its Q, K, V have arrived and chunk j - 1 is done. So
  attention on chunk j runs while chunk j + 1's Q, K, V arrive and chunk j - 1's O leaves. Putting
  every Q, K, V transfer first is the best order of this queue for the model: a transfer of O can only
  delay attention, and the link's total work is the same in any order. Costs: chunk 0's Q, K, V and
  the last chunk's O run beside no attention, at the serial copy fits (the Triton core's for Q, K, V,
  the core's own for O); every other transfer is a copy beside running attention, at the core's
  overlap fit `y0 + n / rate`, and attention runs `1 + k` times as long while a copy is in flight (the
  copy engine's reads share the memory system). A chunk's attention is the core's `b x rounds x work`
  over its heads (rounds of `grid` tiles), `a` once, and `z` for each chunk whose O is sent while later
  chunks run (a block's end: its launch, the cuDNN core's layout copy), as the overlap fit has them.
  With C = 1 this is `serial:CORE`.
- paths. Every cost was measured on the host path (PCIe). On `peer` (NVLink) every copy rate is the
  host fit's times the ratio of the peer profile's drain to the host's, the fixed costs and `k` are
  kept, and the in-kernel stores drain at the peer profile's rate (as `choose_exchange` does): not
  validated.
- dtypes: bf16 and fp16 (2 bytes; Hopper's tensor cores run both at one rate); the attention costs
  were measured in bf16.

Lower bound (`layer_bound`), for every scheme above and any chunking of heads:
- compute: attention of all h heads must run, and no scheme runs it faster than the faster core
  alone (a chunked or blocked run adds rounds, `z` and the slowdown `k`, never removes them);
- first arrival: a head's attention needs that head's whole K and V (no scheme here folds K and V
  in by sequence chunks), so nothing computes before the `2 (S - S_0) D e` bytes of one head's K and
  V (of one sequence) have arrived, at the fastest rate the model knows on the path;
- link: every byte of both exchanges crosses, each direction at most at that rate.
So `time >= max(first arrival + attention, link)`. A scheme that folded K and V in by sequence
chunks would be bounded by `max(attention, link)` only (`LayerBound.any_order_ns`). No last
departure is added: a scheme may compute rank 0's own rows last, whose output stays local.

Example:
    >>> from xstage.sched.layer import LayerConfig, layer_bound, plan_layer
    >>> cfg = LayerConfig(heads=24, dim=128, tokens=32760, ranks=4)
    >>> ranked = plan_layer(cfg)
    >>> ranked[0].time_ns >= layer_bound(cfg).time_ns
    True
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from xstage.bounds import check_int
from xstage.errors import InputError
from xstage.model import load_default_profile
from xstage.sched.exchange import (
    ALIGN,
    BLOCK_M,
    CANDIDATES,
    ExchangeCosts,
    _overlap_geometry,
    _overlap_steps,
    _overlap_time,
    _stores_ns,
    check_call_shape,
    check_predictable,
    default_exchange_costs,
)
from xstage.spec.exchange import CORES, parse_exchange
from xstage.spec.ulysses import UlyssesPlan, split_sizes

# Bytes per element of the dtypes the layer model predicts: the attention costs were measured in
# bf16, and fp16 runs at the same tensor-core rate on Hopper; fp32 attention is another kernel.
ELEM_BYTES = {"bf16": 2, "fp16": 2}
LAYER_PATHS = ("host", "peer")
# Head chunks tried by default (capped at rank 0's heads): a candidate list, not a fitted number.
CHUNKS = (2, 3, 4, 6, 8)
MAX_BATCH = 1 << 16
PIPELINE = "heads"  # the spelling of head-chunk pipelining: heads:CORE:C


@dataclass(frozen=True)
class LayerConfig:
    """One Ulysses layer as rank 0 sees it: `heads` heads of `dim` over `tokens` tokens and `ranks`
    ranks, `batch` sequences, on `path` in `dtype`."""

    heads: int
    dim: int
    tokens: int
    ranks: int
    batch: int = 1
    path: str = "host"
    dtype: str = "bf16"

    def __post_init__(self):
        h, d, t, r = check_call_shape(self.heads, self.dim, self.tokens, self.ranks)
        for name, v in (("heads", h), ("dim", d), ("tokens", t), ("ranks", r)):
            object.__setattr__(self, name, v)
        object.__setattr__(self, "batch", check_int(self.batch, "batch", 1, MAX_BATCH, "sequences per call"))
        if self.path not in LAYER_PATHS:
            raise InputError(f"path={self.path!r}: the layer model predicts {', '.join(LAYER_PATHS)} (the paths "
                             "a Ulysses group's exchanges cross)")
        if self.dtype not in ELEM_BYTES:
            raise InputError(f"dtype={self.dtype!r}: the layer model predicts {', '.join(ELEM_BYTES)} (its "
                             "attention costs were measured in bf16)")

    @property
    def plan(self) -> UlyssesPlan:
        return UlyssesPlan(self.ranks, 0, self.batch, split_sizes(self.tokens, self.ranks), self.heads, self.dim)

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]


@dataclass(frozen=True)
class LayerBytes:
    """Rank 0's bytes in each exchange, per direction."""

    pre_sent: int
    pre_received: int
    post_sent: int
    post_received: int

    @property
    def pre(self) -> int:
        return max(self.pre_sent, self.pre_received)

    @property
    def post(self) -> int:
        return max(self.post_sent, self.post_received)


def layer_bytes(cfg: LayerConfig, chunks: int = 1) -> list[LayerBytes]:
    """Rank 0's bytes per head chunk (`chunks` chunks of every rank's heads, `split_sizes`)."""
    plan, e = cfg.plan, cfg.elem_bytes
    s0, S, row = plan.seq_lens[0], plan.seq_total, cfg.batch * cfg.dim * e
    mine = split_sizes(plan.heads_of(0), chunks)
    peers = [split_sizes(plan.heads_of(p), chunks) for p in range(1, plan.world)]
    out = []
    for j in range(chunks):
        theirs = sum(hp[j] for hp in peers)  # chunk j of every peer's heads
        out.append(LayerBytes(3 * s0 * theirs * row, 3 * mine[j] * (S - s0) * row,
                              mine[j] * (S - s0) * row, s0 * theirs * row))
    return out


@dataclass(frozen=True)
class LayerPrediction:
    scheme: str
    time_ns: float
    attention_ns: float  # the scheme's core alone on rank 0's heads, predicted the same way
    pre_ns: float  # the pre exchange's time before any attention runs (all of it, or chunk 0's)


@dataclass(frozen=True)
class LayerBound:
    """`time_ns` = max(first_arrival_ns + attention_ns, link_ns): see the module docstring."""

    time_ns: float
    attention_ns: float  # the faster core alone
    first_arrival_ns: float  # one head's K and V of one sequence, at the path's fastest rate
    link_ns: float  # every byte of both exchanges, each direction at that rate
    any_order_ns: float  # max(attention, link): the bound of a scheme folding K and V by sequence chunks


def path_costs(path: str, costs: ExchangeCosts | None = None) -> ExchangeCosts:
    """The exchange costs on `path` (see the module docstring): `costs` (default: the embedded host-path
    fit) as measured on `host`; on `peer`, every rate scaled by the peer profile's drain over `costs`'s."""
    costs = default_exchange_costs() if costs is None else costs
    if path == "host":
        return costs
    if path != "peer":
        raise InputError(f"path={path!r}: the layer model predicts {', '.join(LAYER_PATHS)}")
    drain = load_default_profile("peer").params.drain
    f = drain / costs.drain  # the NVLink link's drain over the host link's, both from store probes
    return dataclasses.replace(
        costs, drain=drain, source=f"{costs.source or 'given costs'}, rates x {f:.3g} for peer",
        copy={c: (x0, rate * f) for c, (x0, rate) in costs.copy.items()},
        overlap={c: (y0, rate * f, z, k) for c, (y0, rate, z, k) in costs.overlap.items()})


def fastest_rate(costs: ExchangeCosts) -> float:
    """Bytes per ns: the fastest any byte crosses the path in the model (copies alone or beside
    attention, in-kernel stores at the drain)."""
    rates = [r for _, r in costs.copy.values()] + [v[1] for v in costs.overlap.values()] + [costs.drain / 1e9]
    return max(rates)


def parse_scheme(text: str) -> tuple[str, str, int]:
    """(kind, core or exchange spelling, chunks): `heads:CORE:C` -> ("heads", CORE, C); any exchange
    the planner predicts -> ("exchange", its canonical spelling, 1)."""
    if not isinstance(text, str):
        raise InputError(f"scheme {text!r}: expected a string (heads:CORE:C or an exchange spelling)")
    if text.split(":")[0] == PIPELINE:
        try:
            ex = parse_exchange(text)
        except InputError as exc:
            raise InputError(f"scheme {text!r}: expected heads:CORE:C ({exc})") from None
        return PIPELINE, ex.core, ex.chunks
    return "exchange", str(check_predictable(text)), 1


def _exchange_ns(ex: str, cfg: LayerConfig, costs: ExchangeCosts) -> tuple[float, float]:
    """(time, attention alone) of today's exchange `ex` on rank 0: `xstage.sched.exchange.predict`
    with the batch's tiles and bytes (a batch multiplies the kernels' tiles and each row's bytes)."""
    ex = parse_exchange(ex)
    plan, B = cfg.plan, cfg.batch
    h, S, D = plan.heads_of(0), plan.seq_total, cfg.dim
    row_bytes = B * h * D * cfg.elem_bytes
    remote = (S - plan.seq_lens[0]) * row_bytes
    core = "triton" if ex.in_kernel else ex.core
    alone = costs.attention_ns(core, S, B * h, S, D)
    if ex.mechanism == "serial":
        return alone + costs.copy_ns(core, remote), alone
    if ex.mechanism == "overlap":
        y0, rate, z, k = costs.overlap_terms(core)
        tiles, sends = _overlap_geometry(plan, ex, row_bytes, costs.grid)
        steps = _overlap_steps(([B * t for t in tiles], sends), core, S, D, costs, z)
        return float(_overlap_time(steps, y0, rate, k)), alone
    keys = [key for key in costs.stores if key[0] == ex.burst]
    if not keys:
        raise InputError(f"exchange costs: no `stores` costs for {str(ex)!r}")
    fit = costs.stores[min(keys, key=lambda key: (key[2] != (S % ALIGN == 0), abs(math.log2(key[1] / D))))]
    return float(_stores_ns(alone, B * h, S, remote, fit, costs)), alone


def finish(start: float, work: float, busy: Sequence[tuple[float, float]], k: float) -> float:
    """When compute of `work` ns (at full speed) that starts at `start` ends, running `1 + k` times as
    long inside the `busy` intervals (the link's transfers, disjoint).

    Example:
        >>> finish(0.0, 10.0, [(2.0, 6.0)], 1.0)   # 2 ns, then 2 ns of work in 4 ns, then 6 ns
        12.0
    """
    t, left = float(start), float(work)
    for s, e in sorted(busy):
        if e <= t:
            continue
        if s > t:
            if left <= s - t:
                return t + left
            left -= s - t
            t = s
        span = (e - t) / (1.0 + k)
        if left <= span:
            return t + left * (1.0 + k)
        left -= span
        t = e
    return t + left


def pipeline_ns(pre: Sequence[float], work: Sequence[float], post: Sequence[float], k: float) -> float:
    """The head-chunk pipeline's time: one link carries `pre[0..C-1]` back to back, then each `post[j]`
    once chunk j's compute is done and the link is free; chunk j computes `work[j]` (ns at full speed)
    once `pre[j]` has arrived and chunk j - 1 is done, `1 + k` times as long while a transfer runs.

    Example:
        >>> pipeline_ns([1.0], [5.0], [2.0], 0.5)   # one chunk: the three in turn
        8.0
    """
    busy, t, arrived = [], 0.0, []
    for d in pre:
        busy.append((t, t + d))
        t += d
        arrived.append(t)
    link, done = t, 0.0
    for j, w in enumerate(work):
        done = finish(max(arrived[j], done), w, busy, k)
        start = max(done, link)
        busy.append((start, start + post[j]))
        link = start + post[j]
    return max(done, link)


def _pipeline(core: str, chunks: int, cfg: LayerConfig, costs: ExchangeCosts) -> LayerPrediction:
    plan = cfg.plan
    h, S, D = plan.heads_of(0), plan.seq_total, cfg.dim
    if chunks > h:
        raise InputError(f"heads:{core}:{chunks}: rank 0 holds {h} heads, fewer than {chunks} chunks")
    a, b = costs._att(core, D)
    tile_ns = b * 4.0 * BLOCK_M * S * D
    y0, rate, z, k = costs.overlap_terms(core)
    parts = layer_bytes(cfg, chunks)
    heads = split_sizes(h, chunks)
    last = chunks - 1
    pre = [costs.copy_ns("triton", parts[0].pre)] + [y0 + p.pre / rate for p in parts[1:]]
    post = [y0 + p.post / rate for p in parts[:last]] + [costs.copy_ns(core, parts[last].post)]
    # a chunk's rounds of `grid` tiles (one head of one sequence x 128 rows each); `a` once, `z` per
    # chunk whose O leaves beside later chunks (the last one's end is in its serial copy's fit)
    work = [math.ceil(cfg.batch * hj * math.ceil(S / BLOCK_M) / costs.grid) * tile_ns
            + (a if j == 0 else 0.0) + (z if j < last else 0.0) for j, hj in enumerate(heads)]
    alone = costs.attention_ns(core, S, cfg.batch * h, S, D)
    return LayerPrediction(f"{PIPELINE}:{core}:{chunks}", pipeline_ns(pre, work, post, k), alone, pre[0])


def predict_layer(scheme: str, cfg: LayerConfig, costs: ExchangeCosts | None = None) -> LayerPrediction:
    """Predicted time of rank 0's whole layer (pre exchange, attention, post exchange) under `scheme`:
    `heads:CORE:C`, or an exchange of `xstage.sched.exchange` with the pre exchange before it.
    `costs`: host-path exchange costs (default: the embedded fit), taken to `cfg.path` by `path_costs`."""
    if not isinstance(cfg, LayerConfig):
        raise InputError(f"cfg: expected a LayerConfig, got {type(cfg).__name__}")
    costs = path_costs(cfg.path, costs)
    kind, what, chunks = parse_scheme(scheme)
    if kind == PIPELINE:
        return _pipeline(what, chunks, cfg, costs)
    whole = layer_bytes(cfg)[0]
    pre = costs.copy_ns("triton", whole.pre)
    ex = parse_exchange(what)
    # today's model times rank 0's sends of O; what it receives beyond them crosses after, at the copy rate
    extra = max(0, whole.post_received - whole.post_sent) / costs._copy("triton" if ex.in_kernel else ex.core)[1]
    t, alone = _exchange_ns(what, cfg, costs)
    return LayerPrediction(what, pre + t + extra, alone, pre)


def layer_bound(cfg: LayerConfig, costs: ExchangeCosts | None = None) -> LayerBound:
    """The time no scheme of the model beats on `cfg` (see the module docstring)."""
    costs = path_costs(cfg.path, costs)
    plan = cfg.plan
    S, D, h = plan.seq_total, cfg.dim, plan.heads_of(0)
    rate = fastest_rate(costs)
    attention = min(costs.attention_ns(c, S, cfg.batch * h, S, D) for c in {c for c, _ in costs.attention})
    first = 2 * (S - plan.seq_lens[0]) * D * cfg.elem_bytes / rate
    b = layer_bytes(cfg)[0]
    link = max(b.pre_sent + b.post_sent, b.pre_received + b.post_received) / rate
    return LayerBound(max(first + attention, link), attention, first, link, max(attention, link))


def layer_schemes(cfg: LayerConfig, chunks: Sequence[int] = CHUNKS) -> list[str]:
    """The schemes ranked by default: today's exchanges (`CANDIDATES`, the pre exchange alone before
    each) and `heads:CORE:C` for both cores and every C of `chunks` up to rank 0's heads."""
    h = cfg.plan.heads_of(0)
    return [*(str(parse_exchange(c)) for c in CANDIDATES),
            *(f"{PIPELINE}:{core}:{c}" for core in CORES for c in chunks if c <= h)]


def plan_layer(cfg: LayerConfig, schemes: Sequence[str] | None = None,
               costs: ExchangeCosts | None = None) -> list[LayerPrediction]:
    """Every scheme's prediction for `cfg`, fastest first."""
    schemes = layer_schemes(cfg) if schemes is None else list(schemes)
    if not schemes:
        raise InputError("schemes: at least one is needed")
    return sorted((predict_layer(s, cfg, costs) for s in schemes), key=lambda p: p.time_ns)




def check_measured(rows: list[dict], costs: ExchangeCosts | None = None) -> tuple[list[dict], list[dict]]:
    """The measured part of the layer model against a `xstage bench ulysses` CSV (rows of the host
    path, rank 0): attention alone per core, and attention with today's post exchange per exchange
    (the pre exchange is in no such run). Returns every row's predicted and measured time and, per
    variant, the median and largest |predicted / measured - 1| over configurations."""
    costs = default_exchange_costs() if costs is None else costs
    out = []
    for r in rows:
        if r.get("time_ns") in ("", None) or r.get("path", "host") != "host" or str(r.get("rank", "0")) != "0":
            continue
        name = r["exchange"] if r["variant"] == "auto" else r["variant"]
        cfg = LayerConfig(int(r["heads"]), int(r["dim"]), int(r["tokens"]), int(r["P"]))
        if name.startswith("attention:"):
            core = name.split(":", 1)[1]
            pred = costs.attention_ns(core, cfg.tokens, cfg.plan.heads_of(0), cfg.tokens, cfg.dim)
        else:
            pred = _exchange_ns(name, cfg, costs)[0]
        meas = float(r["time_ns"])
        out.append({"heads": cfg.heads, "dim": cfg.dim, "tokens": cfg.tokens, "P": cfg.ranks, "variant": r["variant"],
                    "scheme": str(parse_exchange(name)) if not name.startswith("attention:") else name,
                    "measured_ns": meas, "predicted_ns": pred, "error": pred / meas - 1})
    if not out:
        raise InputError("results: no timed host-path row of rank 0 to check against")
    summary = []
    for v in sorted({o["variant"] for o in out}):
        e = sorted(abs(o["error"]) for o in out if o["variant"] == v)
        summary.append({"variant": v, "configurations": len(e), "median_abs_error": statistics.median(e),
                        "max_abs_error": e[-1]})
    return out, summary


def prediction_rows(configs: Sequence[LayerConfig], costs: ExchangeCosts | None = None,
                    today: dict | None = None) -> list[dict]:
    """One row per configuration and scheme: predicted ns, the scheme's core alone, the faster core
    alone, the layer's bound (and the bound of any order), the predicted best scheme. `today`:
    configuration -> the exchange `choose_exchange` picks today, predicted with the pre exchange before it."""
    rows = []
    for cfg in configs:
        ranked = plan_layer(cfg, costs=costs)
        bound = layer_bound(cfg, costs)
        now = today.get(cfg) if today else None
        now_ns = predict_layer(now, cfg, costs).time_ns if now else None
        for p in ranked:
            rows.append({"heads": cfg.heads, "dim": cfg.dim, "tokens": cfg.tokens, "P": cfg.ranks, "batch": cfg.batch,
                         "path": cfg.path, "dtype": cfg.dtype, "scheme": p.scheme, "predicted_ns": p.time_ns,
                         "attention_ns": p.attention_ns, "attention_best_ns": bound.attention_ns,
                         "bound_ns": bound.time_ns, "bound_any_order_ns": bound.any_order_ns,
                         "vs_bound": p.time_ns / bound.time_ns, "vs_attention": p.time_ns / bound.attention_ns,
                         "best_scheme": ranked[0].scheme, "best_ns": ranked[0].time_ns,
                         "today_auto": now or "", "today_auto_ns": now_ns if now_ns is not None else ""})
    return rows



__all__ = ["CHUNKS", "ELEM_BYTES", "LAYER_PATHS", "LayerBound", "LayerBytes", "LayerConfig", "LayerPrediction",
           "check_measured", "fastest_rate", "finish", "layer_bound", "layer_bytes", "layer_schemes", "parse_scheme",
           "path_costs", "pipeline_ns", "plan_layer", "predict_layer", "prediction_rows"]
