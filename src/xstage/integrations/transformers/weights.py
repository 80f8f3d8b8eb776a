"""What the fused kernel reads of one transformers experts module: its layout, its activation, its weights.

Problem: transformers 5 stores an experts module's weights in one of several layouts, with or without
biases, under one of several gated activations, in a float dtype or as a fine-grained FP8 checkpoint.
The fused kernel (`fused_moe`) reads `[E, 2I, H]` gate-then-up rows (`w1_layout="concatenated"`) and
`[E, H, I]`, with optional biases and either activation of `xstage.spec.activation`; FP8 experts as
e4m3 weights with DeepSeek-V3 128x128 scales. This module says whether a module can be served, and
makes (once per weight version) what the kernel reads:

- float experts (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, or `is_transposed`: `[E, H, 2I]`,
  `[E, I, H]`; fp16, bf16, fp32; biases with `has_bias`): read in place when the layout is
  transformers' `[gate; up]` and the sizes are multiples of the kernel's tiles; otherwise copied once
  into that layout, transposed, de-interleaved (GPT-OSS interleaves gate and up column by column) and
  zero-padded to the tiles. Zero weight rows and columns and zero biases add nothing: a padded
  intermediate unit gives 0 with either activation (`silu(0) * 0`, and `(min(0, limit) + 1) * 0 *
  sigmoid(0)`), and padded hidden columns are cut off the output.
- fine-grained FP8 experts (transformers' `FP8Experts`: e4m3 `gate_up_proj`, `down_proj` with float32
  `*_scale_inv` of 128x128 blocks, dynamic activation scales): read in place, weights and scales, with
  no dequantize or requantize step; the kernel quantizes the BF16 tokens 1x128 itself. Hidden and
  intermediate sizes must be multiples of 128 (one scale block per tile), and the activation a plain
  SwiGLU.

Everything else (another activation, no gate, FP4 or MXFP4 weights, UE8M0 or static scales) is refused
in one `InputError` line naming the module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from xstage.backend import refuse_interpreter_bf16
from xstage.dtypes import DTYPES
from xstage.errors import InputError
from xstage.moe import BlockConfig
from xstage.moe.buffer import default_block_config
from xstage.moe.fp8 import BLOCK as FP8_BLOCK
from xstage.spec.activation import SILU, ClampedSwiGLU

BIASES = ("gate_up_proj_bias", "down_proj_bias")
SCALES = ("gate_up_proj_scale_inv", "down_proj_scale_inv")


def refuse(name: str, what: str) -> InputError:
    """The one-line refusal of a module: `name: what`."""
    return InputError(f"{name}: {what}")


def is_fp8(module) -> bool:
    """A fine-grained FP8 experts module: its weights come with `*_scale_inv` block scales (parameters,
    buffers or plain attributes: looked up where `nn.Module` keeps each, since `hasattr` on a module
    raises and catches an `AttributeError` per missing name, microseconds on every call)."""
    where = (module.__dict__, module.__dict__.get("_parameters", {}), module.__dict__.get("_buffers", {}))
    return any(s in d for s in SCALES for d in where)


def param_names(module) -> tuple[str, ...]:
    """The expert parameters the kernel reads: `gate_up_proj`, `down_proj`, their scales (FP8) and their
    biases (`has_bias`), each with the experts along dim 0."""
    return ("gate_up_proj", "down_proj", *(SCALES if is_fp8(module) else ()),
            *(BIASES if getattr(module, "has_bias", False) else ()))


def params(module) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(module, n) for n in param_names(module))


def sizes(module) -> tuple[int, int, int]:
    """(E, H, I) of the module's weights, whichever way round they are stored."""
    if getattr(module, "is_transposed", False):
        e, h, two_i = module.gate_up_proj.shape
    else:
        e, two_i, h = module.gate_up_proj.shape
    return e, h, two_i // 2


def default_config(module) -> BlockConfig:
    """The kernel's tiles when the caller names none (`xstage.moe.buffer.default_block_config`): the FP8
    buffer's for FP8 experts, else the default blocks with the stages that fit the module's dtype."""
    return default_block_config(module.gate_up_proj.dtype, is_fp8(module))


