"""`xstage bench ulysses`: every Ulysses exchange against attention alone on one GPU (loopback).

Problem: how much of the post-attention all-to-all does each exchange hide, per shape and group
size? The GPU plays rank 0 of P ranks (`xstage.comm` loopback): the other ranks' buffers live on
`--path` (`host`: pinned host memory over PCIe, `hbm`: device memory), so their rows cross a real
link.

Variants per configuration (`--exchange`, default `VARIANTS`), all on rank 0's share of the work
(its heads over the whole sequence, after the pre-attention all-to-all):
- `attention:triton`, `attention:cudnn`: the attention core alone, output to local memory;
- every exchange spelling of `xstage.attention.exchange` (`serial:cudnn`, `overlap:cudnn:3`,
  `stores:burst`, ...), timed until every destination holds its rows (receiver-visible): the
  serial and overlap exchanges until the last copy has landed, the in-kernel ones until the
  counter wait for every destination returns;
- `auto`: what the planner picks for the configuration (the `exchange` column names it).
Every variant is captured in a CUDA graph (no host launch overhead) and timed as its replays; the
variants take turns in blocks of replays (`--turns`, `time_in_turns`). Each row has the median, p10
and p90 (ns), the TFLOP/s of the attention work and the largest error of what the destinations
received against the Triton kernel's output, relative to its largest value (`max_err`).

Example:
    xstage bench ulysses -o benchmarks/results/h200-ulysses-exchange --only P=2 --only tokens=4608
    xstage bench ulysses -o /tmp/core --core          # attention core vs cuDNN SDPA, a few configs
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from xstage.attention.exchange import resolve_auto
from xstage.attention.flash import FlashConfig, default_config, flash_attention
from xstage.attention.layout import empty_gathered_out, unpack_qkv
from xstage.attention.overlap import run_overlap, run_serial_copies
from xstage.attention.ulysses import (
    check_runnable,
    fused_state,
    loopback_gather,
    run_fused,
    stage_buffer,
    unpack_loopback,
)
from xstage.bench.ulysses_report import CORES, MAX_ERR, TRITON_CONFIG, read_core
from xstage.comm import create_context
from xstage.errors import InputError
from xstage.results.io import ResultWriter
from xstage.results.select import select
from xstage.results.timing import time_device, time_in_turns
from xstage.spec.exchange import parse_exchange
from xstage.spec.ulysses import UlyssesPlan, split_sizes

GRID_SHAPES = ((24, 128), (40, 128), (30, 64))
GRID_TOKENS = (4608, 8192, 16384, 32760, 75600, 118800)
GRID_WORLDS = (2, 4, 8)
# Calibration grid of the planner's tile and copy costs: other head counts and sequence lengths than
# the grid the planner is judged on.
# Two head counts at D = 128: with one, the fused kernel's overhead over attention (which falls as the
# head count grows; no term of the planner's model carries it) was fitted to that count alone and
# over-predicted at others (`benchmarks/results/h200-ulysses-exchange-grid/`).
CALIBRATION_SHAPES = ((16, 128), (32, 64), (32, 128))
# 12280 and 57330 are not multiples of 16: Triton compiles the attention kernels for those separately
# (`benchmarks/results/h200-ulysses-length-specialization/`), and the fused exchange costs more there
CALIBRATION_TOKENS = (3072, 6144, 12280, 12288, 24576, 57330, 57344, 98304)
# every exchange the planner ranks, the even cut of three and four cuDNN blocks beside their `waves` cut
VARIANTS = CORES + ("serial:triton", "serial:cudnn", "overlap:cudnn:3", "overlap:cudnn:4", "overlap:cudnn:3:waves",
                    "overlap:cudnn:4:waves", "overlap:triton:4:waves", "stores:paced", "auto")
KEY_COLUMNS = ["heads", "dim", "tokens", "P", "path", "variant"]
COLUMNS = KEY_COLUMNS + ["exchange", "rank", "rank_heads", "block_m", "block_n", "num_warps", "num_stages", "grid",
                         "tiles", "tile_bytes", "remote_bytes", "time_ns", "p10_ns", "p90_ns", "tflops", "max_err",
                         "exchange_ok", "timed"]
RESULTS, CORE_RESULTS = "ulysses.csv", "core.csv"  # appended to by the grid and by --core
SUMMARY_FILES = ("summary.md", "speedup.png", "overhead.png")  # written again from the CSVs by every run
CORE_COLUMNS = ["tokens", "heads", "dim", "layout", "impl", "block_m", "block_n", "num_warps", "num_stages",
                "ctas_per_sm", "tma", "time_ns", "tflops", "ratio_vs_cudnn", "rel_err", "sass"]


def grid_configs(grid: str = "main"):
    """Short sequences first, so that a run cut short still covers every shape and group size."""
    shapes, tokens = (GRID_SHAPES, GRID_TOKENS) if grid == "main" else (CALIBRATION_SHAPES, CALIBRATION_TOKENS)
    return [{"heads": h, "dim": d, "tokens": t, "P": p} for t in tokens for (h, d) in shapes for p in GRID_WORLDS]


def graphed(fn, warmup: int = 1):
    """`fn` captured in a CUDA graph (after `warmup` eager calls on a side stream); returns the
    replay. Timing replays leaves out the host's launch overhead, as graph-captured serving does."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def attention_flops(batch: int, s_q: int, s_k: int, heads: int, dim: int) -> float:
    """Multiply-adds of QK^T and PV, counted as 2 FLOPs each."""
    return 4.0 * batch * s_q * s_k * heads * dim


