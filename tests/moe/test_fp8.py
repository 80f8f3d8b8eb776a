"""FP8 (e4m3, DeepSeek-V3 block scales): quantization bounds, the FP8-emulating reference against
float64, bad input, Inf/NaN, the torch FP8 baseline chain and a block-scaled fp8 `tl.dot`."""

import pytest
import torch
import triton
import triton.language as tl

from xstage.errors import InputError
from xstage.moe import baseline
from xstage.moe.baseline import ChainFP8, Unfused
from xstage.moe.fp8 import (
    FP8,
    FP8_ERROR_BOUND,
    FP8_MAX,
    check_fp8_activations,
    check_fp8_weights,
    dequantize_activations,
    dequantize_weights,
    quantize_activations,
    quantize_rowwise,
    quantize_weights,
    reference_moe_fp8,
    scaled_linear,
    to_e4m3,
)
from xstage.moe.problem import Problem
from xstage.moe.reference import reference_moe_virtual

# The accuracy targets: against the float reference on dequantized weights with unquantized
# activations (the recipe's own error), and against an emulation of the same quantization.
FROB_TOL = 6e-2
MAX_TOL = 1e-2


def rel_frob(y, ref):
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def rel_max(y, ref):
    return float((y.double() - ref.double()).abs().max() / ref.double().abs().max())


def wide_range(*shape, seed=0):
    """Normal values times per-row magnitudes over 6 decades, so blocks reach e4m3's subnormals."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (torch.rand(*shape[:-1], 1, generator=g) * 6 - 3)
    return torch.randn(*shape, generator=g) * mag * 10.0 ** (torch.rand(*shape, generator=g) * 4 - 4)


def moe_problem(T, H, I, E, K, seed=0):
    """BF16 tokens, routing, float weights and their 128x128-block FP8 form."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    l1 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    l2 = torch.randn(E, H, I, generator=g) * I**-0.5
    return x, idx, w, (*quantize_weights(l1), *quantize_weights(l2))


SHAPES = [
    pytest.param(16, 128, 128, 2, 1, id="T16-H128-I128-E2-K1"),
    pytest.param(37, 256, 128, 4, 2, id="T37-H256-I128-E4-K2"),
    pytest.param(23, 384, 256, 5, 3, id="T23-H384-I256-E5-K3"),
]


