"""The MoE API refuses inputs the kernel cannot run, naming the field, before anything is launched."""

import numpy as np
import pytest
import torch

from xstage.env import interpreter_active
from xstage.errors import InputError
from xstage.moe.layout import transform_weights
from xstage.moe.reference import loopback_inputs, reference_moe_virtual
from xstage.probe.sweeps import parse_sweeps
from xstage.sched.pacing import resolve_pacing
from xstage.spec.moe import BlockConfig, parse_block
from xstage.spec.schedule import make_schedule
from xstage.spec.variant import parse_variants


@pytest.mark.parametrize("field,value,match", [
    ("block_m", 24, r"block_m=24.*power of two in 16\.\.1024"),
    ("block_m", 8, r"block_m=8.*in 16\.\.1024"),
    ("block_m", 2**40, r"block_m=1099511627776: block size must be a power of two in 16\.\.1024"),
    ("block_n1", 0, "block_n1=0"),
    ("block_n2", 96, "block_n2=96"),
    ("block_k", -64, "block_k=-64"),
    ("block_k", 64.0, "block_k=64.0"),
    ("block_d", 48, "block_d=48"),
    ("num_warps", 3, "num_warps=3.*power of two"),
    ("num_warps", 64, r"num_warps=64.*in 1\.\.32"),
    ("num_stages", 0, r"num_stages=0: must be an integer in 1\.\.16 \(pipeline stages\)"),
    ("num_stages", 10**18, r"num_stages=1000000000000000000: must be an integer in 1\.\.16"),
    ("ctas_per_sm", -1, r"ctas_per_sm=-1: must be an integer in 0\.\.32"),
    ("ctas_per_sm", 99, r"ctas_per_sm=99: must be an integer in 0\.\.32"),
    ("ctas_per_sm", 1.5, "ctas_per_sm=1.5"),
    ("tma", "yes", "tma='yes'"),
    ("block_m", True, "block_m=True"),
])
def test_block_config_refuses_what_the_kernel_cannot_run(field, value, match):
    with pytest.raises(InputError, match=f"BlockConfig {match}"):
        BlockConfig(**{field: value})


def test_block_config_accepts_the_configs_in_use():
    BlockConfig()
    BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)
    BlockConfig(block_m=64, block_n1=128, block_n2=256, block_k=64, block_d=8, ctas_per_sm=2, tma=False)
    assert parse_block("64:128:256:64:4:3", 4096).block_m == 64
    with pytest.raises(InputError, match="block_m=100"):
        parse_block("100:128:256:64:4:3", 4096)
    # found by tests/test_fuzz_args.py: an empty spec read as the defaults (`--block ""`, `--block bf16=`)
    with pytest.raises(InputError, match=r"^block '': expected BM:BN1:BN2:BK:WARPS:STAGES\[:FLAGS\]$"):
        parse_block("", 4096)


