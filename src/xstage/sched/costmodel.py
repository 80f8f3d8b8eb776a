"""The planner's cost models, term by term: where each term of a prediction lives, what data it reads,
which experiment measured that data and which results folder validates it.

A MoE task's predicted time is built from six terms, applied in this order (`MOE_TERMS`); a Ulysses
exchange's from five (`EXCHANGE_TERMS`); a whole Ulysses layer's from those and four more
(`LAYER_TERMS`). A new effect belongs to the term whose data measures it, or
becomes a new term here, with its data file, its experiment and its validation. The docs' cost-model
page lists the same terms (a test holds the two equal).

Example:
    >>> from xstage.sched.costmodel import MOE_TERMS
    >>> [t.name for t in MOE_TERMS][:2]
    ['tile', 'order']
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Term:
    """One term of a prediction. `applied_in`: the module and function that apply it; `data`: the files
    of `xstage/data/` it reads (empty where it is a constant of the code); `experiment`: the command or
    `benchmarks/experiments/` script that measured the data; `results`: the `benchmarks/results/`
    folders that hold the measurement and the check of the prediction."""

    name: str
    meaning: str
    applied_in: str
    data: tuple[str, ...]
    experiment: str
    results: tuple[str, ...]


MOE_TERMS: tuple[Term, ...] = (
    Term("tile", "a task's compute time: the traced tile table of its shape and block, interpolated in rows per "
         "expert, else the tile roofline (5 constants) for shapes the table lacks",
         "xstage.sched.costs.TaskCosts.tile_ns", ("h200-moe-task-costs.json", "h200-moe-fp8-task-costs.json"),
         "xstage plan calibrate (xstage.calibrate.tiles); benchmarks/experiments/tile_model.py",
         ("h200-moe-tiles", "tile-roofline")),
    Term("order", "the factor by which a schedule other than the traced one changes the tile times",
         "xstage.sched.ordercost.OrderEffect", ("h200-moe-task-costs.json",),
         "benchmarks/experiments/order_effect.py", ("h200-moe-order",)),
    Term("occupancy", "tiles run faster while fewer CTAs compute: kappa x the share of idle CTAs (held at a floor)",
         "xstage.sched.ordercost.OrderEffect (idle_speedup)", ("h200-moe-task-costs.json",),
         "benchmarks/experiments/order_effect.py", ("h200-moe-order",)),
    Term("interference", "the stretch of tiles beside a busy store path, per storing CTA past an onset",
         "xstage.model.interference.Interference", ("h200-host-interference.json",),
         "benchmarks/experiments/fit_interference.py",
         ("h200-moe-busy-link", "h200-interference", "h200-store-then-load")),
    Term("store path", "the remote stores through the path's Burst-Gap profile: a 16-byte window per SM, the "
         "unpaced drain, and the kernel's pacer (first claimed, first served)",
         "xstage.sched.moe.simulate_remote", ("h200-host-profile.json", "h200-host-interference.json"),
         "xstage probe + xstage fit; benchmarks/experiments/tiles_beside_tile_stores.py",
         ("h200-host-probe", "h200-tiles-beside-tile-stores")),
    Term("unpaced bias", "the measured ratio by which unpaced kernels run slower than the terms above say, applied "
         "when candidates are ranked", "xstage.sched.plan.rank_ns", ("h200-host-interference.json",),
         "benchmarks/experiments/moe_ab.py", ("h200-moe-ab", "h200-moe-validation")),
)

EXCHANGE_TERMS: tuple[Term, ...] = (
    Term("attention", "attention alone on a block of query rows: a + b x rounds x work, per core and head dim",
         "xstage.sched.exchange.ExchangeCosts.attention_ns", ("h200-ulysses-exchange-costs.json",),
         "xstage bench ulysses --grid calibration; xstage plan exchange-costs", ("h200-ulysses-calibration",)),
    Term("copy", "a copy-engine send of the remote rows: x0 + bytes / rate, per core",
         "xstage.sched.exchange.predict", ("h200-ulysses-exchange-costs.json",),
         "xstage bench ulysses --grid calibration; xstage plan exchange-costs", ("h200-ulysses-calibration",)),
    Term("in-kernel stores", "the key loop's slowdown while tiles store, and a cost per round",
         "xstage.sched.exchange.predict", ("h200-ulysses-exchange-costs.json",),
         "xstage bench ulysses --grid calibration; xstage plan exchange-costs", ("h200-ulysses-calibration",)),
    Term("overlap", "blocks on two streams: a send's start, its rate, a block's end and the tiles' slowdown",
         "xstage.sched.exchange.wave_done", ("h200-ulysses-exchange-costs.json",),
         "xstage bench ulysses --grid calibration; xstage plan exchange-costs",
         ("h200-ulysses-calibration", "h200-ulysses-validation")),
    Term("drain", "every remote byte crosses the store path at its drain rate (the path's profile)",
         "xstage.sched.exchange.predict", ("h200-ulysses-exchange-costs.json", "h200-nvlink-peer-profile.json"),
         "xstage probe + xstage fit", ("h200-host-probe", "h200x2-nvlink")),
)

LAYER_TERMS: tuple[Term, ...] = (
    Term("layer bytes", "rank 0's bytes per exchange and direction (Q, K, V before attention: three times O's); a "
         "transfer lasts as long as its larger direction (full-duplex links)", "xstage.sched.layer.layer_bytes",
         (), "xstage plan layer", ("predictions-ulysses-layer",)),
    Term("pre exchange", "Q, K and V sent by the copy engine before attention: the Triton core's copy fit, x0 + "
         "bytes / rate (rows already sequence-major); never measured", "xstage.sched.layer.predict_layer",
         ("h200-ulysses-exchange-costs.json",), "xstage bench ulysses --grid calibration; xstage plan exchange-costs",
         ("h200-ulysses-calibration", "predictions-ulysses-layer")),
    Term("head-chunk pipeline", "both exchanges by head chunks on one copy queue (every chunk's Q, K, V first, each "
         "O once its chunk is done); copies beside attention at the overlap fit, attention 1 + k times as long "
         "while one runs, a once and z per chunk", "xstage.sched.layer.pipeline_ns",
         ("h200-ulysses-exchange-costs.json",), "xstage bench ulysses --grid calibration; xstage plan exchange-costs",
         ("h200-ulysses-calibration", "predictions-ulysses-layer")),
    Term("peer rates", "on NVLink every copy rate is the host fit's times the peer profile's drain over the host's; "
         "fixed costs and k kept (not validated)", "xstage.sched.layer.path_costs",
         ("h200-ulysses-exchange-costs.json", "h200-nvlink-peer-profile.json"), "xstage probe + xstage fit",
         ("h200x2-nvlink", "predictions-ulysses-layer")),
)

__all__ = ["EXCHANGE_TERMS", "LAYER_TERMS", "MOE_TERMS", "Term"]
