"""Where does the fused Ulysses kernel's time go at long sequences? (one GPU, loopback rank 0, no torchrun)

With the exchange in the epilogue the kernel runs a few percent longer than attention alone at 118800
tokens, although the link is busy only a small share of the time. This experiment times each variant
untraced, then runs it once with the kernel trace (`flash_attention(..., trace=)`, layout in
`xstage.attention.flash.trace_buffer`) and reduces the trace per variant to: the median key loop and
epilogue per tile, the share of key-loop time spent issuing paced sends, how far apart the programs
finish a round of tiles (they run in step when the spread is small), and the after-loop sends. It also
reports the registers and spills of each compiled kernel and the clock reads in its PTX (the
untraced pacing must read none).

Configurations: tokens x P x (heads, dim), batch 1, bf16, rank 0 of a loopback group of P (as
`xstage bench ulysses`: rank 0's heads over the whole sequence). Variants (variant, path):
- `attention` (-): the kernel alone, output to local memory;
- `attention:traced` (-): the same, timed with the trace on (the trace's own cost);
- `stores:paced` (host): the paced exchange into pinned host memory over PCIe;
- `stores:burst` (host): whole tiles stored in the epilogue;
- `stores:paced` (hbm): the paced exchange into device memory (no link: staging and epilogue cost).

Writes `trace_summary.csv` and `trace_summary.md` under `--out` (default `$OUT`) after every
configuration, and prints a short table last.

    PYTHONPATH=src python3 benchmarks/experiments/ulysses_trace.py --out OUT_DIR [--tokens 118800] [--worlds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time
from pathlib import Path

import torch

from xstage.attention.flash import (
    TRACE_CHUNKS,
    TRACE_END,
    TRACE_LOOP_END,
    TRACE_SEND_NS,
    TRACE_SM,
    TRACE_START,
    default_config,
    flash_attention,
    launch_grid,
    trace_buffer,
)
from xstage.attention.layout import empty_gathered_out, unpack_qkv
from xstage.attention.ulysses import fused_state, loopback_gather, wait_fused
from xstage.comm import create_context
from xstage.results.io import write_csv_atomic
from xstage.results.tables import markdown_table
from xstage.results.timing import events, synchronize, time_device
from xstage.spec.ulysses import UlyssesPlan, split_sizes

TOKENS = (118800, 32760)  # the long sequence first: a run cut short by --budget-s keeps it
WORLDS = (2, 4, 8)
SHAPES = ((24, 128), (30, 64))
VARIANTS = (("attention", "-"), ("attention:traced", "-"), ("stores:paced", "host"), ("stores:burst", "host"),
            ("stores:paced", "hbm"))
COLUMNS = [
    "tokens", "P", "heads", "dim", "rank_heads", "variant", "path", "block_m", "block_n", "chunk_rows", "grid",
    "tiles", "tiles_per_prog", "time_ns", "p10_ns", "p90_ns", "ratio_vs_attention", "traced_ns",
    "tile_ns_med", "loop_ns_med", "epilogue_ns_med", "gap_ns_med", "send_share", "send_ns_per_chunk",
    "chunks_in_loop", "chunks_after", "tail_ns_med", "end_spread_ns", "launch_skew_ns", "span_ns",
    "distinct_sms", "n_regs", "n_spills", "ptx_clock_reads", "traced_regs", "traced_spills", "exchange_ok", "error",
]
ENV_COLUMNS = ["git_commit", "gpu", "torch", "triton", "date"]
PRINT_COLUMNS = ["tokens", "P", "shape", "variant", "path", "time_ms", "x_attn", "traced_ms", "loop_us", "epi_us",
                 "send_share", "end_spread_us", "tail_us", "regs", "spills", "traced_regs", "clocks"]


def trace_stats(trace: torch.Tensor, n_tiles: int) -> dict:
    """Per-tile statistics of one traced run (`trace`: `[grid, tiles_per_prog + 1, 6]`, see
    `trace_buffer`): medians of tile, key loop, epilogue and inter-tile gap (ns); the share of key-loop
    time inside paced sends; ns per chunk sent; chunks sent in key loops and after the loop; the median
    after-loop duration; the median over full rounds (row j of every program) of the p90 - p10 spread
    of tile end times; the p90 - p10 spread of first-tile starts; the span from the first start to the
    last end; and the number of distinct SMs."""
    t = trace.detach().cpu().to(torch.int64)
    grid, n_rows, _ = t.shape
    per_prog = n_rows - 1
    tiles = torch.arange(grid)[:, None] + grid * torch.arange(per_prog)[None, :]
    has = tiles < n_tiles  # [grid, per_prog]
    r = t[:, :per_prog]
    if not has.any():
        return {}
    origin = r[..., TRACE_START][has].min()
    rel = (r[..., :TRACE_SEND_NS] - origin).to(torch.float64)  # start, loop end, end relative to the first start

    def med(x):
        return float(x.to(torch.float64).median()) if x.numel() else float("nan")

    def spread(x):
        x = x.to(torch.float64)
        return float(torch.quantile(x, 0.9) - torch.quantile(x, 0.1)) if x.numel() else float("nan")

    loop = (r[..., TRACE_LOOP_END] - r[..., TRACE_START])[has]
    send = r[..., TRACE_SEND_NS][has]
    chunks = r[..., TRACE_CHUNKS][has]
    gaps = (r[:, 1:, TRACE_START] - r[:, :-1, TRACE_END])[has[:, 1:]]
    full = [j for j in range(per_prog) if has[:, j].all()]
    tail = t[:, per_prog]
    n_chunks = int(chunks.sum())
    return {
        "tile_ns_med": med((r[..., TRACE_END] - r[..., TRACE_START])[has]),
        "loop_ns_med": med(loop),
        "epilogue_ns_med": med((r[..., TRACE_END] - r[..., TRACE_LOOP_END])[has]),
        "gap_ns_med": med(gaps),
        "send_share": float(send.sum()) / float(loop.sum()) if int(loop.sum()) > 0 else float("nan"),
        "send_ns_per_chunk": float(send.sum()) / n_chunks if n_chunks else float("nan"),
        "chunks_in_loop": n_chunks,
        "chunks_after": int(tail[:, TRACE_CHUNKS].sum()),
        "tail_ns_med": med(tail[:, TRACE_END] - tail[:, TRACE_START]),
        "end_spread_ns": med(torch.tensor([spread(rel[:, j, 2]) for j in full])) if full else float("nan"),
        "launch_skew_ns": spread(rel[:, 0, 0]),
        "span_ns": float(max(int(r[..., TRACE_END][has].max()), int(tail[:, TRACE_END].max())) - int(origin)),
        "distinct_sms": int(torch.unique(r[..., TRACE_SM][has]).numel()),
    }


def kernel_info(kernel) -> dict:
    """Registers, spills and clock reads (`%globaltimer`, `%clock`, `%clock64`) in the PTX of a compiled
    kernel (blank in the interpreter, which compiles nothing)."""
    if kernel is None:
        return {"n_regs": "", "n_spills": "", "ptx_clock_reads": ""}
    ptx = kernel.asm.get("ptx", "")
    return {"n_regs": getattr(kernel, "n_regs", ""), "n_spills": getattr(kernel, "n_spills", ""),
            "ptx_clock_reads": ptx.count("%globaltimer") + ptx.count("%clock")}


def _timed(launch, settle, warmup: int, rep: int):
    """Median of `rep` event-timed launches after `warmup`; `settle` (untimed, between launches) hands
    back the fused exchange's counters."""
    for _ in range(warmup):
        launch()
        settle()
    pending = [False]

    def fn():
        launch()
        pending[0] = True

    def sync():
        if pending[0]:
            settle()
            pending[0] = False

    t = time_device(fn, warmup=0, rep=rep, sync=sync)
    sync()
    return t


