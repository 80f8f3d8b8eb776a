"""xstage: measure, model and schedule the X-Stage of device-initiated remote stores.

Entry points: `ulysses_attention` / `UlyssesAttention` / `flash_attention` (fused Ulysses attention),
`xstage.moe.fused_moe` (the fused MoE layer), `xstage.model` (the Burst-Gap model and profiles),
`xstage.sched` (schedule prediction and planning), `xstage.comm` (buffers, signals, device helpers).
`import xstage` loads the planner, which registers the `model_guided` MoE schedule. On a machine
without a CUDA GPU, kernels run in Triton's CPU interpreter (`xstage.backend`).
"""

from xstage import backend

backend.select()  # before any kernel module is imported: Triton's interpreter where no GPU exists

from xstage import sched  # noqa: E402
from xstage.attention import UlyssesAttention, flash_attention, ulysses_attention  # noqa: E402
from xstage.version import __version__  # noqa: E402

__all__ = ["UlyssesAttention", "__version__", "flash_attention", "sched", "ulysses_attention"]
