"""FP8 tile functions of the fused MoE kernel (`xstage.moe.kernels_fp8`): one LINEAR1 and one LINEAR2
task each, against independent float64 references on the dequantized operands (CPU: Triton's
interpreter; `cuda`: a GPU, BM = 64 since Hopper's fp8 dot runs on wgmma tiles of 64 rows)."""

import os

import pytest
import torch
import triton
import triton.language as tl

from xstage.moe.fp8 import BLOCK, FP8, FP8_ERROR_BOUND, quantize_activations, scaled_linear
from xstage.moe.kernels_fp8 import _linear1_fp8, _linear2_fp8_acc

DEVICES = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                           reason="Triton's interpreter is off (a GPU is present)")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
H, I, E = 256, 256, 2
U, EXPERT, PROW = 2, 1, 7  # the task's unit, its expert (> 0) and its pool slot's first row
# A code may differ from the reference's where the reference value (in units of the scale, <= 448)
# lies this close to the rounding tie between the two codes: float32 accumulation and SwiGLU error,
# ~2^-23 relative to the row's largest |h| times a growth margin, times 448 scaled units.
TIE_TOL = 448 * 2.0**-23 * 64


@triton.jit
def _linear1_task(p_unit, p_recv, p_recv_scale, p_w1, p_w1_scale, p_act, p_act_scale, p_ready, H, I,
                  BM: tl.constexpr, BN1: tl.constexpr, BK: tl.constexpr, USE_PTX: tl.constexpr):
    # The task's fields come from memory, as _run_task loads them from the task and unit tables.
    u, e, prow = tl.load(p_unit), tl.load(p_unit + 1), tl.load(p_unit + 2)
    n_rows, nb = tl.load(p_unit + 3), tl.load(p_unit + 4)
    # Pointer loads (TMA=False); the descriptor arguments are unused then. The TMA path runs in the
    # fused layer's tests (tests/moe/test_fused_fp8.py). USE_PTX on a GPU: the hardware's e4m3 cast. The
    # interleaved layout (W1_CONCAT=False); the checkpoint's own layout is tested there too.
    _linear1_fp8(u, e, prow, n_rows, nb, p_recv, p_recv, p_recv_scale, p_w1, p_w1, p_w1_scale, p_act, p_act_scale,
                 p_ready, H, I, BM, BN1, BK, False, USE_PTX, False)


@triton.jit
def _linear2_task(p_unit, p_act, p_act_scale, p_w2, p_w2_scale, p_out, H, I,
                  BM: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr):
    e, prow = tl.load(p_unit + 1), tl.load(p_unit + 2)
    n_rows, nb = tl.load(p_unit + 3), tl.load(p_unit + 4)
    acc = _linear2_fp8_acc(e, prow, n_rows, nb, p_act, p_act, p_act_scale, p_w2, p_w2, p_w2_scale, H, I, BM, BN2, BK,
                           False, 2)
    o_m, o_n = tl.arange(0, BM), tl.arange(0, BN2)
    tl.store(p_out + o_m[:, None] * BN2 + o_n[None, :], acc)  # the whole tile, masked rows included


def tile_m(device):
    return 16 if device == "cpu" else 64


def unit(n_rows, nb, device):
    return torch.tensor([U, EXPERT, PROW, n_rows, nb], dtype=torch.int32, device=device)


def deq64(q, s, rows):
    """float64 dequantization (float32 `q * s` is not exact: 4 significant bits times 24)."""
    return q.double() * s.double().repeat_interleave(rows, -2).repeat_interleave(BLOCK, -1)


