"""Property: every public parser, constructor and entry point, given one argument replaced by a drawn
value (the others valid and tiny), returns or raises `InputError` with a one-line message; never a
TypeError, AttributeError, ZeroDivisionError, OverflowError, AssertionError, RecursionError or an
error of torch or Triton, and never runs past the watchdog.

The arguments of each function are read from its signature, so a new parameter is fuzzed as soon as it
exists. Values are drawn from numbers past every bound (negative, zero, NaN, infinities, past int64,
fractions, numpy and torch scalars), text, unicode, containers and other objects; for the grammars
(exchange, variant, shape, block, pacing, dtype, `--only`, sizes, times) from mutations of valid
spellings; for tensors, from the valid tensor made wrong (dtype, rank, sizes, strides, empty, device,
NaN, indices out of range). Tensors stay tiny: most malformed inputs are refused before any kernel
launch, and those accepted run in Triton's CPU interpreter in milliseconds. Left out: the plain-torch
references (`attention_reference`, `reference_moe_virtual`, the ground truth of the tests), which
compute what they are given.

CI replays a fixed set of examples (the `ci` profile of `tests/conftest.py`); to explore, run
    HYPOTHESIS_PROFILE=dev PYTHONPATH=src python -m pytest -p no:cacheprovider tests/test_fuzz_api.py
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from xstage.errors import InputError

from .fuzzing import examples, watchdog
from .mutations import near

# ---- values --------------------------------------------------------------------------------------------

ODD = [None, True, False, "", " ", "abc", "4", " 4 ", "nan", "inf", "-1", "1e999", "é", "\n", b"4", [], [1], [1, 2],
       {}, {"a": 1}, (), (1,), object(), float("nan"), float("inf"), -float("inf"), -1, 0, -0.0, 0.5, 1.5, 3, 7,
       2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 1e300, -1e300, 5e-324, complex(1, 1), np.int64(-1),
       np.float64("nan"), np.float32(1e30), np.int32(3), Fraction(1, 3), Fraction(8, 1), Decimal("nan"),
       Decimal("4"), torch.tensor(4), torch.tensor([1, 2]), torch.tensor(float("nan")), torch.float16, "cpu",
       torch.device("meta")]
# Numbers only a little past the bounds, and text: what keeps a valid call tiny when it is accepted.
SMALL = st.integers(-3, 300) | st.floats(-3, 300) | st.sampled_from([2**20, 2**40])
ANY = st.sampled_from(ODD) | SMALL | st.text(max_size=8)


@st.composite
def tensor_like(draw, base: torch.Tensor, index: int | None = None):
    """`base` made wrong: dtype, rank, sizes, strides, emptiness, device or values (`index`: the number
    of valid ids of an index tensor, to draw ids out of range)."""
    t = base.clone()
    ways = [
        lambda: t.to(draw(st.sampled_from([torch.int32, torch.int64, torch.bool, torch.float64, torch.bfloat16,
                                           torch.complex64, torch.uint8, torch.float16, torch.float32]))),
        lambda: t.unsqueeze(0), lambda: t.reshape(-1), lambda: t[..., :0], lambda: t[:0],
        lambda: t.transpose(0, -1), lambda: t[..., ::2], lambda: torch.cat([t, t], dim=-1),
        lambda: torch.cat([t, t], dim=0), lambda: t.new_zeros(()), lambda: t.to("meta"),
        lambda: t.float().fill_(float("nan")).to(t.dtype) if t.is_floating_point() else t,
        lambda: t.flatten(0, 1) if t.dim() >= 2 else t, lambda: t.sum(),
    ]
    if index is not None:
        ways += [lambda: t + index, lambda: t - index, lambda: torch.full_like(t, 2**31 - 1), lambda: t.float(),
                 lambda: t[:, :1].expand_as(t).contiguous() if t.dim() == 2 else t]
    return draw(st.sampled_from(ways))()


def tensors(base: Callable, index: int | None = None):
    """A strategy of wrong tensors made from `base()` (a fresh valid tensor), or any odd value."""
    return st.deferred(lambda: tensor_like(base(), index)) | ANY


# ---- the functions ---------------------------------------------------------------------------------------


# Parameters a caller in the library fills with its own constants: the name an error gives an argument,
# the bounds of a command's option. Left as the base has them.
LABELS = ("arg", "name", "what")


@dataclass(frozen=True)
class Api:
    id: str
    fn: Callable
    base: Callable  # -> (args, kwargs) of a valid, tiny call
    values: dict = field(default_factory=dict)  # parameter -> strategy (default: ANY)
    fixed: tuple = ()  # parameters left as the base has them (callbacks, outputs the call fills)


def _params(api: Api) -> list[str]:
    sig = inspect.signature(api.fn)
    return [n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and n not in api.fixed and n != "self"]


def _call(api: Api, name: str, value):
    args, kwargs = api.base()
    bound = inspect.signature(api.fn).bind_partial(*args, **kwargs)
    bound.arguments[name] = value
    return api.fn(*bound.args, **bound.kwargs)


def _half(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).half()


def _flash_base():
    q = _half(1, 16, 1, 16)
    return (q, q.clone(), q.clone()), {"kv_lens": torch.tensor([16], dtype=torch.int32)}


def _moe_buffer(**kw):
    from xstage.moe.buffer import LoopbackGroup
    from xstage.spec.moe import BlockConfig

    args = dict(num_max_tokens_per_rank=8, num_experts=4, topk=2, hidden=64, intermediate=32,
                group=LoopbackGroup(2), device="cpu", dtype="fp16",
                config=BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32))
    return {**args, **kw}


def _fused_base():
    from xstage.moe import MoEBuffer, transform_weights

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g).half()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(4)])
    w = torch.rand(4, 2, generator=g)
    w1t, w2 = transform_weights(torch.randn(2, 64, 64, generator=g).half(), torch.randn(2, 64, 32, generator=g).half(),
                                16)
    return (x, idx, w, w1t, w2, MoEBuffer(**_moe_buffer())), {"schedule": "lag:1"}


def _ulysses_base():
    from xstage.comm import create_context

    q = _half(1, 16, 2, 16)
    return (q, q.clone(), q.clone()), {"comm": create_context(path="hbm", loopback_world=2, rank=1, device="cpu"),
                                       "exchange": "serial", "seq_lens": [16, 16]}


def _apis() -> list[Api]:
    from xstage.attention import FlashConfig, flash_attention, parse_exchange, ulysses_attention
    from xstage.cli.model import parse_count, parse_size, parse_time
    from xstage.comm import create_context
    from xstage.dtypes import parse_dtype
    from xstage.model import PathParams, Profile, load_default_profile
    from xstage.moe import (
        BlockConfig,
        LoopbackGroup,
        MoEBuffer,
        MoeShape,
        Problem,
        Variant,
        fused_moe,
        make_schedule,
        parse_block,
        parse_variants,
        resolve_pacing,
    )
    from xstage.probe.sweeps import parse_sweeps
    from xstage.results.io import read_json, read_table
    from xstage.results.select import parse_only, select
    from xstage.sched.costs import TaskCosts, load_default_costs
    from xstage.sched.exchange import default_exchange_costs, plan_exchange, predict
    from xstage.sched.moe import MoeConfig
    from xstage.sched.plan import plan_moe
    from xstage.spec.pacing import StorePacing, parse_pacing

    prof = load_default_profile("host")
    params = prof.params.to_dict()
    costs = load_default_costs("moe")
    cfg = MoeConfig.parse("H512-I256-E16-K2", tokens_per_rank=32, ep=4, block_m=64, block_n1=64, block_n2=128)
    exchange = near("serial:cudnn", "overlap:cudnn:3:waves", "stores:paced:16", "stores:burst", "auto")
    variant = near("lag:4@50:128", "expert_wave", "interleaved@off", "lag:16@default")
    shape = near("H4096-I2048-E256-K6", "H64-I32-E4-K2")
    block = near("128:128:256:64:8:4", "64:128:256:64:4:3:td2")
    pacing = near("50:128", "default", "off", "auto", "25.5:0")
    path = st.sampled_from(["", "\x00", "a\x00b", "/", "/dev/null", "/proc/self/mem", "x" * 5000, "/nonexistent/x"]) \
        | ANY
    from xstage.comm import decode_error, error_code
    from xstage.model import closed_form, path_simulator, simulate_bursts
    from xstage.moe import (
        loopback_inputs,
        quantize_activations,
        quantize_weights,
        transform_weights,
    )

    p = prof.params
    more = [
        Api("closed_form.burst", closed_form.burst, lambda: ((p, 65536.0), dict(n_sm=8))),
        Api("closed_form.periodic_steady_issue_time", closed_form.periodic_steady_issue_time,
            lambda: ((p, 65536.0, 2000.0), dict(n_sm=8))),
        Api("simulate_bursts", simulate_bursts, lambda: ((p, [[(65536, 0.0)] * 3, [(4096, 100.0)]]), {}),
            {"programs": st.lists(st.lists(st.tuples(SMALL | ANY, SMALL | ANY), max_size=3), max_size=3) | ANY}),
        Api("path_simulator", path_simulator, lambda: ((p, 4), {})),
        Api("error_code", error_code, lambda: ((3, 1), {})),
        Api("decode_error", decode_error, lambda: ((3 << 16 | 1,), {})),
        Api("transform_weights", transform_weights, lambda: ((_half(2, 64, 64), _half(2, 64, 32), 16), {}),
            {"l1": tensors(lambda: _half(2, 64, 64)), "l2": tensors(lambda: _half(2, 64, 32))}),
        Api("quantize_activations", quantize_activations, lambda: ((_half(4, 128).float(),), {}),
            {"x": tensors(lambda: _half(4, 128).float())}),
        Api("quantize_weights", quantize_weights, lambda: ((_half(2, 128, 128).float(),), {}),
            {"w": tensors(lambda: _half(2, 128, 128).float())}),
        Api("loopback_inputs", loopback_inputs, lambda: ((_half(4, 8).float(), torch.tensor([[0, 1]] * 4),
                                                          torch.rand(4, 2), torch.randn(1, 12, 8), torch.randn(1, 8, 6),
                                                          4), {}),
            {"x": tensors(lambda: _half(4, 8).float()), "topk_idx": tensors(lambda: torch.tensor([[0, 1]] * 4), 4)}),
    ]
    return more + [
        Api("parse_exchange", parse_exchange, lambda: (("serial",), {}), {"spec": exchange | ANY}),
        Api("Variant.parse", Variant.parse, lambda: (("lag:4",), {}), {"text": variant | ANY}),
        Api("Variant", Variant, lambda: (("lag:4", "50:128"), {}), {"schedule": variant | ANY, "pacing": pacing | ANY}),
        Api("parse_variants", parse_variants, lambda: (("lag:4,expert_wave",), {}), {"text": variant | ANY},
            fixed=LABELS),
        Api("MoeShape.parse", MoeShape.parse, lambda: (("H64-I32-E4-K2",), {}), {"text": shape | ANY}, fixed=LABELS),
        Api("parse_block", parse_block, lambda: (("64:64:128:32:4:2", 512), {}),
            {"spec": block | ANY, "hidden": SMALL | ANY}),
        Api("resolve_pacing", resolve_pacing, lambda: (("50:128", "host", 4), {}), {"pacing": pacing | ANY}),
        Api("parse_pacing", parse_pacing, lambda: (("50:128",), {}), {"spec": pacing | ANY}),
        Api("StorePacing", StorePacing, lambda: ((50e9, 131072.0), {})),
        Api("parse_dtype", parse_dtype, lambda: (("fp16",), {}), {"value": near("bf16", "fp8", "fp16") | ANY},
            fixed=LABELS + ("allowed",)),
        Api("parse_sweeps", parse_sweeps, lambda: (("first", "host"), {}),
            {"spec": near("all", "first,periodic") | ANY}),
        Api("parse_only-select", lambda specs, configs: select(configs, parse_only(specs)),
            lambda: ((["P=2,4"], [{"P": 2}, {"P": 8}]), {}), {"specs": st.lists(near("P=2,4", "x=1")) | ANY}),
        Api("parse_size", parse_size, lambda: (("64KiB",), {}), {"text": near("64KiB", "1.5M") | ANY},
            fixed=LABELS + ("max_bytes",)),
        Api("parse_time", parse_time, lambda: (("20us",), {}), {"text": near("20us", "1.5ms") | ANY},
            fixed=LABELS + ("max_ns",)),
        Api("parse_count", parse_count, lambda: (("8", "--sms", 1, 4096, "SMs"), {}), {"text": near("8") | ANY},
            fixed=LABELS + ("lo", "hi")),
        Api("read_table", read_table, lambda: (("src/xstage/data/h200-hostlink-probe.csv",), {}), {"path": path},
            fixed=("kinds", "what", "allow_empty")),
        Api("read_json", read_json, lambda: (("src/xstage/data/h200-host-profile.json",), {}), {"path": path},
            fixed=("what", "allow_nonfinite")),
        Api("Profile.load", Profile.load, lambda: (("src/xstage/data/h200-host-profile.json",), {}), {"path": path}),
        Api("TaskCosts.load", TaskCosts.load, lambda: (("src/xstage/data/h200-moe-task-costs.json",), {}),
            {"path": path}),
        Api("Profile.from_dict", Profile.from_dict, lambda: ((prof.to_dict(),), {}),
            {"d": st.dictionaries(st.sampled_from([*prof.to_dict(), "x"]), ANY) | ANY}, fixed=("source",)),
        Api("TaskCosts.from_dict", TaskCosts.from_dict, lambda: ((costs.to_dict(),), {}),
            {"d": st.dictionaries(st.sampled_from([*costs.to_dict(), "x"]), ANY) | ANY}, fixed=("source",)),
        Api("PathParams", PathParams, lambda: ((), {k: (float(v) if v != "inf" else math.inf)
                                                    for k, v in params.items()})),
        Api("BlockConfig", BlockConfig, lambda: ((), dict(block_m=16, block_n1=16, block_n2=32, block_k=32,
                                                          block_d=32))),
        Api("FlashConfig", FlashConfig, lambda: ((), {})),
        Api("LoopbackGroup", LoopbackGroup, lambda: ((2,), {})),
        Api("create_context", create_context, lambda: ((), dict(path="hbm", loopback_world=2, rank=1,
                                                                device="cpu"))),
        Api("MoEBuffer", MoEBuffer, lambda: ((), _moe_buffer())),
        Api("MoEBuffer.force_decision",
            lambda tokens, variant: MoEBuffer(**_moe_buffer()).force_decision(tokens, variant),
            lambda: ((4, "lag:2@off"), {}),
            {"tokens": st.tuples(SMALL | ANY, SMALL | ANY) | SMALL | ANY, "variant": variant | ANY}),
        Api("Problem", Problem, lambda: (("H128-I128-E4-K2", 8, 2, "hbm"), dict(device="cpu", dtype="fp16")),
            {"shape": near("H64-I32-E4-K2", "H128-I128-E4-K2") | ANY}),  # it allocates the weights: small ones
        Api("MoeConfig.parse", MoeConfig.parse, lambda: (("H512-I256-E16-K2",), dict(tokens_per_rank=32, ep=4)),
            {"shape": shape | ANY}),
        Api("make_schedule", make_schedule, lambda: (("lag:1", [0, 0, 1], 2, 2, 1), {}),
            {"name": variant | ANY, "unit_expert": st.lists(SMALL, max_size=6) | ANY}),
        Api("plan_moe", plan_moe, lambda: ((cfg, prof.params, costs, 8), dict(candidates=["lag:1"])),
            {"candidates": st.lists(variant, max_size=2) | ANY, "block_ms": st.lists(SMALL, max_size=2) | ANY},
            fixed=("progress",)),
        Api("plan_exchange", plan_exchange, lambda: ((24, 128, 4096, 4, default_exchange_costs()), {}),
            {"candidates": st.lists(exchange, max_size=2) | ANY}),
        Api("predict", predict, lambda: (("serial:cudnn", 24, 128, 4096, 4, default_exchange_costs()), {}),
            {"ex": exchange | ANY}),
        Api("flash_attention", flash_attention, _flash_base,
            {**{n: tensors(lambda: _half(1, 16, 1, 16)) for n in ("q", "k", "v", "out")},
             "kv_lens": tensors(lambda: torch.tensor([16], dtype=torch.int32)), "softmax_scale": ANY,
             "trace": tensors(lambda: torch.zeros(4, 6, dtype=torch.int64))},
            fixed=("launched", "route")),
        Api("fused_moe", fused_moe, _fused_base,
            {"x": tensors(lambda: _half(4, 64)), "topk_idx": tensors(lambda: torch.tensor([[0, 1]] * 4), index=4),
             "topk_weights": tensors(lambda: torch.rand(4, 2)), "schedule": variant | ANY, "pacing": pacing | ANY},
            fixed=("w1t", "w2")),
        Api("ulysses_attention", ulysses_attention, _ulysses_base,
            {**{n: tensors(lambda: _half(1, 16, 2, 16)) for n in ("q", "k", "v")}, "exchange": exchange | ANY,
             "seq_lens": st.lists(SMALL, max_size=3) | ANY, "softmax_scale": ANY},
            fixed=("group",)),
    ]


APIS = _apis()


@pytest.mark.parametrize("api", APIS, ids=lambda a: a.id)
def test_the_base_calls_work(api):
    """Every base call is valid: what the property refuses is the drawn value."""
    with watchdog(api.id):
        args, kwargs = api.base()
        api.fn(*args, **kwargs)


@pytest.mark.parametrize("api", APIS, ids=lambda a: a.id)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # deprecated arguments are fuzzed as well
@examples(60)
@given(data=st.data())
def test_a_malformed_argument_works_or_is_one_input_error_line(api, data):
    name = data.draw(st.sampled_from(_params(api)), label="parameter")
    value = data.draw(api.values.get(name, ANY), label="value")
    try:
        with watchdog(f"{api.id}({name}={value!r:.80})"):
            _call(api, name, value)
    except InputError as exc:
        text = str(exc)
        assert text.strip() and "\n" not in text, f"{api.id}({name}=...): {text!r}"
