"""Fine-grained FP8 checkpoints (DeepSeek-V3's 128x128 block-scaled e4m3 experts, transformers'
`FP8Experts`) on `experts_implementation="xstage"`: the FP8 fused layer reads the checkpoint's weights
and scales in place. References: xstage's FP8-emulating reference (`reference_moe_fp8`) on the same
e4m3 weights and scales, and transformers' own `eager` experts in float32 on the dequantized weights.

CPU: Triton's interpreter, BF16 tokens (the FP8 path's input and output), the FP8 tests' tiles. The
experts are converted by transformers' own `replace_with_fp8_linear` (what `from_pretrained` does for
a fine-grained FP8 checkpoint), its other linears left in float (their FP8 kernel is a download).
"""

import copy
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import FineGrainedFP8Config  # noqa: E402
from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear  # noqa: E402

from tests.integrations.test_transformers import _block  # noqa: E402
from tests.moe.test_fused_fp8 import _within_bf16_rounding  # noqa: E402
from xstage.errors import InputError  # noqa: E402
from xstage.integrations import transformers as xt  # noqa: E402
from xstage.moe import BlockConfig  # noqa: E402
from xstage.moe.fp8 import dequantize_weights, quantize_weights, reference_moe_fp8  # noqa: E402

CFG = BlockConfig(block_m=16, block_n1=128, block_n2=64, block_k=128, block_d=128, tma=False)
TOL = 1.1e-2  # max |y - ref| / max |ref| against the FP8-emulating reference (the project's FP8 bound)
# Triton's interpreter does not round fp32 -> BF16 to nearest (up to one ulp, 2^-7, where the GPU has
# half an ulp), for the combine rows and the output: twice the bound there, as in tests/moe/test_fused_fp8.py,
# beside that file's element-wise check of exactly that rounding.
TOL_HERE = 2 * TOL if not torch.cuda.is_available() else TOL
FRO = 6e-2  # relative Frobenius error against float32 on the dequantized weights
# H256-I128 (2 x 1 scale blocks), 4 experts, top-2; I / 128 = 2 for DeepSeek-V3 (two Linear-1 tiles).
ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=256, moe_intermediate_size=128, intermediate_size=256, num_experts=4, num_experts_per_tok=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=256, moe_intermediate_size=256, intermediate_size=256, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16)),
}


@pytest.fixture(autouse=True, scope="module")
def _registered():
    xt.register()


def _float_model(arch: str, seed: int = 0):
    conf_cls, model_cls, kw = ARCHS[arch]
    config = getattr(transformers, conf_cls)(vocab_size=64, num_hidden_layers=1, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def _fp8_model(arch: str, **quant):
    """(an FP8-checkpoint model, the float model whose experts carry the dequantized FP8 weights, the
    experts' e4m3 weights and scales). The FP8 model's experts are transformers' `FP8Experts`."""
    ref = _float_model(arch)
    model = copy.deepcopy(ref)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    replace_with_fp8_linear(model, modules_to_not_convert=linears, pre_quantized=True,
                            quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128), **quant))
    experts, ref_experts = _block(model).experts, _block(ref).experts
    assert type(experts).__name__ == "FP8Experts"
    experts.to_empty(device="cpu")
    l1, s1 = quantize_weights(ref_experts.gate_up_proj.detach())
    l2, s2 = quantize_weights(ref_experts.down_proj.detach())
    with torch.no_grad():
        for p, v in (("gate_up_proj", l1), ("gate_up_proj_scale_inv", s1), ("down_proj", l2),
                     ("down_proj_scale_inv", s2)):
            if getattr(experts, p).shape == v.shape:  # a refusal test may give the module other scale shapes
                getattr(experts, p).copy_(v)
        ref_experts.gate_up_proj.copy_(dequantize_weights(l1, s1))
        ref_experts.down_proj.copy_(dequantize_weights(l2, s2))
    model.requires_grad_(False)
    ref.set_experts_implementation("eager")
    return model, ref, (l1, s1, l2, s2)


