"""Plots of measured issue times over the model's curves (matplotlib, Agg backend, PNG).

Problem: a profile's numbers are easier to trust when the measured CTA medians sit on (or visibly
off) the model's curves, per SM count, against burst size and against the compute gap.

Algorithm: the measured points are the data's rows for the profile's path; each curve predicts the
same statistic for the same launch structure (SM count, bursts per CTA, gap) over a dense grid.

Example:
    >>> import tempfile, os
    >>> from xstage.model.data import load_reference_data
    >>> from xstage.model.profile import load_default_profile
    >>> out = os.path.join(tempfile.mkdtemp(), "burst.png")
    >>> plot_issue_vs_burst(load_default_profile(), load_reference_data(), out) == out
    True
"""

from __future__ import annotations

import numpy as np

from xstage.model.data import Observations
from xstage.model.design import design_observations
from xstage.model.predict import predict_rows
from xstage.results.plots import pyplot, save_figure

SPAN_LABELS = {(0, 0): "first burst", (1, 1): "second burst"}


def _span_label(lo: int, hi: int) -> str:
    return SPAN_LABELS.get((lo, hi), f"bursts {lo}..{hi}" if hi > lo else f"burst {lo}")


def _curve(profile, n_sm: int, bursts, gaps, n_bursts: int, span) -> np.ndarray:
    design = [dict(path=profile.path, n_sm=n_sm, burst_bytes=float(b), gap_ns=float(g), n_bursts=n_bursts,
                   spans=[span]) for b, g in zip(bursts, gaps)]
    return predict_rows(profile.params, design_observations(design), profile.classes)[0]


def plot_issue_vs_burst(profile, data: Observations, out_png) -> str:
    """First-burst CTA-median issue time against bytes per SM, one colour per SM count."""
    plt = pyplot()
    obs = data.for_path(profile.path)
    rows = obs.burst_lo == 0
    g_max = float(obs.gap_ns[rows].max())
    fig, ax = plt.subplots(figsize=(7, 5))
    for j, n in enumerate(sorted(set(obs.n_sm[rows].tolist()))):
        m = rows & (obs.n_sm == n)
        nb = obs.burst_bytes[m] * obs.ctas_per_sm[m]
        colour = f"C{j % 10}"
        ax.scatter(nb, obs.issue_med[m], color=colour, s=18, label=f"{n} SM measured")
        grid = np.geomspace(nb.min(), nb.max(), 24)
        n_bursts = int(obs.n_bursts[m].max())
        ax.plot(grid, _curve(profile, n, grid, [g_max] * len(grid), n_bursts, (0, 0)), color=colour, lw=1.2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("burst bytes per SM")
    ax.set_ylabel("first-burst issue time, CTA median (ns)")
    ax.set_title(f"{profile.path}: measured (points) and model (lines, gap {g_max / 1e3:.0f} us)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return str(save_figure(fig, out_png, dpi=120))


def plot_issue_vs_gap(profile, data: Observations, out_png) -> str:
    """Later-burst CTA-median issue time against the compute gap, one panel per SM count."""
    plt = pyplot()
    obs = data.for_path(profile.path)
    later = obs.burst_hi > 0
    spans = sorted({(int(a), int(b)) for a, b in zip(obs.burst_lo[later], obs.burst_hi[later])})
    span = spans[-1] if spans else (0, 0)
    rows = (obs.burst_lo == span[0]) & (obs.burst_hi == span[1])
    sms = sorted(set(obs.n_sm[rows].tolist()))
    fig, axes = plt.subplots(1, len(sms), figsize=(4 * len(sms), 4), squeeze=False)
    for ax, n in zip(axes[0], sms):
        m = rows & (obs.n_sm == n)
        for j, b in enumerate(sorted(set(obs.burst_bytes[m].tolist()))):
            mb = m & (obs.burst_bytes == b)
            colour = f"C{j % 10}"
            gaps = np.maximum(obs.gap_ns[mb], 1.0)
            ax.scatter(gaps, obs.issue_med[mb], color=colour, s=18, label=f"{b // 1024} KiB")
            grid = np.geomspace(gaps.min(), gaps.max(), 12)
            nb = b * int(obs.ctas_per_sm[mb][0])
            ax.plot(grid, _curve(profile, n, [nb] * len(grid), grid, int(obs.n_bursts[mb].max()), span),
                    color=colour, lw=1.2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{n} SM, {_span_label(*span)}")
        ax.set_xlabel("compute gap (ns)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("issue time, CTA median (ns)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{profile.path}: measured (points) and model (lines)")
    return str(save_figure(fig, out_png))
