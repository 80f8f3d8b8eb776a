"""`xstage bench moe`: the fused MoE kernel per schedule against an unfused pipeline, on one GPU.

Grid (`--grid main`): 4 shapes x tokens per rank {256 .. 16384} x EP {2, 4, 8} (84 configurations)
plus EP=1 at 4096 and 16384 tokens; `--grid decode`: 4 shapes x {1, 8, 64, 256} tokens per rank x EP
{1, 2, 4, 8}. Each EP>1 configuration runs rank 0 of the group over the loopback `host` path (rows for
peers cross PCIe into pinned memory) and records, per variant:

- `expert_wave`, `interleaved`, `lag:k`: the fused persistent kernel (dispatch, Linear-1 + SwiGLU,
  Linear-2 + combine push); `time_ns` is that kernel, `reduce_ns` the separate top-k reduce, both on
  a plan built on the host before the timed runs. Beside them, the public call a user makes
  (`measure_moe_call`): `fused_moe(x, idx, w, w1t, w2, buf, schedule=...)` with every other argument
  at its default, on a buffer at its defaults (pacing `auto` unless the variant names one) sized for
  the run's largest token count, cycling through 16 routings: `call_ns` (wall clock per call over 200
  back-to-back calls), `host_ns` (median, `host_p10_ns`, `host_p90_ns`), `launches` (kernels per
  call), `syncs`, `graph_ns` (the call replayed from a CUDA graph) and `call_note` (what was not
  measured, and why; `xstage.bench.calls`). A plan prologue counts as call time, not kernel time.
  `reduce_host_ns`: one `launch_reduce`'s host time, measured in the kernels' runs;
- `unfused`: gather + copy of the rows for peers to the same destination, `torch._grouped_mm`
  Linear-1, SwiGLU, `torch._grouped_mm` Linear-2, copy of the output rows for peers back to the
  destination (the same exchange bytes as the fused kernel, without the reduce);
- `chain` (EP=1): only the compute chain grouped_mm -> SwiGLU -> grouped_mm on pre-sorted rows.
`tflops` counts 6 * rows * H * I. `speedup` is `expert_wave` time over the variant's time.

`--dtype bf16,fp8` measures each configuration once per dtype, back to back (column `dtype`). With
`fp8` the fused kernel runs on an FP8 buffer from pre-quantized `(x_fp8, x_scale)` and 128x128
block-scaled weights; `unfused` and `chain` stay the BF16 pipeline on the weights the FP8 ones were
quantized from, and EP=1 adds `chain_fp8` (`xstage.moe.baseline.ChainFP8`: eager quantization and
`torch._scaled_grouped_mm`, the issue's FP8 baseline). FP8 rows carry two accuracy columns, from
references on the same sorted rows (`fp8_references`): `err_fp8_ref` (max|y - ref| / max|ref| against
the FP8-emulating reference) and `fro_f32` (relative Frobenius error against float32 on the
dequantized weights with unquantized activations). `combine_link_ns` is the time the rows for peers'
BF16 combine bytes need at the path profile's drain rate: the bound on what FP8 compute can save.

Example (a slice, GPU):
    xstage bench moe -o benchmarks/results/h200-moe --only shape=H4096-I2048-E256-K6 --only tokens=4096
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from xstage.bench.calls import CALL_COLUMNS, CALLS, ROUTINGS, CallMeasure, measure_call
from xstage.bench.moe_summary import summarize
from xstage.dtypes import DTYPES as DTYPE_MAP
from xstage.dtypes import FP8_DTYPES, dtype_name, parse_dtype
from xstage.errors import InputError
from xstage.moe.baseline import ChainFP8, Unfused
from xstage.moe.buffer import LoopbackGroup, MoEBuffer
from xstage.moe.fused import fused_moe, launch_main, launch_reduce, plan
from xstage.moe.problem import Problem, routing
from xstage.results import ResultWriter, Timing, events, select, synchronize, time_device, timing_summary
from xstage.spec.moe import SHAPES, MoeShape, parse_block
from xstage.spec.pacing import spec_of
from xstage.spec.schedule import CANDIDATES
from xstage.spec.variant import Variant

TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_TOKENS = (1, 8, 64, 256)  # tokens per rank of a decode step
GRIDS = ("main", "decode")
EPS = (2, 4, 8)
# The grid measures the orders the planner ranks (`xstage.moe.schedule.CANDIDATES`).
SCHEDULES = CANDIDATES
COLUMNS = ["shape", "H", "I", "E", "K", "tokens", "ep", "path", "dtype", "variant", "time_ns", "time_p10_ns",
           "time_p90_ns", "reduce_ns", "tflops", "speedup", "rows", "remote_rows", "combine_link_ns", "block", "ctas",
           "max_err", "err_fp8_ref", "fro_f32", *CALL_COLUMNS, "reduce_host_ns", "loop_ns"]
# A baseline's row: only fused variants are called (and run back to back, `loop_ns`).
NO_CALL = dict.fromkeys((*CALL_COLUMNS, "loop_ns"), "")
KEYS = ["shape", "tokens", "ep", "path", "dtype", "variant"]
RESULTS = "moe.csv"  # appended to by every run
SUMMARY_FILES = ("summary.md", "speedup-*.png")  # written again from the CSV by every run


def grid_configs(grid: str = "main") -> list[dict]:
    """`main`: the 8 EP=1 configurations, then the 84 EP>1 ones (EP 8 first, the reference design's
    setting); `decode`: decode-sized calls, `DECODE_TOKENS` tokens per rank at EP 1, 8, 4 and 2."""
    if grid == "decode":
        return [dict(shape=s, tokens=t, ep=ep) for ep in (1, *EPS[::-1]) for t in DECODE_TOKENS for s in SHAPES]
    if grid != "main":
        raise InputError(f"--grid {grid!r}: must be one of {', '.join(GRIDS)}")
    out = [dict(shape=s, tokens=t, ep=1) for s in SHAPES for t in (4096, 16384)]
    return out + [dict(shape=s, tokens=t, ep=ep) for ep in EPS[::-1] for t in TOKENS for s in SHAPES]


@dataclass
class Kernels:
    """The kernels of one variant on the host-built table: the main kernel's timing, the reduce's
    median ns, one `launch_reduce`'s median host time (ns), the last run's output, the grid and the
    store pacing the kernels ran with."""

    main: Timing
    reduce_ns: float
    reduce_host_ns: float
    y: torch.Tensor
    ctas: int
    pacing: object


def time_kernels(pb: Problem, variant: Variant | str, warmup: int = 5, rep: int = 30) -> Kernels:
    """The kernels of `variant` (a schedule with an optional pacing, `interleaved@off`; without one the
    buffer's pacing applies), planned once on the host outside the timed runs."""
    v = variant if isinstance(variant, Variant) else Variant.parse(variant)
    p = plan(pb.idx, pb.buf, v.schedule, pacing=v.pacing_or("buffer"))
    y = torch.empty_like(pb.x)
    for _ in range(warmup):
        launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p)
        launch_reduce(pb.idx, pb.w, y, pb.buf)
    synchronize()
    host: list[float] = []
    main, red = time_main_and_reduce(pb, p, y, rep, reduce_host=host)
    return Kernels(main, red, statistics.median(host), y, p.schedule.num_ctas, p.pacing)


