"""One set of dtype names for every CLI, CSV and API: `bf16`, `fp16`, `fp32`, and `fp8` (e4m3) where a
caller allows it (the FP8 MoE buffer).

`parse_dtype` takes one of those names or a `torch.dtype` and refuses anything else with a line naming
the argument; `dtype_name` gives the short name back (as written in result rows).
"""

from __future__ import annotations

import torch

from xstage.errors import InputError

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Accepted only where `allowed` names it: most paths compute in one of DTYPES.
FP8_DTYPES: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn}
_ALL = {**DTYPES, **FP8_DTYPES}
_NAMES = {v: k for k, v in _ALL.items()}


def parse_dtype(value, arg: str = "dtype", allowed=None) -> torch.dtype:
    """`"bf16"` / `torch.bfloat16` -> `torch.bfloat16`; `allowed` (names) narrows the choice."""
    names = list(allowed or DTYPES)
    if isinstance(value, torch.dtype) and _NAMES.get(value) in names:
        return value
    if isinstance(value, str) and value in names:
        return _ALL[value]
    raise InputError(f"{arg}={value!r}: must be one of {names}")


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a supported dtype (`torch.bfloat16` -> `"bf16"`)."""
    if dtype not in _NAMES:
        raise InputError(f"dtype {dtype}: must be one of {list(_ALL)}")
    return _NAMES[dtype]
