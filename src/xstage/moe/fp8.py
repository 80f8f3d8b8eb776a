"""FP8 formats of the MoE layer (DeepSeek-V3 block scales) and its plain-torch FP8-emulating reference.

Problem: serve the MoE layer of `xstage.moe.reference` with `float8_e4m3fn` operands as FP8
checkpoints ship them: expert weights in 128x128 blocks, each with one float32 scale, activations
per token per 128 channels (1x128 scales, `x_scale [T, H/128]`), BF16 output.

Formats: a block of values `v` is stored as `q = e4m3(v / s)` with `s = amax(|v|) / 448`, so the
block's largest magnitude lands on the largest finite e4m3 value, and `v ~= q * s`.
- `quantize_activations(x [T, H])` -> `(x_fp8 [T, H], x_scale float32 [T, ceil(H/128)])`
- `quantize_weights(w [E, N, K])` -> `(w_fp8 [E, N, K], w_scale float32 [E, ceil(N/128), ceil(K/128)])`
- `quantize_rowwise(t [..., R, C])` -> one scale per row (`[..., R]`): the granularity of torch's
  `_scaled_grouped_mm`, used by the FP8 baseline chain.
- `dequantize_activations`, `dequantize_weights`: the inverses, in float32.
An all-zero block gets scale 1 (so nothing divides by zero and the block stays zero). Values are
clamped to +-448 before the cast, so rounding of `v / s` can never overflow into NaN.

Rounding error: e4m3 keeps 3 mantissa bits and rounds to nearest, so a value `v / s` in the normal
range (>= 2^-6) is off by at most half an ulp, 2^-4 of itself; below 2^-6 the spacing is the
subnormal step 2^-9, so the error is at most 2^-10 in units of the scale. Per element:
`|dequantize(quantize(v)) - v| <= max(2^-4 |v|, 2^-10 s)` with `s = amax / 448` (`FP8_ERROR_BOUND`).

Inf and NaN propagate and never hang: a non-finite value makes its block's amax (and scale)
non-finite, so its whole block dequantizes to NaN; in the MoE layer the token's output row turns
NaN (Inf becomes NaN on the way) while every other token's row is unaffected, as rows are
quantized and multiplied independently.

Algorithm of `reference_moe_fp8` (one rank, EP=1, SwiGLU convention of `reference.expert_mlp`):
quantize `x` (1x128) unless given quantized; per expert, Linear-1 as `scaled_linear`: for each
128-wide K block, the float32 product of the raw e4m3 values times `x_scale[:, kb] * w_scale[nb, kb]`,
accumulated in float32 (equal to `sum_kb (x_fp8 * x_scale) @ (w_fp8 * w_scale)^T` up to float32
rounding, and the order a block-scaled tensor-core kernel works in); SwiGLU `g * sigmoid(g) * u` in
float32; the SwiGLU output quantized 1x128 straight from float32; Linear-2 the same way; each
output row rounded to BF16 (combine rows are BF16), then the top-k weighted sum in float32,
returned as BF16.

`check_fp8_weights` / `check_fp8_activations` refuse what the FP8 path cannot run with a one-line
`InputError` naming the argument: sizes that are not multiples of 128, FP8 data without scales,
scales of the wrong shape or dtype, tensors on the wrong device, non-contiguous tensors.

Example:
    >>> import torch
    >>> from xstage.moe.fp8 import quantize_activations, quantize_weights, reference_moe_fp8
    >>> T, H, I, E, K = 4, 128, 128, 2, 2
    >>> x = torch.randn(T, H, dtype=torch.bfloat16)
    >>> x8, xs = quantize_activations(x)
    >>> x8.dtype, tuple(xs.shape)
    (torch.float8_e4m3fn, (4, 1))
    >>> l1, l1s = quantize_weights(torch.randn(E, 2 * I, H) / H**0.5)
    >>> l2, l2s = quantize_weights(torch.randn(E, H, I) / I**0.5)
    >>> tuple(l1s.shape)
    (2, 2, 1)
    >>> idx, w = torch.tensor([[0, 1]] * T), torch.full((T, K), 0.5)
    >>> y = reference_moe_fp8(x, idx, w, l1, l1s, l2, l2s)
    >>> y.dtype, tuple(y.shape)
    (torch.bfloat16, (4, 128))
"""

from __future__ import annotations

import math

import torch

