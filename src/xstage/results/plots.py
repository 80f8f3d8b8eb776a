"""Plots drawn from result rows (lists of dicts, e.g. from `read_rows`), saved as PNG."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from xstage.results.io import atomic_open


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend. Loaded on first use: matplotlib is the slowest
    import of the package and only plotting commands need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out_png: str | os.PathLike, dpi: int = 110) -> Path:
    """Lay out, write (creating the folder) and close a figure; returns the PNG path. The file is
    replaced only once the image is complete (`atomic_open`)."""
    plt = pyplot()
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_open(out, binary=True) as f:
            fig.savefig(f, format=out.suffix.lstrip(".").lower() or "png", dpi=dpi)
    finally:
        plt.close(fig)
    return out


def plot_lines(rows: Sequence[Mapping[str, object]], x: str, y: str, group_by: Sequence[str],
               out_png: str | os.PathLike, **kw) -> Path:
    """`lines_figure(...)` saved as a PNG (see `save_figure`)."""
    return save_figure(lines_figure(rows, x, y, group_by, **kw), out_png)


def lines_figure(
    rows: Sequence[Mapping[str, object]],
    x: str,
    y: str,
    group_by: Sequence[str],
    *,
    title: str = "",
    xlabel: str | None = None,
    ylabel: str | None = None,
    logx: bool = False,
    logy: bool = False,
    hline: float | None = None,
):
    """A figure with one line per distinct value of `group_by`, points sorted by `x`."""
    plt = pyplot()
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        label = ", ".join(f"{g}={r[g]}" for g in group_by)
        series[label].append((float(r[x]), float(r[y])))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
    if hline is not None:
        ax.axhline(hline, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log" if logy else "linear")
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7, ncol=2)
    return fig


def plot_bars(labels: Sequence[str], values: Mapping[str, Sequence[float]], out_png: str | os.PathLike,
              **kw) -> Path:
    """`bars_figure(...)` saved as a PNG (see `save_figure`)."""
    return save_figure(bars_figure(labels, values, **kw), out_png)


def bars_figure(
    labels: Sequence[str],
    values: Mapping[str, Sequence[float]],
    *,
    title: str = "",
    ylabel: str = "",
    hline: float | None = None,
):
    """A figure of grouped bars: one group per label, one bar per key of `values`."""
    plt = pyplot()
    n = max(1, len(values))
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(labels) * n), 4.5))
    for i, (name, vals) in enumerate(values.items()):
        ax.bar([j + i * width for j in range(len(labels))], vals, width, label=name)
    if hline is not None:
        ax.axhline(hline, color="grey", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return fig
