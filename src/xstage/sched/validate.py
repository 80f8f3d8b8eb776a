"""Predicted vs measured fused-MoE kernel times, from a `xstage bench moe` results CSV.

For every measured (shape, tokens, EP, schedule) row of the fused kernel the planner's prediction is
computed with the given path profile and task costs; the report gives the relative error per row,
its median and p90, and per configuration whether the schedule the model ranks first is within
max(3%, measured run-to-run spread) of the best measured one.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from xstage.errors import InputError
from xstage.model.params import PathParams
from xstage.sched.costs import TaskCosts
from xstage.sched.moe import MoeConfig, moe_work, remote_path
from xstage.sched.simulate import simulate_kernel

FUSED_VARIANTS = ("expert_wave", "interleaved")


def _is_schedule(variant: str) -> bool:
    return variant in FUSED_VARIANTS or variant.startswith("lag:")


def _config(row: dict) -> MoeConfig:
    try:
        bm, bn1, bn2, bk = (int(v) for v in row["block"].split("x"))
        return MoeConfig(hidden=int(row["H"]), intermediate=int(row["I"]), num_experts=int(row["E"]),
                         topk=int(row["K"]), tokens_per_rank=int(row["tokens"]), ep=int(row["ep"]),
                         block_m=bm, block_n1=bn1, block_n2=bn2, block_k=bk)
    except (KeyError, ValueError) as exc:
        raise InputError(f"results row {row.get('shape')}/{row.get('tokens')}: malformed ({exc})") from None


def _predict_row(job) -> float:
    row, path, costs = job
    cfg = _config(row)
    work = moe_work(cfg, row["variant"], costs, int(row.get("ctas") or 132))
    return simulate_kernel(work, {"remote": remote_path(path)}).time_ns


def validate_moe(rows: list[dict], path: PathParams, costs: TaskCosts, *, min_ep: int = 2, spread: float = 0.03,
                 progress=None, workers: int = 1) -> tuple[list[dict], dict]:
    """Per-row predictions and the summary (median/p90 error, pick accuracy)."""
    todo = [r for r in rows if _is_schedule(r.get("variant", "")) and int(r.get("ep", 0)) >= min_ep
            and r.get("time_ns") not in ("", None)]
    if not todo:
        raise InputError(f"results: no fused-kernel rows with EP >= {min_ep} to validate")
    jobs = [(r, path, costs) for r in todo]
    if workers > 1:
        from multiprocessing import get_context

        with get_context("spawn").Pool(workers) as pool:
            predicted = []
            for p in pool.imap(_predict_row, jobs):
                predicted.append(p)
                if progress:
                    progress(len(predicted), len(jobs))
    else:
        predicted = []
        for job in jobs:
            predicted.append(_predict_row(job))
            if progress:
                progress(len(predicted), len(jobs))
    out = []
    for r, pred in zip(todo, predicted):
        measured = float(r["time_ns"])
        out.append({"shape": r["shape"], "tokens": int(r["tokens"]), "ep": int(r["ep"]), "schedule": r["variant"],
                    "block": r["block"], "measured_ns": measured, "predicted_ns": pred,
                    "rel_error": pred / measured - 1.0})
    by_cfg: dict[tuple, list[dict]] = defaultdict(list)
    for o in out:
        by_cfg[(o["shape"], o["tokens"], o["ep"])].append(o)
    picks = []
    for group in by_cfg.values():
        if len(group) < 2:
            continue
        best_measured = min(g["measured_ns"] for g in group)
        pick = min(group, key=lambda g: g["predicted_ns"])
        picks.append(pick["measured_ns"] <= best_measured * (1 + spread))
    err = np.abs([o["rel_error"] for o in out])
    summary = {"rows": len(out), "configurations": len(by_cfg), "median_abs_rel_error": float(np.median(err)),
               "p90_abs_rel_error": float(np.quantile(err, 0.9)),
               "pick_within_tolerance": float(np.mean(picks)) if picks else math.nan, "pick_tolerance": spread}
    return out, summary