def _sdpa_cudnn(qg, kg, vg):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2)).transpose(1, 2)


def check_variants(variants) -> list[str]:
    """Each name a core (`attention:triton`, `attention:cudnn`) or an exchange spelling, canonical."""
    out = []
    for v in variants:
        if v in CORES:
            out.append(v)
            continue
        ex = parse_exchange(v)
        check_runnable(ex, torch.device("cpu"))  # `tma` cannot run: say so before any GPU work
        if ex.mechanism == "heads":
            raise InputError(f"--exchange {ex}: this grid times rank 0 of a loopback group, whose Q, K, V exchange "
                             "is not staged on the path; heads:CORE:C runs on a torch.distributed group")
        out.append(str(ex))
    if len(set(out)) != len(out):
        raise InputError(f"--exchange: a variant is named twice in {','.join(variants)}")
    return out


def measure_config(cfg: dict, *, path: str, rank: int, warmup: int, rep: int, flash_cfg=None,
                   variants=VARIANTS, graphs: bool = True, turns: int = 2, costs=None) -> list[dict]:
    """Rows for every variant of one configuration (rank `rank` of a loopback group of P); `graphs`:
    time CUDA-graph replays (a variant that cannot be captured is timed eagerly, `timed` says so);
    `turns`: the variants take turns in this many blocks of replays (`time_in_turns`); `costs`: the
    `ExchangeCosts` that `auto` is decided with (None: the embedded calibration)."""
    H, D, T, P = cfg["heads"], cfg["dim"], cfg["tokens"], cfg["P"]
    dev = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    plan = UlyssesPlan(P, rank, 1, split_sizes(T, P), H, D)
    fc = flash_cfg or default_config(D, dtype, dev)
    h0, h1 = plan.head0[rank], plan.head0[rank + 1]
    h = h1 - h0
    g = torch.Generator(device=dev).manual_seed(0)
    local = [torch.randn(1, plan.seq_lens[rank], H, D, generator=g, device=dev, dtype=dtype) for _ in range(3)]
    # the receive buffer of the pre-attention all-to-all, [S, 3, B, h, D], filled as peers would
    recv = torch.empty(T, 3, 1, h, D, dtype=dtype, device=dev)
    for i, t in enumerate(local):
        recv[:, i].copy_(loopback_gather(plan, t)[:, :, h0:h1].transpose(0, 1))
    del local
    qg, kg, vg = unpack_qkv(plan, recv.view(-1))
    ctx = create_context(path=path, loopback_world=P, rank=rank, device=dev)
    state = fused_state(ctx, plan, dtype, fc.block_m)
    stage = stage_buffer(state, ctx)
    own_out = state.out.local[:, :plan.seq_lens[rank], h0:h1]
    n_m = math.ceil(T / fc.block_m)
    tiles = h * n_m
    grid = min(tiles, torch.cuda.get_device_properties(dev).multi_processor_count * max(fc.ctas_per_sm, 1))
    flops = attention_flops(1, T, T, h, D)
    common = {**cfg, "path": path, "rank": rank, "rank_heads": h, "block_m": fc.block_m, "block_n": fc.block_n,
              "num_warps": fc.num_warps, "num_stages": fc.num_stages, "grid": grid, "tiles": tiles,
              "tile_bytes": fc.block_m * D * 2, "remote_bytes": (T - plan.seq_lens[rank]) * h * D * 2}
    reference = empty_gathered_out(plan, dtype, dev)
    flash_attention(qg, kg, vg, out=reference, config=fc)

    def runner(name: str):
        if name in CORES:
            og = empty_gathered_out(plan, dtype, dev)
            if name == "attention:cudnn":
                return lambda: _sdpa_cudnn(qg, kg, vg)
            return lambda: flash_attention(qg, kg, vg, out=og, config=fc)
        ex = parse_exchange(name)
        if ex.mechanism == "auto":
            ex = resolve_auto(plan, dtype, path, dev, costs=costs)
        if ex.in_kernel:
            return lambda: run_fused(state, ctx, qg, kg, vg, config=fc, exchange=ex)
        og = empty_gathered_out(plan, dtype, dev)
        if ex.mechanism == "overlap":
            return lambda: run_overlap(plan, ex, qg, kg, vg, og, own_out, stage.peers, config=fc)

        def serial():
            if ex.core == "cudnn":
                # the all-to-all's send chunks are slices of the sequence-major output: one copy makes it so
                og.copy_(_sdpa_cudnn(qg, kg, vg))
            else:
                flash_attention(qg, kg, vg, out=og, config=fc)
            run_serial_copies(plan, og, own_out, stage.peers)
        return serial

    fns, errs, resolved, timed = {}, {}, {}, {}
    for name in variants:
        resolved[name] = str(resolve_auto(plan, dtype, path, dev, costs=costs)) if name == "auto" else name
        fn = runner(name)
        try:
            for t in (*state.out.peers, *stage.peers):
                t.fill_(float("nan"))
            fn()
            errs[name] = "" if name in CORES else delivered_error(plan, state, reference, resolved[name])
        except RuntimeError as e:  # cuDNN may refuse a layout: the row says so instead of the grid dying
            errs[name] = f"error: {str(e)[:80]}"
            print(f"  {name}: {errs[name]}", flush=True)
            continue
        fns[name] = fn
        timed[name] = "graph" if graphs else "eager"
    makers = {name: (lambda fn=fn: graphed(fn)) if graphs else (lambda fn=fn: fn) for name, fn in fns.items()}
    timings = time_in_turns(makers, warmup=warmup, rep=rep, turns=turns)
    ctx.check()
    rows = []
    for name in variants:
        row = {**common, "variant": name, "exchange": resolved[name]}
        err = errs[name]
        if name not in timings:
            rows.append({**row, "exchange_ok": err})
            continue
        t = timings[name]
        ok = "" if err == "" else int(err <= MAX_ERR)
        rows.append({**row, "time_ns": t.median_ns, "p10_ns": t.p10_ns, "p90_ns": t.p90_ns,
                     "tflops": flops / t.median_ns / 1e3, "max_err": err, "exchange_ok": ok, "timed": timed[name]})
    ctx.close()
    return rows


