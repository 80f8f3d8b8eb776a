"""The rank side of the diffusers integration tests: P spawned processes on gloo, each building the same
tiny diffusers model with random weights, computing diffusers' own unsharded output as the reference,
then running it under diffusers' context parallelism with xstage's Ulysses attention.

Each scenario returns plain values (relative errors, call counts, refusal lines) that the test module
asserts on; a scenario that raises is reported as its error line, and the next one still runs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from datetime import timedelta
from unittest import mock

import torch
import torch.multiprocessing as mp

FLUX = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
WAN = dict(patch_size=(1, 2, 2), attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16, freq_dim=32,
           ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenarios: list[str], world: int = 2, use_gpu: bool = False, timeout_s: float = 600) -> dict:
    """{scenario: {rank: result}} from `world` spawned ranks running `scenarios` in order; ranks that do
    not answer within `timeout_s` are killed and the call raises."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, use_gpu, scenarios, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, out = results.get(timeout=timeout_s)
            got[rank] = out
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    assert sorted(got) == list(range(world)), f"ranks that answered: {sorted(got)}"
    return {s: {r: got[r][s] for r in got} for s in scenarios}


def _worker(rank, world, port, use_gpu, scenarios, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES="1", NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if not use_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist
    from diffusers.utils import logging

    logging.set_verbosity_error()  # diffusers warns that parallelism is experimental, on every call
    if use_gpu:
        torch.cuda.set_device(0)
    # a rank stuck in a collective fails within a minute instead of hanging the test
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    out = {}
    try:
        for name in scenarios:
            try:
                out[name] = SCENARIOS[name](rank, world, torch.device("cuda", 0) if use_gpu else torch.device("cpu"))
            except Exception as e:  # reported to the parent, which fails the test with it
                out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    finally:
        results.put((rank, out))
        dist.destroy_process_group()


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def enable_parallelism(model, **cp):
    """`model.enable_parallelism(ContextParallelConfig(**cp))`. diffusers 0.42 picks each rank's device as
    `rank % torch.accelerator.device_count()`, which divides by zero on a CPU-only torch; one device is
    what a CPU rank has, so the count reads 1 for that call only."""
    from diffusers import ContextParallelConfig

    count = mock.patch.object(torch.accelerator, "device_count", return_value=1)
    with count if torch.accelerator.device_count() == 0 else contextlib.nullcontext():
        model.enable_parallelism(config=ContextParallelConfig(**cp))


def flux(heads: int, batch: int, txt: int, img: int, device, dtype=torch.float32):
    """A tiny FluxTransformer2DModel (seeded random weights, as diffusers' own tests build it) and its inputs."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(num_attention_heads=heads, **FLUX).to(device, dtype).eval()
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    inputs = dict(hidden_states=r(batch, img, 4), encoder_hidden_states=r(batch, txt, 32),
                  pooled_projections=r(batch, 32), timestep=torch.ones(batch, device=device, dtype=dtype),
                  img_ids=r(img, 3), txt_ids=r(txt, 3), return_dict=False)
    return model, inputs


def wan(heads: int, batch: int, frames: int, hw: int, txt: int, device, dtype=torch.float32):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(num_attention_heads=heads, **WAN).to(device, dtype).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, frames, hw, hw, generator=g).to(device, dtype),
                  timestep=torch.ones(batch, device=device, dtype=torch.long) * 500,
                  encoder_hidden_states=torch.randn(batch, txt, 16, generator=g).to(device, dtype), return_dict=False)
    return model, inputs


@contextlib.contextmanager
def spies():
    """Counts of the calls that tell whose Ulysses layer ran: diffusers' all-to-all (`funcol.all_to_all_single`),
    its templated context-parallel attention and its Ulysses layers (`TemplatedUlyssesAttention`, and the
    `ulysses_anything` one), xstage's `UlyssesAttention` (with the local token counts it
    saw) and its pre-attention all-to-all (`torch.distributed.all_to_all_single`)."""
    import torch.distributed as dist
    from diffusers.models import attention_dispatch as ad

    from xstage.attention import UlyssesAttention

    counts = {"diffusers_a2a": 0, "diffusers_templated": 0, "diffusers_ulysses": 0, "xstage_calls": 0,
              "xstage_a2a": 0, "tokens": []}

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    forward = UlyssesAttention.forward

    def xstage_forward(self, query, *args, **kwargs):
        counts["xstage_calls"] += 1
        counts["tokens"].append(query.shape[1])
        return forward(self, query, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(ad.funcol, "all_to_all_single",
                                              counted("diffusers_a2a", ad.funcol.all_to_all_single)))
        stack.enter_context(mock.patch.object(ad, "_templated_context_parallel_attention",
                                              counted("diffusers_templated", ad._templated_context_parallel_attention)))
        for layer in (ad.TemplatedUlyssesAttention, ad.TemplatedUlyssesAnythingAttention):
            stack.enter_context(mock.patch.object(layer, "forward",
                                                  staticmethod(counted("diffusers_ulysses", layer.forward))))
        stack.enter_context(mock.patch.object(dist, "all_to_all_single", counted("xstage_a2a", dist.all_to_all_single)))
        stack.enter_context(mock.patch.object(UlyssesAttention, "forward", xstage_forward))
        yield counts


def _flux_case(heads, batch, txt, img, exchanges=("auto",), anything=False, dtype=torch.float32):
    def run(rank, world, device):
        from xstage.integrations import diffusers as xd

        model, inputs = flux(heads, batch, txt, img, device, dtype)
        with torch.no_grad():
            ref = model(**inputs)[0]
        enable_parallelism(model, ulysses_degree=world, ulysses_anything=anything)
        res = {}
        for ex in exchanges:
            xd.enable(model, exchange=ex)
            with torch.no_grad(), spies() as counts:
                out = model(**inputs)[0]
            xd.disable(model)
            res[ex] = {"err": rel_err(out, ref), "shape": list(out.shape), **counts}
        res["ref_shape"] = list(ref.shape)
        return res["auto"] if dtype != torch.float32 else res
    return run


def _control(rank, world, device):
    """xstage on, then off: diffusers' own Ulysses layer runs again on the same model, and the spies see it."""
    import gc

    from diffusers.models import attention_dispatch as ad

    from xstage.integrations import diffusers as xd

    registry = ad._AttentionBackendRegistry._backends
    model, inputs = flux(2, 1, 8, 16, device)
    with torch.no_grad():
        ref = model(**inputs)[0]
    enable_parallelism(model, ulysses_degree=world)
    before = len(registry)
    xd.enable(model)
    during = len(registry)
    with torch.no_grad(), spies() as on:
        out_on = model(**inputs)[0]
    enabled = xd.is_enabled(model)
    xd.disable(model)
    backends = sorted({str(m.processor._attention_backend) for m in model.modules() if hasattr(m, "processor")})
    with torch.no_grad(), spies() as off:
        out_off = model(**inputs)[0]
    res = {"on": {"err": rel_err(out_on, ref), **on}, "off": {"err": rel_err(out_off, ref), **off},
           "enabled": enabled, "enabled_after": xd.is_enabled(model), "backends_after": backends,
           "registry": [before, during, len(registry)]}
    # a model collected while enabled takes its registry entry with it
    xd.enable(model)
    res["registry_enabled_again"] = len(registry)
    del model
    gc.collect()
    res["registry_collected"] = len(registry)
    return res


