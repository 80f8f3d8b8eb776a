"""Whose drain share is it? Irregular trains scored burst by burst under four assignments of the drain
weights to the CTAs, with fair-share admission and the embedded host profile's parameters.

The model gives SM slot `i` of `n` the weight `spread ** ((i + 0.5) / n - 0.5)`: unequal sharing by slot
index. On the irregular trains a CTA's per-byte time is persistent (a CTA slow on one large burst is
slow on its next) but hardly ordered by CTA index. Four assignments, same parameters:
- `slot`: the model's (by CTA index);
- `equal`: every CTA weight 1;
- `shuffled`: the slot weights in a seeded random order (the same spread, no index order);
- `oracle`: each CTA's own measured rate over its bursts of >= 256 KiB, relative to the launch's median
  CTA (read from the bursts it then scores: an upper bound of what per-CTA weights can give, not a model).
Where the trace has an `smid` column (traces from `xstage probe --sweep irregular` after `ec72456`), it
also prints the median per-launch rank correlation of a CTA's measured rate with its SM id, and with its
TPC (`smid // 2`, two SMs sharing a texture-processing cluster). Also prints, over the bursts of
>= 256 KiB, the correlation of a CTA's log(measured / predicted) on consecutive bursts, and the median
per-launch rank correlation of per-byte time with the CTA index, measured and predicted.

    PYTHONPATH=src python3 benchmarks/experiments/drain_weights.py -o DIR TRACE.csv [TRACE.csv ...]

Writes `DIR/weights.json` (never over an existing file). Seconds per trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from xstage.model import load_default_profile
from xstage.model import trace as T
from xstage.model.fastsim import class_weights
from xstage.model.simulate import simulate_bursts
from xstage.probe.trains import split

LARGE = 262144  # bursts from this size on are backpressured in every family: they show the drain share


def _rank_corr(x, y) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def _oracle(la) -> list[float]:
    rate = np.array([b[b >= LARGE].sum() / i[b >= LARGE].sum() if (b >= LARGE).any() else np.nan
                     for b, i in zip(la.nbytes, la.issue_ns)])
    if not np.isfinite(rate).any():
        return [1.0] * len(rate)
    rate = np.where(np.isnan(rate), np.nanmedian(rate), rate)
    return list(rate / np.median(rate))


def _smids(path: str) -> dict | None:
    """(launch, cta) -> smid from the trace file's `smid` column, or None where it has none."""
    import csv

    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if "smid" not in (reader.fieldnames or []):
            return None
        return {(int(r["launch"]), int(r["cta"])): int(r["smid"]) for r in reader if r["smid"] != ""}


def score(path: str, params, seed: int = 0) -> dict:
    tr = T.read_trace(path)
    held = {f for f, s in split()["families"].items() if s == "heldout"}
    rng = np.random.default_rng(seed)
    errs = {k: {"heldout": [], "train": []} for k in ("slot", "equal", "shuffled", "oracle")}
    pairs, corr_meas, corr_pred = [], [], []
    smids, corr_sm, corr_tpc = _smids(path), [], []
    for la in tr.launches:
        if smids is not None and len(la.nbytes) > 10:
            sm = np.array([smids[la.launch, c] for c in range(len(la.nbytes))])
            rate = np.log(_oracle(la))
            if rate.std() > 0:
                corr_sm.append(_rank_corr(sm, rate))
                corr_tpc.append(_rank_corr(sm // 2, rate))
        progs, starts = la.programs()
        slot = class_weights(params, [1.0] * len(progs))
        weights = {"slot": slot, "equal": [1.0] * len(progs), "shuffled": list(rng.permutation(slot)),
                   "oracle": _oracle(la)}
        side = "heldout" if la.family in held else "train"
        for name, w in weights.items():
            res = simulate_bursts(params, progs, start_ns=starts, weights=w)
            errs[name][side].append(T.rel_error(np.concatenate(res.issue_ns), np.concatenate(la.issue_ns)))
            if name != "slot":
                continue
            per_byte_m, per_byte_p, ctas = [], [], []
            for cta, (b, i, p) in enumerate(zip(la.nbytes, la.issue_ns, res.issue_ns)):
                m = b >= LARGE
                r = np.log(i[m] / p[m])
                pairs += list(zip(r[:-1], r[1:]))
                if m.any():
                    ctas.append(cta)
                    per_byte_m.append(float(np.median(i[m] / b[m])))
                    per_byte_p.append(float(np.median(p[m] / b[m])))
            if len(ctas) > 10:
                corr_meas.append(_rank_corr(ctas, per_byte_m))
                corr_pred.append(_rank_corr(ctas, per_byte_p))
    a = np.array(pairs)
    return {"per_burst_median": {k: {s: float(np.median(np.concatenate(x))) for s, x in v.items()}
                                 for k, v in errs.items()},
            "consecutive_large_log_ratio_corr": float(np.corrcoef(a[:, 0], a[:, 1])[0, 1]), "pairs": len(a),
            "rank_corr_cta_index_per_byte": {"measured": float(np.median(corr_meas)),
                                             "predicted_slot": float(np.median(corr_pred)),
                                             "launches": len(corr_meas)},
            "rank_corr_rate_smid": None if smids is None else {
                "smid": float(np.median(corr_sm)) if corr_sm else None,
                "tpc": float(np.median(corr_tpc)) if corr_tpc else None, "launches": len(corr_sm)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    out = Path(args.out) / "weights.json"
    if out.exists():
        sys.exit(f"{out}: exists; choose another -o")
    params = load_default_profile("host").params.replace(admission="fair_share")
    res = {}
    for path in args.traces:
        r = res[path] = score(path, params)
        print(path)
        for name, v in r["per_burst_median"].items():
            print(f"  {name:9s} held-out per burst {100 * v['heldout']:.1f}%, train {100 * v['train']:.1f}%")
        c = r["rank_corr_cta_index_per_byte"]
        print(f"  consecutive large bursts of a CTA, corr of log(measured / predicted): "
              f"{r['consecutive_large_log_ratio_corr']:.2f} ({r['pairs']} pairs); rank corr of per-byte time with "
              f"the CTA index: measured {c['measured']:+.2f}, predicted {c['predicted_slot']:+.2f} "
              f"({c['launches']} launches)", flush=True)
        sm = r["rank_corr_rate_smid"]
        print("  no smid column" if sm is None else
              f"  rank corr of a CTA's rate with its SM id {sm['smid']:+.2f}, with its TPC {sm['tpc']:+.2f} "
              f"({sm['launches']} launches)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
