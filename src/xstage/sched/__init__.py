"""`xstage.sched`: persistent kernels' work as task graphs, their simulation through the Burst-Gap
model, and the planner that picks a schedule.

- `Task`, `KernelWork` (`work.py`): per-CTA ordered tasks with compute cost, stores per destination,
  dependencies.
- `simulate_kernel(work, paths)` (`simulate.py`): predicted kernel time, per-CTA timelines, breakdown.
- `plan_moe` (`plan.py`): every candidate schedule predicted and ranked; importing it registers the
  `model_guided` schedule of `xstage.moe` (the planner's pick per call).
- `load_results` (`measured.py`): benchmark results CSVs read back and checked (columns, sizes,
  finite positive times, known variants), for validation and attention tile costs.
"""

from xstage.sched.plan import default_ctas, pick_for_moe_buffer, plan_moe
from xstage.sched.simulate import Segment, SimResult, simulate_kernel
from xstage.sched.work import KernelWork, Task

__all__ = ["KernelWork", "Segment", "SimResult", "Task", "default_ctas", "pick_for_moe_buffer", "plan_moe",
           "simulate_kernel"]
