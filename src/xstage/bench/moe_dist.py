"""The MoE grid on a real expert-parallel group: one process per rank, NVLink peer stores.

Problem: `xstage bench moe` times rank 0 of an EP group on one GPU (loopback); here every rank is a
process with its own GPU, tokens and local experts, and the fused kernel's remote stores cross the
real peer path (`xstage.comm` symmetric memory). For each configuration of the grid with
`ep == world size` (4 shapes x tokens per rank 256 .. 16384) each rank records, per variant:

- each variant `SCHEDULE[@PACING]` of the fused layer (`xstage.moe.Variant`; default: the planner's
  candidates `xstage.moe.CANDIDATES` and `model_guided`, each with the `auto` pacing of the peer
  path): `time_ns` the main kernel (dispatch, Linear-1 + SwiGLU, Linear-2 + combine push to the
  source ranks), `reduce_ns` the top-k reduce (which also waits for every peer's completion signal);
  a variant that cannot be planned (`model_guided` without an embedded profile of the peer path) is
  skipped on every rank and logged. Beside the kernels, the variant's public call on a second buffer
  of the group at its defaults, sized for the run's largest token count, every rank calling together
  on its own 16 routings (`measure_peer_call`; the columns of `xstage.bench.moe`, each the slowest
  rank's);
- `unfused`: on the same routing, `time_ns` = gather + all_to_all dispatch + permute by expert
  + `torch._grouped_mm` Linear-1 (per-expert matmuls where it is missing) + SwiGLU + grouped GEMM
  Linear-2 + un-permute + all_to_all combine + scatter into (token, slot) order; `reduce_ns` the
  weighted top-k sum. Routing metadata (counts, permutations) is built outside the timed region,
  as the fused kernel's routing layout is.

Every timed run starts after a barrier (`xstage.bench.runtime`: device idle, host barrier); per run
the slowest rank counts, and a row holds the median, p10 and p90 over `rep` runs. `tflops` counts
`6 * T * K * H * I` per rank, `speedup` is the time of `expert_wave` at the same pacing over the
variant's time (the unfused baseline against `expert_wave` at the default pacing), `max_err` the
first run's fused output against the unfused one (relative to max |y|, maximum over ranks). Rank 0
writes the rows (columns of `xstage.bench.moe`, `path = "peer"`, resumable) and summary.md.

The process group and NVLink multicast follow `xstage.bench.runtime` (NCCL when every rank has its
own GPU, else gloo: correctness only, timings there mean nothing).

Example (2 GPUs of one node; `benchmarks/moe_multi_gpu.sh` wraps it):
    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 -m xstage.bench.moe_dist -o out/moe-peer \\
        --only tokens=4096 --budget-s 120
    PYTHONPATH=src python3 -m xstage.bench.moe_dist -o out/moe-peer --summarize-only
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from pathlib import Path

import torch

import xstage.sched.plan  # noqa: F401  (registers the `model_guided` schedule)
from xstage.bench.calls import CALLS, ROUTINGS, measure_call
from xstage.bench.moe import COLUMNS, KEYS, NO_CALL, call_routings, tolerance
from xstage.bench.moe_summary import summarize
from xstage.bench.runtime import Runtime
from xstage.errors import InputError, XstageError
from xstage.moe import BlockConfig, MoEBuffer, transform_weights
from xstage.moe.baseline import _grouped_mm
from xstage.moe.fused import fused_moe, launch_main, launch_reduce, plan
from xstage.moe.problem import routing
from xstage.results import ResultWriter, events, read_rows, select, synchronize
from xstage.spec.moe import SHAPES, MoeShape, parse_block
from xstage.spec.schedule import CANDIDATES
from xstage.spec.variant import Variant

SCHEDULES = (*CANDIDATES, "model_guided")
TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
EPS = (2, 4, 8)
PATH = "peer"
DEFAULT_PACING = "default"  # the pacing of a variant without `@PACING` (none on `peer` until measured there)
TINY_SHAPES = {"H64-I32-E4-K2": MoeShape.parse("H64-I32-E4-K2")}
TINY_TOKENS = (12,)
TINY_BLOCK = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)
SUMMARY_TITLE = "# MoE fused kernel: schedules vs expert_wave on a real EP group (peer path)"
SUMMARY_INTRO = ("One process per rank, each with its own GPU, tokens and local experts; the fused kernel "
                 "pushes combine rows into the source ranks' buffers through peer (NVLink) stores. `time_ns`: "
                 "the fused main kernel, or for `unfused` the all_to_all dispatch + grouped GEMMs + "
                 "SwiGLU + all_to_all combine (both without the top-k reduce, in `reduce_ns`); per run the "
                 "slowest rank, median over runs.")


def shape_dims(name: str) -> MoeShape:
    """`(H, I, E, K)` of a grid or test shape name."""
    dims = SHAPES.get(name) or TINY_SHAPES.get(name)
    if dims is None:
        raise InputError(f"shape {name!r}: must be one of {sorted(SHAPES) + sorted(TINY_SHAPES)}")
    return dims


def peer_configs(world: int, tiny: bool = False) -> list[dict]:
    """The grid's configurations with `ep == world` (or the tiny test grid), short sequences first."""
    if tiny:
        return [dict(shape=s, tokens=t, ep=world) for t in TINY_TOKENS for s in TINY_SHAPES]
    if world not in EPS:
        raise InputError(f"world size {world}: must be one of the grid's expert-parallel sizes {EPS} "
                         "(one process per rank)")
    return [dict(shape=s, tokens=t, ep=world) for t in TOKENS for s in SHAPES]


