"""The fused MoE kernel with its bounded row pool against the kernel before it (rows sized by
capacity_factor), timed alternately in one GPU session.

Each round runs every configuration once per tree, in a child process per tree (two versions of one
package cannot share a process), new then old; rows carry the round, the tree and the commit.

    git archive --prefix=old-kernel/ OLD_COMMIT src | tar -x    # the previous tree, untracked
    XSTAGE_GIT_COMMIT=$(git rev-parse --short=12 HEAD) PYTHONPATH=src \\
        python3 benchmarks/experiments/moe_pool_vs_capacity.py --old old-kernel/src --old-commit OLD_COMMIT -o DIR
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

SHAPES = ("H4096-I2048-E256-K6", "H7168-I3072-E384-K6", "H4096-I1536-E128-K8", "H1152-I4608-E8-K2")

MEASURE = r"""
import json, sys, torch
from xstage.bench.moe import time_fused
from xstage.moe.problem import MoeShape, Problem, parse_block
configs, schedule, warmup, rep = json.loads(sys.argv[1])
for shape, tokens, ep in configs:
    H = MoeShape.parse(shape).hidden
    pb = Problem(shape, tokens, ep, "host", parse_block(None, H))
    main, _red, y, _ctas = time_fused(pb, schedule, warmup, rep)
    mem = sum(t.numel() * t.element_size() for t in (pb.buf.recv, pb.buf.act))
    print(json.dumps(dict(shape=shape, tokens=tokens, ep=ep, time_ns=main.median_ns, p10_ns=main.p10_ns,
                          p90_ns=main.p90_ns, pool_bytes=mem, checksum=float(y.float().abs().sum()))), flush=True)
    del pb
    torch.cuda.empty_cache()
"""


def measure(tree: str, configs, schedule: str, warmup: int, rep: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps([configs, schedule, warmup, rep])], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="src folder of the previous tree")
    ap.add_argument("--old-commit", required=True, help="the commit the previous tree was taken from")
    ap.add_argument("-o", "--out", required=True, help="output folder (pool-vs-capacity.csv)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")
    ap.add_argument("--schedule", default="lag:8", help="the fused kernel's variant (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs per configuration (default %(default)s)")
    ap.add_argument("--rep", type=int, default=15, help="timed runs per configuration (default %(default)s)")
    a = ap.parse_args()
    new_commit = os.environ.get("XSTAGE_GIT_COMMIT")
    if not new_commit:
        print("set XSTAGE_GIT_COMMIT to this tree's commit", file=sys.stderr)
        return 2
    configs = [(s, t, ep) for s in SHAPES for t in (1024, 8192) for ep in (2, 8)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rnd in range(a.rounds):
        for tree, label, commit in (("src", "pool", new_commit), (a.old, "capacity", a.old_commit)):
            for r in measure(tree, configs, a.schedule, a.warmup, a.rep):
                rows.append(dict(round=rnd, kernel=label, git_commit=commit, schedule=a.schedule, **r))
                print(f"round {rnd} {label:8} {r['shape']} T={r['tokens']} EP={r['ep']}: {r['time_ns'] / 1e3:9.1f} us",
                      flush=True)
    with (out / "pool-vs-capacity.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ratios = []
    print("\n| shape | tokens | EP | pool (us) | capacity (us) | pool / capacity | pool MiB | capacity MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for s, t, ep in configs:
        sel = [r for r in rows if (r["shape"], r["tokens"], r["ep"]) == (s, t, ep)]
        new = statistics.median(r["time_ns"] for r in sel if r["kernel"] == "pool")
        old = statistics.median(r["time_ns"] for r in sel if r["kernel"] == "capacity")
        mem_new = sel[0]["pool_bytes"] if sel[0]["kernel"] == "pool" else sel[1]["pool_bytes"]
        mem_old = next(r["pool_bytes"] for r in sel if r["kernel"] == "capacity")
        ratios.append(new / old)
        print(f"| {s} | {t} | {ep} | {new / 1e3:.1f} | {old / 1e3:.1f} | {new / old:.3f} | {mem_new / 2**20:.0f} | "
              f"{mem_old / 2**20:.0f} |")
    gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    print(f"\ngeomean pool / capacity {gm:.3f}, worst {max(ratios):.3f}, best {min(ratios):.3f} "
          f"over {len(ratios)} configurations ({a.rounds} alternating rounds, medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
