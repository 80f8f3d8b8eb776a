"""`xstage.calibrate`: measurements that become the planner's data.

- `tiles` (`xstage plan calibrate`): the fused MoE kernel's own tiles traced on the GPU, fitted into
  the task costs the planner predicts with (`xstage.sched.costs.TaskCosts`);
- `tilemodel`: the tile roofline fitted on traced tiles, and task costs as if only some shapes had
  been traced (`costs_calibrated_on`); `ordereffect`: the order effect and its occupancy term;
- `exchange` (`xstage plan exchange-costs`): the Ulysses exchange costs fitted on a calibration grid;
- `interference`: the store/compute interference term fitted on microbenchmarks
  (`benchmarks/experiments/fit_interference.py`).

This floor runs kernels to measure them, so it sits above the kernels; the planner below reads only
what it wrote (`xstage/data/`), and the library never fits at run time.
"""
