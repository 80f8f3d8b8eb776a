"""The arguments of `fused_moe`, checked before any work: each refusal is one `InputError` line that
names the argument and the constraint it breaks. The tensor checks run on every call, so their
common case is one test each."""

from __future__ import annotations

import torch

from xstage.errors import InputError
from xstage.moe.buffer import FP8_BLOCK, MoEBuffer
from xstage.spec.activation import SILU, check_activation


def _check_tensor(name, t, shape, dtypes, device):
    # The common case in one test (every call checks five tensors). `is_cuda`/`is_cpu` say what
    # `t.device.type` does without making a device object (1.5 us of a 2.4 us check on a CPU).
    if (isinstance(t, torch.Tensor) and t.shape == shape and t.dtype in dtypes
            and (t.is_cuda if device.type == "cuda" else device.type == "cpu" and t.is_cpu) and t.is_contiguous()):
        return
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise InputError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device.type != device.type:
        raise InputError(f"{name}: expected a tensor on {device.type}, got {t.device}")
    if not t.is_contiguous():
        raise InputError(f"{name}: must be contiguous")


def _pair(value, name: str, buf: MoEBuffer):
    """(data, scale) of an FP8 argument given as a pair; (value, None) otherwise. A pair on a buffer
    that is not FP8, or a lone FP8 weight, is refused before any launch."""
    if isinstance(value, (tuple, list)):
        if not buf.fp8:
            raise InputError(f"{name}: a (data, scale) pair needs an FP8 buffer (MoEBuffer(dtype='fp8')); this one "
                             f"is {buf.dtype}")
        if len(value) != 2:
            raise InputError(f"{name}: expected (data, {name}_scale), got {len(value)} items")
        return value[0], value[1]
    if buf.fp8 and name != "x":
        raise InputError(f"{name}: an FP8 buffer takes ({name}, {name}_scale) as transform_weights returns them")
    return value, None


def validate_inputs(x, topk_idx, topk_w, w1t, w2, buf: MoEBuffer, check_range: bool = True) -> None:
    """Raise `InputError` naming the argument and the constraint it violates. On an FP8 buffer `x` is
    BF16 `[T, H]` (quantized by `fused_moe`) or a pair `(x_fp8, x_scale)`, and `w1t`, `w2` are the
    pairs of `transform_weights`."""
    x, x_scale = _pair(x, "x", buf)
    w1t, w1_scale = _pair(w1t, "w1t", buf)
    w2, w2_scale = _pair(w2, "w2", buf)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InputError(f"x: expected a 2-d tensor [tokens, hidden], got {getattr(x, 'shape', x)}")
    T = x.shape[0]
    if T > buf.T_max:
        raise InputError(f"x: {T} tokens exceed the buffer capacity num_max_tokens_per_rank={buf.T_max}")
    if buf.fp8:
        n_h, n_i = buf.H // FP8_BLOCK, buf.I // FP8_BLOCK
        _check_tensor("x", x, (T, buf.H), (buf.dtype,) if x_scale is not None else (buf.out_dtype,), buf.device)
        if x_scale is not None:
            _check_tensor("x_scale", x_scale, (T, n_h), (torch.float32,), buf.device)
        _check_tensor("w1t", w1t, (buf.E_local, 2 * buf.I, buf.H), (buf.dtype,), buf.device)
        _check_tensor("w1t_scale", w1_scale, (buf.E_local, 2 * n_i, n_h), (torch.float32,), buf.device)
        _check_tensor("w2", w2, (buf.E_local, buf.H, buf.I), (buf.dtype,), buf.device)
        _check_tensor("w2_scale", w2_scale, (buf.E_local, n_h, n_i), (torch.float32,), buf.device)
    else:
        _check_tensor("x", x, (T, buf.H), (buf.dtype,), buf.device)
        _check_tensor("w1t", w1t, (buf.E_local, 2 * buf.I, buf.H), (buf.dtype,), buf.device)
        _check_tensor("w2", w2, (buf.E_local, buf.H, buf.I), (buf.dtype,), buf.device)
    _check_tensor("topk_idx", topk_idx, (T, buf.K), (torch.int32, torch.int64), buf.device)
    _check_tensor("topk_weights", topk_w, (T, buf.K), (torch.float32, buf.out_dtype), buf.device)
    if check_range and T and bool(((topk_idx < 0) | (topk_idx >= buf.E)).any()):
        bad = topk_idx[(topk_idx < 0) | (topk_idx >= buf.E)][0].item()
        raise InputError(f"topk_idx: value {bad} out of range [0, {buf.E})")


def check_epilogue(b1, b2, activation, buf: MoEBuffer) -> tuple:
    """`fused_moe`'s `b1`, `b2` and `activation`, checked (one `InputError` line naming the argument):
    biases `b1 [E_local, 2I]` (gate biases, then up biases, whatever `w1_layout`) and `b2 [E_local, H]`
    in the buffer's dtype or float32, or None; `activation` as `xstage.spec.activation` spells it. An FP8
    buffer takes neither biases nor another activation (its Linear-1 epilogue requantizes SwiGLU as is)."""
    activation = check_activation(activation)
    if buf.fp8:
        for name, v in (("b1", b1), ("b2", b2), ("activation", None if activation == SILU else activation)):
            if v is not None:
                raise InputError(f"{name}: an FP8 buffer runs plain SwiGLU experts without biases (BF16, FP16 "
                                 "and FP32 buffers take biases and ClampedSwiGLU)")
    dtypes = tuple(dict.fromkeys((buf.dtype, torch.float32)))
    if b1 is not None:
        _check_tensor("b1", b1, (buf.E_local, 2 * buf.I), dtypes, buf.device)
    if b2 is not None:
        _check_tensor("b2", b2, (buf.E_local, buf.H), dtypes, buf.device)
    return b1, b2, activation


W1_LAYOUTS = ("interleaved", "concatenated")


def check_w1_layout(w1_layout) -> None:
    """`fused_moe`'s `w1_layout`: one of `W1_LAYOUTS` (on an FP8 buffer too: the scale rows follow the
    weight rows' layout, `transform_weights`' or the checkpoint's own)."""
    if not isinstance(w1_layout, str) or w1_layout not in W1_LAYOUTS:
        raise InputError(f"w1_layout={w1_layout!r:.40}: must be one of {', '.join(W1_LAYOUTS)}")


def check_mode(check):
    """`fused_moe`'s `check`: True, False or "async"; anything else is one `InputError` line."""
    if isinstance(check, bool) or isinstance(check, str) and check == "async":
        return check
    got = f"{check!r:.40}" if isinstance(check, str) else type(check).__name__
    raise InputError(f"check: must be True, False or 'async', got {got}")