def _refusals(rank, world, device):
    """Each refusal as the line it raised (None: it did not raise); a good call after them still runs."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from xstage.integrations import diffusers as xd

    def line(fn):
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    res = {}
    model, inputs = flux(2, 1, 8, 16, device)
    with torch.no_grad():
        ref = model(**inputs)[0]
    res["before_parallelism"] = line(lambda: xd.enable(model))
    enable_parallelism(model, ulysses_degree=world)
    res["bad_exchange"] = line(lambda: xd.enable(model, exchange="bogus"))
    res["bad_calibration"] = line(lambda: xd.enable(model, calibration="/nonexistent/folder"))
    res["tma"] = line(lambda: xd.enable(model, exchange="tma"))
    xd.enable(model)
    res["twice"] = line(lambda: xd.enable(model))
    res["autograd"] = line(lambda: model(**inputs))  # weights require grad, grad mode on
    mask = torch.ones(1, 12, dtype=torch.bool, device=device)
    with torch.no_grad():
        res["mask"] = line(lambda: model(**inputs, joint_attention_kwargs={"attention_mask": mask}))
        out = model(**inputs)[0]
    res["after_err"] = rel_err(out, ref)
    # what no Flux call passes, straight through diffusers' dispatch with the backend enable set
    from diffusers.models import attention_dispatch as ad

    backend = model.transformer_blocks[0].attn.processor._attention_backend
    q = torch.randn(1, 12, 2, 16, device=device)

    def dispatch(q=q, k=q, v=q, **kw):
        return lambda: ad.dispatch_attention_fn(q, k, v, backend=backend, parallel_config=model._parallel_config,
                                                **kw)

    with torch.no_grad():
        res["causal"] = line(dispatch(is_causal=True))
        res["dropout"] = line(dispatch(dropout_p=0.1))
        res["gqa"] = line(dispatch(enable_gqa=True))
        res["lse"] = line(dispatch(attention_kwargs={"return_lse": True}))
        short = torch.randn(1, 5, 2, 16, device=device)
        res["kv_len"] = line(dispatch(k=short, v=short))
        odd = torch.randn(1, 12, 2, 24, device=device)  # a head dim xstage's kernel does not take
        res["head_dim"] = line(dispatch(q=odd, k=odd, v=odd))
        # no parallel config (attention diffusers runs on local tokens): diffusers' own backend, unchanged
        local = ad.dispatch_attention_fn(q, q, q, backend=backend, parallel_config=None)
        want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, q, q))).transpose(1, 2)
        res["local_err"] = rel_err(local, want)

    ring, _ = flux(2, 1, 8, 16, device)
    enable_parallelism(ring, ring_degree=world)
    res["ring"] = line(lambda: xd.enable(ring))
    # a mesh whose Ulysses dimension holds one rank, while the config says `world`
    mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("ring", "ulysses"))
    other, _ = flux(2, 1, 8, 16, device)
    with mock.patch.object(torch.accelerator, "device_count", return_value=1):
        other.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world, mesh=mesh))
    res["degree"] = line(lambda: xd.enable(other))
    return res


def _wan(rank, world, device):
    """Wan: self-attention under context parallelism (xstage), cross-attention on local tokens (diffusers)."""
    from xstage.integrations import diffusers as xd

    model, inputs = wan(3, 2, 3, 4, 6, device)  # 3 frames of 2x2 patches: 12 tokens over 2 ranks
    with torch.no_grad():
        ref = model(**inputs)[0]
    enable_parallelism(model, ulysses_degree=world)
    xd.enable(model)
    from diffusers.models import attention_dispatch as ad

    native = ad._AttentionBackendRegistry._backends[ad.AttentionBackendName.NATIVE]
    local = {"n": 0}

    def counted_native(*args, **kwargs):
        local["n"] += 1
        return native(*args, **kwargs)

    with torch.no_grad(), spies() as counts, \
            mock.patch.dict(ad._AttentionBackendRegistry._backends, {ad.AttentionBackendName.NATIVE: counted_native}):
        out = model(**inputs)[0]
    return {"err": rel_err(out, ref), "local_calls": local["n"], **counts}


def _compiled(rank, world, device):
    """torch.compile of the whole transformer: with equal shards and no calibration the attention is xstage's
    custom op (`fullgraph=True`); with a calibration it leaves the graph and runs eagerly, calibration and all."""
    from xstage.attention import ulysses as ulysses_module
    from xstage.integrations import diffusers as xd
    from xstage.sched.calibration import Calibration

    res = {}
    for case, fullgraph, calibration in (("op", True, None), ("calibration", False, Calibration(folder="mine")),
                                         ("calibration_fullgraph", True, Calibration(folder="mine"))):
        torch._dynamo.reset()
        model, inputs = flux(3, 2, 8, 16, device)
        with torch.no_grad():
            ref = model(**inputs)[0]
        enable_parallelism(model, ulysses_degree=world)
        xd.enable(model, calibration=calibration)
        compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
        calls = {"n": 0}

        def counted(*args, calls=calls, **kwargs):
            calls["n"] += 1
            return ulysses_module.ulysses_attention(*args, **kwargs)

        # the op's implementation calls `ulysses_attention` by its name in `xstage.attention.ops`
        try:
            with torch.no_grad(), mock.patch("xstage.attention.ops.ulysses_attention", counted), spies() as counts:
                out = compiled(**inputs)[0]
            res[case] = {"err": rel_err(out, ref), "op_calls": calls["n"], "xstage_calls": counts["xstage_calls"]}
        except Exception as e:
            res[case] = {"raised": f"{type(e).__name__}: {e}"}
    return res


def guide_code() -> str:
    """The first Python block of the "Use with diffusers" guide."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "diffusers.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def _guide(rank, world, device):
    """The guide's code as written, on the tiny Flux model."""
    model, inputs = flux(3, 2, 8, 16, device)
    with torch.no_grad():
        ref = model(**inputs)[0]
    namespace = {}
    exec(guide_code(), namespace)
    count = mock.patch.object(torch.accelerator, "device_count", return_value=1)  # see enable_parallelism
    with count if torch.accelerator.device_count() == 0 else contextlib.nullcontext(), spies() as counts:
        out = namespace["parallel_forward"](model, inputs, world)[0]
    return {"err": rel_err(out, ref), **counts}


SCENARIOS = {
    "guide": _guide,
    "gpu_bf16": _flux_case(3, 2, 7, 16, anything=True, dtype=torch.bfloat16),
    "even": _flux_case(3, 2, 8, 16),
    # 7 text tokens split 4 + 3: the ranks hold 12 and 11 tokens. The image tokens split evenly: diffusers
    # gathers the output with one all_gather, which gloo refuses for unequal shards (NCCL takes them).
    "uneven": _flux_case(3, 2, 7, 16, anything=True),
    "exchanges": _flux_case(3, 2, 7, 16, exchanges=("serial", "overlap", "stores", "heads:triton:2"), anything=True),
    "control": _control,
    "refusals": _refusals,
    "wan": _wan,
    "compiled": _compiled,
}
