"""Where kernels run: the bf16 refusal of Triton's CPU interpreter, and why it exists."""

import pytest
import torch
import triton
import triton.language as tl

from xstage.backend import refuse_interpreter_bf16
from xstage.env import interpreter_active
from xstage.errors import InputError

interpreter = pytest.mark.skipif(not interpreter_active(), reason="Triton's CPU interpreter is off")


@triton.jit
def _dot_kernel(p_a, p_b, p_c, N: tl.constexpr):
    o = tl.arange(0, N)
    b_a = tl.load(p_a + o[:, None] * N + o[None, :])  # [N, N]
    b_b = tl.load(p_b + o[:, None] * N + o[None, :])  # [N, N]
    tl.store(p_c + o[:, None] * N + o[None, :], tl.dot(b_a, b_b))


def _dot_error(dtype: torch.dtype) -> float:
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).to(dtype) for _ in range(2))
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, N=16)
    return float((c - a.float() @ b.float()).abs().max())


@interpreter
def test_the_interpreter_gets_bf16_dot_wrong_and_fp16_right():
    """The reason for the refusal: if Triton's interpreter ever computes bf16 `tl.dot` right, this fails
    and the refusal can go."""
    assert _dot_error(torch.float16) < 1e-2
    assert _dot_error(torch.bfloat16) > 1e3


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, "bf16"], ids=["torch", "name"])
def test_bf16_is_refused_by_name_in_the_interpreter(dtype):
    with pytest.raises(InputError, match=r"^x\.dtype=bf16: dtype bf16 cannot run in Triton's CPU interpreter.*"
                                         r"use fp16 or fp32 there$"):
        refuse_interpreter_bf16(dtype, "x.dtype")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, "fp16", "fp8", torch.float8_e4m3fn])
def test_other_dtypes_pass(dtype):
    refuse_interpreter_bf16(dtype)


def test_bf16_passes_where_kernels_are_compiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    refuse_interpreter_bf16(torch.bfloat16)


# ---- backend.launch: relaunching a compiled kernel without Triton's binding -------------------------

def test_launch_key_separates_what_triton_specialises_on():
    # A cached kernel is reused only where Triton would pick the same one: these must all differ.
    from xstage.backend import _spec

    t = torch.zeros(64, dtype=torch.float32)
    assert _spec(t) != _spec(t[1:])  # 16-byte aligned, or not
    assert _spec(t) != _spec(t.half())  # dtype
    # 1, other i32, i32 divisible by 16, past i32 (divisible by 16 or not)
    assert len({_spec(1), _spec(2), _spec(16), _spec(2**31), _spec(-(2**31) - 1)}) == 5
    assert _spec(True) != _spec(False) and _spec(None) is None
    assert _spec(32) == _spec(48) and _spec(3) == _spec(17)  # the same specialisation: one entry


