"""GPT-OSS's experts (biases, clamped SwiGLU, transposed and interleaved weights) on
`experts_implementation="xstage"`, against transformers' own `eager` experts on the same weights, in
float64. CPU: Triton's interpreter, fp32 or fp16, the small tiles and tolerances of the CPU MoE tests."""

import copy
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from xstage.errors import InputError  # noqa: E402
from xstage.integrations import transformers as xt  # noqa: E402
from xstage.moe import BlockConfig  # noqa: E402

CFG = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)
TOL = {torch.float16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-4, atol=1e-4)}
# (hidden, intermediate): H64-I32 fits the tiles; H40-I24 pads both (hidden to 64, intermediate to 32).
SIZES = {"H64-I32": (64, 32), "H40-I24-padded": (40, 24)}


@pytest.fixture(autouse=True, scope="module")
def _registered():
    xt.register()


def _model(hidden: int, inter: int, layers: int = 1, seed: int = 0, tma: bool = False):
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=hidden, intermediate_size=inter,
                                       num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=layers,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias"):  # expert biases of unit scale: as large as the GEMMs' outputs
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                fan_in = p.shape[-2] if name.endswith(("gate_up_proj", "down_proj")) else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def _pair(hidden, inter, layers=1, dtype=torch.float32, tma=False, limit=None):
    """An xstage model in `dtype` and an eager float64 copy of the same (rounded) weights; `limit`, if
    given, replaces every experts module's clamp in both (small enough that the clamps bite)."""
    model = _model(hidden, inter, layers).to(dtype)
    if limit is not None:
        for layer in model.model.layers:
            layer.mlp.experts.limit = limit
    ref = copy.deepcopy(model).double()
    ref.set_experts_implementation("eager")
    model.set_experts_implementation("xstage")
    xt.prepare(model, config=dataclasses.replace(CFG, tma=tma))
    return model, ref


def _block(model):
    return model.model.layers[0].mlp


def _same_routing(block, ref_block, x):
    """`block` on `x`, and `ref_block` on `x` in float64 with the routing `block`'s router chose."""
    seen = {}
    h = block.router.register_forward_hook(lambda m, i, out: seen.setdefault("out", out))
    try:
        y, _ = block(x)
    finally:
        h.remove()
    logits, scores, idx = seen["out"]
    h = ref_block.router.register_forward_hook(lambda m, i, out: (logits.double(), scores.double(), idx))
    try:
        ref, _ = ref_block(x.double())
    finally:
        h.remove()
    return y, ref


