"""Ulysses attention on a real group of ranks (one process per rank, torchrun): fused vs serial.

Problem: the loopback grid (`xstage.bench.ulysses`) plays one rank on one GPU; on a multi-GPU node
every rank runs its own kernel and the fused epilogue stores land in the peers' memory over NVLink.
How much does the fused exchange save there, per shape, against the serial all-to-all?

Every rank holds its tokens of q, k, v `[1, S_local, H, D]` (bf16; the sequence split of
`layout.split_sizes`, the first `S % P` ranks one token more) and, per configuration (heads x dim,
total tokens; P = the world size), times:
- `pre_alltoall`: the pre-attention all-to-all alone (pack, `all_to_all_single`, views);
- `attention`: the Triton kernel alone on this rank's post-all-to-all shard (its heads, whole sequence);
- `serial_triton`: `ulysses_attention(mode="serial")`: all-to-all, kernel, all-to-all back;
- `serial_cudnn`: all-to-all, cuDNN SDPA (torch) on the gathered layout, all-to-all back;
- `fused`: `ulysses_attention(mode="fused")` on a `peer` context; receiver-visible = the whole call,
  sender-visible = all-to-all + the kernel (the same steps, the counter wait after the mark). The
  kernel's default exchange (`epilogue` column); `--burst` stores whole tiles instead (own folder).
The pre-attention all-to-all is inside every end-to-end variant (`serial_*`, `fused`) and outside
`attention`. Before each timed run the ranks synchronise (device, host barrier, then a one-element
all-reduce that every stream leaves at the same time, then a short device sleep that covers the
host's launches); per run the slowest rank's time counts, and rows give the median over runs.
The first fused and serial outputs are compared on every rank (`rel_err` = max |fused - serial| /
max |serial|; `exchange_ok` = 1 when <= 1e-2 on every rank; the `serial_cudnn` row compares cuDNN's
output with serial Triton's the same way). `tflops` = rank 0's attention work / sender-visible time;
`host_bound_runs` counts timed runs whose start the device reached before the host had launched
everything (their time includes launch overhead; expected 0).

Ranks with their own GPUs use NCCL; ranks sharing one GPU (or none: the CPU interpreter) use gloo,
for correctness only. Rank 0 writes `ulysses_peer.csv` (columns of the loopback CSV, `path` =
"peer", `rank` = 0 and rank 0's share: times are the maximum over ranks), resumable, and
`summary.md`.

Example (a node with 2 GPUs; `--only` slices the grid, `--budget-s` stops starting configurations):
    torchrun --nproc-per-node 2 -m xstage.bench.ulysses_dist -o out/ulysses-peer --budget-s 120
    python3 -m xstage.bench.ulysses_dist -o out/ulysses-peer --report-only
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from xstage.bench.grid import select
from xstage.bench.results import ResultWriter, read_rows
from xstage.bench.ulysses import COLUMNS as LOOPBACK_COLUMNS
from xstage.bench.ulysses import GRID_SHAPES, GRID_TOKENS, KEY_COLUMNS, attention_flops
from xstage.errors import InputError

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PATH = "peer"
CSV_NAME = "ulysses_peer.csv"
VARIANTS = ("pre_alltoall", "attention", "serial_triton", "serial_cudnn", "fused")
COLUMNS = LOOPBACK_COLUMNS + ["rel_err", "ref_err", "host_bound_runs", "backend", "dtype", "epilogue"]
TINY_SHAPES = ((5, 32), (4, 16))
TINY_TOKENS = (67, 40)
AGREE_TOL = 1e-2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# cycles of the device sleep before each timed run (~2 ms at the H200's 1.98 GHz): the host
# enqueues the run meanwhile, so its launch overhead stays out of the measurement
SLEEP_CYCLES = 4_000_000


@dataclass
class Ranks:
    """This process's place in the group."""

    rank: int
    world: int
    device: torch.device
    backend: str
    group: object

    @property
    def nccl(self) -> bool:
        return self.backend == "nccl"