def time_kernel_loop(pb: Problem, variant: Variant | str, iterations: int = CALLS) -> float:
    """ns per iteration of `iterations` back-to-back runs of the kernels (main + reduce) on one plan
    built before them, one synchronisation at the end: the kernels under the sustained load a call
    loop puts on the GPU (clocks, power), without the call's plan, checks and Python. `call_ns` over
    this is what the call itself adds."""
    v = variant if isinstance(variant, Variant) else Variant.parse(variant)
    p = plan(pb.idx, pb.buf, v.schedule, pacing=v.pacing_or("buffer"))
    y = torch.empty_like(pb.x)
    for _ in range(2):
        launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p)
        launch_reduce(pb.idx, pb.w, y, pb.buf)
    synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(iterations):
        launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p)
        launch_reduce(pb.idx, pb.w, y, pb.buf)
    synchronize()
    ns = (time.perf_counter_ns() - t0) / iterations
    pb.buf.check()
    return ns


def time_fused(pb: Problem, variant: Variant | str, warmup: int = 5, rep: int = 30):
    """Main kernel timing (median, p10, p90 ns), reduce median ns, the last run's output and the grid
    (`time_kernels`)."""
    k = time_kernels(pb, variant, warmup, rep)
    return k.main, k.reduce_ns, k.y, k.ctas


