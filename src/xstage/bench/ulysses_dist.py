"""Ulysses attention on a real group of ranks (one process per rank, torchrun): fused vs serial.

Problem: the loopback grid (`xstage.bench.ulysses`) plays one rank on one GPU; on a multi-GPU node
every rank runs its own kernel and the fused epilogue stores land in the peers' memory over NVLink.
How much does the fused exchange save there, per shape, against the serial all-to-all?

Every rank holds its tokens of q, k, v `[1, S_local, H, D]` (`--dtype`, default bf16 on GPUs; the
sequence split of `layout.split_sizes`, the first `S % P` ranks one token more) and, per
configuration (heads x dim, total tokens; P = the world size), times:
- `pre_alltoall`: the pre-attention all-to-all alone (pack, `all_to_all_single`, views);
- `attention`: the Triton kernel alone on this rank's post-all-to-all shard (its heads, whole sequence);
- `serial_triton`: `ulysses_attention(exchange="serial")`: all-to-all, kernel, all-to-all back;
- `serial_cudnn`: all-to-all, cuDNN SDPA (torch) on the gathered layout, all-to-all back;
- `fused`: `ulysses_attention(exchange=X)` on a `peer` context with `--exchange X` (default
  `stores:paced`; the `exchange` column names it; another exchange belongs in its own folder);
  receiver-visible = the whole call, sender-visible = all-to-all + the kernel for the in-kernel
  exchanges (the same steps, the counter wait after the mark), the whole call for the others.
The pre-attention all-to-all is inside every end-to-end variant (`serial_*`, `fused`) and outside
`attention`. Before each timed run the ranks synchronise (`xstage.bench.runtime`: device, host
barrier, then a one-element all-reduce that every stream leaves at the same time, then a short device
sleep that covers the host's launches); per run the slowest rank's time counts, and rows give the
median, p10 and p90 over runs (`xstage.results.timing_summary`).
The first fused and serial outputs are compared on every rank (`rel_err` = max |fused - serial| /
max |serial|; `exchange_ok` = 1 when <= 1e-2 on every rank; the `serial_cudnn` row compares cuDNN's
output with serial Triton's the same way). `tflops` = rank 0's attention work / sender-visible time;
`host_bound_runs` counts timed runs whose start the device reached before the host had launched
everything (their time includes launch overhead; expected 0).

The process group and NVLink multicast follow `xstage.bench.runtime` (NCCL when every rank has its
own GPU; gloo when ranks share one, or on the CPU interpreter: correctness only). Rank 0 writes
`ulysses_peer.csv` (columns of the loopback CSV, `path` = "peer", `rank` = 0 and rank 0's share:
times are the maximum over ranks; `dtype` bf16, fp16 or fp32), resumable, and `summary.md`.

Example (a node with 2 GPUs; `--only` slices the grid, `--budget-s` stops starting configurations):
    torchrun --nproc-per-node 2 -m xstage.bench.ulysses_dist -o out/ulysses-peer --budget-s 120
    python3 -m xstage.bench.ulysses_dist -o out/ulysses-peer --summarize-only
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from xstage.attention import ulysses_attention
from xstage.attention.flash import default_config, flash_attention
from xstage.attention.layout import empty_gathered_out, pack_qkv, unpack_out, unpack_qkv
from xstage.attention.reference import ulysses_reference
from xstage.attention.ulysses import fused_state, run_fused, wait_fused
from xstage.bench.runtime import Runtime
from xstage.bench.ulysses import GRID_SHAPES, GRID_TOKENS, KEY_COLUMNS, attention_flops
from xstage.comm import create_context
from xstage.dtypes import dtype_name
from xstage.errors import InputError
from xstage.results import ResultWriter, Timing, events, markdown_table, read_rows, select, synchronize
from xstage.spec.exchange import parse_exchange
from xstage.spec.ulysses import UlyssesPlan, split_sizes

PATH = "peer"
CSV_NAME = "ulysses_peer.csv"
VARIANTS = ("pre_alltoall", "attention", "serial_triton", "serial_cudnn", "fused")
COLUMNS = KEY_COLUMNS + ["rank", "rank_heads", "block_m", "block_n", "num_warps", "num_stages", "grid", "tiles",
                         "tile_bytes", "remote_bytes", "sender_ns", "receiver_ns", "p10_ns", "p90_ns", "tflops",
                         "exchange_ok", "rel_err", "ref_err", "host_bound_runs", "backend", "dtype", "exchange"]
TINY_SHAPES = ((5, 32), (4, 16))
TINY_TOKENS = (67, 40)
AGREE_TOL = 1e-2


def grid_configs(world: int, tiny: bool = False) -> list[dict]:
    """Short sequences first, so that a run cut short still covers every shape."""
    shapes, tokens = (TINY_SHAPES, TINY_TOKENS) if tiny else (GRID_SHAPES, GRID_TOKENS)
    return [{"heads": h, "dim": d, "tokens": t, "P": world} for t in tokens for (h, d) in shapes]


@dataclass(frozen=True)
class RunTimes:
    """Times of the slowest rank per run: the whole call (`total`), the run's mark (`mid_ns`, median;
    the fused sender-visible part; NaN without a mark) and the runs the host launched late."""

    total: Timing
    mid_ns: float
    host_bound: int


def time_runs(rt: Runtime, fn, *, warmup: int, rep: int) -> RunTimes:
    """`fn(mark)` `warmup` + `rep` times, every run started together on all ranks; `mark()` may be
    called once inside `fn` to time a prefix (the fused sender-visible part)."""
    cuda = rt.device.type == "cuda"
    totals, mids, host_bound = [], [], 0
    marked = False
    for i in range(warmup + rep):
        rt.sync_start()
        hit = []
        ev = events(3)
        ev[0].record()
        fn(lambda ev=ev, hit=hit: (ev[1].record(), hit.append(1)))
        ev[2].record()
        # the start had already passed when the host finished launching: launch time counted
        late = cuda and ev[0].query()
        synchronize()
        if i >= warmup:
            host_bound += int(late)
            totals.append(ev[0].elapsed_time(ev[2]) * 1e6)
            mids.append(ev[0].elapsed_time(ev[1]) * 1e6 if hit else 0.0)
            marked = bool(hit)
    total, mid = rt.timings(totals, mids)
    return RunTimes(total, mid.median_ns if marked else float("nan"), int(rt.max_over_ranks([host_bound])[0]))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    return err if math.isfinite(err) else float("inf")


def _sdpa_gathered(qg, kg, vg, cudnn: bool) -> torch.Tensor:
    """SDPA on the gathered `[B, S, h, D]` views; returns `[B, h, S, D]`. cuDNN on a GPU (the CPU
    interpreter runs use torch's default CPU backend)."""
    args = (qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2))
    if not cudnn:
        return F.scaled_dot_product_attention(*args)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(*args)