def interleave(gate, up, rows):
    """`[E, N, ...]` gate and up -> `[E, 2N, ...]`: gate block j of `rows` rows, then up block j, ..."""
    e, n, *rest = gate.shape
    parts = [t.reshape(e, n // rows, rows, *rest) for t in (gate, up)]
    return torch.stack(parts, 2).reshape(e, 2 * n, *rest).contiguous()


def ordinal(codes):
    """e4m3 bytes -> integers in value order (one apart = one e4m3 step; +0 and -0 both 0)."""
    c = codes.view(torch.uint8).int()
    return torch.where(c >= 128, 128 - c, c)


def act_mismatch(q, s, q_ref, s_ref, v_ref):
    """None if codes `q` and scales `s` match the reference's, else what differs. `v_ref`: the
    reference's values in units of its scale, before rounding to e4m3."""
    if not torch.allclose(s, s_ref, rtol=1e-5, atol=0):
        return f"scales differ by up to {float(((s - s_ref) / s_ref).abs().max()):.2e} relative"
    off = ordinal(q) != ordinal(q_ref)
    if int((ordinal(q) - ordinal(q_ref)).abs().max()) > 1:
        return "a code is more than one e4m3 step off"
    if off.float().mean() > 0.01:
        return f"{int(off.sum())} of {off.numel()} codes differ"
    tie = (q.double() + q_ref.double()) / 2  # the rounding tie between the two neighbouring codes
    if bool(((v_ref - tie).abs() > TIE_TOL)[off].any()):
        return "a code differs away from a rounding tie"
    return None


def small_codes(shape, g):
    """e4m3 codes of the integers -8..8. Hopper's FP8 MMA does not keep a float32 sum inside one dot
    (`benchmarks/results/h200-fp8-dot/`: 9.6-12 bits of the sum of |terms| at K = 128), but it is
    exact while every partial sum is: with these codes a 128-term sum stays within +-8192. So the
    tests can hold the tile functions to float32 exactness on the GPU as in the interpreter; the
    scales (float32, over decades) carry the values' range."""
    return torch.randint(-8, 9, shape, generator=g).float().to(FP8)


def block_scales(shape, g, base):
    """float32 scales spread over two decades around `base`."""
    return base * 10.0 ** (torch.rand(shape, generator=g) * 2 - 1)


def linear1_problem(BM, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = PROW + BM + 3
    x8 = small_codes((P, H), g)
    xs = block_scales((P, H // BLOCK), g, 1.0) * 10.0 ** (torch.rand(P, 1, generator=g) * 4 - 2)  # 4 decades of rows
    x8[PROW + 2], xs[PROW + 2] = 0, 1.0  # an all-zero token row: scale 1, codes 0
    wg8, wgs = small_codes((E, I, H), g), block_scales((E, I // BLOCK, H // BLOCK), g, H**-0.5 / 4)
    wu8, wus = small_codes((E, I, H), g), block_scales((E, I // BLOCK, H // BLOCK), g, H**-0.5 / 4)
    w1 = interleave(wg8.view(torch.uint8), wu8.view(torch.uint8), BLOCK).view(FP8)  # the kernel's layout
    w1s = interleave(wgs, wus, 1)
    return x8, xs, (wg8, wgs, wu8, wus), w1, w1s


def linear1_reference(x8, xs, gate_up, n_rows, nb, e=EXPERT):
    """float64 products of the dequantized operands, SwiGLU, then fp8's 1x128 quantization."""
    wg8, wgs, wu8, wus = gate_up
    a = deq64(x8, xs, 1)[PROW:PROW + n_rows]
    cols = slice(nb * BLOCK, (nb + 1) * BLOCK)
    g, u = (a @ deq64(w8, ws, BLOCK)[e, cols].T for w8, ws in ((wg8, wgs), (wu8, wus)))
    h = g * torch.sigmoid(g) * u
    q_ref, s_ref = quantize_activations(h)
    return h, q_ref, s_ref, h / s_ref.double()


# The interpreter's sigmoid takes exp(-g) in float32, which overflows to inf for the large rows' g < -88
# and gives the right limit (sigmoid 0), as the GPU's does.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nb", [1, 0])
def test_linear1_fp8_matches_the_float64_reference_and_touches_only_its_block(device, nb):
    BM = tile_m(device)
    n_rows = BM - 5
    x8, xs, gate_up, w1, w1s = linear1_problem(BM)
    P = x8.shape[0]
    act = torch.full((P, I), -3.0).to(FP8)  # a sentinel: every byte outside the task's block must stay
    act_s = torch.full((P, I // BLOCK), -7.0)
    ready = torch.zeros(4, dtype=torch.int32)
    dev = [t.to(device, copy=True) for t in (x8, xs, w1, w1s, act, act_s, ready)]  # keep act, act_s as they were
    _linear1_task[(1,)](unit(n_rows, nb, device), *dev, H, I, BM=BM, BN1=128, BK=128, USE_PTX=device != "cpu")
    act_k, act_s_k, ready_k = (t.cpu() for t in dev[4:])
    rows, cols = slice(PROW, PROW + n_rows), slice(nb * BLOCK, (nb + 1) * BLOCK)
    q, s = act_k[rows, cols], act_s_k[rows, nb:nb + 1]

    h, q_ref, s_ref, v_ref = linear1_reference(x8, xs, gate_up, n_rows, nb)
    assert act_mismatch(q, s, q_ref, s_ref, v_ref) is None, act_mismatch(q, s, q_ref, s_ref, v_ref)
    assert float(s[2]) == 1.0 and not bool(q[2].float().any())  # the all-zero row
    # Dequantized, each value is within half an e4m3 step of the unquantized SwiGLU output.
    err = (q.double() * s.double() - h).abs()
    bound = torch.maximum(FP8_ERROR_BOUND[0] * h.abs(), FP8_ERROR_BOUND[1] * s.double())
    assert bool((err <= bound * 1.001 + 1e-30).all())
    # The checks can fail: a slightly wrong scale, a code two steps off, the wrong expert's weights.
    assert act_mismatch(q, s * (1 + 1e-4), q_ref, s_ref, v_ref) is not None
    q_off = q.view(torch.uint8).clone()
    q_off[0, 5] ^= 2
    assert act_mismatch(q_off.view(FP8), s, q_ref, s_ref, v_ref) is not None
    assert act_mismatch(q, s, *linear1_reference(x8, xs, gate_up, n_rows, nb, e=0)[1:]) is not None

    # Nothing else was written: other rows, the other column block, their scales.
    written = torch.zeros(P, I, dtype=torch.bool)
    written[rows, cols] = True
    assert torch.equal(act_k.view(torch.uint8)[~written], act.view(torch.uint8)[~written])
    written_s = torch.zeros(P, I // BLOCK, dtype=torch.bool)
    written_s[rows, nb] = True
    assert torch.equal(act_s_k[~written_s], act_s[~written_s])
    assert ready_k.tolist() == [0, 0, 1, 0]  # the unit's readiness counter went up by one


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("BN2,nb", [(64, 3), (64, 0), (128, 1)], ids=["BN64-last", "BN64-first", "BN128-last"])
@pytest.mark.parametrize("I", [I, I + BLOCK], ids=["K-pairs", "K-pairs+1"])  # the loop takes K blocks in pairs
def test_linear2_fp8_acc_matches_the_float64_reference(device, BN2, nb, I):
    BM = tile_m(device)
    n_rows = BM - 5
    g = torch.Generator().manual_seed(1)
    P = PROW + BM
    a8 = small_codes((P, I), g)
    a_s = block_scales((P, I // BLOCK), g, 1.0) * 10.0 ** (torch.rand(P, 1, generator=g) * 4 - 2)
    w8, ws = small_codes((E, H, I), g), block_scales((E, H // BLOCK, I // BLOCK), g, I**-0.5 / 4)
    out = torch.full((BM, BN2), float("nan"), device=device)  # an unwritten tile fails
    _linear2_task[(1,)](unit(n_rows, nb, device), *(t.to(device) for t in (a8, a_s, w8, ws)), out, H, I,
                        BM=BM, BN2=BN2, BK=128)
    out = out.cpu()
    rows, cols = slice(PROW, PROW + n_rows), slice(nb * BN2, (nb + 1) * BN2)

    def close(ref):
        return float((out[:n_rows].double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())

    assert close(deq64(a8, a_s, 1)[rows] @ deq64(w8, ws, BLOCK)[EXPERT, cols].T)
    assert close(scaled_linear(a8[rows], a_s[rows], w8[EXPERT], ws[EXPERT])[:, cols].double())
    assert not bool(out[n_rows:].any())  # rows past n_rows accumulate nothing
    # The check can fail: the tile's weight-scale row off by 1%.
    ws_off = ws.clone()
    ws_off[EXPERT, nb * BN2 // BLOCK] *= 1.01
    assert not close(deq64(a8, a_s, 1)[rows] @ deq64(w8, ws_off, BLOCK)[EXPERT, cols].T)
    # ... or the last K block's activation scales off by 1% (with an odd count, the block after the pairs).
    a_s_off = a_s.clone()
    a_s_off[:, -1] *= 1.01
    assert not close(deq64(a8, a_s_off, 1)[rows] @ deq64(w8, ws, BLOCK)[EXPERT, cols].T)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which,sizes,message", [
    ("linear1", dict(BN1=64, BK=128), "BN1 must be 128"),
    ("linear1", dict(BN1=128, BK=64), "BK must be 128"),
    ("linear2", dict(BN2=64, BK=64), "BK must be 128"),
    ("linear2", dict(BN2=256, BK=128), "BN2 must divide 128"),
], ids=["L1-BN64", "L1-BK64", "L2-BK64", "L2-BN256"])
def test_tile_sizes_off_the_scale_blocks_fail_to_compile(device, which, sizes, message):
    # The interpreter raises the static_assert as an AssertionError wrapped in an InterpreterError,
    # the compiler as a CompilationError; the message pins it to the assertion.
    BM = tile_m(device)
    x8, xs, _, w1, w1s = (t.to(device) if isinstance(t, torch.Tensor) else t for t in linear1_problem(BM))
    u = unit(3, 0, device)
    with pytest.raises(Exception) as failure:
        if which == "linear1":
            act, act_s = torch.zeros_like(x8), torch.zeros_like(xs)
            ready = torch.zeros(4, dtype=torch.int32, device=device)
            _linear1_task[(1,)](u, x8, xs, w1, w1s, act, act_s, ready, H, I, BM=BM, USE_PTX=False, **sizes)
        else:
            out = torch.zeros(BM, sizes["BN2"], device=device)
            _linear2_task[(1,)](u, x8, xs, w1, w1s, out, H, I, BM=BM, **sizes)
    # the message may sit in the exception or in one it was raised from (the GPU compiler wraps it)
    chain, e = [], failure.value
    while e is not None and len(chain) < 8:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    assert any(message in text for text in chain), "\n".join(chain)
