"""`experts_implementation="xstage"` inside real transformers models (tiny random configs of each model's
own config class) against transformers' own `eager` experts on the same weights, in float64.

CPU: the kernels run in Triton's interpreter in fp32 or fp16 (bf16 is refused there), at the small
tiles of the CPU MoE tests and their tolerances. Sizes that are not multiples of those tiles are padded
inside the integration (Mixtral, OLMoE and DeepSeek-V3 below).
"""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from xstage.errors import InputError, XstageError  # noqa: E402
from xstage.integrations import transformers as xt  # noqa: E402
from xstage.moe import BlockConfig  # noqa: E402

CFG = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)
# The CPU MoE tests' tolerances (tests/moe/test_fused_cpu.py): kernel dtype against float64.
TOL = {torch.float16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-4, atol=1e-4)}
CPU = not torch.cuda.is_available()

# (config class, model class, config arguments): hidden H and expert width I chosen so that some need
# padding to the tiles of CFG (H to a multiple of 32, I to a multiple of 32).
ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, moe_intermediate_size=32, intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=40, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        hidden_size=64, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        num_attention_heads=2, num_key_value_heads=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=48, moe_intermediate_size=32, intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16)),
}
IDS = {"qwen3_moe": "qwen3_moe-H64-I32", "mixtral": "mixtral-H40-I24-padded",
       "olmoe": "olmoe-H64-I48-padded", "deepseek_v3": "deepseek_v3-H48-I32-padded-shared"}


@pytest.fixture(autouse=True, scope="module")
def _registered():
    xt.register()


def _randomize(model, seed: int):
    """Weights of unit scale (transformers' init is std 0.02, under which the experts add little)."""
    dev = next(model.parameters()).device
    g = torch.Generator(dev).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device=dev) / p.shape[-1] ** 0.5)
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=dev))


