"""`xstage bench moe`: the fused MoE kernel per schedule against an unfused pipeline, on one GPU.

Grid: 4 shapes x tokens per rank {256 .. 16384} x EP {2, 4, 8} (84 configurations) plus EP=1 at
4096 and 16384 tokens. Each EP>1 configuration runs rank 0 of the group over the loopback `host`
path (rows for peers cross PCIe into pinned memory) and records, per variant:

- `expert_wave`, `interleaved`, `lag:k`: the fused persistent kernel (dispatch, Linear-1 + SwiGLU,
  Linear-2 + combine push); `time_ns` is that kernel, `reduce_ns` the separate top-k reduce;
- `unfused`: gather + copy of the rows for peers to the same destination, `torch._grouped_mm`
  Linear-1, SwiGLU, `torch._grouped_mm` Linear-2, copy of the output rows for peers back to the
  destination (the same exchange bytes as the fused kernel, without the reduce);
- `chain` (EP=1): only the compute chain grouped_mm -> SwiGLU -> grouped_mm on pre-sorted rows.
`tflops` counts 6 * rows * H * I. `speedup` is `expert_wave` time over the variant's time.

Example (a slice, GPU):
    xstage bench moe -o benchmarks/results/h200-moe --only shape=H4096-I2048-E256-K6 --only tokens=4096
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from xstage.bench.grid import select
from xstage.bench.moe_summary import geomean, summarize
from xstage.bench.results import ResultWriter
from xstage.bench.timing import Timing, time_device, timing_summary
from xstage.errors import InputError

SHAPES = {
    "H4096-I2048-E256-K6": (4096, 2048, 256, 6),
    "H7168-I3072-E384-K6": (7168, 3072, 384, 6),
    "H4096-I1536-E128-K8": (4096, 1536, 128, 8),
    "H1152-I4608-E8-K2": (1152, 4608, 8, 2),
}
TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
EPS = (2, 4, 8)
SCHEDULES = ("expert_wave", "interleaved", "lag:4", "lag:16")
COLUMNS = ["shape", "H", "I", "E", "K", "tokens", "ep", "path", "variant", "time_ns", "time_p10_ns", "time_p90_ns",
           "reduce_ns", "tflops", "speedup", "rows", "block", "ctas", "max_err"]
KEYS = ["shape", "tokens", "ep", "path", "variant"]


def grid_configs() -> list[dict]:
    """The 8 EP=1 configurations, then the 84 EP>1 ones (EP 8 first, the reference design's setting)."""
    out = [dict(shape=s, tokens=t, ep=1) for s in SHAPES for t in (4096, 16384)]
    return out + [dict(shape=s, tokens=t, ep=ep) for ep in EPS[::-1] for t in TOKENS for s in SHAPES]


def routing(T, E, K, device, seed=0):
    """Uniform random top-k routing (distinct experts per token) and normalised weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(T, E, generator=g, device=device)
    w, idx = torch.topk(scores, K, dim=1)
    return idx.contiguous(), (w / w.sum(1, keepdim=True)).float().contiguous()


def parse_block(spec: str, H: int):
    """`"BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS]"` -> BlockConfig (BN2 halves until it divides H).

    FLAGS (optional) picks the kernel variant: letters `t` (TMA loads) and `d` (dynamic task
    fetch), or `-` for neither; without it the BlockConfig defaults apply."""
    from xstage.moe import BlockConfig

    parts = spec.split(":")
    flags = parts.pop() if len(parts) == 7 else None
    try:
        bm, bn1, bn2, bk, warps, stages = (int(v) for v in parts)
    except ValueError as exc:
        raise InputError(f"block {spec!r}: expected BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS]") from exc
    if flags is not None and set(flags) - set("td-"):
        raise InputError(f"block {spec!r}: FLAGS must be made of 't' (TMA), 'd' (dynamic) or be '-'")
    while H % bn2:
        bn2 //= 2
    # Dispatch copies [BM, BD] chunks one after another, each waiting for its loads: wide chunks
    # keep more bytes in flight (the copy was latency-bound at BD=128).
    bd = next(b for b in (512, 256, 128, 64, 32, 16, 8) if H % b == 0)
    variant = {} if flags is None else dict(tma="t" in flags, dynamic="d" in flags)
    return BlockConfig(block_m=bm, block_n1=bn1, block_n2=bn2, block_k=bk, block_d=bd, num_warps=warps,
                       num_stages=stages, **variant)


# One tile config for every shape and token count: on the H200, 64-row units were 3% slower over the
# 120 low-token grid runs (0.88-1.36x; benchmarks/results/h200-moe/README.md) and 1.3x slower at EP=1:
# with few rows per expert the tiles stream weights, and 8 warps with 4 stages stream them best.
BLOCK = "128:128:256:64:8:4"
BLOCK_SMALL_CHECK = "64:128:256:64:4:3"  # still checked for correctness: the kernel takes any block_m


def block_for(shape_name: str, tokens: int, ep: int, spec: str | None = None):
    """The block config of a shape (`spec` replaces the default `BLOCK`; BN2 is fitted to H)."""
    H = (SHAPES[shape_name] if isinstance(shape_name, str) else shape_name)[0]
    return parse_block(spec or BLOCK, H)


class Problem:
    """Inputs, weights and buffer of one configuration on one device."""

    def __init__(self, shape_name, tokens, ep, path, cfg, device="cuda", dtype=torch.bfloat16, seed=0):
        from xstage.moe import LoopbackGroup, MoEBuffer, transform_weights

        H, I, E, K = SHAPES[shape_name] if isinstance(shape_name, str) else shape_name
        self.H, self.I, self.E, self.K, self.T, self.ep = H, I, E, K, tokens, ep
        el = E // ep
        g = torch.Generator(device=device).manual_seed(seed + 1)
        self.x = torch.randn(tokens, H, generator=g, device=device, dtype=dtype)
        self.idx, self.w = routing(tokens, E, K, device, seed)
        self.l1 = torch.randn(el, 2 * I, H, generator=g, device=device, dtype=dtype).mul_(H**-0.5)
        self.l2 = torch.randn(el, H, I, generator=g, device=device, dtype=dtype).mul_(I**-0.5)
        self.cfg = cfg
        self.buf = MoEBuffer(tokens, E, K, H, I, LoopbackGroup(ep, path=path), device=device, dtype=dtype,
                             config=cfg)
        self.w1t, self.w2 = transform_weights(self.l1, self.l2, cfg.block_n1)
        self.rows = tokens * K  # rows rank 0 computes (each of its (token, slot) pairs exactly once)

    def flops(self) -> float:
        return 6.0 * self.rows * self.H * self.I


class _HostEvent:
    """CPU stand-in for a CUDA event (interpreter runs of the bench code)."""

    def record(self):
        self.t = time.perf_counter_ns()

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) / 1e6


def _events(n):
    if torch.cuda.is_available():
        return [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    return [_HostEvent() for _ in range(n)]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_fused(pb: Problem, variant: str, warmup=3, rep=10):
    """Main kernel timing (median, p10, p90 ns), reduce median ns, the last run's output and the grid.

    `variant` is a schedule name with an optional pacing suffix (`interleaved@off`, see
    `xstage.comm.pacing.parse_pacing`); without one the buffer's default pacing applies."""
    from xstage.comm.pacing import parse_pacing
    from xstage.moe.fused import launch_main, launch_reduce, plan

    schedule, _, pace = variant.partition("@")
    pb.buf.pacing = parse_pacing(pace, pb.buf.store_path) if pace else "auto"
    p = plan(pb.idx, pb.buf, schedule)
    y = torch.empty_like(pb.x)
    for _ in range(warmup):
        launch_main(pb.x, pb.w1t, pb.w2, pb.buf, p)
        launch_reduce(pb.idx, pb.w, y, pb.buf)
    _sync()
    main, red = time_main_and_reduce(pb, p, y, rep)
    return main, red, y, p.schedule.num_ctas


def time_main_and_reduce(pb, p, y, rep: int, before_each=None) -> tuple[Timing, float]:
    """The main kernel's timing and the reduce's median ns over `rep` event-timed runs into `y`;
    `before_each` (e.g. a barrier across ranks) runs before every timed run."""
    from xstage.moe.fused import launch_main, launch_reduce

    a, b, c = _events(rep), _events(rep), _events(rep)
    for i in range(rep):
        if before_each is not None:
            before_each()
        a[i].record()
        launch_main(pb.x, pb.w1t, pb.w2, pb.buf, p)
        b[i].record()
        launch_reduce(pb.idx, pb.w, y, pb.buf)
        c[i].record()
    _sync()
    pb.buf.check()
    main = timing_summary([a[i].elapsed_time(b[i]) * 1e6 for i in range(rep)])
    red = sorted(b[i].elapsed_time(c[i]) * 1e6 for i in range(rep))[rep // 2]
    return main, red


_GROUPED_MM_FAILED: list[bool] = []


def _grouped_mm(a, w, offs):
    """`a [M, K]` rows sorted by group, `w [G, N, K]` -> `[M, N]`; torch._grouped_mm where available."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is not None and a.is_cuda and not _GROUPED_MM_FAILED:
        try:
            return fn(a, w.transpose(-2, -1), offs=offs)
        except RuntimeError as exc:  # an unsupported layout on this build: fall back to a loop of mm
            print(f"torch._grouped_mm unavailable ({str(exc)[:120]}); using per-expert mm")
            _GROUPED_MM_FAILED.append(True)
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ w[e].t()
        start = end
    return out


class Unfused:
    """The serial pipeline on the same routing: exchange copies, grouped GEMMs, SwiGLU."""

    def __init__(self, pb: Problem, path: str):
        from xstage.moe.reference import loopback_inputs

        self.pb = pb
        _, idx_all, _, _, _ = loopback_inputs(pb.x, pb.idx, pb.w, pb.l1, pb.l2, pb.ep)
        el = pb.E // pb.ep
        rows_t, rows_k, experts, remote = [], [], [], []
        for s in range(pb.ep):
            owner = idx_all[s] // el
            t, k = torch.nonzero(owner == 0, as_tuple=True)
            rows_t.append(t)
            rows_k.append(k)
            experts.append(idx_all[s][t, k] % el)
            remote.append(torch.full_like(t, int(s != 0)))
        t, k, e, r = (torch.cat(v) for v in (rows_t, rows_k, experts, remote))
        order = torch.argsort(e, stable=True)
        self.t, self.k, self.remote = t[order], k[order], r[order].bool()
        self.offs = torch.cumsum(torch.bincount(e, minlength=el), 0).to(torch.int32)
        self.n_remote = int(self.remote.sum())
        pin = path == "host" and pb.x.is_cuda
        self.dst_in = torch.empty(self.n_remote, pb.H, dtype=pb.x.dtype, pin_memory=pin,
                                  device="cpu" if pin else pb.x.device)
        self.dst_out = torch.empty_like(self.dst_in)
        self.sel_remote = torch.nonzero(self.remote).flatten()
        self.x_sorted = pb.x[self.t].contiguous()
        self.w1, self.w2 = pb.l1, pb.l2

    def chain(self, a):
        h = _grouped_mm(a, self.w1, self.offs)
        inter = self.pb.I
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        return _grouped_mm(act, self.w2, self.offs)

    def full(self):
        a = self.pb.x[self.t]  # dispatch: gather, then the rows for peers cross the path
        if self.n_remote:
            self.dst_in.copy_(a[self.sel_remote], non_blocking=True)
        out = self.chain(a)
        if self.n_remote:
            self.dst_out.copy_(out[self.sel_remote], non_blocking=True)
        return out

    def combine(self, out):
        """Top-k weighted sum from the sorted expert outputs (used for the correctness check)."""
        y = torch.zeros(self.pb.T, self.pb.K, self.pb.H, dtype=torch.float32, device=out.device)
        y[self.t, self.k] = out.float()
        return (y * self.pb.w[:, :, None]).sum(1)


def time_fn(fn, warmup=3, rep=10) -> float:
    return time_device(fn, warmup=warmup, rep=rep).median_ns


def run_config(cfg_row: dict, path: str, schedules, writer: ResultWriter | None, warmup=3, rep=10,
               block=None, log=print) -> list[dict]:
    """Measure one configuration: every schedule, the unfused pipeline (and the chain at EP=1)."""
    shape, T, ep = cfg_row["shape"], int(cfg_row["tokens"]), int(cfg_row["ep"])
    H, I, E, K = SHAPES[shape] if isinstance(shape, str) else shape
    cfg = cfg_row.get("config") or block_for(shape, T, ep, block)
    pth = path if ep > 1 else "hbm"
    pb = Problem(shape, T, ep, pth, cfg, device=cfg_row.get("device", "cuda"),
                 dtype=cfg_row.get("dtype", torch.bfloat16))
    name = shape if isinstance(shape, str) else f"H{H}-I{I}-E{E}-K{K}"
    base = dict(shape=name, H=H, I=I, E=E, K=K, tokens=T, ep=ep, path=pth, rows=pb.rows,
                block=f"{cfg.block_m}x{cfg.block_n1}x{cfg.block_n2}x{cfg.block_k}")
    rows, outs = [], {}
    for s in schedules:
        main, red, y, ctas = time_fused(pb, s, warmup, rep)
        outs[s] = y
        rows.append(dict(base, variant=s, time_ns=main.median_ns, time_p10_ns=main.p10_ns, time_p90_ns=main.p90_ns,
                         reduce_ns=red, ctas=ctas))
    un = Unfused(pb, pth)
    rows.append(dict(base, variant="unfused", time_ns=time_fn(un.full, warmup, rep), time_p10_ns="", time_p90_ns="",
                     reduce_ns="", ctas=""))
    if ep == 1:
        rows.append(dict(base, variant="chain", time_ns=time_fn(lambda: un.chain(un.x_sorted), warmup, rep),
                         time_p10_ns="", time_p90_ns="", reduce_ns="", ctas=""))
    ref = un.combine(un.full())
    scale = float(ref.abs().max()) or 1.0
    ew = {r["variant"].partition("@")[2]: r["time_ns"] for r in rows if r["variant"].startswith("expert_wave")}
    for r in rows:
        r["tflops"] = pb.flops() / r["time_ns"] / 1e3
        # Over expert_wave with the same store pacing (the buffer default for unfused and chain).
        base_ew = ew.get(r["variant"].partition("@")[2]) if "@" in r["variant"] else ew.get("")
        r["speedup"] = base_ew / r["time_ns"] if base_ew else ""
        y = outs.get(r["variant"])
        r["max_err"] = float((y.float() - ref).abs().max()) / scale if y is not None else ""
    if writer is not None:
        writer.write_many(rows)
    for r in rows:
        log(f"{shape} T={T} EP={ep} {r['variant']:>12}: {r['time_ns'] / 1e3:9.1f} us {r['tflops']:6.0f} TFLOP/s "
            f"speedup {r['speedup'] if r['speedup'] == '' else round(r['speedup'], 3)} err {r['max_err']}")
    return rows


def run_grid(out_dir, only=None, path="host", schedules=SCHEDULES, warmup=3, rep=10, budget_s=None, block=None,
             log=print):
    """Resumable: configurations already in `out_dir/moe.csv` are skipped; stops after `budget_s`."""
    if not torch.cuda.is_available():
        raise InputError("bench moe: needs a CUDA GPU")
    out = Path(out_dir)
    writer = ResultWriter(out / "moe.csv", COLUMNS, KEYS)
    t0 = time.time()
    for c in select(grid_configs(), only):
        if budget_s is not None and time.time() - t0 > budget_s:
            log("time budget reached; rerun to continue")
            break
        pth = path if c["ep"] > 1 else "hbm"
        if writer.done(dict(c, path=pth, variant="unfused")):
            continue
        try:
            run_config(c, path, schedules, writer, warmup, rep, block=block, log=log)
        except Exception:  # one configuration failing must not lose the rest of the grid
            import traceback

            log(f"config {c}: " + traceback.format_exc()[-2500:])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    summarize(out)


def register_bench(grids) -> None:
    from xstage.bench.commands import add_grid_options

    p = grids.add_parser("moe", help="fused MoE schedules vs expert_wave and the unfused pipeline")
    add_grid_options(p)
    p.add_argument("--path", choices=("host", "hbm"), default="host", help="loopback path for EP>1")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated schedule names")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting configurations after this")
    p.add_argument("--block", default=None, help="block BM:BN1:BN2:BK:WARPS:STAGES[:FLAGS] for every shape")
    p.set_defaults(handler=_handler)


def _handler(args) -> int:
    from xstage.cli import emit

    run_grid(args.out, args.only, args.path, tuple(args.schedules.split(",")), args.warmup, args.rep,
             args.budget_s, args.block)
    summary = summarize(args.out)
    emit(summary, args.json, (Path(args.out) / "summary.md").read_text())
    return 0


def gpu_check(cases=None, device="cuda", dtype=torch.bfloat16, log=print) -> bool:
    """bf16 fused kernel vs the float32 reference, bitwise equality of schedules, repeated calls."""
    from xstage.moe import fused_moe, loopback_inputs, reference_moe_virtual

    ok = True
    cases = cases or [((1024, 512, 16, 4), 300, 1, "hbm", BLOCK),
                      ((1024, 512, 16, 4), 300, 4, "host", BLOCK_SMALL_CHECK),
                      ((1152, 768, 8, 2), 129, 8, "hbm", BLOCK),
                      ((2048, 1024, 64, 6), 1000, 2, "host", BLOCK)]
    for shape, T, ep, path, spec in cases:
        cfg = parse_block(spec, shape[0])
        try:
            pb = Problem(shape, T, ep, path, cfg, device=device, dtype=dtype)
        except Exception as exc:
            log(f"check {shape}: {type(exc).__name__}: {exc}")
            ok = False
            continue
        ref = reference_moe_virtual(*loopback_inputs(pb.x.float(), pb.idx, pb.w, pb.l1.float(), pb.l2.float(), ep))[0]
        outs = {}
        for s in ("expert_wave", "interleaved", "lag:0", "lag:3", "expert_wave"):
            pb.buf.combine.fill_(float("nan"))
            outs.setdefault(s, []).append(fused_moe(pb.x, pb.idx, pb.w, pb.w1t, pb.w2, pb.buf, schedule=s))
        try:
            from xstage.moe.fused import launch_main, plan

            k = launch_main(pb.x, pb.w1t, pb.w2, pb.buf, plan(pb.idx, pb.buf, "interleaved"))
            fused_moe(pb.x, pb.idx, pb.w, pb.w1t, pb.w2, pb.buf)  # the reduce re-arms the counters
            ptx = k.asm.get("ptx", "")
            log(f"kernel {spec}: regs {getattr(k, 'n_regs', '?')} shared {k.metadata.shared} "
                + " ".join(f"{op}={ptx.count(op)}" for op in ("wgmma.mma_async", "cp.async.cg", "st.global.v4",
                                                                "ld.global.v4", "mma.sync")))
        except Exception as exc:
            log(f"kernel info: {type(exc).__name__}: {exc}")
        first = outs["expert_wave"][0]
        same = all(torch.equal(y, first) for ys in outs.values() for y in ys)
        err = float((first.float() - ref).abs().max())
        scale = float(ref.abs().max())
        good = same and err <= 2e-2 * scale and not torch.isnan(first).any()
        ok &= good
        log(f"check {shape} T={T} EP={ep} {path} block={spec}: max|err| {err:.3g} (|ref| {scale:.3g}) "
            f"bitwise-equal schedules {same}: {'ok' if good else 'FAIL'}")
    return ok


def _with_block(pb: Problem, cfg) -> None:
    """Give `pb` a buffer (and, for another block_n1, weight layout) for block config `cfg`."""
    from xstage.moe import LoopbackGroup, MoEBuffer, transform_weights

    if cfg.block_n1 != pb.cfg.block_n1:
        pb.w1t, pb.w2 = transform_weights(pb.l1, pb.l2, cfg.block_n1)
    pb.cfg = cfg
    pb.buf = MoEBuffer(pb.T, pb.E, pb.K, pb.H, pb.I, LoopbackGroup(pb.ep, path="hbm"), device=pb.x.device,
                       dtype=pb.x.dtype, config=cfg)


def _trace_summary(pb: Problem, schedule: str) -> tuple[float, dict]:
    """One traced run: the fraction of CTA time inside tasks (the rest is fetching, waiting and the
    tail) and the median tile time per kind in us."""
    from xstage.moe.fused import launch_main, launch_reduce, plan
    from xstage.moe.schedule import KIND_NAMES

    p = plan(pb.idx, pb.buf, schedule)
    trace = torch.zeros(p.schedule.num_tasks, 3, dtype=torch.int64, device=pb.x.device)
    launch_main(pb.x, pb.w1t, pb.w2, pb.buf, p, trace=trace)
    launch_reduce(pb.idx, pb.w, torch.empty_like(pb.x), pb.buf)
    _sync()
    kinds = torch.from_numpy(p.schedule.global_order()[:, 0]).to(trace.device)
    ran = trace[:, 0] > 0  # unit slots without rows are skipped and leave zeros
    go, done = trace[ran, 0].double(), trace[ran, 1].double()
    busy = float((done - go).sum() / (p.schedule.num_ctas * (done.max() - go.min())))
    tiles = {f"{name}_us": float((done - go)[kinds[ran] == i].median()) / 1e3
             for i, name in enumerate(KIND_NAMES) if bool((kinds[ran] == i).any())}
    return busy, tiles


def ep1_sweep(shapes=None, tokens=(4096, 16384), blocks=(BLOCK,), schedule="interleaved",
              warmup=3, rep=10, trace=False, log=print):
    """EP=1: fused kernel (main + reduce) vs the grouped_mm chain for several block configurations and
    kernel variants, side by side on one problem (weights and routing built once per shape and tokens).
    `trace=True` adds one traced run per variant: busy fraction and median tile times."""
    from xstage.moe.fused import launch_main, launch_reduce, plan

    rows = []
    for shape in shapes or SHAPES:
        for T in tokens:
            H = SHAPES[shape][0]
            pb = Problem(shape, T, 1, "hbm", parse_block(blocks[0], H))
            un = Unfused(pb, "hbm")
            chain = time_fn(lambda un=un: un.chain(un.x_sorted), warmup, rep)
            ref = un.combine(un.chain(un.x_sorted)).float()
            scale = float(ref.abs().max()) or 1.0
            for spec in blocks:
                try:
                    _with_block(pb, parse_block(spec, H))
                    k = launch_main(pb.x, pb.w1t, pb.w2, pb.buf, plan(pb.idx, pb.buf, schedule))  # compiles
                    launch_reduce(pb.idx, pb.w, torch.empty_like(pb.x), pb.buf)  # re-arms the counters
                    main, red, y, ctas = time_fused(pb, schedule, warmup, rep)
                    main = main.median_ns
                except Exception:  # a config that does not compile or fit: report and go on
                    import traceback

                    log(f"ep1 {shape} T={T} block={spec}: " + traceback.format_exc()[-2500:])
                    torch.cuda.empty_cache()
                    continue
                f = pb.flops()
                busy, tiles = _trace_summary(pb, schedule) if trace else (float("nan"), {})
                rows.append(dict(shape=shape, tokens=T, block=spec, fused_us=main / 1e3, reduce_us=red / 1e3,
                                 chain_us=chain / 1e3, fused_tflops=f / main / 1e3, chain_tflops=f / chain / 1e3,
                                 ratio=main / chain, ratio_with_reduce=(main + red) / chain,
                                 max_err=float((y.float() - ref).abs().max()) / scale,
                                 regs=getattr(k, "n_regs", -1), spills=getattr(k, "n_spills", -1),
                                 shared=int(k.metadata.shared) if k is not None else -1, busy=busy, **tiles))
                log("ep1 " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in rows[-1].items()))
            del pb, un
            torch.cuda.empty_cache()
    return rows


def ep1_table(rows: list[dict]) -> str:
    """fused/chain per configuration (rows) and block variant (columns), geomean last."""
    blocks = list(dict.fromkeys(r["block"] for r in rows))
    confs = list(dict.fromkeys((r["shape"], r["tokens"]) for r in rows))
    by = {(r["shape"], r["tokens"], r["block"]): r for r in rows}
    lines = ["| shape | tokens | chain us | " + " | ".join(blocks) + " |", "|---" * (3 + len(blocks)) + "|"]
    for shape, t in confs:
        chain = next(r["chain_us"] for r in rows if (r["shape"], r["tokens"]) == (shape, t))
        cells = [f"{by[(shape, t, b)]['ratio']:.3f}" if (shape, t, b) in by else "-" for b in blocks]
        lines.append(f"| {shape} | {t} | {chain:.0f} | " + " | ".join(cells) + " |")
    gm = [geomean([r["ratio"] for r in rows if r["block"] == b]) for b in blocks]
    lines.append("| geomean | | | " + " | ".join(f"{g:.3f}" for g in gm) + " |")
    if any("busy" in r and r["busy"] == r["busy"] for r in rows):
        lines += ["", "busy fraction / median dispatch, linear1, linear2 tile us:"]
        for (shape, t), b in ((c, b) for c in confs for b in blocks):
            r = by.get((shape, t, b))
            if r is not None:
                lines.append(f"{shape} {t} {b}: {r['busy']:.2f} / " + ", ".join(
                    f"{r.get(k + '_us', float('nan')):.1f}" for k in ("dispatch", "linear1", "linear2")))
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="MoE device runs: check, ep1 sweep, grid")
    ap.add_argument("mode", choices=("check", "ep1", "grid"))
    ap.add_argument("-o", "--out", default="benchmarks/results/h200-moe")
    ap.add_argument("--only", action="append")
    ap.add_argument("--budget-s", type=float, default=None)
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--blocks", default=BLOCK, help="ep1: comma-separated block specs")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--block", default=None, help="grid: block spec for every shape")
    ap.add_argument("--schedule", default="lag:16", help="ep1: the schedule of the fused kernel")
    ap.add_argument("--schedules", default=",".join(SCHEDULES),
                    help="grid: comma-separated variants, SCHEDULE[@PACING] (PACING: off, auto, GBPS:KIB)")
    ap.add_argument("--trace", action="store_true", help="ep1: also one traced run per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rep", type=int, default=10)
    a = ap.parse_args()
    if a.mode == "check":
        raise SystemExit(0 if gpu_check() else 1)
    if a.mode == "ep1":
        res = ep1_sweep(a.shapes.split(",") if a.shapes else None, tokens=[int(t) for t in a.tokens.split(",")],
                        blocks=a.blocks.split(","), schedule=a.schedule, warmup=a.warmup, rep=a.rep,
                        trace=a.trace)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "ep1_sweep.json").write_text(json.dumps(res, indent=1))
        print(ep1_table(res))
    else:
        run_grid(a.out, a.only, schedules=tuple(a.schedules.split(",")), budget_s=a.budget_s, block=a.block,
                 warmup=a.warmup, rep=a.rep)
