"""Where kernels run: the bf16 refusal of Triton's CPU interpreter, and why it exists."""

import pytest
import torch
import triton
import triton.language as tl

from xstage.backend import refuse_interpreter_bf16
from xstage.env import interpreter_active
from xstage.errors import InputError

interpreter = pytest.mark.skipif(not interpreter_active(), reason="Triton's CPU interpreter is off")


@triton.jit
def _dot_kernel(p_a, p_b, p_c, N: tl.constexpr):
    o = tl.arange(0, N)
    b_a = tl.load(p_a + o[:, None] * N + o[None, :])  # [N, N]
    b_b = tl.load(p_b + o[:, None] * N + o[None, :])  # [N, N]
    tl.store(p_c + o[:, None] * N + o[None, :], tl.dot(b_a, b_b))


def _dot_error(dtype: torch.dtype) -> float:
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).to(dtype) for _ in range(2))
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, N=16)
    return float((c - a.float() @ b.float()).abs().max())


@interpreter
def test_the_interpreter_gets_bf16_dot_wrong_and_fp16_right():
    """The reason for the refusal: if Triton's interpreter ever computes bf16 `tl.dot` right, this fails
    and the refusal can go."""
    assert _dot_error(torch.float16) < 1e-2
    assert _dot_error(torch.bfloat16) > 1e3


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, "bf16"], ids=["torch", "name"])
def test_bf16_is_refused_by_name_in_the_interpreter(dtype):
    with pytest.raises(InputError, match=r"^x\.dtype=bf16: dtype bf16 cannot run in Triton's CPU interpreter.*"
                                         r"use fp16 or fp32 there$"):
        refuse_interpreter_bf16(dtype, "x.dtype")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, "fp16", "fp8", torch.float8_e4m3fn])
def test_other_dtypes_pass(dtype):
    refuse_interpreter_bf16(dtype)


def test_bf16_passes_where_kernels_are_compiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    refuse_interpreter_bf16(torch.bfloat16)