def _model(arch: str, layers: int = 1, seed: int = 0):
    conf_cls, model_cls, kw = ARCHS[arch]
    config = getattr(transformers, conf_cls)(vocab_size=64, num_hidden_layers=layers, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _randomize(model, seed)
    return model


def _pair(arch: str, layers: int = 1, dtype=torch.float32, **prepare):
    """An xstage model in `dtype` and an eager float64 copy of the same (rounded) weights."""
    model = _model(arch, layers).to(dtype)
    ref = copy.deepcopy(model).double()
    ref.set_experts_implementation("eager")
    model.set_experts_implementation("xstage")
    xt.prepare(model, config=CFG, **prepare)
    return model, ref


def _block(model):
    return model.model.layers[0].mlp


def _router(block):
    return block.router if hasattr(block, "router") else block.gate


def _same_routing(block, ref_block, x):
    """Run `block` on `x`, and `ref_block` on `x` in its own (wider) dtype with the routing `block`'s router
    chose (a low-precision router may pick another expert on a near tie; the experts are what is compared)."""
    dt = next(ref_block.parameters()).dtype
    seen = {}
    h = _router(block).register_forward_hook(lambda m, i, out: seen.setdefault("out", out))
    try:
        y = block(x)
    finally:
        h.remove()
    logits, scores, idx = seen["out"]
    h = _router(ref_block).register_forward_hook(lambda m, i, out: (logits.to(dt), scores.to(dt), idx))
    try:
        ref = ref_block(x.to(dt))
    finally:
        h.remove()
    return y, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("arch", list(ARCHS), ids=[IDS[a] for a in ARCHS])
def test_moe_block_matches_eager(arch, dtype):
    model, ref = _pair(arch, dtype=dtype)
    x = torch.randn(1, 13, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        if dtype == torch.float32:  # the router at float32 picks what float64 picks: the whole block
            y, want = _block(model)(x), _block(ref)(x.double())
        else:
            y, want = _same_routing(_block(model), _block(ref), x)
    assert y.dtype == dtype and y.shape == x.shape
    assert float(want.abs().max()) > 0.5  # outputs of unit scale: the tolerance is not larger than the signal
    torch.testing.assert_close(y.double(), want, **TOL[dtype])
    assert xt.memory(model).buffers > 0  # the experts ran on xstage's buffer, not transformers' eager loop


@pytest.mark.parametrize("arch", list(ARCHS), ids=[IDS[a] for a in ARCHS])
def test_small_model_logits_match_eager(arch):
    model, ref = _pair(arch, layers=2)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    assert float(want.abs().max()) > 0.5  # logits of unit scale: the tolerance is not larger than the signal


def test_greedy_decode_matches_eager():
    model = _model("qwen3_moe", layers=2)
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    model.set_experts_implementation("xstage")
    xt.prepare(model, config=CFG)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    got, want = model.generate(ids, **kw), ref.generate(ids, **kw)
    assert got.shape == (1, 21) and torch.equal(got, want)


def _experts_call(experts, ref_experts, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    e, h = experts.num_experts, experts.gate_up_proj.shape[2]
    x = torch.randn(tokens, h, generator=g).to(experts.gate_up_proj.dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, 2, dtype=torch.long)
    w = torch.rand(tokens, 2, generator=g)
    with torch.no_grad():
        return experts(x, idx, w), ref_experts(x.double(), idx, w.double())


def test_weights_are_relaid_once_and_again_after_every_change():
    model, ref = _pair("qwen3_moe")
    experts, ref_experts = _block(model).experts, _block(ref).experts
    e, two_i, h = experts.gate_up_proj.shape
    y, want = _experts_call(experts, ref_experts, 11, seed=4)
    torch.testing.assert_close(y.double(), want, **TOL[torch.float32])
    # no padding here: both weights are read in place, nothing is held beside them
    assert xt.memory(model).weights == 0
    # load_state_dict writes the parameters in place: the kernel reads the new values
    other = _model("qwen3_moe", seed=9).state_dict()
    model.load_state_dict(other)
    ref.load_state_dict({k: v.double() for k, v in other.items()})
    y2, want2 = _experts_call(experts, ref_experts, 11, seed=4)
    torch.testing.assert_close(y2.double(), want2, **TOL[torch.float32])
    assert not torch.allclose(want2, want, **TOL[torch.float32])
    # an in-place write of one parameter
    with torch.no_grad():
        experts.gate_up_proj.mul_(-0.5)
        ref_experts.gate_up_proj.mul_(-0.5)
    y3, want3 = _experts_call(experts, ref_experts, 11, seed=4)
    torch.testing.assert_close(y3.double(), want3, **TOL[torch.float32])
    # a dtype change (.to()): new parameters, read in place in fp16
    model.to(torch.float16)
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    y4, want4 = _experts_call(experts, ref_experts, 11, seed=4)
    assert y4.dtype == torch.float16
    torch.testing.assert_close(y4.double(), want4, **TOL[torch.float16])
    assert xt.memory(model).weights == 0
    # a dtype the kernel does not take is refused by name, before any kernel runs
    model.double()
    with pytest.raises(InputError, match=r"^model\.layers\.0\.mlp\.experts: gate_up_proj: dtype torch\.float64") as err:
        _experts_call(experts, ref_experts, 3, seed=4)
    assert "\n" not in str(err.value)
    xt.release(model)
    assert xt.memory(model) == xt.Memory(0, 0, 0)


def test_padded_sizes_are_reported_and_the_parameters_keep_their_shape():
    model, ref = _pair("mixtral")  # H40-I24: padded to H64-I32
    experts = _block(model).experts
    assert tuple(experts.gate_up_proj.shape) == (8, 48, 40) and tuple(experts.down_proj.shape) == (8, 40, 24)
    assert xt.memory(model).weights == 8 * (64 * 64 + 64 * 32) * 4  # both weights, padded
    y, want = _experts_call(experts, _block(ref).experts, 7, seed=5)
    assert y.shape == (7, 40)
    torch.testing.assert_close(y.double(), want, **TOL[torch.float32])


def test_long_calls_run_in_chunks_and_the_buffer_grows_to_max_tokens():
    model, ref = _pair("qwen3_moe", max_tokens=32)
    experts, ref_experts = _block(model).experts, _block(ref).experts
    for tokens in (5, 40):  # 16-token buffer, then 32 tokens: two calls of 32 and 8
        y, want = _experts_call(experts, ref_experts, tokens, seed=tokens)
        torch.testing.assert_close(y.double(), want, **TOL[torch.float32])
    small = xt.memory(model).buffers
    y, want = _experts_call(experts, ref_experts, 0, seed=0)
    assert y.shape == (0, 64) and xt.memory(model).buffers == small


def test_parameters_stay_and_save_pretrained_writes_the_original_layout(tmp_path):
    model, _ = _pair("qwen3_moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = model(ids).logits
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    model.save_pretrained(tmp_path)
    assert "xstage" not in (tmp_path / "config.json").read_text()  # a reload picks its own implementation
    cls = type(model)
    eager = cls.from_pretrained(tmp_path, experts_implementation="eager").eval()
    assert all(torch.equal(before[k], v) for k, v in eager.state_dict().items())
    again = cls.from_pretrained(tmp_path, experts_implementation="xstage").eval()
    xt.prepare(again, config=CFG)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, out)  # the same kernel on the same weights: bitwise


def test_register_is_idempotent_and_import_registers_nothing():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    xt.register()
    xt.register()
    assert ALL_EXPERTS_FUNCTIONS["xstage"] is xt.experts_forward
    assert list(ExpertsInterface._global_mapping).count("xstage") == 1
    code = ("import xstage.integrations.transformers\nfrom transformers.integrations.moe import ExpertsInterface\n"
            "print('xstage' in ExpertsInterface._global_mapping)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(Path(xt.__file__).parents[3]), "TRITON_INTERPRET": "1", "PATH": ""})
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def _model_gpt_oss():
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_local_experts=4,
                                       num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=32)
    return transformers.GptOssForCausalLM(config).eval()


def test_quantized_experts_outside_the_registry_are_refused():
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    model = _model_gpt_oss()
    model.set_experts_implementation("xstage")
    model.model.layers[0].mlp.experts = Mxfp4GptOssExperts(model.config)
    with pytest.raises(InputError, match=r"^model\.layers\.0\.mlp\.experts: Mxfp4GptOssExperts is not dispatched "
                                         r"through transformers' experts registry"):
        xt.prepare(model)


@pytest.mark.skipif(not CPU, reason="bf16 is refused only in Triton's CPU interpreter")
def test_bf16_is_refused_in_the_interpreter():
    model = _model("qwen3_moe").to(torch.bfloat16)
    model.set_experts_implementation("xstage")
    with pytest.raises(InputError, match=r"^model\.layers\.0\.mlp\.experts: gate_up_proj dtype=bf16: .*fp16 or fp32"):
        xt.prepare(model, config=CFG)


def test_autograd_and_mismatched_inputs_are_refused():
    model, _ = _pair("qwen3_moe")
    experts = _block(model).experts
    x, idx, w = torch.randn(4, 64), torch.zeros(4, 2, dtype=torch.long), torch.full((4, 2), 0.5)
    idx[:, 1] = 1
    with pytest.raises(InputError, match=r"^model\.layers\.0\.mlp\.experts: gate_up_proj requires grad: .*no_grad"):
        experts(x, idx, w)  # grad enabled, parameters requiring grad
    with torch.no_grad():
        with pytest.raises(InputError, match=r"hidden_states: torch\.float16 on cpu, the experts' weights "
                                             r"torch\.float32"):
            experts(x.half(), idx, w)
        with pytest.raises(InputError, match=r"top_k_index, top_k_weights: expected \[4, K\]"):
            experts(x, idx[:3], w[:3])
    model.requires_grad_(False)
    y = experts(x, idx, w)  # inference without no_grad once nothing requires grad
    assert not y.requires_grad


def test_prepare_needs_a_model_set_to_xstage():
    model = _model("qwen3_moe")
    with pytest.raises(InputError, match=r"^model: no experts module runs experts_implementation='xstage'"):
        xt.prepare(model)
    model.set_experts_implementation("xstage")
    with pytest.raises(InputError, match=r"^max_tokens"):
        xt.prepare(model, max_tokens=0)
    with pytest.raises(InputError, match=r"^schedule"):
        xt.prepare(model, schedule=7)


def test_torch_compile_runs_the_experts_eagerly_between_graphs():
    model, _ = _pair("qwen3_moe")
    block = _block(model)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = block(x)
        torch._dynamo.reset()
        got = torch.compile(block, backend="eager")(x)
    assert torch.equal(got, want)


def test_missing_or_untested_transformers_names_the_extra(monkeypatch):
    # the module now in sys.modules: transformers' lazy module can be replaced there after import
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.18.0")
    with pytest.raises(XstageError, match=r"^transformers 5\.18\.0: .*tested with >=5\.17,<5\.18; pip install "
                                          r"'xstage\[transformers\]'"):
        xt.register()
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(XstageError, match=r"needs transformers: pip install 'xstage\[transformers\]'$"):
        xt.require_transformers()


@pytest.mark.gpu
def test_qwen3_30b_a3b_block_at_real_width_on_gpu():
    # One MoE block at Qwen3-30B-A3B's width (H2048-I768-E128-K8), BF16, default tiles, 512 tokens,
    # against eager in float32 on the same weights and routing: max|y - ref| / max|ref| <= 1e-2.
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    def block(impl):
        config = transformers.Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                             num_experts_per_tok=8, experts_implementation=impl)
        torch.manual_seed(0)
        with torch.device("cuda"):
            b = Qwen3MoeSparseMoeBlock(config)
        _randomize(b, seed=0)
        return b

    fast = block("xstage").to(torch.bfloat16)
    ref = block("eager").float()
    ref.load_state_dict({k: v.float() for k, v in fast.state_dict().items()})
    xt.prepare(fast)
    x = torch.randn(1, 512, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        y, want = _same_routing(fast, ref, x.to(torch.bfloat16))
    err = float((y.double() - want).abs().max() / want.abs().max())
    assert err <= 1e-2, err
    assert xt.memory(fast).weights == 0  # gate_up_proj and down_proj read in place


def test_the_guide_runs_as_written(capsys):
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "transformers.md").read_text()
    code = guide.split("## Try it on a CPU", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/guides/transformers.md", "exec"), {"__name__": "guide"})
    assert capsys.readouterr().out.split() == ["True", "2"]


def test_the_planner_may_run_transformers_grouped_mm_chain_and_says_so():
    # Measurements claiming grouped_mm is faster for this block's shape on this machine from 8 tokens:
    # the experts call runs transformers' own grouped_mm forward (no fused kernel, no buffer), matches
    # eager, and decisions() says what ran; kernel="fused" keeps the fused layer.
    from xstage.sched.experts import FORMAT, ExpertsCalls

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = [dict(gpu=gpu, dtype="fp32", shape="H64-I32-E8-K2", kernel=k, mode="eager", tokens=t, ns=ns)
            for k, t, ns in (("fused", 1, 100.0), ("fused", 8, 100.0), ("grouped_mm", 1, 150.0),
                             ("grouped_mm", 8, 50.0))]
    calls = ExpertsCalls.from_dict(dict(format=FORMAT, source="test", margin=0.03, rows=rows), "test")
    model, ref = _pair("qwen3_moe", calls=calls)
    name = "model.layers.0.mlp.experts"
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y, want = _block(model)(x), _block(ref)(x.double())
    torch.testing.assert_close(y.double(), want, **TOL[torch.float32])
    d = xt.decisions(model)[name][(12, False)]
    assert (d.kind, d.choice) == ("experts", "grouped_mm") and dict(d.predicted_ns)["grouped_mm"] < 100.0
    assert xt.memory(model).buffers == 0  # the fused layer never ran
    with torch.no_grad():
        _block(model)(x[:, :1])
    assert xt.decisions(model)[name][(1, False)].choice == "fused" and xt.memory(model).buffers > 0
    xt.prepare(model, config=CFG, calls=calls, kernel="fused")
    with torch.no_grad():
        torch.testing.assert_close(_block(model)(x).double(), want, **TOL[torch.float32])
    assert xt.decisions(model)[name] == {}
    with pytest.raises(InputError, match=r"^kernel='grouped': must be one of 'auto', 'fused'"):
        xt.prepare(model, kernel="grouped")
