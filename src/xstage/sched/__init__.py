"""`xstage.sched`: persistent kernels' work as task graphs, their simulation through the Burst-Gap
model, and the planner that picks a schedule.

- `Task`, `KernelWork` (`work.py`): per-CTA ordered tasks with compute cost, stores per destination,
  dependencies.
- `simulate_kernel(work, paths)` (`simulate.py`): predicted kernel time, per-CTA timelines, breakdown.
- `plan_moe` (`plan.py`): every candidate schedule predicted and ranked; importing it registers the
  `model_guided` schedule of `xstage.moe` (the planner's pick per call).
- `plan_exchange` (`exchange.py`): every Ulysses exchange predicted and ranked from tile and copy
  costs; importing it registers the planner as `exchange="auto"` of `xstage.attention`.
- `load_results` (`measured.py`): benchmark results CSVs read back and checked (columns, sizes,
  finite positive times, known variants), for validation and attention tile costs.
"""

from xstage.attention.exchange import register_chooser
from xstage.sched.exchange import choose_exchange, plan_exchange
from xstage.sched.plan import default_ctas, pick_for_moe_buffer, plan_moe
from xstage.sched.simulate import Segment, SimResult, simulate_kernel
from xstage.sched.work import KernelWork, Task

register_chooser(choose_exchange)

__all__ = ["KernelWork", "Segment", "SimResult", "Task", "default_ctas", "pick_for_moe_buffer", "plan_exchange",
           "plan_moe", "simulate_kernel"]
