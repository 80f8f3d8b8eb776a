"""FP8 sections of the fused-MoE summary: FP8 against BF16, the FP8 chain, and accuracy.

`fp8_sections(rows)` takes the rows of a `moe.csv` (each with its `dtype`) and returns markdown lines,
nothing when the file has no FP8 rows:

- **EP=1** (`ep1_fp8_table`): per configuration, fused FP8 (the schedule fastest by geomean over the
  configurations, one for all) against the FP8 chain (`chain_fp8`: quantize, `_scaled_grouped_mm`,
  SwiGLU, quantize, `_scaled_grouped_mm`) and against fused BF16 in the same schedule, with torch's
  own chain ratio (BF16 chain over FP8 chain) beside it.
- **FP8 over BF16 on the host grid** (`speedup_table`): per variant measured in both dtypes, the BF16
  time over the FP8 time, same schedule and pacing, of the public calls where both rows have a call
  time (else of the kernels); per configuration for one variant, beside its bound: the BF16 kernels'
  time over `combine_link_ns`, the time the BF16 combine rows for peers need on the link (they cross
  in BF16 in both dtypes, so FP8 can never be faster than that).
- **Accuracy** (`accuracy_table`): per configuration the largest `err_fp8_ref` and `fro_f32` over the
  fused variants, and how many outputs held a NaN or an infinity.
"""

from __future__ import annotations

import math
from collections import defaultdict

from xstage.results import geomean

_BASELINES = ("unfused", "chain", "chain_fp8")