def _traced_once(launch, settle, trace):
    """Event time of one traced launch; the trace holds that launch. An untimed traced launch before it
    compiles the traced kernel and keeps the device busy while the host prepares the timed one."""
    launch(trace)
    settle()
    start, end = events(2)
    start.record()
    launch(trace)
    end.record()
    settle()
    synchronize()
    return start.elapsed_time(end) * 1e6


def measure(cfg: dict, *, device: torch.device, dtype=torch.bfloat16, flash_cfg=None, warmup: int = 1,
            rep: int = 5, timeout_ns: int = 5_000_000_000, variants=VARIANTS) -> list[dict]:
    """Rows of every variant of one configuration (`tokens`, `P`, `heads`, `dim`) on rank 0 of a
    loopback group of P on `device` (a CPU runs it in the interpreter, for tests)."""
    H, D, T, P = cfg["heads"], cfg["dim"], cfg["tokens"], cfg["P"]
    plan = UlyssesPlan(P, 0, 1, split_sizes(T, P), H, D)
    fc = flash_cfg or default_config(D, dtype, device)
    h0, h1 = plan.head0[0], plan.head0[1]
    h = h1 - h0
    g = torch.Generator(device=device).manual_seed(0)
    # the receive buffer of the pre-attention all-to-all, [S, 3, B, h, D], filled as peers would
    recv = torch.empty(T, 3, 1, h, D, dtype=dtype, device=device)
    for i in range(3):
        local = torch.randn(1, plan.seq_lens[0], H, D, generator=g, device=device, dtype=torch.float32).to(dtype)
        recv[:, i].copy_(loopback_gather(plan, local)[:, :, h0:h1].transpose(0, 1))
        del local
    qg, kg, vg = unpack_qkv(plan, recv.view(-1))
    og = empty_gathered_out(plan, dtype, device)
    grid, per_prog = launch_grid(qg, fc)
    n_tiles = h * math.ceil(T / fc.block_m)
    common = {"tokens": T, "P": P, "heads": H, "dim": D, "rank_heads": h, "block_m": fc.block_m,
              "block_n": fc.block_n, "chunk_rows": min(fc.block_m, fc.chunk_rows or max(1, 2048 // D)),
              "grid": grid, "tiles": n_tiles, "tiles_per_prog": per_prog}
    contexts: dict[str, object] = {}
    rows: list[dict] = []
    attention_ns = float("nan")
    try:
        for variant, path in variants:
            row = {**common, "variant": variant, "path": path, "exchange_ok": ""}
            try:
                launched: list = []
                if variant.startswith("attention"):
                    def launch(trace=None, _l=launched):
                        flash_attention(qg, kg, vg, out=og, config=fc, trace=trace, launched=_l)

                    def settle():
                        pass
                    ctx = state = None
                else:
                    if path not in contexts:
                        contexts[path] = create_context(path=path, loopback_world=P, rank=0, device=device,
                                                        timeout_ns=timeout_ns)
                    ctx = contexts[path]
                    state = fused_state(ctx, plan, dtype, fc.block_m)
                    state.route = dataclasses.replace(state.route, paced=variant == "stores:paced")

                    def launch(trace=None, _l=launched, _s=state):
                        flash_attention(qg, kg, vg, config=fc, route=_s.route, out=_s.own_output(), trace=trace,
                                        launched=_l)

                    def settle(_s=state, _c=ctx):
                        wait_fused(_s, _c)

                trace = trace_buffer(qg, fc)
                if variant == "attention:traced":
                    timing = _timed(lambda _t=trace: launch(_t), settle, warmup, rep)
                    traced_ns = timing.median_ns
                else:
                    timing = _timed(launch, settle, warmup, rep)
                    if state is not None:
                        for t in state.out.peers:
                            t.fill_(float("nan"))
                    traced_ns = _traced_once(launch, settle, trace)
                if ctx is not None:
                    ctx.check()
                    ok = True
                    for p in range(P):
                        got = state.out.peers[p][:, :plan.seq_lens[p], h0:h1].to(device)
                        ok &= bool(torch.equal(got, og[:, plan.tok0[p]:plan.tok0[p + 1]]))
                    row["exchange_ok"] = int(ok)
                if variant == "attention":
                    attention_ns = timing.median_ns
                traced_kernel = kernel_info(launched[-1])
                row.update(time_ns=timing.median_ns, p10_ns=timing.p10_ns, p90_ns=timing.p90_ns,
                           ratio_vs_attention=timing.median_ns / attention_ns, traced_ns=traced_ns,
                           traced_regs=traced_kernel["n_regs"], traced_spills=traced_kernel["n_spills"],
                           **trace_stats(trace, n_tiles), **kernel_info(launched[0]))
            except Exception as e:  # one failing variant (a timeout, a compile error) is a result too
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(row)
    finally:
        for ctx in contexts.values():
            ctx.close()
    return rows


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers separated by commas")
    return vals


def _shape_list(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(x) for x in spec.split("x")) for spec in text.split(",") if spec.strip()]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected HEADSxDIM[,...], e.g. 24x128,30x64")
    return shapes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", "-o", type=Path, default=os.environ.get("OUT") or None,
                   help="output folder (default $OUT)")
    p.add_argument("--tokens", type=_int_list, default=list(TOKENS), help="total tokens, comma-separated "
                   "(default %(default)s, in this order)")
    p.add_argument("--worlds", type=_int_list, default=list(WORLDS), help="group sizes P (default %(default)s)")
    p.add_argument("--shapes", type=_shape_list, default=list(SHAPES), help="HEADSxDIM,... (default 24x128,30x64)")
    p.add_argument("--warmup", type=int, default=1, help="untimed launches per variant (default %(default)s)")
    p.add_argument("--rep", type=int, default=5, help="timed launches per variant (default %(default)s)")
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="start no new configuration after this many seconds (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=5.0,
                   help="progress watchdog of the fused exchange's waits (default %(default)s)")
    args = p.parse_args(argv)
    if args.out is None:
        p.error("--out: required where $OUT is not set")
    if args.warmup < 0 or args.rep < 1:
        p.error("--warmup must be >= 0 and --rep >= 1")
    return args