from xstage.errors import InputError
from xstage.moe.reference import check_topk_idx

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128  # the DeepSeek-V3 block: 128x128 for weights, 1x128 for activations
FP8_ERROR_BOUND = (2.0**-4, 2.0**-10)  # (relative to |v|, in units of the block scale); see the docstring


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Saturating cast to e4m3: clamp to +-448 first (out-of-range casts are not saturating everywhere)."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _block_scales(t: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """float32 scales of `t [..., R, C]` per `br x bc` block: `[..., ceil(R/br), ceil(C/bc)]`."""
    *lead, R, C = t.shape
    nr, nc = -(-R // br), -(-C // bc)
    # A partial edge block is padded with zeros, which never raise its amax.
    pad = torch.nn.functional.pad(t.float(), (0, nc * bc - C, 0, nr * br - R))
    amax = pad.reshape(*lead, nr, br, nc, bc).abs().amax(dim=(-3, -1))
    scale = amax / FP8_MAX
    # An all-zero block (or one whose amax underflows) would divide by zero; NaN stays NaN.
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _expand(scale: torch.Tensor, br: int, bc: int, R: int, C: int) -> torch.Tensor:
    """Block scales `[..., nr, nc]` -> one per element `[..., R, C]`."""
    return scale.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :R, :C]


def _quantize(t: torch.Tensor, br: int, bc: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _block_scales(t, br, bc)
    return to_e4m3(t.float() / _expand(scale, br, bc, *t.shape[-2:])).contiguous(), scale.contiguous()


def _need_float(t, name: str, dims: str, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise InputError(f"{name}: expected a floating-point tensor {dims}, got "
                         f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if (ndim is not None and t.dim() != ndim) or t.dim() < 2:
        raise InputError(f"{name}: expected {dims}, got shape {tuple(t.shape)}")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [T, H]` (any float dtype) -> `(x_fp8 [T, H] e4m3, x_scale float32 [T, ceil(H/128)])`, 1x128 blocks."""
    _need_float(x, "x", "[T, H]", 2)
    return _quantize(x, 1, BLOCK)