# --- formats ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,H", [(1, 128), (5, 384), (3, 200)], ids=["T1-H128", "T5-H384", "T3-H200"])
def test_activation_scales_are_float32_per_token_per_128_channels(T, H):
    x8, xs = quantize_activations(torch.randn(T, H, dtype=torch.bfloat16))
    assert x8.dtype == FP8 and x8.shape == (T, H) and x8.is_contiguous()
    assert xs.dtype == torch.float32 and xs.shape == (T, -(-H // 128)) and xs.is_contiguous()


@pytest.mark.parametrize("E,N,K", [(1, 128, 128), (3, 256, 384), (2, 200, 130)],
                         ids=["E1-N128-K128", "E3-N256-K384", "E2-N200-K130"])
def test_weight_scales_are_float32_per_128x128_block(E, N, K):
    w8, ws = quantize_weights(torch.randn(E, N, K))
    assert w8.dtype == FP8 and w8.shape == (E, N, K)
    assert ws.dtype == torch.float32 and ws.shape == (E, -(-N // 128), -(-K // 128))
    assert dequantize_weights(w8, ws).shape == (E, N, K)


def bound(x, scale_per_elem):
    """`max(2^-4 |x|, 2^-10 s)`: half an ulp in e4m3's normal range, half the subnormal step below it."""
    rel, sub = FP8_ERROR_BOUND
    return torch.maximum(rel * x.abs(), sub * scale_per_elem)


def test_activation_round_trip_error_is_within_half_an_e4m3_ulp():
    x = wide_range(64, 384)
    x8, xs = quantize_activations(x)
    s = xs.repeat_interleave(128, dim=1)
    err = (dequantize_activations(x8, xs) - x).abs()
    b = bound(x, s)
    # float32 rounding of x / s and of q * s adds a few 2^-24 relative.
    assert bool((err <= b * (1 + 1e-6) + 1e-6 * x.abs()).all())
    assert float((err / b).max()) > 0.5  # the bound is tight, not vacuous
    assert bool((err <= 2.0**-4 * s * FP8_MAX + 1e-30).all())  # coarser: 2^-4 of the block max
    assert bool(((x.abs() < 2.0**-6 * s) & (x != 0)).any())  # the subnormal branch was exercised


def test_weight_round_trip_error_is_within_half_an_e4m3_ulp():
    w = wide_range(2, 256, 200, seed=1)
    w8, ws = quantize_weights(w)
    s = ws.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)[:, :256, :200]
    err = (dequantize_weights(w8, ws) - w).abs()
    b = bound(w, s)
    assert bool((err <= b * (1 + 1e-6) + 1e-6 * w.abs()).all())
    assert float((err / b).max()) > 0.5


def test_each_blocks_largest_value_maps_to_448_and_back():
    x = torch.randn(8, 256) * 3
    x8, xs = quantize_activations(x)
    amax = x.abs().reshape(8, 2, 128).amax(-1)
    assert torch.equal(x8.float().abs().reshape(8, 2, 128).amax(-1), torch.full((8, 2), FP8_MAX))
    torch.testing.assert_close(xs * FP8_MAX, amax, rtol=1e-6, atol=0)
    back = dequantize_activations(x8, xs).abs().reshape(8, 2, 128).amax(-1)
    torch.testing.assert_close(back, amax, rtol=1e-6, atol=0)


def test_cast_saturates_instead_of_overflowing():
    v = torch.tensor([1000.0, -1e30, 449.0, 464.0, -470.0, 448.0, 0.5])
    assert to_e4m3(v).float().tolist() == [448.0, -448.0, 448.0, 448.0, -448.0, 448.0, 0.5]


def test_zero_blocks_get_scale_one_and_stay_zero():
    x = torch.randn(4, 384)
    x[1] = 0
    x[2, 128:256] = 0
    x8, xs = quantize_activations(x)
    assert xs[1].tolist() == [1.0, 1.0, 1.0] and float(xs[2, 1]) == 1.0
    assert float(dequantize_activations(x8, xs)[1].abs().max()) == 0.0
    w = torch.randn(2, 256, 256)
    w[1, :128, 128:] = 0
    w8, ws = quantize_weights(w)
    assert float(ws[1, 0, 1]) == 1.0
    assert bool(torch.isfinite(dequantize_weights(w8, ws)).all())
    assert float(dequantize_weights(w8, ws)[1, :128, 128:].abs().max()) == 0.0


def test_rowwise_scales_cover_whole_rows():
    w = torch.randn(3, 64, 256)
    w8, ws = quantize_rowwise(w)
    assert ws.shape == (3, 64) and ws.dtype == torch.float32
    torch.testing.assert_close(ws * FP8_MAX, w.abs().amax(-1), rtol=1e-6, atol=0)


# --- the FP8-emulating reference -------------------------------------------------------------------

def q64(t, cols):
    """Independent 1xcols quantization in float64: amax / 448 scales, saturating e4m3 values."""
    T, C = t.shape
    b = t.reshape(T, C // cols, cols)
    s = b.abs().amax(-1, keepdim=True) / 448.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    return ((b / s).clamp(-448, 448).to(FP8).double() * s).reshape(T, C)


def emulate64(x, idx, w, l1, l1s, l2, l2s):
    """The FP8 layer in float64 with the same quantization steps, written out independently."""
    W1, W2 = dequantize_weights(l1, l1s).double(), dequantize_weights(l2, l2s).double()
    inter = W2.shape[2]
    xq = q64(x.double(), 128)
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            h = xq[t:t + 1] @ W1[e].t()
            act = h[:, :inter] * torch.sigmoid(h[:, :inter]) * h[:, inter:]
            y[t] += float(w[t, k]) * (q64(act, 128) @ W2[e].t())[0]
    return y


@pytest.mark.parametrize("T,H,I,E,K", SHAPES)
def test_reference_meets_the_accuracy_targets(T, H, I, E, K):
    x, idx, w, (l1, l1s, l2, l2s) = moe_problem(T, H, I, E, K)
    y = reference_moe_fp8(x, idx, w, l1, l1s, l2, l2s)
    assert y.dtype == torch.bfloat16 and y.shape == (T, H) and bool(torch.isfinite(y).all())
    # Float64 layer on the dequantized weights, activations left unquantized: the recipe's own error.
    ref = reference_moe_virtual([x.double()], [idx], [w.double()], [dequantize_weights(l1, l1s).double()],
                                [dequantize_weights(l2, l2s).double()], dtype=torch.float64)[0]
    assert rel_frob(y, ref) <= FROB_TOL
    assert rel_max(y, emulate64(x, idx, w, l1, l1s, l2, l2s)) <= MAX_TOL


def test_scaled_linear_is_the_sum_over_k_blocks_of_dequantized_products():
    x8, xs = quantize_activations(torch.randn(9, 384))
    w8, ws = quantize_weights(torch.randn(1, 256, 384))
    got = scaled_linear(x8, xs, w8[0], ws[0])
    want = sum((x8[:, k:k + 128].double() * xs[:, k // 128, None].double())
               @ (w8[0, :, k:k + 128].double() * ws[0, :, k // 128].repeat_interleave(128)[:, None].double()).t()
               for k in range(0, 384, 128))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_prequantized_activations_give_the_same_output():
    x, idx, w, (l1, l1s, l2, l2s) = moe_problem(11, 256, 128, 3, 2, seed=3)
    x8, xs = quantize_activations(x)
    assert torch.equal(reference_moe_fp8(x8, idx, w, l1, l1s, l2, l2s, x_scale=xs),
                       reference_moe_fp8(x, idx, w, l1, l1s, l2, l2s))


def test_inf_and_nan_propagate_to_their_token_only():
    x, idx, w, (l1, l1s, l2, l2s) = moe_problem(6, 256, 128, 3, 2, seed=4)
    x = x.clone()
    x[1, 5] = float("inf")
    x[3, 200] = float("nan")
    x[4, 7] = float("-inf")
    x8, xs = quantize_activations(x)
    deq = dequantize_activations(x8, xs)
    assert bool(deq[1, :128].isnan().all()) and bool(torch.isfinite(deq[1, 128:]).all())
    y = reference_moe_fp8(x, idx, w, l1, l1s, l2, l2s)
    bad = [1, 3, 4]
    assert bool(y[bad].isnan().all())
    assert bool(torch.isfinite(y[[0, 2, 5]]).all())


# --- bad input -------------------------------------------------------------------------------------

def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _cases():
    x, idx, w, (l1, l1s, l2, l2s) = moe_problem(4, 256, 128, 2, 2)
    x8, xs = quantize_activations(x)
    base = dict(x=x, topk_idx=idx, topk_w=w, l1=l1, l1_scale=l1s, l2=l2, l2_scale=l2s)
    i64, i64s = quantize_weights(torch.randn(2, 128, 256))
    h192, h192s = quantize_weights(torch.randn(2, 256, 192))
    return base, [
        ("l1-intermediate-64", dict(l1=i64, l1_scale=i64s), r"l1: intermediate size 64 .*multiple of 128"),
        ("l1-hidden-192", dict(l1=h192, l1_scale=h192s), r"l1: hidden size 192 .*multiple of 128"),
        ("l1-not-fp8", dict(l1=l1.float()), r"l1: dtype torch.float32, expected torch.float8_e4m3fn"),
        ("l1-no-scales", dict(l1_scale=None), r"l1_scale: FP8 l1 needs its scales"),
        ("l2-no-scales", dict(l2_scale=None), r"l2_scale: FP8 l2 needs its scales"),
        ("l1-scale-shape", dict(l1_scale=l1s[:, :1]), r"l1_scale: shape \(2, 1, 2\), expected \(2, 2, 2\)"),
        ("l2-scale-dtype", dict(l2_scale=l2s.bfloat16()), r"l2_scale: dtype torch.bfloat16, expected torch.float32"),
        ("l1-scale-device", dict(l1_scale=_meta(l1s)), r"l1_scale: on meta, expected cpu"),
        ("l2-device", dict(l2=_meta(l2), l2_scale=_meta(l2s)), r"l2: on meta, expected cpu"),
        ("l1-non-contiguous", dict(l1=l1.transpose(1, 2).contiguous().transpose(1, 2)),
         r"l1: must be contiguous"),
        ("l2-scale-non-contiguous", dict(l2_scale=torch.cat([l2s, l2s], 2)[:, :, :1]),
         r"l2_scale: must be contiguous"),
        ("l2-mismatch", dict(zip(("l2", "l2_scale"), quantize_weights(torch.randn(2, 128, 256)))),
         r"l2: shape \(2, 128, 256\), expected \(2, 256, 128\)"),
        ("x-fp8-no-scale", dict(x=x8), r"x_scale: FP8 x needs its scales"),
        ("x-scale-shape", dict(x=x8, x_scale=xs[:, :1].contiguous()), r"x_scale: shape \(4, 1\), expected \(4, 2\)"),
        ("x-scale-with-bf16-x", dict(x_scale=xs), r"x_scale: only goes with FP8 x"),
        ("x-hidden", dict(x=x[:, :128]), r"x: hidden size 128, expected 256"),
        ("x-device", dict(x=_meta(x)), r"x: on meta, expected cpu"),
        ("topk-idx-range", dict(topk_idx=idx + 5), r"topk_idx: expert id \d+ is outside \[0, 2\)"),
        ("topk-w-shape", dict(topk_w=w[:, :1]), r"topk_w: expected shape \(4, 2\)"),
    ]


_BASE, _BAD = _cases()


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in _BAD])
def test_reference_refuses_bad_input_naming_the_argument(case):
    _, change, match = case
    with pytest.raises(InputError, match=match) as info:
        reference_moe_fp8(**dict(_BASE, **change))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("call,match", [
    (lambda: check_fp8_activations(*quantize_activations(torch.randn(2, 200))),
     r"x: hidden size 200 must be a multiple"),
    (lambda: check_fp8_activations(torch.randn(2, 128), None, "tokens"), r"tokens: dtype torch.float32"),
    (lambda: check_fp8_activations(quantize_activations(torch.randn(2, 128))[0], None), r"x_scale: FP8 x needs"),
    (lambda: check_fp8_activations(torch.zeros(2, 2, 128, dtype=FP8), None), r"x: expected 2-d"),
    (lambda: check_fp8_activations(*quantize_activations(torch.randn(2, 128)), hidden=256), r"x: hidden size 128, "),
    (lambda: check_fp8_activations(*quantize_activations(torch.randn(2, 128)), device="meta"),
     r"x: on cpu, expected meta"),
    (lambda: check_fp8_weights(*quantize_weights(torch.randn(1, 200, 128)), "w1"), r"w1: dim 1 \(N\) = 200"),
    (lambda: check_fp8_weights(*quantize_weights(torch.randn(1, 128, 64)), "w1"), r"w1: dim 2 \(K\) = 64"),
    (lambda: check_fp8_weights(quantize_weights(torch.randn(1, 128, 128))[0], "scales", "w1"),
     r"w1_scale: expected a float32 tensor"),
    (lambda: check_fp8_weights(torch.zeros(128, 128, dtype=FP8), None, "w1"), r"w1: expected 3-d"),
])
def test_checks_refuse_bad_input_naming_the_argument(call, match):
    with pytest.raises(InputError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_checks_accept_what_the_quantizers_make():
    check_fp8_activations(*quantize_activations(torch.randn(3, 256)), hidden=256, device="cpu")
    check_fp8_weights(*quantize_weights(torch.randn(2, 256, 384)), "l1", device="cpu")


# --- the torch FP8 baseline chain ------------------------------------------------------------------

def emulated_scaled_grouped_mm(a8, b8, scale_a, scale_b, offs, out_dtype):
    """`torch._scaled_grouped_mm` (rowwise scales, 2-d x 3-d) in float32: a stand-in to run ChainFP8 on CPU."""
    out = torch.empty(a8.shape[0], b8.shape[2], dtype=out_dtype, device=a8.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        a = a8[start:end].float() * scale_a[start:end, None]
        out[start:end] = (a @ (b8[g].float() * scale_b[g][None, :])).to(out_dtype)
        start = end
    return out


def chain_errors(pb, y):
    """`y` (ChainFP8's combined output) against the float64 layer on the problem's weights with
    unquantized activations; the block-scaled FP8 reference against the float64 layer on its
    dequantized weights (the issue's target); `y` against the FP8 reference."""
    x, idx, w = pb.x.double().cpu(), pb.idx.cpu(), pb.w.double().cpu()
    l1, l2 = pb.l1.float().cpu(), pb.l2.float().cpu()
    q1, q2 = quantize_weights(l1), quantize_weights(l2)

    def float_ref(a, b):
        return reference_moe_virtual([x], [idx], [w], [a.double()], [b.double()], dtype=torch.float64)[0]

    fp8 = reference_moe_fp8(pb.x.cpu(), idx, pb.w.cpu(), *q1, *q2)
    return (rel_frob(y.cpu(), float_ref(l1, l2)),
            rel_frob(fp8, float_ref(dequantize_weights(*q1), dequantize_weights(*q2))),
            rel_frob(y.cpu(), fp8))


# Rowwise scales are coarser than 1x128 / 128x128 blocks (a whole row shares one scale, so more of it
# falls into e4m3's subnormals): that recipe's own error sits above the issue's 6e-2 block-scaled target
# (about 6.5% in the CPU emulation below), so the chain gets its own bound.
CHAIN_FROB_TOL = 8e-2


def test_fp8_chain_refuses_a_device_without_scaled_grouped_mm():
    pb = Problem("H256-I128-E4-K2", 8, 1, "hbm", device="cpu", dtype="fp8")  # bf16 x and weights; no bf16 buffer on CPU
    with pytest.raises(InputError, match=r"device=cpu: the FP8 chain needs torch._scaled_grouped_mm"):
        ChainFP8(Unfused(pb, "hbm"))


def test_fp8_chain_with_an_emulated_grouped_gemm(monkeypatch):
    monkeypatch.setattr(baseline, "_scaled_grouped_mm_or_refuse", lambda device: emulated_scaled_grouped_mm)
    pb = Problem("H256-I128-E4-K2", 48, 1, "hbm", device="cpu", dtype="fp8")
    ch = ChainFP8(Unfused(pb, "hbm"))
    out = ch.chain(ch.x_sorted)
    assert out.dtype == torch.bfloat16 and out.shape == (pb.T * pb.K, pb.H)
    to_float, fp8_to_float, _ = chain_errors(pb, ch.combine(out))
    assert to_float <= CHAIN_FROB_TOL and fp8_to_float <= FROB_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("shape,tokens", [("H512-I256-E8-K2", 256), ("H1024-I512-E16-K4", 500)],
                         ids=["H512-I256-E8-K2-T256", "H1024-I512-E16-K4-T500"])
def test_fp8_chain_on_gpu_against_the_references(shape, tokens):
    pb = Problem(shape, tokens, 1, "hbm", device="cuda", dtype="bf16")
    ch = ChainFP8(Unfused(pb, "hbm"))
    y = ch.combine(ch.chain(ch.x_sorted))
    assert bool(torch.isfinite(y).all())
    to_float, fp8_to_float, to_fp8 = chain_errors(pb, y)
    assert to_float <= CHAIN_FROB_TOL, (to_float, fp8_to_float, to_fp8)
    assert fp8_to_float <= FROB_TOL
    # Each GEMM against the same rowwise quantization emulated in float32, on the device's own
    # inputs: only accumulation order and rounding may differ.
    h = ch._gemm(ch.x_sorted, ch.w1, ch.s1)
    act = torch.nn.functional.silu(h[:, :pb.I]) * h[:, pb.I:]
    for a, out, w8, ws in ((ch.x_sorted, h, ch.w1, ch.s1), (act, ch._gemm(act, ch.w2, ch.s2), ch.w2, ch.s2)):
        a8, sa = quantize_rowwise(a)
        emu = emulated_scaled_grouped_mm(a8, w8.transpose(-2, -1), sa, ws, ch.offs, torch.bfloat16)
        assert rel_max(out, emu) <= MAX_TOL


# --- block-scaled fp8 tl.dot (the kernel's inner step) ---------------------------------------------

@triton.jit
def _scaled_dot_kernel(p_a, p_as, p_b, p_bs, p_c, M, N, K, NKB,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n = o_m < M, o_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(NKB):
        b_a = tl.load(p_a + o_m[:, None].to(tl.int64) * K + kb * BK + o_k[None, :], mask=m_m[:, None], other=0.0)
        b_b = tl.load(p_b + o_n[None, :].to(tl.int64) * K + kb * BK + o_k[:, None], mask=m_n[None, :], other=0.0)
        b_as = tl.load(p_as + o_m * NKB + kb, mask=m_m, other=0.0)  # [BM]: 1x128 activation scales
        b_bs = tl.load(p_bs + (i_n * BN // 128) * NKB + kb)  # one 128x128 weight block per BN <= 128 columns
        # The raw e4m3 product accumulates in float32 per K block; the scales apply once per block.
        acc += tl.dot(b_a, b_b, out_dtype=tl.float32) * (b_as[:, None] * b_bs)  # [BM, BN]
    tl.store(p_c + o_m[:, None].to(tl.int64) * N + o_n[None, :], acc, mask=m_m[:, None] & m_n[None, :])


# BM >= 64: on Hopper an fp8 dot runs on wgmma, whose tiles have 64 rows.
@pytest.mark.parametrize("M,N,K,BM,BN", [(96, 128, 256, 64, 64), (20, 256, 384, 64, 128)],
                         ids=["M96-N128-K256", "M20-N256-K384"])
def test_block_scaled_fp8_dot_in_triton_matches_the_emulation(device, M, N, K, BM, BN):
    x8, xs = quantize_activations(torch.randn(M, K) * 3)
    w8, ws = quantize_weights(torch.randn(1, N, K))
    x8, xs, w8, ws = (t.to(device) for t in (x8, xs, w8[0], ws[0]))
    c = torch.full((M, N), float("nan"), device=device)  # an unwritten tile fails
    _scaled_dot_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](x8, xs, w8, ws, c, M, N, K, K // 128,
                                                                 BM=BM, BN=BN, BK=128)
    torch.testing.assert_close(c.cpu(), scaled_linear(x8.cpu(), xs.cpu(), w8.cpu(), ws.cpu()), rtol=1e-5, atol=1e-4)