def _num(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x


def _by_config(rows: list[dict]) -> dict[tuple, dict[tuple[str, str], dict]]:
    """(shape, tokens, ep, path) -> (dtype, variant) -> row, timed rows only."""
    out: dict[tuple, dict] = defaultdict(dict)
    for r in rows:
        if _num(r.get("time_ns")):
            out[(r["shape"], int(r["tokens"]), int(r["ep"]), r["path"])][(r["dtype"], r["variant"])] = r
    return out


def _t(cell: dict, dtype: str, variant: str) -> float | None:
    r = cell.get((dtype, variant))
    return _num(r["time_ns"]) if r else None


def _pair(cell: dict, variant: str) -> tuple[float, float, str] | None:
    """(BF16 time, FP8 time, basis) of one variant in one configuration: the calls' (`call_ns`) where
    both rows have one, else the kernels' (`time_ns`); None unless both dtypes ran."""
    rows = cell.get(("bf16", variant)), cell.get(("fp8", variant))
    if not all(rows):
        return None
    for column, basis in (("call_ns", "call"), ("time_ns", "kernels")):
        t = [_num(r.get(column)) for r in rows]
        if all(t):
            return t[0], t[1], basis
    return None


def _best_constant(cfgs: dict, dtype: str, variants: list[str]) -> str | None:
    """The variant with the lowest geomean time ratio to the per-configuration fastest, over the
    configurations where all of `variants` ran in `dtype`."""
    full = [c for c in cfgs.values() if all(_t(c, dtype, v) for v in variants)]
    if not full:
        return None
    return min(variants, key=lambda v: (geomean([_t(c, dtype, v) / min(_t(c, dtype, w) for w in variants)
                                                 for c in full]), v))


def ep1_fp8_table(cfgs: dict) -> list[str]:
    ep1 = {k: c for k, c in cfgs.items() if k[2] == 1 and _t(c, "fp8", "chain_fp8")}
    fused = sorted({v for c in ep1.values() for d, v in c if d == "fp8" and v not in _BASELINES})
    sched = _best_constant(ep1, "fp8", fused) if fused else None
    if sched is None:
        return []
    lines = ["", f"## EP=1, FP8: fused `{sched}` against the FP8 chain and against fused BF16", "",
             f"`{sched}`: the FP8 schedule fastest by geomean over these configurations (one for all). Times in us "
             "(medians); `chain_fp8` includes its two eager quantizations, the fused kernel starts from "
             "pre-quantized `(x_fp8, x_scale)` and quantizes the SwiGLU output itself.", "",
             "`oracle BF16 / FP8`: each dtype's fastest schedule per configuration, chosen after measuring.", "",
             "| shape | tokens | fused FP8 | chain_fp8 | fused FP8 / chain_fp8 | fused BF16 | BF16 / FP8 fused | "
             "oracle BF16 / FP8 | chain BF16 | chain BF16 / chain_fp8 |", "|---|---|---|---|---|---|---|---|---|---|"]
    over_chain, over_bf16 = [], []
    for key in sorted(ep1):
        c = ep1[key]
        f8, ch8 = _t(c, "fp8", sched), _t(c, "fp8", "chain_fp8")
        f16, ch16 = _t(c, "bf16", sched), _t(c, "fp8", "chain") or _t(c, "bf16", "chain")
        if not f8:
            continue
        over_chain.append(f8 / ch8)
        cells = [f"{f8 / 1e3:.0f}", f"{ch8 / 1e3:.0f}", f"{f8 / ch8:.2f}"]
        if f16:
            over_bf16.append(f16 / f8)
        best = {d: min((_t(c, d, v) for dd, v in c if dd == d and v not in _BASELINES), default=None)
                for d in ("bf16", "fp8")}
        cells += [f"{f16 / 1e3:.0f}" if f16 else "", f"{f16 / f8:.2f}" if f16 else "",
                  f"{best['bf16'] / best['fp8']:.2f}" if best["bf16"] else "",
                  f"{ch16 / 1e3:.0f}" if ch16 else "", f"{ch16 / ch8:.2f}" if ch16 else ""]
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    lines += ["", f"fused FP8 / chain_fp8: geomean {geomean(over_chain):.2f}, max {max(over_chain):.2f}"
              + (f"; fused BF16 / fused FP8: geomean {geomean(over_bf16):.2f}, min {min(over_bf16):.2f}"
                 if over_bf16 else "; no fused BF16 rows to compare") + "."]
    return lines


def speedup_table(cfgs: dict) -> list[str]:
    multi = {k: c for k, c in cfgs.items() if k[2] > 1}
    both = defaultdict(dict)  # variant -> config -> (BF16 time, FP8 time, basis)
    for key, c in multi.items():
        for d, v in c:
            if d == "fp8" and v not in _BASELINES and _pair(c, v):
                both[v][key] = _pair(c, v)
    if not both:
        return []
    lines = ["", "## FP8 over BF16, EP > 1: same schedule, same pacing", "",
             "BF16 time over FP8 time per configuration, of the public calls (`call_ns`, the FP8 call quantizing "
             "its BF16 input) where both rows have one, else of the kernels (`time_ns`); `timed` says which. "
             "`bound`: the BF16 kernels' time over `combine_link_ns`, the time the BF16 combine rows for peers "
             "need at the path profile's drain rate (the same bytes in both dtypes).",
             "", "| variant | timed | configs | geomean | min | max | FP8 slower in |", "|---|---|---|---|---|---|---|"]
    for v, s in sorted(both.items()):
        x = [a / b for a, b, _ in s.values()]
        calls = sum(basis == "call" for *_, basis in s.values())
        timed = "call" if calls == len(x) else "kernels" if not calls else f"call in {calls} of {len(x)}"
        lines.append(f"| {v} | {timed} | {len(x)} | {geomean(x):.3f} | {min(x):.3f} | {max(x):.3f} | "
                     f"{sum(r < 1 for r in x)} of {len(x)} |")
    v = max(both, key=lambda k: (len(both[k]), geomean([a / b for a, b, _ in both[k].values()]), k))
    lines += ["", f"Per configuration, `{v}`:", "",
              "| shape | tokens | EP | path | timed | BF16 (us) | FP8 (us) | BF16 / FP8 | bound |",
              "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(both[v]):
        c = multi[key]
        t16, t8, basis = both[v][key]
        link = _num(c[("fp8", v)].get("combine_link_ns"))
        bound = f"{_t(c, 'bf16', v) / link:.2f}" if link else ""
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {basis} | {t16 / 1e3:.0f} | {t8 / 1e3:.0f} | "
                     f"{t16 / t8:.3f} | {bound} |")
    return lines


def accuracy_table(rows: list[dict]) -> list[str]:
    acc: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        e, f = _num(r.get("err_fp8_ref")), _num(r.get("fro_f32"))
        if r["dtype"] == "fp8" and e is not None and f is not None:
            acc[(r["shape"], int(r["tokens"]), int(r["ep"]), r["path"])].append((e, f))
    if not acc:
        return []
    lines = ["", "## FP8 accuracy", "",
             "Per configuration, the largest over the fused variants of `err_fp8_ref` (max|y - ref| / max|ref| "
             "against the FP8-emulating reference) and `fro_f32` (relative Frobenius error against float32 on the "
             "dequantized weights, unquantized activations); `non-finite`: outputs with a NaN or an infinity.", "",
             "| shape | tokens | EP | path | variants | err_fp8_ref | fro_f32 | non-finite |",
             "|---|---|---|---|---|---|---|---|"]
    for key in sorted(acc):
        v = acc[key]
        bad = sum(not (math.isfinite(e) and math.isfinite(f)) for e, f in v)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {len(v)} | {max(e for e, _ in v):.2e} | "
                     f"{max(f for _, f in v):.4f} | {bad} |")
    e = [x for v in acc.values() for x, _ in v]
    f = [y for v in acc.values() for _, y in v]
    lines += ["", f"Over all {len(e)} FP8 outputs: err_fp8_ref max {max(e):.2e}, fro_f32 max {max(f):.4f}."]
    return lines


def fp8_sections(rows: list[dict]) -> list[str]:
    """The FP8 sections (module docstring) of `rows` with a `dtype` each; [] without FP8 rows."""
    if not any(r["dtype"] == "fp8" for r in rows):
        return []
    cfgs = _by_config(rows)
    return ep1_fp8_table(cfgs) + speedup_table(cfgs) + accuracy_table(rows)