def time_main_and_reduce(pb, p, y, rep: int, before_each=None, reduce_host: list | None = None
                         ) -> tuple[Timing, float]:
    """The main kernel's timing and the reduce's median ns over `rep` event-timed runs into `y`;
    `before_each` (e.g. a barrier across ranks) runs before every timed run; `reduce_host` (a list)
    receives each `launch_reduce`'s host time (ns)."""
    a, b, c = events(rep), events(rep), events(rep)
    for i in range(rep):
        if before_each is not None:
            before_each()
        a[i].record()
        launch_main(pb.x_in, pb.w1t, pb.w2, pb.buf, p)
        b[i].record()
        t0 = time.perf_counter_ns()
        launch_reduce(pb.idx, pb.w, y, pb.buf)
        if reduce_host is not None:
            reduce_host.append(time.perf_counter_ns() - t0)
        c[i].record()
    synchronize()
    pb.buf.check()
    main = timing_summary([a[i].elapsed_time(b[i]) * 1e6 for i in range(rep)])
    red = timing_summary([b[i].elapsed_time(c[i]) * 1e6 for i in range(rep)]).median_ns
    return main, red


def fp8_references(pb: Problem, un: Unfused) -> tuple[torch.Tensor, torch.Tensor]:
    """The two references of an FP8 problem's output, float32 `[T, H]`, on `un`'s sorted rows:
    the FP8-emulating layer (`xstage.moe.fp8.expert_mlp_fp8` on the quantized rows and weights, BF16
    combine rows) and float32 on the dequantized weights with the unquantized activations."""
    from xstage.moe.fp8 import dequantize_weights, expert_mlp_fp8
    from xstage.moe.reference import expert_mlp

    (x8, xs), (l1, s1), (l2, s2) = pb.x_in, pb.l1_fp8, pb.l2_fp8
    out8 = torch.zeros(len(un.t), pb.H, dtype=torch.float32, device=pb.x.device)
    out32 = torch.zeros_like(out8)
    start = 0
    for e, end in enumerate(un.offs.tolist()):
        if end > start:
            t = un.t[start:end]
            out8[start:end] = expert_mlp_fp8(x8[t], xs[t], l1[e], s1[e], l2[e], s2[e]).to(torch.bfloat16).float()
            out32[start:end] = expert_mlp(pb.x[t].float(), dequantize_weights(l1[e:e + 1], s1[e:e + 1])[0],
                                          dequantize_weights(l2[e:e + 1], s2[e:e + 1])[0])
        start = end
    return un.combine(out8), un.combine(out32)


def _errors(y: torch.Tensor, ref8: torch.Tensor, ref32: torch.Tensor) -> dict:
    y = y.float()
    return dict(err_fp8_ref=float((y - ref8).abs().max() / ref8.abs().max().clamp_min(1e-30)),
                fro_f32=float(torch.linalg.vector_norm(y - ref32) / torch.linalg.vector_norm(ref32).clamp_min(1e-30)))


def _combine_link_ns(pb: Problem, un: Unfused, path: str) -> float | str:
    """Time the BF16 combine rows for peers need at the path profile's drain rate (ns); "" without one."""
    from xstage.model.profile import DEFAULT_PROFILES, load_default_profile

    if path not in DEFAULT_PROFILES or not un.n_remote:
        return ""
    return un.n_remote * pb.H * 2 / load_default_profile(path).params.drain * 1e9


def call_routings(idx: torch.Tensor, w: torch.Tensor, E: int, K: int, n: int = ROUTINGS,
                  first_seed: int = 1) -> list[tuple]:
    """`(idx, w)` first, then `n - 1` other uniform routings of as many tokens (seeds `first_seed`,
    `first_seed + 1`, ...; `idx` must come from none of them): the distinct inputs the timed calls
    cycle through."""
    T = int(idx.shape[0])
    return [(idx, w)] + [routing(T, E, K, idx.device, seed=first_seed + s) for s in range(n - 1)]


def tolerance(dtype) -> float:
    """Relative error a call may differ from the kernels by: rounding of the output dtype."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def measure_moe_call(pb: Problem, v: Variant, buf: MoEBuffer, routes: list[tuple], k: Kernels,
                     calls: int = CALLS) -> CallMeasure:
    """The public call `fused_moe(x, idx, w, w1t, w2, buf, schedule=...)` of variant `v` with every
    other argument at its default (the variant's pacing where it names one, else the buffer's), on
    `routes` (`xstage.bench.calls.measure_call`); `x` is BF16 on an FP8 buffer (the call quantizes it).
    Checked first against the kernels' output `k.y` on the same routing."""
    kw = {"schedule": v.schedule} if v.pacing is None else {"schedule": v.schedule, "pacing": v.pacing}

    def call(idx, w):
        return fused_moe(pb.x, idx, w, pb.w1t, pb.w2, buf, **kw)

    m = measure_call(call, routes, k.y, tolerance(pb.buf.out_dtype), calls=calls, after=buf.check)
    paced = plan(pb.idx, buf, v.schedule, pacing=v.pacing_or("buffer")).pacing  # what the calls ran with
    if paced != k.pacing:
        m = CallMeasure(m.timing, m.launches, m.syncs, m.graph,
                        (*m.notes, f"the call paced stores {spec_of(paced)}, the kernels {spec_of(k.pacing)}"))
    return m


