"""`xstage.sched`: the planner. Persistent kernels' work as task graphs, their simulation through the
Burst-Gap model, and the policy that makes every choice a kernel leaves open.

- `Task`, `KernelWork` (`work.py`): per-CTA ordered tasks with compute cost, stores per destination,
  dependencies.
- `simulate_kernel(work, paths)` (`simulate.py`): predicted kernel time, per-CTA timelines, breakdown.
- `plan_moe` (`plan.py`): every candidate MoE schedule predicted and ranked.
- `plan_exchange` (`exchange.py`): every Ulysses exchange predicted and ranked from tile and copy costs.
- `choose_schedule`, `choose_pacing`, `choose_exchange` (`policy.py`): the choices the kernels ask for
  (`model_guided`, `pacing="auto"`, `exchange="auto"`), each a `Decision` with the alternatives'
  predicted times and the calibration it used. The kernels call them directly.
- `resolve_pacing` (`pacing.py`): a pacing spelling as the kernel runs it, on a store path.
- `load_results` (`measured.py`): benchmark results CSVs read back and checked (columns, sizes,
  finite positive times, known variants), for validation and attention tile costs.

The planner imports no kernel module: what it shares with the kernels is data (`xstage.spec`).
"""

from xstage.sched.exchange import plan_exchange
from xstage.sched.plan import default_ctas, plan_moe
from xstage.sched.policy import (
    Decision,
    choose_exchange,
    choose_pacing,
    choose_schedule,
    pick_for_moe_buffer,
    pick_pacing_for_buffer,
)
from xstage.sched.simulate import Segment, SimResult, simulate_kernel
from xstage.sched.work import KernelWork, Task

__all__ = ["Decision", "KernelWork", "Segment", "SimResult", "Task", "choose_exchange", "choose_pacing",
           "choose_schedule", "default_ctas", "pick_for_moe_buffer", "pick_pacing_for_buffer", "plan_exchange",
           "plan_moe", "simulate_kernel"]