@pytest.mark.parametrize("kw,match", [
    (dict(unit_expert=[-1, 0]), r"unit_expert\[0\]=-1: must be an integer in 0\.\.2147483647"),
    (dict(unit_expert=[0, 0.5]), r"unit_expert\[1\]=0.5"),
    (dict(unit_expert="01"), "unit_expert='01'"),
    (dict(num_ctas=2.5), "num_ctas=2.5: must be an integer"),
    (dict(num_ctas=0), "num_ctas=0"),
    (dict(num_ctas=True), "num_ctas=True"),
    (dict(n1=1.5), "n1=1.5"),
    (dict(n2=0), "n2=0"),
    (dict(unit_rows=[4, -1, 2]), r"unit_rows\[1\]=-1"),
    (dict(unit_rows=[4, 2]), "unit_rows: 2 entries for 3 units"),
    (dict(dispatch_lead=-1), "dispatch_lead=-1"),
    # found by tests/test_fuzz_api.py: n2=2**40 built a task list until the machine's memory ran out
    (dict(n2=2**40), r"^n2=1099511627776: must be an integer in 1\.\.8192$"),
    (dict(num_ctas=2**31), r"^num_ctas=2147483648: must be an integer in 1\.\.131072$"),
    (dict(unit_expert=[0] * 300_000, n1=8192, n2=8192), r"^unit_expert: 300000 units x 16385 tasks each are more "),
    # found by tests/test_fuzz_api.py: OverflowError, ValueError and TypeError from numpy and torch
    (dict(block_m=2**31), r"^block_m=2147483648: must be an integer in 1\.\.2147483647$"),
    (dict(unit_expert=[2**40]), r"^unit_expert\[0\]=1099511627776: must be an integer in 0\.\.2147483647$"),
    (dict(unit_rows=torch.tensor(4)), r"^unit_rows=tensor\(4\): must be a sequence of integers >= 0$"),
    (dict(unit_dest_rows=True), r"^unit_dest_rows: must be \[3, R\] integers in 0\.\.2147483647"),
    (dict(unit_dest_rows=[[2**31]] * 3), r"^unit_dest_rows: must be \[3, R\] integers"),
])
def test_make_schedule_refuses_non_integer_or_negative_inputs(kw, match):
    args = dict(name="lag:1", unit_expert=[0, 0, 1], num_ctas=2, n1=2, n2=1)
    args.update(kw)
    with pytest.raises(InputError, match=match):
        make_schedule(**args)


def test_make_schedule_takes_numpy_and_tensor_integers():
    a = make_schedule("lag:1", [0, 0, 1], 2, 2, 1)
    b = make_schedule("lag:1", np.array([0, 0, 1]), np.int64(2), np.int32(2), 1)
    c = make_schedule("lag:1", torch.tensor([0, 0, 1]), 2, 2, 1)
    assert np.array_equal(a.tasks, b.tasks) and np.array_equal(a.tasks, c.tasks)