def pre_alltoall(plan, q, k, v, group):
    """The library's pre-attention all-to-all (`layout.py`): q, k, v views `[B, S, h_r, D]`."""
    send = pack_qkv(plan, q, k, v)
    recv = torch.empty(sum(plan.qkv_recv_splits()), dtype=q.dtype, device=q.device)
    dist.all_to_all_single(recv, send, plan.qkv_recv_splits(), plan.qkv_send_splits(), group=group)
    return unpack_qkv(plan, recv)


def post_alltoall(plan, o_hsd: torch.Tensor, like: torch.Tensor, group) -> torch.Tensor:
    """Attention output `[B, h_r, S, D]` back to the token owners: `[B, S_local, H, D]`."""
    send = o_hsd.permute(2, 0, 1, 3).contiguous().view(-1)  # [S, B, h_r, D]: chunk p = p's rows
    recv = torch.empty(sum(plan.out_recv_splits()), dtype=like.dtype, device=like.device)
    dist.all_to_all_single(recv, send, plan.out_recv_splits(), plan.out_send_splits(), group=group)
    return unpack_out(plan, recv, torch.empty_like(like))


def measure_config(cfg: dict, rt: Runtime, ctx, *, dtype, warmup: int, rep: int, reference: bool,
                   exchange: str = "stores:paced") -> list[dict]:
    """Rows (identical on every rank) for every variant of one configuration; `exchange`: what the
    `fused` rows run."""
    ex = parse_exchange(exchange)
    H, D, T, P = cfg["heads"], cfg["dim"], cfg["tokens"], cfg["P"]
    if P != rt.world:
        raise InputError(f"P={P}: must equal the number of ranks {rt.world}")
    seq = split_sizes(T, P)
    plan = UlyssesPlan(P, rt.rank, 1, seq, H, D)
    dev, group = rt.device, rt.group
    gen = torch.Generator(device=dev).manual_seed(1000 + rt.rank)
    q, k, v = (torch.randn(1, seq[rt.rank], H, D, generator=gen, device=dev, dtype=dtype) for _ in range(3))
    fc = default_config(D, dtype, dev)
    state = fused_state(ctx, plan, dtype, fc.block_m)
    h0 = plan.heads_of(0)
    tiles = h0 * math.ceil(T / fc.block_m)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
    grid = tiles if fc.ctas_per_sm <= 0 or not sms else min(tiles, sms * fc.ctas_per_sm)
    flops = attention_flops(1, T, T, h0, D)
    common = {**cfg, "path": PATH, "rank": 0, "rank_heads": h0, "block_m": fc.block_m, "block_n": fc.block_n,
              "num_warps": fc.num_warps, "num_stages": fc.num_stages, "grid": grid, "tiles": tiles,
              "tile_bytes": fc.block_m * D * dtype.itemsize, "remote_bytes": (T - seq[0]) * h0 * D * dtype.itemsize,
              "backend": rt.backend, "dtype": dtype_name(dtype),
              "exchange": str(ex)}

    qg0, kg0, vg0 = pre_alltoall(plan, q, k, v, group)
    og = empty_gathered_out(plan, dtype, dev)

    def v_pre(mark):
        pre_alltoall(plan, q, k, v, group)

    def v_attention(mark):
        flash_attention(qg0, kg0, vg0, out=og, config=fc)

    def v_serial(mark):
        # check=False: no input agreement (a host collective) inside the timed call, as for `fused`
        return ulysses_attention(q, k, v, group, exchange="serial", seq_lens=seq, config=fc, check=False)

    def v_cudnn(mark):
        qg, kg, vg = pre_alltoall(plan, q, k, v, group)
        return post_alltoall(plan, _sdpa_gathered(qg, kg, vg, dev.type == "cuda"), q, group)

    def v_fused(mark):
        return ulysses_attention(q, k, v, comm=ctx, exchange=ex, seq_lens=seq, config=fc, check=False)

    def v_fused_send(mark):
        if not ex.in_kernel:
            return v_fused(mark)
        qg, kg, vg = pre_alltoall(plan, q, k, v, group)
        run_fused(state, ctx, qg, kg, vg, config=fc, wait=False, exchange=ex)
        mark()
        wait_fused(state, ctx)

    # first runs: the outputs to compare (the fused output buffer starts as NaN, so a row that
    # nobody stored cannot pass)
    state.out.local.fill_(float("nan"))
    rt.sync_start()
    out_s = v_serial(None)
    rt.sync_start()
    out_f = v_fused(None).clone()
    ctx.check()
    errors: dict[str, str] = {}
    out_c = None
    try:
        rt.sync_start()
        out_c = v_cudnn(None)
    except RuntimeError as e:  # cuDNN may refuse a shape: the row says so instead of the grid dying
        errors["serial_cudnn"] = f"error: {str(e)[:80]}"
    refs = {}
    if reference:
        shards = rt.gather([t.cpu() for t in (q, k, v)])
        want = ulysses_reference(*[[s[i] for s in shards] for i in range(3)])[rt.rank]
        refs = {"serial_triton": _rel_err(out_s.cpu(), want), "fused": _rel_err(out_f.cpu(), want)}
        if out_c is not None:
            refs["serial_cudnn"] = _rel_err(out_c.cpu(), want)
    local_err = [_rel_err(out_f, out_s), _rel_err(out_c, out_s) if out_c is not None else float("inf")]
    names = sorted(refs)
    red = rt.max_over_ranks(local_err + [refs[n] for n in names])
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
            recv = time_runs(rt, v_fused, warmup=warmup, rep=rep)
            send = time_runs(rt, v_fused_send, warmup=warmup, rep=rep)
            ctx.check()
            sender = send.mid_ns
            host_bound = recv.host_bound + send.host_bound
        else:
            recv = time_runs(rt, fns[variant], warmup=warmup, rep=rep)
            sender, host_bound = recv.total.median_ns, recv.host_bound
        row.update(sender_ns=sender, receiver_ns=recv.total.median_ns, p10_ns=recv.total.p10_ns,
                   p90_ns=recv.total.p90_ns, tflops=flops / sender / 1e3, host_bound_runs=host_bound)
        if variant in rel:
            row["rel_err"] = rel[variant]
            row["exchange_ok"] = int(rel[variant] <= AGREE_TOL)
        if variant in ref_err:
            row["ref_err"] = ref_err[variant]
        rows.append(row)
    return rows


