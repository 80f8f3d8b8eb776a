"""Predicted vs measured fused-MoE kernel times, from a `xstage bench moe` results CSV.

For every measured (shape, tokens, EP, variant) row of the fused kernel the planner's prediction is
computed with the given path profile, task costs and the row's store pacing (the variant's `@`
suffix, `xstage.moe.Variant`, resolved by `xstage.moe.resolve_pacing`). A variant without a suffix ran
with the fixed default
pacing of the commit that measured it: `default_pacing` says which (`default`: today's default of the
row's path; `off` for results measured before the kernel had pacing). `interference` is the store
path's interference term (None: off). The
report gives the relative error per row, its median and p90, and per configuration and pacing whose
every planner candidate was measured, whether the candidate the model ranks first is within the
tolerance of the best measured one: max(3%, the best one's run-to-run spread), the spread being its
p10-p90 width over its median when the CSV has those columns.

The rows are checked first (`xstage.sched.measured.check_moe_rows`: columns, sizes, finite positive
times, known variants); `xstage plan validate` reads them with `load_results`, which names the line.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from xstage.dtypes import FP8_DTYPES
from xstage.errors import InputError
from xstage.model.interference import Interference
from xstage.model.params import PathParams
from xstage.sched.costs import TaskCosts
from xstage.sched.measured import BASELINES, check_moe_rows
from xstage.sched.moe import FP8_ELEM_BYTES, MoeConfig, moe_work, simulate_remote
from xstage.sched.pacing import resolve_pacing
from xstage.spec.moe import max_units, pool_units
from xstage.spec.schedule import CANDIDATES, chooser
from xstage.spec.variant import Variant


def split_variant(variant: str, default_pacing: str = "default") -> tuple[str, str]:
    """`"lag:4@off"` -> (`"lag:4"`, `"off"`); no suffix -> (schedule, `default_pacing`)."""
    v = Variant.parse(variant)
    return v.schedule, v.pacing_or(default_pacing)


def _is_schedule(variant: str) -> bool:
    """A fused-kernel row of a fixed order: not a baseline, nor a name chosen per call (`model_guided`
    rows measure a pick, which the table's other rows already cover). An unknown name is an error."""
    return variant not in BASELINES and chooser(split_variant(variant)[0]) is None


def _config(row: dict) -> MoeConfig:
    """The configuration of a checked row (`check_moe_row`)."""
    bm, bn1, bn2, bk = (int(v) for v in str(row["block"]).split("x"))
    # FP8 rows: 1-byte operands, BF16 combine rows (the stores).
    elem = FP8_ELEM_BYTES if _dtype(row) in FP8_DTYPES else {}
    return MoeConfig(hidden=int(row["H"]), intermediate=int(row["I"]), num_experts=int(row["E"]),
                     topk=int(row["K"]), tokens_per_rank=int(row["tokens"]), ep=int(row["ep"]),
                     block_m=bm, block_n1=bn1, block_n2=bn2, block_k=bk, **elem)


def _dtype(row: dict) -> str:
    return str(row.get("dtype") or "bf16").strip()


def _predict_row(job) -> float:
    row, cfg, path, costs, default_pacing, interference = job
    if isinstance(costs, Mapping):
        costs = costs["fp8" if _dtype(row) in FP8_DTYPES else "bf16"]
    schedule, pace = split_variant(str(row["variant"]).strip(), default_pacing)
    pacing = resolve_pacing(pace, str(row["path"]).strip(), cfg.ep)
    return simulate_remote(moe_work(cfg, schedule, costs, int(row["ctas"])), path, pacing, interference).time_ns


def _spread(row: dict) -> float:
    """p10-p90 width over the median, 0 where the CSV has no spread columns."""
    try:
        return (float(row["time_p90_ns"]) - float(row["time_p10_ns"])) / float(row["time_ns"])
    except (KeyError, ValueError, TypeError):
        return 0.0


def _map(fn, jobs, workers: int, progress):
    out = []
    if workers > 1:
        from multiprocessing import get_context

        with get_context("spawn").Pool(workers) as pool:
            for p in pool.imap(fn, jobs):
                out.append(p)
                if progress:
                    progress(len(out), len(jobs))
        return out
    for job in jobs:
        out.append(fn(job))
        if progress:
            progress(len(out), len(jobs))
    return out


def pick_accuracy(out: list[dict], candidates: Sequence[str] = CANDIDATES, tolerance: float = 0.03) -> dict:
    """Per configuration and pacing with every candidate measured: is the model's pick within
    max(`tolerance`, the best measured candidate's spread) of that best one?"""
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for o in out:
        schedule, pace = split_variant(o["schedule"])
        groups[(o["shape"], o["tokens"], o["ep"], o.get("dtype", "bf16"), pace)][schedule] = o
    hits, losses = [], []
    for group in groups.values():
        if not all(c in group for c in candidates):
            continue
        cand = [group[c] for c in candidates]
        best = min(cand, key=lambda g: g["measured_ns"])
        pick = min(cand, key=lambda g: g["predicted_ns"])
        tol = max(tolerance, best["spread"])
        hits.append(pick["measured_ns"] <= best["measured_ns"] * (1 + tol))
        losses.append(pick["measured_ns"] / best["measured_ns"] - 1)
    return {"fully_measured": len(hits), "pick_within_tolerance": float(np.mean(hits)) if hits else math.nan,
            "pick_loss_geomean": float(np.exp(np.mean(np.log1p(losses)))) - 1 if losses else math.nan,
            "pick_loss_max": max(losses) if losses else math.nan}


def fused_rows(rows: Sequence[dict], min_ep: int = 2) -> list[dict]:
    """The rows `validate_moe` predicts: the fused kernel in a fixed order (`_is_schedule`), EP >= `min_ep`."""
    return [r for r in rows if _is_schedule(str(r["variant"]).strip()) and int(r["ep"]) >= min_ep]


def validate_moe(rows: list[dict], path: PathParams, costs: TaskCosts | Mapping[str, TaskCosts], *, min_ep: int = 2,
                 tolerance: float = 0.03,
                 candidates: Sequence[str] = CANDIDATES, default_pacing: str = "default", progress=None,
                 workers: int = 1, source: str = "results", lines: Sequence[int] | None = None,
                 pool_bytes: int | None = None, interference: Interference | None = None) -> tuple[list[dict], dict]:
    """Per-row predictions and the summary (median/p90 error, pick accuracy). `costs`: one set for
    every row, or one per dtype (`{"bf16": ..., "fp8": ...}`, chosen by each row's dtype). `progress(done, total)`
    is called after each simulated row; `source` and `lines` (the rows' file and line numbers) name
    where a refused row is. `pool_bytes`: the row pool of the kernel that measured the rows (its slot
    waits are modelled); None for results of the kernel before the pool, whose rows all had a slot."""
    Variant("expert_wave", default_pacing)  # a malformed spec fails here, before any simulation
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise InputError(f"workers={workers!r}: must be a positive integer (processes)")
    check_moe_rows(rows, source, lines)
    todo = fused_rows(rows, min_ep)
    if not todo:
        variants = sorted({str(r["variant"]).strip() for r in rows})
        eps = sorted({int(r["ep"]) for r in rows})
        raise InputError(f"{source}: none of its {len(rows)} rows is a fused-kernel row in a fixed schedule with "
                         f"EP >= {min_ep} (variants {', '.join(variants)}; EP {', '.join(map(str, eps))})")
    index = {id(r): i for i, r in enumerate(rows)}
    jobs = []
    for r in todo:  # every configuration is checked before the first simulation
        try:
            cfg = _config(r)
            if pool_bytes is not None:
                units_cap = max_units(cfg.ep, cfg.tokens_per_rank, cfg.topk, cfg.local_experts, cfg.block_m)
                unit_bytes = cfg.block_m * (cfg.hidden + cfg.intermediate) * cfg.elem_bytes
                cfg = dataclasses.replace(cfg, pool_units=pool_units(pool_bytes, unit_bytes, units_cap))
            resolve_pacing(split_variant(str(r["variant"]).strip(), default_pacing)[1], str(r["path"]).strip(),
                           cfg.ep)
        except InputError as exc:
            i = index[id(r)]
            where = f"{source}, line {lines[i]}" if lines is not None else f"{source}, row {i + 1}"
            raise InputError(f"{where}: {exc}") from None
        jobs.append((r, cfg, path, costs, default_pacing, interference))
    predicted = _map(_predict_row, jobs, workers, progress)
    out = []
    for r, pred in zip(todo, predicted):
        measured = float(r["time_ns"])
        out.append({"shape": r["shape"], "tokens": int(r["tokens"]), "ep": int(r["ep"]), "dtype": _dtype(r),
                    "schedule": str(r["variant"]).strip(),
                    "block": r["block"], "measured_ns": measured, "spread": _spread(r), "predicted_ns": pred,
                    "rel_error": pred / measured - 1.0})
    err = np.abs([o["rel_error"] for o in out])
    summary = {"rows": len(out), "median_abs_rel_error": float(np.median(err)),
               "p90_abs_rel_error": float(np.quantile(err, 0.9)),
               "signed_median_rel_error": float(np.median([o["rel_error"] for o in out])),
               **pick_accuracy(out, candidates, tolerance), "pick_tolerance": tolerance}
    return out, summary
