"""One rank of a spawned gloo group (tests/comm/ranks.py `run_ranks`): Ulysses with ranks that hold no
token or own no head, against the plain-torch reference, then refusals on some ranks that every rank
must turn into its agreed line. Shared by the CPU (interpreter) and GPU tests of test_ranks_agree.py."""

import datetime
import os
import re

import torch

EXCHANGES = ("serial", "overlap", "stores", "auto")


def _shards(world, seq, B, H, D, dtype, seed):
    """Every rank's q, k, v shards (the same on every rank: each builds all of them for the reference)."""
    out = []
    for p in range(world):
        g = torch.Generator().manual_seed(seed + p)
        out.append([torch.randn(B, seq[p], H, D, generator=g).to(dtype) for _ in range(3)])
    return out


def _values(rank, world, device, D, failures):
    """Zero-token and zero-head ranks, every exchange, seq_lens gathered and given."""
    from xstage.attention import ulysses_attention, ulysses_reference
    from xstage.attention.flash import default_config
    from xstage.attention.ulysses import _group_context, fused_state
    from xstage.spec.ulysses import UlyssesPlan

    tol = {torch.float16: 2e-3, torch.float32: 1e-5}
    cases = [  # (B, H, seq, dtype, exchanges)
        (1, 4, [1, 1, 0], torch.float16, EXCHANGES),  # 2 tokens over 3 ranks: rank 2 holds none
        (1, 2, [1, 1, 0], torch.float32, EXCHANGES),  # 2 heads: rank 2 owns none either
        (2, 5, [3, 0, 2], torch.float16, EXCHANGES + ("serial:cudnn", "overlap:cudnn:3")),  # 5 heads: 2, 2, 1
    ]
    for B, H, seq, dtype, exchanges in cases:
        shards = _shards(world, seq, B, H, D, dtype, 100)
        refs = ulysses_reference(*[[s[i] for s in shards] for i in range(3)])
        q, k, v = (t.to(device) for t in shards[rank])
        for exchange in exchanges:
            for given in (False, True):
                if exchange == "stores":
                    # rows that nobody stores stay NaN and fail the comparison
                    plan = UlyssesPlan(world, rank, B, seq, H, D)
                    bm = default_config(D, dtype, torch.device(device)).block_m
                    fused_state(_group_context(torch.distributed.group.WORLD), plan, dtype, bm).out.local.fill_(
                        float("nan"))
                    if device == "cuda":
                        torch.cuda.synchronize()  # the fill lands before any peer can store
                    torch.distributed.barrier()
                what = f"B={B} H={H} seq={seq} {dtype} {exchange} seq_lens {'given' if given else 'gathered'}"
                try:
                    out = ulysses_attention(q, k, v, exchange=exchange, seq_lens=seq if given else None)
                except Exception as e:  # noqa: BLE001 - reported with the case
                    failures.append(f"rank {rank} {what}: {type(e).__name__}: {e}")
                    continue
                want = refs[rank]
                if out.shape != want.shape:
                    failures.append(f"rank {rank} {what}: shape {tuple(out.shape)}, expected {tuple(want.shape)}")
                elif out.numel():
                    err = ((out.double().cpu() - want).abs().max() / want.abs().max()).item()
                    if not err <= tol[dtype]:
                        failures.append(f"rank {rank} {what}: relative error {err}")