def run_grid(out_dir, rt: Runtime, *, only=None, tiny=False, dtype=torch.bfloat16, warmup=5, rep=30,
             budget_s=None, t_start=None, exchange="stores:paced") -> int:
    """Measure every selected configuration not yet in `out_dir/ulysses_peer.csv` (all ranks call
    this; rank 0 decides what runs and writes). Returns the number of configurations measured."""
    t_start = time.monotonic() if t_start is None else t_start
    writer = ResultWriter(Path(out_dir) / CSV_NAME, COLUMNS, KEY_COLUMNS, require_commit=True) if rt.rank == 0 else None
    todo = None
    if rt.rank == 0:
        todo = [c for c in select(grid_configs(rt.world, tiny), only)
                if not writer.done({**c, "path": PATH, "variant": VARIANTS[-1]})]
        if not todo:
            rt.log(f"ulysses_dist: every selected configuration is already in {writer.path}")
    todo = rt.from_rank0(todo)
    ctx = create_context(rt.group, path=PATH, device=rt.device)
    done = 0
    # the fewest seconds per attention FLOP so far: configurations that compiled kernels or are
    # dominated by fixed costs do not inflate the estimate of the large ones
    per_flop = None
    for cfg in todo:
        work = attention_flops(1, cfg["tokens"], cfg["tokens"], cfg["heads"], cfg["dim"])
        go = True
        if rt.rank == 0 and budget_s is not None:
            elapsed = time.monotonic() - t_start
            estimate = per_flop * work if per_flop is not None else 0.0
            go = elapsed + estimate <= budget_s
            if not go:
                rt.log(f"ulysses_dist: stopping after {elapsed:.0f} s (budget {budget_s:.0f} s, next configuration "
                       f"~{estimate:.0f} s); run again to resume")
        if not rt.from_rank0(go):
            break
        t0 = time.monotonic()
        rows = measure_config(cfg, rt, ctx, dtype=dtype, warmup=warmup, rep=rep, reference=tiny, exchange=exchange)
        spent = (time.monotonic() - t0) / work
        per_flop = spent if per_flop is None else min(per_flop, spent)
        done += 1
        if rt.rank == 0:
            for row in rows:
                if not writer.done(row):
                    writer.write(row)
            by = {r["variant"]: r for r in rows}
            f = by["fused"]
            rt.log(f"H{cfg['heads']}xD{cfg['dim']} T={cfg['tokens']} P={cfg['P']}: "
                   + " ".join(f"{n}={by[n].get('receiver_ns', float('nan')) / 1e3:.1f}us" for n in VARIANTS)
                   + f" fused_send={f['sender_ns'] / 1e3:.1f}us rel_err={f['rel_err']:.1e} ok={f['exchange_ok']}"
                   + f" ({time.monotonic() - t0:.1f} s)")
    ctx.barrier()
    return done


def _num(row, col) -> float:
    try:
        return float(row[col]) if row and row.get(col) not in (None, "") else float("nan")
    except ValueError:
        return float("nan")


def write_report(out_dir) -> Path:
    """`summary.md` from `ulysses_peer.csv`: times per variant and the ratios per configuration."""
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
                  f"fused rows: exchange {env.get('exchange')}, "
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


if __name__ == "__main__":
    # `python3 -m xstage.bench.ulysses_dist` (the results folders' commands): the parser lives in the CLI floor,
    # which this module does not import; run it by name.
    import runpy

    runpy.run_module("xstage.cli.ulysses_dist", run_name="__main__")
