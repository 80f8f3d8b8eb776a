"""Expert biases and GPT-OSS's clamped SwiGLU in the fused kernel, against the plain-torch reference in
float64: under Triton's interpreter (fp16/fp32, small shapes), and on the GPU in BF16 (`-m gpu`)."""

import dataclasses

import pytest
import torch

from xstage.errors import InputError
from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer, fused_moe, transform_weights
from xstage.moe.reference import gated, loopback_inputs, reference_moe_virtual
from xstage.spec.activation import ClampedSwiGLU, check_activation

CFG = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)
# The CPU MoE tests' tolerances (tests/moe/test_fused_cpu.py): kernel dtype against float64.
TOL = {torch.float16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-4, atol=1e-4)}
# GPT-OSS's parameters, with a limit small enough that the clamps bite on unit-scale pre-activations.
GPT_OSS = ClampedSwiGLU(alpha=1.702, limit=7.0)
TIGHT = ClampedSwiGLU(alpha=1.702, limit=0.75)


def _problem(T, E, K, H, I, R, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    el = E // R
    l1 = (torch.randn(el, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    l2 = (torch.randn(el, H, I, generator=gen) / I**0.5).to(dtype)
    b1 = torch.randn(el, 2 * I, generator=gen).to(dtype)  # unit scale: as large as the GEMM's output
    b2 = torch.randn(el, H, generator=gen).to(dtype)
    return x, idx, w, l1, l2, b1, b2


def _reference(x, idx, w, l1, l2, R, b1=None, b2=None, activation="silu"):
    xs, ids, ws, l1s, l2s = loopback_inputs(x.double(), idx, w.double(), l1.double(), l2.double(), R)
    per_rank = [None if b is None else [b.double()] * R for b in (b1, b2)]
    return reference_moe_virtual(xs, ids, ws, l1s, l2s, dtype=torch.float64, b1=per_rank[0], b2=per_rank[1],
                                 activation=activation)[0]


def _buf(E, K, H, I, R, dtype, tma):
    return MoEBuffer(32, E, K, H, I, LoopbackGroup(R), device="cpu", dtype=dtype,
                     config=dataclasses.replace(CFG, tma=tma))


def _weights(l1, l2, layout):
    if layout == "concatenated":
        return l1.contiguous(), l2
    return transform_weights(l1, l2, CFG.block_n1)


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("T,E,K,H,I,R,dtype,activation,layout", [
    pytest.param(13, 8, 2, 64, 32, 1, torch.float32, GPT_OSS, "concatenated", id="T13-E8-K2-H64-I32-R1-fp32-gptoss"),
    pytest.param(11, 8, 2, 96, 32, 2, torch.float16, TIGHT, "interleaved", id="T11-E8-K2-H96-I32-R2-fp16-clamped"),
    pytest.param(9, 4, 2, 64, 64, 2, torch.float32, "silu", "interleaved", id="T9-E4-K2-H64-I64-R2-fp32-silu"),
    pytest.param(10, 4, 3, 64, 32, 1, torch.float16, TIGHT, "concatenated", id="T10-E4-K3-H64-I32-R1-fp16-clamped"),
])
def test_biases_and_activation_match_the_reference(T, E, K, H, I, R, dtype, activation, layout, tma):
    x, idx, w, l1, l2, b1, b2 = _problem(T, E, K, H, I, R, dtype, seed=T * E + R)
    buf = _buf(E, K, H, I, R, dtype, tma)
    w1, w2 = _weights(l1, l2, layout)
    buf.combine.fill_(float("nan"))  # a combine row nobody wrote poisons y
    y = fused_moe(x, idx, w, w1, w2, buf, w1_layout=layout, b1=b1, b2=b2, activation=activation)
    want = _reference(x, idx, w, l1, l2, R, b1, b2, activation)
    torch.testing.assert_close(y.double(), want, **TOL[dtype])
    # Each piece matters at this tolerance: dropping a bias or the activation's clamps moves y past it.
    assert float(want.abs().max()) > 0.5
    for other in (_reference(x, idx, w, l1, l2, R, None, b2, activation),
                  _reference(x, idx, w, l1, l2, R, b1, None, activation)):
        assert not torch.allclose(y.double(), other, **TOL[dtype])
    if activation != "silu":
        assert not torch.allclose(y.double(), _reference(x, idx, w, l1, l2, R, b1, b2, "silu"), **TOL[dtype])


def test_clamps_bite_where_the_activation_is_tested():
    # The pre-activations of the tests above reach past TIGHT's limit on both sides (else a clamp on the
    # wrong side could not fail them), and the clamped SwiGLU is GPT-OSS's formula, checked point by point.
    gate = torch.tensor([-3.0, -0.5, 0.0, 0.5, 3.0], dtype=torch.float64)
    up = torch.tensor([-3.0, 2.0, 0.0, -0.5, 3.0], dtype=torch.float64)
    lim, a = TIGHT.limit, TIGHT.alpha
    g = torch.tensor([-3.0, -0.5, 0.0, 0.5, lim], dtype=torch.float64)
    u = torch.tensor([-lim, lim, 0.0, -0.5, lim], dtype=torch.float64)
    torch.testing.assert_close(gated(gate, up, TIGHT), (u + 1) * g * torch.sigmoid(a * g), rtol=0, atol=0)
    # A padded intermediate row (zero weights, zero bias) gives exactly 0: (min(0, L) + 1) * 0 * sigmoid(0).
    assert float(gated(torch.zeros(1), torch.zeros(1), GPT_OSS)) == 0.0


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_flags_off_and_zero_biases_are_bitwise_todays_call(tma):
    T, E, K, H, I, R = 11, 8, 2, 64, 32, 2
    x, idx, w, l1, l2, b1, b2 = _problem(T, E, K, H, I, R, torch.float16, seed=3)
    buf = _buf(E, K, H, I, R, torch.float16, tma)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    plain = fused_moe(x, idx, w, w1t, w2, buf)
    off = fused_moe(x, idx, w, w1t, w2, buf, b1=None, b2=None, activation="silu")
    # With the bias flags on, zero biases add +0.0 to every fp32 accumulator: the same bits come out.
    zero = fused_moe(x, idx, w, w1t, w2, buf, b1=torch.zeros_like(b1), b2=torch.zeros_like(b2))
    assert torch.equal(off, plain) and torch.equal(zero, plain)
    torch.testing.assert_close(plain.double(), _reference(x, idx, w, l1, l2, R), **TOL[torch.float16])


def test_float32_biases_on_a_half_buffer():
    T, E, K, H, I, R = 7, 4, 2, 64, 32, 1
    x, idx, w, l1, l2, b1, b2 = _problem(T, E, K, H, I, R, torch.float16, seed=8)
    buf = _buf(E, K, H, I, R, torch.float16, False)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    y = fused_moe(x, idx, w, w1t, w2, buf, b1=b1.float(), b2=b2.float(), activation=GPT_OSS)
    torch.testing.assert_close(y.double(), _reference(x, idx, w, l1, l2, R, b1, b2, GPT_OSS), **TOL[torch.float16])


def test_bad_biases_and_activations_are_refused_in_one_line():
    E, K, H, I = 4, 2, 64, 32
    x, idx, w, l1, l2, b1, b2 = _problem(5, E, K, H, I, 1, torch.float32, seed=1)
    buf = _buf(E, K, H, I, 1, torch.float32, False)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1)
    cases = [
        (dict(activation="gelu"), r"^activation='gelu': must be 'silu' or ClampedSwiGLU\(alpha, limit\)"),
        (dict(activation=("clamped_swiglu", 1.7, 7.0)), r"^activation=tuple: must be 'silu' or ClampedSwiGLU"),
        (dict(b1=b1[:, :I]), r"^b1: expected shape \(4, 64\), got \(4, 32\)"),
        (dict(b2=b2.double()), r"^b2: expected dtype in \['torch\.float32'\], got torch\.float64"),
        (dict(b2=b2.t().contiguous().t()), r"^b2: must be contiguous"),
    ]
    for kw, msg in cases:
        with pytest.raises(InputError, match=msg) as err:
            fused_moe(x, idx, w, w1t, w2, buf, **kw)
        assert "\n" not in str(err.value)
    for bad, msg in (((float("nan"), 7.0), r"^activation alpha=nan: must be a finite number"),
                     ((1.7, -1.0), r"^activation limit=-1\.0: must be a finite number in 0\.\.")):
        with pytest.raises(InputError, match=msg):
            ClampedSwiGLU(*bad)
    assert check_activation(GPT_OSS) is GPT_OSS


def test_fp8_buffers_refuse_biases_and_other_activations():
    # Checked before any work: the refusal comes before the inputs' own checks, so placeholders do.
    buf = MoEBuffer(16, 4, 2, 128, 128, LoopbackGroup(1), device="cpu", dtype="fp8")
    x = torch.zeros(2, 128)
    idx, w = torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2)
    for kw, arg in ((dict(b1=torch.zeros(4, 256)), "b1"), (dict(b2=torch.zeros(4, 128)), "b2"),
                    (dict(activation=GPT_OSS), "activation")):
        with pytest.raises(InputError, match=rf"^{arg}: an FP8 buffer runs plain SwiGLU experts without biases"):
            fused_moe(x, idx, w, None, None, buf, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("activation", [GPT_OSS, TIGHT, "silu"], ids=["gptoss", "clamped", "silu"])
def test_biases_and_activation_in_bf16_on_the_gpu(activation):
    # The GPU kernel at its default tiles (TMA), BF16, against float64: max|y - ref| / max|ref| <= 1e-2;
    # the layouts agree bit for bit.
    T, E, K, H, I, R = 96, 8, 2, 512, 256, 2
    x, idx, w, l1, l2, b1, b2 = _problem(T, E, K, H, I, R, torch.bfloat16, seed=11)
    ref = _reference(x, idx, w, l1, l2, R, b1, b2, activation)
    x, idx, w, l1, l2, b1, b2 = (t.cuda() for t in (x, idx, w, l1, l2, b1, b2))
    buf = MoEBuffer(T, E, K, H, I, LoopbackGroup(R), device="cuda", dtype="bf16")
    epilogue = dict(b1=b1, b2=b2, activation=activation)
    y = fused_moe(x, idx, w, *transform_weights(l1, l2, buf.cfg.block_n1), buf, **epilogue)
    assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())
    err = float((y.double().cpu() - ref).abs().max() / ref.abs().max())
    assert err <= 1e-2, err
    assert torch.equal(fused_moe(x, idx, w, l1.contiguous(), l2, buf, w1_layout="concatenated", **epilogue), y)