def make_inputs(dims, tokens: int, rank: int, world: int, device, dtype, seed: int = 0):
    """Rank `rank`'s tokens, routing (`xstage.moe.problem.routing` seeded per rank) and local experts.

    Returns `x [T, H]`, `topk_idx [T, K]`, `topk_w [T, K]`, `l1 [E/world, 2I, H]`, `l2 [E/world, H, I]`;
    a function of its arguments only, so a test can rebuild every rank's inputs in one process."""
    H, I, E, K = dims
    el = E // world
    g = torch.Generator(device=device).manual_seed(seed + 1 + 7919 * rank)
    x = torch.randn(tokens, H, generator=g, device=device, dtype=dtype)
    idx, w = routing(tokens, E, K, device, seed + rank)
    l1 = torch.randn(el, 2 * I, H, generator=g, device=device, dtype=dtype).mul_(H**-0.5)
    l2 = torch.randn(el, H, I, generator=g, device=device, dtype=dtype).mul_(I**-0.5)
    return x, idx, w, l1, l2


class PeerProblem:
    """One configuration on one rank: inputs, local weights, and the group's `MoEBuffer`."""

    def __init__(self, shape: str, tokens: int, rt: Runtime, cfg: BlockConfig, dtype, seed: int = 0):
        self.name = shape
        self.H, self.I, self.E, self.K = dims = shape_dims(shape)
        self.T, self.ep, self.cfg = tokens, rt.world, cfg
        if self.E % rt.world:
            raise InputError(f"shape {shape}: {self.E} experts do not split over {rt.world} ranks")
        self.x, self.idx, self.w, self.l1, self.l2 = make_inputs(dims, tokens, rt.rank, rt.world, rt.device,
                                                                 dtype, seed)
        self.w1t, self.w2 = transform_weights(self.l1, self.l2, cfg.block_n1)
        self.rows = tokens * self.K  # rows per rank on average: every rank's T*K pairs, computed once each
        self.buf = None

    def attach(self, rt: Runtime) -> None:
        """Allocate the symmetric buffers (collective) and stage this rank's tokens and routing."""
        self.buf = MoEBuffer(self.T, self.E, self.K, self.H, self.I, rt.group, device=rt.device,
                             dtype=self.x.dtype, config=self.cfg)
        self.buf.x_buf[: self.T].copy_(self.x)
        self.buf.idx_buf.fill_(-1)
        self.buf.idx_buf[: self.T].copy_(self.idx)
        rt.barrier()  # peers pull these rows and read this routing from here on

    def flops(self) -> float:
        return 6.0 * self.rows * self.H * self.I

    def close(self) -> None:
        if self.buf is not None:
            self.buf.ctx.close()
            self.buf = None


