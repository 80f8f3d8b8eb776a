"""Ranks of a fused MoE call under legal but hostile routings, and ranks that die: shared by
`test_robustness.py`. Each rank writes one JSON line per case: what it raised (or `ok`) and how long
the call took."""

import json
import os
import time

import torch
import torch.distributed as dist

from xstage.dtypes import parse_dtype
from xstage.errors import XstageError
from xstage.moe.fp8 import FP8, quantize_weights, reference_moe_fp8

# Routings, per rank `rank` of `world`, with E experts and top-K (distinct experts per token).
ROUTINGS = ("uniform", "top1", "skewed", "one_rank", "one_expert", "empty_rank", "topk_all")


def routing(kind: str, rank: int, world: int, T: int, E: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(1000 * seed + rank + 1)
    el = E // world
    if kind in ("uniform", "top1", "topk_all"):
        return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if kind == "skewed":  # 80% of tokens pick experts 0 and 1 among their K
        rows = []
        for _ in range(T):
            if float(torch.rand(1, generator=g)) < 0.8:
                rest = torch.randperm(E - 2, generator=g)[:K - 2] + 2
                rows.append(torch.cat([torch.tensor([0, 1]), rest]))
            else:
                rows.append(torch.randperm(E, generator=g)[:K])
        return torch.stack(rows)
    if kind == "one_rank":  # every token to rank 0's experts only
        return torch.stack([torch.randperm(el, generator=g)[:K] for _ in range(T)])
    if kind == "one_expert":  # every token to expert 0 (with top-1)
        return torch.zeros(T, K, dtype=torch.int64)
    if kind == "empty_rank":  # the last rank's experts get nothing
        return torch.stack([torch.randperm(E - el, generator=g)[:K] for _ in range(T)])
    raise ValueError(kind)


def _inputs(rank, world, T, H, I, E, K, kind, dtype, device):
    """Every rank holds the same local experts (expert e computes with local expert e % (E / world)).
    FP8: `l1`, `l2` are (e4m3, 128x128 scales) pairs and `x` is BF16."""
    gen = torch.Generator().manual_seed(1234)
    el = E // world
    l1 = torch.randn(el, 2 * I, H, generator=gen) / H**0.5
    l2 = torch.randn(el, H, I, generator=gen) / I**0.5
    if dtype == FP8:
        l1, l2 = (tuple(t.to(device) for t in quantize_weights(w)) for w in (l1, l2))
        dtype = torch.bfloat16
    else:
        l1, l2 = l1.to(dtype).to(device), l2.to(dtype).to(device)
    g = torch.Generator().manual_seed(rank + 7)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    idx = routing(kind, rank, world, T, E, K).to(device)
    w = torch.rand(idx.shape, generator=g).to(device)
    return x, idx, w / w.sum(1, keepdim=True), l1, l2


def worker(rank, world, init_file, result_file, case):
    """`case`: dict(shape=(H, I, E, K), tokens, routings, schedules, dtype, block, die=None|'before'|'during',
    buffer=dict of MoEBuffer keywords, buffer_tokens=its num_max_tokens_per_rank, check=fused_moe's check
    (default: its default), sync_check=True to call buf.check() after every call, final_check=True to call
    it after the last one, bad_input_rank=R and bad_input='expert_id'|'weights_dtype' for that rank's
    first call)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from xstage.moe import BlockConfig, MoEBuffer, fused_moe, reference_moe_dist, transform_weights

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = parse_dtype(case["dtype"], allowed=("bf16", "fp16", "fp32", "fp8"))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out = []
    H, I, E, K = case["shape"]
    T = case["tokens"] + rank - 1  # uneven token counts across ranks
    try:
        cfg = BlockConfig(**case["block"]) if case.get("block") else None
        buf = MoEBuffer(case.get("buffer_tokens", case["tokens"] + world), E, K, H, I, dist.group.WORLD,
                        device=device, dtype=dtype, config=cfg, **case.get("buffer", {}))
    except XstageError as exc:
        out.append({"case": "buffer", "error": f"{type(exc).__name__}: {exc}"})
        _write(result_file, rank, out)
        dist.destroy_process_group()
        return
    for kind in case["routings"]:  # each gives top-K of the case's shape (top1, one_expert: K=1; topk_all: K=E)
        x, idx, w, l1, l2 = _inputs(rank, world, T, H, I, E, K, kind, dtype, device)
        if dtype == FP8:  # the FP8-emulating reference, with every expert's (shared) local weights
            w1t, w2 = transform_weights(l1[0], l2[0], buf.cfg.block_n1, l1[1], l2[1])
            ref = reference_moe_fp8(x, idx, w, *(t.repeat(world, 1, 1) for t in (*l1, *l2))).float()
        else:
            w1t, w2 = transform_weights(l1, l2, buf.cfg.block_n1)
            ref = reference_moe_dist(x.float(), idx, w.float(), l1.float(), l2.float(), dtype=torch.float32)
        ys = {}
        for s in case["schedules"]:
            rec = {"case": f"{kind}/{s}"}
            if case.get("die") == "before" and rank == world - 1:
                os._exit(0)
            t0 = time.monotonic()
            try:
                if case.get("die") == "during" and rank == world - 1:
                    # Stop answering inside the call, once the group has met at its barrier: the peers'
                    # kernels then wait for this rank's rows and completion signal (a short call could
                    # finish before a timed stop, and the interpreter finishes a call before returning).
                    buf.x_buf[: x.shape[0]].copy_(x)
                    buf.idx_buf.fill_(-1)
                    buf.idx_buf[: x.shape[0]].copy_(idx)
                    try:
                        buf.barrier()
                    except XstageError:
                        # The peers may still be compiling their first call when this rank's barrier watchdog
                        # expires; its arrival is counted all the same, which is what their barrier waits for.
                        pass
                    _stop_answering(result_file, rank, world, case)
                bad = case.get("bad_input_rank") == rank and not rec_count(out, kind)
                idx_in, w_in = idx, w
                if bad and case.get("bad_input", "expert_id") == "expert_id":  # an expert id out of range
                    idx_in = idx.clone()
                    idx_in[0, 0] = E + 5
                elif bad:  # weights of a dtype the kernel does not take
                    w_in = w.double()
                y = fused_moe(x, idx_in, w_in, w1t, w2, buf, schedule=s,
                              **({"check": case["check"]} if "check" in case else {}))
                if case.get("sync_check"):
                    buf.check()
                ys[s] = y
                scale = float(ref.abs().max()) or 1.0
                rec["rel_err"] = float((y.float() - ref).abs().max()) / scale
                rec["nan"] = bool(torch.isnan(y).any())
            except Exception as exc:  # reported to the test, which asserts what each rank saw
                rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["seconds"] = time.monotonic() - t0
            out.append(rec)
            _write(result_file, rank, out)
        if case.get("final_check"):  # the errors no call has raised yet
            rec = {"case": f"{kind}/check"}
            t0 = time.monotonic()
            try:
                buf.check()
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["seconds"] = time.monotonic() - t0
            out.append(rec)
        if len(ys) == len(case["schedules"]):
            first = next(iter(ys.values()))
            out.append({"case": f"{kind}/bitwise", "equal": all(torch.equal(y, first) for y in ys.values())})
    _write(result_file, rank, out)
    _linger(result_file, rank, world, case)
    try:
        dist.destroy_process_group()
    except Exception:  # a peer died: nothing left to tear down cleanly
        pass


def _linger(result_file, rank, world, case, cap_s=120.0):
    """Mark this rank done, then stay until every rank still in the group is done (at most `cap_s`).

    A process that exits while its peers' kernels still read and store into the memory it exported takes
    that memory with it, and no watchdog can turn the illegal address that follows into an error
    (docs/failures.md). When a rank stops answering, the survivors' watchdogs fire at different times, so
    the first survivor to report must not exit while the other still waits on it. A rank that died
    before the call (`die="before"`) never reports and is not waited for."""
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # done means this rank's kernels are done, not only enqueued
    except Exception:  # a faulted context: its error is already in the records
        pass
    open(f"{result_file}.{rank}.done", "w").close()
    gone = world - 1 if case.get("die") == "before" else None
    peers = [r for r in range(world) if r not in (rank, gone)]
    t0 = time.monotonic()
    while time.monotonic() - t0 < cap_s:
        if all(os.path.exists(f"{result_file}.{r}.done") for r in peers):
            return
        time.sleep(0.2)


def _stop_answering(result_file, rank, world, case):
    """A rank that stops answering mid-call: it never launches its kernels, and its process stays until every
    peer is done (`_linger`), then exits. A rank that stops answering is what the device watchdog names;
    tearing the group down after a crash is torchrun's part."""
    _linger(result_file, rank, world, case)
    os._exit(0)


def rec_count(out, kind: str) -> int:
    """Calls this rank has made on routing `kind`."""
    return sum(r["case"].startswith(f"{kind}/") and not r["case"].endswith(("/bitwise", "/check")) for r in out)


def _write(result_file, rank, out):
    with open(f"{result_file}.{rank}", "w") as f:
        f.write("\n".join(json.dumps(r) for r in out))


def run(tmp_path, world, case, timeout_s=600):
    """Spawn `world` ranks on `case`; every rank's records (a rank that died early has none)."""
    import multiprocessing as mp

    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    spawn = mp.get_context("spawn")
    result = str(tmp_path / "result")
    procs = [spawn.Process(target=worker, args=(r, world, str(tmp_path / "store"), result, case))
             for r in range(world)]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    for p in procs:
        p.join(max(1.0, timeout_s - (time.monotonic() - t0)))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    recs = []
    for r in range(world):
        path = f"{result}.{r}"
        text = open(path).read() if os.path.exists(path) else ""
        recs.append([json.loads(line) for line in text.splitlines() if line.strip()])
    return recs, hung