def run_config(cfg_row: dict, path: str, schedules, writer: ResultWriter | None, warmup: int = 5, rep: int = 30,
               block: str | None = None, log=print, call_tokens: int | None = None, calls: int | None = CALLS
               ) -> list[dict]:
    """Measure one configuration in one dtype (`cfg_row["dtype"]`, default bf16): every variant
    (`SCHEDULE[@PACING]`), its kernels and its public call (`measure_moe_call`, on a buffer for
    `call_tokens` tokens, default this configuration's; `calls` back-to-back calls, None: the call is
    not measured), the unfused pipeline (and the chains at EP=1)."""
    variants = [s if isinstance(s, Variant) else Variant.parse(s) for s in schedules]
    shape, T, ep = MoeShape.parse(cfg_row["shape"]), int(cfg_row["tokens"]), int(cfg_row["ep"])
    H, I, E, K = shape
    dtype = parse_dtype(cfg_row.get("dtype", "bf16"), allowed=(*DTYPE_MAP, *FP8_DTYPES))
    fp8 = dtype in FP8_DTYPES.values()
    cfg = cfg_row.get("config") or parse_block(block, H, fp8=fp8)
    pth = path if ep > 1 else "hbm"
    pb = Problem(shape, T, ep, pth, cfg, device=cfg_row.get("device", "cuda"), dtype=dtype)
    cfg = pb.cfg
    un = Unfused(pb, pth)
    base = dict(shape=str(shape), H=H, I=I, E=E, K=K, tokens=T, ep=ep, path=pth, dtype=dtype_name(dtype),
                rows=pb.rows, remote_rows=un.n_remote, combine_link_ns=_combine_link_ns(pb, un, pth),
                block=f"{cfg.block_m}x{cfg.block_n1}x{cfg.block_n2}x{cfg.block_k}")
    rows, outs = [], {}
    # The calls run as a caller's would: a buffer at its defaults (pacing "auto"), sized for the run's
    # largest token count, on distinct routings.
    call_buf, routes = None, None
    if calls is not None:
        call_buf = MoEBuffer(max(T, call_tokens or T), E, K, H, I, LoopbackGroup(ep, path=pth), device=pb.x.device,
                             dtype=dtype, config=cfg)
        routes = call_routings(pb.idx, pb.w, E, K)
    for v in variants:
        k = time_kernels(pb, v, warmup, rep)
        outs[str(v)] = k.y
        m = CallMeasure(notes=("call not measured",)) if calls is None else measure_moe_call(pb, v, call_buf, routes,
                                                                                             k, calls)
        loop = "" if calls is None else time_kernel_loop(pb, v, calls)
        rows.append(dict(base, variant=str(v), time_ns=k.main.median_ns, time_p10_ns=k.main.p10_ns,
                         time_p90_ns=k.main.p90_ns, reduce_ns=k.reduce_ns, ctas=k.ctas, reduce_host_ns=k.reduce_host_ns,
                         loop_ns=loop, **m.columns()))
    del call_buf, routes

    def baseline(name, fn):
        t = time_device(fn, warmup=warmup, rep=rep)
        rows.append(dict(base, variant=name, time_ns=t.median_ns, time_p10_ns=t.p10_ns, time_p90_ns=t.p90_ns,
                         reduce_ns="", ctas="", reduce_host_ns="", **NO_CALL))

    baseline("unfused", un.full)
    if ep == 1:
        baseline("chain", lambda: un.chain(un.x_sorted))
        if fp8:
            chain8 = ChainFP8(un)
            baseline("chain_fp8", lambda: chain8.chain(chain8.x_sorted))
            del chain8  # its rowwise FP8 weights
    ref = un.combine(un.full())
    scale = float(ref.abs().max()) or 1.0
    refs = fp8_references(pb, un) if fp8 else None
    pacing_of = {str(v): v.pacing for v in variants}  # baselines: the buffer default (None)
    ew = {v.pacing: r["time_ns"] for v, r in zip(variants, rows) if v.schedule == "expert_wave"}
    for r in rows:
        r["tflops"] = pb.flops() / r["time_ns"] / 1e3
        # Over expert_wave with the same store pacing (the buffer default for unfused and chain).
        base_ew = ew.get(pacing_of.get(r["variant"]))
        r["speedup"] = base_ew / r["time_ns"] if base_ew else ""
        y = outs.get(r["variant"])
        # Against the BF16 pipeline: on FP8 rows, the error of quantizing the activations.
        r["max_err"] = float((y.float() - ref).abs().max()) / scale if y is not None else ""
        r.update(_errors(y, *refs) if y is not None and refs else dict(err_fp8_ref="", fro_f32=""))
    if writer is not None:
        writer.write_many(rows)
    for r in rows:
        call = "" if r["call_ns"] == "" else (f" call {r['call_ns'] / 1e3:.1f} us host {r['host_ns'] / 1e3:.1f} us "
                                              f"{r['launches']} launches")
        log(f"{shape} T={T} EP={ep} {r['dtype']} {r['variant']:>12}: {r['time_ns'] / 1e3:9.1f} us "
            f"{r['tflops']:6.0f} TFLOP/s speedup {r['speedup'] if r['speedup'] == '' else round(r['speedup'], 3)} "
            f"err {r['max_err']}" + ("" if r["err_fp8_ref"] == "" else
                                     f" fp8-ref {r['err_fp8_ref']:.2e} fro32 {r['fro_f32']:.3f}")
            + call + (f" [{r['call_note']}]" if r["call_note"] else ""))
    return rows


