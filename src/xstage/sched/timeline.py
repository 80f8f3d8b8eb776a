"""Timeline plot of a simulated kernel: CTAs as rows, compute and store bars, path backlog as a curve."""

from __future__ import annotations

import os
from pathlib import Path

from xstage.results.plots import pyplot, save_figure
from xstage.sched.simulate import SimResult

COLORS = {"compute": "#4c72b0", "issue": "#55a868", "stall": "#c44e52", "wait": "#dddddd"}


def plot_timeline(result: SimResult, out_png: str | os.PathLike, *, title: str = "", max_ctas: int = 48,
                  capacity: float | None = None) -> Path:
    """`timeline_figure(...)` saved as a PNG."""
    return save_figure(timeline_figure(result, title=title, max_ctas=max_ctas, capacity=capacity), out_png)


def timeline_figure(result: SimResult, *, title: str = "", max_ctas: int = 48, capacity: float | None = None):
    """Up to `max_ctas` CTA rows (evenly chosen) of segments, and each path's backlog below them: the
    bytes issued to the path and not yet drained (its X-Stage). `capacity` (bytes), where given, is drawn
    as the level at which later stores stall, and the axis shows it: a paced kernel's backlog then reads
    as what it is, far below that level, instead of filling the panel at a scale of bytes."""
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
    peak = 0.0
    for name, trace in result.backlog.items():
        if trace:
            peak = max(peak, max(q for _, q in trace))
            axq.plot([t / 1e3 for t, _ in trace], [q / 2**20 for _, q in trace],
                     label=f"{name}: bytes issued, not yet drained (peak {peak / 2**10:.3g} KiB)")
    if capacity is not None and capacity != float("inf"):
        axq.axhline(capacity / 2**20, color="#c44e52", linestyle="--", linewidth=1,
                    label=f"the path's capacity ({capacity / 2**20:.3g} MiB): past it, stores stall")
        axq.set_ylim(0, 1.1 * max(capacity, peak) / 2**20)
    axq.set_xlabel("time (us)")
    axq.set_ylabel("backlog (MiB)")
    axq.set_title("the store path's backlog (the X-Stage)", fontsize=9)
    if result.backlog or capacity is not None:
        axq.legend(fontsize=8, loc="upper right")
    ax.set_xlabel("each row: one persistent CTA's tasks over time (compute: a tile; issue: stores leaving the SM; "
                  "stall: stores waiting, for the pacer or for room on the path; wait: for a dependency)", fontsize=8)
    return fig
