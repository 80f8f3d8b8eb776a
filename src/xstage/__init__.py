"""xstage: measure, model and schedule the X-Stage of device-initiated remote stores.

Entry points: `ulysses_attention` / `UlyssesAttention` / `flash_attention` (fused Ulysses attention),
`xstage.moe.fused_moe` (the fused MoE layer), `xstage.model` (the Burst-Gap model and profiles),
`xstage.sched` (the planner: predictions, and the policy whose `Decision`s the kernels ask for),
`xstage.spec` (shapes, variants, pacings, exchanges: data every floor agrees on), `xstage.comm`
(buffers, signals, device helpers). On a machine without a CUDA GPU, kernels run in Triton's CPU
interpreter (`xstage.backend.select`, called by each kernel package before its kernels are defined).

Importing `xstage` loads nothing else: each entry point is loaded when first used, so that the
planner's data (`xstage.spec`, `xstage.model`) can be used without torch or Triton.
"""

import importlib

from xstage.version import __version__

_LAZY = {"UlyssesAttention": "xstage.attention", "flash_attention": "xstage.attention",
         "ulysses_attention": "xstage.attention", "sched": None}

__all__ = ["UlyssesAttention", "__version__", "flash_attention", "sched", "ulysses_attention"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'xstage' has no attribute {name!r}")
    if _LAZY[name] is None:  # a subpackage
        return importlib.import_module(f"xstage.{name}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__():
    return sorted({*globals(), *_LAZY})