def block_per_dtype(block: str | None, dtypes) -> dict[str, str | None]:
    """`--block`: one spec for every dtype, or `DTYPE=SPEC` entries separated by commas (a dtype without
    one gets its default tiles). Every spec is parsed here, before any GPU work."""
    if not block or "=" not in block:
        out = {d: block for d in dtypes}
    else:
        out = dict.fromkeys(dtypes)
        for part in block.split(","):
            d, eq, spec = part.strip().partition("=")
            if not eq or d not in out:
                raise InputError(f"--block {block!r}: {part.strip()!r} is not DTYPE=SPEC with DTYPE one of "
                                 f"{', '.join(dtypes)} (the measured dtypes)")
            out[d] = spec.strip()
    for d, spec in out.items():
        try:
            parse_block(spec, 4096, fp8=d == "fp8")
        except InputError as exc:
            raise InputError(f"--block {block!r}: {exc}") from None
    return out


def run_grid(out_dir, only=None, path: str = "host", schedules=SCHEDULES, warmup: int = 5, rep: int = 30,
             budget_s: float | None = None, block: str | None = None, log=print, dtypes=("bf16",),
             grid: str = "main") -> dict:
    """Resumable: configurations already in `out_dir/moe.csv` are skipped; stops starting new ones after
    `budget_s`. Each configuration runs in every dtype of `dtypes` in turn. Returns the summary
    (`xstage.bench.moe_summary.summarize`)."""
    if not torch.cuda.is_available():
        raise InputError("needs a CUDA GPU (--summarize-only runs anywhere)")
    variants = [s if isinstance(s, Variant) else Variant.parse(s) for s in schedules]
    dtypes = [dtype_name(parse_dtype(d, allowed=(*DTYPE_MAP, *FP8_DTYPES))) for d in dtypes]
    blocks = block_per_dtype(block, dtypes)
    out = Path(out_dir)
    writer = ResultWriter(out / RESULTS, COLUMNS, KEYS, require_commit=True)
    t0 = time.time()
    configs = select(grid_configs(grid), only)
    call_tokens = max(int(c["tokens"]) for c in configs)  # every call's buffer holds the run's largest call
    for c in configs:
        if budget_s is not None and time.time() - t0 > budget_s:
            log("time budget reached; rerun to continue")
            break
        pth = path if c["ep"] > 1 else "hbm"
        for d in dtypes:
            if writer.done(dict(c, path=pth, dtype=d, variant="unfused")):
                continue
            try:
                run_config(dict(c, dtype=d), path, variants, writer, warmup, rep, block=blocks.get(d), log=log,
                           call_tokens=call_tokens)
            except Exception:  # one configuration failing must not lose the rest of the grid
                log(f"config {c} {d}: " + traceback.format_exc()[-2500:])
            torch.cuda.empty_cache()
    return summarize(out)


