"""Measure the fused MoE kernel's own tile costs on the GPU (`xstage plan calibrate`).

The kernel runs at EP=1 (no remote stores) with `trace=` on, which records `%globaltimer` after each
task's dependency wait and after its last store: the task's compute time with every SM busy, as in
the real kernel. Per shape and task kind the median over tasks is taken; per kind and block config
`overhead_ns + work / rate` is fitted over the shapes (work = FLOPs of the padded tile, bytes for
dispatch), and the tile model (`xstage.sched.tilecost`) over the medians of the shapes chosen for it,
so the costs carry over to shapes that were not traced. Quality: each shape's median against the fits.
The tiles are traced in the `expert_wave` order; other schedules, traced in the same run, give the
order effect (`xstage.sched.ordercost`): their mean tile time per kind over `expert_wave`'s.
"""

from __future__ import annotations

import numpy as np

from xstage.calibrate.ordereffect import order_effect_from_means
from xstage.calibrate.tilemodel import fit_tile_model
from xstage.env import environment
from xstage.errors import InputError
from xstage.moe.fused import launch_main, launch_reduce, plan
from xstage.moe.problem import Problem
from xstage.sched.costs import KindCost, TaskCosts, fit_kind  # noqa: F401
from xstage.sched.moe import FP8_ELEM_BYTES, MoeConfig, task_work
from xstage.sched.ordercost import BASELINE
from xstage.spec.moe import CALIBRATION_SHAPES, MODEL_SHAPES, REPORT_SHAPES, MoeShape, parse_block  # noqa: F401
from xstage.spec.schedule import DISPATCH, KIND_NAMES, LINEAR1, LINEAR2, check_schedule


def task_gaps(trace: np.ndarray) -> np.ndarray:
    """Gaps (ns) between consecutive tasks of each CTA, from a `[tasks, 3]` trace of (start, end, CTA)
    rows; rows with start 0 did not run. A gap is what the kernel spends between tiles: taking the next
    task, loading its row and unit, checking its inputs (and waiting, when they are not ready)."""
    t = trace[trace[:, 0] > 0]
    t = t[np.lexsort((t[:, 0], t[:, 2]))]  # by CTA, then start time
    same_cta = t[1:, 2] == t[:-1, 2]
    return (t[1:, 0] - t[:-1, 1])[same_cta].astype(float)


def trace_tasks(shape: str, tokens: int, block_spec: str | None = None, reps: int = 3, seed: int = 0,
                dtype: str = "bf16", schedule: str = BASELINE):
    """Per task of one EP=1 run in `schedule`'s order: kind and median traced duration (ns) over `reps`
    runs, the median gap between consecutive tasks of a CTA (`task_gaps`) over all runs, and the busy
    share (CTA time inside tasks over CTAs x the traced span; median over runs). `dtype` "fp8": the FP8
    buffer (its default tiles unless `block_spec` says otherwise)."""
    import torch

    if not torch.cuda.is_available():
        raise InputError("tile calibration needs a CUDA GPU (the tiles are timed in the kernel)")
    fp8 = dtype == "fp8"
    cfg = parse_block(block_spec, MoeShape.parse(shape).hidden, fp8=fp8)
    pb = Problem(shape, tokens, 1, "hbm", cfg, seed=seed, dtype=dtype)
    p = plan(pb.idx, pb.buf, schedule)
    trace = torch.zeros(p.schedule.num_tasks, 3, dtype=torch.int64, device="cuda")
    y = torch.empty_like(pb.x)
    runs, gaps, busy = [], [], []
    for _ in range(reps + 1):  # the first run compiles and warms up
        trace.zero_()
        launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p, trace=trace)
        # The reduce re-arms the readiness counters: without it the next run would find every
        # dependency met and trace no waits (nor the task overlap they cause).
        launch_reduce(pb.idx, pb.w, y, pb.buf)
        torch.cuda.synchronize()
        pb.buf.check()
        t = trace.cpu().numpy()
        runs.append(t[:, 1] - t[:, 0])
        gaps.append(task_gaps(t))
        ran = t[:, 0] > 0
        busy.append(float(runs[-1][ran].sum()) / (p.schedule.num_ctas * float(t[ran, 1].max() - t[ran, 0].min())))
    dur = np.median(np.stack(runs[1:]), axis=0).astype(float)
    gap_ns = float(np.median(np.concatenate(gaps[1:])))
    table = p.schedule.global_order()  # trace row g is the task at position g of the global order
    kinds = table[:, 0]
    H, I, E, K = MoeShape.parse(shape)
    mcfg = MoeConfig(hidden=H, intermediate=I, num_experts=E, topk=K, tokens_per_rank=tokens, ep=1,
                     block_m=cfg.block_m, block_n1=cfg.block_n1, block_n2=cfg.block_n2, block_k=cfg.block_k,
                     **(FP8_ELEM_BYTES if fp8 else {}))
    valid = table[:, 1] < len(p.layout.unit_info)  # every row is a real task of a unit
    return mcfg, cfg, kinds[valid], dur[valid], gap_ns, float(np.median(busy[1:]))


