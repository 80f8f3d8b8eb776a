"""xstage's Ulysses attention inside real diffusers models (`xstage.integrations.diffusers`).

Two ranks on gloo (spawned once for the module, `diffusers_ranks.py`) run tiny Flux and Wan
transformers with seeded random weights under diffusers' context parallelism with xstage enabled; the
reference is the same model's diffusers output in one process, unsharded, in float32. Spies count whose
all-to-all ran. The tolerance is the CPU Ulysses tests' float32 one.
"""

import sys

import pytest
import torch

pytest.importorskip("diffusers")

from tests.integrations.diffusers_ranks import run_ranks  # noqa: E402
from xstage.errors import InputError, XstageError  # noqa: E402
from xstage.integrations import diffusers as xd  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # bf16: the whole model against diffusers' own bf16 output
WORLD = 2
CPU_SCENARIOS = ["even", "uneven", "exchanges", "control", "refusals", "wan", "compiled", "guide"]


@pytest.fixture(scope="module")
def ranks():
    if torch.cuda.is_available():
        pytest.skip("the GPU variant runs instead")
    return run_ranks(CPU_SCENARIOS, WORLD, timeout_s=600)


def _per_rank(ranks, scenario):
    per = ranks[scenario]
    errors = [f"rank {r}: {v['error']}\n{v.get('trace', '')}" for r, v in per.items() if "error" in v]
    assert not errors, "\n".join(errors)
    return [per[r] for r in range(WORLD)]


def _xstage_ran(res, calls):
    """xstage's layer ran `calls` times, with its own pre-attention all-to-all, and diffusers' never did."""
    assert res["xstage_calls"] == calls
    assert res["xstage_a2a"] >= calls
    assert res["diffusers_a2a"] == 0
    assert res["diffusers_templated"] == 0
    assert res["diffusers_ulysses"] == 0


def test_flux_matches_the_unsharded_model_with_heads_not_dividing_and_batch_2(ranks):
    # 3 heads over 2 ranks, batch 2, 8 text + 16 image tokens: 12 per rank
    for res in _per_rank(ranks, "even"):
        got = res["auto"]
        assert got["shape"] == res["ref_shape"] == [2, 16, 4]
        assert got["err"] <= TOL[torch.float32]
        _xstage_ran(got, calls=2)  # one double-stream and one single-stream block
        assert got["tokens"] == [12, 12]


def test_flux_uneven_sequence_with_ulysses_anything(ranks):
    # 7 text tokens split 4 + 3: the ranks attend over 12 and 11 local tokens
    r0, r1 = _per_rank(ranks, "uneven")
    assert r0["auto"]["tokens"] == [12, 12] and r1["auto"]["tokens"] == [11, 11]
    for res in (r0, r1):
        assert res["auto"]["err"] <= TOL[torch.float32]
        _xstage_ran(res["auto"], calls=2)


@pytest.mark.parametrize("exchange", ["serial", "overlap", "stores", "heads:triton:2"])
def test_every_exchange_policy(ranks, exchange):
    for res in _per_rank(ranks, "exchanges"):
        assert res[exchange]["err"] <= TOL[torch.float32]
        _xstage_ran(res[exchange], calls=2)


def test_diffusers_all_to_all_is_not_called_and_disable_gives_it_back(ranks):
    for res in _per_rank(ranks, "control"):
        assert res["enabled"] and not res["enabled_after"]
        assert res["on"]["err"] <= TOL[torch.float32]
        _xstage_ran(res["on"], calls=2)
        # the same model after disable: diffusers' own Ulysses layer, which the spies do see
        assert res["backends_after"] == ["None"]
        assert res["off"]["err"] <= TOL[torch.float32]
        assert res["off"]["diffusers_templated"] == res["off"]["diffusers_ulysses"] == 2
        assert res["off"]["diffusers_a2a"] == 2 * 4  # q, k, v and the output, in each of the two blocks
        assert res["off"]["xstage_calls"] == 0
        # one registry entry while enabled, none after disable or once the model is collected
        n = res["registry"][0]
        assert res["registry"] == [n, n + 1, n]
        assert res["registry_enabled_again"] == n + 1 and res["registry_collected"] == n


def test_wan_self_attention_parallel_and_cross_attention_local(ranks):
    for res in _per_rank(ranks, "wan"):
        assert res["err"] <= TOL[torch.float32]
        _xstage_ran(res, calls=2)  # two blocks' self-attention
        assert res["local_calls"] == 2  # their cross-attention, on diffusers' native backend
        assert res["tokens"] == [6, 6]


def test_torch_compile_fullgraph_runs_the_custom_op(ranks):
    for res in _per_rank(ranks, "compiled"):
        assert res["op"]["err"] <= TOL[torch.float32]
        assert res["op"]["op_calls"] == 2 and res["op"]["xstage_calls"] == 0