def delivered_error(plan, state, reference: torch.Tensor, exchange: str, *, stream_ordered: bool = True) -> float:
    """The largest error of what every destination of a loopback group received, relative to the
    largest value of `reference` (the gathered attention output of this rank's heads); inf where a
    destination still holds NaN (the poison put there before the exchange ran).

    A copy-engine exchange's rows are first moved by the stand-in receivers (`unpack_loopback`, in
    stream order after the copies; `stream_ordered=False` only for tests of this check)."""
    if not parse_exchange(exchange).in_kernel:
        unpack_loopback(plan, state, stream_ordered=stream_ordered)
    torch.cuda.synchronize()
    h0, h1 = plan.head0[plan.rank], plan.head0[plan.rank + 1]
    ref_max = reference.float().abs().max().item()
    err = 0.0
    for p in range(plan.world):
        rows = slice(plan.tok0[p], plan.tok0[p + 1])
        got = state.out.peers[p][:, :plan.seq_lens[p], h0:h1].to(reference.device).float()
        err = max(err, float("inf") if got.isnan().any() else (got - reference[:, rows].float()).abs().max().item())
    return err / ref_max


def tuned_configs(*core_csvs) -> dict:
    """The fastest Triton configuration per head dim over `core.csv` files (see `run_core`)."""

    best: dict[int, tuple[float, FlashConfig]] = {}
    for r in (row for path in core_csvs for row in read_core(path)):
        if r["impl"].strip() != "triton":
            continue
        d, tf = int(r["dim"]), float(r["tflops"])
        if d not in best or tf > best[d][0]:
            best[d] = (tf, FlashConfig(*(int(r[c]) for c in TRITON_CONFIG[:5]), bool(int(r["tma"]))))
    return {d: c for d, (_, c) in best.items()}


