"""The gated activation between an expert's two GEMMs: its one type and its one parser.

- `"silu"` (`SILU`): `silu(gate) * up`, the SwiGLU of Qwen3-MoE, Mixtral, DeepSeek-V3 and OLMoE.
- `ClampedSwiGLU(alpha, limit)`: GPT-OSS's clamped SwiGLU,
  `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)` (the gate is
  clamped from above only).

`fused_moe(..., activation=...)`, the references of `xstage.moe.reference` and the transformers
integration all take what `check_activation` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from xstage.bounds import check_real
from xstage.errors import InputError

SILU = "silu"
# Finite, and small enough that `alpha * gate` and `up + 1` stay well inside float32.
_MAX_PARAM = 1e6


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's gated activation (see the module docstring); GPT-OSS uses `alpha=1.702, limit=7.0`."""

    alpha: float
    limit: float

    def __post_init__(self):
        object.__setattr__(self, "alpha", check_real(self.alpha, "activation alpha", -_MAX_PARAM, _MAX_PARAM,
                                                     "the gate's sigmoid scale"))
        object.__setattr__(self, "limit", check_real(self.limit, "activation limit", 0.0, _MAX_PARAM,
                                                     "the clamp of gate and up"))


Activation = str | ClampedSwiGLU


def check_activation(activation, arg: str = "activation") -> Activation:
    """`SILU` or a `ClampedSwiGLU`; anything else is one `InputError` line naming `arg`."""
    if isinstance(activation, ClampedSwiGLU) or (isinstance(activation, str) and activation == SILU):
        return activation
    got = f"{activation!r:.60}" if isinstance(activation, str) else type(activation).__name__
    raise InputError(f"{arg}={got}: must be 'silu' or ClampedSwiGLU(alpha, limit) (xstage.spec.activation)")
