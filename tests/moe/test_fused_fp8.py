"""The fused MoE layer on an FP8 buffer under Triton's interpreter: e4m3 rows and weights with the
DeepSeek-V3 scales, against the FP8-emulating reference (`xstage.moe.fp8.reference_moe_fp8`)."""

import dataclasses

import pytest
import torch

from xstage.errors import InputError
from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer, fused_moe, transform_weights
from xstage.moe.fp8 import FP8, expert_mlp_fp8, quantize_activations, quantize_weights, reference_moe_fp8
from xstage.spec.moe import FP8_BLOCK_CONFIG

CFG = BlockConfig(block_m=16, block_n1=128, block_n2=64, block_k=128, block_d=128, tma=False)
SCHEDULES = ["expert_wave", "interleaved", "lag:1"]
TOL = 1e-2  # the accuracy target: max |y - ref| / max |ref|


def _problem(T, E, K, H, I, R, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 10.0 ** (torch.rand(T, 1, generator=g) * 2 - 1)).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    l1, s1 = quantize_weights(torch.randn(E // R, 2 * I, H, generator=g) * H**-0.5)
    l2, s2 = quantize_weights(torch.randn(E // R, H, I, generator=g) * I**-0.5)
    return x, idx, w, (l1, s1, l2, s2)


def _reference(x, idx, w, weights, R):
    """Rank 0 of a loopback group: every rank holds the same local experts, so expert e computes with
    local expert e % E_local (`xstage.moe.reference.loopback_inputs`)."""
    return reference_moe_fp8(x, idx, w, *(t.repeat(R, 1, 1) for t in weights)).double()


def _rel_err(y, ref):
    return float((y.double() - ref).abs().max() / ref.abs().max())


def _within_bf16_rounding(y, x, idx, w, weights, R, ulp):
    """|y - ref| <= ulp x (sum_k w_k |c_k| + |ref|): the combine rows c_k and y are each rounded to BF16
    once, in the reference by round-to-nearest, in the kernel by the platform's cast (Triton's
    interpreter does not round fp32 -> bf16 to nearest: up to one ulp, 2^-7 relative; the GPU half
    an ulp, 2^-8). Every other step matches the reference bit for bit (same quantization)."""
    ref = _reference(x, idx, w, weights, R)
    l1, s1, l2, s2 = (t.repeat(R, 1, 1) for t in weights)
    x8, xs = quantize_activations(x)
    mag = torch.zeros_like(ref)
    for k in range(idx.shape[1]):
        for e in idx[:, k].unique().tolist():
            t = torch.nonzero(idx[:, k] == e).flatten()
            c = expert_mlp_fp8(x8[t], xs[t], l1[e], s1[e], l2[e], s2[e]).double()
            mag[t] += w[t, k, None].double() * c.abs()
    bound = ulp * (mag + ref.abs()) + 1e-6 * float(ref.abs().max())
    return bool(((y.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("T,E,K,H,I,R,path", [(11, 4, 2, 256, 256, 2, "hbm"), (7, 8, 3, 384, 128, 4, "host"),
                                              (9, 2, 2, 128, 256, 1, "hbm")],
                         ids=["T11-E4-K2-H256-I256-R2-hbm", "T7-E8-K3-H384-I128-R4-host", "T9-E2-K2-H128-I256-R1"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_fp8_layer_matches_the_fp8_reference_and_schedules_are_bitwise_equal(T, E, K, H, I, R, path, tma):
    x, idx, w, weights = _problem(T, E, K, H, I, R, seed=T + E)
    buf = MoEBuffer(16, E, K, H, I, LoopbackGroup(R, path=path), device="cpu", dtype="fp8",
                    config=dataclasses.replace(CFG, tma=tma))
    l1, s1, l2, s2 = weights
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1, s1, s2)
    ref = _reference(x, idx, w, weights, R)
    outs = {}
    for s in SCHEDULES:
        buf.combine.fill_(float("nan"))  # a combine row nobody wrote poisons y
        outs[s] = fused_moe(x, idx, w, w1t, w2, buf, schedule=s)
        assert outs[s].dtype == torch.bfloat16 and not bool(outs[s].isnan().any())
        assert _rel_err(outs[s], ref) <= 2 * TOL, s  # the interpreter's BF16 cast: see _within_bf16_rounding
        assert _within_bf16_rounding(outs[s], x, idx, w, weights, R, ulp=2.0**-7), s
    for s in SCHEDULES[1:]:
        assert torch.equal(outs[s], outs[SCHEDULES[0]]), s
    # pre-quantized rows give the same result as BF16 rows quantized inside
    assert torch.equal(fused_moe(quantize_activations(x), idx, w, w1t, w2, buf, schedule="lag:1"), outs["lag:1"])
    # the check can fail: a Linear-2 weight scale 5% off
    off = (l1, s1, l2, s2 * torch.where(torch.arange(s2.shape[1]) == 0, 1.05, 1.0)[None, :, None])
    assert not _within_bf16_rounding(outs["lag:1"], x, idx, w, off, R, ulp=2.0**-7)


def test_fp8_inputs_that_cannot_run_are_refused_before_any_launch():
    T, E, K, H, I, R = 4, 4, 2, 256, 128, 2
    x, idx, w, (l1, s1, l2, s2) = _problem(T, E, K, H, I, R, seed=3)
    buf = MoEBuffer(8, E, K, H, I, LoopbackGroup(R), device="cpu", dtype="fp8", config=CFG)
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1, s1, s2)
    with pytest.raises(InputError, match="w1t: an FP8 buffer takes"):
        fused_moe(x, idx, w, w1t[0], w2, buf)
    with pytest.raises(InputError, match="w2_scale: expected shape"):
        fused_moe(x, idx, w, w1t, (w2[0], w2[1][:, :1]), buf)
    x8, xs = quantize_activations(x)
    with pytest.raises(InputError, match="x_scale: expected dtype"):
        fused_moe((x8, xs.double()), idx, w, w1t, w2, buf)
    with pytest.raises(InputError, match="x: expected dtype"):
        fused_moe(x.float(), idx, w, w1t, w2, buf)
    fp16 = MoEBuffer(8, E, K, H, I, LoopbackGroup(R), device="cpu", dtype="fp16",
                     config=dataclasses.replace(CFG, num_stages=2))
    with pytest.raises(InputError, match="needs an FP8 buffer"):
        fused_moe(x, idx, w, w1t, w2, fp16)
    with pytest.raises(InputError, match="l1_scale, l2_scale"):
        transform_weights(l1, l2, CFG.block_n1)
    with pytest.raises(InputError, match="block_n1=64"):
        transform_weights(l1, l2, 64, s1, s2)
    for kw, message in ((dict(hidden=192), "hidden=192: must be a multiple of 128"),
                        (dict(config=dataclasses.replace(CFG, block_n1=64)), "block_n1=64: must be 128")):
        args = {**dict(num_max_tokens_per_rank=8, num_experts=E, topk=K, hidden=H, intermediate=I), **kw}
        with pytest.raises(InputError, match=message):
            MoEBuffer(group=LoopbackGroup(R), device="cpu", dtype=FP8, **args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_fp8_layer_meets_the_accuracy_targets_on_the_gpu(tma):
    """On the GPU the FP8 MMA keeps fewer bits than float32 inside a 128-wide K block
    (`benchmarks/results/h200-fp8-dot/`), so the layer is held to the issue's accuracy targets: max
    |y - ref| / max |ref| <= 1e-2 against the FP8-emulating reference, and a relative Frobenius error
    <= 6e-2 against float32 on the dequantized weights and unquantized activations."""
    from xstage.moe.fp8 import dequantize_weights

    T, E, K, H, I, R = 96, 8, 2, 512, 384, 2
    x, idx, w, weights = _problem(T, E, K, H, I, R, seed=5)
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()
    weights = tuple(t.cuda() for t in weights)
    buf = MoEBuffer(T, E, K, H, I, LoopbackGroup(R, path="hbm"), device="cuda", dtype="fp8",
                    config=dataclasses.replace(FP8_BLOCK_CONFIG, tma=tma))
    l1, s1, l2, s2 = weights
    w1t, w2 = transform_weights(l1, l2, buf.cfg.block_n1, s1, s2)
    outs = {s: fused_moe(x, idx, w, w1t, w2, buf, schedule=s) for s in SCHEDULES}
    for s in SCHEDULES[1:]:
        assert torch.equal(outs[s], outs[SCHEDULES[0]]), s
    y = outs[SCHEDULES[0]]
    # a checkpoint's own [gate; up] weights and scale rows, read in place: bit for bit the same y
    assert torch.equal(fused_moe(x, idx, w, (l1, s1), w2, buf, schedule=SCHEDULES[0], w1_layout="concatenated"), y)
    assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())
    assert _rel_err(y, _reference(x, idx, w, weights, R)) <= TOL
    # float32 on dequantized weights, activations unquantized
    d1, d2 = (dequantize_weights(a, b).repeat(R, 1, 1) for a, b in ((l1, s1), (l2, s2)))
    y32 = torch.zeros(T, H, device="cuda")
    for k in range(K):
        g, u = (x.float()[:, None, :] @ d1[idx[:, k]].transpose(1, 2)).squeeze(1).split(I, dim=1)
        y32 += w[:, k, None] * ((g * torch.sigmoid(g) * u)[:, None, :] @ d2[idx[:, k]].transpose(1, 2)).squeeze(1)
    assert float((y.float() - y32).norm() / y32.norm()) <= 6e-2


def test_the_planner_sees_fp8_operands_and_bf16_combine_rows():
    from xstage.sched.costs import load_default_costs
    from xstage.sched.moe import moe_work
    from xstage.sched.policy import buffer_config

    kw = dict(num_max_tokens_per_rank=1024, num_experts=64, topk=4, hidden=1024, intermediate=512,
              group=LoopbackGroup(8, path="host"), device="cpu")
    fp8 = buffer_config(MoEBuffer(dtype="fp8", **kw), 1024)
    same_blocks = dataclasses.replace(MoEBuffer(dtype="fp8", **kw).cfg, num_stages=2)  # 2-byte tiles take 2x the bytes
    # A 2-byte buffer, as the planner sees a bf16 one (fp16: bf16 buffers are refused in the CPU interpreter).
    bf16 = buffer_config(MoEBuffer(dtype="fp16", config=same_blocks, **kw), 1024)
    assert (fp8.elem_bytes, fp8.store_elem_bytes, bf16.elem_bytes, bf16.store_elem_bytes) == (1, 2, 2, 2)
    work = {c.elem_bytes: moe_work(c, "lag:1", load_default_costs("moe"), 8).all_tasks() for c in (fp8, bf16)}
    # the same remote bytes (BF16 combine rows), and GEMM tiles no slower with 1-byte operands
    assert sum(t.store_bytes for t in work[1]) == sum(t.store_bytes for t in work[2]) > 0
    gemm = {e: sum(t.compute_ns for t in w if t.kind in ("linear1", "linear2")) for e, w in work.items()}
    assert gemm[1] < gemm[2]
    # An FP8 buffer's planner takes the tile costs traced on an FP8 buffer: 1-byte rows of its tiles.
    from xstage.sched.policy import _moe_calibration

    def costs(buf):  # what the policy decides this buffer's calls with
        return _moe_calibration(buf.store_path, "fp8" if buf.fp8 else "bf16", None, None, None)[1]

    costs8 = costs(MoEBuffer(dtype="fp8", **kw))
    assert costs8.provenance["dtype"] == "fp8" and costs(MoEBuffer(dtype="fp16", config=same_blocks, **kw)) != costs8
    assert {r["elem_bytes"] for r in costs8.table} == {1} and {r["block"] for r in costs8.table} == {fp8.block}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter, on the non-finite rows
def test_fp8_layer_propagates_inf_and_nan_to_their_tokens_only_and_completes():
    """Documented behaviour: a non-finite input value turns its token's whole output row non-finite
    (NaN or +-inf); every other token is computed as without it (rows are quantized and multiplied
    independently), and the kernel completes (its waits never depend on values)."""
    T, E, K, H, I, R = 9, 4, 2, 256, 128, 2
    x, idx, w, weights = _problem(T, E, K, H, I, R, seed=11)
    buf = MoEBuffer(16, E, K, H, I, LoopbackGroup(R), device="cpu", dtype="fp8", config=CFG)
    l1, s1, l2, s2 = weights
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1, s1, s2)
    clean = fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1")
    bad = x.clone()
    bad[1, 5], bad[3, 200], bad[6, 7] = float("inf"), float("nan"), float("-inf")
    y = fused_moe(bad, idx, w, w1t, w2, buf, schedule="lag:1")
    rows = torch.tensor([1, 3, 6])
    rest = torch.tensor([t for t in range(T) if t not in rows.tolist()])
    assert not bool(torch.isfinite(y[rows]).any())
    assert torch.equal(y[rest], clean[rest])


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_fp8_checkpoint_layout_read_in_place_gives_the_interleaved_result_bit_for_bit(tma):
    # A DeepSeek-V3 checkpoint's own [gate; up] weights and scales (transformers' fine-grained FP8
    # gate_up_proj, gate_up_proj_scale_inv), with I / 128 = 3 tiles: reading the wrong weight rows or
    # the wrong scale row for either layout mixes gate and up, or scales a block by its neighbour's.
    T, E, K, H, I, R = 9, 4, 2, 256, 384, 2
    x, idx, w, weights = _problem(T, E, K, H, I, R, seed=21)
    l1, s1, l2, s2 = weights
    s1 = s1 * (1 + torch.arange(s1.shape[1], dtype=torch.float32))[None, :, None]  # every scale row distinct
    weights = (l1, s1, l2, s2)
    buf = MoEBuffer(16, E, K, H, I, LoopbackGroup(R), device="cpu", dtype="fp8",
                    config=dataclasses.replace(CFG, tma=tma))
    w1t, w2 = transform_weights(l1, l2, CFG.block_n1, s1, s2)
    assert not torch.equal(w1t[0].view(torch.uint8), l1.view(torch.uint8)) and not torch.equal(w1t[1], s1)
    y_int = fused_moe(x, idx, w, w1t, w2, buf)
    y_cat = fused_moe(x, idx, w, (l1, s1), w2, buf, w1_layout="concatenated")
    assert torch.equal(y_cat, y_int)
    assert _rel_err(y_cat, _reference(x, idx, w, weights, R)) <= 2 * TOL
