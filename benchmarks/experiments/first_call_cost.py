"""What a fresh process pays before its first decision: `import xstage` beside `import torch`, the MoE
kernels' package (`from xstage.moe import fused_moe`), and the first `exchange="auto"` decision after
its imports, for one or more source trees, in turns.

Each measurement is its own fresh Python process (the trees take turns, `--rounds` times); times are
wall clock inside the process (`time.perf_counter`), medians with p10/p90 per tree.

    PYTHONPATH=src python3 benchmarks/experiments/first_call_cost.py --tree now=src \\
        --tree before=/tmp/before/src -o benchmarks/results/cpu-first-call
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from xstage.env import environment

_IMPORT_TORCH = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
_IMPORT_XSTAGE = "import time; t = time.perf_counter(); import xstage; print(time.perf_counter() - t)"
# What a MoE user imports: the kernels' package and, through it, torch, Triton and the planner.
_IMPORT_MOE = "import time; t = time.perf_counter(); from xstage.moe import fused_moe; print(time.perf_counter() - t)"
# The first decision as `exchange="auto"` makes it: the planner's pick for one call shape.
_FIRST_AUTO = ("import time; import xstage; from xstage.attention.exchange import resolve_auto; "
               "from xstage.attention.layout import UlyssesPlan; "
               "t = time.perf_counter(); "
               "resolve_auto(UlyssesPlan(4, 0, 1, [8192] * 4, 24, 128), 'bf16', 'host', None); "
               "print(time.perf_counter() - t)")


def _run(code: str, src: str | None) -> float:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _stats(v: list[float]) -> dict:
    return {"median_s": float(np.median(v)), "p10_s": float(np.percentile(v, 10)),
            "p90_s": float(np.percentile(v, 90)), "n": len(v)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=SRC",
                    help="a source tree to import xstage from (repeatable)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("-o", "--out", required=True, type=Path)
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    kinds = ("torch", "xstage", "moe", "first_auto")
    times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in kinds} for n in trees}
    for _ in range(args.rounds):
        for name, src in trees.items():
            times[name]["torch"].append(_run(_IMPORT_TORCH, src))
            times[name]["xstage"].append(_run(_IMPORT_XSTAGE, src))
            times[name]["moe"].append(_run(_IMPORT_MOE, src))
            times[name]["first_auto"].append(_run(_FIRST_AUTO, src))
    result = {"environment": environment(), "trees": trees,
              "results": {n: {k: _stats(v) for k, v in t.items()} for n, t in times.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "first_call_cost.json"
    if path.exists():
        raise SystemExit(f"{path}: exists; give a new folder")
    path.write_text(json.dumps(result, indent=1) + "\n")
    for name, t in result["results"].items():
        add = t["xstage"]["median_s"] - t["torch"]["median_s"]
        print(f"{name}: import torch {t['torch']['median_s']:.2f} s, import xstage {t['xstage']['median_s']:.2f} s "
              f"(+{add:.2f} s), from xstage.moe import fused_moe {t['moe']['median_s']:.2f} s, "
              f"first auto decision {t['first_auto']['median_s'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