def test_torch_compile_with_a_calibration_runs_the_attention_eagerly(ranks):
    for res in _per_rank(ranks, "compiled"):
        # the op takes no calibration: the attention leaves the graph and the module decides with it
        assert res["calibration"]["err"] <= TOL[torch.float32]
        assert res["calibration"]["op_calls"] == 0 and res["calibration"]["xstage_calls"] == 2
        # which fullgraph=True refuses, saying why
        raised = res["calibration_fullgraph"]["raised"]
        assert raised.startswith("Unsupported: Skip calling `torch.compiler.disable()`d function")
        assert "xstage's custom op takes no calibration=" in raised


def test_the_guide_code_runs(ranks):
    for res in _per_rank(ranks, "guide"):
        assert res["err"] <= TOL[torch.float32]
        _xstage_ran(res, calls=2)


@pytest.mark.parametrize("case, starts", [
    ("before_parallelism", "InputError: transformer: FluxTransformer2DModel has no context parallelism; call "
                           "transformer.enable_parallelism("),
    ("bad_exchange", "InputError: exchange 'bogus': expected one of"),
    ("bad_calibration", "InputError: calibration='/nonexistent/folder': not a folder"),
    ("tma", "InputError: exchange 'tma': cannot run here"),
    ("twice", "InputError: transformer: xstage's Ulysses attention is already enabled"),
    ("autograd", "InputError: autograd: xstage's Ulysses attention has no backward"),
    ("mask", "InputError: attn_mask: not supported"),
    ("ring", "InputError: ContextParallelConfig.ring_degree=2: xstage replaces the whole Ulysses layer"),
    ("degree", "InputError: ContextParallelConfig.ulysses_degree=2: the Ulysses mesh's group has 1 ranks"),
    # through diffusers' dispatch: what xstage's layer refuses reaches every rank, each naming itself
    ("causal", "InputError: rank {rank}: causal=True: only non-causal attention is supported"),
    ("dropout", "InputError: rank {rank}: dropout_p=0.1: only 0.0 is supported (inference)"),
    ("head_dim", "InputError: rank {rank}: q: head dim D=24: must be one of"),
    ("gqa", "InputError: enable_gqa: not supported"),
    ("lse", "InputError: return_lse: not supported"),
    ("kv_len", "InputError: key, value: 5 and 5 local tokens against the query's 12"),
])
def test_refusals_are_one_line_on_every_rank(ranks, case, starts):
    for rank, res in enumerate(_per_rank(ranks, "refusals")):
        assert res[case] is not None and res[case].startswith(starts.format(rank=rank)), res[case]
        assert "\n" not in res[case]


def test_attention_without_parallel_config_stays_diffusers_own(ranks):
    for res in _per_rank(ranks, "refusals"):
        assert res["local_err"] == 0.0  # the very native backend, not an approximation of it


def test_a_call_after_refused_calls_still_matches(ranks):
    for res in _per_rank(ranks, "refusals"):
        assert res["after_err"] <= TOL[torch.float32]


# In one process: what is refused before any rank is involved.

def _tiny_flux():
    from tests.integrations.diffusers_ranks import flux

    return flux(2, 1, 8, 16, torch.device("cpu"))[0]


def test_version_outside_the_supported_range_is_refused(monkeypatch):
    import diffusers

    for version in ("0.43.0", "0.41.2", "0.42.0.dev0", "1.0.0"):
        monkeypatch.setattr(diffusers, "__version__", version)
        with pytest.raises(XstageError, match=rf"^diffusers {version}: xstage's integration supports diffusers "
                                              r"0\.42\.x .*pip install 'xstage\[diffusers\]'$"):
            xd.enable(_tiny_flux())


def test_missing_diffusers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # what `import diffusers` raises ImportError for
    with pytest.raises(XstageError, match=r"^diffusers: not installed .*pip install 'xstage\[diffusers\]'$"):
        xd.enable(object())


def test_not_a_diffusers_model_and_disable_before_enable():
    with pytest.raises(InputError, match=r"^transformer: expected a diffusers model \(ModelMixin\), got Linear$"):
        xd.enable(torch.nn.Linear(2, 2))
    model = _tiny_flux()
    with pytest.raises(InputError, match="^transformer: xstage's Ulysses attention is not enabled"):
        xd.disable(model)
    assert not xd.is_enabled(model)


@pytest.mark.gpu
def test_ranks_sharing_one_gpu_bf16():
    res = run_ranks(["gpu_bf16"], WORLD, use_gpu=True, timeout_s=600)["gpu_bf16"]
    errors = [f"rank {r}: {v['error']}" for r, v in res.items() if "error" in v]
    assert not errors, "\n".join(errors)
    for r in range(WORLD):
        assert res[r]["err"] <= TOL[torch.bfloat16]
        _xstage_ran(res[r], calls=2)