def dequantize_activations(x_fp8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_activations`: float32 `[T, H]`."""
    return x_fp8.float() * _expand(x_scale, 1, BLOCK, *x_fp8.shape[-2:])


def quantize_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [E, N, K]` -> `(w_fp8 [E, N, K] e4m3, w_scale float32 [E, ceil(N/128), ceil(K/128)])`, 128x128 blocks."""
    _need_float(w, "w", "[E, N, K]", 3)
    return _per_expert(w, lambda t: _quantize(t, BLOCK, BLOCK))


def _per_expert(w: torch.Tensor, fn) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn` (one `[N, K]` -> (data, scale)) over the experts of `w [E, N, K]`, into preallocated
    outputs: float32 copies of all of a large model's weights do not fit (E384 x 6144 x 7168: 68 GB),
    nor a list of the per-expert results beside their stacked copy."""
    q0, s0 = fn(w[0] if w.shape[0] else w.new_zeros(w.shape[1:]))  # the output shapes
    q = q0.new_empty((w.shape[0], *q0.shape))
    s = s0.new_empty((w.shape[0], *s0.shape))
    for e in range(w.shape[0]):
        q[e], s[e] = (q0, s0) if e == 0 else fn(w[e])
    return q, s


def dequantize_weights(w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_weights`: float32 `[E, N, K]`."""
    return w_fp8.float() * _expand(w_scale, BLOCK, BLOCK, *w_fp8.shape[-2:])


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`t [..., R, C]` -> `(t_fp8, scale float32 [..., R])`: one scale per row, as `_scaled_grouped_mm` takes."""
    _need_float(t, "t", "[..., R, C]")
    if t.dim() > 2:
        return _per_expert(t, quantize_rowwise)
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)  # NaN stays NaN
    return to_e4m3(t.float() / scale).contiguous(), scale.squeeze(-1).contiguous()


def _check_pair(data, scale, name: str, dims: str, scale_dims: str, expected_scale, device) -> None:
    """Shared checks of one FP8 tensor and its scales (names: `name`, `name_scale`)."""
    sname = f"{name}_scale"
    if not isinstance(data, torch.Tensor):
        raise InputError(f"{name}: expected an FP8 tensor {dims}, got {type(data).__name__}")
    if data.dtype != FP8:
        raise InputError(f"{name}: dtype {data.dtype}, expected {FP8} (quantize it with the fp8 helpers)")
    if scale is None:
        raise InputError(f"{sname}: FP8 {name} needs its scales, float32 {scale_dims}")
    if not isinstance(scale, torch.Tensor):
        raise InputError(f"{sname}: expected a float32 tensor {scale_dims}, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise InputError(f"{sname}: dtype {scale.dtype}, expected torch.float32")
    if tuple(scale.shape) != tuple(expected_scale):
        raise InputError(f"{sname}: shape {tuple(scale.shape)}, expected {tuple(expected_scale)} = {scale_dims} "
                         f"for {name} of shape {tuple(data.shape)}")
    want = torch.device(device) if device is not None else data.device
    for n, t in ((name, data), (sname, scale)):
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            raise InputError(f"{n}: on {t.device}, expected {want}")
        if not t.is_contiguous():
            raise InputError(f"{n}: must be contiguous (call .contiguous())")


def check_fp8_activations(x_fp8, x_scale, name: str = "x", hidden: int | None = None, device=None) -> None:
    """Refuse FP8 activations `[T, H]` the FP8 path cannot run (`InputError` naming `name` or `name_scale`).

    `hidden`: the H they must have; `device`: the device they must be on (default: wherever `x_fp8` is)."""
    if isinstance(x_fp8, torch.Tensor) and x_fp8.dim() != 2:
        raise InputError(f"{name}: expected 2-d [T, H], got shape {tuple(x_fp8.shape)}")
    if isinstance(x_fp8, torch.Tensor):
        T, H = x_fp8.shape
        if hidden is not None and H != hidden:
            raise InputError(f"{name}: hidden size {H}, expected {hidden}")
        if H % BLOCK:
            raise InputError(f"{name}: hidden size {H} must be a multiple of {BLOCK}")
        expected = (T, H // BLOCK)
    else:
        expected = ()
    _check_pair(x_fp8, x_scale, name, "[T, H]", "[T, H/128]", expected, device)


def check_fp8_weights(w_fp8, w_scale, name: str, device=None) -> None:
    """Refuse FP8 expert weights `[E, N, K]` the FP8 path cannot run (`InputError` naming `name` or
    `name_scale`): N and K must be multiples of 128, scales float32 `[E, N/128, K/128]`."""
    if isinstance(w_fp8, torch.Tensor) and w_fp8.dim() != 3:
        raise InputError(f"{name}: expected 3-d [E, N, K], got shape {tuple(w_fp8.shape)}")
    if isinstance(w_fp8, torch.Tensor):
        E, N, K = w_fp8.shape
        for what, v in (("dim 1 (N)", N), ("dim 2 (K)", K)):
            if v % BLOCK:
                raise InputError(f"{name}: {what} = {v} must be a multiple of {BLOCK} (128x128 scale blocks)")
        expected = (E, N // BLOCK, K // BLOCK)
    else:
        expected = ()
    _check_pair(w_fp8, w_scale, name, "[E, N, K]", "[E, N/128, K/128]", expected, device)


def check_fp8_moe_weights(l1, l1_scale, l2, l2_scale, device=None) -> tuple[int, int, int]:
    """Both expert weights of the FP8 layer: `l1 [E, 2I, H]`, `l2 [E, H, I]`, H and I multiples of 128
    (so no 128-row scale block of `l1` straddles gate and up). Returns `(E, H, I)`."""
    for name, t in (("l1", l1), ("l2", l2)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise InputError(f"{name}: expected 3-d, got shape {tuple(t.shape)}")
    if isinstance(l1, torch.Tensor):
        two_i, H = l1.shape[1:]
        if two_i % (2 * BLOCK):
            raise InputError(f"l1: intermediate size {two_i / 2:g} (dim 1 = 2I = {two_i}) must be a multiple "
                             f"of {BLOCK}")
        if H % BLOCK:
            raise InputError(f"l1: hidden size {H} (dim 2) must be a multiple of {BLOCK}")
    check_fp8_weights(l1, l1_scale, "l1", device)
    E, two_i, H = l1.shape
    check_fp8_weights(l2, l2_scale, "l2", l1.device if device is None else device)
    if tuple(l2.shape) != (E, H, two_i // 2):
        raise InputError(f"l2: shape {tuple(l2.shape)}, expected {(E, H, two_i // 2)} = [E, H, I] to match "
                         f"l1 {tuple(l1.shape)}")
    return E, H, two_i // 2


def scaled_linear(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor,
                  w_scale: torch.Tensor) -> torch.Tensor:
    """Block-scaled `x @ w^T` as a block-scaled kernel computes it: float32 `[M, N]`.

    `x_fp8 [M, K]` with `x_scale [M, K/128]`, `w_fp8 [N, K]` with `w_scale [N/128, K/128]`: for each K
    block, the raw e4m3 product in float32 (exact per term: 4 significant bits times 4), scaled by
    the two scales, added to a float32 accumulator."""
    M, K = x_fp8.shape
    N = w_fp8.shape[0]
    acc = torch.zeros(M, N, dtype=torch.float32, device=x_fp8.device)
    for kb in range(math.ceil(K / BLOCK)):
        ks = slice(kb * BLOCK, (kb + 1) * BLOCK)
        part = x_fp8[:, ks].float() @ w_fp8[:, ks].float().t()  # [M, N]
        w_cols = w_scale[:, kb].repeat_interleave(BLOCK)[:N]  # [N]: one scale per 128 output columns
        acc += part * (x_scale[:, kb, None] * w_cols[None, :])
    return acc


def expert_mlp_fp8(x_fp8, x_scale, l1, l1_scale, l2, l2_scale) -> torch.Tensor:
    """One expert on quantized rows: `x_fp8 [M, H]` -> float32 `[M, H]` (rows `0..I-1` of `l1` gate, then up)."""
    inter = l1.shape[0] // 2
    h = scaled_linear(x_fp8, x_scale, l1, l1_scale)  # [M, 2I] float32
    g, u = h[:, :inter], h[:, inter:]
    act = g * torch.sigmoid(g) * u  # the kernel's SwiGLU epilogue, in float32
    a8, a_scale = _quantize(act, 1, BLOCK)  # 1x128, straight from float32, as the kernel will before Linear-2
    return scaled_linear(a8, a_scale, l2, l2_scale)


def reference_moe_fp8(x, topk_idx, topk_w, l1, l1_scale, l2, l2_scale, x_scale=None) -> torch.Tensor:
    """The FP8 MoE layer on one rank (EP=1): `y [T, H]` BF16; see the module docstring for each step.

    `x`: BF16/float `[T, H]` (quantized here, 1x128) or FP8 `[T, H]` with `x_scale [T, H/128]`;
    `topk_idx [T, K]` into the E experts of `l1 [E, 2I, H]` / `l2 [E, H, I]` (FP8, with their 128x128
    scales); `topk_w [T, K]`."""
    E, H, _ = check_fp8_moe_weights(l1, l1_scale, l2, l2_scale)
    if isinstance(x, torch.Tensor) and x.dtype == FP8:
        check_fp8_activations(x, x_scale, "x", hidden=H, device=l1.device)
        x8, xs = x, x_scale
    else:
        if x_scale is not None:
            raise InputError("x_scale: only goes with FP8 x (x is quantized here otherwise)")
        _need_float(x, "x", "[T, H]", 2)
        if x.shape[1] != H:
            raise InputError(f"x: hidden size {x.shape[1]}, expected {H} (dim 2 of l1)")
        if x.device != l1.device:
            raise InputError(f"x: on {x.device}, expected {l1.device} (where l1 is)")
        x8, xs = quantize_activations(x)
    check_topk_idx(topk_idx, E)
    T, K = topk_idx.shape
    if not isinstance(topk_w, torch.Tensor) or tuple(topk_w.shape) != (T, K):
        raise InputError(f"topk_w: expected shape {(T, K)} like topk_idx, got "
                         f"{tuple(topk_w.shape) if isinstance(topk_w, torch.Tensor) else type(topk_w).__name__}")
    idx = topk_idx.long()
    comb = torch.zeros(T, K, H, dtype=torch.float32, device=x8.device)
    for e in torch.unique(idx).tolist():
        t, k = torch.nonzero(idx == e, as_tuple=True)
        out = expert_mlp_fp8(x8[t], xs[t], l1[e], l1_scale[e], l2[e], l2_scale[e])
        comb[t, k] = out.to(torch.bfloat16).float()  # combine rows travel as BF16
    return (comb * topk_w.float()[:, :, None]).sum(1).to(torch.bfloat16)