def time_parts(rt: Runtime, first, second, rep: int, second_host: list | None = None
               ) -> tuple[list[float], list[float]]:
    """`first()` then `second()`, `rep` runs each started after a barrier of the group; this rank's
    times (ns) of both parts per run. `second_host` (a list) receives each `second()`'s host time (ns)."""
    a, b, c = events(rep), events(rep), events(rep)
    for i in range(rep):
        rt.barrier()
        a[i].record()
        first()
        b[i].record()
        t0 = time.perf_counter_ns()
        second()
        if second_host is not None:
            second_host.append(time.perf_counter_ns() - t0)
        c[i].record()
    synchronize()
    return [a[i].elapsed_time(b[i]) * 1e6 for i in range(rep)], [b[i].elapsed_time(c[i]) * 1e6 for i in range(rep)]


def time_fused_peer(pb: PeerProblem, rt: Runtime, p, warmup: int, rep: int, reduce_host: list | None = None):
    """This rank's main-kernel and reduce times (ns) per run of a planned schedule, and the first
    run's output; `reduce_host` (a list) receives each `launch_reduce`'s host time (ns)."""
    y0 = torch.empty_like(pb.x)
    pb.buf.combine.fill_(float("nan"))  # a combine row no peer stored shows up as NaN in y0
    for i in range(1 + warmup):
        rt.barrier()
        launch_main(pb.x, pb.w1t, pb.w2, pb.buf, p)
        launch_reduce(pb.idx, pb.w, y0 if i == 0 else torch.empty_like(pb.x), pb.buf)
        if i == 0:
            synchronize()
            pb.buf.check()
    y = torch.empty_like(pb.x)
    main, red = time_parts(rt, lambda: launch_main(pb.x, pb.w1t, pb.w2, pb.buf, p),
                           lambda: launch_reduce(pb.idx, pb.w, y, pb.buf), rep, reduce_host)
    pb.buf.check()
    return main, red, y0


