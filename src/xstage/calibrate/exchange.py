"""Fit the Ulysses exchange costs (`xstage.sched.exchange.ExchangeCosts`) on a calibration grid.

`fit_exchange_costs(rows, drain=...)` fits every coefficient by least squares on the rows of a
`xstage bench ulysses --grid calibration` CSV; `fit_default_exchange_costs()` fits the embedded H200
grid (`xstage/data/h200-ulysses-calibration.csv`). The library fits nothing at run time: `xstage plan
exchange-costs -o DIR` writes the fit as the JSON that `xstage/data` ships (`COSTS_JSON`), which the
planner reads (`xstage.sched.exchange.default_exchange_costs`); a test holds that file equal to a fresh
fit. The model the coefficients belong to is `xstage.sched.exchange`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from importlib import resources

import numpy as np

from xstage.errors import InputError
from xstage.results.io import cell_count, cell_time

# The fit inverts the model's own terms: its helpers are the model's, imported by name.
from xstage.sched.exchange import (
    ALIGN,
    BLOCK_M,
    CALIBRATION_CSV,
    CANDIDATES,
    ExchangeCosts,
    _line,
    _overlap_geometry,
    _overlap_steps,
    _overlap_time,
    _rank0,
    _rel_err,
    _stores_ns,
)
from xstage.sched.measured import load_results
from xstage.spec.exchange import CORES, parse_exchange


def fit_exchange_costs(rows: list[dict], *, drain: float, source: str = "calibration rows",
                       lines: Sequence[int] | None = None) -> ExchangeCosts:
    """Least-squares fit of every coefficient on the rows of a `xstage bench ulysses` CSV. Every value
    the fit reads is checked as it is read (sizes and `remote_bytes` positive integers, times finite
    and > 0): a refusal names `source` and the row's line (`lines`) or number."""
    where = {id(r): f"{source}, line {lines[i]}" if lines is not None else f"{source}, row {i + 1}"
             for i, r in enumerate(rows)}

    def num(r, c):
        return cell_time(r, c, where[id(r)]) if c == "time_ns" else float(cell_count(r, c, where[id(r)]))

    by_cfg: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r.get("time_ns") in ("", None):
            continue
        num(r, "time_ns")
        key = tuple(cell_count(r, c, where[id(r)]) for c in ("heads", "dim", "tokens", "P"))
        by_cfg.setdefault(key, {})[r["variant"]] = r
    if not by_cfg:
        raise InputError(f"{source}: no timed rows to fit exchange costs to")
    first = next(iter(next(iter(by_cfg.values())).values()))
    grid = cell_count(first, "grid", where[id(first)])
    attention, quality = {}, {}
    for core in ("triton", "cudnn"):
        for dim in sorted({k[1] for k in by_cfg}):
            pts = []
            for (H, D, T, P), v in by_cfg.items():
                row = v.get(f"attention:{core}")
                if D != dim or row is None:
                    continue
                h = -(-H // P)
                rounds = math.ceil(h * math.ceil(T / BLOCK_M) / grid)
                pts.append((rounds * 4.0 * BLOCK_M * T * D, num(row, "time_ns")))
            if len(pts) < 2:
                continue
            # relative residuals: the short configurations weigh as much as the long ones
            a, b = _line([p[0] for p in pts], [p[1] for p in pts], scale=[p[1] for p in pts])
            attention[(core, dim)] = (a, b)
            quality[f"attention:{core}@{dim}"] = _rel_err([a + b * x for x, _ in pts], [y for _, y in pts])
    copy = {}
    for core, serial in (("triton", str(parse_exchange("serial:triton"))), ("cudnn", "serial:cudnn")):
        xs, ys, att = [], [], []
        for v in by_cfg.values():
            if serial in v and f"attention:{core}" in v:
                xs.append(num(v[serial], "remote_bytes"))
                att.append(num(v[f"attention:{core}"], "time_ns"))
                ys.append(num(v[serial], "time_ns") - att[-1])
        if len(xs) >= 2:
            # residuals relative to attention alone, the measure the overhead predictions are judged by
            x0, per_byte = _line(xs, ys, scale=att)
            copy[core] = (max(0.0, x0), 1.0 / per_byte if per_byte > 0 else float("inf"))
    stores = {}
    for need, what in ((attention, "attention"), (copy, "copy")):
        if not need:
            raise InputError(f"{source}: too few rows to fit the {what} costs")
    costs = ExchangeCosts(attention, copy, stores, drain, grid, source, quality)
    for burst, name in ((False, "stores:paced"), (True, "stores:burst")):
        for dim in sorted({k[1] for k in by_cfg}):
            for aligned in (True, False):
                fit = _fit_stores([(cfg, v[name], v["attention:triton"]) for cfg, v in by_cfg.items()
                                   if cfg[1] == dim and (cfg[2] % ALIGN == 0) == aligned and name in v
                                   and "attention:triton" in v], costs)
                if fit is not None:
                    what = f"{name}@{dim}" + ("" if aligned else f"@tokens%{ALIGN}!=0")
                    stores[(burst, dim, aligned)], quality[what] = fit
    for core in CORES:
        fit = _fit_overlap(by_cfg, core, costs)
        if fit is not None:
            costs.overlap[core], quality[f"overlap:{core}"] = fit
    return costs


def _fit_stores(cases: list[tuple], costs: ExchangeCosts):
    """((s, c ns), median error) of one `stores` exchange and head dim, from (configuration, its row,
    its attention:triton row) cases: a grid search for the least median |predicted - measured
    overhead| / measured attention alone (the measure the predictions are judged by, as for
    `overlap`). None with fewer than 3 cases."""
    if len(cases) < 3:
        return None
    ss, cs = np.meshgrid(np.linspace(-0.05, 0.2, 101), np.linspace(0.0, 40e3, 161), indexing="ij")
    errs = []
    for (H, D, T, P), row, alone in cases:
        plan = _rank0(H, D, T, P)
        h = plan.heads_of(0)
        pred_alone = costs.attention_ns("triton", T, h, T, D)
        att = float(alone["time_ns"])
        pred = _stores_ns(pred_alone, h, T, (T - plan.seq_lens[0]) * h * D * 2, (ss, cs), costs)
        errs.append(np.abs(pred - pred_alone - (float(row["time_ns"]) - att)) / att)
    med = np.median(np.stack(errs), axis=0)
    i = np.unravel_index(np.argmin(med), med.shape)
    return (float(ss[i]), float(cs[i])), float(med[i])


def _fit_overlap(by_cfg: dict, core: str, costs: ExchangeCosts):
    """((y0 ns, rate B/ns, z ns, k), median error) of `overlap`'s sends and blocks, searched on a grid
    of the four for the least median |predicted - measured overhead| / measured attention alone of the
    worst `overlap:core*` exchange (the measure the predictions are judged by; the max() of the model
    defeats least squares), among those the planner ranks where the calibration has them. None with
    fewer than 3 such rows."""
    # the exchanges the planner ranks, where the calibration has them: the fit serves those
    present = {n for v in by_cfg.values() for n in v}
    ranked = [c for c in CANDIDATES if c in present and c.startswith(f"overlap:{core}")]
    cases = []
    for (H, D, T, P), v in by_cfg.items():
        alone = v.get(f"attention:{core}")
        for name, row in v.items():
            if alone is None or not name.startswith("overlap") or parse_exchange(name).core != core:
                continue
            if ranked and name not in ranked:
                continue
            plan = _rank0(H, D, T, P)
            att = float(alone["time_ns"])
            pred_alone = costs.attention_ns(core, T, plan.heads_of(0), T, D)
            # the blocks and sends do not depend on the coefficients searched: made once per case
            shape = _overlap_geometry(plan, parse_exchange(name), plan.heads_of(0) * D * 2, costs.grid)
            cases.append((shape, T, D, pred_alone, float(row["time_ns"]) - att, att, name))
    if len(cases) < 3:
        return None
    names = sorted({c[-1] for c in cases})
    of_name = [np.array([c[-1] == name for c in cases]) for name in names]
    y0s, rates = np.meshgrid(np.linspace(0.0, 60e3, 31), np.linspace(10.0, 80.0, 36), indexing="ij")
    # a send beside running attention crosses the same link as the serial copy: never faster
    too_fast = rates > costs.copy[core][1] if core in costs.copy else np.zeros_like(rates, bool)
    best = None
    for z in np.linspace(0.0, 40e3, 11):
        steps = [_overlap_steps(shape, core, T, D, costs, z) for shape, T, D, *_ in cases]
        for k in np.linspace(0.0, 0.4, 21):
            errs = np.stack([np.abs(_overlap_time(st, y0s, rates, k) - pa - over) / att
                             for st, (_, _, _, pa, over, att, _) in zip(steps, cases)])
            # the worst exchange's median: the target holds for each exchange the planner ranks
            med = np.max([np.median(errs[mask], axis=0) for mask in of_name], axis=0)
            med[too_fast] = np.inf
            i = np.unravel_index(np.argmin(med), med.shape)
            if best is None or med[i] < best[1] - 1e-12:
                best = ((float(y0s[i]), float(rates[i]), float(z), float(k)), float(med[i]))
    return best


def fit_default_exchange_costs() -> ExchangeCosts:
    """The fit on the embedded H200 host-path calibration grid, computed (about 2 s on a 2-core CPU):
    what `COSTS_JSON` holds, and what `xstage plan exchange-costs` writes."""
    from xstage.model import load_default_profile

    with resources.as_file(resources.files("xstage.data") / CALIBRATION_CSV) as path:
        res = load_results(path, kind="ulysses")
    return fit_exchange_costs(res.rows, drain=load_default_profile("host").params.drain,
                              source=f"xstage/data/{CALIBRATION_CSV}", lines=res.lines)
