"""`expert_parallel` over a real torch.distributed group: 2 ranks on gloo, one process each, running real
transformers models (tiny random configs, the same seed on every rank). Each rank feeds its own tokens,
a different number on each (zero included); its outputs must equal transformers' own `eager` experts
on the full, unsharded model in float64, within the CPU tests' tolerances (`test_transformers.TOL`).

The ranks live in `transformers_ranks.py`; every spawn is joined with a timeout, killed if still alive,
and asserted not hung.
"""

import pytest

transformers = pytest.importorskip("transformers")

from tests.integrations import transformers_ranks  # noqa: E402
from tests.integrations.test_transformers_fp8 import TOL_HERE as TOL_FP8  # noqa: E402
from xstage.errors import InputError  # noqa: E402
from xstage.integrations import transformers as xt  # noqa: E402

WORLD = 2
MODULE = r"model\.layers\.0\.mlp\.experts"


def _spawn(tmp_path, case, world=WORLD):
    recs, hung = transformers_ranks.run(tmp_path, world, case)
    stacks = "".join(f"\n--- rank {r}'s stacks at the timeout:\n{recs[r].get('stack', '(none written)')}" for r in hung)
    assert hung == [], f"ranks {hung} still running at the timeout (killed){stacks}"
    for r, rec in enumerate(recs):
        assert "error" not in rec, f"rank {r}: {rec['error']}"
    return recs


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Qwen3-MoE (H64-I32, 8 experts, top-2), 2 layers, fp32, sharded over 2 ranks, and every refusal."""
    return _spawn(tmp_path_factory.mktemp("qwen"), dict(arch="qwen3_moe", dtype="float32", max_tokens=32,
                                                        refusals=True))


def _assert_matches_eager(rec: dict, rank: int):
    for key, counts in (("block", transformers_ranks.BLOCK_TOKENS), ("block_zero", transformers_ranks.ZERO_TOKENS)):
        got = rec[key]
        assert got["close"] == "ok", f"rank {rank} {key}: {got['close']}"
        assert got["tokens"] == counts[rank] and got["shape"][1] == counts[rank]
        if counts[rank]:
            assert got["scale"] > 0.5  # outputs of unit scale: the tolerance is not larger than the signal


@pytest.mark.slow
def test_each_ranks_block_output_on_its_own_tokens_matches_eager(qwen):
    for r, rec in enumerate(qwen):
        _assert_matches_eager(rec, r)


@pytest.mark.slow
def test_each_ranks_logits_on_its_own_tokens_match_eager(qwen):
    for r, rec in enumerate(qwen):
        assert rec["logits"]["close"] == "ok", f"rank {r}: {rec['logits']['close']}"
        b, t = transformers_ranks.LOGITS_SHAPES[r]
        assert rec["logits"]["tokens"] == b * t and rec["logits"]["scale"] > 0.5
    assert qwen[0]["logits"]["tokens"] != qwen[1]["logits"]["tokens"]  # uneven counts


@pytest.mark.slow
def test_each_rank_holds_its_own_experts_only(qwen):
    for r, rec in enumerate(qwen):
        assert rec["names"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        mem = rec["memory"]
        assert mem["experts"] * WORLD == mem["full"] and mem["full"] == 2 * 8 * (64 * 64 + 64 * 32) * 4
        assert mem["weights"] == 0 and mem["modules"] == 2 and mem["buffers"] > 0
        assert rec["holds_own_slice"], f"rank {r} does not hold experts [{4 * r}, {4 * r + 4}) of the model"


@pytest.mark.slow
def test_saving_or_loading_a_sharded_model_is_refused(qwen):
    for r, rec in enumerate(qwen):
        want = (f"XstageError: model.layers.0.mlp.experts: holds experts [{4 * r}, {4 * r + 4}) of 8 (expert_parallel, "
                f"rank {r} of 2): its state_dict would be one rank's shard under the full model's names; save or load "
                "the model before expert_parallel")
        assert rec["state_dict"] == rec["save_pretrained"] == rec["load_state_dict"] == want
        assert not [f for f in rec["saved_files"] if f.endswith((".safetensors", ".bin"))]  # no weight file


@pytest.mark.slow
def test_a_call_over_max_tokens_is_refused_and_stops_every_rank(qwen):
    rank0, rank1 = qwen
    assert rank1["over_max_tokens"] == (
        "InputError: model.layers.0.mlp.experts: max_tokens: 40 tokens in one call on rank 1, over expert_parallel's "
        "max_tokens=32 (every rank's buffer holds that many; pass a larger max_tokens, or feed fewer tokens per "
        "forward)")
    # the peer's call was skipped (its output NaN, never a silent partial sum), and its next call says why
    assert rank0["over_max_tokens"] == "ok" and rank0["over_max_tokens_nan"] is True
    assert rank0["over_max_tokens_next"].startswith("InputError: rank 1 refused its tokens")
    assert rank1["over_max_tokens_next"] == "ok"
    assert rank0["after_refusal"] == rank1["after_refusal"] == "ok"  # the group runs on


@pytest.mark.slow
def test_autograd_and_unshardable_models_are_refused_by_name(qwen):
    for rec in qwen:
        assert rec["autograd"].startswith("InputError: model.layers.0.mlp.experts: top_k_weights requires grad: "
                                          "the xstage experts run forward only")
        assert rec["indivisible"] == ("InputError: model.layers.0.mlp.experts: num_experts=3 is not a multiple of the "
                                      "group's 2 ranks (expert_parallel gives each rank E / R whole experts)")
        assert rec["dtensor"].startswith("InputError: model.layers.0.mlp.experts: gate_up_proj is a DTensor: the model "
                                         "is sharded by transformers' own tensor or expert parallelism")
        assert rec["twice"].startswith("InputError: model.layers.0.mlp.experts: already sharded")
        assert rec["prepare"].startswith("InputError: model.layers.0.mlp.experts: holds experts")
        assert rec["released"] == [0, 0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16"], ids=["fp32", "fp16"])
def test_mixtral_padded_sizes_match_eager(tmp_path, dtype):
    # H40-I24: each rank pads its own 4 experts to H64-I32, and only those
    recs = _spawn(tmp_path, dict(arch="mixtral", dtype=dtype, max_tokens=16))
    itemsize = 4 if dtype == "float32" else 2
    for r, rec in enumerate(recs):
        _assert_matches_eager(rec, r)
        if dtype == "float32":
            assert rec["logits"]["close"] == "ok", f"rank {r}: {rec['logits']['close']}"
        assert rec["memory"]["experts"] * WORLD == rec["memory"]["full"] == 2 * 8 * (48 * 40 + 40 * 24) * itemsize
        assert rec["memory"]["weights"] == 2 * 4 * (64 * 64 + 64 * 32) * itemsize


@pytest.mark.slow
def test_gpt_oss_biases_and_transposed_weights_shard_and_match_eager(tmp_path):
    # GPT-OSS H40-I24, fp32: each rank keeps its 4 experts' weights and biases, de-interleaves,
    # transposes and pads only those, and the logits on its own tokens match eager on the whole model.
    recs = _spawn(tmp_path, dict(arch="gpt_oss", dtype="float32", max_tokens=16))
    for r, rec in enumerate(recs):
        _assert_matches_eager(rec, r)
        assert rec["logits"]["close"] == "ok", f"rank {r}: {rec['logits']['close']}"
        assert rec["holds_own_slice"], f"rank {r} does not hold its experts' weights and biases"
        # gate_up_proj [8, 40, 48], down_proj [8, 24, 40], biases [8, 48] and [8, 40], two layers, fp32
        full = 2 * 8 * (40 * 48 + 24 * 40 + 48 + 40) * 4
        assert rec["memory"]["experts"] * WORLD == rec["memory"]["full"] == full
        # the copies: 4 experts of w1 [64, 64], w2 [64, 32], b1 [64], b2 [64] per layer
        assert rec["memory"]["weights"] == 2 * 4 * (64 * 64 + 64 * 32 + 64 + 64) * 4


@pytest.mark.slow
def test_fp8_checkpoint_shards_weights_and_scales_and_meets_the_fp8_bounds(tmp_path):
    # Qwen3-MoE H256-I128 as a fine-grained FP8 checkpoint: each rank keeps its 2 experts' e4m3 weights
    # and their 128x128 scales (read in place: no copy), and its own tokens meet the FP8 bounds.
    recs = _spawn(tmp_path, dict(arch="qwen3_moe_fp8", dtype="bfloat16", max_tokens=16))
    for r, rec in enumerate(recs):
        assert rec["holds_own_slice"], f"rank {r} does not hold its experts' weights and scales"
        full = 4 * (256 * 256 + 256 * 128) + 4 * 4 * (2 * 2 + 2 * 1)  # e4m3 weights, float32 scales
        assert rec["memory"]["experts"] * WORLD == rec["memory"]["full"] == full and rec["memory"]["weights"] == 0
        for key, counts in (("block", transformers_ranks.BLOCK_TOKENS), ("block_zero", transformers_ranks.ZERO_TOKENS)):
            got = rec[key]
            assert got["tokens"] == counts[r] and got["shape"] == [counts[r], 256] and got["dtype"] == "torch.bfloat16"
            if counts[r]:
                assert got["rel_fp8"] <= TOL_FP8 and got["fro_float"] <= 6e-2, (r, key, got)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_one_gpu_match_eager(tmp_path, world, arch):
    for dtype in ("float32", "float16"):
        recs = _spawn(tmp_path / dtype, dict(arch=arch, dtype=dtype, max_tokens=64), world=world)
        for r, rec in enumerate(recs):
            _assert_matches_eager(rec, r)
            assert rec["memory"]["experts"] * world == rec["memory"]["full"]


def test_bad_arguments_and_a_missing_group_are_refused_before_any_work():
    import torch.distributed as dist

    assert not dist.is_initialized()
    xt.register()
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2))
    model.set_experts_implementation("xstage")
    with pytest.raises(InputError, match=r"^max_tokens"):
        xt.expert_parallel(model, max_tokens=0)
    with pytest.raises(InputError, match=r"^check: must be True, False or 'async'"):
        xt.expert_parallel(model, check="later")
    with pytest.raises(InputError, match=r"^group: torch\.distributed is not initialized \(call torch\.distributed"
                                         r"\.init_process_group first"):
        xt.expert_parallel(model)
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (4, 64, 64)  # nothing changed
    assert xt.memory(model) == xt.Memory(0, 0, 0)
