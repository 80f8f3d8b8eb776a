"""xstage: measure, model and schedule the X-Stage of device-initiated remote stores.

Entry points: `ulysses_attention` / `UlyssesAttention` / `flash_attention` (fused Ulysses attention),
`xstage.moe.fused_moe` (the fused MoE layer), `xstage.model` (the Burst-Gap model and profiles),
`xstage.sched` (schedule prediction and planning), `xstage.comm` (buffers, signals, device helpers).
`import xstage` loads the planner, which registers the `model_guided` MoE schedule; attention loads on
first use.
"""

from xstage import sched
from xstage.version import __version__

_LAZY = {
    "ulysses_attention": "xstage.attention",
    "UlyssesAttention": "xstage.attention",
    "flash_attention": "xstage.attention",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'xstage' has no attribute {name!r}")


__all__ = ["UlyssesAttention", "__version__", "flash_attention", "sched", "ulysses_attention"]