def _virtual(R=2, T=4, H=8, I=6, E=4, K=2):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=g) for _ in range(R)]
    idx = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) for _ in range(R)]
    ws = [torch.rand(T, K, generator=g) for _ in range(R)]
    l1 = [torch.randn(E // R, 2 * I, H, generator=g) for _ in range(R)]
    l2 = [torch.randn(E // R, H, I, generator=g) for _ in range(R)]
    return xs, idx, ws, l1, l2


@pytest.mark.parametrize("bad", [99, 4, -1])
def test_reference_refuses_expert_ids_outside_the_experts(bad):
    xs, idx, ws, l1, l2 = _virtual()
    assert len(reference_moe_virtual(xs, idx, ws, l1, l2)) == 2
    idx[1] = idx[1].clone()
    idx[1][2, 0] = bad
    with pytest.raises(InputError, match=rf"topk_idx\[1\]: expert id {bad} is outside \[0, 4\)"):
        reference_moe_virtual(xs, idx, ws, l1, l2)


def test_reference_refuses_malformed_topk_idx():
    xs, idx, ws, l1, l2 = _virtual()
    with pytest.raises(InputError, match=r"topk_idx\[0\]: must hold integer expert ids"):
        reference_moe_virtual(xs, [i.float() for i in idx], ws, l1, l2)
    with pytest.raises(InputError, match="topk_idx: 1 tensors for 2 ranks"):
        reference_moe_virtual(xs, idx[:1], ws, l1, l2)
    with pytest.raises(InputError, match=r"topk_idx: expert id 99 is outside \[0, 8\)"):
        loopback_inputs(xs[0], torch.tensor([[0, 99]]), ws[0][:1], l1[0], l2[0], num_ranks=4)
    with pytest.raises(InputError, match=r"topk_idx: must be a 2-d \[tokens, topk\] tensor of expert ids \(holding"):
        loopback_inputs(xs[0], idx[0].to("meta"), ws[0], l1[0], l2[0], num_ranks=2)  # .item() raised


# ---- MoEBuffer, Problem and fused_moe: every number, the group, the device and the dtype -----------

def _buffer(**kw):
    from xstage.moe.buffer import LoopbackGroup, MoEBuffer

    args = dict(num_max_tokens_per_rank=8, num_experts=4, topk=2, hidden=64, intermediate=32,
                group=LoopbackGroup(2), device="cpu", dtype="fp16",
                config=BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32))
    args.update(kw)
    if args["device"] is None:  # left out, as a caller would
        del args["device"]
    return MoEBuffer(**args)


@pytest.mark.parametrize("kw, match", [
    (dict(group="abc"), r"^group='abc': must be a LoopbackGroup, a torch\.distributed ProcessGroup or None$"),
    (dict(timeout_ns=float("nan")), r"^timeout_ns=nan: must be an integer in 1\.\.3600000000000"),
    (dict(timeout_ns=0.5), r"^timeout_ns=0\.5: must be an integer"),
    (dict(num_max_tokens_per_rank=1.5), r"^num_max_tokens_per_rank=1\.5: must be an integer in 1\.\.1048576"),
    (dict(num_max_tokens_per_rank=2**63), r"^num_max_tokens_per_rank=9223372036854775808: must be an integer"),
    (dict(num_experts="4"), r"^num_experts='4': must be an integer in 1\.\.4096"),
    (dict(topk=9), r"^topk=9: must be an integer in 1\.\.4 \(experts per token, at most num_experts\)"),
    (dict(hidden=10**9), r"^hidden=1000000000: must be an integer in 1\.\.65536"),
    (dict(intermediate=float("inf")), r"^intermediate=inf: must be an integer"),
    (dict(pool_bytes=1e300), r"^pool_bytes=1e\+300: must be an integer in 1\.\.9223372036854775807"),
    (dict(pacing="50:1e300"), r"^pacing '50:1e300': BUDGET_KIB=1e\+300: must be a finite number in 0\.\.1048576 KiB"),
    (dict(pacing="1e290:128"), r"^pacing '1e290:128': RATE_GBPS=1e\+290: must be"),
    (dict(device="abc"), r"^device='abc': not a device"),
    (dict(config="64:128"), r"^config='64:128': must be a BlockConfig or None$"),
    (dict(num_max_tokens_per_rank=1 << 20, num_experts=4096, topk=4096, group=None),
     r"^num_max_tokens_per_rank=1048576: 1 ranks x 1048576 tokens x top-4096 make \d+ row slots, over the "
     r"2147483647 int32 row indices hold$"),
])
def test_buffer_checks_every_argument_before_allocating(kw, match):
    with pytest.raises(InputError, match=match):
        _buffer(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(num_ranks=1.5), r"^LoopbackGroup num_ranks=1\.5: must be an integer in 1\.\.1024 \(ranks of the EP group\)$"),
    (dict(num_ranks=10**6), r"^LoopbackGroup num_ranks=1000000: must be an integer in 1\.\.1024"),
    (dict(num_ranks=2, path="nvlink"), r"^LoopbackGroup path='nvlink': must be 'hbm' or 'host'$"),
    (dict(num_ranks=2, silent_ranks=(2,)), r"^LoopbackGroup silent_ranks=2: must be an integer in 0\.\.1"),
    (dict(num_ranks=2, silent_ranks=1), r"^LoopbackGroup silent_ranks=1: must be a tuple of ranks$"),
])
def test_loopback_group_states_its_bounds(kw, match):
    from xstage.moe.buffer import LoopbackGroup

    with pytest.raises(InputError, match=match):
        LoopbackGroup(**kw)


def test_exact_integral_floats_are_taken_as_the_integers_they_spell():
    from xstage.moe.buffer import LoopbackGroup

    buf = _buffer(num_max_tokens_per_rank=8.0, timeout_ns=2e9, group=LoopbackGroup(2.0))
    assert (buf.T_max, buf.timeout_ns, buf.R) == (8, 2_000_000_000, 2)


def test_the_device_defaults_as_create_context_does():
    from xstage.comm import create_context

    buf = _buffer(device=None)
    with create_context(path="hbm") as ctx:
        assert buf.device == ctx.device
    if not torch.cuda.is_available():
        assert buf.device == torch.device("cpu")
        with pytest.raises(InputError, match=r"^device='cuda': no CUDA GPU here"):
            _buffer(device="cuda")


@pytest.mark.skipif(not interpreter_active(), reason="Triton's CPU interpreter is off")
def test_bf16_is_refused_by_name_in_the_interpreter_before_any_work():
    from xstage.moe.buffer import LoopbackGroup, MoEBuffer
    from xstage.moe.problem import Problem

    message = r"^dtype=bf16: dtype bf16 cannot run in Triton's CPU interpreter .*use fp16 or fp32 there$"
    for call in (lambda: _buffer(dtype="bf16"), lambda: _buffer(dtype=torch.bfloat16),
                 lambda: MoEBuffer(8, 4, 2, 64, 32, LoopbackGroup(2)),  # the default dtype
                 lambda: Problem("H64-I32-E4-K2", 8, 2, "hbm", device="cpu")):
        with pytest.raises(InputError, match=message):
            call()


@pytest.mark.parametrize("kw, match", [
    (dict(tokens=2**70), r"^tokens=1180591620717411303424: must be an integer in 1\.\.1048576"),
    (dict(tokens=0), r"^tokens=0: must be an integer"),
    (dict(ep=3), r"^ep=3: must divide the 4 experts of H64-I32-E4-K2$"),
    (dict(ep=0.5), r"^ep=0\.5: must be an integer in 1\.\.1024"),
    (dict(seed=None), r"^seed=None: must be an integer in 0\.\.9223372036854775806"),  # was a TypeError
    (dict(cfg=torch.tensor([1, 2])), r"^cfg: must be a BlockConfig or None, got Tensor$"),  # was a RuntimeError
    (dict(shape="H64-I32-E4-K5"), r"^shape='H64-I32-E4-K5': K=5: must be an integer in 1\.\.4"),
    (dict(shape=(64, 32.5, 4, 2)), r"^shape=\(64, 32\.5, 4, 2\): I=32\.5: must be an integer in 1\.\.65536"),
])
def test_problem_checks_its_numbers(kw, match):
    from xstage.moe.problem import Problem

    args = dict(shape="H64-I32-E4-K2", tokens=8, ep=2, path="hbm", device="cpu", dtype="fp16")
    with pytest.raises(InputError, match=match):
        Problem(**{**args, **kw})


def test_fused_moe_checks_the_call_numbers_before_launching():
    from xstage.moe import fused_moe, transform_weights

    buf = _buffer()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g).half()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(4)])
    w = torch.rand(4, 2, generator=g)
    w1t, w2 = transform_weights(torch.randn(2, 64, 64, generator=g).half(), torch.randn(2, 64, 32, generator=g).half(),
                                16)
    for kw, match in ((dict(timeout_ns=float("nan")), r"^timeout_ns=nan: must be an integer"),
                      (dict(timeout_ns=-1), r"^timeout_ns=-1: must be an integer in 1\.\.3600000000000"),
                      (dict(pacing="50:1e300"), r"^pacing '50:1e300': BUDGET_KIB=1e\+300"),
                      (dict(pacing="1e290:128"), r"^pacing '1e290:128': RATE_GBPS=1e\+290")):
        with pytest.raises(InputError, match=match):
            fused_moe(x, idx, w, w1t, w2, buf, schedule="lag:1", **kw)
    with pytest.raises(InputError, match=r"^buf: expected a MoEBuffer, got str$"):
        fused_moe(x, idx, w, w1t, w2, "buf")
    for flag, what in (("check", "True, False or 'async'"), ("static", "True or False")):
        # found by tests/test_fuzz_api.py: a tensor flag raised a RuntimeError
        with pytest.raises(InputError, match=rf"^{flag}: must be {what}, got Tensor$"):
            fused_moe(x, idx, w, w1t, w2, buf, **{flag: torch.tensor([1, 2])})