def _env() -> dict:
    from xstage.env import environment

    env = environment()
    commit = os.environ.get("XSTAGE_GIT_COMMIT", "").strip() or env["git_commit"]
    return {"git_commit": commit, "gpu": env["gpu"], "torch": env["torch"], "triton": env["triton"],
            "date": env["date"]}


def _short(rows: list[dict]) -> list[dict]:
    def us(r, c):
        v = r.get(c)
        return v / 1e3 if isinstance(v, (int, float)) else float("nan")

    out = []
    for r in rows:
        out.append({"tokens": r["tokens"], "P": r["P"], "shape": f"{r['heads']}x{r['dim']}", "variant": r["variant"],
                    "path": r["path"], "time_ms": us(r, "time_ns") / 1e3, "x_attn": r.get("ratio_vs_attention", "-"),
                    "traced_ms": us(r, "traced_ns") / 1e3,
                    "loop_us": us(r, "loop_ns_med"), "epi_us": us(r, "epilogue_ns_med"),
                    "send_share": r.get("send_share", "-"), "end_spread_us": us(r, "end_spread_ns"),
                    "tail_us": us(r, "tail_ns_med"), "regs": r.get("n_regs", "-"), "spills": r.get("n_spills", "-"),
                    "traced_regs": r.get("traced_regs", "-"),
                    "clocks": r.get("ptx_clock_reads", "-") if not r.get("error") else r["error"][:40]})
    return out