def _experts_call(experts, ref_experts, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    e, h = experts.num_experts, experts.hidden_size
    x = torch.randn(tokens, h, generator=g).to(experts.gate_up_proj.dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=g)
    with torch.no_grad():
        return experts(x, idx, w), ref_experts(x.double(), idx, w.double())


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("size", list(SIZES))
def test_gpt_oss_block_matches_eager(size, dtype, tma):
    model, ref = _pair(*SIZES[size], dtype=dtype, tma=tma)
    x = torch.randn(1, 13, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        y, want = _same_routing(_block(model), _block(ref), x)
    assert y.dtype == dtype and y.shape == x.shape
    assert float(want.abs().max()) > 0.5  # outputs of unit scale: the tolerance is not larger than the signal
    torch.testing.assert_close(y.double(), want, **TOL[dtype])
    assert xt.memory(model).buffers > 0  # the experts ran on xstage's buffer, not transformers' eager loop


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_the_modules_own_limit_and_alpha_are_used(tma):
    # limit 0.5: most gate and up values are clamped, on both sides for up; a clamp on the wrong side,
    # the default limit or a bias in the wrong place would all move y past the tolerance.
    model, ref = _pair(64, 32, tma=tma, limit=0.5)
    experts, ref_experts = _block(model).experts, _block(ref).experts
    y, want = _experts_call(experts, ref_experts, 11, seed=4)
    torch.testing.assert_close(y.double(), want, **TOL[torch.float32])
    experts.alpha = ref_experts.alpha = 0.5  # a plain attribute, read at each call
    y2, want2 = _experts_call(experts, ref_experts, 11, seed=4)
    torch.testing.assert_close(y2.double(), want2, **TOL[torch.float32])
    assert not torch.allclose(want2, want, **TOL[torch.float32])


@pytest.mark.parametrize("size", list(SIZES))
def test_small_gpt_oss_model_logits_match_eager(size):
    model, ref = _pair(*SIZES[size], layers=2)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    assert float(want.abs().max()) > 0.5


def test_weights_are_held_in_the_kernels_layout_and_rebuilt_on_change():
    model, ref = _pair(40, 24)
    experts, ref_experts = _block(model).experts, _block(ref).experts
    assert tuple(experts.gate_up_proj.shape) == (8, 40, 48) and tuple(experts.down_proj.shape) == (8, 24, 40)
    # w1t [8, 2 x 32, 64], w2 [8, 64, 32], b1 [8, 64], b2 [8, 64] in fp32: the copies beside the parameters
    assert xt.memory(model).weights == 8 * (64 * 64 + 64 * 32 + 64 + 64) * 4
    assert xt.memory(model).experts == sum(p.numel() * 4 for n, p in experts.named_parameters())
    y, want = _experts_call(experts, ref_experts, 9, seed=5)
    torch.testing.assert_close(y.double(), want, **TOL[torch.float32])
    # An in-place write of a bias alone is seen (its version counter is part of the copy's key).
    for m in (experts, ref_experts):
        with torch.no_grad():
            m.down_proj_bias.mul_(-2.0)
            m.gate_up_proj_bias[:, 1::2].add_(0.5)  # the up biases only
    y2, want2 = _experts_call(experts, ref_experts, 9, seed=5)
    torch.testing.assert_close(y2.double(), want2, **TOL[torch.float32])
    assert not torch.allclose(want2, want, **TOL[torch.float32])
    # the parameters keep their layout: state_dict writes transformers' own
    assert all(k in model.state_dict() for k in ("model.layers.0.mlp.experts.gate_up_proj_bias",
                                                 "model.layers.0.mlp.experts.down_proj_bias"))
    xt.release(model)
    assert xt.memory(model) == xt.Memory(0, 0, 0)


def test_other_gated_activations_and_layouts_are_refused_by_name():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    class OtherGate(GptOssExperts):
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2

    model = _model(64, 32)
    model.set_experts_implementation("xstage")
    mlp = _block(model)
    mlp.experts = OtherGate(model.config)
    with pytest.raises(InputError) as err:
        xt.prepare(model, config=CFG)
    msg = str(err.value)
    assert msg.startswith("model.layers.0.mlp.experts: the fused kernel cannot honour _apply_gate: its own gated "
                          "activation (alpha=1.702, limit=7.0)") and "\n" not in msg
    mlp.experts = GptOssExperts(model.config)
    mlp.experts.is_concatenated = True  # GPT-OSS's gate reads interleaved columns: a concatenated claim is refused
    with pytest.raises(InputError, match=r"^model\.layers\.0\.mlp\.experts: the fused kernel cannot honour "
                                         r"is_concatenated=True with GPT-OSS's gate"):
        xt.prepare(model, config=CFG)
    mlp.experts = GptOssExperts(model.config)
    mlp.experts.limit = float("inf")
    with pytest.raises(InputError, match=r"^model\.layers\.0\.mlp\.experts: the fused kernel cannot honour "
                                         r"GPT-OSS's clamped SwiGLU with activation limit=inf"):
        xt.prepare(model, config=CFG)
    assert xt.memory(model) == xt.Memory(0, 0, 0)


@pytest.mark.gpu
def test_gpt_oss_width_block_on_gpu():
    # One MoE block at GPT-OSS's width (H2880-I2880, 32 experts, top-4; hidden padded to the default
    # tiles inside), BF16, 512 tokens, against eager in float32 on the same weights and routing:
    # max|y - ref| / max|ref| <= 1e-2.
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    def block(impl):
        config = transformers.GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                                           num_experts_per_tok=4, experts_implementation=impl)
        torch.manual_seed(0)
        with torch.device("cuda"):
            b = GptOssMLP(config)
        g = torch.Generator("cuda").manual_seed(0)
        with torch.no_grad():
            for name, p in b.named_parameters():
                scale = 1.0 if name.endswith("bias") else p.shape[-2] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * scale)
        return b

    fast = block("xstage").to(torch.bfloat16)
    ref = block("eager").float()
    ref.load_state_dict({k: v.float() for k, v in fast.state_dict().items()})
    xt.prepare(fast)
    x = torch.randn(1, 512, 2880, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        seen = {}
        h = fast.router.register_forward_hook(lambda m, i, out: seen.setdefault("out", out))
        y, _ = fast(x.to(torch.bfloat16))
        h.remove()
        logits, scores, idx = seen["out"]
        h = ref.router.register_forward_hook(lambda m, i, out: (logits.float(), scores.float(), idx))
        want, _ = ref(x.to(torch.bfloat16).float())
        h.remove()
    err = float((y.double() - want.double()).abs().max() / want.double().abs().max())
    assert err <= 1e-2, err