@pytest.mark.parametrize("text, match", [
    ("lag:4@1e290:128", r"RATE_GBPS=1e\+290: must be a finite number in 1\.\.10000 GB/s"),
    ("lag:4@50:1e300", r"BUDGET_KIB=1e\+300: must be a finite number in 0\.\.1048576 KiB"),
])
def test_variants_refuse_absurd_pacings(text, match):
    from xstage.spec.variant import Variant

    with pytest.raises(InputError, match=match):
        Variant.parse(text)


@pytest.mark.parametrize("call, match", [
    (lambda: loopback_inputs(torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2),
                             torch.zeros(1, 12, 8), torch.zeros(1, 8, 6), 2**40),
     r"^num_ranks=1099511627776: must be an integer in 1\.\.1024"),  # it built 2**40 copies: a hang
    (lambda: transform_weights(None, torch.zeros(2, 64, 32), 16), r"^l1: must be a 3-d weight tensor, got NoneType$"),
    (lambda: transform_weights(torch.zeros(2, 64, 64), torch.zeros(2, 64, 32), "16"), r"^block_n1='16': must be"),
    (lambda: parse_variants(1048576), r"^--schedules 1048576: expected a str"),
    (lambda: parse_block(True, 512), r"^block True: expected a string BM:BN1:BN2:BK:WARPS:STAGES\[:FLAGS\] or None$"),
    (lambda: parse_block("64:64:128:32:4:2", "512"), r"^hidden='512': must be an integer in 1\.\.65536"),
    (lambda: resolve_pacing("50:128", "host", None),
     r"^num_ranks=None: must be an integer in 1\.\.1024"),
    (lambda: resolve_pacing("default", "nvlink", 2),
     r"^path='nvlink': must be one of hbm, host, peer"),
    (lambda: parse_sweeps(None, "host"), r"^--sweep None: expected"),
    (lambda: parse_sweeps("all", []), r"^--path \[\]: must be one of \['hbm', 'host', 'peer'\]$"),
])
def test_parsers_refuse_what_is_not_their_text(call, match):
    """Found by tests/test_fuzz_api.py: these raised AttributeError or TypeError."""
    with pytest.raises(InputError, match=match):
        call()


