"""Does the fused Ulysses kernel change with the sequence length's divisibility by 16? (one GPU)

Triton compiles a separate kernel for integer arguments divisible by 16 (and assumes that divisibility
in the generated code). Of the Ulysses grid's lengths only 32760 is not divisible by 16, and there the
paced fused kernel ran 11-12% over attention alone at 30x64 (4-6% at the lengths around it) and its
compiled kernel held 225 registers against 174 at 118800 (`../results/h200-ulysses-trace/`). This
experiment times attention alone and the paced exchange (`host` path) with two builds of the same
kernel, configuration by configuration and the builds in turn:
- `specialized`: the library's kernel (lengths specialized by divisibility);
- `unspecialized`: the same source with `do_not_specialize` on the lengths and tile counts (`S_q`,
  `S_k`, `n_m`, `n_tiles`), so every length runs one compiled kernel.
at 32760 (not divisible), 32768 (divisible, 8 tokens more) and 118800 (divisible).

Writes `length_specialization.csv` and `.md` under `--out` (default `$OUT`) and prints a short table.

    PYTHONPATH=src python3 benchmarks/experiments/ulysses_length_specialization.py --out OUT_DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ulysses_trace  # noqa: E402  (its `measure` times one configuration's variants)

# Internal: it tests flash._attn_fwd_kernel's specialization by length, rebuilding and swapping that kernel.
from xstage.attention import flash  # noqa: E402
from xstage.results.io import write_csv_atomic  # noqa: E402
from xstage.results.tables import markdown_table  # noqa: E402

LENGTH_ARGS = ["S_q", "S_k", "n_m", "n_tiles"]
VARIANTS = (("attention", "-"), ("stores:paced", "host"))
COLUMNS = ["build", "tokens", "P", "heads", "dim", "variant", "time_ns", "p10_ns", "p90_ns", "ratio_vs_attention",
           "loop_ns_med", "epilogue_ns_med", "n_regs", "n_spills", "exchange_ok", "error"]


def builds(which=("unspecialized",)) -> dict:
    """The library's kernel and the rebuilt ones named in `which`: `unspecialized` (every length
    argument) or `unspecialized:NAME` (that argument only)."""
    spec = flash._attn_fwd_kernel
    out = {"specialized": spec}
    for name in which:
        args = LENGTH_ARGS if name == "unspecialized" else [name.split(":", 1)[1]]
        out[name] = triton.jit(do_not_specialize=args)(spec.fn)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", "-o", type=Path, default=os.environ.get("OUT") or None)
    p.add_argument("--tokens", type=ulysses_trace._int_list, default=[32760, 32768, 118800])
    p.add_argument("--worlds", type=ulysses_trace._int_list, default=[2, 8])
    p.add_argument("--shapes", type=ulysses_trace._shape_list, default=[(24, 128), (30, 64)])
    p.add_argument("--rep", type=int, default=7)
    p.add_argument("--budget-s", type=float, default=400.0)
    p.add_argument("--builds", default="unspecialized",
                   help="rebuilt kernels beside the library's, comma-separated: unspecialized (every length "
                        "argument) or unspecialized:NAME (one of " + ", ".join(LENGTH_ARGS) + ")")
    args = p.parse_args(argv)
    if args.out is None:
        p.error("--out: required where $OUT is not set")
    if not torch.cuda.is_available():
        print("ulysses_length_specialization: no CUDA GPU; this experiment times kernels on one", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    args.out.mkdir(parents=True, exist_ok=True)
    env = ulysses_trace._env()
    kernels = builds(tuple(b for b in args.builds.split(",") if b))
    rows: list[dict] = []
    t0 = time.monotonic()
    for t in args.tokens:
        for P in args.worlds:
            for h, d in args.shapes:
                if time.monotonic() - t0 > args.budget_s:
                    print("budget spent; stopping", flush=True)
                    break
                for name, kernel in kernels.items():
                    flash._attn_fwd_kernel = kernel
                    try:
                        got = ulysses_trace.measure({"tokens": t, "P": P, "heads": h, "dim": d}, device=device,
                                                    rep=args.rep, variants=VARIANTS)
                    finally:
                        flash._attn_fwd_kernel = kernels["specialized"]
                    rows += [{**r, "build": name} for r in got]
                    ulysses_trace._free(device)
                write_csv_atomic(args.out / "length_specialization.csv", [{**r, **env} for r in rows],
                                 COLUMNS + ulysses_trace.ENV_COLUMNS)
    short = [{"tokens": r["tokens"], "P": r["P"], "shape": f"{r['heads']}x{r['dim']}", "build": r["build"],
              "variant": r["variant"], "ms": r.get("time_ns", float("nan")) / 1e6,
              "x_attn": r.get("ratio_vs_attention", ""), "loop_us": r.get("loop_ns_med", float("nan")) / 1e3,
              "regs": r.get("n_regs", ""), "ok": r.get("exchange_ok", ""), "err": str(r.get("error", ""))[:40]}
             for r in rows]
    table = markdown_table(short, list(short[0]), floatfmt=".4g") if short else "(no rows)"
    (args.out / "length_specialization.md").write_text(
        f"# Length specialization of the fused Ulysses kernel\n\n{env}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