class PeerUnfused:
    """The serial expert-parallel pipeline on the same routing (module docstring): all_to_all
    dispatch, grouped GEMMs around SwiGLU, all_to_all combine, weighted top-k sum."""

    def __init__(self, pb: PeerProblem, rt: Runtime):
        self.pb, self.rt = pb, rt
        R, K, el = rt.world, pb.K, pb.E // rt.world
        idx = pb.idx.long()
        owner = (idx // el).reshape(-1)
        self.order = torch.argsort(owner, stable=True)  # (token, slot) pairs grouped by destination rank
        self.send_t = self.order // K
        send_exp = (idx.reshape(-1)[self.order] % el).contiguous()
        send_counts = torch.bincount(owner, minlength=R)
        recv_counts = torch.empty_like(send_counts)
        rt.all_to_all(recv_counts, send_counts)
        self.sc, self.rc = send_counts.tolist(), recv_counts.tolist()
        recv_exp = send_exp.new_empty(sum(self.rc))
        rt.all_to_all(recv_exp, send_exp, self.rc, self.sc)
        self.perm = torch.argsort(recv_exp, stable=True)  # received rows sorted by local expert
        self.offs = torch.cumsum(torch.bincount(recv_exp, minlength=el), 0).to(torch.int32)
        H, n_send, n_recv = pb.H, idx.numel(), sum(self.rc)
        new = dict(dtype=pb.x.dtype, device=pb.x.device)
        self.send = torch.empty(n_send, H, **new)
        self.recv = torch.empty(n_recv, H, **new)
        self.out = torch.empty(n_recv, H, **new)
        self.back = torch.empty(n_send, H, **new)
        self.comb = torch.empty(n_send, H, **new)

    def exchange_and_compute(self) -> None:
        pb = self.pb
        torch.index_select(pb.x, 0, self.send_t, out=self.send)
        self.rt.all_to_all(self.recv, self.send, self.rc, self.sc)
        a = self.recv[self.perm]
        h = _grouped_mm(a, pb.l1, self.offs)
        act = torch.nn.functional.silu(h[:, : pb.I]) * h[:, pb.I:]
        self.out[self.perm] = _grouped_mm(act, pb.l2, self.offs)
        self.rt.all_to_all(self.back, self.out, self.sc, self.rc)
        self.comb[self.order] = self.back

    def reduce(self) -> torch.Tensor:
        pb = self.pb
        y = (self.comb.view(pb.T, pb.K, pb.H).float() * pb.w[:, :, None]).sum(1)
        return y.to(pb.x.dtype)

    def time(self, warmup: int, rep: int):
        """This rank's times (ns) per run of the exchange + compute part and of the reduce, and the
        first output."""
        self.rt.barrier()
        self.exchange_and_compute()
        y0 = self.reduce()
        for _ in range(warmup):
            self.rt.barrier()
            self.exchange_and_compute()
            self.reduce()
        main, red = time_parts(self.rt, self.exchange_and_compute, self.reduce, rep)
        return main, red, y0


_CALL_NUMBERS = ("call_ns", "host_ns", "host_p10_ns", "host_p90_ns", "launches", "syncs", "graph_ns")


def measure_peer_call(pb: PeerProblem, rt: Runtime, v: Variant, buf: MoEBuffer, routes: list[tuple],
                      y_kernels: torch.Tensor, calls: int) -> dict:
    """The public call of variant `v` on the group's call buffer `buf` (defaults as in
    `xstage.bench.moe.measure_moe_call`), every rank calling together on its own routings; the call
    columns of the slowest rank: each number the maximum over ranks, empty where a rank has none, the
    notes of every rank."""
    kw = {"schedule": v.schedule} if v.pacing is None else {"schedule": v.schedule, "pacing": v.pacing}

    def call(idx, w):
        return fused_moe(pb.x, idx, w, pb.w1t, pb.w2, buf, **kw)

    rt.barrier()
    cols = measure_call(call, routes, y_kernels, tolerance(pb.x.dtype), calls=calls, after=buf.check,
                        agree=rt.all_ok).columns()
    mine = [float(cols[c]) if cols[c] != "" else -math.inf for c in _CALL_NUMBERS]
    worst = rt.max_over_ranks(mine + [1.0 if cols[c] == "" else 0.0 for c in _CALL_NUMBERS])
    n = len(_CALL_NUMBERS)
    for i, c in enumerate(_CALL_NUMBERS):
        cols[c] = "" if worst[n + i] else (int(worst[i]) if c in ("launches", "syncs") else worst[i])
    notes = [note for per_rank in rt.gather(cols["call_note"]) for note in per_rank.split("; ") if note]
    cols["call_note"] = "; ".join(dict.fromkeys(notes))
    return cols


def run_peer_config(c: dict, rt: Runtime, variants: list[Variant], writer: ResultWriter | None, warmup: int,
                    rep: int, dtype, block: str | None = None, cfg: BlockConfig | None = None,
                    dump: dict | None = None, call_tokens: int | None = None, calls: int | None = CALLS
                    ) -> list[dict]:
    """Measure one configuration on every rank; rank 0 writes the rows. [] when it could not be built.

    Each variant's kernels, then its public call (`measure_peer_call`) on a second buffer of the
    group at its defaults, sized for `call_tokens` (default this configuration's tokens); `calls`
    back-to-back calls (None: the call is not measured).

    Building the inputs and planning each variant end in an agreement across ranks, so a failure
    there (memory, a schedule the planner cannot resolve) skips the configuration or variant on
    every rank; a failure while measuring raises (the launcher then stops every rank)."""
    shape, T = c["shape"], int(c["tokens"])
    pb, err = None, ""
    try:
        dims = shape_dims(shape)
        cfg = cfg or parse_block(block, dims.hidden)
        pb = PeerProblem(shape, T, rt, cfg, dtype)
    except (InputError, RuntimeError) as exc:  # RuntimeError: out of device memory
        err = f"{type(exc).__name__}: {exc}"
    if not rt.all_ok(pb is not None):
        rt.log(f"{shape} T={T}: skipped on every rank ({err or 'failed on another rank'})")
        return []
    pb.attach(rt)
    base = dict(shape=shape, H=pb.H, I=pb.I, E=pb.E, K=pb.K, tokens=T, ep=rt.world, path=PATH, rows=pb.rows,
                block=f"{cfg.block_m}x{cfg.block_n1}x{cfg.block_n2}x{cfg.block_k}")
    measured, outs = [], {}
    call_buf, routes = None, None
    if calls is not None:
        call_buf = MoEBuffer(max(T, call_tokens or T), pb.E, pb.K, pb.H, pb.I, rt.group, device=rt.device,
                             dtype=pb.x.dtype, config=cfg)
        routes = call_routings(pb.idx, pb.w, pb.E, pb.K, first_seed=1000 * (rt.rank + 1))
    for v in variants:
        p, err = None, ""
        try:
            p = plan(pb.idx, pb.buf, v.schedule, pacing=v.pacing_or(DEFAULT_PACING))
        except (InputError, RuntimeError, ValueError) as exc:
            err = f"{type(exc).__name__}: {exc}"
        if not rt.all_ok(p is not None):
            rt.log(f"{shape} T={T} {v}: skipped on every rank ({err or 'failed on another rank'})")
            continue
        host: list[float] = []
        main, red, y0 = time_fused_peer(pb, rt, p, warmup, rep, host)
        outs[str(v)] = y0
        call = (dict(NO_CALL, call_note="call not measured") if call_buf is None
                else measure_peer_call(pb, rt, v, call_buf, routes, y0, calls))
        measured.append((v, main, red, p.schedule.num_ctas, statistics.median(host), call))
    if call_buf is not None:
        call_buf.ctx.close()
    un = PeerUnfused(pb, rt)
    u_main, u_red, y_un = un.time(warmup, rep)
    scale = float(y_un.float().abs().max()) or 1.0
    errs = [float((outs[str(v)].float() - y_un.float()).abs().max()) / scale for v, *_ in measured]
    same = all(torch.equal(y, outs[str(measured[0][0])]) for y in outs.values())
    if dump is not None:
        dump.update({(shape, T, s): y.cpu() for s, y in outs.items()})
        dump[(shape, T, "unfused")] = y_un.cpu()
    times = rt.timings(*[t for _, main, red, *_ in measured for t in (main, red)], u_main, u_red)
    errs = rt.max_over_ranks(errs + [0.0 if same else 1.0])  # the worst rank counts
    reduce_host = rt.max_over_ranks([m[4] for m in measured])
    rows = []
    for i, (v, _, _, ctas, _, call) in enumerate(measured):
        main, red = times[2 * i], times[2 * i + 1]
        rows.append(dict(base, variant=str(v), time_ns=main.median_ns, time_p10_ns=main.p10_ns,
                         time_p90_ns=main.p90_ns, reduce_ns=red.median_ns, ctas=ctas, max_err=errs[i],
                         reduce_host_ns=reduce_host[i], **{"loop_ns": "", **call}))  # no loop on real groups
    u_main_t, u_red_t = times[-2], times[-1]
    rows.append(dict(base, variant="unfused", time_ns=u_main_t.median_ns, time_p10_ns=u_main_t.p10_ns,
                     time_p90_ns=u_main_t.p90_ns, reduce_ns=u_red_t.median_ns, ctas="", max_err="",
                     reduce_host_ns="", **NO_CALL))
    # over expert_wave at the same pacing (the default pacing for the unfused baseline)
    pacing_of = {str(v): v.pacing_or(DEFAULT_PACING) for v, *_ in measured}
    ew = {pacing_of[r["variant"]]: r["time_ns"] for (v, *_), r in zip(measured, rows) if v.schedule == "expert_wave"}
    for r in rows:
        r["tflops"] = pb.flops() / r["time_ns"] / 1e3
        base_ew = ew.get(pacing_of.get(r["variant"], DEFAULT_PACING))
        r["speedup"] = base_ew / r["time_ns"] if base_ew else ""
    tol = tolerance(dtype)
    if writer is not None:
        writer.write_many(rows)
    for r in rows:
        ok = r["max_err"] == "" or r["max_err"] <= tol
        call = "" if r["call_ns"] == "" else f" call {r['call_ns'] / 1e3:.1f} us, {r['launches']} launches"
        rt.log(f"{shape} T={T} EP={rt.world} {r['variant']:>12}: {r['time_ns'] / 1e3:9.1f} us "
               f"(+{r['reduce_ns'] / 1e3:.1f} reduce) {r['tflops']:6.1f} TFLOP/s speedup "
               f"{'' if r['speedup'] == '' else round(r['speedup'], 3)} err {r['max_err']}{'' if ok else ' FAIL'}"
               + call + (f" [{r['call_note']}]" if r["call_note"] else ""))
    if errs[-1]:
        rt.log(f"{shape} T={T}: schedules gave outputs that are not bitwise equal on some rank")
    pb.close()
    return rows


def run_peer_grid(out_dir, rt: Runtime, only=None, variants=SCHEDULES, warmup: int = 5, rep: int = 30,
                  budget_s: float | None = None, block: str | None = None, dtype=None, tiny: bool = False,
                  dump: bool = False) -> dict | None:
    """Every selected configuration, resumable from `out_dir/moe.csv`; rank 0 returns the summary
    (`xstage.bench.moe_summary.summarize`), the other ranks None."""
    out = Path(out_dir)
    variants = [v if isinstance(v, Variant) else Variant.parse(v) for v in variants]
    dtype = rt.dtype(None) if dtype is None else dtype
    writer = ResultWriter(out / "moe.csv", COLUMNS, KEYS, require_commit=True) if rt.rank == 0 else None
    outputs: dict | None = {} if dump else None
    t0 = time.time()
    configs = select(peer_configs(rt.world, tiny), only)
    call_tokens = max(int(c["tokens"]) for c in configs)  # every call's buffer holds the run's largest call
    for c in configs:
        decision = None
        if rt.rank == 0:
            if budget_s is not None and time.time() - t0 > budget_s:
                decision = "stop"
            else:
                decision = "skip" if writer.done(dict(c, path=PATH, variant="unfused")) else "run"
        decision = rt.from_rank0(decision)
        if decision == "stop":
            rt.log("time budget reached; rerun to continue")
            break
        if decision == "skip":
            continue
        try:
            run_peer_config(c, rt, variants, writer, warmup, rep, dtype, block=block,
                            cfg=TINY_BLOCK if tiny else None, dump=outputs, call_tokens=call_tokens,
                            calls=ROUTINGS if tiny else CALLS)
        except Exception as exc:
            raise XstageError(f"rank {rt.rank}, configuration {c}: {type(exc).__name__}: {exc}") from exc
        gc.collect()
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(rt.device)
            rt.log(f"device memory free after the configuration: {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
    if outputs is not None:
        torch.save(outputs, out / f"outputs-rank{rt.rank}.pt")
    rt.barrier()
    if rt.rank == 0 and (out / "moe.csv").exists():
        return summarize(out, SUMMARY_TITLE, SUMMARY_INTRO)
    return None


def table(out_dir) -> str:
    """One line per configuration: expert_wave time, every other variant's speedup, worst error."""
    rows = [r for r in read_rows(Path(out_dir) / "moe.csv") if r["path"] == PATH]
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["variant"] != "expert_wave"))
    lines = [f"{'shape':<20} {'tokens':>6} {'ep':>2} {'ew_us':>9} " + " ".join(f"{v:>12}" for v in variants)
             + f" {'max_err':>8}"]
    for key in dict.fromkeys((r["shape"], r["tokens"], r["ep"]) for r in rows):
        sel = {r["variant"]: r for r in rows if (r["shape"], r["tokens"], r["ep"]) == key}
        ew = sel.get("expert_wave")
        cells = [f"{float(sel[v]['speedup']):12.3f}" if v in sel and sel[v]["speedup"] else f"{'':>12}"
                 for v in variants]
        errs = [float(r["max_err"]) for r in sel.values() if r["max_err"]]
        lines.append(f"{key[0]:<20} {key[1]:>6} {key[2]:>2} "
                     f"{float(ew['time_ns']) / 1e3 if ew else float('nan'):9.1f} " + " ".join(cells)
                     + f" {max(errs) if errs else float('nan'):8.2g}")
    return "\n".join(lines)


if __name__ == "__main__":
    # `python3 -m xstage.bench.moe_dist` (the results folders' commands): the parser lives in the CLI floor,
    # which this module does not import; run it by name.
    import runpy

    runpy.run_module("xstage.cli.moe_dist", run_name="__main__")