def run_grid(out_dir, *, only=None, path="host", rank=0, warmup=2, rep=10, max_seconds=None, flash_cfg=None,
             variants=VARIANTS, grid="main", graphs=True, turns=2, costs=None) -> Path:
    """Measure every selected configuration not yet in `out_dir/ulysses.csv`; stop early after
    `max_seconds` (the file is resumable). `flash_cfg`: one FlashConfig, or a dict by head dim;
    `grid`: "main" (the 54 configurations) or "calibration" (the planner's calibration shapes); `costs`: the
    `ExchangeCosts` that `auto` rows are decided with (None: the embedded calibration)."""
    if not torch.cuda.is_available():
        raise InputError("needs a CUDA GPU (--summarize-only runs anywhere)")
    variants = check_variants(variants)
    out = Path(out_dir)
    writer = ResultWriter(out / "ulysses.csv", COLUMNS, KEY_COLUMNS, require_commit=True)
    t_start = time.monotonic()
    for cfg in select(grid_configs(grid), only):
        if all(writer.done({**cfg, "path": path, "variant": v}) for v in variants):
            continue
        if max_seconds is not None and time.monotonic() - t_start > max_seconds:
            print(f"bench ulysses: stopping after {max_seconds} s; run again to resume")
            break
        fc = flash_cfg.get(cfg["dim"]) if isinstance(flash_cfg, dict) else flash_cfg
        rows = measure_config(cfg, path=path, rank=rank, warmup=warmup, rep=rep, flash_cfg=fc, variants=variants,
                              graphs=graphs, turns=turns, costs=costs)
        for row in rows:
            if not writer.done(row):
                writer.write(row)
        print(f"H{cfg['heads']}xD{cfg['dim']} T={cfg['tokens']} P={cfg['P']}: "
              + " ".join(f"{r['variant']}={float(r.get('time_ns') or 'nan') / 1e3:.0f}us" for r in rows), flush=True)
    return out / "ulysses.csv"


CORE_SHAPES = ((16384, 24, 128), (17776, 30, 64))


def core_configs(dim: int):
    """Candidates per head dim (BLOCK_M, BLOCK_N, warps, stages, CTAs per SM, TMA)."""

    if dim >= 128:
        return [FlashConfig(128, 128, 8, 3, 1, True), FlashConfig(128, 128, 8, 3, 1, False),
                FlashConfig(128, 128, 8, 3, 0, True), FlashConfig(128, 64, 8, 4, 1, True)]
    return [FlashConfig(128, 64, 4, 3, 1, True), FlashConfig(128, 64, 8, 3, 1, True),
            FlashConfig(128, 128, 8, 3, 1, True), FlashConfig(128, 64, 4, 4, 1, True),
            FlashConfig(64, 64, 4, 3, 1, True)]


