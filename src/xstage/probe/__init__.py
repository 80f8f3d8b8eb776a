"""`xstage.probe`: microbenchmarks that measure the X-Stage of a store path (hbm, host, peer).

- `kernels`: the Triton injection kernel (bursts of vector stores, compute gaps, per-burst timers)
  and the receiver's flag wait.
- `runner`: `BurstConfig`, `launch` (one run on a `xstage.comm` context), `rows_from_launch` (the
  long format of `xstage.model.data`), `receive` (peer-path check), `compile_ptx`.
- `sweeps`: the named experiments (first, periodic, twoburst, completion, knobs, peers).
- `session`: resumable, sliceable runs into an output folder.
- `analysis`, `report`: summary, experiment figures, plots, profile fit and held-out check.
- `xstage.cli.probe`: `xstage probe`.

Example (one H200, about 2 minutes without the fit):

    xstage probe --path host --sweep all -o results/h200-host
"""

from xstage.backend import select

select()  # before this package's kernels are defined: Triton's interpreter where no GPU exists