def test_default_blocks_keep_the_stages_that_fit_the_dtype_and_a_named_config_is_checked():
    # Found on an H100: float32 experts under expert_parallel were refused (4 stages of 98304 bytes of
    # float32 operand tiles exceed the 232448 bytes of shared memory). Unnamed blocks now keep 2 stages.
    from xstage.moe.buffer import SHARED_BYTES, LoopbackGroup, MoEBuffer, default_block_config, stage_bytes

    assert stage_bytes(BlockConfig(), 4) == 98304 and SHARED_BYTES == 232448
    for dtype, stages in ((torch.float32, 2), (torch.bfloat16, 4), (torch.float16, 4)):
        cfg = default_block_config(dtype)
        assert cfg.num_stages == stages and cfg.num_stages * stage_bytes(cfg, dtype.itemsize) <= SHARED_BYTES
        assert (cfg.block_m, cfg.block_n1, cfg.block_k) == (BlockConfig().block_m, BlockConfig().block_n1,
                                                            BlockConfig().block_k)
    buf = MoEBuffer(16, 8, 2, 256, 256, LoopbackGroup(1), device="cpu", dtype=torch.float32)
    assert buf.cfg == default_block_config(torch.float32)
    with pytest.raises(InputError, match=r"^num_stages=4: 4 x 98304 bytes of operand tiles exceed"):
        MoEBuffer(16, 8, 2, 256, 256, LoopbackGroup(1), device="cpu", dtype=torch.float32, config=BlockConfig())


def test_the_transformers_backend_defaults_to_the_stages_of_the_modules_dtype():
    transformers = pytest.importorskip("transformers")
    from xstage.integrations.transformers import weights

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      num_experts=4, num_experts_per_tok=2)
    experts = transformers.Qwen3MoeForCausalLM(cfg).model.layers[0].mlp.experts
    assert weights.default_config(experts).num_stages == 2  # float32 parameters
    assert weights.default_config(experts.to(torch.bfloat16)).num_stages == 4
