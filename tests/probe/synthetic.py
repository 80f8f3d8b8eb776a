"""Probe output folders made from the Burst-Gap simulator, for testing the analysis without a GPU."""

import numpy as np

from xstage.model.data import LONG_COLUMNS
from xstage.model.params import PathParams
from xstage.model.simulate import simulate_bursts
from xstage.probe.runner import CONFIG_COLUMNS
from xstage.probe.sweeps import plan
from xstage.results.io import ResultWriter

TRUE = PathParams(r0=50e9, c_sm=96 * 1024, drain=52.5e9, capacity=4.5 * 2**20, t0=80.0, latency=1500.0)
NS_PER_GAP_ITER = 2.0
ENV = {"gpu": "simulated", "driver": "none", "torch": "none", "triton": "none", "git_commit": "none",
       "date": "2026-01-01"}


def launch_rows(cfg, params, launch_id, rng, noise):
    gap = cfg.gap_iters * NS_PER_GAP_ITER
    res = simulate_bursts(params, [[(cfg.burst_bytes * cfg.ctas_per_sm, gap)] * cfg.n_bursts],
                          multiplicity=[cfg.n_sm])
    issue = res.issue_ns[0]
    cpl = res.completion_ns[0] - res.start_ns[0]
    base = {k: getattr(cfg, k) for k in CONFIG_COLUMNS}
    rows = []
    for i in range(cfg.n_ctas):
        f = 1.0 + noise * rng.standard_normal(cfg.n_bursts)
        for k in range(cfg.n_bursts):
            rows.append({**base, "gap_ns": gap if k else "", "launch": launch_id, "cta": i, "burst_index": k,
                         "issue_ns": float(issue[k] * f[k]),
                         "completion_ns": float(cpl[k] * f[k]) if cfg.completion != "none" else ""})
    return rows


def write_folder(out_dir, sweeps, sm_count=16, repeats=2, params=TRUE, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    launch_id = 0
    writers = {}
    for sweep, cfg in plan(sweeps, "host", sm_count):
        if sweep not in writers:
            writers[sweep] = ResultWriter(out_dir / "raw" / f"{sweep}.csv", LONG_COLUMNS,
                                          ["launch", "cta", "burst_index"], env=ENV)
        for _ in range(repeats):
            writers[sweep].write_many(launch_rows(cfg, params, launch_id, rng, noise))
            launch_id += 1
    return out_dir