def run_core(out_dir, *, shapes=CORE_SHAPES, configs=None, warmup=3, rep=20,
             layouts=("bshd", "gathered")) -> Path:
    """Attention core (one head group over the whole sequence) against cuDNN SDPA, per config."""

    if not torch.cuda.is_available():
        raise InputError("--core needs a CUDA GPU")
    writer = ResultWriter(Path(out_dir) / "core.csv", CORE_COLUMNS, CORE_COLUMNS[:11], require_commit=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    for (S, H, D) in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        qkv = torch.randn(3, 1, H, S, D, generator=g, device=dev, dtype=torch.bfloat16)
        q4, k4, v4 = qkv[0], qkv[1], qkv[2]  # [B, H, S, D] for SDPA
        flops = attention_flops(1, S, S, H, D)
        args4 = (q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2))
        cud = time_device(lambda a=args4: _sdpa_cudnn(*a), warmup=warmup, rep=rep)
        ref = _sdpa_cudnn(*args4).float()
        base = {"tokens": S, "heads": H, "dim": D}
        writer.write({**base, "layout": "bhsd", "impl": "cudnn_sdpa", "time_ns": cud.median_ns,
                      "tflops": flops / cud.median_ns / 1e3, "ratio_vs_cudnn": 1.0})
        print(f"S={S} H={H} D={D}: cudnn {flops / cud.median_ns / 1e3:.0f} TFLOP/s", flush=True)
        for i_layout, layout in enumerate(layouts):
            if layout == "bshd":
                q, k, v = (t.transpose(1, 2).contiguous() for t in (q4, k4, v4))
            else:  # the gathered Ulysses layout [S, 3, B, h, D]
                buf = torch.stack([t.transpose(1, 2) for t in (q4, k4, v4)], dim=0).permute(2, 0, 1, 3, 4).contiguous()
                q, k, v = (buf[:, i].transpose(0, 1) for i in range(3))
            cands = configs or core_configs(D)
            # the other layouts only with the first (default) candidate: they check the strides, not the tuning
            for c in cands if i_layout == 0 else cands[:1]:
                row = {**base, "layout": layout, "impl": "triton", "block_m": c.block_m, "block_n": c.block_n,
                       "num_warps": c.num_warps, "num_stages": c.num_stages, "ctas_per_sm": c.ctas_per_sm,
                       "tma": int(bool(c.use_tma))}
                try:
                    launched: list = []
                    out = flash_attention(q, k, v, config=c, launched=launched)
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    t = time_device(lambda c=c, a=(q, k, v): flash_attention(*a, config=c), warmup=warmup, rep=rep)
                    sass = sass_summary(launched[0])
                except Exception as e:  # a config that does not compile (e.g. shared memory) is a result too
                    print(f"  {layout} {c}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                tf = flops / t.median_ns / 1e3
                ratio = cud.median_ns / t.median_ns
                writer.write({**row, "time_ns": t.median_ns, "tflops": tf, "ratio_vs_cudnn": ratio, "rel_err": err,
                              "sass": sass})
                print(f"  {layout} BM{c.block_m} BN{c.block_n} w{c.num_warps} s{c.num_stages} "
                      f"cta{c.ctas_per_sm} tma{int(bool(c.use_tma))}: {tf:.0f} TFLOP/s "
                      f"({ratio:.1%} of cuDNN), rel err {err:.1e}, {sass}", flush=True)
    return Path(out_dir) / "core.csv"


def sass_summary(kernel) -> str:
    """Instruction counts of a compiled attention kernel (`flash_attention(..., launched=[])` gives it):
    HGMMA (Hopper warpgroup MMA), the PTX `wgmma` it came from, TMA loads (`UTMALDG`) and spills ('-'
    for no kernel, e.g. in the interpreter; 'sass unavailable' where the tools are missing)."""
    if kernel is None:
        return "-"
    parts = []
    ptx = kernel.asm.get("ptx", "")
    parts.append(f"ptx wgmma={ptx.count('wgmma.mma_async')}")
    try:
        from triton.tools.disasm import get_sass

        sass = get_sass(kernel.asm["cubin"])
        parts.append(f"HGMMA={sass.count('HGMMA')} UTMALDG={sass.count('UTMALDG')} STL={sass.count('STL')}")
    except Exception as e:  # cuobjdump may be absent on the machine
        parts.append(f"sass unavailable ({type(e).__name__})")
    n_spills = getattr(kernel, "n_spills", None)
    if n_spills is not None:
        parts.append(f"spills={n_spills} regs={getattr(kernel, 'n_regs', '?')}")
    return " ".join(parts)


BLOCK_FLAGS = ("--block-n", "--num-warps", "--num-stages")  # each only with --block-m


