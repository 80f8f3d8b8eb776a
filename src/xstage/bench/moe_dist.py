"""The MoE grid on a real expert-parallel group: one process per rank, NVLink peer stores.

Problem: `xstage bench moe` times rank 0 of an EP group on one GPU (loopback); here every rank is a
process with its own GPU, tokens and local experts, and the fused kernel's remote stores cross the
real peer path (`xstage.comm` symmetric memory). For each configuration of the grid with
`ep == world size` (4 shapes x tokens per rank 256 .. 16384) each rank records, per variant:

- each schedule of the fused layer (`expert_wave`, `interleaved`, `lag:k`, `model_guided`):
  `time_ns` the main kernel (dispatch, Linear-1 + SwiGLU, Linear-2 + combine push to the source
  ranks), `reduce_ns` the top-k reduce (which also waits for every peer's completion signal); a
  schedule that cannot be planned (`model_guided` without an embedded profile of the peer path)
  is skipped on every rank and logged;
- `unfused`: on the same routing, `time_ns` = gather + NCCL all_to_all dispatch + permute by expert
  + `torch._grouped_mm` Linear-1 (per-expert matmuls where it is missing) + SwiGLU + grouped GEMM
  Linear-2 + un-permute + all_to_all combine + scatter into (token, slot) order; `reduce_ns` the
  weighted top-k sum. Routing metadata (counts, permutations) is built outside the timed region,
  as the fused kernel's routing layout is.

Every timed run starts after a barrier (device synchronise + a host barrier of the group); a row
holds the median over `rep` runs, maximum over ranks. `tflops` counts `6 * T * K * H * I` per rank,
`speedup` is `expert_wave` time over the variant's time, `max_err` the first run's fused output
against the unfused one (relative to max |y|, maximum over ranks). Rank 0 writes the rows (columns
of `xstage.bench.moe`, `path = "peer"`, resumable) and summary.md.

Process group: NCCL when every local rank has its own GPU, else gloo (ranks sharing a GPU, or the
CPU with Triton's interpreter: correctness only, timings there mean nothing). NVLink multicast is
switched off in the environment before anything initialises.

Example (2 GPUs of one node; `benchmarks/moe_multi_gpu.sh` wraps it):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        torchrun --standalone --nproc-per-node 2 -m xstage.bench.moe_dist -o out/moe-peer \\
        --only tokens=4096 --budget-s 120
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from xstage.bench.grid import select
from xstage.bench.moe import (
    COLUMNS,
    EPS,
    KEYS,
    SCHEDULES,
    SHAPES,
    _events,
    _grouped_mm,
    _sync,
    block_for,
    grid_configs,
    routing,
    time_main_and_reduce,
)
from xstage.bench.moe_summary import summarize
from xstage.bench.results import ResultWriter, read_rows
from xstage.comm.pacing import parse_pacing
from xstage.errors import InputError, XstageError

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DIST_SCHEDULES = SCHEDULES + ("model_guided",)
PATH = "peer"
TINY_SHAPES = {"H64-I32-E4-K2": (64, 32, 4, 2)}
TINY_TOKENS = (12,)
SUMMARY_TITLE = "# MoE fused kernel: schedules vs expert_wave on a real EP group (peer path)"
SUMMARY_INTRO = ("One process per rank, each with its own GPU, tokens and local experts; the fused kernel "
                 "pushes combine rows into the source ranks' buffers through peer (NVLink) stores. `time_ns`: "
                 "the fused main kernel, or for `unfused` the NCCL all_to_all dispatch + grouped GEMMs + "
                 "SwiGLU + all_to_all combine (both without the top-k reduce, in `reduce_ns`); median over "
                 "runs, maximum over ranks.")


def set_multicast_off() -> None:
    """NVLink multicast stays off: set before NCCL, symmetric memory or NVSHMEM initialise."""
    os.environ.update(MULTICAST_OFF)


def shape_dims(name: str) -> tuple[int, int, int, int]:
    """`(H, I, E, K)` of a grid or test shape name."""
    dims = SHAPES.get(name) or TINY_SHAPES.get(name)
    if dims is None:
        raise InputError(f"shape {name!r}: must be one of {sorted(SHAPES) + sorted(TINY_SHAPES)}")
    return dims


def peer_configs(world: int, tiny: bool = False) -> list[dict]:
    """The grid's configurations with `ep == world` (or the tiny test grid)."""
    if tiny:
        return [dict(shape=s, tokens=t, ep=world) for t in TINY_TOKENS for s in TINY_SHAPES]
    out = [c for c in grid_configs() if c["ep"] == world]
    if not out:
        raise InputError(f"world size {world}: must be one of the grid's expert-parallel sizes {EPS} "
                         "(one process per rank)")
    return out


