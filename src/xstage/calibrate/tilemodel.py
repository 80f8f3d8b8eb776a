"""Fit the tile roofline (`xstage.sched.tilecost.TileModel`) on traced tile times, and task costs as if
only some shapes had been traced (`costs_calibrated_on`, for planner evaluations on held-out shapes).
`xstage plan calibrate` writes the fitted model into the task costs; the planner only reads it.
"""

from __future__ import annotations

import numpy as np

from xstage.calibrate.ordereffect import restrict_order_effect
from xstage.errors import InputError
from xstage.sched.costs import TaskCosts, _gaps_of_shapes
from xstage.sched.tilecost import GEMM_KINDS, TileModel, _positive, tile_work, unit_gemm_tiles
from xstage.spec.moe import MoeShape


def _least_squares(residuals, starts, lower) -> np.ndarray:
    """The best of several local least-squares fits (the roofline's max has kinks)."""
    from scipy import optimize

    best = None
    for x0 in starts:
        sol = optimize.least_squares(residuals, x0, bounds=(lower, np.inf), x_scale="jac")
        if best is None or sol.cost < best.cost:
            best = sol
    return best.x


def fit_tile_model(rows, shapes=None) -> TileModel:
    """Fit the five constants to measured task medians (module docstring).

    rows: dicts with shape, block, kind, rows_per_expert, median_ns and optionally elem_bytes (2 where
    absent): `TaskCosts.table` rows or `moe-tiles.csv` rows. shapes: fit on those shapes' rows only
    (default: every shape in `rows`). Needs at least 3 GEMM tiles and 2 dispatch tasks."""
    from scipy import optimize

    rows = list(rows)
    if shapes is not None:
        wanted = [str(MoeShape.parse(s, "shapes")) for s in shapes]
        have = {str(r.get("shape")) for r in rows}
        missing = [s for s in wanted if s not in have]
        if missing:
            raise InputError(f"shapes={missing}: no measured tiles of these shapes; have {sorted(have)}")
        rows = [r for r in rows if str(r.get("shape")) in wanted]
    gemm, disp = [], []
    for r in rows:
        try:
            kind, t, e = str(r["kind"]), float(r["median_ns"]), int(r.get("elem_bytes") or 2)
            args = (r["shape"], r["block"], float(r["rows_per_expert"]), e)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"tile model fit: malformed row {r!r} ({type(exc).__name__}: {exc})") from None
        w = tile_work(kind, *args[:3], elem_bytes=e)
        _positive("median_ns", t)
        if kind in GEMM_KINDS:
            gemm.append((w, t))
        else:
            disp.append((w, unit_gemm_tiles(*args), t))
    if len(gemm) < 3 or len(disp) < 2:
        raise InputError(f"tile model fit: needs >= 3 GEMM tiles and >= 2 dispatch tasks, got {len(gemm)} and "
                         f"{len(disp)} (trace more shapes or token counts)")
    flops = np.array([w.flops * w.elem_bytes / 2 for w, _ in gemm])  # at 2-byte operands
    hbm = np.array([w.hbm_bytes for w, _ in gemm])
    t_gemm = np.array([t for _, t in gemm])

    def gemm_res(x):
        return np.log((x[0] + np.maximum(flops * np.exp(-x[1]), hbm * np.exp(-x[2]))) / t_gemm)

    rate0, bw0, t0 = np.log(np.max(flops / t_gemm)), np.log(np.max(hbm / t_gemm)), float(np.min(t_gemm))
    starts = [np.array([o, rate0 + dr, bw0 + db]) for o in (0.0, 0.1 * t0) for dr in (0, 0.4) for db in (0, 0.4)]
    o, log_rate, log_bw = _least_squares(gemm_res, starts, [0.0, -np.inf, -np.inf])
    base = TileModel(float(o), float(np.exp(log_rate)), float(np.exp(log_bw)), 1.0, 0.0)

    def rho(tiles):
        busy = sum(n * w.hbm_bytes / base.hbm_bytes_per_ns for n, w in tiles)
        return busy / sum(n * base.gemm_ns(w) for n, w in tiles)

    queued = np.array([w.chunks * rho(tiles) ** 2 for w, tiles, _ in disp])
    copied = np.array([w.copy_bytes for w, _, _ in disp])
    t_disp = np.array([t for _, _, t in disp])
    # Start from the linear least squares of relative errors (nonnegative), then fit log errors.
    (lat0, inv_bw0), _ = optimize.nnls(np.stack([queued, copied], axis=1) / t_disp[:, None], np.ones(len(t_disp)))
    inv_bw0 = inv_bw0 if inv_bw0 > 0 else float(np.median(t_disp / copied))

    def disp_res(x):
        return np.log((queued * x[0] + copied * np.exp(-x[1])) / t_disp)

    lat, log_copy = _least_squares(disp_res, [np.array([lat0, -np.log(inv_bw0)])], [0.0, -np.inf])
    model = TileModel(base.overhead_ns, base.mma_flops_per_ns, base.hbm_bytes_per_ns, float(np.exp(log_copy)),
                      float(lat), fitted_on=tuple(sorted({str(MoeShape.parse(r["shape"])) for r in rows})))
    errors: dict[str, list[float]] = {}
    for r in rows:
        pred = model.tile_ns(str(r["kind"]), r["shape"], r["block"], float(r["rows_per_expert"]),
                             int(r.get("elem_bytes") or 2))
        errors.setdefault(str(r["kind"]), []).append(abs(pred / float(r["median_ns"]) - 1))
    quality = {k: {"median_abs_rel_error": float(np.median(v)), "max_abs_rel_error": float(np.max(v)),
                   "points": len(v)} for k, v in sorted(errors.items())}
    return TileModel(*(getattr(model, k) for k in TileModel.CONSTANTS), fitted_on=model.fitted_on, quality=quality)


def costs_calibrated_on(costs: TaskCosts, shapes) -> TaskCosts:
    """These costs as if only `shapes` had been traced: their table rows, the tile model refitted on
    them, `fetch_ns` from their runs' gaps where the provenance lists them per run, their order effect,
    and no per-kind fits (those were fitted over every traced shape). For planner evaluations on
    held-out shapes."""
    wanted = [str(MoeShape.parse(s, "shapes")) for s in shapes]
    if not wanted:
        raise InputError("shapes=[]: give at least one calibration shape")
    table = [r for r in costs.table if r["shape"] in wanted]
    model = fit_tile_model(table, shapes=wanted)
    prov = {"calibrated_on": wanted, "from": costs.provenance}
    gaps = _gaps_of_shapes(costs.provenance, wanted)
    if gaps:
        prov["fetch_ns"] = "median gap of these shapes' runs"
    else:
        prov["fetch_ns"] = "median gap of every traced shape's runs (no gaps per run in the provenance)"
    order = restrict_order_effect(costs.order, wanted) if costs.order is not None else None
    return TaskCosts(costs.kernel, {}, prov, {"tile_model": model.quality}, table,
                     fetch_ns=float(np.median(gaps)) if gaps else costs.fetch_ns, tile_model=model, order=order)
