"""Ranks of an expert-parallel transformers model (gloo group, one process per rank), shared by
`test_transformers_parallel.py`. Every rank builds the same random model (same seed), keeps an eager
float64 copy of it unsharded as the reference, shards the original with `expert_parallel`, runs its own
tokens, and writes what it saw to a JSON file the test reads."""

import copy
import faulthandler
import json
import os
import signal
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import transformers

from tests.integrations import test_transformers_gpt_oss as gpt_oss
from tests.integrations.test_transformers import ARCHS, CFG, TOL, _block, _model, _same_routing
from xstage.integrations import transformers as xt
from xstage.integrations.transformers.weights import param_names

# Tokens per rank of each call: uneven across ranks (rank 0, rank 1, ...), zero tokens included.
BLOCK_TOKENS = (13, 6, 9, 4)
ZERO_TOKENS = (5, 0, 3, 0)
LOGITS_SHAPES = ((1, 7), (2, 3), (1, 5), (3, 2))


def _close(got, want, dtype) -> str:
    """"ok", or why `got` is not within the CPU tests' tolerance of `want` (float64)."""
    try:
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
    except AssertionError as exc:
        return str(exc).splitlines()[0] + " " + " ".join(str(exc).splitlines()[1:4])
    return "ok"


def _attempt(fn) -> str:
    """"ok", or the error `fn` raised as `Type: message`."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _expert_bytes(model) -> int:
    experts = [m for n, m in model.named_modules() if n.endswith(".experts")]
    return sum(p.numel() * p.element_size() for m in experts for p in (getattr(m, n) for n in param_names(m)))


def _arch_model(arch: str):
    """Two layers of `arch`: a `test_transformers.ARCHS` config, or GPT-OSS (biases, clamped SwiGLU,
    transposed and interleaved weights; H40-I24, padded inside)."""
    return gpt_oss._model(40, 24, layers=2) if arch == "gpt_oss" else _model(arch, layers=2)


def _out(y):
    return y[0] if isinstance(y, tuple) else y  # GPT-OSS's block returns (output, router scores)


def _tokens(rank: int, n: int, h: int, dtype, seed: int) -> torch.Tensor:
    return torch.randn(1, n, h, generator=torch.Generator().manual_seed(seed + 100 * rank)).to(dtype)


def _main(rank, world, case, out, device):
    arch, dtype = case["arch"], getattr(torch, case["dtype"])
    xt.register()
    model = _arch_model(arch).to(device)
    ref = copy.deepcopy(model).double()  # every expert, on every rank: the reference
    ref.set_experts_implementation("eager")
    model = model.to(dtype)
    model.set_experts_implementation("xstage")
    full = _expert_bytes(model)
    h = model.config.hidden_size

    out["names"] = xt.expert_parallel(model, config=CFG if device.type == "cpu" else None,
                                      max_tokens=case["max_tokens"], check=case.get("check", "async"))
    mem = xt.memory(model)
    out["memory"] = {"experts": mem.experts, "full": full, "weights": mem.weights, "buffers": mem.buffers,
                     "modules": mem.modules}
    exp, ref_exp = _block(model).experts, _block(ref).experts
    el = exp.num_experts // world
    out["holds_own_slice"] = all(
        tuple(getattr(exp, p).shape)[0] == el
        and torch.equal(getattr(exp, p).double(), getattr(ref_exp, p)[rank * el:(rank + 1) * el].to(dtype).double())
        for p in param_names(exp))

    with torch.no_grad():
        for key, counts, seed in (("block", BLOCK_TOKENS, 1), ("block_zero", ZERO_TOKENS, 7)):
            x = _tokens(rank, counts[rank], h, dtype, seed).to(device)
            if dtype == torch.float32:  # the router at float32 picks what float64 picks: the whole block
                y, want = _block(model)(x), _block(ref)(x.double())
            else:
                y, want = _same_routing(_block(model), _block(ref), x)
            y, want = _out(y), _out(want)
            out[key] = {"close": _close(y.cpu(), want.cpu(), dtype), "tokens": counts[rank],
                        "scale": float(want.abs().max()) if want.numel() else 0.0, "shape": list(y.shape)}
        if dtype == torch.float32:
            ids = torch.randint(0, 64, LOGITS_SHAPES[rank], generator=torch.Generator().manual_seed(2 + rank))
            got, want = model(ids.to(device)).logits, ref(ids.to(device)).logits
            out["logits"] = {"close": _close(got.cpu(), want.cpu(), dtype), "scale": float(want.abs().max()),
                             "tokens": ids.numel()}
    if not case.get("refusals"):
        xt.release(model)  # the group's shared-memory files go with the buffers
        return

    with tempfile.TemporaryDirectory() as tmp:
        out["state_dict"] = _attempt(model.state_dict)
        out["save_pretrained"] = _attempt(lambda: model.save_pretrained(tmp))
        out["saved_files"] = sorted(os.listdir(tmp))
    out["load_state_dict"] = _attempt(lambda: model.load_state_dict(ref.state_dict()))

    with torch.no_grad():
        # Rank 1 passes more than max_tokens: refused there; every rank's call stops, and the peers'
        # error arrives with their next call (check="async").
        over = case["max_tokens"] + 8 if rank == 1 else 5
        seen = {}
        out["over_max_tokens"] = _attempt(
            lambda: seen.setdefault("y", _block(model)(_tokens(rank, over, h, dtype, seed=3))))
        out["over_max_tokens_nan"] = bool(torch.isnan(seen["y"]).all()) if "y" in seen else None
        out["over_max_tokens_next"] = _attempt(lambda: _block(model)(_tokens(rank, 4, h, dtype, seed=4)))
        x = _tokens(rank, 6, h, dtype, seed=5)
        y = _block(model)(x)
        out["after_refusal"] = _close(y, _block(ref)(x.double()), dtype)
    # Gradients enabled and the parameters requiring grad, on every rank
    out["autograd"] = _attempt(lambda: _block(model)(_tokens(rank, 3, h, dtype, seed=6)))

    # A model whose experts do not divide over the group, and one sharded by torch (DTensor weights):
    # refused before any collective, on every rank alike.
    conf_cls, model_cls, kw = ARCHS["qwen3_moe"]
    odd = getattr(transformers, model_cls)(getattr(transformers, conf_cls)(
        vocab_size=64, num_hidden_layers=1, **{**kw, "num_experts": world + 1}))
    odd.set_experts_implementation("xstage")
    out["indivisible"] = _attempt(lambda: xt.expert_parallel(odd, config=CFG))
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    dt = _model("qwen3_moe", layers=1)
    dt.set_experts_implementation("xstage")
    mesh = DeviceMesh("cpu", list(range(world)))
    e = _block(dt).experts
    e.gate_up_proj = torch.nn.Parameter(distribute_tensor(e.gate_up_proj.detach(), mesh, [Shard(0)]))
    out["dtensor"] = _attempt(lambda: xt.expert_parallel(dt, config=CFG))
    out["twice"] = _attempt(lambda: xt.expert_parallel(model, config=CFG))
    out["prepare"] = _attempt(lambda: xt.prepare(model, config=CFG))
    xt.release(model)
    out["released"] = list(map(int, (lambda m: (m.weights, m.buffers, m.modules))(xt.memory(model))))


def _main_fp8(rank, world, case, out, device):
    """A fine-grained FP8 Qwen3-MoE (`test_transformers_fp8`), sharded: each rank calls the experts on
    its own tokens and routing, against the FP8-emulating reference and float32 on the dequantized
    weights of all experts."""
    from tests.integrations import test_transformers_fp8 as fp8

    xt.register()
    model, ref, weights = fp8._fp8_model("qwen3_moe")
    model.set_experts_implementation("xstage")
    full = _expert_bytes(model)
    out["names"] = xt.expert_parallel(model, config=fp8.CFG, max_tokens=case["max_tokens"])
    mem = xt.memory(model)
    out["memory"] = {"experts": mem.experts, "full": full, "weights": mem.weights, "modules": mem.modules}
    exp = _block(model).experts
    el = exp.num_experts // world
    mine = slice(rank * el, (rank + 1) * el)
    def bits(t):  # e4m3 compared bit for bit
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    names = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
    out["holds_own_slice"] = all(torch.equal(bits(getattr(exp, p)), bits(w)[mine]) for p, w in zip(names, weights))
    with torch.no_grad():
        for key, counts, seed in (("block", BLOCK_TOKENS, 1), ("block_zero", ZERO_TOKENS, 7)):
            n = counts[rank]
            x = _tokens(rank, n, 256, torch.bfloat16, seed)[0]
            idx, w = fp8._routing(n, exp.num_experts, seed=seed + rank, skew=False)
            y = exp(x, idx, w)
            rec = {"tokens": n, "shape": list(y.shape), "dtype": str(y.dtype)}
            if n:
                want = _block(ref).experts(x.float(), idx, w)
                rec["rel_fp8"] = fp8._rel(y, fp8.reference_moe_fp8(x, idx, w, *weights))
                rec["fro_float"] = float((y.double() - want.double()).norm() / want.double().norm())
            out[key] = rec
    xt.release(model)


def worker(rank, world, init_file, result_file, case):
    """One rank: runs `case` (dict: arch, dtype, max_tokens, check, refusals) and writes its records."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A rank still running at the test's timeout is asked for its Python stacks before it is killed
    # (`run`): written from the signal handler, so a rank blocked in a CUDA call says where it is too.
    stacks = open(f"{result_file}.{rank}.stack", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    out = {}
    try:
        (_main_fp8 if case["arch"] == "qwen3_moe_fp8" else _main)(rank, world, case, out, device)
    except Exception as exc:  # reported to the test, which shows it
        out["error"] = f"{type(exc).__name__}: {exc} | {traceback.format_exc()[-1500:]}"
    finally:
        with open(f"{result_file}.{rank}", "w") as f:
            json.dump(out, f)
        _leave(world)
        dist.destroy_process_group()


def _leave(world):
    """Leave the group only once every rank's kernels are done: a peer's last kernel still signals into
    the memory this process exported, and an exit frees it (an illegal address in the peer; see the
    failure page). A rank that is gone is named by the barrier's timeout and not waited for longer."""
    from datetime import timedelta

    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if world > 1:
            dist.monitored_barrier(timeout=timedelta(seconds=60))
    except Exception:  # a peer is gone or the context faulted: the records already say what happened
        pass


def run(tmp_path, world, case, timeout_s=300):
    """Spawn `world` ranks on `case`; (every rank's records, the ranks still running at the timeout,
    which are killed after writing their Python stacks to their record's `stack`)."""
    import multiprocessing as mp

    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    tmp_path.mkdir(parents=True, exist_ok=True)  # a case's own folder (tmp_path / dtype)
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
    for r in hung:
        os.kill(procs[r].pid, signal.SIGUSR1)  # its stacks (`worker`)
    time.sleep(2 if hung else 0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    recs = []
    for r in range(world):
        path = f"{result}.{r}"
        recs.append(json.load(open(path)) if os.path.exists(path) else {"error": "no result"})
        if r in hung and os.path.exists(f"{path}.stack"):
            recs[r]["stack"] = open(f"{path}.stack").read()[:6000]  # innermost frames first
    return recs, hung