def _refusals(rank, world, device, D, interp, failures):
    """Each case makes some ranks refuse: those raise `rank R: <line>`, the others `rank R refused its
    <argument>` naming the lowest refusing rank; then a good call must still work."""
    from xstage.attention import UlyssesAttention, ulysses_attention, ulysses_reference
    from xstage.comm import create_context
    from xstage.errors import InputError

    H, seq, dtype = 4, [1, 1, 0], torch.float16
    shards = _shards(world, seq, 1, H, D, dtype, 300)
    q, k, v = (t.to(device) for t in shards[rank])
    other = _shards(world, seq, 1, H + 1, D, dtype, 300)[rank][0].to(device)
    odd = torch.zeros(1, seq[rank], H, 24, dtype=dtype, device=device)
    peer = create_context(path="peer")

    def attn(**kw):
        args = {"q": q, "k": k, "v": v, **kw}
        return ulysses_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)

    # (name, {rank: the call that rank makes}, {refusing rank: its own line's start}, argument), every
    # other rank making the good call `attn()`
    cases = [
        ("q not 4-D", {1: lambda: attn(q=q[0])}, {1: "q: expected a 4-D tensor"}, "q"),
        ("dtypes differ", {2: lambda: attn(k=k.float())}, {2: "q, k, v: dtypes must match"}, "q"),
        ("head dim", {0: lambda: attn(q=odd, k=odd, v=odd)}, {0: "q: head dim D=24"}, "q"),
        ("scale 'a'", {0: lambda: attn(softmax_scale="a")},
         {0: "softmax_scale: must be a finite positive number or None, got 'a'"}, "softmax_scale"),
        ("scale nan, stores, seq_lens given", {2: lambda: attn(softmax_scale=float("nan"), exchange="stores",
                                                               seq_lens=seq)},
         {2: "softmax_scale: must be a finite positive number or None, got nan"}, "softmax_scale"),
        ("own seq_lens entry", {1: lambda: attn(seq_lens=[1, 0, 1])},
         {1: "seq_lens: entry 1 (this rank's) is 0, but q holds 1 tokens"}, "seq_lens"),
        ("seq_lens disagree", {1: lambda: attn(seq_lens=seq), 2: lambda: attn(seq_lens=[2, 0, 0])},
         {2: "seq_lens: [2, 0, 0] differ from the token counts the ranks hold, [1, 1, 0]"}, "seq_lens"),
        ("heads disagree", {1: lambda: attn(q=other, k=other, v=other)},
         {1: f"q: [B, H, D] = [1, 5, {D}] in float16 differs from rank 0's [1, 4, {D}] in float16"}, "q"),
        ("exchange disagrees", {r: (lambda: attn(exchange="stores")) if r == 2 else (lambda: attn(exchange="overlap"))
                                for r in range(world)},
         {2: "exchange 'stores:paced': rank 0 runs another exchange"}, "exchange"),
        ("exchange spelling", {0: lambda: attn(exchange="bogus")}, {0: "exchange 'bogus'"}, "exchange"),
        ("deprecated mode", {2: lambda: attn(mode="bogus")}, {2: "mode 'bogus': deprecated"}, "mode"),
        ("config", {0: lambda: attn(config="x")}, {0: "config: expected a FlashConfig"}, "config"),
        ("two ranks refuse", {0: lambda: attn(softmax_scale=-1), 2: lambda: attn(q=q[0])},
         {0: "softmax_scale: must be", 2: "q: expected a 4-D tensor"}, "softmax_scale"),
        ("module, causal", {r: (lambda r=r: UlyssesAttention(exchange="serial")(q, k, v, causal=r == 1))
                            for r in range(world)}, {1: "causal=True: only non-causal"}, "causal"),
        ("peer context, stores", {r: (lambda r=r: attn(v=v[:, :, :2] if r == 1 else v, comm=peer, exchange="stores"))
                                  for r in range(world)}, {1: "k, v: expected the local shape of q"}, "k"),
    ]
    if interp:
        bf = [t.to(torch.bfloat16) for t in (q, k, v)]
        cases.append(("bf16 in the interpreter", {1: lambda: attn(q=bf[0], k=bf[1], v=bf[2])},
                      {1: "q.dtype=bf16: dtype bf16 cannot run in Triton's CPU interpreter"}, "q"))
    for name, calls, own, arg in cases:
        first = min(own)
        try:
            calls.get(rank, attn)()
            failures.append(f"rank {rank} {name}: no error")
            continue
        except InputError as e:
            msg = str(e)
        except Exception as e:  # noqa: BLE001 - any other error is a failure of the agreement
            failures.append(f"rank {rank} {name}: {type(e).__name__}: {e}")
            continue
        want = (f"rank {rank}: " + own[rank]) if rank in own else f"rank {first} refused its {arg} "
        if not msg.startswith(want) or "\n" in msg:
            failures.append(f"rank {rank} {name}: got {msg!r}, expected it to start with {want!r}")
        if rank not in own and not re.fullmatch(rf"rank {first} refused its {arg} \(its own error says why\); "
                                                "every rank of the group stops this call", msg):
            failures.append(f"rank {rank} {name}: unexpected line {msg!r}")
    # the group goes on: a good call after all those refusals
    refs = ulysses_reference(*[[s[i] for s in shards] for i in range(3)])
    for exchange in ("stores", "serial"):
        out = attn(exchange=exchange)
        if out.numel() and not ((out.double().cpu() - refs[rank]).abs().max() <= 2e-3 * refs[rank].abs().max()):
            failures.append(f"rank {rank}: the good call after the refusals ({exchange}) is wrong")
    peer.close()


def worker(rank, world, init_file, result_file, use_gpu):
    import torch.distributed as dist

    os.environ.update(GLOO_SOCKET_IFNAME="lo", TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES="1", NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if not use_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    device = "cuda" if use_gpu else "cpu"
    if use_gpu:
        torch.cuda.set_device(0)
    # a rank left waiting in a collective fails within this bound instead of hanging the test
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    failures = []
    try:
        D = 64 if use_gpu else 16
        _values(rank, world, device, D, failures)
        _refusals(rank, world, device, D, not use_gpu, failures)
    except Exception as e:  # noqa: BLE001 - reported to the parent test
        failures.append(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        with open(f"{result_file}.{rank}", "w") as f:
            f.write("\n".join(failures) or "ok")
        try:
            # every rank leaves its last collective before any tears the group down: a rank that
            # destroyed it while a peer still talked to it made that peer's process abort at exit
            dist.barrier()
        finally:
            dist.destroy_process_group()