def write_outputs(rows: list[dict], out: Path, env: dict | None = None) -> str:
    """`trace_summary.csv` (every column, provenance on every row) and `trace_summary.md`; returns the
    short table printed at the end."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = env or _env()
    write_csv_atomic(out / "trace_summary.csv", [{**r, **env} for r in rows], COLUMNS + ENV_COLUMNS)
    short = markdown_table(_short(rows), PRINT_COLUMNS, floatfmt=".3g")
    lines = [
        "# Fused Ulysses kernel: where the time goes (kernel trace)", "",
        f"Machine: {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, commit "
        f"{env.get('git_commit')}, {env.get('date')}. Rank 0 of a loopback group of P, batch 1.", "",
        "`time_ms`: median kernel time untraced (`attention:traced`: traced); `x_attn`: over `attention`; "
        "`traced_ms`: the traced build's time (the trace changes the compiled kernel: compare the two before "
        "reading its numbers as the untraced kernel's). From that traced run: `loop_us` / `epi_us` medians "
        "per tile of key loop and epilogue; `send_share`: share "
        "of key-loop time inside paced sends; `end_spread_us`: median over rounds of the p90 - p10 spread of "
        "the programs' tile end times; `tail_us`: median after-loop sends and signals; `regs` / `spills` of "
        "the compiled kernel (`traced_regs`: of its traced build); `clocks`: clock reads in its PTX (0 expected "
        "untraced). Every column is in "
        "`trace_summary.csv`.", "",
        short, "",
    ]
    (out / "trace_summary.md").write_text("\n".join(lines))
    return short


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        print("ulysses_trace: no CUDA GPU; this experiment times kernels on one", file=sys.stderr)
        return 2
    env = _env()
    rows: list[dict] = []
    t_start = time.monotonic()
    configs = [{"tokens": t, "P": p, "heads": h, "dim": d} for t in args.tokens for p in args.worlds
               for (h, d) in args.shapes]
    for cfg in configs:
        if time.monotonic() - t_start > args.budget_s:
            print(f"ulysses_trace: budget of {args.budget_s} s spent; skipping {cfg} and the rest", flush=True)
            break
        t0 = time.monotonic()
        new = measure(cfg, device=device, warmup=args.warmup, rep=args.rep, timeout_ns=int(args.timeout_s * 1e9))
        rows += new
        _free(device)
        write_outputs(rows, args.out, env)
        att = next((r for r in new if r["variant"] == "attention"), {})
        print(f"T={cfg['tokens']} P={cfg['P']} {cfg['heads']}x{cfg['dim']}: "
              + " ".join(f"{r['variant']}@{r['path']}={r.get('time_ns', float('nan')) / 1e6:.2f}ms"
                         for r in new)
              + f" (attention {att.get('time_ns', float('nan')) / 1e6:.2f} ms; {time.monotonic() - t0:.1f} s)",
              flush=True)
    print(write_outputs(rows, args.out, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