def calibrate_moe(shapes=CALIBRATION_SHAPES, tokens=4096, block_specs=(None,), reps: int = 3,
                  progress=None, model_shapes=None, dtype: str = "bf16",
                  schedules=(BASELINE,)) -> tuple[TaskCosts, list[dict]]:
    """Trace every shape at every token count and tile config; fit per-kind costs and the tile model.
    `dtype` "fp8" traces the FP8 buffer: its rows carry `elem_bytes` 1, which the planner's lookups
    and the tile model key on. `schedules` beyond `expert_wave` (which must be among them) are traced
    in the same runs for the order effect.

    Returns the costs (a cross-shape fit per kind and tile config, the measured medians per shape and
    rows per expert, which the planner interpolates, and the tile model fitted on `model_shapes`, by
    default every traced shape) and those medians as rows."""

    token_list = [int(tokens)] if isinstance(tokens, (int, np.integer)) else [int(t) for t in tokens]
    schedules = list(dict.fromkeys(schedules))
    for schedule in schedules:
        check_schedule(schedule)
    if BASELINE not in schedules:
        raise InputError(f"schedules={schedules!r}: include {BASELINE}, the order the tile costs are traced in")
    others = [s for s in schedules if s != BASELINE]
    runs = [(shape, t, b) for shape in shapes for t in token_list for b in (block_specs or (None,))]
    per_shape, means = [], []
    blocks = set()
    gaps: list[float] = []
    for i, (shape, t, spec) in enumerate(runs):
        mcfg, cfg, kinds, dur, gap_ns, busy = trace_tasks(shape, t, spec, reps, dtype=dtype)
        gaps.append(gap_ns)
        blocks.add(mcfg.block)
        for schedule in [BASELINE, *others] if others else []:  # each order's mean tile time per kind
            if schedule == BASELINE:
                o_kinds, o_dur, o_busy = kinds, dur, busy
            else:
                _, _, o_kinds, o_dur, _, o_busy = trace_tasks(shape, t, spec, reps, dtype=dtype, schedule=schedule)
            for k in (DISPATCH, LINEAR1, LINEAR2):
                sel = o_dur[(o_kinds == k) & (o_dur > 0)]
                if len(sel):
                    means.append({"shape": shape, "rows_per_expert": t * mcfg.topk / mcfg.num_experts,
                                  "schedule": schedule, "kind": KIND_NAMES[k], "mean_ns": float(np.mean(sel)),
                                  "busy": o_busy})
        for k in (DISPATCH, LINEAR1, LINEAR2):
            sel = dur[kinds == k]
            sel = sel[sel > 0]
            if len(sel):
                per_shape.append({"shape": shape, "block": mcfg.block, "kind": KIND_NAMES[k], "tokens": t,
                                  "rows_per_expert": t * mcfg.topk / mcfg.num_experts,
                                  "work": task_work(mcfg, k), "median_ns": float(np.median(sel)),
                                  "p10_ns": float(np.quantile(sel, 0.1)), "p90_ns": float(np.quantile(sel, 0.9)),
                                  "tasks": int(len(sel)), "elem_bytes": mcfg.elem_bytes})
        if progress:
            progress(i + 1, len(runs))
    kinds: dict[str, KindCost] = {}
    quality: dict[str, dict] = {}
    for block in sorted(blocks):
        for name in KIND_NAMES:
            rows = [r for r in per_shape if r["kind"] == name and r["block"] == block]
            if not rows:
                continue
            w = np.array([r["work"] for r in rows])
            t = np.array([r["median_ns"] for r in rows])
            cost = fit_kind(w, t)
            kinds[f"{name}@{block}"] = cost
            rel = [cost.time_ns(r["work"]) / r["median_ns"] - 1 for r in rows]
            quality[f"{name}@{block}"] = {"max_abs_rel_error": float(np.max(np.abs(rel))), "points": len(rows)}
    env = environment()
    prov = {k: env[k] for k in ("gpu", "driver", "torch", "triton", "git_commit", "date")}
    prov.update({"tokens": token_list, "shapes": list(shapes), "blocks": sorted(blocks), "dtype": dtype,
                 "block_specs": [spec or "default" for spec in (block_specs or (None,))],
                 "method": "in-kernel %globaltimer per task, EP=1",
                 "task_gap_ns_per_run": [round(g, 1) for g in gaps]})
    table = [{k: r[k] for k in ("shape", "block", "kind", "rows_per_expert", "median_ns", "elem_bytes")}
             for r in per_shape]
    model, prov["tile_model"] = tile_model_of(table, model_shapes)
    fetch = float(np.median(gaps)) if gaps else 0.0
    method = "mean traced tile time per kind over expert_wave's, EP=1, same shape and token count"
    order = order_effect_from_means(means, {"method": method, **{k: prov[k] for k in ("date", "git_commit")}})
    return TaskCosts("moe", kinds, prov, quality, table, fetch_ns=fetch, tile_model=model, order=order), per_shape


def tile_model_of(table: list[dict], shapes=None):
    """The tile model fitted on `table` (restricted to `shapes` when given) and a line of provenance;
    (None, why) where the traces are too few to fit it."""
    try:
        model = fit_tile_model(table, shapes=shapes)
    except InputError as exc:
        if shapes is not None:
            raise
        return None, f"not fitted: {exc}"
    used = sum(q["points"] for q in model.quality.values())
    return model, f"fitted on {', '.join(model.fitted_on)} ({used} medians)"
