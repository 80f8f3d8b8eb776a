"""Fit the experts-kernel choice's data (`xstage.sched.experts.ExpertsCalls`) on an `xstage bench experts` CSV.

`fit_experts_calls(rows, source)` keeps, per GPU, dtype, shape, kernel and mode, the geometric mean over
the measured routings of the call's time at each token count: the xstage side's rows are the fused
layer's (`kernel` column `fused`, or an older CSV without the column), the grouped_mm side's
transformers' chain. `eager` is `call_ns`, `graph` is `graph_ns`. Rows whose xstage side ran the chain
(a run of the integration's own choice) say nothing about the fused layer and are left out.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from xstage.sched.experts import FORMAT, MODES

# Choose grouped_mm only where it is predicted at least this much faster: the medians of one run move
# by a few percent between runs (`benchmarks/results/h200-moe-call-gap/`), and the fused layer is the default.
MARGIN = 0.03
_COLUMN = {"eager": "call_ns", "graph": "graph_ns"}


def fit_experts_calls(rows: list[dict], source: str) -> dict:
    """The `experts-calls.json` document of `rows` (checked rows of `read_experts_csv`)."""
    acc: dict = {}
    for r in rows:
        side = r["side"]
        kernel = "grouped_mm" if side == "grouped_mm" else (r.get("kernel") or "fused")
        if side == "xstage" and kernel != "fused":
            continue
        for mode in MODES:
            text = str(r.get(_COLUMN[mode]) or "").strip()
            if not text:
                continue
            key = (r["gpu"], r["dtype"], r["shape"], kernel, mode, int(r["tokens"]))
            acc.setdefault(key, []).append(math.log(float(text)))
    out = [dict(gpu=k[0], dtype=k[1], shape=k[2], kernel=k[3], mode=k[4], tokens=k[5],
                ns=round(math.exp(sum(v) / len(v)), 1), routings=len(v)) for k, v in sorted(acc.items())]
    return dict(format=FORMAT, source=source, margin=MARGIN, rows=out)


def source_of(csv_path) -> str:
    """How a fit names its CSV: the file name and its SHA-256."""
    p = Path(csv_path)
    return f"{p.name} sha256:{hashlib.sha256(p.read_bytes()).hexdigest()[:16]}"