class PeerGroup:
    """This process's rank in the EP group: device, process group, and a host-side group for control.

    The control group (gloo) carries barriers, decisions of rank 0 and the maximum over ranks, so
    those never queue behind device work; on a gloo world it is the world group itself."""

    def __init__(self, backend: str | None = None, timeout_s: float = 300.0):
        import torch.distributed as dist

        if "RANK" not in os.environ:
            raise InputError("moe_dist: start one process per rank with torchrun (RANK is not set)")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:
            self.device = torch.device("cuda", local % gpus)
            torch.cuda.set_device(self.device)
            own = gpus >= local_world
            if not own:
                os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
            backend = backend or ("nccl" if own else "gloo")
        else:
            self.device = torch.device("cpu")
            backend = backend or "gloo"
        if backend not in ("nccl", "gloo"):
            raise InputError(f"--backend {backend!r}: must be 'nccl' or 'gloo'")
        if backend == "nccl" and not gpus:
            raise InputError("--backend nccl: needs CUDA GPUs")
        kw = dict(device_id=self.device) if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=_dt.timedelta(seconds=timeout_s), **kw)
        self.dist = dist
        self.backend = backend
        self.group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ctrl = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        # gloo moves CPU tensors only: device tensors cross through host copies (correctness runs).
        self.stage_on_host = backend == "gloo" and self.device.type == "cuda"

    def barrier(self) -> None:
        _sync()
        self.dist.barrier(group=self.ctrl)

    def max_all(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.ctrl)
        return t.tolist()

    def all_ok(self, ok: bool) -> bool:
        return self.max_all([0.0 if ok else 1.0])[0] == 0.0

    def from_rank0(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        """`all_to_all_single` of rows; on gloo 16-bit rows travel as bytes (not every gloo build moves bf16)."""
        if self.backend == "gloo" and out.dim() == 2 and out.element_size() == 2:
            o, i = out.view(torch.uint8), inp.contiguous().view(torch.uint8)
        else:
            o, i = out, inp.contiguous()
        if self.stage_on_host:
            o_h = o.cpu()
            self.dist.all_to_all_single(o_h, i.cpu(), out_splits, in_splits, group=self.group)
            o.copy_(o_h)
        else:
            self.dist.all_to_all_single(o, i, out_splits, in_splits, group=self.group)

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def make_inputs(dims, tokens: int, rank: int, world: int, device, dtype, seed: int = 0):
    """Rank `rank`'s tokens, routing (`xstage.bench.moe.routing` seeded per rank) and local experts.

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

    def __init__(self, shape: str, tokens: int, grp: PeerGroup, cfg, dtype, seed: int = 0):
        from xstage.moe import transform_weights

        self.name = shape
        self.H, self.I, self.E, self.K = dims = shape_dims(shape)
        self.T, self.ep, self.cfg = tokens, grp.world, cfg
        if self.E % grp.world:
            raise InputError(f"shape {shape}: {self.E} experts do not split over {grp.world} ranks")
        self.x, self.idx, self.w, self.l1, self.l2 = make_inputs(dims, tokens, grp.rank, grp.world, grp.device,
                                                                 dtype, seed)
        self.w1t, self.w2 = transform_weights(self.l1, self.l2, cfg.block_n1)
        self.rows = tokens * self.K  # rows per rank on average: every rank's T*K pairs, computed once each
        self.buf = None

    def attach(self, grp: PeerGroup) -> None:
        """Allocate the symmetric buffers (collective) and stage this rank's tokens and routing."""
        from xstage.moe import MoEBuffer

        self.buf = MoEBuffer(self.T, self.E, self.K, self.H, self.I, grp.group, device=grp.device,
                             dtype=self.x.dtype, config=self.cfg)
        self.buf.x_buf[: self.T].copy_(self.x)
        self.buf.idx_buf.fill_(-1)
        self.buf.idx_buf[: self.T].copy_(self.idx)
        grp.barrier()  # peers pull these rows and read this routing from here on

    def flops(self) -> float:
        return 6.0 * self.rows * self.H * self.I

    def close(self) -> None:
        if self.buf is not None:
            self.buf.ctx.close()
            self.buf = None


def _median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def time_fused_peer(pb: PeerProblem, grp: PeerGroup, p, warmup: int, rep: int):
    """Main kernel timing (median, p10, p90 ns), reduce median ns of a planned schedule, and the first
    run's output."""
    from xstage.moe.fused import launch_main, launch_reduce

    y0 = torch.empty_like(pb.x)
    pb.buf.combine.fill_(float("nan"))  # a combine row no peer stored shows up as NaN in y0
    for i in range(1 + warmup):
        grp.barrier()
        launch_main(pb.x, pb.w1t, pb.w2, pb.buf, p)
        launch_reduce(pb.idx, pb.w, y0 if i == 0 else torch.empty_like(pb.x), pb.buf)
        if i == 0:
            _sync()
            pb.buf.check()
    main, red = time_main_and_reduce(pb, p, torch.empty_like(pb.x), rep, before_each=grp.barrier)
    return main, red, y0


class PeerUnfused:
    """The serial expert-parallel pipeline on the same routing (module docstring): NCCL all_to_all
    dispatch, grouped GEMMs around SwiGLU, all_to_all combine, weighted top-k sum."""

    def __init__(self, pb: PeerProblem, grp: PeerGroup):
        self.pb, self.grp = pb, grp
        R, K, el = grp.world, pb.K, pb.E // grp.world
        idx = pb.idx.long()
        owner = (idx // el).reshape(-1)
        self.order = torch.argsort(owner, stable=True)  # (token, slot) pairs grouped by destination rank
        self.send_t = self.order // K
        send_exp = (idx.reshape(-1)[self.order] % el).contiguous()
        send_counts = torch.bincount(owner, minlength=R)
        recv_counts = torch.empty_like(send_counts)
        grp.all_to_all(recv_counts, send_counts)
        self.sc, self.rc = send_counts.tolist(), recv_counts.tolist()
        recv_exp = send_exp.new_empty(sum(self.rc))
        grp.all_to_all(recv_exp, send_exp, self.rc, self.sc)
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
        self.grp.all_to_all(self.recv, self.send, self.rc, self.sc)
        a = self.recv[self.perm]
        h = _grouped_mm(a, pb.l1, self.offs)
        act = torch.nn.functional.silu(h[:, : pb.I]) * h[:, pb.I:]
        self.out[self.perm] = _grouped_mm(act, pb.l2, self.offs)
        self.grp.all_to_all(self.back, self.out, self.sc, self.rc)
        self.comb[self.order] = self.back

    def reduce(self) -> torch.Tensor:
        pb = self.pb
        y = (self.comb.view(pb.T, pb.K, pb.H).float() * pb.w[:, :, None]).sum(1)
        return y.to(pb.x.dtype)

    def time(self, warmup: int, rep: int):
        """Medians (ns) of the exchange + compute part and of the reduce, and the first output."""
        self.grp.barrier()
        self.exchange_and_compute()
        y0 = self.reduce()
        for _ in range(warmup):
            self.grp.barrier()
            self.exchange_and_compute()
            self.reduce()
        a, b, c = _events(rep), _events(rep), _events(rep)
        for i in range(rep):
            self.grp.barrier()
            a[i].record()
            self.exchange_and_compute()
            b[i].record()
            self.reduce()
            c[i].record()
        _sync()
        main = _median([a[i].elapsed_time(b[i]) * 1e6 for i in range(rep)])
        red = _median([b[i].elapsed_time(c[i]) * 1e6 for i in range(rep)])
        return main, red, y0


def _tolerance(dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def run_peer_config(c: dict, grp: PeerGroup, schedules, writer: ResultWriter | None, warmup: int, rep: int,
                    dtype, block: str | None = None, cfg=None, dump: dict | None = None, log=print) -> list[dict]:
    """Measure one configuration on every rank; rank 0 writes the rows. [] when it could not be built.

    Building the inputs and planning each schedule end in an agreement across ranks, so a failure
    there (memory, a schedule the planner cannot resolve) skips the configuration or schedule on
    every rank; a failure while measuring raises (the launcher then stops every rank)."""
    from xstage.moe.fused import plan

    shape, T = c["shape"], int(c["tokens"])
    H, I, E, K = shape_dims(shape)
    pb, err = None, ""
    try:
        cfg = cfg or block_for((H, I, E, K), T, grp.world, block)
        pb = PeerProblem(shape, T, grp, cfg, dtype)
    except (InputError, RuntimeError) as exc:  # RuntimeError: out of device memory
        err = f"{type(exc).__name__}: {exc}"
    if not grp.all_ok(pb is not None):
        log(f"{shape} T={T}: skipped on every rank ({err or 'failed on another rank'})")
        return []
    pb.attach(grp)
    base = dict(shape=shape, H=H, I=I, E=E, K=K, tokens=T, ep=grp.world, path=PATH, rows=pb.rows,
                block=f"{cfg.block_m}x{cfg.block_n1}x{cfg.block_n2}x{cfg.block_k}")
    measured, outs = [], {}
    for s in schedules:
        p, err = None, ""
        try:
            schedule, _, pace = s.partition("@")  # SCHEDULE[@PACING], as in `xstage bench moe`
            pb.buf.pacing = parse_pacing(pace, pb.buf.store_path) if pace else "auto"
            p = plan(pb.idx, pb.buf, schedule)
        except (InputError, RuntimeError, ValueError) as exc:
            err = f"{type(exc).__name__}: {exc}"
        if not grp.all_ok(p is not None):
            log(f"{shape} T={T} {s}: skipped on every rank ({err or 'failed on another rank'})")
            continue
        main, red, y0 = time_fused_peer(pb, grp, p, warmup, rep)
        outs[s] = y0
        measured.append((s, main, red, p.schedule.num_ctas))
    un = PeerUnfused(pb, grp)
    u_main, u_red, y_un = un.time(warmup, rep)
    scale = float(y_un.float().abs().max()) or 1.0
    errs = [float((outs[s].float() - y_un.float()).abs().max()) / scale for s, *_ in measured]
    same = all(torch.equal(outs[s], outs[measured[0][0]]) for s, *_ in measured)
    if dump is not None:
        dump.update({(shape, T, s): y.cpu() for s, y in outs.items()})
        dump[(shape, T, "unfused")] = y_un.cpu()
    flat = [v for _, m, r, _ in measured for v in (m.median_ns, m.p10_ns, m.p90_ns, r)]
    flat = grp.max_all(flat + [u_main, u_red] + errs + [0.0 if same else 1.0])  # the slowest rank counts
    n = len(measured)
    rows = []
    for i, (s, _, _, ctas) in enumerate(measured):
        med, p10, p90, red = flat[4 * i: 4 * i + 4]
        rows.append(dict(base, variant=s, time_ns=med, time_p10_ns=p10, time_p90_ns=p90, reduce_ns=red, ctas=ctas,
                         max_err=flat[4 * n + 2 + i]))
    rows.append(dict(base, variant="unfused", time_ns=flat[4 * n], reduce_ns=flat[4 * n + 1], ctas="", max_err=""))
    ew = next((r["time_ns"] for r in rows if r["variant"] == "expert_wave"), None)
    for r in rows:
        r["tflops"] = pb.flops() / r["time_ns"] / 1e3
        r["speedup"] = ew / r["time_ns"] if ew else ""
    tol = _tolerance(dtype)
    if writer is not None:
        writer.write_many(rows)
    for r in rows:
        ok = r["max_err"] == "" or r["max_err"] <= tol
        log(f"{shape} T={T} EP={grp.world} {r['variant']:>12}: {r['time_ns'] / 1e3:9.1f} us "
            f"(+{r['reduce_ns'] / 1e3:.1f} reduce) {r['tflops']:6.1f} TFLOP/s speedup "
            f"{'' if r['speedup'] == '' else round(r['speedup'], 3)} err {r['max_err']}{'' if ok else ' FAIL'}")
    if flat[-1]:
        log(f"{shape} T={T}: schedules gave outputs that are not bitwise equal on some rank")
    pb.close()
    return rows


def run_peer_grid(out_dir, grp: PeerGroup, only=None, schedules=DIST_SCHEDULES, warmup=3, rep=10, budget_s=None,
                  block=None, dtype=None, tiny=False, dump=False, log=print) -> int:
    """Every selected configuration, resumable from `out_dir/moe.csv`; returns configurations measured."""
    out = Path(out_dir)
    dtype = dtype or (torch.bfloat16 if grp.device.type == "cuda" else torch.float32)
    writer = ResultWriter(out / "moe.csv", COLUMNS, KEYS) if grp.rank == 0 else None
    cfg = None
    if tiny:
        from xstage.moe import BlockConfig

        cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)
    outputs: dict | None = {} if dump else None
    t0, measured = time.time(), 0
    for c in select(peer_configs(grp.world, tiny), only):
        decision = None
        if grp.rank == 0:
            if budget_s is not None and time.time() - t0 > budget_s:
                decision = "stop"
            else:
                decision = "skip" if writer.done(dict(c, path=PATH, variant="unfused")) else "run"
        decision = grp.from_rank0(decision)
        if decision == "stop":
            log("time budget reached; rerun to continue")
            break
        if decision == "skip":
            continue
        try:
            rows = run_peer_config(c, grp, schedules, writer, warmup, rep, dtype, block=block, cfg=cfg,
                                   dump=outputs, log=log)
        except Exception as exc:
            raise XstageError(f"rank {grp.rank}, configuration {c}: {type(exc).__name__}: {exc}") from exc
        measured += bool(rows)
        gc.collect()
        if grp.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(grp.device)
            log(f"device memory free after the configuration: {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
    if outputs is not None:
        torch.save(outputs, out / f"outputs-rank{grp.rank}.pt")
    grp.barrier()
    if grp.rank == 0 and (out / "moe.csv").exists():
        summarize(out, SUMMARY_TITLE, SUMMARY_INTRO)
    return measured


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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m xstage.bench.moe_dist",
                                 description="MoE grid on a real EP group (run under torchrun, one process per rank)")
    ap.add_argument("-o", "--out", required=True, help="output folder (moe.csv, summary.md); resumable")
    ap.add_argument("--only", action="append", metavar="KEY=V1,V2", help="run only matching configurations")
    ap.add_argument("--schedules", default=",".join(DIST_SCHEDULES), help="comma-separated schedule names")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting configurations after this")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs per variant")
    ap.add_argument("--rep", type=int, default=10, help="timed runs per variant (median reported)")
    ap.add_argument("--block", default=None, help="large-tile block BM:BN1:BN2:BK:WARPS:STAGES")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                    help="default: nccl when every rank has its own GPU, else gloo")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="default: bfloat16 on GPUs, float32 on the CPU")
    ap.add_argument("--summarize-only", action="store_true",
                    help="rewrite summary.md from moe.csv, print one line per configuration")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dump-outputs", action="store_true", help=argparse.SUPPRESS)
    return ap


def _print_now(msg: str) -> None:
    print(msg, flush=True)


def _quiet(msg: str) -> None:
    pass


def main(argv=None) -> int:
    set_multicast_off()
    args = _parser().parse_args(argv)
    if args.warmup < 0 or args.rep < 1:
        raise InputError(f"--warmup {args.warmup} / --rep {args.rep}: need warmup >= 0 and rep >= 1")
    if args.summarize_only:
        summarize(args.out, SUMMARY_TITLE, SUMMARY_INTRO)
        print(table(args.out))
        return 0
    grp = PeerGroup(args.backend)
    log = _print_now if grp.rank == 0 else _quiet
    try:
        log(f"world {grp.world}, backend {grp.backend}, device {grp.device}")
        run_peer_grid(args.out, grp, args.only, tuple(args.schedules.split(",")), args.warmup, args.rep,
                      args.budget_s, args.block, getattr(torch, args.dtype) if args.dtype else None, args.tiny,
                      args.dump_outputs, log=log)
        log(table(args.out))
    except BaseException:
        # The other ranks may sit in a collective: leave at once, without the group's shutdown
        # handshake, so that the launcher stops them (rows already written stay in moe.csv).
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    grp.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