def _round_up(v: int, *blocks: int) -> int:
    step = math.lcm(*blocks)
    return -(-v // step) * step


def dims(module, cfg: BlockConfig):
    """(E, H, I, H padded, I padded): the padded sizes are the multiples of the tiles `MoEBuffer` asks
    for (hidden: block_k, block_d and 16-byte rows; intermediate: block_n1 and block_k). FP8 experts are
    never padded (`check_layout` asks for multiples of 128)."""
    e, h, i = sizes(module)
    if is_fp8(module):
        return e, h, i, h, i
    return e, h, i, _round_up(h, cfg.block_k, cfg.block_d, 8), _round_up(i, cfg.block_n1, cfg.block_k)


def token_dtype(module) -> torch.dtype:
    """The dtype of the tokens the module takes and returns: its weights', BF16 for FP8 experts."""
    return torch.bfloat16 if is_fp8(module) else module.gate_up_proj.dtype


def _gpt_oss_gate():
    """GPT-OSS's `_apply_gate` (the clamped SwiGLU), the one custom activation the kernel computes."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return GptOssExperts._apply_gate


def _is_silu(module) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(getattr(module, "act_fn", None), (torch.nn.SiLU, SiLUActivation))


def _not_silu(module) -> str:
    return f"act_fn={type(getattr(module, 'act_fn', None)).__name__}: the kernel's gate activation is SiLU"


def _fp8_activation(module):
    """`FP8Experts._apply_gate`: a plain SwiGLU unless the config sets a SwiGLU clamp."""
    for attr in ("swiglu_alpha", "swiglu_limit", "limit"):
        if getattr(module, attr, None) is not None:
            return None, (f"{attr}={getattr(module, attr)}: a clamped SwiGLU on FP8 experts (the FP8 kernel computes "
                          "silu(gate) * up)")
    if not _is_silu(module):
        return None, _not_silu(module)
    return SILU, None


def activation(module):
    """The kernel's activation for the module, or (None, why) when it has none: transformers' default gate
    (SiLU, gate and up concatenated) is `SILU`; GPT-OSS's (interleaved) a `ClampedSwiGLU` of its own
    `alpha` and `limit`, read at each call (plain attributes, which no weight signature follows)."""
    from transformers.integrations import moe as tf_moe

    if is_fp8(module):
        return _fp8_activation(module)
    gate = getattr(type(module), "_apply_gate", None)
    concatenated = getattr(module, "is_concatenated", True)
    if gate is tf_moe._default_apply_gate:
        if not _is_silu(module):
            return None, _not_silu(module)
        if not concatenated:
            return None, ("is_concatenated=False with transformers' default gate, which splits gate and up as "
                          "concatenated halves: an ambiguous layout")
        return SILU, None
    extra = ", ".join(f"{k}={getattr(module, k)}" for k in ("alpha", "limit") if hasattr(module, k))
    if gate is _gpt_oss_gate() and not concatenated:
        try:
            return ClampedSwiGLU(getattr(module, "alpha", None), getattr(module, "limit", None)), None
        except InputError as exc:
            return None, f"GPT-OSS's clamped SwiGLU with {exc}"
    if gate is _gpt_oss_gate():
        return None, "is_concatenated=True with GPT-OSS's gate, which reads gate and up interleaved"
    return None, (f"_apply_gate: its own gated activation{f' ({extra})' if extra else ''}; the kernel computes "
                  "silu(gate) * up or GPT-OSS's clamped SwiGLU")


def _check_tensor(module, name: str, p: str, dims_: int, dtypes, kind: str) -> torch.Tensor:
    t = getattr(module, p, None)
    if not isinstance(t, torch.Tensor) or t.dim() != dims_:
        raise refuse(name, f"{p}: expected a {dims_}-d expert tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if type(t).__name__ == "DTensor" or t.is_meta:
        raise refuse(name, f"{p}: a DTensor or meta tensor (transformers' own tensor or expert parallelism, or "
                           "weights not loaded); xstage runs whole experts on one device")
    if t.dtype not in dtypes:
        raise refuse(name, f"{p}: dtype {t.dtype} ({kind})")
    if t.device != module.gate_up_proj.device:
        raise refuse(name, f"{p}: on {t.device}, gate_up_proj on {module.gate_up_proj.device}: they must match")
    return t


def _check_fp8(module, name: str) -> None:
    """A fine-grained FP8 module the FP8 kernel reads as it is, or one line saying what it cannot."""
    if tuple(getattr(module, "block_size", None) or ()) != (FP8_BLOCK, FP8_BLOCK):
        raise refuse(name, f"block_size={getattr(module, 'block_size', None)}: the FP8 kernel takes 128x128 block "
                           "scales (DeepSeek-V3's)")
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise refuse(name, f"activation_scheme={module.activation_scheme!r}: the FP8 kernel quantizes activations "
                           "itself, 1x128 (dynamic)")
    fp8_kind = "FP8 experts are float8_e4m3fn; FP4-packed and MXFP4 experts do not run here"
    for p in ("gate_up_proj", "down_proj"):
        _check_tensor(module, name, p, 3, (torch.float8_e4m3fn,), fp8_kind)
    e, h, i = sizes(module)
    for v, what in ((h, "hidden"), (i, "intermediate")):
        if v % FP8_BLOCK:
            raise refuse(name, f"{what} size {v}: FP8 experts need a multiple of {FP8_BLOCK} (one scale block per "
                               "tile)")
    if tuple(module.down_proj.shape) != (e, h, i):
        raise refuse(name, f"down_proj: shape {tuple(module.down_proj.shape)} does not match gate_up_proj "
                           f"{tuple(module.gate_up_proj.shape)} ([E, H, I] for [E, 2I, H])")
    for p, shape in zip(SCALES, ((e, 2 * i // FP8_BLOCK, h // FP8_BLOCK), (e, h // FP8_BLOCK, i // FP8_BLOCK))):
        s = _check_tensor(module, name, p, 3, (torch.float32,), "the FP8 kernel takes float32 block scales, not "
                                                                "UE8M0 (scale_fmt='float')")
        if tuple(s.shape) != shape:
            raise refuse(name, f"{p}: shape {tuple(s.shape)}, expected {shape} (one scale per 128x128 block)")


def _check_float(module, name: str) -> None:
    """Float experts the kernel can read, in place or once copied (see the module docstring)."""
    kind = "the kernels take fp16, bf16 or fp32; quantized experts other than fine-grained FP8 do not run here"
    for p in ("gate_up_proj", "down_proj"):
        _check_tensor(module, name, p, 3, tuple(DTYPES.values()), kind)
    e, h, i = sizes(module)
    transposed = getattr(module, "is_transposed", False)
    if module.gate_up_proj.shape[2 if transposed else 1] % 2 or \
            tuple(module.down_proj.shape) != ((e, i, h) if transposed else (e, h, i)):
        want = "[E, I, H] for [E, H, 2I] (is_transposed)" if transposed else "[E, H, I] for [E, 2I, H]"
        raise refuse(name, f"down_proj: shape {tuple(module.down_proj.shape)} does not match gate_up_proj "
                           f"{tuple(module.gate_up_proj.shape)} ({want})")
    if module.gate_up_proj.dtype != module.down_proj.dtype:
        raise refuse(name, f"down_proj: {module.down_proj.dtype}, gate_up_proj {module.gate_up_proj.dtype}: they must "
                           "match")
    if getattr(module, "has_bias", False):
        for p, shape in zip(BIASES, ((e, 2 * i), (e, h))):
            t = getattr(module, p, None)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.is_meta:
                raise refuse(name, f"{p}: expected an expert bias tensor {shape} (has_bias=True), got "
                                   f"{getattr(t, 'shape', type(t).__name__)}")
            if t.dtype != module.gate_up_proj.dtype or t.device != module.gate_up_proj.device:
                raise refuse(name, f"{p}: {t.dtype} on {t.device}, gate_up_proj {module.gate_up_proj.dtype} on "
                                   f"{module.gate_up_proj.device}: they must match")
    try:
        refuse_interpreter_bf16(module.gate_up_proj.dtype, "gate_up_proj dtype")
    except InputError as exc:
        raise refuse(name, str(exc)) from None


def check_layout(module, name: str) -> None:
    """Refuse, in one line naming the module, every part of its weights or activation the fused kernel
    cannot honour (what `expert_parallel` adds is checked by the backend)."""
    if not hasattr(module, "is_transposed"):
        raise refuse(name, f"{type(module).__name__} is not dispatched through transformers' experts registry "
                           "(e.g. MXFP4 or other quantized experts); xstage cannot serve it")
    if not getattr(module, "has_gate", True):
        raise refuse(name, "the fused kernel cannot honour has_gate=False (up_proj only: the kernel computes a "
                           "gated activation)")
    if is_fp8(module) and getattr(module, "has_bias", False):
        raise refuse(name, "the fused kernel cannot honour has_bias=True on FP8 experts (the FP8 kernel adds no bias)")
    _, why = activation(module)
    if why:
        raise refuse(name, f"the fused kernel cannot honour {why}")
    (_check_fp8 if is_fp8(module) else _check_float)(module, name)


def signature(p: torch.Tensor) -> tuple:
    """What identifies one version of a parameter: its storage, version counter, dtype, device, shape."""
    try:
        version = p._version
    except RuntimeError:  # an inference tensor keeps no version counter (and cannot be written outside one)
        version = -1
    return (p.data_ptr(), version, p.dtype, p.device, tuple(p.shape), p.stride())


@dataclass
class KernelWeights:
    """What `fused_moe` reads for one module: `w1t`, `w2` (tensors, or FP8 `(weights, scales)` pairs),
    the biases `b1`, `b2` (None without), the bytes of those that are copies (`held`) and why they were
    copied (empty: every one is a parameter read in place)."""

    w1t: object
    w2: object
    b1: torch.Tensor | None
    b2: torch.Tensor | None
    held: int
    copied: tuple[str, ...]


def _nbytes_if_copy(t: torch.Tensor | None, p: torch.Tensor | None) -> int:
    return 0 if t is None or t.data_ptr() == p.data_ptr() else t.numel() * t.element_size()


def _padded(module, cfg: BlockConfig, l1, l2, bias1, bias2):
    """Copies in the kernel's `[gate; up]` layout: transposed, de-interleaved and zero-padded."""
    e, h, i, hp, ip = dims(module, cfg)
    if getattr(module, "is_transposed", False):  # [E, H, 2I] and [E, I, H] as views [E, 2I, H] and [E, H, I]
        l1, l2 = l1.transpose(1, 2), l2.transpose(1, 2)
    # GPT-OSS interleaves gate and up one by one (gate at even positions); else gate rows come first.
    interleaved = not getattr(module, "is_concatenated", True)
    gate, up = (slice(0, 2 * i, 2), slice(1, 2 * i, 2)) if interleaved else (slice(0, i), slice(i, 2 * i))
    w1 = torch.zeros(e, 2 * ip, hp, dtype=l1.dtype, device=l1.device)
    w1[:, :i, :h] = l1[:, gate]
    w1[:, ip:ip + i, :h] = l1[:, up]
    w2 = torch.zeros(e, hp, ip, dtype=l2.dtype, device=l2.device)
    w2[:, :h, :i] = l2
    b1 = b2 = None
    if bias1 is not None:
        b1 = torch.zeros(e, 2 * ip, dtype=bias1.dtype, device=bias1.device)
        b1[:, :i] = bias1[:, gate]
        b1[:, ip:ip + i] = bias1[:, up]
        b2 = torch.zeros(e, hp, dtype=bias2.dtype, device=bias2.device)
        b2[:, :h] = bias2
    return w1, w2, b1, b2


def kernel_weights(module, cfg: BlockConfig) -> KernelWeights:
    """What the kernel reads for the module's current parameters (call `check_layout` first)."""
    ps = {n: p.detach() for n, p in zip(param_names(module), params(module))}
    l1, l2 = ps["gate_up_proj"], ps["down_proj"]
    if is_fp8(module):  # read in place: the checkpoint's [gate; up] rows and their scale rows
        pairs = [(l1.contiguous(), l1), (ps[SCALES[0]].contiguous(), ps[SCALES[0]]), (l2.contiguous(), l2),
                 (ps[SCALES[1]].contiguous(), ps[SCALES[1]])]
        held = sum(_nbytes_if_copy(t, p) for t, p in pairs)
        return KernelWeights((pairs[0][0], pairs[1][0]), (pairs[2][0], pairs[3][0]), None, None, held,
                             ("contiguous copies",) if held else ())
    bias1, bias2 = ps.get(BIASES[0]), ps.get(BIASES[1])
    _, h, i, hp, ip = dims(module, cfg)
    why = tuple(w for w, on in (("transposed", getattr(module, "is_transposed", False)),
                                ("gate and up de-interleaved", not getattr(module, "is_concatenated", True)),
                                ("padded to the kernel's tiles", (hp, ip) != (h, i))) if on)
    if why:
        w1, w2, b1, b2 = _padded(module, cfg, l1, l2, bias1, bias2)
        held = sum(t.numel() * t.element_size() for t in (w1, w2, b1, b2) if t is not None)
        return KernelWeights(w1, w2, b1, b2, held, why)
    # aliases, unless a parameter is not contiguous
    out = [None if p is None else p.contiguous() for p in (l1, l2, bias1, bias2)]
    held = sum(_nbytes_if_copy(t, p) for t, p in zip(out, (l1, l2, bias1, bias2)))
    return KernelWeights(*out, held, ("contiguous copies",) if held else ())