@pytest.mark.gpu
def test_launch_matches_tritons_own_launch_on_every_specialisation():
    # The same kernel through `launch` (cached after the first launch of a key) and through Triton, on
    # aligned and unaligned pointers and ints Triton specialises differently: bitwise equal to Triton's
    # own launch, and within one rounding of float64 (the GPU fuses the multiply-add: one rounding, where
    # torch's `x * a + 1.0` makes two).
    import triton
    import triton.language as tl

    from xstage import backend

    @triton.jit
    def axpb(p_x, p_y, n, a, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        m = o < n
        tl.store(p_y + o, tl.load(p_x + o, mask=m) * a + 1.0, mask=m)

    base = torch.randn(4096 + 1, device="cuda")
    for _rep in range(3):  # the first launch of each key compiles, the later ones reuse it
        for off, n, a in ((0, 4096, 2), (1, 4096, 2), (0, 1, 3), (0, 17, 1), (1, 1000, 16)):
            x = base[off: off + n]
            y = torch.full_like(x, float("nan"))
            backend.launch(axpb, (triton.cdiv(n, 128),), (x, y, n, a), dict(B=128, num_warps=4))
            own = torch.full_like(x, float("nan"))
            axpb[(triton.cdiv(n, 128),)](x, own, n, a, B=128, num_warps=4)
            assert torch.equal(y, own)
            torch.testing.assert_close(y.double(), x.double() * a + 1.0, rtol=2**-23, atol=0)
    keys = [k for k in backend._compiled if k[0] == id(axpb)]
    assert len(keys) >= 4, keys  # aligned/unaligned, n == 1, n % 16 == 0 / != 0 kept apart


@triton.jit
def _tile_sum(p_x, desc, p_y, n, a, B: tl.constexpr, D: tl.constexpr):
    """y[i] = a * x[i] + the sum of row (i % 8) of a host-descriptor's [8, D] tensor, for i < n."""
    o = tl.program_id(0) * B + tl.arange(0, B)
    m = o < n
    rows = desc.load([0, 0])  # [8, D]
    s = tl.sum(rows.to(tl.float32), axis=1)  # [8]
    pick = tl.sum(tl.where((o % 8)[:, None] == tl.arange(0, 8)[None, :], s[None, :], 0.0), axis=1)
    tl.store(p_y + o, tl.load(p_x + o, mask=m) * a + pick, mask=m)


def _tile_sum_ref(x, table, a):
    s = table.double().sum(1)
    return x.double() * a + s[torch.arange(x.numel(), device=x.device) % 8]


def test_a_launch_hook_counts_as_set_only_when_something_is_hooked():
    # Triton's launch hooks: None on older versions, a `HookChain` (empty when nothing is hooked) on
    # newer ones. An empty chain must not count as a hook, or every relaunch takes Triton's slow path.
    from triton import knobs

    from xstage.backend import hooked

    assert not hooked(None)
    assert hooked(lambda metadata: None)  # an older Triton's hook: a plain callable
    chain = type(knobs.runtime.launch_enter_hook)() if hasattr(knobs.runtime.launch_enter_hook, "calls") else None
    if chain is not None:
        assert not hooked(chain)
        chain.add(print)
        assert hooked(chain)
        chain.remove(print)
        assert not hooked(chain)
    assert not hooked(knobs.runtime.launch_enter_hook) and not hooked(knobs.runtime.launch_exit_hook)


@pytest.mark.gpu
def test_a_relaunch_calls_the_c_launcher_unless_a_hook_is_set():
    # On a Triton whose launcher `Launch` knows, a cached launch goes straight to the C launcher (no
    # `compiled.run`); with a launch hook set, the hook sees every launch. Outputs equal Triton's own.
    import triton
    from triton import knobs

    from xstage import backend

    if not triton.__version__.startswith(backend._RAW_TRITON):
        pytest.skip(f"Triton {triton.__version__}: relaunches go through compiled.run")
    x = torch.randn(4096, device="cuda")
    site = backend.Launch(_axpb, (x, None, None, 3.0), dict(B=128, num_warps=4), holes=(1, 2))
    ran = []

    def seen(metadata):  # Triton 3.6 passes a LazyDict (its `get()` is the dict), earlier ones the dict
        ran.append((metadata.get() if type(metadata).__name__ == "LazyDict" else metadata)["name"])

    for hook in (None, seen):
        if hook is not None:
            knobs.runtime.launch_enter_hook.add(hook)
        try:
            for n in (4096, 4096, 17):
                y = torch.full_like(x, float("nan"))
                site((triton.cdiv(n, 128),), y, n)
                own = torch.full_like(x, float("nan"))
                _axpb[(triton.cdiv(n, 128),)](x, own, n, 3.0, B=128, num_warps=4)
                torch.cuda.synchronize()
                assert torch.equal(y[:n], own[:n]) and torch.isnan(y[n:]).all(), n
        finally:
            if hook is not None:
                knobs.runtime.launch_enter_hook.remove(hook)
        names = {getattr(f, "__name__", "") for f in site._hits.values()}
        assert names == {"relaunch"}, names
    assert ran.count("_axpb") == 6, ran  # every launch of the second round: xstage's three and Triton's


@triton.jit
def _axpb(p_x, p_y, n, a, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    m = o < n
    tl.store(p_y + o, tl.load(p_x + o, mask=m) * a + 1.0, mask=m)


def test_a_launch_fills_its_holes_each_call():
    # Fixed arguments stay, holes take each call's values (in the interpreter: Triton's own launch).
    from xstage.backend import Launch

    @triton.jit
    def axpb(p_x, p_y, n, a, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        m = o < n
        tl.store(p_y + o, tl.load(p_x + o, mask=m) * a + 1.0, mask=m)

    dev = "cuda" if torch.cuda.is_available() and not interpreter_active() else "cpu"
    x = torch.randn(300, device=dev)
    site = Launch(axpb, (x, None, None, 3.0), dict(B=64), holes=(1, 2))
    for n in (300, 1, 17, 64, 0):
        y = torch.full((300,), float("nan"), device=dev)
        site((max(1, triton.cdiv(n, 64)),), y, n)
        own = torch.full_like(y, float("nan"))
        axpb[(max(1, triton.cdiv(n, 64)),)](x, own, n, 3.0, B=64)
        assert torch.equal(y[:n], own[:n])
        torch.testing.assert_close(y[:n].double(), x[:n].double() * 3.0 + 1.0, rtol=1e-6, atol=1e-6)
        assert torch.isnan(y[n:]).all()  # nothing past n


def test_moe_launches_go_with_the_weights_they_were_made_for():
    # A fused call's main launch holds aliases of the weights and is dropped when the caller's
    # tensors go: a buffer never keeps a model's weights alive.
    import gc
    import weakref

    from xstage.moe.buffer import LoopbackGroup, MoEBuffer
    from xstage.moe.fused import fused_moe
    from xstage.moe.layout import transform_weights
    from xstage.moe.problem import routing

    H, I, E, K, T = 128, 128, 4, 2, 8
    buf = MoEBuffer(16, E, K, H, I, LoopbackGroup(1), device="cpu", dtype="fp16")
    g = torch.Generator().manual_seed(0)
    l1 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).half()
    l2 = (torch.randn(E, H, I, generator=g) * I**-0.5).half()
    w1t, w2 = transform_weights(l1, l2, buf.cfg.block_n1)
    x = torch.randn(T, H, generator=g).half()
    idx, w = routing(T, E, K, "cpu", seed=0)
    y1 = fused_moe(x, idx, w, w1t, w2, buf).clone()
    y2 = fused_moe(x, idx, w, w1t, w2, buf)  # the cached launch: the same output
    assert torch.equal(y1, y2)
    assert sum(1 for k in buf._plans if k[0] == "main launch") == 1
    alive, ptrs = weakref.ref(w1t), {w1t.data_ptr(), w2.data_ptr()}
    del w1t, w2
    gc.collect()
    assert alive() is None
    assert not [k for k in buf._plans if k[0] == "main launch"]
    assert not [k for k in buf._plans if k[0] == "tma" and k[1] in ptrs]  # the weights' descriptors too


@pytest.mark.gpu
def test_a_launch_matches_tritons_own_with_a_host_descriptor_fixed():
    # The fixed host TMA descriptor is encoded once and reused; holes of every specialisation (aligned
    # or not, n == 1, n % 16 == 0) give Triton's own launch's output, bit for bit.
    from triton.tools.tensor_descriptor import TensorDescriptor

    from xstage import backend

    table = torch.randn(8, 32, device="cuda")
    desc = TensorDescriptor(table, shape=[8, 32], strides=[32, 1], block_shape=[8, 32])
    base = torch.randn(4096 + 1, device="cuda")
    site = backend.Launch(_tile_sum, (None, desc, None, None, 2.0), dict(B=128, D=32, num_warps=4),
                          holes=(0, 2, 3))
    for _rep in range(3):
        for off, n in ((0, 4096), (1, 4096), (0, 1), (0, 17), (1, 1000)):
            x = base[off: off + n]
            y = torch.full_like(x, float("nan"))
            site((triton.cdiv(n, 128),), x, y, n)
            own = torch.full_like(x, float("nan"))
            _tile_sum[(triton.cdiv(n, 128),)](x, desc, own, n, 2.0, B=128, D=32, num_warps=4)
            assert torch.equal(y, own), (off, n)
            torch.testing.assert_close(y.double(), _tile_sum_ref(x, table, 2.0), rtol=1e-6, atol=1e-5)
    assert len(site._hits) >= 4