def grid_configs(world: int, tiny: bool = False) -> list[dict]:
    """Short sequences first, so that a run cut short still covers every shape."""
    shapes, tokens = (TINY_SHAPES, TINY_TOKENS) if tiny else (GRID_SHAPES, GRID_TOKENS)
    return [{"heads": h, "dim": d, "tokens": t, "P": world} for t in tokens for (h, d) in shapes]


def init_ranks() -> Ranks:
    """Join the torchrun group: NCCL when every local rank has its own GPU, else gloo."""
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise InputError("ulysses_dist: start one process per rank with torchrun (RANK is not set)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpu >= local_world:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        backend = "nccl"
    else:
        if n_gpu:
            # NCCL refuses two ranks on one GPU; symmetric memory needs this to map them
            os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
            device = torch.device("cuda", local % n_gpu)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group("gloo")
        backend = "gloo"
    return Ranks(dist.get_rank(), dist.get_world_size(), device, backend, dist.group.WORLD)


def _sync_start(g: Ranks, token: torch.Tensor) -> None:
    """Start every rank's next run together: device idle, host barrier, then (NCCL) a one-element
    all-reduce that all streams leave at once, followed by a device sleep of equal length."""
    import torch.distributed as dist

    if g.device.type == "cuda":
        torch.cuda.synchronize(g.device)
    dist.barrier(group=g.group)
    if g.nccl:
        dist.all_reduce(token, group=g.group)
    if g.device.type == "cuda":
        torch.cuda._sleep(SLEEP_CYCLES)


def _max_over_ranks(g: Ranks, values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=g.device if g.nccl else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g.group)
    return t.tolist()


@dataclass(frozen=True)
class RunTimes:
    """Median and spread (ns) over runs of the slowest rank; `mid` = the run's mark (sender-visible)."""

    median_ns: float
    p10_ns: float
    p90_ns: float
    mid_ns: float
    host_bound: int


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    """Median, 10th and 90th percentile."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=10)
    return statistics.median(xs), q[0], q[-1]


def time_runs(g: Ranks, fn, *, warmup: int, rep: int) -> RunTimes:
    """`fn(mark)` `warmup` + `rep` times, every run started together on all ranks; `mark()` may be
    called once inside `fn` to time a prefix (the fused sender-visible part)."""
    token = torch.zeros(1, device=g.device if g.nccl else "cpu")
    cuda = g.device.type == "cuda"
    totals, mids, host_bound = [], [], 0
    marked = False
    for i in range(warmup + rep):
        _sync_start(g, token)
        hit = []
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
            fn(lambda ev=ev, hit=hit: (ev[1].record(), hit.append(1)))
            ev[2].record()
            # the start had already passed when the host finished launching: launch time counted
            late = ev[0].query()
            torch.cuda.synchronize(g.device)
            total = ev[0].elapsed_time(ev[2]) * 1e6
            mid = ev[0].elapsed_time(ev[1]) * 1e6 if hit else 0.0
        else:
            t0 = time.perf_counter_ns()
            fn(lambda hit=hit: hit.append(time.perf_counter_ns()))
            total = float(time.perf_counter_ns() - t0)
            mid = float(hit[0] - t0) if hit else 0.0
            late = False
        if i >= warmup:
            host_bound += int(late)
            totals.append(total)
            mids.append(mid)
            marked = bool(hit)
    n = len(totals)
    red = _max_over_ranks(g, totals + mids + [float(host_bound)])
    med, p10, p90 = _quantiles(red[:n])
    mid = _quantiles(red[n:2 * n])[0] if marked else float("nan")
    return RunTimes(med, p10, p90, mid, int(red[-1]))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    return err if math.isfinite(err) else float("inf")


def _sdpa_gathered(qg, kg, vg, cudnn: bool) -> torch.Tensor:
    """SDPA on the gathered `[B, S, h, D]` views; returns `[B, h, S, D]`. cuDNN on a GPU (the CPU
    interpreter runs use torch's default CPU backend)."""
    import torch.nn.functional as F

    args = (qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2))
    if not cudnn:
        return F.scaled_dot_product_attention(*args)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(*args)


def pre_alltoall(plan, q, k, v, group):
    """The library's pre-attention all-to-all (`layout.py`): q, k, v views `[B, S, h_r, D]`."""
    import torch.distributed as dist

    from xstage.attention.layout import pack_qkv, unpack_qkv

    send = pack_qkv(plan, q, k, v)
    recv = torch.empty(sum(plan.qkv_recv_splits()), dtype=q.dtype, device=q.device)
    dist.all_to_all_single(recv, send, plan.qkv_recv_splits(), plan.qkv_send_splits(), group=group)
    return unpack_qkv(plan, recv)


def post_alltoall(plan, o_hsd: torch.Tensor, like: torch.Tensor, group) -> torch.Tensor:
    """Attention output `[B, h_r, S, D]` back to the token owners: `[B, S_local, H, D]`."""
    import torch.distributed as dist

    from xstage.attention.layout import unpack_out

    send = o_hsd.permute(2, 0, 1, 3).contiguous().view(-1)  # [S, B, h_r, D]: chunk p = p's rows
    recv = torch.empty(sum(plan.out_recv_splits()), dtype=like.dtype, device=like.device)
    dist.all_to_all_single(recv, send, plan.out_recv_splits(), plan.out_send_splits(), group=group)
    return unpack_out(plan, recv, torch.empty_like(like))


def measure_config(cfg: dict, g: Ranks, ctx, *, dtype, warmup: int, rep: int, reference: bool,
                   burst: bool = False) -> list[dict]:
    """Rows (identical on every rank) for every variant of one configuration; `burst`: the fused rows
    store whole tiles in the epilogue instead of the kernel's default (paced) exchange."""
    import dataclasses

    import torch.distributed as dist

    from xstage.attention import ulysses_attention
    from xstage.attention.flash import default_config, flash_attention
    from xstage.attention.layout import UlyssesPlan, empty_gathered_out, split_sizes
    from xstage.attention.ulysses import fused_state, run_fused, wait_fused

    H, D, T, P = cfg["heads"], cfg["dim"], cfg["tokens"], cfg["P"]
    if P != g.world:
        raise InputError(f"P={P}: must equal the number of ranks {g.world}")
    seq = split_sizes(T, P)
    plan = UlyssesPlan(P, g.rank, 1, seq, H, D)
    dev = g.device
    gen = torch.Generator(device=dev).manual_seed(1000 + g.rank)
    q, k, v = (torch.randn(1, seq[g.rank], H, D, generator=gen, device=dev, dtype=dtype) for _ in range(3))
    fc = default_config(D, dtype, dev)
    state = fused_state(ctx, plan, dtype, fc.block_m)
    if burst and getattr(state.exchange, "paced", False):
        # the cached state is the one ulysses_attention uses: its calls take the burst epilogue too
        state.exchange = dataclasses.replace(state.exchange, paced=False)
    h0 = plan.heads_of(0)
    tiles = h0 * math.ceil(T / fc.block_m)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
    grid = tiles if fc.ctas_per_sm <= 0 or not sms else min(tiles, sms * fc.ctas_per_sm)
    flops = attention_flops(1, T, T, h0, D)
    common = {**cfg, "path": PATH, "rank": 0, "rank_heads": h0, "block_m": fc.block_m, "block_n": fc.block_n,
              "num_warps": fc.num_warps, "num_stages": fc.num_stages, "grid": grid, "tiles": tiles,
              "tile_bytes": fc.block_m * D * dtype.itemsize, "remote_bytes": (T - seq[0]) * h0 * D * dtype.itemsize,
              "backend": g.backend, "dtype": str(dtype).removeprefix("torch."),
              "epilogue": "paced" if getattr(state.exchange, "paced", False) else "burst"}

    qg0, kg0, vg0 = pre_alltoall(plan, q, k, v, g.group)
    og = empty_gathered_out(plan, dtype, dev)

    def v_pre(mark):
        pre_alltoall(plan, q, k, v, g.group)

    def v_attention(mark):
        flash_attention(qg0, kg0, vg0, out=og, config=fc)

    def v_serial(mark):
        return ulysses_attention(q, k, v, g.group, mode="serial", seq_lens=seq, config=fc)

    def v_cudnn(mark):
        qg, kg, vg = pre_alltoall(plan, q, k, v, g.group)
        return post_alltoall(plan, _sdpa_gathered(qg, kg, vg, dev.type == "cuda"), q, g.group)

    def v_fused(mark):
        return ulysses_attention(q, k, v, comm=ctx, mode="fused", seq_lens=seq, config=fc, check=False)

    def v_fused_send(mark):
        qg, kg, vg = pre_alltoall(plan, q, k, v, g.group)
        run_fused(state, ctx, qg, kg, vg, config=fc, wait=False)
        mark()
        wait_fused(state, ctx)

    token = torch.zeros(1, device=dev if g.nccl else "cpu")
    # first runs: the outputs to compare (the fused output buffer starts as NaN, so a row that
    # nobody stored cannot pass)
    state.out.local.fill_(float("nan"))
    _sync_start(g, token)
    out_s = v_serial(None)
    _sync_start(g, token)
    out_f = v_fused(None).clone()
    ctx.check()
    errors: dict[str, str] = {}
    out_c = None
    try:
        _sync_start(g, token)
        out_c = v_cudnn(None)
    except RuntimeError as e:  # cuDNN may refuse a shape: the row says so instead of the grid dying
        errors["serial_cudnn"] = f"error: {str(e)[:80]}"
    refs = {}
    if reference:
        from xstage.attention.reference import ulysses_reference

        shards: list = [None] * P
        dist.all_gather_object(shards, [t.cpu() for t in (q, k, v)], group=g.group)
        want = ulysses_reference(*[[s[i] for s in shards] for i in range(3)])[g.rank]
        refs = {"serial_triton": _rel_err(out_s.cpu(), want), "fused": _rel_err(out_f.cpu(), want)}
        if out_c is not None:
            refs["serial_cudnn"] = _rel_err(out_c.cpu(), want)
    local_err = [_rel_err(out_f, out_s), _rel_err(out_c, out_s) if out_c is not None else float("inf")]
    names = sorted(refs)
    red = _max_over_ranks(g, local_err + [refs[n] for n in names])
    rel = {"fused": red[0], "serial_cudnn": red[1]}
    ref_err = dict(zip(names, red[2:]))
    del out_s, out_f, out_c

    fns = {"pre_alltoall": v_pre, "attention": v_attention, "serial_triton": v_serial, "serial_cudnn": v_cudnn}
    rows = []
    for variant in VARIANTS:
        row = {**common, "variant": variant}
        if variant in errors:
            rows.append({**row, "exchange_ok": errors[variant]})
            continue
        if variant == "fused":
            recv = time_runs(g, v_fused, warmup=warmup, rep=rep)
            send = time_runs(g, v_fused_send, warmup=warmup, rep=rep)
            ctx.check()
            sender = send.mid_ns
            host_bound = recv.host_bound + send.host_bound
        else:
            recv = time_runs(g, fns[variant], warmup=warmup, rep=rep)
            sender, host_bound = recv.median_ns, recv.host_bound
        row.update(sender_ns=sender, receiver_ns=recv.median_ns, p10_ns=recv.p10_ns, p90_ns=recv.p90_ns,
                   tflops=flops / sender / 1e3, host_bound_runs=host_bound)
        if variant in rel:
            row["rel_err"] = rel[variant]
            row["exchange_ok"] = int(rel[variant] <= AGREE_TOL)
        if variant in ref_err:
            row["ref_err"] = ref_err[variant]
        rows.append(row)
    return rows


def run_grid(out_dir, g: Ranks, *, only=None, tiny=False, dtype=torch.bfloat16, warmup=1, rep=7,
             budget_s=None, t_start=None, burst=False) -> int:
    """Measure every selected configuration not yet in `out_dir/ulysses_peer.csv` (all ranks call
    this; rank 0 decides what runs and writes). Returns the number of configurations measured."""
    import torch.distributed as dist

    from xstage.comm import create_context

    t_start = time.monotonic() if t_start is None else t_start
    writer = None
    if g.rank == 0:
        from xstage.env import environment

        writer = ResultWriter(Path(out_dir) / CSV_NAME, COLUMNS, KEY_COLUMNS, env=environment())
    todo = [None]
    if g.rank == 0:
        todo = [[c for c in select(grid_configs(g.world, tiny), only)
                 if not writer.done({**c, "path": PATH, "variant": VARIANTS[-1]})]]
    dist.broadcast_object_list(todo, src=0, group=g.group)
    todo = todo[0]
    if g.rank == 0 and not todo:
        print(f"ulysses_dist: every selected configuration is already in {writer.path}", flush=True)
    ctx = create_context(g.group, path=PATH, device=g.device)
    done = 0
    # the fewest seconds per attention FLOP so far: configurations that compiled kernels or are
    # dominated by fixed costs do not inflate the estimate of the large ones
    per_flop = None
    for cfg in todo:
        work = attention_flops(1, cfg["tokens"], cfg["tokens"], cfg["heads"], cfg["dim"])
        go = [True]
        if g.rank == 0 and budget_s is not None:
            elapsed = time.monotonic() - t_start
            estimate = per_flop * work if per_flop is not None else 0.0
            go = [elapsed + estimate <= budget_s]
            if not go[0]:
                print(f"ulysses_dist: stopping after {elapsed:.0f} s (budget {budget_s:.0f} s, next configuration "
                      f"~{estimate:.0f} s); run again to resume", flush=True)
        dist.broadcast_object_list(go, src=0, group=g.group)
        if not go[0]:
            break
        t0 = time.monotonic()
        rows = measure_config(cfg, g, ctx, dtype=dtype, warmup=warmup, rep=rep, reference=tiny, burst=burst)
        spent = (time.monotonic() - t0) / work
        per_flop = spent if per_flop is None else min(per_flop, spent)
        done += 1
        if g.rank == 0:
            for row in rows:
                if not writer.done(row):
                    writer.write(row)
            by = {r["variant"]: r for r in rows}
            f = by["fused"]
            print(f"H{cfg['heads']}xD{cfg['dim']} T={cfg['tokens']} P={cfg['P']}: "
                  + " ".join(f"{n}={by[n].get('receiver_ns', float('nan')) / 1e3:.1f}us" for n in VARIANTS)
                  + f" fused_send={f['sender_ns'] / 1e3:.1f}us rel_err={f['rel_err']:.1e} ok={f['exchange_ok']}"
                  + f" ({time.monotonic() - t0:.1f} s)", flush=True)
    ctx.barrier()
    return done


def _num(row, col) -> float:
    try:
        return float(row[col]) if row and row.get(col) not in (None, "") else float("nan")
    except ValueError:
        return float("nan")


def write_report(out_dir) -> Path:
    """`summary.md` from `ulysses_peer.csv`: times per variant and the ratios per configuration."""
    from xstage.bench.report import markdown_table

    out = Path(out_dir)
    if not (out / CSV_NAME).exists():
        raise InputError(f"--out {out}: has no {CSV_NAME}; run the grid first")
    rows = read_rows(out / CSV_NAME)
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["heads"], r["dim"], r["tokens"], r["P"]), {})[r["variant"]] = r
    table = []
    for (H, D, T, P), v in sorted(by_key.items(), key=lambda kv: tuple(int(x) for x in kv[0])):
        f = v.get("fused")
        if not f:
            continue
        pre, at, st, ct = (_num(v.get(n), "receiver_ns") for n in ("pre_alltoall", "attention", "serial_triton",
                                                                    "serial_cudnn"))
        fs, fr = _num(f, "sender_ns"), _num(f, "receiver_ns")
        table.append({"heads x dim": f"{H}x{D}", "tokens": int(T), "P": int(P), "pre_a2a_us": pre / 1e3,
                      "attn_us": at / 1e3, "serial_us": st / 1e3, "serial_cudnn_us": ct / 1e3,
                      "fused_send_us": fs / 1e3, "fused_us": fr / 1e3, "serial/fused": st / fr,
                      "serial_cudnn/fused": ct / fr, "fused/attn": fr / at,
                      "post_exposed_us": (fr - pre - at) / 1e3, "rel_err": _num(f, "rel_err"),
                      "ok": f.get("exchange_ok", "")})
    lines = ["# Ulysses attention on a real group: fused exchange vs serial (one process per GPU)", ""]
    if rows:
        env = rows[0]
        lines += [f"Machine: {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, triton "
                  f"{env.get('triton')}, process group {env.get('backend')}, {env.get('dtype')}, "
                  f"{env.get('epilogue')} fused epilogue, "
                  f"commit {env.get('git_commit')}, {env.get('date')}.", ""]
    lines += ["Every rank holds `[1, S/P, H, D]` q, k, v; times are "
              "medians over runs of the slowest rank, each run started together on all ranks. "
              "`pre_a2a`: the pre-attention all-to-all alone; `attn`: the Triton kernel alone on the "
              "post-all-to-all shard; `serial`, `serial_cudnn`, `fused`: end to end, pre-attention "
              "all-to-all included (cuDNN: torch SDPA then the all-to-all back); `fused_send`: "
              "all-to-all + fused kernel, without the wait for the peers' tiles; `post_exposed` = fused - "
              "pre_a2a - attn: what the fused output exchange still costs. `rel_err`: max |fused - "
              "serial| / max |serial| over ranks; `ok` = rel_err <= 1e-2.", ""]
    lines.append(markdown_table(table, list(table[0]) if table else ["tokens"], floatfmt=".3g"))
    lines.append("")
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m xstage.bench.ulysses_dist",
                                description="Ulysses attention, fused vs serial, on a torchrun group")
    p.add_argument("-o", "--out", required=True, help="output folder (ulysses_peer.csv, summary.md); resumable")
    p.add_argument("--only", action="append", metavar="KEY=V1,V2", help="run only matching configurations")
    p.add_argument("--budget-s", type=float, default=None,
                   help="do not start a configuration that would end after this many seconds")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per variant")
    p.add_argument("--rep", type=int, default=7, help="timed runs per variant (median reported)")
    p.add_argument("--burst", action="store_true",
                   help="fused rows with the burst epilogue (whole tiles at once); write to their own folder")
    p.add_argument("--report-only", action="store_true", help="only rewrite summary.md (no torchrun needed)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    os.environ.update(MULTICAST_OFF)
    t_start = time.monotonic()
    args = build_parser().parse_args(argv)
    if args.warmup < 0 or args.rep < 1:
        raise InputError(f"--warmup {args.warmup}, --rep {args.rep}: need warmup >= 0 and rep >= 1")
    if args.report_only:
        print(write_report(args.out).read_text())
        return 0
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = DTYPES[args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")]
    g = init_ranks()
    import torch.distributed as dist

    try:
        if g.rank == 0:
            print(f"ulysses_dist: {g.world} ranks, {g.backend}, {g.device}, {dtype}", flush=True)
        run_grid(args.out, g, only=args.only, tiny=args.tiny, dtype=dtype, warmup=args.warmup, rep=args.rep,
                 budget_s=args.budget_s, t_start=t_start, burst=args.burst)
        if g.rank == 0:
            print(write_report(args.out).read_text(), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