def _routing(tokens: int, experts: int, seed: int, skew: bool):
    g = torch.Generator().manual_seed(seed)
    if tokens == 0:
        return torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    if skew:  # most tokens to expert 0 and one other
        idx = torch.stack([torch.tensor([0, 1 + int(torch.randint(0, experts - 1, (1,), generator=g))])
                           for _ in range(tokens)])
    else:
        idx = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    return idx, torch.softmax(torch.randn(tokens, 2, generator=g), dim=1)


def _rel(y, ref):
    return float((y.double() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp8_experts_meet_the_fp8_bounds(arch, skew):
    model, ref, weights = _fp8_model(arch)
    model.set_experts_implementation("xstage")
    assert xt.prepare(model, config=CFG) == ["model.layers.0.mlp.experts"]
    experts = _block(model).experts
    x = torch.randn(13, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    idx, w = _routing(13, 4, seed=2, skew=skew)
    with torch.no_grad():
        y = experts(x, idx, w)
        want_fp8 = reference_moe_fp8(x, idx, w, *weights)
        want = _block(ref).experts(x.float(), idx, w)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert _rel(y, want_fp8) <= TOL_HERE
    assert _within_bf16_rounding(y, x, idx, w, weights, 1, ulp=2.0**-7 if not torch.cuda.is_available() else 2.0**-8)
    assert float((y.double() - want.double()).norm() / want.double().norm()) <= FRO
    # the bound can fail: reading the up rows (and their scale rows) as the gate's moves y past it
    l1, s1, l2, s2 = weights
    i, si = l1.shape[1] // 2, s1.shape[1] // 2
    swapped = (torch.cat([l1[:, i:], l1[:, :i]], 1), torch.cat([s1[:, si:], s1[:, :si]], 1), l2, s2)
    assert _rel(y, reference_moe_fp8(x, idx, w, *swapped)) > 5 * TOL
    assert xt.memory(model).weights == 0  # weights and scales read in place: nothing held twice
    assert xt.memory(model).buffers > 0  # the fused layer ran, not transformers' own FP8 path


def test_fp8_model_forward_and_state_dict_stay_transformers_own():
    model, ref, _ = _fp8_model("qwen3_moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.set_experts_implementation("xstage")
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for name, p in model.named_parameters():  # a checkpoint's other layers in BF16, as from_pretrained loads
            if ".experts." not in name:  # (module.to(torch.bfloat16) would cast the e4m3 weights too)
                p.data = p.data.to(torch.bfloat16)
        got = model(ids).logits
        want = ref.to(torch.float32)(ids).logits
    assert float((got.double() - want.double()).norm() / want.double().norm()) <= FRO
    after = model.state_dict()
    assert set(after) == set(before)
    experts = "model.layers.0.mlp.experts."
    for k in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        assert after[experts + k].dtype == before[experts + k].dtype
        assert torch.equal(after[experts + k].view(torch.uint8), before[experts + k].view(torch.uint8))


@pytest.mark.parametrize("quant, message", [
    (dict(weight_block_size=(128, 64)), r"block_size=\(128, 64\): the FP8 kernel takes 128x128 block scales"),
    (dict(activation_scheme="static"), r"activation_scheme='static': the FP8 kernel quantizes activations itself"),
], ids=["block-128x64", "static-activations"])
def test_fp8_checkpoints_the_kernel_cannot_read_are_refused_by_name(quant, message):
    quant = {**dict(weight_block_size=(128, 128)), **quant}
    ref = _float_model("qwen3_moe")
    model = copy.deepcopy(ref)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    replace_with_fp8_linear(model, modules_to_not_convert=linears, pre_quantized=True,
                            quantization_config=FineGrainedFP8Config(**quant))
    _block(model).experts.to_empty(device="cpu")
    model.requires_grad_(False)
    model.set_experts_implementation("xstage")
    with pytest.raises(InputError, match=r"^model\.layers\.0\.mlp\.experts: " + message):
        xt.prepare(model, config=CFG)
    assert xt.memory(model) == xt.Memory(0, 0, 0)


def test_fp8_sizes_clamps_and_tokens_the_kernel_cannot_honour_are_refused():
    model, _, _ = _fp8_model("qwen3_moe")
    model.set_experts_implementation("xstage")
    experts = _block(model).experts
    experts.limit = 7.0  # a clamped SwiGLU (the FP8 kernel computes a plain one)
    with pytest.raises(InputError, match=r"^model\.layers\.0\.mlp\.experts: the fused kernel cannot honour limit=7\.0"):
        xt.prepare(model, config=CFG)
    experts.limit = None
    scale = experts.gate_up_proj_scale_inv
    experts.gate_up_proj_scale_inv = torch.nn.Parameter(scale.detach()[:, :1].clone(), requires_grad=False)
    with pytest.raises(InputError, match=r"gate_up_proj_scale_inv: shape \(4, 1, 2\), expected \(4, 2, 2\)"):
        xt.prepare(model, config=CFG)
    experts.gate_up_proj_scale_inv = torch.nn.Parameter(scale.detach().double(), requires_grad=False)
    with pytest.raises(InputError, match=r"gate_up_proj_scale_inv: dtype torch\.float64 \(the FP8 kernel takes "
                                         r"float32 block scales"):
        xt.prepare(model, config=CFG)
    experts.gate_up_proj_scale_inv = scale
    assert xt.prepare(model, config=CFG) == ["model.layers.0.mlp.experts"]
    idx, w = _routing(3, 4, seed=4, skew=False)
    with torch.no_grad(), pytest.raises(InputError, match=r"hidden_states: torch\.float32 on cpu, FP8 experts take "
                                                          r"torch\.bfloat16"):
        experts(torch.randn(3, 256), idx, w)


def test_fp8_block_config_must_fit_the_scale_blocks():
    model, _, _ = _fp8_model("qwen3_moe")
    model.set_experts_implementation("xstage")
    xt.prepare(model, config=dataclasses.replace(CFG, block_n1=64))  # the tiles meet the sizes at the buffer
    x = torch.randn(3, 256).to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(InputError, match=r"^model\.layers\.0\.mlp\.experts: block_n1=64: must be "
                                                          r"128 with dtype fp8"):
        _block(model).experts(x, *_routing(3, 4, seed=5, skew=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("skew", ["uniform", "skewed"])
def test_fp8_experts_at_qwen3_30b_width_on_the_gpu(skew):
    # transformers' FP8Experts at Qwen3-30B-A3B's width (H2048-I768, 128 experts, top-8), 512 tokens, on
    # the FP8 fused layer: <= 1.1e-2 against the FP8-emulating reference on the checkpoint's e4m3 weights
    # and scales, and a relative Frobenius error <= 6e-2 against eager float32 on the dequantized weights.
    from xstage.integrations.transformers.bench import ARCHS as WIDTHS
    from xstage.integrations.transformers.bench import Pair, routings

    pair = Pair(WIDTHS["qwen3-30b-a3b"], "fp8")
    fp8 = pair.xstage
    ref = copy.copy(pair.grouped_mm)  # its weights: the dequantized FP8 ones
    ref.config = copy.copy(ref.config)
    ref.config._experts_implementation = "eager"
    idx, w = routings(512, 128, 8, skew, "cuda", seed=3)[0]
    x = torch.randn(512, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        y = fp8(x, idx, w)
        want_fp8 = reference_moe_fp8(x, idx, w.float(), fp8.gate_up_proj, fp8.gate_up_proj_scale_inv, fp8.down_proj,
                                     fp8.down_proj_scale_inv)
        want = ref.float()(x.float(), idx, w.float())
    assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())
    assert _rel(y, want_fp8) <= TOL
    assert float((y.double() - want.double()).norm() / want.double().norm()) <= FRO
