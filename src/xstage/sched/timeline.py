"""Timeline plot of a simulated kernel: CTAs as rows, compute and store bars, path backlog as a curve."""

from __future__ import annotations

import os
from pathlib import Path

from xstage.results.plots import pyplot, save_figure
from xstage.sched.simulate import SimResult

COLORS = {"compute": "#4c72b0", "issue": "#55a868", "stall": "#c44e52", "wait": "#dddddd"}


def plot_timeline(result: SimResult, out_png: str | os.PathLike, *, title: str = "", max_ctas: int = 48) -> Path:
    """`timeline_figure(...)` saved as a PNG."""
    return save_figure(timeline_figure(result, title=title, max_ctas=max_ctas), out_png)


def timeline_figure(result: SimResult, *, title: str = "", max_ctas: int = 48):
    """Up to `max_ctas` CTA rows (evenly chosen) of segments, and each path's backlog below them."""
    plt = pyplot()

    ctas = sorted({s.cta for s in result.segments})
    if len(ctas) > max_ctas:
        step = len(ctas) / max_ctas
        ctas = [ctas[int(i * step)] for i in range(max_ctas)]
    row = {c: i for i, c in enumerate(ctas)}
    fig, (ax, axq) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for kind, color in COLORS.items():
        bars = [(s.start_ns / 1e3, s.duration_ns / 1e3, row[s.cta]) for s in result.segments
                if s.kind == kind and s.cta in row and s.duration_ns > 0]
        for start, width, y in bars:
            ax.barh(y, width, left=start, height=0.8, color=color, linewidth=0)
    ax.set_ylabel("CTA")
    ax.set_yticks(range(len(ctas))[:: max(1, len(ctas) // 12)])
    ax.set_yticklabels([str(c) for c in ctas][:: max(1, len(ctas) // 12)])
    ax.invert_yaxis()
    from matplotlib.patches import Patch  # matplotlib loads with the first plot (see pyplot)

    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper right", fontsize=8, ncol=4)
    ax.set_title(title or f"predicted kernel time {result.time_ns / 1e3:.1f} us")
    for name, trace in result.backlog.items():
        if trace:
            axq.plot([t / 1e3 for t, _ in trace], [q / 2**20 for _, q in trace], label=name)
    axq.set_xlabel("time (us)")
    axq.set_ylabel("backlog (MiB)")
    if result.backlog:
        axq.legend(fontsize=8)
    return fig
